// NVRTC: compile one generated source to a cubin. The kernels include only the library's embedded
// headers (kernels/common/types.cuh says why), so NVRTC gets no include directory.
#include "compile/nvrtc.hpp"

#include <dlfcn.h>
#include <fcntl.h>
#include <nvrtc.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <optional>
#include <sstream>
#include <string_view>
#include <system_error>

#include "cache/file_io.hpp"
#include "codegen/embedded.hpp"
#include "common/check.hpp"
#include "common/log.hpp"
#include "compile/cubin_check.hpp"
#include "moejit/error.hpp"

// MOEJIT_NVRTC_CHECK(call): an NVRTC API call that must succeed (not a compile: compile() reads
// nvrtcCompileProgram's result itself and throws CompileError).
#define MOEJIT_NVRTC_CHECK(call)                                                                \
  do {                                                                                          \
    const nvrtcResult moejit_nvrtc_result_ = (call);                                            \
    MOEJIT_CHECK(moejit_nvrtc_result_ == NVRTC_SUCCESS, ::moejit::ErrorCode::kCompileFailed,    \
                 "NVRTC call " #call " failed: " << nvrtcGetErrorString(moejit_nvrtc_result_)); \
  } while (0)

namespace moejit::detail {

namespace fs = std::filesystem;

namespace {

constexpr std::size_t kLogLinesInMessage = 20;

bool is_dir(const fs::path& path) {
  std::error_code ec;
  return fs::is_directory(path, ec);
}

// The archs this NVRTC can target (e.g. 75, 80, ..., 120), once per process.
const std::vector<int>& supported_archs() {
  static const std::vector<int> archs = [] {
    int count = 0;
    MOEJIT_NVRTC_CHECK(nvrtcGetNumSupportedArchs(&count));
    std::vector<int> out(static_cast<std::size_t>(count));
    if (count > 0) MOEJIT_NVRTC_CHECK(nvrtcGetSupportedArchs(out.data()));
    return out;
  }();
  return archs;
}

// Owns one nvrtcProgram.
class Program {
 public:
  Program() = default;
  ~Program() {
    if (program_ != nullptr) nvrtcDestroyProgram(&program_);
  }
  Program(const Program&) = delete;
  Program& operator=(const Program&) = delete;
  nvrtcProgram get() const { return program_; }
  nvrtcProgram* out() { return &program_; }

  // The program log into *text; on failure a line saying why NVRTC gave none (so a compile's
  // error is not lost to a failed log) and the failed call's result.
  nvrtcResult log(std::string* text) const {
    std::size_t size = 0;
    nvrtcResult result = nvrtcGetProgramLogSize(program_, &size);
    std::string out(size, '\0');
    if (result == NVRTC_SUCCESS && size > 0) result = nvrtcGetProgramLog(program_, out.data());
    if (result != NVRTC_SUCCESS) {
      *text =
          std::string("(no log: nvrtcGetProgramLog failed: ") + nvrtcGetErrorString(result) + ")";
      return result;
    }
    while (!out.empty() && (out.back() == '\0' || out.back() == '\n')) out.pop_back();
    *text = std::move(out);
    return NVRTC_SUCCESS;
  }

 private:
  nvrtcProgram program_ = nullptr;
};

// Create `dir` and any missing parents with mode 0700. Returns "" or why it failed.
std::string make_private_dirs(const fs::path& dir) {
  fs::path partial;
  for (const fs::path& part : dir) {
    partial /= part;
    if (partial.empty() || is_dir(partial)) continue;
    if (::mkdir(partial.c_str(), 0700) != 0 && errno != EEXIST) {
      return "cannot create " + partial.string() + ": " + std::strerror(errno);
    }
  }
  return is_dir(dir) ? "" : dir.string() + " is not a directory";
}

std::string join(const std::vector<std::string>& parts) {
  std::string out;
  for (const std::string& part : parts) {
    if (!out.empty()) out += ' ';
    out += part;
  }
  return out;
}

std::string kernel_label(const GeneratedSource& src) {
  const std::string& f = src.file_name;
  return f.size() > 3 && f.compare(f.size() - 3, 3, ".cu") == 0 ? f.substr(0, f.size() - 3) : f;
}

[[noreturn]] void throw_compile_error(const GeneratedSource& src, const std::string& what,
                                      const std::vector<std::string>& options,
                                      const std::string& log, const std::string& failure_dir) {
  std::string why_not_saved;
  const std::string saved = save_failed_source(src, failure_dir, &why_not_saved);
  std::ostringstream os;
  os << "NVRTC " << nvrtc_version() << " could not compile kernel " << kernel_label(src) << " ("
     << src.name_expression << "): " << what << "\n  options: " << join(options);
  std::istringstream lines(log);
  std::string line;
  std::size_t shown = 0;
  std::size_t total = 0;
  std::ostringstream head;
  while (std::getline(lines, line)) {
    ++total;
    if (shown < kLogLinesInMessage) {
      head << "\n    " << line;
      ++shown;
    }
  }
  if (total == 0) {
    os << "\n  log: (empty)";
  } else {
    os << "\n  log (" << shown << " of " << total
       << " lines; all in CompileError::log()):" << head.str();
  }
  if (!saved.empty()) {
    os << "\n  source saved to " << saved;
  } else {
    os << "\n  source not saved: " << why_not_saved;
  }
  throw CompileError(os.str(), kernel_label(src), options, log, saved);
}

}  // namespace

std::string save_failed_source(const GeneratedSource& src, const std::string& failure_dir,
                               std::string* why) {
  why->clear();
  if (failure_dir.empty()) {
    *why = "no failure directory configured";
    return "";
  }
  const std::string& name = src.file_name;
  if (name.empty() || name == "." || name == ".." || name.find('/') != std::string::npos) {
    *why = "the source's file name '" + name + "' is not a plain file name";
    return "";
  }
  *why = make_private_dirs(failure_dir);
  if (!why->empty()) return "";
  // Why: the directory may sit in shared space (/tmp) where another local user can create it
  // first, or plant a symlink in it, to have this user's process overwrite a file of their
  // choosing. So it is opened without following a symlink and used only when it is ours and
  // no one else can add or replace entries in it; every step after that is relative to the
  // opened directory, so the directory checked is the one written in. (O_PATH: openat, renameat
  // and fstat need no read permission on the directory.)
  Fd dir(::open(failure_dir.c_str(), O_PATH | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC));
  if (!dir.ok()) {
    const int error = errno;
    struct stat at_path {};
    if (::lstat(failure_dir.c_str(), &at_path) == 0 && S_ISLNK(at_path.st_mode)) {
      *why = failure_dir + " is a symbolic link; not following it (remove it)";
    } else {
      *why = "cannot open " + failure_dir + ": " + errno_text(error);
    }
    return "";
  }
  struct stat st {};
  if (::fstat(dir.get(), &st) != 0) {
    *why = "cannot inspect " + failure_dir + ": " + errno_text(errno);
    return "";
  }
  if (!S_ISDIR(st.st_mode)) {
    *why = failure_dir + " is not a directory (a symbolic link is not followed; remove it)";
    return "";
  }
  if (st.st_uid != ::geteuid()) {
    *why = failure_dir + " is owned by uid " + std::to_string(st.st_uid) +
           ", not by this user (uid " + std::to_string(::geteuid()) +
           "); its owner could redirect what is written there (remove it; it is then "
           "created again, private to this user)";
    return "";
  }
  if ((st.st_mode & (S_IWGRP | S_IWOTH)) != 0) {
    char mode[8];
    std::snprintf(mode, sizeof(mode), "%04o", static_cast<unsigned>(st.st_mode & 07777));
    *why = failure_dir + " is writable by group or others (mode " + mode +
           "), who could plant a link where the source would go (fix: chmod go-w it)";
    return "";
  }
  const std::string path = (fs::path(failure_dir) / name).string();
  const std::string temp =
      "." + name + "." + std::to_string(::getpid()) + "." + random_hex() + ".tmp";
  Fd out(::openat(dir.get(), temp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC,
                  0600));
  if (!out.ok()) {
    *why = "cannot create " + failure_dir + "/" + temp + ": " + errno_text(errno);
    return "";
  }
  // Why rename: it replaces whatever is at `name` (a planted symlink included) without
  // following it, and a reader never sees a half-written file.
  if (int e = write_all(out.get(), src.source); e != 0) {
    *why = "cannot write " + failure_dir + "/" + temp + ": " + errno_text(e);
  } else if (int c = out.reset(); c != 0) {
    *why = "cannot close " + failure_dir + "/" + temp + ": " + errno_text(c);
  } else if (::renameat(dir.get(), temp.c_str(), dir.get(), name.c_str()) != 0) {
    *why = "cannot rename " + failure_dir + "/" + temp + " to " + path + ": " + errno_text(errno);
  }
  if (!why->empty()) {
    out.reset();
    ::unlinkat(dir.get(), temp.c_str(), 0);
    return "";
  }
  return path;
}

std::string nvrtc_version() {
  int major = 0;
  int minor = 0;
  MOEJIT_NVRTC_CHECK(nvrtcVersion(&major, &minor));
  return std::to_string(major) + "." + std::to_string(minor);
}

namespace {

bool is_nvrtc_library(const fs::path& path) {
  return path.filename().string().rfind("libnvrtc.so", 0) == 0;  // not libnvrtc-builtins
}

// The absolute path of the NVRTC library this process loaded, or "" (a static link). Why two
// ways: dladdr names the object holding nvrtcVersion's address, but by the name it was loaded
// under (a relative LD_LIBRARY_PATH entry gives a relative name, wrong after a chdir), and in a
// non-PIE executable that address is the executable's own PLT entry; /proc/self/maps names every
// mapped file by its absolute path.
fs::path loaded_nvrtc_path() {
  Dl_info info{};
  if (::dladdr(reinterpret_cast<void*>(&nvrtcVersion), &info) != 0 && info.dli_fname != nullptr) {
    const fs::path named(info.dli_fname);
    if (named.is_absolute() && is_nvrtc_library(named)) return named;
  }
  std::ifstream maps("/proc/self/maps");
  std::string line;
  while (std::getline(maps, line)) {
    const std::size_t slash = line.find('/');
    if (slash == std::string::npos) continue;
    const fs::path mapped(line.substr(slash));
    if (is_nvrtc_library(mapped)) return mapped;
  }
  return {};
}

}  // namespace

std::optional<MappedFile> mapped_file(const std::function<bool(const std::string&)>& matches) {
  constexpr std::string_view kDeleted = " (deleted)";
  std::ifstream maps("/proc/self/maps");
  std::string line;
  while (std::getline(maps, line)) {
    // "start-end perms offset dev inode path": the path is the rest of the line from its '/'.
    const std::size_t slash = line.find('/');
    if (slash == std::string::npos) continue;
    std::string path = line.substr(slash);
    if (path.size() > kDeleted.size() &&
        path.compare(path.size() - kDeleted.size(), kDeleted.size(), kDeleted) == 0) {
      path.resize(path.size() - kDeleted.size());
    }
    if (!matches(path)) continue;
    struct stat st {};
    const std::string range = line.substr(0, line.find(' '));
    if (::stat(("/proc/self/map_files/" + range).c_str(), &st) != 0 || !S_ISREG(st.st_mode)) {
      return std::nullopt;
    }
    return MappedFile{path, static_cast<std::uintmax_t>(st.st_size)};
  }
  return std::nullopt;
}

const std::string& nvrtc_identity() {
  static const std::string identity = [] {
    const std::string version = nvrtc_version();
    const fs::path path = loaded_nvrtc_path();
    std::error_code ec;
    const fs::path canonical = path.empty() ? path : fs::canonical(path, ec);
    const std::string wanted = path.empty() || ec ? std::string() : canonical.string();
    // Why the mapped file first: it is the library this process compiles with, where the file at
    // its path may be a newer one an upgrade put there since (whose size would key the old
    // library's cubins as its own), or none. The path is the fallback where the process can't
    // stat its own mappings. (No library found: a static link.)
    std::optional<MappedFile> mapped;
    if (!wanted.empty()) mapped = mapped_file([&](const std::string& p) { return p == wanted; });
    if (!mapped && !path.empty()) {
      mapped = mapped_file([](const std::string& p) { return is_nvrtc_library(fs::path(p)); });
    }
    fs::path file;
    std::uintmax_t size = 0;
    if (mapped) {
      file = mapped->path;
      size = mapped->size;
    } else if (!wanted.empty()) {
      file = canonical;
      std::error_code unsized;
      size = fs::file_size(file, unsized);
      if (unsized) size = 0;
    }
    if (file.empty() || size == 0) {
      log().warn(
          "the NVRTC library this process uses was not found among its mapped files (a "
          "static link?): cache keys name NVRTC {} by its version alone, so a patch "
          "release of it would reuse cubins its predecessor built",
          version);
      return version;
    }
    return version + " " + file.filename().string() + " " + std::to_string(size);
  }();
  return identity;
}

std::string nvrtc_self_test() {
  try {
    const std::vector<int>& archs = supported_archs();
    if (archs.empty()) return "this NVRTC reports no target arch";
    GeneratedSource src;
    src.file_name = "moejit_self_test.cu";
    src.source = "extern \"C\" __global__ void moejit_self_test(int* p) { *p = 1; }\n";
    const std::string sm = "sm_" + std::to_string(archs.front());
    const std::string arch = "--gpu-architecture=" + sm;
    const char* options[] = {arch.c_str(), "-std=c++17"};
    Program program;
    MOEJIT_NVRTC_CHECK(nvrtcCreateProgram(program.out(), src.source.c_str(), src.file_name.c_str(),
                                          0, nullptr, nullptr));
    const nvrtcResult result = nvrtcCompileProgram(program.get(), 2, options);
    if (result != NVRTC_SUCCESS) {
      std::string log;
      program.log(&log);
      return "a one-line kernel did not compile for " + sm + ": " +
             nvrtcGetErrorString(result) + (log.empty() ? "" : " (" + log.substr(0, 300) + ")");
    }
    std::size_t size = 0;
    MOEJIT_NVRTC_CHECK(nvrtcGetCUBINSize(program.get(), &size));
    return size > 0 ? "" : "a one-line kernel compiled to no cubin";
  } catch (const Error& e) {
    return e.what();
  }
}

std::vector<std::string> compile_options(const Arch& arch, bool line_info) {
  // Why: no fast-math (the kernels' accuracy is argued from IEEE expf and division); -Xptxas=-v
  // puts the register and spill report in the log, kept with each cache entry; -default-device
  // makes the kernels' unannotated helpers device functions. -lineinfo only when asked for: it
  // maps SASS to source for profilers without changing an instruction, but quadruples the
  // warpgroup GEMMs' cubins (112 KB to 447 KB for one FC1), which every first request in a
  // process reads, hashes and loads (tools/PERF_LOG.md "line tables on request").
  std::vector<std::string> options{arch.nvrtc_option(), "-std=c++17", "-default-device",
                                   "-Xptxas=-v"};
  if (line_info) options.emplace_back("-lineinfo");
  return options;
}

void require_nvrtc(int result, const char* call, const GeneratedSource& src,
                   const std::vector<std::string>& options, const std::string& log,
                   const std::string& failure_dir) {
  if (result == NVRTC_SUCCESS) return;
  throw_compile_error(
      src, std::string(call) + " failed: " + nvrtcGetErrorString(static_cast<nvrtcResult>(result)),
      options, log, failure_dir);
}

int faulting_copies(const GeneratedSource& src, const std::string& cubin,
                    const std::vector<std::string>& options, const std::string& log,
                    const std::string& failure_dir) {
  try {
    return count_faulting_hinted_copies(cubin);
  } catch (const Error& e) {
    throw_compile_error(src, std::string("the cubin NVRTC returned can't be checked: ") + e.what(),
                        options, log, failure_dir);
  }
}

namespace {

// One NVRTC run of `src` with `options`.
CompiledKernel run_nvrtc(const GeneratedSource& src, const Arch& arch,
                         const std::vector<std::string>& options, const std::string& failure_dir) {
  // Why: std::string copies, so each header is NUL-terminated whatever the embedded table holds.
  std::vector<std::string> contents;
  std::vector<std::string> names;
  for (const EmbeddedHeader& header : embedded_headers()) {
    contents.emplace_back(header.content);
    names.emplace_back(header.path);
  }
  std::vector<const char*> content_ptrs;
  std::vector<const char*> name_ptrs;
  for (std::size_t i = 0; i < contents.size(); ++i) {
    content_ptrs.push_back(contents[i].c_str());
    name_ptrs.push_back(names[i].c_str());
  }
  std::vector<const char*> option_ptrs;
  for (const std::string& option : options) option_ptrs.push_back(option.c_str());
  CompiledKernel out;  // its log, once the compile has made one, goes with every later failure
  const auto require = [&](nvrtcResult result, const char* call) {
    require_nvrtc(result, call, src, options, out.log, failure_dir);
  };
  Program program;
  require(nvrtcCreateProgram(program.out(), src.source.c_str(), src.file_name.c_str(),
                             static_cast<int>(content_ptrs.size()), content_ptrs.data(),
                             name_ptrs.data()),
          "nvrtcCreateProgram");
  require(nvrtcAddNameExpression(program.get(), src.name_expression.c_str()),
          "nvrtcAddNameExpression");
  const nvrtcResult result =
      nvrtcCompileProgram(program.get(), static_cast<int>(option_ptrs.size()), option_ptrs.data());
  const nvrtcResult logged = program.log(&out.log);
  if (result != NVRTC_SUCCESS) {
    throw_compile_error(src, nvrtcGetErrorString(result), options, out.log, failure_dir);
  }
  // Why a failure: the log is the entry's ptxas report (registers, spills), kept with the cubin.
  require(logged, "nvrtcGetProgramLog");

  const char* lowered = nullptr;
  require(nvrtcGetLoweredName(program.get(), src.name_expression.c_str(), &lowered),
          "nvrtcGetLoweredName");
  if (lowered == nullptr || *lowered == '\0') {
    throw_compile_error(src, "NVRTC returned no lowered name for " + src.name_expression, options,
                        out.log, failure_dir);
  }
  out.lowered_name = lowered;

  std::size_t cubin_size = 0;
  require(nvrtcGetCUBINSize(program.get(), &cubin_size), "nvrtcGetCUBINSize");
  if (cubin_size == 0) {
    throw_compile_error(
        src,
        "NVRTC produced no cubin with " + arch.nvrtc_option() + "; a cubin needs a real sm_ arch",
        options, out.log, failure_dir);
  }
  out.cubin.resize(cubin_size);
  require(nvrtcGetCUBIN(program.get(), out.cubin.data()), "nvrtcGetCUBIN");
  return out;
}

}  // namespace

std::string nvrtc_arch_problem(const Arch& arch) {
  const std::vector<int>& archs = supported_archs();
  if (std::find(archs.begin(), archs.end(), arch.sm) != archs.end()) return "";
  std::ostringstream os;
  os << arch.name() << " is not a target of this NVRTC; it supports:";
  for (int sm : archs) os << " sm_" << sm;
  os << ". Choose one of those, or use a toolkit that targets " << arch.name();
  return os.str();
}

CompiledKernel compile(const GeneratedSource& src, const Arch& arch, const std::string& failure_dir,
                       bool line_info) {
  const auto start = std::chrono::steady_clock::now();
  std::vector<std::string> options = compile_options(arch, line_info);

  if (std::string why = nvrtc_arch_problem(arch); !why.empty()) {
    throw_compile_error(src, why, options, "", failure_dir);
  }

  CompiledKernel out = run_nvrtc(src, arch, options, failure_dir);
  out.options = options;
  // Why: a cubin whose copies fault must never reach the cache (cubin_check.hpp). Without the
  // hint ptxas has no cache-policy operand to encode, so the rebuilt kernel takes the plain form.
  const int faulting = faulting_copies(src, out.cubin, options, out.log, failure_dir);
  if (faulting > 0) {
    // Why info, not warn: the rebuilt kernel is correct; it only lacks the hint (1-3%).
    log().info(
        "{} for {}: ptxas encoded {} cache-hinted cp.async as the LDGSTS form that faults "
        "(its policy register is never written); compiling it again with {}",
        kernel_label(src), arch.name(), faulting, kNoL2CacheHintOption);
    options.emplace_back(kNoL2CacheHintOption);
    out = run_nvrtc(src, arch, options, failure_dir);
    out.options = options;
    const int left = faulting_copies(src, out.cubin, options, out.log, failure_dir);
    if (left > 0) {
      std::ostringstream os;
      os << "ptxas encoded " << left << " cp.async as the LDGSTS form that faults even with "
         << kNoL2CacheHintOption << "; this NVRTC cannot build the kernel safely";
      throw_compile_error(src, os.str(), options, out.log, failure_dir);
    }
  }

  out.compile_ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
  log().info("compiled {} for {} in {:.0f} ms", kernel_label(src), arch.name(), out.compile_ms);
  return out;
}

}  // namespace moejit::detail
