// Helpers for the GPU tests: the driver through libmoejit's loader, one private cache for the
// whole binary, device buffers and DLTensors over them, and host-side dtype rounding.
#pragma once

#include <dlpack/dlpack.h>

#include <catch2/catch.hpp>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "driver/driver.hpp"
#include "moejit/runtime.hpp"
#include "support/support.hpp"

namespace moejit::test {

inline const detail::DriverApi& cu() { return detail::driver(); }

// Fails the test with the call, the CUresult name and text.
#define MOEJIT_TEST_CU(call)                                                         \
  do {                                                                               \
    const CUresult moejit_test_result_ = (call);                                     \
    INFO(#call << " -> " << ::moejit::detail::describe(moejit_test_result_));        \
    REQUIRE(moejit_test_result_ == CUDA_SUCCESS);                                    \
  } while (0)

struct GpuEnv {
  CUdevice device = 0;
  CUcontext context = nullptr;  // device 0's primary context
  int device_count = 0;
};

// Once per process: retain device 0's primary context and point the runtime at a private cache
// (so a kernel is never already built by an earlier run: the capture-miss test needs a cold
// one). Every call makes the primary context current on the calling thread.
inline const GpuEnv& gpu() {
  static const GpuEnv env = [] {
    GpuEnv e;
    MOEJIT_TEST_CU(cu().cuDeviceGetCount(&e.device_count));
    MOEJIT_TEST_CU(cu().cuDeviceGet(&e.device, 0));
    MOEJIT_TEST_CU(cu().cuDevicePrimaryCtxRetain(&e.context, e.device));
    static TempDir cache;  // removed at exit
    RuntimeConfig config;
    config.cache_dir = cache.path() + "/cache";
    config.cache_mode = CacheMode::kReadWrite;
    config.allow_compile_during_capture = false;
    moejit::configure(config);
    return e;
  }();
  MOEJIT_TEST_CU(cu().cuCtxSetCurrent(env.context));
  return env;
}

// Device memory in the context current at construction.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  explicit DeviceBuffer(std::size_t bytes) : bytes_(bytes) {
    if (bytes_ > 0) MOEJIT_TEST_CU(cu().cuMemAlloc(&ptr_, bytes_));
  }
  ~DeviceBuffer() {
    if (ptr_ != 0) cu().cuMemFree(ptr_);
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  DeviceBuffer(DeviceBuffer&& other) noexcept : ptr_(other.ptr_), bytes_(other.bytes_) {
    other.ptr_ = 0;
    other.bytes_ = 0;
  }
  DeviceBuffer& operator=(DeviceBuffer&& other) noexcept {
    std::swap(ptr_, other.ptr_);
    std::swap(bytes_, other.bytes_);
    return *this;
  }
  void* data() const { return reinterpret_cast<void*>(static_cast<uintptr_t>(ptr_)); }
  CUdeviceptr ptr() const { return ptr_; }
  std::size_t bytes() const { return bytes_; }

  void upload(const void* host, std::size_t bytes) {
    REQUIRE(bytes <= bytes_);
    if (bytes > 0) MOEJIT_TEST_CU(cu().cuMemcpyHtoD(ptr_, host, bytes));
  }
  template <typename T>
  void upload(const std::vector<T>& host) {
    upload(host.data(), host.size() * sizeof(T));
  }
  template <typename T>
  std::vector<T> download(std::size_t count) const {
    std::vector<T> host(count);
    REQUIRE(count * sizeof(T) <= bytes_);
    if (count > 0) MOEJIT_TEST_CU(cu().cuMemcpyDtoH(host.data(), ptr_, count * sizeof(T)));
    return host;
  }

 private:
  CUdeviceptr ptr_ = 0;
  std::size_t bytes_ = 0;
};

inline DLDataType dl_int(int bits) { return DLDataType{kDLInt, static_cast<uint8_t>(bits), 1}; }
inline DLDataType dl_float(int bits) {
  return DLDataType{kDLFloat, static_cast<uint8_t>(bits), 1};
}
inline DLDataType dl_bf16() { return DLDataType{kDLBfloat, 16, 1}; }

// A 2-D DLTensor over a device buffer it owns (not copyable: the DLTensor points at shape_).
class Tensor2D {
 public:
  Tensor2D(int64_t rows, int64_t cols, DLDataType dtype, int device_id = 0)
      : buffer_(static_cast<std::size_t>(rows * cols) * (dtype.bits / 8)) {
    shape_[0] = rows;
    shape_[1] = cols;
    tensor_.data = buffer_.data();
    tensor_.device = DLDevice{kDLCUDA, device_id};
    tensor_.ndim = 2;
    tensor_.dtype = dtype;
    tensor_.shape = shape_;
    tensor_.strides = nullptr;
    tensor_.byte_offset = 0;
  }
  Tensor2D(const Tensor2D&) = delete;
  Tensor2D& operator=(const Tensor2D&) = delete;

  DLTensor* dl() { return &tensor_; }
  DeviceBuffer& buffer() { return buffer_; }
  int64_t rows() const { return shape_[0]; }
  int64_t cols() const { return shape_[1]; }
  std::size_t count() const { return static_cast<std::size_t>(shape_[0] * shape_[1]); }

 private:
  DeviceBuffer buffer_;
  int64_t shape_[2] = {0, 0};
  DLTensor tensor_{};
};

// bf16 bits of `value` (round to nearest even) and the exact value those bits hold.
inline uint16_t bf16_bits(float value) {
  uint32_t bits = 0;
  std::memcpy(&bits, &value, 4);
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}
inline float bf16_value(uint16_t bits) {
  const uint32_t wide = static_cast<uint32_t>(bits) << 16;
  float value = 0;
  std::memcpy(&value, &wide, 4);
  return value;
}

// fp16 bits of a finite `value` with |value| < 65504 (round to nearest even).
inline uint16_t f16_bits(float value) {
  uint32_t x = 0;
  std::memcpy(&x, &value, 4);
  const uint16_t sign = static_cast<uint16_t>((x >> 16) & 0x8000u);
  const float magnitude = std::fabs(value);
  if (magnitude < 6.103515625e-05f) {  // below 2^-14: a subnormal in units of 2^-24
    return static_cast<uint16_t>(sign | static_cast<uint16_t>(std::nearbyint(magnitude * 16777216.0f)));
  }
  const uint32_t mag = x & 0x7fffffffu;
  uint32_t h = (((mag >> 23) - 127 + 15) << 10) | ((mag >> 13) & 0x3ffu);
  const uint32_t rest = mag & 0x1fffu;
  if (rest > 0x1000u || (rest == 0x1000u && (h & 1u))) ++h;
  return static_cast<uint16_t>(sign | h);
}
inline float f16_value(uint16_t bits) {
  const int exponent = (bits >> 10) & 0x1f;
  const int mantissa = bits & 0x3ff;
  double value = exponent == 0 ? std::ldexp(mantissa, -24)
                               : std::ldexp(mantissa + 1024, exponent - 25);
  if (exponent == 31) value = mantissa != 0 ? NAN : INFINITY;
  return static_cast<float>((bits & 0x8000) ? -value : value);
}

}  // namespace moejit::test
