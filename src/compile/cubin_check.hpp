// Checks of the SASS in a compiled cubin that the driver would not make before a launch.
#pragma once

#include <string>
#include <string_view>

namespace moejit::detail {

// The cache-hinted cp.async that faults.
//
// What: ptxas 13.0 (NVRTC 13.0) may compile a cp.async that carries an L2 cache-policy operand
// (`cp.async...L2::cache_hint`, kernels/moe/ptx.cuh) to an LDGSTS that reads its descriptor from
// a uniform register nothing writes: the createpolicy that should define it is gone. Those
// LDGSTS take the form with a uniform-register shared-memory offset (`[R+UR]`, opcode bits
// 0xdae, the descriptor printed as UR1); the copies whose policy is materialized take the plain
// form (0xfae). On the H200 (sm_90a) a kernel with the 0xdae form stops with
// CUDA_ERROR_ILLEGAL_INSTRUCTION at that copy (tools/PERF_LOG.md, "The cache-hinted cp.async that
// faults"). ptxas emits the same form for sm_100a and sm_120a (not runnable here) and never for
// sm_80-89 in the cases looked at. So compile() scans every cubin and rebuilds a kernel that has
// it without the hint.
//
// Returns how many 128-bit instructions of the ELF image's executable sections have that opcode.
// Throws Error{kInternal} naming the problem when `cubin` is not a whole image
// (elf_image_problem) or an executable section is not whole 16-byte instructions.
int count_faulting_hinted_copies(std::string_view cubin);

// "" when `image` is a whole little-endian ELF64 image: its header, its program and section
// tables and every segment's and section's file bytes lie inside it. Else what is wrong.
//
// Why: the driver is given a cubin by address alone (cuLibraryLoadData takes no length) and reads
// whatever its header points at, so the cache checks that all of that is inside the bytes it
// holds before it serves them (cache/disk_cache.cpp), as compile() does before its scan.
std::string elf_image_problem(std::string_view image);

}  // namespace moejit::detail
