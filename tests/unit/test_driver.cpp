// The driver facts computed from device attributes, and the runtime's capture query on a
// caller's stream, against a driver table whose functions are test functions (no GPU, no
// libcuda).
#include <catch2/catch.hpp>
#include <cstdint>
#include <limits>
#include <string>

#include "driver/driver.hpp"
#include "moejit/error.hpp"
#include "moejit/kernel_spec.hpp"
#include "ops/append_shared_spec.hpp"
#include "ops/moe_launch.hpp"
#include "runtime/runtime_impl.hpp"

namespace {

using moejit::Error;
using moejit::ErrorCode;
using moejit::detail::check_stream_device;
using moejit::detail::DriverApi;
using moejit::detail::peak_dram_bytes_per_second;
using moejit::detail::stream_capturing;

// What the fake query answers, by attribute; a negative value fails the query.
int g_clock_khz = 0;
int g_bus_bits = 0;

CUresult fake_attribute(int* value, CUdevice_attribute attribute, CUdevice) {
  const int answer = attribute == CU_DEVICE_ATTRIBUTE_MEMORY_CLOCK_RATE         ? g_clock_khz
                     : attribute == CU_DEVICE_ATTRIBUTE_GLOBAL_MEMORY_BUS_WIDTH ? g_bus_bits
                                                                                : -1;
  if (answer < 0) return CUDA_ERROR_INVALID_VALUE;
  *value = answer;
  return CUDA_SUCCESS;
}

// What the fake capture query answers, and the stream it was asked about.
CUresult g_capture_result = CUDA_SUCCESS;
CUstreamCaptureStatus g_capture_status = CU_STREAM_CAPTURE_STATUS_NONE;
CUstream g_asked = nullptr;

CUresult fake_is_capturing(CUstream stream, CUstreamCaptureStatus* status) {
  g_asked = stream;
  if (g_capture_result == CUDA_SUCCESS) *status = g_capture_status;
  return g_capture_result;
}

moejit::KernelSpec append_shared_spec() {
  moejit::KernelSpec spec;
  spec.family = moejit::Family::kAppendShared;
  spec.arch = moejit::Arch::parse("sm_90a");
  spec.params = moejit::detail::append_shared_params(
      8, 1, moejit::DType::kI32, moejit::SharedGate::kSigmoid, moejit::DType::kBF16);
  return spec;
}

// The message stream_capturing throws for the fake's answer (empty when it throws none).
std::string capture_error(const DriverApi& api, const moejit::KernelSpec& spec, CUstream stream) {
  try {
    stream_capturing(api, spec, stream);
  } catch (const Error& e) {
    CHECK(e.code() == ErrorCode::kDriver);
    return e.what();
  }
  return "";
}

// The fake driver's streams: 0x1000 and 0x2000 are device 0's (two contexts of it), 0x3000
// device 1's; any other is a handle it can't read. It counts its queries.
int g_stream_queries = 0;

CUresult fake_stream_device(CUstream stream, CUdevice* device) {
  ++g_stream_queries;
  switch (reinterpret_cast<std::uintptr_t>(stream)) {
    case 0x1000:
    case 0x2000:
      *device = 0;
      return CUDA_SUCCESS;
    case 0x3000:
      *device = 1;
      return CUDA_SUCCESS;
    default:
      return CUDA_ERROR_INVALID_HANDLE;
  }
}

CUstream stream_at(std::uintptr_t address) { return reinterpret_cast<CUstream>(address); }

// The message check_stream_device throws (empty when it throws none).
std::string stream_error(const DriverApi& api, CUstream stream, int device) {
  try {
    check_stream_device("moe_forward", api, stream, device);
  } catch (const Error& e) {
    CHECK(e.code() == ErrorCode::kInvalidArgument);
    return e.what();
  }
  return "";
}

}  // namespace

TEST_CASE("driver: the capture query on the caller's stream, its answers and its refusals",
          "[driver]") {
  DriverApi api;
  api.cuStreamIsCapturing = &fake_is_capturing;
  const moejit::KernelSpec spec = append_shared_spec();
  CUstream stream = reinterpret_cast<CUstream>(static_cast<std::uintptr_t>(0x7f00d00d));

  // Asked about the caller's stream itself; every status but NONE is a capture (an invalidated
  // capture too: nothing may load into it either).
  g_capture_result = CUDA_SUCCESS;
  for (CUstreamCaptureStatus status :
       {CU_STREAM_CAPTURE_STATUS_NONE, CU_STREAM_CAPTURE_STATUS_ACTIVE,
        CU_STREAM_CAPTURE_STATUS_INVALIDATED}) {
    g_capture_status = status;
    g_asked = nullptr;
    CHECK(stream_capturing(api, spec, stream) == (status != CU_STREAM_CAPTURE_STATUS_NONE));
    CHECK(g_asked == stream);
  }
  // The legacy stream while another stream captures in global mode: the driver's refusal is
  // the answer (a capture), not an error.
  g_capture_result = CUDA_ERROR_STREAM_CAPTURE_IMPLICIT;
  CHECK(stream_capturing(api, spec, nullptr));

  // A stream the driver can't use: the error names the kernel, the stream, the query and what to
  // pass instead.
  for (CUresult refused :
       {CUDA_ERROR_INVALID_HANDLE, CUDA_ERROR_INVALID_VALUE, CUDA_ERROR_CONTEXT_IS_DESTROYED}) {
    g_capture_result = refused;
    const std::string message = capture_error(api, spec, stream);
    INFO(message);
    CHECK(message.rfind("kernel " + spec.display_name() +
                            ": asking whether stream 0x7f00d00d "
                            "is capturing (cuStreamIsCapturing) failed: ",
                        0) == 0);
    CHECK(message.find("Pass a live stream (or 0, the current context's default stream)") !=
          std::string::npos);
  }
  // Any other failure (a sticky error from an earlier launch) is named without that advice.
  g_capture_result = CUDA_ERROR_LAUNCH_FAILED;
  const std::string message = capture_error(api, spec, stream);
  INFO(message);
  CHECK(message.find("(cuStreamIsCapturing) failed: ") != std::string::npos);
  CHECK(message.find("Pass a live stream") == std::string::npos);
}

TEST_CASE("driver: the peak DRAM rate is twice the memory clock times the bus width", "[driver]") {
  DriverApi api;
  api.cuDeviceGetAttribute = &fake_attribute;

  // An H200's HBM3e: 3.13 GHz over 6144 bits, double data rate.
  g_clock_khz = 3130000;
  g_bus_bits = 6144;
  CHECK(peak_dram_bytes_per_second(api, 0) == 2LL * 3130000 * 1000 * 768);
  // No overflow at the largest int clock over a 16384-bit bus.
  g_clock_khz = 2147483647;
  g_bus_bits = 16384;
  CHECK(peak_dram_bytes_per_second(api, 0) == 2LL * 2147483647 * 1000 * 2048);
  // Past a long long (no such bus): saturated, never wrapped to a small or negative rate.
  g_bus_bits = 2147483647;
  CHECK(peak_dram_bytes_per_second(api, 0) == std::numeric_limits<long long>::max());

  // Unknown (not reported, or 0): 0, so nothing is paced by a made-up rate.
  g_clock_khz = 0;
  g_bus_bits = 6144;
  CHECK(peak_dram_bytes_per_second(api, 0) == 0);
  g_clock_khz = 3130000;
  g_bus_bits = 0;
  CHECK(peak_dram_bytes_per_second(api, 0) == 0);
  g_clock_khz = -1;  // the query fails
  g_bus_bits = 6144;
  CHECK(peak_dram_bytes_per_second(api, 0) == 0);
  g_clock_khz = 3130000;
  g_bus_bits = -1;
  CHECK(peak_dram_bytes_per_second(api, 0) == 0);
}

TEST_CASE("driver: an op's stream must be of the current context's device", "[driver]") {
  DriverApi api;
  api.cuStreamGetDevice = &fake_stream_device;
  g_stream_queries = 0;

  // The default streams are the current context's: no driver call at all.
  DriverApi none;
  for (CUstream stream : {static_cast<CUstream>(nullptr), CU_STREAM_LEGACY, CU_STREAM_PER_THREAD}) {
    CHECK(stream_error(none, stream, 0).empty());
  }
  // Streams of the op's device pass, whichever context of it they belong to: one query each.
  CHECK(stream_error(api, stream_at(0x1000), 0).empty());
  CHECK(stream_error(api, stream_at(0x2000), 0).empty());
  CHECK(g_stream_queries == 2);
  // A stream of device 1 for an op on device 0: refused by name, before anything launches.
  CHECK(stream_error(api, stream_at(0x3000), 0) ==
        "moe_forward: stream: expected a stream of device 0 (the current context's, which the "
        "tensors are checked against), found a stream of device 1: make the stream's device "
        "current, or pass a stream of device 0");
  // The other way round.
  CHECK(stream_error(api, stream_at(0x3000), 1).empty());
  CHECK(stream_error(api, stream_at(0x1000), 1).find("found a stream of device 0") !=
        std::string::npos);
  // What the driver can't answer is left to the capture query and the launch, which name it.
  CHECK(stream_error(api, stream_at(0x9000), 1).empty());
}
