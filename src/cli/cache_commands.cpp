// `moejit list | verify | gc --max-size SIZE | clear`: inspect and maintain the disk cache.
#include <algorithm>
#include <cstdio>
#include <iostream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "cache/disk_cache.hpp"
#include "cli/cli.hpp"
#include "runtime/runtime_impl.hpp"

namespace moejit::cli {
namespace {

// The disk cache the environment names, refusing modes the command can't work in. `removes`:
// the command removes files (gc, clear), which a cache made read-only by a full disk or quota
// still allows (DiskCache::removals_allowed).
const detail::DiskCache& open_cache(const char* command, bool removes) {
  configure_from_environment();
  detail::Runtime& runtime = detail::Runtime::instance();
  const detail::DiskCache& disk = runtime.store().disk();
  CacheMode requested = runtime.config().cache_mode;
  if (requested == CacheMode::kMemoryOnly) {
    throw Failure{kExitEnvironment, std::string(command) +
                                        ": MOEJIT_CACHE_MODE=memory means no disk cache; unset it "
                                        "to work on the cache at " +
                                        disk.dir()};
  }
  if (disk.effective_mode() == CacheMode::kMemoryOnly) {
    throw Failure{kExitEnvironment, std::string(command) + ": the cache at " + disk.dir() +
                                        " can't be used: " + disk.mode_reason()};
  }
  if (removes && !disk.removals_allowed()) {
    std::string why = requested == CacheMode::kReadOnly
                          ? "MOEJIT_CACHE_MODE=ro; unset it or set MOEJIT_CACHE_MODE=rw"
                          : disk.mode_reason();
    throw Failure{kExitEnvironment,
                  std::string(command) + " needs write access to " + disk.dir() + ": " + why};
  }
  return disk;
}

std::string arch_of(const detail::Manifest& m) {
  std::size_t at = m.kernel.rfind('@');
  if (at != std::string::npos) return m.kernel.substr(at + 1);
  nlohmann::json spec = nlohmann::json::parse(m.spec_json, nullptr, false);
  if (spec.is_object() && spec.contains("arch") && spec["arch"].is_string()) {
    return spec["arch"].get<std::string>();
  }
  return "?";
}

std::string kernel_of(const detail::Manifest& m) {
  if (m.kernel.empty()) return "(unknown)";
  std::size_t at = m.kernel.rfind('@');
  return at == std::string::npos ? m.kernel : m.kernel.substr(0, at);
}

// The directories a maintenance walk skipped ("path: reason"), after its summary line.
void print_unreadable(const char* command, const std::vector<std::string>& unreadable,
                      const char* consequence) {
  if (unreadable.empty()) return;
  std::cout << command << ": " << unreadable.size() << " director"
            << (unreadable.size() == 1 ? "y" : "ies") << " could not be read; " << consequence
            << ":\n";
  for (const std::string& dir : unreadable) std::cout << "  " << dir << "\n";
}

uint64_t total_size(const std::vector<detail::EntryInfo>& entries) {
  uint64_t total = 0;
  for (const detail::EntryInfo& e : entries) total += e.file_size;
  return total;
}

}  // namespace

int run_list() {
  const detail::DiskCache& disk = open_cache("list", false);
  std::vector<std::string> unreadable;
  std::vector<detail::EntryInfo> entries = disk.list(false, &unreadable);
  std::sort(entries.begin(), entries.end(),
            [](const detail::EntryInfo& a, const detail::EntryInfo& b) {
              return a.manifest.kernel < b.manifest.kernel;
            });
  std::size_t kernel_width = 6;
  for (const detail::EntryInfo& e : entries) {
    kernel_width = std::max(kernel_width, kernel_of(e.manifest).size());
  }
  int kw = static_cast<int>(kernel_width);
  char line[512];
  std::snprintf(line, sizeof(line), "%-*s  %-8s %10s  %-19s  %10s  %s\n", kw, "KERNEL", "ARCH",
                "SIZE", "LAST USED", "COMPILE", "KEY");
  std::cout << line;
  int with_problem = 0;
  for (const detail::EntryInfo& e : entries) {
    // The key from the file name: an entry whose header can't be read still names its file.
    std::snprintf(line, sizeof(line), "%-*s  %-8s %10s  %-19s  %10s  %s\n", kw,
                  kernel_of(e.manifest).c_str(), arch_of(e.manifest).c_str(),
                  format_bytes(e.file_size).c_str(), format_time(e.last_used_unix).c_str(),
                  format_ms(e.manifest.compile_ms).c_str(), e.key.c_str());
    std::cout << line;
    if (!e.problem.empty()) {
      ++with_problem;
      std::cout << "  ^ " << e.problem << "\n";
    }
  }
  std::cout << entries.size() << " entr" << (entries.size() == 1 ? "y" : "ies") << ", "
            << format_bytes(total_size(entries)) << " in " << disk.dir() << " ("
            << cache_mode_name(disk.effective_mode()) << ")";
  if (with_problem > 0) {
    std::cout << "; " << with_problem << " with a problem (never loaded; `moejit verify` checks "
              << "every entry)";
  }
  std::cout << "\n";
  print_unreadable("list", unreadable, "their entries are not listed");
  return kExitOk;
}

int run_verify() {
  const detail::DiskCache& disk = open_cache("verify", false);
  std::vector<std::string> unreadable;
  std::vector<detail::EntryInfo> entries = disk.list(true, &unreadable);
  int bad = 0;
  int moved = 0;
  for (const detail::EntryInfo& e : entries) {
    if (e.problem.empty()) continue;
    ++bad;
    if (!e.quarantined_to.empty()) ++moved;
    std::cout << "BAD  "
              << (e.manifest.kernel.empty() ? "(entry " + e.key + ")" : e.manifest.kernel) << "  "
              << e.path << ": " << e.problem << "\n";
  }
  std::cout << "verify: " << entries.size() << " entr" << (entries.size() == 1 ? "y" : "ies")
            << ", " << bad << " bad";
  if (moved > 0) {
    std::cout << "; " << moved << " quarantined under " << disk.dir()
              << "/quarantine (the next use rebuilds them)";
  }
  if (bad > moved) {
    // Untrusted, unreadable or unmovable entries, and any in a cache that is not writable.
    std::cout << "; " << bad - moved << " left in place and never loaded (each line above says "
              << "why; fix or remove them)";
  }
  std::cout << "\n";
  print_unreadable("verify", unreadable, "their entries were not verified");
  return bad > 0 || !unreadable.empty() ? kExitWorkFailed : kExitOk;
}

int run_gc(const std::string& max_size) {
  std::optional<uint64_t> limit = parse_size(max_size);
  if (!limit) {
    throw Failure{kExitUsage, "bad --max-size '" + max_size +
                                  "': expected bytes or a number with K, M, G or T (powers of "
                                  "1024), e.g. 500M or 2G"};
  }
  const detail::DiskCache& disk = open_cache("gc", true);
  detail::GcReport report = disk.gc(*limit);
  std::cout << "gc: removed " << report.removed << " file(s) (entries and quarantined)";
  if (report.stale_temp_removed > 0) {
    std::cout << " and " << report.stale_temp_removed << " stale temp file(s)";
  }
  std::cout << ", " << format_bytes(report.bytes_before) << " -> "
            << format_bytes(report.bytes_after) << " (limit " << format_bytes(*limit) << ") in "
            << disk.dir() << "\n";
  int status = kExitOk;
  if (!report.unreadable.empty()) {
    print_unreadable("gc", report.unreadable, "their files were neither counted nor removed");
    status = kExitWorkFailed;
  }
  if (report.bytes_after > *limit) {
    std::cout << "gc: the cache is still over the limit: some files could not be removed (each "
                 "is logged above)\n";
    status = kExitWorkFailed;
  }
  return status;
}

int run_clear() {
  const detail::DiskCache& disk = open_cache("clear", true);
  const detail::ClearReport report = disk.clear();
  std::cout << "clear: removed " << report.removed << " file(s) (entries and quarantined)";
  if (report.stale_temp_removed > 0) {
    std::cout << " and " << report.stale_temp_removed << " stale temp file(s)";
  }
  std::cout << " from " << disk.dir() << "\n";
  int status = kExitOk;
  if (!report.unreadable.empty()) {
    print_unreadable("clear", report.unreadable, "their files were not removed");
    status = kExitWorkFailed;
  }
  if (report.not_removed > 0) {
    std::cout << "clear: " << report.not_removed
              << " file(s) could not be removed (each is logged above)\n";
    status = kExitWorkFailed;
  }
  return status;
}

}  // namespace moejit::cli
