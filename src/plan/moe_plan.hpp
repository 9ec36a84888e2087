// The MoE layer's plan: which kernels moe_forward launches for T tokens (the one function the
// planner and the op share, so a prewarm builds exactly what a call looks up), the sizes that
// follow from it (workspace, launch geometry, shared memory), and the arch facts supports()
// checks. No CUDA headers: testable on a CPU.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "moejit/kernel_spec.hpp"
#include "moejit/shape.hpp"

namespace moejit::detail {

// ---- facts shared by supports(), codegen and the ops ------------------------------------------

// A float constant as an exact ratio of ints: float(num) / float(den) == value (a correctly
// rounded division, as kernels/moe/activation.cuh evaluates it). Tries decimal denominators
// first (1.702 -> 1702 / 1000, readable in the source), then the continued fraction's
// convergents, then the float's own binary fraction. Empty when none fits an int (|value|
// beyond 2^31, or so small that no num / den with den < 2^31 rounds to it).
struct FloatRatio {
  int num = 0;
  int den = 1;
};
std::optional<FloatRatio> float_ratio(float value);

// moe_gemm.cuh's MoeGemmTraits: threads per CTA and dynamic shared memory (kSmemBytes).
int marlin_moe_threads(const MarlinMoeParams& p);
long long marlin_moe_smem_bytes(const MarlinMoeParams& p);
// route.cuh's RouteTraits::kRankSharedBytes (static shared memory of the rank phase).
long long route_rank_shared_bytes(int num_experts, int block_threads);
inline constexpr long long kRouteStaticSharedLimit = 48 * 1024;
// The most dynamic shared memory one CTA may opt into on `arch` (the CUDA programming guide's
// per-arch table; the op still learns the device's own limit when it sets the attribute).
long long max_dynamic_smem_bytes(const Arch& arch);

// ---- the choice per T ---------------------------------------------------------------------------

// Everything moe_forward launches for one token count T >= 1, in launch order:
// [narrow_ids] -> route (single, or rank + scan + scatter) -> FC1 -> FC2 -> combine.
struct MoeForwardConfig {
  int tokens = 0;
  bool narrow_ids = false;  // int64 ids: one narrowing launch first
  NarrowIdsParams narrow;
  bool route_single = true;  // N = T * K <= route.chunk_rows: one route launch
  MoeRouteParams route;      // kernel = kSingle, or kRank (scan and scatter share the rest)
  MarlinMoeParams fc1;
  MarlinMoeParams fc2;
  MoeCombineParams combine;
};

// The config for `tokens` (1 <= tokens) of `shape`. Pure arithmetic on the shape's sizes; the op
// calls it on every forward, the planner at the end of every run of T with one config.
MoeForwardConfig choose_moe_config(const ModelShape& shape, int tokens);

// The kernels of one config for `arch`, by role. Filled without allocating (the op builds it on
// every forward).
struct MoeForwardSpecs {
  bool has_narrow = false;
  KernelSpec narrow;
  int route_count = 0;  // 1 (single) or 3 (rank, scan, scatter)
  KernelSpec route[3];
  KernelSpec fc1;
  KernelSpec fc2;
  KernelSpec combine;
};
MoeForwardSpecs moe_forward_specs(const MoeForwardConfig& config, const Arch& arch);

// The same kernels as a list, in launch order.
std::vector<KernelSpec> moe_config_specs(const MoeForwardConfig& config, const Arch& arch);

// The largest T of each run of T in [1, max_tokens] over which choose_moe_config is constant,
// ascending; the last is max_tokens. Empty when max_tokens < 1.
std::vector<int> moe_config_segment_ends(const ModelShape& shape, int max_tokens);

// The two repack kernels (FC1 gate/up fused, FC2 plain), shared by every shape and layout.
MoeRepackParams moe_repack_params(bool gate_up);

// ---- sizes --------------------------------------------------------------------------------------

// Byte offsets inside the workspace for one config (every region 256-byte aligned).
struct MoeWorkspaceLayout {
  // route arrays (route_params.cuh's RouteWorkspaceLayout, offsets from 0)
  std::size_t expert_counts = 0;
  std::size_t expert_block_offset = 0;
  std::size_t sorted_rows = 0;
  std::size_t block_expert = 0;
  std::size_t slot_row = 0;
  std::size_t total_blocks = 0;
  std::size_t chunk_base = 0;
  std::size_t ids32 = 0;      // narrowed ids [T * K] int32 (only with narrow_ids)
  std::size_t inter = 0;      // FC1 output, bf16 [padded rows, I]
  std::size_t out2 = 0;       // FC2 output, [padded rows, H] in fc2.out_dtype
  std::size_t bytes = 0;      // total
  long long max_blocks = 0;   // route blocks provisioned: the GEMMs' grid.x
  long long padded_rows = 0;  // max_blocks * block
};
MoeWorkspaceLayout moe_workspace_layout(const ModelShape& shape, const MoeForwardConfig& config);

// max over T in [1, max_tokens] of moe_workspace_layout(...).bytes (0 when max_tokens is 0).
std::size_t moe_workspace_bytes_for(const ModelShape& shape, int max_tokens);

// Repacked weight sizes (layout.cuh), in bytes.
struct MoeWeightSizes {
  std::size_t w13 = 0, w13_scales = 0, w2 = 0, w2_scales = 0, b13 = 0, b2 = 0;
  int fc1_m_atoms = 0, fc1_k_atoms = 0, fc2_m_atoms = 0, fc2_k_atoms = 0;
};
MoeWeightSizes moe_weight_sizes(const ModelShape& shape);

// The first reason the op can't serve `shape` (sizes the kernels' arguments can't hold), or "".
// Kernel-level reasons come from supports() on the planned specs.
std::string moe_shape_problem(const ModelShape& shape);

}  // namespace moejit::detail
