// Argument checks on DLPack tensors, shared by the ops. The checks are plain comparisons; only a
// failing check formats a message (what argument, what was expected, what was found), so a valid
// call costs no allocation and no string work.
#pragma once

#include <dlpack/dlpack.h>

#include <cstdint>
#include <string>

#include "moejit/shape.hpp"

namespace moejit::detail {

// A checked 2-D row-major tensor on the current device.
struct Matrix {
  void* data = nullptr;  // DLTensor::data + byte_offset
  int64_t rows = 0;
  int64_t cols = 0;
  DType dtype = DType::kF32;
};

// The library's DType of a DLPack dtype; false when it is none of them.
inline bool dtype_from_dlpack(DLDataType type, DType* out) noexcept {
  if (type.lanes != 1) return false;
  if (type.code == kDLInt && type.bits == 32) {
    *out = DType::kI32;
  } else if (type.code == kDLInt && type.bits == 64) {
    *out = DType::kI64;
  } else if (type.code == kDLFloat && type.bits == 32) {
    *out = DType::kF32;
  } else if (type.code == kDLFloat && type.bits == 16) {
    *out = DType::kF16;
  } else if (type.code == kDLBfloat && type.bits == 16) {
    *out = DType::kBF16;
  } else {
    return false;
  }
  return true;
}

// Bytes per element of `dtype`.
inline int64_t dtype_size(DType dtype) noexcept {
  switch (dtype) {
    case DType::kBF16:
    case DType::kF16: return 2;
    case DType::kF32:
    case DType::kI32: return 4;
    case DType::kI64: return 8;
  }
  return 1;
}

// "float32", "bfloat16", "int64", "uint8", "float16x2", ...
std::string dlpack_dtype_name(DLDataType type);
// "[3, 8]".
std::string shape_text(const DLTensor& tensor);

// `tensor` must be non-null, on CUDA device `device`, 2-D, of one of our dtypes, row-major
// contiguous (strides null, or matching; a stride of a dimension of extent <= 1 is ignored, as
// DLPack producers set it freely), with a non-null element-aligned data pointer when it has
// elements. Throws Error{kInvalidArgument} "<op>: <arg>: expected ..., found ...".
Matrix check_matrix(const char* op, const char* arg, const DLTensor* tensor, int device);

// The throwers the ops call when a comparison fails (cold; they format the message).
[[noreturn]] void throw_argument(const char* op, const char* arg, const std::string& expected,
                                 const std::string& found);
[[noreturn]] void throw_dtype(const char* op, const char* arg, const char* expected,
                              const DLTensor& tensor);
[[noreturn]] void throw_shape(const char* op, const char* arg, const std::string& expected,
                              const DLTensor& tensor);

}  // namespace moejit::detail
