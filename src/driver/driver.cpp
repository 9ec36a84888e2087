// Loads libcuda at run time: dlopen, then every entry point through cuGetProcAddress at the ABI
// version cuda.h declares, then cuInit(0) once per process.
#include "driver/driver.hpp"

#include <cudaTypedefs.h>
#include <dlfcn.h>

#include <cstring>
#include <limits>
#include <string>
#include <type_traits>

#include "common/log.hpp"

namespace moejit::detail {
namespace {

// Compile-time proof that each (name, version) pair of driver_functions.inc is the ABI that
// cuda.h declares for `name`; a wrong version would hand us a function of another signature.
#define MOEJIT_DRIVER_FN(name, version)                                                   \
  static_assert(std::is_same_v<decltype(&::name), PFN_##name##_v##version>,             \
                #name ": driver_functions.inc names version " #version                  \
                      ", whose signature differs from cuda.h's declaration; use the "   \
                      "version of the PFN_" #name "_v* typedef in cudaTypedefs.h that matches");
#include "driver/driver_functions.inc"
#undef MOEJIT_DRIVER_FN

using GetProcAddress = decltype(&::cuGetProcAddress);  // the 12.0+ ABI, with a query result

struct Loaded {
  DriverApi api;
  bool usable = false;
  std::string why;  // set when !usable
};

std::string version_text(int version) {
  return std::to_string(version / 1000) + "." + std::to_string(version % 1000 / 10);
}

const char* kNoDriverAdvice =
    " Kernels can still be compiled into the cache on this machine by naming the target arch, "
    "e.g. `moejit prewarm --arch sm_90a <shapes.json>`.";

std::string describe_with(const DriverApi& api, CUresult result) {
  const char* name = nullptr;
  const char* text = nullptr;
  if (api.cuGetErrorName != nullptr && api.cuGetErrorName(result, &name) != CUDA_SUCCESS) {
    name = nullptr;
  }
  if (api.cuGetErrorString != nullptr && api.cuGetErrorString(result, &text) != CUDA_SUCCESS) {
    text = nullptr;
  }
  std::string out = name != nullptr ? std::string(name)
                                    : "CUresult " + std::to_string(static_cast<int>(result));
  if (text != nullptr) out += std::string(" (") + text + ")";
  return out;
}

const char* query_result_name(CUdriverProcAddressQueryResult status) {
  switch (status) {
    case CU_GET_PROC_ADDRESS_SUCCESS: return "found";
    case CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND: return "symbol not found";
    case CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT: return "driver version not sufficient";
  }
  return "unknown query result";
}

// Resolves `symbol` at ABI `version` into `slot`; on failure sets `why` and returns false.
template <typename Fn>
bool resolve(GetProcAddress get_proc, const char* symbol, int version, int driver_version,
             Fn* slot, std::string* why) {
  static_assert(sizeof(Fn) == sizeof(void*), "driver entry points are plain function pointers");
  void* address = nullptr;
  CUdriverProcAddressQueryResult status = CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
  CUresult result = get_proc(symbol, &address, version, CU_GET_PROC_ADDRESS_DEFAULT, &status);
  if (result == CUDA_SUCCESS && status == CU_GET_PROC_ADDRESS_SUCCESS && address != nullptr) {
    // Why memcpy: converting an object pointer to a function pointer is only conditionally
    // supported as a cast; copying the bits is what every dlsym user relies on.
    std::memcpy(slot, &address, sizeof(address));
    return true;
  }
  if (result == CUDA_ERROR_STUB_LIBRARY) {
    // Why its own message: "update the driver" would send the user the wrong way.
    *why = std::string(
               "the libcuda.so.1 found is the CUDA toolkit's stub (for linking only), not a "
               "driver: no NVIDIA driver is installed, or a stubs directory comes first on "
               "LD_LIBRARY_PATH.") +
           kNoDriverAdvice;
    return false;
  }
  *why = std::string("the NVIDIA driver's libcuda.so.1 (") +
         (driver_version > 0 ? "CUDA " + version_text(driver_version) : "version unknown") +
         ") does not provide " + symbol + " with the CUDA " + version_text(version) +
         " interface (cuGetProcAddress: " +
         (result == CUDA_SUCCESS ? query_result_name(status) : "error " + std::to_string(result)) +
         "); libmoejit was built against CUDA " + version_text(CUDA_VERSION) +
         ": update the NVIDIA driver.";
  return false;
}

Loaded load() {
  Loaded out;
  dlerror();
  // Why RTLD_LOCAL: the driver's symbols stay out of the global namespace, so an application
  // that links libcuda itself is not affected. The handle is never closed: kernels and
  // contexts obtained from it live as long as the process.
  void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (lib == nullptr) {
    const char* error = dlerror();
    out.why = std::string("the CUDA driver library libcuda.so.1 could not be loaded (") +
              (error != nullptr ? error : "not found") +
              "): no NVIDIA driver is installed or visible to this process." + kNoDriverAdvice;
    return out;
  }
  void* symbol = dlsym(lib, "cuGetProcAddress_v2");
  if (symbol == nullptr) {
    out.why = std::string(
                  "libcuda.so.1 has no cuGetProcAddress_v2: the NVIDIA driver is older than "
                  "CUDA 12.0; libmoejit needs a driver for CUDA ") +
              version_text(CUDA_VERSION) + " or newer.";
    return out;
  }
  GetProcAddress get_proc = nullptr;
  std::memcpy(&get_proc, &symbol, sizeof(symbol));

  // The version first, so every later message can name it.
  int driver_version = 0;
  if (resolve(get_proc, "cuDriverGetVersion", 2020, 0, &out.api.cuDriverGetVersion, &out.why) &&
      out.api.cuDriverGetVersion(&driver_version) == CUDA_SUCCESS) {
    out.api.driver_version = driver_version;
  }
#define MOEJIT_DRIVER_FN(name, version) \
  if (!resolve(get_proc, #name, version, driver_version, &out.api.name, &out.why)) return out;
#include "driver/driver_functions.inc"
#undef MOEJIT_DRIVER_FN

  CUresult init = out.api.cuInit(0);
  if (init != CUDA_SUCCESS) {
    out.why = "cuInit(0) failed: " + describe_with(out.api, init);
    if (init == CUDA_ERROR_NO_DEVICE) {
      out.why += ": no CUDA device is visible to this process (check CUDA_VISIBLE_DEVICES)";
    }
    out.why += std::string(".") + kNoDriverAdvice;
    return out;
  }
  out.usable = true;
  log().debug("loaded the CUDA driver (CUDA {})", version_text(driver_version));
  return out;
}

const Loaded& loaded() {
  // Why a function-local static: C++ guarantees one thread-safe initialization, so dlopen and
  // cuInit run once per process however many threads ask first.
  static const Loaded state = load();
  return state;
}

// "src/ops/append_shared.cpp" rather than the build machine's absolute path.
const char* short_path(const char* file) {
  const char* best = nullptr;
  for (const char* marker : {"/src/", "/tests/", "/tools/"}) {
    for (const char* at = std::strstr(file, marker); at != nullptr;
         at = std::strstr(at + 1, marker)) {
      if (best == nullptr || at > best) best = at;
    }
  }
  return best != nullptr ? best + 1 : file;
}

}  // namespace

const DriverApi* try_driver(std::string* why) {
  const Loaded& state = loaded();
  if (state.usable) return &state.api;
  if (why != nullptr) *why = state.why;
  return nullptr;
}

const DriverApi& driver() {
  const Loaded& state = loaded();
  if (!state.usable) throw Error(ErrorCode::kDriver, "the CUDA driver is not usable: " + state.why);
  return state.api;
}

std::string describe(CUresult result) { return describe_with(loaded().api, result); }

long long peak_dram_bytes_per_second(const DriverApi& api, CUdevice device) {
  int clock_khz = 0;
  int bus_bits = 0;
  if (api.cuDeviceGetAttribute(&clock_khz, CU_DEVICE_ATTRIBUTE_MEMORY_CLOCK_RATE, device) !=
          CUDA_SUCCESS ||
      api.cuDeviceGetAttribute(&bus_bits, CU_DEVICE_ATTRIBUTE_GLOBAL_MEMORY_BUS_WIDTH, device) !=
          CUDA_SUCCESS ||
      clock_khz <= 0 || bus_bits <= 0) {
    return 0;
  }
  const long long hz = 1000LL * clock_khz;
  const long long bytes_per_clock = 2LL * (bus_bits / 8);  // double data rate
  if (bytes_per_clock > std::numeric_limits<long long>::max() / hz) {
    return std::numeric_limits<long long>::max();  // no real bus; saturated, not wrapped
  }
  return hz * bytes_per_clock;
}

void throw_driver_error(CUresult result, const char* call, const char* file, int line) {
  std::string message = std::string("CUDA driver call ") + call + " failed at " + short_path(file) +
                        ":" + std::to_string(line) + ": " + describe(result);
  if (result == CUDA_ERROR_INVALID_CONTEXT) {
    message += ". Make a CUDA context current on this thread first (e.g. cudaSetDevice, or "
               "cuDevicePrimaryCtxRetain + cuCtxSetCurrent).";
  }
  throw Error(ErrorCode::kDriver, message);
}

}  // namespace moejit::detail
