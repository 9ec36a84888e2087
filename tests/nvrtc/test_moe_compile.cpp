// NVRTC compiles of the MoE families: every kernel the planner lists for the reference shapes
// (sm_90a, all of them; sm_100a, a subset covering every family and GEMM tile), with the host's
// copies of the kernels' sizes checked against the traits inside the same compile, and the
// kernels' static_asserts firing under NVRTC. Needs the CUDA toolkit, no GPU.
#include <algorithm>
#include <atomic>
#include <catch2/catch.hpp>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <mutex>
#include <string>
#include <thread>
#include <variant>
#include <vector>

#include "codegen/codegen.hpp"
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
};

// Compiles every spec on a few threads (NVRTC programs are independent); returns in order.
std::vector<Outcome> compile_all(const std::vector<KernelSpec>& specs, double* wall_seconds,
                                 unsigned* threads_used) {
  const detail::ToolkitHeaders& toolkit = detail::toolkit_headers("");
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
            detail::compile(with_host_checks(specs[i]), specs[i].arch, toolkit, "");
        out.lowered = kernel.lowered_name;
        out.log = kernel.log;
        out.cubin_size = kernel.cubin.size();
        out.elf = kernel.cubin.compare(0, 4,
                                       "\x7f"
                                       "ELF") == 0;
        out.ms = kernel.compile_ms;
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

void check_outcomes(const std::vector<KernelSpec>& specs, const std::vector<Outcome>& outcomes) {
  for (std::size_t i = 0; i < specs.size(); ++i) {
    const Outcome& out = outcomes[i];
    INFO(out.name);
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
  report("sm_90a", outcomes, wall, threads);
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
      detail::compile(src, Arch::parse("sm_90a"), detail::toolkit_headers(""), "");
      FAIL("NVRTC accepted " << c.name_expression);
    } catch (const CompileError& e) {
      CHECK(contains(e.log(), c.message));
    }
  }
}
