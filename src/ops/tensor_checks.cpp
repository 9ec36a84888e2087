#include "ops/tensor_checks.hpp"

#include <cstdint>
#include <limits>
#include <sstream>

#include "moejit/error.hpp"

namespace moejit::detail {
namespace {

const char* device_type_name(int type) {
  switch (type) {
    case kDLCPU: return "cpu";
    case kDLCUDA: return "cuda";
    case kDLCUDAHost: return "cuda_host (pinned host memory)";
    case kDLCUDAManaged: return "cuda_managed";
    case kDLOpenCL: return "opencl";
    case kDLVulkan: return "vulkan";
    case kDLMetal: return "metal";
    case kDLROCM: return "rocm";
    case kDLROCMHost: return "rocm_host";
    default: return "device type";
  }
}

std::string strides_text(const DLTensor& tensor) {
  if (tensor.strides == nullptr) return "null";
  if (tensor.ndim < 0 || tensor.ndim > kMaxTextDims) return "(not read: ndim out of range)";
  std::ostringstream os;
  os << '[';
  for (int i = 0; i < tensor.ndim; ++i) os << (i ? ", " : "") << tensor.strides[i];
  os << ']';
  return os.str();
}

}  // namespace

__attribute__((cold, noinline)) void throw_device(const char* op, const char* arg,
                                                  const DLTensor& tensor, int device) {
  std::ostringstream expected;
  expected << "a CUDA tensor (kDLCUDA) on device " << device
           << ", the device of the current CUDA context";
  std::ostringstream found;
  found << device_type_name(tensor.device.device_type) << " ("
        << static_cast<int>(tensor.device.device_type) << ") device " << tensor.device.device_id;
  if (tensor.device.device_type == kDLCUDA) {
    found << "; make that device's context current (cudaSetDevice(" << tensor.device.device_id
          << ")) before the call";
  } else if (tensor.device.device_type == kDLCUDAManaged ||
             tensor.device.device_type == kDLCUDAHost) {
    found << "; the kernels can reach this memory: export it as a kDLCUDA tensor of device "
          << device;
  }
  throw_argument(op, arg, expected.str(), found.str());
}

std::string dlpack_dtype_name(DLDataType type) {
  std::ostringstream os;
  switch (type.code) {
    case kDLInt: os << "int"; break;
    case kDLUInt: os << "uint"; break;
    case kDLFloat: os << "float"; break;
    case kDLBfloat: os << "bfloat"; break;
    default: os << "dtype code " << static_cast<int>(type.code) << " bits "; break;
  }
  os << static_cast<int>(type.bits);
  if (type.lanes != 1) os << 'x' << type.lanes;
  return os.str();
}

std::string shape_text(const DLTensor& tensor) {
  if (tensor.ndim < 0 || tensor.ndim > kMaxTextDims) {
    return "(not read: ndim " + std::to_string(tensor.ndim) + " is outside 0.." +
           std::to_string(kMaxTextDims) + ")";
  }
  std::ostringstream os;
  os << '[';
  for (int i = 0; i < tensor.ndim && tensor.shape != nullptr; ++i) {
    os << (i ? ", " : "") << tensor.shape[i];
  }
  os << ']';
  return os.str();
}

void throw_argument(const char* op, const char* arg, const std::string& expected,
                    const std::string& found) {
  throw Error(ErrorCode::kInvalidArgument,
              std::string(op) + ": " + arg + ": expected " + expected + ", found " + found);
}

const void* offset_data(const char* op, const char* arg, const DLTensor& tensor) {
  const auto data = reinterpret_cast<uintptr_t>(tensor.data);
  if (tensor.byte_offset > std::numeric_limits<uintptr_t>::max() - data) {
    std::ostringstream found;
    found << "data " << tensor.data << " + byte_offset " << tensor.byte_offset
          << ", which wraps around the address space";
    throw_argument(op, arg, "a byte_offset inside the tensor's allocation", found.str());
  }
  return static_cast<const char*>(tensor.data) + tensor.byte_offset;
}

void throw_overlap(const char* op, const Span& a, const Span& b) {
  const auto range = [](const Span& s) {
    std::ostringstream text;
    text << "[" << s.data << ", +" << s.bytes << " bytes)";
    return text.str();
  };
  throw_argument(op, a.arg,
                 std::string("a buffer that shares no byte with ") + b.arg + " " + range(b),
                 range(a) + ", which overlaps it");
}

void throw_dtype(const char* op, const char* arg, const char* expected, const DLTensor& tensor) {
  throw_argument(op, arg, std::string("dtype ") + expected,
                 "dtype " + dlpack_dtype_name(tensor.dtype));
}

void throw_shape(const char* op, const char* arg, const std::string& expected,
                 const DLTensor& tensor) {
  throw_argument(op, arg, "shape " + expected, "shape " + shape_text(tensor));
}

Matrix check_matrix(const char* op, const char* arg, const DLTensor* tensor, int device) {
  if (tensor == nullptr) throw_argument(op, arg, "a tensor", "a null DLTensor pointer");
  if (tensor->device.device_type != kDLCUDA || tensor->device.device_id != device) {
    throw_device(op, arg, *tensor, device);
  }
  if (tensor->ndim != 2 || tensor->shape == nullptr) {
    throw_argument(
        op, arg, "a 2-D tensor",
        std::to_string(tensor->ndim) + " dimensions" +
            (tensor->shape == nullptr ? " and a null shape" : " " + shape_text(*tensor)));
  }
  Matrix m;
  if (!dtype_from_dlpack(tensor->dtype, &m.dtype)) {
    throw_dtype(op, arg, "bfloat16, float16, float32, int32 or int64", *tensor);
  }
  m.rows = tensor->shape[0];
  m.cols = tensor->shape[1];
  if (m.rows < 0 || m.cols < 0) throw_shape(op, arg, "with non-negative extents", *tensor);
  if (tensor->strides != nullptr) {
    const bool cols_ok = m.cols <= 1 || tensor->strides[1] == 1;
    const bool rows_ok = m.rows <= 1 || tensor->strides[0] == m.cols;
    if (!cols_ok || !rows_ok) {
      throw_argument(op, arg,
                     "a contiguous row-major tensor (strides null or [" + std::to_string(m.cols) +
                         ", 1] for shape " + shape_text(*tensor) + ")",
                     "strides " + strides_text(*tensor) +
                         "; pass a contiguous tensor (e.g. .contiguous())");
    }
  }
  const int64_t size = dtype_size(m.dtype);
  if (m.rows > 0 && m.cols > 0) {
    if (tensor->data == nullptr) {
      throw_argument(op, arg, "a non-null data pointer for shape " + shape_text(*tensor),
                     "null data");
    }
    m.data = const_cast<void*>(offset_data(op, arg, *tensor));
    if (reinterpret_cast<uintptr_t>(m.data) % static_cast<uintptr_t>(size) != 0) {
      std::ostringstream found;
      found << "address " << m.data << " (data " << tensor->data << " + byte_offset "
            << tensor->byte_offset << ")";
      throw_argument(op, arg,
                     "data aligned to its " + std::to_string(size) + "-byte " +
                         dlpack_dtype_name(tensor->dtype) + " elements",
                     found.str());
    }
  }
  return m;
}

}  // namespace moejit::detail
