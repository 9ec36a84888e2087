// libmoejit: a KernelSpec names one kernel completely: its family, every template argument and
// the target arch. Everything downstream (codegen, cache key, compile, load) is a function of it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <variant>

#include "moejit/shape.hpp"

namespace moejit {

// A compile target, e.g. sm_90a (arch-specific features such as wgmma), sm_100a, sm_80.
struct Arch {
  int sm = 90;                 // major * 10 + minor
  bool arch_specific = false;  // the "a" suffix

  static Arch parse(const std::string& text);  // "sm_90a"; throws Error{kInvalidArgument}
  std::string name() const;                    // "sm_90a"
  std::string nvrtc_option() const;            // "--gpu-architecture=sm_90a"
  friend bool operator==(const Arch& a, const Arch& b) {
    return a.sm == b.sm && a.arch_specific == b.arch_specific;
  }
};

enum class Family { kAppendShared };

const char* family_name(Family family) noexcept;
Family parse_family(const std::string& text);  // "append_shared"; throws Error{kInvalidArgument}

// append_shared: routed top-k copied, then S shared experts appended, one launch.
struct AppendSharedParams {
  int top_k = 0;                         // K routed slots per token
  int num_shared = 0;                    // S shared experts appended per token
  DType id_dtype = DType::kI32;          // topk_ids / out_ids element type (kI32 or kI64)
  SharedGate gate = SharedGate::kSigmoid;
  DType logit_dtype = DType::kBF16;      // kSigmoid: logits element type (kBF16, kF16, kF32)
  int block_threads = 256;               // threads per CTA

  friend bool operator==(const AppendSharedParams& a, const AppendSharedParams& b) {
    return a.top_k == b.top_k && a.num_shared == b.num_shared && a.id_dtype == b.id_dtype &&
           a.gate == b.gate && a.logit_dtype == b.logit_dtype &&
           a.block_threads == b.block_threads;
  }
};

using FamilyParams = std::variant<AppendSharedParams>;

struct KernelSpec {
  Family family = Family::kAppendShared;
  Arch arch;
  FamilyParams params;

  // A short human-readable name, e.g. "append_shared<k6,s1,i32,sigmoid,bf16,t128>@sm_90a" (a
  // constant gate reads no logits, so it omits their dtype: "<k6,s1,i32,constant,t128>").
  std::string display_name() const;
  // The same facts as JSON text (stable field order), for manifests and `moejit list`.
  std::string to_json() const;
  // Cheap hash of the typed fields, for the in-memory kernel table.
  std::size_t hash() const noexcept;
  friend bool operator==(const KernelSpec& a, const KernelSpec& b) {
    return a.family == b.family && a.arch == b.arch && a.params == b.params;
  }
};

// Empty when `spec` can be served; otherwise the reason it can't (checked before any compile).
std::string supports(const KernelSpec& spec);

}  // namespace moejit
