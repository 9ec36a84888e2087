// The rules every ModelShape obeys, whether it came from a file or was built in code.
#include <algorithm>
#include <cfloat>
#include <climits>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "common/text.hpp"
#include "descriptor/descriptor.hpp"
#include "moejit/error.hpp"

namespace moejit {

const char* activation_kind_name(ActivationKind kind) noexcept {
  switch (kind) {
    case ActivationKind::kSwiGLU: return "swiglu";
    case ActivationKind::kClampedSwiGLU: return "clamped_swiglu";
    case ActivationKind::kGptOss: return "gpt_oss";
    case ActivationKind::kSiTU: return "situ";
  }
  return "unknown";
}

const char* dtype_name(DType dtype) noexcept {
  switch (dtype) {
    case DType::kBF16: return "bf16";
    case DType::kF16: return "fp16";
    case DType::kF32: return "fp32";
    case DType::kI32: return "int32";
    case DType::kI64: return "int64";
  }
  return "unknown";
}

const char* shared_gate_name(SharedGate gate) noexcept {
  switch (gate) {
    case SharedGate::kSigmoid: return "sigmoid";
    case SharedGate::kConstant: return "constant";
    case SharedGate::kGiven: return "given";
  }
  return "unknown";
}

namespace detail {
namespace {

std::string range_text(long long lo, long long hi) {
  return "an integer in " + std::to_string(lo) + ".." + std::to_string(hi);
}

std::optional<ShapeViolation> check_range(const std::string& field, const char* label,
                                          long long value, long long lo, long long hi) {
  if (value >= lo && value <= hi) return std::nullopt;
  ShapeViolation v;
  v.field = field;
  v.expected = range_text(lo, hi);
  v.found = std::to_string(value);
  if (value < lo) {
    v.what = std::string(label) + (lo == 1 ? " must be positive" : " is too small");
  } else {
    v.what = std::string(label) + " is larger than any model libmoejit serves";
    v.hint = "a size this large is almost certainly a typo";
  }
  return v;
}

// K of an MXFP4 GEMM must be whole 32-weight scale blocks.
std::optional<ShapeViolation> check_block(const std::string& field, const char* label,
                                          const char* gemm, int value) {
  if (value % kMxfp4BlockK == 0) return std::nullopt;
  int below = value / kMxfp4BlockK * kMxfp4BlockK;
  ShapeViolation v;
  v.field = field;
  v.what = std::string(label) + " breaks the MXFP4 block invariant: " + gemm +
           " reduces over K = " + label + ", and MXFP4 stores one E8M0 scale per " +
           std::to_string(kMxfp4BlockK) + " weights along K, so K must be whole blocks";
  v.expected = "a multiple of " + std::to_string(kMxfp4BlockK);
  v.found = std::to_string(value);
  v.hint = "the nearest valid values are " +
           (below > 0 ? std::to_string(below) + " and " : std::string()) +
           std::to_string(below + kMxfp4BlockK);
  return v;
}

// An activation constant: finite and > 0 when the kind takes it, else left unset (0).
// Why the verdict before any text: moe_forward checks its shape on every call, and formatting
// the four constants cost ~1.7 us a call (tools/PERF_LOG.md "a shape's rules without text").
std::optional<ShapeViolation> check_constant(const char* name, float value, bool taken,
                                             ActivationKind kind) {
  const bool positive = std::isfinite(value) && value >= FLT_MIN;
  if (taken ? positive && float_ratio(value) : value == 0.f) return std::nullopt;
  ShapeViolation v;
  v.field = std::string("/activation/") + name;
  v.found = float_text(value);
  if (!taken) {
    v.what = std::string("activation \"") + activation_kind_name(kind) + "\" takes no " + name;
    v.expected = std::string("no ") + name + " (0)";
  } else if (!positive) {
    v.what = std::string("activation constant ") + name + " must be finite and positive";
    v.expected = "a finite number > 0";
  } else {
    // Why: the kernels take each constant as a template argument num / den (float_ratio).
    v.what = std::string("activation constant ") + name +
             " has no exact int ratio num / den, the form the kernels take it in";
    v.expected =
        "a number that some num / den with |num|, den < 2^31 rounds to (magnitudes from "
        "about 1e-9 to 2e9)";
  }
  return v;
}

bool name_char(char c) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '.' ||
         c == '_' || c == '-';
}

std::optional<ShapeViolation> check_name(const std::string& name) {
  bool ok = !name.empty() && name.size() <= static_cast<std::size_t>(kMaxNameLength) &&
            name[0] != '.' && name[0] != '-' && name[0] != '_';
  for (char c : name) ok = ok && name_char(c);
  if (ok) return std::nullopt;
  ShapeViolation v;
  v.field = "/name";
  v.what = "name is not a valid shape name";
  v.expected = "1 to " + std::to_string(kMaxNameLength) +
               " characters from A-Z a-z 0-9 . _ -, starting with a letter or digit";
  v.found = "\"" + name + "\"";
  // Why: names end up in file names and command lines, so they stay plain.
  v.hint = "names are used in cache manifests and on command lines";
  return v;
}

}  // namespace

std::optional<ShapeViolation> activation_violation(const Activation& a) {
  const bool clamps = a.kind == ActivationKind::kClampedSwiGLU || a.kind == ActivationKind::kGptOss;
  const bool situ = a.kind == ActivationKind::kSiTU;
  if (auto v = check_constant("limit", a.limit, clamps, a.kind)) return v;
  if (auto v = check_constant("alpha", a.alpha, a.kind == ActivationKind::kGptOss, a.kind)) {
    return v;
  }
  if (auto v = check_constant("beta", a.beta, situ, a.kind)) return v;
  return check_constant("linear_beta", a.linear_beta, situ, a.kind);
}

std::optional<FloatRatio> float_ratio(float value) {
  if (!std::isfinite(value)) return std::nullopt;
  if (value == 0.f) return FloatRatio{0, 1};
  const auto exact = [value](long long num, long long den) {
    return static_cast<float>(num) / static_cast<float>(den) == value;
  };
  for (long long den = 1; den <= 1000000000LL; den *= 10) {
    const double scaled = std::nearbyint(static_cast<double>(value) * static_cast<double>(den));
    if (std::fabs(scaled) > static_cast<double>(INT_MAX)) break;
    const long long num = static_cast<long long>(scaled);
    if (exact(num, den)) return FloatRatio{static_cast<int>(num), static_cast<int>(den)};
  }
  // The continued fraction of `value`: its convergents h / k are the best approximations, and
  // between two of them the semiconvergents (h'' + j h') / (k'' + j k'), j = 1 .. a, close in
  // from one side. The first fraction whose float quotient rounds to `value` will do: per term,
  // the smallest j whose semiconvergent does, by bisection (they approach `value` monotonically),
  // else the convergent itself. Why semiconvergents: a convergent may overshoot into a fraction
  // past 2^31 while a semiconvergent before it already rounds to `value` (3.615067726e-06 is
  // 55 / 15214099, a semiconvergent).
  {
    const double x0 = std::fabs(static_cast<double>(value));
    const long long sign = value < 0.f ? -1 : 1;
    long long h_prev = 1, h_prev2 = 0, k_prev = 0, k_prev2 = 1;
    double x = x0;
    for (int iteration = 0; iteration < 64; ++iteration) {
      const double a = std::floor(x);
      if (a > static_cast<double>(INT_MAX)) break;
      const long long ai = static_cast<long long>(a);
      // The largest j that keeps both terms under 2^31.
      long long j_max = ai;
      if (h_prev > 0) j_max = std::min(j_max, (INT_MAX - h_prev2) / h_prev);
      if (k_prev > 0) j_max = std::min(j_max, (INT_MAX - k_prev2) / k_prev);
      const auto rounds = [&](long long j) {
        const long long k = j * k_prev + k_prev2;
        return k > 0 && exact(sign * (j * h_prev + h_prev2), k);
      };
      if (j_max >= 1 && rounds(j_max)) {
        long long lo = 1, j = j_max;  // j always rounds; bisect down to the smallest that does
        while (lo < j) {
          const long long mid = lo + (j - lo) / 2;
          if (rounds(mid)) {
            j = mid;
          } else {
            lo = mid + 1;
          }
        }
        return FloatRatio{static_cast<int>(sign * (j * h_prev + h_prev2)),
                          static_cast<int>(j * k_prev + k_prev2)};
      }
      if (j_max < ai) break;  // the convergent itself passes 2^31
      const long long h = ai * h_prev + h_prev2;
      const long long k = ai * k_prev + k_prev2;
      h_prev2 = h_prev;
      h_prev = h;
      k_prev2 = k_prev;
      k_prev = k;
      const double fraction = x - a;
      if (fraction <= 0.0) break;
      x = 1.0 / fraction;
    }
  }
  // value = mantissa * 2^exponent with an integer mantissa of at most 24 bits.
  int exponent = 0;
  const double fraction = std::frexp(static_cast<double>(value), &exponent);
  long long mantissa = static_cast<long long>(std::ldexp(fraction, 24));
  exponent -= 24;
  while (mantissa % 2 == 0 && exponent < 0) {
    mantissa /= 2;
    ++exponent;
  }
  if (exponent >= 0) {
    if (exponent > 30) return std::nullopt;
    const long long num = mantissa * (1LL << exponent);
    if (num > INT_MAX || num < -static_cast<long long>(INT_MAX)) return std::nullopt;
    if (exact(num, 1)) return FloatRatio{static_cast<int>(num), 1};
    return std::nullopt;
  }
  if (-exponent > 30) return std::nullopt;
  const long long den = 1LL << -exponent;
  if (exact(mantissa, den)) return FloatRatio{static_cast<int>(mantissa), static_cast<int>(den)};
  return std::nullopt;
}

std::optional<ShapeViolation> find_shape_violation(const ModelShape& s) {
  if (auto v = check_name(s.name)) return v;
  // Why two bounds: past kMaxLocalExperts a count is a typo, below it a rank the route kernel
  // can't serve (the rule after says how to split it); both name the range accepted.
  if (auto v = check_range("/num_experts", "num_experts", s.num_experts, 1, kMaxLocalExperts)) {
    v->expected = range_text(1, kMaxRoutedLocalExperts);
    return v;
  }
  if (s.num_experts > kMaxRoutedLocalExperts) {
    ShapeViolation v;
    v.field = "/num_experts";
    v.what =
        "num_experts is more local experts than the route kernel serves (its per-expert "
        "tables fill 48 KB of shared memory)";
    v.expected = "at most " + std::to_string(kMaxRoutedLocalExperts);
    v.found = std::to_string(s.num_experts);
    v.hint = "split the experts over ranks: expert_offset and global_experts";
    return v;
  }
  if (auto v = check_range("/top_k", "top_k", s.top_k, 1, kMaxTopK)) return v;
  if (auto v = check_range("/hidden", "hidden", s.hidden, 1, kMaxDim)) return v;
  if (auto v = check_block("/hidden", "hidden", "FC1", s.hidden)) return v;
  if (auto v = check_range("/intermediate", "intermediate", s.intermediate, 1, kMaxDim)) return v;
  if (auto v = check_block("/intermediate", "intermediate", "FC2", s.intermediate)) return v;
  if (auto v = check_range("/expert_offset", "expert_offset", s.expert_offset, 0,
                           kMaxGlobalExperts - 1))
    return v;
  long long local_end = static_cast<long long>(s.expert_offset) + s.num_experts;
  if (auto v = check_range("/global_experts", "global_experts", s.global_experts, 1,
                           kMaxGlobalExperts))
    return v;
  if (s.global_experts < local_end) {
    ShapeViolation v;
    v.field = "/global_experts";
    v.what = "global_experts does not cover this rank's experts [expert_offset, expert_offset + "
             "num_experts) = [" + std::to_string(s.expert_offset) + ", " +
             std::to_string(local_end) + ")";
    v.expected = "at least expert_offset + num_experts = " + std::to_string(local_end);
    v.found = std::to_string(s.global_experts);
    v.hint = "leave global_experts out when the model is not split across ranks";
    return v;
  }
  if (s.top_k > s.global_experts) {
    ShapeViolation v;
    v.field = "/top_k";
    v.what = "top_k exceeds the number of routed experts: a token can't pick more distinct "
             "experts than the model has";
    v.expected = "at most global_experts = " + std::to_string(s.global_experts);
    v.found = std::to_string(s.top_k);
    return v;
  }

  if (auto v = activation_violation(s.activation)) return v;

  const SharedExperts& sh = s.shared;
  if (auto v = check_range("/shared_experts/count", "shared_experts.count", sh.count, 0,
                           kMaxSharedExperts))
    return v;
  if (sh.count == 0 && sh.intermediate != 0) {
    ShapeViolation v;
    v.field = "/shared_experts/intermediate";
    v.what = "shared_experts.intermediate is set but count is 0";
    v.expected = "0 when there are no shared experts";
    v.found = std::to_string(sh.intermediate);
    return v;
  }
  if (sh.count > 0) {
    if (auto v = check_range("/shared_experts/intermediate", "shared_experts.intermediate",
                             sh.intermediate, 1, kMaxDim))
      return v;
    if (auto v = check_block("/shared_experts/intermediate", "shared_experts.intermediate",
                             "the shared expert's FC2", sh.intermediate))
      return v;
    if (!(std::isfinite(sh.scale) && sh.scale >= FLT_MIN)) {
      ShapeViolation v;
      v.field = "/shared_experts/scale";
      v.what = "shared_experts.scale must be finite and positive";
      v.expected = "a finite number > 0";
      v.found = float_text(sh.scale);
      return v;
    }
    if (sh.logit_dtype != DType::kBF16 && sh.logit_dtype != DType::kF16 &&
        sh.logit_dtype != DType::kF32) {
      ShapeViolation v;
      v.field = "/shared_experts/logit_dtype";
      v.what = "shared_experts.logit_dtype is not a floating-point type";
      v.expected = "one of \"bf16\", \"fp16\", \"fp32\"";
      v.found = std::string("\"") + dtype_name(sh.logit_dtype) + "\"";
      return v;
    }
  }
  if (s.activation_dtype != DType::kBF16) {
    ShapeViolation v;
    v.field = "/activation_dtype";
    v.what = "activation_dtype is not one the kernels take";
    v.expected = "\"bf16\"";
    v.found = std::string("\"") + dtype_name(s.activation_dtype) + "\"";
    return v;
  }
  if (s.id_dtype != DType::kI32 && s.id_dtype != DType::kI64) {
    ShapeViolation v;
    v.field = "/id_dtype";
    v.what = "id_dtype is not an integer type";
    v.expected = "\"int32\" or \"int64\"";
    v.found = std::string("\"") + dtype_name(s.id_dtype) + "\"";
    return v;
  }
  if (auto v = check_range("/max_tokens", "max_tokens", s.max_tokens, 1, kMaxTokensLimit))
    return v;
  return std::nullopt;
}

void check_shape(const ModelShape& shape) {
  auto v = find_shape_violation(shape);
  if (!v) return;
  // shape.source is "file:line" for shapes read from a file.
  std::string file = shape.source.empty() ? "shape \"" + shape.name + "\"" : shape.source;
  int line = 0;
  std::size_t colon = shape.source.rfind(':');
  if (colon != std::string::npos && colon + 1 < shape.source.size() &&
      shape.source.find_first_not_of("0123456789", colon + 1) == std::string::npos) {
    file = shape.source.substr(0, colon);
    line = std::atoi(shape.source.c_str() + colon + 1);
  }
  std::string message =
      descriptor_message(file, line, 0, v->field, v->what, v->expected, v->found, v->hint);
  throw DescriptorError(message, file, line, 0, v->field);
}

std::string listed_names(const std::vector<std::string>& names) {
  constexpr std::size_t kListed = 20;
  std::string out;
  for (std::size_t i = 0; i < names.size() && i < kListed; ++i) {
    out += (i == 0 ? "" : ", ") + names[i];
  }
  if (names.size() > kListed) out += ", ... (" + std::to_string(names.size()) + " in all)";
  return out;
}

std::string printable(std::string_view text, std::size_t max_bytes) {
  std::size_t cut = text.size();
  if (cut > max_bytes) {
    cut = max_bytes;
    while (cut > 0 && (static_cast<unsigned char>(text[cut]) & 0xC0) == 0x80) --cut;
  }
  std::string out;
  out.reserve(cut + 3);
  for (std::size_t i = 0; i < cut; ++i) {
    const auto c = static_cast<unsigned char>(text[i]);
    if (c >= 0x20 && c != 0x7F) {
      out += static_cast<char>(c);
    } else if (c == '\n') {
      out += "\\n";
    } else if (c == '\t') {
      out += "\\t";
    } else if (c == '\r') {
      out += "\\r";
    } else {
      constexpr char kHex[] = "0123456789abcdef";
      out += "\\u00";
      out += kHex[c >> 4];
      out += kHex[c & 0xF];
    }
  }
  if (cut < text.size()) out += "...";
  return out;
}

std::string descriptor_message(const std::string& file, int line, int column,
                               const std::string& pointer, const std::string& what,
                               const std::string& expected, const std::string& found,
                               const std::string& hint) {
  constexpr std::size_t kAll = static_cast<std::size_t>(-1);
  std::string m = file;
  if (line > 0) m += ":" + std::to_string(line);
  if (line > 0 && column > 0) m += ":" + std::to_string(column);
  m += ": " + (pointer.empty() ? std::string("(root)") : printable(pointer, 200)) + ": " +
       printable(what, kAll);
  m += "; expected " + expected + ", found " + printable(found, kAll);
  if (!hint.empty()) m += "; " + printable(hint, kAll);
  return m;
}

}  // namespace detail
}  // namespace moejit
