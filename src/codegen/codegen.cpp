// Codegen: typed spec values mapped through tables to C++ spellings. Nothing from a descriptor is
// ever spliced into the source as free text.
#include "codegen/codegen.hpp"

#include <optional>
#include <sstream>
#include <string>
#include <variant>

#include "common/check.hpp"
#include "moejit/error.hpp"
#include "plan/moe_plan.hpp"
#include "plan/spec_names.hpp"

namespace moejit::detail {

namespace {

// The device type of an id dtype (kernels/common/types.cuh: kIsIdType).
const char* id_type_name(DType dtype) {
  switch (dtype) {
    case DType::kI32:
      return "int";
    case DType::kI64:
      return "long long";
    default:
      break;
  }
  throw Error(ErrorCode::kInternal, std::string("codegen: no id type for dtype ") +
                                        dtype_short_name(dtype) + " (supports() should refuse it)");
}

// The device type of a floating input dtype (kernels/common/types.cuh: kIsFloatInput).
const char* float_type_name(DType dtype) {
  switch (dtype) {
    case DType::kBF16:
      return "moejit::kern::bf16";
    case DType::kF16:
      return "moejit::kern::f16";
    case DType::kF32:
      return "float";
    default:
      break;
  }
  throw Error(ErrorCode::kInternal, std::string("codegen: no floating type for dtype ") +
                                        dtype_short_name(dtype) + " (supports() should refuse it)");
}

const char* gate_enumerator(SharedGate gate) {
  switch (gate) {
    case SharedGate::kSigmoid:
      return "moejit::kern::SharedGate::kSigmoid";
    case SharedGate::kConstant:
      return "moejit::kern::SharedGate::kConstant";
    case SharedGate::kGiven:
      return "moejit::kern::SharedGate::kGiven";
  }
  throw Error(ErrorCode::kInternal, "codegen: unknown SharedGate value");
}

// What differs between families: the header to include, the kernel's name expression, and the
// spec's part of the file name.
struct FamilyText {
  const char* header;
  std::string name_expression;
  std::string file_stem;
};

FamilyText family_text(const AppendSharedParams& p) {
  // Why: a constant gate reads no logits; naming float whatever the spec says keeps the source
  // (and so the cache key) one per real kernel.
  const DType logit = p.gate == SharedGate::kConstant ? DType::kF32 : p.logit_dtype;
  std::ostringstream name;
  name << "moejit::kern::append_shared_kernel<moejit::kern::AppendSharedTraits<" << p.top_k << ", "
       << p.num_shared << ", " << id_type_name(p.id_dtype) << ", " << gate_enumerator(p.gate)
       << ", " << float_type_name(logit) << ", " << p.block_threads << ">>";
  std::ostringstream stem;
  stem << "append_shared_k" << p.top_k << "_s" << p.num_shared << '_'
       << dtype_short_name(p.id_dtype) << '_' << gate_short_name(p.gate);
  if (p.gate != SharedGate::kConstant) stem << '_' << dtype_short_name(logit);
  stem << "_t" << p.block_threads;
  return FamilyText{"moejit/kern/append_shared.cuh", name.str(), stem.str()};
}

// ---- MoE families -----------------------------------------------------------------------------

constexpr const char* kMoeNs = "moejit::kern::moe::";

const char* route_kernel_function(RouteKernel kernel) {
  switch (kernel) {
    case RouteKernel::kSingle:
      return "route_single_kernel";
    case RouteKernel::kRank:
      return "route_rank_kernel";
    case RouteKernel::kScan:
      return "route_scan_kernel";
    case RouteKernel::kScatter:
      return "route_scatter_kernel";
  }
  throw Error(ErrorCode::kInternal, "codegen: unknown RouteKernel value");
}

FamilyText family_text(const MoeRouteParams& p) {
  std::ostringstream name;
  name << kMoeNs << route_kernel_function(p.kernel) << '<' << kMoeNs << "RouteTraits<"
       << p.num_experts << ", " << p.top_k << ", " << p.block_m << ", " << p.block_threads << ", "
       << p.chunk_rows;
  if (p.group_rows != 0) name << ", " << p.group_rows;  // GroupRows defaults to 0
  name << ">>";
  std::ostringstream stem;
  stem << "route_" << route_kernel_name(p.kernel) << "_e" << p.num_experts << "_k" << p.top_k
       << "_b" << p.block_m << "_t" << p.block_threads << "_c" << p.chunk_rows;
  if (p.group_rows != 0) stem << "_g" << p.group_rows;
  return FamilyText{"moejit/kern/moe/route.cuh", name.str(), stem.str()};
}

FamilyText family_text(const MoeRepackParams& p) {
  std::ostringstream name;
  name << kMoeNs << "repack_mxfp4<" << kMoeNs << "RepackTraits<" << (p.gate_up ? "true" : "false")
       << ", " << p.block_threads << ">>";
  std::ostringstream stem;
  stem << "repack_" << (p.gate_up ? "gate_up" : "plain") << "_t" << p.block_threads;
  return FamilyText{"moejit/kern/moe/repack.cuh", name.str(), stem.str()};
}

// A constant as the "num, den" template arguments of activation.cuh's Ratio.
struct RatioText {
  std::string args;  // "1702, 1000"
  std::string stem;  // "1702o1000"
};

RatioText ratio_text(const char* what, float value) {
  const std::optional<FloatRatio> ratio = float_ratio(value);
  if (!ratio) {
    throw Error(ErrorCode::kInternal, std::string("codegen: activation constant ") + what +
                                          " has no exact ratio (supports() should refuse it)");
  }
  return RatioText{std::to_string(ratio->num) + ", " + std::to_string(ratio->den),
                   std::to_string(ratio->num) + "o" + std::to_string(ratio->den)};
}

// The functor type of a gated activation, and its part of the file name.
struct ActivationText {
  std::string type;
  std::string stem;
};

ActivationText activation_type(const Activation& a) {
  const std::string ns = std::string(kMoeNs) + "act::";
  switch (a.kind) {
    case ActivationKind::kSwiGLU:
      return ActivationText{ns + "SwiGLU", "swiglu"};
    case ActivationKind::kClampedSwiGLU: {
      const RatioText limit = ratio_text("limit", a.limit);
      return ActivationText{ns + "ClampedSwiGLU<" + limit.args + ">",
                            "clamped_swiglu_l" + limit.stem};
    }
    case ActivationKind::kGptOss: {
      const RatioText alpha = ratio_text("alpha", a.alpha);
      const RatioText limit = ratio_text("limit", a.limit);
      return ActivationText{ns + "GptOssSwiGLU<" + alpha.args + ", " + limit.args + ">",
                            "gpt_oss_a" + alpha.stem + "_l" + limit.stem};
    }
    case ActivationKind::kSiTU: {
      const RatioText beta = ratio_text("beta", a.beta);
      const RatioText linear = ratio_text("linear_beta", a.linear_beta);
      return ActivationText{ns + "SiTU<" + beta.args + ", " + linear.args + ">",
                            "situ_b" + beta.stem + "_lb" + linear.stem};
    }
  }
  throw Error(ErrorCode::kInternal, "codegen: unknown ActivationKind value");
}

FamilyText family_text(const MarlinMoeParams& p) {
  const bool fc1 = p.stage == MoeGemmStage::kFc1;
  std::string epilogue;
  std::string epilogue_stem;
  if (fc1) {
    const ActivationText act = activation_type(p.activation);
    epilogue = std::string(kMoeNs) + "Fc1Epilogue<" + act.type + ", " +
               (p.has_bias ? "true" : "false") + ">";
    epilogue_stem = act.stem;
  } else {
    epilogue = std::string(kMoeNs) + "Fc2Epilogue<" +
               (p.out_dtype == DType::kBF16 ? "true" : "false") + ", " +
               (p.has_bias ? "true" : "false") + ">";
  }
  if (p.wgmma_n != 0) {
    const int groups = p.warps_m / 4;
    std::ostringstream name;
    name << kMoeNs << "moe_gemm_wg<" << kMoeNs << "MoeGemmWgTraits<" << p.wgmma_n << ", " << groups
         << ", " << p.block_m / (64 * groups) << ", " << p.stages << ", " << p.min_blocks_per_sm
         << ", " << p.block_n << ", "
         << (p.early_weights ? "true" : "false") << ", " << epilogue;
    if (p.k_splits != 1) name << ", " << p.k_splits;  // MoeGemmWgTraits' kKSplits, default 1
    name << ">>";
    std::ostringstream stem;
    stem << "marlin_moe_" << moe_gemm_stage_name(p.stage) << "_wgmma" << p.wgmma_n << "_m"
         << p.block_m << "_n" << p.block_n << "_s" << p.stages << "_g" << groups << "_o"
         << p.min_blocks_per_sm;
    if (p.k_splits != 1) stem << "_ks" << p.k_splits;
    if (p.early_weights) stem << "_early";
    if (fc1) stem << '_' << epilogue_stem;
    if (p.has_bias) stem << "_bias";
    stem << '_' << dtype_short_name(p.out_dtype);
    return FamilyText{"moejit/kern/moe/moe_gemm_wg.cuh", name.str(), stem.str()};
  }
  std::ostringstream name;
  name << kMoeNs << "moe_gemm<" << kMoeNs << "MoeGemmTraits<" << p.block_m << ", " << p.block_n
       << ", " << p.block_k << ", " << p.stages << ", " << p.warps_m << ", " << p.warps_n << ", "
       << p.warps_k << ", " << p.min_blocks_per_sm << ", "
       << (p.early_weights ? "true" : "false") << ", " << epilogue;
  if (p.k_splits != 1) name << ", " << p.k_splits;  // MoeGemmTraits' kKSplits, default 1
  name << ">>";
  std::ostringstream stem;
  stem << "marlin_moe_" << moe_gemm_stage_name(p.stage) << "_m" << p.block_m << "_n" << p.block_n
       << "_k" << p.block_k << "_s" << p.stages << "_w" << p.warps_m << 'x' << p.warps_n << 'x'
       << p.warps_k << "_o" << p.min_blocks_per_sm;
  if (p.k_splits != 1) stem << "_ks" << p.k_splits;
  if (p.early_weights) stem << "_early";
  if (fc1) stem << '_' << epilogue_stem;
  if (p.has_bias) stem << "_bias";
  stem << '_' << dtype_short_name(p.out_dtype);
  return FamilyText{"moejit/kern/moe/moe_gemm.cuh", name.str(), stem.str()};
}

FamilyText family_text(const MoeCombineParams& p) {
  std::ostringstream name;
  name << kMoeNs << "combine_kernel<" << kMoeNs << "CombineTraits<" << p.hidden << ", " << p.top_k
       << ", " << (p.in_dtype == DType::kBF16 ? "true" : "false") << ", " << p.block_threads;
  if (p.k_splits != 1) name << ", " << p.k_splits;  // CombineTraits' KSplits, default 1
  name << ">>";
  std::ostringstream stem;
  stem << "combine_h" << p.hidden << "_k" << p.top_k << '_' << dtype_short_name(p.in_dtype)
       << "_t" << p.block_threads;
  if (p.k_splits != 1) stem << "_ks" << p.k_splits;
  return FamilyText{"moejit/kern/moe/combine.cuh", name.str(), stem.str()};
}

FamilyText family_text(const NarrowIdsParams& p) {
  std::ostringstream name;
  name << kMoeNs << "narrow_ids_kernel<" << kMoeNs << "NarrowIdsTraits<" << p.block_threads
       << ">>";
  std::ostringstream stem;
  stem << "narrow_ids_t" << p.block_threads;
  return FamilyText{"moejit/kern/moe/narrow_ids.cuh", name.str(), stem.str()};
}

FamilyText family_text(const MoeDecodeParams& p) {
  const ActivationText act = activation_type(p.activation);
  const bool ids64 = p.id_dtype == DType::kI64;
  const std::string decode_ns = std::string(kMoeNs) + "decode::";
  std::ostringstream traits;
  std::ostringstream name;
  std::ostringstream stem;
  stem << "decode_moe_" << decode_kernel_name(p.kernel) << "_e" << p.num_experts << "_k" << p.top_k
       << "_h" << p.hidden << "_i" << p.intermediate;
  if (decode_pair_kernel(p.kernel)) {
    traits << decode_ns << "PairTraits<" << p.num_experts << ", " << p.top_k << ", " << p.hidden
           << ", " << p.intermediate << ", " << p.max_tokens << ", " << act.type << ", "
           << (ids64 ? "true" : "false") << '>';
    const bool fc1 = p.kernel == DecodeKernel::kPairFc1;
    name << decode_ns << (fc1 ? "decode_pair_fc1<" : "decode_pair_fc2<") << traits.str() << '>';
    stem << "_t" << p.max_tokens << '_' << act.stem << '_' << dtype_short_name(p.id_dtype);
    return FamilyText{"moejit/kern/moe/decode_pair.cuh", name.str(), stem.str()};
  }
  traits << decode_ns << "DecodeTraits<" << p.num_experts << ", " << p.top_k << ", " << p.hidden
         << ", " << p.intermediate << ", " << p.block_n << ", " << p.fc1_strips << ", "
         << p.fc2_strips << ", " << p.stages << ", " << act.type << ", "
         << (ids64 ? "true" : "false") << '>';
  const char* const kernel = p.kernel == DecodeKernel::kReset     ? "decode_moe_reset<"
                             : p.kernel == DecodeKernel::kCombine ? "decode_moe_combine<"
                                                                  : "decode_moe<";
  name << decode_ns << kernel << traits.str() << '>';
  stem << "_n" << p.block_n << "_f" << p.fc1_strips << 'x' << p.fc2_strips << "_s" << p.stages
       << '_' << act.stem << '_' << dtype_short_name(p.id_dtype);
  return FamilyText{"moejit/kern/moe/decode_moe.cuh", name.str(), stem.str()};
}

}  // namespace

GeneratedSource render(const KernelSpec& spec) {
  const std::string reason = supports(spec);
  MOEJIT_CHECK(reason.empty(), ErrorCode::kUnsupported, reason);
  const FamilyText text = std::visit([](const auto& p) { return family_text(p); }, spec.params);

  GeneratedSource out;
  out.file_name = text.file_stem + '_' + spec.arch.name() + ".cu";
  std::ostringstream source;
  source << "// Generated by libmoejit: " << spec.display_name() << "\n"
         << "#include <" << text.header << ">\n";
  out.source = source.str();
  out.name_expression = text.name_expression;
  return out;
}

}  // namespace moejit::detail
