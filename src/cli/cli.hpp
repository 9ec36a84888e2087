// The `moejit` command line: one function per subcommand, shared helpers, and the exit codes.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "cache/disk_cache.hpp"
#include "compile/nvrtc.hpp"
#include "moejit/error.hpp"
#include "moejit/kernel_spec.hpp"
#include "moejit/runtime.hpp"
#include "moejit/shape.hpp"

namespace moejit::cli {

// The exit codes, documented in `moejit --help` and README.md.
enum ExitCode : int {
  kExitOk = 0,           // success
  kExitWorkFailed = 1,   // some work failed: a kernel did not compile, a bad entry was found,
                         // gc or clear could not remove a file
  kExitUsage = 2,        // bad flags, unknown shape or family, no GPU to take --arch from
  kExitShapeFile = 3,    // a shape file is missing, unreadable or invalid
  kExitEnvironment = 4,  // the cache can't be used as asked (prewarm's kernels not stored),
                         // NVRTC unusable
};

// The footer of every --help: the exit codes and the environment switches.
std::string help_footer();

// A failure the CLI reports itself (not a library error): printed once as "moejit: <message>".
struct Failure {
  int exit_code;
  std::string message;
};

// Library error code -> exit code.
int exit_code_for(ErrorCode code);

// The arch `name` names ("sm_90a"), if it is well formed and this NVRTC can target it; else
// Failure{kExitUsage} saying which and why.
Arch parse_arch_option(const std::string& name);

// Every shape in `paths`, all files parsed before anything else happens. A file that can't be
// read or breaks a rule, or a name that two files (or one file passed twice) define, throws
// Failure{kExitShapeFile} with the DescriptorError's message or the two places.
std::vector<ModelShape> load_shape_files(const std::vector<std::string>& paths);

// The shape named `name` among `shapes` (read from `file`); Failure{kExitUsage} naming the shapes
// there when there is none.
const ModelShape& find_shape(const std::vector<ModelShape>& shapes, const std::string& name,
                             const std::string& file);

// A usage Failure naming the first kernel a shape needs that `arch` can't run (e.g. marlin_moe
// below sm_80), before anything is planned or compiled for it.
void require_arch_serves(const std::vector<ModelShape>& shapes, const Arch& arch);

// "500M", "2G", "1.5GiB", "4096" -> bytes (K/M/G/T are powers of 1024). nullopt when malformed.
std::optional<uint64_t> parse_size(const std::string& text);
std::string format_bytes(uint64_t bytes);       // "1.5 MiB"
std::string format_ms(double ms);               // "312 ms", "1.25 s"
std::string format_time(int64_t unix_seconds);  // local "2024-05-01 12:34:56"; "-" for 0

// The visible GPUs as the driver reports them.
struct GpuInfo {
  int ordinal = 0;
  std::string name;
  Arch arch;
  uint64_t memory_bytes = 0;
  long long dram_bytes_per_second = 0;  // peak; 0 when the driver does not report it
};
struct DriverInfo {
  bool loaded = false;
  std::string why_not;  // when !loaded
  int version = 0;      // cuDriverGetVersion, e.g. 12080
  std::vector<GpuInfo> gpus;
};
DriverInfo probe_driver();

// The arch libmoejit compiles for on a device of compute capability major.minor: the
// arch-specific variant ("a") from sm_90 on, where wgmma / tcgen05 need it.
Arch arch_for_compute_capability(int major, int minor);

// The runtime configured from the environment (MOEJIT_CACHE_DIR, MOEJIT_CACHE_MODE, ...).
void configure_from_environment();
const char* cache_mode_name(CacheMode mode);

// `readable`: afterwards, the cache's directories and files this user owns are made readable by
// every user (never writable): a cache baked into an image as root, read by a service user.
int run_prewarm(const std::vector<std::string>& files, const std::vector<std::string>& arch_names,
                int jobs, bool readable);
int run_source(const std::string& file, const std::string& shape_name, const std::string& family,
               const std::string& arch_name);
int run_plan(const std::string& file, const std::string& shape_name, const std::string& arch_name);
int run_list();
int run_verify();
int run_gc(const std::string& max_size);
int run_clear();
int run_doctor();

}  // namespace moejit::cli
