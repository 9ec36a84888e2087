// append_shared on the GPU: every size, gate, logit and id dtype against an fp64 reference on
// fresh random inputs with poisoned outputs, through C++ and the C ABI; CUDA-graph capture and
// replay; a cold miss during capture; argument checks that refuse without launching.
#include <atomic>
#include <catch2/catch.hpp>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "gpu/gpu_support.hpp"
#include "moejit/error.hpp"
#include "moejit/moejit.h"
#include "moejit/ops.hpp"
#include "moejit/runtime.hpp"
#include "ops/append_shared_spec.hpp"
#include "runtime/runtime_impl.hpp"

namespace {

using moejit::AppendSharedArgs;
using moejit::DType;
using moejit::Error;
using moejit::ErrorCode;
using moejit::SharedGate;
using moejit::test::AppendCase;
using moejit::test::AppendData;
using moejit::test::cu;
using moejit::test::gpu;
using moejit::test::make_append_data;
using moejit::test::PointerChecks;
using moejit::test::TestStream;

struct GateVariant {
  SharedGate gate;
  DType logit;
};
const GateVariant kGateVariants[] = {{SharedGate::kSigmoid, DType::kBF16},
                                     {SharedGate::kSigmoid, DType::kF16},
                                     {SharedGate::kSigmoid, DType::kF32},
                                     {SharedGate::kConstant, DType::kF32},
                                     {SharedGate::kGiven, DType::kF32}};
const int kTopKs[] = {2, 6, 8, 16};
const int kShared[] = {1, 2};
const DType kIdTypes[] = {DType::kI32, DType::kI64};

bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

// Every kernel of the sweep, compiled 16 at a time before the sweep runs.
void prewarm_sweep() {
  const moejit::Arch arch = moejit::detail::Runtime::instance().current_arch();
  std::vector<moejit::KernelSpec> specs;
  for (int k : kTopKs) {
    for (int s : kShared) {
      for (DType id : kIdTypes) {
        for (const GateVariant& v : kGateVariants) {
          moejit::KernelSpec spec;
          spec.family = moejit::Family::kAppendShared;
          spec.arch = arch;
          spec.params = moejit::detail::append_shared_params(k, s, id, v.gate, v.logit);
          specs.push_back(spec);
        }
      }
    }
  }
  std::vector<std::string> errors(specs.size());
  std::atomic<std::size_t> next{0};
  std::vector<std::thread> pool;
  for (int t = 0; t < 16; ++t) {
    pool.emplace_back([&] {
      for (std::size_t i = next++; i < specs.size(); i = next++) {
        try {
          moejit::build_kernel(specs[i]);
        } catch (const std::exception& e) {
          errors[i] = e.what();
        }
      }
    });
  }
  for (std::thread& thread : pool) thread.join();
  for (std::size_t i = 0; i < specs.size(); ++i) {
    INFO(specs[i].display_name() << ": " << errors[i]);
    CHECK(errors[i].empty());
  }
}

}  // namespace

TEST_CASE("append_shared: every size, gate and dtype against the fp64 reference", "[gpu]") {
  gpu();
  prewarm_sweep();
  TestStream stream;
  MOEJIT_TEST_SEEDED_RNG(seed, rng);
  int cases = 0;
  for (int64_t tokens : {1, 3, 128, 4096}) {
    for (int k : kTopKs) {
      for (int s : kShared) {
        for (float scale : {1.f, 0.5f}) {
          for (const GateVariant& v : kGateVariants) {
            for (DType id : kIdTypes) {
              for (bool c_abi : {false, true}) {
                AppendCase c;
                c.tokens = tokens;
                c.top_k = k;
                c.num_shared = s;
                c.scale = scale;
                c.gate = v.gate;
                c.logit_dtype = v.logit;
                c.id_dtype = id;
                c.shared_base = id == DType::kI32 ? 896 : (int64_t{1} << 33) + 7;
                auto data = make_append_data(c, rng);
                data->poison(stream.get());
                if (c_abi) {
                  const moejit_status status = data->call_c_abi(stream.get());
                  INFO(c.describe() << " via the C ABI: " << moejit_last_error());
                  REQUIRE(status == MOEJIT_OK);
                  CHECK(std::string(moejit_last_error()).empty());
                } else {
                  moejit::append_shared(data->args(), stream.get());
                }
                stream.sync();
                const std::string problems = data->verify();
                INFO((c_abi ? "C ABI: " : "C++: ") << problems);
                CHECK(problems.empty());
                ++cases;
              }
            }
          }
        }
      }
    }
  }
  CHECK(cases == 4 * 4 * 2 * 2 * 5 * 2 * 2);
}

TEST_CASE("append_shared: the same input gives the same bits, eager and graph replay", "[gpu]") {
  gpu();
  TestStream stream;
  MOEJIT_TEST_SEEDED_RNG(seed, rng);
  AppendCase c;
  c.tokens = 1000;
  c.top_k = 8;
  c.num_shared = 1;
  c.scale = 0.5f;
  c.gate = SharedGate::kSigmoid;
  c.logit_dtype = DType::kBF16;
  auto data = make_append_data(c, rng);

  // Eager, twice (the first call also loads the kernel: capture needs it loaded).
  data->poison(stream.get());
  moejit::append_shared(data->args(), stream.get());
  stream.sync();
  REQUIRE(data->verify().empty());
  const std::vector<int64_t> ids = data->downloaded_ids();
  const std::vector<float> weights = data->downloaded_weights();
  data->poison(stream.get());
  moejit::append_shared(data->args(), stream.get());
  stream.sync();
  CHECK(data->downloaded_ids() == ids);
  CHECK(std::memcmp(data->downloaded_weights().data(), weights.data(),
                    weights.size() * sizeof(float)) == 0);

  CUgraph graph = nullptr;
  MOEJIT_TEST_CU(cu().cuStreamBeginCapture(stream.get(), CU_STREAM_CAPTURE_MODE_GLOBAL));
  try {
    moejit::append_shared(data->args(), stream.get());
  } catch (const Error& e) {
    cu().cuStreamEndCapture(stream.get(), &graph);
    FAIL("append_shared failed during capture: " << e.what());
  }
  MOEJIT_TEST_CU(cu().cuStreamEndCapture(stream.get(), &graph));
  REQUIRE(graph != nullptr);
  CUgraphExec exec = nullptr;
  MOEJIT_TEST_CU(cu().cuGraphInstantiate(&exec, graph, 0));
  for (int replay = 0; replay < 3; ++replay) {
    data->poison(stream.get());
    MOEJIT_TEST_CU(cu().cuGraphLaunch(exec, stream.get()));
    stream.sync();
    INFO("replay " << replay);
    CHECK(data->downloaded_ids() == ids);
    CHECK(std::memcmp(data->downloaded_weights().data(), weights.data(),
                      weights.size() * sizeof(float)) == 0);
  }
  cu().cuGraphExecDestroy(exec);
  cu().cuGraphDestroy(graph);
}

TEST_CASE("append_shared: a cold kernel during capture is refused with kCaptureMiss", "[gpu]") {
  gpu();
  TestStream stream;
  MOEJIT_TEST_SEEDED_RNG(seed, rng);
  // K = 5, S = 3: built by no other test, and the binary's cache is private and fresh.
  AppendCase c;
  c.tokens = 64;
  c.top_k = 5;
  c.num_shared = 3;
  c.gate = SharedGate::kSigmoid;
  c.logit_dtype = DType::kF32;
  auto data = make_append_data(c, rng);
  data->poison(stream.get());
  stream.sync();

  CUgraph graph = nullptr;
  MOEJIT_TEST_CU(cu().cuStreamBeginCapture(stream.get(), CU_STREAM_CAPTURE_MODE_GLOBAL));
  std::string message;
  ErrorCode code = ErrorCode::kInternal;
  bool threw = false;
  try {
    moejit::append_shared(data->args(), stream.get());
  } catch (const Error& e) {
    threw = true;
    code = e.code();
    message = e.what();
  }
  const moejit_status status = data->call_c_abi(stream.get());
  const std::string c_message = moejit_last_error();
  // The capture itself is intact: nothing illegal happened while it was open.
  MOEJIT_TEST_CU(cu().cuStreamEndCapture(stream.get(), &graph));
  if (graph != nullptr) cu().cuGraphDestroy(graph);

  REQUIRE(threw);
  CHECK(code == ErrorCode::kCaptureMiss);
  INFO(message);
  // Under the op's name, as its argument errors are; the C caller reads the C call's.
  CHECK_THAT(message, Catch::StartsWith("append_shared: kernel append_shared<k5,s3"));
  CHECK(contains(message, "MOEJIT_ALLOW_CAPTURE_COMPILE"));
  CHECK(contains(message, "prewarm"));
  CHECK(contains(message, "Prewarm before capturing"));
  CHECK(status == MOEJIT_ERROR_CAPTURE_MISS);
  CHECK(contains(c_message, "MOEJIT_ALLOW_CAPTURE_COMPILE"));
  CHECK_THAT(c_message, Catch::StartsWith("moejit_append_shared: kernel append_shared<k5,s3"));

  // A kernel that is built (here: in memory) but not loaded yet is refused the same way: loading
  // a module inside a capture is not done, and the capture stays valid.
  AppendCase built_case = c;
  built_case.top_k = 3;
  built_case.num_shared = 2;
  built_case.id_dtype = DType::kI64;
  built_case.logit_dtype = DType::kF16;
  auto built = make_append_data(built_case, rng);
  moejit::KernelSpec built_spec;
  built_spec.family = moejit::Family::kAppendShared;
  built_spec.arch = moejit::detail::Runtime::instance().current_arch();
  built_spec.params = moejit::detail::append_shared_params(3, 2, DType::kI64, SharedGate::kSigmoid,
                                                           DType::kF16);
  moejit::build_kernel(built_spec);
  MOEJIT_TEST_CU(cu().cuStreamBeginCapture(stream.get(), CU_STREAM_CAPTURE_MODE_GLOBAL));
  ErrorCode built_code = ErrorCode::kInternal;
  try {
    moejit::append_shared(built->args(), stream.get());
  } catch (const Error& e) {
    built_code = e.code();
  }
  graph = nullptr;
  MOEJIT_TEST_CU(cu().cuStreamEndCapture(stream.get(), &graph));
  if (graph != nullptr) cu().cuGraphDestroy(graph);
  CHECK(built_code == ErrorCode::kCaptureMiss);

  // Nothing ran; outside capture the same call compiles, loads and is right.
  for (float w : data->downloaded_weights()) {
    uint32_t bits = 0;
    std::memcpy(&bits, &w, 4);
    REQUIRE(bits == 0xFFFFFFFFu);
  }
  moejit::append_shared(data->args(), stream.get());
  stream.sync();
  CHECK(data->verify().empty());
}

TEST_CASE("append_shared: prewarm with a current context, then capture without a warm-up run",
          "[gpu]") {
  gpu();
  // K = 4, S = 2, constant gate: a spec no other test uses, so nothing loaded it before.
  moejit::ModelShape shape;
  shape.name = "prewarm-then-capture";
  shape.num_experts = 64;
  shape.top_k = 4;
  shape.hidden = 2048;
  shape.intermediate = 768;
  shape.max_tokens = 16;
  shape.shared.count = 2;
  shape.shared.intermediate = 768;
  shape.shared.gate = SharedGate::kConstant;
  shape.shared.scale = 0.5f;
  const moejit::Arch arch = moejit::detail::Runtime::instance().current_arch();
  for (const moejit::BuildResult& result : moejit::prewarm({shape}, {arch}, 16)) {
    INFO(result.spec.display_name() << ": " << result.error);
    REQUIRE(result.error.empty());
  }

  TestStream stream;
  MOEJIT_TEST_SEEDED_RNG(seed, rng);
  AppendCase c;
  c.tokens = 16;
  c.top_k = 4;
  c.num_shared = 2;
  c.scale = 0.5f;
  c.gate = SharedGate::kConstant;
  auto data = make_append_data(c, rng);
  CUgraph graph = nullptr;
  MOEJIT_TEST_CU(cu().cuStreamBeginCapture(stream.get(), CU_STREAM_CAPTURE_MODE_GLOBAL));
  std::string error;
  try {
    moejit::append_shared(data->args(), stream.get());
  } catch (const Error& e) {
    error = e.what();
  }
  MOEJIT_TEST_CU(cu().cuStreamEndCapture(stream.get(), &graph));
  INFO(error);
  REQUIRE(error.empty());
  REQUIRE(graph != nullptr);
  CUgraphExec exec = nullptr;
  MOEJIT_TEST_CU(cu().cuGraphInstantiate(&exec, graph, 0));
  data->poison(stream.get());
  MOEJIT_TEST_CU(cu().cuGraphLaunch(exec, stream.get()));
  stream.sync();
  CHECK(data->verify().empty());
  cu().cuGraphExecDestroy(exec);
  cu().cuGraphDestroy(graph);
}

TEST_CASE("append_shared: T = 0 launches nothing and needs no data", "[gpu]") {
  gpu();
  TestStream stream;
  MOEJIT_TEST_SEEDED_RNG(seed, rng);
  AppendCase c;
  c.tokens = 0;
  c.top_k = 6;
  c.num_shared = 1;
  auto data = make_append_data(c, rng);
  CHECK(data->topk_ids->dl()->data == nullptr);
  moejit::append_shared(data->args(), stream.get());
  CHECK(data->call_c_abi(stream.get()) == MOEJIT_OK);
  stream.sync();
}

TEST_CASE("append_shared: invalid arguments are refused with messages, nothing launches",
          "[gpu]") {
  const moejit::test::GpuEnv& env = gpu();
  (void)env;
  TestStream stream;
  MOEJIT_TEST_SEEDED_RNG(seed, rng);
  AppendCase c;
  c.tokens = 4;
  c.top_k = 6;
  c.num_shared = 1;
  c.gate = SharedGate::kSigmoid;
  c.logit_dtype = DType::kBF16;
  auto data = make_append_data(c, rng);
  // Load the kernel first, so a refusal can't be mistaken for a compile problem.
  moejit::append_shared(data->args(), stream.get());
  data->poison(stream.get());
  stream.sync();

  struct Bad {
    const char* what;
    std::vector<std::string> words;  // the message must contain each
  };
  auto expect_refused = [&](const Bad& bad, const AppendSharedArgs& args) {
    INFO(bad.what);
    try {
      moejit::append_shared(args, stream.get());
      FAIL("accepted: " << bad.what);
    } catch (const Error& e) {
      INFO(e.what());
      CHECK(e.code() == ErrorCode::kInvalidArgument);
      CHECK(contains(e.what(), "append_shared"));
      CHECK(contains(e.what(), "expected"));
      CHECK(contains(e.what(), "found"));
      for (const std::string& word : bad.words) CHECK(contains(e.what(), word));
    }
  };

  {  // wrong dtype
    AppendSharedArgs args = data->args();
    DLTensor weights = *data->topk_weights->dl();
    weights.dtype = moejit::test::dl_bf16();
    args.topk_weights = &weights;
    expect_refused({"bf16 topk_weights", {"topk_weights", "float32", "bfloat16"}}, args);
  }
  {  // out_ids dtype differs from topk_ids
    AppendSharedArgs args = data->args();
    DLTensor out_ids = *data->out_ids->dl();
    out_ids.dtype = moejit::test::dl_int(64);
    args.out_ids = &out_ids;
    expect_refused({"int64 out_ids for int32 topk_ids", {"out_ids", "int32", "int64"}}, args);
  }
  {  // sigmoid logits of an integer dtype
    AppendSharedArgs args = data->args();
    DLTensor logits = *data->shared_logits->dl();
    logits.dtype = moejit::test::dl_int(16);
    args.shared_logits = &logits;
    expect_refused({"int16 logits", {"shared_logits", "int16"}}, args);
  }
  {  // shape mismatch between the outputs
    AppendSharedArgs args = data->args();
    DLTensor out_weights = *data->out_weights->dl();
    int64_t shape[2] = {c.tokens, c.top_k + c.num_shared + 1};
    out_weights.shape = shape;
    args.out_weights = &out_weights;
    expect_refused({"out_weights wider than out_ids", {"out_weights", "[4, 7]", "[4, 8]"}}, args);
  }
  {  // T mismatch
    AppendSharedArgs args = data->args();
    DLTensor logits = *data->shared_logits->dl();
    int64_t shape[2] = {c.tokens + 1, c.num_shared};
    logits.shape = shape;
    args.shared_logits = &logits;
    expect_refused({"shared_logits with T + 1 rows", {"shared_logits", "[4, 1]", "[5, 1]"}}, args);
    DLTensor weights = *data->topk_weights->dl();
    int64_t weight_shape[2] = {c.tokens - 1, c.top_k};
    weights.shape = weight_shape;
    args = data->args();
    args.topk_weights = &weights;
    expect_refused({"topk_weights with T - 1 rows", {"topk_weights", "[3, 6]"}}, args);
  }
  {  // non-contiguous (a transposed view)
    AppendSharedArgs args = data->args();
    DLTensor ids = *data->topk_ids->dl();
    int64_t strides[2] = {1, c.tokens};
    ids.strides = strides;
    args.topk_ids = &ids;
    expect_refused({"transposed topk_ids", {"topk_ids", "contiguous", "strides [1, 4]"}}, args);
  }
  {  // wrong device
    AppendSharedArgs args = data->args();
    DLTensor out = *data->out_weights->dl();
    out.device = DLDevice{kDLCUDA, 7};
    args.out_weights = &out;
    expect_refused({"device 7", {"out_weights", "device 0", "device 7"}}, args);
    out.device = DLDevice{kDLCPU, 0};
    expect_refused({"a host tensor", {"out_weights", "cpu"}}, args);
  }
  {  // not 2-D
    AppendSharedArgs args = data->args();
    DLTensor ids = *data->topk_ids->dl();
    int64_t shape[3] = {c.tokens, c.top_k, 1};
    ids.ndim = 3;
    ids.shape = shape;
    args.topk_ids = &ids;
    expect_refused({"3-D topk_ids", {"topk_ids", "2-D", "3 dimensions"}}, args);
  }
  {  // misaligned
    AppendSharedArgs args = data->args();
    DLTensor ids = *data->topk_ids->dl();
    ids.byte_offset = 2;
    args.topk_ids = &ids;
    expect_refused({"topk_ids at a 2-byte offset", {"topk_ids", "aligned", "byte_offset 2"}}, args);
    // A byte_offset that wraps the address space, and an ndim no message may read that far.
    ids.byte_offset = ~uint64_t{0} - 3;
    expect_refused({"a wrapping byte_offset", {"topk_ids", "wraps around the address space"}},
                   args);
    ids = *data->topk_ids->dl();
    ids.ndim = 1 << 30;
    expect_refused({"ndim 2^30", {"topk_ids", "2-D", "1073741824 dimensions", "not read"}}, args);
  }
  {  // rows wider than a kernel serves: refused by argument, at T = 4 and at T = 0 alike
    for (const int64_t tokens : {int64_t{4}, int64_t{0}}) {
      for (const bool wide_k : {true, false}) {
        const int64_t k = wide_k ? 65 : c.top_k;
        const int64_t s = wide_k ? 1 : 9;
        int64_t ids_shape[2] = {tokens, k};
        int64_t out_shape[2] = {tokens, k + s};
        int64_t logits_shape[2] = {tokens, s};
        DLTensor ids = *data->topk_ids->dl();
        DLTensor weights = *data->topk_weights->dl();
        DLTensor out_ids = *data->out_ids->dl();
        DLTensor out_weights = *data->out_weights->dl();
        DLTensor logits = *data->shared_logits->dl();
        ids.shape = weights.shape = ids_shape;
        out_ids.shape = out_weights.shape = out_shape;
        logits.shape = logits_shape;
        ids.strides = weights.strides = out_ids.strides = out_weights.strides = logits.strides =
            nullptr;
        AppendSharedArgs args = data->args();
        args.topk_ids = &ids;
        args.topk_weights = &weights;
        args.out_ids = &out_ids;
        args.out_weights = &out_weights;
        args.shared_logits = &logits;
        INFO("T = " << tokens);
        if (wide_k) {
          expect_refused(
              {"K = 65", {"topk_ids", "K from 1 to 64", "[" + std::to_string(tokens) + ", 65]"}},
              args);
        } else {
          expect_refused({"S = 9", {"out_ids", "S from 1 to 8", "K = 6"}}, args);
        }
      }
    }
  }
  {  // missing logits for a sigmoid gate, and a null tensor
    AppendSharedArgs args = data->args();
    args.shared_logits = nullptr;
    expect_refused({"no logits", {"shared_logits", "null"}}, args);
    args = data->args();
    args.out_ids = nullptr;
    expect_refused({"no out_ids", {"out_ids", "null"}}, args);
  }
  {  // shared ids beyond int32
    AppendSharedArgs args = data->args();
    args.shared_base = int64_t{1} << 31;
    expect_refused({"shared_base past int32", {"shared_base", "int32"}}, args);
    args.shared_base = -1;
    expect_refused({"a negative shared_base", {"shared_base", "non-negative", "found -1"}}, args);
  }
  {  // a scale that is not finite
    AppendSharedArgs args = data->args();
    args.scale = std::numeric_limits<float>::infinity();
    expect_refused({"an infinite scale", {"scale", "finite", "inf"}}, args);
  }
  {  // buffers that share bytes: in place over the inputs, and the two outputs on one buffer
    AppendSharedArgs args = data->args();
    DLTensor in_place = *data->out_ids->dl();
    in_place.data = data->topk_ids->dl()->data;
    args.out_ids = &in_place;
    expect_refused({"out_ids over topk_ids", {"out_ids", "shares no byte with topk_ids"}}, args);
    args = data->args();
    DLTensor weights_on_ids = *data->out_weights->dl();
    weights_on_ids.data = data->out_ids->dl()->data;
    args.out_weights = &weights_on_ids;
    expect_refused({"out_weights over out_ids", {"out_ids", "shares no byte with out_weights"}},
                   args);
  }

  // Through the C ABI: a status, this thread's message, then "" after a success.
  {
    DLTensor weights = *data->topk_weights->dl();
    weights.dtype = moejit::test::dl_bf16();
    const moejit_status status = moejit_append_shared(
        data->topk_ids->dl(), &weights, data->shared_logits->dl(), data->out_ids->dl(),
        data->out_weights->dl(), c.shared_base, c.scale, MOEJIT_SHARED_SIGMOID, stream.get());
    CHECK(status == MOEJIT_ERROR_INVALID_ARGUMENT);
    CHECK(contains(moejit_last_error(), "topk_weights"));
    const moejit_status bad_gate = moejit_append_shared(
        data->topk_ids->dl(), data->topk_weights->dl(), data->shared_logits->dl(),
        data->out_ids->dl(), data->out_weights->dl(), c.shared_base, c.scale,
        static_cast<moejit_shared_gate>(3), stream.get());  // no such gate
    CHECK(bad_gate == MOEJIT_ERROR_INVALID_ARGUMENT);
    CHECK(contains(moejit_last_error(), "gate"));
  }

  // With RuntimeConfig::check_pointers, shared logits in plain host memory are refused by name
  // (without it the kernel would read them through an address the GPU can't reach).
  {
    const PointerChecks checks;
    std::vector<uint16_t> host_logits(static_cast<std::size_t>(c.tokens * c.num_shared));
    DLTensor logits = *data->shared_logits->dl();
    logits.data = host_logits.data();
    AppendSharedArgs args = data->args();
    args.shared_logits = &logits;
    expect_refused({"shared logits in host memory", {"shared_logits", "memory CUDA does not know"}},
                   args);
  }

  // Nothing above launched: the outputs are still poison.
  stream.sync();
  for (int64_t id : data->downloaded_ids()) REQUIRE(id == data->id_poison());
  for (float w : data->downloaded_weights()) {
    uint32_t bits = 0;
    std::memcpy(&bits, &w, 4);
    REQUIRE(bits == 0xFFFFFFFFu);
  }

  // And a valid call still works, clearing the C ABI's message.
  CHECK(data->call_c_abi(stream.get()) == MOEJIT_OK);
  CHECK(std::string(moejit_last_error()).empty());
  stream.sync();
  CHECK(data->verify().empty());
}
