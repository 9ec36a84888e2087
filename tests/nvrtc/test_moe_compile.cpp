// NVRTC compiles of the MoE families: every kernel the planner lists for the reference shapes
// (sm_90a, all of them; sm_100a, a subset covering every family and GEMM tile), with the host's
// copies of the kernels' sizes checked against the traits inside the same compile, and the
// kernels' static_asserts firing under NVRTC. decode_moe has its own cases ([decode]): every
// kernel planned for sm_90a, one tile per shape for sm_100a, no spills, its static_asserts.
// Needs NVRTC, no GPU.
#include <algorithm>
#include <atomic>
#include <catch2/catch.hpp>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <variant>
#include <vector>

#include "codegen/codegen.hpp"
#include "compile/cubin_check.hpp"
#include "compile/nvrtc.hpp"
#include "moejit/error.hpp"
#include "moejit/kernel_spec.hpp"
#include "moejit/runtime.hpp"
#include "moejit/shape.hpp"
#include "plan/moe_plan.hpp"
#include "support/support.hpp"

namespace {

namespace detail = moejit::detail;
using moejit::Arch;
using moejit::CompileError;
using moejit::DType;
using moejit::Family;
using moejit::KernelSpec;
using moejit::MarlinMoeParams;
using moejit::ModelShape;
using moejit::MoeDecodeParams;
using moejit::MoeRouteParams;

bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

bool is_moe(Family family) {
  return family == Family::kRoute || family == Family::kRepack || family == Family::kMarlinMoe ||
         family == Family::kCombine || family == Family::kNarrowIds;
}

std::vector<ModelShape> reference_shapes() {
  const std::string path = moejit::test::shapes_dir() + "/reference.json";
  INFO(path);
  REQUIRE(std::filesystem::exists(path));
  std::vector<ModelShape> shapes = moejit::load_shapes_file(path);
  // One shape with int64 ids, so narrow_ids is planned too.
  ModelShape wide = shapes.front();
  wide.name = wide.name + "-int64-ids";
  wide.id_dtype = DType::kI64;
  shapes.push_back(wide);
  return shapes;
}

// The distinct MoE kernels `shapes` need on `arch`, in plan order.
std::vector<KernelSpec> planned_moe(const std::vector<ModelShape>& shapes, const Arch& arch) {
  std::vector<KernelSpec> specs;
  for (const ModelShape& shape : shapes) {
    for (const KernelSpec& spec : moejit::plan_kernels(shape, arch)) {
      if (!is_moe(spec.family)) continue;
      if (std::find(specs.begin(), specs.end(), spec) == specs.end()) specs.push_back(spec);
    }
  }
  return specs;
}

// The kernel function a spec's lowered name must mention.
const char* function_of(const KernelSpec& spec) {
  switch (spec.family) {
    case Family::kRoute:
      switch (std::get<MoeRouteParams>(spec.params).kernel) {
        case moejit::RouteKernel::kSingle:
          return "route_single_kernel";
        case moejit::RouteKernel::kRank:
          return "route_rank_kernel";
        case moejit::RouteKernel::kScan:
          return "route_scan_kernel";
        case moejit::RouteKernel::kScatter:
          return "route_scatter_kernel";
      }
      break;
    case Family::kRepack:
      return "repack_mxfp4";
    case Family::kMarlinMoe:
      return "moe_gemm";
    case Family::kCombine:
      return "combine_kernel";
    case Family::kNarrowIds:
      return "narrow_ids_kernel";
    case Family::kAppendShared:
      return "append_shared_kernel";
    case Family::kDecodeMoe:
      switch (std::get<MoeDecodeParams>(spec.params).kernel) {
        case moejit::DecodeKernel::kReset:
          return "decode_moe_reset";
        case moejit::DecodeKernel::kMain:
          return "decode_moe";
        case moejit::DecodeKernel::kPairFc1:
          return "decode_pair_fc1";
        case moejit::DecodeKernel::kPairFc2:
          return "decode_pair_fc2";
        case moejit::DecodeKernel::kCombine:
          return "decode_moe_combine";
      }
      break;
  }
  return "?";
}

// The traits type inside a name expression "ns::kernel<Traits>".
std::string traits_of(const std::string& name_expression) {
  const std::size_t open = name_expression.find('<');
  return name_expression.substr(open + 1, name_expression.size() - open - 2);
}

// Source with the host's sizes asserted against the traits in the same translation unit, so
// the op's launch geometry and the kernel's layout can't drift apart.
detail::GeneratedSource with_host_checks(const KernelSpec& spec) {
  detail::GeneratedSource src = detail::render(spec);
  const std::string traits = traits_of(src.name_expression);
  if (const auto* p = std::get_if<MarlinMoeParams>(&spec.params)) {
    src.source += "static_assert(" + traits +
                  "::kSmemBytes == " + std::to_string(detail::marlin_moe_smem_bytes(*p)) +
                  ", \"host marlin_moe_smem_bytes disagrees with kSmemBytes\");\n";
    src.source += "static_assert(" + traits +
                  "::kThreads == " + std::to_string(detail::marlin_moe_threads(*p)) +
                  ", \"host marlin_moe_threads disagrees with kThreads\");\n";
  }
  if (const auto* p = std::get_if<MoeRouteParams>(&spec.params)) {
    src.source +=
        "static_assert(" + traits + "::kRankSharedBytes == " +
        std::to_string(detail::route_rank_shared_bytes(p->num_experts, p->block_threads)) +
        ", \"host route_rank_shared_bytes disagrees with kRankSharedBytes\");\n";
  }
  if (const auto* p = std::get_if<MoeDecodeParams>(&spec.params)) {
    // The launch geometry and the workspace check of the op come from these host values.
    const auto check = [&](const std::string& device, const std::string& host, const char* what) {
      src.source += "static_assert(" + device + " == " + host + ", \"host " + what +
                    " disagrees with the kernel's\");\n";
    };
    if (detail::decode_pair_kernel(p->kernel)) {
      const bool fc1 = p->kernel == moejit::DecodeKernel::kPairFc1;
      check(traits + (fc1 ? "::kGeo.fc1_smem_bytes()" : "::kGeo.fc2_smem_bytes()"),
            std::to_string(detail::decode_moe_smem_bytes(*p)), "decode_moe_smem_bytes");
      check(traits + "::kGeo.workspace_bytes()",
            std::to_string(detail::decode_moe_workspace_bytes(*p)) + "LL",
            "decode_moe_workspace_bytes");
      check("moejit::kern::moe::decode::kPairFc1Threads",
            std::to_string(detail::kDecodePairFc1Threads), "kDecodePairFc1Threads");
      check("moejit::kern::moe::decode::kPairFc2Threads",
            std::to_string(detail::kDecodePairFc2Threads), "kDecodePairFc2Threads");
      check(std::string("static_cast<int>(") + traits + "::kGeo.rule())", "0",
            "PairGeometry::rule() (kOk)");
      return src;
    }
    check(traits + "::kGeo.smem_bytes()", std::to_string(detail::decode_moe_smem_bytes(*p)),
          "decode_moe_smem_bytes");
    check(traits + "::kGeo.blocks_per_sm()", std::to_string(detail::decode_moe_blocks_per_sm(*p)),
          "decode_moe_blocks_per_sm");
    check(traits + "::kMinBlocksPerSm", std::to_string(detail::decode_moe_blocks_per_sm(*p)),
          "decode_moe_blocks_per_sm (launch bounds)");
    check(traits + "::kGeo.workspace_bytes()",
          std::to_string(detail::decode_moe_workspace_bytes(*p)) + "LL",
          "decode_moe_workspace_bytes");
    check("moejit::kern::moe::decode::kThreads", std::to_string(detail::kDecodeThreads),
          "kDecodeThreads");
    check("moejit::kern::moe::decode::kMaxTokens", std::to_string(detail::kDecodeMaxTokens),
          "kDecodeMaxTokens");
    check(std::string("static_cast<int>(") + traits + "::kGeo.rule())", "0",
          "Geometry::rule() (kOk)");
  }
  return src;
}

struct Outcome {
  std::string name;
  std::string error;  // empty on success
  std::string lowered;
  std::string log;
  std::size_t cubin_size = 0;
  bool elf = false;
  double ms = 0;
  int faulting_copies = -1;   // count_faulting_hinted_copies of the cubin compile() returned
  bool hint_dropped = false;  // compiled again with kNoL2CacheHintOption
};

// Compiles every spec on a few threads (NVRTC programs are independent); returns in order.
std::vector<Outcome> compile_all(const std::vector<KernelSpec>& specs, double* wall_seconds,
                                 unsigned* threads_used) {
  std::vector<Outcome> outcomes(specs.size());
  std::atomic<std::size_t> next{0};
  const unsigned threads = std::max(2u, std::min(8u, std::thread::hardware_concurrency()));
  const auto start = std::chrono::steady_clock::now();
  auto worker = [&] {
    for (std::size_t i = next++; i < specs.size(); i = next++) {
      Outcome& out = outcomes[i];
      out.name = specs[i].display_name();
      try {
        const detail::CompiledKernel kernel =
            detail::compile(with_host_checks(specs[i]), specs[i].arch, "");
        out.lowered = kernel.lowered_name;
        out.log = kernel.log;
        out.cubin_size = kernel.cubin.size();
        out.elf = kernel.cubin.compare(0, 4,
                                       "\x7f"
                                       "ELF") == 0;
        out.ms = kernel.compile_ms;
        out.faulting_copies = detail::count_faulting_hinted_copies(kernel.cubin);
        out.hint_dropped = std::find(kernel.options.begin(), kernel.options.end(),
                                     detail::kNoL2CacheHintOption) != kernel.options.end();
      } catch (const std::exception& e) {
        out.error = e.what();
      }
    }
  };
  std::vector<std::thread> pool;
  for (unsigned t = 0; t < threads; ++t) pool.emplace_back(worker);
  for (std::thread& t : pool) t.join();
  *wall_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  *threads_used = threads;
  return outcomes;
}

// Sum of the "N bytes spill stores" and "N bytes spill loads" ptxas reports (-Xptxas=-v); -1
// when the log has no such report.
long long spill_bytes(const std::string& log) {
  long long total = -1;
  for (const char* what : {" bytes spill stores", " bytes spill loads"}) {
    for (std::size_t at = log.find(what); at != std::string::npos; at = log.find(what, at + 1)) {
      std::size_t begin = at;
      while (begin > 0 && log[begin - 1] >= '0' && log[begin - 1] <= '9') --begin;
      if (begin == at) continue;
      total = std::max(total, 0LL) + std::stoll(log.substr(begin, at - begin));
    }
  }
  return total;
}

void check_outcomes(const std::vector<KernelSpec>& specs, const std::vector<Outcome>& outcomes) {
  for (std::size_t i = 0; i < specs.size(); ++i) {
    const Outcome& out = outcomes[i];
    INFO(out.name << (out.error.empty() ? "" : ": " + out.error));
    CHECK(out.error.empty());
    if (!out.error.empty()) continue;
    CHECK(out.elf);
    CHECK(contains(out.lowered, function_of(specs[i])));
    CHECK(contains(out.log, "registers"));
  }
}

void report(const char* arch, const std::vector<Outcome>& outcomes, double wall, unsigned threads) {
  double total_ms = 0;
  double slowest_ms = 0;
  std::string slowest;
  for (const Outcome& out : outcomes) {
    total_ms += out.ms;
    if (out.ms > slowest_ms) {
      slowest_ms = out.ms;
      slowest = out.name;
    }
  }
  std::printf(
      "moe compile %s: %zu kernels, %.1f s of NVRTC, %.1f s wall on %u threads; slowest "
      "%s (%.2f s)\n",
      arch, outcomes.size(), total_ms / 1000.0, wall, threads, slowest.c_str(),
      slowest_ms / 1000.0);
  for (const Outcome& out : outcomes) {
    if (out.hint_dropped) std::printf("  without the L2 cache hint: %s\n", out.name.c_str());
  }
}

// Why: a cubin with the [R+UR] cp.async form stops at its first copy (compile/cubin_check.hpp);
// compile() must never return one.
void check_no_faulting_copies(const std::vector<Outcome>& outcomes) {
  for (const Outcome& out : outcomes) {
    if (!out.error.empty()) continue;
    INFO(out.name);
    CHECK(out.faulting_copies == 0);
  }
}

// Why: a warpgroup tile that runs out of registers spills and gets every wgmma serialized
// (ptxas waits after each one, note C7512), which measured 3-5% slower per layer; any call in
// the kernel (a printf's included) serializes them too (note C7510). Every such ptxas note says
// "wgmma.mma_async instructions are serialized".
void check_warpgroup_tiles_unspilled(const std::vector<KernelSpec>& specs,
                                     const std::vector<Outcome>& outcomes) {
  for (std::size_t i = 0; i < specs.size(); ++i) {
    const auto* p = std::get_if<MarlinMoeParams>(&specs[i].params);
    if (p == nullptr || p->wgmma_n == 0 || !outcomes[i].error.empty()) continue;
    INFO(outcomes[i].name << "\n" << outcomes[i].log);
    CHECK(spill_bytes(outcomes[i].log) == 0);
    CHECK_FALSE(contains(outcomes[i].log, "instructions are serialized"));
  }
}

}  // namespace

TEST_CASE("every planned MoE kernel of every reference shape compiles for sm_90a", "[nvrtc]") {
  const std::vector<KernelSpec> specs = planned_moe(reference_shapes(), Arch::parse("sm_90a"));
  // Every family is there (the int64-id shape adds narrow_ids).
  for (Family family : {Family::kRoute, Family::kRepack, Family::kMarlinMoe, Family::kCombine,
                        Family::kNarrowIds}) {
    INFO(moejit::family_name(family));
    CHECK(std::any_of(specs.begin(), specs.end(),
                      [&](const KernelSpec& s) { return s.family == family; }));
  }
  double wall = 0;
  unsigned threads = 0;
  const std::vector<Outcome> outcomes = compile_all(specs, &wall, &threads);
  check_outcomes(specs, outcomes);
  check_no_faulting_copies(outcomes);
  check_warpgroup_tiles_unspilled(specs, outcomes);
  report("sm_90a", outcomes, wall, threads);
}

TEST_CASE("every planned MoE kernel of the public shapes compiles for sm_90a", "[nvrtc]") {
  // Shapes a model integrator brings (tools/shapes/public.json): top-k 1 and 2, 8-60 experts,
  // I = 1408, 6400 and 14336, H = 1536, 5120 and 7168.
  const std::vector<KernelSpec> specs =
      planned_moe(moejit::test::public_shapes(), Arch::parse("sm_90a"));
  REQUIRE_FALSE(specs.empty());
  double wall = 0;
  unsigned threads = 0;
  const std::vector<Outcome> outcomes = compile_all(specs, &wall, &threads);
  check_outcomes(specs, outcomes);
  check_no_faulting_copies(outcomes);
  check_warpgroup_tiles_unspilled(specs, outcomes);
  report("sm_90a (public shapes)", outcomes, wall, threads);
}

TEST_CASE("on sm_89 (99 KB a CTA) the widest GEMM tile runs three stages and compiles", "[nvrtc]") {
  const Arch arch = Arch::parse("sm_89");
  std::vector<KernelSpec> specs;
  for (const KernelSpec& spec : planned_moe(reference_shapes(), arch)) {
    const auto* p = std::get_if<MarlinMoeParams>(&spec.params);
    if (p == nullptr || p->block_m != 128 || p->block_n != 64) continue;
    INFO(spec.display_name());
    CHECK(p->stages == 3);  // four need 105,216 bytes
    CHECK(moejit::supports(spec).empty());
    specs.push_back(spec);
  }
  REQUIRE_FALSE(specs.empty());
  double wall = 0;
  unsigned threads = 0;
  const std::vector<Outcome> outcomes = compile_all(specs, &wall, &threads);
  check_outcomes(specs, outcomes);
  report("sm_89", outcomes, wall, threads);
}

TEST_CASE("on sm_75, the lowest arch NVRTC targets, every MoE kernel supports() accepts compiles",
          "[nvrtc]") {
  // Why: supports() is the only gate before NVRTC; a kernel it accepts that ptxas then refuses
  // fails at prewarm with a compile error (and a saved source) instead of the planner's reason.
  const Arch arch = Arch::parse("sm_75");
  std::vector<KernelSpec> accepted;
  for (const KernelSpec& spec : planned_moe(reference_shapes(), arch)) {
    const std::string why = moejit::supports(spec);
    INFO(spec.display_name() << ": " << why);
    // marlin_moe needs bf16 mma.sync, combine cvt.rn.bf16x2.f32: both sm_80.
    const bool needs_sm80 = spec.family == Family::kMarlinMoe || spec.family == Family::kCombine;
    CHECK(why.empty() == !needs_sm80);
    if (needs_sm80) CHECK(contains(why, "needs sm_80 or newer"));
    if (why.empty()) accepted.push_back(spec);
  }
  for (Family family : {Family::kRoute, Family::kRepack, Family::kNarrowIds}) {
    INFO(moejit::family_name(family));
    CHECK(std::any_of(accepted.begin(), accepted.end(),
                      [&](const KernelSpec& s) { return s.family == family; }));
  }
  double wall = 0;
  unsigned threads = 0;
  const std::vector<Outcome> outcomes = compile_all(accepted, &wall, &threads);
  check_outcomes(accepted, outcomes);
  report("sm_75", outcomes, wall, threads);
}

TEST_CASE("MoE kernels compile for sm_100a: every GEMM, and route/combine of two shapes",
          "[nvrtc]") {
  const Arch arch = Arch::parse("sm_100a");
  const std::vector<ModelShape> shapes = reference_shapes();
  std::vector<KernelSpec> specs;
  for (const KernelSpec& spec : planned_moe(shapes, arch)) {
    // All GEMM variants (every tile, activation and bias), repack and narrow_ids.
    if (spec.family == Family::kMarlinMoe || spec.family == Family::kRepack ||
        spec.family == Family::kNarrowIds) {
      specs.push_back(spec);
    }
  }
  // Route and combine of the smallest and the largest expert count (E = 32 and 896).
  for (const char* name : {"gpt-oss-20b", "kimi-k3.1-tp8"}) {
    for (const ModelShape& shape : shapes) {
      if (shape.name != name) continue;
      for (const KernelSpec& spec : moejit::plan_kernels(shape, arch)) {
        if (spec.family == Family::kRoute || spec.family == Family::kCombine) {
          specs.push_back(spec);
        }
      }
    }
  }
  double wall = 0;
  unsigned threads = 0;
  const std::vector<Outcome> outcomes = compile_all(specs, &wall, &threads);
  check_outcomes(specs, outcomes);
  check_no_faulting_copies(outcomes);
  report("sm_100a", outcomes, wall, threads);
}

TEST_CASE("the MoE kernels' static_asserts fire under NVRTC, matching supports()", "[nvrtc]") {
  struct Case {
    const char* header;
    const char* name_expression;
    const char* message;
  };
  const Case cases[] = {
      {"moe/moe_gemm.cuh",
       "moejit::kern::moe::moe_gemm<moejit::kern::moe::MoeGemmTraits<48, 8, 256, 4, 2, 1, 1, 4, "
       "false, moejit::kern::moe::Fc1Epilogue<moejit::kern::moe::act::SwiGLU, false>>>",
       "kBlockM must be a multiple of 16 * kWarpsM"},
      {"moe/moe_gemm.cuh",
       "moejit::kern::moe::moe_gemm<moejit::kern::moe::MoeGemmTraits<64, 8, 256, 1, 4, 1, 1, 4, "
       "true, moejit::kern::moe::Fc2Epilogue<false, false>>>",
       "kStages must be >= 2"},
      {"moe/moe_gemm_wg.cuh",
       "moejit::kern::moe::moe_gemm_wg<moejit::kern::moe::MoeGemmWgTraits<128, 2, 1, 2, 2, 64, "
       "true, moejit::kern::moe::Fc2Epilogue<false, false>>>",
       "kStages must be >= 3"},
      {"moe/moe_gemm_wg.cuh",
       "moejit::kern::moe::moe_gemm_wg<moejit::kern::moe::MoeGemmWgTraits<64, 2, 1, 4, 2, 4, "
       "true, moejit::kern::moe::Fc2Epilogue<false, false>>>",
       "kRouteBlock must be kBlockN / 1, 2, 4, 8 or 16"},
      {"moe/moe_gemm.cuh",
       "moejit::kern::moe::moe_gemm<moejit::kern::moe::MoeGemmTraits<64, 128, 256, 16, 4, 1, 1, 1, "
       "true, moejit::kern::moe::Fc2Epilogue<false, false>>>",
       "shared memory over the sm_90 limit"},
      {"moe/moe_gemm.cuh",
       "moejit::kern::moe::moe_gemm<moejit::kern::moe::MoeGemmTraits<64, 8, 256, 4, 4, 1, 1, 4, "
       "false, moejit::kern::moe::Fc1Epilogue<moejit::kern::moe::act::ClampedSwiGLU<-1, 1>, "
       "false>>>",
       "the clamp limit must be positive"},
      {"moe/route.cuh",
       "moejit::kern::moe::route_single_kernel<moejit::kern::moe::RouteTraits<128, 4, 12, 1024, "
       "1024>>",
       "BlockM must be 8, 16, 32, 64 or 128"},
      {"moe/route.cuh",
       "moejit::kern::moe::route_rank_kernel<moejit::kern::moe::RouteTraits<896, 16, 8, 1024, "
       "1024>>",
       "static shared memory"},
      {"moe/combine.cuh",
       "moejit::kern::moe::combine_kernel<moejit::kern::moe::CombineTraits<12, 4, false, 256>>",
       "Hidden must be a positive multiple of 8"},
      {"moe/narrow_ids.cuh",
       "moejit::kern::moe::narrow_ids_kernel<moejit::kern::moe::NarrowIdsTraits<48>>",
       "BlockThreads must be a multiple of 32"},
      {"moe/repack.cuh",
       "moejit::kern::moe::repack_mxfp4<moejit::kern::moe::RepackTraits<true, 2048>>",
       "kThreads must be a multiple of 32 in [32, 1024]"},
  };
  for (const Case& c : cases) {
    INFO(c.name_expression);
    detail::GeneratedSource src;
    src.file_name = "moe_bad_traits.cu";
    src.source = std::string("#include <moejit/kern/") + c.header + ">\n";
    src.name_expression = c.name_expression;
    try {
      detail::compile(src, Arch::parse("sm_90a"), "");
      FAIL("NVRTC accepted " << c.name_expression);
    } catch (const CompileError& e) {
      CHECK(contains(e.log(), c.message));
    }
  }
}

namespace {

// The distinct decode_moe kernels `shapes` need on `arch`, in plan order.
// Every decode_moe kernel prewarm plans, plus the block_n 32 tile a caller may force
// (MoeForwardOptions::decode_block_n) for every served shape: it must compile too.
std::vector<KernelSpec> planned_decode(const std::vector<ModelShape>& shapes, const Arch& arch) {
  std::vector<KernelSpec> specs;
  const auto add = [&specs](const KernelSpec& spec) {
    if (std::find(specs.begin(), specs.end(), spec) == specs.end()) specs.push_back(spec);
  };
  for (const ModelShape& shape : shapes) {
    for (const KernelSpec& spec : moejit::plan_kernels(shape, arch)) {
      if (spec.family == Family::kDecodeMoe) add(spec);
    }
    if (!detail::decode_moe_problem(shape).empty()) continue;
    const MoeDecodeParams wide = detail::choose_decode_config(shape, 256, 32);
    add(detail::decode_moe_spec(wide, arch));
    add(detail::decode_moe_spec(detail::decode_reset_params(wide), arch));
    add(detail::decode_moe_spec(detail::decode_combine_params(wide), arch));
  }
  return specs;
}

// The reference shapes, plus one decode_moe serves with int64 ids (read directly by the kernel).
std::vector<ModelShape> decode_shapes() {
  std::vector<ModelShape> shapes = reference_shapes();
  for (const ModelShape& shape :
       moejit::load_shapes_file(moejit::test::shapes_dir() + "/reference.json")) {
    if (shape.name != "qwen3-30b-a3b") continue;
    ModelShape wide = shape;
    wide.name += "-int64-ids";
    wide.id_dtype = DType::kI64;
    shapes.push_back(wide);
  }
  return shapes;
}

// The "Used N registers" ptxas reports (-Xptxas=-v); -1 when the log has none.
int used_registers(const std::string& log) {
  const std::string what = "Used ";
  const std::size_t at = log.find(what);
  if (at == std::string::npos) return -1;
  std::size_t end = at + what.size();
  while (end < log.size() && log[end] >= '0' && log[end] <= '9') ++end;
  if (end == at + what.size() || log.compare(end, 10, " registers") != 0) return -1;
  return std::stoi(log.substr(at + what.size(), end - at - what.size()));
}

void check_decode_outcomes(const std::vector<KernelSpec>& specs,
                           const std::vector<Outcome>& outcomes) {
  check_outcomes(specs, outcomes);
  for (std::size_t i = 0; i < specs.size(); ++i) {
    const Outcome& out = outcomes[i];
    if (!out.error.empty()) continue;
    INFO(out.name << "\n" << out.log);
    // Why: a spill in the consumers' MMA loop or the producer's copy loop costs the bandwidth
    // the kernel exists for.
    CHECK(spill_bytes(out.log) == 0);
    // Why: one CTA of each pair kernel shares an SM (fc2 loads its weights while fc1 runs), so
    // fc1's 544 threads and fc2's 288 must fit the 64K registers together: at most 72 and 88
    // registers a thread (39168 + 25344 = 64512).
    const auto kernel = std::get<MoeDecodeParams>(specs[i].params).kernel;
    if (kernel == moejit::DecodeKernel::kPairFc1 || kernel == moejit::DecodeKernel::kPairFc2) {
      const int registers = used_registers(out.log);
      CHECK(registers > 0);
      CHECK(registers <= (kernel == moejit::DecodeKernel::kPairFc1 ? 72 : 88));
    }
  }
}

}  // namespace

TEST_CASE("every planned decode_moe kernel compiles for sm_90a with no spills", "[nvrtc][decode]") {
  const Arch arch = Arch::parse("sm_90a");
  const std::vector<ModelShape> shapes = decode_shapes();
  const std::vector<KernelSpec> specs = planned_decode(shapes, arch);
  // Every served shape contributes (gpt-oss none), both kernels, both id types, both block_n.
  for (const ModelShape& shape : shapes) {
    INFO(shape.name);
    const bool served = detail::decode_moe_problem(shape).empty();
    for (const KernelSpec& spec : moejit::plan_kernels(shape, arch)) {
      if (spec.family != Family::kDecodeMoe) continue;
      CHECK(served);
      CHECK(std::find(specs.begin(), specs.end(), spec) != specs.end());
    }
  }
  const auto any = [&](const std::function<bool(const MoeDecodeParams&)>& pred) {
    return std::any_of(specs.begin(), specs.end(), [&](const KernelSpec& s) {
      return pred(std::get<MoeDecodeParams>(s.params));
    });
  };
  CHECK(any([](const MoeDecodeParams& p) { return p.kernel == moejit::DecodeKernel::kReset; }));
  CHECK(any([](const MoeDecodeParams& p) { return p.kernel == moejit::DecodeKernel::kPairFc1; }));
  CHECK(any([](const MoeDecodeParams& p) { return p.kernel == moejit::DecodeKernel::kPairFc2; }));
  CHECK(any([](const MoeDecodeParams& p) { return p.max_tokens == 2; }));
  CHECK(any([](const MoeDecodeParams& p) { return p.id_dtype == DType::kI64; }));
  CHECK(any([](const MoeDecodeParams& p) { return p.block_n == 32; }));
  CHECK(any([](const MoeDecodeParams& p) { return p.block_n == 16; }));
  double wall = 0;
  unsigned threads = 0;
  const std::vector<Outcome> outcomes = compile_all(specs, &wall, &threads);
  check_decode_outcomes(specs, outcomes);
  check_no_faulting_copies(outcomes);
  report("sm_90a decode_moe", outcomes, wall, threads);
}

TEST_CASE("decode_moe compiles for sm_100a: one tile of every served shape", "[nvrtc][decode]") {
  const Arch arch = Arch::parse("sm_100a");
  std::vector<KernelSpec> specs;
  for (const ModelShape& shape : decode_shapes()) {
    if (!detail::decode_moe_problem(shape).empty()) continue;
    // T = 1: the two-launch pair where it serves the shape; T = 3: the persistent tile.
    for (int tokens : {1, 3}) {
      const detail::MoeForwardConfig config = detail::choose_moe_config(shape, tokens);
      REQUIRE(config.decode);
      for (const MoeDecodeParams& p : {config.decode_first, config.decode_second}) {
        const KernelSpec spec = detail::decode_moe_spec(p, arch);
        if (std::find(specs.begin(), specs.end(), spec) == specs.end()) specs.push_back(spec);
      }
    }
  }
  CHECK(specs.size() >= 4 * 6);
  double wall = 0;
  unsigned threads = 0;
  const std::vector<Outcome> outcomes = compile_all(specs, &wall, &threads);
  check_decode_outcomes(specs, outcomes);
  check_no_faulting_copies(outcomes);
  report("sm_100a decode_moe", outcomes, wall, threads);
}

TEST_CASE("decode_moe's static_asserts fire under NVRTC and match supports()", "[nvrtc][decode]") {
  struct Case {
    MoeDecodeParams params;
    const char* message;  // the static_assert's
    const char* reason;   // supports()'s
  };
  MoeDecodeParams good;
  good.num_experts = 128;
  good.top_k = 8;
  good.hidden = 2048;
  good.intermediate = 768;
  good.block_n = 16;
  good.fc1_strips = 2;
  good.fc2_strips = 4;
  good.stages = 4;
  std::vector<Case> cases;
  MoeDecodeParams p = good;
  p.hidden = 2880;
  cases.push_back({p, "hidden must be a multiple of 256", "hidden = 2880"});
  p = good;
  p.intermediate = 320;
  cases.push_back({p, "inter must be a multiple of 128", "intermediate = 320"});
  p = good;
  p.block_n = 24;
  cases.push_back({p, "block_n must be 8, 16 or 32", "block_n = 24"});
  p = good;
  p.stages = 9;
  cases.push_back({p, "2 <= stages <= 8", "stages = 9"});
  p = good;
  p.fc2_strips = 2;
  cases.push_back({p, "fc2_strips must be 4 or 8", "fc2_strips = 2"});
  p = good;
  p.fc1_strips = 1;
  cases.push_back({p, "fc1_strips must be 2, 4 or 8", "fc1_strips = 1"});
  p = good;
  p.block_n = 32;
  p.stages = 8;
  cases.push_back({p, "shared memory over 227 KB", "bytes of shared memory"});
  for (const Case& c : cases) {
    // The spec is refused before any compile; the kernel refuses the same traits on its own.
    KernelSpec spec;
    spec.family = Family::kDecodeMoe;
    spec.arch = Arch::parse("sm_90a");
    spec.params = c.params;
    INFO(spec.display_name());
    CHECK(contains(moejit::supports(spec), c.reason));
    spec.params = good;
    detail::GeneratedSource src = detail::render(spec);
    const std::string good_traits = traits_of(src.name_expression);
    spec.params = c.params;
    const std::string bad_traits =
        "moejit::kern::moe::decode::DecodeTraits<" + std::to_string(c.params.num_experts) + ", " +
        std::to_string(c.params.top_k) + ", " + std::to_string(c.params.hidden) + ", " +
        std::to_string(c.params.intermediate) + ", " + std::to_string(c.params.block_n) + ", " +
        std::to_string(c.params.fc1_strips) + ", " + std::to_string(c.params.fc2_strips) + ", " +
        std::to_string(c.params.stages) + ", moejit::kern::moe::act::SwiGLU, false>";
    REQUIRE(contains(good_traits, "DecodeTraits<128, 8, 2048, 768, 16, 2, 4, 4,"));
    src.file_name = "decode_bad_traits.cu";
    src.name_expression = "moejit::kern::moe::decode::decode_moe<" + bad_traits + ">";
    try {
      detail::compile(src, Arch::parse("sm_90a"), "");
      FAIL("NVRTC accepted " << src.name_expression);
    } catch (const CompileError& e) {
      CHECK(contains(e.log(), c.message));
    }
  }
}

TEST_CASE("decode_moe pair: its static_asserts fire under NVRTC and match supports()",
          "[nvrtc][decode]") {
  struct Case {
    MoeDecodeParams params;
    const char* message;  // the static_assert's
    const char* reason;   // supports()'s
  };
  MoeDecodeParams good;
  good.kernel = moejit::DecodeKernel::kPairFc1;
  good.num_experts = 128;
  good.top_k = 8;
  good.hidden = 2048;
  good.intermediate = 768;
  good.max_tokens = 2;
  REQUIRE(moejit::supports(detail::decode_moe_spec(good, Arch::parse("sm_90a"))).empty());
  std::vector<Case> cases;
  MoeDecodeParams p = good;
  p.hidden = 2816;  // a multiple of 256 (the persistent tile's rule), not of 512
  cases.push_back(
      {p, "hidden must be a multiple of 512", "hidden = 2816 is not a multiple of 512"});
  p = good;
  p.intermediate = 800;
  cases.push_back({p, "inter must be a multiple of 64", "intermediate = 800"});
  p = good;
  p.max_tokens = 3;
  cases.push_back({p, "max_tokens in {1, 2, 4, 8}", "max_tokens = 3 with top_k = 8"});
  p = good;
  p.max_tokens = 8;
  p.top_k = 16;
  cases.push_back({p, "max_tokens * top_k <= 64", "max_tokens = 8 with top_k = 16"});
  p = good;
  p.intermediate = 2560;
  p.hidden = 3584;
  p.kernel = moejit::DecodeKernel::kPairFc2;
  cases.push_back({p, "fc2 8 units within 112 KB", "FC2 units"});
  for (const Case& c : cases) {
    KernelSpec spec = detail::decode_moe_spec(c.params, Arch::parse("sm_90a"));
    INFO(spec.display_name());
    CHECK(contains(moejit::supports(spec), c.reason));
    // The kernel refuses the same traits on its own.
    spec.params = good;
    detail::GeneratedSource src = detail::render(spec);
    REQUIRE(contains(src.name_expression, "PairTraits<128, 8, 2048, 768, 2,"));
    const std::string bad_traits =
        "moejit::kern::moe::decode::PairTraits<" + std::to_string(c.params.num_experts) + ", " +
        std::to_string(c.params.top_k) + ", " + std::to_string(c.params.hidden) + ", " +
        std::to_string(c.params.intermediate) + ", " + std::to_string(c.params.max_tokens) +
        ", moejit::kern::moe::act::SwiGLU, false>";
    src.file_name = "decode_pair_bad_traits.cu";
    src.name_expression = "moejit::kern::moe::decode::decode_pair_fc2<" + bad_traits + ">";
    try {
      detail::compile(src, Arch::parse("sm_90a"), "");
      FAIL("NVRTC accepted " << src.name_expression);
    } catch (const CompileError& e) {
      CHECK(contains(e.log(), c.message));
    }
  }
}
