// KernelSpec and Arch: parsing, names, JSON, hashing, supports(), and the planner.
#include <catch2/catch.hpp>
#include <filesystem>
#include <functional>
#include <nlohmann/json.hpp>
#include <string>
#include <variant>
#include <vector>

#include "codegen/codegen.hpp"
#include "moejit/error.hpp"
#include "moejit/kernel_spec.hpp"
#include "moejit/runtime.hpp"
#include "moejit/shape.hpp"
#include "support/support.hpp"

namespace {

using moejit::AppendSharedParams;
using moejit::Arch;
using moejit::DType;
using moejit::Error;
using moejit::ErrorCode;
using moejit::KernelSpec;
using moejit::SharedGate;

bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

KernelSpec make_spec(const AppendSharedParams& params, const char* arch = "sm_90a") {
  KernelSpec spec;
  spec.family = moejit::Family::kAppendShared;
  spec.arch = Arch::parse(arch);
  spec.params = params;
  return spec;
}

AppendSharedParams qwen_params() {
  AppendSharedParams p;
  p.top_k = 8;
  p.num_shared = 1;
  p.id_dtype = DType::kI32;
  p.gate = SharedGate::kSigmoid;
  p.logit_dtype = DType::kBF16;
  p.block_threads = 128;
  return p;
}

std::string arch_error(const std::string& text) {
  try {
    Arch::parse(text);
  } catch (const Error& e) {
    CHECK(e.code() == ErrorCode::kInvalidArgument);
    return e.what();
  }
  FAIL("Arch::parse accepted \"" << text << "\"");
  return "";
}

}  // namespace

TEST_CASE("Arch parses sm_XY and sm_XYa", "[spec]") {
  const Arch a = Arch::parse("sm_90a");
  CHECK(a.sm == 90);
  CHECK(a.arch_specific);
  CHECK(a.name() == "sm_90a");
  CHECK(a.nvrtc_option() == "--gpu-architecture=sm_90a");

  const Arch b = Arch::parse("sm_80");
  CHECK(b.sm == 80);
  CHECK(!b.arch_specific);
  CHECK(b.name() == "sm_80");

  const Arch c = Arch::parse("sm_100a");
  CHECK(c.sm == 100);
  CHECK(c.arch_specific);
  CHECK(c.name() == "sm_100a");

  CHECK(Arch::parse("sm_70").sm == 70);
  CHECK(Arch::parse("sm_120").name() == "sm_120");
  CHECK(Arch::parse("sm_90a") == a);
  CHECK(!(Arch::parse("sm_90") == a));
}

TEST_CASE("Arch refuses malformed and too-old targets, naming the text and the forms", "[spec]") {
  for (const char* text : {"", "sm_", "sm_9", "sm90a", "SM_90", "compute_90", "sm_90b", "sm_90aa",
                           "sm_9x", "sm_1000", "sm_090", " sm_90", "sm_90a "}) {
    INFO("text: \"" << text << "\"");
    const std::string message = arch_error(text);
    CHECK(contains(message, std::string("\"") + text + "\""));
    CHECK(contains(message, "sm_<NN>"));
    CHECK(contains(message, "sm_<NN>a"));
  }
  CHECK(contains(arch_error("sm_60"), "NN >= 70"));
  CHECK(contains(arch_error("sm_80a"), "\"a\" (arch-specific) suffix needs NN >= 90"));
  CHECK(contains(arch_error("sm_89a"), "sm_89a"));
}

TEST_CASE("family names round-trip", "[spec]") {
  CHECK(std::string(moejit::family_name(moejit::Family::kAppendShared)) == "append_shared");
  CHECK(moejit::parse_family("append_shared") == moejit::Family::kAppendShared);
  try {
    moejit::parse_family("route_v2");
    FAIL("parse_family accepted route_v2");
  } catch (const Error& e) {
    CHECK(e.code() == ErrorCode::kInvalidArgument);
    CHECK(contains(e.what(), "route_v2"));
    CHECK(contains(e.what(), "append_shared"));
  }
}

TEST_CASE("supports() accepts the served ranges", "[spec]") {
  CHECK(moejit::supports(make_spec(qwen_params())).empty());
  for (int top_k : {1, 64}) {
    for (int num_shared : {1, 8}) {
      for (int threads : {32, 96, 1024}) {
        AppendSharedParams p = qwen_params();
        p.top_k = top_k;
        p.num_shared = num_shared;
        p.block_threads = threads;
        INFO(top_k << " " << num_shared << " " << threads);
        CHECK(moejit::supports(make_spec(p)).empty());
      }
    }
  }
  for (DType logit : {DType::kBF16, DType::kF16, DType::kF32}) {
    AppendSharedParams p = qwen_params();
    p.logit_dtype = logit;
    p.id_dtype = DType::kI64;
    CHECK(moejit::supports(make_spec(p, "sm_80")).empty());
  }
  AppendSharedParams constant = qwen_params();
  constant.gate = SharedGate::kConstant;
  constant.logit_dtype = DType::kI32;  // not read by a constant gate
  CHECK(moejit::supports(make_spec(constant)).empty());
  AppendSharedParams given = qwen_params();
  given.gate = SharedGate::kGiven;
  given.logit_dtype = DType::kF32;
  CHECK(moejit::supports(make_spec(given)).empty());
}

TEST_CASE("supports() names the field, the value found and the range allowed", "[spec]") {
  struct Case {
    std::function<void(AppendSharedParams&)> edit;
    std::vector<std::string> parts;
  };
  const std::vector<Case> cases = {
      {[](AppendSharedParams& p) { p.top_k = 0; }, {"top_k = 0", "1..64"}},
      {[](AppendSharedParams& p) { p.top_k = 65; }, {"top_k = 65", "1..64"}},
      {[](AppendSharedParams& p) { p.num_shared = 0; }, {"num_shared = 0", "1..8"}},
      {[](AppendSharedParams& p) { p.num_shared = 9; }, {"num_shared = 9", "1..8"}},
      {[](AppendSharedParams& p) { p.id_dtype = DType::kBF16; }, {"id_dtype = bf16", "i32, i64"}},
      {[](AppendSharedParams& p) { p.logit_dtype = DType::kI64; },
       {"logit_dtype = i64", "sigmoid", "bf16, f16, f32"}},
      {[](AppendSharedParams& p) {
         p.gate = SharedGate::kGiven;
         p.logit_dtype = DType::kBF16;
       },
       {"logit_dtype = bf16", "given", "f32"}},
      {[](AppendSharedParams& p) { p.block_threads = 100; },
       {"block_threads = 100", "multiple of 32 in 32..1024"}},
      {[](AppendSharedParams& p) { p.block_threads = 0; }, {"block_threads = 0"}},
      {[](AppendSharedParams& p) { p.block_threads = 2048; }, {"block_threads = 2048"}},
  };
  for (const Case& c : cases) {
    AppendSharedParams p = qwen_params();
    c.edit(p);
    const KernelSpec spec = make_spec(p);
    const std::string reason = moejit::supports(spec);
    INFO(reason);
    REQUIRE(!reason.empty());
    CHECK(contains(reason, spec.display_name()));
    for (const std::string& part : c.parts) CHECK(contains(reason, part));
  }
  KernelSpec bad_arch = make_spec(qwen_params());
  bad_arch.arch.sm = 60;
  CHECK(contains(moejit::supports(bad_arch), "below the minimum sm_70"));
  bad_arch.arch.sm = 86;
  bad_arch.arch.arch_specific = true;
  CHECK(contains(moejit::supports(bad_arch), "\"a\" suffix"));
}

TEST_CASE("display_name and to_json are stable and complete", "[spec]") {
  const KernelSpec spec = make_spec(qwen_params());
  CHECK(spec.display_name() == "append_shared<k8,s1,i32,sigmoid,bf16,t128>@sm_90a");
  CHECK(spec.to_json() ==
        "{\"family\":\"append_shared\",\"arch\":\"sm_90a\",\"params\":{\"top_k\":8,"
        "\"num_shared\":1,\"id_dtype\":\"i32\",\"gate\":\"sigmoid\",\"logit_dtype\":\"bf16\","
        "\"block_threads\":128}}");
  CHECK(make_spec(qwen_params()).to_json() == spec.to_json());
  const auto parsed = nlohmann::json::parse(spec.to_json());
  CHECK(parsed.at("params").at("top_k") == 8);

  AppendSharedParams constant = qwen_params();
  constant.gate = SharedGate::kConstant;
  constant.id_dtype = DType::kI64;
  CHECK(make_spec(constant, "sm_100a").display_name() ==
        "append_shared<k8,s1,i64,constant,t128>@sm_100a");
}

TEST_CASE("hash and equality follow every typed field", "[spec]") {
  const KernelSpec base = make_spec(qwen_params());
  CHECK(base == make_spec(qwen_params()));
  CHECK(base.hash() == make_spec(qwen_params()).hash());

  std::vector<KernelSpec> variants;
  auto vary = [&](const std::function<void(KernelSpec&)>& edit) {
    KernelSpec s = base;
    edit(s);
    variants.push_back(s);
  };
  vary([](KernelSpec& s) { s.arch = Arch::parse("sm_90"); });
  vary([](KernelSpec& s) { s.arch = Arch::parse("sm_100a"); });
  vary([](KernelSpec& s) { std::get<AppendSharedParams>(s.params).top_k = 6; });
  vary([](KernelSpec& s) { std::get<AppendSharedParams>(s.params).num_shared = 2; });
  vary([](KernelSpec& s) { std::get<AppendSharedParams>(s.params).id_dtype = DType::kI64; });
  vary([](KernelSpec& s) { std::get<AppendSharedParams>(s.params).gate = SharedGate::kGiven; });
  vary([](KernelSpec& s) { std::get<AppendSharedParams>(s.params).logit_dtype = DType::kF16; });
  vary([](KernelSpec& s) { std::get<AppendSharedParams>(s.params).block_threads = 256; });
  for (std::size_t i = 0; i < variants.size(); ++i) {
    INFO(variants[i].display_name());
    CHECK(!(variants[i] == base));
    CHECK(variants[i].hash() != base.hash());
    for (std::size_t j = i + 1; j < variants.size(); ++j) {
      CHECK(variants[i].hash() != variants[j].hash());
    }
  }
}

TEST_CASE("codegen renders includes and a name expression from tables", "[spec]") {
  const moejit::detail::GeneratedSource src = moejit::detail::render(make_spec(qwen_params()));
  CHECK(src.file_name == "append_shared_k8_s1_i32_sigmoid_bf16_t128_sm_90a.cu");
  CHECK(contains(src.source, "#include <moejit/kern/append_shared.cuh>"));
  CHECK(contains(src.source, "append_shared<k8,s1,i32,sigmoid,bf16,t128>@sm_90a"));
  CHECK(src.name_expression ==
        "moejit::kern::append_shared_kernel<moejit::kern::AppendSharedTraits<8, 1, int, "
        "moejit::kern::SharedGate::kSigmoid, moejit::kern::bf16, 128>>");
  CHECK(moejit::detail::render(make_spec(qwen_params())).source == src.source);

  AppendSharedParams p = qwen_params();
  p.id_dtype = DType::kI64;
  p.gate = SharedGate::kGiven;
  p.logit_dtype = DType::kF32;
  p.num_shared = 2;
  const auto given = moejit::detail::render(make_spec(p, "sm_100a"));
  CHECK(given.file_name == "append_shared_k8_s2_i64_given_f32_t128_sm_100a.cu");
  CHECK(given.name_expression ==
        "moejit::kern::append_shared_kernel<moejit::kern::AppendSharedTraits<8, 2, long long, "
        "moejit::kern::SharedGate::kGiven, float, 128>>");

  // A constant gate reads no logits: whatever dtype the spec carries, one kernel.
  p.gate = SharedGate::kConstant;
  p.logit_dtype = DType::kBF16;
  const auto constant_bf16 = moejit::detail::render(make_spec(p));
  p.logit_dtype = DType::kF16;
  const auto constant_f16 = moejit::detail::render(make_spec(p));
  CHECK(constant_bf16.source == constant_f16.source);
  CHECK(constant_bf16.name_expression == constant_f16.name_expression);
  CHECK(contains(constant_bf16.name_expression, "SharedGate::kConstant, float, 128>>"));

  AppendSharedParams bad = qwen_params();
  bad.num_shared = 0;
  try {
    moejit::detail::render(make_spec(bad));
    FAIL("render accepted num_shared = 0");
  } catch (const Error& e) {
    CHECK(e.code() == ErrorCode::kUnsupported);
    CHECK(contains(e.what(), "num_shared = 0"));
  }
}

// The append_shared kernels among a shape's planned kernels (the MoE families are planned too;
// tests/unit/test_moe_plan.cpp covers those).
std::vector<KernelSpec> append_shared_specs(const moejit::ModelShape& shape, const Arch& arch) {
  std::vector<KernelSpec> out;
  for (const KernelSpec& spec : moejit::plan_kernels(shape, arch)) {
    if (spec.family == moejit::Family::kAppendShared) out.push_back(spec);
  }
  return out;
}

TEST_CASE("planner: shared experts need one append_shared kernel, none otherwise", "[spec]") {
  moejit::ModelShape shape;
  shape.name = "synthetic";
  shape.num_experts = 64;
  shape.global_experts = 64;
  shape.top_k = 8;
  shape.hidden = 2048;
  shape.intermediate = 768;
  shape.id_dtype = DType::kI64;
  CHECK(append_shared_specs(shape, Arch::parse("sm_90a")).empty());

  shape.shared.count = 2;
  shape.shared.gate = SharedGate::kSigmoid;
  shape.shared.logit_dtype = DType::kF16;
  const auto specs = append_shared_specs(shape, Arch::parse("sm_100a"));
  REQUIRE(specs.size() == 1);
  CHECK(specs[0].family == moejit::Family::kAppendShared);
  CHECK(specs[0].arch == Arch::parse("sm_100a"));
  const auto& p = std::get<AppendSharedParams>(specs[0].params);
  CHECK(p.top_k == 8);
  CHECK(p.num_shared == 2);
  CHECK(p.id_dtype == DType::kI64);
  CHECK(p.gate == SharedGate::kSigmoid);
  CHECK(p.logit_dtype == DType::kF16);
  CHECK(moejit::supports(specs[0]).empty());

  // Gates that read no logits of their own dtype are planned as f32.
  shape.shared.gate = SharedGate::kConstant;
  shape.shared.logit_dtype = DType::kBF16;
  const auto constant = append_shared_specs(shape, Arch::parse("sm_90a"));
  REQUIRE(constant.size() == 1);
  CHECK(std::get<AppendSharedParams>(constant[0].params).logit_dtype == DType::kF32);
  shape.shared.gate = SharedGate::kGiven;
  const auto given = append_shared_specs(shape, Arch::parse("sm_90a"));
  REQUIRE(given.size() == 1);
  CHECK(moejit::supports(given[0]).empty());
}

TEST_CASE("planner: the reference shapes", "[spec]") {
  const std::string path = moejit::test::shapes_dir() + "/reference.json";
  INFO(path);
  REQUIRE(std::filesystem::exists(path));
  const std::vector<moejit::ModelShape> shapes = moejit::load_shapes_file(path);
  bool saw_qwen2 = false;
  bool saw_gpt_oss = false;
  for (const moejit::ModelShape& shape : shapes) {
    INFO(shape.name);
    for (const char* arch : {"sm_90a", "sm_100a", "sm_80"}) {
      const auto specs = moejit::plan_kernels(shape, Arch::parse(arch));
      for (const KernelSpec& spec : specs) CHECK(moejit::supports(spec).empty());
      CHECK(append_shared_specs(shape, Arch::parse(arch)).size() ==
            (shape.shared.count > 0 ? 1u : 0u));
    }
    if (shape.name == "qwen2-57b-a14b") {
      saw_qwen2 = true;
      const auto specs = append_shared_specs(shape, Arch::parse("sm_90a"));
      REQUIRE(specs.size() == 1);
      const auto& p = std::get<AppendSharedParams>(specs[0].params);
      CHECK(p.top_k == 8);
      CHECK(p.num_shared == 1);
      CHECK(p.gate == SharedGate::kSigmoid);
      CHECK(p.id_dtype == shape.id_dtype);
      CHECK(p.logit_dtype == shape.shared.logit_dtype);
    }
    if (shape.name == "gpt-oss-120b") {
      saw_gpt_oss = true;
      CHECK(append_shared_specs(shape, Arch::parse("sm_90a")).empty());
    }
  }
  CHECK(saw_qwen2);
  CHECK(saw_gpt_oss);
}
