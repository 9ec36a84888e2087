// libmoejit: the process-wide runtime: shape registry, kernel cache, prewarm.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "moejit/kernel_spec.hpp"
#include "moejit/shape.hpp"

namespace moejit {

enum class CacheMode {
  kReadWrite,   // normal: load hits, publish compiles
  kReadOnly,    // load hits, never write (a cache baked into an image)
  kMemoryOnly,  // no disk at all
};

struct RuntimeConfig {
  // "" = MOEJIT_CACHE_DIR, else $XDG_CACHE_HOME/moejit, else ~/.cache/moejit.
  std::string cache_dir;
  CacheMode cache_mode = CacheMode::kReadWrite;
  // A miss during stream capture compiles instead of throwing.
  bool allow_compile_during_capture = false;
  // Kernels carry SASS-to-source line tables (NVRTC -lineinfo) for profilers. Off by default:
  // the tables make the large kernels' cubins ~4x bigger (slower to read, verify and load) and
  // change no instruction. A kernel built with them is a cache entry of its own.
  bool line_info = false;
  // Each op call asks the driver about every buffer it is given (tensors, weights, workspace,
  // repack targets) before it launches: cuPointerGetAttributes on each buffer's first and last
  // byte. Memory CUDA does not know (host memory from malloc, memory cuMemFree'd, a wrong
  // address), another device's memory, a buffer running past the end of its allocation, an end
  // in an unmapped hole of a reservation, an end mapped without access for this device
  // (cuMemMap without cuMemSetAccess), or an output, workspace or repack target with an end
  // mapped read-only is refused as Error{kInvalidArgument} naming the argument, instead of
  // faulting in a kernel. Managed memory, pinned host memory and memory mapped through cuMemMap
  // in chunks (expandable segments) pass (a tensor of such memory must still say kDLCUDA and the
  // device's ordinal, as torch's do: a DLTensor labelled kDLCUDAManaged or kDLCUDAHost is refused
  // by its label, checks on or off). Off by default: two driver calls per buffer on every
  // call (a forward took 3.9-5.0 us more on an H100). What it can't see: the inside of an
  // allocation (a tensor a caching allocator cut too small, or took back, still passes), and a
  // hole or a chunk without access between a buffer's two ends; pageable host memory that HMM
  // or ATS systems do let kernels read (it is refused). While the stream captures a graph, a
  // buffer with no memory yet passes (an allocation made in the capture), and a graph's replays
  // are not checked. The only field configure() may change after kernels are loaded.
  bool check_pointers = false;

  // The configuration the environment asks for (MOEJIT_CACHE_DIR, MOEJIT_CACHE_MODE, ...).
  // Throws Error{kInvalidArgument} naming a variable whose value can't be used.
  static RuntimeConfig from_environment();
};

// Replace the process runtime's configuration. Call before the first op; later calls throw
// Error{kInvalidArgument} once kernels are loaded, or while another thread is loading one (its
// build already read the configuration), unless they change nothing but check_pointers.
// Without a call the runtime takes the environment's (RuntimeConfig::from_environment); when a
// variable there can't be used, the first op or kernel build throws its error, and configure()
// replaces it.
void configure(const RuntimeConfig& config);
// A copy of the configuration in use, taken under the lock configure() writes it under, so any
// thread may ask while another configures. (Before 0.4.0 this returned a reference, which a
// concurrent configure() could change under its reader.)
RuntimeConfig config();
// Turns RuntimeConfig::check_pointers on or off for the ops' later calls, from any thread, before
// or after kernels are loaded; returns the previous setting. Nothing else of the configuration
// changes, and an unusable environment's error stays (what configure() would replace). The C ABI's
// moejit_set_check_pointers; MOEJIT_CHECK_POINTERS sets it at start-up.
bool set_check_pointers(bool on);

// Shape registry: an engine registers shape files at run time; the CLI uses the same calls.
// Registration is all-or-nothing per file; a name registered twice is refused.
std::vector<std::string> register_shapes_file(const std::string& path);
std::vector<std::string> register_shapes(const std::string& text, const std::string& source_name);
ModelShape registered_shape(const std::string& name);  // throws Error{kInvalidArgument}
std::vector<std::string> registered_shape_names();

// The kernels a shape needs on `arch`, each with a reason when unsupported. Throws
// Error{kInvalidDescriptor} for a shape no op can serve (moe_shape_problem's rules).
std::vector<KernelSpec> plan_kernels(const ModelShape& shape, const Arch& arch);

// The compile target of the device whose CUDA context is current on the calling thread: what the
// ops build and launch for (e.g. sm_90a on an H100 or H200), and the arch whose kernels prewarm
// also loads. Throws Error{kDriver} naming why without a driver or a current context.
Arch current_arch();

// How a kernel request was satisfied.
enum class CacheOutcome { kMemoryHit, kDiskHit, kCompiled, kCompiledNotStored };

struct BuildResult {
  KernelSpec spec;
  CacheOutcome outcome = CacheOutcome::kCompiled;
  double milliseconds = 0;   // compile time when compiled, load time otherwise
  std::string key;           // cache key (hex)
  std::string error;         // non-empty when the build failed
};

// Compile (or find) every kernel `shapes` need for each arch, `jobs` at a time (0: one per
// hardware thread). Never throws for one kernel's failure: it is reported in its BuildResult.
// `progress` is called after each; a kernel the arch can't run (supports()) fails with that
// reason, without a compile. Error{kInvalidArgument}, before any kernel: no arch, jobs < 0, an
// arch this NVRTC can't target, or an environment the runtime can't use (a bad
// MOEJIT_CACHE_MODE, ...).
std::vector<BuildResult> prewarm(const std::vector<ModelShape>& shapes,
                                 const std::vector<Arch>& archs, int jobs,
                                 const std::function<void(const BuildResult&, std::size_t done,
                                                          std::size_t total)>& progress = {});

// Compile (or find) one kernel for one arch and return how; throws on failure.
BuildResult build_kernel(const KernelSpec& spec);

// The generated CUDA source of one kernel (what `moejit source` prints).
std::string kernel_source(const KernelSpec& spec);

}  // namespace moejit
