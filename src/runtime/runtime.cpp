// The process runtime: configuration from the environment, builds through the kernel store,
// context-independent kernel loading, the current device's arch, and prewarm.
#include "runtime/runtime_impl.hpp"

#include <pwd.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <chrono>
#include <cstdint>
#include <ctime>
#include <exception>
#include <filesystem>
#include <optional>
#include <sstream>
#include <system_error>
#include <thread>
#include <unordered_set>
#include <utility>

#include "codegen/embedded.hpp"
#include "common/env.hpp"
#include "common/fork.hpp"
#include "common/hash.hpp"
#include "common/log.hpp"
#include "driver/driver.hpp"
#include "moejit/error.hpp"
#include "moejit/version.hpp"

namespace moejit {
namespace detail {
namespace {

std::string lower(std::string text) {
  for (char& c : text) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return text;
}

CacheMode parse_cache_mode(const std::string& text) {
  const std::string value = lower(text);
  if (value == "rw" || value == "read-write" || value == "readwrite") return CacheMode::kReadWrite;
  if (value == "ro" || value == "read-only" || value == "readonly") return CacheMode::kReadOnly;
  if (value == "memory" || value == "mem" || value == "none") return CacheMode::kMemoryOnly;
  throw Error(ErrorCode::kInvalidArgument,
              "MOEJIT_CACHE_MODE=" + text +
                  " is not a cache mode; expected rw (read and publish), ro (read a cache baked "
                  "into an image, never write) or memory (no disk at all)");
}

bool parse_switch(const char* name, const std::string& text) {
  const std::string value = lower(text);
  if (value == "1" || value == "true" || value == "yes" || value == "on") return true;
  if (value == "0" || value == "false" || value == "no" || value == "off") return false;
  throw Error(ErrorCode::kInvalidArgument,
              std::string(name) + "=" + text + " is not a switch; expected 1 or 0");
}

// The user's home from the password database, for a process started without $HOME.
std::string home_from_passwd() {
  long size = sysconf(_SC_GETPW_R_SIZE_MAX);
  std::string buffer(size > 0 ? static_cast<std::size_t>(size) : 16384, '\0');
  passwd entry{};
  passwd* found = nullptr;
  if (getpwuid_r(geteuid(), &entry, buffer.data(), buffer.size(), &found) != 0 ||
      found == nullptr || found->pw_dir == nullptr) {
    return "";
  }
  return found->pw_dir;
}

// MOEJIT_CACHE_DIR, else $XDG_CACHE_HOME/moejit, else $HOME/.cache/moejit ("" when none).
std::string default_cache_dir() {
  if (auto dir = env("MOEJIT_CACHE_DIR")) return *dir;
  // Why: the XDG spec says a relative XDG_CACHE_HOME is invalid and must be ignored.
  if (auto xdg = env("XDG_CACHE_HOME"); xdg && xdg->front() == '/') return *xdg + "/moejit";
  std::string home = env("HOME").value_or(home_from_passwd());
  if (home.empty()) return "";
  return home + "/.cache/moejit";
}

RuntimeConfig resolved(RuntimeConfig config) {
  if (config.cache_dir.empty() && config.cache_mode != CacheMode::kMemoryOnly) {
    config.cache_dir = default_cache_dir();
    if (config.cache_dir.empty()) {
      log().warn(
          "no cache directory: MOEJIT_CACHE_DIR, XDG_CACHE_HOME and HOME are unset and the user "
          "has no home directory; kernels are kept in memory only (set MOEJIT_CACHE_DIR)");
      config.cache_mode = CacheMode::kMemoryOnly;
    }
  }
  return config;
}

const char* outcome_name(CacheOutcome outcome) {
  switch (outcome) {
    case CacheOutcome::kMemoryHit: return "memory hit";
    case CacheOutcome::kDiskHit: return "disk hit";
    case CacheOutcome::kCompiled: return "compiled";
    case CacheOutcome::kCompiledNotStored: return "compiled (not stored)";
  }
  return "unknown";
}

// The register / spill report lines of an NVRTC log (-Xptxas=-v), for the manifest.
std::string ptxas_lines(const std::string& log_text) {
  std::istringstream in(log_text);
  std::string line;
  std::string out;
  while (std::getline(in, line)) {
    if (line.find("ptxas") == std::string::npos) continue;
    if (!out.empty()) out += '\n';
    out += line;
  }
  return out;
}

// Where a failed compile's source is saved: beside the cache when it is writable, else a
// per-user directory under the system temp dir.
std::string failure_dir_for(const DiskCache& disk) {
  if (disk.effective_mode() == CacheMode::kReadWrite && !disk.dir().empty()) {
    return disk.dir() + "/failed";
  }
  std::error_code ec;
  std::filesystem::path temp = std::filesystem::temp_directory_path(ec);
  if (ec) temp = "/tmp";
  return (temp / ("moejit-failed-" + std::to_string(geteuid()))).string();
}

bool is_capture_error(CUresult result) {
  return result == CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED ||
         result == CUDA_ERROR_STREAM_CAPTURE_INVALIDATED ||
         result == CUDA_ERROR_STREAM_CAPTURE_IMPLICIT ||
         result == CUDA_ERROR_CAPTURED_EVENT || result == CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD;
}

std::string stream_text(CUstream stream) {
  std::ostringstream os;
  os << static_cast<const void*>(stream);
  return os.str();
}

[[noreturn]] void throw_no_context(const DriverApi& api, CUresult result) {
  CUcontext context = nullptr;
  const bool no_context = result == CUDA_ERROR_INVALID_CONTEXT ||
                          result == CUDA_ERROR_CONTEXT_IS_DESTROYED ||
                          (api.cuCtxGetCurrent(&context) == CUDA_SUCCESS && context == nullptr);
  if (no_context) {
    throw Error(ErrorCode::kDriver,
                "no usable CUDA context is current on this thread (cuCtxGetDevice: " +
                    describe(result) +
                    "). libmoejit launches on the device of the caller's current context and "
                    "compiles for its arch: make a context current first, e.g. cudaSetDevice(n) "
                    "(CUDA runtime) or cuDevicePrimaryCtxRetain + cuCtxSetCurrent (driver API)");
  }
  throw_driver_error(result, "cuCtxGetDevice(&device)", __FILE__, __LINE__);
}

int encode_arch(const Arch& arch) { return arch.sm * 2 + (arch.arch_specific ? 1 : 0) + 1; }
Arch decode_arch(int code) {
  Arch arch;
  arch.sm = (code - 1) / 2;
  arch.arch_specific = (code - 1) % 2 == 1;
  return arch;
}

}  // namespace

bool stream_capturing(const DriverApi& api, const KernelSpec& spec, CUstream stream) {
  CUstreamCaptureStatus status = CU_STREAM_CAPTURE_STATUS_NONE;
  const CUresult result = api.cuStreamIsCapturing(stream, &status);
  if (result == CUDA_ERROR_STREAM_CAPTURE_IMPLICIT) return true;
  if (result != CUDA_SUCCESS) {
    std::string message = "kernel " + spec.display_name() + ": asking whether stream " +
                          stream_text(stream) +
                          " is capturing (cuStreamIsCapturing) failed: " + describe(result);
    if (result == CUDA_ERROR_INVALID_HANDLE || result == CUDA_ERROR_INVALID_VALUE ||
        result == CUDA_ERROR_CONTEXT_IS_DESTROYED) {
      message += ". Pass a live stream (or 0, the current context's default stream)";
    }
    throw Error(ErrorCode::kDriver, message);
  }
  return status != CU_STREAM_CAPTURE_STATUS_NONE;
}

KeyInputs make_key_inputs(const GeneratedSource& source, const Arch& arch, bool line_info) {
  KeyInputs inputs;
  inputs.schema_version = kCacheSchemaVersion;
  inputs.pipeline_version = kCompilePipelineVersion;
  inputs.nvrtc_version = nvrtc_identity();
  inputs.options = compile_options(arch, line_info);
  inputs.arch = arch.name();
  inputs.program_name = source.file_name;
  inputs.source = source.source;
  inputs.name_expression = source.name_expression;
  const std::vector<EmbeddedHeader>& headers = embedded_headers();
  inputs.headers.reserve(headers.size());
  for (const EmbeddedHeader& header : headers) {
    inputs.headers.push_back(KeyHeader{header.path, header.content});
  }
  return inputs;
}

Runtime& Runtime::instance() {
  // Why leaked: ops may run from threads that outlive static destruction at exit, and loaded
  // kernels are never unloaded anyway (the driver reclaims them with the process).
  static Runtime* runtime = new Runtime();
  return *runtime;
}

Runtime::Runtime() {
  // Why: a process that forks (a prefork server, Python multiprocessing) while another thread
  // holds one of these would leave its child waiting on the copy forever. In this order: a
  // thread holding setup_mutex_ may create a store (the fork guard's lock, then), and one
  // holding load_mutex_ takes loaded_mutex_; none is held while an earlier one is taken.
  hold_across_fork(&setup_mutex_);
  hold_across_fork(&keys_mutex_);
  hold_across_fork(&load_mutex_);
  hold_across_fork(&loaded_mutex_);
  try {
    config_ = resolved(RuntimeConfig::from_environment());
  } catch (const Error& e) {
    config_ = resolved(RuntimeConfig{});
    environment_error_ = e;
  }
  check_pointers_.store(config_.check_pointers);
}

int Runtime::gpu_loads_in_flight_here() {
  if (gpu_loads_generation_ != fork_generation()) {
    gpu_loads_generation_ = fork_generation();
    gpu_loads_in_flight_ = 0;
  }
  return gpu_loads_in_flight_;
}

class Runtime::GpuLoadScope {
 public:
  explicit GpuLoadScope(Runtime& runtime) : runtime_(runtime) {
    std::lock_guard<std::mutex> lock(runtime_.setup_mutex_);
    runtime_.gpu_loads_in_flight_here();
    ++runtime_.gpu_loads_in_flight_;
  }
  // Runs on the thread that made it, so in the process (and fork generation) that counted it.
  ~GpuLoadScope() {
    std::lock_guard<std::mutex> lock(runtime_.setup_mutex_);
    --runtime_.gpu_loads_in_flight_;
  }
  GpuLoadScope(const GpuLoadScope&) = delete;
  GpuLoadScope& operator=(const GpuLoadScope&) = delete;

 private:
  Runtime& runtime_;
};

void Runtime::configure(const RuntimeConfig& config) {
  RuntimeConfig next = resolved(config);
  std::lock_guard<std::mutex> lock(setup_mutex_);
  // Why check_pointers may change once kernels are loaded: it is read per op call and changes
  // no kernel. (Before, a configure() with the same settings still gives a fresh store.)
  const int loads_in_flight = gpu_loads_in_flight_here();
  if ((loads_in_flight > 0 || gpu_loaded_.load()) && !environment_error_ &&
      next.cache_dir == config_.cache_dir && next.cache_mode == config_.cache_mode &&
      next.allow_compile_during_capture == config_.allow_compile_during_capture &&
      next.line_info == config_.line_info) {
    store_check_pointers(next.check_pointers);
    return;
  }
  if (loads_in_flight > 0) {
    throw Error(ErrorCode::kInvalidArgument,
                "moejit::configure() called while another thread is loading a kernel on a GPU "
                "under the current configuration; configure the runtime once, before the first "
                "op or kernel load");
  }
  if (gpu_loaded_.load()) {
    throw Error(ErrorCode::kInvalidArgument,
                "moejit::configure() called after kernels were loaded on a GPU (from cache " +
                    (config_.cache_dir.empty() ? std::string("in memory") : config_.cache_dir) +
                    "); configure the runtime once, before the first op or kernel load (after "
                    "it, only check_pointers may change: start from moejit::config())");
  }
  config_ = std::move(next);
  check_pointers_.store(config_.check_pointers);
  environment_error_.reset();
  if (store_) retired_stores_.push_back(std::move(store_));
  store_.reset();
  log().debug("runtime configured: cache {} ({})", config_.cache_dir,
              config_.cache_mode == CacheMode::kReadWrite   ? "rw"
              : config_.cache_mode == CacheMode::kReadOnly ? "ro"
                                                            : "memory");
}

RuntimeConfig Runtime::config() {
  std::lock_guard<std::mutex> lock(setup_mutex_);
  return config_;
}

void Runtime::store_check_pointers(bool on) {
  config_.check_pointers = on;
  check_pointers_.store(on);
}

bool Runtime::set_check_pointers(bool on) {
  std::lock_guard<std::mutex> lock(setup_mutex_);
  const bool previous = config_.check_pointers;
  store_check_pointers(on);
  return previous;
}

std::shared_ptr<KernelStore> Runtime::current_store(RuntimeConfig* config_out) {
  std::lock_guard<std::mutex> lock(setup_mutex_);
  if (environment_error_) throw *environment_error_;
  if (!store_) {
    auto disk = std::make_shared<const DiskCache>(config_.cache_dir, config_.cache_mode);
    store_ = std::make_shared<KernelStore>(std::move(disk));
  }
  if (config_out != nullptr) *config_out = config_;
  return store_;
}

KernelStore& Runtime::store() { return *current_store(nullptr); }

KeyInputs Runtime::key_inputs(const KernelSpec& spec) {
  RuntimeConfig config;
  current_store(&config);  // for the configuration (and a bad environment's error)
  const GeneratedSource source = render(spec);
  return make_key_inputs(source, spec.arch, config.line_info);
}

std::string Runtime::cache_key(const KernelSpec& spec) { return compute_key(key_inputs(spec)); }

BuildResult Runtime::build(const KernelSpec& spec) { return build_impl(spec, nullptr); }

std::string Runtime::memoized_key(const KernelSpec& spec, bool line_info,
                                  std::optional<GeneratedSource>* source) {
  KeyMemo memo{spec, line_info};
  {
    std::lock_guard<std::mutex> lock(keys_mutex_);
    auto it = keys_.find(memo);
    if (it != keys_.end()) return it->second;
  }
  // Outside the lock: two threads may compute the same key, and both get the same string.
  *source = render(spec);
  std::string key = compute_key(make_key_inputs(**source, spec.arch, line_info));
  std::lock_guard<std::mutex> lock(keys_mutex_);
  return keys_.emplace(std::move(memo), std::move(key)).first->second;
}

BuildResult Runtime::build_impl(const KernelSpec& spec, std::shared_ptr<const Entry>* entry_out) {
  RuntimeConfig config;
  std::shared_ptr<KernelStore> store = current_store(&config);
  std::optional<GeneratedSource> source;  // rendered only for a new key or a compile
  const std::string key = memoized_key(spec, config.line_info, &source);
  const std::string name = spec.display_name();

  bool compiled_here = false;
  auto compile_entry = [&]() -> Entry {
    compiled_here = true;
    log().debug("cache miss: {} (key {}): compiling", name, key);
    if (!source) source = render(spec);
    CompiledKernel compiled =
        compile(*source, spec.arch, failure_dir_for(store->disk()), config.line_info);
    Entry entry;
    Manifest& manifest = entry.manifest;
    manifest.key = key;
    manifest.kernel = name;
    manifest.spec_json = spec.to_json();
    manifest.lowered_name = compiled.lowered_name;
    manifest.options = compiled.options;
    manifest.nvrtc_version = nvrtc_version();
    manifest.library_version = kVersionString;
    manifest.compile_ms = compiled.compile_ms;
    manifest.ptxas_info = ptxas_lines(compiled.log);
    manifest.cubin_size = compiled.cubin.size();
    manifest.cubin_hash = hash_bytes(compiled.cubin).hex();
    manifest.created_unix = static_cast<int64_t>(std::time(nullptr));
    entry.cubin = std::move(compiled.cubin);
    log().info("compiled {} in {:.1f} ms (key {})", name, compiled.compile_ms, key);
    return entry;
  };

  const auto start = std::chrono::steady_clock::now();
  KernelStore::Result found = store->get(key, compile_entry);
  if ((found.outcome == CacheOutcome::kCompiled ||
       found.outcome == CacheOutcome::kCompiledNotStored) &&
      !compiled_here) {
    // Why: this caller joined another thread's compile of the same key and got the kernel from
    // memory; reporting kCompiled to every waiter would count one compile many times.
    found.outcome = CacheOutcome::kMemoryHit;
    found.milliseconds =
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start)
            .count();
  }
  if (found.outcome == CacheOutcome::kMemoryHit || found.outcome == CacheOutcome::kDiskHit) {
    log().debug("cache {}: {} (key {}, {:.3f} ms)", outcome_name(found.outcome), name, key,
                found.milliseconds);
  }
  if (entry_out != nullptr) *entry_out = found.entry;
  BuildResult result;
  result.spec = spec;
  result.outcome = found.outcome;
  result.milliseconds = found.milliseconds;
  result.key = key;
  return result;
}

CurrentDevice Runtime::current_device() {
  const DriverApi& api = driver();
  CUdevice device = 0;
  const CUresult result = api.cuCtxGetDevice(&device);
  if (result != CUDA_SUCCESS) throw_no_context(api, result);
  if (device >= 0 && device < kMaxCachedDevices) {
    const int code = device_arch_[static_cast<std::size_t>(device)].load(std::memory_order_acquire);
    if (code != 0) return CurrentDevice{device, decode_arch(code)};
  }
  return query_device(device);
}

CurrentDevice Runtime::query_device(int ordinal) {
  const DriverApi& api = driver();
  int major = 0;
  int minor = 0;
  MOEJIT_CU_CHECK(
      api.cuDeviceGetAttribute(&major, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, ordinal));
  MOEJIT_CU_CHECK(
      api.cuDeviceGetAttribute(&minor, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, ordinal));
  CurrentDevice out;
  out.ordinal = ordinal;
  out.arch.sm = major * 10 + minor;
  // Why: from sm_90 on, arch-specific features (wgmma, setmaxnreg, tcgen05) need the "a"
  // target, and a cubin for sm_90a runs only on sm_90 devices, which is exactly this device.
  out.arch.arch_specific = out.arch.sm >= 90;
  if (ordinal >= 0 && ordinal < kMaxCachedDevices) {
    device_arch_[static_cast<std::size_t>(ordinal)].store(encode_arch(out.arch),
                                                          std::memory_order_release);
    log().debug("device {} compiles for {}", ordinal, out.arch.name());
  }
  return out;
}

CUkernel Runtime::load(const KernelSpec& spec, CUstream stream) {
  const DriverApi& api = driver();
  const CurrentDevice device = current_device();
  if (!(device.arch == spec.arch)) {
    throw Error(ErrorCode::kInvalidArgument,
                "kernel " + spec.display_name() + " was requested for " + spec.arch.name() +
                    ", but the current context's device " + std::to_string(device.ordinal) +
                    " is " + device.arch.name() + ": build the spec with Runtime::current_arch()");
  }
  // Counted from here, before anything below reads the configuration (configure() refuses
  // while a load is in flight).
  const GpuLoadScope in_flight(*this);
  const bool capturing = stream_capturing(api, spec, stream);
  const std::string capture_context =
      "stream " + stream_text(stream) + " is capturing a CUDA graph";
  if (capturing) {
    // Why first: a spec no kernel serves fails whatever was prewarmed, so the capture error's
    // advice (prewarm first) would send the caller the wrong way.
    const std::string unsupported = supports(spec);
    if (!unsupported.empty()) throw Error(ErrorCode::kUnsupported, unsupported);
    bool allowed = false;
    {
      std::lock_guard<std::mutex> lock(setup_mutex_);
      allowed = config_.allow_compile_during_capture;
    }
    // Why refuse before touching the cache: loading a module (let alone compiling) inside a
    // capture stalls it and, in global capture mode, may invalidate it; a clear error at the call
    // that needs the kernel beats a broken graph found later.
    if (!allowed) {
      throw Error(ErrorCode::kCaptureMiss,
                  "kernel " + spec.display_name() + " is not loaded in this process yet, and " +
                      capture_context +
                      ": it would have to be loaded (and compiled, unless cached) during the "
                      "capture. Prewarm before capturing: call moejit::prewarm for the shape "
                      "with this device's context current (it compiles and loads), or run the "
                      "op once (a warm-up pass); `moejit prewarm` only fills the disk cache. Or "
                      "set MOEJIT_ALLOW_CAPTURE_COMPILE=1 to compile and load during capture");
    }
  }
  log().debug("kernel table miss: {}{}", spec.display_name(),
              capturing ? " (stream capturing; allowed by MOEJIT_ALLOW_CAPTURE_COMPILE)" : "");
  std::shared_ptr<const Entry> entry;
  const BuildResult built = build_impl(spec, &entry);
  CUresult failure = CUDA_SUCCESS;
  try {
    return load_built(spec, *entry, built.key, &failure);
  } catch (const Error& e) {
    if (capturing && is_capture_error(failure)) {
      throw Error(ErrorCode::kCaptureMiss,
                  std::string(e.what()) + ". The driver refuses to load code while " +
                      capture_context +
                      " (even with MOEJIT_ALLOW_CAPTURE_COMPILE=1): run the op once before "
                      "capturing");
    }
    throw;
  }
}

BuildResult Runtime::build_and_load(const KernelSpec& spec) {
  const GpuLoadScope in_flight(*this);
  std::shared_ptr<const Entry> entry;
  BuildResult built = build_impl(spec, &entry);
  CUresult failure = CUDA_SUCCESS;
  load_built(spec, *entry, built.key, &failure);
  return built;
}

CUkernel Runtime::load_built(const KernelSpec& spec, const Entry& entry, const std::string& key,
                             CUresult* failure) {
  const DriverApi& api = driver();
  // Why a mutex across the load: two threads that missed together load the library once; the
  // lock is not held across the build before it.
  std::lock_guard<std::mutex> load_lock(load_mutex_);
  {
    std::shared_lock<std::shared_mutex> lock(loaded_mutex_);
    auto it = loaded_.find(spec);
    if (it != loaded_.end()) return it->second;
  }
  const auto start = std::chrono::steady_clock::now();
  CUlibrary library = nullptr;
  // Why cuLibraryLoadData: a library is context-independent, so one load serves every context
  // and device of this arch in the process, and its CUkernel handles never need reloading.
  CUresult result = api.cuLibraryLoadData(&library, entry.cubin.data(), nullptr, nullptr, 0,
                                          nullptr, nullptr, 0);
  if (result != CUDA_SUCCESS) {
    *failure = result;
    std::string message = "loading kernel " + spec.display_name() + " (cache key " + key + ", " +
                          std::to_string(entry.cubin.size()) +
                          " bytes): cuLibraryLoadData failed: " + describe(result);
    if (result == CUDA_ERROR_NO_BINARY_FOR_GPU || result == CUDA_ERROR_INVALID_IMAGE ||
        result == CUDA_ERROR_UNSUPPORTED_PTX_VERSION) {
      message += ". The cubin was compiled by NVRTC " + nvrtc_version() + " for " +
                 spec.arch.name() + "; the driver may be older than that NVRTC (update it)";
    }
    throw Error(ErrorCode::kDriver, message);
  }
  CUkernel kernel = nullptr;
  result = api.cuLibraryGetKernel(&kernel, library, entry.manifest.lowered_name.c_str());
  if (result != CUDA_SUCCESS) {
    *failure = result;
    api.cuLibraryUnload(library);
    throw Error(ErrorCode::kDriver, "kernel " + spec.display_name() + " (cache key " + key +
                                        "): cuLibraryGetKernel(\"" +
                                        entry.manifest.lowered_name + "\") failed: " +
                                        describe(result));
  }
  gpu_loaded_.store(true);
  {
    std::unique_lock<std::shared_mutex> lock(loaded_mutex_);
    loaded_.emplace(spec, kernel);
  }
  const double ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
  log().debug("loaded {} ({} bytes) in {:.3f} ms", spec.display_name(), entry.cubin.size(), ms);
  return kernel;
}

const char* outcome_word(const BuildResult& r) noexcept {
  if (!r.error.empty()) return "failed";
  switch (r.outcome) {
    case CacheOutcome::kCompiled: return "compiled";
    case CacheOutcome::kCompiledNotStored: return "compiled (not stored)";
    case CacheOutcome::kDiskHit:
    case CacheOutcome::kMemoryHit: return "cached";
  }
  return "failed";
}

std::string failures_text(const std::vector<BuildResult>& results) {
  std::string text;
  for (const BuildResult& r : results) {
    if (r.error.empty()) continue;
    text += "  " + r.spec.display_name() + ":\n    ";
    for (char c : r.error) text += c == '\n' ? std::string("\n    ") : std::string(1, c);
    text += '\n';
  }
  return text;
}

}  // namespace detail

RuntimeConfig RuntimeConfig::from_environment() {
  RuntimeConfig config;
  config.cache_dir = detail::default_cache_dir();
  if (auto mode = detail::env("MOEJIT_CACHE_MODE")) {
    config.cache_mode = detail::parse_cache_mode(*mode);
  }
  if (auto allow = detail::env("MOEJIT_ALLOW_CAPTURE_COMPILE")) {
    config.allow_compile_during_capture =
        detail::parse_switch("MOEJIT_ALLOW_CAPTURE_COMPILE", *allow);
  }
  if (auto line_info = detail::env("MOEJIT_LINEINFO")) {
    config.line_info = detail::parse_switch("MOEJIT_LINEINFO", *line_info);
  }
  if (auto check = detail::env("MOEJIT_CHECK_POINTERS")) {
    config.check_pointers = detail::parse_switch("MOEJIT_CHECK_POINTERS", *check);
  }
  return config;
}

void configure(const RuntimeConfig& config) { detail::Runtime::instance().configure(config); }

RuntimeConfig config() { return detail::Runtime::instance().config(); }

bool set_check_pointers(bool on) { return detail::Runtime::instance().set_check_pointers(on); }

BuildResult build_kernel(const KernelSpec& spec) { return detail::Runtime::instance().build(spec); }

std::string kernel_source(const KernelSpec& spec) { return detail::render(spec).source; }

Arch current_arch() { return detail::Runtime::instance().current_arch(); }

std::vector<BuildResult> prewarm(
    const std::vector<ModelShape>& shapes, const std::vector<Arch>& archs, int jobs,
    const std::function<void(const BuildResult&, std::size_t, std::size_t)>& progress) {
  if (archs.empty()) {
    throw Error(ErrorCode::kInvalidArgument,
                "prewarm: archs: expected at least one arch (e.g. sm_90a), found none");
  }
  if (jobs < 0) {
    throw Error(ErrorCode::kInvalidArgument,
                "prewarm: jobs: expected 0 (one per hardware thread) or more, found " +
                    std::to_string(jobs));
  }
  // Why up front: an arch this NVRTC can't target, or an unusable environment (a bad
  // MOEJIT_CACHE_MODE), would fail every kernel the same way; the call's one error says so
  // instead of a compile failure per kernel.
  for (const Arch& arch : archs) {
    if (std::string why = detail::nvrtc_arch_problem(arch); !why.empty()) {
      throw Error(ErrorCode::kInvalidArgument, "prewarm: arch " + arch.name() + ": " + why);
    }
  }
  detail::Runtime& runtime = detail::Runtime::instance();
  try {
    runtime.store();
  } catch (const Error& e) {
    throw Error(e.code(), std::string("prewarm: ") + e.what());
  }
  // Every distinct kernel, in the order the shapes and archs first need it.
  std::vector<KernelSpec> specs;
  std::unordered_set<KernelSpec, detail::KernelSpecHash> seen;
  for (const ModelShape& shape : shapes) {
    for (const Arch& arch : archs) {
      for (KernelSpec& spec : plan_kernels(shape, arch)) {
        if (seen.insert(spec).second) specs.push_back(std::move(spec));
      }
    }
  }
  const std::size_t total = specs.size();
  std::vector<BuildResult> results(total);
  if (total == 0) return results;

  // Why load as well: a kernel already in the table needs no load when its op is captured into a
  // CUDA graph, so "prewarm, then capture" works without a warm-up pass. Only for the arch of the
  // device whose context is current on the calling thread; a CPU-only builder just compiles.
  std::optional<Arch> load_arch;
  if (const detail::DriverApi* api = detail::try_driver()) {
    CUdevice device = 0;
    if (api->cuCtxGetDevice(&device) == CUDA_SUCCESS) load_arch = runtime.current_arch();
  }
  std::atomic<std::size_t> next{0};
  std::mutex progress_mutex;
  std::size_t done = 0;
  std::exception_ptr progress_error;
  // What escaped a worker's loop (out of memory while recording a result): kept for the caller,
  // as an exception leaving a thread, or the caller's loop while threads run, would terminate the
  // process. The other workers stop claiming kernels.
  std::exception_ptr worker_error;
  std::atomic<bool> stopped{false};
  const auto claim = [&]() { return stopped.load() ? total : next.fetch_add(1); };
  const auto loop = [&]() {
    for (std::size_t i = claim(); i < total; i = claim()) {
      BuildResult result;
      try {
        result = load_arch && specs[i].arch == *load_arch ? runtime.build_and_load(specs[i])
                                                          : runtime.build(specs[i]);
      } catch (const std::exception& e) {
        result = BuildResult{};
        result.spec = specs[i];
        result.error = e.what();
      }
      std::lock_guard<std::mutex> lock(progress_mutex);
      results[i] = std::move(result);
      ++done;
      if (progress && !progress_error) {
        // Why: the callback is the caller's code on a pool thread; its exception is carried
        // back to the caller instead of terminating the process.
        try {
          progress(results[i], done, total);
        } catch (...) {
          progress_error = std::current_exception();
        }
      }
    }
  };
  const auto work = [&]() noexcept {
    try {
      loop();
    } catch (...) {
      stopped = true;
      std::lock_guard<std::mutex> lock(progress_mutex);
      if (!worker_error) worker_error = std::current_exception();
    }
  };

  unsigned wanted = jobs > 0 ? static_cast<unsigned>(jobs) : std::thread::hardware_concurrency();
  if (wanted == 0) wanted = 1;
  const std::size_t workers = std::min<std::size_t>(wanted, total);
  std::vector<std::thread> pool;
  pool.reserve(workers);  // so that starting a thread is the only thing that can fail below
  // Why the caller is one of the workers: if a thread can't be started, the caller's own loop
  // still finishes every kernel.
  for (std::size_t t = 1; t < workers; ++t) {
    try {
      pool.emplace_back(work);
    } catch (const std::exception& e) {
      detail::log().warn("prewarm: could not start worker thread {} ({}); continuing with {}", t,
                         e.what(), pool.size() + 1);
      break;
    }
  }
  work();
  for (std::thread& thread : pool) thread.join();
  if (worker_error) std::rethrow_exception(worker_error);
  if (progress_error) std::rethrow_exception(progress_error);
  return results;
}

}  // namespace moejit
