// The planner: which kernels a model shape needs on one arch, every template argument fixed.
// Each family contributes one planning function; plan_kernels runs them all in a fixed order,
// so a new family is one more function and one more table row.
#include <algorithm>
#include <string>
#include <vector>

#include "moejit/error.hpp"
#include "moejit/kernel_spec.hpp"
#include "moejit/runtime.hpp"
#include "moejit/shape.hpp"
#include "plan/moe_plan.hpp"

namespace moejit {

namespace {

// Why: the kernel moves a few bytes per thread and waits on one memory round trip; small CTAs
// spread mid-sized batches over more SMs (T = 1024 with K + S = 9 is 72 CTAs of 128 rather than
// 36 of 256), and large batches still give every SM several CTAs.
constexpr int kAppendSharedBlockThreads = 128;

// append_shared: one kernel when the shape appends shared experts, none otherwise.
void plan_append_shared(const ModelShape& shape, const Arch& arch, std::vector<KernelSpec>& out) {
  if (shape.shared.count <= 0) return;
  AppendSharedParams params;
  params.top_k = shape.top_k;
  params.num_shared = shape.shared.count;
  params.id_dtype = shape.id_dtype;
  params.gate = shape.shared.gate;
  // Why: only a sigmoid gate reads logits of a chosen dtype; a given gate reads fp32 weights and
  // a constant gate reads nothing, so both are planned as f32 and specs that would generate the
  // same kernel compare equal.
  params.logit_dtype =
      shape.shared.gate == SharedGate::kSigmoid ? shape.shared.logit_dtype : DType::kF32;
  params.block_threads = kAppendSharedBlockThreads;
  KernelSpec spec;
  spec.family = Family::kAppendShared;
  spec.arch = arch;
  spec.params = params;
  out.push_back(spec);
}

void add_unique(const KernelSpec& spec, std::vector<KernelSpec>& out) {
  if (std::find(out.begin(), out.end(), spec) == out.end()) out.push_back(spec);
}

// repack: the two kernels every checkpoint layout uses (gpt-oss's interleaved w13 and DeepSeek's
// separate w1 / w3 differ only in the source strides the op passes, not in the kernel).
void plan_repack(const ModelShape&, const Arch& arch, std::vector<KernelSpec>& out) {
  for (bool gate_up : {true, false}) {
    KernelSpec spec;
    spec.family = Family::kRepack;
    spec.arch = arch;
    spec.params = detail::moe_repack_params(gate_up);
    out.push_back(spec);
  }
}

// The routed-expert layer: every kernel moe_forward can launch for any T in [1, max_tokens], i.e.
// the kernels of detail::choose_moe_config at the end of each run of T with one config (the
// config is constant over a run, so its end stands for all of it).
void plan_moe_forward(const ModelShape& shape, const Arch& arch, std::vector<KernelSpec>& out) {
  for (int tokens : detail::moe_config_segment_ends(shape, shape.max_tokens)) {
    const detail::MoeForwardConfig config = detail::choose_moe_config(shape, tokens);
    for (const KernelSpec& spec : detail::moe_config_specs(config, arch)) add_unique(spec, out);
  }
}

using FamilyPlanner = void (*)(const ModelShape&, const Arch&, std::vector<KernelSpec>&);

constexpr FamilyPlanner kPlanners[] = {
    plan_append_shared,
    plan_repack,
    plan_moe_forward,
};

}  // namespace

std::vector<KernelSpec> plan_kernels(const ModelShape& shape, const Arch& arch) {
  // Why here: a shape built in code reaches the planner without the shape-file rules, and a plan
  // of kernels for sizes no op can take would let prewarm report success for nothing.
  const std::string problem = detail::moe_shape_problem(shape);
  if (!problem.empty()) throw Error(ErrorCode::kInvalidDescriptor, "plan_kernels: " + problem);
  std::vector<KernelSpec> specs;
  for (FamilyPlanner planner : kPlanners) planner(shape, arch, specs);
  return specs;
}

}  // namespace moejit
