// The CUDA driver API, loaded at run time (dlopen libcuda.so.1 + cuGetProcAddress), so the
// library and CLI run where there is no driver. Only this unit and runtime/ops include cuda.h.
#pragma once

#include <cuda.h>

#include <string>

#include "moejit/error.hpp"

namespace moejit::detail {

// One pointer per entry point of driver_functions.inc, named as cuda.h names the call, so
// `api.cuMemAlloc(...)` reads like the C API (cuda.h's macros rename both sides alike).
struct DriverApi {
#define MOEJIT_DRIVER_FN(name, version) decltype(&::name) name = nullptr;
#include "driver/driver_functions.inc"
#undef MOEJIT_DRIVER_FN
  int driver_version = 0;  // cuDriverGetVersion, e.g. 13000
};

// The loaded driver (cuInit done), or nullptr with `why` set when there is none. Loads once per
// process (thread safe); later calls are a load of a static.
const DriverApi* try_driver(std::string* why = nullptr);
// The loaded driver; throws Error{kDriver} saying why when there is none.
const DriverApi& driver();

// Peak DRAM rate of `device` in bytes per second: twice the memory clock (double data rate)
// times the bus width, from CU_DEVICE_ATTRIBUTE_MEMORY_CLOCK_RATE and _GLOBAL_MEMORY_BUS_WIDTH.
// 0 when the driver does not report both.
long long peak_dram_bytes_per_second(const DriverApi& api, CUdevice device);

// "CUDA_ERROR_INVALID_VALUE (invalid argument)"; works even when cuInit failed.
std::string describe(CUresult result);

// Throws Error{kDriver}: "<call> failed at <file>:<line>: CUDA_ERROR_X (text)".
[[noreturn]] void throw_driver_error(CUresult result, const char* call, const char* file, int line);

}  // namespace moejit::detail

#define MOEJIT_CU_CHECK(call)                                                            \
  do {                                                                                   \
    CUresult moejit_cu_result_ = (call);                                                 \
    if (moejit_cu_result_ != CUDA_SUCCESS)                                               \
      ::moejit::detail::throw_driver_error(moejit_cu_result_, #call, __FILE__, __LINE__); \
  } while (0)
