// `moejit plan FILE [--shape NAME] [--arch ARCH]`: what each shape runs, without compiling: the
// repacked weight and workspace sizes an engine allocates, whether decode_moe serves the shape,
// and, per range of T, the kernels moe_forward launches (the automatic path and the one a call
// can force). Every kernel named is one `moejit prewarm` compiles.
#include <cstddef>
#include <iostream>
#include <string>
#include <utility>
#include <vector>

#include "cli/cli.hpp"
#include "moejit/moe.hpp"
#include "plan/moe_plan.hpp"

namespace moejit::cli {

namespace {

// The kernels of one path of a forward call, in launch order, with what the path is.
struct PathKernels {
  std::string what;
  std::vector<KernelSpec> kernels;
  friend bool operator==(const PathKernels& a, const PathKernels& b) {
    return a.what == b.what && a.kernels == b.kernels;
  }
};

// What moe_forward runs at one T on `arch`: the automatic path first, then the path a call can
// force instead (none where no other path runs on `arch`, and no forced decode path where
// `decode_forcible` is false: moe_forward refuses MoePath::kDecode for the whole shape where
// decode_moe_problem names a T it can't serve).
std::vector<PathKernels> forward_paths(const detail::MoeForwardConfig& config, const Arch& arch,
                                       bool decode_forcible) {
  const detail::MoeForwardSpecs s = detail::moe_forward_specs(config, arch);
  PathKernels decode{config.decode_pair ? "decode_moe, two-launch tile"
                                         : "decode_moe, persistent tile",
                     detail::decode_chain(s)};
  PathKernels marlin{"marlin_moe", detail::marlin_chain(s)};
  if (s.decode && detail::decode_by_default(config)) {
    decode.what += " (automatic)";
    marlin.what += " (MoePath::kMarlin)";
    return {decode, marlin};
  }
  marlin.what += " (automatic)";
  if (!s.decode || !decode_forcible) return {marlin};
  decode.what += " (MoePath::kDecode)";
  return {marlin, decode};
}

std::string token_range(int first, int last) {
  return first == last ? "T = " + std::to_string(first)
                       : "T = " + std::to_string(first) + ".." + std::to_string(last);
}

std::string bytes_text(std::size_t bytes) {
  return std::to_string(bytes) + " bytes (" + format_bytes(bytes) + ")";
}

void print_plan(const ModelShape& shape, const Arch& arch) {
  // Why plan_kernels first: it refuses a shape the op can't serve, with the reason, before any
  // size below is computed from it.
  const std::vector<KernelSpec> all = plan_kernels(shape, arch);
  std::cout << shape.name << " on " << arch.name() << ": " << shape.num_experts
            << " local experts (ids " << shape.expert_offset << ".."
            << shape.expert_offset + shape.num_experts - 1 << " of "
            << (shape.global_experts > 0 ? shape.global_experts : shape.num_experts)
            << " routed), top-k " << shape.top_k << ", hidden " << shape.hidden << ", intermediate "
            << shape.intermediate << ", " << activation_kind_name(shape.activation.kind)
            << (shape.has_bias ? ", biases" : "") << ", T <= " << shape.max_tokens << "\n";

  const MoeWeightLayout layout = moe_weight_layout(shape);
  const std::size_t weights = layout.w13_bytes + layout.w13_scale_bytes + layout.w2_bytes +
                              layout.w2_scale_bytes + layout.b13_bytes + layout.b2_bytes;
  std::cout << "  repacked weights: " << bytes_text(weights) << ": w13 "
            << format_bytes(layout.w13_bytes) << " + " << format_bytes(layout.w13_scale_bytes)
            << " scales, w2 " << format_bytes(layout.w2_bytes) << " + "
            << format_bytes(layout.w2_scale_bytes) << " scales";
  if (shape.has_bias) {
    std::cout << ", biases " << format_bytes(layout.b13_bytes + layout.b2_bytes);
  }
  std::cout << "; weight layout version " << layout.version << "\n";
  std::cout << "  workspace: " << bytes_text(moe_workspace_bytes(shape, shape.max_tokens))
            << " for T <= " << shape.max_tokens << "\n";
  // moe_decode_problem names the path itself ("decode_moe can't serve shape ...").
  const std::string decode_problem = moe_decode_problem(shape);
  std::cout << "  "
            << (decode_problem.empty() ? "decode_moe serves this shape for T <= " +
                                             std::to_string(detail::kDecodeMaxTokens) +
                                             " (on sm_90 and newer)"
                                       : decode_problem)
            << "\n";
  std::cout << "  kernels: " << all.size() << " (what `moejit prewarm` compiles for "
            << arch.name() << ")\n";
  for (const KernelSpec& spec : all) {
    if (spec.family == Family::kAppendShared || spec.family == Family::kRepack) {
      std::cout << "    " << spec.display_name() << "\n";
    }
  }

  // Runs of T whose kernels on this arch are the same, each printed once (the planner's runs
  // split further where only another arch's kernels change).
  auto print_run = [](int first, int last, const std::vector<PathKernels>& paths) {
    std::cout << "  " << token_range(first, last) << ":\n";
    for (const PathKernels& path : paths) {
      std::cout << "    " << path.what << "\n";
      for (const KernelSpec& spec : path.kernels) {
        std::cout << "      " << spec.display_name() << "\n";
      }
    }
  };
  std::vector<PathKernels> run;
  int run_first = 1;
  int run_last = 0;  // 0: no run yet
  for (int last : detail::moe_config_segment_ends(shape, shape.max_tokens)) {
    std::vector<PathKernels> paths =
        forward_paths(detail::choose_moe_config(shape, last), arch, decode_problem.empty());
    if (run_last > 0 && paths == run) {
      run_last = last;
      continue;
    }
    if (run_last > 0) print_run(run_first, run_last, run);
    run_first = run_last + 1;
    run_last = last;
    run = std::move(paths);
  }
  if (run_last > 0) print_run(run_first, run_last, run);
}

}  // namespace

int run_plan(const std::string& file, const std::string& shape_name, const std::string& arch_name) {
  std::vector<ModelShape> shapes = load_shape_files({file});
  const Arch arch = parse_arch_option(arch_name);
  if (!shape_name.empty()) shapes = {find_shape(shapes, shape_name, file)};
  require_arch_serves(shapes, arch);
  for (std::size_t i = 0; i < shapes.size(); ++i) {
    if (i > 0) std::cout << "\n";
    print_plan(shapes[i], arch);
  }
  return kExitOk;
}

}  // namespace moejit::cli
