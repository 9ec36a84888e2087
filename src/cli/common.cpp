// Helpers shared by the subcommands: exit codes, shape files, sizes, times, the driver probe.
#include <cctype>
#include <cmath>
#include <cstdio>
#include <ctime>
#include <sstream>
#include <string>

#include "cli/cli.hpp"
#include "common/env.hpp"
#include "compile/nvrtc.hpp"
#include "descriptor/descriptor.hpp"
#include "driver/driver.hpp"
#include "moejit/error.hpp"

namespace moejit::cli {

std::string help_footer() {
  return "Exit codes:\n"
         "  0  success\n"
         "  1  some work failed (a kernel failed to compile, bad cache entries were found, gc or\n"
         "     clear could not remove files)\n"
         "  2  usage error (bad flags, unknown shape or kernel family, no GPU to take the default\n"
         "     --arch from: pass --arch sm_90a)\n"
         "  3  invalid shape file (missing, unreadable, or breaks a rule: file:line:column named)\n"
         "  4  environment problem (cache unusable as asked, e.g. prewarm's kernels not stored;\n"
         "     NVRTC unusable)\n"
         "Environment: MOEJIT_CACHE_DIR, MOEJIT_CACHE_MODE=rw|ro|memory, MOEJIT_LINEINFO=0|1,\n"
         "  MOEJIT_LOG_LEVEL, XDG_CACHE_HOME (see README.md)";
}

int exit_code_for(ErrorCode code) {
  switch (code) {
    case ErrorCode::kInvalidDescriptor:
      return kExitShapeFile;
    case ErrorCode::kInvalidArgument:
    case ErrorCode::kUnsupported:
      return kExitUsage;
    case ErrorCode::kCache:
    case ErrorCode::kDriver:
    case ErrorCode::kIo:
      return kExitEnvironment;
    case ErrorCode::kCompileFailed:
    case ErrorCode::kCacheCorrupt:
    case ErrorCode::kCaptureMiss:
    case ErrorCode::kInternal:
      return kExitWorkFailed;
  }
  return kExitWorkFailed;
}

std::vector<ModelShape> load_shape_files(const std::vector<std::string>& paths) {
  std::vector<ModelShape> shapes;
  for (const std::string& path : paths) {
    try {
      std::vector<detail::LocatedShape> loaded =
          detail::parse_shapes_located(detail::read_shapes_text(path), path);
      // Why: a name is unique inside a file (the parser's rule) and across the files an engine
      // registers (the registry's), so one command's files follow the registry's rule too.
      for (const detail::LocatedShape& s : loaded) {
        for (const ModelShape& earlier : shapes) {
          if (earlier.name != s.shape.name) continue;
          throw Failure{
              kExitShapeFile,
              "invalid shape file: " +
                  detail::descriptor_message(
                      path, s.name_line, s.name_column, s.name_pointer,
                      "shape \"" + s.shape.name + "\" is also defined at " + earlier.source,
                      "a name no earlier file of the command defines (an engine "
                      "registering both files would be refused)",
                      "\"" + s.shape.name + "\"", "rename one, or pass its file once")};
        }
      }
      for (detail::LocatedShape& s : loaded) shapes.push_back(std::move(s.shape));
    } catch (const DescriptorError& e) {
      std::string message = e.what();
      // Why: the location must reach the user even if a message was written without it.
      if (e.line() > 0 && message.find(":" + std::to_string(e.line()) + ":") == std::string::npos) {
        message = e.file() + ":" + std::to_string(e.line()) + ":" + std::to_string(e.column()) +
                  ": " + message;
      }
      throw Failure{kExitShapeFile, "invalid shape file: " + message};
    } catch (const Error& e) {
      throw Failure{kExitShapeFile, "cannot use shape file " + path + ": " + e.what()};
    }
  }
  return shapes;
}

const ModelShape& find_shape(const std::vector<ModelShape>& shapes, const std::string& name,
                             const std::string& file) {
  for (const ModelShape& s : shapes) {
    if (s.name == name) return s;
  }
  std::vector<std::string> names;
  for (const ModelShape& s : shapes) names.push_back(s.name);
  throw Failure{kExitUsage, "no shape named '" + name + "' in " + file +
                                " (it has: " + detail::listed_names(names) + ")"};
}

Arch parse_arch_option(const std::string& name) {
  Arch arch;
  try {
    arch = Arch::parse(name);
  } catch (const Error& e) {
    throw Failure{kExitUsage, std::string("bad --arch: ") + e.what()};
  }
  if (std::string why = detail::nvrtc_arch_problem(arch); !why.empty()) {
    throw Failure{kExitUsage, "bad --arch: " + why};
  }
  return arch;
}

void require_arch_serves(const std::vector<ModelShape>& shapes, const Arch& arch) {
  for (const ModelShape& shape : shapes) {
    for (const KernelSpec& spec : plan_kernels(shape, arch)) {
      if (std::string why = supports(spec); !why.empty()) {
        throw Failure{kExitUsage, "arch " + arch.name() + " can't run shape \"" + shape.name +
                                      "\": " + why};
      }
    }
  }
}

std::optional<uint64_t> parse_size(const std::string& text) {
  std::size_t i = 0;
  while (i < text.size() && (std::isdigit(static_cast<unsigned char>(text[i])) || text[i] == '.'))
    ++i;
  if (i == 0) return std::nullopt;
  std::string number = text.substr(0, i);
  if (number.find('.') != number.rfind('.') || number == ".") return std::nullopt;
  std::string unit;
  for (std::size_t j = i; j < text.size(); ++j) {
    char c = static_cast<char>(std::toupper(static_cast<unsigned char>(text[j])));
    if (c == ' ') continue;
    unit.push_back(c);
  }
  // Accept "", "B", "K", "KB", "KIB", ... (all powers of 1024).
  if (!unit.empty() && unit.back() == 'B') unit.pop_back();
  if (!unit.empty() && unit.back() == 'I') unit.pop_back();
  double scale = 1;
  if (unit.empty()) {
    scale = 1;
  } else if (unit == "K") {
    scale = 1024.0;
  } else if (unit == "M") {
    scale = 1024.0 * 1024;
  } else if (unit == "G") {
    scale = 1024.0 * 1024 * 1024;
  } else if (unit == "T") {
    scale = 1024.0 * 1024 * 1024 * 1024;
  } else {
    return std::nullopt;
  }
  double value = 0;
  try {
    value = std::stod(number) * scale;
  } catch (const std::exception&) {
    return std::nullopt;
  }
  // Why 2^64 and std::round: llround's long long overflows from 2^63, and every double below 2^64
  // converts to uint64_t exactly once rounded.
  if (!std::isfinite(value) || value < 0 || value >= 18446744073709551616.0) return std::nullopt;
  return static_cast<uint64_t>(std::round(value));
}

std::string format_bytes(uint64_t bytes) {
  static const char* const kUnits[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double value = static_cast<double>(bytes);
  int unit = 0;
  while (value >= 1024 && unit < 4) {
    value /= 1024;
    ++unit;
  }
  char text[32];
  if (unit == 0) {
    std::snprintf(text, sizeof(text), "%llu B", static_cast<unsigned long long>(bytes));
  } else {
    std::snprintf(text, sizeof(text), "%.1f %s", value, kUnits[unit]);
  }
  return text;
}

std::string format_ms(double ms) {
  char text[32];
  if (ms >= 10000) {
    std::snprintf(text, sizeof(text), "%.1f s", ms / 1000);
  } else if (ms >= 1000) {
    std::snprintf(text, sizeof(text), "%.2f s", ms / 1000);
  } else if (ms >= 10) {
    std::snprintf(text, sizeof(text), "%.0f ms", ms);
  } else {
    std::snprintf(text, sizeof(text), "%.2f ms", ms);
  }
  return text;
}

std::string format_time(int64_t unix_seconds) {
  if (unix_seconds <= 0) return "-";
  std::time_t t = static_cast<std::time_t>(unix_seconds);
  std::tm local{};
  localtime_r(&t, &local);
  char text[32];
  std::strftime(text, sizeof(text), "%Y-%m-%d %H:%M:%S", &local);
  return text;
}

Arch arch_for_compute_capability(int major, int minor) {
  Arch arch;
  arch.sm = major * 10 + minor;
  arch.arch_specific = major >= 9;
  return arch;
}

DriverInfo probe_driver() {
  DriverInfo info;
  const detail::DriverApi* api = detail::try_driver(&info.why_not);
  if (api == nullptr) return info;
  info.loaded = true;
  if (api->cuDriverGetVersion(&info.version) != CUDA_SUCCESS) info.version = 0;
  int count = 0;
  CUresult result = api->cuDeviceGetCount(&count);
  if (result != CUDA_SUCCESS) {
    info.why_not = "cuDeviceGetCount failed: " + detail::describe(result);
    return info;
  }
  for (int i = 0; i < count; ++i) {
    CUdevice device = 0;
    if (api->cuDeviceGet(&device, i) != CUDA_SUCCESS) continue;
    GpuInfo gpu;
    gpu.ordinal = i;
    char name[256] = {};
    if (api->cuDeviceGetName(name, sizeof(name), device) == CUDA_SUCCESS) gpu.name = name;
    int major = 0;
    int minor = 0;
    api->cuDeviceGetAttribute(&major, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, device);
    api->cuDeviceGetAttribute(&minor, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, device);
    gpu.arch = arch_for_compute_capability(major, minor);
    std::size_t bytes = 0;
    if (api->cuDeviceTotalMem(&bytes, device) == CUDA_SUCCESS) gpu.memory_bytes = bytes;
    gpu.dram_bytes_per_second = detail::peak_dram_bytes_per_second(*api, device);
    info.gpus.push_back(gpu);
  }
  return info;
}

void configure_from_environment() {
  try {
    configure(RuntimeConfig::from_environment());
  } catch (const Error& e) {
    throw Failure{kExitEnvironment,
                  std::string("the environment's configuration can't be used: ") + e.what()};
  }
}

const char* cache_mode_name(CacheMode mode) {
  switch (mode) {
    case CacheMode::kReadWrite:
      return "read-write";
    case CacheMode::kReadOnly:
      return "read-only";
    case CacheMode::kMemoryOnly:
      return "memory only";
  }
  return "unknown";
}

}  // namespace moejit::cli
