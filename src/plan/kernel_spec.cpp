// KernelSpec: names, JSON, hashing and the supports() checks that run before any compile.
#include "moejit/kernel_spec.hpp"

#include <cctype>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <nlohmann/json.hpp>
#include <sstream>
#include <type_traits>

#include "common/check.hpp"
#include "common/text.hpp"
#include "moejit/error.hpp"
#include "plan/moe_plan.hpp"
#include "plan/spec_names.hpp"

namespace moejit {

namespace detail {

const char* dtype_short_name(DType dtype) noexcept {
  switch (dtype) {
    case DType::kBF16:
      return "bf16";
    case DType::kF16:
      return "f16";
    case DType::kF32:
      return "f32";
    case DType::kI32:
      return "i32";
    case DType::kI64:
      return "i64";
  }
  return "unknown";
}

const char* gate_short_name(SharedGate gate) noexcept {
  switch (gate) {
    case SharedGate::kSigmoid:
      return "sigmoid";
    case SharedGate::kConstant:
      return "constant";
    case SharedGate::kGiven:
      return "given";
  }
  return "unknown";
}

std::string activation_problem(const Activation& a) {
  const bool clamps = a.kind == ActivationKind::kClampedSwiGLU || a.kind == ActivationKind::kGptOss;
  const bool situ = a.kind == ActivationKind::kSiTU;
  if (a.kind != ActivationKind::kSwiGLU && !clamps && !situ) {
    return "activation kind " + std::to_string(static_cast<int>(a.kind)) +
           " is unknown; allowed: swiglu, clamped_swiglu, gpt_oss, situ";
  }
  // The shape rules' check (descriptor/shape_rules.cpp), in this layer's "name = value" form.
  const std::optional<ShapeViolation> v = activation_violation(a);
  if (!v) return "";
  const std::string prefix = "/activation/";
  const std::string name =
      v->field.compare(0, prefix.size(), prefix) == 0 ? v->field.substr(prefix.size()) : v->field;
  return "activation." + name + " = " + v->found + ": " + v->what + "; allowed: " + v->expected;
}

}  // namespace detail

namespace {

constexpr int kMinSm = 70;
constexpr int kMinArchSpecificSm = 90;

const char* const kArchForms =
    "expected \"sm_<NN>\" or \"sm_<NN>a\" with NN >= 70 (e.g. sm_80, sm_90a, sm_100a); the "
    "\"a\" (arch-specific) suffix needs NN >= 90";

// The reason `arch` is not a valid target, or "".
std::string arch_problem(const Arch& arch) {
  std::ostringstream os;
  if (arch.sm < kMinSm) {
    os << "arch sm " << arch.sm << " is below the minimum sm_" << kMinSm;
  } else if (arch.arch_specific && arch.sm < kMinArchSpecificSm) {
    os << "arch sm_" << arch.sm << "a: the \"a\" suffix needs sm >= " << kMinArchSpecificSm;
  }
  return os.str();
}

// "field = found; allowed: range" for the first broken rule of an append_shared spec.
std::string append_shared_problem(const AppendSharedParams& p) {
  std::ostringstream os;
  if (p.top_k < 1 || p.top_k > AppendSharedParams::kMaxTopK) {
    os << "top_k = " << p.top_k << " is out of range; allowed: 1.." << AppendSharedParams::kMaxTopK;
  } else if (p.num_shared < 1 || p.num_shared > AppendSharedParams::kMaxShared) {
    os << "num_shared = " << p.num_shared << " is out of range; allowed: 1.."
       << AppendSharedParams::kMaxShared << " (a shape without shared experts needs no kernel)";
  } else if (p.id_dtype != DType::kI32 && p.id_dtype != DType::kI64) {
    os << "id_dtype = " << detail::dtype_short_name(p.id_dtype)
       << " is not an id type; allowed: i32, i64";
  } else if (p.gate == SharedGate::kSigmoid && p.logit_dtype != DType::kBF16 &&
             p.logit_dtype != DType::kF16 && p.logit_dtype != DType::kF32) {
    os << "logit_dtype = " << detail::dtype_short_name(p.logit_dtype)
       << " with gate sigmoid; allowed: bf16, f16, f32";
  } else if (p.gate == SharedGate::kGiven && p.logit_dtype != DType::kF32) {
    os << "logit_dtype = " << detail::dtype_short_name(p.logit_dtype)
       << " with gate given (the given weights are read as fp32); allowed: f32";
  } else if (p.block_threads < 32 || p.block_threads > 1024 || p.block_threads % 32 != 0) {
    os << "block_threads = " << p.block_threads
       << " is not allowed; allowed: a multiple of 32 in 32..1024";
  }
  return os.str();
}

// ---- MoE families: the planner-side copy of every static_assert of kernels/moe ----------------

// Why a set: route pads each expert's rows to the block, and the route kernels' shared counters
// and the grouped GEMM's n8 MMA tiles are sized for these.
bool is_route_block(int block) {
  return block == 8 || block == 16 || block == 32 || block == 64 || block == 128;
}

bool threads_ok(int threads) { return threads >= 32 && threads <= 1024 && threads % 32 == 0; }

std::string route_problem(const MoeRouteParams& p) {
  std::ostringstream os;
  if (p.kernel != RouteKernel::kSingle && p.kernel != RouteKernel::kRank &&
      p.kernel != RouteKernel::kScan && p.kernel != RouteKernel::kScatter) {
    os << "kernel = " << static_cast<int>(p.kernel)
       << " is not a route kernel; allowed: single, rank, scan, scatter";
  } else if (p.num_experts < 1 || p.num_experts > 32767) {
    os << "num_experts = " << p.num_experts
       << " is out of range; allowed: 1..32767 (the multi-CTA path packs the local expert into "
          "15 bits): split the experts over more EP ranks";
  } else if (p.top_k < 1 || p.top_k > 64) {
    os << "top_k = " << p.top_k << " is out of range; allowed: 1..64";
  } else if (!is_route_block(p.block_m)) {
    os << "block_m = " << p.block_m
       << " is not a route block; allowed: 8, 16, 32, 64, 128 (the grouped GEMM's block_n)";
  } else if (!threads_ok(p.block_threads)) {
    os << "block_threads = " << p.block_threads
       << " is not allowed; allowed: a multiple of 32 in 32..1024";
  } else if (p.chunk_rows < p.block_threads || p.chunk_rows > 32768 ||
             p.chunk_rows % p.block_threads != 0) {
    os << "chunk_rows = " << p.chunk_rows
       << " is not allowed; allowed: a multiple of block_threads (" << p.block_threads
       << ") in " << p.block_threads << "..32768 (counters and in-chunk ranks are 16-bit)";
  } else if (p.chunk_rows / p.block_threads > 32) {
    os << "chunk_rows / block_threads = " << p.chunk_rows / p.block_threads
       << " entries per thread; allowed: at most 32 (kept in registers): raise block_threads or "
          "lower chunk_rows";
  } else if (p.group_rows != 0 &&
             (p.group_rows < p.block_m || p.group_rows % p.block_m != 0 || p.group_rows > 32767)) {
    os << "group_rows = " << p.group_rows << " is not allowed; allowed: 0 (no groups) or a "
       << "multiple of block_m (" << p.block_m << ") up to 32767 (the warpgroup GEMM's token tile)";
  } else if (detail::route_rank_shared_bytes(p.num_experts, p.block_threads) >
             detail::kRouteStaticSharedLimit) {
    os << "block_threads = " << p.block_threads << " with num_experts = " << p.num_experts
       << " needs " << detail::route_rank_shared_bytes(p.num_experts, p.block_threads)
       << " bytes of static shared memory (a 16-bit counter per warp and expert); allowed: "
       << detail::kRouteStaticSharedLimit << ": lower block_threads";
  }
  return os.str();
}

std::string repack_problem(const MoeRepackParams& p) {
  std::ostringstream os;
  if (!threads_ok(p.block_threads)) {
    os << "block_threads = " << p.block_threads
       << " is not allowed; allowed: a multiple of 32 in 32..1024";
  }
  return os.str();
}

bool is_default_activation(const Activation& a) {
  return a.kind == ActivationKind::kSwiGLU && a.limit == 0.f && a.alpha == 0.f && a.beta == 0.f &&
         a.linear_beta == 0.f;
}

// The rules both main loops share after their geometry: occupancy and shared memory
// (`smem_hint` says what to lower), then marlin_stage_problem.
std::string marlin_limits_problem(const MarlinMoeParams& p, const char* smem_hint);
// The stage's roles (out_dtype, early weights, activation), whatever the main loop.
std::string marlin_stage_problem(const MarlinMoeParams& p);

// marlin_moe with the warpgroup main loop (moe_gemm_wg.cuh: MoeGemmWgTraits' static_asserts).
std::string wgmma_problem(const MarlinMoeParams& p) {
  std::ostringstream os;
  const int groups = p.warps_m / 4;
  if (p.wgmma_n != 64 && p.wgmma_n != 128 && p.wgmma_n != 256) {
    os << "wgmma_n = " << p.wgmma_n << "; allowed: 0 (mma.sync), 64, 128, 256";
  } else if (p.block_n < 8 || p.wgmma_n % p.block_n != 0 || p.wgmma_n / p.block_n > 16 ||
             ((p.wgmma_n / p.block_n) & (p.wgmma_n / p.block_n - 1)) != 0) {
    os << "block_n = " << p.block_n << " with wgmma_n = " << p.wgmma_n
       << "; allowed: wgmma_n / 1, 2, 4, 8 or 16 and at least 8 (the route block; a CTA takes "
          "that many consecutive blocks of one expert)";
  } else if (p.warps_m < 4 || p.warps_m % 4 != 0 || p.warps_n != 1 || p.warps_k != 1) {
    os << "warps = " << p.warps_m << 'x' << p.warps_n << 'x' << p.warps_k
       << " with wgmma_n; allowed: warps_m a multiple of 4 (whole warpgroups), warps_n = "
          "warps_k = 1";
  } else if (p.block_m != 64 * groups && p.block_m != 128 * groups) {
    os << "block_m = " << p.block_m << " with " << groups << " warpgroups; allowed: "
       << 64 * groups << " or " << 128 * groups << " (one or two m64 tiles per warpgroup)";
  } else if (p.block_k != 64) {
    os << "block_k = " << p.block_k << " with wgmma_n; allowed: 64 (one atom column per stage)";
  } else if (p.stages < 3) {
    os << "stages = " << p.stages
       << " with wgmma_n; allowed: >= 3 (the next tile lands while one is read and one refills)";
  } else if (detail::marlin_moe_threads(p) > 1024) {
    os << "warps_m = " << p.warps_m << "; allowed: at most 32 warps (1024 threads)";
  } else {
    return marlin_limits_problem(p, "lower stages or wgmma_n");
  }
  return os.str();
}

std::string marlin_problem(const MarlinMoeParams& p) {
  std::ostringstream os;
  if (p.stage != MoeGemmStage::kFc1 && p.stage != MoeGemmStage::kFc2) {
    os << "stage = " << static_cast<int>(p.stage)
       << " is not a GEMM of the layer; allowed: fc1, fc2";
  } else if (p.k_splits < 1 || p.k_splits > detail::kMaxKSplits) {
    os << "k_splits = " << p.k_splits << " is out of range; allowed: 1.." << detail::kMaxKSplits;
  } else if (p.k_splits > 1 && (p.stage != MoeGemmStage::kFc2 || p.out_dtype != DType::kF32)) {
    os << "k_splits = " << p.k_splits << " with stage " << moe_gemm_stage_name(p.stage)
       << ", out_dtype = " << detail::dtype_short_name(p.out_dtype)
       << "; allowed: k_splits > 1 only for fc2 with out_dtype f32 (each split writes fp32 "
          "partial rows that combine adds)";
  } else if (p.wgmma_n != 0) {
    return wgmma_problem(p);
  } else if (p.warps_m < 1 || p.warps_n < 1 || p.warps_k < 1) {
    os << "warps = " << p.warps_m << 'x' << p.warps_n << 'x' << p.warps_k
       << "; allowed: at least 1 warp along each of M, N and K";
  } else if (p.block_m < 16 || p.block_m % (16 * p.warps_m) != 0) {
    os << "block_m = " << p.block_m << " must be a multiple of 16 * warps_m = " << 16 * p.warps_m
       << ": each warp owns whole 16-row atoms";
  } else if (!is_route_block(p.block_n)) {
    os << "block_n = " << p.block_n
       << " is not a route block; allowed: 8, 16, 32, 64, 128 (route pads each expert's rows to "
          "the GEMM's token tile)";
  } else if (p.block_n % (8 * p.warps_n) != 0) {
    os << "block_n = " << p.block_n << " must be a multiple of 8 * warps_n = " << 8 * p.warps_n
       << ": each warp owns whole n8 MMA tiles";
  } else if (p.block_k < 64 || p.block_k % (64 * p.warps_k) != 0) {
    os << "block_k = " << p.block_k << " must be a multiple of 64 * warps_k = " << 64 * p.warps_k
       << ": each warp owns whole 64-wide atoms";
  } else if (p.stages < 2) {
    os << "stages = " << p.stages << "; allowed: >= 2 (one stage loads while one computes)";
  } else if (detail::marlin_moe_threads(p) > 1024) {
    os << "warps_m * warps_n * warps_k = " << p.warps_m * p.warps_n * p.warps_k
       << " warps; allowed: at most 32 (1024 threads)";
  } else {
    return marlin_limits_problem(p, "lower stages, block_k or block_n");
  }
  return os.str();
}

std::string marlin_limits_problem(const MarlinMoeParams& p, const char* smem_hint) {
  std::ostringstream os;
  if (p.min_blocks_per_sm < 1) {
    os << "min_blocks_per_sm = " << p.min_blocks_per_sm << "; allowed: >= 1";
  } else if (detail::marlin_moe_smem_bytes(p) > 227 * 1024) {
    os << "needs " << detail::marlin_moe_smem_bytes(p)
       << " bytes of shared memory; allowed: at most " << 227 * 1024 << " (sm_90): " << smem_hint;
  } else {
    return marlin_stage_problem(p);
  }
  return os.str();
}

std::string marlin_stage_problem(const MarlinMoeParams& p) {
  std::ostringstream os;
  const bool fc1 = p.stage == MoeGemmStage::kFc1;
  if (fc1 && p.early_weights) {
    os << "early_weights with stage fc1: FC1 reads the route's block map, which the previous "
          "kernel writes, before the early weight prologue; allowed: early_weights for fc2 only";
  } else if (fc1 && p.out_dtype != DType::kBF16) {
    os << "out_dtype = " << detail::dtype_short_name(p.out_dtype)
       << " with stage fc1 (FC1 writes the bf16 intermediate); allowed: bf16";
  } else if (!fc1 && p.out_dtype != DType::kF32 && p.out_dtype != DType::kBF16) {
    os << "out_dtype = " << detail::dtype_short_name(p.out_dtype)
       << " with stage fc2; allowed: f32, bf16";
  } else if (!fc1 && !is_default_activation(p.activation)) {
    os << "activation " << activation_kind_name(p.activation.kind)
       << " with stage fc2 (FC2 applies none); allowed: the default activation (swiglu, no "
          "constants)";
  } else if (fc1) {
    os << detail::activation_problem(p.activation);
  }
  return os.str();
}

std::string combine_problem(const MoeCombineParams& p) {
  std::ostringstream os;
  if (p.hidden < 8 || p.hidden % 8 != 0) {
    os << "hidden = " << p.hidden
       << " is not allowed; allowed: a positive multiple of 8 (16-byte bf16 vectors)";
  } else if (p.top_k < 1 || p.top_k > 64) {
    os << "top_k = " << p.top_k << " is out of range; allowed: 1..64";
  } else if (p.in_dtype != DType::kF32 && p.in_dtype != DType::kBF16) {
    os << "in_dtype = " << detail::dtype_short_name(p.in_dtype) << "; allowed: f32, bf16";
  } else if (!threads_ok(p.block_threads)) {
    os << "block_threads = " << p.block_threads
       << " is not allowed; allowed: a multiple of 32 in 32..1024";
  } else if (p.k_splits < 1 || p.k_splits > detail::kMaxKSplits) {
    os << "k_splits = " << p.k_splits << " is out of range; allowed: 1.." << detail::kMaxKSplits;
  } else if (p.k_splits > 1 && p.in_dtype != DType::kF32) {
    os << "k_splits = " << p.k_splits << " with in_dtype "
       << detail::dtype_short_name(p.in_dtype)
       << "; allowed: f32 (FC2's split rows are fp32 partial sums)";
  }
  return os.str();
}

std::string narrow_ids_problem(const NarrowIdsParams& p) {
  std::ostringstream os;
  if (!threads_ok(p.block_threads)) {
    os << "block_threads = " << p.block_threads
       << " is not allowed; allowed: a multiple of 32 in 32..1024";
  }
  return os.str();
}

std::string decode_problem(const MoeDecodeParams& p) {
  std::ostringstream os;
  if (p.kernel != DecodeKernel::kReset && p.kernel != DecodeKernel::kMain &&
      p.kernel != DecodeKernel::kPairFc1 && p.kernel != DecodeKernel::kPairFc2 &&
      p.kernel != DecodeKernel::kCombine) {
    os << "kernel = " << static_cast<int>(p.kernel)
       << " is not a decode_moe kernel; allowed: reset, main, pair_fc1, pair_fc2, combine";
    return os.str();
  }
  std::string reason = detail::decode_pair_kernel(p.kernel) ? detail::decode_pair_rule_problem(p)
                                                            : detail::decode_rule_problem(p);
  if (!reason.empty()) return reason;
  if (p.id_dtype != DType::kI32 && p.id_dtype != DType::kI64) {
    os << "id_dtype = " << detail::dtype_short_name(p.id_dtype)
       << " is not an id type; allowed: i32, i64 (decode_moe reads topk_ids directly)";
    return os.str();
  }
  return detail::activation_problem(p.activation);
}

// Arch rules per family (after the arch itself is valid).
std::string family_arch_problem(Family family, const FamilyParams& params, const Arch& arch) {
  std::ostringstream os;
  if (family == Family::kDecodeMoe) {
    if (arch.sm < 90) {
      os << "decode_moe needs sm_90 or newer (cp.async.bulk, mbarrier transaction counts, "
            "griddepcontrol); found "
         << arch.name() << ": such devices use marlin_moe";
    } else if (const auto* p = std::get_if<MoeDecodeParams>(&params)) {
      const long long need = detail::decode_moe_smem_bytes(*p);
      const long long limit = detail::max_dynamic_smem_bytes(arch);
      if (need > limit) {
        os << "needs " << need << " bytes of shared memory per CTA; "
           << detail::smem_limit_text(arch) << ": lower stages or block_n";
      }
    }
  }
  if (family == Family::kCombine && arch.sm < 80) {
    os << "combine needs sm_80 or newer (its bf16 output is converted with cvt.rn.bf16x2.f32); "
          "found "
       << arch.name() << " (marlin_moe, whose output it sums, needs sm_80 too)";
  }
  if (family == Family::kMarlinMoe) {
    const auto* wg = std::get_if<MarlinMoeParams>(&params);
    if (arch.sm < 80) {
      os << "marlin_moe needs sm_80 or newer (bf16 mma.sync, cp.async, ldmatrix); found "
         << arch.name();
    } else if (wg != nullptr && wg->wgmma_n != 0 && !(arch.sm == 90 && arch.arch_specific)) {
      os << "marlin_moe with wgmma_n = " << wg->wgmma_n
         << " needs sm_90a (wgmma exists on sm_90a only); found " << arch.name()
         << ": use wgmma_n = 0 (the mma.sync main loop)";
    } else if (const auto* p = std::get_if<MarlinMoeParams>(&params)) {
      const long long need = detail::marlin_moe_smem_bytes(*p);
      const long long limit = detail::max_dynamic_smem_bytes(arch);
      if (need > limit) {
        os << "needs " << need << " bytes of shared memory per CTA; "
           << detail::smem_limit_text(arch) << ": lower stages, block_k or block_n";
      }
    }
  }
  return os.str();
}

std::string problem(const AppendSharedParams& p) { return append_shared_problem(p); }
std::string problem(const MoeRouteParams& p) { return route_problem(p); }
std::string problem(const MoeRepackParams& p) { return repack_problem(p); }
std::string problem(const MarlinMoeParams& p) { return marlin_problem(p); }
std::string problem(const MoeCombineParams& p) { return combine_problem(p); }
std::string problem(const NarrowIdsParams& p) { return narrow_ids_problem(p); }
std::string problem(const MoeDecodeParams& p) { return decode_problem(p); }

// The family a params alternative belongs to.
Family family_of(const AppendSharedParams&) { return Family::kAppendShared; }
Family family_of(const MoeRouteParams&) { return Family::kRoute; }
Family family_of(const MoeRepackParams&) { return Family::kRepack; }
Family family_of(const MarlinMoeParams&) { return Family::kMarlinMoe; }
Family family_of(const MoeCombineParams&) { return Family::kCombine; }
Family family_of(const NarrowIdsParams&) { return Family::kNarrowIds; }
Family family_of(const MoeDecodeParams&) { return Family::kDecodeMoe; }

using detail::float_text;

// "gpt_oss(limit=7,alpha=1.702)": the kind and the constants it takes.
std::string activation_text(const Activation& a) {
  std::string out = activation_kind_name(a.kind);
  switch (a.kind) {
    case ActivationKind::kSwiGLU:
      break;
    case ActivationKind::kClampedSwiGLU:
      out += "(limit=" + float_text(a.limit) + ")";
      break;
    case ActivationKind::kGptOss:
      out += "(limit=" + float_text(a.limit) + ",alpha=" + float_text(a.alpha) + ")";
      break;
    case ActivationKind::kSiTU:
      out += "(beta=" + float_text(a.beta) + ",linear_beta=" + float_text(a.linear_beta) + ")";
      break;
  }
  return out;
}

// The activation's kind and all four constants (the ones it does not take are 0).
nlohmann::ordered_json activation_json(const Activation& a) {
  nlohmann::ordered_json act;
  act["kind"] = activation_kind_name(a.kind);
  act["limit"] = a.limit;
  act["alpha"] = a.alpha;
  act["beta"] = a.beta;
  act["linear_beta"] = a.linear_beta;
  return act;
}

void add_params_json(nlohmann::ordered_json& out, const AppendSharedParams& p) {
  out["top_k"] = p.top_k;
  out["num_shared"] = p.num_shared;
  out["id_dtype"] = detail::dtype_short_name(p.id_dtype);
  out["gate"] = detail::gate_short_name(p.gate);
  out["logit_dtype"] = detail::dtype_short_name(p.logit_dtype);
  out["block_threads"] = p.block_threads;
}

void add_params_json(nlohmann::ordered_json& out, const MoeRouteParams& p) {
  out["kernel"] = route_kernel_name(p.kernel);
  out["num_experts"] = p.num_experts;
  out["top_k"] = p.top_k;
  out["block_m"] = p.block_m;
  out["block_threads"] = p.block_threads;
  out["chunk_rows"] = p.chunk_rows;
  out["group_rows"] = p.group_rows;
}

void add_params_json(nlohmann::ordered_json& out, const MoeRepackParams& p) {
  out["gate_up"] = p.gate_up;
  out["block_threads"] = p.block_threads;
}

void add_params_json(nlohmann::ordered_json& out, const MarlinMoeParams& p) {
  out["stage"] = moe_gemm_stage_name(p.stage);
  out["block_m"] = p.block_m;
  out["block_n"] = p.block_n;
  out["block_k"] = p.block_k;
  out["stages"] = p.stages;
  out["warps_m"] = p.warps_m;
  out["warps_n"] = p.warps_n;
  out["warps_k"] = p.warps_k;
  out["min_blocks_per_sm"] = p.min_blocks_per_sm;
  out["early_weights"] = p.early_weights;
  out["has_bias"] = p.has_bias;
  out["activation"] = activation_json(p.activation);
  out["out_dtype"] = detail::dtype_short_name(p.out_dtype);
  out["wgmma_n"] = p.wgmma_n;
  out["k_splits"] = p.k_splits;
}

void add_params_json(nlohmann::ordered_json& out, const MoeCombineParams& p) {
  out["hidden"] = p.hidden;
  out["top_k"] = p.top_k;
  out["in_dtype"] = detail::dtype_short_name(p.in_dtype);
  out["block_threads"] = p.block_threads;
  out["k_splits"] = p.k_splits;
}

void add_params_json(nlohmann::ordered_json& out, const NarrowIdsParams& p) {
  out["block_threads"] = p.block_threads;
}

void add_params_json(nlohmann::ordered_json& out, const MoeDecodeParams& p) {
  out["kernel"] = decode_kernel_name(p.kernel);
  out["num_experts"] = p.num_experts;
  out["top_k"] = p.top_k;
  out["hidden"] = p.hidden;
  out["intermediate"] = p.intermediate;
  out["block_n"] = p.block_n;
  out["fc1_strips"] = p.fc1_strips;
  out["fc2_strips"] = p.fc2_strips;
  out["stages"] = p.stages;
  out["max_tokens"] = p.max_tokens;
  out["activation"] = activation_json(p.activation);
  out["id_dtype"] = detail::dtype_short_name(p.id_dtype);
}

void add_params_display(std::ostringstream& os, const MoeRouteParams& p) {
  os << '<' << route_kernel_name(p.kernel) << ",e" << p.num_experts << ",k" << p.top_k << ",b"
     << p.block_m << ",t" << p.block_threads << ",c" << p.chunk_rows;
  if (p.group_rows != 0) os << ",g" << p.group_rows;
  os << '>';
}

void add_params_display(std::ostringstream& os, const MoeRepackParams& p) {
  os << '<' << (p.gate_up ? "gate_up" : "plain") << ",t" << p.block_threads << '>';
}

void add_params_display(std::ostringstream& os, const MarlinMoeParams& p) {
  os << '<' << moe_gemm_stage_name(p.stage) << ",m" << p.block_m << ",n" << p.block_n << ",k"
     << p.block_k << ",s" << p.stages << ",w" << p.warps_m << 'x' << p.warps_n << 'x' << p.warps_k
     << ",o" << p.min_blocks_per_sm;
  if (p.early_weights) os << ",early";
  if (p.stage == MoeGemmStage::kFc1) os << ',' << activation_text(p.activation);
  if (p.has_bias) os << ",bias";
  if (p.wgmma_n != 0) os << ",wgmma" << p.wgmma_n;
  if (p.k_splits != 1) os << ",ks" << p.k_splits;
  os << ',' << detail::dtype_short_name(p.out_dtype) << '>';
}

void add_params_display(std::ostringstream& os, const MoeCombineParams& p) {
  os << "<h" << p.hidden << ",k" << p.top_k << ',' << detail::dtype_short_name(p.in_dtype) << ",t"
     << p.block_threads;
  if (p.k_splits != 1) os << ",ks" << p.k_splits;
  os << '>';
}

void add_params_display(std::ostringstream& os, const NarrowIdsParams& p) {
  os << "<t" << p.block_threads << '>';
}

void add_params_display(std::ostringstream& os, const MoeDecodeParams& p) {
  os << '<' << decode_kernel_name(p.kernel) << ",e" << p.num_experts << ",k" << p.top_k << ",h"
     << p.hidden << ",i" << p.intermediate;
  if (detail::decode_pair_kernel(p.kernel)) {
    os << ",t" << p.max_tokens;
  } else {
    os << ",n" << p.block_n << ",f" << p.fc1_strips << 'x' << p.fc2_strips << ",s" << p.stages;
  }
  os << ',' << activation_text(p.activation) << ',' << detail::dtype_short_name(p.id_dtype) << '>';
}

void add_params_display(std::ostringstream& os, const AppendSharedParams& p) {
  os << "<k" << p.top_k << ",s" << p.num_shared << ',' << detail::dtype_short_name(p.id_dtype)
     << ',' << detail::gate_short_name(p.gate);
  // Why: a constant gate reads no logits, so their dtype does not name anything.
  if (p.gate != SharedGate::kConstant) os << ',' << detail::dtype_short_name(p.logit_dtype);
  os << ",t" << p.block_threads << '>';
}

void combine(std::size_t& seed, std::size_t value) {
  // Why: the 64-bit golden-ratio mix; std::hash of small ints is often the identity.
  seed ^= value + 0x9e3779b97f4a7c15ull + (seed << 6) + (seed >> 2);
}

void hash_params(std::size_t& seed, const AppendSharedParams& p) {
  combine(seed, std::hash<int>{}(p.top_k));
  combine(seed, std::hash<int>{}(p.num_shared));
  combine(seed, static_cast<std::size_t>(p.id_dtype));
  combine(seed, static_cast<std::size_t>(p.gate));
  combine(seed, static_cast<std::size_t>(p.logit_dtype));
  combine(seed, std::hash<int>{}(p.block_threads));
}

// Why zero apart: equality compares values, so -0.0 and 0.0 are the same spec and must hash alike
// (an unordered_map's contract); other values hash by their bits.
std::size_t float_bits(float value) {
  if (value == 0.0f) return 0;
  uint32_t bits = 0;
  std::memcpy(&bits, &value, sizeof(bits));
  return bits;
}

void hash_params(std::size_t& seed, const MoeRouteParams& p) {
  combine(seed, static_cast<std::size_t>(p.kernel));
  combine(seed, std::hash<int>{}(p.num_experts));
  combine(seed, std::hash<int>{}(p.top_k));
  combine(seed, std::hash<int>{}(p.block_m));
  combine(seed, std::hash<int>{}(p.block_threads));
  combine(seed, std::hash<int>{}(p.chunk_rows));
  combine(seed, std::hash<int>{}(p.group_rows));
}

void hash_params(std::size_t& seed, const MoeRepackParams& p) {
  combine(seed, p.gate_up ? 1u : 0u);
  combine(seed, std::hash<int>{}(p.block_threads));
}

void hash_params(std::size_t& seed, const MarlinMoeParams& p) {
  combine(seed, static_cast<std::size_t>(p.stage));
  for (int v : {p.block_m, p.block_n, p.block_k, p.stages, p.warps_m, p.warps_n, p.warps_k,
                p.min_blocks_per_sm}) {
    combine(seed, std::hash<int>{}(v));
  }
  combine(seed, p.early_weights ? 1u : 0u);
  combine(seed, p.has_bias ? 1u : 0u);
  combine(seed, static_cast<std::size_t>(p.activation.kind));
  for (float v : {p.activation.limit, p.activation.alpha, p.activation.beta,
                  p.activation.linear_beta}) {
    combine(seed, float_bits(v));
  }
  combine(seed, static_cast<std::size_t>(p.out_dtype));
  combine(seed, std::hash<int>{}(p.wgmma_n));
  combine(seed, std::hash<int>{}(p.k_splits));
}

void hash_params(std::size_t& seed, const MoeCombineParams& p) {
  combine(seed, std::hash<int>{}(p.hidden));
  combine(seed, std::hash<int>{}(p.top_k));
  combine(seed, static_cast<std::size_t>(p.in_dtype));
  combine(seed, std::hash<int>{}(p.block_threads));
  combine(seed, std::hash<int>{}(p.k_splits));
}

void hash_params(std::size_t& seed, const NarrowIdsParams& p) {
  combine(seed, std::hash<int>{}(p.block_threads));
}

void hash_params(std::size_t& seed, const MoeDecodeParams& p) {
  combine(seed, static_cast<std::size_t>(p.kernel));
  for (int v : {p.num_experts, p.top_k, p.hidden, p.intermediate, p.block_n, p.fc1_strips,
                p.fc2_strips, p.stages, p.max_tokens}) {
    combine(seed, std::hash<int>{}(v));
  }
  combine(seed, static_cast<std::size_t>(p.activation.kind));
  for (float v :
       {p.activation.limit, p.activation.alpha, p.activation.beta, p.activation.linear_beta}) {
    combine(seed, float_bits(v));
  }
  combine(seed, static_cast<std::size_t>(p.id_dtype));
}

}  // namespace

const char* route_kernel_name(RouteKernel kernel) noexcept {
  switch (kernel) {
    case RouteKernel::kSingle:
      return "single";
    case RouteKernel::kRank:
      return "rank";
    case RouteKernel::kScan:
      return "scan";
    case RouteKernel::kScatter:
      return "scatter";
  }
  return "unknown";
}

const char* decode_kernel_name(DecodeKernel kernel) noexcept {
  switch (kernel) {
    case DecodeKernel::kReset:
      return "reset";
    case DecodeKernel::kMain:
      return "main";
    case DecodeKernel::kPairFc1:
      return "pair_fc1";
    case DecodeKernel::kPairFc2:
      return "pair_fc2";
    case DecodeKernel::kCombine:
      return "combine";
  }
  return "unknown";
}

const char* moe_gemm_stage_name(MoeGemmStage stage) noexcept {
  switch (stage) {
    case MoeGemmStage::kFc1:
      return "fc1";
    case MoeGemmStage::kFc2:
      return "fc2";
  }
  return "unknown";
}

Arch Arch::parse(const std::string& text) {
  auto fail = [&]() {
    std::ostringstream os;
    os << "invalid arch \"" << text << "\": " << kArchForms;
    detail::throw_error(ErrorCode::kInvalidArgument, os.str());
  };
  const std::string prefix = "sm_";
  if (text.compare(0, prefix.size(), prefix) != 0) fail();
  std::size_t pos = prefix.size();
  std::size_t digits_end = pos;
  while (digits_end < text.size() && std::isdigit(static_cast<unsigned char>(text[digits_end]))) {
    ++digits_end;
  }
  const std::size_t digit_count = digits_end - pos;
  if (digit_count < 2 || digit_count > 3 || text[pos] == '0') fail();
  Arch arch;
  arch.sm = std::stoi(text.substr(pos, digit_count));
  arch.arch_specific = false;
  if (digits_end < text.size()) {
    if (text[digits_end] != 'a' || digits_end + 1 != text.size()) fail();
    arch.arch_specific = true;
  }
  if (arch.sm < kMinSm || (arch.arch_specific && arch.sm < kMinArchSpecificSm)) fail();
  return arch;
}

std::string Arch::name() const {
  std::string out = "sm_" + std::to_string(sm);
  if (arch_specific) out += 'a';
  return out;
}

std::string Arch::nvrtc_option() const { return "--gpu-architecture=" + name(); }

const char* family_name(Family family) noexcept {
  switch (family) {
    case Family::kAppendShared:
      return "append_shared";
    case Family::kRoute:
      return "route";
    case Family::kRepack:
      return "repack";
    case Family::kMarlinMoe:
      return "marlin_moe";
    case Family::kCombine:
      return "combine";
    case Family::kNarrowIds:
      return "narrow_ids";
    case Family::kDecodeMoe:
      return "decode_moe";
  }
  return "unknown";
}

Family parse_family(const std::string& text) {
  static constexpr Family kAll[] = {Family::kAppendShared, Family::kRoute,   Family::kRepack,
                                    Family::kMarlinMoe,    Family::kCombine, Family::kNarrowIds,
                                    Family::kDecodeMoe};
  std::string known;
  for (Family family : kAll) {
    if (text == family_name(family)) return family;
    if (!known.empty()) known += ", ";
    known += family_name(family);
  }
  detail::throw_error(ErrorCode::kInvalidArgument,
                      "unknown kernel family \"" + text + "\"; known families: " + known);
}

std::string KernelSpec::display_name() const {
  std::ostringstream os;
  os << family_name(family);
  std::visit([&](const auto& p) { add_params_display(os, p); }, params);
  os << '@' << arch.name();
  return os.str();
}

std::string KernelSpec::to_json() const {
  nlohmann::ordered_json out;
  out["family"] = family_name(family);
  out["arch"] = arch.name();
  nlohmann::ordered_json p = nlohmann::ordered_json::object();
  std::visit([&](const auto& alt) { add_params_json(p, alt); }, params);
  out["params"] = std::move(p);
  return out.dump();
}

std::size_t KernelSpec::hash() const noexcept {
  std::size_t seed = static_cast<std::size_t>(family);
  combine(seed, std::hash<int>{}(arch.sm));
  combine(seed, arch.arch_specific ? 1u : 0u);
  combine(seed, params.index());
  std::visit([&](const auto& p) { hash_params(seed, p); }, params);
  return seed;
}

std::string supports(const KernelSpec& spec) {
  std::string reason = arch_problem(spec.arch);
  if (!reason.empty()) return spec.display_name() + ": " + reason;
  const Family params_family = std::visit([](const auto& p) { return family_of(p); }, spec.params);
  if (params_family != spec.family) {
    return std::string("kernel spec names family ") + family_name(spec.family) +
           " but carries the parameters of " + family_name(params_family);
  }
  reason = std::visit([](const auto& p) { return problem(p); }, spec.params);
  if (!reason.empty()) return spec.display_name() + ": " + reason;
  reason = family_arch_problem(spec.family, spec.params, spec.arch);
  if (!reason.empty()) return spec.display_name() + ": " + reason;
  return "";
}

}  // namespace moejit
