// libmoejit kernels/moe: fixed-width integer types and the host/device function marker, usable
// from three compilers: NVRTC (no host headers: cuda::std), nvcc, and a plain host C++ compiler
// (the library's host code includes params.cuh and layout.cuh to size buffers and launch).
#pragma once

#if defined(__CUDACC_RTC__)
#include <cuda/std/cstdint>
#define MOEJIT_MOE_STD ::cuda::std
#else
#include <cstdint>
#define MOEJIT_MOE_STD ::std
#endif

// Why: layout index math is shared by device code and host code (repack round-trip tests).
#if !defined(MOEJIT_HD)
#if defined(__CUDACC__)
#define MOEJIT_HD __host__ __device__
#else
#define MOEJIT_HD
#endif
#endif

namespace moejit::kern::moe {

using i32 = MOEJIT_MOE_STD::int32_t;
using i64 = MOEJIT_MOE_STD::int64_t;
using u8 = MOEJIT_MOE_STD::uint8_t;
using u16 = MOEJIT_MOE_STD::uint16_t;
using u32 = MOEJIT_MOE_STD::uint32_t;
using u64 = MOEJIT_MOE_STD::uint64_t;

MOEJIT_HD constexpr i32 ceil_div(i32 a, i32 b) { return (a + b - 1) / b; }

}  // namespace moejit::kern::moe
