// Checks of the SASS in a compiled cubin that the driver would not make before a launch.
#pragma once

#include <string_view>

namespace moejit::detail {

// The sm_90 cp.async encoding that faults.
//
// What: ptxas 13.0 (NVRTC 13.0) may encode a cp.async that carries an L2 cache-policy operand
// (`cp.async...L2::cache_hint`, kernels/moe/ptx.cuh) as an LDGSTS whose shared-memory address is a
// register plus a uniform register (`[R+UR]`, opcode bits 0xdae). The same copy without the
// cache-policy operand, or with the address in one register, is the LDGSTS form 0xfae. On the
// H200 (sm_90a) a kernel holding the 0xdae form stops with CUDA_ERROR_ILLEGAL_INSTRUCTION at that
// copy (tools/PERF_LOG.md, "The cache-hinted cp.async that faults"), so compile() checks every
// sm_90 cubin for it and rebuilds the kernel without the hint where it is found.
//
// Returns how many 128-bit instructions of the ELF image's executable sections have that opcode.
// Throws Error{kInternal} naming the problem when `cubin` is not a little-endian ELF64 image whose
// section table lies inside it.
int count_faulting_sm90_copies(std::string_view cubin);

}  // namespace moejit::detail
