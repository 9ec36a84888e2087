// The CUDA driver API, loaded at run time (dlopen libcuda.so.1 + cuGetProcAddress), so the
// library and CLI run where there is no driver. Only this unit and runtime/ops include cuda.h.
#pragma once

#include <cuda.h>

#include <string>

#include "moejit/error.hpp"

namespace moejit::detail {

struct DriverApi {
#define MOEJIT_DRIVER_FN(name) decltype(&::name) name = nullptr;
#include "driver/driver_functions.inc"
#undef MOEJIT_DRIVER_FN
};

// The loaded driver (cuInit done), or nullptr with `why` set when there is none.
const DriverApi* try_driver(std::string* why = nullptr);
// The loaded driver; throws Error{kDriver} saying why when there is none.
const DriverApi& driver();

// "CUDA_ERROR_INVALID_VALUE (invalid argument)".
std::string describe(CUresult result);

[[noreturn]] void throw_driver_error(CUresult result, const char* call, const char* file, int line);

}  // namespace moejit::detail

#define MOEJIT_CU_CHECK(call)                                                            \
  do {                                                                                   \
    CUresult moejit_cu_result_ = (call);                                                 \
    if (moejit_cu_result_ != CUDA_SUCCESS)                                               \
      ::moejit::detail::throw_driver_error(moejit_cu_result_, #call, __FILE__, __LINE__); \
  } while (0)
