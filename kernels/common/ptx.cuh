// Thin wrappers over PTX the kernels use, each compiled to nothing where the target lacks it.
#pragma once

namespace moejit::kern::ptx {

// Programmatic dependent launch (sm_90+). When the grid was launched with the programmatic
// stream serialization attribute, wait until the previous grid in the stream has completed and
// its memory is visible; otherwise (or below sm_90) a no-op. Call before reading any input.
__device__ __forceinline__ void grid_dependency_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// Programmatic dependent launch (sm_90+): let the next grid in the stream, if launched with the
// attribute, start its prologue now. Safe anywhere: its own grid_dependency_wait() still waits
// for this whole grid to finish. A no-op below sm_90 or without the attribute.
__device__ __forceinline__ void launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// threadIdx.x read again: the asm is volatile, so the compiler cannot reuse an earlier read or
// anything derived from it. For values needed only after a register-heavy loop: the compiler
// then recomputes them there instead of keeping them live through it (or spilling them).
__device__ __forceinline__ int thread_index_reread() {
  int tid;
  asm volatile("mov.u32 %0, %%tid.x;" : "=r"(tid));
  return tid;
}
// blockIdx.x read again, for the same reason.
__device__ __forceinline__ int block_index_reread() {
  int block;
  asm volatile("mov.u32 %0, %%ctaid.x;" : "=r"(block));
  return block;
}
// blockIdx.y read again, for the same reason.
__device__ __forceinline__ int block_index_y_reread() {
  int block;
  asm volatile("mov.u32 %0, %%ctaid.y;" : "=r"(block));
  return block;
}
// blockIdx.z read again, for the same reason.
__device__ __forceinline__ int block_index_z_reread() {
  int block;
  asm volatile("mov.u32 %0, %%ctaid.z;" : "=r"(block));
  return block;
}

}  // namespace moejit::kern::ptx
