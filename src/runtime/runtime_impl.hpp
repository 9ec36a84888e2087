// The process runtime: configuration, shape registry, kernel store, and the table of loaded
// kernels the ops' hot path reads.
#pragma once

#include <cuda.h>

#include <memory>
#include <mutex>
#include <shared_mutex>
#include <string>
#include <unordered_map>

#include "cache/kernel_store.hpp"
#include "moejit/kernel_spec.hpp"
#include "moejit/runtime.hpp"

namespace moejit::detail {

struct KernelSpecHash {
  std::size_t operator()(const KernelSpec& s) const noexcept { return s.hash(); }
};

class Runtime {
 public:
  static Runtime& instance();

  const RuntimeConfig& config() const { return config_; }
  void configure(const RuntimeConfig& config);

  // Build (memory / disk / compile) one kernel; never loads it on a GPU.
  BuildResult build(const KernelSpec& spec);
  // The cache key of `spec` (codegen + options + toolkit digest + NVRTC version + schema).
  std::string cache_key(const KernelSpec& spec);

  // Hot path. The arch of the device bound to the calling thread's current context.
  Arch current_arch();
  // Hot path. The loaded kernel for `spec` (spec.arch must be current_arch()). A miss builds and
  // loads it, unless `stream` is capturing and compiling during capture is not allowed (then
  // Error{kCaptureMiss}). The handle stays valid for the life of the process.
  CUkernel kernel(const KernelSpec& spec, CUstream stream);

  KernelStore& store();

 private:
  Runtime();
  RuntimeConfig config_;
  std::mutex setup_mutex_;
  std::shared_ptr<KernelStore> store_;
  std::shared_mutex loaded_mutex_;
  std::unordered_map<KernelSpec, CUkernel, KernelSpecHash> loaded_;
};

}  // namespace moejit::detail
