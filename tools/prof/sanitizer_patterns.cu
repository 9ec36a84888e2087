// libmoejit tools/prof: the synchronization patterns of the decode kernels, each alone in a small
// kernel, to read compute-sanitizer's racecheck and synccheck reports on the library's kernels
// against (`tools/prof/device.sh sanitize`; tools/PERF_LOG.md "main's kernels under
// compute-sanitizer"). One CTA of 320 threads (10 warps) a case; warp 9 plays the producer,
// warps 0-7 the consumers. Every case but 0 and 1 is correct by the PTX ISA.
//
//   case  pattern                                                  racecheck  synccheck
//   0     a store and a load with no synchronization (control)     race       -
//   1     barrier 3 reached from two instructions as bar.sync      -          divergent
//         (bar.sync is barrier.sync.aligned: undefined unless every thread runs the same one)
//   2     plain stores handed over by mbarrier arrive / try_wait   race       -
//   3     a bulk copy completing on an mbarrier (arrive.expect_tx) -          -
//   4     plain stores handed over by st.release / ld.acquire      race       -
//   5     loads, then an mbarrier arrive; the overwrite after      race       -
//         the producer's wait (write after read)
//   6     cp.async, each lane's cp.async.mbarrier.arrive, then     -          overflow
//         one counted arrive (the PTX ISA's own example)
//   7     case 1 with barrier.sync (not aligned)                   -          -
//   8     expect_tx alone, a bulk copy, then a plain arrive        -          -
//   9     decode_moe's routing hand-over: the routing warps store  race (*)   (not run)
//         a table after their last barrier 2 (as route() stores
//         vinfo), then barrier.sync 3; the producer claims an item
//         (atomicAdd), reaches barrier 3 from its own instruction
//         and every lane loads the table
//   10    case 9 with bar.sync 3 (decode_moe before the fix)       race (*)   divergent?
//   11    case 9, the producer initializing and fencing an         race       (not run)
//         mbarrier before barrier 3
//   12    case 9, the producer's griddepcontrol.wait and           race       (not run)
//         launch_dependents before barrier 3
//   13    cases 11 and 12 together (decode_moe's producer start)   race       (not run)
// (*) Cases 9 and 10 swap from run to run: 10 raced and 9 did not on 2026-12-05, 9 raced and
//     10 did not on 2026-12-06 (same source, same tool, H100 machines).
// (compute-sanitizer 2025.3.1 on H100 machines: 0-8 on 2026-12-05 with the same PTX written out
// in this file, and racecheck on 0-13 on 2026-12-06 through the kernels' own wrappers, pipe.cuh
// and ptx.cuh, with the same results for 0-7 and no report for 8.) So racecheck does not see an
// mbarrier's or a release/acquire pair's ordering of plain accesses (2, 4, 5), and synccheck
// counts the non-.noinc arrive-on as an arrival without its increment (6).
// Cases 9-13 are for racecheck's one unexplained report on decode_moe: route()'s store of vinfo
// against the producer's load of it after routing_done (tools/PERF_LOG.md "main's kernels under
// compute-sanitizer"). Cases 1 and 7 hand over data stored before the routing warps' barrier 2;
// vinfo is stored after their last one. 11-13 add the producer's other work before barrier 3,
// one part at a time. Every one of 9-13 has been reported in some run, 9 and 10 each in one run
// of two: racecheck's report on this hand-over depends on the run, not on the barrier's form, so
// decode_moe's vinfo report is read as the tool's, on a hand-over the PTX ISA orders.
//
// Build (an include directory in which moejit/kern is the repository's kernels/, as the library
// embeds them): nvcc -std=c++17 -arch=sm_90a -O2 -I INC -o sanitizer_patterns
// sanitizer_patterns.cu
// Run: sanitizer_patterns [CASE]: every case, or only CASE (synccheck ends a process at its
// first barrier error).
#include <cstdint>
#include <cstdio>
#include <cstdlib>

#include <moejit/kern/common/ptx.cuh>
#include <moejit/kern/moe/pipe.cuh>
#include <moejit/kern/moe/ptx.cuh>

namespace {

namespace pipe = moejit::kern::moe::decode::pipe;
using moejit::kern::moe::ptx::smem_u32;

template <int kCase>
__global__ void __launch_bounds__(320) pattern(const uint32_t* src, uint32_t* out) {
  __shared__ alignas(128) uint32_t data[256];
  __shared__ alignas(8) uint64_t bar[3];
  __shared__ uint32_t flag;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  if (tid == 0) {
    pipe::mbar_init(smem_u32(&bar[0]), 1);
    pipe::mbar_init(smem_u32(&bar[1]), 8);
    flag = 0;
    pipe::fence_mbar_init();
  }
  __syncthreads();
  uint32_t acc = 0;
  if constexpr (kCase == 0) {
    if (warp == 9) data[lane] = lane;
    if (warp == 0) acc = data[31 - lane];
  } else if constexpr (kCase == 1 || kCase == 7) {
    if (warp < 9) {
      if (tid < 256) data[tid] = tid;
      asm volatile("bar.sync 2, 288;" ::: "memory");
      if constexpr (kCase == 1) {
        asm volatile("bar.sync 3, 320;" ::: "memory");
      } else {
        asm volatile("barrier.sync 3, 320;" ::: "memory");
      }
    } else {
      if constexpr (kCase == 1) {
        asm volatile("bar.sync 3, 320;" ::: "memory");
      } else {
        asm volatile("barrier.sync 3, 320;" ::: "memory");
      }
      acc = data[(tid * 7) % 256];
    }
  } else if constexpr (kCase == 2) {
    if (warp == 9) {
      data[lane] = lane + 1;
      __syncwarp();
      if (lane == 0) pipe::arrive(smem_u32(&bar[0]));
    } else if (warp < 8) {
      pipe::wait(smem_u32(&bar[0]), 0);
      acc = data[31 - lane];
    }
  } else if constexpr (kCase == 3) {
    if (warp == 9 && lane == 0) {
      // The combined arrive and expect_tx (pipe.cuh has them apart: case 8).
      asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(
                       smem_u32(&bar[0])),
                   "r"(1024)
                   : "memory");
      pipe::copy(smem_u32(data), src, 1024, smem_u32(&bar[0]));
    } else if (warp < 8) {
      pipe::wait(smem_u32(&bar[0]), 0);
      acc = data[(tid * 5) % 256];
    }
  } else if constexpr (kCase == 4) {
    if (warp == 9) {
      data[lane] = lane + 2;
      __syncwarp();
      if (lane == 0) pipe::store_release_cta(&flag, 1);
    } else if (warp < 8) {
      while (pipe::load_acquire_cta(&flag) == 0) {
      }
      acc = data[31 - lane];
    }
  } else if constexpr (kCase == 5) {
    if (warp < 8) {
      acc = data[(tid * 3) % 256];
      __syncwarp();
      if (lane == 0) pipe::arrive(smem_u32(&bar[1]));
    } else if (warp == 9) {
      pipe::wait(smem_u32(&bar[1]), 0);
      data[lane] = 7;
    }
  } else if constexpr (kCase == 6) {
    if (warp == 9) {
      // Each lane's arrive-on raises the pending count and arrives once its copy has landed; lane
      // 0 then makes the one counted arrival.
      moejit::kern::moe::ptx::cp_async_16(smem_u32(data + 4 * lane), src + 4 * lane, 16);
      pipe::arrive_on_copies(smem_u32(&bar[0]));
      __syncwarp();
      if (lane == 0) pipe::arrive(smem_u32(&bar[0]));
    } else if (warp < 8) {
      pipe::wait(smem_u32(&bar[0]), 0);
      acc = data[(tid * 5) % 128];
    }
  } else if constexpr (kCase >= 9 && kCase <= 13) {
    if (warp < 9) {
      if (tid < 256) data[tid] = 0;
      asm volatile("bar.sync 2, 288;" ::: "memory");
      for (int i = tid; i < 200; i += 288) data[i] = static_cast<uint32_t>(i) * 3u + 1u;
      if constexpr (kCase != 10) {
        asm volatile("barrier.sync 3, 320;" ::: "memory");
      } else {
        asm volatile("bar.sync 3, 320;" ::: "memory");
      }
    } else {
      uint32_t item = 0;
      if constexpr (kCase == 11 || kCase == 13) {
        // As decode_moe's producer: its own barriers initialized and fenced before barrier 3.
        pipe::mbar_init(smem_u32(&bar[2]), 1);
        pipe::fence_mbar_init();
      }
      if constexpr (kCase == 12 || kCase == 13) {
        ::moejit::kern::ptx::grid_dependency_wait();
        ::moejit::kern::ptx::launch_dependents();
      }
      if (lane == 0) item = atomicAdd(out + 320, 1u);
      if constexpr (kCase != 10) {
        asm volatile("barrier.sync 3, 320;" ::: "memory");
      } else {
        asm volatile("bar.sync 3, 320;" ::: "memory");
      }
      item = __shfl_sync(0xffffffffu, item, 0);
      for (int v = 0; v < 8; ++v) acc += data[(item + v * 25) % 200];
    }
  } else if constexpr (kCase == 8) {
    if (warp == 9 && lane == 0) {
      pipe::expect_tx(smem_u32(&bar[0]), 1024);
      pipe::copy(smem_u32(data), src, 1024, smem_u32(&bar[0]));
      pipe::arrive(smem_u32(&bar[0]));
    } else if (warp < 8) {
      pipe::wait(smem_u32(&bar[0]), 0);
      acc = data[(tid * 5) % 256];
    }
  }
  out[tid] = acc;
}

}  // namespace

int main(int argc, char** argv) {
  const int only = argc > 1 ? atoi(argv[1]) : -1;
  uint32_t* src = nullptr;
  uint32_t* out = nullptr;
  if (cudaMalloc(&src, 4096) != cudaSuccess || cudaMalloc(&out, 321 * 4) != cudaSuccess ||
      cudaMemset(out, 0, 321 * 4) != cudaSuccess ||
      cudaMemset(src, 1, 4096) != cudaSuccess) {
    fprintf(stderr, "sanitizer_patterns: no GPU memory\n");
    return 2;
  }
  void (*cases[])(const uint32_t*, uint32_t*) = {pattern<0>, pattern<1>, pattern<2>,
                                                 pattern<3>, pattern<4>, pattern<5>,
                                                 pattern<6>, pattern<7>, pattern<8>,
                                                 pattern<9>, pattern<10>, pattern<11>,
                                                 pattern<12>, pattern<13>};
  constexpr int kCases = sizeof(cases) / sizeof(cases[0]);
  for (int c = 0; c < kCases; ++c) {
    if (only < 0 || only == c) cases[c]<<<1, 320>>>(src, out);
  }
  const cudaError_t e = cudaDeviceSynchronize();
  printf("cases done: %s\n", cudaGetErrorString(e));
  return e == cudaSuccess ? 0 : 1;
}
