// KernelSpec: names, JSON, hashing and the supports() checks that run before any compile.
#include "moejit/kernel_spec.hpp"

#include <cctype>
#include <functional>
#include <nlohmann/json.hpp>
#include <sstream>
#include <type_traits>

#include "common/check.hpp"
#include "moejit/error.hpp"
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
  if (p.top_k < 1 || p.top_k > 64) {
    os << "top_k = " << p.top_k << " is out of range; allowed: 1..64";
  } else if (p.num_shared < 1 || p.num_shared > 8) {
    os << "num_shared = " << p.num_shared
       << " is out of range; allowed: 1..8 (a shape without shared experts needs no kernel)";
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

std::string problem(const AppendSharedParams& p) { return append_shared_problem(p); }

// The family a params alternative belongs to.
Family family_of(const AppendSharedParams&) { return Family::kAppendShared; }

void add_params_json(nlohmann::ordered_json& out, const AppendSharedParams& p) {
  out["top_k"] = p.top_k;
  out["num_shared"] = p.num_shared;
  out["id_dtype"] = detail::dtype_short_name(p.id_dtype);
  out["gate"] = detail::gate_short_name(p.gate);
  out["logit_dtype"] = detail::dtype_short_name(p.logit_dtype);
  out["block_threads"] = p.block_threads;
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

}  // namespace

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
  }
  return "unknown";
}

Family parse_family(const std::string& text) {
  static constexpr Family kAll[] = {Family::kAppendShared};
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
  return "";
}

}  // namespace moejit
