// decode_moe's plan, the host's view of kernels/moe/decode_params.cuh and
// decode_pair_params.cuh: the tile for T tokens of a shape, the sizes and rules the op and
// supports() check (the same constexpr Geometry functions the kernel static_asserts on), and the
// messages that name a broken rule. Which path a call takes is moe_plan.hpp's. No CUDA or kernel
// headers: testable on a CPU.
#pragma once

#include <string>

#include "moejit/kernel_spec.hpp"
#include "moejit/shape.hpp"

namespace moejit::detail {

inline constexpr int kDecodeMaxTokens = 256;  // decode::kMaxTokens: decode_moe serves T <= 256
// MoePath::kAuto takes decode_moe for T <= kDecodeAutoMaxTokens where the two-launch pair's rules
// pass (decode_by_default), marlin_moe otherwise. Why 1: on the H200 (tools/PERF_LOG.md
// "the right shift on the ALU" and "kAuto at T = 2"), over the four served reference shapes
// decode_moe takes 0.76-0.96x marlin_moe's time at T = 1, but 0.97-1.18x at T = 2 (the pair,
// once marlin_moe's dequant got faster), 0.96-1.18x at T = 3..5, 0.92-1.18x at T = 8..16 and
// 1.03-1.13x at T = 24: past T = 1 the persistent tile or the pair wins on a few (shape, T) only,
// by at most 8%, and loses up to 18%. With the top-k sum as its own launch, kimi-k3.1's FC2 chunks
// of 3 atoms and the routing's ids table (tools/PERF_LOG.md, thirty-third session) the
// persistent tile still takes 1.02-1.16x at T = 3-6 and 1.02-1.14x at T = 24-256; after the
// thirty-fifth session 1.06-1.16x at T = 6 and 1.02-1.14x at T = 24-256; in the thirty-ninth
// (seeds 1 and 2, same call) 1.01-1.14x at T = 6 and 0.98-1.04x at T = 24-256 but qwen3-30b-a3b
// T = 256 (1.09x): faster only on deepseek-v4-flash-tp4 T = 256, by 1-2%.
inline constexpr int kDecodeAutoMaxTokens = 1;
// Why the pair up to T = 2: in the harness (H200, tools/PERF_LOG.md "decode_moe pair") it took
// 15.0 / 20.9 / 15.0 us at T = 1 (deepseek-v4-flash-tp4 / kimi-k3.1-tp8 / qwen3-30b-a3b) against
// the persistent tile's 23.9 / 29.3 / 26.7, and 23.8 / 37.6 / 23.4 at T = 2 against 28.8 / 41.7 /
// 28.5; at T = 4 it lost (38.9 / - / 41.8 against 35.5 / 59.2 / 34.6).
inline constexpr int kDecodePairMaxTokens = 2;
inline constexpr int kDecodeThreads =
    320;  // decode::kThreads: 8 consumer, 1 producer, 1 publisher warp
inline constexpr int kDecodePairFc1Threads = 544;  // decode::kPairFc1Threads: 16 + 1 warps
inline constexpr int kDecodePairFc2Threads = 288;  // decode::kPairFc2Threads: 8 + 1 warps
inline constexpr bool decode_pair_kernel(DecodeKernel kernel) {
  return kernel == DecodeKernel::kPairFc1 || kernel == DecodeKernel::kPairFc2;
}
// The block_n values decode_moe supports (Geometry::rule()); a call may force any of them.
inline constexpr int kDecodeBlockNs[] = {8, 16, 32};

// Geometry::smem_bytes(), blocks_per_sm() and workspace_bytes() of a decode spec's traits (for a
// pair kernel: PairGeometry's fc1 or fc2 shared memory and its workspace; one CTA per SM).
long long decode_moe_smem_bytes(const MoeDecodeParams& p);
int decode_moe_blocks_per_sm(const MoeDecodeParams& p);
long long decode_moe_workspace_bytes(const MoeDecodeParams& p);
// The rule of PairGeometry::rule() that a pair kernel's sizes break, named with the value; "" when
// rule() is kOk.
std::string decode_pair_rule_problem(const MoeDecodeParams& p);
// The rule of Geometry::rule() that `p`'s sizes and tile break, named with the value and how to
// fix it ("hidden = 2880 is not a multiple of 256 (...)"); "" when rule() is kOk.
std::string decode_rule_problem(const MoeDecodeParams& p);

// Whether decode_moe serves `shape` by the rules of the shape alone (no biases; E, K, H, I), with
// no message built: the op asks this on every forward. decode_moe_problem names what breaks.
bool decode_shape_ok(const ModelShape& shape);

// "" when decode_moe serves `shape` (arch aside: sm_90 or newer, see decode_moe_runs_on): no
// biases, and Geometry::rule() is kOk for every tile the planner can choose for T in 1..256
// with every block_n (8, 16 or 32, so a forced block_n also works). Otherwise every reason,
// ending with "such shapes use marlin_moe".
std::string decode_moe_problem(const ModelShape& shape);

// The decode_moe main kernel for T tokens (1..256) of `shape`: block_n_override 0 = the
// planner's block_n, 8, 16 or 32 forces it. Pure arithmetic, no allocation. stages == 0 when no
// pipeline depth fits (decode_moe_problem names that shape).
MoeDecodeParams choose_decode_config(const ModelShape& shape, int tokens, int block_n_override);
// The reset kernel and the combine kernel that go with a main kernel (same traits).
MoeDecodeParams decode_reset_params(const MoeDecodeParams& main);
MoeDecodeParams decode_combine_params(const MoeDecodeParams& main);
// The pair's fc1 kernel for T tokens of `shape` (T bucket 1, 2, 4 or 8), or max_tokens == 0 when
// T > kDecodePairMaxTokens or PairGeometry::rule() refuses the shape. The fc2 kernel is the same
// with kernel = kPairFc2 (decode_pair_fc2_params).
MoeDecodeParams choose_decode_pair(const ModelShape& shape, int tokens);
MoeDecodeParams decode_pair_fc2_params(const MoeDecodeParams& fc1);
// Whether `p` runs on `arch`: sm_90 or newer (bulk copies, mbarrier transaction counts,
// griddepcontrol) with the shared memory the arch allows one CTA.
bool decode_moe_runs_on(const MoeDecodeParams& p, const Arch& arch);
// The spec of one decode kernel on `arch`.
KernelSpec decode_moe_spec(const MoeDecodeParams& p, const Arch& arch);

}  // namespace moejit::detail
