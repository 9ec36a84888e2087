// libmoejit benchmarks: driver calls libmoejit does not use (graph inspection), fetched from the
// libcuda the library loaded, with cuGetProcAddress at the ABI versions cudaTypedefs.h names.
#pragma once

#include <cuda.h>
#include <cudaTypedefs.h>
#include <dlfcn.h>

#include <stdexcept>
#include <string>

#include "driver/driver.hpp"

namespace moejit::bench {

// libcuda's cuGetProcAddress_v2. Loads the library's driver first, which throws
// moejit::Error{kDriver} saying why where no driver is installed.
inline PFN_cuGetProcAddress_v12000 driver_proc_address() {
  moejit::detail::driver();
  void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (lib == nullptr) throw std::runtime_error(std::string("dlopen libcuda.so.1: ") + dlerror());
  auto get = reinterpret_cast<PFN_cuGetProcAddress_v12000>(dlsym(lib, "cuGetProcAddress_v2"));
  if (get == nullptr) throw std::runtime_error("libcuda.so.1 has no cuGetProcAddress_v2");
  return get;
}

// *fn = the driver's `name` at ABI `version` (e.g. 12030 for CUDA 12.3), or a message saying
// which call and ABI the driver lacks.
template <typename Fn>
void load_entry(PFN_cuGetProcAddress_v12000 get, const char* name, int version, Fn* fn) {
  void* pointer = nullptr;
  CUdriverProcAddressQueryResult status = CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
  const CUresult result = get(name, &pointer, version, CU_GET_PROC_ADDRESS_DEFAULT, &status);
  if (result != CUDA_SUCCESS || pointer == nullptr || status != CU_GET_PROC_ADDRESS_SUCCESS) {
    throw std::runtime_error(std::string("the driver has no ") + name + " (ABI of CUDA " +
                             std::to_string(version / 1000) + "." +
                             std::to_string(version % 1000 / 10) + "); update the NVIDIA driver");
  }
  *fn = reinterpret_cast<Fn>(pointer);
}

}  // namespace moejit::bench
