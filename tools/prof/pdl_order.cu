// Does programmatic dependent launch order a grid after one it never waited for?
//
// marlin_moe's chained FC2 (moe_gemm.cuh's MoeGemmChain) waits for FC1's tile counts, not for
// FC1's grid, and the combine after it waits only for FC2's grid. Whether the stream's order then
// still reaches FC1 is what this probe measures, on three grids in one stream:
//   A  triggers its dependents at once, then one thread spins for kSpinNs and stores a flag;
//   B  launched with programmatic stream serialization; triggers at once and either never waits
//      for A, or waits for A as it leaves (one thread of its last CTA, as marlin_moe's chained
//      FC2 does);
//   C  launched with programmatic stream serialization and griddepcontrol.wait first, or in plain
//      stream order; it reads A's flag.
// The four combinations of B and C run in turn, after two controls.
// C reading 0 means C ran while A had not finished: its wait (or the stream) covered B alone.
//
// Build and run on the GPU machine:
//   nvcc -std=c++17 -arch=sm_90a -O2 -o pdl_order tools/prof/pdl_order.cu && ./pdl_order
// Prints, per case, how many of the trials C saw A's flag unset.
#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace {

constexpr unsigned long long kSpinNs = 2'000'000;  // A's store comes 2 ms after its trigger
constexpr int kTrials = 20;

__device__ unsigned long long global_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
__device__ void wait_for_primary() { asm volatile("griddepcontrol.wait;" ::: "memory"); }
__device__ void trigger_dependents() {
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
}

__global__ void grid_a(int* flag) {
  trigger_dependents();
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    const unsigned long long start = global_ns();
    while (global_ns() - start < kSpinNs) {
    }
    atomicExch(flag, 1);
  }
}

// Where B waits matters for its cost, not for the order: any one thread of the grid suffices.
__global__ void grid_b(bool wait_at_exit) {
  trigger_dependents();
  if (wait_at_exit && blockIdx.x == gridDim.x - 1 && threadIdx.x == 0) wait_for_primary();
}

__global__ void grid_c(const int* flag, int* seen, bool wait) {
  if (wait) wait_for_primary();
  if (blockIdx.x == 0 && threadIdx.x == 0) *seen = atomicAdd(const_cast<int*>(flag), 0);
}

void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    std::fprintf(stderr, "pdl_order: %s: %s\n", what, cudaGetErrorString(e));
    std::exit(1);
  }
}

template <class... Args>
void launch(void (*kernel)(Args...), bool pdl, cudaStream_t stream, Args... args) {
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(8);
  config.blockDim = dim3(128);
  config.stream = stream;
  cudaLaunchAttribute attribute{};
  attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute.val.programmaticStreamSerializationAllowed = 1;
  config.attrs = &attribute;
  config.numAttrs = pdl ? 1 : 0;
  check(cudaLaunchKernelEx(&config, kernel, args...), "cudaLaunchKernelEx");
}

// Trials in which C read A's flag unset. Without B, C follows A directly.
int run_case(bool with_b, bool b_waits, bool c_pdl, bool c_waits, int* flag, int* seen,
             cudaStream_t stream) {
  int early = 0;
  for (int trial = 0; trial < kTrials; ++trial) {
    check(cudaMemsetAsync(flag, 0, sizeof(int), stream), "cudaMemsetAsync");
    check(cudaMemsetAsync(seen, 0xff, sizeof(int), stream), "cudaMemsetAsync");
    launch(grid_a, false, stream, flag);
    if (with_b) launch(grid_b, true, stream, b_waits);
    launch(grid_c, c_pdl, stream, static_cast<const int*>(flag), seen, c_waits);
    int host_seen = -1;
    check(cudaMemcpyAsync(&host_seen, seen, sizeof(int), cudaMemcpyDeviceToHost, stream),
          "cudaMemcpyAsync");
    check(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
    if (host_seen != 0 && host_seen != 1) {
      std::fprintf(stderr, "pdl_order: C never stored (read %d)\n", host_seen);
      std::exit(1);
    }
    early += host_seen == 0;
  }
  return early;
}

}  // namespace

int main() {
  cudaDeviceProp prop{};
  check(cudaGetDeviceProperties(&prop, 0), "cudaGetDeviceProperties");
  std::printf("pdl_order on %s (sm_%d%d), %d trials a case, A's store %llu us after its trigger\n",
              prop.name, prop.major, prop.minor, kTrials, kSpinNs / 1000);
  cudaStream_t stream;
  check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate");
  int* buffers = nullptr;
  check(cudaMalloc(&buffers, 2 * sizeof(int)), "cudaMalloc");
  struct Case {
    const char* name;
    bool with_b;
    bool b_waits;
    bool c_pdl;
    bool c_waits;
  };
  // The first two are controls: they show A's trigger really lets a dependent run before A's
  // store (else every case would read the flag set and the others would show nothing).
  const Case cases[] = {
      {"control: no B,   C (PDL) never waits", false, false, true, false},
      {"control: B never waits, C (PDL) never waits", true, false, true, false},
      {"B never waits,   C (PDL) waits for B", true, false, true, true},
      {"B never waits,   C in plain order   ", true, false, false, false},
      {"B waits at exit, C (PDL) waits for B", true, true, true, true},
      {"B waits at exit, C in plain order   ", true, true, false, false},
  };
  for (const Case& c : cases) {
    const int early =
        run_case(c.with_b, c.b_waits, c.c_pdl, c.c_waits, buffers, buffers + 1, stream);
    std::printf("%s: C read A's flag unset in %d of %d trials\n", c.name, early, kTrials);
  }
  check(cudaFree(buffers), "cudaFree");
  check(cudaStreamDestroy(stream), "cudaStreamDestroy");
  return 0;
}
