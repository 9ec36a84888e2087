// The MXFP4 MoE layer on the GPU (moejit/moe.hpp): moe_forward against the fp64 CPU reference
// (src/ops/moe_reference) on every reference shape of DESIGN.md and T in {1, 7, 48, 256, 1000},
// bitwise repeatability, expert parallelism (two halves sum to the whole), ids of -1 and of other
// ranks (int32 and int64), CUDA-graph capture and replay, the workspace size contract, the repack
// round trip for both checkpoint layouts (unpacked on the CPU with kernels/moe/layout.cuh), and
// the route arrays moe_forward leaves in its workspace against the CPU route model, bit for bit.
//
// Inputs: random E2M1 nibbles (all 16 codes equally likely) and E8M0 scales 2^-10 .. 2^3, bf16
// hidden states scaled so FC1's pre-activations have a standard deviation near 3 (the clamps of
// gpt-oss at 7 and DeepSeek-V4 at 10 are reached, but not everywhere), top-k weights positive and
// summing to 1. Fresh seeds every run (printed) so a failure can be replayed.
//
// Reduced experts: the CPU reference dequantizes every local expert to fp64 (24·H·I bytes each),
// so the forward sweep keeps the real H, I, top-k and activation of each shape but at most 32
// local experts (its memory, not its time: the reference costs T·k·3·H·I multiply-adds whatever
// E is). The route check runs every shape at its real expert count (no reference weights needed).
// The reference runs on all cores, split by tokens; at T = 1000 the three heaviest shapes check
// 128 sampled tokens (every other case checks every token).
//
// Each forward case prints one line, "moe_forward <shape> T=<T> relL2=<x> ...", for PERF_LOG.
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
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "gpu/gpu_support.hpp"
#include "moejit/error.hpp"
#include "moejit/moe.hpp"
#include "moejit/runtime.hpp"
#include "ops/moe_reference.hpp"
#include "plan/moe_plan.hpp"
#include "runtime/runtime_impl.hpp"
#include "support/support.hpp"

namespace {

using moejit::ActivationKind;
using moejit::DType;
using moejit::Error;
using moejit::ErrorCode;
using moejit::ModelShape;
using moejit::MoeWeightLayout;
using moejit::MoeWeights;
using moejit::detail::MoeLayerOptions;
using moejit::detail::MoeWeightsF64;
using moejit::detail::Mxfp4Matrix;
using moejit::test::cu;
using moejit::test::DeviceBuffer;
using moejit::test::gpu;
using moejit::test::TestStream;
namespace layout = moejit::kern::moe::layout;

// ---- small helpers ---------------------------------------------------------------------------

uint64_t fresh_seed() {
  std::random_device device;
  return (static_cast<uint64_t>(device()) << 32) ^ device();
}

// splitmix64's finalizer: a well-mixed 64-bit value of x.
uint64_t mix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

unsigned worker_count() { return std::max(1u, std::thread::hardware_concurrency()); }

// body(i) for i in [0, count), spread over every core (dynamic: tasks may differ in cost).
void parallel_for(int64_t count, const std::function<void(int64_t)>& body) {
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

std::string fmt(double value) {
  char text[32];
  std::snprintf(text, sizeof(text), "%.3e", value);
  return text;
}

std::size_t to_size(int64_t n) { return static_cast<std::size_t>(n); }

// ---- device tensors ---------------------------------------------------------------------------

DLDataType dl_u8() { return DLDataType{kDLUInt, 8, 1}; }

// A DLTensor over device memory it does not own (row-major, compact).
class TensorView {
 public:
  TensorView(const void* base, std::size_t byte_offset, std::vector<int64_t> shape,
             DLDataType dtype)
      : shape_(std::move(shape)) {
    tensor_.data = const_cast<void*>(base);
    tensor_.device = DLDevice{kDLCUDA, 0};
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

void poison(const DeviceBuffer& buffer, CUstream stream, unsigned char byte = 0xFF) {
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

// Every kernel of `shapes` for this device's arch, compiled in parallel (idempotent).
void prewarm(const std::vector<ModelShape>& shapes) {
  const moejit::Arch arch = moejit::detail::Runtime::instance().current_arch();
  for (const moejit::BuildResult& result :
       moejit::prewarm(shapes, {arch}, static_cast<int>(worker_count()))) {
    INFO(result.spec.display_name() << ": " << result.error);
    REQUIRE(result.error.empty());
  }
}

// ---- shapes -----------------------------------------------------------------------------------

// A shape of tools/shapes/reference.json (the table of DESIGN.md).
ModelShape reference_shape(const std::string& name) {
  static const std::vector<ModelShape> shapes =
      moejit::load_shapes_file(moejit::test::shapes_dir() + "/reference.json");
  for (const ModelShape& s : shapes) {
    if (s.name == name) return s;
  }
  FAIL("no shape \"" << name << "\" in reference.json");
  return {};
}

// The shape with `experts` local experts from `offset` out of `global` routed experts; the real
// H, I, activation and bias; top-k capped by the experts a token can choose from.
ModelShape resized(const ModelShape& real, int experts, int offset, int global, int max_tokens) {
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
bool uses_gpt_oss_layout(const ModelShape& shape) {
  return shape.activation.kind == ActivationKind::kGptOss;
}

// ---- checkpoints ------------------------------------------------------------------------------

// Random bytes: byte i depends only on (seed, i), not on the thread count.
void fill_random(std::vector<uint8_t>& bytes, uint64_t seed) {
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

constexpr int kMinScaleExponent = -10;
constexpr int kMaxScaleExponent = 3;

// A [rows, cols] MXFP4 matrix (checkpoint layout): nibbles uniform over the 16 codes, scales
// 2^u with u uniform in [kMinScaleExponent, kMaxScaleExponent].
Mxfp4Matrix random_mxfp4(int64_t rows, int64_t cols, uint64_t seed) {
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

std::vector<uint16_t> random_bf16(std::size_t count, double sigma, std::mt19937_64& rng) {
  std::normal_distribution<double> normal(0.0, sigma);
  std::vector<uint16_t> bits(count);
  for (uint16_t& b : bits) b = moejit::detail::bf16_bits(static_cast<float>(normal(rng)));
  return bits;
}

Checkpoint make_checkpoint(const ModelShape& shape, bool interleaved, uint64_t seed) {
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
Mxfp4Matrix row_slice(const Mxfp4Matrix& m, int64_t row0, int64_t rows) {
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
MoeWeightsF64 dequantize(const Checkpoint& c, int first, int count) {
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
        moejit::detail::mxfp4_dequantize(row_slice(*task.source, task.source_row, task.rows));
    std::copy(values.begin(), values.end(), task.destination);
  });
  if (!c.b13.empty()) {
    for (int64_t e = 0; e < count; ++e) {
      for (int64_t r = 0; r < 2 * i; ++r) {
        w.b13.push_back(moejit::detail::bf16_value(c.b13[to_size((first + e) * 2 * i + r)]));
      }
      for (int64_t r = 0; r < h; ++r) {
        w.b2.push_back(moejit::detail::bf16_value(c.b2[to_size((first + e) * h + r)]));
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

std::unique_ptr<DeviceModel> allocate_model(const ModelShape& shape) {
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
  // per expert (the separate layout's per-expert form). Returns the bad-scale count.
  int repack(DeviceModel& model, int first, int count, int target_first, bool stacked,
             CUstream stream) const {
    const Checkpoint& c = *host;
    const int64_t h = c.hidden;
    const int64_t i = c.inter;
    DeviceBuffer bad(sizeof(int32_t));
    bad.upload(std::vector<int32_t>{0});
    moejit::MoeRepackTarget target;
    target.weights = model.weights();
    target.bad_scale_count = static_cast<int32_t*>(bad.data());
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
      moejit::moe_repack_gpt_oss(model.shape, ck, target, stream);
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
        moejit::moe_repack_separate(model.shape, ck, target, stream);
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
std::unique_ptr<DeviceModel> repacked_model(const ModelShape& shape, const DeviceCheckpoint& c,
                                            int first, CUstream stream) {
  auto model = allocate_model(shape);
  const int bad = c.repack(*model, first, shape.num_experts, 0, true, stream);
  INFO("repack of " << shape.name << " counted " << bad << " scale bytes out of range");
  REQUIRE(bad == 0);
  return model;
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
double hidden_sigma(int hidden) {
  double scale_sq = 0;
  for (int u = kMinScaleExponent; u <= kMaxScaleExponent; ++u) scale_sq += std::ldexp(1.0, 2 * u);
  scale_sq /= kMaxScaleExponent - kMinScaleExponent + 1;
  return 3.0 / std::sqrt(hidden * 8.5625 * scale_sq);
}

Tokens make_tokens(const ModelShape& shape, int count, const IdPlan& plan, std::mt19937_64& rng) {
  Tokens tk;
  tk.count = count;
  tk.top_k = shape.top_k;
  const int k = shape.top_k;
  tk.hidden_bits = random_bf16(to_size(static_cast<int64_t>(count) * shape.hidden),
                               hidden_sigma(shape.hidden), rng);
  tk.hidden.resize(tk.hidden_bits.size());
  for (std::size_t j = 0; j < tk.hidden.size(); ++j) {
    tk.hidden[j] = moejit::detail::bf16_value(tk.hidden_bits[j]);
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
std::vector<int32_t> reference_ids(const std::vector<int64_t>& ids) {
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
    hidden_t = std::make_unique<TensorView>(hidden.data(), 0, std::vector<int64_t>{t, h},
                                            moejit::test::dl_bf16());
    ids_t = std::make_unique<TensorView>(ids.data(), 0, std::vector<int64_t>{t, k},
                                         moejit::test::dl_int(s.id_dtype == DType::kI64 ? 64 : 32));
    weights_t = std::make_unique<TensorView>(weights.data(), 0, std::vector<int64_t>{t, k},
                                             moejit::test::dl_float(32));
    out_t = std::make_unique<TensorView>(out.data(), 0, std::vector<int64_t>{t, h},
                                         moejit::test::dl_bf16());
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
  std::vector<uint16_t> run(const DeviceModel& model, CUstream stream) {
    poison(out, stream);
    poison(workspace, stream);
    moejit::moe_forward(*shape, args(model), stream);
    MOEJIT_TEST_CU(cu().cuStreamSynchronize(stream));
    return output();
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
std::vector<double> reference_layer(const MoeWeightsF64& w, const Tokens& tk,
                                    const std::vector<int>& which, const MoeLayerOptions& options) {
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
        moejit::detail::moe_layer_reference(w, x, mine, weights, n, static_cast<int>(k), options);
  });
  std::vector<double> out = std::move(parts[0]);
  for (std::size_t g = 1; g < parts.size(); ++g) {
    for (std::size_t j = 0; j < out.size(); ++j) out[j] += parts[g][j];
  }
  return out;
}

MoeLayerOptions layer_options(const ModelShape& shape) {
  MoeLayerOptions o;
  o.activation = shape.activation;
  o.expert_offset = shape.expert_offset;
  return o;
}

std::vector<int> all_tokens(int count) {
  std::vector<int> which(to_size(count));
  for (int t = 0; t < count; ++t) which[to_size(t)] = t;
  return which;
}

// `count` tokens spread over [0, tokens), the first and the last included.
std::vector<int> sampled_tokens(int tokens, int count) {
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
//   Should the plan store FC2's rows in bf16 (MarlinMoeParams::out_dtype), a third term makes
//   it ~2.8e-3.
// - so 1e-2 is ~4x the expected error, while any structural fault costs far more: one lost or
//   misrouted slot of k = 16 is ~0.25 of a token's norm, a wrong scale group or nibble order
//   gives O(1) errors on its rows. The per-token bound (2e-2, ~7x the worst token above) keeps
//   one wrong token of 1000 from hiding in the global figure.
constexpr double kRelL2Tolerance = 1e-2;
constexpr double kTokenRelL2Tolerance = 2e-2;

Score score(const std::vector<uint16_t>& got_bits, const std::vector<double>& ref,
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
      const double got = moejit::detail::bf16_value(bits);
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

double rel_l2(const std::vector<double>& got, const std::vector<double>& want) {
  double err = 0;
  double norm = 0;
  for (std::size_t j = 0; j < got.size(); ++j) {
    err += (got[j] - want[j]) * (got[j] - want[j]);
    norm += want[j] * want[j];
  }
  return norm > 0 ? std::sqrt(err / norm) : std::sqrt(err);
}

std::vector<double> values_of(const std::vector<uint16_t>& bits) {
  std::vector<double> v(bits.size());
  for (std::size_t j = 0; j < bits.size(); ++j) v[j] = moejit::detail::bf16_value(bits[j]);
  return v;
}

// Checks `s` and prints the case's line.
void check_score(const std::string& label, const Score& s, std::size_t checked, int tokens) {
  std::printf("moe_forward %s relL2=%s (worst token %s; checked %zu of %d tokens%s)\n",
              label.c_str(), fmt(s.rel_l2).c_str(), fmt(s.worst_token).c_str(), checked, tokens,
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

// Every element is still the NaN poison (nothing was written).
bool still_poisoned(const std::vector<uint16_t>& bits) {
  return std::all_of(bits.begin(), bits.end(), [](uint16_t b) { return b == 0xFFFF; });
}

bool same_bits(const std::vector<uint16_t>& a, const std::vector<uint16_t>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * 2) == 0;
}

// ---- the forward sweep --------------------------------------------------------------------------

struct SweepShape {
  const char* name;
  int experts;        // local experts the test uses (<= the real count)
  bool sample_t1000;  // at T = 1000 check 128 sampled tokens (the reference's heaviest shapes)
};

// DESIGN.md's reference shapes. Experts: at most 32 (fp64 weights of up to 7 GB on the host);
// some fewer so no two entries are the same shape.
constexpr SweepShape kSweep[] = {
    {"gpt-oss-120b", 24, false},          {"gpt-oss-20b", 32, true},
    {"kimi-k3.1-tp8", 32, false},         {"kimi-k3.1-tp4-ep2", 32, true},
    {"deepseek-v4-flash-tp4", 32, false}, {"deepseek-v4.1-flash-tp4", 48, false},
    {"qwen3-30b-a3b", 32, false},         {"qwen2-57b-a14b", 24, true},
};
constexpr int kSweepTokens[] = {1, 7, 48, 256, 1000};
constexpr int kSampledTokens = 128;

ModelShape sweep_shape(const SweepShape& s) {
  const ModelShape real = reference_shape(s.name);
  return resized(real, s.experts, 0, s.experts, 1000);
}

std::string describe(const ModelShape& s, int real_experts) {
  std::ostringstream os;
  os << "(E=" << s.num_experts << " of " << real_experts << ", k=" << s.top_k << ", H=" << s.hidden
     << ", I=" << s.intermediate << ", " << moejit::activation_kind_name(s.activation.kind)
     << (s.has_bias ? ", bias" : "") << ")";
  return os.str();
}

}  // namespace

TEST_CASE("moe_forward: reference shapes x T vs the fp64 reference, 3 runs bitwise", "[gpu][moe]") {
  gpu();
  TestStream stream;
  std::vector<ModelShape> shapes;
  for (const SweepShape& s : kSweep) shapes.push_back(sweep_shape(s));
  prewarm(shapes);
  const uint64_t seed = fresh_seed();
  INFO("seed " << seed);
  std::printf("moe_forward sweep: seed %llu, reference on %u threads\n",
              static_cast<unsigned long long>(seed), worker_count());
  std::mt19937_64 rng(seed);
  for (std::size_t n = 0; n < shapes.size(); ++n) {
    const ModelShape& shape = shapes[n];
    const int real_experts = reference_shape(kSweep[n].name).num_experts;
    const Checkpoint ck = make_checkpoint(shape, uses_gpt_oss_layout(shape), rng());
    std::unique_ptr<DeviceModel> model;
    {
      const DeviceCheckpoint dck(ck);
      model = repacked_model(shape, dck, 0, stream.get());
    }
    const MoeWeightsF64 f64 = dequantize(ck, 0, shape.num_experts);
    std::printf("moe_forward shape %s %s, %s checkpoint layout\n", kSweep[n].name,
                describe(shape, real_experts).c_str(),
                uses_gpt_oss_layout(shape) ? "gpt-oss" : "separate w1/w3/w2");
    IdPlan plan;
    plan.lo = 0;
    plan.hi = shape.num_experts;
    for (int tokens : kSweepTokens) {
      const Tokens tk = make_tokens(shape, tokens, plan, rng);
      ForwardIo io(shape, tk, moejit::moe_workspace_bytes(shape, tokens));
      const std::vector<uint16_t> first = io.run(*model, stream.get());
      bool repeat = true;
      for (int again = 1; again < 3; ++again) {
        repeat = same_bits(io.run(*model, stream.get()), first) && repeat;
      }
      const std::vector<int> which = kSweep[n].sample_t1000 && tokens == 1000
                                         ? sampled_tokens(tokens, kSampledTokens)
                                         : all_tokens(tokens);
      const std::vector<double> ref = reference_layer(f64, tk, which, layer_options(shape));
      const std::string label = std::string(kSweep[n].name) + " T=" + std::to_string(tokens);
      check_score(label, score(first, ref, which, shape.hidden), which.size(), tokens);
      INFO(label << " " << describe(shape, real_experts) << ": 3 runs bitwise identical");
      CHECK(repeat);
    }
  }
}

TEST_CASE("moe_forward: EP halves (offsets 0 and E/2) sum to the layer", "[gpu][moe]") {
  gpu();
  TestStream stream;
  const uint64_t seed = fresh_seed();
  INFO("seed " << seed);
  std::mt19937_64 rng(seed);
  for (const char* name : {"kimi-k3.1-tp4-ep2", "gpt-oss-20b"}) {
    const ModelShape real = reference_shape(name);
    const int e = 32;
    const ModelShape full = resized(real, e, 0, e, 256);
    const ModelShape half0 = resized(real, e / 2, 0, e, 256);
    const ModelShape half1 = resized(real, e / 2, e / 2, e, 256);
    prewarm({full, half0, half1});
    const Checkpoint ck = make_checkpoint(full, uses_gpt_oss_layout(full), rng());
    std::unique_ptr<DeviceModel> m_full, m_half0, m_half1;
    {
      const DeviceCheckpoint dck(ck);
      m_full = repacked_model(full, dck, 0, stream.get());
      m_half0 = repacked_model(half0, dck, 0, stream.get());
      m_half1 = repacked_model(half1, dck, e / 2, stream.get());
    }
    const MoeWeightsF64 f64 = dequantize(ck, 0, e);
    IdPlan plan;
    plan.lo = 0;
    plan.hi = e;
    plan.drop = 0.05;
    for (int tokens : {7, 256}) {
      const Tokens tk = make_tokens(full, tokens, plan, rng);
      ForwardIo io_full(full, tk, moejit::moe_workspace_bytes(full, tokens));
      ForwardIo io0(half0, tk, moejit::moe_workspace_bytes(half0, tokens));
      ForwardIo io1(half1, tk, moejit::moe_workspace_bytes(half1, tokens));
      const std::vector<double> whole = values_of(io_full.run(*m_full, stream.get()));
      const std::vector<double> part0 = values_of(io0.run(*m_half0, stream.get()));
      const std::vector<double> part1 = values_of(io1.run(*m_half1, stream.get()));
      std::vector<double> sum(whole.size());
      for (std::size_t j = 0; j < sum.size(); ++j) sum[j] = part0[j] + part1[j];
      const std::vector<double> ref =
          reference_layer(f64, tk, all_tokens(tokens), layer_options(full));
      const double halves_vs_full = rel_l2(sum, whole);
      const double halves_vs_ref = rel_l2(sum, ref);
      const double full_vs_ref = rel_l2(whole, ref);
      std::printf(
          "moe_forward %s EP halves T=%d relL2=%s (halves vs full layer %s, full vs "
          "reference %s)\n",
          name, tokens, fmt(halves_vs_ref).c_str(), fmt(halves_vs_full).c_str(),
          fmt(full_vs_ref).c_str());
      INFO(name << " T=" << tokens);
      CHECK(halves_vs_full <= kRelL2Tolerance);
      CHECK(halves_vs_ref <= kRelL2Tolerance);
      CHECK(full_vs_ref <= kRelL2Tolerance);
      // Each half alone is far from the whole (so the sum is not trivially equal).
      CHECK(rel_l2(part0, whole) > 0.1);
      CHECK(rel_l2(part1, whole) > 0.1);
    }
  }
}

TEST_CASE("moe_forward: ids of -1, other ranks and beyond int32 add nothing", "[gpu][moe]") {
  gpu();
  TestStream stream;
  const uint64_t seed = fresh_seed();
  INFO("seed " << seed);
  std::mt19937_64 rng(seed);
  struct IdCase {
    const char* name;
    int experts;
    int offset;
    int global;
    DType id_dtype;
  };
  const IdCase cases[] = {
      {"kimi-k3.1-tp8", 32, 0, 64, DType::kI32},             // ids >= 32 are rank 1's
      {"kimi-k3.1-tp4-ep2-rank1", 32, 32, 64, DType::kI32},  // ids < 32 are rank 0's
      {"deepseek-v4-flash-tp4", 32, 0, 32, DType::kI64},     // int64 ids, some beyond int32
  };
  for (const IdCase& c : cases) {
    const ModelShape real = reference_shape(c.name);
    ModelShape shape = resized(real, c.experts, c.offset, c.global, 256);
    shape.id_dtype = c.id_dtype;
    shape.name += c.id_dtype == DType::kI64 ? "-i64" : "";
    prewarm({shape});
    const Checkpoint ck = make_checkpoint(shape, uses_gpt_oss_layout(shape), rng());
    std::unique_ptr<DeviceModel> model;
    {
      const DeviceCheckpoint dck(ck);
      model = repacked_model(shape, dck, 0, stream.get());
    }
    const MoeWeightsF64 f64 = dequantize(ck, 0, c.experts);
    IdPlan plan;
    plan.lo = 0;
    plan.hi = c.global;
    plan.drop = 0.2;
    plan.empty_stride = 10;
    if (c.id_dtype == DType::kI64) {
      // Ids whose low 32 bits name a local expert: a narrowing that truncates would route them.
      plan.wild = {int64_t{1} << 32,
                   (int64_t{1} << 32) + 5,
                   -(int64_t{1} << 32) + 3,
                   std::numeric_limits<int64_t>::min(),
                   std::numeric_limits<int64_t>::max(),
                   int64_t{INT32_MAX} + 1,
                   int64_t{INT32_MIN} - 1,
                   -2};
      plan.wild_rate = 0.1;
    }
    for (int tokens : {48, 256}) {
      const Tokens tk = make_tokens(shape, tokens, plan, rng);
      ForwardIo io(shape, tk, moejit::moe_workspace_bytes(shape, tokens));
      const std::vector<uint16_t> got = io.run(*model, stream.get());
      const std::vector<int> which = all_tokens(tokens);
      const std::vector<double> ref = reference_layer(f64, tk, which, layer_options(shape));
      const Score s = score(got, ref, which, shape.hidden);
      check_score(shape.name + " (ids -1 / other rank" +
                      (c.id_dtype == DType::kI64 ? " / int64" : "") +
                      ") T=" + std::to_string(tokens),
                  s, which.size(), tokens);
      CHECK(s.empty_tokens > 0);
    }
  }
}

TEST_CASE("moe_forward: a prewarmed call in a CUDA graph replays the same bits", "[gpu][moe]") {
  gpu();
  TestStream stream;
  const uint64_t seed = fresh_seed();
  INFO("seed " << seed);
  std::mt19937_64 rng(seed);
  const ModelShape shape = resized(reference_shape("qwen3-30b-a3b"), 32, 0, 32, 256);
  prewarm({shape});
  const Checkpoint ck = make_checkpoint(shape, false, rng());
  std::unique_ptr<DeviceModel> model;
  {
    const DeviceCheckpoint dck(ck);
    model = repacked_model(shape, dck, 0, stream.get());
  }
  IdPlan plan;
  plan.lo = 0;
  plan.hi = shape.num_experts;
  plan.drop = 0.05;
  // T = 7: one route launch; T = 256 (N = 2048): the three-launch route.
  for (int tokens : {7, 256}) {
    INFO("T=" << tokens);
    const Tokens tk = make_tokens(shape, tokens, plan, rng);
    ForwardIo io(shape, tk, moejit::moe_workspace_bytes(shape, 256));
    const std::vector<uint16_t> eager = io.run(*model, stream.get());
    CUgraph graph = nullptr;
    MOEJIT_TEST_CU(cu().cuStreamBeginCapture(stream.get(), CU_STREAM_CAPTURE_MODE_GLOBAL));
    try {
      moejit::moe_forward(shape, io.args(*model), stream.get());
    } catch (const Error& e) {
      cu().cuStreamEndCapture(stream.get(), &graph);
      if (graph != nullptr) cu().cuGraphDestroy(graph);
      FAIL("moe_forward failed during capture: " << e.what());
    }
    MOEJIT_TEST_CU(cu().cuStreamEndCapture(stream.get(), &graph));
    REQUIRE(graph != nullptr);
    CUgraphExec exec = nullptr;
    MOEJIT_TEST_CU(cu().cuGraphInstantiate(&exec, graph, 0));
    for (int replay = 0; replay < 3; ++replay) {
      poison(io.out, stream.get());
      poison(io.workspace, stream.get());
      MOEJIT_TEST_CU(cu().cuGraphLaunch(exec, stream.get()));
      stream.sync();
      INFO("replay " << replay);
      CHECK(same_bits(io.output(), eager));
    }
    cu().cuGraphExecDestroy(exec);
    cu().cuGraphDestroy(graph);
  }
}

TEST_CASE("moe_forward: a kernel not built during capture is refused", "[gpu][moe]") {
  gpu();
  TestStream stream;
  std::mt19937_64 rng(fresh_seed());
  // E = 5, k = 3: a route kernel no other test builds, in this binary's private, fresh cache.
  ModelShape shape = resized(reference_shape("qwen3-30b-a3b"), 5, 0, 5, 64);
  shape.top_k = 3;
  shape.hidden = 256;
  shape.intermediate = 128;
  shape.name = "capture-miss";
  auto model = allocate_model(shape);
  IdPlan plan;
  plan.lo = 0;
  plan.hi = 5;
  const Tokens tk = make_tokens(shape, 4, plan, rng);
  ForwardIo io(shape, tk, moejit::moe_workspace_bytes(shape, 4));
  poison(io.out, stream.get());
  stream.sync();
  CUgraph graph = nullptr;
  MOEJIT_TEST_CU(cu().cuStreamBeginCapture(stream.get(), CU_STREAM_CAPTURE_MODE_GLOBAL));
  ErrorCode code = ErrorCode::kInternal;
  std::string message;
  try {
    moejit::moe_forward(shape, io.args(*model), stream.get());
  } catch (const Error& e) {
    code = e.code();
    message = e.what();
  }
  cu().cuStreamEndCapture(stream.get(), &graph);
  if (graph != nullptr) cu().cuGraphDestroy(graph);
  INFO(message);
  CHECK(code == ErrorCode::kCaptureMiss);
  // Nothing ran: the output is still the poison.
  CHECK(still_poisoned(io.output()));
}

TEST_CASE("moe_forward: the workspace size query is respected", "[gpu][moe]") {
  gpu();
  TestStream stream;
  std::mt19937_64 rng(fresh_seed());
  const ModelShape shape = resized(reference_shape("deepseek-v4-flash-tp4"), 32, 0, 32, 1000);
  prewarm({shape});
  const Checkpoint ck = make_checkpoint(shape, false, rng());
  std::unique_ptr<DeviceModel> model;
  {
    const DeviceCheckpoint dck(ck);
    model = repacked_model(shape, dck, 0, stream.get());
  }
  const std::size_t max_bytes = moejit::moe_workspace_bytes(shape, 1000);
  CHECK(moejit::moe_workspace_bytes(shape, 0) == 0);
  CHECK_THROWS_AS(moejit::moe_workspace_bytes(shape, -1), Error);
  try {
    (void)moejit::moe_workspace_bytes(shape, shape.max_tokens + 1);
    FAIL("moe_workspace_bytes accepted max_tokens + 1");
  } catch (const Error& e) {
    CHECK(e.code() == ErrorCode::kInvalidArgument);
  }
  IdPlan plan;
  plan.lo = 0;
  plan.hi = shape.num_experts;
  const std::size_t guard = 1 << 16;
  for (int tokens : {1, 7, 48, 256, 1000}) {
    INFO("T=" << tokens);
    // The size for T never exceeds the size for the largest T, and bounds the plan's layout.
    const std::size_t bytes = moejit::moe_workspace_bytes(shape, tokens);
    CHECK(bytes <= max_bytes);
    const moejit::detail::MoeWorkspaceLayout used = moejit::detail::moe_workspace_layout(
        shape, moejit::detail::choose_moe_config(shape, tokens));
    CHECK(used.bytes <= bytes);
    const Tokens tk = make_tokens(shape, tokens, plan, rng);
    ForwardIo io(shape, tk, bytes);
    const std::vector<uint16_t> reference_out = io.run(*model, stream.get());
    // Exactly the bytes this T needs (and the size for the largest T), followed by a guard
    // band: the guard is never written, and the output is the same as with a private workspace.
    for (std::size_t given : {used.bytes, max_bytes}) {
      DeviceBuffer region(given + guard);
      poison(region, stream.get(), 0x5A);
      moejit::MoeForwardArgs a = io.args(*model);
      a.workspace = region.data();
      a.workspace_bytes = given;
      poison(io.out, stream.get());
      moejit::moe_forward(shape, a, stream.get());
      stream.sync();
      CHECK(same_bits(io.output(), reference_out));
      const std::vector<uint8_t> tail = download_at<uint8_t>(region, given, guard);
      CHECK(std::count(tail.begin(), tail.end(), uint8_t{0x5A}) ==
            static_cast<std::ptrdiff_t>(guard));
    }
    // One byte short of what this T needs: refused before anything runs.
    moejit::MoeForwardArgs a = io.args(*model);
    a.workspace_bytes = used.bytes - 1;
    poison(io.out, stream.get());
    stream.sync();
    try {
      moejit::moe_forward(shape, a, stream.get());
      FAIL("moe_forward accepted a workspace of " << used.bytes - 1 << " bytes; T = " << tokens
                                                  << " needs " << used.bytes);
    } catch (const Error& e) {
      CHECK(e.code() == ErrorCode::kInvalidArgument);
    }
    stream.sync();
    CHECK(still_poisoned(io.output()));
  }
}

namespace {

// CPU unpack of the kernel layout (layout.cuh) of local expert `expert` of one matrix, compared
// with its checkpoint rows: matrix `m` of the RowSource (FC1: 0 = gate, 1 = up; FC2: 0) comes
// from `sources[m]`, rows [first_row, first_row + rows) of it. Padding must be nibble 0 and scale
// kPadScale. Returns the number of mismatching nibbles and scales; `where` gets the first.
int64_t unpack_mismatches(const std::vector<uint8_t>& weights, const std::vector<uint8_t>& scales,
                          layout::Dims dims, int expert, bool gate_up,
                          const std::vector<const Mxfp4Matrix*>& sources,
                          const std::vector<int64_t>& first_rows, int rows, int k,
                          std::string* where) {
  int64_t bad = 0;
  const int64_t groups = k / 32;
  for (int m_atom = 0; m_atom < dims.m_atoms; ++m_atom) {
    for (int r = 0; r < layout::kAtomRows; ++r) {
      const layout::RowSource rs = layout::row_source(gate_up, m_atom, r);
      const bool row_ok = rs.row < rows;
      const Mxfp4Matrix& src = *sources[to_size(rs.matrix)];
      const int64_t src_row = first_rows[to_size(rs.matrix)] + rs.row;
      for (int kk = 0; kk < dims.k_atoms * layout::kAtomK; ++kk) {
        const int k_atom = kk / layout::kAtomK;
        const int in_atom = kk % layout::kAtomK;
        const layout::AtomCoord c = layout::atom_coord(r, in_atom);
        const int64_t atom = layout::atom_index(dims, expert, m_atom, k_atom);
        uint32_t word = 0;
        std::memcpy(&word, &weights[to_size(atom * layout::kAtomBytes + c.lane * 16 + c.step * 4)],
                    4);
        const uint32_t got = layout::extract_nibble(word, c.pair, c.half);
        uint32_t want = 0;
        if (row_ok && kk < k) {
          const uint8_t byte = src.blocks[to_size((src_row * k + kk) / 2)];
          want = (kk % 2 == 0) ? (byte & 15u) : (byte >> 4);
        }
        if (got != want) {
          if (bad++ == 0) {
            *where = "nibble of expert " + std::to_string(expert) + " m_atom " +
                     std::to_string(m_atom) + " row " + std::to_string(r) + " k " +
                     std::to_string(kk) + ": " + std::to_string(got) + ", expected " +
                     std::to_string(want);
          }
        }
        if (in_atom % 32 == 0) {
          const uint8_t got_s =
              scales[to_size(atom * layout::kAtomScaleBytes + layout::scale_byte(r, in_atom))];
          const uint8_t want_s = row_ok && kk < k ? src.scales[to_size(src_row * groups + kk / 32)]
                                                  : layout::kPadScale;
          if (got_s != want_s) {
            if (bad++ == 0) {
              *where = "scale of expert " + std::to_string(expert) + " m_atom " +
                       std::to_string(m_atom) + " row " + std::to_string(r) + " k " +
                       std::to_string(kk) + ": " + std::to_string(got_s) + ", expected " +
                       std::to_string(want_s);
            }
          }
        }
      }
    }
  }
  return bad;
}

// Every local expert of `model` unpacked and compared with checkpoint experts
// [first, first + E) of `ck`; the number of mismatches (0 = a perfect round trip).
int64_t round_trip_mismatches(const DeviceModel& model, const Checkpoint& ck, int first,
                              std::string* where) {
  const ModelShape& s = model.shape;
  const layout::Dims d1 = layout::fc1_dims(s.intermediate, s.hidden);
  const layout::Dims d2 = layout::fc2_dims(s.intermediate, s.hidden);
  const std::vector<uint8_t> w13 = model.w13.download<uint8_t>(model.sizes.w13_bytes);
  const std::vector<uint8_t> s13 = model.w13_scales.download<uint8_t>(model.sizes.w13_scale_bytes);
  const std::vector<uint8_t> w2 = model.w2.download<uint8_t>(model.sizes.w2_bytes);
  const std::vector<uint8_t> s2 = model.w2_scales.download<uint8_t>(model.sizes.w2_scale_bytes);
  CHECK(to_size(layout::weight_bytes(d1, s.num_experts)) == model.sizes.w13_bytes);
  CHECK(to_size(layout::scale_bytes(d1, s.num_experts)) == model.sizes.w13_scale_bytes);
  CHECK(to_size(layout::weight_bytes(d2, s.num_experts)) == model.sizes.w2_bytes);
  CHECK(to_size(layout::scale_bytes(d2, s.num_experts)) == model.sizes.w2_scale_bytes);
  std::vector<int64_t> bad(to_size(s.num_experts));
  std::vector<std::string> first_where(to_size(s.num_experts));
  const int64_t i = s.intermediate;
  const int64_t h = s.hidden;
  parallel_for(s.num_experts, [&](int64_t e) {
    const int64_t src = first + e;
    std::string w1;
    std::string w2_where;
    int64_t n = 0;
    if (ck.interleaved) {
      // gpt-oss: gate j is row 2j, up j is row 2j + 1: a view with every other row.
      Mxfp4Matrix gate;
      Mxfp4Matrix up;
      gate.rows = up.rows = i;
      gate.cols = up.cols = h;
      for (int64_t j = 0; j < i; ++j) {
        for (Mxfp4Matrix* m : {&gate, &up}) {
          const int64_t row = src * 2 * i + 2 * j + (m == &up ? 1 : 0);
          m->blocks.insert(m->blocks.end(), ck.w13.blocks.begin() + row * h / 2,
                           ck.w13.blocks.begin() + (row + 1) * h / 2);
          m->scales.insert(m->scales.end(), ck.w13.scales.begin() + row * h / 32,
                           ck.w13.scales.begin() + (row + 1) * h / 32);
        }
      }
      n += unpack_mismatches(w13, s13, d1, static_cast<int>(e), true, {&gate, &up}, {0, 0},
                             static_cast<int>(i), static_cast<int>(h), &w1);
    } else {
      n += unpack_mismatches(w13, s13, d1, static_cast<int>(e), true, {&ck.w1, &ck.w3},
                             {src * i, src * i}, static_cast<int>(i), static_cast<int>(h), &w1);
    }
    n += unpack_mismatches(w2, s2, d2, static_cast<int>(e), false, {&ck.w2}, {src * h},
                           static_cast<int>(h), static_cast<int>(i), &w2_where);
    bad[to_size(e)] = n;
    first_where[to_size(e)] = !w1.empty() ? "FC1 " + w1 : "FC2 " + w2_where;
  });
  int64_t total = 0;
  for (std::size_t e = 0; e < bad.size(); ++e) {
    if (bad[e] != 0 && where->empty()) *where = first_where[e];
    total += bad[e];
  }
  return total;
}

}  // namespace

TEST_CASE("moe repack: GPU round trip vs a CPU unpack, both checkpoint layouts", "[gpu][moe]") {
  gpu();
  TestStream stream;
  const uint64_t seed = fresh_seed();
  INFO("seed " << seed);
  std::mt19937_64 rng(seed);
  struct RepackCase {
    const char* what;
    int experts, hidden, inter;
    bool interleaved;
    bool stacked;  // separate layout: one stacked call, or one 3-D tensor per expert
    int first;     // checkpoint expert that becomes local expert 0 (a view into the stack)
  };
  const RepackCase cases[] = {
      {"gpt-oss H=I=2880", 3, 2880, 2880, true, true, 1},
      {"gpt-oss odd H=160 I=96 (K not a multiple of 64)", 5, 160, 96, true, true, 0},
      {"separate H=4096 I=512 stacked", 3, 4096, 512, false, true, 0},
      {"separate H=2880 I=2880 per expert", 2, 2880, 2880, false, false, 1},
      {"separate odd H=224 I=160 per expert", 4, 224, 160, false, false, 0},
  };
  for (const RepackCase& c : cases) {
    INFO(c.what);
    ModelShape shape = reference_shape(c.interleaved ? "gpt-oss-120b" : "qwen3-30b-a3b");
    shape.name = std::string("repack ") + c.what;
    shape.num_experts = c.experts;
    shape.global_experts = c.experts;
    shape.hidden = c.hidden;
    shape.intermediate = c.inter;
    shape.top_k = std::min(shape.top_k, c.experts);
    ModelShape stack = shape;  // the checkpoint holds `first` more experts than the rank
    stack.num_experts = c.experts + c.first;
    const Checkpoint ck = make_checkpoint(stack, c.interleaved, rng());
    const DeviceCheckpoint dck(ck);
    auto model = allocate_model(shape);
    // Poisoned destination: a byte the repack does not write shows up as a mismatch.
    for (const DeviceBuffer* b : {&model->w13, &model->w13_scales, &model->w2, &model->w2_scales}) {
      poison(*b, stream.get(), 0xA5);
    }
    const int bad_scales = dck.repack(*model, c.first, c.experts, 0, c.stacked, stream.get());
    CHECK(bad_scales == 0);
    std::string where;
    const int64_t mismatches = round_trip_mismatches(*model, ck, c.first, &where);
    INFO(where);
    CHECK(mismatches == 0);
    std::printf("moe repack %s: %d experts, %lld mismatches\n", c.what, c.experts,
                static_cast<long long>(mismatches));
  }
}

TEST_CASE("moe repack: scale bytes the kernels can't dequantize are counted", "[gpu][moe]") {
  gpu();
  TestStream stream;
  std::mt19937_64 rng(fresh_seed());
  ModelShape shape = reference_shape("qwen3-30b-a3b");
  shape.name = "repack bad scales";
  shape.num_experts = 2;
  shape.global_experts = 2;
  shape.hidden = 256;
  shape.intermediate = 128;
  Checkpoint ck = make_checkpoint(shape, false, rng());
  // 0xFF is NaN; below kScaleMin (2^-62) the bf16 factor would be subnormal or zero.
  ck.w1.scales[3] = 0xFF;
  ck.w3.scales[10] = 0;
  ck.w2.scales[7] = static_cast<uint8_t>(layout::kScaleMin - 1);
  ck.w2.scales[8] = static_cast<uint8_t>(layout::kScaleMin);  // the smallest exact one
  const DeviceCheckpoint dck(ck);
  auto model = allocate_model(shape);
  CHECK(dck.repack(*model, 0, 2, 0, true, stream.get()) == 3);
}

namespace {

// Route id sets: random (with -1 and other ranks' ids) and adversarial ones.
std::vector<std::pair<std::string, std::vector<int32_t>>> route_id_cases(const ModelShape& s,
                                                                         int tokens,
                                                                         std::mt19937_64& rng,
                                                                         bool adversarial) {
  const int64_t n = static_cast<int64_t>(tokens) * s.top_k;
  const int32_t lo = s.expert_offset;
  const int32_t e = s.num_experts;
  std::vector<std::pair<std::string, std::vector<int32_t>>> cases;
  {
    // Distinct ids per token over every rank's experts, 5% dropped.
    const int global = std::max(s.global_experts, lo + e);
    std::vector<int32_t> ids(to_size(n));
    std::uniform_int_distribution<int32_t> pick(0, global - 1);
    std::bernoulli_distribution drop(0.05);
    for (int t = 0; t < tokens; ++t) {
      int32_t* row = ids.data() + static_cast<int64_t>(t) * s.top_k;
      for (int j = 0; j < s.top_k; ++j) {
        int32_t id = 0;
        do {
          id = pick(rng);
        } while (std::find(row, row + j, id) != row + j);
        row[j] = id;
      }
      for (int j = 0; j < s.top_k; ++j) {
        if (drop(rng)) row[j] = -1;
      }
    }
    cases.emplace_back("random", std::move(ids));
  }
  if (!adversarial) return cases;
  cases.emplace_back("all -1", std::vector<int32_t>(to_size(n), -1));
  cases.emplace_back("all on one expert", std::vector<int32_t>(to_size(n), lo + e / 2));
  cases.emplace_back("all on another rank", std::vector<int32_t>(to_size(n), lo + e));
  cases.emplace_back("all on the last local expert", std::vector<int32_t>(to_size(n), lo + e - 1));
  const int32_t pool[] = {INT32_MIN, INT32_MAX, -1, lo - 1, lo, lo + e - 1, lo + e, -7};
  std::vector<int32_t> extremes(to_size(n));
  for (int64_t j = 0; j < n; ++j) extremes[to_size(j)] = pool[(j * 7 + j / 3) % 8];
  cases.emplace_back("extremes", std::move(extremes));
  std::vector<int32_t> ragged;
  for (int32_t x = 0; static_cast<int64_t>(ragged.size()) < n; x = (x + 1) % e) {
    for (int32_t j = 0; j <= x % 37 && static_cast<int64_t>(ragged.size()) < n; ++j) {
      ragged.push_back(lo + x);
    }
  }
  cases.emplace_back("ragged", std::move(ragged));
  // One expert with most entries, every other nonempty expert with one: max_blocks is reached.
  std::vector<int32_t> tight(to_size(n), lo);
  for (int64_t x = 1; x < e && x * 3 < n; ++x) tight[to_size(x * 3)] = lo + static_cast<int32_t>(x);
  cases.emplace_back("max blocks", std::move(tight));
  return cases;
}

}  // namespace

TEST_CASE("moe route: workspace route arrays equal the CPU route model bitwise", "[gpu][moe]") {
  gpu();
  TestStream stream;
  const uint64_t seed = fresh_seed();
  INFO("seed " << seed);
  std::mt19937_64 rng(seed);
  const char* names[] = {"gpt-oss-120b",
                         "gpt-oss-20b",
                         "kimi-k3.1-tp8",
                         "kimi-k3.1-tp4-ep2",
                         "kimi-k3.1-tp4-ep2-rank1",
                         "deepseek-v4-flash-tp4",
                         "deepseek-v4.1-flash-tp4",
                         "qwen3-30b-a3b",
                         "qwen2-57b-a14b"};
  const int token_counts[] = {1, 7, 48, 256, 1000, 4096};
  std::vector<ModelShape> shapes;
  for (const char* name : names) {
    ModelShape s = reference_shape(name);
    s.max_tokens = 4096;
    shapes.push_back(s);
  }
  prewarm(shapes);
  int checked = 0;
  for (const ModelShape& shape : shapes) {
    // Real expert counts; weights zero (nibbles 0, scales 2^0, biases 0): only the route arrays
    // are compared here.
    auto model = allocate_model(shape);
    for (const DeviceBuffer* b : {&model->w13, &model->w2, &model->b13, &model->b2}) {
      poison(*b, stream.get(), 0);
    }
    poison(model->w13_scales, stream.get(), layout::kPadScale);
    poison(model->w2_scales, stream.get(), layout::kPadScale);
    for (int tokens : token_counts) {
      const moejit::detail::MoeForwardConfig config =
          moejit::detail::choose_moe_config(shape, tokens);
      const moejit::detail::MoeWorkspaceLayout ws =
          moejit::detail::moe_workspace_layout(shape, config);
      const int block = config.route.block_m;
      // Hidden states of zero and equal top-k weights: only the ids matter here.
      Tokens tk;
      tk.count = tokens;
      tk.top_k = shape.top_k;
      tk.hidden_bits.assign(to_size(static_cast<int64_t>(tokens) * shape.hidden), 0);
      tk.weights.assign(to_size(static_cast<int64_t>(tokens) * shape.top_k),
                        1.0f / static_cast<float>(shape.top_k));
      for (auto& [label, ids] : route_id_cases(shape, tokens, rng, tokens <= 1000)) {
        INFO(shape.name << " T=" << tokens << " B=" << block << " ("
                        << (config.route_single ? "one launch" : "three launches") << ") "
                        << label);
        tk.ids.assign(ids.begin(), ids.end());
        ForwardIo io(shape, tk, moejit::moe_workspace_bytes(shape, tokens));
        const moejit::detail::RouteReference ref = moejit::detail::route_reference(
            ids, tokens, shape.top_k, shape.num_experts, shape.expert_offset, block);
        REQUIRE(ref.max_blocks == ws.max_blocks);
        std::vector<int32_t> first_rows;
        for (int run = 0; run < 3; ++run) {
          INFO("run " << run);
          poison(io.workspace, stream.get(), 0xA5);
          poison(io.out, stream.get());
          moejit::moe_forward(shape, io.args(*model), stream.get());
          stream.sync();
          const std::size_t e = to_size(shape.num_experts);
          CHECK(download_at<int32_t>(io.workspace, ws.expert_counts, e) == ref.expert_counts);
          CHECK(download_at<int32_t>(io.workspace, ws.expert_block_offset, e + 1) ==
                ref.expert_block_offset);
          CHECK(download_at<int32_t>(io.workspace, ws.total_blocks, 1) ==
                std::vector<int32_t>{ref.total_blocks});
          CHECK(download_at<int32_t>(io.workspace, ws.block_expert, to_size(ref.max_blocks)) ==
                ref.block_expert);
          CHECK(download_at<int32_t>(io.workspace, ws.slot_row, ids.size()) == ref.slot_row);
          const std::vector<int32_t> rows =
              download_at<int32_t>(io.workspace, ws.sorted_rows, ref.sorted_rows.size());
          CHECK(rows == ref.sorted_rows);
          if (run == 0) first_rows = rows;
          CHECK(rows == first_rows);
          // Zero weights and biases: every output is +0 or -0, never the poison.
          for (uint16_t bits : io.output()) {
            if ((bits & 0x7FFF) != 0) {
              FAIL_CHECK("output " << bits << " is not a zero");
              break;
            }
          }
        }
        ++checked;
      }
    }
  }
  std::printf("moe route: %d id sets checked bitwise (3 runs each)\n", checked);
}
