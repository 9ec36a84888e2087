#include "ops/moe_launch.hpp"

#include <cstdint>
#include <limits>
#include <mutex>
#include <shared_mutex>
#include <sstream>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "common/fork.hpp"
#include "driver/driver.hpp"
#include "moejit/error.hpp"
#include "ops/tensor_checks.hpp"

namespace moejit::detail {

namespace {

// (kernel, device) pairs whose dynamic shared memory limit is raised. Why a table: the attribute
// is per kernel and device and survives for the process, and a driver call per launch would
// cost more than the launch's own checks.
class SmemOptIns {
 public:
  static SmemOptIns& instance() {
    // Why leaked, as the runtime is: ops may run from threads that outlive static destruction.
    static SmemOptIns* table = new SmemOptIns;
    return *table;
  }
  bool contains(CUkernel kernel, int device, int bytes) {
    std::shared_lock<std::shared_mutex> lock(mutex_);
    return set_.count(Key{kernel, device, bytes}) != 0;
  }
  void insert(CUkernel kernel, int device, int bytes) {
    std::unique_lock<std::shared_mutex> lock(mutex_);
    set_.insert(Key{kernel, device, bytes});
  }

 private:
  // Why: a fork must not copy the table's mutex locked (it is a leaf: nothing is taken under it).
  SmemOptIns() { hold_across_fork_last(&mutex_); }
  struct Key {
    CUkernel kernel;
    int device;
    int bytes;
    bool operator==(const Key& o) const {
      return kernel == o.kernel && device == o.device && bytes == o.bytes;
    }
  };
  struct KeyHash {
    std::size_t operator()(const Key& k) const noexcept {
      return std::hash<const void*>{}(k.kernel) ^
             (static_cast<std::size_t>(static_cast<unsigned>(k.device)) << 1) ^
             (static_cast<std::size_t>(static_cast<unsigned>(k.bytes)) << 9);
    }
  };
  std::shared_mutex mutex_;
  std::unordered_set<Key, KeyHash> set_;
};

std::string dims_text(const DLTensor& tensor) { return shape_text(tensor); }

// What the driver says of one byte's memory (cuPointerGetAttributes, which reports a byte it does
// not know with zeros instead of failing).
struct ByteMemory {
  unsigned type = 0;  // CUmemorytype; 0: memory CUDA does not know
  int ordinal = -1;   // the device it was allocated on or registered with
  bool managed = false;
  bool mapped = false;  // something is mapped at it (else a reserved range's hole)
  unsigned access = 0;  // CUDA_POINTER_ATTRIBUTE_ACCESS_FLAGS of the current context's device
  CUdeviceptr range_start = 0;
  std::size_t range_size = 0;  // the allocation's, or the reserved address range's
};

ByteMemory byte_memory(const DriverApi& api, const char* op, const char* arg, CUdeviceptr address) {
  CUpointer_attribute asked[] = {
      CU_POINTER_ATTRIBUTE_MEMORY_TYPE,      CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
      CU_POINTER_ATTRIBUTE_IS_MANAGED,       CU_POINTER_ATTRIBUTE_MAPPED,
      CU_POINTER_ATTRIBUTE_RANGE_START_ADDR, CU_POINTER_ATTRIBUTE_RANGE_SIZE,
      CU_POINTER_ATTRIBUTE_ACCESS_FLAGS};
  constexpr unsigned kCount = sizeof(asked) / sizeof(asked[0]);
  // Why 8 zeroed bytes each: the attributes are 4-byte ints and bools or 8-byte addresses and
  // sizes, and one the driver leaves unset must read as 0.
  uint64_t value[kCount] = {};
  void* data[kCount];
  for (unsigned i = 0; i < kCount; ++i) data[i] = &value[i];
  const CUresult result = api.cuPointerGetAttributes(kCount, asked, data, address);
  if (result != CUDA_SUCCESS) {
    std::ostringstream os;
    os << op << ": " << arg << ": the driver could not describe address 0x" << std::hex << address
       << " (cuPointerGetAttributes: " << describe(result) << ")";
    throw Error(ErrorCode::kDriver, os.str());
  }
  ByteMemory m;
  m.type = static_cast<unsigned>(value[0] & 0xffffffffu);
  m.ordinal = m.type == 0 ? -1 : static_cast<int>(static_cast<int32_t>(value[1] & 0xffffffffu));
  m.managed = (value[2] & 0xffffffffu) != 0;
  m.mapped = (value[3] & 0xffffffffu) != 0;
  m.range_start = static_cast<CUdeviceptr>(value[4]);
  m.range_size = static_cast<std::size_t>(value[5]);
  m.access = static_cast<unsigned>(value[6] & 0xffffffffu);
  return m;
}

std::string bytes_text(uint64_t bytes) {
  return std::to_string(bytes) + (bytes == 1 ? " byte" : " bytes");
}

std::string address_text(uint64_t address) {
  std::ostringstream os;
  os << "0x" << std::hex << address;
  return os.str();
}

}  // namespace

void check_span_memory(const char* op, const DriverApi& api, int device, const Span& span,
                       SpanUse use, bool capturing) {
  if (span.bytes <= 0 || span.data == nullptr) return;
  const uint64_t first = reinterpret_cast<uintptr_t>(span.data);
  const uint64_t bytes = static_cast<uint64_t>(span.bytes);
  // Why a message only when refusing: a call whose buffers pass builds no string.
  const auto refuse = [&](const std::string& found) {
    throw_argument(op, span.arg,
                   "memory mapped on device " + std::to_string(device) + " for its " +
                       bytes_text(bytes) + " from " + address_text(first) +
                       " (its first and last byte, within one allocation, " +
                       (use == SpanUse::kWrite ? "read-write" : "readable") + " for it)",
                   found);
  };
  if (bytes - 1 > std::numeric_limits<uint64_t>::max() - first) {
    refuse("a span that wraps around the address space");
  }
  const uint64_t last = first + bytes - 1;
  // Why unknown or unmapped bytes pass while the stream captures: an allocation made in the
  // capture (cudaMallocAsync, a graph's memory node) has its address but no memory until the
  // graph runs. What the driver does know is still checked.
  const auto no_memory = [](const ByteMemory& m) {
    return m.type == 0 || (m.type == CU_MEMORYTYPE_DEVICE && !m.managed && !m.mapped);
  };
  const auto unreachable = [&](const ByteMemory& m) { return !capturing && no_memory(m); };
  const auto other_device = [&](const ByteMemory& m) {
    return m.type == CU_MEMORYTYPE_DEVICE && !m.managed && m.ordinal != device;
  };
  const ByteMemory head = byte_memory(api, op, span.arg, static_cast<CUdeviceptr>(first));
  if (unreachable(head)) {
    refuse(head.type == 0
               ? "memory CUDA does not know at " + address_text(first) +
                     " (host memory from malloc or new, memory cuMemFree'd, or a "
                     "wrong address)"
               : "no memory mapped at " + address_text(first) + " (a hole in a reserved range)");
  }
  if (other_device(head)) refuse("device memory of device " + std::to_string(head.ordinal));
  // What an end's access flags refuse. Why only where there is memory: the driver reports no
  // access for bytes it does not know or that nothing is mapped at, which get here only while
  // capturing. Why each end: a reservation's chunks are mapped, and given access, one by one.
  enum class Access { kOk, kNone, kReadOnly };
  const auto access_of = [&](const ByteMemory& m) {
    if (no_memory(m)) return Access::kOk;
    if ((m.access & CU_POINTER_ATTRIBUTE_ACCESS_FLAG_READ) == 0) return Access::kNone;
    if (use == SpanUse::kWrite && m.access != CU_POINTER_ATTRIBUTE_ACCESS_FLAG_READWRITE) {
      return Access::kReadOnly;
    }
    return Access::kOk;
  };
  const auto access_text = [&](const ByteMemory& m, Access access) {
    const std::string of = "device " + std::to_string(device);
    if (access == Access::kReadOnly) {
      return "mapped read-only for " + of + ", for a buffer the kernels write";
    }
    return "mapped without access for " + of +
           (m.type == CU_MEMORYTYPE_DEVICE ? " (cuMemMap'd, and cuMemSetAccess gave it none)" : "");
  };
  if (const Access access = access_of(head); access != Access::kOk) {
    refuse("memory at " + address_text(first) + " " + access_text(head, access));
  }
  if (head.range_size > 0 &&
      (first < head.range_start || bytes > head.range_start + head.range_size - first)) {
    const uint64_t end = head.range_start + head.range_size;
    refuse("an allocation of " + bytes_text(head.range_size) + " from " +
           address_text(head.range_start) + " that ends " + bytes_text(first + bytes - end) +
           " before the buffer does");
  }
  if (bytes > 1) {
    const ByteMemory tail = byte_memory(api, op, span.arg, static_cast<CUdeviceptr>(last));
    if (unreachable(tail)) refuse("no memory at its last byte, " + address_text(last));
    if (other_device(tail)) {
      refuse("its last byte, " + address_text(last) + ", in device memory of device " +
             std::to_string(tail.ordinal));
    }
    if (const Access access = access_of(tail); access != Access::kOk) {
      refuse("its last byte, " + address_text(last) + ", in memory " + access_text(tail, access));
    }
  }
}

SpanMemoryCheck::SpanMemoryCheck(const char* op, const OpTarget& target)
    : op_(op), api_(driver()), device_(target.device.ordinal) {
  CUstreamCaptureStatus status = CU_STREAM_CAPTURE_STATUS_NONE;
  const CUresult result = api_.cuStreamIsCapturing(target.stream.handle, &status);
  // The legacy stream while another stream captures in global mode: the driver refuses the
  // question, and a capture is under way.
  capturing_ = result == CUDA_ERROR_STREAM_CAPTURE_IMPLICIT ||
               (result == CUDA_SUCCESS && status != CU_STREAM_CAPTURE_STATUS_NONE);
}

void rethrow_for_op(const char* op) {
  const std::string prefix = std::string(op) + ": ";
  try {
    throw;
  } catch (const CompileError& e) {
    throw CompileError(prefix + e.what(), e.kernel(), e.options(), e.log(), e.source_path());
  } catch (const DescriptorError& e) {
    throw DescriptorError(prefix + e.what(), e.file(), e.line(), e.column(), e.pointer());
  } catch (const Error& e) {
    throw Error(e.code(), prefix + e.what());
  }
}

OpStream check_stream_device(const char* op, const DriverApi& api, CUstream stream, int device) {
  OpStream out;
  out.handle = stream;
  CUcontext current = nullptr;
  if (api.cuCtxGetCurrent(&current) != CUDA_SUCCESS) return out;
  // Why not cuStreamGetDevice (one call): on a capturing stream it invalidates the capture
  // (measured on an H100, driver 13.0: every captured op then failed). cuStreamGetCtx does not.
  CUcontext stream_context = current;
  const bool default_stream =
      stream == nullptr || stream == CU_STREAM_LEGACY || stream == CU_STREAM_PER_THREAD;
  if (!default_stream && api.cuStreamGetCtx(stream, &stream_context) != CUDA_SUCCESS) return out;
  if (api.cuCtxGetId(stream_context, &out.context_id) != CUDA_SUCCESS) out.context_id = 0;
  out.context_current = stream_context == current;
  if (out.context_current) return out;
  // Another context: its device, asked with it current for the query (cuCtxGetDevice's
  // pre-13.0 form, which every driver has), then the caller's context current again.
  if (api.cuCtxPushCurrent(stream_context) != CUDA_SUCCESS) return out;
  CUdevice of_stream = -1;
  const CUresult asked = api.cuCtxGetDevice(&of_stream);
  CUcontext popped = nullptr;
  if (api.cuCtxPopCurrent(&popped) != CUDA_SUCCESS || popped != stream_context) {
    throw Error(ErrorCode::kDriver, std::string(op) +
                                        ": stream: asking the device of the stream's context left "
                                        "another context current (cuCtxPopCurrent)");
  }
  if (asked != CUDA_SUCCESS || of_stream == device) return out;
  const std::string ours = "device " + std::to_string(device);
  throw Error(ErrorCode::kInvalidArgument,
              std::string(op) + ": stream: expected a stream of " + ours +
                  " (the current context's, which the tensors are checked against), found a "
                  "stream of device " +
                  std::to_string(of_stream) +
                  ": make the stream's device current, or pass a stream of " + ours);
}

CUfunction launch_function(CUkernel kernel, const OpStream& stream) {
  // Why: cuLaunchKernelEx given a CUkernel finds its function in the stream's context on every
  // launch, which cost 0.15-0.3 us a launch more than the function itself on the H200; with this
  // table the library's time over bare launches fell from 0.8-2.3 to 0.4-0.9 us a moe_forward
  // call on an H100 machine (tools/PERF_LOG.md "each kernel launched through its function").
  // Why the context's id (cuCtxGetId, unique for the life of the process) and not its handle: a
  // context created after another was destroyed may reuse the handle, and the old context's
  // functions are gone. Why per thread: no lock on the launch path. Why the id from the op's
  // stream check: it asked the driver once for every launch of the op.
  struct Key {
    CUkernel kernel;
    unsigned long long context;
    bool operator==(const Key& o) const { return kernel == o.kernel && context == o.context; }
  };
  struct KeyHash {
    std::size_t operator()(const Key& k) const noexcept {
      return std::hash<const void*>{}(k.kernel) ^ std::hash<unsigned long long>{}(k.context) << 1;
    }
  };
  // Why a bound: a process that creates and destroys contexts would otherwise grow the table by
  // its kernels on every context; past it, the table starts over.
  constexpr std::size_t kMaxFunctions = 4096;
  thread_local std::unordered_map<Key, CUfunction, KeyHash> functions;

  // Every failure below leaves the launch to the CUkernel, as the driver takes it: a real
  // problem (no context, a bad stream) is then reported by the launch, with the op and geometry.
  const auto as_kernel = reinterpret_cast<CUfunction>(kernel);
  if (stream.context_id == 0) return as_kernel;
  const Key key{kernel, stream.context_id};
  const auto it = functions.find(key);
  if (it != functions.end()) return it->second;
  // cuKernelGetFunction answers for the current context; a stream of another one keeps the
  // CUkernel (the driver launches it in the stream's context).
  CUfunction function = nullptr;
  if (!stream.context_current || driver().cuKernelGetFunction(&function, kernel) != CUDA_SUCCESS) {
    return as_kernel;
  }
  if (functions.size() >= kMaxFunctions) functions.clear();
  functions.emplace(key, function);
  return function;
}

void launch_moe_kernel(const char* op, const KernelSpec& spec, CUkernel kernel,
                       const LaunchShape& shape, bool pdl, const OpStream& stream, void** args) {
  CUlaunchAttribute attribute{};
  attribute.id = CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
  attribute.value.programmaticStreamSerializationAllowed = 1;
  const bool use_pdl = pdl && spec.arch.sm >= 90;
  CUlaunchConfig config{};
  config.gridDimX = shape.grid_x;
  config.gridDimY = shape.grid_y;
  config.gridDimZ = shape.grid_z;
  config.blockDimX = shape.block;
  config.blockDimY = 1;
  config.blockDimZ = 1;
  config.sharedMemBytes = shape.smem;
  config.hStream = stream.handle;
  config.attrs = use_pdl ? &attribute : nullptr;
  config.numAttrs = use_pdl ? 1 : 0;
  const CUresult result =
      driver().cuLaunchKernelEx(&config, launch_function(kernel, stream), args, nullptr);
  if (result != CUDA_SUCCESS) {
    std::ostringstream os;
    os << op << ": launching " << spec.display_name() << " (grid " << shape.grid_x << 'x'
       << shape.grid_y << 'x' << shape.grid_z << ", block " << shape.block
       << ", dynamic shared memory " << shape.smem << " bytes) on stream "
       << static_cast<const void*>(stream.handle) << " failed: " << describe(result);
    throw Error(ErrorCode::kDriver, os.str());
  }
}

void ensure_dynamic_smem(const char* op, const KernelSpec& spec, CUkernel kernel, int device,
                         int bytes, bool max_carveout) {
  // Why 48 KB: every CUDA device gives a CTA that much without opting in.
  if (bytes <= 48 * 1024 && !max_carveout) return;
  SmemOptIns& table = SmemOptIns::instance();
  if (table.contains(kernel, device, bytes)) return;
  const DriverApi& api = driver();
  if (max_carveout) {
    const CUresult carveout = api.cuKernelSetAttribute(
        CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT, CU_SHAREDMEM_CARVEOUT_MAX_SHARED,
        kernel, device);
    if (carveout != CUDA_SUCCESS) {
      std::ostringstream os;
      os << op << ": " << spec.display_name()
         << ": asking for the largest shared-memory carveout failed (cuKernelSetAttribute: "
         << describe(carveout) << ")";
      throw Error(ErrorCode::kDriver, os.str());
    }
  }
  const CUresult result = api.cuKernelSetAttribute(CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                                                   bytes, kernel, device);
  if (result != CUDA_SUCCESS) {
    int limit = 0;
    api.cuDeviceGetAttribute(&limit, CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN, device);
    std::ostringstream os;
    os << op << ": " << spec.display_name() << " needs " << bytes
       << " bytes of dynamic shared memory per CTA; device " << device << " allows " << limit
       << " (cuKernelSetAttribute: " << describe(result) << ")";
    throw Error(limit > 0 && limit < bytes ? ErrorCode::kUnsupported : ErrorCode::kDriver,
                os.str());
  }
  table.insert(kernel, device, bytes);
}

void check_device_pointer(const char* op, const char* arg, const void* pointer,
                          std::uintptr_t alignment) {
  if (pointer == nullptr) {
    throw_argument(op, arg, "a device pointer", "null");
  }
  if (reinterpret_cast<std::uintptr_t>(pointer) % alignment != 0) {
    std::ostringstream found;
    found << "address " << pointer;
    throw_argument(op, arg, "a pointer aligned to " + std::to_string(alignment) + " bytes",
                   found.str());
  }
}

ByteTensor check_byte_tensor(const char* op, const char* arg, const DLTensor* tensor, int device,
                             std::initializer_list<std::int64_t> dims_after_leading,
                             bool leading_optional, const char* dims_text_expected) {
  const std::vector<std::int64_t> dims(dims_after_leading);
  const int full = static_cast<int>(dims.size()) + 1;
  const std::string expected_shape =
      std::string(dims_text_expected) +
      (leading_optional ? " (or without the leading n: one expert)" : "");
  if (tensor == nullptr) throw_argument(op, arg, "a uint8 tensor " + expected_shape, "null");
  if (tensor->device.device_type != kDLCUDA || tensor->device.device_id != device) {
    throw_device(op, arg, *tensor, device);
  }
  if (tensor->dtype.code != kDLUInt || tensor->dtype.bits != 8 || tensor->dtype.lanes != 1) {
    throw_dtype(op, arg, "uint8 (MXFP4 nibble pairs or E8M0 scales, as the checkpoint stores them)",
                *tensor);
  }
  const bool short_form = leading_optional && tensor->ndim == full - 1;
  if (tensor->shape == nullptr || (tensor->ndim != full && !short_form)) {
    throw_shape(op, arg, expected_shape, *tensor);
  }
  const int offset = short_form ? 0 : 1;
  ByteTensor out;
  out.count = short_form ? 1 : tensor->shape[0];
  if (out.count < 1) throw_shape(op, arg, expected_shape + " with n >= 1", *tensor);
  for (std::size_t i = 0; i < dims.size(); ++i) {
    if (tensor->shape[static_cast<int>(i) + offset] != dims[i]) {
      throw_shape(op, arg, expected_shape, *tensor);
    }
  }
  if (tensor->strides != nullptr) {
    std::int64_t expect = 1;
    for (int d = tensor->ndim - 1; d >= 0; --d) {
      if (tensor->shape[d] > 1 && tensor->strides[d] != expect) {
        throw_argument(op, arg, "a contiguous row-major tensor",
                       "strides that are not compact for shape " + dims_text(*tensor) +
                           "; pass a contiguous tensor (e.g. .contiguous())");
      }
      // Why not past the leading dim: only the dims after it are bounded here (the caller
      // checks n), and n times their product may not fit an int64.
      if (d > 0) expect *= tensor->shape[d];
    }
  }
  if (tensor->data == nullptr) throw_argument(op, arg, "non-null data", "null data");
  out.data = static_cast<const std::uint8_t*>(offset_data(op, arg, *tensor));
  return out;
}

}  // namespace moejit::detail
