// libmoejit kernels/moe: decode_moe (family 4) shape traits, rules, workspace layout and kernel
// arguments. Host-usable (the planner checks the same rules and sizes the same workspace the
// kernel's static_asserts and carving use): no device code here.
//
// Vocabulary (see decode_moe.cuh for the kernel):
// - position: one (token, slot) pair, p = token * top_k + slot, p < tokens * top_k.
// - virtual expert: one block of up to BlockN positions routed to the same local expert, in
//   (token, slot) order; an expert with c positions has ceil(c / BlockN) of them. Their number is
//   at most min(P, E + P / BlockN) for P positions, the bound the workspace is sized by.
// - strip: 16 weight rows of one expert (layout.cuh atoms); FC1 strips hold 8 gate/up pairs.
// - item: the unit of work claimed from the queue: FC1 (virtual expert, kFc1Strips strips, all
//   of K = hidden) or FC2 (virtual expert, kFc2Strips strips, all of K = inter).
// - chunk: one pipeline stage of an item, strips x chunk_k 64-wide K atoms, landed by one tensor
//   copy per group of up to 4 atoms (a box row holds at most 2 KB), in slot order
//   [group][strip][atom] (slot_atom).
#pragma once

#include <moejit/kern/moe/layout.cuh>
#include <moejit/kern/moe/types.cuh>

namespace moejit::kern::moe::decode {

inline constexpr i32 kMaxTokens = 256;                     // decode_moe serves T <= 256
inline constexpr i32 kConsumerWarps = 8;                   // warps that dequantize and multiply
inline constexpr i32 kPublisherWarp = kConsumerWarps;      // retires items (fences, counters)
inline constexpr i32 kProducerWarp = kConsumerWarps + 1;   // streams the ring (the last warp)
inline constexpr i32 kThreads = 32 * (kConsumerWarps + 2);
inline constexpr i32 kConsumerThreads = 32 * kConsumerWarps;
inline constexpr i32 kFc1ChunkKMin = 4;        // FC1 chunk: 4 to 16 K atoms (fc1_chunk_k)
inline constexpr i32 kFc2ChunkKMax = 4;        // FC2 chunk: 4, 3 or 2 K atoms (fc2_chunk_k)
inline constexpr i32 kSlotAtoms = 32;          // weight atoms per ring slot: 16 KB
inline constexpr i32 kCopyAtoms = 4;           // atoms per box row of one tensor copy (2 KB)
inline constexpr i32 kMaxExperts = 4096;       // 12 bits in a virtual expert's packed info
inline constexpr i32 kMaxTopK = 64;            // positions < 2^14
inline constexpr i32 kSmemLimit = 227 * 1024;  // sm_90 opt-in limit per CTA
// decode_moe_combine: a thread per token and kCombineColumns output columns (16 bytes of each
// bf16 FC2 row), kCombineThreads a CTA; the grid covers T x H / kCombineColumns threads.
inline constexpr i32 kCombineThreads = 256;
inline constexpr i32 kCombineColumns = 8;

// Why every rule: the kernel has no tail code anywhere. Each rule is static_assert-ed by
// DecodeTraits and checked by the planner (decode_rule), which routes a shape that breaks one to
// marlin_moe with the rule's text.
enum class Rule : i32 {
  kOk = 0,
  kExperts,       // 1 <= E <= kMaxExperts (12-bit expert field)
  kTopK,          // 1 <= K <= kMaxTopK (positions fit 14 bits)
  kHidden,        // H % 256 == 0: FC1 chunks are whole 256-wide K runs; FC2 strips whole
  kInter,         // I % 128 == 0: FC2 chunks are whole 128-, 192- or 256-wide K runs; FC1 whole
  kBlockN,        // BlockN in {8, 16, 32}: n8 MMA tiles, packed count field
  kFc1Strips,     // kFc1Strips in {2, 4, 8} and divides I / 8
  kFc2Strips,     // kFc2Strips in {4, 8} and divides H / 16
  kStages,        // 2 <= stages <= 8
  kSharedMemory,  // the CTA's shared memory fits sm_90's 227 KB
};

// Every size of one decode_moe instance, derived from the shape traits (E, K, H, I, BlockN) and
// the tile choice (strips per item, stages). constexpr, so DecodeTraits static_asserts on the
// very functions the planner calls.
struct Geometry {
  i32 experts;     // E local experts
  i32 top_k;       // K
  i32 hidden;      // H
  i32 inter;       // I
  i32 block_n;     // BlockN positions per virtual expert (the MMA's N, 1, 2 or 4 n8 tiles)
  i32 fc1_strips;  // strips per FC1 item
  i32 fc2_strips;  // strips per FC2 item
  i32 stages;      // pipeline depth (chunks in flight per CTA)

  // ---- routing ----
  MOEJIT_HD constexpr i32 positions() const { return kMaxTokens * top_k; }
  MOEJIT_HD constexpr i32 max_virtual() const {
    return positions() < experts + positions() / block_n ? positions()
                                                         : experts + positions() / block_n;
  }
  MOEJIT_HD constexpr i32 n_tiles() const { return block_n / 8; }

  // ---- FC1: W13 [2I x H], strips of 8 gate/up pairs; K = H ----
  MOEJIT_HD constexpr i32 fc1_k_atoms() const { return hidden / layout::kAtomK; }
  MOEJIT_HD constexpr i32 fc1_m_atoms() const { return inter / layout::kGateUpRows; }
  MOEJIT_HD constexpr i32 fc1_items() const { return fc1_m_atoms() / fc1_strips; }  // per v
  // Why FC1 chunks wider than 4 atoms with block_n 8 (the small-T tiles): with few strips per
  // item a chunk of 4 atoms left most of a 16 KB slot empty, and each CTA kept ~12 KB in flight
  // on its one item (ncu, v8 deepseek T = 1: consumers waited on the ring in 35% of samples).
  // With block_n 8 the chunk is the widest of 16, 8 atoms that fills at most a slot and divides
  // H / 64 (its activation rows, 8 x 16 atoms, take 16 KB of the slot: two CTAs per SM still
  // fit). block_n 16 and 32 keep 4 atoms.
  MOEJIT_HD constexpr i32 fc1_chunk_k() const {
    if (block_n == 8) {
      for (i32 c = 16; c > kFc1ChunkKMin; c /= 2) {
        if (fc1_strips * c <= kSlotAtoms && fc1_k_atoms() % c == 0) return c;
      }
    }
    return kFc1ChunkKMin;
  }
  MOEJIT_HD constexpr i32 fc1_chunks() const { return fc1_k_atoms() / fc1_chunk_k(); }  // per item
  MOEJIT_HD constexpr i32 fc1_warps_k() const { return kConsumerWarps / fc1_strips; }
  // ---- FC2: W2 [H x I]; K = I ----
  MOEJIT_HD constexpr i32 fc2_k_atoms() const { return inter / layout::kAtomK; }
  MOEJIT_HD constexpr i32 fc2_m_atoms() const { return hidden / layout::kAtomRows; }
  MOEJIT_HD constexpr i32 fc2_items() const { return fc2_m_atoms() / fc2_strips; }  // per v
  // Why 4 atoms where they divide I: a 16 KB chunk of 8 strips halves the producer's work per
  // byte. I = 384 (kimi-k3.1, 6 atoms) takes 3 with 8 strips, a 12 KB chunk where 2 atoms left
  // half of each slot empty (the bytes a slot holds in flight set FC2's pace: 8 KB chunks of 4
  // strips were 12-53% slower, tools/PERF_LOG.md); 3 atoms do not split over 2 warps, so 4
  // strips keep 2.
  MOEJIT_HD constexpr i32 fc2_chunk_k() const {
    if (fc2_k_atoms() % 4 == 0) return 4;
    if (fc2_k_atoms() % 3 == 0 && fc2_warps_k() == 1) return 3;
    return 2;
  }
  MOEJIT_HD constexpr i32 fc2_chunks() const { return fc2_k_atoms() / fc2_chunk_k(); }
  MOEJIT_HD constexpr i32 fc2_warps_k() const { return kConsumerWarps / fc2_strips; }

  // ---- shared memory (bytes; every region 16-byte aligned) ----
  MOEJIT_HD constexpr i32 chunk_atoms() const {
    return fc1_strips * fc1_chunk_k() > fc2_strips * fc2_chunk_k() ? fc1_strips * fc1_chunk_k()
                                                                   : fc2_strips * fc2_chunk_k();
  }
  // Why +16: consecutive activation rows then start 16 bytes apart modulo 128, so ldmatrix is
  // free of bank conflicts without a swizzle.
  MOEJIT_HD constexpr i32 act_row_bytes() const {
    return (fc1_chunk_k() > kFc2ChunkKMax ? fc1_chunk_k() : kFc2ChunkKMax) * layout::kAtomK * 2 +
           16;
  }
  MOEJIT_HD constexpr i32 slot_weight_bytes() const { return chunk_atoms() * layout::kAtomBytes; }
  MOEJIT_HD constexpr i32 slot_scale_bytes() const {
    return chunk_atoms() * layout::kAtomScaleBytes;
  }
  MOEJIT_HD constexpr i32 slot_act_bytes() const { return block_n * act_row_bytes(); }
  MOEJIT_HD constexpr i32 slot_bytes() const {
    return slot_weight_bytes() + slot_scale_bytes() + slot_act_bytes();
  }
  MOEJIT_HD constexpr i32 ring_bytes() const { return stages * slot_bytes(); }
  // Partial sums of the warps that split an item's K, summed in a fixed order; two buffers
  // (by item parity) so one barrier per item suffices.
  // None when no item splits K over warps (8 strips per item).
  MOEJIT_HD constexpr i32 reduce_bytes() const {
    return fc1_warps_k() > 1 || fc2_warps_k() > 1 ? 2 * kConsumerWarps * n_tiles() * 4 * 32 * 4 : 0;
  }
  MOEJIT_HD constexpr i32 sorted_bytes() const { return align16(positions() * 2); }
  MOEJIT_HD constexpr i32 vinfo_bytes() const { return align16(max_virtual() * 4); }
  // mbarriers and chunk headers per stage; scan sums, the producer's in-flight item list,
  // pending combines and the per-item "done" barriers.
  MOEJIT_HD static constexpr i32 misc_bytes() { return 768; }  // control words, item barriers
  MOEJIT_HD constexpr i32 control_bytes() const { return misc_bytes() + stages * 32; }
  // Routing scratch, aliased with the ring (the ring is not used before routing ends): per-warp
  // expert counts u16 [8][E], packed per-expert sums u32 [E], the local expert of every position
  // u16 [positions] (past 8 x 32 positions, topk_ids are read into it once), and every position's
  // rank among its warp's positions on the same expert u16 [positions].
  MOEJIT_HD constexpr i32 route_counts_bytes() const {
    return align16(kConsumerWarps * experts * 2);
  }
  MOEJIT_HD constexpr i32 route_sums_bytes() const { return align16(experts * 4); }
  MOEJIT_HD constexpr i32 route_local_bytes() const { return align16(positions() * 2); }
  MOEJIT_HD constexpr i32 route_scratch_bytes() const {
    return route_counts_bytes() + route_sums_bytes() + 2 * route_local_bytes();
  }
  MOEJIT_HD constexpr i32 smem_bytes() const {
    return ring_bytes() + reduce_bytes() + sorted_bytes() + vinfo_bytes() + control_bytes();
  }
  // CTAs per SM the shared memory allows (sm_90: 228 KB per SM, 1 KB reserved per CTA), at most
  // three (the registers of 320 threads): the persistent grid is this many CTAs per SM.
  MOEJIT_HD constexpr i32 blocks_per_sm() const {
    return 3 * (smem_bytes() + 1024) <= 228 * 1024   ? 3
           : 2 * (smem_bytes() + 1024) <= 228 * 1024 ? 2
                                                     : 1;
  }

  // ---- global workspace (bytes; every region 256-byte aligned) ----
  // counters (zeroed by the reset kernel before every forward): [0] the work queue,
  // [1 .. max_virtual] FC1 items done per virtual expert.
  MOEJIT_HD constexpr i32 counter_words() const { return 1 + max_virtual(); }
  MOEJIT_HD constexpr i64 ws_counters() const { return 0; }
  MOEJIT_HD constexpr i64 ws_inter() const { return align256(4LL * counter_words()); }
  // FC1 output, bf16 [max_virtual][BlockN][I]
  MOEJIT_HD constexpr i64 inter_bytes() const {
    return static_cast<i64>(max_virtual()) * block_n * inter * 2;
  }
  MOEJIT_HD constexpr i64 ws_out2() const { return ws_inter() + align256(inter_bytes()); }
  // FC2 rows, bf16 [positions][H], top-k weight applied; the combine launch sums them per token
  // in slot order.
  MOEJIT_HD constexpr i64 out2_bytes() const { return static_cast<i64>(positions()) * hidden * 2; }
  MOEJIT_HD constexpr i64 workspace_bytes() const { return ws_out2() + align256(out2_bytes()); }

  MOEJIT_HD constexpr Rule rule() const {
    if (experts < 1 || experts > kMaxExperts) return Rule::kExperts;
    if (top_k < 1 || top_k > kMaxTopK) return Rule::kTopK;
    if (hidden < kFc1ChunkKMin * layout::kAtomK || hidden % (kFc1ChunkKMin * layout::kAtomK) != 0) {
      return Rule::kHidden;
    }
    if (inter < 128 || inter % 128 != 0) return Rule::kInter;
    if (block_n != 8 && block_n != 16 && block_n != 32) return Rule::kBlockN;
    if ((fc1_strips != 2 && fc1_strips != 4 && fc1_strips != 8) ||
        fc1_m_atoms() % fc1_strips != 0) {
      return Rule::kFc1Strips;
    }
    if ((fc2_strips != 4 && fc2_strips != 8) || fc2_m_atoms() % fc2_strips != 0) {
      return Rule::kFc2Strips;
    }
    if (stages < 2 || stages > 8) return Rule::kStages;
    if (smem_bytes() > kSmemLimit || route_scratch_bytes() > ring_bytes()) {
      return Rule::kSharedMemory;
    }
    return Rule::kOk;
  }

  MOEJIT_HD static constexpr i32 align16(i32 x) { return (x + 15) / 16 * 16; }
  MOEJIT_HD static constexpr i64 align256(i64 x) { return (x + 255) / 256 * 256; }
};

// ---- weight streams as 2D tensors for the bulk tensor copy (TMA) ----
// Why tensor copies: one copy moves every strip of a chunk (up to 4 atoms of K each) and one its
// scales, where a plain bulk copy moves one strip run; the producer warp was the kernel's limit
// (ncu, v4: 250 instructions per 8 KB chunk, 180 of them bookkeeping and per-strip copies).
// The layout's atoms are [expert][m_atom][k_atom], so a matrix is 2D: rows = expert * m_atoms +
// strip, each row k_atoms atoms long, elements of 8 bytes (the box's inner extent is at most 256
// elements: 4 atoms, so a wider FC1 chunk takes one copy per 4 atoms: slot_atom).
struct TensorMapShape {
  i64 inner;      // elements (8 bytes) per row
  i64 rows;       // E * m_atoms
  i64 row_bytes;  // stride between rows
  i32 box_inner;  // elements per row in one copy
  i32 box_rows;   // strips in one copy
  MOEJIT_HD constexpr i32 box_bytes() const { return box_inner * box_rows * 8; }
};
inline constexpr i32 kMapElementBytes = 8;
// Atoms per box row (copy group) of a chunk chunk_k atoms wide.
MOEJIT_HD constexpr i32 copy_group_atoms(i32 chunk_k) {
  return chunk_k < kCopyAtoms ? chunk_k : kCopyAtoms;
}
// Where atom j (0 .. chunk_k - 1) of strip `strip` of a chunk lands in its slot, in atoms: the
// chunk's copies land one after the other, each [strips][group atoms].
MOEJIT_HD constexpr i32 slot_atom(i32 strips, i32 chunk_k, i32 strip, i32 j) {
  const i32 gw = copy_group_atoms(chunk_k);
  return (j / gw) * strips * gw + strip * gw + j % gw;
}
MOEJIT_HD constexpr TensorMapShape weight_map_shape(layout::Dims d, i32 experts, i32 chunk_k,
                                                    i32 strips, bool scales) {
  const i32 atom = scales ? layout::kAtomScaleBytes : layout::kAtomBytes;
  return TensorMapShape{static_cast<i64>(d.k_atoms) * atom / kMapElementBytes,
                        static_cast<i64>(experts) * d.m_atoms, static_cast<i64>(d.k_atoms) * atom,
                        copy_group_atoms(chunk_k) * atom / kMapElementBytes, strips};
}
MOEJIT_HD constexpr TensorMapShape fc1_map_shape(const Geometry& g, bool scales) {
  return weight_map_shape(layout::Dims{g.fc1_m_atoms(), g.fc1_k_atoms()}, g.experts,
                          g.fc1_chunk_k(), g.fc1_strips, scales);
}
MOEJIT_HD constexpr TensorMapShape fc2_map_shape(const Geometry& g, bool scales) {
  return weight_map_shape(layout::Dims{g.fc2_m_atoms(), g.fc2_k_atoms()}, g.experts,
                          g.fc2_chunk_k(), g.fc2_strips, scales);
}

// An encoded CUtensorMap (cuda.h's type: 128 bytes, 128-byte aligned), opaque to the kernel.
struct alignas(128) TensorMap {
  u64 words[16];
};

// A virtual expert's packed description: local expert (12 bits), positions (6 bits), first index
// into the expert-sorted position list (14 bits).
static_assert(kMaxTokens * kMaxTopK <= (1 << 14) && kMaxExperts <= (1 << 12),
              "a virtual expert's first index must fit 14 bits and its expert 12");
MOEJIT_HD constexpr u32 pack_virtual(i32 expert, i32 count, i32 first) {
  return static_cast<u32>(expert) | (static_cast<u32>(count) << 12) |
         (static_cast<u32>(first) << 18);
}
MOEJIT_HD constexpr i32 virtual_expert(u32 info) { return static_cast<i32>(info & 0xFFFu); }
MOEJIT_HD constexpr i32 virtual_count(u32 info) { return static_cast<i32>((info >> 12) & 0x3Fu); }
MOEJIT_HD constexpr i32 virtual_first(u32 info) { return static_cast<i32>(info >> 18); }

// Kernel arguments (both kernels of the family take this struct by value).
struct DecodeMoeParams {
  // The kernel layout (layout.cuh, the marlin_moe repack) as 2D tensors: fc1_map_shape /
  // fc2_map_shape, 8-byte elements, no swizzle, no interleave.
  TensorMap w13;
  TensorMap w13_scales;
  TensorMap w2;
  TensorMap w2_scales;
  const u16* hidden;          // bf16 [T][H], rows 16-byte aligned
  const void* topk_ids;       // [T][K] int32, or int64 with kIds64
  const float* topk_weights;  // [T][K]
  u16* out;                   // bf16 [T][H]
  u8* workspace;              // Geometry::workspace_bytes(), 256-byte aligned
  i32 num_tokens;             // T, 1 .. kMaxTokens
  i32 expert_offset;          // global id of local expert 0
};

}  // namespace moejit::kern::moe::decode
