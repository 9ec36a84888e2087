// libmoejit: a KernelSpec names one kernel completely: its family, every template argument and
// the target arch. Everything downstream (codegen, cache key, compile, load) is a function of it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <variant>

#include "moejit/shape.hpp"

namespace moejit {

// A compile target, e.g. sm_90a (arch-specific features such as wgmma), sm_100a, sm_80.
struct Arch {
  int sm = 90;                 // major * 10 + minor
  bool arch_specific = false;  // the "a" suffix

  static Arch parse(const std::string& text);  // "sm_90a"; throws Error{kInvalidArgument}
  std::string name() const;                    // "sm_90a"
  std::string nvrtc_option() const;            // "--gpu-architecture=sm_90a"
  friend bool operator==(const Arch& a, const Arch& b) {
    return a.sm == b.sm && a.arch_specific == b.arch_specific;
  }
};

enum class Family {
  kAppendShared,  // routed top-k + shared experts (kernels/append_shared.cuh)
  kRoute,         // topk_ids -> expert-sorted, block-padded rows (kernels/moe/route.cuh)
  kRepack,        // checkpoint MXFP4 -> kernel layout (kernels/moe/repack.cuh)
  kMarlinMoe,     // grouped MXFP4 x bf16 GEMM, FC1 or FC2 (kernels/moe/moe_gemm.cuh)
  kCombine,       // top-k weighted sum of FC2 rows into [T, H] (kernels/moe/combine.cuh)
  kNarrowIds,     // int64 topk_ids -> int32 for route (kernels/moe/narrow_ids.cuh)
  kDecodeMoe,     // fused small-T layer: route + FC1 + FC2 + combine (kernels/moe/decode_moe.cuh)
};

const char* family_name(Family family) noexcept;
// "append_shared", "route", "repack", "marlin_moe", "combine", "narrow_ids", "decode_moe"; throws
// Error{kInvalidArgument} naming the known families.
Family parse_family(const std::string& text);

// append_shared: routed top-k copied, then S shared experts appended, one launch.
struct AppendSharedParams {
  static constexpr int kMaxTopK = 64;   // the widest K a kernel serves
  static constexpr int kMaxShared = 8;  // the most shared experts a kernel appends

  int top_k = 0;                         // K routed slots per token
  int num_shared = 0;                    // S shared experts appended per token
  DType id_dtype = DType::kI32;          // topk_ids / out_ids element type (kI32 or kI64)
  SharedGate gate = SharedGate::kSigmoid;
  DType logit_dtype = DType::kBF16;      // kSigmoid: logits element type (kBF16, kF16, kF32)
  int block_threads = 256;               // threads per CTA

  friend bool operator==(const AppendSharedParams& a, const AppendSharedParams& b) {
    return a.top_k == b.top_k && a.num_shared == b.num_shared && a.id_dtype == b.id_dtype &&
           a.gate == b.gate && a.logit_dtype == b.logit_dtype &&
           a.block_threads == b.block_threads;
  }
};

// route: one of the four route kernels. N = T * K entries; N <= chunk_rows takes the one-launch
// path (kSingle), larger N the three launches kRank, kScan, kScatter (same traits for all three).
enum class RouteKernel { kSingle, kRank, kScan, kScatter };

struct MoeRouteParams {
  RouteKernel kernel = RouteKernel::kSingle;
  int num_experts = 0;    // E local experts (ids [expert_offset, expert_offset + E) are local)
  int top_k = 0;          // K slots per token
  int block_m = 0;        // rows per GEMM block: the grouped GEMM's block_n (8..128, power of 2)
  int block_threads = 0;  // threads per CTA of every route kernel
  int chunk_rows = 0;     // C: entries one CTA ranks (a multiple of block_threads)
  // G: 0, or the warpgroup GEMM's token tile (a multiple of block_m): the route also lists the
  // groups of G / block_m blocks of one expert that GEMM's CTAs take (scan and scatter, or the
  // single kernel; the rank kernel never reads it).
  int group_rows = 0;

  friend bool operator==(const MoeRouteParams& a, const MoeRouteParams& b) {
    return a.kernel == b.kernel && a.num_experts == b.num_experts && a.top_k == b.top_k &&
           a.block_m == b.block_m && a.block_threads == b.block_threads &&
           a.chunk_rows == b.chunk_rows && a.group_rows == b.group_rows;
  }
};

// repack: one launch per matrix; nothing in it depends on the model's sizes.
struct MoeRepackParams {
  bool gate_up = true;      // FC1 (gate and up sources fused per atom) or a plain matrix (FC2)
  int block_threads = 256;  // threads per CTA (one per lane of an atom)

  friend bool operator==(const MoeRepackParams& a, const MoeRepackParams& b) {
    return a.gate_up == b.gate_up && a.block_threads == b.block_threads;
  }
};

// Which GEMM of the layer a marlin_moe kernel is.
enum class MoeGemmStage {
  kFc1,  // W13 x hidden -> (+ bias) -> activation(gate, up) -> inter, bf16
  kFc2,  // W2 x inter -> (+ bias) * top-k weight -> out2, fp32 or bf16
};

// marlin_moe: every template argument of kernels/moe/moe_gemm.cuh's MoeGemmTraits and epilogue.
// Sizes of the model (E, H, I) are kernel arguments, so one kernel serves every shape that
// shares the tile, the activation and the bias.
struct MarlinMoeParams {
  MoeGemmStage stage = MoeGemmStage::kFc1;
  int block_m = 0;            // weight rows per CTA (multiple of 16 * warps_m)
  int block_n = 0;            // token rows per CTA = the route block (multiple of 8 * warps_n)
  int block_k = 0;            // K per pipeline stage (multiple of 64 * warps_k)
  int stages = 0;             // cp.async pipeline depth (>= 2)
  int warps_m = 0;            // warps splitting the CTA's rows
  int warps_n = 0;            // warps splitting the CTA's token rows
  int warps_k = 0;            // warps splitting each stage's K (summed in a fixed order)
  int min_blocks_per_sm = 1;  // occupancy target of __launch_bounds__
  bool early_weights = false; // weight prologue before the PDL wait (FC2 only)
  bool has_bias = false;      // FC1 bias [E, 2I] (gate, up pairs), FC2 bias [E, H]
  Activation activation;      // FC1: the gated activation; FC2: none (left default)
  DType out_dtype = DType::kBF16;  // FC1: bf16; FC2: f32 or bf16 (the FC2 rows combine sums)
  // 0: the mma.sync main loop (moe_gemm.cuh). 64, 128 or 256: the sm_90a warpgroup main loop
  // (moe_gemm_wg.cuh) with this wgmma N, warps_m / 4 warpgroups of block_m / warps_m * 4 rows
  // each, warps_n = warps_k = 1 and block_k = 64; block_n (the route block) is wgmma_n / 1, 2,
  // 4, 8 or 16 (at least 8): a CTA takes that many consecutive blocks of one expert.
  int wgmma_n = 0;
  // FC2 only: CTAs per M tile, each summing one contiguous range of the K tiles into a set of
  // fp32 rows of its own (out_dtype f32); combine adds the sets in split order
  // (MoeCombineParams::k_splits). 1: no split.
  int k_splits = 1;

  friend bool operator==(const MarlinMoeParams& a, const MarlinMoeParams& b) {
    return a.stage == b.stage && a.block_m == b.block_m && a.block_n == b.block_n &&
           a.block_k == b.block_k && a.stages == b.stages && a.warps_m == b.warps_m &&
           a.warps_n == b.warps_n && a.warps_k == b.warps_k &&
           a.min_blocks_per_sm == b.min_blocks_per_sm && a.early_weights == b.early_weights &&
           a.has_bias == b.has_bias && a.activation.kind == b.activation.kind &&
           a.activation.limit == b.activation.limit && a.activation.alpha == b.activation.alpha &&
           a.activation.beta == b.activation.beta &&
           a.activation.linear_beta == b.activation.linear_beta && a.out_dtype == b.out_dtype &&
           a.wgmma_n == b.wgmma_n && a.k_splits == b.k_splits;
  }
};

// combine: out[t] = bf16(sum over slots in order, and within a slot over FC2's K splits in
// order, of the FC2 rows of token t).
struct MoeCombineParams {
  int hidden = 0;              // H (multiple of 8)
  int top_k = 0;               // K
  DType in_dtype = DType::kF32;  // FC2 rows: f32 or bf16 (MarlinMoeParams::out_dtype of FC2)
  int block_threads = 256;
  int k_splits = 1;  // FC2's sets of rows per slot (MarlinMoeParams::k_splits), added in order

  friend bool operator==(const MoeCombineParams& a, const MoeCombineParams& b) {
    return a.hidden == b.hidden && a.top_k == b.top_k && a.in_dtype == b.in_dtype &&
           a.block_threads == b.block_threads && a.k_splits == b.k_splits;
  }
};

// narrow_ids: int64 topk_ids -> int32 (ids outside int32 become -1: no local expert has one).
struct NarrowIdsParams {
  int block_threads = 256;

  friend bool operator==(const NarrowIdsParams& a, const NarrowIdsParams& b) {
    return a.block_threads == b.block_threads;
  }
};

// decode_moe: one kernel of the family's two launch sequences, each launched with programmatic
// dependent launch. The persistent tile, three kernels of the same traits: kReset zeroes the
// work-queue counters (one CTA, after waiting for the grid before it); kMain is the persistent
// fused layer up to FC2's bf16 rows (it waits on kReset before touching the counters); kCombine
// sums each token's rows into the output (it waits for kMain's grid). The two-launch tile for the
// smallest T (kernels/moe/decode_pair.cuh): kPairFc1 (FC1 with the activation), then kPairFc2
// (FC2 and the top-k sum); both take PairTraits.
enum class DecodeKernel { kReset, kMain, kPairFc1, kPairFc2, kCombine };

// decode_moe (kernels/moe/decode_moe.cuh DecodeTraits, decode_pair.cuh PairTraits): the model's
// sizes are template arguments, so every rule of kernels/moe/decode_params.cuh (Geometry::rule)
// or decode_pair_params.cuh (PairGeometry::rule) is checked per spec.
struct MoeDecodeParams {
  DecodeKernel kernel = DecodeKernel::kMain;
  int num_experts = 0;           // E local experts (1..4096: 12-bit field)
  int top_k = 0;                 // K slots per token (1..64)
  int hidden = 0;                // H, a multiple of 256 (whole FC1 chunks)
  int intermediate = 0;          // I, a multiple of 128 (whole FC2 chunks)
  int block_n = 0;               // positions per virtual expert, the MMA's N: 8, 16 or 32
  int fc1_strips = 0;            // 16-row strips per FC1 item: 2, 4 or 8 dividing I / 8
  int fc2_strips = 0;            // 16-row strips per FC2 item: 4 or 8 dividing H / 16
  int stages = 0;                // chunks in flight per CTA (2..8)
  // The pair kernels have no block_n, strips or stages (all 0): their tile follows from the
  // shape and the T bucket they serve, 1, 2, 4 or 8 tokens (0 for kReset, kMain and kCombine).
  int max_tokens = 0;
  Activation activation;         // the gated activation of FC1
  DType id_dtype = DType::kI32;  // topk_ids element type read directly (kI32 or kI64)

  friend bool operator==(const MoeDecodeParams& a, const MoeDecodeParams& b) {
    return a.kernel == b.kernel && a.num_experts == b.num_experts && a.top_k == b.top_k &&
           a.hidden == b.hidden && a.intermediate == b.intermediate && a.block_n == b.block_n &&
           a.fc1_strips == b.fc1_strips && a.fc2_strips == b.fc2_strips && a.stages == b.stages &&
           a.max_tokens == b.max_tokens &&
           a.activation.kind == b.activation.kind && a.activation.limit == b.activation.limit &&
           a.activation.alpha == b.activation.alpha && a.activation.beta == b.activation.beta &&
           a.activation.linear_beta == b.activation.linear_beta && a.id_dtype == b.id_dtype;
  }
};

using FamilyParams =
    std::variant<AppendSharedParams, MoeRouteParams, MoeRepackParams, MarlinMoeParams,
                 MoeCombineParams, NarrowIdsParams, MoeDecodeParams>;

const char* route_kernel_name(RouteKernel kernel) noexcept;  // "single", "rank", "scan", "scatter"
const char* moe_gemm_stage_name(MoeGemmStage stage) noexcept;  // "fc1", "fc2"
// "reset", "main", "pair_fc1", "pair_fc2", "combine"
const char* decode_kernel_name(DecodeKernel kernel) noexcept;

struct KernelSpec {
  Family family = Family::kAppendShared;
  Arch arch;
  FamilyParams params;

  // A short human-readable name, e.g. "append_shared<k6,s1,i32,sigmoid,bf16,t128>@sm_90a" (a
  // constant gate reads no logits, so it omits their dtype: "<k6,s1,i32,constant,t128>").
  std::string display_name() const;
  // The same facts as JSON text (stable field order), for manifests and `moejit list`.
  std::string to_json() const;
  // Cheap hash of the typed fields, for the in-memory kernel table.
  std::size_t hash() const noexcept;
  friend bool operator==(const KernelSpec& a, const KernelSpec& b) {
    return a.family == b.family && a.arch == b.arch && a.params == b.params;
  }
};

// Empty when `spec` can be served; otherwise the reason it can't (checked before any compile).
std::string supports(const KernelSpec& spec);

}  // namespace moejit
