// Can one CTA an SM stream a whole expert at its share of the HBM rate, and dequantize and
// multiply it as it lands? The first question of PERF_LOG's lead "an expert-stationary fused tile
// where every expert is touched" (seventy-fourth session), asked without the rest of the tile.
//
// The grid is one CTA per expert (qwen3-30b-a3b: 128 experts of 2.507 MB, FC1 and FC2 weights and
// scales back to back) at one CTA per SM (its ring takes most of the shared memory). A producer
// lane streams the expert with bulk copies (cp.async.bulk, evict-first) into a ring of 17 KB
// stages: 16 KB of weight atoms (4 strips x 8 atoms of layout.cuh, the m64 rows of one
// warpgroup over 512 K) and their 1 KB of scales. Consumer warpgroup g takes stages g, g + G, ...
// into slots of its own (ring / G of them). With `rotate` ("rot" rows) expert e starts at stage
// e x rotate, wrapping, so the experts do not read in lockstep at one offset of equal strides.
// In mode "stream" its warps release each stage as it lands; in mode "mma" each lane loads its
// 16 bytes and scale word per atom, dequantizes them with mxfp4::dequant_step into the A
// registers of four k16 steps, and issues four wgmma m64nNk16 against a fixed activation tile
// of N tokens in shared memory (in the tile the lead describes, the expert's rows stay resident
// for all of K), as moe_gemm_wg.cuh's loop does; every fourth stage of a warpgroup drains its
// wgmmas, as an m64 tile's epilogue would. The results are summed into a sink so nothing is
// dropped; their values are not checked (the inputs are arbitrary bits).
//
// Prints per variant the median of 20 launches (each reads one of two copies of the weights in
// turn, 642 MB in all, so no launch finds its bytes in the 50 MB L2), the bytes' rate and its
// fraction of the device-to-device copy rate measured in the same run (read + write counted, as
// moejit_bench_moe does). The lead is worth building if "mma" holds ~85% of copy or more at an
// SM's share of the H200's rate, and at qwen3-30b-a3b T = 256's width (N = 32): on an H100 at 94
// CTAs it held 86% at N = 16 and 75% at N = 32 (PERF_LOG, P75c), so it is not built.
//
// Its one argument is the grid, 1 to 128 CTAs (default 128): fewer CTAs share the same HBM rate,
// so 94 ask an H100's SMs (3.0 TB/s) for what 128 ask of the H200's (4.2 TB/s).
// On the GPU machine: `tools/prof/device.sh probe expert_stream [CTAS]` (builds it with that
// machine's nvcc, runs it, keeps its output under $OUT). By hand (here or there):
//   mkdir -p /tmp/moejit-inc/moejit && ln -sfn "$PWD/kernels" /tmp/moejit-inc/moejit/kern
//   nvcc -std=c++17 -gencode arch=compute_90a,code=sm_90a -O3 -I /tmp/moejit-inc \
//     -o expert_stream tools/prof/expert_stream.cu && ./expert_stream
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <moejit/kern/moe/layout.cuh>
#include <moejit/kern/moe/mxfp4.cuh>
#include <moejit/kern/moe/pipe.cuh>
#include <moejit/kern/moe/ptx.cuh>
#include <moejit/kern/moe/wgmma.cuh>
#include <vector>

namespace {

namespace kern = moejit::kern::moe;
namespace pipe = kern::decode::pipe;
using u32 = unsigned int;
using u64 = unsigned long long;

constexpr int kExperts = 128;
// The grid: kExperts, or fewer from the command line. Fewer CTAs, each on an SM of its own,
// share the same HBM rate, so each must stream (and dequantize) faster: at 94 CTAs an H100's
// 3.0 TB/s gives an SM the share the H200's 4.2 TB/s gives each of 128.
int g_experts = kExperts;
constexpr int kStrips = 4;         // one warpgroup's m64 rows
constexpr int kAtomsPerStrip = 8;  // 512 K a stage
constexpr int kStageWeightBytes = kStrips * kAtomsPerStrip * kern::layout::kAtomBytes;  // 16 KB
constexpr int kStageScaleBytes = kStrips * kAtomsPerStrip * kern::layout::kAtomScaleBytes;
constexpr int kStageBytes = kStageWeightBytes + kStageScaleBytes;
// qwen3-30b-a3b: FC1 2I x H = 1536 x 2048 and FC2 H x I = 2048 x 768 weights, 2.25 MiB an expert.
constexpr long long kExpertWeightBytes = (1536LL * 2048 + 2048LL * 768) / 2;
constexpr int kStagesPerExpert = static_cast<int>(kExpertWeightBytes / kStageWeightBytes);
static_assert(kExpertWeightBytes % kStageWeightBytes == 0, "whole stages an expert");
constexpr int kRingMax = 10;  // 170 KB of stages

enum class Mode { kStream, kMma };

// The slots each warpgroup owns in a ring of `ring` stages (the kernel uses the first
// slots(ring, groups) x groups).
__host__ __device__ constexpr int slots(int ring, int groups) { return ring / groups; }
// The threads of a CTA: `groups` consumer warpgroups and the producer warp.
__host__ __device__ constexpr int threads_of(int groups) { return 128 * groups + 32; }
// Expert e's stream starts at stage e x kRotate in the "rot" rows.
constexpr int kRotate = 37;

template <Mode kMode, int kN, int kGroups, int kRing>
__global__ void __launch_bounds__(threads_of(kGroups), 1)
    expert_stream(const unsigned char* weights, const unsigned char* scales, float* sink,
                  int rotate) {
  // Each warpgroup has slots of its own: a parity wait tells apart only two phases of a
  // barrier, so a warpgroup must never wait on a slot whose previous fill another warpgroup has
  // yet to see land (it would pass at once, on the old phase).
  constexpr int kSlots = slots(kRing, kGroups);
  static_assert(kSlots >= 2, "two slots a warpgroup at least");
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  // The activation tile first (1024-aligned for the 128-byte swizzle), then the ring, then the
  // barriers.
  unsigned char* const base = reinterpret_cast<unsigned char*>(
      (reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~static_cast<uintptr_t>(1023));
  unsigned char* const tile = base;
  unsigned char* const ring = tile + kN * 128;
  u64* const bars = reinterpret_cast<u64*>(ring + kRing * kStageBytes);
  const u32 full0 = kern::ptx::smem_u32(bars);
  const u32 empty0 = full0 + 8 * kRing;
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int expert = blockIdx.x;

  if (threadIdx.x == 0) {
    for (int s = 0; s < kRing; ++s) {
      pipe::mbar_init(full0 + 8 * s, 1);
      pipe::mbar_init(empty0 + 8 * s, 4);  // the four warps of the consuming warpgroup
    }
    pipe::fence_mbar_init();
  }
  for (int i = threadIdx.x; i < kN * 32; i += blockDim.x) {
    reinterpret_cast<u32*>(tile)[i] = 0x3f803f80u;  // bf16 1.0 pairs
  }
  __syncthreads();

  if (warp == 4 * kGroups) {  // the producer
    if (lane == 0) {
      const u64 policy = kern::ptx::policy_evict_first();
      const unsigned char* w = weights + expert * kExpertWeightBytes;
      const unsigned char* sc = scales + expert * (kExpertWeightBytes / 16);
      for (int s = 0; s < kStagesPerExpert; ++s) {
        const int k = s / kGroups;  // the stage's turn within its group
        const int slot = (s % kGroups) * kSlots + k % kSlots;
        if (k >= kSlots) pipe::wait(empty0 + 8 * slot, ((k / kSlots) - 1) & 1);
        const u32 full = full0 + 8 * slot;
        const u32 dst = kern::ptx::smem_u32(ring + slot * kStageBytes);
        pipe::expect_tx(full, kStageBytes);
        // With `rotate`, expert e starts its stream at stage e * rotate (wrapping), so the
        // experts' concurrent reads do not sit at one offset of their equal strides.
        const long long at = (s + expert * rotate) % kStagesPerExpert;
        pipe::copy(dst, w + at * kStageWeightBytes, kStageWeightBytes, full, policy);
        pipe::copy(dst + kStageWeightBytes, sc + at * kStageScaleBytes, kStageScaleBytes, full,
                   policy);
        pipe::arrive(full);
      }
    }
    return;
  }

  const int group = warp / 4;
  const int strip = warp % 4;
  float d[kN / 2] = {};
  u32 a[2][4][4];
  const u32 tile_addr = kern::ptx::smem_u32(tile);
  int atom_count = 0;
  int tile_stages = 0;
  float sum = 0.0f;
  for (int s = group; s < kStagesPerExpert; s += kGroups) {
    const int k = s / kGroups;
    const int slot = group * kSlots + k % kSlots;
    pipe::wait(full0 + 8 * slot, (k / kSlots) & 1);
    if constexpr (kMode == Mode::kMma) {
      const u32 stage = kern::ptx::smem_u32(ring + slot * kStageBytes);
      u32 words[kAtomsPerStrip][4];
      u32 scale_words[kAtomsPerStrip];
#pragma unroll
      for (int at = 0; at < kAtomsPerStrip; ++at) {
        const int atom = strip * kAtomsPerStrip + at;
        kern::ptx::lds128(stage + atom * kern::layout::kAtomBytes + lane * 16, words[at]);
        scale_words[at] = kern::ptx::lds32(stage + kStageWeightBytes +
                                           atom * kern::layout::kAtomScaleBytes + (lane / 4) * 4);
      }
      __syncwarp();
      if (lane == 0) pipe::arrive(empty0 + 8 * slot);  // the stage is in registers
#pragma unroll
      for (int at = 0; at < kAtomsPerStrip; ++at, ++atom_count) {
        u32(&set)[4][4] = a[at % 2];
        const u32 f0 = kern::mxfp4::group_factors<0>(scale_words[at]);
        const u32 f1 = kern::mxfp4::group_factors<1>(scale_words[at]);
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          kern::mxfp4::dequant_step<true>(words[at][j], j < 2 ? f0 : f1, set[j]);
        }
        kern::wgmma::fence();
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          kern::wgmma::mma<kN>(d, set[j], kern::wgmma::desc_sw128(tile_addr + 32 * j));
        }
        kern::wgmma::commit();
        kern::wgmma::wait<1>();  // the other set's wgmmas are done: it may be rewritten
        kern::wgmma::fence_operands(d);
      }
      // Every fourth stage of a warpgroup ends an m64 tile's K (2048 = FC1's H): the tile's
      // epilogue drains its wgmmas and starts the next tile from zero, as the real tile would
      // (its outputs folded into `sum` here instead of activated into shared memory).
      if (++tile_stages % 4 == 0) {
        kern::wgmma::wait<0>();
        kern::wgmma::fence_operands(d);
#pragma unroll
        for (int i = 0; i < kN / 2; ++i) {
          sum += d[i];
          d[i] = 0.0f;
        }
      }
    } else {
      __syncwarp();
      if (lane == 0) pipe::arrive(empty0 + 8 * slot);
    }
  }
  kern::wgmma::wait<0>();
  kern::wgmma::fence_operands(d);
  sum += static_cast<float>(atom_count);
#pragma unroll
  for (int i = 0; i < kN / 2; ++i) sum += d[i];
  sink[blockIdx.x * blockDim.x + threadIdx.x] = sum;
}

void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    std::fprintf(stderr, "expert_stream: %s: %s\n", what, cudaGetErrorString(e));
    std::exit(1);
  }
}

__global__ void fill(unsigned char* p, long long bytes, unsigned seed, bool scale) {
  for (long long i = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x; i < bytes;
       i += static_cast<long long>(gridDim.x) * blockDim.x) {
    unsigned x = static_cast<unsigned>(i) * 2654435761u ^ seed;
    x ^= x >> 15;
    p[i] = scale ? static_cast<unsigned char>(120 + x % 16) : static_cast<unsigned char>(x);
  }
}

__global__ void empty() {}

// The median time of `enqueue(i)` in ms over `runs` calls after `warmup` more, each timed alone.
template <class Enqueue>
float median_ms(cudaStream_t stream, int warmup, int runs, const char* what, Enqueue enqueue) {
  cudaEvent_t start, stop;
  check(cudaEventCreate(&start), "cudaEventCreate");
  check(cudaEventCreate(&stop), "cudaEventCreate");
  std::vector<float> ms;
  for (int i = 0; i < warmup + runs; ++i) {
    cudaEventRecord(start, stream);
    enqueue(i);
    cudaEventRecord(stop, stream);
    check(cudaEventSynchronize(stop), what);
    float t = 0;
    cudaEventElapsedTime(&t, start, stop);
    if (i >= warmup) ms.push_back(t);
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

double copy_rate(cudaStream_t stream) {  // GB/s, read + write
  const size_t bytes = 1ull << 30;
  void* a = nullptr;
  void* b = nullptr;
  check(cudaMalloc(&a, bytes), "cudaMalloc copy");
  check(cudaMalloc(&b, bytes), "cudaMalloc copy");
  const float ms = median_ms(stream, 2, 10, "copy", [&](int) {
    cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice, stream);
  });
  cudaFree(a);
  cudaFree(b);
  return 2.0 * bytes / (ms * 1e-3) / 1e9;
}

template <Mode kMode, int kN, int kGroups, int kRing = kRingMax>
void run(const char* name, unsigned char* const (&w)[2], unsigned char* const (&sc)[2], float* sink,
         cudaStream_t stream, double copy_gbs, int rotate = 0) {
  auto kernel = expert_stream<kMode, kN, kGroups, kRing>;
  const int smem = 1024 + kN * 128 + kRing * kStageBytes + 16 * kRing;
  check(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem),
        "smem attribute");
  const int threads = threads_of(kGroups);
  const float t = 1e3f * median_ms(stream, 4, 20, name, [&](int i) {
                    kernel<<<g_experts, threads, smem, stream>>>(w[i % 2], sc[i % 2], sink, rotate);
                  });
  const double bytes = g_experts * (kExpertWeightBytes + kExpertWeightBytes / 16.0);
  const double gbs = bytes / (t * 1e-6) / 1e9;
  std::printf("  %-12s %3d warps  slots %2d x 17 KB  %8.1f us  %7.1f GB/s  %5.1f%% of copy\n", name,
              threads / 32, slots(kRing, kGroups) * kGroups, t, gbs, 100.0 * gbs / copy_gbs);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc > 1) g_experts = std::atoi(argv[1]);
  if (g_experts < 1 || g_experts > kExperts) {
    std::fprintf(stderr, "expert_stream: grid %s: 1 to %d CTAs\n", argv[1], kExperts);
    return 1;
  }
  cudaStream_t stream;
  check(cudaStreamCreate(&stream), "stream");
  cudaDeviceProp prop;
  check(cudaGetDeviceProperties(&prop, 0), "device");
  const double copy_gbs = copy_rate(stream);
  std::printf("expert_stream: %s, %d SMs; copy %.0f GB/s (read + write); %d experts x %.3f MB\n",
              prop.name, prop.multiProcessorCount, copy_gbs, g_experts,
              (kExpertWeightBytes + kExpertWeightBytes / 16) / 1e6);
  unsigned char* w[2];
  unsigned char* sc[2];
  for (int c = 0; c < 2; ++c) {
    check(cudaMalloc(&w[c], kExperts * kExpertWeightBytes), "weights");
    check(cudaMalloc(&sc[c], kExperts * kExpertWeightBytes / 16), "scales");
    fill<<<1024, 256, 0, stream>>>(w[c], kExperts * kExpertWeightBytes, 17u + c, false);
    fill<<<1024, 256, 0, stream>>>(sc[c], kExperts * kExpertWeightBytes / 16, 29u + c, true);
  }
  float* sink = nullptr;
  check(cudaMalloc(&sink, kExperts * 1024 * sizeof(float)), "sink");
  check(cudaStreamSynchronize(stream), "fill");
  // What a launch alone costs in this timing (an empty kernel of the same grid).
  std::printf("  empty launch %8.1f us\n", 1e3f * median_ms(stream, 4, 20, "empty", [&](int) {
                                             empty<<<g_experts, threads_of(3), 0, stream>>>();
                                           }));
  run<Mode::kStream, 16, 1>("stream", w, sc, sink, stream, copy_gbs);
  run<Mode::kStream, 16, 3>("stream", w, sc, sink, stream, copy_gbs);
  run<Mode::kStream, 16, 1>("stream rot", w, sc, sink, stream, copy_gbs, kRotate);
  run<Mode::kStream, 16, 3>("stream rot", w, sc, sink, stream, copy_gbs, kRotate);
  run<Mode::kMma, 16, 2>("mma N = 16", w, sc, sink, stream, copy_gbs);
  run<Mode::kMma, 16, 3>("mma N = 16", w, sc, sink, stream, copy_gbs);
  run<Mode::kMma, 16, 3>("mma16 rot", w, sc, sink, stream, copy_gbs, kRotate);
  // The ring that fits beside 64 KB of resident activations (16 tokens x 2048 K) and FC1's
  // 24 KB of output rows (seven stages: six slots at three warpgroups).
  run<Mode::kMma, 16, 3, 7>("mma N = 16", w, sc, sink, stream, copy_gbs);
  run<Mode::kMma, 32, 2>("mma N = 32", w, sc, sink, stream, copy_gbs);
  run<Mode::kMma, 32, 3>("mma N = 32", w, sc, sink, stream, copy_gbs);
  return 0;
}
