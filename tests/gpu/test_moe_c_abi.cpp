// The MoE layer through the C ABI (moejit/moejit.h) on the GPU, end to end: shapes registered
// with moejit_register_shapes_file, a handle per shape, the weight layout, both repacks, the
// workspace query, moejit_moe_forward and moejit_moe_forward_ex, decode_moe's verdict.
//
// The C ABI is a thin wrapper over moejit/moe.hpp, so its results must be the C++ calls' to the
// bit: the repacked bytes (both destinations poisoned with different bytes first, so a byte one
// of them leaves unwritten shows) and every output (on the same inputs and the same repacked
// weights). The outputs are also held to the fp64 CPU reference with the tolerance argued in
// gpu/moe_support.hpp. Refusals (a short workspace, a tensor on the host or of the wrong dtype,
// out on the repacked weights) must return a status and a message naming the argument, and
// leave the output untouched; a success must leave moejit_last_error() empty.
//
// Shapes: qwen3-30b-a3b (separate w1 / w3 / w2 checkpoint, decode_moe serves it) and
// gpt-oss-120b (w13 interleaved, biases; decode_moe refuses it), at their real H, I, top-k and
// activation but with fewer local experts: the reference's fp64 weights take 24·H·I bytes per
// expert (gpt-oss: 200 MB each). T = 1 (the automatic path takes decode_moe where it serves) and
// T = 48 (marlin_moe).
#include <cuda.h>
#include <dlpack/dlpack.h>

#include <algorithm>
#include <catch2/catch.hpp>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include "gpu/gpu_support.hpp"
#include "gpu/moe_support.hpp"
#include "moejit/moe.hpp"
#include "moejit/moejit.h"
#include "moejit/runtime.hpp"
#include "support/support.hpp"

namespace {

using namespace moejit::test;  // the shared MoE test helpers (gpu/moe_support.hpp)
using moejit::ModelShape;
using moejit::MoeForwardArgs;
using moejit::MoeForwardOptions;
using moejit::MoePath;
using moejit::MoeWeightLayout;

struct CAbiShape {
  const char* reference;  // its entry in tools/shapes/reference.json
  int experts;            // local experts (fewer than the real count: the reference's memory)
  const char* name;       // the name it is registered under, unique in this binary
  bool decode_serves;     // moejit_moe_decode_problem reports ""
};

constexpr CAbiShape kShapes[] = {
    {"qwen3-30b-a3b", 32, "capi-gpu-moe-qwen3-30b-a3b-e32", true},
    {"gpt-oss-120b", 8, "capi-gpu-moe-gpt-oss-120b-e8", false},
};
constexpr int kTokens[] = {1, 48};
constexpr int kMaxTokens = 48;

bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

// Registers kShapes once per process through moejit_register_shapes_file: each is its
// reference.json entry with the name, the expert count and max_tokens replaced, so the handle's
// shape and the C++ calls' (moejit::registered_shape) are one shape.
void register_c_abi_shapes() {
  static const bool registered = [] {
    const std::string text = read_text(shapes_dir() + "/reference.json");
    REQUIRE(!text.empty());
    const nlohmann::json reference = nlohmann::json::parse(text);
    nlohmann::json shapes = nlohmann::json::array();
    for (const CAbiShape& s : kShapes) {
      bool found = false;
      for (const nlohmann::json& entry : reference.at("shapes")) {
        if (entry.at("name") != s.reference) continue;
        nlohmann::json shape = entry;
        shape["name"] = s.name;
        shape["num_experts"] = s.experts;
        shape["max_tokens"] = kMaxTokens;
        // One rank holding every expert: global_experts defaults to expert_offset + num_experts.
        shape.erase("expert_offset");
        shape.erase("global_experts");
        shapes.push_back(shape);
        found = true;
      }
      INFO(s.reference << " in reference.json");
      REQUIRE(found);
    }
    const TempDir dir;
    const std::string path = dir.path() + "/capi-gpu-moe.json";
    write_text(path, nlohmann::json{{"shapes", shapes}}.dump(2));
    const moejit_status status = moejit_register_shapes_file(path.c_str());
    INFO("moejit_register_shapes_file: " << moejit_last_error());
    REQUIRE(status == MOEJIT_OK);
    CHECK(std::string(moejit_last_error()).empty());
    return true;
  }();
  (void)registered;
}

using MoeHandle = std::unique_ptr<moejit_moe, void (*)(moejit_moe*)>;

MoeHandle create_handle(const char* name) {
  moejit_moe* raw = nullptr;
  const moejit_status status = moejit_moe_create(name, &raw);
  INFO("moejit_moe_create(\"" << name << "\"): " << moejit_last_error());
  REQUIRE(status == MOEJIT_OK);
  REQUIRE(raw != nullptr);
  CHECK(std::string(moejit_last_error()).empty());
  return MoeHandle(raw, moejit_moe_destroy);
}

// The registered shape, checked against the reference entry it was made from.
ModelShape registered(const CAbiShape& s) {
  const ModelShape shape = moejit::registered_shape(s.name);
  const ModelShape real = reference_shape(s.reference);
  CHECK(shape.num_experts == s.experts);
  CHECK(shape.global_experts == s.experts);
  CHECK(shape.max_tokens == kMaxTokens);
  CHECK(shape.top_k == real.top_k);
  CHECK(shape.hidden == real.hidden);
  CHECK(shape.intermediate == real.intermediate);
  CHECK(shape.has_bias == real.has_bias);
  CHECK(shape.activation.kind == real.activation.kind);
  CHECK(shape.id_dtype == real.id_dtype);
  return shape;
}

// The four repacked buffers of a model, by name.
struct RepackedBuffer {
  const char* name;
  const DeviceBuffer* buffer;
  std::size_t bytes;
};
std::vector<RepackedBuffer> repacked_buffers(const DeviceModel& m) {
  return {{"w13", &m.w13, m.sizes.w13_bytes},
          {"w13_scales", &m.w13_scales, m.sizes.w13_scale_bytes},
          {"w2", &m.w2, m.sizes.w2_bytes},
          {"w2_scales", &m.w2_scales, m.sizes.w2_scale_bytes}};
}

}  // namespace

TEST_CASE("moe C ABI: repack and forward give the C++ calls' bits and match the fp64 reference",
          "[gpu][moe]") {
  gpu();
  TestStream stream;
  register_c_abi_shapes();
  MOEJIT_TEST_SEEDED_RNG(seed, rng);
  std::printf("moe C ABI: seed %llu\n", static_cast<unsigned long long>(seed));
  for (const CAbiShape& s : kShapes) {
    INFO(s.name);
    const ModelShape shape = registered(s);
    prewarm_shapes({shape});
    const MoeHandle moe = create_handle(s.name);

    // decode_moe's verdict: the C++ one, empty exactly where decode_moe serves the shape.
    const char* problem_text = nullptr;
    REQUIRE(moejit_moe_decode_problem(moe.get(), &problem_text) == MOEJIT_OK);
    REQUIRE(problem_text != nullptr);
    const std::string problem = problem_text;
    CHECK(problem == moejit::moe_decode_problem(shape));
    CHECK(problem.empty() == s.decode_serves);
    if (!s.decode_serves) CHECK(contains(problem, "no bias epilogue"));

    moejit_moe_weight_layout layout{};
    layout.struct_size = sizeof(layout);
    REQUIRE(moejit_moe_get_weight_layout(moe.get(), &layout) == MOEJIT_OK);
    const MoeWeightLayout sizes = moejit::moe_weight_layout(shape);
    CHECK(layout.w13_bytes == sizes.w13_bytes);
    CHECK(layout.w13_scale_bytes == sizes.w13_scale_bytes);
    CHECK(layout.w2_bytes == sizes.w2_bytes);
    CHECK(layout.w2_scale_bytes == sizes.w2_scale_bytes);
    CHECK(layout.b13_bytes == sizes.b13_bytes);
    CHECK(layout.b2_bytes == sizes.b2_bytes);
    CHECK((layout.b13_bytes > 0) == shape.has_bias);

    // The same checkpoint repacked by the C++ call and by the C ABI, into destinations poisoned
    // with different bytes. The separate layout goes one expert a call (stacked = false), so
    // first_expert crosses the ABI with values other than 0.
    const bool gpt_oss = uses_gpt_oss_layout(shape);
    const Checkpoint ck = make_checkpoint(shape, gpt_oss, rng());
    auto cpp_model = allocate_model(shape);
    auto c_model = allocate_model(shape);
    for (const RepackedBuffer& b : repacked_buffers(*cpp_model))
      poison(*b.buffer, stream.get(), 0xA5);
    for (const RepackedBuffer& b : repacked_buffers(*c_model))
      poison(*b.buffer, stream.get(), 0x5A);
    {
      const DeviceCheckpoint dck(ck);
      CHECK(dck.repack(*cpp_model, 0, shape.num_experts, 0, gpt_oss, stream.get()) == 0);
      CHECK(dck.repack(*c_model, 0, shape.num_experts, 0, gpt_oss, stream.get(), moe.get()) == 0);
    }
    const std::vector<RepackedBuffer> cpp_buffers = repacked_buffers(*cpp_model);
    const std::vector<RepackedBuffer> c_buffers = repacked_buffers(*c_model);
    for (std::size_t n = 0; n < cpp_buffers.size(); ++n) {
      const std::vector<uint8_t> want =
          cpp_buffers[n].buffer->download<uint8_t>(cpp_buffers[n].bytes);
      const std::vector<uint8_t> got = c_buffers[n].buffer->download<uint8_t>(c_buffers[n].bytes);
      INFO("repacked " << cpp_buffers[n].name << " (" << want.size() << " bytes)");
      CHECK(first_difference(got, want) == -1);
    }
    const MoeWeightsF64 f64 = dequantize(ck, 0, shape.num_experts);
    const moejit_moe_weights weights = capi_weights(*c_model);

    IdPlan plan;
    plan.lo = 0;
    plan.hi = shape.num_experts;
    for (int tokens : kTokens) {
      const std::string label = std::string(s.name) + " T=" + std::to_string(tokens);
      INFO(label);
      std::size_t workspace_bytes = 0;
      REQUIRE(moejit_moe_workspace_bytes(moe.get(), tokens, &workspace_bytes) == MOEJIT_OK);
      CHECK(workspace_bytes == moejit::moe_workspace_bytes(shape, tokens));
      const Tokens tk = make_tokens(shape, tokens, plan, rng);
      ForwardIo io(shape, tk, workspace_bytes);
      const MoeForwardArgs a = io.args(*c_model);
      const std::vector<int> which = all_tokens(tokens);
      const std::vector<double> ref = reference_layer(f64, tk, which, layer_options(shape));

      struct Call {
        const char* what;
        bool ex;  // moejit_moe_forward_ex, else moejit_moe_forward
        moejit_moe_path path;
        MoeForwardOptions cpp;
      };
      // Forced decode first: on gpt-oss it is refused, so the calls after it show that a
      // success clears the message.
      const Call calls[] = {
          {"moejit_moe_forward_ex decode", true, MOEJIT_MOE_PATH_DECODE, kDecode},
          {"moejit_moe_forward_ex marlin", true, MOEJIT_MOE_PATH_MARLIN, kMarlin},
          {"moejit_moe_forward_ex auto", true, MOEJIT_MOE_PATH_AUTO, kAuto},
          {"moejit_moe_forward", false, MOEJIT_MOE_PATH_AUTO, kAuto},
      };
      for (const Call& call : calls) {
        INFO(call.what);
        const bool served = call.cpp.path != MoePath::kDecode || decode_serves(shape, tokens);
        // The C++ call on the same inputs and the C ABI's repacked weights.
        std::vector<uint16_t> want;
        if (served) want = io.run(*c_model, stream.get(), call.cpp);
        poison(io.out, stream.get());
        poison(io.workspace, stream.get());
        const moejit_status status =
            call.ex ? moejit_moe_forward_ex(moe.get(), a.hidden, a.topk_ids, a.topk_weights,
                                            &weights, a.workspace, a.workspace_bytes, a.out,
                                            call.path, 0, stream.get())
                    : moejit_moe_forward(moe.get(), a.hidden, a.topk_ids, a.topk_weights, &weights,
                                         a.workspace, a.workspace_bytes, a.out, stream.get());
        const std::string message = moejit_last_error();
        stream.sync();
        const std::vector<uint16_t> got = io.output();
        INFO("moejit_last_error: " << message);
        if (!served) {
          // decode_moe can't serve it (the shape, or a device older than sm_90): refused with
          // the reason, nothing written.
          CHECK(status == MOEJIT_ERROR_UNSUPPORTED);
          CHECK(contains(message, "a forced decode path can't serve this call"));
          CHECK_FALSE(contains(message, "options."));  // no C++ field names in a C message
          CHECK(contains(message, problem.empty() ? std::string("sm_90") : problem));
          CHECK(still_poisoned(got));
          continue;
        }
        REQUIRE(status == MOEJIT_OK);
        CHECK(message.empty());
        CHECK(count_nonfinite(got) == 0);
        CHECK(same_bits(got, want));
        check_score(label + " [" + call.what + "]", score(got, ref, which, shape.hidden),
                    which.size(), tokens, "moe C ABI");
      }
    }
  }
}

TEST_CASE(
    "moe C ABI: a short workspace, a host tensor, a wrong dtype and out on the weights "
    "are refused naming the argument, and nothing is written",
    "[gpu][moe]") {
  gpu();
  TestStream stream;
  register_c_abi_shapes();
  MOEJIT_TEST_SEEDED_RNG(seed, rng);
  for (const CAbiShape& s : kShapes) {
    INFO(s.name);
    const ModelShape shape = registered(s);
    prewarm_shapes({shape});
    const MoeHandle moe = create_handle(s.name);
    // FC1's weights and the biases zero, FC2's nibbles 0x22 (E2M1 1.0), scales 2^0: FC1's
    // activation is 0 everywhere (act(0) = 0 for SwiGLU and gpt-oss), so a call that runs writes
    // zeros, and one that wrongly wrote into w2 would change its 0x22 bytes.
    auto model = allocate_model(shape);
    poison(model->w13, stream.get(), 0);
    poison(model->w2, stream.get(), 0x22);
    poison(model->w13_scales, stream.get(), layout::kPadScale);
    poison(model->w2_scales, stream.get(), layout::kPadScale);
    poison(model->b13, stream.get(), 0);
    poison(model->b2, stream.get(), 0);
    const moejit_moe_weights weights = capi_weights(*model);
    std::size_t sized = 0;
    REQUIRE(moejit_moe_workspace_bytes(moe.get(), kMaxTokens, &sized) == MOEJIT_OK);

    IdPlan plan;
    plan.lo = 0;
    plan.hi = shape.num_experts;
    for (int tokens : kTokens) {
      INFO("T=" << tokens);
      const Tokens tk = make_tokens(shape, tokens, plan, rng);
      ForwardIo io(shape, tk, sized);
      const MoeForwardArgs a = io.args(*model);
      const auto forward = [&](const DLTensor* hidden, const DLTensor* ids,
                               const DLTensor* topk_weights, std::size_t workspace_bytes,
                               DLTensor* out) {
        return moejit_moe_forward(moe.get(), hidden, ids, topk_weights, &weights, a.workspace,
                                  workspace_bytes, out, stream.get());
      };
      // A call that runs: all zeros, and the kernels loaded, so no refusal below can be a build
      // problem.
      const auto expect_runs = [&] {
        poison(io.out, stream.get());
        const moejit_status status =
            forward(a.hidden, a.topk_ids, a.topk_weights, a.workspace_bytes, a.out);
        const std::string message = moejit_last_error();
        stream.sync();
        INFO("moejit_last_error: " << message);
        REQUIRE(status == MOEJIT_OK);
        CHECK(message.empty());
        for (uint16_t bits : io.output()) {
          if ((bits & 0x7FFF) != 0) {
            FAIL_CHECK("output " << bits << " is not a zero");
            break;
          }
        }
      };
      // The output poisoned, one call that must be refused with MOEJIT_ERROR_INVALID_ARGUMENT
      // and a message holding each of `words`; the output still the poison after the stream
      // drains.
      const auto refused = [&](const char* what, const std::vector<std::string>& words,
                               const auto& call) {
        INFO(what);
        poison(io.out, stream.get());
        stream.sync();
        const moejit_status status = call();
        const std::string message = moejit_last_error();
        stream.sync();
        INFO("moejit_last_error: " << message);
        CHECK(status == MOEJIT_ERROR_INVALID_ARGUMENT);
        for (const std::string& word : words) CHECK(contains(message, word));
        CHECK(still_poisoned(io.output()));
      };

      expect_runs();

      // A workspace one byte short of what this call needs (less than moejit_moe_workspace_bytes
      // reports): refused stating the need. Also through forward_ex on the marlin path.
      const std::size_t need = call_workspace_bytes(shape, tokens, kAuto);
      const std::size_t marlin_need = call_workspace_bytes(shape, tokens, kMarlin);
      INFO("needs " << need << " bytes (marlin " << marlin_need << ") of " << sized);
      REQUIRE(need > 0);
      CHECK(need <= sized);
      CHECK(marlin_need <= sized);
      refused("workspace_bytes one short",
              {"workspace_bytes: expected at least " + std::to_string(need)},
              [&] { return forward(a.hidden, a.topk_ids, a.topk_weights, need - 1, a.out); });
      refused("workspace_bytes one short, forward_ex marlin",
              {"workspace_bytes: expected at least " + std::to_string(marlin_need)}, [&] {
                return moejit_moe_forward_ex(moe.get(), a.hidden, a.topk_ids, a.topk_weights,
                                             &weights, a.workspace, marlin_need - 1, a.out,
                                             MOEJIT_MOE_PATH_MARLIN, 0, stream.get());
              });
      expect_runs();

      {  // tensors on the wrong device type
        DLTensor hidden = *a.hidden;
        hidden.device = DLDevice{kDLCPU, 0};
        refused(
            "hidden on the host", {"hidden: expected a CUDA tensor (kDLCUDA)", "found cpu"},
            [&] { return forward(&hidden, a.topk_ids, a.topk_weights, a.workspace_bytes, a.out); });
        DLTensor out = *a.out;
        out.device = DLDevice{kDLCUDAHost, 0};
        refused(
            "out in pinned host memory",
            {"out: expected a CUDA tensor (kDLCUDA)", "found cuda_host",
             "the kernels can reach this memory: export it as a kDLCUDA tensor"},
            [&] { return forward(a.hidden, a.topk_ids, a.topk_weights, a.workspace_bytes, &out); });
      }
      expect_runs();

      {  // wrong dtypes
        DLTensor topk_weights = *a.topk_weights;
        topk_weights.dtype = dl_bf16();
        refused(
            "bf16 topk_weights", {"topk_weights: expected dtype float32", "found dtype bfloat16"},
            [&] { return forward(a.hidden, a.topk_ids, &topk_weights, a.workspace_bytes, a.out); });
        DLTensor ids = *a.topk_ids;
        ids.dtype = dl_int(64);
        refused("int64 topk_ids for an int32 shape",
                {"topk_ids: expected dtype int32", "found dtype int64"},
                [&] { return forward(a.hidden, &ids, a.topk_weights, a.workspace_bytes, a.out); });
        DLTensor hidden = *a.hidden;
        hidden.dtype = dl_float(16);
        refused("fp16 hidden", {"hidden: expected dtype bfloat16", "found dtype float16"}, [&] {
          return forward(&hidden, a.topk_ids, a.topk_weights, a.workspace_bytes, a.out);
        });
      }
      expect_runs();

      {  // out on the last bytes of the repacked w2: refused, and w2 keeps its bytes
        const std::size_t out_bytes = to_size(static_cast<int64_t>(tokens) * shape.hidden * 2);
        REQUIRE(model->sizes.w2_bytes >= out_bytes);
        const std::size_t offset = model->sizes.w2_bytes - out_bytes;
        TensorView out_on_w2(model->w2.data(), offset, {tokens, shape.hidden}, dl_bf16());
        refused("out on the repacked w2",
                {"out: expected a buffer that shares no byte with weights->w2"}, [&] {
                  return forward(a.hidden, a.topk_ids, a.topk_weights, a.workspace_bytes,
                                 out_on_w2.dl());
                });
        const std::vector<uint8_t> w2 = download_at<uint8_t>(model->w2, offset, out_bytes);
        CHECK(std::count(w2.begin(), w2.end(), uint8_t{0x22}) ==
              static_cast<std::ptrdiff_t>(out_bytes));
      }
      {  // repack targets the C caller passes: named as its arguments, not as C++ fields
        const bool gpt_oss = uses_gpt_oss_layout(shape);
        const auto repack = [&](const moejit_moe_weights& target, int32_t* bad_scale_count) {
          return gpt_oss ? moejit_moe_repack_gpt_oss(moe.get(), nullptr, nullptr, nullptr, nullptr,
                                                     &target, 0, bad_scale_count, stream.get())
                         : moejit_moe_repack_separate(moe.get(), nullptr, nullptr, nullptr, nullptr,
                                                      nullptr, nullptr, &target, 0, bad_scale_count,
                                                      stream.get());
        };
        const char* call = gpt_oss ? "moejit_moe_repack_gpt_oss: " : "moejit_moe_repack_separate: ";
        moejit_moe_weights target = weights;
        // 4 bytes in: enough for the repack's stores, not for moe_forward's reads.
        target.w13_scales = static_cast<uint8_t*>(target.w13_scales) + 4;
        refused("repack into a misaligned w13_scales",
                {call + std::string("target->w13_scales: expected a pointer aligned to 16 bytes")},
                [&] { return repack(target, nullptr); });
        CHECK_FALSE(contains(moejit_last_error(), "target.weights"));
        DeviceBuffer counter(8);
        refused("a misaligned bad_scale_count",
                {call + std::string("bad_scale_count: expected a pointer aligned to 4 bytes")},
                [&] {
                  return repack(weights,
                                reinterpret_cast<int32_t*>(static_cast<char*>(counter.data()) + 2));
                });
        CHECK_FALSE(contains(moejit_last_error(), "target."));
      }
      // After a refusal, a success leaves moejit_last_error() empty (checked in expect_runs).
      expect_runs();
    }
  }
}
