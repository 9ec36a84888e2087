// libmoejit kernels/moe: decode_moe's two-launch tile for the smallest T (decode_pair.cuh): shape
// rules, shared-memory plan, workspace and kernel arguments. Host-usable (the planner checks the
// same rules and sizes the same buffers): no device code here.
//
// Vocabulary as in decode_params.cuh: a position is one (token, slot) pair; a virtual expert is up
// to 8 positions routed to one local expert (one n8 MMA tile); a strip is 16 weight rows (FC1: 8
// gate/up pairs) of one expert, all of K.
#pragma once

#include <moejit/kern/moe/layout.cuh>
#include <moejit/kern/moe/types.cuh>

namespace moejit::kern::moe::decode {

inline constexpr i32 kPairConsumerWarps = 8;  // warps that share one unit (fc1) or one CTA (fc2)
inline constexpr i32 kPairConsumerThreads = 32 * kPairConsumerWarps;
// Why two groups of eight warps in fc1 (units alternate between them): with fc2's CTA beside it
// (the largest carveout), kimi-k3.1-tp8 T = 1 took 21.1 us against 23.5 with one group, deepseek
// 15.0 against 15.3 (harness, H200; tools/PERF_LOG.md "decode_moe pair").
inline constexpr i32 kPairFc1Groups = 2;
inline constexpr i32 kPairFc1Threads = 32 * (kPairFc1Groups * kPairConsumerWarps + 1);
inline constexpr i32 kPairFc2Threads = 32 * (kPairConsumerWarps + 1);  // + one producer warp
// Why register caps: one CTA of each kernel shares an SM (fc2 loads its weights while fc1 runs),
// so their threads must fit the SM's 64K registers together. The kernels carry them as __maxnreg__
// (ptxas would otherwise take up to 65536 / threads, and did on sm_100a: 79 for fc1).
inline constexpr i32 kPairFc1MaxRegisters = 72;
inline constexpr i32 kPairFc2MaxRegisters = 88;
static_assert(kPairFc1Threads * kPairFc1MaxRegisters + kPairFc2Threads * kPairFc2MaxRegisters <=
                  64 * 1024,
              "one fc1 CTA and one fc2 CTA fit an SM's registers");
inline constexpr i32 kPairMaxPositions = 64;  // T * top_k: routing is quadratic in it
inline constexpr i32 kPairColumns = 8;        // positions per virtual expert (one n8 tile)
// Why 112 KB: one CTA of each kernel shares an SM (fc2's prefetch runs while fc1 streams), and an
// SM has 228 KB with 1 KB reserved per CTA.
inline constexpr i32 kPairSmemBudget = 112 * 1024;
inline constexpr i32 kPairMaxFc1Stages = 8;
inline constexpr i32 kPairMaxFc2Stages = 32;
// Why fc1's producer keeps only about this many bytes in flight (PairGeometry::fc1_in_flight: it
// issues a unit once the unit that many before it has landed, not as soon as a ring slot is
// free): DRAM serves the requests of all SMs interleaved, so a unit lands only when about every
// byte asked for with it has; asking for one unit at a time (about what one SM needs in flight
// at the copy rate, 4.2 TB/s x ~1 us / 132) lands each SM's first unit sooner, and each next one
// while the last is multiplied. Measured on the H200 (tools/PERF_LOG.md "the pair's producers
// paced by landings"), decode us against the unpaced fc1, three id draws: deepseek-v4-flash-tp4
// T = 1 14.3 -> 13.5-13.8, T = 2 22.1-22.5 -> 20.6-21.3; qwen3-30b-a3b T = 1 14.3-14.5 ->
// 13.9-14.2; kimi-k3.1-tp8 T = 1 19.4-19.7 -> 19.0-19.3; at ~56 KB the gain was mostly gone
// (deepseek T = 1 14.4-14.5). fc2's producer is not paced: its units must be in shared memory
// when fc1 ends, and paced to ~16 KB they landed after it (2.4-8 us slower on every pair shape).
inline constexpr i32 kPairFc1InFlightBytes = 32 * 1024;
inline constexpr i32 kPairFc2MaxStrips = 4;  // H strips per fc2 CTA (the launch's grid keeps to it)

// Why every rule (static_assert-ed by PairTraits, checked by the planner, which then keeps the
// persistent tile):
enum class PairRule : i32 {
  kOk = 0,
  kExperts,       // 1 <= E <= 4096 (12-bit expert field of a virtual expert)
  kTokens,        // max_tokens in {1, 2, 4, 8} and max_tokens * top_k <= kPairMaxPositions
  kHidden,        // H % 512 == 0: the eight consumer warps split a strip's K atoms evenly
  kInter,         // I % 64 == 0: whole K atoms for FC2, whole gate/up strips for FC1
  kSharedMemory,  // fc1 keeps >= 1 strip per group in flight; fc2 >= 8 units (one per warp)
};

struct PairGeometry {
  i32 experts;     // E local experts
  i32 top_k;       // K
  i32 hidden;      // H
  i32 inter;       // I
  i32 max_tokens;  // T bucket this instance serves (1, 2, 4 or 8)

  MOEJIT_HD constexpr i32 positions() const { return max_tokens * top_k; }

  // ---- routing tables, in both kernels ----
  // expert [P] i32, blocks [P] u32, weight [P] f32, vinfo [P] u32, sorted [8P] u16, total u32.
  MOEJIT_HD static constexpr i32 route_bytes() {
    return 4 * 4 * kPairMaxPositions + 2 * kPairColumns * kPairMaxPositions + 16;
  }
  MOEJIT_HD static constexpr i32 barrier_bytes(i32 stages) { return 16 * stages; }

  // ---- fc1: one unit = one FC1 strip of one virtual expert, all of K = H ----
  MOEJIT_HD constexpr i32 fc1_strips() const { return inter / layout::kGateUpRows; }  // per expert
  MOEJIT_HD constexpr i32 fc1_atoms() const { return hidden / layout::kAtomK; }
  MOEJIT_HD constexpr i32 fc1_unit_bytes() const {
    return fc1_atoms() * (layout::kAtomBytes + layout::kAtomScaleBytes);
  }
  // Why +16: consecutive rows start 16 bytes apart modulo 128, so ldmatrix has no bank conflict.
  MOEJIT_HD constexpr i32 hidden_row_bytes() const { return hidden * 2 + 16; }
  MOEJIT_HD constexpr i32 fc1_hidden_bytes() const { return max_tokens * hidden_row_bytes(); }
  MOEJIT_HD constexpr i32 fc1_fixed_bytes() const {
    return fc1_hidden_bytes() + route_bytes() + barrier_bytes(kPairMaxFc1Stages);
  }
  // Units fc1's producer keeps in flight: the whole units nearest kPairFc1InFlightBytes, at least
  // one (deepseek-v4-flash-tp4 and kimi: 1 of 35 / 30 KB; qwen3-30b-a3b: 2 of 17 KB). Pacing
  // applies where this is below fc1_stages(); the ring's empty slots bound the rest.
  MOEJIT_HD constexpr i32 fc1_in_flight() const {
    const i32 units = (kPairFc1InFlightBytes + fc1_unit_bytes() / 2) / fc1_unit_bytes();
    return units > 1 ? units : 1;
  }
  MOEJIT_HD constexpr i32 fc1_stages() const {
    const i32 s = (kPairSmemBudget - fc1_fixed_bytes()) / fc1_unit_bytes();
    return s < 0 ? 0 : s > kPairMaxFc1Stages ? kPairMaxFc1Stages : s;
  }
  MOEJIT_HD constexpr i32 fc1_ring_bytes() const { return fc1_stages() * fc1_unit_bytes(); }
  MOEJIT_HD constexpr i32 fc1_smem_bytes() const { return fc1_ring_bytes() + fc1_fixed_bytes(); }

  // ---- fc2: one unit = one 16-row strip of H of one virtual expert, all of K = I ----
  MOEJIT_HD constexpr i32 fc2_strips() const { return hidden / layout::kAtomRows; }  // per expert
  MOEJIT_HD constexpr i32 fc2_atoms() const { return inter / layout::kAtomK; }
  MOEJIT_HD constexpr i32 fc2_unit_bytes() const {
    return fc2_atoms() * (layout::kAtomBytes + layout::kAtomScaleBytes);
  }
  MOEJIT_HD constexpr i32 inter_row_bytes() const { return inter * 2 + 16; }
  MOEJIT_HD constexpr i32 fc2_inter_bytes() const { return positions() * inter_row_bytes(); }
  // FC2 rows times the top-k weight, fp32 [strips][16][P], summed per token in slot order.
  MOEJIT_HD constexpr i32 fc2_rows_bytes() const {
    return kPairFc2MaxStrips * layout::kAtomRows * positions() * 4;
  }
  MOEJIT_HD constexpr i32 fc2_fixed_bytes() const {
    return fc2_inter_bytes() + fc2_rows_bytes() + route_bytes() +
           barrier_bytes(kPairMaxFc2Stages);
  }
  MOEJIT_HD constexpr i32 fc2_stages() const {
    const i32 s = (kPairSmemBudget - fc2_fixed_bytes()) / fc2_unit_bytes();
    return s < 0 ? 0 : s > kPairMaxFc2Stages ? kPairMaxFc2Stages : s;
  }
  MOEJIT_HD constexpr i32 fc2_ring_bytes() const { return fc2_stages() * fc2_unit_bytes(); }
  MOEJIT_HD constexpr i32 fc2_smem_bytes() const { return fc2_ring_bytes() + fc2_fixed_bytes(); }
  // fc2's grid: a CTA per H strip up to the SM count, and never more than kPairFc2MaxStrips
  // strips per CTA.
  MOEJIT_HD constexpr i32 fc2_grid(i32 sms) const {
    const i32 by_sms = sms < fc2_strips() ? sms : fc2_strips();
    const i32 least = (fc2_strips() + kPairFc2MaxStrips - 1) / kPairFc2MaxStrips;
    return by_sms > least ? by_sms : least;
  }

  // ---- global workspace: fc1's output, bf16 [positions][I] ----
  MOEJIT_HD constexpr i64 workspace_bytes() const {
    return (static_cast<i64>(positions()) * inter * 2 + 255) / 256 * 256;
  }

  MOEJIT_HD constexpr PairRule rule() const {
    if (experts < 1 || experts > 4096) return PairRule::kExperts;
    if ((max_tokens != 1 && max_tokens != 2 && max_tokens != 4 && max_tokens != 8) ||
        top_k < 1 || positions() > kPairMaxPositions) {
      return PairRule::kTokens;
    }
    if (hidden < 512 || hidden % 512 != 0) return PairRule::kHidden;
    if (inter < 64 || inter % 64 != 0) return PairRule::kInter;
    if (fc1_stages() < kPairFc1Groups || fc2_stages() < kPairConsumerWarps) {
      return PairRule::kSharedMemory;
    }
    return PairRule::kOk;
  }
};

// Kernel arguments (both kernels take this struct by value). Weights in the kernel layout
// (layout.cuh), 16-byte aligned.
struct DecodePairParams {
  const u8* w13;              // FC1 atoms [E][I / 8][H / 64]
  const u8* w13_scales;       // their scales
  const u8* w2;               // FC2 atoms [E][H / 16][I / 64]
  const u8* w2_scales;        // their scales
  const u16* hidden;          // bf16 [T][H], rows 16-byte aligned
  const void* topk_ids;       // [T][K] int32, or int64 with kIds64
  const float* topk_weights;  // [T][K]
  u16* out;                   // bf16 [T][H]
  u16* inter;                 // workspace: fc1's output, bf16 [T * K][I]
  i32 num_tokens;             // T, 1 .. max_tokens
  i32 expert_offset;          // global id of local expert 0
  // The device's peak DRAM rate, bytes per microsecond; 0 if unknown. fc2 holds its weight
  // prefetch back until its CTA has run as long as fc1's bytes take at that rate (decode_pair.cuh
  // says why); 0 prefetches at once.
  u32 dram_bytes_per_us;
};

}  // namespace moejit::kern::moe::decode
