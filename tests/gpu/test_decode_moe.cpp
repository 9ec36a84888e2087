// decode_moe (family 4, the fused small-T layer) through the library: moe_forward with
// MoeForwardOptions{kDecode, 8, 16 or 32} (the persistent tile) and, at T <= 2, {kDecode, 0} (the
// two-launch pair the planner picks there) on every reference shape decode_moe serves, at its
// real expert count, T in {1, 2, 7, 48, 96, 256}, against the fp64 CPU reference
// (src/ops/moe_reference);
// the same bits over 3 runs and from a CUDA-graph replay; forced marlin_moe within tolerance of
// it; block_n 0 equal to the planner's block_n, and the automatic path equal to the path the
// library picks (decode_moe at the planner's tile for the T detail::decode_by_default names,
// else marlin_moe), bit for bit; expert parallelism (two ranks' halves sum to the whole layer);
// the gpt-oss shapes refused with their rule and served by marlin_moe; T = 0, tokens and calls
// with no local expert, the workspace contract, bad options and capture misses.
//
// Activations: SiTU(4, 25) (Kimi-K3), SwiGLU clamped at 10 (DeepSeek-V4) and SwiGLU (Qwen) come
// with the shapes. gpt-oss's activation exists only on the gpt-oss shapes, which decode_moe
// refuses (hidden = 2880 is not a multiple of 256, and they have biases): it is marlin_moe's
// alone, and the refusal test below runs it there.
//
// Real expert counts, few distinct weights: decode_moe's kernel is specialized on E (route
// scratch, virtual-expert bound, workspace), so each shape runs with its real E and ids spread
// over all of them, as a serving engine sees them. The fp64 reference holds 24·H·I bytes per
// expert, so the E local experts are copies of a few random checkpoint experts ("sources",
// 16..48 per shape; local expert e holds source[e], a random map), and the reference maps each
// local id to its source. A misrouted slot still shows: it lands on another source with
// probability 1 - 1/sources per slot, and one lost slot of k = 16 costs ~0.25 of a token's norm.
//
// Tolerance: gpu/moe_support.hpp argues 1e-2 relative L2 (2e-2 per token) for marlin_moe
// (~2.8e-3 expected); decode_moe rounds at the same three points (FC1's activation output and
// the weighted FC2 rows stored as bf16, the layer output rounded once), so the same bounds hold.
// decode vs marlin: their difference is at most the sum of both errors (~5.1e-3, about 2x under
// 1e-2), so 1e-2 again.
//
// Reference cost: T·k·3·H·I multiply-adds per shape and T, on every core; at T = 96 and 256 the
// three heaviest shapes check 48 or 64 sampled tokens (every token is still checked for NaN and
// the poison).
//
// Each case prints "decode_moe <shape> T=<T> bn=<block_n> relL2=<x> ..." and a line with the
// decode vs marlin figure.
#include <cuda.h>
#include <dlpack/dlpack.h>

#include <algorithm>
#include <catch2/catch.hpp>
#include <climits>
#include <cstdint>
#include <cstdio>
#include <initializer_list>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "gpu/gpu_support.hpp"
#include "gpu/moe_support.hpp"
#include "moejit/error.hpp"
#include "moejit/kernel_spec.hpp"
#include "moejit/moe.hpp"
#include "moejit/moejit.h"
#include "moejit/runtime.hpp"
#include "ops/moe_reference.hpp"
#include "plan/moe_plan.hpp"
#include "runtime/runtime_impl.hpp"

namespace {

using namespace moejit::test;  // the shared MoE test helpers (gpu/moe_support.hpp)
using moejit::DType;
using moejit::Error;
using moejit::ErrorCode;
using moejit::KernelSpec;
using moejit::ModelShape;
using moejit::MoeForwardOptions;
using moejit::MoePath;
namespace detail = moejit::detail;

constexpr int kBlockNs[] = {8, 16, 32};
// T = 1 and 2 also run the two-launch pair (the planner's choice there; T buckets 1 and 2).
constexpr int kSweepTokens[] = {1, 2, 7, 48, 96, 256};

MoeForwardOptions forced_decode(int block_n) {
  return MoeForwardOptions{MoePath::kDecode, block_n};
}

bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

moejit::Arch device_arch() { return detail::Runtime::instance().current_arch(); }

// ---- kernels ------------------------------------------------------------------------------------

// Every kernel the decode tests launch on `shapes`: prewarm's list (the planner's decode tile for
// each run of T and the marlin chain), plus decode_moe with each forced block_n at every T of
// `tokens` (prewarm builds only the planner's block_n), so graph capture finds them all.
void build_decode_kernels(const std::vector<ModelShape>& shapes, const std::vector<int>& tokens) {
  const moejit::Arch arch = device_arch();
  std::vector<KernelSpec> forced;
  for (const ModelShape& shape : shapes) {
    for (int t : tokens) {
      for (int block_n : kBlockNs) {
        const moejit::MoeDecodeParams main = detail::choose_decode_config(shape, t, block_n);
        forced.push_back(detail::decode_moe_spec(detail::decode_reset_params(main), arch));
        forced.push_back(detail::decode_moe_spec(main, arch));
        forced.push_back(detail::decode_moe_spec(detail::decode_combine_params(main), arch));
      }
    }
  }
  build_kernels(shapes, true, forced);
}

// ---- models: E local experts over a few checkpoint experts --------------------------------------

// A random map of `experts` local experts onto `sources` checkpoint experts, each source used at
// least once.
std::vector<int> random_sources(int experts, int sources, std::mt19937_64& rng) {
  std::vector<int> map(to_size(experts));
  std::uniform_int_distribution<int> pick(0, sources - 1);
  for (int e = 0; e < experts; ++e) map[to_size(e)] = e < sources ? e : pick(rng);
  std::shuffle(map.begin(), map.end(), rng);
  return map;
}

// The host checkpoint of `sources` experts with `shape`'s sizes and layout.
Checkpoint source_checkpoint(const ModelShape& shape, int sources, uint64_t seed) {
  ModelShape s = shape;
  s.num_experts = sources;
  return make_checkpoint(s, uses_gpt_oss_layout(shape), seed);
}

// `shape`'s local experts on the device, expert e repacked from checkpoint expert source[e].
std::unique_ptr<DeviceModel> mapped_model(const ModelShape& shape, const DeviceCheckpoint& ck,
                                          const std::vector<int>& source, CUstream stream) {
  REQUIRE(static_cast<int>(source.size()) == shape.num_experts);
  auto model = allocate_model(shape);
  int bad = 0;
  for (int e = 0; e < shape.num_experts; ++e) {
    bad += ck.repack(*model, source[to_size(e)], 1, e, true, stream);
  }
  INFO("repack of " << shape.name << " counted " << bad << " scale bytes out of range");
  REQUIRE(bad == 0);
  return model;
}

// `tk` as the fp64 reference of a mapped model takes it: a local id names its source expert
// (reference expert_offset 0), every other id is -1.
Tokens reference_tokens(const Tokens& tk, const ModelShape& shape, const std::vector<int>& source) {
  Tokens r = tk;
  const int64_t lo = shape.expert_offset;
  const int64_t hi = lo + shape.num_experts;
  for (int64_t& id : r.ids) id = id >= lo && id < hi ? source[to_size(id - lo)] : -1;
  return r;
}

detail::MoeLayerOptions mapped_options(const ModelShape& shape) {
  detail::MoeLayerOptions o;
  o.activation = shape.activation;
  o.expert_offset = 0;
  return o;
}

// ---- tokens -------------------------------------------------------------------------------------

// Ids no local expert has: other ranks' experts (above the rank's range, and below it when it
// has an offset), -2, the int32 extremes; with int64 ids also values beyond int32 whose low 32
// bits name a local expert (a kernel that truncates them would route them).
std::vector<int64_t> foreign_ids(const ModelShape& shape) {
  const int64_t lo = shape.expert_offset;
  const int64_t e = shape.num_experts;
  std::vector<int64_t> ids = {lo + e, lo + e + e / 2, lo + 2 * e - 1, -2, INT32_MAX, INT32_MIN};
  if (lo > 0) {
    ids.push_back(lo - 1);
    ids.push_back(0);
  }
  if (shape.id_dtype == DType::kI64) {
    const int64_t wrap = int64_t{1} << 32;
    ids.insert(ids.end(), {wrap + lo, wrap + lo + 5, -wrap + lo + 3, int64_t{INT32_MAX} + 1,
                           int64_t{INT32_MIN} - 1, std::numeric_limits<int64_t>::min(),
                           std::numeric_limits<int64_t>::max()});
  }
  return ids;
}

// T tokens for `shape`: k distinct local ids per token, uniform over all E local experts, each
// slot -1 with chance 5% and a foreign id with chance 5%; when T > 1, tokens 3, 8, 13, ... have
// every slot -1 and tokens 4, 9, 14, ... only foreign ids (no local expert: their output is +0).
Tokens decode_tokens(const ModelShape& shape, int count, std::mt19937_64& rng) {
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
  const std::vector<int64_t> foreign = foreign_ids(shape);
  std::uniform_int_distribution<int64_t> local(shape.expert_offset,
                                               shape.expert_offset + shape.num_experts - 1);
  std::uniform_int_distribution<std::size_t> pick_foreign(0, foreign.size() - 1);
  std::uniform_real_distribution<double> unit(0.0, 1.0);
  tk.ids.resize(to_size(static_cast<int64_t>(count) * k));
  tk.weights.resize(tk.ids.size());
  for (int t = 0; t < count; ++t) {
    int64_t* row = tk.ids.data() + static_cast<int64_t>(t) * k;
    const bool all_dropped = count > 1 && t % 5 == 3;
    const bool all_foreign = count > 1 && t % 5 == 4;
    for (int s = 0; s < k; ++s) {
      int64_t id = 0;
      do {
        id = local(rng);
      } while (std::find(row, row + s, id) != row + s);
      row[s] = id;
    }
    double sum = 0;
    for (int s = 0; s < k; ++s) {
      const double u = unit(rng);
      if (all_dropped || (!all_foreign && u < 0.05)) {
        row[s] = -1;
      } else if (all_foreign || u < 0.10) {
        row[s] = foreign[pick_foreign(rng)];
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

// Whether every element is +0 (the bits of a token with no local expert).
bool all_plus_zero(const std::vector<uint16_t>& bits, std::size_t begin, std::size_t end) {
  return std::all_of(bits.begin() + static_cast<std::ptrdiff_t>(begin),
                     bits.begin() + static_cast<std::ptrdiff_t>(end),
                     [](uint16_t b) { return b == 0; });
}

// ---- the device ---------------------------------------------------------------------------------

// decode_moe needs sm_90 or newer. On an older device a forced decode call must be refused
// (checked here, then the caller has nothing else to test); true on sm_90 and newer.
bool decode_runs_here(CUstream stream) {
  const moejit::Arch arch = device_arch();
  if (arch.sm >= 90) return true;
  WARN("decode_moe needs sm_90 or newer; this device is " << arch.name()
                                                          << ": only the refusal is checked");
  ModelShape shape = reference_shape("qwen3-30b-a3b");
  shape.max_tokens = 256;
  const auto model = allocate_model(shape);
  MOEJIT_TEST_SEEDED_RNG(seed, rng);
  const Tokens tk = decode_tokens(shape, 7, rng);
  ForwardIo io(shape, tk, moejit::moe_workspace_bytes(shape, 7));
  const std::string message =
      expect_refused(io, io.args(*model), stream, forced_decode(0), ErrorCode::kUnsupported);
  CHECK(contains(message, "sm_90"));
  return false;
}

// ---- the sweep ----------------------------------------------------------------------------------

struct DecodeCase {
  const char* name;  // a shape of tools/shapes/reference.json that decode_moe serves
  int sources;       // distinct checkpoint experts behind the real E (fp64 memory: 24·H·I each)
  DType ids;         // topk_ids dtype of the run
  int checked;       // tokens checked against the reference when T is larger (0: all)
};

// Every reference shape decode_moe serves (kimi-k3.1-tp4-ep2-rank1 runs in the EP test).
constexpr DecodeCase kCases[] = {
    {"kimi-k3.1-tp8", 48, DType::kI32, 64},           // SiTU, E = 896, k = 16, I = 384
    {"kimi-k3.1-tp4-ep2", 32, DType::kI32, 48},       // SiTU, E = 448 of 896, I = 768
    {"deepseek-v4-flash-tp4", 32, DType::kI64, 0},    // SwiGLU limit 10, E = 256, k = 6
    {"deepseek-v4.1-flash-tp4", 32, DType::kI32, 0},  // SwiGLU limit 10, E = 384, k = 6
    {"qwen3-30b-a3b", 32, DType::kI64, 0},            // SwiGLU, E = 128, k = 8, H = 2048
    {"qwen2-57b-a14b", 16, DType::kI32, 48},          // SwiGLU, E = 64, k = 8, I = 2560
};

ModelShape case_shape(const DecodeCase& c) {
  ModelShape s = reference_shape(c.name);
  s.id_dtype = c.ids;
  s.max_tokens = 256;
  return s;
}

std::string describe(const ModelShape& s, int sources) {
  std::string text = "(E=" + std::to_string(s.num_experts) + " over " + std::to_string(sources) +
                     " sources, k=" + std::to_string(s.top_k) + ", H=" + std::to_string(s.hidden) +
                     ", I=" + std::to_string(s.intermediate) + ", " +
                     moejit::activation_kind_name(s.activation.kind) + ", " +
                     moejit::dtype_name(s.id_dtype) + " ids";
  if (s.expert_offset != 0 || s.global_experts > s.num_experts) {
    text += ", experts " + std::to_string(s.expert_offset) + ".." +
            std::to_string(s.expert_offset + s.num_experts - 1) + " of " +
            std::to_string(s.global_experts);
  }
  return text + ")";
}

}  // namespace

TEST_CASE("decode_moe: served reference shapes x T x block_n vs the fp64 reference",
          "[gpu][moe][decode]") {
  gpu();
  TestStream stream;
  if (!decode_runs_here(stream.get())) return;
  std::vector<ModelShape> shapes;
  for (const DecodeCase& c : kCases) shapes.push_back(case_shape(c));
  build_decode_kernels(shapes, std::vector<int>(std::begin(kSweepTokens), std::end(kSweepTokens)));
  MOEJIT_TEST_SEEDED_RNG(seed, rng);
  std::printf("decode_moe sweep: seed %llu, reference on %u threads\n",
              static_cast<unsigned long long>(seed), worker_count());
  for (std::size_t n = 0; n < shapes.size(); ++n) {
    const DecodeCase& c = kCases[n];
    const ModelShape& shape = shapes[n];
    INFO(c.name << " " << describe(shape, c.sources));
    {
      const std::string problem = moejit::moe_decode_problem(shape);
      INFO(problem);
      REQUIRE(problem.empty());
    }
    const Checkpoint ck = source_checkpoint(shape, c.sources, rng());
    const std::vector<int> source = random_sources(shape.num_experts, c.sources, rng);
    std::unique_ptr<DeviceModel> model;
    {
      const DeviceCheckpoint dck(ck);
      model = mapped_model(shape, dck, source, stream.get());
    }
    const MoeWeightsF64 f64 = dequantize(ck, 0, c.sources);
    std::printf("decode_moe shape %s %s\n", c.name, describe(shape, c.sources).c_str());
    for (int tokens : kSweepTokens) {
      const Tokens tk = decode_tokens(shape, tokens, rng);
      ForwardIo io(shape, tk, moejit::moe_workspace_bytes(shape, tokens));
      const std::vector<int> which = c.checked > 0 && tokens > c.checked
                                         ? sampled_tokens(tokens, c.checked)
                                         : all_tokens(tokens);
      const std::vector<double> ref =
          reference_layer(f64, reference_tokens(tk, shape, source), which, mapped_options(shape));
      const std::string base = std::string(c.name) + " T=" + std::to_string(tokens);
      INFO(base);

      const std::vector<uint16_t> marlin = io.run(*model, stream.get(), kMarlin);
      CHECK(count_nonfinite(marlin) == 0);
      check_score(std::string(c.name) + "[forced-marlin] T=" + std::to_string(tokens),
                  score(marlin, ref, which, shape.hidden), which.size(), tokens, "decode_moe");

      // One decode variant: three eager runs (each on a NaN-poisoned output and an 0xFF
      // workspace), every element written and finite, the checked tokens against the reference,
      // two graph replays equal to the eager run, and forced marlin within tolerance.
      const auto check_variant = [&](const std::string& label, const MoeForwardOptions& options) {
        INFO(label);
        const std::vector<uint16_t> first = io.run(*model, stream.get(), options);
        bool repeat = true;
        for (int again = 1; again < 3; ++again) {
          repeat = same_bits(io.run(*model, stream.get(), options), first) && repeat;
        }
        CHECK(count_nonfinite(first) == 0);
        check_score(label, score(first, ref, which, shape.hidden), which.size(), tokens,
                    "decode_moe");
        {
          INFO("3 runs bitwise identical");
          CHECK(repeat);
        }
        const std::vector<std::vector<uint16_t>> replays =
            io.graph_replays(*model, stream.get(), options, 2);
        for (std::size_t r = 0; r < replays.size(); ++r) {
          INFO("graph replay " << r << " bitwise identical to the eager run");
          CHECK(same_bits(replays[r], first));
        }
        const double vs_marlin = rel_l2(values_of(first), values_of(marlin));
        std::printf("decode_moe %s vs forced marlin relL2=%s\n", label.c_str(),
                    fmt(vs_marlin).c_str());
        CHECK(vs_marlin <= kRelL2Tolerance);
        return first;
      };

      // The persistent tile at every block_n (forced).
      const int planner_block_n = detail::choose_decode_config(shape, tokens, 0).block_n;
      INFO("planner's block_n " << planner_block_n);
      std::vector<uint16_t> planner_out;
      for (int block_n : kBlockNs) {
        const std::vector<uint16_t> out =
            check_variant(base + " bn=" + std::to_string(block_n), forced_decode(block_n));
        if (block_n == planner_block_n) planner_out = out;
      }
      REQUIRE(!planner_out.empty());
      // block_n 0 is the planner's choice: the two-launch pair where it picks that (T <= 2 on
      // the shapes it serves), else the persistent tile at the planner's block_n.
      const detail::MoeForwardConfig config = detail::choose_moe_config(shape, tokens);
      std::vector<uint16_t> default_out = planner_out;
      if (config.decode_pair) {
        default_out = check_variant(base + " pair", forced_decode(0));
      } else {
        CHECK(same_bits(io.run(*model, stream.get(), forced_decode(0)), planner_out));
      }
      // The automatic path is the one the library picks.
      const bool auto_decode = auto_takes_decode(shape, tokens);
      INFO("the automatic path takes " << (auto_decode ? "decode_moe" : "marlin_moe"));
      CHECK(same_bits(io.run(*model, stream.get(), kAuto), auto_decode ? default_out : marlin));
    }
  }
}

TEST_CASE("decode_moe: EP halves (expert_offset 0 and E/2) sum to the whole layer",
          "[gpu][moe][decode]") {
  gpu();
  TestStream stream;
  if (!decode_runs_here(stream.get())) return;
  // The two real ranks of kimi-k3.1-tp4-ep2 (448 experts each) and the whole layer they split
  // (896 experts at offset 0), each with its own repack of its experts.
  ModelShape half0 = reference_shape("kimi-k3.1-tp4-ep2");
  ModelShape half1 = reference_shape("kimi-k3.1-tp4-ep2-rank1");
  half0.max_tokens = half1.max_tokens = 256;
  REQUIRE(half0.expert_offset == 0);
  REQUIRE(half1.expert_offset == half0.num_experts);
  const int experts = half0.num_experts + half1.num_experts;
  const ModelShape whole = resized(half0, experts, 0, experts, 256);
  for (const ModelShape* s : std::initializer_list<const ModelShape*>{&whole, &half0, &half1}) {
    const std::string problem = moejit::moe_decode_problem(*s);
    INFO(s->name << ": " << problem);
    REQUIRE(problem.empty());
  }
  // T = 2 also runs the two-launch pair (block_n 0 there: the planner's choice).
  const std::vector<int> token_counts = {2, 7, 256};
  build_decode_kernels({whole, half0, half1}, token_counts);
  MOEJIT_TEST_SEEDED_RNG(seed, rng);
  const int sources = 32;
  const Checkpoint ck = source_checkpoint(whole, sources, rng());
  const std::vector<int> source = random_sources(experts, sources, rng);
  const std::vector<int> source0(source.begin(), source.begin() + half0.num_experts);
  const std::vector<int> source1(source.begin() + half0.num_experts, source.end());
  std::unique_ptr<DeviceModel> m_whole, m_half0, m_half1;
  {
    const DeviceCheckpoint dck(ck);
    m_whole = mapped_model(whole, dck, source, stream.get());
    m_half0 = mapped_model(half0, dck, source0, stream.get());
    m_half1 = mapped_model(half1, dck, source1, stream.get());
  }
  const MoeWeightsF64 f64 = dequantize(ck, 0, sources);
  const int h = whole.hidden;
  for (int tokens : token_counts) {
    const Tokens tk = decode_tokens(whole, tokens, rng);
    ForwardIo io_whole(whole, tk, moejit::moe_workspace_bytes(whole, tokens));
    ForwardIo io0(half0, tk, moejit::moe_workspace_bytes(half0, tokens));
    ForwardIo io1(half1, tk, moejit::moe_workspace_bytes(half1, tokens));
    const std::vector<int> which = tokens > 48 ? sampled_tokens(tokens, 48) : all_tokens(tokens);
    const std::vector<double> ref =
        reference_layer(f64, reference_tokens(tk, whole, source), which, mapped_options(whole));
    std::vector<int> block_ns(std::begin(kBlockNs), std::end(kBlockNs));
    if (tokens <= detail::kDecodePairMaxTokens) {
      for (const ModelShape* s : std::initializer_list<const ModelShape*>{&whole, &half0, &half1}) {
        REQUIRE(detail::choose_moe_config(*s, tokens).decode_pair);
      }
      block_ns.push_back(0);
    }
    for (int block_n : block_ns) {
      const MoeForwardOptions options = forced_decode(block_n);
      INFO("T=" << tokens << " bn=" << block_n << (block_n == 0 ? " (the pair)" : ""));
      const std::vector<uint16_t> bits_whole = io_whole.run(*m_whole, stream.get(), options);
      const std::vector<uint16_t> bits0 = io0.run(*m_half0, stream.get(), options);
      const std::vector<uint16_t> bits1 = io1.run(*m_half1, stream.get(), options);
      CHECK(count_nonfinite(bits_whole) == 0);
      CHECK(count_nonfinite(bits0) == 0);
      CHECK(count_nonfinite(bits1) == 0);
      const std::vector<double> full = values_of(bits_whole);
      const std::vector<double> part0 = values_of(bits0);
      const std::vector<double> part1 = values_of(bits1);
      std::vector<double> sum(full.size());
      for (std::size_t j = 0; j < sum.size(); ++j) sum[j] = part0[j] + part1[j];
      const double halves_vs_whole = rel_l2(sum, full);
      const double halves_vs_ref = rel_l2(rows_of(sum, which, h), ref);
      const double whole_vs_ref = rel_l2(rows_of(full, which, h), ref);
      std::printf(
          "decode_moe kimi-k3.1-tp4-ep2 EP halves T=%d bn=%d relL2=%s (halves vs whole layer %s, "
          "whole vs reference %s; %zu of %d tokens vs the reference)\n",
          tokens, block_n, fmt(halves_vs_ref).c_str(), fmt(halves_vs_whole).c_str(),
          fmt(whole_vs_ref).c_str(), which.size(), tokens);
      CHECK(halves_vs_whole <= kRelL2Tolerance);
      CHECK(halves_vs_ref <= kRelL2Tolerance);
      CHECK(whole_vs_ref <= kRelL2Tolerance);
      // Each half alone is far from the whole (so the sum is not trivially equal).
      CHECK(rel_l2(part0, full) > 0.1);
      CHECK(rel_l2(part1, full) > 0.1);
    }
  }
}

TEST_CASE("decode_moe: gpt-oss shapes are refused with their rule and served by marlin_moe",
          "[gpu][moe][decode]") {
  gpu();
  TestStream stream;
  for (const char* name : {"gpt-oss-120b", "gpt-oss-20b"}) {
    const std::string problem = moejit::moe_decode_problem(reference_shape(name));
    INFO(name << ": " << problem);
    CHECK(contains(problem, "hidden = 2880 is not a multiple of 256"));
    CHECK(contains(problem, "bias"));
    CHECK(contains(problem, "marlin_moe"));
  }
  ModelShape shape = reference_shape("gpt-oss-120b");
  shape.max_tokens = 256;
  prewarm_shapes({shape});
  MOEJIT_TEST_SEEDED_RNG(seed, rng);
  const int sources = 8;
  const Checkpoint ck = source_checkpoint(shape, sources, rng());
  const std::vector<int> source = random_sources(shape.num_experts, sources, rng);
  std::unique_ptr<DeviceModel> model;
  {
    const DeviceCheckpoint dck(ck);
    model = mapped_model(shape, dck, source, stream.get());
  }
  const MoeWeightsF64 f64 = dequantize(ck, 0, sources);
  for (int tokens : {0, 1, 7, 256}) {
    INFO("gpt-oss-120b T=" << tokens);
    const Tokens tk = decode_tokens(shape, tokens, rng);
    ForwardIo io(shape, tk, moejit::moe_workspace_bytes(shape, tokens));
    // Forced decode is refused before anything runs, whatever T and block_n, naming the rule.
    for (int block_n : {0, 8, 16, 32}) {
      INFO("forced decode, block_n " << block_n);
      const std::string message = expect_refused(io, io.args(*model), stream.get(),
                                                 forced_decode(block_n), ErrorCode::kUnsupported);
      CHECK(contains(message, "hidden = 2880 is not a multiple of 256"));
    }
    if (tokens == 0) continue;
    // The automatic path is marlin_moe: the same bits as forcing it, 3 runs alike, and the layer
    // (biases and the gpt-oss activation) within tolerance of the reference.
    const std::vector<uint16_t> automatic = io.run(*model, stream.get(), kAuto);
    const std::vector<uint16_t> marlin = io.run(*model, stream.get(), kMarlin);
    CHECK(same_bits(automatic, marlin));
    CHECK(same_bits(io.run(*model, stream.get(), kAuto), automatic));
    CHECK(count_nonfinite(automatic) == 0);
    const std::vector<int> which = tokens > 32 ? sampled_tokens(tokens, 32) : all_tokens(tokens);
    const std::vector<double> ref =
        reference_layer(f64, reference_tokens(tk, shape, source), which, mapped_options(shape));
    check_score("gpt-oss-120b (refused by decode_moe, automatic path) T=" + std::to_string(tokens),
                score(automatic, ref, which, shape.hidden), which.size(), tokens, "decode_moe");
  }
}

TEST_CASE("decode_moe: no local expert, T = 0, the workspace contract and bad options",
          "[gpu][moe][decode]") {
  gpu();
  TestStream stream;
  if (!decode_runs_here(stream.get())) return;
  // int64 ids on qwen3 (E = 128), int32 on deepseek-v4.1 (E = 384); max_tokens above 256 so
  // T = 257 can be asked for.
  ModelShape qwen = reference_shape("qwen3-30b-a3b");
  qwen.id_dtype = DType::kI64;
  ModelShape deepseek = reference_shape("deepseek-v4.1-flash-tp4");
  std::vector<ModelShape> shapes = {qwen, deepseek};
  for (ModelShape& s : shapes) s.max_tokens = 300;
  build_decode_kernels(shapes, {1, 2, 7, 48, 256});
  MOEJIT_TEST_SEEDED_RNG(seed, rng);
  const std::vector<MoeForwardOptions> decode_paths = {forced_decode(0), forced_decode(8),
                                                       forced_decode(16), forced_decode(32)};
  for (const ModelShape& shape : shapes) {
    INFO(shape.name << " (" << moejit::dtype_name(shape.id_dtype) << " ids)");
    const int sources = 8;
    const Checkpoint ck = source_checkpoint(shape, sources, rng());
    const std::vector<int> source = random_sources(shape.num_experts, sources, rng);
    std::unique_ptr<DeviceModel> model;
    {
      const DeviceCheckpoint dck(ck);
      model = mapped_model(shape, dck, source, stream.get());
    }
    const MoeWeightsF64 f64 = dequantize(ck, 0, sources);
    const std::size_t h = to_size(shape.hidden);

    {  // T = 0 launches nothing
      // The workspace every launch writes first (decode_moe's reset zeroes its counters, the
      // marlin chain's route its counts) stays the poison.
      const Tokens none = decode_tokens(shape, 0, rng);
      ForwardIo io(shape, none, moejit::moe_workspace_bytes(shape, 256));
      for (const MoeForwardOptions& options :
           {forced_decode(0), forced_decode(8), forced_decode(16), forced_decode(32), kAuto,
            kMarlin}) {
        poison(io.workspace, stream.get(), 0xA5);
        moejit::moe_forward(shape, io.args(*model), stream.get(), options);
        stream.sync();
        const std::vector<uint8_t> ws = download_at<uint8_t>(io.workspace, 0, io.workspace_bytes);
        CHECK(std::count(ws.begin(), ws.end(), uint8_t{0xA5}) ==
              static_cast<std::ptrdiff_t>(ws.size()));
      }
    }

    {  // no token with a local expert: every element +0 (decode_moe's empty layer)
      for (int tokens : {1, 7, 256}) {
        for (bool foreign : {false, true}) {
          INFO("T=" << tokens << ", every id " << (foreign ? "another rank's" : "-1"));
          Tokens tk = decode_tokens(shape, tokens, rng);
          const std::vector<int64_t> others = foreign_ids(shape);
          for (std::size_t j = 0; j < tk.ids.size(); ++j) {
            tk.ids[j] = foreign ? others[j % others.size()] : -1;
          }
          ForwardIo io(shape, tk, moejit::moe_workspace_bytes(shape, tokens));
          for (const MoeForwardOptions& options : decode_paths) {
            INFO("block_n " << options.decode_block_n);
            const std::vector<uint16_t> out = io.run(*model, stream.get(), options);
            CHECK(all_plus_zero(out, 0, out.size()));
          }
          for (const MoeForwardOptions& options : {kMarlin, kAuto}) {
            INFO("path " << path_name(options.path));
            const std::vector<uint16_t> out = io.run(*model, stream.get(), options);
            CHECK(all_plus_zero(out, 0, out.size()));
          }
        }
      }
    }

    {  // a token whose ids are all -1 gets +0 beside one with experts
      Tokens tk = decode_tokens(shape, 2, rng);
      for (int s = 0; s < shape.top_k; ++s) tk.ids[to_size(shape.top_k + s)] = -1;
      ForwardIo io(shape, tk, moejit::moe_workspace_bytes(shape, 2));
      const std::vector<int> which = all_tokens(2);
      const std::vector<double> ref =
          reference_layer(f64, reference_tokens(tk, shape, source), which, mapped_options(shape));
      for (const MoeForwardOptions& options : decode_paths) {
        INFO("block_n " << options.decode_block_n);
        const std::vector<uint16_t> out = io.run(*model, stream.get(), options);
        CHECK(all_plus_zero(out, h, 2 * h));
        CHECK(!all_plus_zero(out, 0, h));
        const Score s = score(out, ref, which, shape.hidden);
        check_score(
            shape.name + " T=2 (token 1 all -1) bn=" + std::to_string(options.decode_block_n), s,
            which.size(), 2, "decode_moe");
        CHECK(s.empty_tokens == 1);
      }
    }

    {  // the workspace: exactly what a call needs suffices, one byte less is refused
      const std::size_t guard = 1 << 16;
      for (int tokens : {1, 48, 256}) {
        const Tokens tk = decode_tokens(shape, tokens, rng);
        const std::size_t sized = moejit::moe_workspace_bytes(shape, tokens);
        ForwardIo io(shape, tk, sized);
        // Forced decode_moe at each block_n (0: the planner's), and the automatic path
        // (whichever it takes).
        for (const MoeForwardOptions& options :
             {forced_decode(0), forced_decode(8), forced_decode(16), forced_decode(32), kAuto}) {
          const std::size_t need = call_workspace_bytes(shape, tokens, options);
          INFO("T=" << tokens << ", path " << path_name(options.path) << ", block_n "
                    << options.decode_block_n << ": needs " << need << " of " << sized << " bytes");
          // moe_workspace_bytes covers a forced block_n as well as the planner's.
          CHECK(need <= sized);
          const std::vector<uint16_t> expected = io.run(*model, stream.get(), options);
          CHECK(count_nonfinite(expected) == 0);  // written: the poison is NaN
          DeviceBuffer region(need + guard);
          poison(region, stream.get(), 0x5A);
          moejit::MoeForwardArgs a = io.args(*model);
          a.workspace = region.data();
          a.workspace_bytes = need;
          poison(io.out, stream.get());
          moejit::moe_forward(shape, a, stream.get(), options);
          stream.sync();
          CHECK(same_bits(io.output(), expected));
          const std::vector<uint8_t> tail = download_at<uint8_t>(region, need, guard);
          CHECK(std::count(tail.begin(), tail.end(), uint8_t{0x5A}) ==
                static_cast<std::ptrdiff_t>(guard));
          a.workspace_bytes = need - 1;
          const std::string message =
              expect_refused(io, a, stream.get(), options, ErrorCode::kInvalidArgument);
          CHECK(contains(message, "workspace_bytes"));
        }
      }
    }

    {  // bad options and T > 256
      const Tokens tk = decode_tokens(shape, 7, rng);
      ForwardIo io(shape, tk, moejit::moe_workspace_bytes(shape, 7));
      for (const MoeForwardOptions& options :
           {forced_decode(12), forced_decode(64), forced_decode(-16),
            MoeForwardOptions{MoePath::kAuto, 24}, MoeForwardOptions{static_cast<MoePath>(7), 0}}) {
        INFO("path " << path_name(options.path) << ", block_n " << options.decode_block_n);
        expect_refused(io, io.args(*model), stream.get(), options, ErrorCode::kInvalidArgument);
      }
      // Buffers that share bytes: refused naming both, and nothing is written.
      {
        // hidden inside the workspace's own allocation (workspace_bytes of it): only that pair
        // overlaps, whatever the allocator put next to what.
        REQUIRE(io.workspace_bytes >= to_size(7 * shape.hidden * 2));
        moejit::MoeForwardArgs a = io.args(*model);
        TensorView hidden_in_workspace(io.workspace.data(), 0, {7, shape.hidden}, dl_bf16());
        a.hidden = hidden_in_workspace.dl();
        const std::string message =
            expect_refused(io, a, stream.get(), kAuto, ErrorCode::kInvalidArgument);
        CHECK(contains(message, "workspace: expected a buffer that shares no byte with hidden"));
        TensorView out_on_hidden(io.hidden.data(), 0, {7, shape.hidden}, dl_bf16());
        a = io.args(*model);
        a.out = out_on_hidden.dl();
        CHECK(contains(
            expect_refused(io, a, stream.get(), forced_decode(0), ErrorCode::kInvalidArgument),
            "out: expected a buffer that shares no byte with hidden"));
        CHECK(
            same_bits(download_at<uint16_t>(io.hidden, 0, tk.hidden_bits.size()), tk.hidden_bits));
        // The repacked weights are inputs too: out on w2's bytes, the workspace on w13's.
        a = io.args(*model);
        REQUIRE(model->sizes.w2_bytes >= to_size(7 * shape.hidden * 2));
        TensorView out_on_w2(a.weights.w2, 0, {7, shape.hidden}, dl_bf16());
        a.out = out_on_w2.dl();
        CHECK(contains(expect_refused(io, a, stream.get(), kAuto, ErrorCode::kInvalidArgument),
                       "out: expected a buffer that shares no byte with weights.w2"));
        a = io.args(*model);
        a.workspace = const_cast<void*>(a.weights.w13);
        a.workspace_bytes = std::min(io.workspace_bytes, model->sizes.w13_bytes);
        CHECK(contains(expect_refused(io, a, stream.get(), kAuto, ErrorCode::kInvalidArgument),
                       "workspace: expected a buffer that shares no byte with weights.w13"));
      }
      // T = 257: forced decode is refused naming its limit; the automatic path is marlin_moe.
      const Tokens many = decode_tokens(shape, 257, rng);
      ForwardIo io_many(shape, many, moejit::moe_workspace_bytes(shape, 257));
      const std::string message = expect_refused(io_many, io_many.args(*model), stream.get(),
                                                 forced_decode(16), ErrorCode::kUnsupported);
      CHECK(contains(message, "T <= 256"));
      const std::vector<uint16_t> automatic = io_many.run(*model, stream.get(), kAuto);
      CHECK(count_nonfinite(automatic) == 0);
      CHECK(same_bits(automatic, io_many.run(*model, stream.get(), kMarlin)));
    }
  }
}

TEST_CASE("decode_moe: T = 0 looks up no kernel; one not built during capture is refused",
          "[gpu][moe][decode]") {
  gpu();
  TestStream stream;
  if (!decode_runs_here(stream.get())) return;
  // E = 40: no other test builds a kernel of this shape, in this binary's private, fresh cache.
  ModelShape shape = resized(reference_shape("qwen3-30b-a3b"), 40, 0, 40, 256);
  shape.name = "decode-capture-miss";
  REQUIRE(moejit::moe_decode_problem(shape).empty());
  auto model = allocate_model(shape);  // never read: nothing launches
  MOEJIT_TEST_SEEDED_RNG(seed, rng);
  // One call under stream capture: the code of the error it threw (kInternal stands for none),
  // and its message.
  const auto captured = [&](ForwardIo& io, const MoeForwardOptions& options, std::string* message) {
    ErrorCode code = ErrorCode::kInternal;
    CUgraph graph = nullptr;
    MOEJIT_TEST_CU(cu().cuStreamBeginCapture(stream.get(), CU_STREAM_CAPTURE_MODE_GLOBAL));
    try {
      moejit::moe_forward(shape, io.args(*model), stream.get(), options);
    } catch (const Error& e) {
      code = e.code();
      *message = e.what();
    }
    cu().cuStreamEndCapture(stream.get(), &graph);
    if (graph != nullptr) cu().cuGraphDestroy(graph);
    return code;
  };
  {
    // T = 0 returns before any kernel lookup: a lookup of these unbuilt kernels during capture
    // would throw kCaptureMiss.
    const Tokens none = decode_tokens(shape, 0, rng);
    ForwardIo io(shape, none, moejit::moe_workspace_bytes(shape, 0));
    for (const MoeForwardOptions& options : {forced_decode(0), forced_decode(32), kAuto, kMarlin}) {
      std::string message;
      INFO("path " << path_name(options.path) << ", block_n " << options.decode_block_n);
      CHECK(captured(io, options, &message) == ErrorCode::kInternal);
      INFO(message);
      CHECK(message.empty());
    }
  }
  {
    const Tokens tk = decode_tokens(shape, 3, rng);
    ForwardIo io(shape, tk, moejit::moe_workspace_bytes(shape, 3));
    for (const MoeForwardOptions& options : {forced_decode(0), forced_decode(16), kAuto}) {
      INFO("path " << path_name(options.path) << ", block_n " << options.decode_block_n);
      poison(io.out, stream.get());
      stream.sync();
      std::string message;
      CHECK(captured(io, options, &message) == ErrorCode::kCaptureMiss);
      INFO(message);
      const bool decode = options.path == MoePath::kDecode || auto_takes_decode(shape, 3);
      CHECK(contains(message, decode ? "decode_moe" : "route"));
      // Nothing ran: the output is still the poison.
      stream.sync();
      CHECK(still_poisoned(io.output()));
    }
  }
}

TEST_CASE("decode_moe: the C ABI forward (moejit_moe_forward, _ex) equals the C++ call bitwise",
          "[gpu][moe][decode]") {
  gpu();
  TestStream stream;
  if (!decode_runs_here(stream.get())) return;
  // qwen3-30b-a3b's sizes under a name of its own, registered for the C ABI's handle.
  const char* text = R"({"name": "capi-gpu-qwen3", "num_experts": 128, "top_k": 8,
                         "hidden": 2048, "intermediate": 768,
                         "activation": {"kind": "swiglu"}, "max_tokens": 256})";
  moejit::register_shapes(text, "capi-gpu-qwen3.json");
  ModelShape shape = reference_shape("qwen3-30b-a3b");
  shape.name = "capi-gpu-qwen3";
  shape.max_tokens = 256;
  build_decode_kernels({shape}, {7, 48});
  moejit_moe* moe = nullptr;
  REQUIRE(moejit_moe_create("capi-gpu-qwen3", &moe) == MOEJIT_OK);
  const std::unique_ptr<moejit_moe, void (*)(moejit_moe*)> handle(moe, moejit_moe_destroy);
  size_t capi_workspace = 0;
  REQUIRE(moejit_moe_workspace_bytes(moe, 256, &capi_workspace) == MOEJIT_OK);
  CHECK(capi_workspace == moejit::moe_workspace_bytes(shape, 256));

  MOEJIT_TEST_SEEDED_RNG(seed, rng);
  const int sources = 8;
  const Checkpoint ck = source_checkpoint(shape, sources, rng());
  const std::vector<int> source = random_sources(shape.num_experts, sources, rng);
  std::unique_ptr<DeviceModel> model;
  {
    const DeviceCheckpoint dck(ck);
    model = mapped_model(shape, dck, source, stream.get());
  }
  const moejit_moe_weights weights = capi_weights(*model);
  for (int tokens : {7, 48}) {
    INFO("T=" << tokens);
    const Tokens tk = decode_tokens(shape, tokens, rng);
    ForwardIo io(shape, tk, capi_workspace);
    const moejit::MoeForwardArgs a = io.args(*model);
    struct Path {
      moejit_moe_path capi;
      MoeForwardOptions cpp;
    };
    for (const Path& path :
         {Path{MOEJIT_MOE_PATH_AUTO, kAuto}, Path{MOEJIT_MOE_PATH_MARLIN, kMarlin},
          Path{MOEJIT_MOE_PATH_DECODE, forced_decode(0)},
          Path{MOEJIT_MOE_PATH_DECODE, forced_decode(32)}}) {
      INFO("path " << path_name(path.cpp.path) << " block_n " << path.cpp.decode_block_n);
      const std::vector<uint16_t> want = io.run(*model, stream.get(), path.cpp);
      poison(io.out, stream.get());
      poison(io.workspace, stream.get());
      REQUIRE(moejit_moe_forward_ex(moe, a.hidden, a.topk_ids, a.topk_weights, &weights,
                                    a.workspace, a.workspace_bytes, a.out, path.capi,
                                    path.cpp.decode_block_n, stream.get()) == MOEJIT_OK);
      stream.sync();
      const std::vector<uint16_t> got = io.output();
      CHECK(count_nonfinite(got) == 0);
      CHECK(got == want);
      if (path.capi == MOEJIT_MOE_PATH_AUTO) {
        poison(io.out, stream.get());
        REQUIRE(moejit_moe_forward(moe, a.hidden, a.topk_ids, a.topk_weights, &weights, a.workspace,
                                   a.workspace_bytes, a.out, stream.get()) == MOEJIT_OK);
        stream.sync();
        CHECK(io.output() == want);
      }
    }
  }
}
