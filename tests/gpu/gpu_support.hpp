// Helpers for the GPU tests: the driver through libmoejit's loader, one private cache for the
// whole binary, device buffers and DLTensors over them, and host-side dtype rounding.
#pragma once

#include <dlpack/dlpack.h>

#include <catch2/catch.hpp>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "driver/driver.hpp"
#include "moejit/moejit.h"
#include "moejit/ops.hpp"
#include "moejit/runtime.hpp"
#include "ops/moe_reference.hpp"
#include "support/support.hpp"

namespace moejit::test {

inline const detail::DriverApi& cu() { return detail::driver(); }

// A seed drawn from random_device on every call, so each run tests fresh inputs.
inline uint64_t fresh_seed() {
  std::random_device device;
  return (static_cast<uint64_t>(device()) << 32) ^ device();
}

// Declares `seed` (fresh_seed()) and `rng` (a std::mt19937_64 seeded with it) in the enclosing
// scope, and names the seed in every failure message after it, so a failing case can be rerun
// with the same inputs.
#define MOEJIT_TEST_SEEDED_RNG(seed, rng)             \
  const uint64_t seed = ::moejit::test::fresh_seed(); \
  INFO("seed " << seed);                              \
  std::mt19937_64 rng(seed)

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

// RuntimeConfig::check_pointers set to `on` for the holder's lifetime, then back to what it was
// (configure() may change it alone after kernels are loaded).
class PointerChecks {
 public:
  explicit PointerChecks(bool on = true) : before_(moejit::config().check_pointers) { set(on); }
  ~PointerChecks() { set(before_); }
  PointerChecks(const PointerChecks&) = delete;
  PointerChecks& operator=(const PointerChecks&) = delete;

 private:
  static void set(bool on) {
    RuntimeConfig config = moejit::config();
    config.check_pointers = on;
    moejit::configure(config);
  }
  bool before_;
};

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

// A non-blocking stream of the current context (graph capture needs one other than the legacy
// default stream).
class TestStream {
 public:
  TestStream() { MOEJIT_TEST_CU(cu().cuStreamCreate(&stream_, CU_STREAM_NON_BLOCKING)); }
  ~TestStream() {
    if (stream_ != nullptr) cu().cuStreamDestroy(stream_);
  }
  TestStream(const TestStream&) = delete;
  TestStream& operator=(const TestStream&) = delete;
  CUstream get() const { return stream_; }
  void sync() const { MOEJIT_TEST_CU(cu().cuStreamSynchronize(stream_)); }

 private:
  CUstream stream_ = nullptr;
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

// bf16 bits of `value` (round to nearest even) and the exact value those bits hold: the
// reference's (ops/moe_reference.hpp).
using detail::bf16_bits;
using detail::bf16_value;

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

namespace moejit::test {

// One append_shared call: sizes, gate, dtypes.
struct AppendCase {
  int64_t tokens = 1;
  int top_k = 6;
  int num_shared = 1;
  float scale = 1.f;
  SharedGate gate = SharedGate::kSigmoid;
  DType logit_dtype = DType::kBF16;  // kSigmoid only
  DType id_dtype = DType::kI32;
  int64_t shared_base = 896;

  std::string describe() const {
    std::ostringstream os;
    os << "T=" << tokens << " K=" << top_k << " S=" << num_shared << " scale=" << scale
       << " gate=" << shared_gate_name(gate)
       << (gate == SharedGate::kSigmoid ? std::string(" logits=") + dtype_name(logit_dtype) : "")
       << " ids=" << dtype_name(id_dtype) << " shared_base=" << shared_base;
    return os.str();
  }
};

// Host inputs (already rounded to the dtypes the kernel reads) and the device tensors.
struct AppendData {
  AppendCase c;
  std::vector<int64_t> ids;         // [T, K]
  std::vector<float> weights;       // [T, K]
  std::vector<float> logit_values;  // [T, S], the exact values of the stored logits
  std::unique_ptr<Tensor2D> topk_ids, topk_weights, shared_logits, out_ids, out_weights;

  AppendSharedArgs args() {
    AppendSharedArgs a;
    a.topk_ids = topk_ids->dl();
    a.topk_weights = topk_weights->dl();
    a.shared_logits = shared_logits ? shared_logits->dl() : nullptr;
    a.out_ids = out_ids->dl();
    a.out_weights = out_weights->dl();
    a.shared_base = c.shared_base;
    a.scale = c.scale;
    a.gate = c.gate;
    return a;
  }

  moejit_status call_c_abi(CUstream stream) {
    const moejit_shared_gate gate = c.gate == SharedGate::kSigmoid    ? MOEJIT_SHARED_SIGMOID
                                    : c.gate == SharedGate::kConstant ? MOEJIT_SHARED_CONSTANT
                                                                      : MOEJIT_SHARED_GIVEN;
    return moejit_append_shared(topk_ids->dl(), topk_weights->dl(),
                                shared_logits ? shared_logits->dl() : nullptr, out_ids->dl(),
                                out_weights->dl(), c.shared_base, c.scale, gate, stream);
  }

  // Bytes the outputs are poisoned with: weights 0xFF (NaN), ids 0xA5 (a negative id other than
  // -1), so an element the kernel skips can't pass. Why not 0xFF for the ids too: it reads as -1,
  // the id a dropped slot is expected to get.
  static constexpr unsigned char kIdPoisonByte = 0xA5;
  void poison(CUstream stream) {
    MOEJIT_TEST_CU(cu().cuMemsetD8Async(out_ids->buffer().ptr(), kIdPoisonByte,
                                        out_ids->buffer().bytes(), stream));
    MOEJIT_TEST_CU(cu().cuMemsetD8Async(out_weights->buffer().ptr(), 0xFF,
                                        out_weights->buffer().bytes(), stream));
  }
  // An id as downloaded_ids() reads the poison.
  int64_t id_poison() const {
    uint64_t bits = 0;
    for (int byte = 0; byte < 8; ++byte) bits = bits << 8 | kIdPoisonByte;
    if (c.id_dtype == DType::kI32) return static_cast<int32_t>(static_cast<uint32_t>(bits));
    return static_cast<int64_t>(bits);
  }

  std::vector<int64_t> downloaded_ids() const {
    std::vector<int64_t> out(out_ids->count());
    if (c.id_dtype == DType::kI32) {
      std::vector<int32_t> raw = out_ids->buffer().download<int32_t>(out.size());
      for (std::size_t i = 0; i < out.size(); ++i) out[i] = raw[i];
    } else {
      out = out_ids->buffer().download<int64_t>(out.size());
    }
    return out;
  }
  std::vector<float> downloaded_weights() const {
    return out_weights->buffer().download<float>(out_weights->count());
  }

  // "" when every output element is right; else the first mismatches.
  std::string verify() const {
    const std::vector<int64_t> got_ids = downloaded_ids();
    const std::vector<float> got_w = downloaded_weights();
    const int64_t width = c.top_k + c.num_shared;
    std::ostringstream problems;
    int bad = 0;
    for (int64_t t = 0; t < c.tokens; ++t) {
      for (int64_t j = 0; j < width; ++j) {
        const std::size_t i = static_cast<std::size_t>(t * width + j);
        int64_t want_id = 0;
        bool weight_ok = false;
        double want_w = 0;
        if (j < c.top_k) {
          const std::size_t src = static_cast<std::size_t>(t * c.top_k + j);
          want_id = ids[src];
          want_w = weights[src];
          // Copied exactly: bit equality (a NaN never equals).
          weight_ok = std::memcmp(&got_w[i], &weights[src], sizeof(float)) == 0;
        } else {
          const int64_t s = j - c.top_k;
          want_id = c.shared_base + s;
          const float logit = c.gate == SharedGate::kConstant
                                  ? 0.f
                                  : logit_values[static_cast<std::size_t>(t * c.num_shared + s)];
          if (c.gate == SharedGate::kSigmoid) {
            // fp64 reference on the rounded logit; the kernel's fp32 sigmoid (IEEE expf and a
            // division, a few ulp) times an exact power-of-two scale is within 1e-6 relative.
            want_w = 1.0 / (1.0 + std::exp(-static_cast<double>(logit))) * c.scale;
            weight_ok = std::fabs(static_cast<double>(got_w[i]) - want_w) <= 1e-6 * std::fabs(want_w);
          } else if (c.gate == SharedGate::kConstant) {
            want_w = c.scale;
            weight_ok = got_w[i] == c.scale;
          } else {
            want_w = logit;
            weight_ok = std::memcmp(&got_w[i], &logit, sizeof(float)) == 0;
          }
        }
        if (got_ids[i] != want_id || !weight_ok) {
          if (++bad <= 5) {
            problems << "  [t=" << t << ", j=" << j << "]: id " << got_ids[i] << " (want "
                     << want_id << "), weight " << got_w[i] << " (want " << want_w << ")\n";
          }
        }
      }
    }
    if (bad == 0) return "";
    return std::to_string(bad) + " wrong elements of " + std::to_string(c.tokens * width) +
           " for " + c.describe() + ":\n" + problems.str();
  }
};

// Fresh random inputs for `c` on the current context's device `device_id`, uploaded; outputs
// allocated (not poisoned).
inline std::unique_ptr<AppendData> make_append_data(const AppendCase& c, std::mt19937_64& rng,
                                                    int device_id = 0) {
  auto d = std::make_unique<AppendData>();
  d->c = c;
  const int64_t T = c.tokens;
  const int64_t width = c.top_k + c.num_shared;
  const std::size_t routed = static_cast<std::size_t>(T * c.top_k);
  const std::size_t shared = static_cast<std::size_t>(T * c.num_shared);
  const int id_bits = c.id_dtype == DType::kI32 ? 32 : 64;

  // Ids in a range that includes -1 (a dropped slot); int64 ids beyond the int32 range, so a
  // narrowing copy would show.
  const int64_t max_id = c.id_dtype == DType::kI32 ? 1023 : (int64_t{1} << 40);
  std::uniform_int_distribution<int64_t> id_dist(-1, max_id);
  std::bernoulli_distribution dropped(0.05);
  std::uniform_real_distribution<float> weight_dist(0.f, 1.f);
  std::uniform_real_distribution<float> logit_dist(-12.f, 12.f);
  d->ids.resize(routed);
  d->weights.resize(routed);
  for (std::size_t i = 0; i < routed; ++i) {
    d->ids[i] = dropped(rng) ? -1 : id_dist(rng);
    d->weights[i] = weight_dist(rng);
  }

  d->topk_ids = std::make_unique<Tensor2D>(T, c.top_k, dl_int(id_bits), device_id);
  d->topk_weights = std::make_unique<Tensor2D>(T, c.top_k, dl_float(32), device_id);
  d->out_ids = std::make_unique<Tensor2D>(T, width, dl_int(id_bits), device_id);
  d->out_weights = std::make_unique<Tensor2D>(T, width, dl_float(32), device_id);
  if (c.id_dtype == DType::kI32) {
    std::vector<int32_t> narrow(routed);
    for (std::size_t i = 0; i < routed; ++i) narrow[i] = static_cast<int32_t>(d->ids[i]);
    d->topk_ids->buffer().upload(narrow);
  } else {
    d->topk_ids->buffer().upload(d->ids);
  }
  d->topk_weights->buffer().upload(d->weights);

  if (c.gate != SharedGate::kConstant) {
    d->logit_values.resize(shared);
    const DType stored = c.gate == SharedGate::kGiven ? DType::kF32 : c.logit_dtype;
    if (stored == DType::kF32) {
      std::vector<float> raw(shared);
      for (std::size_t i = 0; i < shared; ++i) {
        raw[i] = c.gate == SharedGate::kGiven ? weight_dist(rng) : logit_dist(rng);
        d->logit_values[i] = raw[i];
      }
      d->shared_logits = std::make_unique<Tensor2D>(T, c.num_shared, dl_float(32), device_id);
      d->shared_logits->buffer().upload(raw);
    } else {
      std::vector<uint16_t> raw(shared);
      for (std::size_t i = 0; i < shared; ++i) {
        const float x = logit_dist(rng);
        raw[i] = stored == DType::kBF16 ? bf16_bits(x) : f16_bits(x);
        d->logit_values[i] = stored == DType::kBF16 ? bf16_value(raw[i]) : f16_value(raw[i]);
      }
      d->shared_logits = std::make_unique<Tensor2D>(
          T, c.num_shared, stored == DType::kBF16 ? dl_bf16() : dl_float(16), device_id);
      d->shared_logits->buffer().upload(raw);
    }
  }
  return d;
}

}  // namespace moejit::test
