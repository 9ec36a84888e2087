// NVRTC: compile a generated translation unit to a cubin for one arch.
#pragma once

#include <string>
#include <vector>

#include "codegen/codegen.hpp"
#include "common/hash.hpp"
#include "moejit/kernel_spec.hpp"

namespace moejit::detail {

// The CUDA toolkit headers NVRTC needs (NVRTC 13 ships none of its own).
struct ToolkitHeaders {
  std::string include_dir;  // where cuda_bf16.h etc. were found
  // Every directory compile() passes as -I, in order: include_dir, then include_dir/cccl when the
  // toolkit keeps CCCL (cuda/std/..., nv/target) there, as CUDA 13 does.
  std::vector<std::string> include_dirs;
  // The toolkit files the digest covers, as include names relative to their include directory
  // (e.g. "cuda_bf16.h", "cuda/std/cstdint"), sorted.
  std::vector<std::string> files;
  // Hash of the content of every toolkit header the kernels can reach from their includes
  // (followed transitively), so a toolkit change changes every cache key.
  Digest digest;
};

// Found from, in order: `configured` (RuntimeConfig::cuda_include_dir), MOEJIT_CUDA_INCLUDE,
// $CUDA_HOME/include, $CUDA_PATH/include, /usr/local/cuda/include, /usr/local/cuda-*/include
// (newest), /opt/cuda/include, /usr/include. A directory qualifies when it holds cuda_bf16.h and
// cuda/std/cstdint (itself or under cccl/). The explicit settings (`configured`, then
// MOEJIT_CUDA_INCLUDE) are taken at their word: when set and not qualifying, Error{kCompileFailed}
// names that setting and the path, with no fallback. Otherwise the first qualifying candidate
// wins, and when none does, Error{kCompileFailed} lists every path tried and why each failed.
// Memoized per (configured, MOEJIT_CUDA_INCLUDE, CUDA_HOME, CUDA_PATH), successes only; the
// reference stays valid for the life of the process.
//
// Fingerprinting reads every reachable header (~10-20 ms), too slow for the first kernel request
// of a fresh process. With `stamp_dir` (the cache directory) the result is remembered there in a
// stamp that lists each file read with its size, mtime and inode, and each include candidate that
// was absent; a later process that finds every file unchanged and every absent one still absent
// takes the digest from the stamp (a few stat calls) instead of reading the headers again. The
// stamp is written only when `stamp_writable`, and ignored unless owned by this user or root and
// not group/world writable.
const ToolkitHeaders& toolkit_headers(const std::string& configured,
                                      const std::string& stamp_dir = {},
                                      bool stamp_writable = false);

// toolkit_headers without the per-process memo (for tests and tools that look at the stamp).
ToolkitHeaders locate_toolkit_headers(const std::string& configured, const std::string& stamp_dir,
                                      bool stamp_writable);

// The search's /usr/local/cuda-<version>/include candidates, with `parent` in place of
// /usr/local (for tests), newest version first. A name whose version is not dot-separated
// numbers that each fit an int (cuda-x, cuda-99999999999) is skipped.
std::vector<std::string> versioned_toolkit_includes(const std::string& parent);

// "13.0" (nvrtcVersion).
std::string nvrtc_version();

// nvrtc_version() and the loaded NVRTC library's file name and size ("13.0 libnvrtc.so.13
// 109338064"), computed once per process: the cache key's NVRTC field. Why more than the
// version: nvrtcVersion reports major.minor only, and a patch release (a ptxas fix among them)
// must not reuse cubins its predecessor built. The name and size carry no path, so machines with
// the same toolkit still share keys. Just the version where the library can't be located (a
// static link).
const std::string& nvrtc_identity();

// The full option list for `arch`, the include path excluded (it is machine-specific and does
// not go into the cache key; the toolkit header digest does). `line_info` adds -lineinfo
// (RuntimeConfig::line_info).
std::vector<std::string> compile_options(const Arch& arch, bool line_info = false);

// Defined for the compile that replaces a cubin holding the faulting cp.async form
// (cubin_check.hpp): kernels/moe/ptx.cuh then issues its weight copies without the L2 cache hint.
inline constexpr const char* kNoL2CacheHintOption = "-DMOEJIT_NO_L2_CACHE_HINT";

struct CompiledKernel {
  std::string cubin;          // the ELF image
  std::string lowered_name;   // mangled name from nvrtcGetLoweredName
  std::string log;            // NVRTC program log (with -Xptxas=-v: registers, spills)
  // The options of the compile that made `cubin`, include directories excluded: compile_options,
  // plus kNoL2CacheHintOption where the first cubin held the faulting copy form.
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

// Compile `src`. On failure throws CompileError naming the kernel and options, with the first
// lines of the log in the message and the source saved under `failure_dir` (if non-empty). A
// cubin holding the faulting cp.async form (cubin_check.hpp) is compiled again with
// kNoL2CacheHintOption; if that one still holds it, CompileError.
CompiledKernel compile(const GeneratedSource& src, const Arch& arch, const ToolkitHeaders& toolkit,
                       const std::string& failure_dir, bool line_info = false);

}  // namespace moejit::detail
