// moejit_bench_runtime: the host-side costs of libmoejit and the append_shared op, as tables
// (and JSON with --json PATH). Every figure is a median over many runs.
//
//   (a) cold compile per family: a fresh process asks for a kernel in a fresh cache (codegen +
//       key + NVRTC + publish), NVRTC alone in a fresh process (its first compile there), and
//       NVRTC alone in this process (warm)
//   (b) loading one cached kernel in a fresh process: request -> launchable CUkernel (disk hit,
//       verify, cuLibraryLoadData); without a GPU only the disk hit (request -> verified cubin)
//   (c) in-memory hit: build_kernel() of a built spec, and the hot-path kernel lookup
//   (d) host overhead of one append_shared call vs a bare cuLaunchKernelEx of the same kernel
//       (through its function in the context, as the library launches)
//   (e) append_shared device time vs the unfused sigmoid -> cast -> append sequence
//   (f) host time of one moe_forward call (C++ and C ABI), on the automatic and the decode path,
//       vs bare cuLaunchKernelEx of the same kernels with the same arguments (the call captured
//       once, its kernel nodes launched again), also in launch_moe_kernel's form (PDL on every
//       launch)
//
// Children: the program runs itself with --child MODE (one JSON line on stdout).
#include <dlpack/dlpack.h>
#include <stdlib.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iostream>
#include <memory>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include "bench_common.hpp"
#include "bench_driver.hpp"
#include "bench_nvrtc.hpp"
#include "codegen/codegen.hpp"
#include "compile/nvrtc.hpp"
#include "driver/driver.hpp"
#include "moejit/moejit.h"
#include "moejit/moejit.hpp"
#include "ops/append_shared_spec.hpp"
#include "ops/moe_reference.hpp"
#include "plan/decode_plan.hpp"
#include "runtime/runtime_impl.hpp"

namespace {

using moejit::bench::fixed;
using moejit::bench::print_table;
using moejit::detail::bf16_bits;

using json = nlohmann::json;
using Clock = std::chrono::steady_clock;

double ms_since(Clock::time_point start) {
  return std::chrono::duration<double, std::milli>(Clock::now() - start).count();
}

struct Stats {
  std::size_t n = 0;
  double median = 0;
  double p10 = 0;
  double p90 = 0;
  double min = 0;
  double mean = 0;
};

Stats summarize(std::vector<double> v) {
  Stats s;
  if (v.empty()) return s;
  std::sort(v.begin(), v.end());
  auto at = [&v](double q) {
    double pos = q * static_cast<double>(v.size() - 1);
    auto lo = static_cast<std::size_t>(std::floor(pos));
    std::size_t hi = std::min(lo + 1, v.size() - 1);
    double frac = pos - static_cast<double>(lo);
    return v[lo] * (1 - frac) + v[hi] * frac;
  };
  s.n = v.size();
  s.median = at(0.5);
  s.p10 = at(0.1);
  s.p90 = at(0.9);
  s.min = v.front();
  double sum = 0;
  for (double x : v) sum += x;
  s.mean = sum / static_cast<double>(v.size());
  return s;
}

json to_json(const Stats& s) {
  return json{{"n", s.n},     {"median", s.median}, {"p10", s.p10},
              {"p90", s.p90}, {"min", s.min},       {"mean", s.mean}};
}

// A private temporary directory, removed at the end.
class TempDir {
 public:
  TempDir() {
    std::string pattern = (std::filesystem::temp_directory_path() / "moejit-bench-XXXXXX").string();
    if (mkdtemp(pattern.data()) == nullptr) throw std::runtime_error("mkdtemp failed");
    path_ = pattern;
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

std::string shell_quote(const std::string& s) {
  std::string out = "'";
  for (char c : s) out += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return out + "'";
}

// The reference shape of the benchmark: qwen2-57b-a14b (K = 8, one sigmoid-gated shared expert).
moejit::ModelShape reference_shape() {
  moejit::ModelShape shape;
  shape.name = "qwen2-57b-a14b";
  shape.num_experts = 64;
  shape.top_k = 8;
  shape.hidden = 3584;
  shape.intermediate = 2560;
  shape.global_experts = 64;
  shape.activation.kind = moejit::ActivationKind::kSwiGLU;
  shape.shared.count = 1;
  shape.shared.intermediate = 20480;
  shape.shared.gate = moejit::SharedGate::kSigmoid;
  shape.shared.logit_dtype = moejit::DType::kBF16;
  shape.shared.scale = 1.f;
  shape.source = "bench_runtime.cpp";
  return shape;
}

// One spec per family the reference shape needs on `arch` (the first of each family).
std::vector<moejit::KernelSpec> family_specs(const moejit::Arch& arch) {
  std::vector<moejit::KernelSpec> out;
  for (const moejit::KernelSpec& spec : moejit::plan_kernels(reference_shape(), arch)) {
    bool seen = false;
    for (const moejit::KernelSpec& s : out) seen = seen || s.family == spec.family;
    if (!seen && moejit::supports(spec).empty()) out.push_back(spec);
  }
  return out;
}

// ---- the device -----------------------------------------------------------------------------

const moejit::detail::DriverApi* g_api = nullptr;

void check(CUresult result, const char* what) {
  if (result != CUDA_SUCCESS) {
    throw std::runtime_error(std::string(what) + " failed: " + moejit::detail::describe(result));
  }
}

// The primary context of device 0 made current, or why there is none.
bool open_gpu(std::string* why, CUcontext* ctx, std::string* name) {
  g_api = moejit::detail::try_driver(why);
  if (g_api == nullptr) return false;
  int count = 0;
  if (g_api->cuDeviceGetCount(&count) != CUDA_SUCCESS || count == 0) {
    *why = "the driver reports no CUDA device";
    return false;
  }
  CUdevice device = 0;
  check(g_api->cuDeviceGet(&device, 0), "cuDeviceGet");
  check(g_api->cuDevicePrimaryCtxRetain(ctx, device), "cuDevicePrimaryCtxRetain");
  check(g_api->cuCtxSetCurrent(*ctx), "cuCtxSetCurrent");
  char text[256] = {};
  check(g_api->cuDeviceGetName(text, sizeof(text), device), "cuDeviceGetName");
  *name = text;
  return true;
}

class DeviceBuffer {
 public:
  explicit DeviceBuffer(std::size_t bytes) : bytes_(std::max<std::size_t>(bytes, 16)) {
    check(g_api->cuMemAlloc(&ptr_, bytes_), "cuMemAlloc");
  }
  ~DeviceBuffer() {
    if (ptr_ != 0) g_api->cuMemFree(ptr_);
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  CUdeviceptr ptr() const { return ptr_; }
  void* data() const { return reinterpret_cast<void*>(ptr_); }
  void upload(const void* host, std::size_t bytes) {
    check(g_api->cuMemcpyHtoD(ptr_, host, bytes), "cuMemcpyHtoD");
  }
  void download(void* host, std::size_t bytes) const {
    check(g_api->cuMemcpyDtoH(host, ptr_, bytes), "cuMemcpyDtoH");
  }

 private:
  CUdeviceptr ptr_ = 0;
  std::size_t bytes_;
};

// A contiguous 2-D DLTensor over `b` on CUDA device 0; `dims` must outlive it.
DLTensor matrix_view(const DeviceBuffer& b, int64_t* dims, DLDataTypeCode code, uint8_t bits) {
  DLTensor x{};
  x.data = b.data();
  x.device = DLDevice{kDLCUDA, 0};
  x.ndim = 2;
  x.dtype = DLDataType{static_cast<uint8_t>(code), bits, 1};
  x.shape = dims;
  return x;
}

// The tensors of one append_shared call with T tokens, K = 8, S = 1, int32 ids, bf16 logits.
struct AppendSharedProblem {
  static constexpr int kTopK = 8;
  static constexpr int kShared = 1;
  static constexpr int kWidth = kTopK + kShared;
  static constexpr int64_t kSharedBase = 64;
  static constexpr float kScale = 0.5f;

  explicit AppendSharedProblem(int tokens)
      : t(tokens),
        ids(sizeof(int32_t) * static_cast<std::size_t>(t) * kTopK),
        weights(sizeof(float) * static_cast<std::size_t>(t) * kTopK),
        logits(sizeof(uint16_t) * static_cast<std::size_t>(t) * kShared),
        out_ids(sizeof(int32_t) * static_cast<std::size_t>(t) * kWidth),
        out_weights(sizeof(float) * static_cast<std::size_t>(t) * kWidth),
        shape_k{t, kTopK},
        shape_s{t, kShared},
        shape_out{t, kWidth} {
    std::mt19937 rng(1234u + static_cast<unsigned>(t));
    std::uniform_int_distribution<int32_t> id_dist(0, 63);
    std::uniform_real_distribution<float> w_dist(0.f, 1.f);
    std::uniform_real_distribution<float> l_dist(-6.f, 6.f);
    std::vector<int32_t> h_ids(static_cast<std::size_t>(t) * kTopK);
    std::vector<float> h_w(h_ids.size());
    std::vector<uint16_t> h_l(static_cast<std::size_t>(t) * kShared);
    for (auto& x : h_ids) x = id_dist(rng);
    for (auto& x : h_w) x = w_dist(rng);
    for (auto& x : h_l) x = bf16_bits(l_dist(rng));
    ids.upload(h_ids.data(), h_ids.size() * sizeof(int32_t));
    weights.upload(h_w.data(), h_w.size() * sizeof(float));
    logits.upload(h_l.data(), h_l.size() * sizeof(uint16_t));
    t_ids = matrix_view(ids, shape_k.data(), kDLInt, 32);
    t_weights = matrix_view(weights, shape_k.data(), kDLFloat, 32);
    t_logits = matrix_view(logits, shape_s.data(), kDLBfloat, 16);
    t_out_ids = matrix_view(out_ids, shape_out.data(), kDLInt, 32);
    t_out_weights = matrix_view(out_weights, shape_out.data(), kDLFloat, 32);
    args.topk_ids = &t_ids;
    args.topk_weights = &t_weights;
    args.shared_logits = &t_logits;
    args.out_ids = &t_out_ids;
    args.out_weights = &t_out_weights;
    args.shared_base = kSharedBase;
    args.scale = kScale;
    args.gate = moejit::SharedGate::kSigmoid;
  }

  // Bytes the op must move: inputs read once, outputs written once.
  double bytes_moved() const {
    double tt = t;
    return tt * kTopK * (4 + 4) + tt * kShared * 2 + tt * kWidth * (4 + 4);
  }

  int t;
  DeviceBuffer ids, weights, logits, out_ids, out_weights;
  std::array<int64_t, 2> shape_k, shape_s, shape_out;
  DLTensor t_ids{}, t_weights{}, t_logits{}, t_out_ids{}, t_out_weights{};
  moejit::AppendSharedArgs args;
};

// ---- children -------------------------------------------------------------------------------

struct ChildOptions {
  std::string mode;  // "build", "load" or "nvrtc"
  int spec_index = 0;
  std::string arch;
};

// NVRTC alone on the spec's rendered source (no key, no cache), in ms; with the library's own
// options (MOEJIT_LINEINFO included), so it compiles as a request does.
double nvrtc_alone_ms(const moejit::KernelSpec& spec, const moejit::detail::GeneratedSource& src) {
  auto start = Clock::now();
  moejit::detail::CompiledKernel k =
      moejit::detail::compile(src, spec.arch, "", moejit::config().line_info);
  const double ms = ms_since(start);
  if (k.cubin.empty()) throw std::runtime_error("NVRTC returned an empty cubin");
  return ms;
}

// One request in a fresh process; prints {"outcome", "library_ms", "request_ms"}. "nvrtc" compiles
// the spec's rendered source with NVRTC alone (no key, no cache), the process's first compile.
int run_child(const ChildOptions& options) {
  json out;
  try {
    moejit::configure(moejit::RuntimeConfig::from_environment());
    moejit::detail::Runtime& runtime = moejit::detail::Runtime::instance();
    if (options.mode == "load") {
      std::string why;
      CUcontext ctx = nullptr;
      std::string name;
      if (!open_gpu(&why, &ctx, &name)) throw std::runtime_error("no GPU: " + why);
      CUstream stream = nullptr;
      check(g_api->cuStreamCreate(&stream, CU_STREAM_NON_BLOCKING), "cuStreamCreate");
      moejit::KernelSpec spec =
          family_specs(runtime.current_arch()).at(static_cast<std::size_t>(options.spec_index));
      auto start = Clock::now();
      CUkernel kernel = runtime.kernel(spec, stream);
      out["request_ms"] = ms_since(start);
      out["outcome"] = kernel != nullptr ? "loaded" : "null kernel";
      g_api->cuStreamDestroy(stream);
    } else if (options.mode == "nvrtc") {
      moejit::KernelSpec spec = family_specs(moejit::Arch::parse(options.arch))
                                    .at(static_cast<std::size_t>(options.spec_index));
      out["request_ms"] = nvrtc_alone_ms(spec, moejit::detail::render(spec));
      out["outcome"] = "compiled";
    } else {
      moejit::KernelSpec spec = family_specs(moejit::Arch::parse(options.arch))
                                    .at(static_cast<std::size_t>(options.spec_index));
      auto start = Clock::now();
      moejit::BuildResult result = moejit::build_kernel(spec);
      out["request_ms"] = ms_since(start);
      out["library_ms"] = result.milliseconds;
      static const char* const kOutcome[] = {"memory hit", "disk hit", "compiled",
                                             "compiled, not stored"};
      out["outcome"] = kOutcome[static_cast<int>(result.outcome)];
    }
  } catch (const std::exception& e) {
    out["error"] = e.what();
  }
  std::cout << out.dump() << std::endl;
  return out.contains("error") ? 1 : 0;
}

json spawn_child(const std::string& cache_dir, const ChildOptions& options) {
  std::string exe = std::filesystem::read_symlink("/proc/self/exe").string();
  std::string command = "MOEJIT_CACHE_MODE=rw MOEJIT_CACHE_DIR=" + shell_quote(cache_dir) + " " +
                        shell_quote(exe) + " --child " + options.mode + " --child-spec " +
                        std::to_string(options.spec_index) + " --arch " + options.arch;
  FILE* pipe = popen(command.c_str(), "r");
  if (pipe == nullptr) throw std::runtime_error("popen failed: " + command);
  std::string output;
  std::array<char, 4096> buffer{};
  std::size_t n = 0;
  while ((n = std::fread(buffer.data(), 1, buffer.size(), pipe)) > 0)
    output.append(buffer.data(), n);
  int status = pclose(pipe);
  std::size_t brace = output.rfind("\n{");
  std::string last = brace == std::string::npos ? output : output.substr(brace + 1);
  json result = json::parse(last, nullptr, false);
  if (result.is_discarded()) {
    throw std::runtime_error("child (" + command + ") exited " + std::to_string(status) +
                             " without a result: " + output);
  }
  if (result.contains("error")) {
    throw std::runtime_error("child failed: " + result["error"].get<std::string>());
  }
  return result;
}

// ---- the unfused sequence -------------------------------------------------------------------

// Three kernels as an engine without the fused op would run them (e.g. torch.sigmoid on bf16
// logits, .float() * scale, torch.cat of ids and weights), K and S as run-time values. bf16 as
// its bits, converted as cuda_bf16.h does on sm_90 (the compile has no toolkit include path).
const char* kUnfusedSource = R"(
__device__ float bf16_to_float(unsigned short x) { return __uint_as_float((unsigned)x << 16); }
__device__ unsigned short float_to_bf16(float v) {
  unsigned short out;
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(out) : "f"(v));
  return out;
}

extern "C" __global__ void unfused_sigmoid_bf16(const unsigned short* x, unsigned short* y, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) {
    float v = bf16_to_float(x[i]);
    y[i] = float_to_bf16(1.f / (1.f + expf(-v)));
  }
}

extern "C" __global__ void unfused_cast_scale(const unsigned short* x, float* y, float scale,
                                              int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) y[i] = bf16_to_float(x[i]) * scale;
}

extern "C" __global__ void unfused_append(const int* topk_ids, const float* topk_weights,
                                          const float* shared_weights, int* out_ids,
                                          float* out_weights, long long shared_base, int tokens,
                                          int k, int s) {
  long long i = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
  long long width = k + s;
  if (i >= tokens * width) return;
  long long t = i / width;
  long long j = i - t * width;
  if (j < k) {
    out_ids[i] = topk_ids[t * k + j];
    out_weights[i] = topk_weights[t * k + j];
  } else {
    out_ids[i] = static_cast<int>(shared_base + (j - k));
    out_weights[i] = shared_weights[t * s + (j - k)];
  }
}
)";

struct UnfusedKernels {
  CUlibrary library = nullptr;
  CUkernel sigmoid = nullptr;
  CUkernel cast = nullptr;
  CUkernel append = nullptr;
  ~UnfusedKernels() {
    if (library != nullptr) g_api->cuLibraryUnload(library);
  }
};

void load_unfused(const moejit::Arch& arch, UnfusedKernels* k) {
  const std::vector<std::string> options = {arch.nvrtc_option(), "--std=c++17", "-default-device"};
  const std::string cubin =
      moejit::bench::compile_cubin(kUnfusedSource, "unfused.cu", options, "unfused kernels");
  check(
      g_api->cuLibraryLoadData(&k->library, cubin.data(), nullptr, nullptr, 0, nullptr, nullptr, 0),
      "cuLibraryLoadData (unfused)");
  check(g_api->cuLibraryGetKernel(&k->sigmoid, k->library, "unfused_sigmoid_bf16"),
        "cuLibraryGetKernel(sigmoid)");
  check(g_api->cuLibraryGetKernel(&k->cast, k->library, "unfused_cast_scale"),
        "cuLibraryGetKernel(cast)");
  check(g_api->cuLibraryGetKernel(&k->append, k->library, "unfused_append"),
        "cuLibraryGetKernel(append)");
}

// `kernel`'s function in the current context, the handle the library launches through
// (moe_launch.hpp's launch_function); through the CUkernel the driver would find it every launch.
CUfunction function_of(CUkernel kernel) {
  CUfunction function = nullptr;
  check(g_api->cuKernelGetFunction(&function, kernel), "cuKernelGetFunction");
  return function;
}

// One cuLaunchKernelEx. `pdl`: allow programmatic dependent launch, as the op does on sm_90+
// (only for kernels that wait on griddepcontrol before reading, like append_shared_kernel).
void launch(CUfunction function, unsigned grid, unsigned block, CUstream stream, void** params,
            bool pdl = false) {
  CUlaunchAttribute attribute;
  const CUlaunchConfig config =
      moejit::bench::launch_config(std::max(grid, 1u), block, 0, stream, pdl, attribute);
  check(g_api->cuLaunchKernelEx(&config, function, params, nullptr), "cuLaunchKernelEx");
}

unsigned blocks_for(long long elements, unsigned block) {
  return static_cast<unsigned>((elements + block - 1) / block);
}

// Device time per repetition of `body` (microseconds): `body` captured `per_graph` times into a
// CUDA graph, the graph replayed `replays` times between two events; median of `trials`.
double graph_time_us(CUstream stream, const std::function<void()>& body, int per_graph, int replays,
                     int trials) {
  CUgraph graph = nullptr;
  CUgraphExec exec = nullptr;
  check(g_api->cuStreamBeginCapture(stream, CU_STREAM_CAPTURE_MODE_RELAXED),
        "cuStreamBeginCapture");
  try {
    for (int i = 0; i < per_graph; ++i) body();
  } catch (...) {
    g_api->cuStreamEndCapture(stream, &graph);
    if (graph != nullptr) g_api->cuGraphDestroy(graph);
    throw;
  }
  check(g_api->cuStreamEndCapture(stream, &graph), "cuStreamEndCapture");
  check(g_api->cuGraphInstantiateWithFlags(&exec, graph, 0), "cuGraphInstantiate");
  CUevent start = nullptr;
  CUevent stop = nullptr;
  check(g_api->cuEventCreate(&start, CU_EVENT_DEFAULT), "cuEventCreate");
  check(g_api->cuEventCreate(&stop, CU_EVENT_DEFAULT), "cuEventCreate");
  std::vector<double> per_rep;
  for (int w = 0; w < 3; ++w) check(g_api->cuGraphLaunch(exec, stream), "cuGraphLaunch");
  for (int trial = 0; trial < trials; ++trial) {
    check(g_api->cuEventRecord(start, stream), "cuEventRecord");
    for (int r = 0; r < replays; ++r) check(g_api->cuGraphLaunch(exec, stream), "cuGraphLaunch");
    check(g_api->cuEventRecord(stop, stream), "cuEventRecord");
    check(g_api->cuEventSynchronize(stop), "cuEventSynchronize");
    float ms = 0;
    check(g_api->cuEventElapsedTime(&ms, start, stop), "cuEventElapsedTime");
    per_rep.push_back(static_cast<double>(ms) * 1000.0 /
                      (static_cast<double>(per_graph) * replays));
  }
  g_api->cuEventDestroy(start);
  g_api->cuEventDestroy(stop);
  g_api->cuGraphExecDestroy(exec);
  g_api->cuGraphDestroy(graph);
  return summarize(per_rep).median;
}

// ---- the parts ------------------------------------------------------------------------------

struct Options {
  std::string json_path;
  std::string arch;  // "" = the GPU's arch, else sm_90a
  int compile_reps = 5;
  int children = 30;
  int memory_hits = 20000;
  int launches = 10000;
  int launch_tokens = 1;
  int graph_launches = 100;
  int graph_replays = 20;
  int trials = 5;
  std::string shapes_file;  // (f): "" = tools/shapes/reference.json
  std::string moe_shape = "qwen3-30b-a3b";
  std::vector<int> moe_tokens = {1, 6, 256};
  int moe_calls = 2000;
  bool moe_only = false;  // (f) alone
};

json part_cold_compile(const Options& o, const std::vector<moejit::KernelSpec>& specs) {
  json out = json::array();
  std::vector<std::vector<std::string>> rows;
  for (std::size_t i = 0; i < specs.size(); ++i) {
    const moejit::KernelSpec& spec = specs[i];
    std::vector<double> fresh;
    std::vector<double> library;
    std::vector<double> nvrtc_fresh;
    for (int rep = 0; rep < o.compile_reps; ++rep) {
      TempDir cache;
      json r = spawn_child(cache.path(), {"build", static_cast<int>(i), spec.arch.name()});
      if (r["outcome"] != "compiled") {
        throw std::runtime_error("cold compile child reported " + r["outcome"].dump() +
                                 " in a fresh cache");
      }
      fresh.push_back(r["request_ms"].get<double>());
      library.push_back(r["library_ms"].get<double>());
      json n = spawn_child(cache.path(), {"nvrtc", static_cast<int>(i), spec.arch.name()});
      if (n["outcome"] != "compiled") {
        throw std::runtime_error("NVRTC child reported " + n["outcome"].dump());
      }
      nvrtc_fresh.push_back(n["request_ms"].get<double>());
    }
    std::vector<double> nvrtc;
    moejit::detail::GeneratedSource src = moejit::detail::render(spec);
    for (int rep = 0; rep < o.compile_reps; ++rep) nvrtc.push_back(nvrtc_alone_ms(spec, src));
    Stats f = summarize(fresh);
    Stats l = summarize(library);
    Stats n = summarize(nvrtc);
    Stats nf = summarize(nvrtc_fresh);
    rows.push_back({moejit::family_name(spec.family), spec.display_name(), fixed(f.median, 1),
                    fixed(l.median, 1), fixed(nf.median, 1), fixed(n.median, 1), fixed(n.min, 1),
                    std::to_string(o.compile_reps)});
    out.push_back({{"family", moejit::family_name(spec.family)},
                   {"kernel", spec.display_name()},
                   {"fresh_process_request_ms", to_json(f)},
                   {"library_reported_ms", to_json(l)},
                   {"nvrtc_fresh_process_ms", to_json(nf)},
                   {"nvrtc_compile_ms", to_json(n)}});
  }
  print_table(
      "(a) cold compile per family (ms; fresh process + fresh cache; NVRTC alone as a fresh "
      "process's first compile, and warm in this process)",
      {"family", "kernel", "request", "library", "nvrtc fresh", "nvrtc warm", "warm min", "reps"},
      rows);
  return out;
}

json part_disk_hit(const Options& o, const std::vector<moejit::KernelSpec>& specs, bool gpu) {
  json out = json::array();
  std::vector<std::vector<std::string>> rows;
  for (std::size_t i = 0; i < specs.size(); ++i) {
    const moejit::KernelSpec& spec = specs[i];
    TempDir cache;
    json first = spawn_child(cache.path(), {"build", static_cast<int>(i), spec.arch.name()});
    if (first["outcome"] != "compiled") throw std::runtime_error("warm-up child did not compile");
    std::vector<double> request;
    std::vector<double> library;
    for (int c = 0; c < o.children; ++c) {
      json r = spawn_child(cache.path(),
                           {gpu ? "load" : "build", static_cast<int>(i), spec.arch.name()});
      if (!gpu && r["outcome"] != "disk hit") {
        throw std::runtime_error("a fresh process reported " + r["outcome"].dump() +
                                 " for a cached kernel (expected a disk hit)");
      }
      request.push_back(r["request_ms"].get<double>());
      if (r.contains("library_ms")) library.push_back(r["library_ms"].get<double>());
    }
    Stats q = summarize(request);
    Stats lib = summarize(library);
    rows.push_back(
        {spec.display_name(),
         gpu ? "disk hit + verify + cuLibraryLoadData" : "disk hit + verify (no GPU: no load)",
         fixed(q.median, 3), fixed(q.p10, 3), fixed(q.p90, 3),
         library.empty() ? "-" : fixed(lib.median, 3), std::to_string(o.children)});
    json entry = {
        {"kernel", spec.display_name()},
        {"measures", gpu ? "request to launchable CUkernel" : "request to verified cubin"},
        {"request_ms", to_json(q)}};
    if (!library.empty()) entry["library_reported_ms"] = to_json(lib);
    out.push_back(entry);
  }
  print_table(
      "(b) first request for a cached kernel in a fresh process (ms; 'library' = the "
      "load time BuildResult reports, key computation excluded)",
      {"kernel", "what", "median", "p10", "p90", "library", "children"}, rows);
  return out;
}

json part_memory_hit(const Options& o, const std::vector<moejit::KernelSpec>& specs,
                     CUstream stream) {
  json out = json::array();
  std::vector<std::vector<std::string>> rows;
  moejit::detail::Runtime& runtime = moejit::detail::Runtime::instance();
  for (const moejit::KernelSpec& spec : specs) {
    moejit::build_kernel(spec);
    std::vector<double> build_us;
    build_us.reserve(static_cast<std::size_t>(o.memory_hits));
    for (int i = 0; i < o.memory_hits; ++i) {
      auto start = Clock::now();
      moejit::BuildResult r = moejit::build_kernel(spec);
      build_us.push_back(ms_since(start) * 1000);
      if (r.outcome != moejit::CacheOutcome::kMemoryHit) {
        throw std::runtime_error("build_kernel of a built spec was not a memory hit");
      }
    }
    Stats b = summarize(build_us);
    rows.push_back({spec.display_name(), "build_kernel()", fixed(b.median, 3), fixed(b.p90, 3)});
    json entry = {{"kernel", spec.display_name()}, {"build_kernel_us", to_json(b)}};
    if (stream != nullptr && spec.arch == runtime.current_arch()) {
      runtime.kernel(spec, stream);
      std::vector<double> lookup_us;
      for (int i = 0; i < o.memory_hits; ++i) {
        auto start = Clock::now();
        CUkernel k = runtime.kernel(spec, stream);
        lookup_us.push_back(ms_since(start) * 1000);
        if (k == nullptr) throw std::runtime_error("null kernel from the runtime");
      }
      Stats l = summarize(lookup_us);
      rows.push_back({spec.display_name(), "Runtime::kernel() (hot path)", fixed(l.median, 3),
                      fixed(l.p90, 3)});
      entry["hot_path_lookup_us"] = to_json(l);
    }
    out.push_back(entry);
  }
  print_table("(c) in-memory hit (us)", {"kernel", "call", "median", "p90"}, rows);
  return out;
}

json part_launch_overhead(const Options& o, CUstream stream) {
  moejit::detail::Runtime& runtime = moejit::detail::Runtime::instance();
  AppendSharedProblem p(o.launch_tokens);
  moejit::append_shared(p.args, stream);
  check(g_api->cuStreamSynchronize(stream), "cuStreamSynchronize");

  // The same kernel the op launches (the spec the op derives from these tensors), with the same
  // arguments and launch attributes, launched bare.
  moejit::KernelSpec spec;
  spec.family = moejit::Family::kAppendShared;
  spec.arch = runtime.current_arch();
  const moejit::AppendSharedParams params = moejit::detail::append_shared_params(
      AppendSharedProblem::kTopK, AppendSharedProblem::kShared, moejit::DType::kI32,
      moejit::SharedGate::kSigmoid, moejit::DType::kBF16);
  spec.params = params;
  const CUfunction function = function_of(runtime.kernel(spec, stream));
  const bool pdl = spec.arch.sm >= 90;
  void* ids = p.ids.data();
  void* weights = p.weights.data();
  void* logits = p.logits.data();
  void* out_ids = p.out_ids.data();
  void* out_weights = p.out_weights.data();
  long long base = AppendSharedProblem::kSharedBase;
  float scale = AppendSharedProblem::kScale;
  int tokens = p.t;
  void* kernel_params[] = {&ids, &weights, &logits, &out_ids, &out_weights, &base, &scale, &tokens};
  auto block = static_cast<unsigned>(params.block_threads);
  unsigned grid = blocks_for(static_cast<long long>(tokens) * AppendSharedProblem::kWidth, block);

  std::vector<double> op_us;
  std::vector<double> bare_us;
  op_us.reserve(static_cast<std::size_t>(o.launches));
  bare_us.reserve(static_cast<std::size_t>(o.launches));
  // Why interleaved rounds: clock drift, frequency changes and queue state hit both alike.
  const int rounds = 10;
  const int per_round = std::max(1, o.launches / rounds);
  for (int round = 0; round < rounds; ++round) {
    for (int i = 0; i < per_round; ++i) {
      auto start = Clock::now();
      moejit::append_shared(p.args, stream);
      op_us.push_back(ms_since(start) * 1000);
    }
    check(g_api->cuStreamSynchronize(stream), "cuStreamSynchronize");
    for (int i = 0; i < per_round; ++i) {
      auto start = Clock::now();
      launch(function, grid, block, stream, kernel_params, pdl);
      bare_us.push_back(ms_since(start) * 1000);
    }
    check(g_api->cuStreamSynchronize(stream), "cuStreamSynchronize");
  }
  Stats op = summarize(op_us);
  Stats bare = summarize(bare_us);
  double diff = op.median - bare.median;
  print_table(
      "(d) host time per launch, T = " + std::to_string(tokens) + ", " + std::to_string(op.n) +
          " calls each (us)",
      {"call", "median", "p10", "p90", "mean"},
      {{"moejit::append_shared", fixed(op.median, 3), fixed(op.p10, 3), fixed(op.p90, 3),
        fixed(op.mean, 3)},
       {"bare cuLaunchKernelEx", fixed(bare.median, 3), fixed(bare.p10, 3), fixed(bare.p90, 3),
        fixed(bare.mean, 3)},
       {"difference (target <= 0.5)", fixed(diff, 3), "", "", fixed(op.mean - bare.mean, 3)}});
  return {{"tokens", tokens},
          {"op_us", to_json(op)},
          {"bare_launch_us", to_json(bare)},
          {"difference_median_us", diff},
          {"target_us", 0.5}};
}

json part_device_time(const Options& o, CUstream stream) {
  moejit::detail::Runtime& runtime = moejit::detail::Runtime::instance();
  UnfusedKernels unfused;
  load_unfused(runtime.current_arch(), &unfused);
  json out = json::array();
  std::vector<std::vector<std::string>> rows;
  const unsigned block = 256;
  for (int tokens : {1, 128, 4096}) {
    AppendSharedProblem p(tokens);
    DeviceBuffer sig(sizeof(uint16_t) * static_cast<std::size_t>(tokens) *
                     AppendSharedProblem::kShared);
    DeviceBuffer shared_w(sizeof(float) * static_cast<std::size_t>(tokens) *
                          AppendSharedProblem::kShared);
    DeviceBuffer ref_ids(sizeof(int32_t) * static_cast<std::size_t>(tokens) *
                         AppendSharedProblem::kWidth);
    DeviceBuffer ref_w(sizeof(float) * static_cast<std::size_t>(tokens) *
                       AppendSharedProblem::kWidth);
    void* logits = p.logits.data();
    void* sig_p = sig.data();
    void* shared_p = shared_w.data();
    void* ids = p.ids.data();
    void* weights = p.weights.data();
    void* ref_ids_p = ref_ids.data();
    void* ref_w_p = ref_w.data();
    int n_shared = tokens * AppendSharedProblem::kShared;
    float scale = AppendSharedProblem::kScale;
    long long base = AppendSharedProblem::kSharedBase;
    int k = AppendSharedProblem::kTopK;
    int s = AppendSharedProblem::kShared;
    void* sigmoid_params[] = {&logits, &sig_p, &n_shared};
    void* cast_params[] = {&sig_p, &shared_p, &scale, &n_shared};
    void* append_params[] = {&ids,  &weights, &shared_p, &ref_ids_p, &ref_w_p,
                             &base, &tokens,  &k,        &s};
    unsigned grid_shared = blocks_for(n_shared, block);
    unsigned grid_append =
        blocks_for(static_cast<long long>(tokens) * AppendSharedProblem::kWidth, block);
    const CUfunction sigmoid = function_of(unfused.sigmoid);
    const CUfunction cast = function_of(unfused.cast);
    const CUfunction append = function_of(unfused.append);
    auto run_sigmoid = [&] { launch(sigmoid, grid_shared, block, stream, sigmoid_params); };
    auto run_cast = [&] { launch(cast, grid_shared, block, stream, cast_params); };
    auto run_append = [&] { launch(append, grid_append, block, stream, append_params); };
    auto run_unfused = [&] {
      run_sigmoid();
      run_cast();
      run_append();
    };
    auto run_fused = [&] { moejit::append_shared(p.args, stream); };

    // Both once, then compare: the fused op against the unfused sequence (whose sigmoid is
    // rounded to bf16, hence the tolerance of a bf16 ulp at 1 times the scale).
    run_fused();
    run_unfused();
    check(g_api->cuStreamSynchronize(stream), "cuStreamSynchronize");
    std::size_t n_out = static_cast<std::size_t>(tokens) * AppendSharedProblem::kWidth;
    std::vector<int32_t> a_ids(n_out), b_ids(n_out);
    std::vector<float> a_w(n_out), b_w(n_out);
    p.out_ids.download(a_ids.data(), n_out * sizeof(int32_t));
    p.out_weights.download(a_w.data(), n_out * sizeof(float));
    ref_ids.download(b_ids.data(), n_out * sizeof(int32_t));
    ref_w.download(b_w.data(), n_out * sizeof(float));
    std::size_t mismatches = 0;
    for (std::size_t i = 0; i < n_out; ++i) {
      if (a_ids[i] != b_ids[i] || std::fabs(a_w[i] - b_w[i]) > 4e-3f * AppendSharedProblem::kScale)
        ++mismatches;
    }

    double fused = graph_time_us(stream, run_fused, o.graph_launches, o.graph_replays, o.trials);
    double seq = graph_time_us(stream, run_unfused, o.graph_launches, o.graph_replays, o.trials);
    double t_sig = graph_time_us(stream, run_sigmoid, o.graph_launches, o.graph_replays, o.trials);
    double t_cast = graph_time_us(stream, run_cast, o.graph_launches, o.graph_replays, o.trials);
    double t_app = graph_time_us(stream, run_append, o.graph_launches, o.graph_replays, o.trials);
    const char* slowest_name = "append";
    double slowest = t_app;
    if (t_sig > slowest) {
      slowest = t_sig;
      slowest_name = "sigmoid";
    }
    if (t_cast > slowest) {
      slowest = t_cast;
      slowest_name = "cast";
    }
    double gbps = p.bytes_moved() / (fused * 1e-6) / 1e9;
    rows.push_back({std::to_string(tokens), fixed(fused, 3), fixed(seq, 3),
                    std::string(slowest_name) + " " + fixed(slowest, 3), fixed(seq / fused, 2),
                    fixed(gbps, 1),
                    mismatches == 0 ? "yes" : std::to_string(mismatches) + " differ"});
    out.push_back({{"tokens", tokens},
                   {"top_k", AppendSharedProblem::kTopK},
                   {"num_shared", AppendSharedProblem::kShared},
                   {"fused_us", fused},
                   {"unfused_total_us", seq},
                   {"unfused_sigmoid_us", t_sig},
                   {"unfused_cast_us", t_cast},
                   {"unfused_append_us", t_app},
                   {"unfused_slowest", slowest_name},
                   {"fused_effective_GBps", gbps},
                   {"outputs_agree", mismatches == 0}});
  }
  print_table(
      "(e) device time per op, CUDA graph replay of " + std::to_string(o.graph_launches) +
          " launches x " + std::to_string(o.graph_replays) + " replays, median of " +
          std::to_string(o.trials) + " (us; K = 8, S = 1, bf16 sigmoid gate; inputs L2-resident)",
      {"T", "append_shared", "unfused total", "unfused slowest", "speedup", "GB/s", "agree"}, rows);
  return out;
}

}  // namespace

// ---- (f) moe_forward: host time against bare launches of its kernels ------------------------

// One moe_forward call's device buffers for `shape` at `tokens`, in the C++ and the C ABI's
// argument forms. Weight bytes 0x22 and scale bytes 127 (every nibble a finite E2M1 value, every
// scale 2^0) and zero hidden states: the host time does not depend on the values, and the kernels
// run on finite numbers.
class MoeProblem {
 public:
  MoeProblem(const moejit::ModelShape& shape, int tokens)
      : layout_(moejit::moe_weight_layout(shape)),
        w13_(layout_.w13_bytes),
        w13_scales_(layout_.w13_scale_bytes),
        w2_(layout_.w2_bytes),
        w2_scales_(layout_.w2_scale_bytes),
        b13_(layout_.b13_bytes),
        b2_(layout_.b2_bytes),
        id_bytes_(shape.id_dtype == moejit::DType::kI64 ? 8 : 4),
        hidden_(elements(tokens, shape.hidden) * 2),
        ids_(elements(tokens, shape.top_k) * id_bytes_),
        topk_(elements(tokens, shape.top_k) * 4),
        out_(elements(tokens, shape.hidden) * 2),
        workspace_bytes_(moejit::moe_workspace_bytes(shape, tokens)),
        workspace_(workspace_bytes_),
        rows_{tokens, shape.hidden},
        slots_{tokens, shape.top_k} {
    fill(w13_, layout_.w13_bytes, 0x22);
    fill(w2_, layout_.w2_bytes, 0x22);
    fill(w13_scales_, layout_.w13_scale_bytes, 127);
    fill(w2_scales_, layout_.w2_scale_bytes, 127);
    fill(b13_, layout_.b13_bytes, 0);
    fill(b2_, layout_.b2_bytes, 0);
    fill(hidden_, elements(tokens, shape.hidden) * 2, 0);
    // Distinct experts per token, uniform over the rank's; weights 1 / K.
    std::mt19937 rng(20261205u + static_cast<unsigned>(tokens));
    std::vector<int64_t> experts(static_cast<std::size_t>(shape.num_experts));
    std::vector<int64_t> ids64;
    for (int t = 0; t < tokens; ++t) {
      for (std::size_t e = 0; e < experts.size(); ++e) {
        experts[e] = shape.expert_offset + static_cast<int64_t>(e);
      }
      std::shuffle(experts.begin(), experts.end(), rng);
      ids64.insert(ids64.end(), experts.begin(), experts.begin() + shape.top_k);
    }
    if (id_bytes_ == 8) {
      ids_.upload(ids64.data(), ids64.size() * 8);
    } else {
      std::vector<int32_t> ids32(ids64.begin(), ids64.end());
      ids_.upload(ids32.data(), ids32.size() * 4);
    }
    std::vector<float> topk(ids64.size(), 1.f / static_cast<float>(shape.top_k));
    topk_.upload(topk.data(), topk.size() * 4);
    check(g_api->cuCtxSynchronize(), "cuCtxSynchronize");

    hidden_t_ = matrix_view(hidden_, rows_.data(), kDLBfloat, 16);
    ids_t_ = matrix_view(ids_, slots_.data(), kDLInt, static_cast<uint8_t>(id_bytes_ * 8));
    topk_t_ = matrix_view(topk_, slots_.data(), kDLFloat, 32);
    out_t_ = matrix_view(out_, rows_.data(), kDLBfloat, 16);
    const bool bias = shape.has_bias;
    args.hidden = &hidden_t_;
    args.topk_ids = &ids_t_;
    args.topk_weights = &topk_t_;
    args.weights = {w13_.data(),       w13_scales_.data(),           w2_.data(),
                    w2_scales_.data(), bias ? b13_.data() : nullptr, bias ? b2_.data() : nullptr};
    args.workspace = workspace_.data();
    args.workspace_bytes = workspace_bytes_;
    args.out = &out_t_;
    c_weights = {sizeof(moejit_moe_weights), w13_.data(),
                 w13_scales_.data(),         w2_.data(),
                 w2_scales_.data(),          bias ? b13_.data() : nullptr,
                 bias ? b2_.data() : nullptr};
  }
  MoeProblem(const MoeProblem&) = delete;
  MoeProblem& operator=(const MoeProblem&) = delete;

  moejit::MoeForwardArgs args;
  moejit_moe_weights c_weights{};

 private:
  static std::size_t elements(int64_t rows, int64_t cols) {
    return static_cast<std::size_t>(rows * cols);
  }
  static void fill(const DeviceBuffer& b, std::size_t bytes, unsigned char value) {
    if (bytes > 0) check(g_api->cuMemsetD8Async(b.ptr(), value, bytes, nullptr), "cuMemsetD8Async");
  }

  moejit::MoeWeightLayout layout_;
  DeviceBuffer w13_, w13_scales_, w2_, w2_scales_, b13_, b2_;
  std::size_t id_bytes_;
  DeviceBuffer hidden_, ids_, topk_, out_;
  std::size_t workspace_bytes_;
  DeviceBuffer workspace_;
  std::array<int64_t, 2> rows_, slots_;
  DLTensor hidden_t_{}, ids_t_{}, topk_t_{}, out_t_{};
};

// The kernel launches of one captured call, in launch order, each as the graph holds it (function,
// geometry, a copy of its arguments) with whether it followed its predecessor programmatically
// (the programmatic dependent launch attribute). Valid while `graph` lives.
struct CapturedLaunch {
  CUDA_KERNEL_NODE_PARAMS params{};
  bool pdl = false;
};

std::vector<CapturedLaunch> captured_launches(CUgraph graph) {
  static const PFN_cuGraphGetEdges_v12030 get_edges = [] {
    PFN_cuGraphGetEdges_v12030 fn = nullptr;
    moejit::bench::load_entry(moejit::bench::driver_proc_address(), "cuGraphGetEdges", 12030, &fn);
    return fn;
  }();
  std::size_t count = 0;
  check(g_api->cuGraphGetNodes(graph, nullptr, &count), "cuGraphGetNodes");
  std::vector<CUgraphNode> nodes(count);
  if (count > 0) check(g_api->cuGraphGetNodes(graph, nodes.data(), &count), "cuGraphGetNodes");
  std::size_t edges = 0;
  check(get_edges(graph, nullptr, nullptr, nullptr, &edges), "cuGraphGetEdges");
  std::vector<CUgraphNode> from(edges), to(edges);
  std::vector<CUgraphEdgeData> data(edges);
  if (edges > 0)
    check(get_edges(graph, from.data(), to.data(), data.data(), &edges), "cuGraphGetEdges");
  // A call captured on one stream is a chain: start at the node nothing leads to, follow edges.
  std::vector<CapturedLaunch> out;
  CUgraphNode node = nullptr;
  for (CUgraphNode n : nodes) {
    if (std::find(to.begin(), to.end(), n) == to.end()) node = n;
  }
  bool pdl = false;
  while (node != nullptr) {
    CUgraphNodeType type;
    check(g_api->cuGraphNodeGetType(node, &type), "cuGraphNodeGetType");
    if (type != CU_GRAPH_NODE_TYPE_KERNEL) {
      throw std::runtime_error("moe_forward captured a node that is not a kernel (type " +
                               std::to_string(static_cast<int>(type)) + ")");
    }
    CapturedLaunch launch;
    check(g_api->cuGraphKernelNodeGetParams(node, &launch.params), "cuGraphKernelNodeGetParams");
    launch.pdl = pdl;
    out.push_back(launch);
    CUgraphNode next = nullptr;
    for (std::size_t e = 0; e < edges; ++e) {
      if (from[e] != node) continue;
      if (next != nullptr) throw std::runtime_error("moe_forward's captured graph is not a chain");
      next = to[e];
      pdl = data[e].type == CU_GRAPH_DEPENDENCY_TYPE_PROGRAMMATIC;
    }
    node = next;
  }
  if (out.size() != count) throw std::runtime_error("moe_forward's captured graph is not a chain");
  return out;
}

// `all_pdl`: every launch with the PDL attribute, as launch_moe_kernel issues them (else the
// node's own). Through the node's function, as the library launches (its function in the context).
void launch_bare(const CapturedLaunch& l, CUstream stream, bool all_pdl) {
  CUlaunchAttribute attribute{};
  attribute.id = CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
  attribute.value.programmaticStreamSerializationAllowed = 1;
  CUlaunchConfig config{};
  config.gridDimX = l.params.gridDimX;
  config.gridDimY = l.params.gridDimY;
  config.gridDimZ = l.params.gridDimZ;
  config.blockDimX = l.params.blockDimX;
  config.blockDimY = l.params.blockDimY;
  config.blockDimZ = l.params.blockDimZ;
  config.sharedMemBytes = l.params.sharedMemBytes;
  config.hStream = stream;
  const bool pdl = l.pdl || all_pdl;
  config.attrs = pdl ? &attribute : nullptr;
  config.numAttrs = pdl ? 1 : 0;
  CUfunction f =
      l.params.func != nullptr ? l.params.func : reinterpret_cast<CUfunction>(l.params.kern);
  check(g_api->cuLaunchKernelEx(&config, f, l.params.kernelParams, l.params.extra),
        "cuLaunchKernelEx");
}

// A captured call's graph, destroyed with its owner.
using GraphOwner = std::unique_ptr<CUgraph_st, void (*)(CUgraph)>;

GraphOwner capture_one(CUstream stream, const std::function<void()>& call) {
  const auto destroy = [](CUgraph g) { g_api->cuGraphDestroy(g); };
  check(g_api->cuStreamBeginCapture(stream, CU_STREAM_CAPTURE_MODE_THREAD_LOCAL),
        "cuStreamBeginCapture");
  CUgraph graph = nullptr;
  try {
    call();
  } catch (...) {
    g_api->cuStreamEndCapture(stream, &graph);
    if (graph != nullptr) destroy(graph);
    throw;
  }
  check(g_api->cuStreamEndCapture(stream, &graph), "cuStreamEndCapture");
  return GraphOwner(graph, destroy);
}

json part_moe_host(const Options& o, CUstream stream) {
  const std::string file = moejit::bench::find_shapes_file(o.shapes_file, MOEJIT_BENCH_SHAPES_FILE);
  moejit::register_shapes_file(file);
  const moejit::ModelShape shape = moejit::registered_shape(o.moe_shape);
  moejit_moe* raw_handle = nullptr;
  if (moejit_moe_create(shape.name.c_str(), &raw_handle) != MOEJIT_OK) {
    throw std::runtime_error(std::string("moejit_moe_create: ") + moejit_last_error());
  }
  const std::unique_ptr<moejit_moe, void (*)(moejit_moe*)> handle(raw_handle, moejit_moe_destroy);
  const bool decode = moejit::moe_decode_problem(shape).empty() && moejit::current_arch().sm >= 90;
  // The captured launches again: bare (each node's attributes and function), then with the PDL
  // attribute on every launch (launch_moe_kernel's form). Why no CUkernel column: the library
  // launches through each kernel's function in the context (moe_launch.hpp's launch_function),
  // so the captured nodes carry no CUkernel handle.
  struct Variant {
    const char* column;
    const char* json_key;
    bool all_pdl;
  };
  static constexpr Variant kVariants[] = {{"bare launches", "bare_launches_us", false},
                                          {"bare, PDL all", "bare_as_library_us", true}};
  // Why rounds of kPerRound with a sync between: the host runs ahead of the GPU at large T, and
  // a full launch queue would time the GPU; interleaved rounds see the same host state.
  constexpr int kPerRound = 50;
  const int rounds = std::max(1, o.moe_calls / kPerRound);
  json out = json::array();
  std::vector<std::vector<std::string>> rows;
  for (int t : o.moe_tokens) {
    MoeProblem p(shape, t);
    std::vector<moejit::MoePath> paths = {moejit::MoePath::kAuto};
    if (decode && t <= moejit::detail::kDecodeMaxTokens) paths.push_back(moejit::MoePath::kDecode);
    for (moejit::MoePath path : paths) {
      const moejit::MoeForwardOptions options{path, 0};
      const moejit_moe_path c_path =
          path == moejit::MoePath::kDecode ? MOEJIT_MOE_PATH_DECODE : MOEJIT_MOE_PATH_AUTO;
      const auto cpp_call = [&] { moejit::moe_forward(shape, p.args, stream, options); };
      cpp_call();  // builds (or loads) the kernels
      check(g_api->cuStreamSynchronize(stream), "cuStreamSynchronize");
      const GraphOwner graph = capture_one(stream, cpp_call);
      const std::vector<CapturedLaunch> launches = captured_launches(graph.get());
      std::vector<std::function<void()>> calls = {
          cpp_call, [&] {
            if (moejit_moe_forward_ex(handle.get(), p.args.hidden, p.args.topk_ids,
                                      p.args.topk_weights, &p.c_weights, p.args.workspace,
                                      p.args.workspace_bytes, p.args.out, c_path, 0,
                                      stream) != MOEJIT_OK) {
              throw std::runtime_error(std::string("moejit_moe_forward_ex: ") +
                                       moejit_last_error());
            }
          }};
      for (const Variant& v : kVariants) {
        calls.push_back([&launches, &v, stream] {
          for (const CapturedLaunch& l : launches) launch_bare(l, stream, v.all_pdl);
        });
      }
      std::vector<std::vector<double>> samples(calls.size());
      for (int round = 0; round < rounds; ++round) {
        for (std::size_t k = 0; k < calls.size(); ++k) {
          for (int i = 0; i < kPerRound; ++i) {
            const auto start = Clock::now();
            calls[k]();
            samples[k].push_back(ms_since(start) * 1000);
          }
          check(g_api->cuStreamSynchronize(stream), "cuStreamSynchronize");
        }
      }
      std::vector<Stats> stats;
      for (const std::vector<double>& s : samples) stats.push_back(summarize(s));
      const Stats& cpp = stats[0];
      const Stats& bare = stats[2];  // kVariants[0]
      const double difference = cpp.median - bare.median;
      const std::string name = path == moejit::MoePath::kDecode ? "decode" : "auto";
      std::vector<std::string> row = {std::to_string(t),
                                      name,
                                      std::to_string(launches.size()),
                                      fixed(cpp.median, 2),
                                      fixed(stats[1].median, 2),
                                      fixed(difference, 2),
                                      fixed(difference / static_cast<double>(launches.size()), 2),
                                      fixed(cpp.p10, 2) + " / " + fixed(cpp.p90, 2)};
      json entry = {{"tokens", t},
                    {"path", name},
                    {"kernels", launches.size()},
                    {"moe_forward_us", to_json(cpp)},
                    {"c_abi_us", to_json(stats[1])},
                    {"difference_median_us", difference}};
      for (std::size_t v = 0; v < std::size(kVariants); ++v) {
        row.push_back(fixed(stats[2 + v].median, 2));
        entry[kVariants[v].json_key] = to_json(stats[2 + v]);
      }
      rows.push_back(std::move(row));
      out.push_back(std::move(entry));
    }
  }
  std::cout << "\nbare launches: the captured launches with each node's attributes and function; "
               "PDL all: every launch with the PDL attribute, launch_moe_kernel's form. "
               "difference: moe_forward - bare launches";
  std::vector<std::string> header = {"T",     "path",       "kernels",  "moe_forward",
                                     "C ABI", "difference", "a kernel", "moe_forward p10 / p90"};
  for (const Variant& v : kVariants) header.push_back(v.column);
  print_table("(f) host time per moe_forward call, " + shape.name + ", " +
                  std::to_string(rounds * kPerRound) + " calls each (us, median)",
              header, rows);
  return out;
}

int main(int argc, char** argv) {
  Options o;
  ChildOptions child;
  CLI::App app{"moejit_bench_runtime: host-side costs of libmoejit, append_shared and moe_forward"};
  app.add_option("--json", o.json_path, "Also write the results as JSON to PATH");
  app.add_option("--arch", o.arch, "Arch to compile for (default: the GPU's, else sm_90a)");
  app.add_option("--compile-reps", o.compile_reps, "Cold compiles per family")
      ->check(CLI::PositiveNumber);
  app.add_option("--children", o.children, "Fresh processes for the cached-load figure")
      ->check(CLI::PositiveNumber);
  app.add_option("--memory-hits", o.memory_hits, "Calls for the in-memory hit figure")
      ->check(CLI::PositiveNumber);
  app.add_option("--launches", o.launches, "append_shared calls for the host overhead figure")
      ->check(CLI::PositiveNumber);
  app.add_option("--launch-tokens", o.launch_tokens, "T of the host overhead figure")
      ->check(CLI::PositiveNumber);
  app.add_option("--graph-launches", o.graph_launches, "Launches captured per graph")
      ->check(CLI::PositiveNumber);
  app.add_option("--graph-replays", o.graph_replays, "Graph replays per trial")
      ->check(CLI::PositiveNumber);
  app.add_option("--trials", o.trials, "Timed trials per device figure")
      ->check(CLI::PositiveNumber);
  app.add_option("--shapes", o.shapes_file,
                 "(f): shape file (default tools/shapes/reference.json)");
  app.add_option("--moe-shape", o.moe_shape, "(f): the shape moe_forward runs");
  app.add_option("--moe-tokens", o.moe_tokens, "(f): token counts, comma-separated")
      ->delimiter(',')
      ->check(CLI::Range(1, 1 << 20));
  app.add_flag("--moe-only", o.moe_only, "Run (f) alone (needs a GPU)");
  app.add_option("--moe-calls", o.moe_calls, "(f): calls per figure")
      ->check(CLI::Range(50, 1 << 24));
  app.add_option("--child", child.mode,
                 "(internal) run one request as a child: build | load | nvrtc")
      ->check(CLI::IsMember({"build", "load", "nvrtc"}));
  app.add_option("--child-spec", child.spec_index, "(internal) which family spec");
  CLI11_PARSE(app, argc, argv);
  if (!child.mode.empty()) {
    child.arch = o.arch.empty() ? "sm_90a" : o.arch;
    return run_child(child);
  }

  json report;
  try {
    // Why: the parent's own cache is private, so nothing here reads or changes the user's cache.
    TempDir parent_cache;
    moejit::RuntimeConfig config = moejit::RuntimeConfig::from_environment();
    config.cache_dir = parent_cache.path();
    config.cache_mode = moejit::CacheMode::kReadWrite;
    moejit::configure(config);
    moejit::detail::Runtime& runtime = moejit::detail::Runtime::instance();

    std::string why;
    CUcontext ctx = nullptr;
    std::string device_name;
    bool gpu = open_gpu(&why, &ctx, &device_name);
    CUstream stream = nullptr;
    moejit::Arch arch = moejit::Arch::parse("sm_90a");
    if (gpu) {
      check(g_api->cuStreamCreate(&stream, CU_STREAM_NON_BLOCKING), "cuStreamCreate");
      arch = runtime.current_arch();
    }
    if (!o.arch.empty()) arch = moejit::Arch::parse(o.arch);
    bool gpu_parts = gpu && arch == runtime.current_arch();

    std::cout << "moejit_bench_runtime: libmoejit " << moejit::kVersionString << ", NVRTC "
              << moejit::detail::nvrtc_version() << ", arch " << arch.name() << ", "
              << (gpu ? "GPU " + device_name : "no GPU (" + why + ")") << "\n";
    report["library_version"] = moejit::kVersionString;
    report["nvrtc_version"] = moejit::detail::nvrtc_version();
    report["arch"] = arch.name();
    report["device"] = gpu ? device_name : "";
    if (!gpu) report["no_gpu_reason"] = why;

    std::vector<moejit::KernelSpec> specs = family_specs(arch);
    if (specs.empty()) throw std::runtime_error("the reference shape plans no supported kernel");

    if (o.moe_only && !gpu_parts) {
      throw std::runtime_error("--moe-only needs a GPU of the arch it runs for");
    }
    if (!o.moe_only) {
      report["cold_compile"] = part_cold_compile(o, specs);
      report["cached_load_fresh_process"] = part_disk_hit(o, specs, gpu_parts);
      report["memory_hit"] = part_memory_hit(o, specs, gpu_parts ? stream : nullptr);
    }
    if (gpu_parts) {
      if (!o.moe_only) {
        report["launch_overhead"] = part_launch_overhead(o, stream);
        report["append_shared_device_time"] = part_device_time(o, stream);
      }
      report["moe_forward_host"] = part_moe_host(o, stream);
    } else {
      std::string reason =
          gpu ? "--arch " + arch.name() + " is not the GPU's arch " + runtime.current_arch().name()
              : "no GPU: " + why;
      std::cout << "\n(d) host overhead per launch: skipped (" << reason << ")\n";
      std::cout << "(e) append_shared device time: skipped (" << reason << ")\n";
      std::cout << "(f) moe_forward host time: skipped (" << reason << ")\n";
      report["launch_overhead"] = {{"skipped", reason}};
      report["append_shared_device_time"] = {{"skipped", reason}};
      report["moe_forward_host"] = {{"skipped", reason}};
    }
    if (stream != nullptr) g_api->cuStreamDestroy(stream);
  } catch (const std::exception& e) {
    std::cerr << "moejit_bench_runtime: " << e.what() << "\n";
    return 1;
  }
  if (!o.json_path.empty()) {
    std::ofstream file(o.json_path);
    file << report.dump(2) << "\n";
    if (!file) {
      std::cerr << "moejit_bench_runtime: can't write " << o.json_path << "\n";
      return 1;
    }
    std::cout << "\nwrote " << o.json_path << "\n";
  }
  return 0;
}
