// decode_moe on the host: which shapes it serves (and the reason it refuses the others), the
// planner's tile per T (checked against the kernel's own Geometry rules), the supports()
// refusal of every Geometry rule with its message, names / JSON / hashes / generated source,
// the plan and prewarm per arch, the workspace, and the options of moe_forward and the C ABI
// that need no GPU.
#include <algorithm>
#include <catch2/catch.hpp>
#include <cmath>
#include <filesystem>
#include <functional>
#include <map>
#include <moejit/kern/moe/decode_pair_params.cuh>
#include <moejit/kern/moe/decode_params.cuh>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <variant>
#include <vector>

#include "codegen/codegen.hpp"
#include "moejit/error.hpp"
#include "moejit/kernel_spec.hpp"
#include "moejit/moe.hpp"
#include "moejit/moejit.h"
#include "moejit/runtime.hpp"
#include "moejit/shape.hpp"
#include "plan/moe_plan.hpp"
#include "support/support.hpp"

namespace {

using moejit::Activation;
using moejit::ActivationKind;
using moejit::Arch;
using moejit::DecodeKernel;
using moejit::DType;
using moejit::Error;
using moejit::ErrorCode;
using moejit::Family;
using moejit::KernelSpec;
using moejit::ModelShape;
using moejit::MoeDecodeParams;
namespace detail = moejit::detail;
namespace decode = moejit::kern::moe::decode;

bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

using moejit::test::find_shape;
using moejit::test::reference_shapes;

// The reference shapes decode_moe serves (issue 4), and the two it refuses.
const std::vector<std::string> kServed = {"kimi-k3.1-tp8",           "kimi-k3.1-tp4-ep2",
                                          "kimi-k3.1-tp4-ep2-rank1", "deepseek-v4-flash-tp4",
                                          "deepseek-v4.1-flash-tp4", "qwen3-30b-a3b",
                                          "qwen2-57b-a14b"};
const std::vector<std::string> kRefused = {"gpt-oss-120b", "gpt-oss-20b"};

decode::Geometry geometry_of(const MoeDecodeParams& p) {
  return decode::Geometry{p.num_experts, p.top_k,      p.hidden,     p.intermediate,
                          p.block_n,     p.fc1_strips, p.fc2_strips, p.stages};
}

KernelSpec spec_of(const MoeDecodeParams& p, const char* arch = "sm_90a") {
  KernelSpec spec;
  spec.family = Family::kDecodeMoe;
  spec.arch = Arch::parse(arch);
  spec.params = p;
  return spec;
}

// kimi-k3.1-tp8's main kernel at T = 1 with a fixed tile, to break one field of.
MoeDecodeParams good_params() {
  MoeDecodeParams p;
  p.kernel = DecodeKernel::kMain;
  p.num_experts = 896;
  p.top_k = 16;
  p.hidden = 3584;
  p.intermediate = 384;
  p.block_n = 16;
  p.fc1_strips = 2;
  p.fc2_strips = 4;
  p.stages = 4;
  p.activation.kind = ActivationKind::kSiTU;
  p.activation.beta = 4.f;
  p.activation.linear_beta = 25.f;
  p.id_dtype = DType::kI32;
  return p;
}

// supports() of `p` on `arch` must name every part of `expected`, and render must refuse it
// with the same reason.
void expect_refused(const MoeDecodeParams& p, const std::vector<std::string>& expected,
                    const char* arch = "sm_90a") {
  const KernelSpec spec = spec_of(p, arch);
  const std::string reason = moejit::supports(spec);
  INFO(spec.display_name() << " -> \"" << reason << "\"");
  REQUIRE_FALSE(reason.empty());
  CHECK(contains(reason, spec.display_name()));
  for (const std::string& part : expected) CHECK(contains(reason, part));
  try {
    detail::render(spec);
    FAIL("render accepted " << spec.display_name());
  } catch (const Error& e) {
    CHECK(e.code() == ErrorCode::kUnsupported);
    CHECK(contains(e.what(), reason));
  }
}

// The planner's CTAs per SM, restated: three for block_n 16 with 8 FC1 strips from T = 16 where
// the expected FC1 items, E (1 - (1 - k / E)^T) x I / 64, give each of 3 x 132 CTAs two; else two.
bool expected_three_ctas(const decode::Geometry& g, int tokens) {
  return g.block_n == 16 && g.fc1_strips == 8 && tokens >= 16 &&
         moejit::test::expected_touched(g.experts, g.top_k, tokens) * (g.inter / 64) >=
             2.0 * 3 * 132;
}

// The stage rule of the planner, restated on the kernel's Geometry: the deepest ring of 2..6
// chunks that keeps those CTAs per SM, else the deepest that keeps fewer.
int expected_stages(decode::Geometry g, int tokens) {
  const int aim = expected_three_ctas(g, tokens) ? 3 : 2;
  for (int ctas = aim; ctas >= 1; --ctas) {
    for (int s = 6; s >= 2; --s) {
      g.stages = s;
      if (g.rule() == decode::Rule::kOk && g.blocks_per_sm() >= ctas) return s;
    }
  }
  return 0;
}

double expected_touched(const ModelShape& shape, int tokens) {
  return moejit::test::expected_touched(shape.num_experts, shape.top_k, tokens);
}

// The planner's FC1 strips per item, restated. block_n 8: the fewest of 2, 4, 8 (dividing
// intermediate / 8) whose FC1 item, strips x hidden / 64 atoms of 512 bytes, is at least 64 KB.
// Otherwise the most of 8, 4, 2 whose expected FC1 items at T, expected_touched times
// intermediate / (8 * strips), number at least 160; else 2.
int expected_fc1_strips(const ModelShape& shape, int tokens, int block_n) {
  const int strips_total = shape.intermediate / 8;
  if (block_n == 8) {
    int last = 0;
    for (int strips : {2, 4, 8}) {
      if (strips_total % strips != 0) continue;
      last = strips;
      if (strips * (shape.hidden / 64) * 512 >= 64 * 1024) break;
    }
    return last;
  }
  const double touched = expected_touched(shape, tokens);
  for (int strips : {8, 4}) {
    if (strips_total % strips == 0 && touched * strips_total / strips >= 160.0) return strips;
  }
  return 2;
}

// The planner's block_n, restated: 8 for T <= 5; else 32 where the expected positions per
// touched expert, T * k / expected_touched, are at least 12; else 16.
int expected_block_n(const ModelShape& shape, int tokens) {
  if (tokens <= 5) return 8;
  // Below T = 16, also where the 8-strip block_n 16 tile (I / 64 FC1 items per touched expert)
  // would give its 2 x 132 CTAs fewer than 1.4 items each.
  if (tokens < 16 && expected_touched(shape, tokens) * (shape.intermediate / 64) < 1.4 * 264) {
    return 8;
  }
  return static_cast<double>(tokens) * shape.top_k / expected_touched(shape, tokens) >= 12.0 ? 32
                                                                                             : 16;
}

// The distinct main kernels the planner picks for T in 1..min(256, max_tokens).
// Every decode kernel the planner's configs launch for T <= min(max_tokens, 256): every kernel
// of each launch sequence (reset, main and combine, or the pair's fc1 and fc2).
std::vector<MoeDecodeParams> planner_choices(const ModelShape& shape, int max_tokens) {
  std::vector<MoeDecodeParams> out;
  for (int t = 1; t <= std::min(max_tokens, 256); ++t) {
    const detail::MoeForwardConfig c = detail::choose_moe_config(shape, t);
    if (!c.decode) continue;
    std::vector<MoeDecodeParams> launched = {c.decode_first, c.decode_second};
    if (!c.decode_pair) launched.push_back(c.decode_combine);
    for (const MoeDecodeParams& p : launched) {
      if (std::find(out.begin(), out.end(), p) == out.end()) out.push_back(p);
    }
  }
  return out;
}

// The persistent tiles (kMain) among them.
std::size_t main_tiles(const std::vector<MoeDecodeParams>& kernels) {
  return static_cast<std::size_t>(
      std::count_if(kernels.begin(), kernels.end(),
                    [](const MoeDecodeParams& p) { return p.kernel == DecodeKernel::kMain; }));
}

}  // namespace

TEST_CASE("decode_moe_problem: which reference shapes decode_moe serves", "[plan][decode]") {
  const std::vector<ModelShape> shapes = reference_shapes();
  REQUIRE(shapes.size() == kServed.size() + kRefused.size());
  for (const std::string& name : kServed) {
    const ModelShape& shape = find_shape(shapes, name);
    INFO(name);
    CHECK(detail::decode_moe_problem(shape).empty());
    CHECK(moejit::moe_decode_problem(shape).empty());
    // The planner picks decode_moe for every T up to 256 and never above.
    for (int t = 1; t <= 300; ++t) {
      const detail::MoeForwardConfig config = detail::choose_moe_config(shape, t);
      CHECK(config.decode == (t <= 256));
      if (!config.decode) continue;
      // The two-launch pair where it serves the shape up to kDecodePairMaxTokens, else the
      // persistent tile.
      const MoeDecodeParams pair = detail::choose_decode_pair(shape, t);
      CHECK(config.decode_pair == (pair.max_tokens != 0));
      CHECK(config.decode_pair == (t <= detail::kDecodePairMaxTokens && pair.max_tokens != 0));
      if (config.decode_pair) {
        CHECK(config.decode_first == pair);
        CHECK(config.decode_first.kernel == DecodeKernel::kPairFc1);
        CHECK(config.decode_first.max_tokens == (t == 1 ? 1 : 2));
        CHECK(config.decode_second == detail::decode_pair_fc2_params(pair));
        CHECK(config.decode_second.kernel == DecodeKernel::kPairFc2);
        CHECK(detail::decode_by_default(config) == (t <= detail::kDecodeAutoMaxTokens));
        continue;
      }
      CHECK(config.decode_second.kernel == DecodeKernel::kMain);
      CHECK(config.decode_first == detail::decode_reset_params(config.decode_second));
      CHECK(config.decode_first.kernel == DecodeKernel::kReset);
      CHECK(config.decode_combine == detail::decode_combine_params(config.decode_second));
      CHECK(config.decode_combine.kernel == DecodeKernel::kCombine);
      // An automatic call takes the persistent tile at no T (marlin_moe is faster there).
      CHECK_FALSE(detail::decode_by_default(config));
    }
  }
  for (const std::string& name : kRefused) {
    const ModelShape& shape = find_shape(shapes, name);
    INFO(name);
    const std::string reason = detail::decode_moe_problem(shape);
    INFO(reason);
    // Both reasons, named with the value and the rule, and where such shapes go.
    CHECK(contains(reason, "\"" + name + "\""));
    CHECK(contains(reason, "hidden = 2880 is not a multiple of 256"));
    CHECK(contains(reason, "256-wide FC1 chunks"));
    CHECK(contains(reason, "no bias epilogue"));
    CHECK(contains(reason, "use marlin_moe"));
    CHECK(moejit::moe_decode_problem(shape) == reason);
    for (int t = 1; t <= 300; ++t) CHECK_FALSE(detail::choose_moe_config(shape, t).decode);
  }

  // One rule at a time, on a shape decode_moe serves otherwise.
  const ModelShape& qwen = find_shape(shapes, "qwen3-30b-a3b");
  struct Case {
    std::function<void(ModelShape&)> edit;
    std::vector<std::string> expected;
  };
  const std::vector<Case> cases = {
      {[](ModelShape& s) { s.has_bias = true; }, {"no bias epilogue", "use marlin_moe"}},
      {[](ModelShape& s) { s.intermediate = 800; },
       {"intermediate = 800 is not a multiple of 128", "128- or 256-wide FC2 chunks"}},
      {[](ModelShape& s) { s.hidden = 2432; }, {"hidden = 2432 is not a multiple of 256"}},
      {[](ModelShape& s) {
         s.num_experts = 5000;
         s.global_experts = 5000;
       },
       {"num_experts = 5000", "1..4096", "12 bits"}},
  };
  for (const Case& c : cases) {
    ModelShape shape = qwen;
    c.edit(shape);
    const std::string reason = detail::decode_moe_problem(shape);
    INFO(reason);
    REQUIRE_FALSE(reason.empty());
    for (const std::string& part : c.expected) CHECK(contains(reason, part));
    CHECK_FALSE(detail::choose_moe_config(shape, 1).decode);
  }
  // An invalid shape is the descriptor's error, as for the other MoE entry points.
  ModelShape odd = qwen;
  odd.hidden = 48;
  try {
    moejit::moe_decode_problem(odd);
    FAIL("moe_decode_problem accepted hidden = 48");
  } catch (const Error& e) {
    CHECK(e.code() == ErrorCode::kInvalidDescriptor);
    CHECK(contains(e.what(), "hidden = 48"));
  }
}

TEST_CASE("decode_moe_problem: answers asked again come from the shape asked, not the last one",
          "[plan][decode]") {
  // decode_moe_problem keeps its answers per shape (moe_forward asks it on every forced call):
  // each field it reads must tell two shapes apart, in either order.
  const ModelShape qwen = find_shape(reference_shapes(), "qwen3-30b-a3b");
  ModelShape biased = qwen;
  biased.has_bias = true;
  ModelShape renamed = biased;
  renamed.name = "qwen3-30b-a3b-biased";
  ModelShape wide_k = qwen;
  wide_k.top_k = 100;
  ModelShape narrow_i = qwen;
  narrow_i.intermediate = 800;
  for (int round = 0; round < 2; ++round) {
    INFO("round " << round);
    CHECK(detail::decode_moe_problem(qwen).empty());
    const std::string bias_reason = detail::decode_moe_problem(biased);
    CHECK(contains(bias_reason, "\"qwen3-30b-a3b\""));
    CHECK(contains(bias_reason, "no bias epilogue"));
    const std::string renamed_reason = detail::decode_moe_problem(renamed);
    CHECK(contains(renamed_reason, "\"qwen3-30b-a3b-biased\""));
    CHECK(contains(detail::decode_moe_problem(wide_k), "top_k = 100 is out of range"));
    CHECK(contains(detail::decode_moe_problem(narrow_i), "intermediate = 800"));
    CHECK(detail::decode_moe_problem(qwen).empty());
  }
}

TEST_CASE("decode_moe planner: the tile for every T in 1..256 obeys the kernel's rules",
          "[plan][decode]") {
  std::vector<ModelShape> shapes;
  for (const std::string& name : kServed) shapes.push_back(find_shape(reference_shapes(), name));
  ModelShape wide = shapes.back();
  wide.name += "-int64-ids";
  wide.id_dtype = DType::kI64;
  shapes.push_back(wide);
  for (const ModelShape& shape : shapes) {
    INFO(shape.name);
    for (int t = 1; t <= 256; ++t) {
      for (int forced : {0, 8, 16, 32}) {
        INFO("T = " << t << ", block_n override " << forced);
        const MoeDecodeParams p = detail::choose_decode_config(shape, t, forced);
        const decode::Geometry g = geometry_of(p);
        REQUIRE(g.rule() == decode::Rule::kOk);
        CHECK(g.smem_bytes() <= 227 * 1024);
        CHECK(detail::decode_rule_problem(p).empty());
        CHECK(moejit::supports(spec_of(p, "sm_90a")).empty());
        CHECK(moejit::supports(spec_of(p, "sm_100a")).empty());
        // The host's sizes are the kernel's Geometry.
        CHECK(detail::decode_moe_smem_bytes(p) == g.smem_bytes());
        CHECK(detail::decode_moe_blocks_per_sm(p) == g.blocks_per_sm());
        CHECK(detail::decode_moe_workspace_bytes(p) == g.workspace_bytes());
        // The shape's sizes and types, unchanged.
        CHECK(p.kernel == DecodeKernel::kMain);
        CHECK(p.num_experts == shape.num_experts);
        CHECK(p.top_k == shape.top_k);
        CHECK(p.hidden == shape.hidden);
        CHECK(p.intermediate == shape.intermediate);
        CHECK(p.activation.kind == shape.activation.kind);
        CHECK(p.activation.beta == shape.activation.beta);
        CHECK(p.activation.limit == shape.activation.limit);
        CHECK(p.id_dtype == shape.id_dtype);
        // block_n as forced, else expected_block_n; 8 FC2 strips; FC1 strips by T
        // (expected_fc1_strips).
        CHECK(p.block_n == (forced != 0 ? forced : expected_block_n(shape, t)));
        CHECK(p.fc1_strips == expected_fc1_strips(shape, t, p.block_n));
        // Wide FC1 chunks only with block_n 8 (Geometry::fc1_chunk_k): 16 or 8 atoms filling at
        // most a 16 KB slot and dividing hidden / 64, else 4.
        if (p.block_n == 8) {
          CHECK(g.fc1_chunk_k() >= 8);
          CHECK(g.fc1_strips * g.fc1_chunk_k() <= 32);
          CHECK(g.fc1_k_atoms() % g.fc1_chunk_k() == 0);
          if (g.fc1_chunk_k() == 8) {
            CHECK((g.fc1_strips * 16 > 32 || g.fc1_k_atoms() % 16 != 0));
          }
        } else {
          CHECK(g.fc1_chunk_k() == 4);
        }
        CHECK(p.fc2_strips == 8);
        CHECK(p.stages == expected_stages(g, t));
        // For these shapes every 16-wide tile keeps three CTAs per SM where it aims for them (8
        // FC1 strips there), two elsewhere.
        if (p.block_n == 16) CHECK(g.blocks_per_sm() == (expected_three_ctas(g, t) ? 3 : 2));
        if (forced == 0 && p.block_n != 16) CHECK(g.blocks_per_sm() == 2);
        const detail::MoeForwardConfig c = detail::choose_moe_config(shape, t);
        if (forced == 0 && !c.decode_pair) CHECK(p == c.decode_second);
      }
    }
  }

  // deepseek-v4-flash-tp4 at T = 16..20: 592-773 expected FC1 items, under two per CTA of three
  // per SM, so two CTAs (T = 16: 82.7 us against 95.2 with three); T = 21 on, three.
  {
    const ModelShape ds = find_shape(reference_shapes(), "deepseek-v4-flash-tp4");
    for (int t : {16, 20, 21, 24}) {
      INFO("deepseek T = " << t);
      const MoeDecodeParams p = detail::choose_decode_config(ds, t, 0);
      CHECK(geometry_of(p).blocks_per_sm() == (t >= 21 ? 3 : 2));
    }
    // kimi and qwen3 keep three from T = 16.
    for (const char* name : {"kimi-k3.1-tp8", "qwen3-30b-a3b"}) {
      const MoeDecodeParams p =
          detail::choose_decode_config(find_shape(reference_shapes(), name), 16, 0);
      CHECK(geometry_of(p).blocks_per_sm() == 3);
    }
  }

  // The measured cases behind the rules (tools/PERF_LOG.md, decode_moe v6 and v10): below T = 6
  // block_n 8, with 2 strips per item for deepseek (64 KB items) and 4 for kimi (2 strips would
  // be 56 KB) and qwen3 (32 KB); above, 8 strips (deepseek from T = 9), with three CTAs per SM
  // from T = 16 (deepseek from T = 21). So each shape compiles two to four main kernels, not one
  // per T.
  const std::vector<ModelShape> refs = reference_shapes();
  for (int t : {1, 5}) {
    const MoeDecodeParams ds =
        detail::choose_decode_config(find_shape(refs, "deepseek-v4-flash-tp4"), t, 0);
    CHECK(ds.block_n == 8);
    CHECK(ds.fc1_strips == 2);
    CHECK(geometry_of(ds).fc1_chunk_k() == 16);
    const MoeDecodeParams kimi =
        detail::choose_decode_config(find_shape(refs, "kimi-k3.1-tp8"), t, 0);
    CHECK(kimi.block_n == 8);
    CHECK(kimi.fc1_strips == 4);
    CHECK(geometry_of(kimi).fc1_chunk_k() == 8);
    CHECK(detail::choose_decode_config(find_shape(refs, "qwen3-30b-a3b"), t, 0).fc1_strips == 4);
  }
  CHECK(detail::choose_decode_config(find_shape(refs, "kimi-k3.1-tp8"), 6, 0).block_n == 16);
  // block_n 32 where experts average 12 positions or more: qwen3 at T = 256 (16), not at 96 (6).
  CHECK(detail::choose_decode_config(find_shape(refs, "qwen3-30b-a3b"), 256, 0).block_n == 32);
  CHECK(detail::choose_decode_config(find_shape(refs, "qwen3-30b-a3b"), 96, 0).block_n == 16);
  CHECK(detail::choose_decode_config(find_shape(refs, "kimi-k3.1-tp8"), 256, 0).block_n == 16);
  // block_n 8 up to where the 8-strip tile has 1.4 FC1 items per CTA: deepseek-v4-flash-tp4
  // (8 items per expert) to T = 8 (44.7 experts touched), not at T = 9 (49); qwen3-30b-a3b (12 per
  // expert, 43 experts at T = 6) and kimi-k3.1-tp8 (6 per expert, 91 experts) not at T = 6.
  const ModelShape& deepseek = find_shape(refs, "deepseek-v4-flash-tp4");
  for (int t = 6; t <= 8; ++t) {
    INFO("T = " << t);
    CHECK(detail::choose_decode_config(deepseek, t, 0).block_n == 8);
    CHECK(detail::choose_decode_config(deepseek, t, 0).fc1_strips == 2);
  }
  CHECK(detail::choose_decode_config(deepseek, 9, 0).block_n == 16);
  CHECK(detail::choose_decode_config(find_shape(refs, "qwen3-30b-a3b"), 6, 0).block_n == 16);
  for (const std::string& name : kServed) {
    INFO(name);
    for (int t : {6, 24, 96, 256}) {
      const MoeDecodeParams p = detail::choose_decode_config(find_shape(refs, name), t, 0);
      if (p.block_n != 8) CHECK(p.fc1_strips == 8);
    }
    const std::size_t tiles = main_tiles(planner_choices(find_shape(refs, name), 256));
    CHECK(tiles >= 2);
    CHECK(tiles <= 4);
  }
}

// What one 2D tensor copy of the producer lands in shared memory: the box of `m` at element
// (x0, row0), row-major, 8-byte elements, as byte offsets into the tensor (the copy engine's
// tile mode, no swizzle).
std::vector<long long> box_offsets(const decode::TensorMapShape& m, long long x0, long long row0) {
  std::vector<long long> out;
  for (int r = 0; r < m.box_rows; ++r) {
    for (int x = 0; x < m.box_inner; ++x) {
      for (int b = 0; b < decode::kMapElementBytes; ++b) {
        out.push_back((row0 + r) * m.row_bytes + (x0 + x) * decode::kMapElementBytes + b);
      }
    }
  }
  return out;
}

TEST_CASE("decode_moe tensor maps: each chunk's copies land the atoms where the consumers read",
          "[plan][decode]") {
  namespace layout = moejit::kern::moe::layout;
  const std::vector<ModelShape> refs = reference_shapes();
  for (const std::string& name : kServed) {
    const ModelShape& shape = find_shape(refs, name);
    for (int t : {1, 2, 6, 16, 256}) {
      for (int forced : {0, 8, 16, 32}) {
        const decode::Geometry g = geometry_of(detail::choose_decode_config(shape, t, forced));
        INFO(name << " T = " << t << " fc1_strips " << g.fc1_strips << " block_n " << g.block_n);
        for (bool fc2 : {false, true}) {
          INFO((fc2 ? "FC2" : "FC1"));
          const layout::Dims dims = fc2 ? layout::Dims{g.fc2_m_atoms(), g.fc2_k_atoms()}
                                        : layout::Dims{g.fc1_m_atoms(), g.fc1_k_atoms()};
          const int strips = fc2 ? g.fc2_strips : g.fc1_strips;
          const int chunk_k = fc2 ? g.fc2_chunk_k() : g.fc1_chunk_k();
          const int group = decode::copy_group_atoms(chunk_k);  // atoms per copy
          const int groups = chunk_k / group;
          CHECK(groups * group == chunk_k);
          const int chunks = fc2 ? g.fc2_chunks() : g.fc1_chunks();
          const int items = fc2 ? g.fc2_items() : g.fc1_items();
          const decode::TensorMapShape w =
              fc2 ? decode::fc2_map_shape(g, false) : decode::fc1_map_shape(g, false);
          const decode::TensorMapShape sc =
              fc2 ? decode::fc2_map_shape(g, true) : decode::fc1_map_shape(g, true);
          // The tensors are exactly the kernel layout's buffers, and the boxes fit the engine.
          CHECK(w.rows * w.row_bytes == layout::weight_bytes(dims, g.experts));
          CHECK(sc.rows * sc.row_bytes == layout::scale_bytes(dims, g.experts));
          for (const decode::TensorMapShape& m : {w, sc}) {
            CHECK(m.row_bytes % 16 == 0);
            CHECK(m.box_inner >= 1);
            CHECK(m.box_inner <= 256);
            CHECK(m.box_rows <= 256);
            CHECK((m.box_inner * decode::kMapElementBytes) % 16 == 0);
            CHECK(m.inner * decode::kMapElementBytes == m.row_bytes);
          }
          // The bytes the chunk's barrier expects for its weights and scales, and the slot
          // regions they land in.
          CHECK(groups * w.box_bytes() == strips * chunk_k * layout::kAtomBytes);
          CHECK(groups * sc.box_bytes() == strips * chunk_k * layout::kAtomScaleBytes);
          CHECK(groups * w.box_bytes() <= g.slot_weight_bytes());
          CHECK(groups * sc.box_bytes() <= g.slot_scale_bytes());
          // First and last expert, item and chunk: the chunk's copies (one per group of atoms,
          // landing one after the other) put the atom (slice * strips + r, c * chunk_k + j) of
          // expert e at slot_atom(strips, chunk_k, r, j), where mma_chunk reads it.
          for (int e : {0, g.experts - 1}) {
            for (int item : {0, items - 1}) {
              for (int c : {0, chunks - 1}) {
                const long long row0 = static_cast<long long>(e) * dims.m_atoms + item * strips;
                std::vector<long long> wb;
                std::vector<long long> sb;
                for (int q = 0; q < groups; ++q) {
                  const long long atom0 = static_cast<long long>(c) * chunk_k + q * group;
                  const std::vector<long long> wq =
                      box_offsets(w, atom0 * layout::kAtomBytes / 8, row0);
                  const std::vector<long long> sq =
                      box_offsets(sc, atom0 * layout::kAtomScaleBytes / 8, row0);
                  wb.insert(wb.end(), wq.begin(), wq.end());
                  sb.insert(sb.end(), sq.begin(), sq.end());
                }
                bool weights_ok = true;
                bool scales_ok = true;
                for (int r = 0; r < strips; ++r) {
                  for (int j = 0; j < chunk_k; ++j) {
                    const long long atom =
                        layout::atom_index(dims, e, item * strips + r, c * chunk_k + j);
                    for (int b = 0; b < layout::kAtomBytes; ++b) {
                      const std::size_t at = static_cast<std::size_t>(
                          decode::slot_atom(strips, chunk_k, r, j) * layout::kAtomBytes + b);
                      weights_ok = weights_ok && wb[at] == atom * layout::kAtomBytes + b;
                    }
                    for (int b = 0; b < layout::kAtomScaleBytes; ++b) {
                      const std::size_t at = static_cast<std::size_t>(
                          decode::slot_atom(strips, chunk_k, r, j) * layout::kAtomScaleBytes + b);
                      scales_ok = scales_ok && sb[at] == atom * layout::kAtomScaleBytes + b;
                    }
                  }
                }
                INFO("expert " << e << ", item " << item << ", chunk " << c);
                CHECK(weights_ok);
                CHECK(scales_ok);
              }
            }
          }
        }
      }
    }
  }
}

TEST_CASE("decode_moe supports(): every Geometry rule, the types and the arch, with the reason",
          "[plan][decode]") {
  REQUIRE(moejit::supports(spec_of(good_params())).empty());
  MoeDecodeParams reset = good_params();
  reset.kernel = DecodeKernel::kReset;
  CHECK(moejit::supports(spec_of(reset)).empty());

  struct Case {
    std::function<void(MoeDecodeParams&)> edit;
    decode::Rule rule;  // kOk: a rule outside Geometry (types, activation)
    std::vector<std::string> expected;
  };
  const std::vector<Case> cases = {
      {[](MoeDecodeParams& p) { p.num_experts = 5000; },
       decode::Rule::kExperts,
       {"num_experts = 5000", "1..4096", "12 bits"}},
      {[](MoeDecodeParams& p) { p.num_experts = 0; }, decode::Rule::kExperts, {"num_experts = 0"}},
      {[](MoeDecodeParams& p) { p.top_k = 65; }, decode::Rule::kTopK, {"top_k = 65", "1..64"}},
      {[](MoeDecodeParams& p) { p.hidden = 2880; },
       decode::Rule::kHidden,
       {"hidden = 2880 is not a multiple of 256", "256-wide FC1 chunks"}},
      {[](MoeDecodeParams& p) { p.intermediate = 320; },
       decode::Rule::kInter,
       {"intermediate = 320 is not a multiple of 128", "128- or 256-wide FC2 chunks"}},
      {[](MoeDecodeParams& p) { p.block_n = 24; },
       decode::Rule::kBlockN,
       {"block_n = 24", "8, 16, 32"}},
      {[](MoeDecodeParams& p) { p.fc1_strips = 3; },
       decode::Rule::kFc1Strips,
       {"fc1_strips = 3", "2, 4 or 8", "intermediate / 8 = 48"}},
      {[](MoeDecodeParams& p) { p.fc2_strips = 2; },
       decode::Rule::kFc2Strips,
       {"fc2_strips = 2", "4 or 8", "hidden / 16 = 224"}},
      {[](MoeDecodeParams& p) { p.stages = 1; }, decode::Rule::kStages, {"stages = 1", "2..8"}},
      {[](MoeDecodeParams& p) { p.stages = 9; }, decode::Rule::kStages, {"stages = 9", "2..8"}},
      {[](MoeDecodeParams& p) {
         p.block_n = 32;
         p.fc1_strips = 2;
         p.fc2_strips = 8;
         p.stages = 8;
       },
       decode::Rule::kSharedMemory,
       {"bytes of shared memory per CTA", "at most 232448", "lower stages"}},
      // 4096 experts: 80 KB of routing counters, more than a two-chunk ring.
      {[](MoeDecodeParams& p) {
         p.num_experts = 4096;
         p.top_k = 1;
         p.stages = 2;
       },
       decode::Rule::kSharedMemory,
       {"routing scratch", "raise stages"}},
      {[](MoeDecodeParams& p) { p.id_dtype = DType::kF32; },
       decode::Rule::kOk,
       {"id_dtype = f32", "i32, i64"}},
      {[](MoeDecodeParams& p) { p.activation.limit = 7.f; },
       decode::Rule::kOk,
       {"limit = 7", "takes no limit"}},
      {[](MoeDecodeParams& p) { p.activation.beta = -1.f; },
       decode::Rule::kOk,
       {"beta = -1", "finite and positive"}},
      {[](MoeDecodeParams& p) { p.kernel = static_cast<DecodeKernel>(7); },
       decode::Rule::kOk,
       {"kernel = 7", "reset, main"}},
  };
  std::set<decode::Rule> rules_seen;
  for (const Case& c : cases) {
    MoeDecodeParams p = good_params();
    c.edit(p);
    CHECK(geometry_of(p).rule() == c.rule);
    rules_seen.insert(geometry_of(p).rule());
    expect_refused(p, c.expected);
  }
  // Every rule of the kernel's static_asserts is exercised.
  CHECK(rules_seen.size() == 10);

  // Arch: sm_90 or newer, and the arch's shared memory per CTA.
  expect_refused(good_params(), {"decode_moe needs sm_90 or newer", "found sm_80", "marlin_moe"},
                 "sm_80");
  expect_refused(good_params(), {"needs sm_90 or newer", "sm_89"}, "sm_89");
  CHECK(moejit::supports(spec_of(good_params(), "sm_90")).empty());
  MoeDecodeParams deep = good_params();
  deep.stages = 8;
  const long long smem = detail::decode_moe_smem_bytes(deep);
  REQUIRE(smem > 101376);
  expect_refused(deep, {"needs " + std::to_string(smem), "sm_120 allows at most 101376"}, "sm_120");
  CHECK_FALSE(detail::decode_moe_runs_on(deep, Arch::parse("sm_120")));
  CHECK_FALSE(detail::decode_moe_runs_on(good_params(), Arch::parse("sm_80")));
  CHECK(detail::decode_moe_runs_on(good_params(), Arch::parse("sm_90a")));
  CHECK(detail::decode_moe_runs_on(good_params(), Arch::parse("sm_100a")));
}

TEST_CASE("decode_moe names, JSON, hashes and generated source", "[plan][decode]") {
  CHECK(std::string(moejit::family_name(Family::kDecodeMoe)) == "decode_moe");
  CHECK(moejit::parse_family("decode_moe") == Family::kDecodeMoe);
  CHECK(std::string(moejit::decode_kernel_name(DecodeKernel::kReset)) == "reset");
  CHECK(std::string(moejit::decode_kernel_name(DecodeKernel::kMain)) == "main");
  CHECK(std::string(moejit::decode_kernel_name(DecodeKernel::kCombine)) == "combine");

  const KernelSpec main = spec_of(good_params());
  MoeDecodeParams reset_params = good_params();
  reset_params.kernel = DecodeKernel::kReset;
  const KernelSpec reset = spec_of(reset_params);
  const KernelSpec combine = spec_of(detail::decode_combine_params(good_params()));
  CHECK(main.display_name() ==
        "decode_moe<main,e896,k16,h3584,i384,n16,f2x4,s4,situ(beta=4,linear_beta=25),i32>"
        "@sm_90a");
  CHECK(reset.display_name() ==
        "decode_moe<reset,e896,k16,h3584,i384,n16,f2x4,s4,situ(beta=4,linear_beta=25),i32>"
        "@sm_90a");
  CHECK(combine.display_name() ==
        "decode_moe<combine,e896,k16,h3584,i384,n16,f2x4,s4,situ(beta=4,linear_beta=25),i32>"
        "@sm_90a");

  const auto json = nlohmann::json::parse(main.to_json());
  CHECK(json["family"] == "decode_moe");
  CHECK(json["arch"] == "sm_90a");
  CHECK(json["params"]["kernel"] == "main");
  CHECK(json["params"]["num_experts"] == 896);
  CHECK(json["params"]["top_k"] == 16);
  CHECK(json["params"]["hidden"] == 3584);
  CHECK(json["params"]["intermediate"] == 384);
  CHECK(json["params"]["block_n"] == 16);
  CHECK(json["params"]["fc1_strips"] == 2);
  CHECK(json["params"]["fc2_strips"] == 4);
  CHECK(json["params"]["stages"] == 4);
  CHECK(json["params"]["activation"]["kind"] == "situ");
  CHECK(json["params"]["activation"]["linear_beta"].get<float>() == 25.f);
  CHECK(json["params"]["id_dtype"] == "i32");

  // Typed values become template arguments; the activation is the same functor marlin uses.
  const detail::GeneratedSource src = detail::render(main);
  CHECK(contains(src.source, "#include <moejit/kern/moe/decode_moe.cuh>"));
  CHECK(src.name_expression ==
        "moejit::kern::moe::decode::decode_moe<moejit::kern::moe::decode::DecodeTraits<896, 16, "
        "3584, 384, 16, 2, 4, 4, moejit::kern::moe::act::SiTU<4, 1, 25, 1>, false>>");
  CHECK(detail::render(reset).name_expression ==
        "moejit::kern::moe::decode::decode_moe_reset<moejit::kern::moe::decode::DecodeTraits<896, "
        "16, 3584, 384, 16, 2, 4, 4, moejit::kern::moe::act::SiTU<4, 1, 25, 1>, false>>");
  CHECK(detail::render(combine).name_expression ==
        "moejit::kern::moe::decode::decode_moe_combine<moejit::kern::moe::decode::DecodeTraits<"
        "896, 16, 3584, 384, 16, 2, 4, 4, moejit::kern::moe::act::SiTU<4, 1, 25, 1>, false>>");
  CHECK(src.file_name ==
        "decode_moe_main_e896_k16_h3584_i384_n16_f2x4_s4_situ_b4o1_lb25o1_i32_sm_90a.cu");
  MoeDecodeParams wide = good_params();
  wide.id_dtype = DType::kI64;
  wide.activation = Activation{};
  wide.activation.kind = ActivationKind::kClampedSwiGLU;
  wide.activation.limit = 10.f;
  CHECK(
      contains(detail::render(spec_of(wide)).name_expression, "act::ClampedSwiGLU<10, 1>, true>>"));

  // Every field is in equality, the hash, the display name and the file name.
  const std::vector<std::function<void(MoeDecodeParams&)>> edits = {
      [](MoeDecodeParams&) {},
      [](MoeDecodeParams& p) { p.kernel = DecodeKernel::kReset; },
      [](MoeDecodeParams& p) { p.kernel = DecodeKernel::kCombine; },
      [](MoeDecodeParams& p) { p.num_experts = 448; },
      [](MoeDecodeParams& p) { p.top_k = 8; },
      [](MoeDecodeParams& p) { p.hidden = 4096; },
      [](MoeDecodeParams& p) { p.intermediate = 768; },
      [](MoeDecodeParams& p) {
        p.block_n = 32;
        p.stages = 3;
      },
      [](MoeDecodeParams& p) { p.fc1_strips = 4; },
      [](MoeDecodeParams& p) { p.fc2_strips = 8; },
      [](MoeDecodeParams& p) { p.stages = 3; },
      [](MoeDecodeParams& p) { p.activation.beta = 2.f; },
      [](MoeDecodeParams& p) { p.activation.linear_beta = 20.f; },
      [](MoeDecodeParams& p) {
        p.activation = Activation{};
        p.activation.kind = ActivationKind::kSwiGLU;
      },
      [](MoeDecodeParams& p) { p.id_dtype = DType::kI64; },
  };
  std::vector<KernelSpec> variants;
  for (const auto& edit : edits) {
    MoeDecodeParams p = good_params();
    edit(p);
    REQUIRE(moejit::supports(spec_of(p)).empty());
    variants.push_back(spec_of(p));
  }
  variants.push_back(spec_of(good_params(), "sm_100a"));
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
  // Params of another family under decode_moe's name.
  KernelSpec mixed = main;
  mixed.params = moejit::NarrowIdsParams{};
  const std::string reason = moejit::supports(mixed);
  CHECK(contains(reason, "names family decode_moe"));
}

TEST_CASE("decode_moe plan: prewarm lists every decode kernel a call can pick, per arch",
          "[plan][decode]") {
  const std::vector<ModelShape> shapes = reference_shapes();
  const Arch sm90 = Arch::parse("sm_90a");
  const Arch sm80 = Arch::parse("sm_80");
  for (const ModelShape& shape : shapes) {
    INFO(shape.name);
    const bool served = detail::decode_moe_problem(shape).empty();
    // Two kernels (reset, main) per distinct tile the planner picks for T <= 256.
    const std::vector<MoeDecodeParams> choices = planner_choices(shape, shape.max_tokens);
    for (const char* arch : {"sm_90a", "sm_100a", "sm_80"}) {
      INFO(arch);
      const Arch target = Arch::parse(arch);
      std::set<std::string> planned_decode;
      std::vector<KernelSpec> marlin;
      for (const KernelSpec& spec : moejit::plan_kernels(shape, target)) {
        if (spec.family == Family::kDecodeMoe) planned_decode.insert(spec.display_name());
        if (spec.family == Family::kMarlinMoe) marlin.push_back(spec);
      }
      std::set<std::string> expected;
      if (served && target.sm >= 90) {
        for (const MoeDecodeParams& p : choices) {
          expected.insert(detail::decode_moe_spec(p, target).display_name());
        }
      }
      CHECK(planned_decode == expected);
      // marlin stays planned for every T (a call can force it): its tiles for every T
      // (test_moe_plan.cpp's reference-shape test says which, per shape).
      CHECK(static_cast<int>(marlin.size()) ==
            moejit::test::planned_marlin_kernels(shape, target == sm90));
    }
  }

  // The kernels of one config: the decode launches first, then the marlin chain a call may force.
  ModelShape kimi = find_shape(shapes, "kimi-k3.1-tp8");
  const detail::MoeForwardConfig k1 = detail::choose_moe_config(kimi, 1);
  const detail::MoeForwardSpecs s90 = detail::moe_forward_specs(k1, sm90);
  CHECK(s90.decode);
  CHECK(k1.decode_pair);
  CHECK(s90.decode_first == detail::decode_moe_spec(k1.decode_first, sm90));
  CHECK(s90.decode_second == detail::decode_moe_spec(k1.decode_second, sm90));
  const std::vector<KernelSpec> listed = detail::moe_config_specs(k1, sm90);
  REQUIRE(listed.size() == 6);
  CHECK(listed[0] == s90.decode_first);
  CHECK(listed[1] == s90.decode_second);
  CHECK(std::get<MoeDecodeParams>(listed[0].params).kernel == DecodeKernel::kPairFc1);
  CHECK(std::get<MoeDecodeParams>(listed[1].params).kernel == DecodeKernel::kPairFc2);
  const detail::MoeForwardConfig k3 = detail::choose_moe_config(kimi, 3);
  CHECK_FALSE(k3.decode_pair);
  const std::vector<KernelSpec> listed3 = detail::moe_config_specs(k3, sm90);
  CHECK(std::get<MoeDecodeParams>(listed3[0].params).kernel == DecodeKernel::kReset);
  CHECK(std::get<MoeDecodeParams>(listed3[1].params).kernel == DecodeKernel::kMain);
  CHECK(std::get<MoeDecodeParams>(listed3[2].params).kernel == DecodeKernel::kCombine);
  CHECK(listed3[3].family != Family::kDecodeMoe);
  CHECK_FALSE(s90.decode_has_combine);
  CHECK(detail::moe_forward_specs(k3, sm90).decode_has_combine);
  CHECK(listed[2].family == Family::kRoute);
  CHECK(listed[5].family == Family::kCombine);
  // Below sm_90 the same config runs marlin only.
  const detail::MoeForwardSpecs s80 = detail::moe_forward_specs(k1, sm80);
  CHECK_FALSE(s80.decode);
  CHECK(detail::moe_config_specs(k1, sm80).size() == 4);
  // int64 ids: decode reads them directly (no narrow launch on that path).
  kimi.id_dtype = DType::kI64;
  const std::vector<KernelSpec> wide =
      detail::moe_config_specs(detail::choose_moe_config(kimi, 1), sm90);
  REQUIRE(wide.size() == 7);
  CHECK(std::get<MoeDecodeParams>(wide[1].params).id_dtype == DType::kI64);
  CHECK(wide[2].family == Family::kNarrowIds);

  // Segment ends: the decode tile is constant inside each run of T.
  for (const std::string& name : kServed) {
    const ModelShape& shape = find_shape(shapes, name);
    INFO(name);
    const std::vector<int> ends = detail::moe_config_segment_ends(shape, shape.max_tokens);
    CHECK(std::find(ends.begin(), ends.end(), 256) != ends.end());
    int previous = 0;
    for (int end : ends) {
      if (previous >= 256) break;
      const detail::MoeForwardConfig at_end = detail::choose_moe_config(shape, end);
      for (int t = previous + 1; t <= end; ++t) {
        const detail::MoeForwardConfig c = detail::choose_moe_config(shape, t);
        CHECK(c.decode == at_end.decode);
        CHECK(c.decode_first == at_end.decode_first);
        CHECK(c.decode_second == at_end.decode_second);
      }
      previous = end;
    }
  }
}

TEST_CASE("decode_moe pair: the planner's choice, its rules, names and the SM it shares",
          "[plan][decode]") {
  const std::vector<ModelShape> shapes = reference_shapes();
  // Every served reference shape but qwen2-57b-a14b takes the pair at T = 1 and 2 (buckets 1 and
  // 2), nothing at T = 3; qwen2's I = 2560 leaves fc2 fewer than 8 units of shared memory.
  for (const std::string& name : kServed) {
    const ModelShape& shape = find_shape(shapes, name);
    INFO(name);
    const bool pair_served = name != "qwen2-57b-a14b";
    for (int t = 1; t <= 3; ++t) {
      const MoeDecodeParams p = detail::choose_decode_pair(shape, t);
      CHECK(p.kernel == DecodeKernel::kPairFc1);
      CHECK(p.max_tokens == (pair_served && t <= 2 ? t : 0));
      if (p.max_tokens == 0) continue;
      const MoeDecodeParams fc2 = detail::decode_pair_fc2_params(p);
      for (const MoeDecodeParams& k : {p, fc2}) {
        const KernelSpec spec = detail::decode_moe_spec(k, Arch::parse("sm_90a"));
        INFO(spec.display_name());
        CHECK(moejit::supports(spec).empty());
        CHECK(detail::decode_moe_runs_on(k, Arch::parse("sm_90a")));
        CHECK_FALSE(detail::decode_moe_runs_on(k, Arch::parse("sm_80")));
        CHECK(detail::decode_moe_blocks_per_sm(k) == 1);
      }
      // One CTA of each kernel fits an SM together (228 KB, 1 KB reserved per CTA).
      const long long both = detail::decode_moe_smem_bytes(p) + detail::decode_moe_smem_bytes(fc2);
      CHECK(both + 2 * 1024 <= 228 * 1024);
      CHECK(detail::decode_moe_workspace_bytes(p) ==
            (static_cast<long long>(t) * shape.top_k * shape.intermediate * 2 + 255) / 256 * 256);
      CHECK(detail::decode_moe_workspace_bytes(fc2) == detail::decode_moe_workspace_bytes(p));
    }
  }
  const ModelShape qwen2 = find_shape(shapes, "qwen2-57b-a14b");
  MoeDecodeParams refused = detail::choose_decode_pair(find_shape(shapes, "qwen3-30b-a3b"), 1);
  refused.hidden = qwen2.hidden;
  refused.intermediate = qwen2.intermediate;
  refused.num_experts = qwen2.num_experts;
  CHECK(contains(moejit::supports(spec_of(refused)), "FC2 units"));
  CHECK(contains(detail::decode_pair_rule_problem(refused), "at max_tokens = 1"));
  // A shape with biases never takes the pair (decode_moe has no bias epilogue).
  ModelShape biased = find_shape(shapes, "qwen3-30b-a3b");
  biased.has_bias = true;
  CHECK(detail::choose_decode_pair(biased, 1).max_tokens == 0);

  // Names, JSON and source: PairTraits with the T bucket; the persistent tile's fields unused.
  CHECK(std::string(moejit::decode_kernel_name(DecodeKernel::kPairFc1)) == "pair_fc1");
  CHECK(std::string(moejit::decode_kernel_name(DecodeKernel::kPairFc2)) == "pair_fc2");
  const MoeDecodeParams kimi = detail::choose_decode_pair(find_shape(shapes, "kimi-k3.1-tp8"), 2);
  const KernelSpec fc1 = spec_of(kimi);
  const KernelSpec fc2 = spec_of(detail::decode_pair_fc2_params(kimi));
  CHECK(fc1.display_name() ==
        "decode_moe<pair_fc1,e896,k16,h3584,i384,t2,situ(beta=4,linear_beta=25),i32>@sm_90a");
  CHECK(fc2.display_name() ==
        "decode_moe<pair_fc2,e896,k16,h3584,i384,t2,situ(beta=4,linear_beta=25),i32>@sm_90a");
  CHECK_FALSE(fc1 == fc2);
  CHECK(fc1.hash() != fc2.hash());
  const auto json = nlohmann::json::parse(fc1.to_json());
  CHECK(json["params"]["kernel"] == "pair_fc1");
  CHECK(json["params"]["max_tokens"] == 2);
  const detail::GeneratedSource src = detail::render(fc2);
  CHECK(contains(src.source, "#include <moejit/kern/moe/decode_pair.cuh>"));
  CHECK(src.name_expression ==
        "moejit::kern::moe::decode::decode_pair_fc2<moejit::kern::moe::decode::PairTraits<896, 16, "
        "3584, 384, 2, moejit::kern::moe::act::SiTU<4, 1, 25, 1>, false>>");
  CHECK(detail::render(fc1).file_name != src.file_name);
  // fc2's grid: a CTA per H strip up to the SMs, never more than 4 strips a CTA.
  const decode::PairGeometry g{896, 16, 3584, 384, 2};
  CHECK(g.fc2_grid(132) == 132);
  CHECK(g.fc2_grid(300) == 224);
  CHECK(g.fc2_grid(16) == 56);
  // fc1's producer keeps the whole units nearest 32 KB in flight, at least one, and paces only
  // where that is fewer than its ring's slots (else the empty slots bound it already).
  CHECK(g.fc1_unit_bytes() == 56 * 544);
  CHECK(g.fc1_in_flight() == 1);
  const decode::PairGeometry deepseek{256, 6, 4096, 512, 1};
  CHECK(deepseek.fc1_unit_bytes() == 64 * 544);
  CHECK(deepseek.fc1_in_flight() == 1);
  const decode::PairGeometry qwen3{128, 8, 2048, 768, 1};
  CHECK(qwen3.fc1_unit_bytes() == 32 * 544);
  CHECK(qwen3.fc1_in_flight() == 2);
  CHECK(qwen3.fc1_in_flight() < qwen3.fc1_stages());
  CHECK(decode::PairGeometry{64, 8, 1024, 768, 1}.fc1_in_flight() == 4);   // 8.5 KB units
  CHECK(decode::PairGeometry{64, 8, 16384, 768, 1}.fc1_in_flight() == 1);  // 139 KB units
}

TEST_CASE("moe_forward's automatic path takes decode_moe at T = 1 only where the pair serves",
          "[plan][decode]") {
  // The public shapes decode_moe serves, with or without the two-launch pair at T = 1: the
  // pair's rules refuse the ones with I >= 1536 here, and on those the persistent tile lost to
  // marlin_moe at T = 1 (tools/PERF_LOG.md, "the eight public shapes on both paths"), so an
  // automatic call takes marlin_moe there.
  const std::vector<std::string> with_pair = {"qwen1.5-moe-a2.7b", "olmoe-1b-7b",
                                              "granite-3.0-3b-a800m"};
  const std::vector<std::string> without_pair = {"mixtral-8x7b", "deepseek-v3", "qwen3-235b-a22b",
                                                 "llama-4-scout", "phi-3.5-moe"};
  const std::vector<ModelShape> shapes = moejit::test::public_shapes();
  for (const ModelShape& shape : shapes) {
    INFO(shape.name);
    const bool pair = std::find(with_pair.begin(), with_pair.end(), shape.name) != with_pair.end();
    REQUIRE((pair || std::find(without_pair.begin(), without_pair.end(), shape.name) !=
                         without_pair.end()));
    for (int t = 1; t <= 3; ++t) {
      const detail::MoeForwardConfig config = detail::choose_moe_config(shape, t);
      CHECK(config.decode);  // decode_moe serves every public shape (forced, at any T <= 256)
      if (t == 1) CHECK(config.decode_pair == pair);
      CHECK(detail::decode_by_default(config) == (pair && t == 1));
    }
  }
}

TEST_CASE("moe_forward's path for every option, arch and T, and a forced block_n no depth fits",
          "[plan][decode]") {
  using detail::ForwardPath;
  const Arch sm90a = Arch::parse("sm_90a");
  // sm_120: decode_moe's arch, with ~99 KB of shared memory a CTA, where some tiles don't fit.
  const Arch sm120 = Arch::parse("sm_120");
  std::vector<ModelShape> shapes = reference_shapes();
  const std::vector<ModelShape> more = moejit::test::public_shapes();
  shapes.insert(shapes.end(), more.begin(), more.end());
  int auto_pair_not_on_arch = 0;  // kAuto calls that take marlin_moe because the pair doesn't fit
  int persistent_not_on_arch = 0;
  for (const ModelShape& shape : shapes) {
    const bool served = detail::decode_moe_problem(shape).empty();
    for (int t : {1, 2, 3, 6, 24, 96, 256, 257, 1000}) {
      const detail::MoeForwardConfig config = detail::choose_moe_config(shape, t);
      for (moejit::MoePath path :
           {moejit::MoePath::kAuto, moejit::MoePath::kMarlin, moejit::MoePath::kDecode}) {
        if (path == moejit::MoePath::kDecode && !served) continue;  // refused before the choice
        for (int block_n : {0, 8, 16, 32}) {
          const moejit::MoeForwardOptions options{path, block_n};
          INFO(shape.name << " T = " << t << " path " << static_cast<int>(path) << " block_n "
                          << block_n);
          CHECK(detail::choose_forward_path(shape, config, options, Arch::parse("sm_80")).path ==
                ForwardPath::kMarlin);
          const bool decode =
              config.decode &&
              (path == moejit::MoePath::kDecode ||
               (path == moejit::MoePath::kAuto && detail::decode_by_default(config)));
          for (const Arch& arch : {sm90a, sm120}) {
            INFO(arch.name());
            const detail::ForwardChoice c =
                detail::choose_forward_path(shape, config, options, arch);
            const bool pair_runs = config.decode && config.decode_pair &&
                                   detail::decode_moe_runs_on(config.decode_first, arch) &&
                                   detail::decode_moe_runs_on(config.decode_second, arch);
            if (!decode) {
              CHECK(c.path == ForwardPath::kMarlin);
            } else if (block_n == 0 && config.decode_pair && pair_runs) {
              CHECK(c.path == ForwardPath::kPair);
              CHECK(c.decode == config.decode_first);
            } else if (block_n == 0 && path == moejit::MoePath::kAuto) {
              CHECK(c.path == ForwardPath::kMarlin);  // decode_by_default takes only the pair
              ++auto_pair_not_on_arch;
            } else {
              const MoeDecodeParams tile = detail::choose_decode_config(shape, t, block_n);
              CHECK(c.decode ==
                    (block_n == 0 && !config.decode_pair ? config.decode_second : tile));
              CHECK(c.decode.kernel == DecodeKernel::kMain);
              const bool runs = c.decode.stages != 0 && detail::decode_moe_runs_on(c.decode, arch);
              CHECK(c.path == (runs ? ForwardPath::kPersistent : ForwardPath::kMarlin));
              if (!runs) ++persistent_not_on_arch;
              // A served shape fits a depth at every block_n and T (decode_moe_problem's walk),
              // in the shared memory of an sm_90a CTA.
              if (served && arch.sm == 90) CHECK(c.path == ForwardPath::kPersistent);
            }
          }
        }
      }
    }
  }
  INFO(auto_pair_not_on_arch << " automatic calls, " << persistent_not_on_arch
                             << " persistent tiles that don't run on their arch");
  CHECK(auto_pair_not_on_arch > 0);
  CHECK(persistent_not_on_arch > 0);

  // A shape the pair serves at T = 1 whose block_n 8 persistent tile fits no pipeline depth (its
  // routing scratch outgrows the ring): an automatic call that forces block_n 8 there takes
  // marlin_moe, as where decode_moe can't serve the call, instead of building a tile that breaks
  // a rule; block_n 16 fits.
  const ModelShape wide = moejit::parse_shapes(
      R"({"name": "e3509-k64", "num_experts": 3509, "top_k": 64, "hidden": 512,
          "intermediate": 256, "activation": {"kind": "swiglu"}})",
      "wide.json")[0];
  INFO(detail::decode_moe_problem(wide));
  CHECK(contains(detail::decode_moe_problem(wide), "with block_n = 8 at T = 1 no pipeline depth"));
  const detail::MoeForwardConfig one = detail::choose_moe_config(wide, 1);
  REQUIRE(detail::decode_by_default(one));
  const auto path_for = [&](moejit::MoePath path, int block_n) {
    return detail::choose_forward_path(wide, one, moejit::MoeForwardOptions{path, block_n}, sm90a)
        .path;
  };
  CHECK(path_for(moejit::MoePath::kAuto, 0) == ForwardPath::kPair);
  CHECK(detail::choose_decode_config(wide, 1, 8).stages == 0);
  CHECK(path_for(moejit::MoePath::kAuto, 8) == ForwardPath::kMarlin);
  CHECK(detail::choose_decode_config(wide, 1, 16).stages != 0);
  CHECK(path_for(moejit::MoePath::kAuto, 16) == ForwardPath::kPersistent);
}

TEST_CASE("decode_moe workspace: moe_workspace_bytes covers every decode tile, every block_n",
          "[plan][decode]") {
  for (const std::string& name : kServed) {
    const ModelShape shape = find_shape(reference_shapes(), name);
    INFO(name);
    for (int max_tokens : {1, 8, 9, 100, 256, 300, shape.max_tokens}) {
      INFO("max_tokens " << max_tokens);
      const std::size_t bytes = moejit::moe_workspace_bytes(shape, max_tokens);
      for (int t = 1; t <= std::min(max_tokens, 256); ++t) {
        for (int forced : {0, 8, 16, 32}) {
          const MoeDecodeParams p = detail::choose_decode_config(shape, t, forced);
          CHECK(bytes >= static_cast<std::size_t>(geometry_of(p).workspace_bytes()));
        }
        const detail::MoeForwardConfig c = detail::choose_moe_config(shape, t);
        const detail::MoeWorkspaceLayout w = detail::moe_workspace_layout(shape, c);
        CHECK(w.decode_bytes ==
              static_cast<std::size_t>(detail::decode_moe_workspace_bytes(c.decode_second)));
        if (c.decode_pair) {
          CHECK(w.decode_bytes ==
                static_cast<std::size_t>(detail::decode_moe_workspace_bytes(c.decode_first)));
        } else {
          CHECK(w.decode_bytes ==
                static_cast<std::size_t>(geometry_of(c.decode_second).workspace_bytes()));
        }
        CHECK(w.bytes == std::max(w.marlin_bytes, w.decode_bytes));
        CHECK(bytes >= w.bytes);
      }
    }
  }
  // The decode workspace does not depend on T itself: the counters, the FC1 output and the FC2
  // rows are sized for 256 tokens.
  const ModelShape kimi = find_shape(reference_shapes(), "kimi-k3.1-tp8");
  const MoeDecodeParams p = detail::choose_decode_config(kimi, 1, 16);
  const decode::Geometry g = geometry_of(p);
  CHECK(g.workspace_bytes() ==
        decode::Geometry::align256(4LL * g.counter_words()) +
            decode::Geometry::align256(static_cast<long long>(g.max_virtual()) * 16 * 384 * 2) +
            decode::Geometry::align256(256LL * 16 * 3584 * 2));
  // A shape decode_moe refuses sizes marlin only.
  const ModelShape gpt = find_shape(reference_shapes(), "gpt-oss-120b");
  const detail::MoeWorkspaceLayout w =
      detail::moe_workspace_layout(gpt, detail::choose_moe_config(gpt, 1));
  CHECK(w.decode_bytes == 0);
  CHECK(w.bytes == w.marlin_bytes);
}

TEST_CASE("moe_forward options and the C ABI's forward_ex refuse bad options without a GPU",
          "[plan][decode][capi]") {
  const std::vector<ModelShape> shapes = reference_shapes();
  const ModelShape& kimi = find_shape(shapes, "kimi-k3.1-tp8");
  const ModelShape& gpt = find_shape(shapes, "gpt-oss-120b");
  const moejit::MoeForwardArgs args;
  const auto expect = [&](const ModelShape& shape, moejit::MoeForwardOptions options,
                          ErrorCode code, const std::vector<std::string>& parts) {
    try {
      moejit::moe_forward(shape, args, nullptr, options);
      FAIL("moe_forward accepted the options");
    } catch (const Error& e) {
      INFO(e.what());
      CHECK(e.code() == code);
      for (const std::string& part : parts) CHECK(contains(e.what(), part));
    }
  };
  moejit::MoeForwardOptions options;
  options.decode_block_n = 24;
  expect(kimi, options, ErrorCode::kInvalidArgument,
         {"options.decode_block_n", "8, 16 or 32", "24"});
  options.decode_block_n = 0;
  options.path = static_cast<moejit::MoePath>(9);
  expect(kimi, options, ErrorCode::kInvalidArgument, {"options.path", "9"});
  // A forced decode path on a shape it can't serve: refused before any device or tensor is
  // looked at, with the rule.
  options.path = moejit::MoePath::kDecode;
  expect(gpt, options, ErrorCode::kUnsupported,
         {"a forced decode path can't serve this call", "hidden = 2880 is not a multiple of 256",
          "the auto or the marlin path"});

  // The C ABI: the handle carries decode_moe's verdict; forward_ex checks path and block_n.
  const char* text = R"({"name": "capi-decode-kimi", "num_experts": 896, "top_k": 16,
                         "hidden": 3584, "intermediate": 384,
                         "activation": {"kind": "situ", "beta": 4, "linear_beta": 25},
                         "max_tokens": 512})";
  moejit::register_shapes(text, "capi-decode.json");
  const char* gpt_text = R"({"name": "capi-decode-gpt", "num_experts": 32, "top_k": 4,
                             "hidden": 2880, "intermediate": 2880, "has_bias": true,
                             "activation": {"kind": "gpt_oss", "limit": 7, "alpha": 1.702},
                             "max_tokens": 512})";
  moejit::register_shapes(gpt_text, "capi-decode-gpt.json");
  moejit_moe* served = nullptr;
  moejit_moe* refused = nullptr;
  REQUIRE(moejit_moe_create("capi-decode-kimi", &served) == MOEJIT_OK);
  REQUIRE(moejit_moe_create("capi-decode-gpt", &refused) == MOEJIT_OK);
  const char* reason = nullptr;
  REQUIRE(moejit_moe_decode_problem(served, &reason) == MOEJIT_OK);
  REQUIRE(reason != nullptr);
  CHECK(std::string(reason).empty());
  REQUIRE(moejit_moe_decode_problem(refused, &reason) == MOEJIT_OK);
  CHECK(contains(reason, "hidden = 2880"));
  CHECK(contains(reason, "no bias epilogue"));
  CHECK(moejit_moe_decode_problem(nullptr, &reason) == MOEJIT_ERROR_INVALID_ARGUMENT);
  CHECK(moejit_moe_decode_problem(served, nullptr) == MOEJIT_ERROR_INVALID_ARGUMENT);

  moejit_moe_weights weights{};
  weights.struct_size = sizeof(weights);
  CHECK(moejit_moe_forward_ex(served, nullptr, nullptr, nullptr, &weights, nullptr, 0, nullptr,
                              static_cast<moejit_moe_path>(5), 0,
                              nullptr) == MOEJIT_ERROR_INVALID_ARGUMENT);
  CHECK(contains(moejit_last_error(), "moejit_moe_forward_ex: path"));
  CHECK(contains(moejit_last_error(), "MOEJIT_MOE_PATH_DECODE"));
  CHECK(moejit_moe_forward_ex(served, nullptr, nullptr, nullptr, &weights, nullptr, 0, nullptr,
                              MOEJIT_MOE_PATH_AUTO, 12, nullptr) == MOEJIT_ERROR_INVALID_ARGUMENT);
  // Named as the C caller called it, not as the C++ op ("moe_forward: options...").
  CHECK_THAT(std::string(moejit_last_error()),
             Catch::StartsWith("moejit_moe_forward_ex: decode_block_n: expected"));
  CHECK(contains(moejit_last_error(), "found 12"));
  CHECK(moejit_moe_forward_ex(refused, nullptr, nullptr, nullptr, &weights, nullptr, 0, nullptr,
                              MOEJIT_MOE_PATH_DECODE, 0, nullptr) == MOEJIT_ERROR_UNSUPPORTED);
  CHECK(contains(moejit_last_error(), "hidden = 2880"));
  CHECK_THAT(std::string(moejit_last_error()), Catch::StartsWith("moejit_moe_forward_ex: "));
  CHECK(moejit_moe_forward_ex(served, nullptr, nullptr, nullptr, nullptr, nullptr, 0, nullptr,
                              MOEJIT_MOE_PATH_DECODE, 0, nullptr) == MOEJIT_ERROR_INVALID_ARGUMENT);
  CHECK(contains(moejit_last_error(), "weights"));
  moejit_moe_destroy(served);
  moejit_moe_destroy(refused);
}
