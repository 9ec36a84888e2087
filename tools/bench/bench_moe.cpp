// moejit_bench_moe: the routed-expert MXFP4 MoE layer (moejit::moe_forward) on the GPU, per model
// and token count, as tables (and JSON with --json PATH, rewritten after every model so a run cut
// short keeps what it measured). Every figure is a median. Two sections, both in the default run
// (--section marlin or --section decode runs one):
//
// marlin section (MoePath::kMarlin forced: route -> FC1 -> FC2 -> combine), per row (model, T):
//   - the whole layer: one CUDA graph of N back-to-back moe_forward calls, replayed; median
//     replay time / N (so launch gaps are not counted as kernel time at small T);
//   - each kernel: the same graph with every layer cut after each of its kernels in launch order,
//     the cut layers joined as the whole ones are (programmatic dependent launch kept), replayed
//     in turn with the whole graph; a kernel's time is what it adds to the cut before it (the
//     part of it that does not overlap the previous kernel), so the kernels add up to the
//     whole graph's time in that alternation ("sum us"). Where the dense baseline runs, the
//     layer column alternates with it instead, and the two differ where the layer draws the
//     most power: on the H200 a layer of 1-2 GB replayed back to back reaches the 700 W cap and
//     the SM clock falls to ~1770-1830 MHz (5-14% more time: gpt-oss-120b T = 96 447 against
//     400 us), while beside the dense GEMMs, or after an idle gap (--gap-ms), it runs at 1980
//     MHz; each figure's median SM clock is printed ("MHz", NVML) so the regime is visible;
//   - experts touched and bytes of MXFP4 weights touched (kernel layout: nibbles + scales), and
//     that traffic over the layer time as a fraction of the device-to-device copy bandwidth
//     measured in the same run (bytes read + written / time);
//   - TFLOP/s = 2·(T·k local entries)·3·H·I / time, beside a dense bf16 baseline measured in the
//     same run: cuBLAS bf16 GEMMs (fp32 accumulate) over the same routing, one [m_e x H] x
//     [H x 2I] and one [m_e x I] x [I x H] per touched expert (inputs pre-gathered; no activation
//     or combine), captured in a CUDA graph whose replays alternate with the layer's (both see
//     the same clocks); and one GEMM pair of the same FLOPs (M = the T·k local entries as rows,
//     one expert's weights) as the dense compute roofline; and the same GEMMs as two cuBLAS
//     grouped calls a layer (cublasGemmGroupedBatchedEx, experts of equal row count one group),
//     in the same alternation: what a library grouped GEMM makes of the per-expert loop.
//   Default: gpt-oss-120b, deepseek-v4-flash-tp4, qwen3-30b-a3b, kimi-k3.1-tp8 at T = 1, 6, 24,
//   96, 256, 1024, 4096.
//
// decode section (decode_moe, MoePath::kDecode forced, against MoePath::kMarlin on the same
// inputs and weight copies), per row (model, T <= 256):
//   - the decode layer time and the marlin layer time, each as above (graph of N back-to-back
//     calls, median replay / N); the two graphs' replays alternate, so both see the same clocks;
//   - experts touched, MXFP4 bytes touched, each path's fraction of the copy bandwidth, and the
//     time ratio decode / marlin (below 1: decode_moe is faster);
//   - the read floor (--no-floor skips it): a kernel that only reads the bytes the layer reads
//     (every touched expert's nibbles and scales), once per layer call, as a graph of the same N
//     calls replayed in the same alternation, the fastest of seven read kernels: what reading
//     those bytes costs by itself under the layer's launch policy (see ReadFloor). Read-only
//     streams beat the copy figure (which reads and writes): the floor passes 100% of it;
//   - decode_moe's tile (block_n, FC1/FC2 strips per item, pipeline stages, CTAs per SM, or
//     "pair t<bucket>" for the two-launch tile of T <= 2), the planner's unless
//     --decode-block-n 8|16|32 forces the persistent tile's block_n;
//   - a check of one call of each: NaN/inf outputs, decode vs marlin relative L2 difference, and
//     the rms and exact zeros of marlin's output (so a 0 difference is seen to be one between
//     real outputs: where both paths add K in the same order, as the persistent decode tile and
//     the mma.sync marlin tile do, the outputs are equal to the bit).
//   Default: kimi-k3.1-tp8, kimi-k3.1-tp4-ep2, deepseek-v4-flash-tp4, qwen3-30b-a3b at T = 1, 6,
//   24, 96, 256. A model decode_moe can't serve (moe_decode_problem) is listed with the reason.
//
// --models and --tokens replace both sections' lists (the decode section keeps T <= 256), so a
// subset fits one short run: e.g. --section decode --models kimi-k3.1-tp8 --tokens 1,24.
// A model in both sections is set up once (kernels, weights) and serves both.
//
// Weights stay out of L2 between timed iterations: iteration i reads weight copy i mod R, with R
// chosen so that the other R - 1 copies' traffic covers L2 twice (both the MXFP4 and the dense
// weights). Weights are random (nibbles uniform, scales 2^-10..2^3); routing is uniform over the
// model's global experts (shape.global_experts: a rank of an expert-parallel model, such as
// kimi-k3.1-tp4-ep2, sees the entries that land on its own experts, about k·E/global per token;
// --local-routing draws only the rank's experts), distinct per token, with normalized weights;
// hidden states are bf16 with FC1 pre-activations near unit scale.
//
// Kernels are compiled (or loaded from the cache the environment names, MOEJIT_CACHE_DIR) by
// moejit::prewarm (and a forced decode block_n's kernels by moejit::build_kernel) before any
// timing; the compile time is reported, not timed as part of a row.
#include <cublas_v2.h>
#include <cuda.h>
#include <cudaTypedefs.h>
#include <cxxabi.h>
#include <dlfcn.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iostream>
#include <map>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "bench_common.hpp"
#include "bench_driver.hpp"
#include "bench_nvrtc.hpp"
#include "driver/driver.hpp"
#include "moejit/error.hpp"
#include "moejit/moe.hpp"
#include "moejit/runtime.hpp"
#include "moejit/version.hpp"
#include "ops/moe_reference.hpp"
#include "plan/moe_plan.hpp"

namespace {

using moejit::bench::driver_proc_address;
using moejit::bench::fixed;
using moejit::bench::load_entry;
using moejit::bench::print_table;
using moejit::detail::bf16_bits;
using moejit::detail::bf16_value;

using json = nlohmann::json;
using Clock = std::chrono::steady_clock;

// ---- errors -----------------------------------------------------------------------------------

void check(CUresult result, const char* call) {
  if (result == CUDA_SUCCESS) return;
  throw std::runtime_error(std::string(call) + " failed: " + moejit::detail::describe(result));
}
#define BENCH_CU(call) check((call), #call)

void check_blas(cublasStatus_t status, const char* call) {
  if (status == CUBLAS_STATUS_SUCCESS) return;
  throw std::runtime_error(std::string(call) + " failed: " + cublasGetStatusString(status));
}
#define BENCH_BLAS(call) check_blas((call), #call)

// ---- the driver -------------------------------------------------------------------------------

// The driver as libmoejit loaded it (dlopen at run time: the program starts, and says why, where
// no driver is installed).
const moejit::detail::DriverApi& cu() { return moejit::detail::driver(); }

// Graph inspection and editing calls libmoejit does not use (per-kernel times), fetched from the
// same libcuda with cuGetProcAddress at the ABI versions cudaTypedefs.h names.
struct GraphApi {
  PFN_cuGraphGetNodes_v10000 get_nodes = nullptr;
  PFN_cuGraphGetEdges_v12030 get_edges = nullptr;
  PFN_cuGraphNodeGetType_v10000 node_get_type = nullptr;
  PFN_cuGraphKernelNodeGetParams_v12000 kernel_node_get_params = nullptr;
  PFN_cuFuncGetName_v12030 func_get_name = nullptr;
  PFN_cuKernelGetName_v12030 kernel_get_name = nullptr;
  PFN_cuGraphClone_v10000 clone = nullptr;
  PFN_cuGraphNodeFindInClone_v10000 node_find_in_clone = nullptr;
  PFN_cuGraphDestroyNode_v10000 destroy_node = nullptr;
  PFN_cuGraphAddDependencies_v12030 add_dependencies = nullptr;
};

const GraphApi& graph_api() {
  static const GraphApi api = [] {
    const PFN_cuGetProcAddress_v12000 get = driver_proc_address();
    GraphApi a;
    load_entry(get, "cuGraphGetNodes", 10000, &a.get_nodes);
    load_entry(get, "cuGraphGetEdges", 12030, &a.get_edges);
    load_entry(get, "cuGraphNodeGetType", 10000, &a.node_get_type);
    load_entry(get, "cuGraphKernelNodeGetParams", 12000, &a.kernel_node_get_params);
    load_entry(get, "cuFuncGetName", 12030, &a.func_get_name);
    load_entry(get, "cuKernelGetName", 12030, &a.kernel_get_name);
    load_entry(get, "cuGraphClone", 10000, &a.clone);
    load_entry(get, "cuGraphNodeFindInClone", 10000, &a.node_find_in_clone);
    load_entry(get, "cuGraphDestroyNode", 10000, &a.destroy_node);
    load_entry(get, "cuGraphAddDependencies", 12030, &a.add_dependencies);
    return a;
  }();
  return api;
}

// ---- small helpers ------------------------------------------------------------------------------

std::size_t to_size(int64_t n) { return static_cast<std::size_t>(n); }

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const std::size_t n = v.size();
  return n % 2 == 1 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

uint64_t mix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// A uniform double in [0, 1) from (seed, i).
double unit(uint64_t seed, uint64_t i) {
  return static_cast<double>(mix64(seed * 0x100000001B3ull + i) >> 11) * 0x1p-53;
}

// A normal sample from (seed, i) (Box-Muller).
double normal(uint64_t seed, uint64_t i) {
  const double u1 = std::max(unit(seed, 2 * i), 1e-300);
  const double u2 = unit(seed, 2 * i + 1);
  return std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2);
}

// ---- device memory ------------------------------------------------------------------------------

class Buffer {
 public:
  Buffer() = default;
  explicit Buffer(std::size_t bytes) : bytes_(bytes) {
    if (bytes_ > 0) BENCH_CU(cu().cuMemAlloc(&ptr_, bytes_));
  }
  ~Buffer() {
    if (ptr_ != 0) cu().cuMemFree(ptr_);
  }
  Buffer(Buffer&& other) noexcept : ptr_(other.ptr_), bytes_(other.bytes_) {
    other.ptr_ = 0;
    other.bytes_ = 0;
  }
  Buffer& operator=(Buffer&& other) noexcept {
    std::swap(ptr_, other.ptr_);
    std::swap(bytes_, other.bytes_);
    return *this;
  }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;

  CUdeviceptr ptr() const { return ptr_; }
  void* data() const { return reinterpret_cast<void*>(static_cast<uintptr_t>(ptr_)); }
  void* at(std::size_t offset) const {
    return reinterpret_cast<void*>(static_cast<uintptr_t>(ptr_ + offset));
  }
  std::size_t bytes() const { return bytes_; }

 private:
  CUdeviceptr ptr_ = 0;
  std::size_t bytes_ = 0;
};

template <typename T>
void upload(const Buffer& buffer, std::size_t offset, const std::vector<T>& host) {
  if (!host.empty())
    BENCH_CU(cu().cuMemcpyHtoD(buffer.ptr() + offset, host.data(), host.size() * sizeof(T)));
}

// Fills `bytes` bytes at `dst` with copies of `pattern` (uploaded once, then doubled on the
// device), so large buffers get random content without a host buffer of their size.
void fill_with_pattern(CUdeviceptr dst, std::size_t bytes, const std::vector<uint8_t>& pattern,
                       CUstream stream) {
  if (bytes == 0) return;
  const std::size_t first = std::min(bytes, pattern.size());
  BENCH_CU(cu().cuMemcpyHtoD(dst, pattern.data(), first));
  // Why: a pageable cuMemcpyHtoD may return before its DMA lands, and `stream` does not order
  // after the legacy stream; the doubling copies below must read the finished pattern.
  BENCH_CU(cu().cuCtxSynchronize());
  std::size_t done = first;
  while (done < bytes) {
    const std::size_t n = std::min(done, bytes - done);
    BENCH_CU(cu().cuMemcpyDtoDAsync(dst + done, dst, n, stream));
    done += n;
  }
  BENCH_CU(cu().cuStreamSynchronize(stream));
}

std::vector<uint8_t> random_bytes(std::size_t count, uint64_t seed) {
  std::vector<uint8_t> v(count);
  for (std::size_t i = 0; i < count; i += 8) {
    const uint64_t r = mix64(seed ^ (static_cast<uint64_t>(i) * 0xD1B54A32D192ED03ull));
    for (std::size_t j = i; j < std::min(count, i + 8); ++j) {
      v[j] = static_cast<uint8_t>(r >> (8 * (j - i)));
    }
  }
  return v;
}

// E8M0 bytes 2^-10 .. 2^3 (117 .. 130), uniform.
std::vector<uint8_t> random_scales(std::size_t count, uint64_t seed) {
  std::vector<uint8_t> v = random_bytes(count, seed);
  for (uint8_t& b : v) b = static_cast<uint8_t>(117 + b % 14);
  return v;
}

// Random bf16 values in [-1, 1) (dense baseline data).
std::vector<uint8_t> random_bf16_bytes(std::size_t count, uint64_t seed) {
  std::vector<uint8_t> v(count * 2);
  for (std::size_t i = 0; i < count; ++i) {
    const uint16_t b = bf16_bits(static_cast<float>(2.0 * unit(seed, i) - 1.0));
    std::memcpy(&v[2 * i], &b, 2);
  }
  return v;
}

// ---- DLPack views -------------------------------------------------------------------------------

class TensorView {
 public:
  TensorView(void* data, std::vector<int64_t> shape, DLDataType dtype) : shape_(std::move(shape)) {
    tensor_.data = data;
    tensor_.device = DLDevice{kDLCUDA, 0};
    tensor_.ndim = static_cast<int32_t>(shape_.size());
    tensor_.dtype = dtype;
    tensor_.shape = shape_.data();
    tensor_.strides = nullptr;
    tensor_.byte_offset = 0;
  }
  TensorView(const TensorView&) = delete;
  TensorView& operator=(const TensorView&) = delete;
  DLTensor* dl() { return &tensor_; }

 private:
  std::vector<int64_t> shape_;
  DLTensor tensor_{};
};

const DLDataType kU8{kDLUInt, 8, 1};
const DLDataType kBf16{kDLBfloat, 16, 1};
const DLDataType kI32{kDLInt, 32, 1};
const DLDataType kF32{kDLFloat, 32, 1};

// ---- SM clock and power (NVML) ------------------------------------------------------------------

// Why: a sustained MXFP4 layer of 1-2 GB streams HBM near its peak while every SM dequantizes,
// and on the H200 that reaches the 700 W power cap; the driver then lowers the SM clock (1980 ->
// 1755-1830 MHz seen) and the layer takes 5-14% longer than the same graph after an idle gap
// (tools/PERF_LOG.md "the two layer measures"). Every figure reports the SM clock and power its
// replays ran at. NVML (libnvidia-ml.so.1, beside the driver) is loaded at run time; without it
// the figures print "-".
class Telemetry {
 public:
  // What the samples taken during one figure's replays say.
  struct Stats {
    int samples = 0;
    double sm_mhz = 0;  // median SM clock
    double watts = 0;   // mean board power
    double capped = 0;  // fraction of samples with the software power cap active
  };

  static Telemetry& get() {
    static Telemetry t;
    return t;
  }
  bool available() const { return device_ != nullptr; }
  std::string why_unavailable() const { return why_; }
  unsigned max_sm_mhz() const { return max_mhz_; }

  // Binds the sampler to `device` and starts it (every kPeriod); no-op without NVML.
  void start(CUdevice device) {
    if (lib_ == nullptr || thread_.joinable()) return;
    char bus_id[64] = {};
    PFN_cuDeviceGetPCIBusId_v4010 bus_id_of = nullptr;
    try {
      load_entry(driver_proc_address(), "cuDeviceGetPCIBusId", 4010, &bus_id_of);
    } catch (const std::exception& e) {
      why_ = e.what();
      return;
    }
    if (bus_id_of(bus_id, sizeof(bus_id), device) != CUDA_SUCCESS) {
      why_ = "cuDeviceGetPCIBusId failed";
      return;
    }
    if (by_bus_id_(bus_id, &device_) != 0) {
      why_ = std::string("NVML has no device at PCI ") + bus_id;
      device_ = nullptr;
      return;
    }
    if (max_clock_(device_, kClockSm, &max_mhz_) != 0) max_mhz_ = 0;
    thread_ = std::thread([this] { run(); });
  }

  // Samples from now until end() count for figure `tag` (0, 1, ...).
  void begin(int tag) { tag_.store(tag, std::memory_order_release); }
  void end() { tag_.store(-1, std::memory_order_release); }

  // The samples of each tag since the last reset, then forgets them.
  std::vector<Stats> take(int tags) {
    std::lock_guard<std::mutex> lock(mutex_);
    std::vector<Stats> out(to_size(tags));
    for (int t = 0; t < tags && t < static_cast<int>(bins_.size()); ++t) {
      const std::vector<Sample>& b = bins_[to_size(t)];
      if (b.empty()) continue;
      std::vector<double> mhz;
      double watts = 0;
      int capped = 0;
      for (const Sample& x : b) {
        mhz.push_back(x.sm_mhz);
        watts += x.watts;
        capped += x.capped ? 1 : 0;
      }
      Stats& st = out[to_size(t)];
      st.samples = static_cast<int>(b.size());
      st.sm_mhz = median(mhz);
      st.watts = watts / static_cast<double>(b.size());
      st.capped = static_cast<double>(capped) / static_cast<double>(b.size());
    }
    bins_.clear();
    return out;
  }

  ~Telemetry() {
    stop_.store(true);
    if (thread_.joinable()) thread_.join();
  }
  Telemetry(const Telemetry&) = delete;
  Telemetry& operator=(const Telemetry&) = delete;

 private:
  using Device = void*;  // nvmlDevice_t
  struct Sample {
    double sm_mhz;
    double watts;
    bool capped;  // the software power cap active (it can slow a figure while the sampled clock
                  // reads its maximum: gpt-oss-120b T = 96 back to back, 443 us at 1980 MHz)
  };
  static constexpr auto kPeriod = std::chrono::milliseconds(2);
  static constexpr unsigned kClockSm = 1;                 // NVML_CLOCK_SM
  static constexpr unsigned long long kSwPowerCap = 0x4;  // nvmlClocksEventReasonSwPowerCap

  Telemetry() {
    lib_ = dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_LOCAL);
    if (lib_ == nullptr) {
      why_ = std::string("dlopen libnvidia-ml.so.1: ") + dlerror();
      return;
    }
    auto sym = [&](const char* name) { return dlsym(lib_, name); };
    auto init = reinterpret_cast<int (*)()>(sym("nvmlInit_v2"));
    by_bus_id_ =
        reinterpret_cast<int (*)(const char*, Device*)>(sym("nvmlDeviceGetHandleByPciBusId_v2"));
    clock_ = reinterpret_cast<int (*)(Device, unsigned, unsigned*)>(sym("nvmlDeviceGetClockInfo"));
    max_clock_ =
        reinterpret_cast<int (*)(Device, unsigned, unsigned*)>(sym("nvmlDeviceGetMaxClockInfo"));
    power_ = reinterpret_cast<int (*)(Device, unsigned*)>(sym("nvmlDeviceGetPowerUsage"));
    reasons_ = reinterpret_cast<int (*)(Device, unsigned long long*)>(
        sym("nvmlDeviceGetCurrentClocksThrottleReasons"));
    if (init == nullptr || by_bus_id_ == nullptr || clock_ == nullptr || max_clock_ == nullptr ||
        power_ == nullptr || reasons_ == nullptr || init() != 0) {
      why_ = "libnvidia-ml.so.1 lacks a call this program uses, or nvmlInit_v2 failed";
      lib_ = nullptr;
    }
  }

  void run() {
    while (!stop_.load()) {
      const int tag = tag_.load(std::memory_order_acquire);
      if (tag >= 0) {
        unsigned mhz = 0;
        unsigned mw = 0;
        unsigned long long r = 0;
        if (clock_(device_, kClockSm, &mhz) == 0 && power_(device_, &mw) == 0 &&
            reasons_(device_, &r) == 0) {
          std::lock_guard<std::mutex> lock(mutex_);
          if (bins_.size() <= to_size(tag)) bins_.resize(to_size(tag) + 1);
          bins_[to_size(tag)].push_back(
              {static_cast<double>(mhz), mw / 1000.0, (r & kSwPowerCap) != 0});
        }
      }
      std::this_thread::sleep_for(kPeriod);
    }
  }

  void* lib_ = nullptr;
  Device device_ = nullptr;
  unsigned max_mhz_ = 0;  // the SM clock's maximum (0: unknown), printed once
  std::string why_;
  int (*by_bus_id_)(const char*, Device*) = nullptr;
  int (*clock_)(Device, unsigned, unsigned*) = nullptr;
  int (*max_clock_)(Device, unsigned, unsigned*) = nullptr;
  int (*power_)(Device, unsigned*) = nullptr;
  int (*reasons_)(Device, unsigned long long*) = nullptr;
  std::thread thread_;
  std::atomic<bool> stop_{false};
  std::atomic<int> tag_{-1};
  std::mutex mutex_;
  std::vector<std::vector<Sample>> bins_;
};

Telemetry& telemetry() { return Telemetry::get(); }

// ---- timing -------------------------------------------------------------------------------------

class Events {
 public:
  Events() {
    BENCH_CU(cu().cuEventCreate(&start_, CU_EVENT_DEFAULT));
    BENCH_CU(cu().cuEventCreate(&stop_, CU_EVENT_DEFAULT));
  }
  ~Events() {
    cu().cuEventDestroy(start_);
    cu().cuEventDestroy(stop_);
  }
  Events(const Events&) = delete;
  Events& operator=(const Events&) = delete;

  // Microseconds of `body` on `stream` (events around it).
  double time_us(CUstream stream, const std::function<void()>& body) {
    BENCH_CU(cu().cuEventRecord(start_, stream));
    body();
    BENCH_CU(cu().cuEventRecord(stop_, stream));
    BENCH_CU(cu().cuEventSynchronize(stop_));
    float ms = 0;
    BENCH_CU(cu().cuEventElapsedTime(&ms, start_, stop_));
    return static_cast<double>(ms) * 1000.0;
  }

 private:
  CUevent start_ = nullptr;
  CUevent stop_ = nullptr;
};

struct Graph {
  CUgraph graph = nullptr;
  Graph() = default;
  explicit Graph(CUgraph g) : graph(g) {}
  ~Graph() {
    if (graph != nullptr) cu().cuGraphDestroy(graph);
  }
  Graph(Graph&& other) noexcept : graph(other.graph) { other.graph = nullptr; }
  Graph& operator=(Graph&& other) noexcept {
    std::swap(graph, other.graph);
    return *this;
  }
  Graph(const Graph&) = delete;
  Graph& operator=(const Graph&) = delete;
};

Graph capture(CUstream stream, const std::function<void()>& body) {
  BENCH_CU(cu().cuStreamBeginCapture(stream, CU_STREAM_CAPTURE_MODE_THREAD_LOCAL));
  try {
    body();
  } catch (...) {
    CUgraph broken = nullptr;
    cu().cuStreamEndCapture(stream, &broken);
    if (broken != nullptr) cu().cuGraphDestroy(broken);
    throw;
  }
  CUgraph graph = nullptr;
  BENCH_CU(cu().cuStreamEndCapture(stream, &graph));
  return Graph(graph);
}

// The host's pause before each timed replay (--gap-ms): the GPU idles that long between replays.
void idle_gap(double gap_ms) {
  if (gap_ms > 0) std::this_thread::sleep_for(std::chrono::duration<double, std::milli>(gap_ms));
}

class GraphExec {
 public:
  explicit GraphExec(const Graph& graph) {
    BENCH_CU(cu().cuGraphInstantiate(&exec_, graph.graph, 0));
  }
  ~GraphExec() {
    if (exec_ != nullptr) cu().cuGraphExecDestroy(exec_);
  }
  GraphExec(const GraphExec&) = delete;
  GraphExec& operator=(const GraphExec&) = delete;
  CUgraphExec get() const { return exec_; }

 private:
  CUgraphExec exec_ = nullptr;
};

// Medians over `trials` rounds, each round replaying every graph once in turn (after two warm-up
// rounds), each divided by that graph's `per_replay`, each replay after an idle gap of `gap_ms`.
// Why alternate: paths compared in one row
// then see the same clocks and temperature, not one the first half of the row and one the other.
// `clocks`, if given, receives each graph's SM clock and power during its timed replays.
std::vector<double> replay_alternating_us(const std::vector<const Graph*>& graphs,
                                          const std::vector<int>& per_replay, CUstream stream,
                                          int trials, Events& events, double gap_ms = 0,
                                          std::vector<Telemetry::Stats>* clocks = nullptr) {
  std::vector<std::unique_ptr<GraphExec>> execs;
  for (const Graph* g : graphs) execs.push_back(std::make_unique<GraphExec>(*g));
  for (int w = 0; w < 2; ++w) {
    for (const auto& e : execs) BENCH_CU(cu().cuGraphLaunch(e->get(), stream));
  }
  BENCH_CU(cu().cuStreamSynchronize(stream));
  telemetry().take(0);
  std::vector<std::vector<double>> us(graphs.size());
  for (int t = 0; t < trials; ++t) {
    for (std::size_t g = 0; g < execs.size(); ++g) {
      const CUgraphExec exec = execs[g]->get();
      idle_gap(gap_ms);
      telemetry().begin(static_cast<int>(g));
      try {
        us[g].push_back(events.time_us(stream, [&] {
          BENCH_CU(cu().cuGraphLaunch(exec, stream));
        }) / per_replay[g]);
      } catch (...) {
        telemetry().end();
        throw;
      }
      telemetry().end();
    }
  }
  const std::vector<Telemetry::Stats> stats = telemetry().take(static_cast<int>(graphs.size()));
  if (clocks != nullptr) *clocks = stats;
  std::vector<double> out;
  for (const auto& v : us) out.push_back(median(v));
  return out;
}

// Median over `trials` replays of `graph` (after two warm-up replays) divided by `per_replay`,
// each after an idle gap of `gap_ms`; `clocks`, if given, receives the SM clock and power during
// the timed replays.
double replay_us(const Graph& graph, CUstream stream, int trials, int per_replay, Events& events,
                 double gap_ms = 0, Telemetry::Stats* clocks = nullptr) {
  std::vector<Telemetry::Stats> stats;
  const double us =
      replay_alternating_us({&graph}, {per_replay}, stream, trials, events, gap_ms, &stats)[0];
  if (clocks != nullptr) *clocks = stats[0];
  return us;
}

// A graph's nodes in a topological order (for a captured stream: launch order) and its edges,
// with their dependency types (programmatic or full).
struct GraphTopology {
  std::vector<CUgraphNode> order;
  std::vector<CUgraphNode> from, to;
  std::vector<CUgraphEdgeData> data;
};

GraphTopology topology_of(CUgraph graph) {
  std::size_t count = 0;
  BENCH_CU(graph_api().get_nodes(graph, nullptr, &count));
  std::vector<CUgraphNode> nodes(count);
  if (count > 0) BENCH_CU(graph_api().get_nodes(graph, nodes.data(), &count));
  GraphTopology t;
  std::size_t edges = 0;
  BENCH_CU(graph_api().get_edges(graph, nullptr, nullptr, nullptr, &edges));
  t.from.resize(edges);
  t.to.resize(edges);
  t.data.resize(edges);
  if (edges > 0)
    BENCH_CU(graph_api().get_edges(graph, t.from.data(), t.to.data(), t.data.data(), &edges));
  // Kahn's walk, taking ready nodes first in, first out.
  std::unordered_map<CUgraphNode, std::size_t> index;
  for (std::size_t i = 0; i < count; ++i) index.emplace(nodes[i], i);
  std::vector<std::vector<std::size_t>> out_edges(count);
  std::vector<int> indegree(count, 0);
  for (std::size_t e = 0; e < edges; ++e) {
    out_edges[index.at(t.from[e])].push_back(index.at(t.to[e]));
    ++indegree[index.at(t.to[e])];
  }
  std::deque<std::size_t> ready;
  for (std::size_t i = 0; i < count; ++i) {
    if (indegree[i] == 0) ready.push_back(i);
  }
  while (!ready.empty()) {
    const std::size_t n = ready.front();
    ready.pop_front();
    t.order.push_back(nodes[n]);
    for (std::size_t m : out_edges[n]) {
      if (--indegree[m] == 0) ready.push_back(m);
    }
  }
  if (t.order.size() != count) throw std::runtime_error("captured graph has a cycle");
  return t;
}

std::vector<CUgraphNode> topological_nodes(CUgraph graph) { return topology_of(graph).order; }

// A short name for a graph node: the kernel's function name (demangled, namespace and template
// arguments dropped), with the grouped GEMM's stage; else the node type.
std::string node_label(CUgraphNode node) {
  CUgraphNodeType type;
  BENCH_CU(graph_api().node_get_type(node, &type));
  if (type == CU_GRAPH_NODE_TYPE_MEMSET) return "memset";
  if (type == CU_GRAPH_NODE_TYPE_MEMCPY) return "memcpy";
  if (type != CU_GRAPH_NODE_TYPE_KERNEL)
    return "node type " + std::to_string(static_cast<int>(type));
  CUDA_KERNEL_NODE_PARAMS params{};
  BENCH_CU(graph_api().kernel_node_get_params(node, &params));
  // Why three tries: a node captured from a launch of a CUkernel (cast to CUfunction, as the
  // library launches) may name its kernel either way.
  const char* mangled = nullptr;
  if (!(params.func != nullptr &&
        graph_api().func_get_name(&mangled, params.func) == CUDA_SUCCESS) &&
      !(params.kern != nullptr &&
        graph_api().kernel_get_name(&mangled, params.kern) == CUDA_SUCCESS) &&
      !(params.func != nullptr &&
        graph_api().kernel_get_name(&mangled, reinterpret_cast<CUkernel>(params.func)) ==
            CUDA_SUCCESS)) {
    return "kernel";
  }
  int status = 0;
  char* demangled = abi::__cxa_demangle(mangled, nullptr, nullptr, &status);
  const std::string full = status == 0 && demangled != nullptr ? demangled : mangled;
  std::free(demangled);
  std::string name = full.substr(0, full.find_first_of("<("));
  const std::size_t space = name.rfind(' ');
  if (space != std::string::npos) name = name.substr(space + 1);
  const std::size_t colon = name.rfind("::");
  if (colon != std::string::npos) name = name.substr(colon + 2);
  const std::string suffix = "_kernel";
  if (name.size() > suffix.size() &&
      name.compare(name.size() - suffix.size(), suffix.size(), suffix) == 0) {
    name.resize(name.size() - suffix.size());
  }
  if (name == "route_single") name = "route";
  if (full.find("Fc1Epilogue") != std::string::npos) name += " fc1";
  if (full.find("Fc2Epilogue") != std::string::npos) name += " fc2";
  return name;
}

// A copy of `layers` (a graph of back-to-back layers, `per_layer` nodes each, one after another
// in `t.order`) with each layer cut after its first `keep` nodes. An edge that left a layer's cut
// part for the next layer now leaves the layer's last kept node, with its dependency type, so the
// cut layers follow one another as the whole ones did (programmatic dependent launch included).
Graph layer_prefix(CUgraph layers, const GraphTopology& t, std::size_t per_layer,
                   std::size_t keep) {
  CUgraph clone = nullptr;
  BENCH_CU(graph_api().clone(&clone, layers));
  Graph out(clone);
  std::unordered_map<CUgraphNode, std::size_t> index;
  std::vector<CUgraphNode> copy(t.order.size());
  for (std::size_t i = 0; i < t.order.size(); ++i) {
    index.emplace(t.order[i], i);
    BENCH_CU(graph_api().node_find_in_clone(&copy[i], t.order[i], clone));
  }
  std::vector<CUgraphNode> from, to;
  std::vector<CUgraphEdgeData> data;
  for (std::size_t e = 0; e < t.from.size(); ++e) {
    const std::size_t u = index.at(t.from[e]);
    const std::size_t v = index.at(t.to[e]);
    if (u / per_layer == v / per_layer || u % per_layer < keep || v % per_layer >= keep) continue;
    const CUgraphNode source = copy[u / per_layer * per_layer + keep - 1];
    bool present = false;
    for (std::size_t d = 0; d < from.size(); ++d) present |= from[d] == source && to[d] == copy[v];
    if (present) continue;
    from.push_back(source);
    to.push_back(copy[v]);
    data.push_back(t.data[e]);
  }
  for (std::size_t i = 0; i < copy.size(); ++i) {
    if (i % per_layer >= keep) BENCH_CU(graph_api().destroy_node(copy[i]));
  }
  if (!from.empty()) {
    BENCH_CU(graph_api().add_dependencies(clone, from.data(), to.data(), data.data(), from.size()));
  }
  return out;
}

// ---- the read floor -----------------------------------------------------------------------------

// Kernels that read a list of byte regions and nothing else: the floor under a decode layer,
// whose weight reads are the same bytes. Each CTA reads one chunk of a region (a multiple of 2048
// 16-byte pieces: 32 KB), either with every thread keeping 8 loads in flight (issued together,
// then folded, so none waits for a later one) or by bulk copies into shared memory, 64 KB at a
// time; regions are found by a binary search over their first CTA. It waits for the grid before it
// first (griddepcontrol.wait, as the layer's first kernel does) and lets the next one launch, so a
// graph of N of them pays what N layer calls pay per boundary. Each row times every variant of
// kFloorVariants and keeps the fastest: the floor is the best plain read found, not a bound.
// Compiled here by NVRTC: it is the benchmark's, not libmoejit's.
constexpr unsigned kFloorThreads = 256;  // read_floor's __launch_bounds__ and stride
constexpr unsigned kFloorBulkThreads = 32;
constexpr int kFloorBulkSharedBytes = 64 * 1024;
// The variants each row times: loads or bulk copies, KB a CTA.
struct FloorVariant {
  bool bulk;
  int chunk_kb;
};
constexpr FloorVariant kFloorVariants[] = {{false, 32}, {false, 64}, {false, 128}, {false, 256},
                                           {true, 64},  {true, 128}, {true, 256}};
std::string floor_variant_name(const FloorVariant& v) {
  return std::string(v.bulk ? "bulk" : "loads") + " " + std::to_string(v.chunk_kb) + " KB";
}
const char* const kReadFloorSource = R"(
struct Piece { unsigned x, y, z, w; };
struct FloorRegion {
  const Piece* data;
  unsigned long long pieces;
  unsigned long long first_block;
};
// This CTA's chunk: pieces [begin, end) of the region whose first CTA is the last at or below it.
__device__ const Piece* my_chunk(const FloorRegion* regions, int count, unsigned long long chunk,
                                 unsigned long long& begin, unsigned long long& end) {
  const unsigned long long block = blockIdx.x;
  int lo = 0;
  int hi = count - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (regions[mid].first_block <= block) lo = mid; else hi = mid - 1;
  }
  begin = (block - regions[lo].first_block) * chunk;
  end = begin + chunk < regions[lo].pieces ? begin + chunk : regions[lo].pieces;
  return regions[lo].data;
}

extern "C" __global__ void __launch_bounds__(256)
read_floor(const FloorRegion* regions, int count, unsigned long long chunk, unsigned* sink) {
  asm volatile("griddepcontrol.wait;" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  unsigned long long begin = 0;
  unsigned long long end = 0;
  const Piece* const data = my_chunk(regions, count, chunk, begin, end);
  unsigned fold = 0;
  for (unsigned long long j = begin + threadIdx.x; j < end; j += 8 * 256) {
    Piece v[8];
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      v[k].x = v[k].y = v[k].z = v[k].w = 0u;
      if (j + k * 256 < end) {
        asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                     : "=r"(v[k].x), "=r"(v[k].y), "=r"(v[k].z), "=r"(v[k].w)
                     : "l"(data + j + k * 256));
      }
    }
#pragma unroll
    for (int k = 0; k < 8; ++k) fold ^= v[k].x ^ v[k].y ^ v[k].z ^ v[k].w;
  }
  if (fold == 0x9E3779B9u) atomicAdd(sink, 1u);  // keeps the loads; the count is never read
}

// The same chunks landed by the copy engine: one thread per CTA asks for 64 KB of shared memory
// at a time in bulk copies of 16 KB on one mbarrier, waits, and goes on; nothing reads them.
extern "C" __global__ void __launch_bounds__(32)
read_floor_bulk(const FloorRegion* regions, int count, unsigned long long chunk, unsigned* sink) {
  extern __shared__ __align__(128) unsigned char landing[];
  __shared__ __align__(8) unsigned long long bar;
  asm volatile("griddepcontrol.wait;" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  if (threadIdx.x != 0) return;
  unsigned long long begin = 0;
  unsigned long long end = 0;
  const char* const src =
      reinterpret_cast<const char*>(my_chunk(regions, count, chunk, begin, end) + begin);
  const unsigned long long bytes = (end - begin) * 16;
  const unsigned b = static_cast<unsigned>(__cvta_generic_to_shared(&bar));
  const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(landing));
  asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(b) : "memory");
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  unsigned phase = 0;
  for (unsigned long long at = 0; at < bytes; at += 65536) {
    const unsigned seg = bytes - at < 65536 ? static_cast<unsigned>(bytes - at) : 65536u;
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(b), "r"(seg)
                 : "memory");
    for (unsigned p = 0; p < seg; p += 16384) {
      const unsigned n = seg - p < 16384 ? seg - p : 16384u;
      asm volatile(
          "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
          ::"r"(dst + p), "l"(src + at + p), "r"(n), "r"(b) : "memory");
    }
    unsigned done = 0;
    while (!done) {
      asm volatile(
          "{ .reg .pred q; mbarrier.try_wait.parity.shared::cta.b64 q, [%1], %2; selp.u32 %0, 1, 0, "
          "q; }" : "=r"(done) : "r"(b), "r"(phase) : "memory");
    }
    phase ^= 1u;
  }
  (void)sink;
}
)";

struct FloorRegion {
  const void* data;
  uint64_t pieces;
  uint64_t first_block;
};
static_assert(sizeof(FloorRegion) == 24, "read_floor's FloorRegion is three 8-byte fields");

class ReadFloor {
 public:
  explicit ReadFloor(const moejit::Arch& arch) {
    const std::string cubin = moejit::bench::compile_cubin(
        kReadFloorSource, "read_floor.cu", {arch.nvrtc_option(), "--std=c++17"}, "read floor");
    BENCH_CU(
        cu().cuLibraryLoadData(&library_, cubin.data(), nullptr, nullptr, 0, nullptr, nullptr, 0));
    BENCH_CU(cu().cuLibraryGetKernel(&kernel_, library_, "read_floor"));
    BENCH_CU(cu().cuLibraryGetKernel(&bulk_, library_, "read_floor_bulk"));
    CUdevice device = 0;
    BENCH_CU(cu().cuCtxGetDevice(&device));
    BENCH_CU(cu().cuKernelSetAttribute(CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                                       kFloorBulkSharedBytes, bulk_, device));
  }
  ~ReadFloor() {
    if (library_ != nullptr) cu().cuLibraryUnload(library_);
  }
  ReadFloor(const ReadFloor&) = delete;
  ReadFloor& operator=(const ReadFloor&) = delete;

  // One launch over `count` regions at `regions` (device FloorRegion[count]) spanning `blocks`
  // CTAs of `chunk` 16-byte pieces each, by loads or (`bulk`) bulk copies.
  void launch(bool bulk, const void* regions, int count, uint64_t chunk, uint64_t blocks,
              void* sink, CUstream stream) const {
    CUlaunchAttribute attribute;
    const CUlaunchConfig config = moejit::bench::launch_config(
        static_cast<unsigned>(blocks), bulk ? kFloorBulkThreads : kFloorThreads,
        bulk ? kFloorBulkSharedBytes : 0, stream, true, attribute);
    void* params[] = {&regions, &count, &chunk, &sink};
    BENCH_CU(cu().cuLaunchKernelEx(&config, reinterpret_cast<CUfunction>(bulk ? bulk_ : kernel_),
                                   params, nullptr));
  }

 private:
  CUlibrary library_ = nullptr;
  CUkernel kernel_ = nullptr;
  CUkernel bulk_ = nullptr;
};

// ---- the models ---------------------------------------------------------------------------------

constexpr std::size_t kAlign = 256;
std::size_t align_up(std::size_t n) { return (n + kAlign - 1) / kAlign * kAlign; }

// One set of kernel-layout weights in one allocation.
struct WeightSet {
  Buffer buffer;
  moejit::MoeWeights weights;
};

struct Routing {
  int tokens = 0;
  std::vector<int32_t> ids;     // [T, K] global expert ids
  std::vector<float> weights;   // [T, K]
  std::vector<int> per_expert;  // [E] entries per local expert
  int touched = 0;              // local experts with at least one entry
  int64_t local_entries = 0;    // entries on the rank's experts (T·K unless expert-parallel)
};

// Distinct top-k ids per token, uniform over [0, global_experts) when `global` (ids outside the
// rank's [expert_offset, expert_offset + E) contribute nothing), else over the rank's experts.
// Why global by default: an expert-parallel rank sees only its share of a token's k entries.
Routing make_routing(const moejit::ModelShape& s, int tokens, bool global, uint64_t seed) {
  Routing r;
  r.tokens = tokens;
  const int k = s.top_k;
  const int first = global ? 0 : s.expert_offset;
  const int range = global ? s.global_experts : s.num_experts;
  r.ids.resize(to_size(static_cast<int64_t>(tokens) * k));
  r.weights.resize(r.ids.size());
  r.per_expert.assign(to_size(s.num_experts), 0);
  uint64_t draw = 0;
  for (int t = 0; t < tokens; ++t) {
    int32_t* row = r.ids.data() + static_cast<int64_t>(t) * k;
    double sum = 0;
    for (int j = 0; j < k; ++j) {
      int32_t e = 0;
      do {
        e = first + static_cast<int32_t>(mix64(seed ^ (draw++ * 0x9E3779B97F4A7C15ull)) %
                                         static_cast<uint64_t>(range));
      } while (std::find(row, row + j, e) != row + j);
      row[j] = e;
      const float w = static_cast<float>(0.05 + unit(seed + 1, draw));
      r.weights[to_size(static_cast<int64_t>(t) * k + j)] = w;
      sum += w;
    }
    for (int j = 0; j < k; ++j) {
      float& w = r.weights[to_size(static_cast<int64_t>(t) * k + j)];
      w = static_cast<float>(w / sum);
      const int local = row[j] - s.expert_offset;
      if (local >= 0 && local < s.num_experts) {
        ++r.per_expert[to_size(local)];
        ++r.local_entries;
      }
    }
  }
  for (int c : r.per_expert) r.touched += c > 0 ? 1 : 0;
  return r;
}

// The device inputs of one layer call for a routing, with their DLPack views: hidden states
// (bf16, FC1 pre-activations near unit scale), ids, weights, the output and a workspace for
// either path.
class LayerInputs {
 public:
  LayerInputs(const moejit::ModelShape& s, const Routing& r, uint64_t seed)
      : tokens_(r.tokens),
        hidden_size_(s.hidden),
        hidden_(to_size(tokens_ * hidden_size_) * 2),
        ids_(r.ids.size() * 4),
        weights_(r.weights.size() * 4),
        out_(to_size(tokens_ * hidden_size_) * 2),
        workspace_bytes_(moejit::moe_workspace_bytes(s, r.tokens)),
        workspace_(std::max<std::size_t>(workspace_bytes_, kAlign)),
        hidden_t_(hidden_.data(), {tokens_, hidden_size_}, kBf16),
        ids_t_(ids_.data(), {tokens_, s.top_k}, kI32),
        weights_t_(weights_.data(), {tokens_, s.top_k}, kF32),
        out_t_(out_.data(), {tokens_, hidden_size_}, kBf16) {
    double scale_sq = 0;
    for (int u = -10; u <= 3; ++u) scale_sq += std::ldexp(1.0, 2 * u) / 14.0;
    const double sigma = 1.0 / std::sqrt(static_cast<double>(hidden_size_) * 8.5625 * scale_sq);
    std::vector<uint16_t> hidden(to_size(tokens_ * hidden_size_));
    for (std::size_t j = 0; j < hidden.size(); ++j) {
      hidden[j] = bf16_bits(static_cast<float>(normal(seed + 41, j) * sigma));
    }
    upload(hidden_, 0, hidden);
    upload(ids_, 0, r.ids);
    upload(weights_, 0, r.weights);
  }
  LayerInputs(const LayerInputs&) = delete;
  LayerInputs& operator=(const LayerInputs&) = delete;

  void forward(const moejit::ModelShape& s, const moejit::MoeWeights& weights, CUstream stream,
               const moejit::MoeForwardOptions& options) {
    moejit::MoeForwardArgs a;
    a.hidden = hidden_t_.dl();
    a.topk_ids = ids_t_.dl();
    a.topk_weights = weights_t_.dl();
    a.weights = weights;
    a.workspace = workspace_.data();
    a.workspace_bytes = workspace_bytes_;
    a.out = out_t_.dl();
    moejit::moe_forward(s, a, stream, options);
  }

  // Fills the output with 0xFF bytes (bf16 NaN), so a row the call does not write shows.
  void poison_out(CUstream stream) {
    BENCH_CU(cu().cuMemsetD8Async(out_.ptr(), 0xFF, out_.bytes(), stream));
  }
  // The output as bf16 bits (synchronizes the context first).
  std::vector<uint16_t> read_out() const {
    BENCH_CU(cu().cuCtxSynchronize());
    std::vector<uint16_t> out(to_size(tokens_ * hidden_size_));
    BENCH_CU(cu().cuMemcpyDtoH(out.data(), out_.ptr(), out.size() * 2));
    return out;
  }

 private:
  int64_t tokens_;
  int64_t hidden_size_;
  Buffer hidden_;
  Buffer ids_;
  Buffer weights_;
  Buffer out_;
  std::size_t workspace_bytes_;
  Buffer workspace_;
  TensorView hidden_t_;
  TensorView ids_t_;
  TensorView weights_t_;
  TensorView out_t_;
};

int64_t count_nonfinite(const std::vector<uint16_t>& bf16) {
  int64_t n = 0;
  for (uint16_t b : bf16) n += (b & 0x7F80u) == 0x7F80u ? 1 : 0;
  return n;
}

const moejit::MoeForwardOptions kMarlinPath{moejit::MoePath::kMarlin, 0};

struct Options {
  bool marlin_section = true;
  bool decode_section = true;
  // The marlin section.
  std::vector<std::string> models = {"gpt-oss-120b", "deepseek-v4-flash-tp4", "qwen3-30b-a3b",
                                     "kimi-k3.1-tp8"};
  std::vector<int> tokens = {1, 6, 24, 96, 256, 1024, 4096};
  // The decode section (token counts above 256 are dropped: decode_moe ends there).
  std::vector<std::string> decode_models = {"kimi-k3.1-tp8", "kimi-k3.1-tp4-ep2",
                                            "deepseek-v4-flash-tp4", "qwen3-30b-a3b"};
  std::vector<int> decode_tokens = {1, 6, 24, 96, 256};
  int decode_block_n = 0;  // 0 = the planner's, 8, 16 or 32 forced
  bool global_routing = true;
  std::string shapes_file;
  std::string json_path;
  int trials = 15;
  double target_ms = 10;  // graph replay length the iteration count aims at
  double gap_ms = 0;      // host pause (GPU idle) before each timed replay
  double budget_gb = 48;  // device memory for rotated weight copies, per model
  int max_rotation = 16;
  bool dense = true;
  bool floor = true;  // the decode section's read floor
  uint64_t seed = 20261130;
};

struct Device {
  CUdevice device = 0;
  CUcontext context = nullptr;
  moejit::Arch arch;
  std::string name;
  int sms = 0;
  std::size_t l2_bytes = 0;
  std::size_t total_bytes = 0;
};

// Device-to-device copy bandwidth: (bytes read + bytes written) / time, 1 GiB buffers.
double copy_bandwidth_gbs(CUstream stream, Events& events) {
  const std::size_t bytes = std::size_t{1} << 30;
  Buffer a(bytes);
  Buffer b(bytes);
  BENCH_CU(cu().cuMemsetD8Async(a.ptr(), 1, bytes, stream));
  std::vector<double> us;
  for (int i = 0; i < 23; ++i) {
    const double t = events.time_us(
        stream, [&] { BENCH_CU(cu().cuMemcpyDtoDAsync(b.ptr(), a.ptr(), bytes, stream)); });
    if (i >= 3) us.push_back(t);
  }
  return 2.0 * static_cast<double>(bytes) / (median(us) * 1e-6) / 1e9;
}

// C [m x n] = A [m x k] x B^T, B [n x k], all row-major bf16, fp32 accumulate (cuBLAS is
// column-major: C^T = B x A^T, i.e. op(B) = T with ld k, op(A^T) = N with ld lda).
void gemm_bf16(cublasHandle_t handle, int m, int n, int k, const void* a, int lda, const void* b,
               int ldb, void* c, int ldc) {
  const float one = 1.0f;
  const float zero = 0.0f;
  BENCH_BLAS(cublasGemmEx(handle, CUBLAS_OP_T, CUBLAS_OP_N, n, m, k, &one, b, CUDA_R_16BF, ldb, a,
                          CUDA_R_16BF, lda, &zero, c, CUDA_R_16BF, ldc, CUBLAS_COMPUTE_32F,
                          CUBLAS_GEMM_DEFAULT));
}

// Dense bf16 peak: one 8192^3 GEMM, graph replays.
double dense_peak_tflops(cublasHandle_t handle, CUstream stream, Events& events, int trials) {
  const int n = 8192;
  const std::size_t elems = static_cast<std::size_t>(n) * n;
  Buffer a(elems * 2);
  Buffer b(elems * 2);
  Buffer c(elems * 2);
  const std::vector<uint8_t> pattern = random_bf16_bytes(1 << 22, 7);
  fill_with_pattern(a.ptr(), a.bytes(), pattern, stream);
  fill_with_pattern(b.ptr(), b.bytes(), pattern, stream);
  const int per = 5;
  // Eager first: cuBLAS picks and loads its kernel outside the capture.
  gemm_bf16(handle, n, n, n, a.data(), n, b.data(), n, c.data(), n);
  BENCH_CU(cu().cuStreamSynchronize(stream));
  Graph g = capture(stream, [&] {
    for (int i = 0; i < per; ++i) gemm_bf16(handle, n, n, n, a.data(), n, b.data(), n, c.data(), n);
  });
  const double us = replay_us(g, stream, trials, per, events);
  return 2.0 * n * static_cast<double>(n) * n / (us * 1e-6) / 1e12;
}

struct KernelTime {
  std::string name;
  double us = 0;
};

struct Row {
  int tokens = 0;
  int touched = 0;
  double mxfp4_bytes = 0;
  double layer_us = 0;
  // The whole layer again, replayed in turn with its cuts (MoE work only between its replays);
  // the kernels add up to it. 0 where per-kernel times are unavailable.
  double kernels_sum_us = 0;
  Telemetry::Stats layer_clocks;  // SM clock and power during the layer's timed replays
  Telemetry::Stats sum_clocks;    // ... during those of kernels_sum_us
  Telemetry::Stats dense_clocks;  // ... during the dense baseline's
  std::vector<KernelTime> kernels;
  std::string kernels_note;  // why per-kernel times are missing, if they are
  double copy_fraction = 0;
  double tflops = 0;
  double dense_us = 0;
  double dense_tflops = 0;
  double dense_single_tflops = 0;
  // cuBLAS's grouped GEMM (cublasGemmGroupedBatchedEx) over the same GEMMs; 0 where it refused.
  double cublas_grouped_us = 0;
  double cublas_grouped_tflops = 0;
  int cublas_grouped_iterations = 0;
  Telemetry::Stats cublas_grouped_clocks;
  std::string cublas_grouped_note;  // why the grouped figure is missing, if it is
  int rotation = 1;
  int dense_rotation = 1;
  int iterations = 0;
  int dense_iterations = 0;
  int64_t nonfinite = 0;
};

// One row of the decode section: decode_moe and marlin_moe on the same inputs and weights.
struct DecodeRow {
  int tokens = 0;
  int touched = 0;
  double mxfp4_bytes = 0;
  moejit::MoeDecodeParams tile;  // the main kernel's tile for this T (and forced block_n)
  int ctas_per_sm = 0;
  double decode_us = 0;
  double marlin_us = 0;
  Telemetry::Stats decode_clocks;  // SM clock and power during each path's timed replays
  Telemetry::Stats marlin_clocks;
  double decode_copy_fraction = 0;
  double marlin_copy_fraction = 0;
  double floor_us = 0;  // the read floor (0: not measured): the fastest variant's
  double floor_copy_fraction = 0;
  std::vector<double> floor_us_by_variant;  // per kFloorVariants
  int rotation = 1;
  int decode_iterations = 0;
  int marlin_iterations = 0;
  int64_t decode_nonfinite = 0;
  int64_t marlin_nonfinite = 0;
  double rel_l2 = 0;         // ||decode - marlin|| / ||marlin|| over one checked call
  double max_abs_diff = 0;   // max |decode - marlin| over the same call
  double marlin_rms = 0;     // root mean square of marlin's output (0: the check says nothing)
  int64_t marlin_zeros = 0;  // marlin's outputs that are exactly 0
  std::vector<std::string> decode_kernels;  // the kernels of one captured call, launch order
  std::vector<std::string> marlin_kernels;
  std::string error;  // a moejit::Error that stopped the row (the rest of the run goes on)
};

class ModelBench {
 public:
  ModelBench(const moejit::ModelShape& shape, const Options& o, const Device& device,
             CUstream stream, cublasHandle_t blas, double copy_gbs, Clock::time_point started,
             const ReadFloor* floor)
      : s_(shape),
        o_(o),
        device_(device),
        stream_(stream),
        blas_(blas),
        copy_gbs_(copy_gbs),
        started_(started),
        floor_(floor) {}

  // Kernels and weight copies once for both sections (dense copies only for marlin rows).
  void prepare(const std::vector<int>& marlin_tokens, const std::vector<int>& decode_tokens) {
    const auto& s = s_;
    std::cout << "\n" << stamp() << "== " << s.name << ": E " << s.num_experts;
    if (s.global_experts != s.num_experts) {
      std::cout << " of " << s.global_experts << " (experts " << s.expert_offset << ".."
                << s.expert_offset + s.num_experts - 1 << ")";
    }
    std::cout << ", top-k " << s.top_k << ", H " << s.hidden << ", I " << s.intermediate << ", "
              << moejit::activation_kind_name(s.activation.kind) << (s.has_bias ? ", biases" : "")
              << std::endl;
    if (!decode_tokens.empty()) decode_problem_ = moejit::moe_decode_problem(s);
    const auto compile_start = Clock::now();
    int compiled = 0;
    int loaded = 0;
    auto count = [&](const moejit::BuildResult& r) {
      if (r.outcome == moejit::CacheOutcome::kCompiled ||
          r.outcome == moejit::CacheOutcome::kCompiledNotStored) {
        ++compiled;
      } else {
        ++loaded;
      }
    };
    for (const moejit::BuildResult& r :
         moejit::prewarm({s}, {device_.arch},
                         static_cast<int>(std::max(1u, std::thread::hardware_concurrency())))) {
      if (!r.error.empty())
        throw std::runtime_error("prewarm " + r.spec.display_name() + ": " + r.error);
      count(r);
    }
    // Why: prewarm builds the planner's decode tiles only; a forced block_n is built here so its
    // compile time is reported with the rest, not paid inside a row.
    if (o_.decode_block_n != 0 && decode_problem_.empty() && device_.arch.sm >= 90) {
      std::vector<moejit::KernelSpec> extra;
      for (int t : decode_tokens) {
        const moejit::MoeDecodeParams main =
            moejit::detail::choose_decode_config(s, t, o_.decode_block_n);
        for (const moejit::MoeDecodeParams& p : {moejit::detail::decode_reset_params(main), main,
                                                 moejit::detail::decode_combine_params(main)}) {
          const moejit::KernelSpec spec = moejit::detail::decode_moe_spec(p, device_.arch);
          if (std::find(extra.begin(), extra.end(), spec) == extra.end()) extra.push_back(spec);
        }
      }
      for (const moejit::KernelSpec& spec : extra) {
        try {
          count(moejit::build_kernel(spec));
        } catch (const moejit::Error& e) {
          // Why go on: the rows that need this kernel report the error; the others still run.
          std::cout << "   build " << spec.display_name() << " failed: " << e.what() << std::endl;
        }
      }
    }
    compile_s_ = std::chrono::duration<double>(Clock::now() - compile_start).count();
    compiled_ = compiled;
    loaded_ = loaded;
    std::cout << "   prewarm: " << compiled << " kernels compiled, " << loaded
              << " found in the cache, " << fixed(compile_s_, 1) << " s" << std::endl;

    sizes_ = moejit::moe_weight_layout(s);
    expert_bytes_ = static_cast<double>(sizes_.w13_bytes + sizes_.w13_scale_bytes +
                                        sizes_.w2_bytes + sizes_.w2_scale_bytes) /
                    s.num_experts;
    dense_expert_bytes_ = 3.0 * s.hidden * static_cast<double>(s.intermediate) * 2;
    const bool dense = o_.dense && !marlin_tokens.empty();

    int want = 1;
    int want_dense = 1;
    for (const std::vector<int>* list : {&marlin_tokens, &decode_tokens}) {
      for (int t : *list) {
        const Routing r = routing(t);
        want = std::max(want, rotation_for(r.touched * expert_bytes_));
        if (dense && list == &marlin_tokens) {
          want_dense = std::max(want_dense, rotation_for(r.touched * dense_expert_bytes_));
        }
      }
    }
    const double budget = o_.budget_gb * 1e9;
    const double set_bytes = expert_bytes_ * s.num_experts;
    copies_ = std::max(1, std::min(want, static_cast<int>(budget / 2 / set_bytes)));
    prepare_weights(copies_);
    dense_copies_ = 0;
    if (dense) {
      dense_copies_ = std::max(
          1, std::min(want_dense,
                      static_cast<int>(budget / 2 / (dense_expert_bytes_ * s.num_experts))));
      prepare_dense(dense_copies_);
    }
    std::cout << "   weights: " << fixed(set_bytes / 1e9, 2) << " GB MXFP4 x " << copies_
              << " copies"
              << (dense ? ", " + fixed(dense_expert_bytes_ * s.num_experts / 1e9, 2) +
                              " GB bf16 x " + std::to_string(dense_copies_) + " copies"
                        : std::string())
              << " (rotated so timed iterations read weights from DRAM, L2 "
              << device_.l2_bytes / (1 << 20) << " MiB)" << std::endl;
  }

  // The marlin section's rows of this model (MoePath::kMarlin forced), as before decode_moe.
  json marlin_section(const std::vector<int>& tokens,
                      std::vector<std::vector<std::string>>* table) {
    std::cout << "   marlin section (MoePath::kMarlin)" << std::endl;
    json rows = json::array();
    for (int t : tokens) {
      const Routing r = routing(t);
      Row row = bench_row(r, expert_bytes_, dense_expert_bytes_, copies_, dense_copies_);
      rows.push_back(row_json(row));
      table->push_back(row_cells(row));
      std::cout << stamp() << "   marlin T " << row.tokens << ": " << fixed(row.layer_us, 1)
                << " us, " << fixed(100 * row.copy_fraction, 1) << "% of copy bandwidth, "
                << fixed(row.tflops, 1) << " TFLOP/s" << std::endl;
    }
    json out = model_json();
    out["dense_weight_copies"] = dense_copies_;
    out["rows"] = rows;
    return out;
  }

  // The decode section's rows of this model: decode_moe against marlin_moe per T.
  json decode_section(const std::vector<int>& tokens,
                      std::vector<std::vector<std::string>>* table) {
    json out = model_json();
    out["decode_problem"] = decode_problem_;
    out["decode_block_n_forced"] = o_.decode_block_n;
    json rows = json::array();
    if (!decode_problem_.empty()) {
      std::cout << "   decode section: skipped, " << decode_problem_ << std::endl;
      table->push_back({s_.name, "-", "-", "-", "-", "-", "-", "-", "-", "-", "-", "-", "-",
                        "skipped: decode_moe can't serve this shape (see JSON)"});
      out["rows"] = rows;
      return out;
    }
    std::cout << "   decode section (MoePath::kDecode vs kMarlin, block_n "
              << (o_.decode_block_n == 0 ? std::string("planner's")
                                         : std::to_string(o_.decode_block_n) + " forced")
              << ")" << std::endl;
    for (int t : tokens) {
      const Routing r = routing(t);
      const DecodeRow row = decode_row(r);
      rows.push_back(decode_row_json(row));
      table->push_back(decode_row_cells(row));
      if (!row.error.empty()) {
        std::cout << stamp() << "   decode T " << row.tokens << ": " << row.error << std::endl;
        continue;
      }
      std::cout << stamp() << "   decode T " << row.tokens << ": " << fixed(row.decode_us, 1)
                << " us (" << fixed(100 * row.decode_copy_fraction, 1) << "% of copy), marlin "
                << fixed(row.marlin_us, 1) << " us (" << fixed(100 * row.marlin_copy_fraction, 1)
                << "%), decode/marlin " << fixed(row.decode_us / row.marlin_us, 2) << "x, tile "
                << tile_text(row) << "; check: rel L2 " << row.rel_l2 << ", marlin rms "
                << row.marlin_rms << ", " << row.marlin_zeros << " zeros" << std::endl;
    }
    out["rows"] = rows;
    return out;
  }

  std::vector<std::string> decode_row_cells(const DecodeRow& row) const {
    std::vector<std::string> cells = {s_.name, std::to_string(row.tokens),
                                      std::to_string(row.touched), fixed(row.mxfp4_bytes / 1e6, 1),
                                      tile_text(row)};
    if (!row.error.empty()) {
      cells.insert(cells.end(), {"-", "-", "-", "-", "-", "-", "-", "-", row.error});
      return cells;
    }
    std::string check = "ok";
    if (row.decode_nonfinite != 0 || row.marlin_nonfinite != 0) {
      check = std::to_string(row.decode_nonfinite) + " / " + std::to_string(row.marlin_nonfinite) +
              " NaN";
    }
    char rel[32];
    std::snprintf(rel, sizeof(rel), "%.1e", row.rel_l2);
    cells.insert(cells.end(),
                 {fixed(row.decode_us, 1), fixed(100 * row.decode_copy_fraction, 1) + "%",
                  fixed(row.marlin_us, 1), fixed(100 * row.marlin_copy_fraction, 1) + "%",
                  fixed(row.decode_us / row.marlin_us, 2) + "x",
                  row.floor_us > 0 ? fixed(row.floor_us, 1) + ", " +
                                         fixed(100 * row.floor_copy_fraction, 1) + "%"
                                   : "-",
                  mhz_text(row.decode_clocks) + " / " + mhz_text(row.marlin_clocks), rel, check});
    return cells;
  }

  // A figure's median SM clock, "*" where the software power cap was active in most samples.
  static std::string mhz_text(const Telemetry::Stats& c) {
    if (c.samples == 0) return "-";
    return fixed(c.sm_mhz, 0) + (c.capped > 0.5 ? "*" : "");
  }

  std::vector<std::string> row_cells(const Row& row) const {
    std::string kernels;
    for (const KernelTime& k : row.kernels) {
      kernels += (kernels.empty() ? "" : ", ") + k.name + " " + fixed(k.us, 1);
    }
    if (kernels.empty()) kernels = row.kernels_note;
    return {s_.name,
            std::to_string(row.tokens),
            std::to_string(row.touched),
            fixed(row.mxfp4_bytes / 1e6, 1),
            fixed(row.layer_us, 1),
            fixed(100 * row.copy_fraction, 1) + "%",
            mhz_text(row.layer_clocks),
            fixed(row.tflops, 1),
            o_.dense ? fixed(row.dense_us, 1) : "-",
            o_.dense ? fixed(row.dense_tflops, 1) : "-",
            o_.dense ? fixed(row.dense_us / row.layer_us, 2) + "x" : "-",
            o_.dense ? fixed(row.dense_single_tflops, 1) : "-",
            row.cublas_grouped_us > 0 ? fixed(row.cublas_grouped_us, 1) : "-",
            row.cublas_grouped_us > 0 ? fixed(row.cublas_grouped_us / row.layer_us, 2) + "x" : "-",
            row.nonfinite == 0 ? "ok" : std::to_string(row.nonfinite) + " NaN",
            row.kernels_sum_us > 0 ? fixed(row.kernels_sum_us, 1) : "-",
            row.kernels_sum_us > 0 ? mhz_text(row.sum_clocks) : "-",
            kernels};
  }

 private:
  // Copies to rotate through so that the R - 1 other copies' traffic covers L2 twice.
  int rotation_for(double touched_bytes) const {
    if (touched_bytes <= 0) return 1;
    const double need = 2.0 * static_cast<double>(device_.l2_bytes) / touched_bytes;
    return std::min(o_.max_rotation, 1 + static_cast<int>(std::ceil(need)));
  }

  void prepare_weights(int copies) {
    const auto& s = s_;
    const int64_t e = s.num_experts;
    const int64_t h = s.hidden;
    const int64_t i = s.intermediate;
    const std::size_t o13 = 0;
    const std::size_t os13 = align_up(o13 + sizes_.w13_bytes);
    const std::size_t o2 = align_up(os13 + sizes_.w13_scale_bytes);
    const std::size_t os2 = align_up(o2 + sizes_.w2_bytes);
    const std::size_t total = align_up(os2 + sizes_.w2_scale_bytes);
    sets_.clear();
    sets_.resize(to_size(copies));
    for (WeightSet& set : sets_) {
      set.buffer = Buffer(total);
      set.weights.w13 = set.buffer.at(o13);
      set.weights.w13_scales = set.buffer.at(os13);
      set.weights.w2 = set.buffer.at(o2);
      set.weights.w2_scales = set.buffer.at(os2);
    }
    if (s.has_bias) {
      std::vector<uint16_t> b13(to_size(e * 2 * i));
      std::vector<uint16_t> b2(to_size(e * h));
      for (std::size_t j = 0; j < b13.size(); ++j)
        b13[j] = bf16_bits(static_cast<float>(normal(o_.seed + 11, j)));
      for (std::size_t j = 0; j < b2.size(); ++j)
        b2[j] = bf16_bits(static_cast<float>(normal(o_.seed + 12, j)));
      bias13_ = Buffer(b13.size() * 2);
      bias2_ = Buffer(b2.size() * 2);
      upload(bias13_, 0, b13);
      upload(bias2_, 0, b2);
      for (WeightSet& set : sets_) {
        set.weights.b13 = bias13_.data();
        set.weights.b2 = bias2_.data();
      }
    }
    // A checkpoint in its own layout on the device (random content from repeated patterns),
    // repacked into copy 0 by the library, then copied.
    const std::vector<uint8_t> nibbles = random_bytes(std::size_t{1} << 24, o_.seed + 21);
    const std::vector<uint8_t> scales =
        random_scales((std::size_t{1} << 24) / 16 + 4093, o_.seed + 22);
    moejit::MoeRepackTarget target;
    target.weights = sets_[0].weights;
    Buffer bad(sizeof(int32_t));
    BENCH_CU(cu().cuMemsetD8Async(bad.ptr(), 0, bad.bytes(), stream_));
    target.bad_scale_count = static_cast<int32_t*>(bad.data());
    const bool gpt_oss = s.activation.kind == moejit::ActivationKind::kGptOss;
    if (gpt_oss) {
      Buffer w13b(to_size(e * 2 * i * h / 2));
      Buffer w13s(to_size(e * 2 * i * h / 32));
      Buffer w2b(to_size(e * h * i / 2));
      Buffer w2s(to_size(e * h * i / 32));
      fill_with_pattern(w13b.ptr(), w13b.bytes(), nibbles, stream_);
      fill_with_pattern(w13s.ptr(), w13s.bytes(), scales, stream_);
      fill_with_pattern(w2b.ptr(), w2b.bytes(), nibbles, stream_);
      fill_with_pattern(w2s.ptr(), w2s.bytes(), scales, stream_);
      TensorView a(w13b.data(), {e, 2 * i, h / 32, 16}, kU8);
      TensorView b(w13s.data(), {e, 2 * i, h / 32}, kU8);
      TensorView c(w2b.data(), {e, h, i / 32, 16}, kU8);
      TensorView d(w2s.data(), {e, h, i / 32}, kU8);
      moejit::GptOssCheckpoint ck;
      ck.w13_blocks = a.dl();
      ck.w13_scales = b.dl();
      ck.w2_blocks = c.dl();
      ck.w2_scales = d.dl();
      moejit::moe_repack_gpt_oss(s, ck, target, stream_);
      BENCH_CU(cu().cuStreamSynchronize(stream_));
    } else {
      Buffer w1b(to_size(e * i * h / 2));
      Buffer w1s(to_size(e * i * h / 32));
      Buffer w2b(to_size(e * h * i / 2));
      Buffer w2s(to_size(e * h * i / 32));
      fill_with_pattern(w1b.ptr(), w1b.bytes(), nibbles, stream_);
      fill_with_pattern(w1s.ptr(), w1s.bytes(), scales, stream_);
      fill_with_pattern(w2b.ptr(), w2b.bytes(), nibbles, stream_);
      fill_with_pattern(w2s.ptr(), w2s.bytes(), scales, stream_);
      TensorView a(w1b.data(), {e, i, h / 32, 16}, kU8);
      TensorView b(w1s.data(), {e, i, h / 32}, kU8);
      TensorView c(w2b.data(), {e, h, i / 32, 16}, kU8);
      TensorView d(w2s.data(), {e, h, i / 32}, kU8);
      moejit::SeparateCheckpoint ck;
      // Why w1 for w3 too: the content is random either way, and one buffer less fits kimi's
      // 896 experts beside the rotated copies.
      ck.w1_blocks = a.dl();
      ck.w1_scales = b.dl();
      ck.w3_blocks = a.dl();
      ck.w3_scales = b.dl();
      ck.w2_blocks = c.dl();
      ck.w2_scales = d.dl();
      moejit::moe_repack_separate(s, ck, target, stream_);
      BENCH_CU(cu().cuStreamSynchronize(stream_));
    }
    int32_t bad_count = 0;
    BENCH_CU(cu().cuMemcpyDtoH(&bad_count, bad.ptr(), sizeof(bad_count)));
    if (bad_count != 0) {
      throw std::runtime_error("repack counted " + std::to_string(bad_count) +
                               " scale bytes out of range in random scales 2^-10..2^3");
    }
    for (std::size_t c = 1; c < sets_.size(); ++c) {
      BENCH_CU(
          cu().cuMemcpyDtoDAsync(sets_[c].buffer.ptr(), sets_[0].buffer.ptr(), total, stream_));
    }
    BENCH_CU(cu().cuStreamSynchronize(stream_));
  }

  void prepare_dense(int copies) {
    const auto& s = s_;
    const std::size_t per =
        to_size(static_cast<int64_t>(s.num_experts) * 3 * s.hidden * s.intermediate * 2);
    const std::vector<uint8_t> pattern = random_bf16_bytes(std::size_t{1} << 23, o_.seed + 31);
    dense_.clear();
    for (int c = 0; c < copies; ++c) {
      dense_.emplace_back(per);
      fill_with_pattern(dense_.back().ptr(), per, pattern, stream_);
    }
  }

  // W13 of expert e ([2I, H] row-major) and W2 ([H, I]) in dense copy c.
  const void* dense_w13(int c, int e) const {
    const std::size_t h = to_size(s_.hidden);
    const std::size_t i = to_size(s_.intermediate);
    return dense_[to_size(c)].at(to_size(e) * 2 * i * h * 2);
  }
  const void* dense_w2(int c, int e) const {
    const std::size_t h = to_size(s_.hidden);
    const std::size_t i = to_size(s_.intermediate);
    return dense_[to_size(c)].at(to_size(s_.num_experts) * 2 * i * h * 2 + to_size(e) * h * i * 2);
  }

  Row bench_row(const Routing& r, double expert_bytes, double dense_expert_bytes, int copies,
                int dense_copies) {
    const auto& s = s_;
    const int64_t h = s.hidden;
    const int64_t i = s.intermediate;
    Row row;
    row.tokens = r.tokens;
    row.touched = r.touched;
    row.mxfp4_bytes = r.touched * expert_bytes;
    const double flops =
        2.0 * static_cast<double>(r.local_entries) * 3.0 * static_cast<double>(h * i);
    row.rotation = std::min(copies, rotation_for(row.mxfp4_bytes));

    LayerInputs in(s, r, o_.seed);
    auto forward = [&](int copy) {
      in.forward(s, sets_[to_size(copy)].weights, stream_, kMarlinPath);
    };

    // Eager: warm up, check the output is finite, estimate the layer time.
    Events events;
    in.poison_out(stream_);
    forward(0);
    row.nonfinite = count_nonfinite(in.read_out());
    std::vector<double> eager;
    for (int rep = 0; rep < 3; ++rep) {
      eager.push_back(events.time_us(stream_, [&] { forward(rep % row.rotation); }));
    }
    const double estimate = std::max(1.0, median(eager));
    row.iterations = std::clamp(static_cast<int>(o_.target_ms * 1000.0 / estimate), 3, 400);

    // The layer's kernels in launch order.
    const Graph layer = capture(stream_, [&] { forward(0); });
    const std::vector<CUgraphNode> order = topological_nodes(layer.graph);

    // The whole layer: N calls captured back to back (iteration j reads copy j mod R); with the
    // dense baseline, their replays alternate so both see the same clocks and temperature.
    const Graph all = capture(stream_, [&] {
      for (int j = 0; j < row.iterations; ++j) forward(j % row.rotation);
    });
    if (dense_copies > 0) {
      const std::unique_ptr<DenseLayer> dense =
          dense_layer(r, dense_expert_bytes, dense_copies, events, &row);
      std::vector<const Graph*> graphs = {&all, &dense->graph};
      std::vector<int> per_replay = {row.iterations, row.dense_iterations};
      std::unique_ptr<CublasGrouped> grouped;
      try {
        grouped = cublas_grouped(r, *dense, events, &row);
        graphs.push_back(&grouped->graph);
        per_replay.push_back(row.cublas_grouped_iterations);
      } catch (const std::exception& e) {
        row.cublas_grouped_note = e.what();
        std::cerr << stamp() << s.name << " T = " << r.tokens
                  << ": no cuBLAS grouped baseline: " << e.what() << "\n";
      }
      std::vector<Telemetry::Stats> clocks;
      const std::vector<double> us =
          replay_alternating_us(graphs, per_replay, stream_, o_.trials, events, o_.gap_ms, &clocks);
      row.layer_us = us[0];
      row.dense_us = us[1];
      row.layer_clocks = clocks[0];
      row.dense_clocks = clocks[1];
      row.dense_tflops = flops / (row.dense_us * 1e-6) / 1e12;
      if (grouped) {
        row.cublas_grouped_us = us[2];
        row.cublas_grouped_clocks = clocks[2];
        row.cublas_grouped_tflops = flops / (row.cublas_grouped_us * 1e-6) / 1e12;
      }
      row.dense_single_tflops = dense_single_tflops(*dense, r, flops, events);
    } else {
      row.layer_us =
          replay_us(all, stream_, o_.trials, row.iterations, events, o_.gap_ms, &row.layer_clocks);
    }
    // Each kernel: the same N-layer graph with every layer cut after its first p kernels
    // (layer_prefix), all cuts replayed in turn with the whole graph; a kernel's time is what its
    // cut adds to the one before.
    try {
      const GraphTopology t = topology_of(all.graph);
      const std::size_t per_layer = order.size();
      if (t.order.size() != per_layer * to_size(row.iterations)) {
        throw std::runtime_error("the captured layers have " + std::to_string(t.order.size()) +
                                 " nodes, not " + std::to_string(row.iterations) + " x " +
                                 std::to_string(per_layer));
      }
      std::vector<std::string> labels;
      for (CUgraphNode node : order) labels.push_back(node_label(node));
      for (std::size_t n = 0; n < t.order.size(); ++n) {
        if (node_label(t.order[n]) != labels[n % per_layer]) {
          throw std::runtime_error("the captured layers do not repeat the layer's kernels");
        }
      }
      std::vector<Graph> cuts;
      for (std::size_t p = 1; p < per_layer; ++p) {
        cuts.push_back(layer_prefix(all.graph, t, per_layer, p));
      }
      std::vector<const Graph*> graphs;
      for (const Graph& g : cuts) graphs.push_back(&g);
      graphs.push_back(&all);
      std::vector<Telemetry::Stats> clocks;
      const std::vector<double> us =
          replay_alternating_us(graphs, std::vector<int>(graphs.size(), row.iterations), stream_,
                                o_.trials, events, o_.gap_ms, &clocks);
      row.sum_clocks = clocks.back();
      for (std::size_t p = 0; p < per_layer; ++p) {
        row.kernels.push_back({labels[p], us[p] - (p > 0 ? us[p - 1] : 0.0)});
      }
      row.kernels_sum_us = us.back();
    } catch (const std::exception& e) {
      row.kernels.clear();
      row.kernels_note = std::string("per-kernel times unavailable: ") + e.what();
    }
    row.copy_fraction = row.mxfp4_bytes / (row.layer_us * 1e-6) / (copy_gbs_ * 1e9);
    row.tflops = flops / (row.layer_us * 1e-6) / 1e12;
    return row;
  }

  // The dense baseline of a row: gathered inputs [T*K, H], FC1 out [T*K, 2I], FC2 out [T*K, H]
  // (expert e's rows contiguous), and N grouped calls captured back to back.
  struct DenseLayer {
    Buffer x, y1, y2;
    Graph graph;
    double estimate_us = 1;  // one grouped call, eager
  };

  // Builds the dense baseline's graph; sets row->dense_rotation and row->dense_iterations.
  std::unique_ptr<DenseLayer> dense_layer(const Routing& r, double dense_expert_bytes,
                                          int dense_copies, Events& events, Row* row) {
    const auto& s = s_;
    const int64_t t = r.tokens;
    const int h = s.hidden;
    const int i = s.intermediate;
    const int64_t rows = t * s.top_k;
    row->dense_rotation = std::min(dense_copies, rotation_for(r.touched * dense_expert_bytes));
    auto dense = std::make_unique<DenseLayer>();
    dense->x = Buffer(to_size(rows * h * 2));
    dense->y1 = Buffer(to_size(rows * 2 * i * 2));
    dense->y2 = Buffer(to_size(rows * h * 2));
    const Buffer& x = dense->x;
    const Buffer& y1 = dense->y1;
    const Buffer& y2 = dense->y2;
    const std::vector<uint8_t> pattern = random_bf16_bytes(std::size_t{1} << 20, o_.seed + 51);
    fill_with_pattern(x.ptr(), x.bytes(), pattern, stream_);
    BENCH_BLAS(cublasSetStream(blas_, reinterpret_cast<cudaStream_t>(stream_)));
    auto grouped = [&](int copy) {
      int64_t first = 0;
      for (int e = 0; e < s.num_experts; ++e) {
        const int m = r.per_expert[to_size(e)];
        if (m == 0) continue;
        gemm_bf16(blas_, m, 2 * i, h, x.at(to_size(first * h * 2)), h, dense_w13(copy, e), h,
                  y1.at(to_size(first * 2 * i * 2)), 2 * i);
        gemm_bf16(blas_, m, h, i, y1.at(to_size(first * 2 * i * 2)), 2 * i, dense_w2(copy, e), i,
                  y2.at(to_size(first * h * 2)), h);
        first += m;
      }
    };
    grouped(0);
    BENCH_CU(cu().cuStreamSynchronize(stream_));
    std::vector<double> eager;
    for (int rep = 0; rep < 3; ++rep) {
      eager.push_back(events.time_us(stream_, [&] { grouped(rep % row->dense_rotation); }));
    }
    const double estimate = std::max(1.0, median(eager));
    dense->estimate_us = estimate;
    // Why the node cap: a graph of tens of thousands of GEMM nodes takes long to instantiate.
    const int max_by_nodes = std::max(2, 6000 / std::max(1, 2 * r.touched));
    row->dense_iterations = std::clamp(static_cast<int>(o_.target_ms * 1000.0 / estimate), 2,
                                       std::min(400, max_by_nodes));
    dense->graph = capture(stream_, [&] {
      for (int j = 0; j < row->dense_iterations; ++j) grouped(j % row->dense_rotation);
    });
    return dense;
  }

  // The dense baseline's GEMMs as two cuBLAS grouped calls a layer (cublasGemmGroupedBatchedEx):
  // every touched expert's FC1, then every FC2, experts of equal row count sharing a group. The
  // operand pointers live in device memory, one table per weight copy, so the calls capture.
  struct CublasGrouped {
    Buffer pointers;
    Graph graph;
  };

  // Builds the grouped graph on the dense layer's buffers and weight copies (same rotation);
  // sets row->cublas_grouped_iterations. Throws where cuBLAS refuses (e.g. a build without it).
  std::unique_ptr<CublasGrouped> cublas_grouped(const Routing& r, const DenseLayer& dense,
                                                Events& events, Row* row) {
    const int h = s_.hidden;
    const int i = s_.intermediate;
    // Problems ordered by group: experts with the same m side by side.
    std::map<int, std::vector<int>> experts_by_m;
    std::vector<int64_t> first_row(to_size(s_.num_experts), 0);
    int64_t rows = 0;
    std::size_t problems = 0;  // touched experts: one GEMM each
    for (int e = 0; e < s_.num_experts; ++e) {
      first_row[to_size(e)] = rows;
      const int m = r.per_expert[to_size(e)];
      if (m == 0) continue;
      experts_by_m[m].push_back(e);
      rows += m;
      ++problems;
    }
    std::vector<int> m_of_group;
    std::vector<int> group_size;
    for (const auto& [m, experts] : experts_by_m) {
      m_of_group.push_back(m);
      group_size.push_back(static_cast<int>(experts.size()));
    }
    const int groups = static_cast<int>(m_of_group.size());
    // Per copy: FC1's A (weights), B (inputs), C; then FC2's; each `problems` pointers long.
    const std::size_t per_copy = 6 * problems;
    std::vector<const void*> table(per_copy * to_size(row->dense_rotation));
    for (int c = 0; c < row->dense_rotation; ++c) {
      const void** t = table.data() + per_copy * to_size(c);
      std::size_t p = 0;
      for (const auto& [m, experts] : experts_by_m) {
        for (int e : experts) {
          const std::size_t first = to_size(first_row[to_size(e)]);
          t[p] = dense_w13(c, e);
          t[problems + p] = dense.x.at(first * to_size(h) * 2);
          t[2 * problems + p] = dense.y1.at(first * 2 * to_size(i) * 2);
          t[3 * problems + p] = dense_w2(c, e);
          t[4 * problems + p] = dense.y1.at(first * 2 * to_size(i) * 2);
          t[5 * problems + p] = dense.y2.at(first * to_size(h) * 2);
          ++p;
        }
      }
    }
    auto grouped = std::make_unique<CublasGrouped>();
    grouped->pointers = Buffer(table.size() * sizeof(void*));
    BENCH_CU(cu().cuMemcpyHtoD(grouped->pointers.ptr(), table.data(), grouped->pointers.bytes()));

    // Column-major as gemm_bf16: C^T [n x m] = W [n x k] (op T) x X^T [k x m].
    const std::vector<cublasOperation_t> op_t(to_size(groups), CUBLAS_OP_T);
    const std::vector<cublasOperation_t> op_n(to_size(groups), CUBLAS_OP_N);
    const std::vector<int> n1(to_size(groups), 2 * i), n2(to_size(groups), h);
    const std::vector<int> k1(to_size(groups), h), k2(to_size(groups), i);
    const std::vector<float> ones(to_size(groups), 1.0f), zeros(to_size(groups), 0.0f);
    auto layer = [&](int copy) {
      const void* const* t = static_cast<const void* const*>(
          grouped->pointers.at(per_copy * to_size(copy) * sizeof(void*)));
      // FC1: [m x 2I] = X [m x H] W13^T; FC2: [m x H] = Y1 [m x 2I, first I used] W2^T.
      BENCH_BLAS(cublasGemmGroupedBatchedEx(
          blas_, op_t.data(), op_n.data(), n1.data(), m_of_group.data(), k1.data(), ones.data(), t,
          CUDA_R_16BF, k1.data(), t + problems, CUDA_R_16BF, k1.data(), zeros.data(),
          const_cast<void* const*>(t + 2 * problems), CUDA_R_16BF, n1.data(), groups,
          group_size.data(), CUBLAS_COMPUTE_32F));
      BENCH_BLAS(cublasGemmGroupedBatchedEx(
          blas_, op_t.data(), op_n.data(), n2.data(), m_of_group.data(), k2.data(), ones.data(),
          t + 3 * problems, CUDA_R_16BF, k2.data(), t + 4 * problems, CUDA_R_16BF, n1.data(),
          zeros.data(), const_cast<void* const*>(t + 5 * problems), CUDA_R_16BF, n2.data(), groups,
          group_size.data(), CUBLAS_COMPUTE_32F));
    };
    layer(0);  // eager first: cuBLAS picks and loads its kernels outside the capture
    BENCH_CU(cu().cuStreamSynchronize(stream_));
    std::vector<double> eager;
    for (int rep = 0; rep < 3; ++rep) {
      eager.push_back(events.time_us(stream_, [&] { layer(rep % row->dense_rotation); }));
    }
    const double estimate = std::max(1.0, median(eager));
    row->cublas_grouped_iterations =
        std::clamp(static_cast<int>(o_.target_ms * 1000.0 / estimate), 2, 400);
    grouped->graph = capture(stream_, [&] {
      for (int j = 0; j < row->cublas_grouped_iterations; ++j) layer(j % row->dense_rotation);
    });
    return grouped;
  }

  // TFLOP/s of the same FLOPs as one GEMM pair (M = T*K rows on expert 0's weights): the dense
  // roofline.
  double dense_single_tflops(const DenseLayer& dense, const Routing& r, double flops,
                             Events& events) {
    const int h = s_.hidden;
    const int i = s_.intermediate;
    const Buffer& x = dense.x;
    const Buffer& y1 = dense.y1;
    const Buffer& y2 = dense.y2;
    const int m = static_cast<int>(r.local_entries);
    gemm_bf16(blas_, m, 2 * i, h, x.data(), h, dense_w13(0, 0), h, y1.data(), 2 * i);
    gemm_bf16(blas_, m, h, i, y1.data(), 2 * i, dense_w2(0, 0), i, y2.data(), h);
    BENCH_CU(cu().cuStreamSynchronize(stream_));
    const int per = std::clamp(static_cast<int>(o_.target_ms * 1000.0 / dense.estimate_us), 2, 50);
    Graph g = capture(stream_, [&] {
      for (int j = 0; j < per; ++j) {
        gemm_bf16(blas_, m, 2 * i, h, x.data(), h, dense_w13(0, 0), h, y1.data(), 2 * i);
        gemm_bf16(blas_, m, h, i, y1.data(), 2 * i, dense_w2(0, 0), i, y2.data(), h);
      }
    });
    const double us = replay_us(g, stream_, o_.trials, per, events);
    return flops / (us * 1e-6) / 1e12;
  }

  static json clocks_json(const Telemetry::Stats& c) {
    if (c.samples == 0) return nullptr;
    return {{"sm_mhz_median", c.sm_mhz},
            {"watts_mean", c.watts},
            {"power_capped_fraction", c.capped},
            {"samples", c.samples}};
  }

  json row_json(const Row& row) const {
    json kernels = json::array();
    for (const KernelTime& k : row.kernels) kernels.push_back({{"name", k.name}, {"us", k.us}});
    json j = {{"tokens", row.tokens},
              {"experts_touched", row.touched},
              {"mxfp4_bytes_touched", row.mxfp4_bytes},
              {"layer_us", row.layer_us},
              {"kernels", kernels},
              {"kernels_sum_us", row.kernels_sum_us},
              {"copy_bandwidth_fraction", row.copy_fraction},
              {"tflops", row.tflops},
              {"weight_rotation", row.rotation},
              {"graph_iterations", row.iterations},
              {"nonfinite_outputs", row.nonfinite}};
    if (!row.kernels_note.empty()) j["kernels_note"] = row.kernels_note;
    j["layer_clocks"] = clocks_json(row.layer_clocks);
    j["kernels_sum_clocks"] = clocks_json(row.sum_clocks);
    if (o_.dense) j["dense_clocks"] = clocks_json(row.dense_clocks);
    if (o_.dense) {
      j["dense_grouped_us"] = row.dense_us;
      j["dense_grouped_tflops"] = row.dense_tflops;
      j["dense_single_gemm_tflops"] = row.dense_single_tflops;
      if (row.cublas_grouped_us > 0) {
        j["cublas_grouped_us"] = row.cublas_grouped_us;
        j["cublas_grouped_tflops"] = row.cublas_grouped_tflops;
        j["cublas_grouped_graph_iterations"] = row.cublas_grouped_iterations;
        j["cublas_grouped_clocks"] = clocks_json(row.cublas_grouped_clocks);
      } else {
        j["cublas_grouped_note"] = row.cublas_grouped_note;
      }
      j["dense_weight_rotation"] = row.dense_rotation;
      j["dense_graph_iterations"] = row.dense_iterations;
    }
    return j;
  }

  // The routing of T tokens (the same for both sections and both paths: seeded by T).
  Routing routing(int tokens) const {
    return make_routing(s_, tokens, o_.global_routing, o_.seed + static_cast<uint64_t>(tokens));
  }

  // "[  42 s] ": seconds since the program started, for progress lines.
  std::string stamp() const {
    char text[32];
    std::snprintf(text, sizeof(text), "[%4.0f s] ",
                  std::chrono::duration<double>(Clock::now() - started_).count());
    return text;
  }

  json model_json() const {
    const auto& s = s_;
    return {{"model", s.name},
            {"num_experts", s.num_experts},
            {"expert_offset", s.expert_offset},
            {"global_experts", s.global_experts},
            {"top_k", s.top_k},
            {"hidden", s.hidden},
            {"intermediate", s.intermediate},
            {"activation", moejit::activation_kind_name(s.activation.kind)},
            {"has_bias", s.has_bias},
            {"routing", o_.global_routing ? "global" : "local"},
            {"prewarm_seconds", compile_s_},
            {"kernels_compiled", compiled_},
            {"kernels_cached", loaded_},
            {"mxfp4_bytes_per_expert", expert_bytes_},
            {"weight_copies", copies_}};
  }

  // decode_moe's tile: n block_n, s FC1/FC2 strips per item, d pipeline stages, x CTAs per SM.
  static std::string tile_text(const DecodeRow& row) {
    const moejit::MoeDecodeParams& p = row.tile;
    if (moejit::detail::decode_pair_kernel(p.kernel))
      return "pair t" + std::to_string(p.max_tokens);
    return "n" + std::to_string(p.block_n) + " s" + std::to_string(p.fc1_strips) + "/" +
           std::to_string(p.fc2_strips) + " d" + std::to_string(p.stages) + " x" +
           std::to_string(row.ctas_per_sm);
  }

  // The kernels of one captured call, in launch order.
  static std::vector<std::string> kernel_names(const Graph& graph) {
    std::vector<std::string> names;
    try {
      for (CUgraphNode node : topological_nodes(graph.graph)) names.push_back(node_label(node));
    } catch (const std::exception& e) {
      names.assign(1, std::string("unavailable: ") + e.what());
    }
    return names;
  }

  DecodeRow decode_row(const Routing& r) {
    const auto& s = s_;
    DecodeRow row;
    row.tokens = r.tokens;
    row.touched = r.touched;
    row.mxfp4_bytes = r.touched * expert_bytes_;
    row.rotation = std::min(copies_, rotation_for(row.mxfp4_bytes));
    // The tile the call runs: the planner's (the two-launch pair at small T where it serves the
    // shape), or the persistent tile of a forced block_n.
    const moejit::detail::MoeForwardConfig config = moejit::detail::choose_moe_config(s, r.tokens);
    row.tile = o_.decode_block_n == 0 && config.decode_pair
                   ? config.decode_first
                   : moejit::detail::choose_decode_config(s, r.tokens, o_.decode_block_n);
    row.ctas_per_sm = moejit::detail::decode_moe_blocks_per_sm(row.tile);
    const moejit::MoeForwardOptions decode_path{moejit::MoePath::kDecode, o_.decode_block_n};
    LayerInputs in(s, r, o_.seed);
    auto forward = [&](int copy, const moejit::MoeForwardOptions& path) {
      in.forward(s, sets_[to_size(copy)].weights, stream_, path);
    };
    try {
      // Eager: one checked call of each path (outputs poisoned first), then three timed calls
      // of each for the iteration counts.
      Events events;
      in.poison_out(stream_);
      forward(0, decode_path);
      const std::vector<uint16_t> decoded = in.read_out();
      in.poison_out(stream_);
      forward(0, kMarlinPath);
      const std::vector<uint16_t> reference = in.read_out();
      row.decode_nonfinite = count_nonfinite(decoded);
      row.marlin_nonfinite = count_nonfinite(reference);
      double diff_sq = 0;
      double ref_sq = 0;
      for (std::size_t j = 0; j < decoded.size(); ++j) {
        const double d = bf16_value(decoded[j]);
        const double m = bf16_value(reference[j]);
        diff_sq += (d - m) * (d - m);
        ref_sq += m * m;
        row.marlin_zeros += m == 0 ? 1 : 0;
        row.max_abs_diff = std::max(row.max_abs_diff, std::fabs(d - m));
      }
      row.rel_l2 = std::sqrt(ref_sq > 0 ? diff_sq / ref_sq : diff_sq);
      row.marlin_rms =
          std::sqrt(ref_sq / static_cast<double>(std::max<std::size_t>(1, decoded.size())));

      auto iterations = [&](const moejit::MoeForwardOptions& path) {
        std::vector<double> eager;
        for (int rep = 0; rep < 3; ++rep) {
          eager.push_back(events.time_us(stream_, [&] { forward(rep % row.rotation, path); }));
        }
        const double estimate = std::max(1.0, median(eager));
        return std::clamp(static_cast<int>(o_.target_ms * 1000.0 / estimate), 3, 400);
      };
      row.decode_iterations = iterations(decode_path);
      row.marlin_iterations = iterations(kMarlinPath);
      row.decode_kernels = kernel_names(capture(stream_, [&] { forward(0, decode_path); }));
      row.marlin_kernels = kernel_names(capture(stream_, [&] { forward(0, kMarlinPath); }));

      // Each layer: N calls captured back to back (iteration j reads copy j mod R).
      const Graph decode_graph = capture(stream_, [&] {
        for (int j = 0; j < row.decode_iterations; ++j) forward(j % row.rotation, decode_path);
      });
      const Graph marlin_graph = capture(stream_, [&] {
        for (int j = 0; j < row.marlin_iterations; ++j) forward(j % row.rotation, kMarlinPath);
      });
      std::vector<const Graph*> graphs = {&decode_graph, &marlin_graph};
      std::vector<int> per_replay = {row.decode_iterations, row.marlin_iterations};
      // The read floor: the decode graph's N calls, each only reading its copy's bytes, once
      // per variant (none where the rank's experts get no entry: nothing to read).
      std::vector<FloorTable> tables;
      std::vector<Graph> floor_graphs;
      Buffer sink(kAlign);
      if (floor_ != nullptr && r.touched > 0) {
        for (const FloorVariant& v : kFloorVariants) {
          const uint64_t chunk = static_cast<uint64_t>(v.chunk_kb) * 1024 / 16;
          const std::size_t first = tables.size();
          for (int c = 0; c < row.rotation; ++c) tables.push_back(floor_table(r, c, chunk));
          floor_graphs.push_back(capture(stream_, [&] {
            for (int j = 0; j < row.decode_iterations; ++j) {
              const FloorTable& t = tables[first + to_size(j % row.rotation)];
              floor_->launch(v.bulk, t.regions.data(), t.count, chunk, t.blocks, sink.data(),
                             stream_);
            }
          }));
        }
        for (const Graph& g : floor_graphs) {
          graphs.push_back(&g);
          per_replay.push_back(row.decode_iterations);
        }
      }
      std::vector<Telemetry::Stats> clocks;
      const std::vector<double> us =
          replay_alternating_us(graphs, per_replay, stream_, o_.trials, events, o_.gap_ms, &clocks);
      row.decode_us = us[0];
      row.decode_clocks = clocks[0];
      row.marlin_clocks = clocks[1];
      row.marlin_us = us[1];
      if (us.size() > 2) {
        row.floor_us_by_variant.assign(us.begin() + 2, us.end());
        row.floor_us =
            *std::min_element(row.floor_us_by_variant.begin(), row.floor_us_by_variant.end());
      }
    } catch (const moejit::Error& e) {
      // Why these two end the run: after a driver error the context may be unusable, and an
      // internal error is a libmoejit bug; any other error (a refused path, a failed compile)
      // is this row's result.
      if (e.code() == moejit::ErrorCode::kDriver || e.code() == moejit::ErrorCode::kInternal) throw;
      row.error = std::string(moejit::error_code_name(e.code())) + ": " + e.what();
      return row;
    }
    row.decode_copy_fraction = row.mxfp4_bytes / (row.decode_us * 1e-6) / (copy_gbs_ * 1e9);
    row.marlin_copy_fraction = row.mxfp4_bytes / (row.marlin_us * 1e-6) / (copy_gbs_ * 1e9);
    if (row.floor_us > 0) {
      row.floor_copy_fraction = row.mxfp4_bytes / (row.floor_us * 1e-6) / (copy_gbs_ * 1e9);
    }
    return row;
  }

  // The read floor's regions for weight copy `copy`: each of the four weight arrays' touched
  // experts, runs of consecutive experts merged, on the device.
  struct FloorTable {
    Buffer regions;
    int count = 0;
    uint64_t blocks = 0;
  };
  FloorTable floor_table(const Routing& r, int copy, uint64_t chunk) const {
    const moejit::MoeWeights& w = sets_[to_size(copy)].weights;
    const int64_t e = s_.num_experts;
    const std::pair<const void*, std::size_t> arrays[] = {{w.w13, sizes_.w13_bytes},
                                                          {w.w13_scales, sizes_.w13_scale_bytes},
                                                          {w.w2, sizes_.w2_bytes},
                                                          {w.w2_scales, sizes_.w2_scale_bytes}};
    std::vector<FloorRegion> regions;
    uint64_t blocks = 0;
    for (const auto& [base, bytes] : arrays) {
      if (bytes % to_size(e) != 0 || bytes / to_size(e) % 16 != 0) {
        throw std::runtime_error("read floor: a weight array's per-expert size (" +
                                 std::to_string(bytes) + " bytes over " + std::to_string(e) +
                                 " experts) is not a multiple of 16 bytes");
      }
      const uint64_t per = bytes / to_size(e) / 16;  // pieces per expert
      for (int64_t x = 0; x < e;) {
        if (r.per_expert[to_size(x)] == 0) {
          ++x;
          continue;
        }
        int64_t y = x;
        while (y < e && r.per_expert[to_size(y)] > 0) ++y;
        const uint64_t pieces = per * static_cast<uint64_t>(y - x);
        regions.push_back(
            {static_cast<const uint8_t*>(base) + to_size(x) * per * 16, pieces, blocks});
        blocks += (pieces + chunk - 1) / chunk;
        x = y;
      }
    }
    FloorTable t;
    t.count = static_cast<int>(regions.size());
    t.blocks = blocks;
    t.regions = Buffer(std::max<std::size_t>(regions.size(), 1) * sizeof(FloorRegion));
    if (!regions.empty()) upload(t.regions, 0, regions);
    return t;
  }

  json decode_row_json(const DecodeRow& row) const {
    const moejit::MoeDecodeParams& p = row.tile;
    json j = {{"tokens", row.tokens},
              {"experts_touched", row.touched},
              {"mxfp4_bytes_touched", row.mxfp4_bytes},
              {"tile",
               {{"block_n", p.block_n},
                {"fc1_strips", p.fc1_strips},
                {"fc2_strips", p.fc2_strips},
                {"stages", p.stages},
                {"ctas_per_sm", row.ctas_per_sm},
                {"block_n_forced", o_.decode_block_n != 0}}},
              {"weight_rotation", row.rotation}};
    if (!row.error.empty()) {
      j["error"] = row.error;
      return j;
    }
    j["decode_us"] = row.decode_us;
    j["decode_copy_bandwidth_fraction"] = row.decode_copy_fraction;
    j["marlin_us"] = row.marlin_us;
    j["marlin_copy_bandwidth_fraction"] = row.marlin_copy_fraction;
    j["decode_over_marlin"] = row.decode_us / row.marlin_us;
    if (row.floor_us > 0) {
      j["read_floor_us"] = row.floor_us;
      j["read_floor_copy_bandwidth_fraction"] = row.floor_copy_fraction;
      json by_variant = json::object();
      for (std::size_t c = 0; c < row.floor_us_by_variant.size(); ++c) {
        by_variant[floor_variant_name(kFloorVariants[c])] = row.floor_us_by_variant[c];
      }
      j["read_floor_us_by_variant"] = by_variant;
    }
    j["decode_clocks"] = clocks_json(row.decode_clocks);
    j["marlin_clocks"] = clocks_json(row.marlin_clocks);
    j["decode_graph_iterations"] = row.decode_iterations;
    j["marlin_graph_iterations"] = row.marlin_iterations;
    j["decode_nonfinite_outputs"] = row.decode_nonfinite;
    j["marlin_nonfinite_outputs"] = row.marlin_nonfinite;
    j["rel_l2_decode_vs_marlin"] = row.rel_l2;
    j["max_abs_diff_decode_vs_marlin"] = row.max_abs_diff;
    j["marlin_output_rms"] = row.marlin_rms;
    j["marlin_output_zeros"] = row.marlin_zeros;
    j["decode_kernels"] = row.decode_kernels;
    j["marlin_kernels"] = row.marlin_kernels;
    return j;
  }

  moejit::ModelShape s_;
  const Options& o_;
  const Device& device_;
  CUstream stream_;
  cublasHandle_t blas_;
  double copy_gbs_;
  Clock::time_point started_;
  const ReadFloor* floor_;      // null: no read floor
  std::string decode_problem_;  // moe_decode_problem, asked when the model has decode rows
  double compile_s_ = 0;
  int compiled_ = 0;
  int loaded_ = 0;
  double expert_bytes_ = 0;
  double dense_expert_bytes_ = 0;
  int copies_ = 1;
  int dense_copies_ = 0;
  moejit::MoeWeightLayout sizes_;
  std::vector<WeightSet> sets_;
  Buffer bias13_;
  Buffer bias2_;
  std::vector<Buffer> dense_;
};

std::vector<std::string> split_list(const std::string& text) {
  std::vector<std::string> out;
  std::stringstream in(text);
  std::string item;
  while (std::getline(in, item, ',')) {
    if (!item.empty()) out.push_back(item);
  }
  return out;
}

// Rewritten after every model, so a run cut short keeps the rows it measured.
void write_json(const json& report, const std::string& path) {
  if (path.empty()) return;
  std::ofstream file(path);
  file << report.dump(2) << "\n";
  if (!file) throw std::runtime_error("could not write " + path);
}

// A model of the run and the sections it has rows in.
struct ModelPlan {
  moejit::ModelShape shape;
  bool marlin = false;
  bool decode = false;
};

std::string join_ints(const std::vector<int>& values) {
  std::string out;
  for (int v : values) out += (out.empty() ? "" : ",") + std::to_string(v);
  return out;
}

int run(const Options& o) {
  const Clock::time_point started = Clock::now();
  const std::string shapes_file =
      moejit::bench::find_shapes_file(o.shapes_file, MOEJIT_BENCH_SHAPES_FILE);
  const std::vector<moejit::ModelShape> all = moejit::load_shapes_file(shapes_file);
  std::vector<int> decode_tokens;
  std::vector<int> dropped;
  for (int t : o.decode_tokens) {
    (t <= moejit::detail::kDecodeMaxTokens ? decode_tokens : dropped).push_back(t);
  }
  const bool marlin_section = o.marlin_section && !o.models.empty() && !o.tokens.empty();
  const bool decode_section = o.decode_section && !o.decode_models.empty();

  // The models in run order: the marlin section's, then the decode section's others. A model in
  // both is set up once.
  std::vector<ModelPlan> plans;
  auto plan_of = [&](const std::string& name) -> ModelPlan& {
    for (ModelPlan& p : plans) {
      if (p.shape.name == name) return p;
    }
    auto it = std::find_if(all.begin(), all.end(),
                           [&](const moejit::ModelShape& s) { return s.name == name; });
    if (it == all.end()) throw std::runtime_error("no shape \"" + name + "\" in " + shapes_file);
    plans.push_back(ModelPlan{*it, false, false});
    return plans.back();
  };
  if (marlin_section) {
    for (const std::string& name : o.models) plan_of(name).marlin = true;
  }
  if (decode_section && !decode_tokens.empty()) {
    for (const std::string& name : o.decode_models) plan_of(name).decode = true;
  }
  for (ModelPlan& p : plans) {
    int max_tokens = 1;
    for (int t : p.marlin ? o.tokens : std::vector<int>{}) max_tokens = std::max(max_tokens, t);
    for (int t : p.decode ? decode_tokens : std::vector<int>{}) {
      max_tokens = std::max(max_tokens, t);
    }
    // Why: prewarm builds the kernels of every T up to max_tokens; no more than the run needs.
    p.shape.max_tokens = max_tokens;
  }

  BENCH_CU(cu().cuInit(0));
  Device device;
  int count = 0;
  BENCH_CU(cu().cuDeviceGetCount(&count));
  if (count == 0) throw std::runtime_error("no CUDA device");
  BENCH_CU(cu().cuDeviceGet(&device.device, 0));
  BENCH_CU(cu().cuDevicePrimaryCtxRetain(&device.context, device.device));
  BENCH_CU(cu().cuCtxSetCurrent(device.context));
  char name[256] = {};
  BENCH_CU(cu().cuDeviceGetName(name, sizeof(name), device.device));
  device.name = name;
  int l2 = 0;
  BENCH_CU(cu().cuDeviceGetAttribute(&l2, CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE, device.device));
  device.l2_bytes = static_cast<std::size_t>(l2);
  BENCH_CU(cu().cuDeviceGetAttribute(&device.sms, CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
                                     device.device));
  BENCH_CU(cu().cuDeviceTotalMem(&device.total_bytes, device.device));
  int major = 0;
  int minor = 0;
  BENCH_CU(cu().cuDeviceGetAttribute(&major, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR,
                                     device.device));
  BENCH_CU(cu().cuDeviceGetAttribute(&minor, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR,
                                     device.device));
  device.arch.sm = major * 10 + minor;
  device.arch.arch_specific = device.arch.sm >= 90;
  CUstream stream = nullptr;
  BENCH_CU(cu().cuStreamCreate(&stream, CU_STREAM_NON_BLOCKING));

  moejit::configure(moejit::RuntimeConfig::from_environment());
  cublasHandle_t blas = nullptr;
  BENCH_BLAS(cublasCreate(&blas));
  // Why a fixed workspace: cuBLAS must not allocate while a stream is being captured.
  Buffer blas_workspace(std::size_t{64} << 20);
  BENCH_BLAS(cublasSetWorkspace(blas, blas_workspace.data(), blas_workspace.bytes()));
  BENCH_BLAS(cublasSetStream(blas, reinterpret_cast<cudaStream_t>(stream)));

  Events events;
  std::cout << "moejit_bench_moe: libmoejit " << moejit::kVersionString << ", " << device.name
            << " (" << device.arch.name() << "), " << device.sms << " SMs, L2 "
            << device.l2_bytes / (1 << 20) << " MiB, "
            << device.total_bytes / (std::size_t{1} << 30) << " GiB; shapes from " << shapes_file
            << std::endl;
  telemetry().start(device.device);
  std::cout << "SM clock and power: "
            << (telemetry().available()
                    ? "NVML, sampled every 2 ms during timed replays (SM clock max " +
                          std::to_string(telemetry().max_sm_mhz()) + " MHz)"
                    : "not reported (" + telemetry().why_unavailable() + ")")
            << std::endl;
  std::string decode_skipped;
  if (decode_section) {
    if (decode_tokens.empty()) {
      decode_skipped =
          "no token count <= " + std::to_string(moejit::detail::kDecodeMaxTokens) +
          " asked (decode_moe serves T <= " + std::to_string(moejit::detail::kDecodeMaxTokens) +
          ")";
    } else if (device.arch.sm < 90) {
      decode_skipped = "decode_moe needs sm_90 or newer; this device is " + device.arch.name();
      for (ModelPlan& p : plans) p.decode = false;
    }
  }
  std::cout << "marlin section: "
            << (marlin_section ? join_ints(o.tokens) + " tokens" : std::string("not run"))
            << "; decode section: "
            << (!decode_section ? std::string("not run")
                : decode_skipped.empty()
                    ? join_ints(decode_tokens) + " tokens, block_n " +
                          (o.decode_block_n == 0 ? std::string("planner's")
                                                 : std::to_string(o.decode_block_n))
                    : "skipped, " + decode_skipped)
            << (dropped.empty() || !decode_section || !decode_skipped.empty()
                    ? std::string()
                    : " (T " + join_ints(dropped) + " left out: decode_moe serves T <= " +
                          std::to_string(moejit::detail::kDecodeMaxTokens) + ")")
            << "; routing over " << (o.global_routing ? "global" : "local") << " experts"
            << std::endl;
  std::cout << "models:";
  for (const ModelPlan& p : plans) {
    std::cout << " " << p.shape.name << " ("
              << (p.marlin && p.decode ? "both"
                  : p.marlin           ? "marlin"
                                       : "decode")
              << ")";
  }
  std::cout << std::endl;

  const double copy_gbs = copy_bandwidth_gbs(stream, events);
  std::cout << "copy bandwidth (cuMemcpyDtoDAsync 1 GiB, read + write): " << fixed(copy_gbs, 0)
            << " GB/s" << std::endl;
  const bool dense = o.dense && marlin_section;
  double peak = 0;
  if (dense) {
    peak = dense_peak_tflops(blas, stream, events, o.trials);
    std::cout << "dense bf16 GEMM 8192^3 (cuBLAS, fp32 accumulate): " << fixed(peak, 1)
              << " TFLOP/s" << std::endl;
  }

  std::unique_ptr<ReadFloor> floor;
  if (decode_section && o.floor) floor = std::make_unique<ReadFloor>(device.arch);

  json report = {{"library_version", moejit::kVersionString},
                 {"device", device.name},
                 {"arch", device.arch.name()},
                 {"sms", device.sms},
                 {"l2_bytes", device.l2_bytes},
                 {"copy_bandwidth_GBps", copy_gbs},
                 {"trials", o.trials},
                 {"target_ms", o.target_ms}};
  if (dense) report["dense_bf16_8192_tflops"] = peak;
  json models = json::array();
  json decode_models = json::array();
  if (marlin_section) report["models"] = models;
  if (decode_section) {
    report["decode"] = {{"block_n_forced", o.decode_block_n}, {"models", decode_models}};
    if (!decode_skipped.empty()) report["decode"]["skipped"] = decode_skipped;
  }
  std::vector<std::vector<std::string>> table;
  std::vector<std::vector<std::string>> decode_table;
  for (const ModelPlan& p : plans) {
    if (!p.marlin && !p.decode) continue;
    ModelBench bench(p.shape, o, device, stream, blas, copy_gbs, started, floor.get());
    bench.prepare(p.marlin ? o.tokens : std::vector<int>{},
                  p.decode ? decode_tokens : std::vector<int>{});
    if (p.marlin) {
      models.push_back(bench.marlin_section(o.tokens, &table));
      report["models"] = models;
    }
    if (p.decode) {
      decode_models.push_back(bench.decode_section(decode_tokens, &decode_table));
      report["decode"]["models"] = decode_models;
    }
    write_json(report, o.json_path);
  }
  if (marlin_section) {
    print_table(
        "moe_forward, marlin path (MoePath::kMarlin), CUDA graph replay (median per "
        "layer); copy bandwidth " +
            fixed(copy_gbs, 0) + " GB/s" +
            (dense ? ", dense bf16 peak " + fixed(peak, 1) + " TFLOP/s" : std::string()),
        {"model", "T", "experts", "MB", "layer us", "% copy", "MHz", "TFLOP/s", "dense us",
         "dense TFLOP/s", "speedup", "1-GEMM TFLOP/s", "grouped us", "vs grouped", "output",
         "sum us", "sum MHz", "kernels (us)"},
        table);
    std::cout
        << "\nMB: MXFP4 weights of the experts touched (nibbles + scales, kernel layout). % copy:"
           " MB / layer time / copy bandwidth.\ndense: cuBLAS bf16 GEMMs per touched expert"
           " (FC1 and FC2, same routing); speedup: dense us / layer us; 1-GEMM: the same FLOPs as "
           "one\n"
           "GEMM pair. grouped: the same GEMMs as two cuBLAS grouped calls a layer"
           " (cublasGemmGroupedBatchedEx, experts of equal rows one group); vs grouped: grouped us"
           " / layer us.\noutput: NaN/inf count of one checked call. kernels:"
           " what each kernel adds to the layers cut before it (launch order).\nsum us: the"
           " whole layer replayed in turn with those cuts, so with MoE work alone between its"
           " replays (the kernels add up to it); layer us alternates with the dense baseline"
           " where that runs.\nMHz: median SM clock during the figure's replays (NVML); *: the"
           " software power cap was active in most samples (it can slow a figure even where the"
           " sampled clock reads its maximum).\n";
  }
  if (decode_section && decode_skipped.empty()) {
    print_table(
        "decode_moe (MoePath::kDecode) vs marlin_moe (MoePath::kMarlin), same inputs, "
        "CUDA graph replay (median per layer), alternating; copy bandwidth " +
            fixed(copy_gbs, 0) + " GB/s",
        {"model", "T", "experts", "MB", "tile", "decode us", "% copy", "marlin us", "% copy",
         "decode/marlin", "floor us, % copy", "MHz d / m", "rel L2", "output"},
        decode_table);
    std::cout
        << "\ntile: decode_moe's n block_n, s FC1/FC2 strips per item, d pipeline stages, x"
           " CTAs per SM"
        << (o.decode_block_n != 0 ? " (block_n forced)" : "")
        << ". decode/marlin: time ratio (below 1: decode faster). MHz: median SM clock"
           " during each path's replays (NVML; *: the power cap active in most samples).\nrel L2: "
           "||decode -"
           " marlin|| / ||marlin|| over one call's output. output: NaN/inf counts (decode /"
           " marlin) of one checked call.\nfloor: a kernel that only reads the same bytes, once per"
           " call, same graph and alternation (ReadFloor in the source).\n";
  } else if (decode_section) {
    std::cout << "\ndecode section skipped: " << decode_skipped << "\n";
  }
  if (!o.json_path.empty()) {
    write_json(report, o.json_path);
    std::cout << "wrote " << o.json_path << "\n";
  }
  std::cout << "total " << fixed(std::chrono::duration<double>(Clock::now() - started).count(), 0)
            << " s\n";
  cublasDestroy(blas);
  cu().cuStreamDestroy(stream);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  std::string models;
  std::string tokens;
  std::string section = "all";
  bool local_routing = false;
  CLI::App app{
      "moejit_bench_moe: the MXFP4 MoE layer (moe_forward) on the GPU, per model and T.\n"
      "Sections (both by default): marlin = the marlin path (MoePath::kMarlin) with per-kernel\n"
      "times and a cuBLAS bf16 baseline, default gpt-oss-120b, deepseek-v4-flash-tp4,\n"
      "qwen3-30b-a3b, kimi-k3.1-tp8 at T = 1,6,24,96,256,1024,4096; decode = decode_moe\n"
      "(MoePath::kDecode) against the marlin path on the same inputs, default kimi-k3.1-tp8,\n"
      "kimi-k3.1-tp4-ep2, deepseek-v4-flash-tp4, qwen3-30b-a3b at T = 1,6,24,96,256.\n"
      "All times: CUDA graph of N back-to-back calls, median replay / N, weights rotated out\n"
      "of L2; % copy against the D2D copy bandwidth measured in the same run."};
  app.add_option("--section", section, "all (default), marlin or decode: which sections to run")
      ->check(CLI::IsMember({"all", "marlin", "decode"}));
  app.add_option("--models", models,
                 "Comma-separated shape names; replaces both sections' model lists");
  app.add_option("--tokens", tokens,
                 "Comma-separated token counts; replaces both sections' lists (the decode "
                 "section keeps T <= 256)");
  app.add_option("--decode-block-n", o.decode_block_n,
                 "decode section: force decode_moe's block_n to 8, 16 or 32 (0 = the planner's)")
      ->check(CLI::IsMember({0, 8, 16, 32}));
  app.add_flag("--local-routing", local_routing,
               "Draw top-k ids from the rank's own experts only (default: from all global "
               "experts, so an expert-parallel rank such as kimi-k3.1-tp4-ep2 sees its share)");
  app.add_option("--shapes", o.shapes_file, "Shape file (default tools/shapes/reference.json)");
  app.add_option("--json", o.json_path,
                 "Also write the results as JSON to PATH (rewritten after each model)");
  app.add_option("--trials", o.trials, "Timed graph replays per figure (median)")
      ->check(CLI::PositiveNumber);
  app.add_option("--target-ms", o.target_ms, "Length of one timed graph replay")
      ->check(CLI::PositiveNumber);
  app.add_option("--gap-ms", o.gap_ms,
                 "Idle the GPU this long before each timed replay (default 0: back to back)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--budget-gb", o.budget_gb, "Device memory for rotated weight copies per model")
      ->check(CLI::PositiveNumber);
  app.add_option("--max-rotation", o.max_rotation, "Most weight copies to rotate through")
      ->check(CLI::PositiveNumber);
  app.add_flag("--no-dense{false}", o.dense, "Skip the cuBLAS bf16 baseline (marlin section)");
  app.add_flag("--no-floor{false}", o.floor, "Skip the read floor (decode section)");
  app.add_option("--seed", o.seed, "Seed of the random weights, routing and inputs");
  CLI11_PARSE(app, argc, argv);
  try {
    o.marlin_section = section != "decode";
    o.decode_section = section != "marlin";
    o.global_routing = !local_routing;
    if (!models.empty()) {
      o.models = split_list(models);
      o.decode_models = o.models;
    }
    if (!tokens.empty()) {
      o.tokens.clear();
      for (const std::string& t : split_list(tokens)) {
        std::size_t used = 0;
        int value = 0;
        try {
          value = std::stoi(t, &used);
        } catch (const std::exception&) {
          used = 0;
        }
        if (used != t.size() || value < 1) {
          throw std::runtime_error("--tokens: token counts are integers >= 1; found \"" + t + "\"");
        }
        o.tokens.push_back(value);
      }
      o.decode_tokens = o.tokens;
    }
    return run(o);
  } catch (const moejit::Error& e) {
    std::cerr << "moejit_bench_moe: " << moejit::error_code_name(e.code()) << ": " << e.what()
              << "\n";
  } catch (const std::exception& e) {
    std::cerr << "moejit_bench_moe: " << e.what() << "\n";
  }
  return 1;
}
