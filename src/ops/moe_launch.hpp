// Launch plumbing shared by the MoE ops: one cuLaunchKernelEx with the programmatic dependent
// launch attribute where the kernel waits on its predecessor, the dynamic shared memory opt-in
// (once per kernel and device), and the checks of raw device pointers and uint8 checkpoint
// tensors that the DLTensor checks of tensor_checks.hpp don't cover.
#pragma once

#include <cuda.h>
#include <dlpack/dlpack.h>

#include <cstdint>
#include <initializer_list>

#include "moejit/error.hpp"
#include "moejit/kernel_spec.hpp"
#include "ops/tensor_checks.hpp"
#include "runtime/runtime_impl.hpp"

namespace moejit::detail {

// Rethrows the moejit::Error being handled with "<op>: " in front of its message, as the op's own
// argument errors have it, keeping its type and fields (a CompileError keeps its log). Call only
// inside a catch block of moejit::Error.
[[noreturn]] void rethrow_for_op(const char* op);

// The caller's stream as an op's launches use it, asked of the driver once per op
// (check_stream_device): its context's id, which each launch finds its kernel's function by
// (launch_function), and whether that context is the current one. context_id 0: the driver
// could not say, and the launches go through the CUkernel (the driver then names what is wrong).
struct OpStream {
  CUstream handle = nullptr;
  unsigned long long context_id = 0;
  bool context_current = false;
};

// Refuses (Error{kInvalidArgument}, "<op>: stream: ...") a stream of another device than
// `device`, the current context's, which the op checks its tensors against: launched there, its
// kernels would read this device's pointers on that one (an illegal address, which breaks that
// device's context). The default streams (0, CU_STREAM_LEGACY, CU_STREAM_PER_THREAD) are the
// current context's; a stream of another context of the same device passes; a stream the driver
// can't read is left to the capture query and the launch, which name it. Returns the stream as
// the op's launches use it. Three driver calls where the stream is the current context's (the
// common case; two for a default stream); for another context's, its device is asked with that
// context pushed current for the query.
OpStream check_stream_device(const char* op, const DriverApi& api, CUstream stream, int device);

// What an op runs on: the current context's device and the caller's stream, checked against it;
// and whether its buffers are asked of the driver too (RuntimeConfig::check_pointers).
struct OpTarget {
  CurrentDevice device;
  OpStream stream;
  bool check_pointers = false;
};

// Runtime::current_device for an op, and the caller's stream checked against it
// (check_stream_device): no usable context (or no driver) is refused under the op's name, as
// op_kernel's errors are.
inline OpTarget op_target(const char* op, Runtime& runtime, CUstream stream) {
  OpTarget target;
  try {
    target.device = runtime.current_device();
  } catch (const Error&) {
    rethrow_for_op(op);
  }
  target.stream = check_stream_device(op, driver(), stream, target.device.ordinal);
  target.check_pointers = runtime.check_pointers();
  return target;
}

// Runtime::kernel for an op: a kernel it can't have (a failed compile, a capture miss, a driver
// refusal) is refused under the op's name ("moe_forward: kernel ... is not loaded in this process
// yet, ..."), which the C ABI then gives its caller as the C call's.
inline CUkernel op_kernel(const char* op, Runtime& runtime, const KernelSpec& spec,
                          CUstream stream) {
  try {
    return runtime.kernel(spec, stream);
  } catch (const Error&) {
    rethrow_for_op(op);
  }
}

struct LaunchShape {
  unsigned grid_x = 1;
  unsigned grid_y = 1;
  unsigned grid_z = 1;
  unsigned block = 1;
  unsigned smem = 0;  // dynamic shared memory bytes
};

// The handle to launch `kernel` on `stream` through: its function in the stream's context
// (cuKernelGetFunction), kept per thread and context, where that context is current; else the
// CUkernel itself (the driver then finds the function in the stream's context at each launch).
// No driver call once the function is kept.
CUfunction launch_function(CUkernel kernel, const OpStream& stream);

// Launches `kernel` on `stream`, through its function in the stream's context (launch_function).
// `pdl`: the kernel starts with griddepcontrol.wait, so it may be scheduled while the previous
// kernel drains (the attribute is set on sm_90+ only). Throws Error{kDriver} naming the op, the
// kernel and the geometry.
void launch_moe_kernel(const char* op, const KernelSpec& spec, CUkernel kernel,
                       const LaunchShape& shape, bool pdl, const OpStream& stream, void** args);

// Lets `kernel` use `bytes` of dynamic shared memory on device `device` (cuKernelSetAttribute,
// needed above 48 KB). The first call per (kernel, device) sets it; later ones are a table read.
// Throws Error{kUnsupported} with the device's limit when it is lower. With `max_carveout` it also
// asks for the SM's largest shared-memory carveout, for kernels whose CTAs must share an SM with
// another kernel's (the driver otherwise sizes the carveout for one kernel alone, and a second
// kernel's CTA then waits for the SM to drain).
void ensure_dynamic_smem(const char* op, const KernelSpec& spec, CUkernel kernel, int device,
                         int bytes, bool max_carveout = false);

// Whether the kernels only read a buffer or also write it (outputs, workspaces, repack targets).
enum class SpanUse { kRead, kWrite };

// RuntimeConfig::check_pointers: `span` (unless empty) must be memory the driver has mapped on
// device `device` at its first and last byte, within one allocation (or one cuMemAddressReserve
// range), with access for `device` at both ends (read-write where `use` is kWrite), as
// cuPointerGetAttributes reports those two bytes (one call each, through `api`).
// Refused, as Error{kInvalidArgument} "<op>: <arg>: expected ..., found ...": memory CUDA does not
// know (host memory from malloc, memory cuMemFree'd, wrong addresses), device memory of another
// device at either end, a span running past the end of its allocation or range, either end in
// an unmapped hole of a reservation, either end mapped without access for `device` (cuMemMap
// without cuMemSetAccess), or a written span with an end mapped read-only. Managed and pinned
// host memory pass. It can't see inside an allocation: a tensor a caching allocator cut too
// small, or one it has taken back, passes. While the stream `capturing` a graph, unknown and
// unmapped bytes pass (an allocation made in the capture has no memory until the graph runs).
void check_span_memory(const char* op, const DriverApi& api, int device, const Span& span,
                       SpanUse use, bool capturing);
// check_span_memory for the buffers of one op call on `target`, through the process's driver:
// whether the call's stream captures a graph is asked once, at construction (the legacy stream
// during another's global capture counts; a stream the driver can't answer for counts as not
// capturing, and the launch then names it).
class SpanMemoryCheck {
 public:
  SpanMemoryCheck(const char* op, const OpTarget& target);
  // A buffer the kernels only read.
  void read(const Span& span) const {
    check_span_memory(op_, api_, device_, span, SpanUse::kRead, capturing_);
  }
  // A buffer the kernels write (and may read).
  void write(const Span& span) const {
    check_span_memory(op_, api_, device_, span, SpanUse::kWrite, capturing_);
  }

 private:
  const char* op_;
  const DriverApi& api_;
  int device_;
  bool capturing_;
};

// `pointer` non-null and aligned to `alignment` bytes, else Error{kInvalidArgument}.
void check_device_pointer(const char* op, const char* arg, const void* pointer,
                          std::uintptr_t alignment);

// A contiguous uint8 tensor on CUDA device `device` whose shape is `dims` (or, when
// `leading_optional`, `dims` without its first extent: one expert). Returns the data pointer
// (data + byte_offset) and the leading extent (1 for the short form). Throws
// Error{kInvalidArgument} "<op>: <arg>: expected ..., found ..." naming every expected extent.
struct ByteTensor {
  const std::uint8_t* data = nullptr;
  std::int64_t count = 0;  // leading extent (experts)
};
ByteTensor check_byte_tensor(const char* op, const char* arg, const DLTensor* tensor, int device,
                             std::initializer_list<std::int64_t> dims_after_leading,
                             bool leading_optional, const char* dims_text);

}  // namespace moejit::detail
