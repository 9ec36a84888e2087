// libmoejit kernels/moe: marlin_moe (family 3) grouped GEMM, MXFP4 weights x bf16 activations,
// fp32 accumulate, with FC1's activation or FC2's bias / top-k weight fused into the epilogue.
//
// Structure (one template, used twice per MoE layer):
// - Grid (x, y, z) = (M tiles of kBlockM weight rows, route blocks of kBlockN padded rows in y
//   and z: block = z * kGridBlocksY + y; cta_tile). A CTA whose block_expert is -1 (past the
//   blocks route used) exits at once, so the grid is sized for the worst case (route_max_blocks)
//   and the launch needs no host sync (CUDA-graph capturable). At small T every SM streams: M is
//   split into many tiles of every touched expert. Why M tiles fastest: CTAs start in index
//   order, so the CTAs resident at once hold every M tile of a few blocks, and each block's
//   gathered input rows are read from HBM once (with blocks fastest, every M tile's wave read
//   all of them again: gpt-oss-120b T = 4096 FC2 read 2.72 GB against 0.66 GB, 752 against 588
//   us; tools/PERF_LOG.md "the prefill rows, m27 against m28"); and the CTAs of unused blocks
//   (about a quarter of the grid at T = 24-256) come after the last real one.
//   Why blocks over y and z: grid.y and grid.z allow 65535 each, and blocks can pass that at
//   large T * K (z is 1 below it).
// - Pipeline: kStages-deep cp.async ring; a stage holds BlockM x BlockK weights (kernel layout,
//   copied verbatim: BlockM/16 contiguous runs of BlockK/64 atoms, evict-first L2 policy), their
//   scales, and BlockN gathered input rows (zero-filled for padding rows and past K, so a last
//   partial K tile needs no special code and K only needs to be a multiple of 32).
// - Warps: kWarpsM x kWarpsN x kWarpsK. Each warp owns kWarpAtomsM atoms along M and
//   kWarpTilesN n8 tiles along N, and every kWarpsK-th atom column of each stage. Per atom a
//   lane does one 16-byte shared load (four k16 steps of A), one 32-bit scale load, and per k16
//   step one dequant (mxfp4.cuh) feeding kWarpTilesN mma.sync.m16n8k16; B comes by ldmatrix.x4.
// - Epilogue: the kWarpsK partial sums are added in a fixed order through shared memory, so
//   results are bitwise deterministic (no atomics). FC1 applies the activation to (gate, up) held
//   by the same thread and writes inter bf16 [padded row][I]; FC2 writes (acc + bias) *
//   topk_weight to out2 [padded row][H]; combine sums a token's rows.
// - K splits (FC2 only, kKSplits > 1): where few experts hold a long K (llama-4-scout at T = 1:
//   one expert, H / 32 = 160 CTAs of 32 K tiles for 528 CTA slots) the M tiles alone leave most
//   SMs idle, so kKSplits CTAs share each M tile, split s summing the s-th contiguous range of
//   its K tiles. Each writes fp32 rows of its own, (acc_s + bias if s == 0) * topk_weight, as row
//   set s of out2 (padded row + s * blocks * kBlockN); combine adds a slot's sets in order s = 0,
//   1, ..., so the result stays bitwise deterministic.
// - PDL: kEarlyWeights issues the weight prologue before the wait for its inputs, so FC2 streams
//   its weights while FC1 drains. Valid only when the previous kernel triggers its dependents
//   after the route data it read was complete, which this kernel does (it triggers after its
//   wait). That wait is griddepcontrol.wait, or with a MoeGemmChain (params.cuh) FC1's count of
//   the CTA's own tile, so FC2 runs on the SMs FC1's last wave leaves (wait_for_inputs).
//
// Tile sizes, pipeline depth, warp split and the epilogue are template arguments chosen by the
// planner from T and the shape; wgmma for large T is a later, separate path of the same traits.
#pragma once

#include <moejit/kern/common/ptx.cuh>
#include <moejit/kern/moe/activation.cuh>
#include <moejit/kern/moe/layout.cuh>
#include <moejit/kern/moe/mxfp4.cuh>
#include <moejit/kern/moe/params.cuh>
#include <moejit/kern/moe/ptx.cuh>

namespace moejit::kern::moe {

// The type kB picks (no <type_traits> under NVRTC without the toolkit's C++ library).
template <bool kB, class A, class B>
struct Select {
  using Type = A;
};
template <class A, class B>
struct Select<false, A, B> {
  using Type = B;
};

// FC1: W13 x hidden[token] -> + bias -> Act(gate, up) -> inter (bf16).
template <class Act_, bool kHasBias_>
struct Fc1Epilogue {
  using Act = Act_;                            // gated activation functor (activation.cuh)
  static constexpr bool kHasBias = kHasBias_;  // add bias [E][I][2] (gate, up) first
  static constexpr bool kGatherTokens = true;  // input row = token = sorted id / top_k
  using Out = u16;                             // inter element: bf16 bits
  static constexpr bool kOutBf16 = true;
  static constexpr i32 kOutPerAtom = layout::kGateUpRows;  // outputs of a 16-row strip

  // The (gate, up) bias pair of output j as bf16x2 bits (0 without bias).
  __device__ __forceinline__ static u32 bias(const MoeGemmParams& p, i32 expert, i32 j) {
    if constexpr (kHasBias) {
      return reinterpret_cast<const u32*>(p.bias)[static_cast<i64>(expert) * p.out_features + j];
    } else {
      return 0u;
    }
  }
  // Output j from its gate and up accumulators (rows g and g + 8 of the strip).
  __device__ __forceinline__ static u16 value(float acc_gate, float acc_up, u32 bias_pair) {
    float gate = acc_gate * mxfp4::kAccumulatorScale;
    float up = acc_up * mxfp4::kAccumulatorScale;
    if constexpr (kHasBias) {
      gate += ptx::bf16_lo(bias_pair);
      up += ptx::bf16_hi(bias_pair);
    }
    return ptx::to_bf16(Act::apply(gate, up));
  }

  // Token column h (0/1) of a lane's fragment c: rows g (gate j) and g + 8 (up j). FC1 is never
  // split along K (its activation needs whole sums), so with_bias is always true here.
  __device__ __forceinline__ static void store(const MoeGemmParams& p, i32 expert, i32 m_atom,
                                               i32 g, i64 row, float /*weight*/,
                                               const float (&c)[4], i32 h, bool /*with_bias*/) {
    const i32 j = m_atom * layout::kGateUpRows + g;
    if (j >= p.out_features) return;
    static_cast<u16*>(p.output)[row * p.ld_output + j] = value(c[h], c[2 + h], bias(p, expert, j));
  }
};

// FC2: W2 x inter[row] -> (+ bias) * topk_weight -> out2 (fp32, or bf16 when kOutBf16).
template <bool kOutBf16_, bool kHasBias_>
struct Fc2Epilogue {
  static constexpr bool kOutBf16 = kOutBf16_;   // out2 element type: bf16 (true) or fp32
  static constexpr bool kHasBias = kHasBias_;   // add bias [E][H] before the top-k weight
  static constexpr bool kGatherTokens = false;  // input row = the padded row itself
  using Out = typename Select<kOutBf16, u16, float>::Type;  // out2 element
  static constexpr i32 kOutPerAtom = layout::kAtomRows;     // outputs of a 16-row strip

  // The bias of output col (0 without bias).
  __device__ __forceinline__ static float bias(const MoeGemmParams& p, i32 expert, i32 col) {
    if constexpr (kHasBias) {
      return __uint_as_float(
          static_cast<u32>(p.bias[static_cast<i64>(expert) * p.out_features + col]) << 16);
    } else {
      return 0.0f;
    }
  }
  __device__ __forceinline__ static Out value(float acc, float bias_v, float weight) {
    float v = acc * mxfp4::kAccumulatorScale;
    if constexpr (kHasBias) v += bias_v;  // 0 for K splits past the first
    v *= weight;
    if constexpr (kOutBf16) {
      return ptx::to_bf16(v);
    } else {
      return v;
    }
  }

  // weight: the row's top-k weight (the kernel copied it to shared memory in its prologue).
  // with_bias: false for the K splits past the first (the bias is added once per row).
  __device__ __forceinline__ static void store(const MoeGemmParams& p, i32 expert, i32 m_atom,
                                               i32 g, i64 row, float weight, const float (&c)[4],
                                               i32 h, bool with_bias) {
#pragma unroll
    for (i32 r = 0; r < 2; ++r) {
      const i32 col = m_atom * layout::kAtomRows + g + 8 * r;
      if (col >= p.out_features) continue;
      static_cast<Out*>(p.output)[row * p.ld_output + col] =
          value(c[2 * r + h], with_bias ? bias(p, expert, col) : 0.0f, weight);
    }
  }
};

template <int kBlockM_, int kBlockN_, int kBlockK_, int kStages_, int kWarpsM_, int kWarpsN_,
          int kWarpsK_, int kMinBlocksPerSm_, bool kEarlyWeights_, class Epilogue_,
          int kKSplits_ = 1>
struct MoeGemmTraits {
  static constexpr int kBlockM = kBlockM_;  // weight rows per CTA (FC1: 8 gate/up pairs per 16)
  static constexpr int kBlockN = kBlockN_;  // padded token rows per CTA = route block size
  static constexpr int kBlockK = kBlockK_;  // K elements per pipeline stage
  static constexpr int kStages = kStages_;  // cp.async pipeline depth
  static constexpr int kWarpsM = kWarpsM_;  // warps splitting the CTA's rows
  static constexpr int kWarpsN = kWarpsN_;  // warps splitting the CTA's token rows
  static constexpr int kWarpsK = kWarpsK_;  // warps splitting each stage's K (fixed-order sum)
  static constexpr int kMinBlocksPerSm = kMinBlocksPerSm_;  // occupancy target (register cap)
  static constexpr bool kEarlyWeights = kEarlyWeights_;     // weight prologue before input wait
  using Epilogue = Epilogue_;  // Fc1Epilogue<Act, bias> or Fc2Epilogue<bf16 out, bias>
  // CTAs per M tile along K (FC2 only): CTA x = split * m_tiles + m_tile sums the split-th range
  // of K tiles into row set `split` of out2 (rows + split * blocks * kBlockN); combine adds the
  // sets in order. See the file comment.
  static constexpr int kKSplits = kKSplits_;

  static constexpr int kWarps = kWarpsM * kWarpsN * kWarpsK;
  static constexpr int kThreads = 32 * kWarps;
  static constexpr int kAtomsM = kBlockM / layout::kAtomRows;
  static constexpr int kAtomsK = kBlockK / layout::kAtomK;
  static constexpr int kWarpAtomsM = kAtomsM / kWarpsM;
  static constexpr int kWarpTilesN = kBlockN / 8 / kWarpsN;
  static constexpr int kStageWeightBytes = kAtomsM * kAtomsK * layout::kAtomBytes;
  static constexpr int kStageScaleBytes = kAtomsM * kAtomsK * layout::kAtomScaleBytes;
  // Why +16: consecutive rows then start 16 bytes apart modulo 128, so ldmatrix is
  // conflict-free without a swizzle.
  static constexpr int kInputRowBytes = kBlockK * 2 + 16;
  static constexpr int kStageInputBytes = kBlockN * kInputRowBytes;
  static constexpr int kStageBytes = kStageWeightBytes + kStageScaleBytes + kStageInputBytes;
  static constexpr int kAccRegs = kWarpAtomsM * kWarpTilesN * 4;
  static constexpr int kReduceBytes = (kWarpsK - 1) * kWarpsM * kWarpsN * kAccRegs * 32 * 4;
  static constexpr int kPipeBytes =
      kStages * kStageBytes > kReduceBytes ? kStages* kStageBytes : kReduceBytes;
  // + ids, input rows and (FC2) top-k weights of the block's rows
  static constexpr int kSmemBytes = kPipeBytes + 3 * kBlockN * 4;
  static constexpr int kChunksWeights = kStageWeightBytes / 16;
  static constexpr int kChunksScales = kStageScaleBytes / 16;
  static constexpr int kChunksInput = kBlockN * kBlockK / 8;

  static_assert(kBlockM % (layout::kAtomRows * kWarpsM) == 0,
                "kBlockM must be a multiple of 16 * kWarpsM: each warp owns whole 16-row atoms");
  static_assert(kBlockN % (8 * kWarpsN) == 0,
                "kBlockN must be a multiple of 8 * kWarpsN: each warp owns whole n8 MMA tiles");
  static_assert(kBlockK % (layout::kAtomK * kWarpsK) == 0,
                "kBlockK must be a multiple of 64 * kWarpsK: each warp owns whole 64-wide atoms");
  static_assert(kStages >= 2, "kStages must be >= 2 (one stage loads while one computes)");
  static_assert(kThreads <= 1024, "at most 1024 threads: lower kWarpsM * kWarpsN * kWarpsK");
  static_assert(kSmemBytes <= 227 * 1024,
                "shared memory over the sm_90 limit (227 KB): lower kStages, kBlockK or kBlockN");
  static_assert(kMinBlocksPerSm >= 1, "kMinBlocksPerSm must be >= 1");
  static_assert(kKSplits >= 1 && kKSplits <= kMaxKSplits, "kKSplits must be in 1..kMaxKSplits");
  static_assert(kKSplits == 1 || (!Epilogue::kGatherTokens && !Epilogue::kOutBf16),
                "K splits are for FC2 with fp32 rows only: FC1's activation needs whole sums, "
                "and partial sums rounded to bf16 would each lose 8 bits");
};

// A compile-time bool passed to generic lambdas.
template <bool kB>
struct Flag {
  static constexpr bool kValue = kB;
};

// A CTA's kN route rows (row0 .. row0 + kN - 1, those from row0 + limit on treated as padding),
// loaded into registers first and stored to shared memory after the weight prologue: a store
// waits for its load, and the weight copies, which need only the expert, should not wait a round
// trip for them. s_ids[n] is the sorted id (token * top_k + slot, or -1), s_rows[n] the input row
// (the token when kGatherTokens, else the padded row itself; -1 for padding).
template <i32 kN, i32 kThreads>
struct BlockRows {
  static constexpr i32 kLoads = ceil_div(kN, kThreads);
  i32 ids[kLoads];

  __device__ __forceinline__ void load(const MoeGemmParams& p, i32 tid, i32 row0, i32 limit) {
#pragma unroll
    for (i32 j = 0; j < kLoads; ++j) {
      const i32 n = tid + j * kThreads;
      ids[j] = n < kN && n < limit ? p.sorted_rows[row0 + n] : -1;
    }
  }
  // FC2: each row's top-k weight (0 for padding) into s_weights by cp.async, so the epilogue
  // does not wait a round trip for it; it lands with the copies committed next.
  __device__ __forceinline__ void copy_weights(const MoeGemmParams& p, i32 tid,
                                               u32 s_weights) const {
#pragma unroll
    for (i32 j = 0; j < kLoads; ++j) {
      const i32 n = tid + j * kThreads;
      if (n < kN) copy_topk_weight(p, ids[j], s_weights + static_cast<u32>(n) * 4u);
    }
  }
  template <bool kGatherTokens>
  __device__ __forceinline__ void store(const MoeGemmParams& p, i32 tid, i32 row0, i32* s_ids,
                                        i32* s_rows) const {
#pragma unroll
    for (i32 j = 0; j < kLoads; ++j) {
      const i32 n = tid + j * kThreads;
      if (n < kN) {
        const i32 id = ids[j];
        s_ids[n] = id;
        s_rows[n] = id < 0 ? -1 : (kGatherTokens ? id / p.top_k : row0 + n);
      }
    }
  }
};

// FC2: copies the top-k weight of sorted id `id` (0 where id < 0: a padding row) to `dst` by
// cp.async, so the epilogue does not wait a round trip for it. Used by both GEMM tiles.
__device__ __forceinline__ void copy_topk_weight(const MoeGemmParams& p, i32 id, u32 dst) {
  ptx::cp_async_4(dst, id >= 0 ? p.topk_weights + id : p.topk_weights, id >= 0 ? 4u : 0u);
}

// The route block and the M tile of this CTA (see the file comment), read from %ctaid each call
// (ptx::block_index_reread): values derived from them are not kept through a main loop. The
// host splits the blocks as y < kGridBlocksY (params.cuh), z = the rest (moe_forward.cpp).
struct CtaTile {
  i32 block;
  i32 m_tile;
};
__device__ __forceinline__ CtaTile cta_tile() {
  return {::moejit::kern::ptx::block_index_z_reread() * kGridBlocksY +
              ::moejit::kern::ptx::block_index_y_reread(),
          ::moejit::kern::ptx::block_index_reread()};
}

// FC1's first weights asked of L2 while the route runs. Why: under PDL FC1's CTAs are resident
// before the route finishes, but which expert a CTA serves comes from the route, so HBM idles
// for the route's few us. Where nearly every expert is touched, CTA (b, m) for b <
// prefetch_experts asks for expert b's M tile m (its first K atoms): the first wave holds every
// M tile of the first blocks (M tiles run fastest), and those blocks belong to the first experts,
// so the first wave's CTAs find their prologue in L2 (the host sizes it: fc1_prefetch). Thread j
// asks for strip j (one bulk prefetch of its weights, one of its scales). A hint only: it reads
// weights, which no earlier kernel of the layer writes, and changes no result.
template <i32 kAtomsM>
__device__ __forceinline__ void prefetch_first_weights(const MoeGemmParams& p) {
  // Why the indices read again: values derived here must not be kept for the main loop (they
  // made the 128-register warpgroup tiles spill).
  const i32 tid = ::moejit::kern::ptx::thread_index_reread();
  const CtaTile cta = cta_tile();
  const i32 expert = cta.block;
  const i32 m_tile = cta.m_tile;
  const i32 m_atom = m_tile * kAtomsM + tid;
  if (expert >= p.prefetch_experts || m_tile >= p.prefetch_m_tiles || tid >= kAtomsM ||
      m_atom >= p.m_atoms) {
    return;
  }
  const i64 atom = layout::atom_index(layout::Dims{p.m_atoms, p.k_atoms}, expert, m_atom, 0);
  ptx::prefetch_l2(p.weights + atom * layout::kAtomBytes,
                   static_cast<u32>(p.prefetch_k_atoms) * layout::kAtomBytes);
  ptx::prefetch_l2(p.scales + atom * layout::kAtomScaleBytes,
                   static_cast<u32>(p.prefetch_k_atoms) * layout::kAtomScaleBytes);
}

// FC2's wait for its inputs (MoeGemmChain, params.cuh): FC1's whole grid, or FC1's M tiles of
// this CTA's tile only. One thread spins; the CTA barrier after the call orders every thread's
// input copies after its acquire. Why the last warp's lane and a call before the route rows go
// to shared memory: the acquire load stalls its warp for an L2 round trip even when the tile is
// long done, and that warp holds no route rows (kN <= kThreads - 32 in every planned tile), so
// the round trip overlaps the other warps' wait for their rows instead of following it
// (measured: with thread 0 after the rows, FC2 at kimi-k3.1-tp8 T = 4096, short K and many CTAs,
// was 5% slower; tools/PERF_LOG.md "FC2 waits for its own tile of FC1").
// Why a chained FC2 need not wait for FC1's grid as well, though the combine's wait covers FC2's
// grid alone: griddepcontrol.wait waits for all prerequisite grids in flight, and a grid that
// never waited for its own does not end that chain. Measured by tools/prof/pdl_order.cu (H100,
// 2 x 20 trials a case, with controls in which a dependent did run before its primary's store in
// 19 of 20): a grid after one that never waited still saw the first grid's last store every time,
// with PDL and in plain order. One thread of FC2's last CTA waiting at its exit measured 0.2-0.6
// us slower at kimi-k3.1-tp8, in runs that did not rule out the builds' order (tools/PERF_LOG.md
// "the guard's CTA triggers the combine before it waits").
template <i32 kThreads>
__device__ __forceinline__ void wait_for_inputs(const MoeGemmChain& chain) {
  if (chain.wait == nullptr) {
    ::moejit::kern::ptx::grid_dependency_wait();
  } else if (threadIdx.x == kThreads - 32) {
    const u32* done = chain.wait + cta_tile().block;
    if (ptx::load_acquire(done) < chain.wait_count) {
      ptx::wait_at_least(done, chain.wait_count, chain.wait_limit_ns);
    }
  }
}

// FC1's count of this CTA's tile (MoeGemmChain): call after a barrier that every thread which
// stored outputs has passed; the release makes those stores visible before the count. Why a
// release reduction, not a fence and atomicAdd: the same MEMBAR.GPU, without the L1 invalidation
// (CCTL.IVALL) that atomicAdd's acquire half adds (SASS, sm_90a).
__device__ __forceinline__ void signal_stored(const MoeGemmChain& chain) {
  if (chain.signal != nullptr && threadIdx.x == 0) {
    ptx::red_add_release(chain.signal + cta_tile().block, 1u);
  }
}

template <class Traits>
__global__ void __launch_bounds__(Traits::kThreads, Traits::kMinBlocksPerSm)
    moe_gemm(const MoeGemmParams p, const MoeGemmChain chain) {
  using T = Traits;
  using Epi = typename Traits::Epilogue;
  extern __shared__ __align__(128) u8 smem[];
  i32* s_ids = reinterpret_cast<i32*>(smem + T::kPipeBytes);
  i32* s_rows = s_ids + T::kBlockN;
  const float* s_weights = reinterpret_cast<const float*>(s_rows + T::kBlockN);

  const i32 tid = static_cast<i32>(threadIdx.x);
  const i32 lane = tid & 31;
  const i32 warp = tid >> 5;
  const i32 wm = warp % T::kWarpsM;
  const i32 wn = (warp / T::kWarpsM) % T::kWarpsN;
  const i32 wk = warp / (T::kWarpsM * T::kWarpsN);
  const CtaTile cta = cta_tile();
  const i32 block = cta.block;
  // With K splits, x = split * m_tiles + m_tile (the host's grid: m_tiles * kKSplits in x).
  const i32 m_tiles = ceil_div(p.m_atoms, T::kAtomsM);
  const i32 split = T::kKSplits == 1 ? 0 : cta.m_tile / m_tiles;
  const i32 m_atom0 = (T::kKSplits == 1 ? cta.m_tile : cta.m_tile % m_tiles) * T::kAtomsM;

  if constexpr (!T::kEarlyWeights) {
    prefetch_first_weights<T::kAtomsM>(p);
    ::moejit::kern::ptx::grid_dependency_wait();
    ::moejit::kern::ptx::launch_dependents();
  }
  if (block >= p.blocks) return;  // the y x z rectangle's last blocks
  const i32 expert = p.block_expert[block];
  if (expert < 0) return;
  const i32 row0 = block * T::kBlockN;
  BlockRows<T::kBlockN, T::kThreads> rows;
  rows.load(p, tid, row0, T::kBlockN);

  // This CTA's K tiles: kt0 .. kt0 + k_tiles - 1 (all of them without K splits). A split past
  // the last K tile (the planner avoids it) sums nothing and stores zeros.
  const i32 all_k_tiles = ceil_div(p.k_atoms, T::kAtomsK);
  const i32 split_k_tiles = ceil_div(all_k_tiles, T::kKSplits);
  const i32 kt0 = split * split_k_tiles;
  const i32 k_tiles = max(0, min(all_k_tiles - kt0, split_k_tiles));
  const layout::Dims dims{p.m_atoms, p.k_atoms};
  const u64 policy = ptx::policy_evict_first();
  const u32 smem_base = ptx::smem_u32(smem);

  // Why precomputed: each thread copies the same chunk positions every k-tile, so their global
  // addresses are a base plus kt * stride, and whether a chunk is padding (padding token rows)
  // is fixed: only the last, partial K tile needs per-copy bound checks.
  constexpr i32 kNW = ceil_div(T::kChunksWeights, T::kThreads);
  constexpr i32 kNS = ceil_div(T::kChunksScales, T::kThreads);
  constexpr i32 kNI = ceil_div(T::kChunksInput, T::kThreads);
  constexpr i32 kInputChunksPerRow = T::kBlockK / 8;
  // A strip past m_atoms (the last M tile of a GEMM whose rows are not a multiple of kBlockM)
  // copies the CTA's first strip instead: it only feeds accumulator rows the epilogue never
  // stores, the lines it reads are the ones this CTA fetches for the same stage (no DRAM
  // traffic), and the copies need no per-chunk size register (at 256 rows over four warps,
  // eight copies a thread, those registers made ptxas spill).
  const u8* w_src[kNW];
  i32 w_ka[kNW];  // k atom of the chunk inside a tile
  const u8* s_src[kNS];
  i32 s_ka[kNS];
#pragma unroll
  for (i32 i = 0; i < kNW; ++i) {
    const i32 c = tid + i * T::kThreads;
    const i32 ma = m_atom0 + c / (T::kAtomsK * 32);
    w_ka[i] = (c / 32) % T::kAtomsK;
    w_src[i] = p.weights +
               layout::atom_index(dims, expert, ma < p.m_atoms ? ma : m_atom0, w_ka[i]) *
                   layout::kAtomBytes +
               (c % 32) * 16;
  }
#pragma unroll
  for (i32 i = 0; i < kNS; ++i) {
    const i32 c = tid + i * T::kThreads;
    const i32 ma = m_atom0 + c / (T::kAtomsK * 2);
    s_ka[i] = (c / 2) % T::kAtomsK;
    s_src[i] = p.scales +
               layout::atom_index(dims, expert, ma < p.m_atoms ? ma : m_atom0, s_ka[i]) *
                   layout::kAtomScaleBytes +
               (c % 2) * 16;
  }
  // kChecked: the tile may run past k_atoms (zero-fill those atoms).
  auto load_weights = [&](i32 stage, i32 kt, auto checked) {
    constexpr bool kChecked = decltype(checked)::kValue;
    const u32 dst = smem_base + stage * T::kStageBytes;
    const i32 ka0 = kt * T::kAtomsK;
    const i64 w_step = static_cast<i64>(ka0) * layout::kAtomBytes;
    const i64 s_step = static_cast<i64>(ka0) * layout::kAtomScaleBytes;
#pragma unroll
    for (i32 i = 0; i < kNW; ++i) {
      const i32 c = tid + i * T::kThreads;
      if (T::kChunksWeights % T::kThreads == 0 || c < T::kChunksWeights) {
        if constexpr (kChecked) {
          const bool ok = w_ka[i] + ka0 < p.k_atoms;
          ptx::cp_async_16_stream(dst + c * 16, ok ? w_src[i] + w_step : p.weights, ok ? 16u : 0u,
                                  policy);
        } else {
          ptx::cp_async_16_stream(dst + c * 16, w_src[i] + w_step, 16u, policy);
        }
      }
    }
#pragma unroll
    for (i32 i = 0; i < kNS; ++i) {
      const i32 c = tid + i * T::kThreads;
      if (T::kChunksScales % T::kThreads == 0 || c < T::kChunksScales) {
        const u32 dst_s = dst + T::kStageWeightBytes + c * 16;
        if constexpr (kChecked) {
          const bool ok = s_ka[i] + ka0 < p.k_atoms;
          ptx::cp_async_16_stream(dst_s, ok ? s_src[i] + s_step : p.scales, ok ? 16u : 0u, policy);
        } else {
          ptx::cp_async_16_stream(dst_s, s_src[i] + s_step, 16u, policy);
        }
      }
    }
  };
  const u16* in_src[kNI];
  u32 in_bytes[kNI];  // 16, or 0 for padding token rows
  i32 in_k[kNI];      // K element of the chunk inside a tile
  auto setup_inputs = [&] {
#pragma unroll
    for (i32 i = 0; i < kNI; ++i) {
      const i32 c = tid + i * T::kThreads;
      const i32 row = s_rows[(c / kInputChunksPerRow) % T::kBlockN];
      in_k[i] = (c % kInputChunksPerRow) * 8;
      in_bytes[i] = row >= 0 ? 16u : 0u;
      in_src[i] = p.input + (row >= 0 ? static_cast<i64>(row) * p.ld_input : 0) + in_k[i];
    }
  };
  auto load_inputs = [&](i32 stage, i32 kt, auto checked) {
    constexpr bool kChecked = decltype(checked)::kValue;
    const u32 dst = smem_base + stage * T::kStageBytes + T::kStageWeightBytes + T::kStageScaleBytes;
    const i32 k0 = kt * T::kBlockK;
#pragma unroll
    for (i32 i = 0; i < kNI; ++i) {
      const i32 c = tid + i * T::kThreads;
      if (T::kChunksInput % T::kThreads == 0 || c < T::kChunksInput) {
        const u32 dst_c =
            dst + (c / kInputChunksPerRow) * T::kInputRowBytes + (c % kInputChunksPerRow) * 16;
        if constexpr (kChecked) {
          const bool ok = in_k[i] + k0 < p.in_features;
          ptx::cp_async_16(dst_c, ok ? in_src[i] + k0 : p.input, ok ? in_bytes[i] : 0u);
        } else {
          ptx::cp_async_16(dst_c, in_src[i] + k0, in_bytes[i]);
        }
      }
    }
  };
  // A tile is "full" when no weight atom and no input chunk of it lies past K.
  auto tile_full = [&](i32 kt) {
    return (kt + 1) * T::kAtomsK <= p.k_atoms && (kt + 1) * T::kBlockK <= p.in_features;
  };

  // Prologue: weights first (they do not depend on the previous kernel), then inputs. Stage j
  // holds the CTA's j-th K tile, kt0 + j.
#pragma unroll
  for (i32 s = 0; s < T::kStages - 1; ++s) {
    if (s < k_tiles) load_weights(s, kt0 + s, Flag<true>{});
  }
  if constexpr (T::kEarlyWeights) {
    wait_for_inputs<T::kThreads>(chain);
    ::moejit::kern::ptx::launch_dependents();
  }
  rows.template store<Epi::kGatherTokens>(p, tid, row0, s_ids, s_rows);
  if constexpr (!Epi::kGatherTokens) rows.copy_weights(p, tid, ptx::smem_u32(s_weights));
  __syncthreads();  // s_rows visible to every thread (and FC1's rows, after wait_for_inputs)
  setup_inputs();
#pragma unroll
  for (i32 s = 0; s < T::kStages - 1; ++s) {
    if (s < k_tiles) load_inputs(s, kt0 + s, Flag<true>{});
    ptx::cp_async_commit();
  }

  float acc[T::kWarpAtomsM][T::kWarpTilesN][4];
#pragma unroll
  for (i32 mi = 0; mi < T::kWarpAtomsM; ++mi)
#pragma unroll
    for (i32 ni = 0; ni < T::kWarpTilesN; ++ni)
#pragma unroll
      for (i32 r = 0; r < 4; ++r) acc[mi][ni][r] = 0.0f;

  const i32 g = lane >> 2;
  // Real rows are a prefix of the block (route pads only the end of an expert's last block), so
  // this warp's n8 tiles from the first one without a real row on are skipped: no B load, no
  // MMA (an expert with 5 rows in a 16-row block costs 1 tile of math, not 2). Why not with one
  // tile per warp: its block always has a real row, and the test alone made the n8 tile's loop
  // 4-10% slower (H200, gpt-oss-120b T = 128: 663 against 600 us).
  i32 tiles_on = T::kWarpTilesN;
  if constexpr (T::kWarpTilesN > 1) {
    tiles_on = 0;
#pragma unroll
    for (i32 ni = 0; ni < T::kWarpTilesN; ++ni) {
      tiles_on += s_ids[(wn * T::kWarpTilesN + ni) * 8] >= 0 ? 1 : 0;
    }
  }
  // Per-lane shared-memory offsets inside a stage.
  const u32 a_lane =
      static_cast<u32>((wm * T::kWarpAtomsM * T::kAtomsK) * layout::kAtomBytes + lane * 16);
  const u32 s_lane = static_cast<u32>(
      T::kStageWeightBytes + (wm * T::kWarpAtomsM * T::kAtomsK) * layout::kAtomScaleBytes + g * 4);
  const u32 b_lane = static_cast<u32>(T::kStageWeightBytes + T::kStageScaleBytes +
                                      (wn * T::kWarpTilesN * 8 + (lane & 7)) * T::kInputRowBytes +
                                      (lane >> 3) * 16);

  for (i32 kt = 0; kt < k_tiles; ++kt) {
    ptx::cp_async_wait<T::kStages - 2>();
    __syncthreads();
    const i32 next = kt + T::kStages - 1;
    if (next < k_tiles) {
      if (tile_full(kt0 + next)) {
        load_weights(next % T::kStages, kt0 + next, Flag<false>{});
        load_inputs(next % T::kStages, kt0 + next, Flag<false>{});
      } else {
        load_weights(next % T::kStages, kt0 + next, Flag<true>{});
        load_inputs(next % T::kStages, kt0 + next, Flag<true>{});
      }
    }
    ptx::cp_async_commit();

    const u32 stage = smem_base + static_cast<u32>((kt % T::kStages) * T::kStageBytes);
#pragma unroll
    for (i32 i = 0; i < T::kAtomsK / T::kWarpsK; ++i) {
      const i32 ki = i * T::kWarpsK + wk;
      u32 w[T::kWarpAtomsM][4];
      u32 sw[T::kWarpAtomsM];
#pragma unroll
      for (i32 mi = 0; mi < T::kWarpAtomsM; ++mi) {
        const u32 atom = static_cast<u32>(mi * T::kAtomsK + ki);
        ptx::lds128(stage + a_lane + atom * layout::kAtomBytes, w[mi]);
        sw[mi] = ptx::lds32(stage + s_lane + atom * layout::kAtomScaleBytes);
      }
#pragma unroll
      for (i32 kg = 0; kg < 2; ++kg) {  // the two 32-wide scale groups of the atom
        u32 b[T::kWarpTilesN][4];
#pragma unroll
        for (i32 ni = 0; ni < T::kWarpTilesN; ++ni) {
          if (T::kWarpTilesN == 1 || ni < tiles_on) {
            ptx::ldmatrix_x4(
                stage + b_lane + ni * 8 * T::kInputRowBytes + (ki * 64 + kg * 32) * 2, b[ni]);
          }
        }
#pragma unroll
        for (i32 mi = 0; mi < T::kWarpAtomsM; ++mi) {
          const u32 f = kg == 0 ? mxfp4::group_factors<0>(sw[mi]) : mxfp4::group_factors<1>(sw[mi]);
#pragma unroll
          for (i32 step = 0; step < 2; ++step) {
            u32 a[4];
            mxfp4::dequant_step(w[mi][2 * kg + step], f, a);
#pragma unroll
            for (i32 ni = 0; ni < T::kWarpTilesN; ++ni) {
              if (T::kWarpTilesN == 1 || ni < tiles_on) {
                ptx::mma_bf16_16816(acc[mi][ni], a, b[ni][2 * step], b[ni][2 * step + 1]);
              }
            }
          }
        }
      }
    }
  }
  ptx::cp_async_wait<0>();

  if constexpr (T::kWarpsK > 1) {
    // Why fixed order: partial sums of warp slices wk = 1, 2, ... are added to wk = 0's in
    // that order, so every run rounds identically.
    __syncthreads();  // every warp is done with the pipeline buffers
    float* red = reinterpret_cast<float*>(smem);
    const i32 mn = warp % (T::kWarpsM * T::kWarpsN);
    if (wk > 0) {
      float* dst = red + ((wk - 1) * T::kWarpsM * T::kWarpsN + mn) * T::kAccRegs * 32 + lane;
#pragma unroll
      for (i32 mi = 0; mi < T::kWarpAtomsM; ++mi)
#pragma unroll
        for (i32 ni = 0; ni < T::kWarpTilesN; ++ni)
#pragma unroll
          for (i32 r = 0; r < 4; ++r)
            dst[((mi * T::kWarpTilesN + ni) * 4 + r) * 32] = acc[mi][ni][r];
    }
    __syncthreads();
    if (wk > 0) return;
#pragma unroll 1
    for (i32 q = 0; q < T::kWarpsK - 1; ++q) {
      const float* src = red + (q * T::kWarpsM * T::kWarpsN + mn) * T::kAccRegs * 32 + lane;
#pragma unroll
      for (i32 mi = 0; mi < T::kWarpAtomsM; ++mi)
#pragma unroll
        for (i32 ni = 0; ni < T::kWarpTilesN; ++ni)
#pragma unroll
          for (i32 r = 0; r < 4; ++r)
            acc[mi][ni][r] += src[((mi * T::kWarpTilesN + ni) * 4 + r) * 32];
    }
  }

  const i32 t = lane & 3;
#pragma unroll
  for (i32 mi = 0; mi < T::kWarpAtomsM; ++mi) {
    const i32 m_atom = m_atom0 + wm * T::kWarpAtomsM + mi;
#pragma unroll
    for (i32 ni = 0; ni < T::kWarpTilesN; ++ni) {
#pragma unroll
      for (i32 h = 0; h < 2; ++h) {
        const i32 n = (wn * T::kWarpTilesN + ni) * 8 + 2 * t + h;
        if (s_ids[n] < 0) continue;
        // Split s's rows follow split s - 1's: blocks * kBlockN rows a set (the host sizes out2).
        const i64 row = (static_cast<i64>(split) * p.blocks + block) * T::kBlockN + n;
        Epi::store(p, expert, m_atom, g, row, Epi::kGatherTokens ? 0.0f : s_weights[n],
                   acc[mi][ni], h, split == 0);
      }
    }
  }
  if constexpr (Epi::kGatherTokens) {
    // FC1: every storing warp (the kWarpsK == 0 slice, which holds thread 0) past its stores.
    constexpr i32 kStoringThreads = T::kWarpsM * T::kWarpsN * 32;
    if constexpr (kStoringThreads == T::kThreads) {
      __syncthreads();
    } else {
      asm volatile("bar.sync 2, %0;" ::"n"(kStoringThreads) : "memory");
    }
    signal_stored(chain);
  }
}

}  // namespace moejit::kern::moe
