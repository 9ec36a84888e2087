// libmoejit benchmarks: a benchmark's own kernels (not libmoejit's, no cache), compiled by NVRTC
// to a cubin and launched with cuLaunchKernelEx. Both bench programs link NVRTC for it.
#pragma once

#include <cuda.h>
#include <nvrtc.h>

#include <stdexcept>
#include <string>
#include <vector>

namespace moejit::bench {

// `source` (named `file` in messages) compiled with `options` to a cubin; throws
// std::runtime_error naming `what` and carrying NVRTC's log.
inline std::string compile_cubin(const char* source, const char* file,
                                 const std::vector<std::string>& options, const std::string& what) {
  nvrtcProgram program = nullptr;
  auto check = [&](nvrtcResult result, const char* call) {
    if (result == NVRTC_SUCCESS) return;
    std::string log;
    std::size_t size = 0;
    if (program != nullptr && nvrtcGetProgramLogSize(program, &size) == NVRTC_SUCCESS && size > 1) {
      log.resize(size);
      nvrtcGetProgramLog(program, log.data());
    }
    if (program != nullptr) nvrtcDestroyProgram(&program);
    throw std::runtime_error(std::string(call) + " (" + what +
                             ") failed: " + nvrtcGetErrorString(result) + "\n" + log);
  };
  check(nvrtcCreateProgram(&program, source, file, 0, nullptr, nullptr), "nvrtcCreateProgram");
  std::vector<const char*> raw;
  for (const std::string& o : options) raw.push_back(o.c_str());
  check(nvrtcCompileProgram(program, static_cast<int>(raw.size()), raw.data()),
        "nvrtcCompileProgram");
  std::size_t size = 0;
  check(nvrtcGetCUBINSize(program, &size), "nvrtcGetCUBINSize");
  std::string cubin(size, '\0');
  check(nvrtcGetCUBIN(program, cubin.data()), "nvrtcGetCUBIN");
  nvrtcDestroyProgram(&program);
  return cubin;
}

// The cuLaunchKernelEx config of a 1D launch of a benchmark kernel. With `pdl` the launch may
// start while the grid before it drains (the kernel waits on griddepcontrol before it reads);
// `attribute` holds that setting and must outlive the launch. Each program calls the driver
// through its own loader.
inline CUlaunchConfig launch_config(unsigned grid, unsigned block, unsigned shared_bytes,
                                    CUstream stream, bool pdl, CUlaunchAttribute& attribute) {
  attribute = CUlaunchAttribute{};
  attribute.id = CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
  attribute.value.programmaticStreamSerializationAllowed = 1;
  CUlaunchConfig config{};
  config.gridDimX = grid;
  config.gridDimY = 1;
  config.gridDimZ = 1;
  config.blockDimX = block;
  config.blockDimY = 1;
  config.blockDimZ = 1;
  config.sharedMemBytes = shared_bytes;
  config.hStream = stream;
  config.attrs = pdl ? &attribute : nullptr;
  config.numAttrs = pdl ? 1 : 0;
  return config;
}

}  // namespace moejit::bench
