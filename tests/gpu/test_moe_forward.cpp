// The MXFP4 MoE layer on the GPU (moejit/moe.hpp): moe_forward against the fp64 CPU reference
// (src/ops/moe_reference) on every reference shape (tools/shapes/reference.json) and T in
// {1, 7, 48, 256, 1000} (and T = 1100, 4096 for the prefill tile, on 128 sampled tokens),
// on the automatic path, forced marlin_moe and forced decode_moe where it serves (T <= 256 on the
// shapes it accepts; refused elsewhere), the automatic path bit for bit the one the library picks
// (decode_moe for T = 1 on the shapes it serves, as detail::decode_by_default says, else
// marlin_moe), bitwise repeatability, expert parallelism (two halves sum to the whole), ids of -1
// and of other ranks (int32 and int64), CUDA-graph capture and replay, the workspace size
// contract, the repack round trip for both checkpoint layouts (unpacked on the CPU with
// kernels/moe/layout.cuh), and the route arrays marlin_moe leaves in its workspace against the
// CPU route model, bit for bit, and a second device (or, with one GPU, a second context)
// computing device 0's bits, alone and from its own thread beside device 0's. decode_moe's own
// sweep (both block_n, T up to 256, real expert counts) is test_decode_moe.cpp.
//
// Inputs: see gpu/moe_support.hpp. Fresh seeds every run (printed) so a failure can be replayed.
//
// Reduced experts: the CPU reference dequantizes every local expert to fp64 (24·H·I bytes each),
// so the forward sweep keeps the real H, I, top-k and activation of each shape but at most 48
// local experts (its memory, not its time: the reference costs T·k·3·H·I multiply-adds whatever
// E is). The route check runs every shape at its real expert count (no reference weights needed).
// The reference runs on all cores, split by experts; at T = 1000 the three heaviest shapes check
// 128 sampled tokens (every other case checks every token).
//
// Each forward case prints one line, "moe_forward <shape> T=<T> relL2=<x> ...", for PERF_LOG.
#include <cuda.h>
#include <dlpack/dlpack.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <catch2/catch.hpp>
#include <chrono>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <memory>
#include <moejit/kern/moe/layout.cuh>
#include <moejit/kern/moe/params.cuh>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "descriptor/descriptor.hpp"
#include "gpu/gpu_support.hpp"
#include "gpu/moe_support.hpp"
#include "moejit/error.hpp"
#include "moejit/moe.hpp"
#include "moejit/runtime.hpp"
#include "ops/moe_reference.hpp"
#include "plan/moe_plan.hpp"
#include "runtime/runtime_impl.hpp"
#include "support/support.hpp"

namespace {

using namespace moejit::test;  // the shared MoE test helpers (gpu/moe_support.hpp)
using moejit::ActivationKind;
using moejit::DType;
using moejit::Error;
using moejit::ErrorCode;
using moejit::ModelShape;
using moejit::MoeForwardOptions;
using moejit::MoePath;
using moejit::MoeWeightLayout;
using moejit::MoeWeights;

// The forced paths that serve `shape` at T = `tokens`: marlin_moe, and decode_moe where it does.
std::vector<MoeForwardOptions> forced_paths(const ModelShape& shape, int tokens) {
  std::vector<MoeForwardOptions> paths = {kMarlin};
  if (decode_serves(shape, tokens)) paths.push_back(kDecode);
  return paths;
}

std::string path_suffix(const MoeForwardOptions& options) {
  return options.path == MoePath::kAuto ? ""
                                        : std::string("[forced-") + path_name(options.path) + "]";
}

// ---- the forward sweep --------------------------------------------------------------------------

struct SweepShape {
  const char* name;
  int experts;        // local experts the test uses (<= the real count)
  bool sample_t1000;  // at T = 1000 check 128 sampled tokens (the reference's heaviest shapes)
};

// The reference shapes. Experts: at most 48 (fp64 weights of up to 7 GB on the host);
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

// Three runs of one path: the first run's bits, and whether the other two repeat them.
std::vector<uint16_t> three_runs(ForwardIo& io, const DeviceModel& model, CUstream stream,
                                 const MoeForwardOptions& options, bool* repeat) {
  const std::vector<uint16_t> first = io.run(model, stream, options);
  *repeat = true;
  for (int again = 1; again < 3; ++again) {
    *repeat = same_bits(io.run(model, stream, options), first) && *repeat;
  }
  return first;
}

}  // namespace

namespace {

// One shape of a sweep: every T of `token_counts` on the automatic, marlin and decode paths (output
// and workspace poisoned before each of three runs): within tolerance of the fp64 reference,
// every element finite, the same bits every run; the automatic call equal to the path it takes;
// decode and marlin within tolerance of each other; a forced decode that can't serve refused.
// From T = `sample_from` the reference checks kSampledTokens spread tokens, not all.
void sweep_paths(const ModelShape& shape, const std::string& name, int real_experts,
                 const std::vector<int>& token_counts, int sample_from, std::mt19937_64& rng,
                 TestStream& stream) {
  const bool decode_accepts = moejit::moe_decode_problem(shape).empty();
  const TestWeights weights = test_weights(shape, rng(), stream.get());
  const DeviceModel& model = *weights.model;
  const MoeWeightsF64& f64 = weights.f64;
  std::printf("moe_forward shape %s %s, %s checkpoint layout, decode_moe %s\n", name.c_str(),
              describe(shape, real_experts).c_str(),
              uses_gpt_oss_layout(shape) ? "gpt-oss" : "separate w1/w3/w2",
              decode_accepts ? "serves it" : "refuses it");
  IdPlan plan;
  plan.lo = 0;
  plan.hi = shape.num_experts;
  for (int tokens : token_counts) {
    const Tokens tk = make_tokens(shape, tokens, plan, rng);
    ForwardIo io(shape, tk, moejit::moe_workspace_bytes(shape, tokens));
    const std::vector<int> which =
        tokens >= sample_from ? sampled_tokens(tokens, kSampledTokens) : all_tokens(tokens);
    const std::vector<double> ref = reference_layer(f64, tk, which, layer_options(shape));
    const std::string label = name + " T=" + std::to_string(tokens);
    INFO(label << " " << describe(shape, real_experts));
    // Forced decode_moe serves T <= 256 on the shapes it accepts (sm_90 or newer); the
    // automatic path takes it there for the T detail::decode_by_default names. (What the calls
    // below do is checked against these; the planner's answers themselves are the unit tests'.)
    const moejit::Arch arch = moejit::detail::Runtime::instance().current_arch();
    const bool decode = decode_serves(shape, tokens);
    const bool auto_decode = auto_takes_decode(shape, tokens);
    // The sm_90a warpgroup main loop serves marlin_moe here (T = 1000; T = 256 where experts
    // average 14 rows) on such a device: the forced marlin line says so.
    const bool wgmma_tile =
        moejit::detail::moe_forward_specs(moejit::detail::choose_moe_config(shape, tokens), arch)
            .fc1_params.wgmma_n != 0;

    std::vector<uint16_t> auto_out;
    std::vector<uint16_t> marlin_out;
    std::vector<uint16_t> decode_out;
    for (const MoeForwardOptions& options : {kAuto, kMarlin, kDecode}) {
      if (options.path == MoePath::kDecode && !decode) {
        // Forced decode_moe where it can't serve: refused before anything runs.
        expect_refused(io, io.args(model), stream.get(), kDecode, ErrorCode::kUnsupported);
        continue;
      }
      bool repeat = false;
      const std::vector<uint16_t> out = three_runs(io, model, stream.get(), options, &repeat);
      check_score(name + path_suffix(options) + " T=" + std::to_string(tokens) +
                      (options.path == MoePath::kMarlin && wgmma_tile ? " [wgmma]" : ""),
                  score(out, ref, which, shape.hidden), which.size(), tokens);
      INFO(path_name(options.path) << ": 3 runs bitwise identical, every element finite");
      CHECK(count_nonfinite(out) == 0);
      CHECK(repeat);
      if (options.path == MoePath::kAuto) auto_out = out;
      if (options.path == MoePath::kMarlin) marlin_out = out;
      if (options.path == MoePath::kDecode) decode_out = out;
    }
    // The automatic call is the path the library picks, bit for bit.
    CHECK(same_bits(auto_out, auto_decode ? decode_out : marlin_out));
    // Both paths compute the same layer.
    if (decode) {
      const double paths = rel_l2(values_of(decode_out), values_of(marlin_out));
      std::printf("moe_forward %s decode vs marlin relL2=%s\n", label.c_str(), fmt(paths).c_str());
      CHECK(paths <= kRelL2Tolerance);
    }
  }
}

}  // namespace

TEST_CASE("moe_forward: reference shapes x T vs the fp64 reference, auto and marlin paths",
          "[gpu][moe]") {
  gpu();
  TestStream stream;
  std::vector<ModelShape> shapes;
  for (const SweepShape& s : kSweep) shapes.push_back(sweep_shape(s));
  prewarm_shapes(shapes);
  MOEJIT_TEST_SEEDED_RNG(seed, rng);
  std::printf("moe_forward sweep: seed %llu, reference on %u threads\n",
              static_cast<unsigned long long>(seed), worker_count());
  const std::vector<int> token_counts(std::begin(kSweepTokens), std::end(kSweepTokens));
  for (std::size_t n = 0; n < shapes.size(); ++n) {
    sweep_paths(shapes[n], kSweep[n].name, reference_shape(kSweep[n].name).num_experts,
                token_counts, kSweep[n].sample_t1000 ? 1000 : INT_MAX, rng, stream);
  }
}

// A model integrator's shape is not one of the reference shapes: tools/shapes/public.json holds
// public MoE models whose sizes the reference set lacks (top-k 1 and 2, 8-60 experts, I = 1408,
// 6400 and 14336, H = 1536, 5120 and 7168), every one through the same sweep at T from the pair to
// the 64-row prefill bucket. Experts are cut where the fp64 weights would pass ~6 GB on the host.
TEST_CASE("moe_forward: public MoE shapes beyond the reference set vs the fp64 reference",
          "[gpu][moe]") {
  gpu();
  TestStream stream;
  const std::vector<ModelShape> file = public_shapes();
  REQUIRE(file.size() >= 8);
  // The fp64 reference holds 24 bytes a weight of the three matrices: 3 * 8 * H * I per expert.
  constexpr double kHostBytes = 6e9;
  std::vector<ModelShape> shapes;
  for (const ModelShape& real : file) {
    const double per_expert = 24.0 * real.hidden * static_cast<double>(real.intermediate);
    // At least top-k (a token's experts must differ), at most 64 (the reference's time).
    const int most = std::max(real.top_k, std::min(real.num_experts, 64));
    const int experts = std::clamp(static_cast<int>(kHostBytes / per_expert), real.top_k, most);
    shapes.push_back(resized(real, experts, 0, experts, 1100));
  }
  prewarm_shapes(shapes);
  MOEJIT_TEST_SEEDED_RNG(seed, rng);
  std::printf("moe_forward public shapes: seed %llu, reference on %u threads\n",
              static_cast<unsigned long long>(seed), worker_count());
  // 1 and 2: the pair; 7: the persistent decode tile; 48 and 300: 8- and 16-row blocks; 600:
  // 32-row blocks; 1100: 64-row blocks (warpgroup tiles on sm_90a from 512).
  const std::vector<int> token_counts = {1, 2, 7, 48, 300, 600, 1100};
  for (std::size_t n = 0; n < shapes.size(); ++n) {
    sweep_paths(shapes[n], file[n].name, file[n].num_experts, token_counts, 300, rng, stream);
  }
}

// From T = 513 marlin_moe runs its sm_90a warpgroup tile (moe_gemm_wg.cuh) where the device is
// sm_90a, the mma.sync tile elsewhere: N = 128 over 32- or 64-row route blocks where experts
// average 56 rows or more, N = 64 (one warpgroup of two m64 tiles) below, and N = 256 (one CTA
// per SM) over 64-row blocks from 384 rows where min(H, I) >= 2560. A CTA runs at the narrowest
// quarter of N that holds its real rows. The sweep shapes (24-48 experts) give every expert tens
// of blocks at T = 1100 (N = 128, 137-550 rows an expert) and 4096 (512-2048 rows: N = 256 on
// gpt-oss-120b, gpt-oss-20b and qwen2-57b-a14b, N = 128 on the short-K others); two shapes with
// top-k 1 over 32 experts average 19, 34 and 44 rows at T = 600, 1100 and 1400 (N = 64, over 32-
// then 64-row blocks). The test counts which quarter each expert's last CTA takes, per N, and
// requires every one of them.
TEST_CASE("moe_forward: the prefill tiles (T = 600 .. 4096) vs the fp64 reference", "[gpu][moe]") {
  gpu();
  TestStream stream;
  struct Case {
    ModelShape shape;
    std::string name;  // the reference shape it is resized from
    std::vector<int> tokens;
  };
  std::vector<Case> cases;
  for (const SweepShape& s : kSweep) {
    cases.push_back(
        {resized(reference_shape(s.name), s.experts, 0, s.experts, 4096), s.name, {1100, 4096}});
  }
  for (const char* name : {"qwen3-30b-a3b", "gpt-oss-20b"}) {
    ModelShape few = resized(reference_shape(name), 32, 0, 32, 1400);
    few.top_k = 1;
    few.name += "k1";
    cases.push_back({few, name, {600, 1100, 1400}});
  }
  std::vector<ModelShape> shapes;
  for (const Case& c : cases) shapes.push_back(c.shape);
  prewarm_shapes(shapes);
  MOEJIT_TEST_SEEDED_RNG(seed, rng);
  std::printf("moe_forward prefill: seed %llu\n", static_cast<unsigned long long>(seed));
  const moejit::Arch arch = moejit::detail::Runtime::instance().current_arch();
  const bool wgmma = moejit::detail::wgmma_runs_on(arch);
  // Experts whose last CTA runs at quarter q of N, for N = 64, 128 and 256.
  int last_tiles[3][4] = {};
  for (const Case& c : cases) {
    const ModelShape& shape = c.shape;
    const TestWeights weights = test_weights(shape, rng(), stream.get());
    const DeviceModel& model = *weights.model;
    const MoeWeightsF64& f64 = weights.f64;
    IdPlan plan;
    plan.lo = 0;
    plan.hi = shape.num_experts;
    for (int tokens : c.tokens) {
      const std::string label = shape.name + " T=" + std::to_string(tokens);
      INFO(label << " " << describe(shape, reference_shape(c.name).num_experts));
      const moejit::detail::MoeForwardSpecs specs = moejit::detail::moe_forward_specs(
          moejit::detail::choose_moe_config(shape, tokens), arch);
      const int wgmma_n = moejit::test::wide_wgmma_n(shape, tokens);
      CHECK(specs.fc1_params.wgmma_n == (wgmma ? wgmma_n : 0));
      CHECK(specs.fc2_params.wgmma_n == (wgmma ? wgmma_n : 0));
      const Tokens tk = make_tokens(shape, tokens, plan, rng);
      std::vector<int> rows(static_cast<std::size_t>(shape.num_experts), 0);
      for (int64_t id : tk.ids) {
        if (id >= 0 && id < shape.num_experts) ++rows[static_cast<std::size_t>(id)];
      }
      const int quarter = wgmma_n / 4;
      const int width = wgmma_n == 64 ? 0 : wgmma_n == 128 ? 1 : 2;
      for (int r : rows) {
        if (r > 0) ++last_tiles[width][((r - 1) % wgmma_n) / quarter];
      }
      ForwardIo io(shape, tk, moejit::moe_workspace_bytes(shape, tokens));
      const std::vector<int> which = sampled_tokens(tokens, kSampledTokens);
      const std::vector<double> ref = reference_layer(f64, tk, which, layer_options(shape));
      bool repeat = false;
      const std::vector<uint16_t> out = three_runs(io, model, stream.get(), kAuto, &repeat);
      check_score(label + (wgmma ? " [wgmma" + std::to_string(wgmma_n) + "]" : " [mma.sync]"),
                  score(out, ref, which, shape.hidden), which.size(), tokens);
      INFO("3 runs bitwise identical, every element finite");
      CHECK(count_nonfinite(out) == 0);
      CHECK(repeat);
      // The forced marlin path is the same call at these T.
      CHECK(same_bits(io.run(model, stream.get(), kMarlin), out));
    }
  }
  for (int w = 0; w < 3; ++w) {
    const int n = 64 << w;
    std::printf(
        "moe_forward prefill: experts whose last tile is N = %d / %d / %d / %d of %d: "
        "%d / %d / %d / %d\n",
        n / 4, n / 2, 3 * n / 4, n, n, last_tiles[w][0], last_tiles[w][1], last_tiles[w][2],
        last_tiles[w][3]);
    for (int q = 0; q < 4; ++q) {
      INFO("no expert's last tile ran at N = " << n / 4 * (q + 1) << " of " << n);
      CHECK(last_tiles[w][q] > 0);
    }
  }
}

// With 16-row route blocks and I <= 768, FC2 takes a 256-row tile (four warps of four atoms)
// where its CTAs fill four waves from the bucket's first T (moe_plan.cpp fc2_tile_for): the
// full kimi and deepseek shapes only. Resized to 128 experts they still take it (first T of
// 16-row blocks: 41 and 107, 4.5 and 5.1 waves), at T whose experts average 10 and 9.4 rows
// (below the warpgroup tile's 14 for shapes whose FC1 takes the wide-K tile), so the CPU
// reference stays affordable; and deepseek at T = 300 (14.06 rows), where on sm_90a FC1 runs the
// warpgroup tile and FC2 keeps this one. qwen3-30b-a3b (2.6 waves of it) takes the bucket's
// 128-row tile at six CTAs per SM instead: T = 96, 6 rows an expert.
TEST_CASE("moe_forward: the short-K FC2 tiles of 16-row blocks vs the fp64 reference",
          "[gpu][moe]") {
  gpu();
  TestStream stream;
  struct Case {
    const char* name;
    int tokens;
    int fc2_block_m;
    int fc2_min_blocks_per_sm;
  };
  const Case cases[] = {{"kimi-k3.1-tp8", 80, 256, 3},
                        {"deepseek-v4-flash-tp4", 200, 256, 3},
                        {"deepseek-v4-flash-tp4", 300, 256, 3},
                        {"qwen3-30b-a3b", 96, 128, 6}};
  std::vector<ModelShape> shapes;
  for (const Case& c : cases) shapes.push_back(resized(reference_shape(c.name), 128, 0, 128, 512));
  prewarm_shapes(shapes);
  MOEJIT_TEST_SEEDED_RNG(seed, rng);
  std::printf("moe_forward short-K FC2: seed %llu\n", static_cast<unsigned long long>(seed));
  const moejit::Arch arch = moejit::detail::Runtime::instance().current_arch();
  for (std::size_t n = 0; n < shapes.size(); ++n) {
    const ModelShape& shape = shapes[n];
    const int tokens = cases[n].tokens;
    const std::string label = shape.name + " T=" + std::to_string(tokens);
    INFO(label);
    const moejit::detail::MoeForwardSpecs specs =
        moejit::detail::moe_forward_specs(moejit::detail::choose_moe_config(shape, tokens), arch);
    // The tile this case is for, on every arch (the warpgroup tile starts at 14 rows here, H
    // being a multiple of 256, and takes FC1 only).
    CHECK(specs.fc2_params.block_m == cases[n].fc2_block_m);
    CHECK(specs.fc2_params.min_blocks_per_sm == cases[n].fc2_min_blocks_per_sm);
    CHECK(specs.fc2_params.block_n == 16);
    CHECK(specs.fc2_params.warps_m == 4);
    CHECK(specs.fc2_params.wgmma_n == 0);
    REQUIRE(shape.hidden % 256 == 0);
    const bool rows14 = static_cast<long long>(tokens) * shape.top_k >= 14LL * shape.num_experts;
    CHECK((specs.fc1_params.wgmma_n != 0) == (rows14 && moejit::detail::wgmma_runs_on(arch)));
    const TestWeights weights = test_weights(shape, rng(), stream.get());
    const DeviceModel& model = *weights.model;
    const MoeWeightsF64& f64 = weights.f64;
    IdPlan plan;
    plan.lo = 0;
    plan.hi = shape.num_experts;
    const Tokens tk = make_tokens(shape, tokens, plan, rng);
    ForwardIo io(shape, tk, moejit::moe_workspace_bytes(shape, tokens));
    const std::vector<int> which = sampled_tokens(tokens, kSampledTokens);
    const std::vector<double> ref = reference_layer(f64, tk, which, layer_options(shape));
    bool repeat = false;
    const std::vector<uint16_t> out = three_runs(io, model, stream.get(), kMarlin, &repeat);
    check_score(label + " [short-K FC2, " + std::to_string(cases[n].fc2_block_m) + " rows]",
                score(out, ref, which, shape.hidden), which.size(), tokens);
    INFO("3 runs bitwise identical, every element finite");
    CHECK(count_nonfinite(out) == 0);
    CHECK(repeat);
  }
}

TEST_CASE("moe_forward: EP halves (offsets 0 and E/2) sum to the layer", "[gpu][moe]") {
  gpu();
  TestStream stream;
  MOEJIT_TEST_SEEDED_RNG(seed, rng);
  for (const char* name : {"kimi-k3.1-tp4-ep2", "gpt-oss-20b"}) {
    const ModelShape real = reference_shape(name);
    const int e = 32;
    const ModelShape full = resized(real, e, 0, e, 256);
    const ModelShape half0 = resized(real, e / 2, 0, e, 256);
    const ModelShape half1 = resized(real, e / 2, e / 2, e, 256);
    prewarm_shapes({full, half0, half1});
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
      const std::vector<double> ref =
          reference_layer(f64, tk, all_tokens(tokens), layer_options(full));
      for (const MoeForwardOptions& options : forced_paths(full, tokens)) {
        const std::vector<double> whole = values_of(io_full.run(*m_full, stream.get(), options));
        const std::vector<double> part0 = values_of(io0.run(*m_half0, stream.get(), options));
        const std::vector<double> part1 = values_of(io1.run(*m_half1, stream.get(), options));
        std::vector<double> sum(whole.size());
        for (std::size_t j = 0; j < sum.size(); ++j) sum[j] = part0[j] + part1[j];
        const double halves_vs_full = rel_l2(sum, whole);
        const double halves_vs_ref = rel_l2(sum, ref);
        const double full_vs_ref = rel_l2(whole, ref);
        const std::string label = std::string(name) + path_suffix(options);
        std::printf(
            "moe_forward %s EP halves T=%d relL2=%s (halves vs full layer %s, full vs "
            "reference %s)\n",
            label.c_str(), tokens, fmt(halves_vs_ref).c_str(), fmt(halves_vs_full).c_str(),
            fmt(full_vs_ref).c_str());
        INFO(label << " T=" << tokens);
        CHECK(halves_vs_full <= kRelL2Tolerance);
        CHECK(halves_vs_ref <= kRelL2Tolerance);
        CHECK(full_vs_ref <= kRelL2Tolerance);
        // Each half alone is far from the whole (so the sum is not trivially equal).
        CHECK(rel_l2(part0, whole) > 0.1);
        CHECK(rel_l2(part1, whole) > 0.1);
      }
    }
  }
}

TEST_CASE("moe_forward: ids of -1, other ranks and beyond int32 add nothing", "[gpu][moe]") {
  gpu();
  TestStream stream;
  MOEJIT_TEST_SEEDED_RNG(seed, rng);
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
    prewarm_shapes({shape});
    const TestWeights weights = test_weights(shape, rng(), stream.get());
    const DeviceModel& model = *weights.model;
    const MoeWeightsF64& f64 = weights.f64;
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
      const std::vector<int> which = all_tokens(tokens);
      const std::vector<double> ref = reference_layer(f64, tk, which, layer_options(shape));
      // Both paths: marlin_moe (int64 ids narrowed by a launch of their own first) and decode_moe
      // (it reads int64 ids directly).
      for (const MoeForwardOptions& options : forced_paths(shape, tokens)) {
        const std::vector<uint16_t> got = io.run(model, stream.get(), options);
        const Score s = score(got, ref, which, shape.hidden);
        check_score(shape.name + path_suffix(options) + " (ids -1 / other rank" +
                        (c.id_dtype == DType::kI64 ? " / int64" : "") +
                        ") T=" + std::to_string(tokens),
                    s, which.size(), tokens);
        CHECK(s.empty_tokens > 0);
      }
    }
  }
}

TEST_CASE("moe_forward: a prewarmed call in a CUDA graph replays the same bits", "[gpu][moe]") {
  gpu();
  TestStream stream;
  MOEJIT_TEST_SEEDED_RNG(seed, rng);
  const ModelShape shape = resized(reference_shape("qwen3-30b-a3b"), 32, 0, 32, 256);
  prewarm_shapes({shape});
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
  // marlin_moe: at T = 7 one route launch, at T = 256 (N = 2048) the three-launch route.
  // decode_moe: its reset and fused kernels (the planner's tile, which prewarm builds). The
  // automatic path: whichever of the two the library picks.
  for (int tokens : {7, 256}) {
    const Tokens tk = make_tokens(shape, tokens, plan, rng);
    ForwardIo io(shape, tk, moejit::moe_workspace_bytes(shape, 256));
    std::vector<MoeForwardOptions> paths = forced_paths(shape, tokens);
    paths.push_back(kAuto);
    for (const MoeForwardOptions& options : paths) {
      INFO("T=" << tokens << ", path " << path_name(options.path));
      const std::vector<uint16_t> eager = io.run(*model, stream.get(), options);
      // The poison is NaN: an eager call that wrote nothing would match replays that did not.
      CHECK(count_nonfinite(eager) == 0);
      const std::vector<std::vector<uint16_t>> replays =
          io.graph_replays(*model, stream.get(), options, 3);
      for (std::size_t replay = 0; replay < replays.size(); ++replay) {
        INFO("replay " << replay);
        CHECK(same_bits(replays[replay], eager));
      }
    }
  }
}

namespace {

// One context's copy of the two-context case: its stream, the checkpoint repacked there, and the
// inputs, output and workspace of each call, all made in that context.
struct ContextRun {
  CUcontext context = nullptr;
  std::unique_ptr<TestStream> stream;
  std::unique_ptr<DeviceModel> model;
  std::vector<std::unique_ptr<ForwardIo>> io;  // one per call
};

std::unique_ptr<ContextRun> context_run(CUcontext context, const ModelShape& shape,
                                        const Checkpoint& ck, const std::vector<Tokens>& calls) {
  MOEJIT_TEST_CU(cu().cuCtxSetCurrent(context));
  auto run = std::make_unique<ContextRun>();
  run->context = context;
  run->stream = std::make_unique<TestStream>();
  {
    const DeviceCheckpoint dck(ck);
    run->model = repacked_model(shape, dck, 0, run->stream->get());
  }
  for (const Tokens& tk : calls) {
    run->io.push_back(
        std::make_unique<ForwardIo>(shape, tk, moejit::moe_workspace_bytes(shape, tk.count)));
  }
  return run;
}

// What both context cases run: qwen3-30b-a3b cut to 32 experts and I = 256, prewarmed, a random
// checkpoint, one call per T in `tokens` (ids over every local expert, a share `drop` of the
// slots -1), on marlin_moe and, where it serves T = 7, decode_moe.
struct ContextCase {
  ModelShape shape;
  Checkpoint ck;
  std::vector<Tokens> calls;
  std::vector<MoeForwardOptions> paths;
};

ContextCase context_case(std::mt19937_64& rng, std::initializer_list<int> tokens, double drop) {
  ContextCase c;
  c.shape = resized(reference_shape("qwen3-30b-a3b"), 32, 0, 32, 256);
  prewarm_shapes({c.shape});
  c.ck = make_checkpoint(c.shape, false, rng());
  IdPlan plan;
  plan.lo = 0;
  plan.hi = c.shape.num_experts;
  plan.drop = drop;
  for (int t : tokens) c.calls.push_back(make_tokens(c.shape, t, plan, rng));
  c.paths = {kMarlin};
  if (decode_serves(c.shape, 7)) c.paths.push_back(kDecode);
  return c;
}

// `rounds` x every (call, path) in `run`'s context from the calling thread, output and workspace
// poisoned before each call (ForwardIo::try_run), each output compared with
// `expected[call][path]`. No Catch2 macro here (it runs beside another thread): "" when every
// output matched, else what went wrong.
std::string forwards_match(const ContextRun& run, const std::vector<MoeForwardOptions>& paths,
                           const std::vector<std::vector<std::vector<uint16_t>>>& expected,
                           int rounds) {
  const CUresult current = cu().cuCtxSetCurrent(run.context);
  if (current != CUDA_SUCCESS) {
    return std::string("cuCtxSetCurrent: ") + moejit::detail::describe(current);
  }
  int mismatches = 0;
  std::vector<uint16_t> got;
  for (int round = 0; round < rounds; ++round) {
    for (std::size_t call = 0; call < run.io.size(); ++call) {
      for (std::size_t path = 0; path < paths.size(); ++path) {
        const std::string problem =
            run.io[call]->try_run(*run.model, run.stream->get(), paths[path], got);
        if (!problem.empty()) return problem;
        mismatches += got == expected[call][path] ? 0 : 1;
      }
    }
  }
  if (mismatches == 0) return "";
  std::ostringstream problems;
  problems << mismatches << " of " << rounds * run.io.size() * paths.size()
           << " outputs differ from context 0's first run";
  return problems.str();
}

// The two contexts of the case and what was made in each. However the test ends, the second
// context's buffers and stream go with it current, then it is released (device 1's primary
// context) or destroyed (one created on device 0), and device 0's primary context is current.
struct TwoContexts {
  CUcontext first = nullptr;
  CUcontext second = nullptr;
  CUdevice second_device = 0;
  bool second_is_primary = false;
  std::unique_ptr<ContextRun> runs[2];

  ~TwoContexts() {
    const moejit::detail::DriverApi& api = cu();
    if (second != nullptr) api.cuCtxSetCurrent(second);
    runs[1].reset();
    api.cuCtxSetCurrent(first);
    runs[0].reset();
    if (second != nullptr && second_is_primary) api.cuDevicePrimaryCtxRelease(second_device);
    if (second != nullptr && !second_is_primary) api.cuCtxDestroy(second);
    api.cuCtxSetCurrent(first);
  }
};

}  // namespace

// An engine that drives several GPUs from one process calls moe_forward in each device's
// context, often from one thread per device. The kernels are loaded once per arch (CUkernel
// handles serve every context), but a kernel's dynamic shared-memory opt-in and carveout are set
// per device, so device 1's first calls must set their own. The second context is device 1's
// primary context where there are two GPUs, else a context created on device 0 (the same
// handles and threads, without the per-device opt-ins: the test says which). Context 0's outputs
// are checked against the fp64 reference; the second context's repacked weights and outputs
// (marlin_moe and, where it serves, decode_moe, at T = 7 and 256) must be its bits; then both
// contexts run every call at once, one thread each, and every output is those bits again.
TEST_CASE("moe_forward: a second device (or context) gives device 0's bits, alone and beside it",
          "[gpu][moe]") {
  const GpuEnv& env = gpu();
  const bool two_devices = env.device_count >= 2;
  if (!two_devices) {
    WARN("only " << env.device_count
                 << " CUDA device visible: the second context is one created on device 0, so "
                    "device 1's shared-memory opt-ins are not exercised");
  }
  MOEJIT_TEST_SEEDED_RNG(seed, rng);
  const ContextCase c = context_case(rng, {7, 256}, 0.05);
  const ModelShape& shape = c.shape;
  const Checkpoint& ck = c.ck;
  const std::vector<Tokens>& calls = c.calls;
  const std::vector<MoeForwardOptions>& paths = c.paths;
  REQUIRE(std::all_of(calls.begin(), calls.end(), [&](const Tokens& tk) {
    return paths.size() == 1 || decode_serves(shape, tk.count);
  }));

  TwoContexts contexts;
  contexts.first = env.context;
  contexts.second_is_primary = two_devices;
  if (two_devices) {
    MOEJIT_TEST_CU(cu().cuDeviceGet(&contexts.second_device, 1));
    MOEJIT_TEST_CU(cu().cuDevicePrimaryCtxRetain(&contexts.second, contexts.second_device));
  } else {
    MOEJIT_TEST_CU(cu().cuCtxCreate(&contexts.second, nullptr, 0, env.device));
  }
  std::unique_ptr<ContextRun>(&runs)[2] = contexts.runs;
  runs[0] = context_run(env.context, shape, ck, calls);
  runs[1] = context_run(contexts.second, shape, ck, calls);
  CHECK(current_device_ordinal() == (two_devices ? 1 : 0));

  // The repacked weights and scales: the same bytes in both contexts.
  std::vector<uint8_t> packed[2];
  for (int d = 0; d < 2; ++d) {
    MOEJIT_TEST_CU(cu().cuCtxSetCurrent(runs[d]->context));
    const DeviceModel& m = *runs[d]->model;
    for (const DeviceBuffer* b : {&m.w13, &m.w13_scales, &m.w2, &m.w2_scales}) {
      const std::vector<uint8_t> bytes = b->download<uint8_t>(b->bytes());
      packed[d].insert(packed[d].end(), bytes.begin(), bytes.end());
    }
  }
  // Compared as one flag: Catch2 would print ~100 MB of bytes for the vectors.
  const bool same_packed = packed[0] == packed[1];
  CHECK(same_packed);

  // One after the other: context 0 against the reference, the second against context 0's bits.
  const MoeWeightsF64 f64 = dequantize(ck, 0, shape.num_experts);
  std::vector<std::vector<std::vector<uint16_t>>> expected(calls.size());
  for (std::size_t call = 0; call < calls.size(); ++call) {
    const Tokens& tk = calls[call];
    const std::vector<int> which = all_tokens(tk.count);
    const std::vector<double> ref = reference_layer(f64, tk, which, layer_options(shape));
    for (const MoeForwardOptions& options : paths) {
      const std::string label =
          "qwen3-30b-a3b" + path_suffix(options) + " T=" + std::to_string(tk.count);
      INFO(label);
      MOEJIT_TEST_CU(cu().cuCtxSetCurrent(runs[0]->context));
      const std::vector<uint16_t> first =
          runs[0]->io[call]->run(*runs[0]->model, runs[0]->stream->get(), options);
      check_score(label + " [context 0]", score(first, ref, which, shape.hidden), which.size(),
                  tk.count);
      CHECK(count_nonfinite(first) == 0);
      MOEJIT_TEST_CU(cu().cuCtxSetCurrent(runs[1]->context));
      const std::vector<uint16_t> other =
          runs[1]->io[call]->run(*runs[1]->model, runs[1]->stream->get(), options);
      INFO("the second context's output is context 0's, bit for bit");
      CHECK(same_bits(other, first));
      expected[call].push_back(first);
    }
  }

  // At once: one thread per context, each running every call and path several times.
  constexpr int kRounds = 8;
  std::string problems[2];
  {
    std::vector<std::thread> threads;
    for (int d = 0; d < 2; ++d) {
      threads.emplace_back(
          [&, d] { problems[d] = forwards_match(*runs[d], paths, expected, kRounds); });
    }
    for (std::thread& t : threads) t.join();
  }
  for (int d = 0; d < 2; ++d) {
    INFO("context " << d << ", " << kRounds << " rounds beside the other context's thread");
    CHECK(problems[d].empty());
    if (!problems[d].empty()) std::printf("context %d: %s\n", d, problems[d].c_str());
  }
  std::printf("moe_forward in two contexts (%s): %zu calls x %zu paths, %d rounds each at once\n",
              two_devices ? "devices 0 and 1" : "both on device 0", calls.size(), paths.size(),
              kRounds);
}

namespace {

// A context created on device 0 for one run, with what was made in it: however the test ends,
// the run's buffers go with the context current, then the context is destroyed and `restore` is
// current again.
struct CreatedContext {
  CUcontext context = nullptr;
  CUcontext restore = nullptr;
  std::unique_ptr<ContextRun> run;

  ~CreatedContext() {
    const moejit::detail::DriverApi& api = cu();
    if (context != nullptr) api.cuCtxSetCurrent(context);
    run.reset();
    if (context != nullptr) api.cuCtxDestroy(context);
    api.cuCtxSetCurrent(restore);
  }
};

}  // namespace

// The library launches each kernel through its function in the stream's context, kept per
// context. A context created after another was destroyed may get the destroyed one's handle,
// and the destroyed context's functions are gone: each new context must run its own and give the
// primary context's bits (marlin_moe and, where it serves, decode_moe). Each new context's first
// forward is captured into a graph (global capture mode), so the functions are first asked for
// during a capture, as in an engine that prewarms, then captures without an eager call.
TEST_CASE("moe_forward: a context created after another was destroyed runs its own kernels",
          "[gpu][moe]") {
  const GpuEnv& env = gpu();
  MOEJIT_TEST_SEEDED_RNG(seed, rng);
  const ContextCase c = context_case(rng, {7}, 0);
  const ModelShape& shape = c.shape;
  const Checkpoint& ck = c.ck;
  const std::vector<Tokens>& calls = c.calls;
  const std::vector<MoeForwardOptions>& paths = c.paths;

  std::vector<std::vector<std::vector<uint16_t>>> expected(1);
  {
    const std::unique_ptr<ContextRun> first = context_run(env.context, shape, ck, calls);
    for (const MoeForwardOptions& options : paths) {
      expected[0].push_back(first->io[0]->run(*first->model, first->stream->get(), options));
      CHECK(count_nonfinite(expected[0].back()) == 0);
    }
  }
  constexpr int kContexts = 3;
  std::vector<CUcontext> handles;
  for (int i = 0; i < kContexts; ++i) {
    std::string problem;
    {
      CreatedContext created;
      created.restore = env.context;
      MOEJIT_TEST_CU(cu().cuCtxCreate(&created.context, nullptr, 0, env.device));
      handles.push_back(created.context);
      created.run = context_run(created.context, shape, ck, calls);
      ContextRun& run = *created.run;
      for (std::size_t path = 0; path < paths.size(); ++path) {
        const std::vector<std::vector<uint16_t>> replays =
            run.io[0]->graph_replays(*run.model, run.stream->get(), paths[path], 2);
        for (std::size_t replay = 0; replay < replays.size(); ++replay) {
          INFO("context " << i << ", path " << path << ", replay " << replay << " of its graph");
          CHECK(same_bits(replays[replay], expected[0][path]));
        }
      }
      problem = forwards_match(run, paths, expected, 2);
    }
    INFO("context " << i << " created after " << i << " destroyed, eager calls");
    CHECK(problem.empty());
  }
  std::sort(handles.begin(), handles.end());
  const auto distinct = std::unique(handles.begin(), handles.end()) - handles.begin();
  std::printf("moe_forward in %d contexts created one after another's end: %td distinct handles\n",
              kContexts, distinct);
}

TEST_CASE("moe_forward: a kernel not built during capture is refused", "[gpu][moe]") {
  gpu();
  TestStream stream;
  MOEJIT_TEST_SEEDED_RNG(seed, rng);
  // E = 5, k = 3: a route kernel no other test builds, in this binary's private, fresh cache
  // (H = 256: decode_moe refuses the shape, so the automatic path is marlin_moe).
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
  CHECK_THAT(message, Catch::StartsWith("moe_forward: kernel "));
  // Nothing ran: the output is still the poison.
  CHECK(still_poisoned(io.output()));
}

TEST_CASE("moe_forward: the workspace size query is respected", "[gpu][moe]") {
  gpu();
  TestStream stream;
  MOEJIT_TEST_SEEDED_RNG(seed, rng);
  const ModelShape shape = resized(reference_shape("deepseek-v4-flash-tp4"), 32, 0, 32, 1000);
  prewarm_shapes({shape});
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
    // The size for T never exceeds the size for the largest T, and bounds the plan's layout.
    const std::size_t bytes = moejit::moe_workspace_bytes(shape, tokens);
    CHECK(bytes <= max_bytes);
    const moejit::detail::MoeForwardConfig config =
        moejit::detail::choose_moe_config(shape, tokens);
    const moejit::detail::MoeWorkspaceLayout used =
        moejit::detail::moe_workspace_layout(shape, config);
    CHECK(used.bytes <= bytes);
    const Tokens tk = make_tokens(shape, tokens, plan, rng);
    ForwardIo io(shape, tk, bytes);
    for (const MoeForwardOptions& options : {kAuto, kMarlin, kDecode}) {
      if (options.path == MoePath::kDecode && !decode_serves(shape, tokens)) continue;
      // What this call needs: decode_moe's workspace on the decode path, else the marlin
      // chain's regions.
      const std::size_t need = call_workspace_bytes(shape, tokens, options);
      INFO("T=" << tokens << ", path " << path_name(options.path) << ", needs " << need
                << " bytes");
      CHECK(need <= used.bytes);
      const std::vector<uint16_t> reference_out = io.run(*model, stream.get(), options);
      CHECK(count_nonfinite(reference_out) == 0);  // written: the poison is NaN
      // Exactly the bytes this call needs (and the size for the largest T), followed by a guard
      // band: the guard is never written, and the output is the same as with a private
      // workspace.
      for (std::size_t given : {need, max_bytes}) {
        DeviceBuffer region(given + guard);
        poison(region, stream.get(), 0x5A);
        moejit::MoeForwardArgs a = io.args(*model);
        a.workspace = region.data();
        a.workspace_bytes = given;
        poison(io.out, stream.get());
        moejit::moe_forward(shape, a, stream.get(), options);
        stream.sync();
        CHECK(same_bits(io.output(), reference_out));
        const std::vector<uint8_t> tail = download_at<uint8_t>(region, given, guard);
        CHECK(std::count(tail.begin(), tail.end(), uint8_t{0x5A}) ==
              static_cast<std::ptrdiff_t>(guard));
      }
      // One byte short of what this call needs: refused before anything runs.
      moejit::MoeForwardArgs a = io.args(*model);
      a.workspace_bytes = need - 1;
      expect_refused(io, a, stream.get(), options, ErrorCode::kInvalidArgument);
    }
  }
}

namespace {

using Catch::Matchers::Contains;

// Device memory of the current device in an address range of its own (cuMemAddressReserve),
// mapped chunk by chunk (cuMemCreate + cuMemMap), as torch's expandable segments map theirs: one
// reservation, several physical allocations. At least `bytes`, in at least two chunks. With
// `access` false the device is given no access to it (no cuMemSetAccess).
class ChunkedBuffer {
 public:
  explicit ChunkedBuffer(std::size_t bytes, bool access = true) {
    prop_.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop_.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop_.location.id = current_device_ordinal();
    MOEJIT_TEST_CU(
        cu().cuMemGetAllocationGranularity(&chunk_, &prop_, CU_MEM_ALLOC_GRANULARITY_MINIMUM));
    const std::size_t chunks = std::max<std::size_t>(2, (bytes + chunk_ - 1) / chunk_);
    size_ = chunks * chunk_;
    MOEJIT_TEST_CU(cu().cuMemAddressReserve(&base_, size_, 0, 0, 0));
    for (std::size_t c = 0; c < chunks; ++c) {
      CUmemGenericAllocationHandle handle = 0;
      MOEJIT_TEST_CU(cu().cuMemCreate(&handle, chunk_, &prop_, 0));
      handles_.push_back(handle);
      MOEJIT_TEST_CU(cu().cuMemMap(base_ + c * chunk_, chunk_, 0, handle, 0));
    }
    if (access) MOEJIT_TEST_CU(set_access(CU_MEM_ACCESS_FLAGS_PROT_READWRITE));
  }
  ~ChunkedBuffer() {
    for (std::size_t c = 0; c < handles_.size(); ++c) {
      cu().cuMemUnmap(base_ + c * chunk_, chunk_);
      cu().cuMemRelease(handles_[c]);
    }
    if (base_ != 0) cu().cuMemAddressFree(base_, size_);
  }
  ChunkedBuffer(const ChunkedBuffer&) = delete;
  ChunkedBuffer& operator=(const ChunkedBuffer&) = delete;

  // Unmaps the last chunk: a hole at the end of the reservation.
  void unmap_last() {
    MOEJIT_TEST_CU(cu().cuMemUnmap(base_ + (handles_.size() - 1) * chunk_, chunk_));
    MOEJIT_TEST_CU(cu().cuMemRelease(handles_.back()));
    handles_.pop_back();
  }
  // The device's access to the whole reservation.
  CUresult set_access(CUmemAccess_flags flags) {
    CUmemAccessDesc access{};
    access.location = prop_.location;
    access.flags = flags;
    return cu().cuMemSetAccess(base_, size_, &access, 1);
  }
  CUdeviceptr ptr() const { return base_; }
  void* data() const { return reinterpret_cast<void*>(static_cast<uintptr_t>(base_)); }
  std::size_t size() const { return size_; }
  std::size_t chunk() const { return chunk_; }

 private:
  CUmemAllocationProp prop_{};
  std::size_t chunk_ = 0;
  std::size_t size_ = 0;
  CUdeviceptr base_ = 0;
  std::vector<CUmemGenericAllocationHandle> handles_;
};

}  // namespace

TEST_CASE("moe_forward: check_pointers refuses buffers the kernels can't reach, before launching",
          "[gpu][moe]") {
  gpu();
  TestStream stream;
  MOEJIT_TEST_SEEDED_RNG(seed, rng);
  const ModelShape shape = resized(reference_shape("deepseek-v4-flash-tp4"), 32, 0, 32, 64);
  prewarm_shapes({shape});
  const Checkpoint ck = make_checkpoint(shape, false, rng());
  std::unique_ptr<DeviceModel> model;
  {
    const DeviceCheckpoint dck(ck);
    model = repacked_model(shape, dck, 0, stream.get());
  }
  IdPlan plan;
  plan.lo = 0;
  plan.hi = shape.num_experts;
  const int tokens = 7;
  ForwardIo io(shape, make_tokens(shape, tokens, plan, rng),
               moejit::moe_workspace_bytes(shape, tokens));
  const std::vector<uint16_t> auto_bits = io.run(*model, stream.get(), kAuto);
  const std::vector<uint16_t> marlin_bits = io.run(*model, stream.get(), kMarlin);
  REQUIRE(count_nonfinite(auto_bits) == 0);

  PointerChecks checks;
  // Valid calls pass, with the same bits.
  CHECK(same_bits(io.run(*model, stream.get(), kAuto), auto_bits));
  CHECK(same_bits(io.run(*model, stream.get(), kMarlin), marlin_bits));

  // FC2's weights in a reservation mapped as several chunks pass, and give the same bits; with
  // the reservation's last chunk unmapped (the weights run into a hole) they are refused.
  ChunkedBuffer chunked(model->w2.bytes());
  REQUIRE(model->w2.bytes() > chunked.chunk());  // so unmapping the last chunk leaves the first
  INFO("w2 " << model->w2.bytes() << " bytes in " << chunked.size() / chunked.chunk()
             << " chunks of " << chunked.chunk());
  // Placed so the weights end in the reservation's last chunk.
  const std::size_t w2_offset = (chunked.size() - model->w2.bytes()) / 256 * 256;
  MOEJIT_TEST_CU(cu().cuMemcpyDtoDAsync(chunked.ptr() + w2_offset, model->w2.ptr(),
                                        model->w2.bytes(), stream.get()));
  moejit::MoeForwardArgs a = io.args(*model);
  a.weights.w2 = static_cast<char*>(chunked.data()) + w2_offset;
  {
    poison(io.out, stream.get());
    moejit::moe_forward(shape, a, stream.get(), kAuto);
    stream.sync();
    CHECK(same_bits(io.output(), auto_bits));
  }
  chunked.unmap_last();
  std::string e = expect_refused(io, a, stream.get(), kAuto, ErrorCode::kInvalidArgument);
  CHECK_THAT(e, Contains("moe_forward: weights.w2: expected memory mapped on device 0"));
  CHECK_THAT(e, Contains("no memory at its last byte"));

  // The device's access, as the driver reports it for a byte (the call the checks make).
  const auto access_at = [](CUdeviceptr address) {
    unsigned flags = 0xFFu;
    CUpointer_attribute asked = CU_POINTER_ATTRIBUTE_ACCESS_FLAGS;
    void* data = &flags;
    MOEJIT_TEST_CU(cu().cuPointerGetAttributes(1, &asked, &data, address));
    return flags;
  };
  // FC2's weights in a reservation this device may only read pass, and give the same bits; the
  // output there is refused. Why the driver's flags are asked first: a write the checks let
  // through would fault the context and every test after this one.
  {
    ChunkedBuffer read_only(model->w2.bytes());
    MOEJIT_TEST_CU(
        cu().cuMemcpyDtoDAsync(read_only.ptr(), model->w2.ptr(), model->w2.bytes(), stream.get()));
    stream.sync();
    const CUresult downgraded = read_only.set_access(CU_MEM_ACCESS_FLAGS_PROT_READ);
    if (downgraded != CUDA_SUCCESS) {
      WARN("read-only mappings not tested: cuMemSetAccess(PROT_READ) gave "
           << moejit::detail::describe(downgraded));
    } else {
      REQUIRE(access_at(read_only.ptr()) == CU_POINTER_ATTRIBUTE_ACCESS_FLAG_READ);
      moejit::MoeForwardArgs r = io.args(*model);
      r.weights.w2 = read_only.data();
      poison(io.out, stream.get());
      moejit::moe_forward(shape, r, stream.get(), kAuto);
      stream.sync();
      CHECK(same_bits(io.output(), auto_bits));
      TensorView out(read_only.data(), 0, {tokens, shape.hidden}, dl_bf16());
      moejit::MoeForwardArgs o = io.args(*model);
      o.out = out.dl();
      e = expect_refused(io, o, stream.get(), kAuto, ErrorCode::kInvalidArgument);
      CHECK_THAT(e, Contains("moe_forward: out: expected memory mapped on device 0"));
      CHECK_THAT(e, Contains("read-write for it"));
      CHECK_THAT(e, Contains("mapped read-only for device 0, for a buffer the kernels write"));
    }
  }
  // A reservation mapped without access for this device is refused as an input.
  {
    ChunkedBuffer no_access(model->w2.bytes(), false);
    const unsigned flags = access_at(no_access.ptr());
    INFO("access flags of a mapping given no access: " << flags);
    REQUIRE(flags == CU_POINTER_ATTRIBUTE_ACCESS_FLAG_NONE);
    moejit::MoeForwardArgs n = io.args(*model);
    n.weights.w2 = no_access.data();
    e = expect_refused(io, n, stream.get(), kAuto, ErrorCode::kInvalidArgument);
    CHECK_THAT(e, Contains("moe_forward: weights.w2: expected memory mapped on device 0"));
    CHECK_THAT(e, Contains("mapped without access for device 0"));
  }

  // Captured into a graph with the output allocated inside the capture (cuMemAllocAsync: an
  // address, and no memory until the graph runs): the checks pass it, and the graph gives the
  // eager bits.
  {
    CUgraph graph = nullptr;
    MOEJIT_TEST_CU(cu().cuStreamBeginCapture(stream.get(), CU_STREAM_CAPTURE_MODE_GLOBAL));
    CUdeviceptr in_graph = 0;
    std::string failure;
    const CUresult allocated = cu().cuMemAllocAsync(&in_graph, io.out.bytes(), stream.get());
    if (allocated == CUDA_SUCCESS) {
      TensorView out(reinterpret_cast<void*>(static_cast<uintptr_t>(in_graph)), 0,
                     {tokens, shape.hidden}, dl_bf16());
      moejit::MoeForwardArgs g = io.args(*model);
      g.out = out.dl();
      try {
        moejit::moe_forward(shape, g, stream.get(), kAuto);
      } catch (const Error& err) {
        failure = err.what();
      }
      cu().cuMemcpyDtoDAsync(io.out.ptr(), in_graph, io.out.bytes(), stream.get());
      cu().cuMemFreeAsync(in_graph, stream.get());
    }
    const CUresult ended = cu().cuStreamEndCapture(stream.get(), &graph);
    INFO("cuMemAllocAsync in the capture: " << moejit::detail::describe(allocated));
    REQUIRE(allocated == CUDA_SUCCESS);
    INFO("moe_forward in the capture: " << failure);
    REQUIRE(failure.empty());
    MOEJIT_TEST_CU(ended);
    CUgraphExec exec = nullptr;
    const CUresult instantiated = cu().cuGraphInstantiate(&exec, graph, 0);
    if (instantiated != CUDA_SUCCESS) cu().cuGraphDestroy(graph);
    MOEJIT_TEST_CU(instantiated);
    poison(io.out, stream.get());
    MOEJIT_TEST_CU(cu().cuGraphLaunch(exec, stream.get()));
    stream.sync();
    CHECK(same_bits(io.output(), auto_bits));
    cu().cuGraphExecDestroy(exec);
    cu().cuGraphDestroy(graph);
  }

  // The output in pinned host memory passes (the kernels write it over the bus).
  {
    void* host = nullptr;
    const std::size_t out_bytes = io.out.bytes();
    MOEJIT_TEST_CU(cu().cuMemAllocHost(&host, out_bytes));
    std::memset(host, 0xFF, out_bytes);
    TensorView out(host, 0, {tokens, shape.hidden}, dl_bf16());
    moejit::MoeForwardArgs h = io.args(*model);
    h.out = out.dl();
    moejit::moe_forward(shape, h, stream.get(), kAuto);
    stream.sync();
    std::vector<uint16_t> bits(auto_bits.size());
    std::memcpy(bits.data(), host, bits.size() * 2);
    cu().cuMemFreeHost(host);
    CHECK(same_bits(bits, auto_bits));
  }

  // The output in managed memory passes.
  {
    CUdeviceptr managed = 0;
    MOEJIT_TEST_CU(cu().cuMemAllocManaged(&managed, io.out.bytes(), CU_MEM_ATTACH_GLOBAL));
    TensorView out(reinterpret_cast<void*>(static_cast<uintptr_t>(managed)), 0,
                   {tokens, shape.hidden}, dl_bf16());
    moejit::MoeForwardArgs m = io.args(*model);
    m.out = out.dl();
    poison(io.out, stream.get());
    std::string failure;
    try {
      moejit::moe_forward(shape, m, stream.get(), kAuto);
      MOEJIT_TEST_CU(cu().cuMemcpyDtoDAsync(io.out.ptr(), managed, io.out.bytes(), stream.get()));
    } catch (const Error& err) {
      failure = err.what();
    }
    stream.sync();
    cu().cuMemFree(managed);
    INFO("moe_forward with a managed output: " << failure);
    CHECK(failure.empty());
    CHECK(same_bits(io.output(), auto_bits));
  }

  // The hidden rows and the output from the device's stream-ordered pool, outside any capture
  // (cuMemAllocAsync, as torch's cudaMallocAsync backend allocates), pass: the driver knows
  // them as live device memory of this device.
  {
    CUdeviceptr pooled_hidden = 0;
    CUdeviceptr pooled_out = 0;
    MOEJIT_TEST_CU(cu().cuMemAllocAsync(&pooled_hidden, io.hidden.bytes(), stream.get()));
    MOEJIT_TEST_CU(cu().cuMemAllocAsync(&pooled_out, io.out.bytes(), stream.get()));
    MOEJIT_TEST_CU(
        cu().cuMemcpyDtoDAsync(pooled_hidden, io.hidden.ptr(), io.hidden.bytes(), stream.get()));
    TensorView hidden(reinterpret_cast<void*>(static_cast<uintptr_t>(pooled_hidden)), 0,
                      {tokens, shape.hidden}, dl_bf16());
    TensorView out(reinterpret_cast<void*>(static_cast<uintptr_t>(pooled_out)), 0,
                   {tokens, shape.hidden}, dl_bf16());
    moejit::MoeForwardArgs p = io.args(*model);
    p.hidden = hidden.dl();
    p.out = out.dl();
    poison(io.out, stream.get());
    std::string failure;
    try {
      moejit::moe_forward(shape, p, stream.get(), kAuto);
      MOEJIT_TEST_CU(
          cu().cuMemcpyDtoDAsync(io.out.ptr(), pooled_out, io.out.bytes(), stream.get()));
    } catch (const Error& err) {
      failure = err.what();
    }
    cu().cuMemFreeAsync(pooled_out, stream.get());
    cu().cuMemFreeAsync(pooled_hidden, stream.get());
    stream.sync();
    INFO("moe_forward on pool allocations: " << failure);
    CHECK(failure.empty());
    CHECK(same_bits(io.output(), auto_bits));
  }

  // Refused, named, and nothing launched (the output is still the poison):
  // a workspace in plain host memory,
  {
    std::vector<std::uint8_t> host(io.workspace_bytes + 256);
    moejit::MoeForwardArgs w = io.args(*model);
    w.workspace = host.data() + (256 - reinterpret_cast<uintptr_t>(host.data()) % 256) % 256;
    e = expect_refused(io, w, stream.get(), kAuto, ErrorCode::kInvalidArgument);
    CHECK_THAT(e, Contains("moe_forward: workspace: expected memory mapped on device 0"));
    CHECK_THAT(e, Contains("memory CUDA does not know"));
  }
  // FC1's weights starting 4 MiB into their allocation (so running 4 MiB past its end),
  {
    REQUIRE(model->w13.bytes() > (std::size_t{4} << 20));
    moejit::MoeForwardArgs w = io.args(*model);
    w.weights.w13 = static_cast<char*>(model->w13.data()) + (std::size_t{4} << 20);
    e = expect_refused(io, w, stream.get(), kAuto, ErrorCode::kInvalidArgument);
    CHECK_THAT(e, Contains("weights.w13"));
    CHECK_THAT(e, Contains("bytes before the buffer does"));
  }
  // and the hidden rows in freed device memory.
  {
    void* freed = nullptr;
    {
      DeviceBuffer gone(io.hidden.bytes());
      freed = gone.data();
    }
    TensorView hidden(freed, 0, {tokens, shape.hidden}, dl_bf16());
    moejit::MoeForwardArgs w = io.args(*model);
    w.hidden = hidden.dl();
    e = expect_refused(io, w, stream.get(), kAuto, ErrorCode::kInvalidArgument);
    CHECK_THAT(e, Contains("moe_forward: hidden: expected"));
    CHECK_THAT(e, Contains("memory CUDA does not know"));
  }

  // The repack checks its target: FC2's target weights running into an unmapped chunk (a
  // reservation of their own, so no other buffer's bytes follow them and the overlap checks
  // pass).
  {
    auto t = allocate_model(shape);
    const DeviceCheckpoint dck(ck);
    ChunkedBuffer short_w2(t->w2.bytes());
    REQUIRE(t->w2.bytes() > short_w2.chunk());
    short_w2.unmap_last();
    MoeWeights into = t->weights();
    into.w2 = short_w2.data();
    try {
      dck.repack(*t, 0, shape.num_experts, 0, true, stream.get(), nullptr, &into);
      FAIL("the repack accepted FC2 target weights whose last chunk is not mapped");
    } catch (const Error& err) {
      CHECK(err.code() == ErrorCode::kInvalidArgument);
      CHECK_THAT(err.what(), Contains("moe_repack_separate: target.weights.w2: expected memory"));
      CHECK_THAT(err.what(), Contains("no memory at its last byte"));
    }
    // The whole target mapped: the same call passes the checks and repacks.
    CHECK(dck.repack(*t, 0, shape.num_experts, 0, true, stream.get()) == 0);
    CHECK(first_difference(t->w2.download<uint8_t>(t->w2.bytes()),
                           model->w2.download<uint8_t>(model->w2.bytes())) == -1);
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
  MOEJIT_TEST_SEEDED_RNG(seed, rng);
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

namespace {

// Runs this test binary's hidden case `tag` in a process of its own, under `timeout` (a hang
// ends there), with kChildCaseVariable set to `tag`: its output and its exit status (as waitpid
// gives it).
std::string run_child_case(const std::string& tag, int timeout_s, int* status) {
  char self[4096] = {};
  const ssize_t length = readlink("/proc/self/exe", self, sizeof(self) - 1);
  REQUIRE(length > 0);
  const std::string command = std::string(kChildCaseVariable) + "='" + tag + "' timeout " +
                              std::to_string(timeout_s) + " '" + std::string(self) + "' '[" + tag +
                              "]' 2>&1";
  FILE* pipe = popen(command.c_str(), "r");
  REQUIRE(pipe != nullptr);
  std::string output;
  char chunk[512];
  while (std::fgets(chunk, sizeof(chunk), pipe) != nullptr) output += chunk;
  *status = pclose(pipe);
  return output;
}

// A gpt-oss layout of two experts small enough to repack in a moment (H = 160, I = 96: K not a
// multiple of 64), named for the test that uses it.
ModelShape small_gpt_oss(const char* name) {
  ModelShape shape = reference_shape("gpt-oss-120b");
  shape.name = name;
  shape.num_experts = 2;
  shape.global_experts = 2;
  shape.hidden = 160;
  shape.intermediate = 96;
  shape.top_k = 2;
  return shape;
}

// The first n experts of a gpt-oss device checkpoint of hidden size h and intermediate size i,
// as the repack takes them (the views live as long as this object).
struct GptOssViews {
  GptOssViews(const DeviceCheckpoint& dck, int64_t n, int64_t h, int64_t i)
      : w13b(dck.w13_blocks.data(), 0, {n, 2 * i, h / 32, 16}, dl_u8()),
        w13s(dck.w13_scales.data(), 0, {n, 2 * i, h / 32}, dl_u8()),
        w2b(dck.w2_blocks.data(), 0, {n, h, i / 32, 16}, dl_u8()),
        w2s(dck.w2_scales.data(), 0, {n, h, i / 32}, dl_u8()) {}
  moejit::GptOssCheckpoint checkpoint() {
    moejit::GptOssCheckpoint c;
    c.w13_blocks = w13b.dl();
    c.w13_scales = w13s.dl();
    c.w2_blocks = w2b.dl();
    c.w2_scales = w2s.dl();
    return c;
  }
  TensorView w13b, w13s, w2b, w2s;
};

}  // namespace

// The repack reads the checkpoint while it writes the target: a target that shares a byte with
// a checkpoint tensor (an in-place attempt) or with another target would come out corrupt, so it
// is refused, naming both. And more checkpoint experts than the shape has room for from
// first_expert blames the checkpoint's leading extent, not a first_expert of 0.
TEST_CASE("moe repack: overlapping buffers and too many experts are refused, named",
          "[gpu][moe]") {
  gpu();
  TestStream stream;
  const ModelShape shape = small_gpt_oss("repack overlap");
  ModelShape stack = shape;
  stack.num_experts = 3;  // one expert more than the shape holds
  MOEJIT_TEST_SEEDED_RNG(seed, rng);
  const Checkpoint ck = make_checkpoint(stack, true, rng());
  const DeviceCheckpoint dck(ck);
  auto model = allocate_model(shape);
  const auto call = [&](int64_t n, const moejit::MoeRepackTarget& target) {
    GptOssViews views(dck, n, shape.hidden, shape.intermediate);
    try {
      moejit::moe_repack_gpt_oss(shape, views.checkpoint(), target, stream.get());
    } catch (const Error& e) {
      CHECK(e.code() == moejit::ErrorCode::kInvalidArgument);
      return std::string(e.what());
    }
    return std::string("(no error)");
  };
  moejit::MoeRepackTarget good;
  good.weights = model->weights();

  moejit::MoeRepackTarget in_place = good;
  in_place.weights.w13 = dck.w13_blocks.data();
  std::string what = call(2, in_place);
  INFO(what);
  CHECK(what.find("w13_blocks") != std::string::npos);
  CHECK(what.find("target.weights.w13") != std::string::npos);
  CHECK(what.find("overlaps") != std::string::npos);

  moejit::MoeRepackTarget shared = good;
  shared.weights.w2_scales = good.weights.w2;  // two targets in one buffer
  what = call(2, shared);
  CHECK(what.find("target.weights.w2") != std::string::npos);
  CHECK(what.find("overlaps") != std::string::npos);

  what = call(3, good);  // 3 experts into a shape of 2, first_expert 0
  CHECK(what.find("w13_blocks") != std::string::npos);
  CHECK(what.find("n = 3") != std::string::npos);

  // first_expert = E leaves no room for any expert: it is to blame, not the checkpoint.
  moejit::MoeRepackTarget past_end = good;
  past_end.first_expert = 2;
  what = call(1, past_end);
  CHECK(what.rfind("moe_repack_gpt_oss: target.first_expert: expected [first_expert, "
                   "first_expert + n) inside the shape's local experts [0, 2)",
                   0) == 0);
  CHECK(what.find("first_expert = 2 with n = 1 experts") != std::string::npos);

  CHECK(call(2, good) == "(no error)");
  stream.sync();
}

// The child half of the test after it, run only by it in a process of its own, where no kernel
// is loaded yet: FC1's repack kernel is loaded, FC2's is not, and the repack is called while its
// stream captures. FC2's lookup is then a capture miss, refused before FC1's repack launches (a
// launch there would have written half of the target): the capture holds no node. Prints one
// line with what it found; outside a capture the same call then repacks.
TEST_CASE("moe repack (child process): a capture miss on FC2's kernel launches nothing",
          "[.][repack_capture_child]") {
  if (!started_by_parent("repack_capture_child",
                         "moe repack: a capture miss on the second kernel launches neither")) {
    return;
  }
  gpu();
  TestStream stream;
  moejit::detail::Runtime& runtime = moejit::detail::Runtime::instance();
  moejit::KernelSpec fc1;
  fc1.family = moejit::Family::kRepack;
  fc1.arch = runtime.current_arch();
  fc1.params = moejit::detail::moe_repack_params(true);
  moejit::KernelSpec fc2 = fc1;
  fc2.params = moejit::detail::moe_repack_params(false);
  runtime.kernel(fc1, stream.get());  // loaded before the capture: a hit inside it

  const ModelShape shape = small_gpt_oss("repack capture miss");
  MOEJIT_TEST_SEEDED_RNG(seed, rng);
  std::printf("repack_capture_child: seed %llu\n", static_cast<unsigned long long>(seed));
  const Checkpoint ck = make_checkpoint(shape, true, rng());
  const DeviceCheckpoint dck(ck);
  auto model = allocate_model(shape);
  GptOssViews views(dck, 2, shape.hidden, shape.intermediate);
  const moejit::GptOssCheckpoint checkpoint = views.checkpoint();
  moejit::MoeRepackTarget target;
  target.weights = model->weights();

  CUgraph graph = nullptr;
  MOEJIT_TEST_CU(cu().cuStreamBeginCapture(stream.get(), CU_STREAM_CAPTURE_MODE_GLOBAL));
  ErrorCode code = ErrorCode::kInternal;
  std::string message;
  try {
    moejit::moe_repack_gpt_oss(shape, checkpoint, target, stream.get());
  } catch (const Error& e) {
    code = e.code();
    message = e.what();
  }
  MOEJIT_TEST_CU(cu().cuStreamEndCapture(stream.get(), &graph));
  REQUIRE(graph != nullptr);
  std::size_t nodes = 0;
  MOEJIT_TEST_CU(cu().cuGraphGetNodes(graph, nullptr, &nodes));
  cu().cuGraphDestroy(graph);
  std::printf("repack_capture_child: %s; %zu node(s) captured\n",
              code == ErrorCode::kCaptureMiss ? "capture miss" : "no capture miss", nodes);
  std::fflush(stdout);
  INFO(message);
  CHECK(code == ErrorCode::kCaptureMiss);
  CHECK_THAT(message, Catch::StartsWith("moe_repack_gpt_oss: kernel " + fc2.display_name()));
  CHECK(nodes == 0);

  // Outside a capture FC2's kernel loads and the repack writes the whole target.
  for (const DeviceBuffer* b : {&model->w13, &model->w13_scales, &model->w2, &model->w2_scales}) {
    poison(*b, stream.get(), 0xA5);
  }
  moejit::moe_repack_gpt_oss(shape, checkpoint, target, stream.get());
  stream.sync();
  std::string where;
  const int64_t mismatches = round_trip_mismatches(*model, ck, 0, &where);
  INFO(where);
  CHECK(mismatches == 0);
}

TEST_CASE("moe repack: a capture miss on the second kernel launches neither", "[gpu][moe]") {
  gpu();
  // The child is this binary, running the hidden case above in a process with nothing loaded.
  int status = 0;
  const std::string output = run_child_case("repack_capture_child", 300, &status);
  INFO("child output:\n" << output);
  REQUIRE(WIFEXITED(status));
  CHECK(WEXITSTATUS(status) == 0);
  const std::size_t line = output.find("repack_capture_child: capture miss; 0 node(s) captured");
  REQUIRE(line != std::string::npos);
  std::printf("moe repack: %s", output.substr(line, output.find('\n', line) - line + 1).c_str());
}

TEST_CASE("moe repack: scale bytes the kernels can't dequantize are counted", "[gpu][moe]") {
  gpu();
  TestStream stream;
  MOEJIT_TEST_SEEDED_RNG(seed, rng);
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
  MOEJIT_TEST_SEEDED_RNG(seed, rng);
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
  // The most local experts the route serves (kMaxRoutedLocalExperts): its one-CTA kernel at one
  // warp, 32 entries a thread, whose rank tables fill the 48 KB of static shared memory. Small H
  // and I keep its weights at ~0.7 GB.
  {
    ModelShape widest = reference_shape("qwen3-30b-a3b");
    widest.name = "route-widest";
    widest.num_experts = widest.global_experts = moejit::detail::kMaxRoutedLocalExperts;
    widest.hidden = 512;
    widest.intermediate = 256;
    widest.max_tokens = 4096;
    REQUIRE_FALSE(moejit::detail::find_shape_violation(widest).has_value());
    shapes.push_back(widest);
  }
  // marlin_moe's kernels only: this test forces that path.
  build_kernels(shapes, false);
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
      // The groups the route lists where the warpgroup tile runs on this arch (0: none).
      const moejit::detail::MoeForwardSpecs specs = moejit::detail::moe_forward_specs(
          config, moejit::detail::Runtime::instance().current_arch());
      const int group_rows =
          std::get<moejit::MoeRouteParams>(specs.route[specs.route_count - 1].params).group_rows;
      const int fc1_m_tiles = moejit::detail::marlin_moe_m_tiles(
          specs.fc1_params, moejit::detail::moe_weight_sizes(shape).fc1_m_atoms);
      // Hidden states of zero and equal top-k weights: only the ids matter here.
      Tokens tk;
      tk.count = tokens;
      tk.top_k = shape.top_k;
      tk.hidden_bits.assign(to_size(static_cast<int64_t>(tokens) * shape.hidden), 0);
      tk.weights.assign(to_size(static_cast<int64_t>(tokens) * shape.top_k),
                        1.0f / static_cast<float>(shape.top_k));
      for (auto& [label, ids] : route_id_cases(shape, tokens, rng, tokens <= 1000)) {
        INFO(shape.name << " T=" << tokens << " B=" << block << " G=" << group_rows << " ("
                        << (config.route_single ? "one launch" : "three launches") << ") "
                        << label);
        tk.ids.assign(ids.begin(), ids.end());
        ForwardIo io(shape, tk, moejit::moe_workspace_bytes(shape, tokens));
        const moejit::detail::RouteReference ref = moejit::detail::route_reference(
            ids, tokens, shape.top_k, shape.num_experts, shape.expert_offset, block, group_rows);
        REQUIRE(ref.max_blocks == ws.max_blocks);
        REQUIRE(ref.max_groups == (group_rows > 0 ? ws.max_groups : 0));
        std::vector<int32_t> first_rows;
        for (int run = 0; run < 3; ++run) {
          INFO("run " << run);
          poison(io.workspace, stream.get(), 0xA5);
          poison(io.out, stream.get());
          // Forced: these are marlin_moe's route arrays (the automatic path takes decode_moe
          // for T <= 256 on the shapes it serves).
          moejit::moe_forward(shape, io.args(*model), stream.get(), kMarlin);
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
          if (group_rows > 0) {
            CHECK(download_at<int32_t>(io.workspace, ws.expert_group_offset, e + 1) ==
                  ref.expert_group_offset);
            CHECK(download_at<int32_t>(io.workspace, ws.group_tiles, to_size(2 * ref.max_groups)) ==
                  ref.group_tiles);
          }
          // The GEMMs' per-tile counters over the poison: the route zeroed every one, then FC1
          // added one per M tile to each tile it served (the groups used, or the blocks used),
          // where FC2 waits on them.
          {
            const int used = group_rows > 0 ? ref.expert_group_offset[e] : ref.total_blocks;
            std::vector<uint32_t> expect(to_size(ref.max_blocks), 0u);
            if (specs.gemm_chain) {
              std::fill_n(expect.begin(), used, static_cast<uint32_t>(fc1_m_tiles));
            }
            CHECK(download_at<uint32_t>(io.workspace, ws.tile_done, expect.size()) == expect);
          }
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

// ---- A wait that can never end fails the launch instead of hanging the stream ----------------

// The child half of the test after it, run only by it in a process of its own (the trap it
// provokes ends that process's CUDA context): one marlin_moe call captured into a graph whose FC2
// node is edited to wait for a tile count FC1 never reaches, with a 0.2 s limit. Prints the
// synchronize's result and the time it took, then exits at once (0: the trap failed the launch
// after the limit; 3: anything else), so no destructor touches the dead context.
TEST_CASE("moe_forward (child process): FC2 waiting for a count that never comes traps",
          "[.][wait_trap_child]") {
  if (!started_by_parent("wait_trap_child",
                         "moe_forward: a wait that can never end fails the launch instead of "
                         "hanging")) {
    return;
  }
  gpu();
  TestStream stream;
  MOEJIT_TEST_SEEDED_RNG(seed, rng);
  const ModelShape shape = resized(reference_shape("qwen3-30b-a3b"), 32, 0, 32, 64);
  const int tokens = 24;
  prewarm_shapes({shape});
  const moejit::detail::MoeForwardSpecs specs =
      moejit::detail::moe_forward_specs(moejit::detail::choose_moe_config(shape, tokens),
                                        moejit::detail::Runtime::instance().current_arch());
  REQUIRE(specs.gemm_chain);
  auto model = allocate_model(shape);
  IdPlan plan;
  plan.lo = 0;
  plan.hi = shape.num_experts;
  const Tokens tk = make_tokens(shape, tokens, plan, rng);
  ForwardIo io(shape, tk, moejit::moe_workspace_bytes(shape, tokens));
  MoeForwardOptions marlin;
  marlin.path = MoePath::kMarlin;

  CUgraph graph = nullptr;
  MOEJIT_TEST_CU(cu().cuStreamBeginCapture(stream.get(), CU_STREAM_CAPTURE_MODE_GLOBAL));
  moejit::moe_forward(shape, io.args(*model), stream.get(), marlin);
  MOEJIT_TEST_CU(cu().cuStreamEndCapture(stream.get(), &graph));
  REQUIRE(graph != nullptr);
  // FC2's node: the kernel launched as FC2's spec (the launch passes the CUkernel as its
  // function; the node may hold it or the function it resolves to in this context).
  const CUkernel fc2 = moejit::detail::Runtime::instance().kernel(specs.fc2, stream.get());
  CUfunction fc2_function = nullptr;
  MOEJIT_TEST_CU(cu().cuKernelGetFunction(&fc2_function, fc2));
  std::size_t count = 0;
  MOEJIT_TEST_CU(cu().cuGraphGetNodes(graph, nullptr, &count));
  std::vector<CUgraphNode> nodes(count);
  MOEJIT_TEST_CU(cu().cuGraphGetNodes(graph, nodes.data(), &count));
  int edited = 0;
  for (CUgraphNode node : nodes) {
    CUgraphNodeType type{};
    MOEJIT_TEST_CU(cu().cuGraphNodeGetType(node, &type));
    if (type != CU_GRAPH_NODE_TYPE_KERNEL) continue;
    CUDA_KERNEL_NODE_PARAMS params{};
    MOEJIT_TEST_CU(cu().cuGraphKernelNodeGetParams(node, &params));
    const bool is_fc2 = params.func == fc2_function ||
                        params.func == reinterpret_cast<CUfunction>(fc2) || params.kern == fc2;
    if (!is_fc2) continue;
    REQUIRE(params.kernelParams != nullptr);
    moejit::kern::moe::MoeGemmParams gemm =
        *static_cast<const moejit::kern::moe::MoeGemmParams*>(params.kernelParams[0]);
    moejit::kern::moe::MoeGemmChain chain =
        *static_cast<const moejit::kern::moe::MoeGemmChain*>(params.kernelParams[1]);
    REQUIRE(chain.wait != nullptr);
    // REQUIRE, not CHECK: this process ends in _Exit, which would drop a failed CHECK.
    REQUIRE(chain.wait_limit_ns == moejit::kern::moe::kCounterWaitLimitNs);
    chain.wait_count = 0xFFFFFFFFu;
    chain.wait_limit_ns = 200ull * 1000 * 1000;
    void* args[] = {&gemm, &chain};
    params.kernelParams = args;
    params.extra = nullptr;
    MOEJIT_TEST_CU(cu().cuGraphKernelNodeSetParams(node, &params));
    ++edited;
  }
  REQUIRE(edited == 1);
  CUgraphExec exec = nullptr;
  MOEJIT_TEST_CU(cu().cuGraphInstantiate(&exec, graph, 0));
  const auto start = std::chrono::steady_clock::now();
  MOEJIT_TEST_CU(cu().cuGraphLaunch(exec, stream.get()));
  const CUresult result = cu().cuStreamSynchronize(stream.get());
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  const char* name = nullptr;
  cu().cuGetErrorName(result, &name);
  std::printf("wait_trap_child: synchronize returned %s after %.3f s\n",
              name != nullptr ? name : "?", seconds);
  std::fflush(stdout);
  // A trap reads as CUDA_ERROR_LAUNCH_FAILED, and only after the 0.2 s limit: a fault of the
  // edited launch itself would read otherwise or come sooner.
  std::_Exit(result == CUDA_ERROR_LAUNCH_FAILED && seconds >= 0.2 ? 0 : 3);
}

TEST_CASE("moe_forward: a wait that can never end fails the launch instead of hanging",
          "[gpu][moe]") {
  gpu();
  // The child is this binary, running the hidden case above; `timeout` bounds a hang.
  int status = 0;
  const std::string output = run_child_case("wait_trap_child", 120, &status);
  INFO("child output:\n" << output);
  REQUIRE(WIFEXITED(status));
  CHECK(WEXITSTATUS(status) == 0);
  const std::size_t line =
      output.find("wait_trap_child: synchronize returned CUDA_ERROR_LAUNCH_FAILED");
  REQUIRE(line != std::string::npos);
  std::printf("moe_forward: %s", output.substr(line).c_str());
}
