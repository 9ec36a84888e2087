// `moejit doctor`: everything that decides whether kernels can be built, cached and launched.
#include <unistd.h>

#include <cstdio>
#include <iostream>
#include <string>
#include <vector>

#include "cache/disk_cache.hpp"
#include "cli/cli.hpp"
#include "common/log.hpp"
#include "compile/nvrtc.hpp"
#include "moejit/error.hpp"
#include "moejit/moe.hpp"
#include "moejit/version.hpp"
#include "runtime/runtime_impl.hpp"

namespace moejit::cli {
namespace {

void row(const char* label, const std::string& value) {
  std::string padded = std::string(label) + ":";
  padded.resize(15, ' ');
  std::cout << padded << value << "\n";
}

std::string driver_version_text(int version) {
  return std::to_string(version / 1000) + "." + std::to_string((version % 1000) / 10);
}

}  // namespace

int run_doctor() {
  std::vector<std::string> problems;
  row("libmoejit", std::string(kVersionString) + " (cache schema " +
                       std::to_string(kCacheSchemaVersion) + ", weight layout " +
                       std::to_string(moe_weight_layout_version()) + ")");

  DriverInfo driver = probe_driver();
  if (driver.loaded) {
    row("driver", "CUDA " + driver_version_text(driver.version) + " (libcuda loaded)");
  } else {
    row("driver", "not loaded: " + driver.why_not);
  }
  if (driver.gpus.empty()) {
    row("GPUs", driver.loaded ? "none visible (" + driver.why_not + ")"
                              : std::string("none visible (no driver); prewarm needs --arch"));
  } else {
    for (const GpuInfo& gpu : driver.gpus) {
      std::string line = std::to_string(gpu.ordinal) + ": " + gpu.name + "  " + gpu.arch.name() +
                         "  " + format_bytes(gpu.memory_bytes);
      if (gpu.dram_bytes_per_second > 0) {
        char rate[48];
        std::snprintf(rate, sizeof(rate), "  %.2f TB/s peak DRAM",
                      static_cast<double>(gpu.dram_bytes_per_second) * 1e-12);
        line += rate;
      }
      row("GPU", line);
    }
  }

  try {
    const std::string broken = detail::nvrtc_self_test();
    row("NVRTC", detail::nvrtc_identity() + (broken.empty() ? " (compiles)" : ""));
    if (!broken.empty()) {
      row("NVRTC", "UNUSABLE: " + broken);
      problems.push_back("NVRTC can't compile: " + broken);
    }
  } catch (const Error& e) {
    row("NVRTC", std::string("unusable: ") + e.what());
    problems.push_back(std::string("NVRTC: ") + e.what());
  }

  if (const std::string problem = detail::log_level_problem(); !problem.empty()) {
    problems.push_back(problem);
  }
  bool configured = true;
  try {
    configure_from_environment();
  } catch (const Failure& f) {
    configured = false;
    problems.push_back(f.message);
    configure(RuntimeConfig{});  // the rest of the report: the defaults
  }
  detail::Runtime& runtime = detail::Runtime::instance();
  try {
    const detail::DiskCache& disk = runtime.store().disk();
    CacheMode requested = runtime.config().cache_mode;
    row("cache dir", disk.dir());
    std::string mode = cache_mode_name(disk.effective_mode());
    if (requested != disk.effective_mode()) {
      mode += std::string(" (asked for ") + cache_mode_name(requested) + ": " + disk.mode_reason() +
              ")";
    }
    row("cache mode", mode);
    if (disk.effective_mode() == CacheMode::kMemoryOnly) {
      row("writable", "n/a (memory only)");
    } else {
      bool writable =
          disk.effective_mode() == CacheMode::kReadWrite && ::access(disk.dir().c_str(), W_OK) == 0;
      row("writable", writable ? "yes" : "no");
      std::vector<std::string> unreadable;
      std::vector<detail::EntryInfo> entries = disk.list(false, &unreadable);
      uint64_t total = 0;
      for (const detail::EntryInfo& e : entries) total += e.file_size;
      row("entries", std::to_string(entries.size()) + " (" + format_bytes(total) + ")" +
                         (unreadable.empty() ? std::string()
                                             : ", " + std::to_string(unreadable.size()) +
                                                   " unreadable director(ies) not counted"));
      for (const std::string& dir : unreadable) {
        problems.push_back("cache directory unreadable: " + dir);
      }
    }
    if (requested == CacheMode::kReadWrite && disk.effective_mode() != CacheMode::kReadWrite) {
      problems.push_back("the cache dir " + disk.dir() + " is not writable (" + disk.mode_reason() +
                         "): compiled kernels are not kept between processes");
    }
  } catch (const Error& e) {
    row("cache", std::string("unusable: ") + e.what());
    problems.push_back(std::string("cache: ") + e.what());
  }

  if (problems.empty()) {
    std::cout << "doctor: OK" << (configured ? "" : " (with default configuration)") << "\n";
    return kExitOk;
  }
  std::cout << "doctor: " << problems.size() << " problem(s):\n";
  for (const std::string& p : problems) std::cout << "  - " << p << "\n";
  return kExitEnvironment;
}

}  // namespace moejit::cli
