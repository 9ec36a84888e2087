// libmoejit kernels/moe: MXFP4 (E2M1 + E8M0) -> bf16 A fragments, for the kernel layout of
// layout.cuh.
//
// Why this conversion: an E2M1 code s|e1 e0|m placed as a bf16 with its sign in bit 15, e1 e0 in
// exponent bits 1..0 (bits 8..7) and m in the top mantissa bit (bit 6) has the value
// v * 2^-126 for every code, the e = 0 codes included (0 and 0.5 become bf16 subnormals, which
// bf16 arithmetic keeps). So one bf16x2 multiply per register applies the exponent bias and the
// E8M0 scale 2^(s-127) together. A single factor 2^(s-1) would overflow bf16 for s >= 129
// (scales above 2^1), so the factor is 2^(s - kScaleBias) (bf16 bits (s + 63) << 7, finite for
// s <= 191) and the fp32 accumulator is multiplied by 2^(kScaleBias - 1) = 2^63 in the epilogue,
// which is exact. Cost per 32-bit word (8 weights): 6 LOP3 + 3 shifts (2 on the FMA pipe, 1 on
// the ALU: see shift) + 1 IMAD (layout::multiply_form) + 4 bf16x2 multiplies; per two scale
// bytes a permute and a shift-add (each multiply takes its factor from one half of a register,
// which the multiply's operand selects for free).
#pragma once

#include <moejit/kern/moe/layout.cuh>
#include <moejit/kern/moe/ptx.cuh>

namespace moejit::kern::moe::mxfp4 {

// The epilogue multiplies fp32 accumulators by this (2^63) to undo the bias of the factor.
inline constexpr float kAccumulatorScale = 0x1p63f;
static_assert(layout::kScaleBias == 64, "kAccumulatorScale is 2^(kScaleBias - 1)");

// The bf16 factors 2^(s - kScaleBias) of K group kGroup (0 or 1) of a lane's scale word: row g's
// in the low half, row g + 8's in the high half (scale bytes kGroup and 2 + kGroup, layout.cuh).
// dequant_step multiplies by one half at a time, so two factors cost a permute and a shift-add.
template <int kGroup>
__device__ __forceinline__ u32 group_factors(u32 scale_word) {
  static_assert(kGroup == 0 || kGroup == 1, "an atom holds two 32-wide K groups");
  // 0x00tt00ss (s: row g's byte, t: row g + 8's), then ((byte + 127 - kScaleBias) << 7) per half:
  // the exponent field of 2^(byte - 64).
  constexpr u32 kSelect = kGroup == 0 ? 0x4240u : 0x4341u;
  constexpr u32 kBiasBits = static_cast<u32>(127 - layout::kScaleBias) << 7;
  return ptx::prmt(scale_word, 0u, kSelect) * 128u + (kBiasBits | (kBiasBits << 16));
}

// Which pipe: ptxas compiles the left shifts to IMAD.SHL on the FMA pipe, leaving the integer ALU
// (LOP3, PRMT) to the masks, and the one right shift of a word (register 3's magnitude) to SHF on
// the ALU. Why not that one on the FMA pipe too, as the high word of w * 2^(32 - s) (IMAD.HI):
// measured on the H200 (tools/PERF_LOG.md "the right shift on the ALU"), the SHF form is 3-6%
// faster in every MXFP4 tile (marlin_moe gpt-oss-120b T = 96 479 -> 458 us, deepseek-v4-flash-tp4
// T = 6 46.9 -> 44.0; decode_moe kimi-k3.1-tp8 T = 24 239 -> 233) and the tall FC1 tile needs 80
// registers instead of 91; moving the left shifts by 3 and 5 to SHF as well lost half of that.
// kFmaShifts: in the warpgroup tile ptxas put two of the four left shifts of a word on SHF anyway
// (SASS: 6 LOP3 + 3 SHF on the ALU against 2 IMAD.SHL + 4 HMUL2 on the FMA pipe; ncu: 11% of its
// warp samples throttled on a math pipe), so there each left shift is a multiply by a register
// ptxas cannot fold into a shift: 2^s | (dynamic shared memory bytes >> 31), which is 2^s, as no
// CTA has 2 GB of shared memory (the same bits as the shift). Measured on the H200
// (tools/PERF_LOG.md "the warpgroup tile's left shifts on the FMA pipe"), layer us: kimi-k3.1-tp8
// T = 1024 872.8 -> 843.9, gpt-oss-120b T = 512 594.2 -> 586.0, qwen3-30b-a3b T = 256 137.6 ->
// 135.8. (These runs read the layout before layout::multiply_form, four left shifts a word; the
// present one has two, and the multiply is an IMAD, on the FMA pipe too.)
template <int kShift, bool kFmaShifts = false>
__device__ __forceinline__ u32 shift(u32 w) {
  static_assert(kShift > -32 && kShift < 32, "shift out of range");
  if constexpr (kShift > 0) {
    return w >> kShift;
  } else if constexpr (kShift < 0 && kFmaShifts) {
    u32 smem_bytes;
    asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(smem_bytes));
    return w * ((smem_bytes >> 31) | (1u << -kShift));
  } else if constexpr (kShift < 0) {
    return w << -kShift;
  } else {
    return w;
  }
}

// Register `kPair` of a word, as a bf16x2 of value code * 2^-126.
template <int kPair, bool kFmaShifts = false>
__device__ __forceinline__ u32 extract_pair(u32 w) {
  constexpr u32 kMag = layout::kMagBits;
  constexpr u32 kSign = layout::kSignBits;
  constexpr int kMagShift = layout::mag_shift(kPair);
  constexpr int kSignShift = layout::sign_shift(kPair);
  if constexpr (kMagShift == kSignShift) {
    return shift<kMagShift, kFmaShifts>(w) & (kMag | kSign);
  } else if constexpr (layout::multiply_form(kPair)) {
    return ((w & layout::pair_sources(kPair)) * layout::multiply_factor(kPair)) & (kMag | kSign);
  } else {
    return (shift<kMagShift, kFmaShifts>(w) & kMag) | (shift<kSignShift, kFmaShifts>(w) & kSign);
  }
}

// The four A registers of one k16 step: a0, a2 hold row g (the low half of `factors`, from
// group_factors), a1, a3 row g + 8 (the high half). kFmaShifts: see shift.
template <bool kFmaShifts = false>
__device__ __forceinline__ void dequant_step(u32 w, u32 factors, u32 (&a)[4]) {
  a[0] = ptx::mul_bf16x2_half<0>(extract_pair<0, kFmaShifts>(w), factors);
  a[1] = ptx::mul_bf16x2_half<1>(extract_pair<1, kFmaShifts>(w), factors);
  a[2] = ptx::mul_bf16x2_half<0>(extract_pair<2, kFmaShifts>(w), factors);
  a[3] = ptx::mul_bf16x2_half<1>(extract_pair<3, kFmaShifts>(w), factors);
}

}  // namespace moejit::kern::moe::mxfp4
