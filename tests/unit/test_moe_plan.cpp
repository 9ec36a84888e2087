// The MoE plan: the kernels every reference shape needs, the config chosen per T (and that it is
// always one plan_kernels lists, so a prewarm covers every call), the supports() refusals of the
// MoE families, their names, hashes and generated source, and the workspace and weight sizes.
// (decode_moe's own planning: test_decode_plan.cpp.)
#include <algorithm>
#include <catch2/catch.hpp>
#include <cfloat>
#include <climits>
#include <cmath>
#include <filesystem>
#include <functional>
#include <map>
#include <moejit/kern/moe/layout.cuh>
#include <moejit/kern/moe/route_params.cuh>
#include <nlohmann/json.hpp>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <unordered_set>
#include <variant>
#include <vector>

#include "capi/capi_guard.hpp"
#include "codegen/codegen.hpp"
#include "moejit/error.hpp"
#include "moejit/kernel_spec.hpp"
#include "moejit/moe.hpp"
#include "moejit/moejit.h"
#include "moejit/ops.hpp"
#include "moejit/runtime.hpp"
#include "moejit/shape.hpp"
#include "moejit/version.hpp"
#include "ops/moe_launch.hpp"
#include "plan/moe_plan.hpp"
#include "support/support.hpp"

namespace {

using moejit::Activation;
using moejit::ActivationKind;
using moejit::Arch;
using moejit::DType;
using moejit::Error;
using moejit::ErrorCode;
using moejit::Family;
using moejit::KernelSpec;
using moejit::MarlinMoeParams;
using moejit::ModelShape;
using moejit::MoeCombineParams;
using moejit::MoeGemmStage;
using moejit::MoeRepackParams;
using moejit::MoeRouteParams;
using moejit::NarrowIdsParams;
using moejit::RouteKernel;
namespace detail = moejit::detail;

bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

struct SpecHash {
  std::size_t operator()(const KernelSpec& spec) const noexcept { return spec.hash(); }
};
using SpecSet = std::unordered_set<KernelSpec, SpecHash>;

using moejit::test::find_shape;
using moejit::test::reference_shapes;

KernelSpec spec_of(Family family, moejit::FamilyParams params, const char* arch = "sm_90a") {
  KernelSpec spec;
  spec.family = family;
  spec.arch = Arch::parse(arch);
  spec.params = params;
  return spec;
}

// The measured tile of each T bucket: block_m, block_n, block_k, stages, warps m/n/k, min blocks.
struct Tile {
  int m, n, k, stages, wm, wn, wk, occupancy;
};

Tile tile_of(const MarlinMoeParams& p) {
  return Tile{p.block_m, p.block_n, p.block_k, p.stages,
              p.warps_m, p.warps_n, p.warps_k, p.min_blocks_per_sm};
}

bool same_tile(const Tile& a, const Tile& b) {
  return a.m == b.m && a.n == b.n && a.k == b.k && a.stages == b.stages && a.wm == b.wm &&
         a.wn == b.wn && a.wk == b.wk && a.occupancy == b.occupancy;
}

MarlinMoeParams fc1_of(const ModelShape& shape, int tokens) {
  return detail::choose_moe_config(shape, tokens).fc1;
}

// A valid FC1 spec to break one field of.
MarlinMoeParams good_fc1() {
  MarlinMoeParams p;
  p.stage = MoeGemmStage::kFc1;
  p.block_m = 64;
  p.block_n = 8;
  p.block_k = 256;
  p.stages = 4;
  p.warps_m = 4;
  p.warps_n = 1;
  p.warps_k = 1;
  p.min_blocks_per_sm = 4;
  p.early_weights = false;
  p.has_bias = true;
  p.activation.kind = ActivationKind::kGptOss;
  p.activation.limit = 7.f;
  p.activation.alpha = 1.702f;
  p.out_dtype = DType::kBF16;
  return p;
}

MarlinMoeParams good_fc2() {
  MarlinMoeParams p = good_fc1();
  p.stage = MoeGemmStage::kFc2;
  p.early_weights = true;
  p.activation = Activation{};
  p.out_dtype = DType::kF32;
  return p;
}

// A valid FC1 spec of the sm_90a warpgroup main loop (the planner's prefill tile).
MarlinMoeParams good_wgmma_fc1() {
  MarlinMoeParams p = good_fc1();
  p.block_m = 128;
  p.block_n = 64;
  p.block_k = 64;
  p.warps_m = 8;
  p.min_blocks_per_sm = 2;
  p.wgmma_n = 128;
  return p;
}

MoeRouteParams good_route() {
  MoeRouteParams p;
  p.kernel = RouteKernel::kSingle;
  p.num_experts = 128;
  p.top_k = 4;
  p.block_m = 8;
  p.block_threads = 1024;
  p.chunk_rows = 1024;
  return p;
}

MoeCombineParams good_combine() {
  MoeCombineParams p;
  p.hidden = 2880;
  p.top_k = 4;
  p.in_dtype = DType::kF32;
  p.block_threads = 256;
  return p;
}

// supports() of a spec built from `params` must name every part of `expected`.
void expect_refused(Family family, const moejit::FamilyParams& params,
                    const std::vector<std::string>& expected, const char* arch = "sm_90a") {
  const KernelSpec spec = spec_of(family, params, arch);
  const std::string reason = moejit::supports(spec);
  INFO(spec.display_name() << " -> \"" << reason << "\"");
  REQUIRE_FALSE(reason.empty());
  CHECK(contains(reason, spec.display_name()));
  for (const std::string& part : expected) CHECK(contains(reason, part));
  // Codegen refuses the same spec, with the same reason, before anything compiles.
  try {
    detail::render(spec);
    FAIL("render accepted " << spec.display_name());
  } catch (const Error& e) {
    CHECK(e.code() == ErrorCode::kUnsupported);
    CHECK(contains(e.what(), reason));
  }
}

}  // namespace

TEST_CASE("moe plan: every reference shape gets repack, route, FC1, FC2 and combine", "[plan]") {
  // decode_moe kernels (reset, main, combine) for T <= 256 on sm_90+: three per tile the planner
  // picks over T: block_n 8 below T = 6, then 8 FC1 strips with two CTAs per SM, then 8 with three
  // from T = 16, and block_n 32 where experts average 12 positions (the qwen shapes at large T).
  // gpt-oss: none (H = 2880 is not a multiple of 256, and biases).
  // The two-launch pair adds fc1 and fc2 for T = 1 and for T = 2 where it serves the shape (not
  // qwen2-57b: I = 2560 leaves fc2 fewer than 8 units of shared memory).
  const std::map<std::string, int> decode_kernels = {{"gpt-oss-120b", 0},
                                                     {"gpt-oss-20b", 0},
                                                     {"kimi-k3.1-tp8", 9 + 4},
                                                     {"kimi-k3.1-tp4-ep2", 9 + 4},
                                                     {"kimi-k3.1-tp4-ep2-rank1", 9 + 4},
                                                     {"deepseek-v4-flash-tp4", 9 + 4},
                                                     {"deepseek-v4.1-flash-tp4", 9 + 4},
                                                     {"qwen3-30b-a3b", 12 + 4},
                                                     {"qwen2-57b-a14b", 12}};
  for (const ModelShape& shape : reference_shapes()) {
    INFO(shape.name);
    REQUIRE(decode_kernels.count(shape.name) == 1);
    // sm_86, sm_89 and sm_120 allow 99 KB of shared memory a CTA, not 227: every kernel planned
    // there must still fit (the widest mma.sync tile runs with fewer stages).
    for (const char* arch : {"sm_90a", "sm_100a", "sm_80", "sm_86", "sm_89", "sm_120"}) {
      const std::vector<KernelSpec> specs = moejit::plan_kernels(shape, Arch::parse(arch));
      std::map<Family, int> count;
      std::set<std::pair<int, int>> fc1_tiles;
      std::set<int> route_blocks;
      std::set<RouteKernel> route_kernels;
      int rank_kernels = 0;
      for (const KernelSpec& spec : specs) {
        INFO(spec.display_name());
        CHECK(moejit::supports(spec).empty());
        CHECK(spec.arch == Arch::parse(arch));
        ++count[spec.family];
        if (const auto* p = std::get_if<MarlinMoeParams>(&spec.params)) {
          if (p->stage == MoeGemmStage::kFc1) {
            fc1_tiles.insert({p->block_m, p->block_n});
            CHECK(p->activation.kind == shape.activation.kind);
            CHECK_FALSE(p->early_weights);
            CHECK(p->out_dtype == DType::kBF16);
          } else {
            CHECK(p->early_weights);
            // bf16 rows on every tile, fp32 partial rows where FC2 splits K
            CHECK(p->out_dtype == (p->k_splits > 1 ? DType::kF32 : DType::kBF16));
          }
          CHECK(p->has_bias == shape.has_bias);
        }
        if (const auto* p = std::get_if<MoeRouteParams>(&spec.params)) {
          CHECK(p->num_experts == shape.num_experts);
          CHECK(p->top_k == shape.top_k);
          route_blocks.insert(p->block_m);
          route_kernels.insert(p->kernel);
          // The rank kernel ignores the block size: one kernel serves every block size.
          if (p->kernel == RouteKernel::kRank) {
            CHECK(p->block_m == 8);
            ++rank_kernels;
          }
        }
        if (const auto* p = std::get_if<MoeCombineParams>(&spec.params)) {
          CHECK(p->hidden == shape.hidden);
          CHECK(p->top_k == shape.top_k);
        }
      }
      // Distinct specs only.
      const SpecSet distinct(specs.begin(), specs.end());
      CHECK(distinct.size() == specs.size());
      // Five measured tiles (T = 1, 8-row blocks, 16-row blocks up to T = 512, T <= 1024,
      // above), FC1 and FC2 each. On sm_90a the warpgroup tile (block_m 128) replaces the last
      // two, and the 16-row one from T * K >= 12 * routed experts (14 where H is a multiple of
      // 256, FC1's wide-K tile): for part of those T on gpt-oss-120b (T >= 384), qwen3-30b-a3b
      // (T >= 224), gpt-oss-20b (T >= 96) and qwen2-57b-a14b (T >= 112; 16-row blocks from
      // T = 49), which so plan both, never on the kimi shapes (T >= 784), deepseek-v4-flash-tp4
      // (T >= 598) or deepseek-v4.1-flash-tp4 (T >= 896).
      const bool sm90a = std::string(arch) == "sm_90a";
      const moejit::test::MidBucketTiles mid = moejit::test::mid_bucket_tiles(shape);
      const bool both_mid = sm90a && mid.mma && mid.wgmma;
      CHECK(both_mid ==
            (sm90a && shape.name.rfind("kimi", 0) != 0 && shape.name.rfind("deepseek", 0) != 0));
      // 32-row blocks (T = 513..1024) and 64-row ones (above) take N = 64 below 56 rows per
      // expert, N = 128 from 56, and 64-row blocks N = 256 from 384 where min(H, I) >= 40 K
      // tiles of 64: with 32-row blocks qwen3-30b-a3b (32-64 rows) plans two widths; with 64-row
      // ones every shape whose T = 1025 has fewer than 56 (all but qwen3-30b-a3b, gpt-oss-20b and
      // qwen2-57b-a14b) plans N = 64, and those with K that long whose T = 16384 reaches 384
      // (gpt-oss-120b 512, gpt-oss-20b 2048, qwen2-57b-a14b 2048; not deepseek-v4-flash-tp4,
      // 384 rows but I = 512, nor qwen3-30b-a3b, 1024 rows but I = 768) N = 256.
      const moejit::test::WideTiles wide = moejit::test::wide_tiles(shape, 513, 1024);
      const int wide_extra = sm90a ? 2 * (wide.count() - 1) : 0;
      CHECK(wide_extra == (sm90a && shape.name == "qwen3-30b-a3b" ? 2 : 0));
      const moejit::test::WideTiles prefill = moejit::test::wide_tiles(shape, 1025, INT_MAX);
      const int prefill_extra = sm90a ? 2 * (prefill.count() - 1) : 0;
      if (sm90a) {
        CHECK(prefill.n64 == (shape.name != "qwen3-30b-a3b" && shape.name != "gpt-oss-20b" &&
                              shape.name != "qwen2-57b-a14b"));
        CHECK(prefill.n128);
        CHECK(prefill.n256 ==
              (shape.name.rfind("gpt-oss", 0) == 0 || shape.name == "qwen2-57b-a14b"));
      }
      // With 8-row blocks FC1 takes 128 rows from 792 CTAs (fc1_tall_expected), and FC1 and FC2
      // the 64-row tile's wave variant from one wave (small_block_wave_expected): each further
      // tile the T of 8-row blocks use plans one kernel more.
      const moejit::test::BucketTiles fc1_small = moejit::test::fc1_bucket_tiles(shape);
      const moejit::test::BucketTiles fc2_small = moejit::test::fc2_bucket_tiles(shape);
      const int small_extra =
          std::max(fc1_small.count() - 1, 0) + std::max(fc2_small.count() - 1, 0);
      const int mid_extra = both_mid ? (moejit::test::fc2_mid_short_k_expected(shape) ? 1 : 2) : 0;
      // And FC2 with its K split, where its CTAs fill under 0.9 of a wave (gpt-oss at T = 1).
      const int split_extra = static_cast<int>(moejit::test::fc2_split_kernels(shape).size());
      CHECK(split_extra == (shape.name.rfind("gpt-oss", 0) == 0 ? 1 : 0));
      CHECK(count[Family::kMarlinMoe] ==
            10 + mid_extra + wide_extra + prefill_extra + small_extra + split_extra);
      CHECK(count[Family::kMarlinMoe] == moejit::test::planned_marlin_kernels(shape, sm90a));
      // (16-row blocks: block_m 128 on both the mma.sync tile and the warpgroup one.)
      std::set<std::pair<int, int>> tiles{{32, 8}, {128, 16}, {64, 32}, {128, 64}};
      if (fc1_small.base || fc1_small.wave) tiles.insert({64, 8});
      if (fc1_small.tall) tiles.insert({128, 8});
      if (sm90a) {
        tiles.erase({64, 32});
        tiles.insert({128, 32});
      }
      CHECK(fc1_tiles == tiles);
      CHECK(route_blocks == std::set<int>{8, 16, 32, 64});
      // max_tokens 16384 with K >= 4: both the one-launch and the three-launch route paths.
      CHECK(route_kernels == std::set<RouteKernel>{RouteKernel::kSingle, RouteKernel::kRank,
                                                   RouteKernel::kScan, RouteKernel::kScatter});
      // One rank kernel per chunk size (the planner's two: 1024 and 4096 entries).
      CHECK(rank_kernels == 2);
      CHECK(count[Family::kRepack] == 2);
      // Small-T and large-T CTAs, over bf16 rows from every FC2 tile, and one for each set of
      // fp32 split rows (gpt-oss at T = 1).
      CHECK(count[Family::kCombine] == 2 + moejit::test::fc2_split_combines(shape));
      CHECK(moejit::test::fc2_split_combines(shape) ==
            (shape.name.rfind("gpt-oss", 0) == 0 ? 1 : 0));
      CHECK(count[Family::kNarrowIds] == (shape.id_dtype == DType::kI64 ? 1 : 0));
      CHECK(count[Family::kAppendShared] == (shape.shared.count > 0 ? 1 : 0));
      // decode_moe needs sm_90: an sm_80 prewarm plans none. On sm_120 it plans the tiles that
      // fit 99 KB (decode_moe_runs_on), a subset of the 227 KB archs' ones.
      const Arch a = Arch::parse(arch);
      if (a.sm == 120) {
        CHECK(count[Family::kDecodeMoe] <= decode_kernels.at(shape.name));
      } else {
        CHECK(count[Family::kDecodeMoe] == (a.sm >= 90 ? decode_kernels.at(shape.name) : 0));
      }
    }
  }
}

TEST_CASE("moe plan: the config for every T in 1..16384 is one plan_kernels lists", "[plan]") {
  std::vector<ModelShape> shapes = reference_shapes();
  // An int64-id shape, and one with a small max_tokens (fewer buckets planned).
  ModelShape wide = find_shape(shapes, "qwen3-30b-a3b");
  wide.name = "qwen3-int64-ids";
  wide.id_dtype = DType::kI64;
  shapes.push_back(wide);
  ModelShape small = find_shape(shapes, "deepseek-v4-flash-tp4");
  small.name = "deepseek-max-300";
  small.max_tokens = 300;
  shapes.push_back(small);
  const Arch arch = Arch::parse("sm_90a");
  for (const ModelShape& shape : shapes) {
    INFO(shape.name);
    const std::vector<KernelSpec> planned = moejit::plan_kernels(shape, arch);
    const SpecSet plan(planned.begin(), planned.end());
    SpecSet used;
    int misses = 0;
    for (int tokens = 1; tokens <= shape.max_tokens; ++tokens) {
      const detail::MoeForwardConfig config = detail::choose_moe_config(shape, tokens);
      for (const KernelSpec& spec : detail::moe_config_specs(config, arch)) {
        used.insert(spec);
        if (plan.count(spec) == 0 && ++misses <= 5) {
          FAIL_CHECK("T = " << tokens << " uses " << spec.display_name()
                            << ", which plan_kernels does not list");
        }
      }
    }
    CHECK(misses == 0);
    // And nothing is planned that no T uses (besides repack and append_shared).
    for (const KernelSpec& spec : planned) {
      if (spec.family == Family::kRepack || spec.family == Family::kAppendShared) continue;
      INFO(spec.display_name());
      CHECK(used.count(spec) == 1);
    }
  }
}

TEST_CASE("moe plan: public shapes beyond the reference set plan valid kernels on every arch",
          "[plan]") {
  // tools/shapes/public.json: top-k 1 and 2, 8-60 experts, I = 1408, 6400 and 14336. Every T's
  // kernels are ones plan_kernels lists (what prewarm compiles), and each is valid for its arch.
  for (const ModelShape& shape : moejit::test::public_shapes()) {
    INFO(shape.name);
    for (const char* name : {"sm_90a", "sm_89", "sm_80", "sm_120"}) {
      INFO(name);
      const Arch arch = Arch::parse(name);
      const std::vector<KernelSpec> planned = moejit::plan_kernels(shape, arch);
      for (const KernelSpec& spec : planned) {
        INFO(spec.display_name());
        CHECK(moejit::supports(spec).empty());
      }
      const SpecSet plan(planned.begin(), planned.end());
      int misses = 0;
      for (int tokens = 1; tokens <= shape.max_tokens; tokens += tokens < 64 ? 1 : 37) {
        const detail::MoeForwardConfig config = detail::choose_moe_config(shape, tokens);
        for (const KernelSpec& spec : detail::moe_config_specs(config, arch)) {
          if (plan.count(spec) == 0 && ++misses <= 5) {
            FAIL_CHECK("T = " << tokens << " uses " << spec.display_name()
                              << ", which plan_kernels does not list");
          }
        }
      }
      CHECK(misses == 0);
    }
  }
}

TEST_CASE("moe plan: FC2 splits a long K where its CTAs fill under 0.9 of a wave", "[plan]") {
  // Reference shapes: only gpt-oss-120b and gpt-oss-20b at T = 1 (four experts x 90 CTAs of
  // 32 rows: 0.68 of the 528 slots; two splits of 6 K tiles fill a wave). Short-K shapes never,
  // and never the warpgroup FC2.
  for (const ModelShape& shape : reference_shapes()) {
    INFO(shape.name);
    const bool gpt_oss = shape.name == "gpt-oss-120b" || shape.name == "gpt-oss-20b";
    for (int t = 1; t <= 300; ++t) {
      INFO("T = " << t);
      const detail::MoeForwardConfig c = detail::choose_moe_config(shape, t);
      CHECK(c.fc2.k_splits == (gpt_oss && t == 1 ? 2 : 1));
      CHECK(c.combine.k_splits == c.fc2.k_splits);
      CHECK(c.fc2_wgmma.k_splits == 1);
    }
  }
  // Public shapes with few experts and a long K: at T = 1 llama-4-scout's one expert gives FC2
  // H / 32 = 160 CTAs for 528 slots (0.30 of a wave: four splits of 8 K tiles); mixtral-8x7b's and
  // phi-3.5-moe's two experts 2 x 128 = 256 (0.48: three splits). Where the splits apply, FC2
  // writes fp32 rows, combine adds as many sets, and each split holds at least a ring of K tiles.
  const std::vector<ModelShape> shapes = moejit::test::public_shapes();
  const std::vector<std::pair<std::string, int>> at_t1 = {
      {"llama-4-scout", 4}, {"mixtral-8x7b", 3}, {"phi-3.5-moe", 3}, {"deepseek-v3", 1},
      {"qwen3-235b-a22b", 1}, {"qwen1.5-moe-a2.7b", 1}, {"olmoe-1b-7b", 1},
      {"granite-3.0-3b-a800m", 1}};
  for (const auto& [name, splits] : at_t1) {
    INFO(name);
    CHECK(detail::choose_moe_config(find_shape(shapes, name), 1).fc2.k_splits == splits);
  }
  for (const ModelShape& shape : shapes) {
    INFO(shape.name);
    for (int t = 1; t <= 400; ++t) {
      INFO("T = " << t);
      const detail::MoeForwardConfig c = detail::choose_moe_config(shape, t);
      CHECK(c.combine.k_splits == c.fc2.k_splits);
      CHECK(c.combine_wgmma.k_splits == (c.wgmma ? c.fc2_wgmma.k_splits : c.fc2.k_splits));
      // The warpgroup FC2 splits only mixtral-8x7b's (8 experts x 32 CTAs of 128 rows, 0.48 of
      // a wave: 3 splits), from 14 rows an expert (T = 56) to T = 256.
      if (c.wgmma) {
        const bool mixtral_split = shape.name == "mixtral-8x7b" && t <= 256;
        CHECK(c.fc2_wgmma.k_splits == (mixtral_split ? 3 : 1));
        CHECK(c.fc2_wgmma.out_dtype == (mixtral_split ? DType::kF32 : DType::kBF16));
        CHECK(c.combine_wgmma.in_dtype == c.fc2_wgmma.out_dtype);
        if (mixtral_split) {
          const detail::MoeWorkspaceLayout w = detail::moe_workspace_layout(shape, c);
          CHECK(w.marlin_bytes >= w.out2 + 3u * static_cast<std::size_t>(w.max_groups) *
                                               c.fc2_wgmma.wgmma_n * shape.hidden * 4);
          CHECK(moejit::moe_workspace_bytes(shape, t) >= w.bytes);
        }
      }
      if (c.fc2.k_splits == 1) continue;
      CHECK(t <= 256);
      CHECK(shape.intermediate > 768);
      CHECK(c.fc2.out_dtype == DType::kF32);
      CHECK(c.combine.in_dtype == DType::kF32);
      const int k_atoms = (shape.intermediate + 63) / 64;
      const int atoms_per_tile = c.fc2.block_k / 64;
      const int k_tiles = (k_atoms + atoms_per_tile - 1) / atoms_per_tile;
      const int per = (k_tiles + c.fc2.k_splits - 1) / c.fc2.k_splits;
      CHECK(per >= c.fc2.stages);
      CHECK((c.fc2.k_splits - 1) * per < k_tiles);  // no split is empty
      // The workspace holds k_splits sets of fp32 rows.
      const detail::MoeWorkspaceLayout w = detail::moe_workspace_layout(shape, c);
      CHECK(w.marlin_bytes >= w.out2 + static_cast<std::size_t>(c.fc2.k_splits) *
                                           w.padded_rows * shape.hidden * 4);
      CHECK(moejit::moe_workspace_bytes(shape, t) >= w.bytes);
    }
  }
}

TEST_CASE("moe plan: FC2 over a short K takes taller, 128-K tiles from T = 3 to 512", "[plan]") {
  // Where I <= 768 the 8-row bucket's 64-row CTA would run 1-3 K tiles of 256; FC2 (only FC2:
  // FC1's K is H) takes eight warps on 256 rows over 128-wide K tiles, with the bucket's route
  // block. With 16-row blocks, 256 rows over four warps of four atoms where those CTAs fill four
  // waves from the bucket's first T (deepseek and kimi), else the bucket's own tile, 128 rows
  // over 128-wide K tiles, at six CTAs per SM instead of four (qwen3-30b-a3b).
  const Tile n8{256, 8, 128, 3, 8, 1, 1, 3};
  const Tile n16{128, 16, 128, 2, 4, 1, 1, 4};
  const Tile n16_six{128, 16, 128, 2, 4, 1, 1, 6};  // the bucket's tile at six CTAs per SM
  const Tile n16_tall{256, 16, 128, 3, 4, 1, 1, 3};
  int short_shapes = 0;
  int mid_short_shapes = 0;
  int long_shapes = 0;
  int short_beside_wgmma = 0;
  for (const ModelShape& shape : reference_shapes()) {
    INFO(shape.name);
    const bool short_k = shape.intermediate <= 768;
    ++(short_k ? short_shapes : long_shapes);
    const bool mid_short = moejit::test::fc2_mid_short_k_expected(shape);
    if (mid_short) ++mid_short_shapes;
    CHECK(mid_short == (shape.name.rfind("kimi", 0) == 0 || shape.name.rfind("deepseek", 0) == 0));
    for (int tokens : {1, 2, 3, 24, 48, 49, 160, 161, 256, 257, 336, 337, 512, 513, 1024, 4096}) {
      INFO("T = " << tokens);
      const detail::MoeForwardConfig c = detail::choose_moe_config(shape, tokens);
      const bool small = moejit::test::small_blocks_expected(shape, tokens);
      if (short_k && tokens >= 3 && (small || tokens <= 512)) {
        CHECK(same_tile(tile_of(c.fc2), small ? n8 : (mid_short ? n16_tall : n16_six)));
      } else if (small) {  // the tall tile, the wave tile or the bucket's over H rows
        Tile expected{64, 8, 256, 4, 4, 1, 1, 4};
        if (moejit::test::fc2_tall_expected(shape, tokens)) {
          expected = Tile{128, 8, 128, 4, 4, 1, 1, 4};
        } else if (moejit::test::small_block_wave_expected(shape, tokens, shape.hidden)) {
          expected = Tile{64, 8, 256, 3, 4, 1, 1, 5};
        }
        CHECK(same_tile(tile_of(c.fc2), expected));
      } else if (c.fc1.block_n == 16 && shape.hidden % 256 == 0) {
        // FC1 alone takes 256-wide K stages there (the test case below); FC2 keeps the bucket's.
        CHECK(same_tile(tile_of(c.fc2), n16));
      } else {
        CHECK(same_tile(tile_of(c.fc2), tile_of(c.fc1)));
      }
      CHECK(c.fc2.block_n == c.route.block_m);
      for (const char* arch : {"sm_90a", "sm_80"}) {
        CHECK(moejit::supports(spec_of(Family::kMarlinMoe, c.fc2, arch)).empty());
      }
      // The short-K tile stays FC2's on sm_90a too, where FC1 runs the warpgroup tile (the
      // resized deepseek-v4-flash-tp4 below).
      const bool short_tile =
          short_k && tokens >= 3 && (small || tokens <= 512) && (small || mid_short);
      CHECK(c.fc2_short_k == short_tile);
      const detail::MoeForwardSpecs on_90a = detail::moe_forward_specs(c, Arch::parse("sm_90a"));
      if (short_tile) {
        CHECK(on_90a.fc2_params == c.fc2);
        CHECK(on_90a.fc1_params == (c.wgmma ? c.fc1_wgmma : c.fc1));
        CHECK(std::get<MoeCombineParams>(on_90a.combine.params) == c.combine);
        if (c.wgmma) ++short_beside_wgmma;
      }
    }
  }
  // No reference shape pairs them now (deepseek-v4-flash-tp4 reaches 14 rows per expert only
  // past the bucket); the resized shape below does.
  CHECK(short_beside_wgmma == 0);
  // Both sides of the rule among the reference shapes (deepseek, kimi, qwen3; gpt-oss, qwen2).
  CHECK(short_shapes >= 3);
  CHECK(mid_short_shapes >= 2);
  CHECK(short_shapes > mid_short_shapes);
  // The GPU test of this tile runs kimi-k3.1-tp8 and deepseek-v4-flash-tp4 resized to 128
  // experts at T = 80 and 200 (10 and 9.4 rows per expert): they must still take it.
  for (const auto& [name, tokens] :
       {std::pair{"kimi-k3.1-tp8", 80}, std::pair{"deepseek-v4-flash-tp4", 200}}) {
    INFO(name);
    ModelShape shape = find_shape(reference_shapes(), name);
    shape.num_experts = 128;
    shape.global_experts = 128;
    shape.max_tokens = 256;
    CHECK(moejit::test::fc2_mid_short_k_expected(shape));
    const detail::MoeForwardConfig c = detail::choose_moe_config(shape, tokens);
    CHECK_FALSE(moejit::test::small_blocks_expected(shape, tokens));
    CHECK_FALSE(c.wgmma);
    CHECK(same_tile(tile_of(c.fc2), n16_tall));
  }
  // And deepseek-v4-flash-tp4 so resized at T = 300 (14 rows per expert): FC1 on the warpgroup
  // tile on sm_90a, FC2 on this one.
  {
    ModelShape shape = find_shape(reference_shapes(), "deepseek-v4-flash-tp4");
    shape.num_experts = 128;
    shape.global_experts = 128;
    shape.max_tokens = 512;
    const detail::MoeForwardConfig c = detail::choose_moe_config(shape, 300);
    CHECK(c.wgmma);
    CHECK(c.fc2_short_k);
    CHECK(same_tile(tile_of(c.fc2), n16_tall));
    const detail::MoeForwardSpecs on_90a = detail::moe_forward_specs(c, Arch::parse("sm_90a"));
    CHECK(on_90a.fc1_params == c.fc1_wgmma);
    CHECK(on_90a.fc2_params == c.fc2);
  }
  CHECK(long_shapes >= 2);
}

TEST_CASE("moe plan: FC1 with 8-row blocks takes 128-row CTAs where they fill 792 slots",
          "[plan]") {
  const Tile tall{128, 8, 128, 4, 4, 1, 1, 4};
  int shapes_with_both = 0;
  for (const ModelShape& shape : reference_shapes()) {
    INFO(shape.name);
    for (int tokens = 1; tokens <= std::min(shape.max_tokens, 512); ++tokens) {
      INFO("T = " << tokens);
      const detail::MoeForwardConfig c = detail::choose_moe_config(shape, tokens);
      CHECK(same_tile(tile_of(c.fc1), tall) == moejit::test::fc1_tall_expected(shape, tokens));
      CHECK(c.fc1.block_n == c.route.block_m);
    }
    const moejit::test::BucketTiles used = moejit::test::fc1_bucket_tiles(shape);
    shapes_with_both += (used.base || used.wave) && used.tall ? 1 : 0;
    // The segment ends (what prewarm walks) split the bucket where the tile changes.
    const std::vector<int> ends = detail::moe_config_segment_ends(shape, shape.max_tokens);
    for (int t = 3; t < std::min(512, shape.max_tokens); ++t) {
      if (moejit::test::fc1_tall_expected(shape, t) !=
              moejit::test::fc1_tall_expected(shape, t + 1) ||
          moejit::test::small_blocks_expected(shape, t) !=
              moejit::test::small_blocks_expected(shape, t + 1)) {
        INFO("T = " << t);
        CHECK(std::find(ends.begin(), ends.end(), t) != ends.end());
      }
    }
  }
  CHECK(shapes_with_both >= 3);  // the rule flips inside the bucket on the reference shapes
}

TEST_CASE("moe plan: the 8-row bucket's tiles by the waves their CTAs fill", "[plan]") {
  // Per GEMM (FC1 over 2I rows; FC2 over H rows where its K is long): 128 rows from 1.5 waves of
  // four CTAs per SM, else the 64-row tile at three stages and five CTAs per SM from one wave,
  // else at four stages and four.
  const Tile tall{128, 8, 128, 4, 4, 1, 1, 4};
  const Tile wave{64, 8, 256, 3, 4, 1, 1, 5};
  const Tile base{64, 8, 256, 4, 4, 1, 1, 4};
  int fc1_changes = 0;
  int fc2_changes = 0;
  std::set<std::string> fc2_tall_shapes;
  for (const ModelShape& shape : reference_shapes()) {
    INFO(shape.name);
    const std::vector<int> ends = detail::moe_config_segment_ends(shape, shape.max_tokens);
    auto fc1_expected = [&](int t) {
      if (moejit::test::fc1_tall_expected(shape, t)) return tall;
      return moejit::test::small_block_wave_expected(shape, t, 2 * shape.intermediate) ? wave
                                                                                       : base;
    };
    auto fc2_expected = [&](int t) {
      if (moejit::test::fc2_tall_expected(shape, t)) return tall;
      return moejit::test::small_block_wave_expected(shape, t, shape.hidden) ? wave : base;
    };
    for (int tokens = 3; tokens <= shape.max_tokens; ++tokens) {
      INFO("T = " << tokens);
      if (!moejit::test::small_blocks_expected(shape, tokens)) break;
      const detail::MoeForwardConfig c = detail::choose_moe_config(shape, tokens);
      CHECK(same_tile(tile_of(c.fc1), fc1_expected(tokens)));
      const bool long_k = !moejit::test::fc2_short_k_expected(shape);
      if (long_k) CHECK(same_tile(tile_of(c.fc2), fc2_expected(tokens)));
      if (moejit::test::fc2_tall_expected(shape, tokens)) fc2_tall_shapes.insert(shape.name);
      // Each change (the CTAs only grow with T) ends a segment that prewarm walks.
      if (tokens > 3) {
        const bool fc1_change = !same_tile(fc1_expected(tokens), fc1_expected(tokens - 1));
        const bool fc2_change =
            long_k && !same_tile(fc2_expected(tokens), fc2_expected(tokens - 1));
        fc1_changes += fc1_change ? 1 : 0;
        fc2_changes += fc2_change ? 1 : 0;
        if (fc1_change || fc2_change) {
          CHECK(std::find(ends.begin(), ends.end(), tokens - 1) != ends.end());
        }
      }
    }
  }
  // The rules change tiles inside the bucket on the reference shapes, for FC1 and for FC2, and
  // FC2 turns tall on the long-K shapes that reach 1.5 waves.
  CHECK(fc1_changes >= 3);
  CHECK(fc2_changes >= 2);
  CHECK(fc2_tall_shapes.count("gpt-oss-120b") == 1);
}

TEST_CASE("moe plan: FC1 of 16-row blocks takes 256-wide K stages where H is a multiple of 256",
          "[plan]") {
  // The bucket's tile with each of its two stages twice as wide; where H is not a multiple of
  // 256 (gpt-oss-120b, H = 2880) its last stage would be mostly zero-filled atoms, so FC1 keeps
  // the bucket's 128-wide stages.
  const Tile wide{128, 16, 256, 2, 4, 1, 1, 4};
  const Tile bucket{128, 16, 128, 2, 4, 1, 1, 4};
  std::set<std::string> wide_shapes;
  std::set<std::string> bucket_shapes;
  for (const ModelShape& shape : reference_shapes()) {
    INFO(shape.name);
    const bool multiple = shape.hidden % 256 == 0;
    for (int tokens = 1; tokens <= std::min(shape.max_tokens, 1024); ++tokens) {
      const detail::MoeForwardConfig c = detail::choose_moe_config(shape, tokens);
      if (c.fc1.block_n != 16) continue;  // another bucket
      INFO("T = " << tokens);
      CHECK(same_tile(tile_of(c.fc1), multiple ? wide : bucket));
      (multiple ? wide_shapes : bucket_shapes).insert(shape.name);
      CHECK(c.fc2.block_k == 128);  // FC2 keeps the bucket's stages (or its short-K tile's)
      for (const char* arch : {"sm_90a", "sm_100a", "sm_80"}) {
        CHECK(moejit::supports(spec_of(Family::kMarlinMoe, c.fc1, arch)).empty());
      }
    }
  }
  // Where FC1 takes the wide tile the warpgroup tile starts at 14 rows per routed expert, not
  // 12: qwen3-30b-a3b (128 experts, top-8) from T = 224, gpt-oss-120b (top-4) from T = 384.
  const std::vector<ModelShape> shapes = reference_shapes();
  for (const auto& [name, first] :
       {std::pair{"qwen3-30b-a3b", 224}, std::pair{"gpt-oss-120b", 384}}) {
    INFO(name);
    const ModelShape& shape = find_shape(shapes, name);
    CHECK_FALSE(detail::choose_moe_config(shape, first - 1).wgmma);
    CHECK(detail::choose_moe_config(shape, first).wgmma);
    const std::vector<int> ends = detail::moe_config_segment_ends(shape, shape.max_tokens);
    CHECK(std::find(ends.begin(), ends.end(), first - 1) != ends.end());
  }
  // Both sides among the reference shapes.
  CHECK(wide_shapes.count("qwen3-30b-a3b") == 1);
  CHECK(wide_shapes.count("deepseek-v4-flash-tp4") == 1);
  CHECK(wide_shapes.count("kimi-k3.1-tp8") == 1);
  CHECK(bucket_shapes.count("gpt-oss-120b") == 1);
}

TEST_CASE("moe plan: the measured tile per T bucket and the route per N", "[plan]") {
  const std::vector<ModelShape> shapes = reference_shapes();
  const ModelShape& gpt = find_shape(shapes, "gpt-oss-120b");
  const Tile t1{32, 8, 256, 4, 2, 1, 2, 4};
  const Tile t96{64, 8, 256, 4, 4, 1, 1, 4};
  const Tile t256{128, 16, 128, 2, 4, 1, 1, 4};  // two 16-row atoms a warp, two stages
  const Tile t1000{64, 32, 128, 4, 4, 1, 1, 3};
  const Tile t4096{128, 64, 128, 4, 8, 1, 1, 2};
  const std::vector<std::pair<int, Tile>> expected = {
      {1, t1},       {2, t1},       {3, t96},      {7, t96},      {96, t96},    {160, t96},
      {161, t256},   {192, t256},   {256, t256},   {512, t256},   {513, t1000}, {1024, t1000},
      {1025, t4096}, {2048, t4096}, {4096, t4096}, {16384, t4096}};
  // 8-row route blocks while experts average at most 5 rows: T * 4 <= 5 * 128, T <= 160.
  CHECK(moejit::test::small_blocks_expected(gpt, 160));
  CHECK_FALSE(moejit::test::small_blocks_expected(gpt, 161));
  // FC1 with 8-row blocks on gpt-oss-120b: 45 128-row tiles per touched expert reach 792 CTAs
  // (1.5 waves of 4 x 132) from T = 5 (expected 18.3 experts touched: 824 CTAs; T = 4: 675).
  const Tile t96_tall{128, 8, 128, 4, 4, 1, 1, 4};
  CHECK_FALSE(moejit::test::fc1_tall_expected(gpt, 4));
  CHECK(moejit::test::fc1_tall_expected(gpt, 5));
  // Below that, FC1's 90 64-row tiles per expert fill a wave of 4 x 132 from T = 3 (1047 CTAs);
  // FC2's 45 from T = 4 (T = 3: 11.6 experts, 523 CTAs; T = 4: 685).
  // And FC2's 23 128-row tiles reach 792 CTAs from T = 10 (T = 9: 31.8 experts, 732 CTAs).
  const Tile t96_wave{64, 8, 256, 3, 4, 1, 1, 5};
  CHECK(moejit::test::small_block_wave_expected(gpt, 3, 2 * gpt.intermediate));
  CHECK_FALSE(moejit::test::small_block_wave_expected(gpt, 3, gpt.hidden));
  CHECK(moejit::test::small_block_wave_expected(gpt, 4, gpt.hidden));
  CHECK_FALSE(moejit::test::fc2_tall_expected(gpt, 9));
  CHECK(moejit::test::fc2_tall_expected(gpt, 10));
  for (const auto& [tokens, tile] : expected) {
    INFO("T = " << tokens);
    const detail::MoeForwardConfig c = detail::choose_moe_config(gpt, tokens);
    const bool small = tokens >= 3 && tokens <= 160;
    CHECK(same_tile(tile_of(c.fc1), small ? (tokens >= 5 ? t96_tall : t96_wave) : tile));
    const Tile fc2_small = tokens >= 10 ? t96_tall : tokens >= 4 ? t96_wave : t96;
    CHECK(same_tile(tile_of(c.fc2), small ? fc2_small : tile));
    CHECK(c.route.block_m == c.fc1.block_n);  // route pads to the GEMM's token tile
    CHECK(c.combine.in_dtype == c.fc2.out_dtype);
    CHECK(c.tokens == tokens);
    CHECK(c.fc1.wgmma_n == 0);
    CHECK(c.fc2.wgmma_n == 0);
  }

  // Above T = 512, and with 16-row blocks where experts average 12 rows or more (gpt-oss:
  // T * 4 >= 12 * 128, T >= 384), the tile has an sm_90a warpgroup variant on the same route
  // blocks; the specs take it on sm_90a only. N = 64 over 16-row blocks and elsewhere below 56
  // rows per expert (gpt-oss: T * 4 < 56 * 128, T <= 1791): one warpgroup of two m64 tiles,
  // four CTAs per SM; from 384 rows (T * 4 >= 384 * 128, T >= 12288) N = 256: two warpgroups of
  // one m64 tile, one CTA per SM; between, N = 128: the same two warpgroups, two CTAs per SM.
  const Tile wg{128, 64, 64, 4, 8, 1, 1, 2};  // n = the route block, 16, 32 or 64 by bucket
  const std::vector<std::pair<int, int>> wgmma_route = {
      {1, 0},     {96, 0},    {192, 0},   {193, 0},   {383, 0},   {384, 16},
      {512, 16},  {513, 32},  {1000, 32}, {1024, 32}, {1025, 64}, {1791, 64},
      {1792, 64}, {2048, 64}, {4096, 64}, {12287, 64}, {12288, 64}, {16384, 64}};
  for (const auto& [tokens, route_block] : wgmma_route) {
    INFO("T = " << tokens);
    const detail::MoeForwardConfig c = detail::choose_moe_config(gpt, tokens);
    CHECK(c.wgmma == (route_block != 0));
    const detail::MoeForwardSpecs on_90a = detail::moe_forward_specs(c, Arch::parse("sm_90a"));
    const detail::MoeForwardSpecs on_90 = detail::moe_forward_specs(c, Arch::parse("sm_90"));
    const detail::MoeForwardSpecs on_100a = detail::moe_forward_specs(c, Arch::parse("sm_100a"));
    CHECK(on_90.fc1_params == c.fc1);
    CHECK(on_100a.fc2_params == c.fc2);
    if (!c.wgmma) {
      CHECK(on_90a.fc1_params == c.fc1);
      continue;
    }
    CHECK(c.route.block_m == route_block);
    const bool narrow = tokens <= 1791;
    const bool wide = tokens >= 12288;
    for (const MarlinMoeParams* p : {&c.fc1_wgmma, &c.fc2_wgmma}) {
      Tile expected = wg;
      expected.n = route_block;
      if (narrow) {
        expected.wm = 4;
        expected.occupancy = 4;
      }
      if (wide) expected.occupancy = 1;
      CHECK(same_tile(tile_of(*p), expected));
      CHECK(p->wgmma_n == (narrow ? 64 : wide ? 256 : 128));
      CHECK(p->block_n == c.route.block_m);  // wgmma_n / block_n route blocks per CTA, same route
    }
    CHECK(on_90a.fc1_params == c.fc1_wgmma);
    CHECK(on_90a.fc2_params == c.fc2_wgmma);
    CHECK(c.fc1_wgmma.activation.kind == c.fc1.activation.kind);
    CHECK(c.fc1_wgmma.has_bias == c.fc1.has_bias);
    CHECK_FALSE(c.fc1_wgmma.early_weights);
    CHECK(c.fc2_wgmma.early_weights);
    CHECK(c.fc2.out_dtype == DType::kBF16);  // half the FC2-row traffic of fp32 rows
    CHECK(c.fc2_wgmma.out_dtype == DType::kBF16);
    CHECK(c.combine_wgmma.in_dtype == DType::kBF16);
    CHECK(std::get<MoeCombineParams>(on_90a.combine.params) == c.combine_wgmma);
    CHECK(std::get<MoeCombineParams>(on_90.combine.params) == c.combine);
    CHECK(moejit::supports(on_90a.fc1).empty());
    CHECK(moejit::supports(on_90a.fc2).empty());
    CHECK(detail::marlin_moe_threads(c.fc1_wgmma) == (narrow ? 128 : 256));
    // MoeGemmWgTraits<128, 2, 1, 4, ...>: 4 stages of (16 KB inputs + 8 atoms of 544 bytes,
    // rounded to 21504), ids, rows and top-k weights (3 x 4 bytes per token), alignment (the
    // nvrtc test asserts it against kSmemBytes); with N = 64 (MoeGemmWgTraits<64, 1, 2, 4, ...>,
    // the same 128 rows), 8 KB of inputs (stages of 13312) and half the ids; with N = 256
    // (MoeGemmWgTraits<256, 2, 1, 4, ...>), 32 KB of inputs (stages of 37888) and twice the ids.
    const long long smem = narrow ? 4 * 13312 + 768 + 1024
                           : wide ? 4 * 37888 + 3072 + 1024
                                  : 4 * 21504 + 1536 + 1024;
    CHECK(detail::marlin_moe_smem_bytes(c.fc1_wgmma) == smem);
    // FC2's staging tile (wgmma_n tokens x 128 bf16 + 16 bytes) fits in its ring.
    CHECK(detail::marlin_moe_smem_bytes(c.fc2_wgmma) == smem);
  }

  // gpt-oss (E = 128): one launch while T * K <= 2048 (two entries a thread of 1024), with 512
  // threads and C = 1024 up to 1024 entries, 1024 threads and C = 2048 above.
  CHECK(detail::choose_moe_config(gpt, 1).route_single);
  CHECK(detail::choose_moe_config(gpt, 1).route.block_threads == 512);
  CHECK(detail::choose_moe_config(gpt, 1).route.chunk_rows == 1024);
  CHECK(detail::choose_moe_config(gpt, 256).route.block_threads == 512);
  CHECK(detail::choose_moe_config(gpt, 256).route.chunk_rows == 1024);
  CHECK(detail::choose_moe_config(gpt, 257).route_single);
  CHECK(detail::choose_moe_config(gpt, 257).route.block_threads == 1024);
  CHECK(detail::choose_moe_config(gpt, 257).route.chunk_rows == 2048);
  CHECK(detail::choose_moe_config(gpt, 512).route_single);
  CHECK(detail::choose_moe_config(gpt, 512).route.block_threads == 1024);
  CHECK(detail::choose_moe_config(gpt, 512).route.chunk_rows == 2048);
  CHECK_FALSE(detail::choose_moe_config(gpt, 513).route_single);
  CHECK(detail::choose_moe_config(gpt, 513).route.kernel == RouteKernel::kRank);
  CHECK(detail::choose_moe_config(gpt, 513).route.chunk_rows == 1024);
  CHECK(detail::choose_moe_config(gpt, 8192).route.chunk_rows == 1024);  // N = 32768
  CHECK(detail::choose_moe_config(gpt, 8193).route.chunk_rows == 4096);  // N > 32768

  // kimi (E = 896, K = 16): the rank counters of 1024 threads would not fit in 48 KB.
  const ModelShape& kimi = find_shape(shapes, "kimi-k3.1-tp8");
  const detail::MoeForwardConfig k1 = detail::choose_moe_config(kimi, 1);
  CHECK(k1.route.block_threads == 512);
  CHECK(detail::route_rank_shared_bytes(896, 1024) > detail::kRouteStaticSharedLimit);
  CHECK(detail::route_rank_shared_bytes(896, 512) <= detail::kRouteStaticSharedLimit);
  // Two entries a thread would be 1024: one launch while T * K <= 1024 all the same.
  CHECK(detail::choose_moe_config(kimi, 64).route_single);
  CHECK(detail::choose_moe_config(kimi, 64).route.chunk_rows == 1024);
  CHECK_FALSE(detail::choose_moe_config(kimi, 65).route_single);

  // Activations and epilogues follow the shape.
  CHECK(k1.fc1.activation.kind == ActivationKind::kSiTU);
  CHECK(k1.fc1.activation.beta == 4.f);
  CHECK(k1.fc1.activation.linear_beta == 25.f);
  CHECK_FALSE(k1.fc1.has_bias);
  const detail::MoeForwardConfig g1 = detail::choose_moe_config(gpt, 1);
  CHECK(g1.fc1.activation.kind == ActivationKind::kGptOss);
  CHECK(g1.fc1.has_bias);
  CHECK(g1.fc2.has_bias);
  CHECK_FALSE(g1.fc1.early_weights);
  CHECK(g1.fc2.early_weights);
  CHECK(g1.fc2.activation.kind == ActivationKind::kSwiGLU);
  CHECK(g1.fc2.activation.limit == 0.f);
  CHECK(g1.combine.block_threads == 64);
  CHECK(detail::choose_moe_config(gpt, 17).combine.block_threads == 256);
  CHECK_FALSE(g1.narrow_ids);

  // The kernels of one config, in launch order.
  const std::vector<KernelSpec> single = detail::moe_config_specs(g1, Arch::parse("sm_90a"));
  REQUIRE(single.size() == 4);
  CHECK(single[0].family == Family::kRoute);
  CHECK(single[1].family == Family::kMarlinMoe);
  CHECK(std::get<MarlinMoeParams>(single[1].params).stage == MoeGemmStage::kFc1);
  CHECK(std::get<MarlinMoeParams>(single[2].params).stage == MoeGemmStage::kFc2);
  CHECK(single[3].family == Family::kCombine);
  ModelShape wide = gpt;
  wide.id_dtype = DType::kI64;
  const std::vector<KernelSpec> multi =
      detail::moe_config_specs(detail::choose_moe_config(wide, 4096), Arch::parse("sm_90a"));
  REQUIRE(multi.size() == 7);
  CHECK(multi[0].family == Family::kNarrowIds);
  CHECK(std::get<MoeRouteParams>(multi[1].params).kernel == RouteKernel::kRank);
  CHECK(std::get<MoeRouteParams>(multi[2].params).kernel == RouteKernel::kScan);
  CHECK(std::get<MoeRouteParams>(multi[3].params).kernel == RouteKernel::kScatter);
}

TEST_CASE("moe plan: N = 256 warpgroup tiles from 384 rows an expert where K spans 40 tiles",
          "[plan]") {
  // 64-row route blocks (T > 1024) take N = 256 (one CTA per SM) where experts average 384 rows
  // or more and min(H, I) / 64 >= 40, else N = 128 from 56 rows. Public shapes: mixtral-8x7b
  // (8 experts, top-2: 384 rows at T = 1536), phi-3.5-moe (16, top-2: T = 3072), llama-4-scout
  // (16, top-1: T = 6144); qwen3-235b-a22b (I = 1536, 24 K tiles) and deepseek-v3 (I = 2048, 32)
  // never, whatever their rows.
  const std::vector<ModelShape> shapes = moejit::test::public_shapes();
  const Arch sm90a = Arch::parse("sm_90a");
  const std::vector<std::tuple<std::string, int, int>> cases = {
      {"mixtral-8x7b", 1535, 128},     {"mixtral-8x7b", 1536, 256},
      {"mixtral-8x7b", 16384, 256},    {"phi-3.5-moe", 3071, 128},
      {"phi-3.5-moe", 3072, 256},      {"llama-4-scout", 6143, 128},
      {"llama-4-scout", 6144, 256},    {"qwen3-235b-a22b", 16384, 128},
      {"deepseek-v3", 16384, 128}};
  for (const auto& [name, tokens, n] : cases) {
    const ModelShape& shape = find_shape(shapes, name);
    INFO(name << " T = " << tokens);
    const detail::MoeForwardConfig c = detail::choose_moe_config(shape, tokens);
    REQUIRE(c.wgmma);
    CHECK(c.route.block_m == 64);
    CHECK(c.route.group_rows == n);
    for (const MarlinMoeParams* p : {&c.fc1_wgmma, &c.fc2_wgmma}) {
      CHECK(p->wgmma_n == n);
      CHECK(p->block_m == 128);  // two warpgroups of one m64 tile at both widths
      CHECK(p->warps_m == 8);
      CHECK(p->min_blocks_per_sm == (n == 256 ? 1 : 2));
      CHECK(p->k_splits == 1);
      // MoeGemmWgTraits<256, 2, 1, 4, ...>: 4 stages of 37888 bytes (32 KB of inputs and 8
      // atoms), 256 x 12 bytes of ids, rows and top-k weights, 1024 of alignment.
      if (n == 256) CHECK(detail::marlin_moe_smem_bytes(*p) == 4 * 37888 + 3072 + 1024);
    }
    CHECK(moejit::test::wide_wgmma_n(shape, tokens) == n);
    const detail::MoeForwardSpecs specs = detail::moe_forward_specs(c, sm90a);
    CHECK(moejit::supports(specs.fc1).empty());
    CHECK(moejit::supports(specs.fc2).empty());
    // A group is whole route blocks, so FC2 writes its bf16 rows inside the route's padded rows.
    const detail::MoeWorkspaceLayout w = detail::moe_workspace_layout(shape, c);
    CHECK(w.marlin_bytes >= w.out2 + static_cast<std::size_t>(w.padded_rows) * shape.hidden * 2);
    CHECK(moejit::moe_workspace_bytes(shape, tokens) >= w.bytes);
  }
}

TEST_CASE("moe plan: FC1's L2 prefetch covers the first wave within its byte budget", "[plan]") {
  const Arch hopper = Arch::parse("sm_90a");
  constexpr int kSms = 132;
  constexpr long long kAtomBytes =
      moejit::kern::moe::layout::kAtomBytes + moejit::kern::moe::layout::kAtomScaleBytes;
  for (const ModelShape& shape : reference_shapes()) {
    const detail::MoeWeightSizes sizes = detail::moe_weight_sizes(shape);
    const int routed = shape.global_experts > 0 ? shape.global_experts : shape.num_experts;
    for (int t : {1, 6, 24, 96, 256, 1024, 4096, 16384}) {
      INFO(shape.name << " T = " << t);
      const detail::MoeForwardConfig c = detail::choose_moe_config(shape, t);
      const detail::MoeForwardSpecs specs = detail::moe_forward_specs(c, hopper);
      const long long max_blocks = detail::moe_workspace_layout(shape, c).max_blocks;
      const detail::GemmPrefetch p =
          detail::fc1_prefetch(shape, c, specs.fc1_params, sizes, max_blocks, kSms, hopper);
      // Never before sm_90 (no bulk prefetch there), whatever T.
      const detail::GemmPrefetch old_arch = detail::fc1_prefetch(
          shape, c, specs.fc1_params, sizes, max_blocks, kSms, Arch::parse("sm_80"));
      CHECK(old_arch.experts == 0);
      CHECK(old_arch.k_atoms == 0);
      const double untouched = std::pow(1.0 - static_cast<double>(shape.top_k) / routed, t);
      if (untouched > detail::kFc1PrefetchMaxUntouched) {
        CHECK(p.experts == 0);
        CHECK(p.m_tiles == 0);
        CHECK(p.k_atoms == 0);
        continue;
      }
      const int atoms_per_tile = specs.fc1_params.block_m / 16;
      const int m_tiles = (sizes.fc1_m_atoms + atoms_per_tile - 1) / atoms_per_tile;
      // Every M tile (the grid runs M tiles fastest) of the blocks of the first wave, one
      // expert per block, never more than E or the blocks that exist.
      CHECK(p.m_tiles == m_tiles);
      const long long wave = static_cast<long long>(kSms) * specs.fc1_params.min_blocks_per_sm;
      const long long columns = std::min<long long>(shape.num_experts, max_blocks);
      CHECK(p.experts >= 1);
      CHECK(p.experts <= columns);
      CHECK((p.experts == columns || static_cast<long long>(p.experts) * m_tiles >= wave));
      CHECK(static_cast<long long>(p.experts - 1) * m_tiles < wave);
      // Whole atoms inside each strip's K, within the budget unless one atom already exceeds it.
      CHECK(p.k_atoms >= 1);
      CHECK(p.k_atoms <= sizes.fc1_k_atoms);
      const long long bytes =
          static_cast<long long>(p.experts) * p.m_tiles * atoms_per_tile * p.k_atoms * kAtomBytes;
      CHECK((bytes <= detail::kFc1PrefetchBytes || p.k_atoms == 1));
      CHECK((p.k_atoms == sizes.fc1_k_atoms ||
             bytes + static_cast<long long>(p.experts) * p.m_tiles * atoms_per_tile * kAtomBytes >
                 detail::kFc1PrefetchBytes));
    }
  }
  // qwen3-30b-a3b: on from T = 6 (68% of 128 experts expected untouched), off at T = 1.
  const ModelShape qwen = find_shape(reference_shapes(), "qwen3-30b-a3b");
  const auto prefetch_at = [&](int t) {
    const detail::MoeForwardConfig c = detail::choose_moe_config(qwen, t);
    return detail::fc1_prefetch(qwen, c, detail::moe_forward_specs(c, hopper).fc1_params,
                                detail::moe_weight_sizes(qwen),
                                detail::moe_workspace_layout(qwen, c).max_blocks, kSms, hopper);
  };
  CHECK(prefetch_at(1).k_atoms == 0);
  CHECK(prefetch_at(5).k_atoms == 0);
  CHECK(prefetch_at(6).k_atoms > 0);
  // T = 96: FC1's 12 M tiles of 128 rows; four CTAs per SM on 132 SMs start 44 blocks.
  CHECK(prefetch_at(96).m_tiles == 12);
  CHECK(prefetch_at(96).experts == 44);
}

TEST_CASE("moe plan: segment ends cover [1, max_tokens]", "[plan]") {
  const ModelShape gpt = find_shape(reference_shapes(), "gpt-oss-120b");
  const std::vector<int> ends = detail::moe_config_segment_ends(gpt, 16384);
  REQUIRE_FALSE(ends.empty());
  CHECK(ends.back() == 16384);
  CHECK(std::is_sorted(ends.begin(), ends.end()));
  CHECK(detail::moe_config_segment_ends(gpt, 0).empty());
  CHECK(detail::moe_config_segment_ends(gpt, 1) == std::vector<int>{1});
  // Consecutive T inside one segment share a config; a change happens only at an end.
  int previous_end = 0;
  for (int end : ends) {
    const std::vector<KernelSpec> at_end =
        detail::moe_config_specs(detail::choose_moe_config(gpt, end), Arch::parse("sm_90a"));
    for (int t : {previous_end + 1, (previous_end + 1 + end) / 2}) {
      INFO("T = " << t << " in (" << previous_end << ", " << end << "]");
      CHECK(detail::moe_config_specs(detail::choose_moe_config(gpt, t), Arch::parse("sm_90a")) ==
            at_end);
    }
    previous_end = end;
  }
  // Every reference shape, every T up to 1100 (the marlin buckets and the warpgroup tile's
  // rows-per-expert threshold, which counts the routed experts of all ranks): the kernels of
  // each T are those of its segment's end, so a prewarm over the ends covers every call.
  for (const ModelShape& shape : reference_shapes()) {
    INFO(shape.name);
    const std::vector<int> shape_ends = detail::moe_config_segment_ends(shape, 1100);
    const auto specs_at = [&](int t) {
      return detail::moe_config_specs(detail::choose_moe_config(shape, t), Arch::parse("sm_90a"));
    };
    int mismatches = 0;
    for (std::size_t i = 0, t = 1; i < shape_ends.size(); ++i) {
      const std::vector<KernelSpec> at_end = specs_at(shape_ends[i]);
      for (; static_cast<int>(t) <= shape_ends[i]; ++t) {
        if (specs_at(static_cast<int>(t)) == at_end) continue;
        ++mismatches;
        FAIL_CHECK("T = " << t << " differs from its segment's end " << shape_ends[i]);
      }
    }
    CHECK(mismatches == 0);
  }
}

// The warpgroup tile keeps its input copies' sources as 32-bit element offsets: FC1's hidden
// (T x H) and FC2's activations (padded rows x I) must stay under 2^32 elements, or it would read
// the wrong rows without a fault. Above that T the mma.sync tile (64-bit offsets) runs, and the
// plan's segments end there so a prewarm lists it.
TEST_CASE("moe plan: no warpgroup tile where its input offsets pass 32 bits", "[plan]") {
  ModelShape big = find_shape(reference_shapes(), "gpt-oss-120b");
  big.name = "mixtral-like";
  big.num_experts = 8;
  big.global_experts = 8;
  big.top_k = 2;
  big.hidden = 4096;
  big.intermediate = 14336;
  big.has_bias = false;
  big.max_tokens = 200000;
  const auto fc2_input_elements = [&](int t) {
    const detail::MoeForwardConfig c = detail::choose_moe_config(big, t);
    return moejit::kern::moe::route_max_padded_rows(static_cast<long long>(t) * big.top_k,
                                            big.num_experts, c.route.block_m) *
           big.intermediate;
  };
  const std::vector<int> ends = detail::moe_config_segment_ends(big, big.max_tokens);
  // The last T with the warpgroup tile is a segment end, and past it the inputs pass 2^32.
  int last_wgmma = 0;
  for (int t : ends) {
    if (detail::choose_moe_config(big, t).wgmma) last_wgmma = t;
  }
  INFO("last T on the warpgroup tile " << last_wgmma);
  REQUIRE(last_wgmma > 100000);
  REQUIRE(last_wgmma < big.max_tokens);
  CHECK(fc2_input_elements(last_wgmma) < (1LL << 32));
  CHECK(fc2_input_elements(last_wgmma + 1) >= (1LL << 32));
  CHECK_FALSE(detail::choose_moe_config(big, last_wgmma + 1).wgmma);
  CHECK_FALSE(detail::choose_moe_config(big, big.max_tokens).wgmma);
  // Every T from there on runs kernels plan_kernels lists (on sm_90a).
  const Arch arch = Arch::parse("sm_90a");
  const std::vector<KernelSpec> planned = moejit::plan_kernels(big, arch);
  const SpecSet plan(planned.begin(), planned.end());
  for (int t : {last_wgmma, last_wgmma + 1, (last_wgmma + big.max_tokens) / 2, big.max_tokens}) {
    INFO("T = " << t);
    for (const KernelSpec& spec :
         detail::moe_config_specs(detail::choose_moe_config(big, t), arch)) {
      CHECK(plan.count(spec) == 1);
    }
  }
  // FC1's hidden rows alone: H = 65536 passes 2^32 elements at T = 65536.
  ModelShape wide = big;
  wide.hidden = 65536;
  wide.intermediate = 256;
  wide.max_tokens = 70000;
  CHECK(detail::choose_moe_config(wide, 65535).wgmma);
  CHECK_FALSE(detail::choose_moe_config(wide, 65536).wgmma);
}

TEST_CASE("moe supports(): every rule of the kernels' static_asserts, with the reason", "[plan]") {
  CHECK(moejit::supports(spec_of(Family::kMarlinMoe, good_fc1())).empty());
  CHECK(moejit::supports(spec_of(Family::kMarlinMoe, good_fc2())).empty());
  CHECK(moejit::supports(spec_of(Family::kRoute, good_route())).empty());
  CHECK(moejit::supports(spec_of(Family::kCombine, good_combine())).empty());
  CHECK(moejit::supports(spec_of(Family::kNarrowIds, NarrowIdsParams{})).empty());
  CHECK(moejit::supports(spec_of(Family::kRepack, MoeRepackParams{})).empty());

  struct GemmCase {
    std::function<void(MarlinMoeParams&)> edit;
    std::vector<std::string> expected;
    const char* arch;
  };
  const auto wide_tile = [](MarlinMoeParams& p) {
    p.block_m = 128;
    p.block_n = 64;
    p.block_k = 128;
    p.warps_m = 8;
  };
  const std::vector<GemmCase> gemm_cases = {
      {[](MarlinMoeParams& p) { p.block_m = 48; }, {"block_m = 48", "16 * warps_m = 64"}, "sm_90a"},
      {[](MarlinMoeParams& p) { p.warps_m = 0; }, {"warps = 0x1x1"}, "sm_90a"},
      {[](MarlinMoeParams& p) { p.block_n = 24; },
       {"block_n = 24", "8, 16, 32, 64, 128"},
       "sm_90a"},
      {[](MarlinMoeParams& p) {
         p.block_n = 8;
         p.warps_n = 2;
         p.block_m = 32;
         p.warps_m = 2;
       },
       {"block_n = 8", "8 * warps_n = 16"},
       "sm_90a"},
      {[](MarlinMoeParams& p) { p.block_k = 96; }, {"block_k = 96", "64 * warps_k = 64"}, "sm_90a"},
      {[](MarlinMoeParams& p) {
         p.block_k = 128;
         p.warps_k = 4;
       },
       {"block_k = 128", "64 * warps_k = 256"},
       "sm_90a"},
      {[](MarlinMoeParams& p) { p.stages = 1; }, {"stages = 1", ">= 2"}, "sm_90a"},
      {[](MarlinMoeParams& p) {
         p.block_m = 1024;
         p.warps_m = 64;
       },
       {"64 warps", "1024 threads"},
       "sm_90a"},
      {[](MarlinMoeParams& p) { p.min_blocks_per_sm = 0; }, {"min_blocks_per_sm = 0"}, "sm_90a"},
      {[](MarlinMoeParams& p) {
         p.stages = 16;
         p.block_n = 128;
       },
       {"bytes of shared memory", "232448", "lower stages"},
       "sm_90a"},
      // 4 stages of 128 x 64 x 128 tiles: 104960 bytes, more than sm_86 gives a CTA.
      {wide_tile, {"sm_86 allows at most 101376"}, "sm_86"},
      // The same tile on an arch the planner has no figure for: 48 KB, said to be assumed.
      {wide_tile,
       {"sm_88 allows at most 49152 (assumed: the planner has no figure for sm_88"},
       "sm_88"},
      {[](MarlinMoeParams&) {}, {"sm_80 or newer", "sm_75"}, "sm_75"},
      {[](MarlinMoeParams& p) { p.early_weights = true; }, {"early_weights", "fc2 only"}, "sm_90a"},
      {[](MarlinMoeParams& p) { p.out_dtype = DType::kF32; },
       {"out_dtype = f32", "bf16"},
       "sm_90a"},
      {[](MarlinMoeParams& p) { p.activation.limit = -1.f; },
       {"limit = -1", "finite and positive"},
       "sm_90a"},
      {[](MarlinMoeParams& p) { p.activation.alpha = std::nanf(""); },
       {"alpha", "finite"},
       "sm_90a"},
      {[](MarlinMoeParams& p) { p.activation.limit = 1e-20f; },
       {"limit", "exact int ratio"},
       "sm_90a"},
      {[](MarlinMoeParams& p) { p.activation.beta = 4.f; },
       {"beta = 4", "takes no beta"},
       "sm_90a"},
      // K splits: FC2 with fp32 rows only (either main loop), 1..8.
      {[](MarlinMoeParams& p) { p.k_splits = 0; }, {"k_splits = 0", "1..8"}, "sm_90a"},
      {[](MarlinMoeParams& p) { p.k_splits = 9; }, {"k_splits = 9", "1..8"}, "sm_90a"},
      {[](MarlinMoeParams& p) { p.k_splits = 2; },
       {"k_splits = 2 with stage fc1", "only for fc2"},
       "sm_90a"},
  };
  for (const GemmCase& c : gemm_cases) {
    MarlinMoeParams p = good_fc1();
    c.edit(p);
    expect_refused(Family::kMarlinMoe, p, c.expected, c.arch);
  }
  {
    MarlinMoeParams split = good_fc2();
    split.out_dtype = DType::kF32;
    split.k_splits = 3;
    CHECK(moejit::supports(spec_of(Family::kMarlinMoe, split)).empty());
    split.out_dtype = DType::kBF16;
    expect_refused(Family::kMarlinMoe, split, {"k_splits = 3", "out_dtype = bf16", "f32"});
    MarlinMoeParams wg_split = good_wgmma_fc1();
    wg_split.stage = MoeGemmStage::kFc2;
    wg_split.early_weights = true;
    wg_split.activation = moejit::Activation{};
    wg_split.out_dtype = DType::kF32;
    wg_split.k_splits = 2;
    CHECK(moejit::supports(spec_of(Family::kMarlinMoe, wg_split)).empty());
    wg_split.out_dtype = DType::kBF16;
    expect_refused(Family::kMarlinMoe, wg_split, {"k_splits = 2", "out_dtype = bf16", "f32"});
  }
  // The warpgroup main loop (MoeGemmWgTraits): its own geometry rules, and sm_90a only.
  CHECK(moejit::supports(spec_of(Family::kMarlinMoe, good_wgmma_fc1())).empty());
  const std::vector<GemmCase> wgmma_cases = {
      {[](MarlinMoeParams& p) { p.wgmma_n = 96; }, {"wgmma_n = 96", "64, 128, 256"}, "sm_90a"},
      {[](MarlinMoeParams& p) { p.block_n = 48; },
       {"block_n = 48 with wgmma_n = 128", "wgmma_n / 1, 2, 4, 8 or 16"},
       "sm_90a"},
      {[](MarlinMoeParams& p) {
         p.wgmma_n = 64;
         p.block_n = 4;
       },
       {"block_n = 4 with wgmma_n = 64", "at least 8"},
       "sm_90a"},
      {[](MarlinMoeParams& p) {
         p.wgmma_n = 256;
         p.block_n = 8;
       },
       {"block_n = 8 with wgmma_n = 256", "or 16"},
       "sm_90a"},
      {[](MarlinMoeParams& p) { p.warps_m = 6; }, {"warps = 6x1x1", "whole warpgroups"}, "sm_90a"},
      {[](MarlinMoeParams& p) { p.warps_k = 2; }, {"warps = 8x1x2", "warps_k = 1"}, "sm_90a"},
      {[](MarlinMoeParams& p) { p.block_m = 192; },
       {"block_m = 192 with 2 warpgroups", "128 or 256"},
       "sm_90a"},
      {[](MarlinMoeParams& p) { p.block_k = 128; }, {"block_k = 128", "allowed: 64"}, "sm_90a"},
      {[](MarlinMoeParams& p) { p.stages = 2; }, {"stages = 2", ">= 3"}, "sm_90a"},
      {[](MarlinMoeParams& p) {
         p.stages = 12;
         p.wgmma_n = 256;
         p.block_n = 128;
       },
       {"bytes of shared memory", "lower stages or wgmma_n"},
       "sm_90a"},
      {[](MarlinMoeParams& p) { p.out_dtype = DType::kF32; }, {"out_dtype = f32"}, "sm_90a"},
      {[](MarlinMoeParams&) {}, {"needs sm_90a", "found sm_90", "wgmma_n = 0"}, "sm_90"},
      {[](MarlinMoeParams&) {}, {"needs sm_90a", "found sm_100a"}, "sm_100a"},
  };
  for (const GemmCase& c : wgmma_cases) {
    MarlinMoeParams p = good_wgmma_fc1();
    c.edit(p);
    expect_refused(Family::kMarlinMoe, p, c.expected, c.arch);
  }
  MarlinMoeParams fc2 = good_fc2();
  fc2.activation.kind = ActivationKind::kSiTU;
  expect_refused(Family::kMarlinMoe, fc2, {"with stage fc2", "FC2 applies none"});
  fc2 = good_fc2();
  fc2.out_dtype = DType::kI32;
  expect_refused(Family::kMarlinMoe, fc2, {"out_dtype = i32", "f32, bf16"});
  // The same tile on sm_80 (163 KB) is fine.
  MarlinMoeParams big = good_fc1();
  big.block_m = 128;
  big.block_n = 64;
  big.block_k = 128;
  big.warps_m = 8;
  CHECK(detail::marlin_moe_smem_bytes(big) == 105216);  // 4 stages of 26 KB + 3 x 64 x 4
  // The GEMM grid's M tiles: 8 atoms of 16 rows a tile, a partial last tile counted
  // (gpt-oss-120b's FC2, H = 2880: 180 atoms).
  CHECK(detail::marlin_moe_m_tiles(big, 180) == 23);
  CHECK(detail::marlin_moe_m_tiles(big, 176) == 22);
  CHECK(moejit::supports(spec_of(Family::kMarlinMoe, big, "sm_80")).empty());

  struct RouteCase {
    std::function<void(MoeRouteParams&)> edit;
    std::vector<std::string> expected;
  };
  const std::vector<RouteCase> route_cases = {
      {[](MoeRouteParams& p) { p.num_experts = 40000; }, {"num_experts = 40000", "1..32767"}},
      {[](MoeRouteParams& p) { p.num_experts = 0; }, {"num_experts = 0"}},
      {[](MoeRouteParams& p) { p.top_k = 65; }, {"top_k = 65", "1..64"}},
      {[](MoeRouteParams& p) { p.block_m = 12; }, {"block_m = 12", "8, 16, 32, 64, 128"}},
      {[](MoeRouteParams& p) { p.block_threads = 100; }, {"block_threads = 100"}},
      {[](MoeRouteParams& p) { p.chunk_rows = 1536; }, {"chunk_rows = 1536", "multiple"}},
      {[](MoeRouteParams& p) { p.chunk_rows = 65536; }, {"chunk_rows = 65536", "16-bit"}},
      {[](MoeRouteParams& p) { p.group_rows = 12; }, {"group_rows = 12", "multiple of block_m"}},
      {[](MoeRouteParams& p) { p.group_rows = 4; }, {"group_rows = 4", "multiple of block_m"}},
      {[](MoeRouteParams& p) { p.group_rows = 40000; }, {"group_rows = 40000", "32767"}},
      {[](MoeRouteParams& p) {
         p.block_threads = 32;
         p.chunk_rows = 2048;
       },
       {"64 entries per thread", "at most 32"}},
      {[](MoeRouteParams& p) { p.num_experts = 896; },
       {"static shared memory", "lower block_threads"}},
  };
  for (const RouteCase& c : route_cases) {
    MoeRouteParams p = good_route();
    c.edit(p);
    expect_refused(Family::kRoute, p, c.expected);
  }

  MoeCombineParams combine = good_combine();
  combine.hidden = 12;
  expect_refused(Family::kCombine, combine, {"hidden = 12", "multiple of 8"});
  combine = good_combine();
  combine.top_k = 0;
  expect_refused(Family::kCombine, combine, {"top_k = 0"});
  combine = good_combine();
  combine.in_dtype = DType::kF16;
  expect_refused(Family::kCombine, combine, {"in_dtype = f16"});
  combine = good_combine();
  combine.block_threads = 2048;
  expect_refused(Family::kCombine, combine, {"block_threads = 2048"});
  combine = good_combine();
  combine.k_splits = 9;
  expect_refused(Family::kCombine, combine, {"k_splits = 9", "1..8"});
  combine = good_combine();
  combine.k_splits = 2;
  combine.in_dtype = DType::kBF16;
  expect_refused(Family::kCombine, combine, {"k_splits = 2 with in_dtype bf16", "f32"});
  NarrowIdsParams narrow;
  narrow.block_threads = 48;
  expect_refused(Family::kNarrowIds, narrow, {"block_threads = 48"});
  MoeRepackParams repack;
  repack.block_threads = 0;
  expect_refused(Family::kRepack, repack, {"block_threads = 0"});

  // Params of one family under another family's name.
  const std::string mixed = moejit::supports(spec_of(Family::kCombine, good_route()));
  CHECK(contains(mixed, "names family combine"));
  CHECK(contains(mixed, "parameters of route"));
}

TEST_CASE("moe plan: a shape the kernels can't serve is refused before any compile", "[plan]") {
  // More local experts than the route's shared tables hold: refused by the planner itself, and by
  // every op that takes the shape, at the route's exact limit.
  ModelShape shape = find_shape(reference_shapes(), "qwen3-30b-a3b");
  shape.name = "too-many-experts";
  shape.num_experts = moejit::detail::kMaxRoutedLocalExperts + 1;
  shape.global_experts = shape.num_experts;
  const std::string count = "num_experts = " + std::to_string(shape.num_experts);
  try {
    moejit::plan_kernels(shape, Arch::parse("sm_90a"));
    FAIL("plan_kernels planned a shape with more experts than the route serves");
  } catch (const Error& e) {
    CHECK(e.code() == ErrorCode::kInvalidDescriptor);
    CHECK(contains(e.what(), count));
    CHECK(contains(e.what(), "1..3509"));
  }
  CHECK_THROWS_WITH(moejit::moe_weight_layout(shape), Catch::Contains(count));
  CHECK_THROWS_WITH(moejit::moe_workspace_bytes(shape, 1), Catch::Contains(count));
  --shape.num_experts;
  --shape.global_experts;
  for (const KernelSpec& spec : moejit::plan_kernels(shape, Arch::parse("sm_90a"))) {
    if (spec.family != Family::kRoute) continue;
    INFO(spec.display_name());
    CHECK(moejit::supports(spec).empty());
  }

  // Sizes and constants a shape built in code can hold but no kernel takes: refused by the
  // planner (prewarm plans through it) and by the ops, naming the field.
  ModelShape empty = find_shape(reference_shapes(), "qwen3-30b-a3b");
  empty.intermediate = 0;
  CHECK_THROWS_WITH(moejit::plan_kernels(empty, Arch::parse("sm_90a")),
                    Catch::Contains("intermediate = 0"));
  ModelShape no_tokens = find_shape(reference_shapes(), "qwen3-30b-a3b");
  no_tokens.max_tokens = -1;
  CHECK_THROWS_WITH(moejit::prewarm({no_tokens}, {Arch::parse("sm_90a")}, 1),
                    Catch::Contains("max_tokens = -1"));
  // No arch would plan nothing and so pass any shape; a negative jobs meant "auto" silently.
  CHECK_THROWS_WITH(moejit::prewarm({no_tokens}, {}, 1),
                    "prewarm: archs: expected at least one arch (e.g. sm_90a), found none");
  CHECK_THROWS_WITH(moejit::prewarm({no_tokens}, {Arch::parse("sm_90a")}, -2),
                    "prewarm: jobs: expected 0 (one per hardware thread) or more, found -2");
  ModelShape nan_limit = find_shape(reference_shapes(), "deepseek-v4-flash-tp4");
  REQUIRE(nan_limit.activation.kind == moejit::ActivationKind::kClampedSwiGLU);
  nan_limit.activation.limit = std::nanf("");
  CHECK_THROWS_WITH(moejit::moe_weight_layout(nan_limit), Catch::Contains("limit"));
  CHECK_THROWS_WITH(moejit::plan_kernels(nan_limit, Arch::parse("sm_90a")),
                    Catch::Contains("finite and positive"));
  ModelShape huge_limit = nan_limit;
  huge_limit.activation.limit = 1e10f;
  CHECK_THROWS_WITH(moejit::moe_workspace_bytes(huge_limit, 1),
                    Catch::Contains("no exact int ratio"));

  // Shared experts past what append_shared's template holds, or with gates or logits it does not
  // take: refused as the shape file's rules refuse them, not planned.
  const ModelShape with_shared = [] {
    for (const ModelShape& s : reference_shapes()) {
      if (s.shared.count > 0) return s;
    }
    FAIL("no reference shape has shared experts");
    return ModelShape{};
  }();
  REQUIRE_NOTHROW(moejit::plan_kernels(with_shared, Arch::parse("sm_90a")));
  struct SharedCase {
    const char* found;
    std::function<void(moejit::SharedExperts&)> set;
  };
  for (const SharedCase& c : std::vector<SharedCase>{
           {"shared.count = 9", [](auto& sh) { sh.count = 9; }},
           {"shared.count = -1", [](auto& sh) { sh.count = -1; }},
           {"shared.gate = 7", [](auto& sh) { sh.gate = static_cast<moejit::SharedGate>(7); }},
           {"shared.logit_dtype = int32",
            [](auto& sh) { sh.logit_dtype = moejit::DType::kI32; }}}) {
    INFO(c.found);
    ModelShape bad = with_shared;
    c.set(bad.shared);
    CHECK_THROWS_WITH(moejit::plan_kernels(bad, Arch::parse("sm_90a")), Catch::Contains(c.found));
    CHECK_THROWS_WITH(moejit::moe_weight_layout(bad), Catch::Contains(c.found));
  }
  ModelShape no_shared = with_shared;  // no shared experts: their other fields are not read
  no_shared.shared.count = 0;
  no_shared.shared.gate = static_cast<moejit::SharedGate>(7);
  CHECK_NOTHROW(moejit::plan_kernels(no_shared, Arch::parse("sm_90a")));

  ModelShape odd = find_shape(reference_shapes(), "qwen3-30b-a3b");
  odd.hidden = 48;
  try {
    moejit::moe_weight_layout(odd);
    FAIL("moe_weight_layout accepted hidden = 48");
  } catch (const Error& e) {
    CHECK(e.code() == ErrorCode::kInvalidDescriptor);
    CHECK(contains(e.what(), "hidden = 48"));
    CHECK(contains(e.what(), "multiple of 32"));
  }
}

TEST_CASE("moe families: names, JSON, hashes and generated source", "[plan]") {
  for (Family family : {Family::kRoute, Family::kRepack, Family::kMarlinMoe, Family::kCombine,
                        Family::kNarrowIds, Family::kDecodeMoe}) {
    CHECK(moejit::parse_family(moejit::family_name(family)) == family);
  }
  CHECK(std::string(moejit::family_name(Family::kMarlinMoe)) == "marlin_moe");

  const KernelSpec fc1 = spec_of(Family::kMarlinMoe, good_fc1());
  CHECK(fc1.display_name() ==
        "marlin_moe<fc1,m64,n8,k256,s4,w4x1x1,o4,gpt_oss(limit=7,alpha=1.702),bias,bf16>@sm_90a");
  const KernelSpec fc2 = spec_of(Family::kMarlinMoe, good_fc2());
  CHECK(fc2.display_name() == "marlin_moe<fc2,m64,n8,k256,s4,w4x1x1,o4,early,bias,f32>@sm_90a");
  CHECK(spec_of(Family::kRoute, good_route()).display_name() ==
        "route<single,e128,k4,b8,t1024,c1024>@sm_90a");
  CHECK(spec_of(Family::kCombine, good_combine()).display_name() ==
        "combine<h2880,k4,f32,t256>@sm_90a");
  CHECK(spec_of(Family::kRepack, MoeRepackParams{}).display_name() ==
        "repack<gate_up,t256>@sm_90a");
  CHECK(spec_of(Family::kNarrowIds, NarrowIdsParams{}).display_name() == "narrow_ids<t256>@sm_90a");

  const auto json = nlohmann::json::parse(fc1.to_json());
  CHECK(json["family"] == "marlin_moe");
  CHECK(json["params"]["stage"] == "fc1");
  CHECK(json["params"]["block_k"] == 256);
  CHECK(json["params"]["activation"]["kind"] == "gpt_oss");
  CHECK(json["params"]["activation"]["alpha"].get<float>() == 1.702f);
  CHECK(json["params"]["out_dtype"] == "bf16");
  CHECK(nlohmann::json::parse(
            spec_of(Family::kRoute, good_route()).to_json())["params"]["kernel"] == "single");

  // Every field is in equality and (for these variations) in the hash.
  std::vector<KernelSpec> variants = {fc1, fc2};
  const std::vector<std::function<void(MarlinMoeParams&)>> edits = {
      [](MarlinMoeParams& p) { p.block_m = 128; },
      [](MarlinMoeParams& p) { p.block_n = 16; },
      [](MarlinMoeParams& p) { p.block_k = 128; },
      [](MarlinMoeParams& p) { p.stages = 3; },
      [](MarlinMoeParams& p) { p.warps_m = 2; },
      [](MarlinMoeParams& p) {
        p.block_n = 16;
        p.warps_n = 2;
      },
      [](MarlinMoeParams& p) { p.warps_k = 2; },
      [](MarlinMoeParams& p) { p.min_blocks_per_sm = 3; },
      [](MarlinMoeParams& p) { p.has_bias = false; },
      [](MarlinMoeParams& p) { p.activation.limit = 8.f; },
      [](MarlinMoeParams& p) { p.activation.alpha = 1.7f; },
      [](MarlinMoeParams& p) {
        p.activation.kind = ActivationKind::kClampedSwiGLU;
        p.activation.alpha = 0.f;
      },
  };
  for (const auto& edit : edits) {
    MarlinMoeParams p = good_fc1();
    edit(p);
    variants.push_back(spec_of(Family::kMarlinMoe, p));
  }
  // The warpgroup main loop: a different kernel from the mma.sync tile of the same sizes, and
  // each route block (block_n = wgmma_n / 2 here) is a different kernel.
  const MarlinMoeParams wg = good_wgmma_fc1();
  variants.push_back(spec_of(Family::kMarlinMoe, wg));
  MarlinMoeParams wg_same_sizes = wg;
  wg_same_sizes.wgmma_n = 0;
  variants.push_back(spec_of(Family::kMarlinMoe, wg_same_sizes));
  MarlinMoeParams wg_unpaired = wg;
  wg_unpaired.block_n = 128;
  variants.push_back(spec_of(Family::kMarlinMoe, wg_unpaired));
  const std::vector<std::function<void(MoeRouteParams&)>> route_edits = {
      [](MoeRouteParams&) {},
      [](MoeRouteParams& p) { p.kernel = RouteKernel::kScan; },
      [](MoeRouteParams& p) { p.num_experts = 64; },
      [](MoeRouteParams& p) { p.top_k = 8; },
      [](MoeRouteParams& p) { p.block_m = 16; },
      [](MoeRouteParams& p) { p.block_threads = 512; },
      [](MoeRouteParams& p) { p.chunk_rows = 4096; },
  };
  for (const auto& edit : route_edits) {
    MoeRouteParams p = good_route();
    edit(p);
    variants.push_back(spec_of(Family::kRoute, p));
  }
  variants.push_back(spec_of(Family::kCombine, good_combine()));
  MoeCombineParams bf16_in = good_combine();
  bf16_in.in_dtype = DType::kBF16;
  variants.push_back(spec_of(Family::kCombine, bf16_in));
  variants.push_back(spec_of(Family::kRepack, MoeRepackParams{}));
  variants.push_back(spec_of(Family::kRepack, moejit::MoeRepackParams{false, 256}));
  variants.push_back(spec_of(Family::kNarrowIds, NarrowIdsParams{}));
  for (std::size_t i = 0; i < variants.size(); ++i) {
    CHECK(variants[i] == variants[i]);
    for (std::size_t j = i + 1; j < variants.size(); ++j) {
      INFO(variants[i].display_name() << " vs " << variants[j].display_name());
      CHECK_FALSE(variants[i] == variants[j]);
      CHECK(variants[i].hash() != variants[j].hash());
      CHECK(variants[i].display_name() != variants[j].display_name());
      CHECK(detail::render(variants[i]).file_name != detail::render(variants[j]).file_name);
    }
  }

  // A constant of -0.0 is the same spec as 0.0 (equality compares values), so it hashes alike.
  MarlinMoeParams zero = good_fc1();
  zero.activation.kind = moejit::ActivationKind::kSiTU;
  zero.activation.beta = 1.0f;
  zero.activation.linear_beta = 0.0f;
  MarlinMoeParams negative_zero = zero;
  negative_zero.activation.linear_beta = -0.0f;
  CHECK(spec_of(Family::kMarlinMoe, zero) == spec_of(Family::kMarlinMoe, negative_zero));
  CHECK(spec_of(Family::kMarlinMoe, zero).hash() ==
        spec_of(Family::kMarlinMoe, negative_zero).hash());

  // Typed values become template arguments; activation constants become exact ratios.
  const detail::GeneratedSource src = detail::render(fc1);
  CHECK(contains(src.source, "#include <moejit/kern/moe/moe_gemm.cuh>"));
  CHECK(src.name_expression ==
        "moejit::kern::moe::moe_gemm<moejit::kern::moe::MoeGemmTraits<64, 8, 256, 4, 4, 1, 1, 4, "
        "false, moejit::kern::moe::Fc1Epilogue<moejit::kern::moe::act::GptOssSwiGLU<1702, 1000, "
        "7, 1>, true>>>");
  CHECK(detail::render(fc2).name_expression ==
        "moejit::kern::moe::moe_gemm<moejit::kern::moe::MoeGemmTraits<64, 8, 256, 4, 4, 1, 1, 4, "
        "true, moejit::kern::moe::Fc2Epilogue<false, true>>>");
  const KernelSpec wg_fc1 = spec_of(Family::kMarlinMoe, wg);
  CHECK(wg_fc1.display_name() ==
        "marlin_moe<fc1,m128,n64,k64,s4,w8x1x1,o2,gpt_oss(limit=7,alpha=1.702),bias,wgmma128,bf16>"
        "@sm_90a");
  CHECK(nlohmann::json::parse(wg_fc1.to_json())["params"]["wgmma_n"] == 128);
  const detail::GeneratedSource wg_src = detail::render(wg_fc1);
  CHECK(contains(wg_src.source, "#include <moejit/kern/moe/moe_gemm_wg.cuh>"));
  CHECK(wg_src.name_expression ==
        "moejit::kern::moe::moe_gemm_wg<moejit::kern::moe::MoeGemmWgTraits<128, 2, 1, 4, 2, 64, "
        "false, moejit::kern::moe::Fc1Epilogue<moejit::kern::moe::act::GptOssSwiGLU<1702, 1000, "
        "7, 1>, true>>>");
  CHECK(contains(detail::render(spec_of(Family::kMarlinMoe, wg_unpaired)).name_expression,
                 "MoeGemmWgTraits<128, 2, 1, 4, 2, 128, false"));
  MarlinMoeParams situ = good_fc1();
  situ.has_bias = false;
  situ.activation = Activation{};
  situ.activation.kind = ActivationKind::kSiTU;
  situ.activation.beta = 4.f;
  situ.activation.linear_beta = 25.f;
  CHECK(contains(detail::render(spec_of(Family::kMarlinMoe, situ)).name_expression,
                 "act::SiTU<4, 1, 25, 1>, false>"));
  MarlinMoeParams clamped = situ;
  clamped.activation = Activation{};
  clamped.activation.kind = ActivationKind::kClampedSwiGLU;
  clamped.activation.limit = 10.f;
  CHECK(contains(detail::render(spec_of(Family::kMarlinMoe, clamped)).name_expression,
                 "act::ClampedSwiGLU<10, 1>"));
  CHECK(detail::render(spec_of(Family::kRoute, good_route())).name_expression ==
        "moejit::kern::moe::route_single_kernel<moejit::kern::moe::RouteTraits<128, 4, 8, 1024, "
        "1024>>");
  MoeRouteParams grouped = good_route();
  grouped.group_rows = 64;
  CHECK(detail::render(spec_of(Family::kRoute, grouped)).name_expression ==
        "moejit::kern::moe::route_single_kernel<moejit::kern::moe::RouteTraits<128, 4, 8, 1024, "
        "1024, 64>>");
  CHECK(spec_of(Family::kRoute, grouped).display_name() !=
        spec_of(Family::kRoute, good_route()).display_name());
  CHECK(detail::render(spec_of(Family::kCombine, good_combine())).name_expression ==
        "moejit::kern::moe::combine_kernel<moejit::kern::moe::CombineTraits<2880, 4, false, "
        "256>>");
  CHECK(detail::render(spec_of(Family::kRepack, MoeRepackParams{})).name_expression ==
        "moejit::kern::moe::repack_mxfp4<moejit::kern::moe::RepackTraits<true, 256>>");
  CHECK(detail::render(spec_of(Family::kNarrowIds, NarrowIdsParams{})).name_expression ==
        "moejit::kern::moe::narrow_ids_kernel<moejit::kern::moe::NarrowIdsTraits<256>>");
}

TEST_CASE("float_ratio: exact int ratios of activation constants", "[plan]") {
  const auto ratio = [](float v) {
    const auto r = detail::float_ratio(v);
    REQUIRE(r.has_value());
    return std::make_pair(r->num, r->den);
  };
  CHECK(ratio(1.702f) == std::make_pair(1702, 1000));
  CHECK(ratio(7.f) == std::make_pair(7, 1));
  CHECK(ratio(25.f) == std::make_pair(25, 1));
  CHECK(ratio(0.1f) == std::make_pair(1, 10));
  CHECK(ratio(0.f) == std::make_pair(0, 1));
  CHECK(ratio(-2.5f) == std::make_pair(-25, 10));
  CHECK_FALSE(detail::float_ratio(1e-20f).has_value());
  CHECK_FALSE(detail::float_ratio(3e38f).has_value());
  CHECK_FALSE(detail::float_ratio(std::nanf("")).has_value());
  CHECK_FALSE(detail::float_ratio(INFINITY).has_value());
  // Whatever is returned reads back exactly, as the kernel evaluates it.
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> dist(-1000.f, 1000.f);
  for (int i = 0; i < 20000; ++i) {
    const float v = i % 2 == 0 ? dist(rng) : std::ldexp(dist(rng), -20);
    const auto r = detail::float_ratio(v);
    INFO(v);
    REQUIRE(r.has_value());
    CHECK(static_cast<float>(r->num) / static_cast<float>(r->den) == v);
  }
  // Every float that some num / den with |num|, den < 2^24 (exact as floats) rounds to is found,
  // also where only a semiconvergent of its continued fraction does (55 / 15214099), and small
  // magnitudes whose fractions need dens near 2^24.
  CHECK(detail::float_ratio(55.f / 15214099.f).has_value());
  std::uniform_int_distribution<int> any(1, (1 << 24) - 1);
  int small = 0;
  for (int i = 0; i < 200000; ++i) {
    // One draw in two: num <= 100 over den >= 2^22, magnitudes of 6e-8 to 2.4e-5.
    const int num = i % 2 == 0 ? any(rng) % 100 + 1 : any(rng);
    const int den = i % 2 == 0 ? any(rng) | (1 << 22) : any(rng);
    const float v = static_cast<float>(num) / static_cast<float>(den);
    small += v < 1e-5f ? 1 : 0;
    const auto r = detail::float_ratio(v);
    INFO(num << " / " << den << " = " << v);
    REQUIRE(r.has_value());
    CHECK(static_cast<float>(r->num) / static_cast<float>(r->den) == v);
  }
  CHECK(small > 1000);  // the small magnitudes were drawn
}

namespace {

// The host's model of mxfp4::extract_pair: register `pair` of word w, by the form layout.cuh gives
// it (one shift and a mask, a multiply, or two shifts and two masks).
uint32_t layout_register(uint32_t w, int pair) {
  namespace layout = moejit::kern::moe::layout;
  const auto shifted = [](uint32_t v, int s) { return s >= 0 ? v >> s : v << -s; };
  const int mag = layout::mag_shift(pair);
  const int sign = layout::sign_shift(pair);
  const uint32_t both = layout::kMagBits | layout::kSignBits;
  if (mag == sign) return shifted(w, mag) & both;
  if (layout::multiply_form(pair)) {
    return ((w & layout::pair_sources(pair)) * layout::multiply_factor(pair)) & both;
  }
  return (shifted(w, mag) & layout::kMagBits) | (shifted(w, sign) & layout::kSignBits);
}

}  // namespace

TEST_CASE("kernel layout: each register's dequant form yields its two codes as bf16 bits",
          "[plan]") {
  namespace layout = moejit::kern::moe::layout;
  // bf16 bits of code c (sign bit 3, magnitude bits 2..0): the sign at bit 15, the magnitude at
  // bits 8..6 (the value c * 2^-126 that dequant's multiply scales).
  const auto bf16_bits = [](uint32_t c) { return ((c >> 3) << 15) | ((c & 7u) << 6); };
  std::mt19937 rng(2026);
  int multiply_forms = 0;
  for (int pair = 0; pair < layout::kPairsPerStep; ++pair) {
    multiply_forms += layout::multiply_form(pair) ? 1 : 0;
    for (uint32_t lo = 0; lo < 16; ++lo) {
      for (uint32_t hi = 0; hi < 16; ++hi) {
        // The other registers' bits random: a form must not let them through.
        uint32_t w = static_cast<uint32_t>(rng()) & ~layout::pair_sources(pair);
        w = layout::deposit_nibble(w, pair, 0, lo);
        w = layout::deposit_nibble(w, pair, 1, hi);
        REQUIRE(layout::extract_nibble(w, pair, 0) == lo);
        REQUIRE(layout::extract_nibble(w, pair, 1) == hi);
        INFO("register " << pair << ", codes " << lo << " / " << hi << ", word " << w);
        REQUIRE(layout_register(w, pair) == (bf16_bits(lo) | (bf16_bits(hi) << 16)));
      }
    }
  }
  CHECK(layout::pairs_tile_word());
  CHECK(multiply_forms == 1);  // the layout's one multiply (layout.cuh): 10 integer ops per word
}

namespace {

// FNV-1a over where the repack puts every checkpoint value: for each (row, k) of an atom its lane,
// word, the bits of its code (all four, and the sign with the lowest magnitude bit, which fixes
// their order) and its scale byte; the gate / up / FC2 rows of a strip; atom order, sizes, K and
// row padding; the padding scale byte.
uint64_t layout_fingerprint() {
  namespace layout = moejit::kern::moe::layout;
  uint64_t h = 14695981039346656037ull;
  const auto mix = [&h](int64_t v) {
    for (int i = 0; i < 8; ++i) {
      h ^= static_cast<uint64_t>(v >> (8 * i)) & 0xFFu;
      h *= 1099511628211ull;
    }
  };
  for (int row = 0; row < layout::kAtomRows; ++row) {
    for (int k = 0; k < layout::kAtomK; ++k) {
      const layout::AtomCoord c = layout::atom_coord(row, k);
      mix(c.lane);
      mix(c.step);
      mix(layout::deposit_nibble(0, c.pair, c.half, 0xF));
      mix(layout::deposit_nibble(0, c.pair, c.half, 0x9));
      mix(layout::scale_byte(row, k));
    }
  }
  for (int m_atom = 0; m_atom < 3; ++m_atom) {
    for (int r = 0; r < layout::kAtomRows; ++r) {
      for (const bool gate_up : {false, true}) {
        const layout::RowSource src = layout::row_source(gate_up, m_atom, r);
        mix(src.matrix);
        mix(src.row);
      }
    }
  }
  const layout::Dims d{3, 5};
  mix(layout::atom_index(d, 2, 1, 4));
  mix(layout::weight_bytes(d, 2));
  mix(layout::scale_bytes(d, 2));
  for (const layout::Dims dims : {layout::fc1_dims(96, 2880), layout::fc2_dims(96, 2880),
                                  layout::fc1_dims(2880, 100), layout::fc2_dims(2880, 100)}) {
    mix(dims.m_atoms);
    mix(dims.k_atoms);
  }
  mix(layout::kPadScale);
  return h;
}

}  // namespace

TEST_CASE("kernel layout: its version names one fingerprint, at every interface", "[plan]") {
  namespace layout = moejit::kern::moe::layout;
  // Every layout a version has named. A layout change fails here until layout::kVersion and
  // version.hpp's kMoeWeightLayoutVersion are bumped and the new pair is added: weights kept
  // under the old version must then be told to repack, not be misread.
  struct Known {
    int version;
    uint64_t fingerprint;
  };
  constexpr Known kKnown[] = {{1, 0x088209037edc4240ull}};
  const uint64_t now = layout_fingerprint();
  INFO("layout fingerprint 0x" << std::hex << now << std::dec << ", layout::kVersion "
                               << layout::kVersion);
  const auto it = std::find_if(std::begin(kKnown), std::end(kKnown),
                               [](const Known& k) { return k.version == layout::kVersion; });
  REQUIRE(it != std::end(kKnown));
  CHECK(it->fingerprint == now);
  for (const Known& k : kKnown) {
    if (k.version != layout::kVersion) CHECK(k.fingerprint != now);
  }
  // The header's constant is tied at compile time (as in moe_forward.cpp): no run can differ.
  static_assert(moejit::kMoeWeightLayoutVersion == layout::kVersion,
                "version.hpp's kMoeWeightLayoutVersion is layout.cuh's kVersion");
  CHECK(moejit::moe_weight_layout_version() == layout::kVersion);
  CHECK(moejit_moe_weight_layout_version() == layout::kVersion);
  for (const ModelShape& shape : reference_shapes()) {
    INFO(shape.name);
    CHECK(moejit::moe_weight_layout(shape).version == layout::kVersion);
  }
}

TEST_CASE("moe sizes: workspace and repacked weights", "[plan]") {
  const std::vector<ModelShape> shapes = reference_shapes();
  for (const ModelShape& shape : shapes) {
    INFO(shape.name);
    const std::size_t whole = moejit::moe_workspace_bytes(shape, shape.max_tokens);
    CHECK(moejit::moe_workspace_bytes(shape, 0) == 0);
    std::size_t largest = 0;
    for (int tokens = 1; tokens <= shape.max_tokens; tokens += tokens < 64 ? 1 : 37) {
      const detail::MoeForwardConfig config = detail::choose_moe_config(shape, tokens);
      const detail::MoeWorkspaceLayout w = detail::moe_workspace_layout(shape, config);
      largest = std::max(largest, w.bytes);
      // Regions are ordered, aligned, and large enough for the padded rows.
      CHECK(w.inter % 256 == 0);
      CHECK(w.out2 % 256 == 0);
      CHECK(w.slot_row % 256 == 0);
      CHECK(w.out2 >= w.inter + static_cast<std::size_t>(w.padded_rows) * shape.intermediate * 2);
      CHECK(w.bytes >=
            w.out2 + static_cast<std::size_t>(w.padded_rows) * shape.hidden * 2);  // bf16 rows
      CHECK(w.padded_rows == w.max_blocks * config.route.block_m);
      CHECK(w.max_blocks >= 1);
      // The warpgroup tile's groups: listed by the route where that tile is planned, sized by the
      // same bound with the tile's N for the block, inside the route's regions.
      const int group_rows = config.route.group_rows;
      CHECK(group_rows == (config.wgmma ? config.fc1_wgmma.wgmma_n : 0));
      const long long rows = static_cast<long long>(tokens) * shape.top_k;
      CHECK(w.max_groups ==
            moejit::kern::moe::route_max_groups(rows, shape.num_experts, group_rows));
      if (group_rows > 0) {
        CHECK(w.max_groups >= 1);
        CHECK(w.max_groups <= w.max_blocks);
        CHECK(w.expert_group_offset % 256 == 0);
        CHECK(w.group_tiles % 256 == 0);
        CHECK(w.expert_group_offset >= w.chunk_base);
        CHECK(w.group_tiles >= w.expert_group_offset + 4 * (shape.num_experts + 1));
        CHECK(w.tile_done >= w.group_tiles + static_cast<std::size_t>(w.max_groups) * 8);
      }
      // The GEMMs' per-tile counters: one per block (groups never outnumber blocks).
      CHECK(w.tile_done % 256 == 0);
      CHECK(w.tile_done >= w.chunk_base);
      CHECK(w.inter >= w.tile_done + static_cast<std::size_t>(w.max_blocks) * 4);
      // The route's kernels carry the groups only where the warpgroup tile runs (sm_90a), and
      // the rank kernel never does.
      for (const char* arch : {"sm_90a", "sm_80"}) {
        const detail::MoeForwardSpecs specs = detail::moe_forward_specs(config, Arch::parse(arch));
        for (int i = 0; i < specs.route_count; ++i) {
          const auto& route = std::get<moejit::MoeRouteParams>(specs.route[i].params);
          CHECK(route.group_rows ==
                (route.kernel == RouteKernel::kRank ? 0 : specs.fc1_params.wgmma_n));
        }
        // FC2 waits per tile exactly where both GEMMs take the same tiles: both warpgroup tiles
        // (the same groups), or both mma.sync tiles (the same route blocks); not where FC2 keeps
        // its short-K tile beside the warpgroup FC1.
        const bool same_tiles = specs.fc1_params.wgmma_n == specs.fc2_params.wgmma_n;
        CHECK(specs.gemm_chain == same_tiles);
        CHECK(specs.fc1_params.block_n == specs.fc2_params.block_n);
        if (std::string(arch) == "sm_80") CHECK(specs.gemm_chain);
      }
      if (tokens <= 300) {
        CHECK(moejit::moe_workspace_bytes(shape, tokens) >= w.bytes);
      }
    }
    CHECK(whole >= largest);
    try {
      moejit::moe_workspace_bytes(shape, shape.max_tokens + 1);
      FAIL("moe_workspace_bytes accepted max_tokens above the shape's");
    } catch (const Error& e) {
      CHECK(e.code() == ErrorCode::kInvalidArgument);
      CHECK(contains(e.what(), "max_tokens"));
    }
  }

  // gpt-oss-120b: H = I = 2880 is 45 whole 64-wide atoms and 360 gate/up row pairs: no padding.
  const ModelShape& gpt = find_shape(shapes, "gpt-oss-120b");
  const moejit::MoeWeightLayout g = moejit::moe_weight_layout(gpt);
  CHECK(g.w13_bytes == 128ull * 2 * 2880 * 2880 / 2);
  CHECK(g.w13_scale_bytes == 128ull * 2 * 2880 * 2880 / 32);
  CHECK(g.w2_bytes == 128ull * 2880 * 2880 / 2);
  CHECK(g.w2_scale_bytes == 128ull * 2880 * 2880 / 32);
  CHECK(g.b13_bytes == 128ull * 2 * 2880 * 2);
  CHECK(g.b2_bytes == 128ull * 2880 * 2);
  // kimi: I = 384 is 6 atoms of K for FC2; H = 3584 is 56; no biases.
  const moejit::MoeWeightLayout k = moejit::moe_weight_layout(find_shape(shapes, "kimi-k3.1-tp8"));
  CHECK(k.w13_bytes == 896ull * 2 * 384 * 3584 / 2);
  CHECK(k.w2_bytes == 896ull * 3584 * 384 / 2);
  CHECK(k.b13_bytes == 0);
  CHECK(k.b2_bytes == 0);
  // A K that is not a whole atom is padded to one: I = 96 is 1.5 atoms of FC2's K.
  ModelShape odd = find_shape(shapes, "qwen3-30b-a3b");
  odd.intermediate = 96;
  const moejit::MoeWeightLayout o = moejit::moe_weight_layout(odd);
  CHECK(o.w2_bytes == 128ull * 2048 * 128 / 2);
  CHECK(o.w13_bytes == 128ull * 2 * 96 * 2048 / 2);
}

TEST_CASE("moe C ABI: handles, sizes and errors without a GPU", "[plan][capi]") {
  const char* text = R"({"name": "capi-moe-qwen3", "num_experts": 128, "top_k": 8,
                         "hidden": 2048, "intermediate": 768, "activation": {"kind": "swiglu"},
                         "max_tokens": 4096})";
  moejit::register_shapes(text, "capi-moe.json");
  const ModelShape shape = moejit::registered_shape("capi-moe-qwen3");

  moejit_moe* moe = nullptr;
  REQUIRE(moejit_moe_create("capi-moe-qwen3", &moe) == MOEJIT_OK);
  REQUIRE(moe != nullptr);
  CHECK(std::string(moejit_last_error()).empty());

  moejit_moe_weight_layout layout{};
  layout.struct_size = sizeof(layout);
  REQUIRE(moejit_moe_get_weight_layout(moe, &layout) == MOEJIT_OK);
  const moejit::MoeWeightLayout expected = moejit::moe_weight_layout(shape);
  CHECK(layout.w13_bytes == expected.w13_bytes);
  CHECK(layout.w13_scale_bytes == expected.w13_scale_bytes);
  CHECK(layout.w2_bytes == expected.w2_bytes);
  CHECK(layout.w2_scale_bytes == expected.w2_scale_bytes);
  CHECK(layout.b13_bytes == 0);
  CHECK(layout.b2_bytes == 0);

  std::size_t bytes = 0;
  REQUIRE(moejit_moe_workspace_bytes(moe, 4096, &bytes) == MOEJIT_OK);
  CHECK(bytes == moejit::moe_workspace_bytes(shape, 4096));
  CHECK(bytes > 0);
  CHECK(moejit_moe_workspace_bytes(moe, 4097, &bytes) == MOEJIT_ERROR_INVALID_ARGUMENT);
  // The C caller reads the name it called, not the C++ op's ("moe_workspace_bytes: ...").
  CHECK_THAT(std::string(moejit_last_error()),
             Catch::StartsWith("moejit_moe_workspace_bytes: max_tokens: expected"));
  CHECK(moejit_moe_workspace_bytes(moe, 16, nullptr) == MOEJIT_ERROR_INVALID_ARGUMENT);

  // Null handles and weights are refused with a message, never a crash.
  CHECK(moejit_moe_workspace_bytes(nullptr, 16, &bytes) == MOEJIT_ERROR_INVALID_ARGUMENT);
  CHECK(contains(moejit_last_error(), "moejit_moe_create"));
  CHECK(moejit_moe_forward(moe, nullptr, nullptr, nullptr, nullptr, nullptr, 0, nullptr, nullptr) ==
        MOEJIT_ERROR_INVALID_ARGUMENT);
  CHECK(contains(moejit_last_error(), "weights"));
  moejit_moe* none = nullptr;
  CHECK(moejit_moe_create("capi-moe-no-such-shape", &none) == MOEJIT_ERROR_INVALID_ARGUMENT);
  CHECK(none == nullptr);
  CHECK(contains(moejit_last_error(), "capi-moe-no-such-shape"));
  CHECK(contains(moejit_last_error(), "moejit_moe_create: shape_name: "));
  CHECK(moejit_moe_create(nullptr, &none) == MOEJIT_ERROR_INVALID_ARGUMENT);
  CHECK(none == nullptr);
  CHECK(moejit_moe_create("capi-moe-qwen3", nullptr) == MOEJIT_ERROR_INVALID_ARGUMENT);
  CHECK(moejit_moe_get_weight_layout(moe, nullptr) == MOEJIT_ERROR_INVALID_ARGUMENT);
  CHECK(moejit_moe_get_weight_layout(nullptr, &layout) == MOEJIT_ERROR_INVALID_ARGUMENT);
  // Repack with no handle or no target: refused before any tensor or driver call.
  moejit_moe_weights target{};
  target.struct_size = sizeof(target);
  CHECK(moejit_moe_repack_gpt_oss(nullptr, nullptr, nullptr, nullptr, nullptr, &target, 0, nullptr,
                                  nullptr) == MOEJIT_ERROR_INVALID_ARGUMENT);
  CHECK(contains(moejit_last_error(), "moejit_moe_repack_gpt_oss"));
  CHECK(moejit_moe_repack_gpt_oss(moe, nullptr, nullptr, nullptr, nullptr, nullptr, 0, nullptr,
                                  nullptr) == MOEJIT_ERROR_INVALID_ARGUMENT);
  CHECK(contains(moejit_last_error(), "target"));
  CHECK(moejit_moe_repack_separate(moe, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr,
                                   nullptr, 0, nullptr, nullptr) == MOEJIT_ERROR_INVALID_ARGUMENT);
  CHECK(contains(moejit_last_error(), "target"));
  // A gate value outside the enum: refused naming the three, before any device lookup.
  CHECK(moejit_append_shared(nullptr, nullptr, nullptr, nullptr, nullptr, 0, 1.f,
                             static_cast<moejit_shared_gate>(7),
                             nullptr) == MOEJIT_ERROR_INVALID_ARGUMENT);
  CHECK(contains(moejit_last_error(), "found 7"));

  // The structs that can grow (moejit.h): an unset, short, odd or huge struct_size is refused
  // naming the struct; an output larger than the library's is filled up to its own size, the
  // rest left as it was, and struct_size says how much was filled.
  for (const std::size_t bad : {std::size_t{0}, sizeof(moejit_moe_weight_layout) - 8,
                                sizeof(moejit_moe_weight_layout) + 4, std::size_t{4096}}) {
    INFO("struct_size " << bad);
    moejit_moe_weight_layout sized{};
    sized.struct_size = bad;
    sized.w13_bytes = 7;
    CHECK(moejit_moe_get_weight_layout(moe, &sized) == MOEJIT_ERROR_INVALID_ARGUMENT);
    CHECK_THAT(std::string(moejit_last_error()),
               Catch::StartsWith("moejit_moe_get_weight_layout: out->struct_size: expected "
                                 "sizeof(moejit_moe_weight_layout)"));
    CHECK(contains(moejit_last_error(), "found " + std::to_string(bad)));
    CHECK(sized.w13_bytes == 7);  // nothing written
  }
  struct {
    moejit_moe_weight_layout layout;
    std::size_t later_fields[3];
  } newer{};
  newer.layout.struct_size = sizeof(newer);
  newer.later_fields[0] = newer.later_fields[2] = 0x5a5a;
  REQUIRE(moejit_moe_get_weight_layout(moe, &newer.layout) == MOEJIT_OK);
  CHECK(newer.layout.struct_size == sizeof(moejit_moe_weight_layout));
  CHECK(newer.layout.w13_bytes == moejit::moe_weight_layout(shape).w13_bytes);
  CHECK(newer.layout.w2_scale_bytes == moejit::moe_weight_layout(shape).w2_scale_bytes);
  CHECK(newer.later_fields[0] == 0x5a5a);
  CHECK(newer.later_fields[1] == 0);
  CHECK(newer.later_fields[2] == 0x5a5a);
  // An input: an unset struct_size, or a field past this library's struct set, is refused before
  // any tensor is read; past it but zero is accepted (the next refusal is another's).
  const auto repack_with = [&](const moejit_moe_weights* weights) {
    return moejit_moe_repack_separate(moe, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr,
                                      weights, 0, nullptr, nullptr);
  };
  const moejit_moe_weights unset{};
  CHECK(repack_with(&unset) == MOEJIT_ERROR_INVALID_ARGUMENT);
  CHECK_THAT(std::string(moejit_last_error()),
             Catch::StartsWith("moejit_moe_repack_separate: target->struct_size: expected "
                               "sizeof(moejit_moe_weights)"));
  CHECK(contains(moejit_last_error(), "found 0 (left unset?)"));
  struct {
    moejit_moe_weights weights;
    std::size_t later_fields[2];
  } newer_weights{};
  newer_weights.weights.struct_size = sizeof(newer_weights);
  const moejit_status next = repack_with(&newer_weights.weights);
  CHECK(next != MOEJIT_OK);  // the null tensors, or no driver here: not the struct
  CHECK(next != MOEJIT_ERROR_UNSUPPORTED);
  CHECK_FALSE(contains(moejit_last_error(), "struct_size"));
  CHECK_FALSE(contains(moejit_last_error(), "is set, past"));
  newer_weights.later_fields[1] = 1;
  CHECK(repack_with(&newer_weights.weights) == MOEJIT_ERROR_UNSUPPORTED);
  CHECK_THAT(std::string(moejit_last_error()),
             Catch::StartsWith("moejit_moe_repack_separate: target: byte " +
                               std::to_string(sizeof(moejit_moe_weights) + 8) + " of " +
                               std::to_string(sizeof(newer_weights)) + " is set, past the " +
                               std::to_string(sizeof(moejit_moe_weights)) +
                               " bytes of moejit_moe_weights that libmoejit "));
  CHECK(moejit_moe_forward(moe, nullptr, nullptr, nullptr, &unset, nullptr, 0, nullptr, nullptr) ==
        MOEJIT_ERROR_INVALID_ARGUMENT);
  CHECK(contains(moejit_last_error(), "moejit_moe_forward: weights->struct_size: "));

  // A success clears this thread's message.
  REQUIRE(moejit_moe_get_weight_layout(moe, &layout) == MOEJIT_OK);
  CHECK(std::string(moejit_last_error()).empty());
  moejit_moe_destroy(moe);
  moejit_moe_destroy(nullptr);
}

// An op's kernel that can't be had (a failed compile, a capture miss) is refused under the op's
// name, as its argument errors are, and keeps its type: a CompileError its log and options.
TEST_CASE("ops: a kernel's error is given the op's name and keeps its type", "[plan][capi]") {
  const auto rethrown = [](const auto& thrown) -> std::exception_ptr {
    try {
      try {
        throw thrown;
      } catch (const Error&) {
        moejit::detail::rethrow_for_op("moe_forward");
      }
    } catch (...) {
      return std::current_exception();
    }
    return nullptr;
  };
  try {
    std::rethrow_exception(rethrown(moejit::CompileError("NVRTC refused kernel k", "k<e8>@sm_90a",
                                                         {"-arch=sm_90a"}, "log text", "/t/k.cu")));
  } catch (const moejit::CompileError& e) {
    CHECK(std::string(e.what()) == "moe_forward: NVRTC refused kernel k");
    CHECK(e.code() == moejit::ErrorCode::kCompileFailed);
    CHECK(e.kernel() == "k<e8>@sm_90a");
    CHECK(e.options() == std::vector<std::string>{"-arch=sm_90a"});
    CHECK(e.log() == "log text");
    CHECK(e.source_path() == "/t/k.cu");
  } catch (...) {
    FAIL("not a CompileError");
  }
  try {
    std::rethrow_exception(
        rethrown(Error(moejit::ErrorCode::kCaptureMiss, "kernel k is not loaded in this process")));
  } catch (const moejit::CompileError&) {
    FAIL("became a CompileError");
  } catch (const Error& e) {
    CHECK(std::string(e.what()) == "moe_forward: kernel k is not loaded in this process");
    CHECK(e.code() == moejit::ErrorCode::kCaptureMiss);
  }
  // Through the C ABI's guard, the C call's name replaces the op's.
  const moejit_status status =
      moejit::detail::capi_call({"moejit_moe_forward", "moe_forward"}, [&] {
        std::rethrow_exception(rethrown(Error(moejit::ErrorCode::kCaptureMiss, "kernel k")));
      });
  CHECK(status == MOEJIT_ERROR_CAPTURE_MISS);
  CHECK(std::string(moejit_last_error()) == "moejit_moe_forward: kernel k");
}

// The first thing an op asks the runtime, the calling thread's device, fails under the op's name
// too: here in a thread of its own, where no context is current (with no driver at all, the same
// error code).
TEST_CASE("ops: no current context is refused under the op's name", "[plan][capi]") {
  std::string message;
  moejit::ErrorCode code = moejit::ErrorCode::kInternal;
  std::string c_message;
  moejit_status c_status = MOEJIT_OK;
  std::thread([&] {
    try {
      moejit::append_shared(moejit::AppendSharedArgs{}, nullptr);
    } catch (const Error& e) {
      code = e.code();
      message = e.what();
    }
    c_status = moejit_append_shared(nullptr, nullptr, nullptr, nullptr, nullptr, 0, 1.f,
                                    MOEJIT_SHARED_SIGMOID, nullptr);
    c_message = moejit_last_error();
  }).join();
  INFO(message);
  CHECK(code == moejit::ErrorCode::kDriver);
  CHECK_THAT(message, Catch::StartsWith("append_shared: "));
  INFO(c_message);
  CHECK(c_status == MOEJIT_ERROR_DRIVER);
  CHECK_THAT(c_message, Catch::StartsWith("moejit_append_shared: "));
}

// The C ABI hands the C++ ops' messages on under the names its caller used: the call's name for
// the op's, and each C++ argument path in its C spelling where it stands as a whole word, so
// that "topk_weights.", a longer field, a shape name or a file path that holds one stays.
TEST_CASE("moe C ABI: messages name the C call and its arguments, not the C++ ones",
          "[plan][capi]") {
  using moejit::detail::CapiNames;
  using moejit::detail::CapiRename;
  constexpr CapiRename kRenames[] = {{"target.weights.w13", "target->w13"},
                                     {"target.weights.w2_scales", "target->w2_scales"},
                                     {"target.first_expert", "first_expert"},
                                     {"weights.w2", "weights->w2"},
                                     {"weights.b13", "weights->b13"},
                                     {"", "never"},
                                     {nullptr, nullptr}};
  const CapiNames names{"moejit_moe_repack_gpt_oss", "moe_repack_gpt_oss", kRenames};
  const auto message = [&](const char* text) { return moejit::detail::capi_message(text, names); };
  CHECK(message("moe_repack_gpt_oss: target.weights.w13: expected 16-byte alignment") ==
        "moejit_moe_repack_gpt_oss: target->w13: expected 16-byte alignment");
  CHECK(message("moe_repack_gpt_oss: w13_blocks: expected a buffer that shares no byte with "
                "target.weights.w2_scales; target.first_expert = -1") ==
        "moejit_moe_repack_gpt_oss: w13_blocks: expected a buffer that shares no byte with "
        "target->w2_scales; first_expert = -1");
  // Paths inside longer words stay; a whole one is renamed, at a sentence's end too.
  CHECK(message("x: topk_weights.w2, my_weights.w2, a.weights.w2, weights.w2_scales, "
                "weights.w2x, (weights.b13)") ==
        "x: topk_weights.w2, my_weights.w2, a.weights.w2, weights.w2_scales, weights.w2x, "
        "(weights->b13)");
  CHECK(message("weights.w2 then weights.w2.") == "weights->w2 then weights->w2.");
  CHECK(message("shape \"weights.w2.v1\" and /data/weights.w2/cache and weights.w2-old") ==
        "shape \"weights.w2.v1\" and /data/weights.w2/cache and weights.w2-old");
  CHECK(message("shape \"weights.w2\" or 'weights.b13'") ==
        "shape \"weights.w2\" or 'weights.b13'");
  // Another op's message keeps its name; no renames: the message as thrown.
  CHECK(message("moe_forward: weights.w2: x") == "moe_forward: weights->w2: x");
  CHECK(moejit::detail::capi_message("moe_forward: weights.w2: x", {}) ==
        "moe_forward: weights.w2: x");

  // Through the guard, as every C call records it.
  const moejit_status status = moejit::detail::capi_call(names, [] {
    throw Error(moejit::ErrorCode::kInvalidArgument,
                "moe_repack_gpt_oss: target.weights.w2_scales: expected 4-byte alignment");
  });
  CHECK(status == MOEJIT_ERROR_INVALID_ARGUMENT);
  CHECK(std::string(moejit_last_error()) ==
        "moejit_moe_repack_gpt_oss: target->w2_scales: expected 4-byte alignment");
}
