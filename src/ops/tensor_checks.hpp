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
// "[3, 8]"; for an ndim outside 0..kMaxTextDims, a note that the shape was not read.
std::string shape_text(const DLTensor& tensor);

// The most dimensions an error message reads of a DLTensor's shape or strides. Why a cap: ndim is
// the caller's word for how long those arrays are, and an uninitialized DLTensor's would have the
// message read far past them; no tensor an op takes has more than 4.
inline constexpr int kMaxTextDims = 8;

// data + byte_offset of a tensor with non-null data, refused where the sum wraps around the
// address space (a byte_offset no real buffer has). Throws Error{kInvalidArgument}.
const void* offset_data(const char* op, const char* arg, const DLTensor& tensor);

// "<op>: <arg>: expected a CUDA tensor (kDLCUDA) on device `device` ..., found <its device>"
// with what to do about it, as Error{kInvalidArgument}.
[[noreturn]] void throw_device(const char* op, const char* arg, const DLTensor& tensor, int device);

// `tensor` must be non-null, on CUDA device `device`, 2-D, of one of our dtypes, row-major
// contiguous (strides null, or matching; a stride of a dimension of extent <= 1 is ignored, as
// DLPack producers set it freely), with a non-null element-aligned data pointer when it has
// elements. Throws Error{kInvalidArgument} "<op>: <arg>: expected ..., found ...".
Matrix check_matrix(const char* op, const char* arg, const DLTensor* tensor, int device);

// A buffer an op reads or writes: its argument name and its bytes.
struct Span {
  const char* arg;
  const void* data;
  int64_t bytes;
};
inline Span span_of(const char* arg, const Matrix& m) {
  return Span{arg, m.data, m.rows * m.cols * dtype_size(m.dtype)};
}
[[noreturn]] void throw_overlap(const char* op, const Span& a, const Span& b);
// Why: the kernels read their inputs while they write their outputs (and take every pointer as
// __restrict__), so buffers that share a byte give wrong results, silently. Empty spans overlap
// nothing. A few comparisons on the valid path.
inline void check_disjoint(const char* op, const Span& a, const Span& b) {
  const auto lo_a = reinterpret_cast<uintptr_t>(a.data);
  const auto lo_b = reinterpret_cast<uintptr_t>(b.data);
  if (a.bytes > 0 && b.bytes > 0 && lo_a < lo_b + static_cast<uint64_t>(b.bytes) &&
      lo_b < lo_a + static_cast<uint64_t>(a.bytes)) {
    throw_overlap(op, a, b);
  }
}

// The throwers the ops call when a comparison fails (cold; they format the message).
[[noreturn]] void throw_argument(const char* op, const char* arg, const std::string& expected,
                                 const std::string& found);
[[noreturn]] void throw_dtype(const char* op, const char* arg, const char* expected,
                              const DLTensor& tensor);
[[noreturn]] void throw_shape(const char* op, const char* arg, const std::string& expected,
                              const DLTensor& tensor);

}  // namespace moejit::detail
