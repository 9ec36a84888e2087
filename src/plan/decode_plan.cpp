// decode_moe's plan: its tile for T tokens of a shape (block_n, FC1 and FC2 strips, pipeline
// depth, CTAs per SM), the two-launch pair's choice, the sizes the op and supports() check, and
// the messages that name a broken rule. The rules follow the H200 measurements in
// tools/PERF_LOG.md; moe_plan.cpp decides between this path and marlin_moe.
#include "plan/decode_plan.hpp"

#include <algorithm>
#include <cmath>
#include <moejit/kern/moe/decode_params.cuh>
#include <moejit/kern/moe/layout.cuh>
#include <mutex>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "common/fork.hpp"
#include "plan/decode_geometry.hpp"
#include "plan/moe_plan.hpp"

namespace moejit::detail {

namespace decode = kern::moe::decode;

namespace {

static_assert(kDecodeMaxTokens == decode::kMaxTokens,
              "decode_plan.hpp's copy of decode::kMaxTokens");
static_assert(kDecodeThreads == decode::kThreads, "decode_plan.hpp's copy of decode::kThreads");
static_assert(kDecodePairFc1Threads == decode::kPairFc1Threads &&
                  kDecodePairFc2Threads == decode::kPairFc2Threads,
              "decode_plan.hpp's copies of decode::kPairFc1Threads and kPairFc2Threads");

// The tile rules below follow the H200 measurements of decode_moe (tools/PERF_LOG.md,
// "decode_moe"); keep them in these functions so planner and op agree.
//
// Why block_n 16, and 32 only where experts average 12 positions or more: a virtual expert
// streams its expert's weights, so an expert with 17..32 positions reads them twice with blocks
// of 16 (qwen3 T = 256, 16 per expert on average: block_n 32 39.1% of copy against 34.8%; with
// 12 on average about one expert in ten has more than 16), while blocks of 32 double the
// activation rows of every ring slot, which costs pipeline depth or a CTA per SM where experts
// hold few positions (v7: deepseek T = 96 68.5% against 70.2%; kimi drops to one CTA per SM:
// 46.8% against 64.2% at T = 96). Any of 8, 16, 32 is available when forced (decode_block_n).
//
// Why block_n 8 below T = 6: it halves the activation rows of a ring slot, which lets an FC1
// chunk be 8 or 16 atoms wide with few strips per item (Geometry::fc1_chunk_k), so each CTA
// keeps 2-4x the bytes in flight on its item (v10, harness, H200: deepseek T = 1 / 2 / 4 19.9 /
// 32.9 / 45.6% of copy against 17.7 / 26.9 / 41.2% with the block_n 16 tiles; qwen3 T = 2 / 4
// 33.6 / 47.6% against 31.3 / 41.4%; kimi T = 2 / 4 39.9 / 51.9% against 37.4 / 49.3%). From
// T = 6 the 8-strip block_n 16 tiles are as fast or faster (kimi T = 6: 57.8% against 55.3%).
constexpr int kDecodeNarrowBlockN = 8;
constexpr int kDecodeNarrowMaxTokens = 5;  // block_n 8 for T <= this
// Why block_n 8 also below T = 16 where the 8-strip block_n 16 tile would give each of its CTAs
// fewer than 1.4 FC1 items: with about one item per CTA the ones holding two set the time, while
// block_n 8's 2-strip items are four times as many (library bench, H200, eighth session,
// deepseek-v4-flash-tp4 with 1.03 / 1.34 / 1.49 / 1.92 such items per CTA at T = 6 / 8 / 9 / 12:
// block_n 8 51.0 / 60.0 / 66.2 / 83.1 us, block_n 16 57.6 / 62.2 / 63.7-64.3 / 74.8; qwen3-30b-a3b
// (1.87 at T = 6) and kimi-k3.1-tp8 (2.09) were faster with block_n 16: 44.8 against 46.3 us,
// 79.4 against 83.3). The CTAs are those of the H200 the tile rules were measured on (132 SMs,
// two CTAs per SM).
constexpr double kDecodeNarrowMinItemsPerCta = 1.4;
// Why items of at least 64 KB for block_n 8: four 16 KB chunks, one more than the ring holds, so
// the ring stays full through the item; among those, the fewest strips give the most items
// (v10, T = 1 / 2 / 4: deepseek 2 strips (64 KB) 19.9 / 32.9 / 45.6% against 4 strips 16.2 /
// 31.7 / 41.4%; kimi 4 strips (112 KB) 28.8 / 39.9 / 51.9% against 2 (56 KB) 28.0 / 39.4 /
// 48.2%; qwen3 4 strips (64 KB) 18.0 / 33.6 / 47.6% against 2 (32 KB) 21.9 / 30.0 / 33.9%).
constexpr long long kDecodeNarrowItemBytes = 64 * 1024;
constexpr int kDecodeBlockN = 16;  // the planner's block_n below kDecodeWideBlockPositions
constexpr int kDecodeWideBlockN = 32;
constexpr double kDecodeWideBlockPositions = 12.0;  // expected positions per touched expert
constexpr int kDecodeMinStages = 2;
constexpr int kDecodeMaxStages = 6;
// CTAs per SM the planner aims for. Why 3 from T = 16 for the tiles of 8 FC1 strips (block_n 16):
// the consumers are latency-bound (ncu, v7 deepseek T = 24: no eligible warp in 37% of cycles),
// and a third CTA with a 2-chunk ring beats two with 3-4 chunks from T = 24 (harness: deepseek
// 73.0% of copy against 72.7% in one run; kimi T = 24 71.4% against 65.4%, T = 256 61.5% against
// 56.9%, and qwen3 67.5% against 66.0%, the two-CTA figures from the run before the publisher's
// end-of-kernel wake-up, worth ~1 us). Why 2 below: every CTA routes and starts on its own,
// and at small T a third CTA costs more than it hides (T = 6: kimi-ep2 83.5 us against 70.1, qwen3
// 51.6 against 45.0; deepseek T = 4: 52.6 against 42.0).
// And only where the tile's expected FC1 items give those CTAs two each: deepseek-v4-flash-tp4 at
// T = 16 (592 items for 396 CTAs) ran 94.6 us with three, against 73.3 at T = 12 with two
// (tools/PERF_LOG.md "decode_moe: three CTAs per SM by items").
constexpr int kDecodeThreeCtaMinTokens = 16;
constexpr double kDecodeThreeCtaMinItemsPerCta = 2.0;
constexpr int kDecodeSmallTCtasPerSm = 2;
constexpr int kDecodeCtasPerSm = 3;
// Why FC1 strips by T: an item of 8 strips is a 16 KB chunk that no warp splits along K, the
// fastest at T >= 6 (v6, T = 24: deepseek 70% of copy against 59% with 4 strips, kimi 65%
// against 57%); at T = 1 there are too few such items for 264 CTAs (deepseek: 48), and 2 or 4
// strips win (deepseek T = 1: 27.0 us with 2, 30.5 with 4, 35.8 with 8; kimi: 29.3 us with 4,
// 36.5 with 8). So: the most strips whose expected FC1 item count reaches this target, more than
// the 132 SMs of an H200 (96 items leave a quarter of them idle), below its 264 CTAs.
constexpr double kDecodeFc1TargetItems = 160.0;
constexpr int kDecodeFc2Strips = 8;

// The tile of one block_n choice at T = tokens, stages not yet chosen: FC1 strips by the rules
// above among those Geometry::rule() accepts (block_n 8: by item bytes, else by item count),
// 8 FC2 strips (else 4).
decode::Geometry decode_tile(const ModelShape& shape, int block_n, int tokens) {
  decode::Geometry g{shape.num_experts, shape.top_k, shape.hidden,     shape.intermediate,
                     block_n,           2,           kDecodeFc2Strips, kDecodeMinStages};
  if (block_n == kDecodeNarrowBlockN) {
    for (int strips : {2, 4, 8}) {
      g.fc1_strips = strips;
      if (g.rule() == decode::Rule::kFc1Strips) continue;
      const long long item_bytes =
          static_cast<long long>(strips) * g.fc1_k_atoms() * kern::moe::layout::kAtomBytes;
      if (item_bytes >= kDecodeNarrowItemBytes) break;
    }
  } else {
    const double strips_total = expected_experts_touched(shape, tokens) * g.fc1_m_atoms();
    for (int strips : {8, 4, 2}) {
      g.fc1_strips = strips;
      if (g.rule() == decode::Rule::kFc1Strips) continue;
      if (strips == 2 || strips_total / strips >= kDecodeFc1TargetItems) break;
    }
  }
  if (g.rule() == decode::Rule::kFc1Strips) {
    for (int strips : {4, 2, 8}) {
      g.fc1_strips = strips;
      if (g.rule() != decode::Rule::kFc1Strips) break;
    }
  }
  if (g.rule() == decode::Rule::kFc2Strips) {
    g.fc2_strips = 4;
  }
  return g;
}

// The pipeline depth of a tile at T = tokens: the deepest ring (2..6 chunks) that keeps the CTAs
// per SM aimed for (3 for block_n 16 with 8 FC1 strips from T = 16 where the expected FC1 items
// give each of them two, else 2), else the deepest that keeps fewer. 0 when none fits.
int decode_stages(decode::Geometry g, int tokens) {
  const double items = expected_experts_touched(g.experts, g.top_k, tokens) * g.fc1_items();
  const bool three = g.block_n == 16 && g.fc1_strips == 8 && tokens >= kDecodeThreeCtaMinTokens &&
                     items >= kDecodeThreeCtaMinItemsPerCta * kDecodeCtasPerSm * kPlannedSms;
  const int aim = three ? kDecodeCtasPerSm : kDecodeSmallTCtasPerSm;
  for (int ctas = aim; ctas >= 1; --ctas) {
    for (int stages = kDecodeMaxStages; stages >= kDecodeMinStages; --stages) {
      g.stages = stages;
      if (g.rule() == decode::Rule::kOk && g.blocks_per_sm() >= ctas) return stages;
    }
  }
  return 0;
}

MoeDecodeParams decode_params_of(const ModelShape& shape, const decode::Geometry& g) {
  MoeDecodeParams p;
  p.kernel = DecodeKernel::kMain;
  p.num_experts = g.experts;
  p.top_k = g.top_k;
  p.hidden = g.hidden;
  p.intermediate = g.inter;
  p.block_n = g.block_n;
  p.fc1_strips = g.fc1_strips;
  p.fc2_strips = g.fc2_strips;
  p.stages = g.stages;
  p.activation = shape.activation;
  p.id_dtype = shape.id_dtype;
  return p;
}

}  // namespace

// The rules of the shape alone (no biases; E, K, H, I) without building a message: the op asks
// this on every forward.
bool decode_shape_ok(const ModelShape& shape) {
  if (shape.has_bias) return false;
  const decode::Geometry g = decode_tile(shape, kDecodeBlockN, kDecodeMaxTokens);
  const decode::Rule rule = g.rule();
  return rule != decode::Rule::kExperts && rule != decode::Rule::kTopK &&
         rule != decode::Rule::kHidden && rule != decode::Rule::kInter;
}

long long decode_moe_smem_bytes(const MoeDecodeParams& p) {
  if (p.kernel == DecodeKernel::kPairFc1) return decode_pair_geometry(p).fc1_smem_bytes();
  if (p.kernel == DecodeKernel::kPairFc2) return decode_pair_geometry(p).fc2_smem_bytes();
  return decode_geometry(p).smem_bytes();
}

int decode_moe_blocks_per_sm(const MoeDecodeParams& p) {
  if (decode_pair_kernel(p.kernel)) return 1;
  return decode_geometry(p).blocks_per_sm();
}

long long decode_moe_workspace_bytes(const MoeDecodeParams& p) {
  if (decode_pair_kernel(p.kernel)) return decode_pair_geometry(p).workspace_bytes();
  return decode_geometry(p).workspace_bytes();
}

std::string decode_pair_rule_problem(const MoeDecodeParams& p) {
  const decode::PairGeometry g = decode_pair_geometry(p);
  std::ostringstream os;
  switch (g.rule()) {
    case decode::PairRule::kOk:
      break;
    case decode::PairRule::kExperts:
      os << "num_experts = " << p.num_experts
         << " is out of range; allowed: 1..4096 (decode_moe packs the local expert into 12 bits)";
      break;
    case decode::PairRule::kTokens:
      os << "max_tokens = " << p.max_tokens << " with top_k = " << p.top_k
         << " is not allowed; allowed: max_tokens 1, 2, 4 or 8 with max_tokens * top_k <= "
         << decode::kPairMaxPositions << " (the pair's routing is quadratic in the positions)";
      break;
    case decode::PairRule::kHidden:
      os << "hidden = " << p.hidden
         << " is not a multiple of 512 (the pair splits a strip's K atoms over eight warps)";
      break;
    case decode::PairRule::kInter:
      os << "intermediate = " << p.intermediate
         << " is not a multiple of 64 (the pair's FC2 reads whole 64-wide K atoms)";
      break;
    case decode::PairRule::kSharedMemory:
      os << "the pair's shared memory (" << decode::kPairSmemBudget << " bytes per kernel) holds "
         << g.fc1_stages() << " FC1 strips (" << g.fc1_unit_bytes() << " bytes each; needs "
         << decode::kPairFc1Groups << ") and " << g.fc2_stages() << " FC2 units ("
         << g.fc2_unit_bytes() << " bytes each; needs " << decode::kPairConsumerWarps
         << ") at max_tokens = " << p.max_tokens;
      break;
  }
  return os.str();
}

std::string decode_rule_problem(const MoeDecodeParams& p) {
  const decode::Geometry g = decode_geometry(p);
  std::ostringstream os;
  switch (g.rule()) {
    case decode::Rule::kOk:
      break;
    case decode::Rule::kExperts:
      os << "num_experts = " << p.num_experts << " is out of range; allowed: 1.."
         << decode::kMaxExperts
         << " (decode_moe packs the local expert into 12 bits): split the experts over more EP "
            "ranks";
      break;
    case decode::Rule::kTopK:
      os << "top_k = " << p.top_k << " is out of range; allowed: 1.." << decode::kMaxTopK
         << " (decode_moe packs the 256 * top_k positions into 14 bits)";
      break;
    case decode::Rule::kHidden:
      os << "hidden = " << p.hidden
         << " is not a multiple of 256 (decode_moe streams whole 256-wide FC1 chunks)";
      break;
    case decode::Rule::kInter:
      os << "intermediate = " << p.intermediate
         << " is not a multiple of 128 (decode_moe streams whole 128- or 256-wide FC2 chunks)";
      break;
    case decode::Rule::kBlockN:
      os << "block_n = " << p.block_n
         << " is not allowed; allowed: 8, 16, 32 (one, two or four n8 MMA tiles per virtual "
            "expert)";
      break;
    case decode::Rule::kFc1Strips:
      os << "fc1_strips = " << p.fc1_strips << " is not allowed; allowed: 2, 4 or 8 dividing "
         << "intermediate / 8 = " << g.fc1_m_atoms() << " (FC1 items are whole strips of 8 "
         << "gate/up pairs)";
      break;
    case decode::Rule::kFc2Strips:
      os << "fc2_strips = " << p.fc2_strips << " is not allowed; allowed: 4 or 8 dividing "
         << "hidden / 16 = " << g.fc2_m_atoms() << " (FC2 items are whole 16-row strips)";
      break;
    case decode::Rule::kStages:
      os << "stages = " << p.stages << " is out of range; allowed: 2..8";
      break;
    case decode::Rule::kSharedMemory:
      if (g.smem_bytes() > decode::kSmemLimit) {
        os << "needs " << g.smem_bytes() << " bytes of shared memory per CTA; allowed: at most "
           << decode::kSmemLimit << " (sm_90): lower stages or block_n";
      } else {
        os << "the routing scratch needs " << g.route_scratch_bytes()
           << " bytes of shared memory but the ring it reuses has " << g.ring_bytes()
           << " (stages = " << p.stages << "): raise stages";
      }
      break;
  }
  return os.str();
}

namespace {

// decode_moe_problem's answer, from the rules and a walk of every tile the planner can choose.
std::string decode_moe_problem_walk(const ModelShape& shape) {
  std::vector<std::string> reasons;
  const decode::Geometry shape_tile = decode_tile(shape, kDecodeBlockN, kDecodeMaxTokens);
  const decode::Rule rule = shape_tile.rule();
  if (rule == decode::Rule::kExperts || rule == decode::Rule::kTopK ||
      rule == decode::Rule::kHidden || rule == decode::Rule::kInter) {
    reasons.push_back(decode_rule_problem(decode_params_of(shape, shape_tile)));
  }
  if (shape.has_bias) {
    reasons.push_back("decode_moe has no bias epilogue (has_bias is true)");
  }
  if (reasons.empty()) {
    // Every tile the planner can choose: each T (the strips change with it), every block_n.
    for (int tokens = 1; tokens <= kDecodeMaxTokens; ++tokens) {
      for (int block_n : kDecodeBlockNs) {
        MoeDecodeParams p = choose_decode_config(shape, tokens, block_n);
        if (p.stages != 0) continue;
        // Why stages 2: the shallowest ring names the smallest shared memory that would be needed.
        p.stages = kDecodeMinStages;
        reasons.push_back("with block_n = " + std::to_string(block_n) +
                          " at T = " + std::to_string(tokens) +
                          " no pipeline depth fits: " + decode_rule_problem(p));
        break;
      }
      if (!reasons.empty()) break;
    }
  }
  if (reasons.empty()) return "";
  std::string out = "decode_moe can't serve shape \"" + shape.name + "\": ";
  for (std::size_t i = 0; i < reasons.size(); ++i) {
    if (i > 0) out += "; ";
    out += reasons[i];
  }
  out += ". Such shapes use marlin_moe";
  return out;
}

// The shape fields decode_moe_problem_walk reads (through decode_tile, choose_decode_config and
// the message).
struct ProblemKey {
  std::string name;
  int num_experts = 0;
  int top_k = 0;
  int hidden = 0;
  int intermediate = 0;
  Activation activation;
  bool has_bias = false;
  DType id_dtype = DType::kI32;

  explicit ProblemKey(const ModelShape& s)
      : name(s.name),
        num_experts(s.num_experts),
        top_k(s.top_k),
        hidden(s.hidden),
        intermediate(s.intermediate),
        activation(s.activation),
        has_bias(s.has_bias),
        id_dtype(s.id_dtype) {}
  // Why against the shape itself, not a key built from it: a key copies the name, which for a
  // name past the short-string buffer is a heap allocation on every forced-decode forward.
  bool matches(const ModelShape& s) const {
    const Activation& a = activation;
    const Activation& b = s.activation;
    return num_experts == s.num_experts && top_k == s.top_k && hidden == s.hidden &&
           intermediate == s.intermediate && has_bias == s.has_bias && id_dtype == s.id_dtype &&
           a.kind == b.kind && a.limit == b.limit && a.alpha == b.alpha && a.beta == b.beta &&
           a.linear_beta == b.linear_beta && name == s.name;
  }
};

}  // namespace

std::string decode_moe_problem(const ModelShape& shape) {
  // Why a memo: the walk asks the planner for 768 tiles, and moe_forward asks on every call that
  // forces the decode path, which then cost 110-150 us of host time a call against 8.5-12 us for
  // its three launches (moejit_bench_runtime (f), tools/PERF_LOG.md, fifty-eighth session). A
  // process serves a few shapes; the memo keeps the last kMemoShapes. A hit allocates nothing
  // (an empty answer is a shape decode_moe serves; any other makes the caller throw).
  constexpr std::size_t kMemoShapes = 64;
  // Why leaked, as the runtime is: ops may run from threads that outlive static destruction.
  static std::mutex& mutex = []() -> std::mutex& {
    auto* made = new std::mutex;
    hold_across_fork_last(made);  // a leaf: nothing is taken under it
    return *made;
  }();
  static std::vector<std::pair<ProblemKey, std::string>>& memo =
      *new std::vector<std::pair<ProblemKey, std::string>>;
  {
    std::lock_guard<std::mutex> lock(mutex);
    for (const auto& entry : memo) {
      if (entry.first.matches(shape)) return entry.second;
    }
  }
  std::string answer = decode_moe_problem_walk(shape);
  std::lock_guard<std::mutex> lock(mutex);
  if (memo.size() == kMemoShapes) memo.erase(memo.begin());
  memo.emplace_back(ProblemKey(shape), answer);
  return answer;
}

// The planner's block_n at T = tokens (see kDecodeNarrowMaxTokens, kDecodeNarrowMinItemsPerCta,
// kDecodeWideBlockPositions).
int decode_block_n(const ModelShape& shape, int tokens) {
  if (tokens <= kDecodeNarrowMaxTokens) return kDecodeNarrowBlockN;
  const double touched = expected_experts_touched(shape, tokens);
  if (tokens < kDecodeThreeCtaMinTokens) {
    // The FC1 items of the 8-strip block_n 16 tile, which decode_tile takes where they reach
    // kDecodeFc1TargetItems (no tile is built here: this runs on every forward).
    const decode::Geometry wide{shape.num_experts, shape.top_k,     shape.hidden,
                                shape.intermediate, kDecodeBlockN,   8,
                                kDecodeFc2Strips,   kDecodeMinStages};
    const double items = touched * wide.fc1_items();
    const double ctas = static_cast<double>(kDecodeSmallTCtasPerSm) * kPlannedSms;
    if (items >= kDecodeFc1TargetItems && items < kDecodeNarrowMinItemsPerCta * ctas) {
      return kDecodeNarrowBlockN;
    }
  }
  const double positions = static_cast<double>(tokens) * shape.top_k;
  return touched > 0 && positions / touched >= kDecodeWideBlockPositions ? kDecodeWideBlockN
                                                                         : kDecodeBlockN;
}

MoeDecodeParams choose_decode_config(const ModelShape& shape, int tokens, int block_n_override) {
  const int block_n = block_n_override != 0 ? block_n_override : decode_block_n(shape, tokens);
  decode::Geometry g = decode_tile(shape, block_n, tokens);
  g.stages = decode_stages(g, tokens);
  return decode_params_of(shape, g);
}

MoeDecodeParams decode_reset_params(const MoeDecodeParams& main) {
  MoeDecodeParams p = main;
  p.kernel = DecodeKernel::kReset;
  return p;
}

MoeDecodeParams decode_combine_params(const MoeDecodeParams& main) {
  MoeDecodeParams p = main;
  p.kernel = DecodeKernel::kCombine;
  return p;
}

MoeDecodeParams choose_decode_pair(const ModelShape& shape, int tokens) {
  MoeDecodeParams p;
  p.kernel = DecodeKernel::kPairFc1;
  if (tokens < 1 || tokens > kDecodePairMaxTokens || shape.has_bias) return p;
  int bucket = 1;
  while (bucket < tokens) bucket *= 2;
  p.num_experts = shape.num_experts;
  p.top_k = shape.top_k;
  p.hidden = shape.hidden;
  p.intermediate = shape.intermediate;
  p.max_tokens = bucket;
  p.activation = shape.activation;
  p.id_dtype = shape.id_dtype;
  if (decode_pair_geometry(p).rule() != decode::PairRule::kOk) p.max_tokens = 0;
  return p;
}

MoeDecodeParams decode_pair_fc2_params(const MoeDecodeParams& fc1) {
  MoeDecodeParams p = fc1;
  p.kernel = DecodeKernel::kPairFc2;
  return p;
}

bool decode_moe_runs_on(const MoeDecodeParams& p, const Arch& arch) {
  return arch.sm >= 90 && decode_moe_smem_bytes(p) <= max_dynamic_smem_bytes(arch);
}

KernelSpec decode_moe_spec(const MoeDecodeParams& p, const Arch& arch) {
  return KernelSpec{Family::kDecodeMoe, arch, p};
}

}  // namespace moejit::detail
