// libmoejit kernels/moe: repack (family 5). Checkpoint MXFP4 matrices -> the kernel layout of
// layout.cuh, on the GPU, padding included.
//
// Sources (params.cuh Mxfp4Source views, so no host-side reshuffle is needed):
// - gpt-oss w13: blocks [E, 2I, H/32, 16] and scales [E, 2I, H/32], gate = rows 2j, up = rows
//   2j + 1 (openai's reference splits the FC1 output as x[..., ::2] / x[..., 1::2]): gate view
//   = base, up view = base + H/2 bytes, both with row stride H bytes (scales: H/16).
// - DeepSeek: w1 (gate) and w3 (up) as two views, w2 as one; per-expert tensors are repacked
//   one call per expert with expert_offset.
// - FC2 (w2 [E, H, I/32, 16]): one plain view.
// Biases need no repack: FC1 reads gpt-oss's [E, 2I] bias as stored ((gate, up) pairs).
//
// One thread per (expert, atom, lane): it gathers the 16 source bytes of its fragment (two rows,
// four k16 steps), writes its 16 output bytes with one store, and lanes 4g write the four scale
// bytes of rows g and g + 8. Repack runs once per model load; it is simple rather than fast.
#pragma once

#include <moejit/kern/moe/layout.cuh>
#include <moejit/kern/moe/params.cuh>

namespace moejit::kern::moe {

template <bool kGateUp_, int kThreads_>
struct RepackTraits {
  static constexpr bool kGateUp = kGateUp_;   // FC1 (gate + up sources fused per atom) vs plain
  static constexpr int kThreads = kThreads_;  // threads per CTA (one per lane of an atom)
  static_assert(kThreads % 32 == 0 && kThreads >= 32 && kThreads <= 1024,
                "kThreads must be a multiple of 32 in [32, 1024]");
};

// Grid: ceil(num_experts * m_atoms * k_atoms * 32 / kThreads) CTAs of kThreads.
template <class Traits>
__global__ void __launch_bounds__(Traits::kThreads) repack_mxfp4(const RepackParams p) {
  using namespace layout;
  const i64 gid = static_cast<i64>(blockIdx.x) * Traits::kThreads + threadIdx.x;
  const i64 atoms_per_expert = static_cast<i64>(p.m_atoms) * p.k_atoms;
  if (gid >= static_cast<i64>(p.num_experts) * atoms_per_expert * 32) return;
  const i32 lane = static_cast<i32>(gid & 31);
  const i64 atom = gid >> 5;
  const i32 expert = static_cast<i32>(atom / atoms_per_expert);
  const i32 m_atom = static_cast<i32>((atom % atoms_per_expert) / p.k_atoms);
  const i32 k_atom = static_cast<i32>(atom % p.k_atoms);
  const i32 groups = p.k / kGroupK;

  u32 words[4] = {0u, 0u, 0u, 0u};
  u32 scale_word = 0u;
  i32 bad = 0;
#pragma unroll
  for (i32 pair_row = 0; pair_row < 2; ++pair_row) {
    const i32 row_in_atom = atom_row(lane, pair_row);
    const RowSource rs = row_source(Traits::kGateUp, m_atom, row_in_atom);
    const Mxfp4Source& src = p.src[rs.matrix];
    const bool row_ok = rs.row < p.rows;
    const u8* q = src.blocks + expert * src.blocks_expert_stride + rs.row * src.blocks_row_stride;
#pragma unroll
    for (i32 step = 0; step < 4; ++step) {
#pragma unroll
      for (i32 khalf = 0; khalf < 2; ++khalf) {
        const i32 pair = pair_row + 2 * khalf;
        const i32 k = k_atom * kAtomK + atom_k(lane, step, pair, 0);  // even: both nibbles
        const u32 byte = (row_ok && k < p.k) ? q[k >> 1] : 0u;
        words[step] = deposit_nibble(words[step], pair, 0, byte & 15u);
        words[step] = deposit_nibble(words[step], pair, 1, byte >> 4);
      }
    }
    if ((lane & 3) == 0) {
      const u8* s = src.scales + expert * src.scales_expert_stride + rs.row * src.scales_row_stride;
#pragma unroll
      for (i32 g = 0; g < 2; ++g) {
        const i32 group = k_atom * (kAtomK / kGroupK) + g;
        const bool ok = row_ok && group < groups;
        const u32 v = ok ? s[group] : kPadScale;
        bad += (ok && (v < static_cast<u32>(kScaleMin) || v > static_cast<u32>(kScaleMax))) ? 1 : 0;
        scale_word |= v << (8 * (scale_byte(row_in_atom, g * kGroupK) & 3));
      }
    }
  }
  const i64 out_atom =
      atom_index(Dims{p.m_atoms, p.k_atoms}, expert + p.expert_offset, m_atom, k_atom);
  u32* dst = reinterpret_cast<u32*>(p.weights + out_atom * kAtomBytes + lane * 16);
  *reinterpret_cast<uint4*>(dst) = make_uint4(words[0], words[1], words[2], words[3]);
  if ((lane & 3) == 0) {
    *reinterpret_cast<u32*>(p.scales + out_atom * kAtomScaleBytes + (lane >> 2) * 4) = scale_word;
  }
  if (p.bad_scales != nullptr && bad != 0) atomicAdd(p.bad_scales, bad);
}

}  // namespace moejit::kern::moe
