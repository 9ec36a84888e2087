// The process runtime: configuration, kernel store, and the table of loaded kernels the ops' hot
// path reads. (The shape registry lives in registry.cpp.)
#pragma once

#include <cuda.h>

#include <array>
#include <atomic>
#include <memory>
#include <mutex>
#include <optional>
#include <shared_mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "cache/kernel_store.hpp"
#include "cache/key.hpp"
#include "codegen/codegen.hpp"
#include "compile/nvrtc.hpp"
#include "driver/driver.hpp"
#include "moejit/error.hpp"
#include "moejit/kernel_spec.hpp"
#include "moejit/runtime.hpp"

namespace moejit::detail {

struct KernelSpecHash {
  std::size_t operator()(const KernelSpec& s) const noexcept { return s.hash(); }
};

// The device bound to the calling thread's current context.
struct CurrentDevice {
  int ordinal = -1;  // CUdevice ordinal (what DLPack calls device_id)
  Arch arch;         // its compile target: sm_<major><minor>, "a" from sm_90 on
};

// The key inputs of a rendered kernel: what Runtime::cache_key hashes. `line_info`: the
// configuration's (RuntimeConfig::line_info), which the compile options carry.
KeyInputs make_key_inputs(const GeneratedSource& source, const Arch& arch, bool line_info = false);

// Whether `stream` (or, for the legacy default stream, any stream in global mode) is capturing,
// asked through `api` on `spec`'s first request in this process. A failure throws Error{kDriver}
// naming the kernel and the stream (this is the first driver call that sees the caller's
// stream), with what to pass instead where the driver says the stream is not usable.
bool stream_capturing(const DriverApi& api, const KernelSpec& spec, CUstream stream);

class Runtime {
 public:
  static Runtime& instance();

  // A copy of the configuration, taken under setup_mutex_ (configure() writes it under the same).
  RuntimeConfig config();
  // RuntimeConfig::check_pointers alone, under setup_mutex_; returns the previous setting.
  bool set_check_pointers(bool on);
  // Replaces the configuration (empty cache_dir = the environment's), and with it a bad
  // environment's error. Throws Error{kInvalidArgument} once a kernel has been loaded on a GPU,
  // or while another thread is loading one, unless nothing but check_pointers changes.
  void configure(const RuntimeConfig& config);

  // Hot path: RuntimeConfig::check_pointers, one relaxed load.
  bool check_pointers() const { return check_pointers_.load(std::memory_order_relaxed); }

  // Build (memory / disk / compile) one kernel; never loads it on a GPU. Throws on failure.
  BuildResult build(const KernelSpec& spec);
  // Build, then load into the kernel table (no context needed: libraries are
  // context-independent), so a later kernel() hit needs no load, even during graph capture.
  BuildResult build_and_load(const KernelSpec& spec);
  // The cache key of `spec` (codegen + embedded headers + options + NVRTC version + schema).
  std::string cache_key(const KernelSpec& spec);
  // What cache_key() hashes for `spec`.
  KeyInputs key_inputs(const KernelSpec& spec);

  // Hot path: one driver call (cuCtxGetDevice) and a table read. Throws Error{kDriver} when no
  // context is current on this thread (or there is no driver).
  CurrentDevice current_device();
  Arch current_arch() { return current_device().arch; }

  // Hot path. The loaded kernel for `spec` (spec.arch must be the current device's arch). A hit
  // is a shared lock and a hash lookup. A miss builds (memory / disk / compile) and loads it,
  // unless `stream` is capturing: then Error{kCaptureMiss}, unless the config allows compiling
  // during capture. The handle is context-independent and stays valid for the life of the
  // process.
  CUkernel kernel(const KernelSpec& spec, CUstream stream) {
    {
      std::shared_lock<std::shared_mutex> lock(loaded_mutex_);
      auto it = loaded_.find(spec);
      if (it != loaded_.end()) return it->second;
    }
    return load(spec, stream);
  }

  // The current store (created on first use). Stays valid after a reconfigure.
  KernelStore& store();

 private:
  Runtime();
  std::shared_ptr<KernelStore> current_store(RuntimeConfig* config_out);
  BuildResult build_impl(const KernelSpec& spec, std::shared_ptr<const Entry>* entry_out);
  // The cache key of `spec` under `line_info`, computed once per process: rendering
  // the kernel and hashing it with the embedded headers (~280 KB) was most of a memory hit (13-15
  // us on the Debian machine, 17.5-20 on the H200 machine). When the key is computed here,
  // `*source` receives the rendering, which a compile then reuses.
  std::string memoized_key(const KernelSpec& spec, bool line_info,
                           std::optional<GeneratedSource>* source);
  CUkernel load(const KernelSpec& spec, CUstream stream);
  // Loads a built entry once per process; on a driver failure sets *failure, then throws.
  CUkernel load_built(const KernelSpec& spec, const Entry& entry, const std::string& key,
                      CUresult* failure);
  CurrentDevice query_device(int ordinal);
  // config_.check_pointers and its copy for the ops (check_pointers_); setup_mutex_ held.
  void store_check_pointers(bool on);

  RuntimeConfig config_;
  // Why kept, not thrown from the constructor: a bad MOEJIT_* variable must not stop
  // configure() from replacing the environment's settings. Until configure() is called, the
  // first use of the configuration (current_store) throws it.
  std::optional<moejit::Error> environment_error_;
  std::mutex setup_mutex_;  // config_, environment_error_, store_, retired_stores_
  std::shared_ptr<KernelStore> store_;
  std::vector<std::shared_ptr<KernelStore>> retired_stores_;  // keeps store() refs valid
  std::atomic<bool> gpu_loaded_{false};
  std::atomic<bool> check_pointers_{false};  // config_.check_pointers, for the ops to read
  // Loads (build then load, for a GPU) begun and not yet ended, under setup_mutex_. Why counted:
  // a load reads the configuration when it builds and sets gpu_loaded_ only once the driver
  // holds the kernel, so configure() in between would succeed and leave a kernel of the old
  // configuration loaded. configure() refuses while any is in flight.
  int gpu_loads_in_flight_ = 0;
  // The fork generation gpu_loads_in_flight_ counts in: a forked child inherits its parent's
  // count, but not the threads whose loads it counts, which would never end in the child.
  uint64_t gpu_loads_generation_ = 0;
  // gpu_loads_in_flight_ in this process (zero in a child that forked since it was counted).
  // Under setup_mutex_.
  int gpu_loads_in_flight_here();
  class GpuLoadScope;  // counts one load in gpu_loads_in_flight_ for its lifetime

  // memoized_key's table. What a key depends on besides the spec: line_info; the NVRTC version
  // and the embedded headers are fixed for the process.
  struct KeyMemo {
    KernelSpec spec;
    bool line_info = false;
    friend bool operator==(const KeyMemo& a, const KeyMemo& b) {
      return a.line_info == b.line_info && a.spec == b.spec;
    }
  };
  struct KeyMemoHash {
    std::size_t operator()(const KeyMemo& m) const noexcept {
      return m.spec.hash() ^ static_cast<std::size_t>(m.line_info);
    }
  };
  std::mutex keys_mutex_;
  std::unordered_map<KeyMemo, std::string, KeyMemoHash> keys_;

  std::shared_mutex loaded_mutex_;                   // loaded_
  std::unordered_map<KernelSpec, CUkernel, KernelSpecHash> loaded_;
  std::mutex load_mutex_;                            // one cuLibraryLoadData at a time

  // Arch per device ordinal, encoded as sm * 2 + arch_specific + 1 (0 = not queried yet).
  static constexpr int kMaxCachedDevices = 256;
  std::array<std::atomic<int>, kMaxCachedDevices> device_arch_{};
};

// How a prewarm reports one kernel: "compiled", "compiled (not stored)", "cached" (a memory or disk
// hit) or "failed" (r.error is set). The CLI's progress lines and the C ABI's callback use it.
const char* outcome_word(const BuildResult& r) noexcept;
// Every failed kernel of a prewarm, as the CLI and the C ABI report them: "  <kernel>:\n" then its
// whole error (the compile log's first lines, where the source was saved), each line indented by
// four spaces and ended by a newline. "" when none failed.
std::string failures_text(const std::vector<BuildResult>& results);

}  // namespace moejit::detail
