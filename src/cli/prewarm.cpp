// `moejit prewarm FILE... [--arch A[,B]] [-j N] [--readable]`: fill the cache before a server
// starts.
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <iostream>
#include <mutex>
#include <string>
#include <vector>

#include "cli/cli.hpp"
#include "moejit/error.hpp"
#include "runtime/runtime_impl.hpp"

namespace moejit::cli {
namespace {

std::vector<Arch> resolve_archs(const std::vector<std::string>& names) {
  std::vector<Arch> archs;
  auto add = [&archs](const Arch& arch) {
    if (std::find(archs.begin(), archs.end(), arch) == archs.end()) archs.push_back(arch);
  };
  if (!names.empty()) {
    for (const std::string& name : names) add(parse_arch_option(name));
    return archs;
  }
  DriverInfo info = probe_driver();
  for (const GpuInfo& gpu : info.gpus) add(gpu.arch);
  if (archs.empty()) {
    std::string why =
        info.loaded ? "the CUDA driver reports no GPU" : "no CUDA driver: " + info.why_not;
    throw Failure{kExitUsage, "no --arch given and no GPU to take it from (" + why +
                                  "). Name the targets, e.g. --arch sm_90a (H100/H200) or "
                                  "--arch sm_90a,sm_100a"};
  }
  return archs;
}

std::string first_line(const std::string& text) {
  std::size_t end = text.find('\n');
  return end == std::string::npos ? text : text.substr(0, end);
}

double median(std::vector<double> values) {
  if (values.empty()) return 0;
  std::sort(values.begin(), values.end());
  std::size_t n = values.size();
  return n % 2 == 1 ? values[n / 2] : (values[n / 2 - 1] + values[n / 2]) / 2;
}

void print_row(const char* outcome, const std::vector<double>& ms) {
  char line[160];
  if (ms.empty()) {
    std::snprintf(line, sizeof(line), "  %-22s %7d %12s %12s\n", outcome, 0, "-", "-");
  } else {
    double total = 0;
    for (double m : ms) total += m;
    std::snprintf(line, sizeof(line), "  %-22s %7zu %12s %12s\n", outcome, ms.size(),
                  format_ms(total).c_str(), format_ms(median(ms)).c_str());
  }
  std::cout << line;
}

// --readable: the cache's directories and files that this user owns, readable (and the
// directories searchable) by every user; nothing is made writable. Why: a cache is created
// private (0700 directories, 0600 entries), and one prewarmed as root into an image must be
// read by the unprivileged service that runs there. Returns how many modes changed; a path
// whose mode can't be changed is a Failure.
std::size_t make_readable(const std::string& dir) {
  namespace fs = std::filesystem;
  std::size_t changed = 0;
  const auto open_up = [&changed](const std::string& path) {
    struct stat st {};
    if (::lstat(path.c_str(), &st) != 0 || S_ISLNK(st.st_mode) || st.st_uid != ::geteuid()) {
      return;  // gone, a link (never followed) or another user's
    }
    if (!S_ISDIR(st.st_mode) && !S_ISREG(st.st_mode)) return;
    const mode_t mode = st.st_mode & 07777;
    const mode_t want =
        mode | S_IRGRP | S_IROTH | (S_ISDIR(st.st_mode) ? S_IXGRP | S_IXOTH : 0);
    if (want == mode) return;
    if (::chmod(path.c_str(), want) != 0) {
      // Why ENOENT passes: another process (a writer's temp file renamed into its entry, gc or
      // clear) may remove a file between the walk's lstat and this chmod. (The library never
      // removes a directory of the cache.)
      if (errno == ENOENT) return;
      throw Failure{kExitEnvironment, "--readable: cannot change the mode of " + path + ": " +
                                          std::strerror(errno)};
    }
    ++changed;
  };
  open_up(dir);
  std::error_code error;
  // Why skip: a directory another user made private is theirs to open, not this walk's to fail.
  fs::recursive_directory_iterator it(dir, fs::directory_options::skip_permission_denied, error);
  for (; !error && it != fs::recursive_directory_iterator(); it.increment(error)) {
    open_up(it->path().string());
  }
  if (error) {
    throw Failure{kExitEnvironment,
                  "--readable: cannot walk the cache " + dir + ": " + error.message()};
  }
  return changed;
}

// The first directory above `dir` that other users can't search, or "" (--readable's note).
std::string closed_ancestor(const std::string& dir) {
  namespace fs = std::filesystem;
  fs::path at = fs::absolute(fs::path(dir)).lexically_normal().parent_path();
  for (; !at.empty(); at = at.parent_path()) {
    struct stat st {};
    if (::stat(at.c_str(), &st) == 0 && (st.st_mode & S_IXOTH) == 0) return at.string();
    if (at == at.root_path()) break;
  }
  return "";
}

}  // namespace

int run_prewarm(const std::vector<std::string>& files, const std::vector<std::string>& arch_names,
                int jobs, bool readable) {
  // All-or-nothing: every file is parsed and validated before anything else happens.
  std::vector<ModelShape> shapes = load_shape_files(files);
  std::vector<Arch> archs = resolve_archs(arch_names);
  for (const Arch& arch : archs) require_arch_serves(shapes, arch);

  configure_from_environment();
  detail::Runtime& runtime = detail::Runtime::instance();
  const detail::DiskCache& disk = runtime.store().disk();
  if (disk.effective_mode() != CacheMode::kReadWrite) {
    std::string why = runtime.config().cache_mode == CacheMode::kReadWrite
                          ? "the cache dir " + disk.dir() +
                                " can't be used: " + disk.mode_reason() +
                                " (point MOEJIT_CACHE_DIR elsewhere if needed)"
                          : std::string("MOEJIT_CACHE_MODE asks for a ") +
                                cache_mode_name(runtime.config().cache_mode) +
                                " cache; unset it or set MOEJIT_CACHE_MODE=rw";
    throw Failure{kExitEnvironment, "prewarm needs a writable cache: " + why};
  }
  std::string arch_list;
  for (const Arch& a : archs) arch_list += (arch_list.empty() ? "" : ",") + a.name();
  std::cerr << "prewarm: " << shapes.size() << " shape(s) for " << arch_list << ", " << jobs
            << " job(s), cache " << disk.dir() << "\n";

  std::mutex print_mutex;
  auto progress = [&print_mutex](const BuildResult& r, std::size_t done, std::size_t total) {
    int width = static_cast<int>(std::to_string(total).size());
    char counter[48];
    std::snprintf(counter, sizeof(counter), "[%*zu/%zu]", width, done, total);
    std::string line = std::string(counter) + " " + detail::outcome_word(r) + " " +
                       r.spec.display_name() + "  " + format_ms(r.milliseconds);
    if (!r.error.empty()) line += ": " + first_line(r.error);
    std::lock_guard<std::mutex> lock(print_mutex);
    std::cerr << line << std::endl;
  };

  auto start = std::chrono::steady_clock::now();
  std::vector<BuildResult> results = prewarm(shapes, archs, jobs, progress);
  double wall_ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();

  std::vector<double> compiled;
  std::vector<double> not_stored;
  std::vector<double> cached;
  std::vector<double> failed;
  for (const BuildResult& r : results) {
    if (!r.error.empty()) {
      failed.push_back(r.milliseconds);
    } else if (r.outcome == CacheOutcome::kCompiled) {
      compiled.push_back(r.milliseconds);
    } else if (r.outcome == CacheOutcome::kCompiledNotStored) {
      not_stored.push_back(r.milliseconds);
    } else {
      cached.push_back(r.milliseconds);
    }
  }

  char header[160];
  std::snprintf(header, sizeof(header), "  %-22s %7s %12s %12s\n", "outcome", "kernels", "total",
                "median");
  std::cout << "\n" << header;
  print_row("compiled", compiled);
  if (!not_stored.empty()) print_row("compiled (not stored)", not_stored);
  print_row("already cached", cached);
  print_row("failed", failed);
  std::cout << "prewarm: " << results.size() << " kernel(s) for " << arch_list << ": "
            << compiled.size() << " compiled, ";
  if (!not_stored.empty()) std::cout << not_stored.size() << " compiled but not stored, ";
  std::cout << cached.size() << " already cached, " << failed.size() << " failed in "
            << format_ms(wall_ms) << " (cache " << disk.dir() << ")\n";
  if (readable) {
    const std::size_t changed = make_readable(disk.dir());
    std::cout << "prewarm: the cache is readable by every user, writable only by its owner ("
              << changed << " mode(s) changed)\n";
    if (std::string closed = closed_ancestor(disk.dir()); !closed.empty()) {
      std::cout << "prewarm: note: other users can't reach it: " << closed
                << " is not searchable by them\n";
    }
    // Why: a reader trusts only entries owned by itself or by root (a cache is code that runs
    // on the GPU), so readable entries of another user are ignored all the same.
    if (const uid_t me = ::geteuid(); me != 0) {
      std::cout << "prewarm: note: other users will not trust these entries: they load only "
                   "their own and root's (these are uid "
                << me << "'s); prewarm as root for a cache that other users load\n";
    }
  }
  if (!failed.empty()) {
    std::cout << "\nfailures:\n";
    std::cout << detail::failures_text(results);
    return kExitWorkFailed;
  }
  if (!not_stored.empty()) {
    // Why a failure: filling the cache is what prewarm is for, and these kernels would be
    // compiled again by the next process that needs them.
    std::cout << "\nprewarm: " << not_stored.size()
              << " kernel(s) compiled but not stored: the cache at " << disk.dir()
              << " refused them (why is logged above); the next process that needs them "
                 "compiles them again\n";
    return kExitEnvironment;
  }
  return kExitOk;
}

}  // namespace moejit::cli
