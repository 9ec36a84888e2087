// The runtime on a GPU: the current device's arch, context-independent kernel handles that work
// from a second context (a created one, and a second device's primary context when there is
// one), the no-context error, and configure() refused once kernels are loaded or while another
// thread loads one.
#include <algorithm>
#include <atomic>
#include <catch2/catch.hpp>
#include <chrono>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "compile/cubin_check.hpp"
#include "compile/nvrtc.hpp"
#include "gpu/gpu_support.hpp"
#include "gpu/moe_support.hpp"
#include "moejit/error.hpp"
#include "moejit/ops.hpp"
#include "moejit/runtime.hpp"
#include "ops/append_shared_spec.hpp"
#include "ops/decode_forward.hpp"
#include "plan/decode_plan.hpp"
#include "runtime/runtime_impl.hpp"
#include "support/log_capture.hpp"

namespace {

using moejit::DType;
using moejit::Error;
using moejit::ErrorCode;
using moejit::KernelSpec;
using moejit::SharedGate;
using moejit::detail::Runtime;
using moejit::test::AppendCase;
using moejit::test::cu;
using moejit::test::gpu;
using moejit::test::make_append_data;
using moejit::test::TestStream;

KernelSpec sigmoid_spec(const moejit::Arch& arch) {
  KernelSpec spec;
  spec.family = moejit::Family::kAppendShared;
  spec.arch = arch;
  spec.params =
      moejit::detail::append_shared_params(6, 1, DType::kI32, SharedGate::kSigmoid, DType::kBF16);
  return spec;
}

AppendCase sigmoid_case() {
  AppendCase c;
  c.tokens = 300;
  c.top_k = 6;
  c.num_shared = 1;
  c.gate = SharedGate::kSigmoid;
  c.logit_dtype = DType::kBF16;
  return c;
}

// Runs append_shared in the current context on tensors of `device_id`; "" when right.
std::string run_and_verify(int device_id, std::mt19937_64& rng) {
  TestStream stream;
  auto data = make_append_data(sigmoid_case(), rng, device_id);
  data->poison(stream.get());
  moejit::append_shared(data->args(), stream.get());
  stream.sync();
  return data->verify();
}

}  // namespace

TEST_CASE("runtime gpu: the arch is the current device's", "[gpu]") {
  const moejit::test::GpuEnv& env = gpu();
  int major = 0;
  int minor = 0;
  MOEJIT_TEST_CU(
      cu().cuDeviceGetAttribute(&major, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, env.device));
  MOEJIT_TEST_CU(
      cu().cuDeviceGetAttribute(&minor, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, env.device));
  const moejit::detail::CurrentDevice device = Runtime::instance().current_device();
  CHECK(device.ordinal == 0);
  CHECK(device.arch.sm == major * 10 + minor);
  CHECK(device.arch.arch_specific == (major >= 9));
  if (major == 9 && minor == 0) CHECK(device.arch.name() == "sm_90a");
  // Memoized: the same answer again.
  CHECK(Runtime::instance().current_arch() == device.arch);
}

TEST_CASE("runtime gpu: the device facts the decode launches read", "[gpu]") {
  const moejit::test::GpuEnv& env = gpu();
  int sms = 0;
  int clock_khz = 0;
  int bus_bits = 0;
  MOEJIT_TEST_CU(
      cu().cuDeviceGetAttribute(&sms, CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, env.device));
  MOEJIT_TEST_CU(
      cu().cuDeviceGetAttribute(&clock_khz, CU_DEVICE_ATTRIBUTE_MEMORY_CLOCK_RATE, env.device));
  MOEJIT_TEST_CU(cu().cuDeviceGetAttribute(&bus_bits, CU_DEVICE_ATTRIBUTE_GLOBAL_MEMORY_BUS_WIDTH,
                                           env.device));
  CHECK(moejit::detail::multiprocessor_count("test", 0) == sms);
  // Double data rate over the whole bus, in bytes per microsecond (an H200: ~4.8e6).
  const long long expected = 2LL * clock_khz * 1000 * (bus_bits / 8) / 1000000;
  const long long rate = moejit::detail::dram_bytes_per_us(0);
  INFO("memory clock " << clock_khz << " kHz, bus " << bus_bits << " bits");
  if (expected >= 100000) {  // at least 100 GB/s: any GPU these kernels run on
    CHECK(rate == expected);
  } else {
    CHECK(rate == 0);  // not said, or implausible: the pair prefetches at once
  }
  // Memoized: the same answer again.
  CHECK(moejit::detail::dram_bytes_per_us(0) == rate);
}

TEST_CASE("runtime gpu: a thread without a current context gets a clear error", "[gpu]") {
  gpu();
  std::string message;
  ErrorCode code = ErrorCode::kInternal;
  std::thread worker([&] {
    try {
      Runtime::instance().current_arch();
    } catch (const Error& e) {
      code = e.code();
      message = e.what();
    }
  });
  worker.join();
  INFO(message);
  CHECK(code == ErrorCode::kDriver);
  CHECK(message.find("cudaSetDevice") != std::string::npos);
}

TEST_CASE("runtime gpu: kernel handles are shared by every context and stay valid", "[gpu]") {
  const moejit::test::GpuEnv& env = gpu();
  MOEJIT_TEST_SEEDED_RNG(seed, rng);
  Runtime& runtime = Runtime::instance();
  const KernelSpec spec = sigmoid_spec(runtime.current_arch());
  const CUkernel kernel = runtime.kernel(spec, nullptr);
  REQUIRE(kernel != nullptr);
  CHECK(runtime.kernel(spec, nullptr) == kernel);
  CHECK(run_and_verify(0, rng).empty());

  SECTION("a created second context on device 0") {
    CUcontext second = nullptr;
    MOEJIT_TEST_CU(cu().cuCtxCreate(&second, nullptr, 0, env.device));
    MOEJIT_TEST_CU(cu().cuCtxSetCurrent(second));
    {
      CHECK(runtime.current_device().ordinal == 0);
      CHECK(runtime.kernel(spec, nullptr) == kernel);
      CUfunction function = nullptr;
      MOEJIT_TEST_CU(cu().cuKernelGetFunction(&function, kernel));
      CHECK(function != nullptr);
      // Buffers of this context, the op launched in it.
      CHECK(run_and_verify(0, rng).empty());
    }
    MOEJIT_TEST_CU(cu().cuCtxSetCurrent(env.context));
    MOEJIT_TEST_CU(cu().cuCtxDestroy(second));
    // The handle outlives the context it was last used in.
    CHECK(runtime.kernel(spec, nullptr) == kernel);
    CHECK(run_and_verify(0, rng).empty());
  }

  SECTION("the primary context of a second device") {
    if (env.device_count < 2) {
      WARN("SKIPPED: only " << env.device_count
                            << " CUDA device visible; the second-device check needs two");
      return;
    }
    CUdevice other = 0;
    MOEJIT_TEST_CU(cu().cuDeviceGet(&other, 1));
    CUcontext context = nullptr;
    MOEJIT_TEST_CU(cu().cuDevicePrimaryCtxRetain(&context, other));
    MOEJIT_TEST_CU(cu().cuCtxSetCurrent(context));
    {
      const moejit::detail::CurrentDevice device = runtime.current_device();
      CHECK(device.ordinal == 1);
      const KernelSpec other_spec = sigmoid_spec(device.arch);
      if (device.arch == spec.arch) {
        // Same arch: the one library loaded for device 0 serves device 1 too.
        CHECK(runtime.kernel(other_spec, nullptr) == kernel);
      } else {
        CHECK(runtime.kernel(other_spec, nullptr) != nullptr);
      }
      CHECK(run_and_verify(1, rng).empty());
      // Tensors of device 0 while device 1's context is current are refused.
      TestStream stream;
      auto data = make_append_data(sigmoid_case(), rng, 1);
      DLTensor wrong = *data->topk_ids->dl();
      wrong.device.device_id = 0;
      moejit::AppendSharedArgs args = data->args();
      args.topk_ids = &wrong;
      try {
        moejit::append_shared(args, stream.get());
        FAIL("a tensor of device 0 was accepted in device 1's context");
      } catch (const Error& e) {
        CHECK(e.code() == ErrorCode::kInvalidArgument);
        CHECK(std::string(e.what()).find("device 1") != std::string::npos);
      }
      // Device 1's tensors on a stream of device 0: refused before anything launches there.
      MOEJIT_TEST_CU(cu().cuCtxSetCurrent(env.context));
      TestStream device0_stream;
      MOEJIT_TEST_CU(cu().cuCtxSetCurrent(context));
      try {
        moejit::append_shared(data->args(), device0_stream.get());
        FAIL("a stream of device 0 was accepted in device 1's context");
      } catch (const Error& e) {
        CHECK(e.code() == ErrorCode::kInvalidArgument);
        CHECK(std::string(e.what()) ==
              "append_shared: stream: expected a stream of device 1 (the current context's, "
              "which the tensors are checked against), found a stream of device 0: make the "
              "stream's device current, or pass a stream of device 1");
      }
      CHECK(run_and_verify(1, rng).empty());  // device 1 still launches
      MOEJIT_TEST_CU(cu().cuCtxSetCurrent(env.context));
    }
    MOEJIT_TEST_CU(cu().cuCtxSetCurrent(env.context));
    MOEJIT_TEST_CU(cu().cuDevicePrimaryCtxRelease(other));
  }
}

TEST_CASE("runtime gpu: configure() is refused once kernels are loaded", "[gpu]") {
  gpu();
  Runtime& runtime = Runtime::instance();
  runtime.kernel(sigmoid_spec(runtime.current_arch()), nullptr);
  const std::string before = moejit::config().cache_dir;
  moejit::RuntimeConfig next;
  next.cache_dir = before + "-other";
  try {
    moejit::configure(next);
    FAIL("configure() succeeded after a kernel was loaded");
  } catch (const Error& e) {
    CHECK(e.code() == ErrorCode::kInvalidArgument);
    CHECK(std::string(e.what()).find("before the first op") != std::string::npos);
    CHECK(std::string(e.what()).find("only check_pointers may change") != std::string::npos);
  }
  CHECK(moejit::config().cache_dir == before);
  // check_pointers alone may change at any time: it is read per call and changes no kernel.
  moejit::RuntimeConfig checked = moejit::config();
  checked.check_pointers = !checked.check_pointers;
  moejit::configure(checked);
  CHECK(moejit::config().check_pointers == checked.check_pointers);
  CHECK(Runtime::instance().check_pointers() == checked.check_pointers);
  checked.check_pointers = !checked.check_pointers;
  moejit::configure(checked);
  CHECK(Runtime::instance().check_pointers() == checked.check_pointers);
  CHECK(moejit::config().cache_dir == before);
}

// Hidden: it needs a process in which no kernel was loaded yet (ctest's moejit_gpu_tests_fresh).
TEST_CASE("runtime gpu: configure() is refused while another thread loads a kernel",
          "[gpu][.fresh]") {
  const moejit::test::GpuEnv& env = gpu();
  Runtime& runtime = Runtime::instance();
  const moejit::RuntimeConfig before = moejit::config();
  try {
    // Another cache directory and back: refused only once a kernel was loaded.
    moejit::RuntimeConfig probe = before;
    probe.cache_dir = before.cache_dir + "-probe";
    moejit::configure(probe);
    moejit::configure(before);
  } catch (const Error& e) {
    FAIL("run this case in a process of its own (ctest moejit_gpu_tests_fresh): " << e.what());
  }
  // A kernel whose cold compile takes hundreds of milliseconds (decode_moe's main tile), loaded
  // on another thread; configure() comes once that load has begun (its "kernel table miss" line,
  // logged after the load is counted) and while it builds, before anything is loaded.
  const moejit::ModelShape shape = moejit::test::reference_shape("qwen3-30b-a3b");
  const KernelSpec spec = moejit::detail::decode_moe_spec(
      moejit::detail::choose_decode_config(shape, 24, 16), runtime.current_arch());
  moejit::test::LogWatch miss("kernel table miss: " + spec.display_name());
  std::atomic<bool> loaded{false};
  std::string load_error;
  std::thread loader([&] {
    try {  // no Catch2 assertion on this thread
      const CUresult set = cu().cuCtxSetCurrent(env.context);
      if (set != CUDA_SUCCESS)
        throw std::runtime_error("cuCtxSetCurrent: " + moejit::detail::describe(set));
      runtime.kernel(spec, nullptr);
    } catch (const std::exception& e) {
      load_error = e.what();
    }
    loaded.store(true);
  });
  const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  while (!miss.seen() && !loaded.load() && std::chrono::steady_clock::now() < give_up) {
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
  const bool began = miss.seen();
  const bool still_loading = !loaded.load();
  moejit::RuntimeConfig next = before;
  next.cache_dir = before.cache_dir + "-other";
  std::string refusal;
  try {
    moejit::configure(next);
  } catch (const Error& e) {
    CHECK(e.code() == ErrorCode::kInvalidArgument);
    refusal = e.what();
  }
  loader.join();
  INFO("load error: " << load_error << "; configure: " << refusal);
  REQUIRE(load_error.empty());
  REQUIRE(began);
  // Why asked: were the compile ever done before configure() came, the case would show nothing,
  // so it says so instead of passing.
  REQUIRE(still_loading);
  CHECK(refusal.find("while another thread is loading a kernel") != std::string::npos);
  CHECK(moejit::config().cache_dir == before.cache_dir);
}

TEST_CASE("runtime gpu: a kernel ptxas would encode in the faulting copy form runs as built",
          "[gpu]") {
  gpu();
  const moejit::Arch arch = Runtime::instance().current_arch();
  // On sm_90a the ring's hinted copies take the faulting form under ptxas 13.0 (the nvrtc test
  // shows the retry); whatever compile() returns must run and copy every byte.
  const moejit::detail::GeneratedSource src =
      moejit::test::copy_ring_source("copy_ring_library.cu", moejit::test::kRingLibraryCopy);
  const moejit::detail::CompiledKernel built =
      moejit::detail::compile(src, arch, "");
  CHECK(moejit::detail::count_faulting_hinted_copies(built.cubin) == 0);
  const bool retried = std::find(built.options.begin(), built.options.end(),
                                 moejit::detail::kNoL2CacheHintOption) != built.options.end();
  if (!retried) WARN("this NVRTC kept the hint on the ring: the retried build is not exercised");

  CUlibrary library = nullptr;
  MOEJIT_TEST_CU(cu().cuLibraryLoadData(&library, built.cubin.data(), nullptr, nullptr, 0, nullptr,
                                        nullptr, 0));
  CUkernel kernel = nullptr;
  MOEJIT_TEST_CU(cu().cuLibraryGetKernel(&kernel, library, built.lowered_name.c_str()));
  MOEJIT_TEST_SEEDED_RNG(seed, rng);
  std::vector<uint32_t> input(4096);
  for (uint32_t& word : input) word = static_cast<uint32_t>(rng());
  moejit::test::DeviceBuffer in(input.size() * 4);
  moejit::test::DeviceBuffer out(input.size() * 4);
  in.upload(input);
  out.upload(std::vector<uint32_t>(input.size(), 0xFFFFFFFFu));  // poison
  TestStream stream;
  CUdeviceptr in_ptr = in.ptr();
  CUdeviceptr out_ptr = out.ptr();
  int slots = 4;
  void* args[] = {&in_ptr, &out_ptr, &slots};
  CUlaunchConfig config{};
  config.gridDimX = config.gridDimY = config.gridDimZ = 1;
  config.blockDimX = 256;
  config.blockDimY = config.blockDimZ = 1;
  config.sharedMemBytes = 16384;
  config.hStream = stream.get();
  MOEJIT_TEST_CU(
      cu().cuLaunchKernelEx(&config, reinterpret_cast<CUfunction>(kernel), args, nullptr));
  stream.sync();
  CHECK(out.download<uint32_t>(input.size()) == input);
  MOEJIT_TEST_CU(cu().cuLibraryUnload(library));
}
