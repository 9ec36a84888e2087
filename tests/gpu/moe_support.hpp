// Helpers of the MoE layer's GPU tests (test_moe_forward.cpp, test_decode_moe.cpp,
// test_moe_c_abi.cpp): random MXFP4 checkpoints and their fp64 copies, the repack onto the device
// (through the C++ calls or the C ABI), token batches with ids of -1 and of other ranks, one
// moe_forward call's device buffers (poisoned before every run), CUDA graph capture and replay,
// the fp64 reference layer on every core, and the scoring against it with its tolerance (argued
// below).
//
// Inputs: random E2M1 nibbles (all 16 codes equally likely) and E8M0 scales 2^-10 .. 2^3, bf16
// hidden states scaled so FC1's pre-activations have a standard deviation near 3 (the clamps of
// gpt-oss at 7 and DeepSeek-V4 at 10 are reached, but not everywhere), top-k weights positive and
// summing to 1.
#pragma once

#include <cuda.h>
#include <dlpack/dlpack.h>

#include <algorithm>
#include <atomic>
#include <catch2/catch.hpp>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <moejit/kern/moe/layout.cuh>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "gpu/gpu_support.hpp"
#include "moejit/error.hpp"
#include "moejit/moe.hpp"
#include "moejit/moejit.h"
#include "moejit/runtime.hpp"
#include "ops/moe_reference.hpp"
#include "plan/moe_plan.hpp"
#include "runtime/runtime_impl.hpp"
#include "support/support.hpp"

namespace moejit::test {

using detail::MoeLayerOptions;
using detail::MoeWeightsF64;
using detail::Mxfp4Matrix;
namespace layout = kern::moe::layout;

// ---- small helpers ---------------------------------------------------------------------------

// splitmix64's finalizer: a well-mixed 64-bit value of x.
inline uint64_t mix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

inline unsigned worker_count() { return std::max(1u, std::thread::hardware_concurrency()); }

// body(i) for i in [0, count), spread over every core (dynamic: tasks may differ in cost).
inline void parallel_for(int64_t count, const std::function<void(int64_t)>& body) {
  const int64_t workers = std::min<int64_t>(worker_count(), count);
  if (workers <= 1) {
    for (int64_t i = 0; i < count; ++i) body(i);
    return;
  }
  std::atomic<int64_t> next{0};
  std::vector<std::thread> threads;
  for (int64_t w = 0; w < workers; ++w) {
    threads.emplace_back([&] {
      for (int64_t i = next.fetch_add(1); i < count; i = next.fetch_add(1)) body(i);
    });
  }
  for (std::thread& t : threads) t.join();
}

inline std::string fmt(double value) {
  char text[32];
  std::snprintf(text, sizeof(text), "%.3e", value);
  return text;
}

inline std::size_t to_size(int64_t n) { return static_cast<std::size_t>(n); }

// ---- device tensors ---------------------------------------------------------------------------

inline DLDataType dl_u8() { return DLDataType{kDLUInt, 8, 1}; }

// The ordinal of the current context's device.
inline int current_device_ordinal() {
  CUdevice device = 0;
  MOEJIT_TEST_CU(cu().cuCtxGetDevice(&device));
  return static_cast<int>(device);
}

// A DLTensor over device memory it does not own (row-major, compact), on the current context's
// device (where the tests allocate).
class TensorView {
 public:
  TensorView(const void* base, std::size_t byte_offset, std::vector<int64_t> shape,
             DLDataType dtype)
      : shape_(std::move(shape)) {
    tensor_.data = const_cast<void*>(base);
    tensor_.device = DLDevice{kDLCUDA, current_device_ordinal()};
    tensor_.ndim = static_cast<int32_t>(shape_.size());
    tensor_.dtype = dtype;
    tensor_.shape = shape_.data();
    tensor_.strides = nullptr;
    tensor_.byte_offset = byte_offset;
  }
  TensorView(const TensorView&) = delete;
  TensorView& operator=(const TensorView&) = delete;
  DLTensor* dl() { return &tensor_; }

 private:
  std::vector<int64_t> shape_;
  DLTensor tensor_{};
};

inline void poison(const DeviceBuffer& buffer, CUstream stream, unsigned char byte = 0xFF) {
  if (buffer.bytes() > 0) {
    MOEJIT_TEST_CU(cu().cuMemsetD8Async(buffer.ptr(), byte, buffer.bytes(), stream));
  }
}

template <typename T>
std::vector<T> download_at(const DeviceBuffer& buffer, std::size_t byte_offset, std::size_t count) {
  std::vector<T> host(count);
  REQUIRE(byte_offset + count * sizeof(T) <= buffer.bytes());
  if (count > 0) {
    MOEJIT_TEST_CU(cu().cuMemcpyDtoH(host.data(), buffer.ptr() + byte_offset, count * sizeof(T)));
  }
  return host;
}

template <typename T>
DeviceBuffer upload_new(const std::vector<T>& host) {
  DeviceBuffer buffer(std::max<std::size_t>(host.size() * sizeof(T), 16));
  buffer.upload(host);
  return buffer;
}

// Every kernel of `shapes` for this device's arch, compiled in parallel and loaded (idempotent).
inline void prewarm_shapes(const std::vector<ModelShape>& shapes) {
  const Arch arch = detail::Runtime::instance().current_arch();
  for (const BuildResult& result :
       moejit::prewarm(shapes, {arch}, static_cast<int>(worker_count()))) {
    INFO(result.spec.display_name() << ": " << result.error);
    REQUIRE(result.error.empty());
  }
}

// The kernels prewarm lists for `shapes` on this device's arch (decode_moe's left out unless
// `with_decode`), then `extra` (kernels prewarm does not list, e.g. decode_moe with a forced
// block_n), each once, built and loaded in parallel: a later call finds them, even during stream
// capture.
inline void build_kernels(const std::vector<ModelShape>& shapes, bool with_decode,
                          const std::vector<KernelSpec>& extra = {}) {
  const Arch arch = detail::Runtime::instance().current_arch();
  std::vector<KernelSpec> specs;
  const auto add = [&specs](const KernelSpec& spec) {
    if (std::find(specs.begin(), specs.end(), spec) == specs.end()) specs.push_back(spec);
  };
  for (const ModelShape& shape : shapes) {
    for (const KernelSpec& spec : moejit::plan_kernels(shape, arch)) {
      if (with_decode || spec.family != Family::kDecodeMoe) add(spec);
    }
  }
  for (const KernelSpec& spec : extra) add(spec);
  std::vector<std::string> errors(specs.size());
  parallel_for(static_cast<int64_t>(specs.size()), [&](int64_t i) {
    try {
      detail::Runtime::instance().build_and_load(specs[to_size(i)]);
    } catch (const std::exception& e) {
      errors[to_size(i)] = e.what();
    }
  });
  for (std::size_t i = 0; i < specs.size(); ++i) {
    INFO(specs[i].display_name() << ": " << errors[i]);
    REQUIRE(errors[i].empty());
  }
}

// ---- paths --------------------------------------------------------------------------------------

inline const char* path_name(MoePath path) {
  return path == MoePath::kMarlin ? "marlin" : path == MoePath::kDecode ? "decode" : "auto";
}

// Whether a forced decode_moe call with T tokens runs here: the shape is one decode_moe serves,
// 1 <= T <= 256, and the device is sm_90 or newer (moe_forward refuses it otherwise).
inline bool decode_serves(const ModelShape& shape, int tokens) {
  return tokens >= 1 && tokens <= detail::kDecodeMaxTokens &&
         detail::decode_moe_problem(shape).empty() &&
         detail::Runtime::instance().current_arch().sm >= 90;
}

// Whether an automatic call with T tokens takes decode_moe, as moe_forward decides it: where
// detail::decode_by_default takes the planner's decode launches and they run on this arch.
inline bool auto_takes_decode(const ModelShape& shape, int tokens) {
  const detail::MoeForwardConfig config = detail::choose_moe_config(shape, tokens);
  if (!detail::decode_by_default(config)) return false;
  const Arch arch = detail::Runtime::instance().current_arch();
  return detail::decode_moe_runs_on(config.decode_first, arch) &&
         detail::decode_moe_runs_on(config.decode_second, arch);
}

// The workspace bytes one call (T >= 1) checks for: decode_moe's at its tile on the decode path,
// else the marlin chain's regions.
inline std::size_t call_workspace_bytes(const ModelShape& shape, int tokens,
                                        const MoeForwardOptions& options) {
  const detail::MoeForwardConfig config = detail::choose_moe_config(shape, tokens);
  const bool decode = options.path == MoePath::kDecode ||
                      (options.path == MoePath::kAuto && auto_takes_decode(shape, tokens));
  if (!decode) return detail::moe_workspace_layout(shape, config).marlin_bytes;
  const MoeDecodeParams main =
      options.decode_block_n == 0
          ? config.decode_second
          : detail::choose_decode_config(shape, tokens, options.decode_block_n);
  return static_cast<std::size_t>(detail::decode_moe_workspace_bytes(main));
}

// ---- shapes -----------------------------------------------------------------------------------

// A shape of tools/shapes/reference.json (the reference models).
inline ModelShape reference_shape(const std::string& name) {
  static const std::vector<ModelShape> shapes =
      moejit::load_shapes_file(shapes_dir() + "/reference.json");
  for (const ModelShape& s : shapes) {
    if (s.name == name) return s;
  }
  FAIL("no shape \"" << name << "\" in reference.json");
  return {};
}

// The shape with `experts` local experts from `offset` out of `global` routed experts; the real
// H, I, activation and bias; top-k capped by the experts a token can choose from.
inline ModelShape resized(const ModelShape& real, int experts, int offset, int global,
                          int max_tokens) {
  ModelShape s = real;
  s.num_experts = experts;
  s.expert_offset = offset;
  s.global_experts = global;
  s.top_k = std::min(real.top_k, global);
  s.max_tokens = max_tokens;
  s.name = real.name + (experts == real.num_experts && offset == real.expert_offset
                            ? std::string()
                            : "@e" + std::to_string(experts) + "o" + std::to_string(offset) + "g" +
                                  std::to_string(global));
  return s;
}

// gpt-oss's checkpoint interleaves gate and up rows in one w13; the others store w1, w3, w2.
inline bool uses_gpt_oss_layout(const ModelShape& shape) {
  return shape.activation.kind == ActivationKind::kGptOss;
}

// ---- checkpoints ------------------------------------------------------------------------------

// Random bytes: byte i depends only on (seed, i), not on the thread count.
inline void fill_random(std::vector<uint8_t>& bytes, uint64_t seed) {
  const int64_t chunk = 1 << 16;
  const int64_t n = static_cast<int64_t>(bytes.size());
  parallel_for((n + chunk - 1) / chunk, [&](int64_t c) {
    for (int64_t i = c * chunk; i < std::min(n, (c + 1) * chunk); i += 8) {
      const uint64_t r = mix64(seed ^ (static_cast<uint64_t>(i) * 0xD1B54A32D192ED03ull));
      for (int64_t j = i; j < std::min(n, i + 8); ++j) {
        bytes[to_size(j)] = static_cast<uint8_t>(r >> (8 * (j - i)));
      }
    }
  });
}

inline constexpr int kMinScaleExponent = -10;
inline constexpr int kMaxScaleExponent = 3;

// A [rows, cols] MXFP4 matrix (checkpoint layout): nibbles uniform over the 16 codes, scales
// 2^u with u uniform in [kMinScaleExponent, kMaxScaleExponent].
inline Mxfp4Matrix random_mxfp4(int64_t rows, int64_t cols, uint64_t seed) {
  Mxfp4Matrix m;
  m.rows = rows;
  m.cols = cols;
  m.blocks.resize(to_size(rows * cols / 2));
  m.scales.resize(to_size(rows * cols / 32));
  fill_random(m.blocks, seed);
  fill_random(m.scales, seed + 1);
  const int span = kMaxScaleExponent - kMinScaleExponent + 1;
  for (uint8_t& s : m.scales) s = static_cast<uint8_t>(127 + kMinScaleExponent + s % span);
  return m;
}

// One rank's experts in a checkpoint layout, on the host.
struct Checkpoint {
  int experts = 0;
  int hidden = 0;
  int inter = 0;
  bool interleaved = false;   // gpt-oss: w13 [E, 2I, H] rows gate 0, up 0, gate 1, ...
  Mxfp4Matrix w13;            // interleaved only: [E * 2I, H]
  Mxfp4Matrix w1, w3;         // separate only: gate and up, [E * I, H] each
  Mxfp4Matrix w2;             // [E * H, I]
  std::vector<uint16_t> b13;  // bf16 bits [E, 2I], (gate, up) pairs; empty without bias
  std::vector<uint16_t> b2;   // bf16 bits [E, H]; empty without bias
};

inline std::vector<uint16_t> random_bf16(std::size_t count, double sigma, std::mt19937_64& rng) {
  std::normal_distribution<double> normal(0.0, sigma);
  std::vector<uint16_t> bits(count);
  for (uint16_t& b : bits) b = detail::bf16_bits(static_cast<float>(normal(rng)));
  return bits;
}

inline Checkpoint make_checkpoint(const ModelShape& shape, bool interleaved, uint64_t seed) {
  Checkpoint c;
  c.experts = shape.num_experts;
  c.hidden = shape.hidden;
  c.inter = shape.intermediate;
  c.interleaved = interleaved;
  const int64_t e = c.experts;
  const int64_t h = c.hidden;
  const int64_t i = c.inter;
  if (interleaved) {
    c.w13 = random_mxfp4(e * 2 * i, h, seed);
  } else {
    c.w1 = random_mxfp4(e * i, h, seed);
    c.w3 = random_mxfp4(e * i, h, seed + 2);
  }
  c.w2 = random_mxfp4(e * h, i, seed + 4);
  if (shape.has_bias) {
    std::mt19937_64 rng(seed + 6);
    c.b13 = random_bf16(to_size(e * 2 * i), 1.0, rng);
    c.b2 = random_bf16(to_size(e * h), 10.0, rng);
  }
  return c;
}

// Rows [row0, row0 + rows) of `m` as their own matrix.
inline Mxfp4Matrix row_slice(const Mxfp4Matrix& m, int64_t row0, int64_t rows) {
  Mxfp4Matrix s;
  s.rows = rows;
  s.cols = m.cols;
  const auto b = m.blocks.begin() + static_cast<std::ptrdiff_t>(row0 * m.cols / 2);
  s.blocks.assign(b, b + static_cast<std::ptrdiff_t>(rows * m.cols / 2));
  const auto sc = m.scales.begin() + static_cast<std::ptrdiff_t>(row0 * m.cols / 32);
  s.scales.assign(sc, sc + static_cast<std::ptrdiff_t>(rows * m.cols / 32));
  return s;
}

// Rows of a source matrix copied (dequantized) to a row of the destination.
struct DequantTask {
  const Mxfp4Matrix* source;
  int64_t source_row;
  int64_t rows;
  double* destination;
};

// fp64 copies of experts [first, first + count) (mxfp4_dequantize, in parallel row blocks).
inline MoeWeightsF64 dequantize(const Checkpoint& c, int first, int count) {
  MoeWeightsF64 w;
  w.num_experts = count;
  w.hidden = c.hidden;
  w.intermediate = c.inter;
  w.gate_up_interleaved = c.interleaved;
  const int64_t h = c.hidden;
  const int64_t i = c.inter;
  w.w13.resize(to_size(count * 2 * i * h));
  w.w2.resize(to_size(count * h * i));
  std::vector<DequantTask> tasks;
  const int64_t block_rows = 256;
  auto add = [&](const Mxfp4Matrix& source, int64_t row, int64_t rows, double* destination) {
    for (int64_t r = 0; r < rows; r += block_rows) {
      tasks.push_back(
          {&source, row + r, std::min(block_rows, rows - r), destination + r * source.cols});
    }
  };
  for (int64_t e = 0; e < count; ++e) {
    const int64_t src = first + e;
    double* w13 = w.w13.data() + e * 2 * i * h;
    if (c.interleaved) {
      add(c.w13, src * 2 * i, 2 * i, w13);
    } else {
      add(c.w1, src * i, i, w13);
      add(c.w3, src * i, i, w13 + i * h);
    }
    add(c.w2, src * h, h, w.w2.data() + e * h * i);
  }
  parallel_for(static_cast<int64_t>(tasks.size()), [&](int64_t t) {
    const DequantTask& task = tasks[to_size(t)];
    const std::vector<double> values =
        detail::mxfp4_dequantize(row_slice(*task.source, task.source_row, task.rows));
    std::copy(values.begin(), values.end(), task.destination);
  });
  if (!c.b13.empty()) {
    for (int64_t e = 0; e < count; ++e) {
      for (int64_t r = 0; r < 2 * i; ++r) {
        w.b13.push_back(detail::bf16_value(c.b13[to_size((first + e) * 2 * i + r)]));
      }
      for (int64_t r = 0; r < h; ++r) {
        w.b2.push_back(detail::bf16_value(c.b2[to_size((first + e) * h + r)]));
      }
    }
  }
  return w;
}

// ---- the layer on the device ------------------------------------------------------------------

// Kernel-layout weights of one rank, repacked on the GPU from a host checkpoint.
struct DeviceModel {
  ModelShape shape;
  MoeWeightLayout sizes;
  DeviceBuffer w13, w13_scales, w2, w2_scales, b13, b2;

  MoeWeights weights() const {
    MoeWeights w;
    w.w13 = w13.data();
    w.w13_scales = w13_scales.data();
    w.w2 = w2.data();
    w.w2_scales = w2_scales.data();
    w.b13 = shape.has_bias ? b13.data() : nullptr;
    w.b2 = shape.has_bias ? b2.data() : nullptr;
    return w;
  }
};

// moe_forward's three paths as options, block_n the planner's.
inline const MoeForwardOptions kAuto{MoePath::kAuto, 0};
inline const MoeForwardOptions kMarlin{MoePath::kMarlin, 0};
inline const MoeForwardOptions kDecode{MoePath::kDecode, 0};

// The C ABI's weights struct for a repacked model.
inline moejit_moe_weights capi_weights(const DeviceModel& model) {
  const MoeWeights w = model.weights();
  moejit_moe_weights out{};
  out.struct_size = sizeof(out);
  out.w13 = w.w13;
  out.w13_scales = w.w13_scales;
  out.w2 = w.w2;
  out.w2_scales = w.w2_scales;
  out.b13 = w.b13;
  out.b2 = w.b2;
  return out;
}

inline std::unique_ptr<DeviceModel> allocate_model(const ModelShape& shape) {
  auto m = std::make_unique<DeviceModel>();
  m->shape = shape;
  m->sizes = moejit::moe_weight_layout(shape);
  m->w13 = DeviceBuffer(m->sizes.w13_bytes);
  m->w13_scales = DeviceBuffer(m->sizes.w13_scale_bytes);
  m->w2 = DeviceBuffer(m->sizes.w2_bytes);
  m->w2_scales = DeviceBuffer(m->sizes.w2_scale_bytes);
  m->b13 = DeviceBuffer(m->sizes.b13_bytes);
  m->b2 = DeviceBuffer(m->sizes.b2_bytes);
  return m;
}

// Checkpoint tensors on the device, and DLTensor views of experts [first, first + count).
struct DeviceCheckpoint {
  const Checkpoint* host = nullptr;
  DeviceBuffer w13_blocks, w13_scales, w1_blocks, w1_scales, w3_blocks, w3_scales, w2_blocks,
      w2_scales;

  explicit DeviceCheckpoint(const Checkpoint& c) : host(&c) {
    if (c.interleaved) {
      w13_blocks = upload_new(c.w13.blocks);
      w13_scales = upload_new(c.w13.scales);
    } else {
      w1_blocks = upload_new(c.w1.blocks);
      w1_scales = upload_new(c.w1.scales);
      w3_blocks = upload_new(c.w3.blocks);
      w3_scales = upload_new(c.w3.scales);
    }
    w2_blocks = upload_new(c.w2.blocks);
    w2_scales = upload_new(c.w2.scales);
  }

  // Repack experts [first, first + count) of the checkpoint into local experts
  // [target_first, target_first + count) of `model`; `stacked` = false passes one 3-D tensor
  // per expert (the separate layout's per-expert form). `c_abi`: call moejit_moe_repack_* on
  // that handle (made for model.shape) instead of the C++ functions, with the same tensors.
  // `into`: the buffers to repack into in place of model's (model still gives the shape).
  // Returns the bad-scale count.
  int repack(DeviceModel& model, int first, int count, int target_first, bool stacked,
             CUstream stream, const moejit_moe* c_abi = nullptr,
             const MoeWeights* into = nullptr) const {
    const Checkpoint& c = *host;
    const int64_t h = c.hidden;
    const int64_t i = c.inter;
    DeviceBuffer bad(sizeof(int32_t));
    bad.upload(std::vector<int32_t>{0});
    moejit::MoeRepackTarget target;
    target.weights = into != nullptr ? *into : model.weights();
    target.bad_scale_count = static_cast<int32_t*>(bad.data());
    moejit_moe_weights c_target = capi_weights(model);
    if (into != nullptr) {
      c_target.w13 = into->w13;
      c_target.w13_scales = into->w13_scales;
      c_target.w2 = into->w2;
      c_target.w2_scales = into->w2_scales;
      c_target.b13 = into->b13;
      c_target.b2 = into->b2;
    }
    const auto require_ok = [](const char* call, moejit_status status) {
      INFO(call << ": " << moejit_last_error());
      REQUIRE(status == MOEJIT_OK);
      CHECK(std::string(moejit_last_error()).empty());
    };
    if (c.interleaved) {
      const std::size_t b_off = to_size(first * 2 * i * h / 2);
      const std::size_t s_off = to_size(first * 2 * i * h / 32);
      TensorView w13b(w13_blocks.data(), b_off, {count, 2 * i, h / 32, 16}, dl_u8());
      TensorView w13s(w13_scales.data(), s_off, {count, 2 * i, h / 32}, dl_u8());
      TensorView w2b(w2_blocks.data(), to_size(first * h * i / 2), {count, h, i / 32, 16}, dl_u8());
      TensorView w2s(w2_scales.data(), to_size(first * h * i / 32), {count, h, i / 32}, dl_u8());
      moejit::GptOssCheckpoint ck;
      ck.w13_blocks = w13b.dl();
      ck.w13_scales = w13s.dl();
      ck.w2_blocks = w2b.dl();
      ck.w2_scales = w2s.dl();
      target.first_expert = target_first;
      if (c_abi != nullptr) {
        require_ok("moejit_moe_repack_gpt_oss",
                   moejit_moe_repack_gpt_oss(c_abi, ck.w13_blocks, ck.w13_scales, ck.w2_blocks,
                                             ck.w2_scales, &c_target, target.first_expert,
                                             target.bad_scale_count, stream));
      } else {
        moejit::moe_repack_gpt_oss(model.shape, ck, target, stream);
      }
    } else {
      const int calls = stacked ? 1 : count;
      const int per_call = stacked ? count : 1;
      for (int call = 0; call < calls; ++call) {
        const int64_t e = first + call * per_call;
        auto dims = [&](int64_t rows, int64_t cols, bool blocks) {
          std::vector<int64_t> d;
          if (stacked) d.push_back(per_call);
          d.push_back(rows);
          d.push_back(cols / 32);
          if (blocks) d.push_back(16);
          return d;
        };
        TensorView w1b(w1_blocks.data(), to_size(e * i * h / 2), dims(i, h, true), dl_u8());
        TensorView w1s(w1_scales.data(), to_size(e * i * h / 32), dims(i, h, false), dl_u8());
        TensorView w3b(w3_blocks.data(), to_size(e * i * h / 2), dims(i, h, true), dl_u8());
        TensorView w3s(w3_scales.data(), to_size(e * i * h / 32), dims(i, h, false), dl_u8());
        TensorView w2b(w2_blocks.data(), to_size(e * h * i / 2), dims(h, i, true), dl_u8());
        TensorView w2s(w2_scales.data(), to_size(e * h * i / 32), dims(h, i, false), dl_u8());
        moejit::SeparateCheckpoint ck;
        ck.w1_blocks = w1b.dl();
        ck.w1_scales = w1s.dl();
        ck.w3_blocks = w3b.dl();
        ck.w3_scales = w3s.dl();
        ck.w2_blocks = w2b.dl();
        ck.w2_scales = w2s.dl();
        target.first_expert = target_first + call * per_call;
        if (c_abi != nullptr) {
          require_ok(
              "moejit_moe_repack_separate",
              moejit_moe_repack_separate(c_abi, ck.w1_blocks, ck.w1_scales, ck.w3_blocks,
                                         ck.w3_scales, ck.w2_blocks, ck.w2_scales, &c_target,
                                         target.first_expert, target.bad_scale_count, stream));
        } else {
          moejit::moe_repack_separate(model.shape, ck, target, stream);
        }
      }
    }
    if (!c.b13.empty()) {
      const std::vector<uint16_t> b13(c.b13.begin() + first * 2 * i,
                                      c.b13.begin() + (first + count) * 2 * i);
      const std::vector<uint16_t> b2(c.b2.begin() + first * h, c.b2.begin() + (first + count) * h);
      MOEJIT_TEST_CU(cu().cuMemcpyHtoD(model.b13.ptr() + to_size(target_first * 2 * i * 2),
                                       b13.data(), b13.size() * 2));
      MOEJIT_TEST_CU(cu().cuMemcpyHtoD(model.b2.ptr() + to_size(target_first * h * 2), b2.data(),
                                       b2.size() * 2));
    }
    MOEJIT_TEST_CU(cu().cuStreamSynchronize(stream));
    return bad.download<int32_t>(1)[0];
  }
};

// A model whose local experts are experts [first, first + shape.num_experts) of `c`.
inline std::unique_ptr<DeviceModel> repacked_model(const ModelShape& shape,
                                                   const DeviceCheckpoint& c, int first,
                                                   CUstream stream) {
  auto model = allocate_model(shape);
  const int bad = c.repack(*model, first, shape.num_experts, 0, true, stream);
  INFO("repack of " << shape.name << " counted " << bad << " scale bytes out of range");
  REQUIRE(bad == 0);
  return model;
}

// A shape's random checkpoint (drawn from `seed`) repacked on the device, and its local experts
// dequantized to fp64 for the reference.
struct TestWeights {
  std::unique_ptr<DeviceModel> model;
  MoeWeightsF64 f64;
};

inline TestWeights test_weights(const ModelShape& shape, uint64_t seed, CUstream stream) {
  const Checkpoint ck = make_checkpoint(shape, uses_gpt_oss_layout(shape), seed);
  TestWeights w;
  {
    const DeviceCheckpoint dck(ck);
    w.model = repacked_model(shape, dck, 0, stream);
  }
  w.f64 = dequantize(ck, 0, shape.num_experts);
  return w;
}

// ---- tokens -------------------------------------------------------------------------------------

struct Tokens {
  int count = 0;                      // T
  int top_k = 0;                      // K
  std::vector<uint16_t> hidden_bits;  // [T, H] bf16
  std::vector<float> hidden;          // their values
  std::vector<int64_t> ids;           // [T, K] global expert ids
  std::vector<float> weights;         // [T, K]
};

// How the ids of a call are drawn.
struct IdPlan {
  int64_t lo = 0;  // ids of a token: distinct, uniform in [lo, hi)
  int64_t hi = 0;
  double drop = 0;            // chance that a slot is -1
  int empty_stride = 0;       // when > 0: every slot of tokens 0, stride, 2 * stride, ... is -1
  std::vector<int64_t> wild;  // when not empty: a slot is replaced by one of these with chance
  double wild_rate = 0;       // wild_rate (ids that belong to no local expert)
};

// The standard deviation of bf16 hidden values that gives FC1 pre-activations a standard
// deviation near 3: E[v^2] over the 16 E2M1 codes is 8.5625, and E[s^2] over the scales.
inline double hidden_sigma(int hidden) {
  double scale_sq = 0;
  for (int u = kMinScaleExponent; u <= kMaxScaleExponent; ++u) scale_sq += std::ldexp(1.0, 2 * u);
  scale_sq /= kMaxScaleExponent - kMinScaleExponent + 1;
  return 3.0 / std::sqrt(hidden * 8.5625 * scale_sq);
}

inline Tokens make_tokens(const ModelShape& shape, int count, const IdPlan& plan,
                          std::mt19937_64& rng) {
  Tokens tk;
  tk.count = count;
  tk.top_k = shape.top_k;
  const int k = shape.top_k;
  tk.hidden_bits = random_bf16(to_size(static_cast<int64_t>(count) * shape.hidden),
                               hidden_sigma(shape.hidden), rng);
  tk.hidden.resize(tk.hidden_bits.size());
  for (std::size_t j = 0; j < tk.hidden.size(); ++j) {
    tk.hidden[j] = detail::bf16_value(tk.hidden_bits[j]);
  }
  REQUIRE(plan.hi - plan.lo >= k);
  std::uniform_int_distribution<int64_t> pick(plan.lo, plan.hi - 1);
  std::uniform_real_distribution<double> unit(0.0, 1.0);
  tk.ids.resize(to_size(static_cast<int64_t>(count) * k));
  tk.weights.resize(tk.ids.size());
  for (int t = 0; t < count; ++t) {
    int64_t* row = tk.ids.data() + static_cast<int64_t>(t) * k;
    for (int s = 0; s < k; ++s) {
      int64_t id = 0;
      do {
        id = pick(rng);
      } while (std::find(row, row + s, id) != row + s);
      row[s] = id;
    }
    const bool drop_all = plan.empty_stride > 0 && t % plan.empty_stride == 0;
    double sum = 0;
    for (int s = 0; s < k; ++s) {
      if (drop_all || unit(rng) < plan.drop) row[s] = -1;
      if (!plan.wild.empty() && unit(rng) < plan.wild_rate) {
        row[s] = plan.wild[to_size(static_cast<int64_t>(mix64(rng()) % plan.wild.size()))];
      }
      float& w = tk.weights[to_size(static_cast<int64_t>(t) * k + s)];
      w = static_cast<float>(0.05 + unit(rng));
      sum += w;
    }
    for (int s = 0; s < k; ++s) {
      float& w = tk.weights[to_size(static_cast<int64_t>(t) * k + s)];
      w = static_cast<float>(w / sum);
    }
  }
  return tk;
}

// The ids as the fp64 reference takes them (int32; an id outside int32 names no expert: -1).
inline std::vector<int32_t> reference_ids(const std::vector<int64_t>& ids) {
  std::vector<int32_t> out(ids.size());
  for (std::size_t j = 0; j < ids.size(); ++j) {
    const int64_t id = ids[j];
    out[j] = id >= INT32_MIN && id <= INT32_MAX ? static_cast<int32_t>(id) : -1;
  }
  return out;
}

// Inputs, output and workspace of one moe_forward call on the device.
struct ForwardIo {
  const ModelShape* shape;
  int tokens;
  DeviceBuffer hidden, ids, weights, out, workspace;
  std::size_t workspace_bytes;
  std::unique_ptr<TensorView> hidden_t, ids_t, weights_t, out_t;

  ForwardIo(const ModelShape& s, const Tokens& tk, std::size_t workspace_size)
      : shape(&s), tokens(tk.count), workspace_bytes(workspace_size) {
    const int64_t t = tk.count;
    const int64_t k = s.top_k;
    const int64_t h = s.hidden;
    hidden = upload_new(tk.hidden_bits);
    if (s.id_dtype == DType::kI64) {
      ids = upload_new(tk.ids);
    } else {
      std::vector<int32_t> narrow(tk.ids.size());
      std::size_t outside = 0;
      for (std::size_t j = 0; j < narrow.size(); ++j) {
        outside += tk.ids[j] < INT32_MIN || tk.ids[j] > INT32_MAX ? 1 : 0;
        narrow[j] = static_cast<int32_t>(tk.ids[j]);
      }
      REQUIRE(outside == 0);
      ids = upload_new(narrow);
    }
    weights = upload_new(tk.weights);
    out = DeviceBuffer(std::max<std::size_t>(to_size(t * h * 2), 16));
    workspace = DeviceBuffer(std::max<std::size_t>(workspace_bytes, 256));
    hidden_t =
        std::make_unique<TensorView>(hidden.data(), 0, std::vector<int64_t>{t, h}, dl_bf16());
    ids_t = std::make_unique<TensorView>(ids.data(), 0, std::vector<int64_t>{t, k},
                                         dl_int(s.id_dtype == DType::kI64 ? 64 : 32));
    weights_t =
        std::make_unique<TensorView>(weights.data(), 0, std::vector<int64_t>{t, k}, dl_float(32));
    out_t = std::make_unique<TensorView>(out.data(), 0, std::vector<int64_t>{t, h}, dl_bf16());
  }

  moejit::MoeForwardArgs args(const DeviceModel& model) const {
    moejit::MoeForwardArgs a;
    a.hidden = hidden_t->dl();
    a.topk_ids = ids_t->dl();
    a.topk_weights = weights_t->dl();
    a.weights = model.weights();
    a.workspace = workspace.data();
    a.workspace_bytes = workspace_bytes;
    a.out = out_t->dl();
    return a;
  }

  // Output (NaN bf16) and workspace (0xFF) poisoned, one call, the output's bits.
  std::vector<uint16_t> run(const DeviceModel& model, CUstream stream,
                            const MoeForwardOptions& options = {}) const {
    std::vector<uint16_t> bits;
    const std::string problem = try_run(model, stream, options, bits);
    if (!problem.empty()) FAIL(problem);
    return bits;
  }

  // run() without Catch2, for threads beside the test's own (its macros are not thread-safe): ""
  // when the call ran, else what failed; `bits` receives the output's bits.
  std::string try_run(const DeviceModel& model, CUstream stream, const MoeForwardOptions& options,
                      std::vector<uint16_t>& bits) const {
    const detail::DriverApi& api = cu();
    auto failed = [](const char* what, CUresult result) {
      return std::string(what) + ": " + detail::describe(result);
    };
    for (const DeviceBuffer* buffer : {&out, &workspace}) {
      if (buffer->bytes() == 0) continue;
      const CUresult poisoned = api.cuMemsetD8Async(buffer->ptr(), 0xFF, buffer->bytes(), stream);
      if (poisoned != CUDA_SUCCESS) return failed("poison", poisoned);
    }
    try {
      moejit::moe_forward(*shape, args(model), stream, options);
    } catch (const Error& e) {
      return std::string("moe_forward: ") + e.what();
    }
    const CUresult synced = api.cuStreamSynchronize(stream);
    if (synced != CUDA_SUCCESS) return failed("cuStreamSynchronize", synced);
    bits.resize(to_size(static_cast<int64_t>(tokens) * shape->hidden));
    const CUresult copied = api.cuMemcpyDtoH(bits.data(), out.ptr(), bits.size() * 2);
    if (copied != CUDA_SUCCESS) return failed("download", copied);
    return "";
  }

  // One call captured into a CUDA graph (the kernels must be built already: prewarm), then
  // `replays` launches of it, output and workspace poisoned before each; every replay's output.
  std::vector<std::vector<uint16_t>> graph_replays(const DeviceModel& model, CUstream stream,
                                                   const MoeForwardOptions& options, int replays) {
    CUgraph graph = nullptr;
    MOEJIT_TEST_CU(cu().cuStreamBeginCapture(stream, CU_STREAM_CAPTURE_MODE_GLOBAL));
    try {
      moejit::moe_forward(*shape, args(model), stream, options);
    } catch (const Error& e) {
      cu().cuStreamEndCapture(stream, &graph);
      if (graph != nullptr) cu().cuGraphDestroy(graph);
      FAIL("moe_forward failed during capture: " << e.what());
    }
    MOEJIT_TEST_CU(cu().cuStreamEndCapture(stream, &graph));
    REQUIRE(graph != nullptr);
    CUgraphExec exec = nullptr;
    const CUresult instantiated = cu().cuGraphInstantiate(&exec, graph, 0);
    if (instantiated != CUDA_SUCCESS) cu().cuGraphDestroy(graph);
    MOEJIT_TEST_CU(instantiated);
    std::vector<std::vector<uint16_t>> outputs;
    for (int replay = 0; replay < replays; ++replay) {
      poison(out, stream);
      poison(workspace, stream);
      MOEJIT_TEST_CU(cu().cuGraphLaunch(exec, stream));
      MOEJIT_TEST_CU(cu().cuStreamSynchronize(stream));
      outputs.push_back(output());
    }
    cu().cuGraphExecDestroy(exec);
    cu().cuGraphDestroy(graph);
    return outputs;
  }

  std::vector<uint16_t> output() const {
    return out.download<uint16_t>(to_size(static_cast<int64_t>(tokens) * shape->hidden));
  }
};

// ---- reference and comparison -------------------------------------------------------------------

// The fp64 layer for tokens `which` of `tk` ([which.size(), H]) on every core. Why split by
// experts and not by tokens: the reference walks each expert's fp64 weights once per call, so
// token chunks would stream every touched expert's weights from DRAM once per chunk; expert
// groups read each expert once. Each group's call sees only its experts' ids (the others become
// -1), and the groups' outputs are added in group order.
inline std::vector<double> reference_layer(const MoeWeightsF64& w, const Tokens& tk,
                                           const std::vector<int>& which,
                                           const MoeLayerOptions& options) {
  const int64_t h = w.hidden;
  const int64_t k = tk.top_k;
  const int n = static_cast<int>(which.size());
  const std::vector<int32_t> all_ids = reference_ids(tk.ids);
  std::vector<float> x;
  std::vector<int32_t> ids;
  std::vector<float> weights;
  for (int t : which) {
    x.insert(x.end(), tk.hidden.begin() + t * h, tk.hidden.begin() + (t + 1) * h);
    ids.insert(ids.end(), all_ids.begin() + t * k, all_ids.begin() + (t + 1) * k);
    weights.insert(weights.end(), tk.weights.begin() + t * k, tk.weights.begin() + (t + 1) * k);
  }
  auto local = [&](int32_t id) -> int64_t {
    const int64_t e = static_cast<int64_t>(id) - options.expert_offset;
    return e >= 0 && e < w.num_experts ? e : -1;
  };
  std::vector<int64_t> count(to_size(w.num_experts), 0);
  for (int32_t id : ids) {
    if (local(id) >= 0) ++count[to_size(local(id))];
  }
  std::vector<int64_t> order;
  for (int64_t e = 0; e < w.num_experts; ++e) {
    if (count[to_size(e)] > 0) order.push_back(e);
  }
  std::sort(order.begin(), order.end(),
            [&](int64_t a, int64_t b) { return count[to_size(a)] > count[to_size(b)]; });
  const int64_t groups =
      std::max<int64_t>(1, std::min<int64_t>(worker_count(), static_cast<int64_t>(order.size())));
  // Largest first onto the least loaded group.
  std::vector<int64_t> group_of(to_size(w.num_experts), -1);
  std::vector<int64_t> load(to_size(groups), 0);
  for (int64_t e : order) {
    const auto g = std::min_element(load.begin(), load.end()) - load.begin();
    group_of[to_size(e)] = g;
    load[to_size(g)] += count[to_size(e)];
  }
  std::vector<std::vector<double>> parts(to_size(groups));
  parallel_for(groups, [&](int64_t g) {
    std::vector<int32_t> mine = ids;
    for (int32_t& id : mine) {
      if (local(id) < 0 || group_of[to_size(local(id))] != g) id = -1;
    }
    parts[to_size(g)] =
        detail::moe_layer_reference(w, x, mine, weights, n, static_cast<int>(k), options);
  });
  std::vector<double> out = std::move(parts[0]);
  for (std::size_t g = 1; g < parts.size(); ++g) {
    for (std::size_t j = 0; j < out.size(); ++j) out[j] += parts[g][j];
  }
  return out;
}

inline MoeLayerOptions layer_options(const ModelShape& shape) {
  MoeLayerOptions o;
  o.activation = shape.activation;
  o.expert_offset = shape.expert_offset;
  return o;
}

inline std::vector<int> all_tokens(int count) {
  std::vector<int> which(to_size(count));
  for (int t = 0; t < count; ++t) which[to_size(t)] = t;
  return which;
}

// `count` tokens spread over [0, tokens), the first and the last included.
inline std::vector<int> sampled_tokens(int tokens, int count) {
  std::vector<int> which;
  for (int j = 0; j < count; ++j) {
    which.push_back(static_cast<int>(static_cast<int64_t>(j) * (tokens - 1) / (count - 1)));
  }
  which.erase(std::unique(which.begin(), which.end()), which.end());
  return which;
}

struct Score {
  double rel_l2 = 0;       // ||got - ref|| / ||ref|| over the checked tokens
  double worst_token = 0;  // the largest per-token relative L2 (tokens with ref != 0)
  int worst_token_index = -1;
  int64_t nonfinite = 0;      // NaN or inf outputs among the checked tokens
  int64_t nonzero_empty = 0;  // outputs of tokens with no local expert that are not +0 bits
  int empty_tokens = 0;       // checked tokens with no local expert
};

// Why the tolerance is 1e-2 (relative L2 over the layer output, fp64 reference on the same
// bf16 inputs and the exact dequantized weights):
// - exact in the kernel: bf16 hidden values (the reference reads the same values); every MXFP4
//   weight (E2M1 times a power of two is a bf16 value); each product (bf16 x bf16 has 16
//   significant bits, fp32 keeps 24).
// - fp32 accumulation over K <= 4096 products: relative error around sqrt(K) * 2^-24 ~ 4e-6
//   for these random signs (worst case K * 2^-24 = 2.4e-4); the activation in fp32 with
//   accurate sigmoid / tanh: a few ulp, ~1e-7.
// - bf16 storage: FC1's activation output is stored as bf16 (relative rounding error uniform
//   within half an ulp, at most 2^-9 = 2e-3, RMS ~1.6e-3 over random mantissas); the errors of
//   the I terms of each FC2 dot product are independent, so FC2's output carries about the
//   same 1.6e-3 relative L2. The layer output is rounded to bf16 once more: a second
//   independent ~1.6e-3, so ~2.3e-3 in all. (The fp64 reference with its bf16 intermediate
//   switch on and the output rounded to bf16 - the kernel's arithmetic minus fp32 rounding -
//   measures 2.33e-3 against the exact one, worst token 2.9e-3, on these input statistics.)
//   marlin_moe stores FC2's weighted rows in bf16 before the fp32 top-k sum
//   (MarlinMoeParams::out_dtype): a third independent term, ~2.8e-3 in all. decode_moe's
//   persistent tile does the same (bf16 rows per position, summed by decode_moe_combine:
//   ~2.8e-3, equal to marlin_moe's to the bit where both add K in the same order); its pair
//   (T <= 2) sums each token's slots in fp32 inside fc2, so it rounds at the first two points
//   only: ~2.3e-3.
// - so 1e-2 is ~4x the expected error, while any structural fault costs far more: one lost or
//   misrouted slot of k = 16 is ~0.25 of a token's norm, a wrong scale group or nibble order
//   gives O(1) errors on its rows. The per-token bound (2e-2, ~7x the worst token above) keeps
//   one wrong token of 1000 from hiding in the global figure.
inline constexpr double kRelL2Tolerance = 1e-2;
inline constexpr double kTokenRelL2Tolerance = 2e-2;

inline Score score(const std::vector<uint16_t>& got_bits, const std::vector<double>& ref,
                   const std::vector<int>& which, int hidden) {
  Score s;
  double err = 0;
  double norm = 0;
  for (std::size_t j = 0; j < which.size(); ++j) {
    const int64_t t = which[j];
    double token_err = 0;
    double token_norm = 0;
    bool finite = true;
    for (int64_t c = 0; c < hidden; ++c) {
      const uint16_t bits = got_bits[to_size(t * hidden + c)];
      const double got = detail::bf16_value(bits);
      const double want = ref[j * to_size(hidden) + to_size(c)];
      if (!std::isfinite(got)) {
        ++s.nonfinite;
        finite = false;
        continue;
      }
      token_err += (got - want) * (got - want);
      token_norm += want * want;
    }
    err += token_err;
    norm += token_norm;
    if (token_norm == 0) {
      // No local expert (the reference is exactly 0): the op writes +0 everywhere.
      ++s.empty_tokens;
      for (int64_t c = 0; c < hidden; ++c) {
        if (got_bits[to_size(t * hidden + c)] != 0) ++s.nonzero_empty;
      }
    } else if (finite) {
      const double rel = std::sqrt(token_err / token_norm);
      if (rel > s.worst_token) {
        s.worst_token = rel;
        s.worst_token_index = static_cast<int>(t);
      }
    }
  }
  s.rel_l2 = norm > 0 ? std::sqrt(err / norm) : std::sqrt(err);
  if (s.nonfinite > 0) s.rel_l2 = std::numeric_limits<double>::quiet_NaN();
  return s;
}

inline double rel_l2(const std::vector<double>& got, const std::vector<double>& want) {
  double err = 0;
  double norm = 0;
  for (std::size_t j = 0; j < got.size(); ++j) {
    err += (got[j] - want[j]) * (got[j] - want[j]);
    norm += want[j] * want[j];
  }
  return norm > 0 ? std::sqrt(err / norm) : std::sqrt(err);
}

inline std::vector<double> values_of(const std::vector<uint16_t>& bits) {
  std::vector<double> v(bits.size());
  for (std::size_t j = 0; j < bits.size(); ++j) v[j] = detail::bf16_value(bits[j]);
  return v;
}

// Checks `s` and prints the case's line.
inline void check_score(const std::string& label, const Score& s, std::size_t checked, int tokens,
                        const char* op = "moe_forward") {
  std::printf("%s %s relL2=%s (worst token %s; checked %zu of %d tokens%s)\n", op, label.c_str(),
              fmt(s.rel_l2).c_str(), fmt(s.worst_token).c_str(), checked, tokens,
              s.empty_tokens > 0 ? (", " + std::to_string(s.empty_tokens) +
                                    " with no local "
                                    "expert")
                                       .c_str()
                                 : "");
  std::fflush(stdout);
  INFO(label << ": relL2 " << s.rel_l2 << ", worst token " << s.worst_token_index << " at "
             << s.worst_token << ", " << s.nonfinite << " NaN/inf, " << s.nonzero_empty
             << " nonzero outputs of tokens with no local expert");
  CHECK(s.nonfinite == 0);
  CHECK(s.rel_l2 <= kRelL2Tolerance);
  CHECK(s.worst_token <= kTokenRelL2Tolerance);
  CHECK(s.nonzero_empty == 0);
}

// NaN or inf elements (the NaN poison included) among all of `bits`.
inline int64_t count_nonfinite(const std::vector<uint16_t>& bits) {
  return std::count_if(bits.begin(), bits.end(), [](uint16_t b) { return (b & 0x7F80) == 0x7F80; });
}

// Rows `which` of a row-major [T, cols] matrix, concatenated.
inline std::vector<double> rows_of(const std::vector<double>& values, const std::vector<int>& which,
                                   int cols) {
  std::vector<double> out;
  out.reserve(which.size() * to_size(cols));
  for (int t : which) {
    const auto row = values.begin() + static_cast<std::ptrdiff_t>(t) * cols;
    out.insert(out.end(), row, row + cols);
  }
  return out;
}

// Every element is still the NaN poison (nothing was written).
inline bool still_poisoned(const std::vector<uint16_t>& bits) {
  return std::all_of(bits.begin(), bits.end(), [](uint16_t b) { return b == 0xFFFF; });
}

inline bool same_bits(const std::vector<uint16_t>& a, const std::vector<uint16_t>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * 2) == 0;
}

// The first byte offset where a and b differ (the shorter one's size where one is a prefix of the
// other), or -1 where they are equal. Why not `a == b` in a CHECK: Catch2 prints both operands,
// and a buffer of megabytes as text takes minutes.
inline int64_t first_difference(const std::vector<uint8_t>& a, const std::vector<uint8_t>& b) {
  const auto diff = std::mismatch(a.begin(), a.end(), b.begin(), b.end());
  if (diff.first == a.end() && diff.second == b.end()) return -1;
  return diff.first - a.begin();
}

// One call with `args` (io's tensors, perhaps altered) that must throw Error{code} before
// anything runs: io's output is poisoned first and still the poison after the stream drains.
// Returns the message.
inline std::string expect_refused(ForwardIo& io, const MoeForwardArgs& args, CUstream stream,
                                  const MoeForwardOptions& options, ErrorCode code) {
  poison(io.out, stream);
  MOEJIT_TEST_CU(cu().cuStreamSynchronize(stream));
  std::string message;
  bool threw = false;
  try {
    moejit::moe_forward(*io.shape, args, stream, options);
  } catch (const Error& e) {
    threw = true;
    message = e.what();
    INFO(message);
    CHECK(std::string(error_code_name(e.code())) == error_code_name(code));
  }
  MOEJIT_TEST_CU(cu().cuStreamSynchronize(stream));
  INFO("expected Error{" << error_code_name(code) << "}");
  CHECK(threw);
  CHECK(still_poisoned(io.output()));
  return message;
}

}  // namespace moejit::test
