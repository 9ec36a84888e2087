// The driver facts computed from device attributes, and the runtime's capture query on a
// caller's stream, against a driver table whose functions are test functions (no GPU, no
// libcuda).
#include <catch2/catch.hpp>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "driver/driver.hpp"
#include "moejit/error.hpp"
#include "moejit/kernel_spec.hpp"
#include "ops/append_shared_spec.hpp"
#include "ops/moe_launch.hpp"
#include "ops/tensor_checks.hpp"
#include "runtime/runtime_impl.hpp"

namespace {

using moejit::Error;
using moejit::ErrorCode;
using moejit::detail::check_stream_device;
using moejit::detail::DriverApi;
using moejit::detail::launch_function;
using moejit::detail::OpStream;
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

// The fake driver's contexts: two on device 0 (ids 1, 2), one on device 1 (id 3); its streams
// name their context by address (0x1000 * id). Push and pop keep a stack.
struct FakeContexts {
  std::vector<std::uintptr_t> stack{1};  // the top is current
  int pushes = 0;
  int stream_queries = 0;  // cuStreamGetCtx calls
  bool push_fails = false;
  bool id_fails = false;
} g_contexts;

CUcontext context_of(std::uintptr_t id) { return reinterpret_cast<CUcontext>(id); }

CUresult fake_stream_context(CUstream stream, CUcontext* context) {
  ++g_contexts.stream_queries;
  const auto id = reinterpret_cast<std::uintptr_t>(stream) / 0x1000;
  if (id < 1 || id > 3) return CUDA_ERROR_INVALID_HANDLE;
  *context = context_of(id);
  return CUDA_SUCCESS;
}
CUresult fake_current(CUcontext* context) {
  *context = context_of(g_contexts.stack.back());
  return CUDA_SUCCESS;
}
CUresult fake_push(CUcontext context) {
  if (g_contexts.push_fails) return CUDA_ERROR_INVALID_CONTEXT;
  ++g_contexts.pushes;
  g_contexts.stack.push_back(reinterpret_cast<std::uintptr_t>(context));
  return CUDA_SUCCESS;
}
CUresult fake_pop(CUcontext* context) {
  *context = context_of(g_contexts.stack.back());
  g_contexts.stack.pop_back();
  return CUDA_SUCCESS;
}
// A context's id is its address (1, 2 or 3).
CUresult fake_context_id(CUcontext context, unsigned long long* id) {
  if (g_contexts.id_fails) return CUDA_ERROR_INVALID_CONTEXT;
  *id = reinterpret_cast<std::uintptr_t>(context);
  return CUDA_SUCCESS;
}
CUresult fake_device(CUdevice* device) {
  *device = g_contexts.stack.back() == 3 ? 1 : 0;
  return CUDA_SUCCESS;
}

CUstream stream_in(std::uintptr_t context_id) {
  return reinterpret_cast<CUstream>(context_id * 0x1000);
}

// A driver table of the fake contexts above, every call the stream check makes.
DriverApi fake_context_driver() {
  DriverApi api;
  api.cuStreamGetCtx = &fake_stream_context;
  api.cuCtxGetCurrent = &fake_current;
  api.cuCtxPushCurrent = &fake_push;
  api.cuCtxPopCurrent = &fake_pop;
  api.cuCtxGetDevice = &fake_device;
  api.cuCtxGetId = &fake_context_id;
  return api;
}

// The message check_stream_device throws (empty when it throws none); `out` gets what it returns.
std::string stream_error(const DriverApi& api, CUstream stream, int device,
                         OpStream* out = nullptr) {
  try {
    const OpStream checked = check_stream_device("moe_forward", api, stream, device);
    CHECK(checked.handle == stream);
    if (out != nullptr) *out = checked;
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
  const DriverApi api = fake_context_driver();
  g_contexts = FakeContexts{};  // context 1 (device 0) current

  // The default streams are the current context's: its id, without asking about the stream.
  for (CUstream stream : {static_cast<CUstream>(nullptr), CU_STREAM_LEGACY, CU_STREAM_PER_THREAD}) {
    OpStream checked;
    CHECK(stream_error(api, stream, 0, &checked).empty());
    CHECK(checked.context_id == 1);
    CHECK(checked.context_current);
  }
  CHECK(g_contexts.stream_queries == 0);
  // The current context's stream, and another context's of the same device, pass, each with its
  // context's id; the query of the other context leaves the caller's current.
  OpStream checked;
  CHECK(stream_error(api, stream_in(1), 0, &checked).empty());
  CHECK((checked.context_id == 1 && checked.context_current));
  CHECK(g_contexts.pushes == 0);
  CHECK(stream_error(api, stream_in(2), 0, &checked).empty());
  CHECK((checked.context_id == 2 && !checked.context_current));
  CHECK(g_contexts.pushes == 1);
  CHECK(g_contexts.stack == std::vector<std::uintptr_t>{1});
  // A stream of device 1 for an op on device 0: refused by name, nothing launched.
  const std::string message = stream_error(api, stream_in(3), 0);
  CHECK(message ==
        "moe_forward: stream: expected a stream of device 0 (the current context's, which the "
        "tensors are checked against), found a stream of device 1: make the stream's device "
        "current, or pass a stream of device 0");
  CHECK(g_contexts.stack == std::vector<std::uintptr_t>{1});
  // With device 1's context current, its stream passes and device 0's is refused.
  g_contexts.stack = {3};
  CHECK(stream_error(api, stream_in(3), 1).empty());
  CHECK(stream_error(api, stream_in(1), 1).find("found a stream of device 0") != std::string::npos);
  // What the driver can't answer is left to the capture query and the launch, which name it;
  // without a context id the launches go through the CUkernel.
  CHECK(stream_error(api, reinterpret_cast<CUstream>(0x9000), 1, &checked).empty());
  CHECK(checked.context_id == 0);
  g_contexts.push_fails = true;
  CHECK(stream_error(api, stream_in(1), 1, &checked).empty());
  CHECK((checked.context_id == 1 && !checked.context_current));
  CHECK(g_contexts.stack == std::vector<std::uintptr_t>{3});
  g_contexts.push_fails = false;
  g_contexts.id_fails = true;
  CHECK(stream_error(api, stream_in(3), 1, &checked).empty());
  CHECK(checked.context_id == 0);
}

TEST_CASE("driver: a launch without its context's function goes through the CUkernel", "[driver]") {
  // No driver call on these paths (the library's driver table is never loaded here): the op's
  // stream check found no context id, or a context that is not current (cuKernelGetFunction
  // answers for the current one only).
  const auto kernel = reinterpret_cast<CUkernel>(static_cast<std::uintptr_t>(0xbeef0));
  OpStream unknown;
  CHECK(launch_function(kernel, unknown) == reinterpret_cast<CUfunction>(kernel));
  OpStream other;
  other.context_id = 2;
  other.context_current = false;
  CHECK(launch_function(kernel, other) == reinterpret_cast<CUfunction>(kernel));
}

TEST_CASE("driver: the stream check fails loudly if the caller's context is not restored",
          "[driver]") {
  DriverApi api = fake_context_driver();
  // A pop that hands back another context than the one pushed.
  api.cuCtxPopCurrent = [](CUcontext* context) {
    *context = context_of(2);
    g_contexts.stack.pop_back();
    return CUDA_SUCCESS;
  };
  g_contexts = FakeContexts{};
  try {
    check_stream_device("moe_forward", api, stream_in(3), 0);
    FAIL("a pop of the wrong context passed");
  } catch (const Error& e) {
    CHECK(e.code() == ErrorCode::kDriver);
    CHECK(std::string(e.what()) ==
          "moe_forward: stream: asking the device of the stream's context left another context "
          "current (cuCtxPopCurrent)");
  }
}

namespace {

// The fake driver's memory for check_span_memory: address ranges as cuPointerGetAttributes
// reports them. A range may have a hole (nothing mapped, as in a cuMemAddressReserve range
// mapped in part).
struct FakeRange {
  std::uintptr_t start;
  std::size_t size;
  CUmemorytype type;
  int ordinal;
  bool managed;
  std::uintptr_t hole_start = 0;  // [hole_start, hole_start + hole_size): nothing mapped
  std::size_t hole_size = 0;
  bool range_known = true;  // else RANGE_START_ADDR and RANGE_SIZE read 0
  unsigned access = CU_POINTER_ATTRIBUTE_ACCESS_FLAG_READWRITE;  // device 0's, where mapped
  // [read_only_start, read_only_start + read_only_size): mapped read-only for device 0 (one
  // chunk of a reservation given less access than the rest)
  std::uintptr_t read_only_start = 0;
  std::size_t read_only_size = 0;
};
std::vector<FakeRange> g_ranges;
int g_attribute_calls = 0;

CUresult fake_pointer_attributes(unsigned count, CUpointer_attribute* attributes, void** data,
                                 CUdeviceptr address) {
  ++g_attribute_calls;
  const FakeRange* in = nullptr;
  for (const FakeRange& r : g_ranges) {
    if (address >= r.start && address - r.start < r.size) in = &r;
  }
  for (unsigned i = 0; i < count; ++i) {
    // Unknown memory: every attribute zero, the call still a success (as the driver does).
    const bool mapped =
        in != nullptr && !(address >= in->hole_start && address - in->hole_start < in->hole_size);
    switch (attributes[i]) {
      case CU_POINTER_ATTRIBUTE_MEMORY_TYPE:
        *static_cast<unsigned*>(data[i]) = in != nullptr ? in->type : 0u;
        break;
      case CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL:
        *static_cast<int*>(data[i]) = in != nullptr ? in->ordinal : 0;
        break;
      case CU_POINTER_ATTRIBUTE_IS_MANAGED:
        *static_cast<unsigned*>(data[i]) = in != nullptr && in->managed ? 1u : 0u;
        break;
      case CU_POINTER_ATTRIBUTE_MAPPED:
        *static_cast<unsigned*>(data[i]) = mapped ? 1u : 0u;
        break;
      case CU_POINTER_ATTRIBUTE_RANGE_START_ADDR:
        *static_cast<CUdeviceptr*>(data[i]) = in != nullptr && in->range_known ? in->start : 0;
        break;
      case CU_POINTER_ATTRIBUTE_RANGE_SIZE:
        *static_cast<std::size_t*>(data[i]) = in != nullptr && in->range_known ? in->size : 0;
        break;
      case CU_POINTER_ATTRIBUTE_ACCESS_FLAGS: {
        // Bytes the driver does not know, or nothing is mapped at, have no access.
        unsigned access = mapped ? in->access : 0u;
        if (mapped && address >= in->read_only_start &&
            address - in->read_only_start < in->read_only_size) {
          access = CU_POINTER_ATTRIBUTE_ACCESS_FLAG_READ;
        }
        *static_cast<unsigned*>(data[i]) = access;
        break;
      }
      default:
        return CUDA_ERROR_INVALID_VALUE;
    }
  }
  return CUDA_SUCCESS;
}

// The message check_span_memory throws for `span` on device 0 (empty when it throws none).
std::string span_error(const DriverApi& api, const moejit::detail::Span& span,
                       bool capturing = false,
                       moejit::detail::SpanUse use = moejit::detail::SpanUse::kRead) {
  try {
    moejit::detail::check_span_memory("moe_forward", api, 0, span, use, capturing);
  } catch (const Error& e) {
    CHECK(e.code() == ErrorCode::kInvalidArgument);
    return e.what();
  }
  return "";
}

const void* at(std::uintptr_t address) { return reinterpret_cast<const void*>(address); }

}  // namespace

TEST_CASE("driver: check_pointers refuses a buffer the kernels can't reach, naming it",
          "[driver]") {
  DriverApi api;
  api.cuPointerGetAttributes = &fake_pointer_attributes;
  g_ranges = {
      {0x10000000, 0x100000, CU_MEMORYTYPE_DEVICE, 0, false},  // device 0, 1 MiB
      {0x20000000, 0x100000, CU_MEMORYTYPE_DEVICE, 1, false},  // device 1
      // Pinned host and managed memory, made with device 1 current: reachable from device 0.
      {0x30000000, 0x100000, CU_MEMORYTYPE_HOST, 1, false},
      {0x40000000, 0x100000, CU_MEMORYTYPE_DEVICE, 1, true},
      // A reserved range of 4 MiB whose third MiB is not mapped (as torch's expandable
      // segments map chunks into one reservation).
      {0x50000000, 0x400000, CU_MEMORYTYPE_DEVICE, 0, false, 0x50200000, 0x100000},
      // Device 0's memory right below device 1's.
      {0x60000000, 0x100000, CU_MEMORYTYPE_DEVICE, 0, false},
      {0x60100000, 0x100000, CU_MEMORYTYPE_DEVICE, 1, false},
  };
  using moejit::detail::Span;
  const auto contains = [](const std::string& text, const std::string& part) {
    INFO(text);
    return text.find(part) != std::string::npos;
  };

  // Passes: a whole allocation, a slice of it, pinned host and managed memory, a span across two
  // mapped chunks of one reservation, and empty or null spans (nothing to read).
  g_attribute_calls = 0;
  CHECK(span_error(api, Span{"weights.w13", at(0x10000000), 0x100000}).empty());
  CHECK(g_attribute_calls == 2);  // the first and the last byte
  CHECK(span_error(api, Span{"hidden", at(0x10000010), 0x1000}).empty());
  CHECK(span_error(api, Span{"out", at(0x30000000), 0x100000}).empty());
  CHECK(span_error(api, Span{"out", at(0x40000100), 0x1000}).empty());
  CHECK(span_error(api, Span{"weights.w2", at(0x50000000), 0x200000}).empty());
  g_attribute_calls = 0;
  CHECK(span_error(api, Span{"weights.b13", at(0x10000000), 0}).empty());
  CHECK(span_error(api, Span{"weights.b13", nullptr, 64}).empty());
  CHECK(g_attribute_calls == 0);

  // Refused, each naming the op, the argument, what it needs and what was found.
  std::string e = span_error(api, Span{"workspace", at(0x7000), 4096});
  CHECK(contains(e,
                 "moe_forward: workspace: expected memory mapped on device 0 for its 4096 "
                 "bytes from 0x7000"));
  CHECK(contains(e, "memory CUDA does not know at 0x7000"));
  e = span_error(api, Span{"weights.w2", at(0x20000000), 256});
  CHECK(contains(e, "weights.w2"));
  CHECK(contains(e, "device memory of device 1"));
  // 16 bytes past the end of the 1 MiB allocation.
  e = span_error(api, Span{"weights.w13", at(0x10000010), 0x100000});
  CHECK(contains(e, "weights.w13"));
  CHECK(contains(e, "an allocation of 1048576 bytes from 0x10000000 that ends 16 bytes before"));
  // Into the reservation's unmapped MiB, and starting in it.
  e = span_error(api, Span{"weights.w2", at(0x50100000), 0x100001});
  CHECK(contains(e, "no memory at its last byte, 0x50200000"));
  e = span_error(api, Span{"weights.w2", at(0x50200000), 16});
  CHECK(contains(e, "no memory mapped at 0x50200000"));
  // Past the reservation itself.
  e = span_error(api, Span{"weights.w2", at(0x50300000), 0x100001});
  CHECK(contains(e, "that ends 1 byte before the buffer does"));
  // Ending in another device's memory, where the driver reports no range for the first byte
  // (so no range check): the last byte's own device refuses it.
  g_ranges[5].range_known = false;
  e = span_error(api, Span{"out", at(0x600ff000), 0x2000});
  CHECK(contains(e, "its last byte, 0x60100fff, in device memory of device 1"));
  // A span wrapping around the address space.
  e = span_error(api, Span{"hidden", at(0xfffffffffffff000), 0x2000});
  CHECK(contains(e, "a span that wraps around the address space"));

  // While the stream captures a graph, what has no memory yet (an allocation made in the
  // capture) passes; what the driver knows is still checked.
  CHECK(span_error(api, Span{"out", at(0x7000), 4096}, true).empty());
  CHECK(span_error(api, Span{"weights.w2", at(0x50100000), 0x100001}, true).empty());
  CHECK(contains(span_error(api, Span{"weights.w2", at(0x20000000), 256}, true),
                 "device memory of device 1"));
  CHECK(contains(span_error(api, Span{"weights.w13", at(0x10000010), 0x100000}, true),
                 "that ends 16 bytes before the buffer does"));
  g_ranges.clear();
}

TEST_CASE("driver: check_pointers refuses memory mapped without access, or read-only for outputs",
          "[driver]") {
  DriverApi api;
  api.cuPointerGetAttributes = &fake_pointer_attributes;
  FakeRange read_only{0x10000000, 0x100000, CU_MEMORYTYPE_DEVICE, 0, false};
  read_only.access = CU_POINTER_ATTRIBUTE_ACCESS_FLAG_READ;
  FakeRange no_access{0x20000000, 0x100000, CU_MEMORYTYPE_DEVICE, 0, false};
  no_access.access = CU_POINTER_ATTRIBUTE_ACCESS_FLAG_NONE;
  // A reservation of 4 MiB whose last MiB device 0 may only read.
  FakeRange last_read_only{0x30000000, 0x400000, CU_MEMORYTYPE_DEVICE, 0, false};
  last_read_only.read_only_start = 0x30300000;
  last_read_only.read_only_size = 0x100000;
  // Pinned host memory the device may only read (as cuMemHostRegister's READ_ONLY flag asks).
  FakeRange host_read_only{0x40000000, 0x100000, CU_MEMORYTYPE_HOST, 0, false};
  host_read_only.access = CU_POINTER_ATTRIBUTE_ACCESS_FLAG_READ;
  // Pinned host memory this device has no access to (the hint is for device memory only).
  FakeRange host_no_access{0x50000000, 0x100000, CU_MEMORYTYPE_HOST, 0, false};
  host_no_access.access = CU_POINTER_ATTRIBUTE_ACCESS_FLAG_NONE;
  g_ranges = {read_only, no_access, last_read_only, host_read_only, host_no_access};
  using moejit::detail::Span;
  using moejit::detail::SpanUse;
  const auto contains = [](const std::string& text, const std::string& part) {
    INFO(text);
    return text.find(part) != std::string::npos;
  };
  const auto write_error = [&](const Span& span, bool capturing = false) {
    return span_error(api, span, capturing, SpanUse::kWrite);
  };

  // Read-only memory serves a buffer the kernels only read, not one they write.
  CHECK(span_error(api, Span{"weights.w13", at(0x10000000), 0x100000}).empty());
  CHECK(span_error(api, Span{"weights.w13", at(0x40000000), 0x1000}).empty());
  std::string e = write_error(Span{"out", at(0x10000000), 0x1000});
  CHECK(contains(e,
                 "moe_forward: out: expected memory mapped on device 0 for its 4096 bytes from "
                 "0x10000000 (its first and last byte, within one allocation, read-write for "
                 "it), found memory at 0x10000000 mapped read-only for device 0, for a buffer "
                 "the kernels write"));
  CHECK(contains(write_error(Span{"out", at(0x40000000), 0x1000}), "mapped read-only"));
  // No access at all: refused whichever way the kernels use it.
  e = span_error(api, Span{"weights.w2", at(0x20000000), 0x1000});
  CHECK(contains(e, "(its first and last byte, within one allocation, readable for it)"));
  CHECK(contains(e,
                 "found memory at 0x20000000 mapped without access for device 0 "
                 "(cuMemMap'd, and cuMemSetAccess gave it none)"));
  CHECK(contains(write_error(Span{"workspace", at(0x20000000), 0x1000}),
                 "mapped without access for device 0"));
  e = span_error(api, Span{"hidden", at(0x50000000), 0x1000});
  CHECK(contains(e, "found memory at 0x50000000 mapped without access for device 0"));
  CHECK(!contains(e, "cuMemSetAccess"));
  // A reservation's ends are asked one by one: a span ending in its read-only chunk is refused
  // as an output by its last byte, and passes as an input; one ending before that chunk passes.
  CHECK(write_error(Span{"out", at(0x30000000), 0x300000}).empty());
  e = write_error(Span{"out", at(0x30200000), 0x100001});
  CHECK(contains(e, "found its last byte, 0x30300000, in memory mapped read-only for device 0"));
  CHECK(span_error(api, Span{"hidden", at(0x30200000), 0x100001}).empty());
  // While capturing: bytes with no memory yet still pass as outputs (they report no access),
  // and what the driver knows is still checked.
  CHECK(write_error(Span{"out", at(0x7000), 4096}, true).empty());
  CHECK(contains(write_error(Span{"out", at(0x10000000), 0x1000}, true), "mapped read-only"));
  CHECK(
      contains(span_error(api, Span{"hidden", at(0x20000000), 16}, true), "mapped without access"));
  g_ranges.clear();
}

TEST_CASE("driver: a tensor labelled managed or pinned host is refused by its label, with a hint",
          "[driver]") {
  // Why a hint: the kernels can reach such memory, so the producer's label is all that is wrong
  // (torch labels managed and pinned tensors kDLCUDA; the pointer checks pass their memory).
  int64_t shape[2] = {4, 8};
  DLTensor tensor{};
  tensor.data = reinterpret_cast<void*>(uintptr_t{0x10000});
  tensor.ndim = 2;
  tensor.shape = shape;
  tensor.dtype = DLDataType{kDLBfloat, 16, 1};
  const auto message = [&](DLDeviceType type) {
    tensor.device = DLDevice{type, 0};
    try {
      moejit::detail::check_matrix("moe_forward", "hidden", &tensor, 0);
    } catch (const Error& e) {
      CHECK(e.code() == ErrorCode::kInvalidArgument);
      return std::string(e.what());
    }
    return std::string("(accepted)");
  };
  CHECK(message(kDLCUDA) == "(accepted)");
  for (DLDeviceType type : {kDLCUDAManaged, kDLCUDAHost}) {
    const std::string text = message(type);
    INFO(text);
    CHECK(text.rfind("moe_forward: hidden: expected a CUDA tensor (kDLCUDA) on device 0", 0) == 0);
    CHECK(text.find("the kernels can reach this memory: export it as a kDLCUDA tensor of device "
                    "0") != std::string::npos);
  }
  const std::string host = message(kDLCPU);
  INFO(host);
  CHECK(host.find("found cpu") != std::string::npos);
  CHECK(host.find("can reach") == std::string::npos);

  // A repack's checkpoint tensors say the same, by name of device type.
  int64_t blocks_shape[4] = {2, 16, 4, 16};
  DLTensor blocks{};
  blocks.data = reinterpret_cast<void*>(uintptr_t{0x10000});
  blocks.ndim = 4;
  blocks.shape = blocks_shape;
  blocks.dtype = DLDataType{kDLUInt, 8, 1};
  blocks.device = DLDevice{kDLCUDAHost, 0};
  try {
    moejit::detail::check_byte_tensor("moe_repack", "w2_blocks", &blocks, 0, {16, 4, 16}, false,
                                      "[n, 16, 4, 16]");
    FAIL("a pinned-host checkpoint tensor was accepted");
  } catch (const Error& e) {
    const std::string text = e.what();
    INFO(text);
    CHECK(text.find("moe_repack: w2_blocks: expected a CUDA tensor (kDLCUDA) on device 0") == 0);
    CHECK(text.find("found cuda_host (pinned host memory) (3) device 0; the kernels can reach") !=
          std::string::npos);
  }
}
