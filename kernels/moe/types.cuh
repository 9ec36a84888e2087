// libmoejit kernels/moe: fixed-width integer types and the host/device function marker, usable
// from three compilers: NVRTC, nvcc, and a plain host C++ compiler (the library's host code
// includes params.cuh and layout.cuh to size buffers and launch).
#pragma once

#if !defined(__CUDACC_RTC__)
#include <cstdint>
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

#if defined(__CUDACC_RTC__)
// Why spelled out: NVRTC has no <cstdint>, and the toolkit's cuda/std/cstdint would make its
// include directory a run-time dependency (common/types.cuh). These are the types cuda::std
// names under NVRTC, where every target has 32-bit int and 64-bit long long.
using i32 = int;
using i64 = long long;
using u8 = unsigned char;
using u16 = unsigned short;
using u32 = unsigned int;
using u64 = unsigned long long;
#else
using i32 = std::int32_t;
using i64 = std::int64_t;
using u8 = std::uint8_t;
using u16 = std::uint16_t;
using u32 = std::uint32_t;
using u64 = std::uint64_t;
#endif
static_assert(sizeof(i32) == 4 && sizeof(i64) == 8 && sizeof(u8) == 1 && sizeof(u16) == 2 &&
                  sizeof(u32) == 4 && sizeof(u64) == 8,
              "fixed-width integers");

MOEJIT_HD constexpr i32 ceil_div(i32 a, i32 b) { return (a + b - 1) / b; }

}  // namespace moejit::kern::moe
