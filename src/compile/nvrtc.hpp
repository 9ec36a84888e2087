// NVRTC: compile a generated translation unit to a cubin for one arch.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "codegen/codegen.hpp"
#include "moejit/kernel_spec.hpp"

namespace moejit::detail {

// "13.0" (nvrtcVersion).
std::string nvrtc_version();

// nvrtc_version() and the loaded NVRTC library's file name and size ("13.0 libnvrtc.so.13
// 109338064"), computed once per process: the cache key's NVRTC field. Why more than the
// version: nvrtcVersion reports major.minor only, and a patch release (a ptxas fix among them)
// must not reuse cubins its predecessor built. The name and size carry no path, so machines with
// the same toolkit still share keys. The library is found by the address of its nvrtcVersion,
// else among the process's mapped files (a relative load path, a non-PIE executable), and its
// size is the mapped file's (mapped_file), whatever an upgrade has since put at its path; where it
// can't be located (a static link), just the version, with a warning.
const std::string& nvrtc_identity();

// A file this process maps, as /proc/self/maps names it (" (deleted)" dropped), and its size
// read through /proc/self/map_files: the size of the file mapped, even where its path now names
// another file (an upgrade renamed a new one over it) or none. The first mapping whose path
// `matches`; nullopt where none does or the process can't stat its own mappings.
struct MappedFile {
  std::string path;
  std::uintmax_t size = 0;
};
std::optional<MappedFile> mapped_file(const std::function<bool(const std::string&)>& matches);

// "" when NVRTC compiles a one-line kernel to a cubin (for its lowest target arch), else what
// went wrong: a missing libnvrtc-builtins shows here, not at the first real compile. For
// `moejit doctor`.
std::string nvrtc_self_test();

// The full option list for `arch`: every option of the compile, and so all of them go into the
// cache key. No include directory: the kernels include only the embedded headers, which are
// handed to NVRTC by name. `line_info` adds -lineinfo (RuntimeConfig::line_info).
std::vector<std::string> compile_options(const Arch& arch, bool line_info = false);

// The version of what compile() does with a cubin after NVRTC made it (the checks that decide a
// second compile, and that compile's options): part of the cache key, so a cubin kept from an
// older pipeline is built again rather than served. Bump it with any change there. 1: the
// faulting cp.async check (cubin_check.hpp) on every arch, then one compile with
// kNoL2CacheHintOption.
inline constexpr int kCompilePipelineVersion = 1;

// Defined for the compile that replaces a cubin holding the faulting cp.async form
// (cubin_check.hpp): kernels/moe/ptx.cuh then issues its weight copies without the L2 cache hint.
inline constexpr const char* kNoL2CacheHintOption = "-DMOEJIT_NO_L2_CACHE_HINT";

struct CompiledKernel {
  std::string cubin;          // the ELF image
  std::string lowered_name;   // mangled name from nvrtcGetLoweredName
  std::string log;            // NVRTC program log (with -Xptxas=-v: registers, spills)
  // The options of the compile that made `cubin`: compile_options, plus kNoL2CacheHintOption
  // where the first cubin held the faulting copy form.
  std::vector<std::string> options;
  double compile_ms = 0;
};

// Saves `src` (a source that failed to compile) as `failure_dir`/src.file_name; returns that
// path, or "" with *why saying what went wrong and where. Creates `failure_dir` and its missing
// parents with mode 0700, and writes only when the directory itself is not a symbolic link, is
// owned by this user and is not group- or world-writable (it may be a per-user directory under
// /tmp that another user created first). The file (mode 0600) is written under a temp name and
// renamed into place, so a symlink planted at the name is replaced, never followed. Never throws
// for a filesystem problem: a compile error must not be lost to a failed save.
std::string save_failed_source(const GeneratedSource& src, const std::string& failure_dir,
                               std::string* why);

// The steps of compile() that turn a failure into CompileError(kernel, options, log, saved
// source) like a failed compile (exposed for tests): an NVRTC API call's result other than
// NVRTC_SUCCESS (`call` names it; `log` is the compile's, "" before it), and
// count_faulting_hinted_copies on a cubin it can't read.
void require_nvrtc(int result, const char* call, const GeneratedSource& src,
                   const std::vector<std::string>& options, const std::string& log,
                   const std::string& failure_dir);
int faulting_copies(const GeneratedSource& src, const std::string& cubin,
                    const std::vector<std::string>& options, const std::string& log,
                    const std::string& failure_dir);

// Why this NVRTC cannot compile for `arch` (not among nvrtcGetSupportedArchs), naming the archs
// it can; "" when it can.
std::string nvrtc_arch_problem(const Arch& arch);

// Compile `src`. On failure throws CompileError naming the kernel and options, with the first
// lines of the log in the message and the source saved under `failure_dir` (if non-empty). A
// cubin holding the faulting cp.async form (cubin_check.hpp) is compiled again with
// kNoL2CacheHintOption; if that one still holds it, CompileError. Every NVRTC API failure and an
// unreadable cubin are CompileErrors too.
CompiledKernel compile(const GeneratedSource& src, const Arch& arch, const std::string& failure_dir,
                       bool line_info = false);

}  // namespace moejit::detail
