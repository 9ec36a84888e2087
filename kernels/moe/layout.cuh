// libmoejit kernels/moe: the MXFP4 "kernel layout" of marlin_moe weights. Index math only, usable
// on the host too (buffer sizing, the CPU unpack of the repack round-trip test).
//
// Why this layout (read this before changing anything here; repack.cuh writes it, moe_gemm.cuh
// reads it):
// - Weight rows sit in the MMA's M, tokens in N (mma.sync m16n8k16, bf16 in, fp32 accumulate):
//   decode has 1-2 tokens per expert, so N = 8 wastes little and M = 16 weight rows is dense.
// - The unit is an "atom": 16 weight rows x 64 K = 1024 nibbles = 512 bytes = 32 lanes x 16 B.
//   Lane l = 4g + t (g = l / 4, t = l % 4) owns exactly the A fragments of the four k16 MMA
//   steps of the atom, so ONE 16-byte load per lane feeds four MMAs, and a warp's 32 loads are
//   one contiguous, coalesced 512-byte run. Word s (0..3) of the lane's 16 bytes is k16 step s.
// - Atoms are stored [expert][m_atom][k_atom]: the atoms of one 16-row strip are contiguous
//   along K, so a CTA that owns some rows streams long contiguous runs (decode splits rows
//   across all SMs), and a stage of BlockM x BlockK is BlockM/16 runs of BlockK/64 atoms.
//   The layout does not depend on the GEMM's tile sizes: one repack serves every config.
// - Scales: one E8M0 byte per 32 K, stored per atom as 32 bytes [g][4]: byte 4g+0 = (row g,
//   group 0), +1 = (row g, group 1), +2 = (row g+8, group 0), +3 = (row g+8, group 1). A lane
//   reads its four scales with one 32-bit load (the four lanes of a group broadcast), and the
//   scale stream is 1/16 of the weight stream, never duplicated.
// - Inside a word, the 8 nibbles of the lane's four bf16x2 A registers (a0: row g, k 2t..2t+1;
//   a1: row g+8, same k; a2: row g, k 2t+8..2t+9; a3: row g+8, k 2t+8..) are stored with their
//   sign bit and their three magnitude bits at positions chosen so that dequant is a shift and
//   a mask per register (see mag_shift / sign_shift): register j = ((w >> mag_shift) & MAG) |
//   ((w >> sign_shift) & SIGN), negative shift = left shift, MAG = 0x01C001C0 (bf16 bits 8..6
//   of each half: exponent bits 1..0 and the top mantissa bit), SIGN = 0x80008000. A search
//   over all shift pairs shows no layout where every register is one shift + one mask (the
//   masks cannot tile 32 bits). In this one register 2 is a mask, register 1 a shift and a mask,
//   register 3 two shifts and two masks, and register 0 a mask, a multiply by 2^6 + 2^1 (both
//   shifts at once: multiply_form) and a mask: 10 integer ops per word. Searching every layout of
//   those four forms (tools/gen/layout_search.py), none takes fewer (the previous layout took 11,
//   the shift-by-4 nibble layout 16). The layout is internal to a library build, not a storage
//   format: weights repacked by one build are read by that build's kernels.
// - FC1 rows: an atom holds gate rows 8a..8a+7 in its rows 0..7 and the matching up rows in its
//   rows 8..15, so the accumulator a lane holds for row g (gate j) and row g+8 (up j) are in the
//   same thread and the activation is fused with no data exchange. FC2 rows are plain.
// - Padding: K is padded to a multiple of 64 and rows to a multiple of 16 (8 gate/up pairs)
//   with zero nibbles and scale 127 (1.0). The GEMM zero-fills any part of its last K tile
//   beyond k_atoms, so K needs no padding to the kernel's K tile (gpt-oss H = 2880 = 45 atoms:
//   no waste at all).
// - Scale range: dequant multiplies by the bf16 2^(s - kScaleBias) and the fp32 accumulator by
//   2^(kScaleBias - 1), so the weight's bf16 stays normal and finite for s in
//   [kScaleMin, kScaleMax] = [65, 191], i.e. scales 2^-62 .. 2^64. repack counts scale bytes
//   outside that range (0xFF = NaN included) so the caller can refuse such a checkpoint.
#pragma once

#include <moejit/kern/moe/types.cuh>

namespace moejit::kern::moe::layout {

inline constexpr i32 kAtomRows = 16;                // weight rows per atom (the MMA's M)
inline constexpr i32 kAtomK = 64;                   // K elements per atom (four k16 MMA steps)
inline constexpr i32 kAtomBytes = 512;              // kAtomRows * kAtomK / 2: 16 bytes per lane
inline constexpr i32 kGroupK = 32;                  // K elements per E8M0 scale (MXFP4 block)
inline constexpr i32 kAtomScaleBytes = 32;          // kAtomRows * kAtomK / kGroupK
inline constexpr i32 kPairsPerStep = 4;             // bf16x2 A registers per lane per k16 step
inline constexpr i32 kGateUpRows = 8;               // FC1: gate/up pairs per atom
inline constexpr u8 kPadScale = 127;                // scale byte written for padding (2^0)
inline constexpr i32 kScaleBias = 64;               // dequant factor is 2^(s - kScaleBias) in bf16
inline constexpr i32 kScaleMin = kScaleBias + 1;    // smallest scale byte dequantized exactly
inline constexpr i32 kScaleMax = kScaleBias + 127;  // largest scale byte with a finite factor

static_assert(kAtomBytes == kAtomRows * kAtomK / 2, "an atom is 16 rows x 64 K nibbles");
static_assert(kAtomBytes == 32 * 16, "one 16-byte load per lane must cover the atom");
static_assert(kAtomScaleBytes == kAtomRows * (kAtomK / kGroupK), "one scale per row and group");

// Shift (right if >= 0, left if < 0) that brings the magnitude bits of register `pair` to bf16
// bits 8..6 (and 24..22), and the one that brings its sign bits to bits 15 and 31.
MOEJIT_HD constexpr i32 mag_shift(i32 pair) {
  return pair == 0 ? -6 : pair == 1 ? -3 : pair == 2 ? 0 : 3;
}
MOEJIT_HD constexpr i32 sign_shift(i32 pair) {
  return pair == 0 ? -1 : pair == 1 ? -3 : pair == 2 ? 0 : -2;
}
// Word bit of the mantissa bit (the lowest of the three magnitude bits) of element `half`
// (0: even k, low bf16; 1: odd k, high bf16) of register `pair`, and of its sign bit.
MOEJIT_HD constexpr i32 mag_bit(i32 pair, i32 half) { return 6 + 16 * half + mag_shift(pair); }
MOEJIT_HD constexpr i32 sign_bit(i32 pair, i32 half) { return 15 + 16 * half + sign_shift(pair); }

// The bf16x2 bits a register's two codes end in: magnitudes at 8..6 and 24..22, signs at 15, 31.
inline constexpr u32 kMagBits = 0x01C001C0u;
inline constexpr u32 kSignBits = 0x80008000u;
// The word bits register `pair` is made of (its two codes' magnitude and sign bits).
MOEJIT_HD constexpr u32 pair_sources(i32 pair) {
  u32 m = 0;
  for (i32 half = 0; half < 2; ++half) {
    m |= 7u << mag_bit(pair, half);
    m |= 1u << sign_bit(pair, half);
  }
  return m;
}
// Whether the four registers take every bit of a word exactly once.
MOEJIT_HD constexpr bool pairs_tile_word() {
  u32 seen = 0;
  for (i32 pair = 0; pair < kPairsPerStep; ++pair) {
    for (i32 half = 0; half < 2; ++half) {
      if (mag_bit(pair, half) < 0 || mag_bit(pair, half) + 2 > 31 || sign_bit(pair, half) < 0 ||
          sign_bit(pair, half) > 31) {
        return false;
      }
    }
    if ((seen & pair_sources(pair)) != 0) return false;
    seen |= pair_sources(pair);
  }
  return seen == 0xFFFFFFFFu;
}
static_assert(pairs_tile_word(), "the four registers' bits tile a 32-bit word");
// Whether register `pair` comes from one multiply: both its shifts left and different, and
// ((w & sources) * (2^-mag_shift + 2^-sign_shift)) holds the magnitudes at kMagBits and the signs
// at kSignBits, with no carry between the two shifted copies and no bit of either copy on the
// other's targets. One AND, one IMAD and one AND, where two shifts and two ANDs would do.
MOEJIT_HD constexpr bool multiply_form(i32 pair) {
  if (mag_shift(pair) >= 0 || sign_shift(pair) >= 0 || mag_shift(pair) == sign_shift(pair)) {
    return false;
  }
  const u32 v = pair_sources(pair);
  const u32 by_mag = v << -mag_shift(pair);
  const u32 by_sign = v << -sign_shift(pair);
  return (by_mag & by_sign) == 0 && (by_mag & (kMagBits | kSignBits)) == kMagBits &&
         (by_sign & (kMagBits | kSignBits)) == kSignBits;
}
MOEJIT_HD constexpr u32 multiply_factor(i32 pair) {
  return (1u << -mag_shift(pair)) + (1u << -sign_shift(pair));
}

// Places E2M1 code `nibble` (bit 3 sign, bits 2..1 exponent, bit 0 mantissa) into `word`.
MOEJIT_HD constexpr u32 deposit_nibble(u32 word, i32 pair, i32 half, u32 nibble) {
  return word | ((nibble & 7u) << mag_bit(pair, half)) |
         (((nibble >> 3) & 1u) << sign_bit(pair, half));
}
MOEJIT_HD constexpr u32 extract_nibble(u32 word, i32 pair, i32 half) {
  return ((word >> mag_bit(pair, half)) & 7u) | (((word >> sign_bit(pair, half)) & 1u) << 3);
}

// Where element (row, k) of an atom (row 0..15, k 0..63) lives.
struct AtomCoord {
  i32 lane;  // 0..31: byte offset lane * 16 in the atom
  i32 step;  // 0..3: the 32-bit word (k16 step) of the lane's 16 bytes
  i32 pair;  // 0..3: A register a0..a3 of mma.m16n8k16
  i32 half;  // 0: low bf16 (even k), 1: high bf16 (odd k)
};
MOEJIT_HD constexpr AtomCoord atom_coord(i32 row, i32 k) {
  return AtomCoord{4 * (row & 7) + ((k & 7) >> 1), k >> 4, (row >> 3) + 2 * ((k >> 3) & 1), k & 1};
}
// The inverse: the row and k of a lane's register element.
MOEJIT_HD constexpr i32 atom_row(i32 lane, i32 pair) { return (lane >> 2) + 8 * (pair & 1); }
MOEJIT_HD constexpr i32 atom_k(i32 lane, i32 step, i32 pair, i32 half) {
  return 16 * step + 2 * (lane & 3) + 8 * (pair >> 1) + half;
}
// Byte of the atom's 32 scale bytes that holds the scale of (row, k).
MOEJIT_HD constexpr i32 scale_byte(i32 row, i32 k) {
  return 4 * (row & 7) + 2 * (row >> 3) + (k >> 5);
}

// Atom counts of one expert's matrix in the kernel layout.
struct Dims {
  i32 m_atoms;  // 16-row strips (FC1: 8 gate/up pairs each)
  i32 k_atoms;  // 64-wide K blocks
};
// FC1 = W13 [2 * inter x hidden], FC2 = W2 [hidden x inter].
MOEJIT_HD constexpr Dims fc1_dims(i32 inter, i32 hidden) {
  return Dims{ceil_div(inter, kGateUpRows), ceil_div(hidden, kAtomK)};
}
MOEJIT_HD constexpr Dims fc2_dims(i32 inter, i32 hidden) {
  return Dims{ceil_div(hidden, kAtomRows), ceil_div(inter, kAtomK)};
}
MOEJIT_HD constexpr i64 atom_index(Dims d, i32 expert, i32 m_atom, i32 k_atom) {
  return (static_cast<i64>(expert) * d.m_atoms + m_atom) * d.k_atoms + k_atom;
}
MOEJIT_HD constexpr i64 weight_bytes(Dims d, i32 experts) {
  return static_cast<i64>(experts) * d.m_atoms * d.k_atoms * kAtomBytes;
}
MOEJIT_HD constexpr i64 scale_bytes(Dims d, i32 experts) {
  return static_cast<i64>(experts) * d.m_atoms * d.k_atoms * kAtomScaleBytes;
}

// Which source matrix and row feed row `row_in_atom` of strip `m_atom`. FC1 (gate_up): matrix 0
// is gate, 1 is up, and the row is the pair index j; FC2: one matrix, plain rows.
struct RowSource {
  i32 matrix;
  i32 row;
};
MOEJIT_HD constexpr RowSource row_source(bool gate_up, i32 m_atom, i32 row_in_atom) {
  return gate_up ? RowSource{row_in_atom >> 3, kGateUpRows * m_atom + (row_in_atom & 7)}
                 : RowSource{0, kAtomRows * m_atom + row_in_atom};
}

// The layout's version (moejit::moe_weight_layout_version): bump it with any change above that
// moves a checkpoint value in the repacked buffers (a code's bits, the lane order, the scale
// bytes, the row order, atom order or padding). The unit tests keep each version's fingerprint
// of these functions, so a change without a bump fails them.
inline constexpr i32 kVersion = 1;

}  // namespace moejit::kern::moe::layout
