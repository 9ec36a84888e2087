// CPU models of the MoE kernels (see moe_reference.hpp).
#include "ops/moe_reference.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "common/check.hpp"

namespace moejit::detail {

namespace {

constexpr ErrorCode kBadArg = ErrorCode::kInvalidArgument;

double sigmoid(double x) {
  if (x >= 0) return 1.0 / (1.0 + std::exp(-x));
  const double e = std::exp(x);
  return e / (1.0 + e);
}

double silu(double x) { return x * sigmoid(x); }

// Why not std::min / std::clamp: both return the first argument when a compare with NaN is
// false, which would turn min(NaN, L) into NaN only by accident of argument order; spell it out.
double min_limit(double x, double limit) { return x > limit ? limit : x; }
double clamp_limit(double x, double limit) { return x > limit ? limit : (x < -limit ? -limit : x); }

constexpr float kE2m1Magnitude[8] = {0.f, 0.5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f};

// Nearest E2M1 code of v >= 0 (v <= 6), ties to the even code.
uint8_t nearest_e2m1(double v) {
  uint8_t best = 0;
  double best_err = std::numeric_limits<double>::infinity();
  for (uint8_t code = 0; code < 8; ++code) {
    const double err = std::fabs(v - static_cast<double>(kE2m1Magnitude[code]));
    if (err < best_err || (err == best_err && (code & 1u) == 0)) {
      best = code;
      best_err = err;
    }
  }
  return best;
}

}  // namespace

// ---- route ----------------------------------------------------------------------------------

RouteReference route_reference(const std::vector<int32_t>& topk_ids, int num_tokens, int top_k,
                               int num_experts, int expert_offset, int block_m, int group_rows) {
  MOEJIT_CHECK(
      num_tokens >= 0 && top_k >= 1 && num_experts >= 1 && block_m >= 1 && expert_offset >= 0,
      kBadArg,
      "route_reference: expected T >= 0, K >= 1, E >= 1, block_m >= 1 and "
      "expert_offset >= 0; found T = "
          << num_tokens << ", K = " << top_k << ", E = " << num_experts << ", block_m = " << block_m
          << ", expert_offset = " << expert_offset);
  MOEJIT_CHECK(group_rows == 0 || (group_rows >= block_m && group_rows % block_m == 0), kBadArg,
               "route_reference: group_rows = "
                   << group_rows << " must be 0 or a multiple of block_m = " << block_m);
  const int64_t n = static_cast<int64_t>(num_tokens) * top_k;
  MOEJIT_CHECK(static_cast<int64_t>(topk_ids.size()) == n, kBadArg,
               "route_reference: topk_ids holds "
                   << topk_ids.size() << " ids; expected T * K = " << n << " (T = " << num_tokens
                   << ", K = " << top_k << ")");
  const int64_t e_count = num_experts;
  const int64_t nonempty = std::min(e_count, n);
  RouteReference out;
  out.max_blocks = n == 0 ? 0 : (n + nonempty * (block_m - 1)) / block_m;
  MOEJIT_CHECK(out.max_blocks * block_m <= std::numeric_limits<int32_t>::max(), kBadArg,
               "route_reference: " << out.max_blocks * block_m
                                   << " padded rows do not fit int32; lower T, K or block_m");

  const int64_t lo = expert_offset;
  const int64_t hi = lo + num_experts;
  auto local = [&](int32_t id) -> int { return id >= lo && id < hi ? id - expert_offset : -1; };

  out.expert_counts.assign(static_cast<size_t>(num_experts), 0);
  for (int32_t id : topk_ids) {
    const int e = local(id);
    if (e >= 0) ++out.expert_counts[static_cast<size_t>(e)];
  }
  out.expert_block_offset.assign(static_cast<size_t>(num_experts) + 1, 0);
  for (size_t e = 0; e < out.expert_counts.size(); ++e) {
    out.expert_block_offset[e + 1] =
        out.expert_block_offset[e] + (out.expert_counts[e] + block_m - 1) / block_m;
  }
  out.total_blocks = out.expert_block_offset.back();

  out.sorted_rows.assign(static_cast<size_t>(out.total_blocks) * static_cast<size_t>(block_m), -1);
  out.block_expert.assign(static_cast<size_t>(out.max_blocks), -1);
  for (int e = 0; e < num_experts; ++e) {
    for (int32_t b = out.expert_block_offset[static_cast<size_t>(e)];
         b < out.expert_block_offset[static_cast<size_t>(e) + 1]; ++b) {
      out.block_expert[static_cast<size_t>(b)] = e;
    }
  }
  std::vector<int32_t> next(static_cast<size_t>(num_experts));
  for (size_t e = 0; e < next.size(); ++e) next[e] = out.expert_block_offset[e] * block_m;
  out.slot_row.assign(static_cast<size_t>(n), -1);
  for (int64_t i = 0; i < n; ++i) {
    const int e = local(topk_ids[static_cast<size_t>(i)]);
    if (e < 0) continue;
    const int32_t row = next[static_cast<size_t>(e)]++;
    out.sorted_rows[static_cast<size_t>(row)] = static_cast<int32_t>(i);
    out.slot_row[static_cast<size_t>(i)] = row;
  }
  if (group_rows > 0) {
    out.max_groups = n == 0 ? 0 : (n + nonempty * (group_rows - 1)) / group_rows;
    out.expert_group_offset.assign(static_cast<size_t>(num_experts) + 1, 0);
    out.group_tiles.assign(static_cast<size_t>(out.max_groups) * 2, -1);
    for (size_t e = 0; e < out.expert_counts.size(); ++e) {
      const int32_t count = out.expert_counts[e];
      const int32_t groups = (count + group_rows - 1) / group_rows;
      const int32_t first = out.expert_group_offset[e];
      out.expert_group_offset[e + 1] = first + groups;
      for (int32_t j = 0; j < groups; ++j) {
        const size_t g = static_cast<size_t>(first + j);
        out.group_tiles[2 * g] = out.expert_block_offset[e] + j * (group_rows / block_m);
        out.group_tiles[2 * g + 1] =
            (std::min(group_rows, count - j * group_rows) << 16) | static_cast<int32_t>(e);
      }
    }
  }
  return out;
}

// ---- bf16 -----------------------------------------------------------------------------------

uint16_t bf16_bits(float x) {
  uint32_t u = 0;
  std::memcpy(&u, &x, sizeof(u));
  if (std::isnan(x)) return static_cast<uint16_t>((u >> 16) | 0x0040u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

float bf16_value(uint16_t bits) {
  const uint32_t u = static_cast<uint32_t>(bits) << 16;
  float x = 0;
  std::memcpy(&x, &u, sizeof(x));
  return x;
}

float round_to_bf16(float x) { return bf16_value(bf16_bits(x)); }

double round_to_bf16(double x) {
  if (!std::isfinite(x) || x == 0) return x;
  // Why: 8 significant bits; below the normal range the quantum stays 2^-133 (subnormals).
  const int exponent = std::max(std::ilogb(x), -126);
  const double quantum = std::ldexp(1.0, exponent - 7);
  const double rounded = std::nearbyint(x / quantum) * quantum;  // ties to even (default mode)
  if (std::fabs(rounded) >= std::ldexp(1.0, 128)) {
    return std::copysign(std::numeric_limits<double>::infinity(), x);
  }
  return rounded;
}

// ---- MXFP4 ----------------------------------------------------------------------------------

float e2m1_value(uint8_t code) {
  const float magnitude = kE2m1Magnitude[code & 7u];
  return (code & 8u) != 0 ? -magnitude : magnitude;
}

double e8m0_value(uint8_t e) {
  if (e == 0xffu) return std::numeric_limits<double>::quiet_NaN();
  return std::ldexp(1.0, static_cast<int>(e) - 127);
}

namespace {

void check_mxfp4_shape(int64_t rows, int64_t cols, const char* where) {
  MOEJIT_CHECK(rows >= 0 && cols >= 0 && cols % 32 == 0, kBadArg,
               where << ": expected rows >= 0 and cols a multiple of 32 (one E8M0 scale per 32 "
                        "elements); found rows = "
                     << rows << ", cols = " << cols);
}

}  // namespace

Mxfp4Matrix mxfp4_random(int64_t rows, int64_t cols, int min_exponent, int max_exponent,
                         std::mt19937_64& rng) {
  check_mxfp4_shape(rows, cols, "mxfp4_random");
  MOEJIT_CHECK(min_exponent >= -127 && max_exponent <= 127 && min_exponent <= max_exponent, kBadArg,
               "mxfp4_random: expected -127 <= min_exponent <= max_exponent <= 127 (E8M0 0xFF "
               "is NaN); found ["
                   << min_exponent << ", " << max_exponent << "]");
  Mxfp4Matrix m;
  m.rows = rows;
  m.cols = cols;
  m.blocks.resize(static_cast<size_t>(rows * cols / 2));
  m.scales.resize(static_cast<size_t>(rows * cols / 32));
  std::uniform_int_distribution<int> byte(0, 255);
  std::uniform_int_distribution<int> exponent(min_exponent, max_exponent);
  for (uint8_t& b : m.blocks) b = static_cast<uint8_t>(byte(rng));
  for (uint8_t& s : m.scales) s = static_cast<uint8_t>(exponent(rng) + 127);
  return m;
}

Mxfp4Matrix mxfp4_quantize(const std::vector<float>& values, int64_t rows, int64_t cols) {
  check_mxfp4_shape(rows, cols, "mxfp4_quantize");
  MOEJIT_CHECK(static_cast<int64_t>(values.size()) == rows * cols, kBadArg,
               "mxfp4_quantize: " << values.size() << " values for a [" << rows << ", " << cols
                                  << "] matrix");
  Mxfp4Matrix m;
  m.rows = rows;
  m.cols = cols;
  m.blocks.assign(static_cast<size_t>(rows * cols / 2), 0);
  m.scales.assign(static_cast<size_t>(rows * cols / 32), 127);
  for (int64_t g = 0; g < rows * cols / 32; ++g) {
    const float* x = values.data() + g * 32;
    double amax = 0;
    for (int j = 0; j < 32; ++j) amax = std::max(amax, std::fabs(static_cast<double>(x[j])));
    int k = 0;
    if (amax > 0) {
      k = std::ilogb(amax) - 2;
      while (amax > 6.0 * std::ldexp(1.0, k)) ++k;
      while (amax <= 6.0 * std::ldexp(1.0, k - 1)) --k;
      k = std::min(std::max(k, -127), 127);
    }
    m.scales[static_cast<size_t>(g)] = static_cast<uint8_t>(k + 127);
    const double scale = std::ldexp(1.0, k);
    for (int j = 0; j < 32; ++j) {
      const double v = static_cast<double>(x[j]);
      uint8_t code = nearest_e2m1(std::min(std::fabs(v) / scale, 6.0));
      if (v < 0 && code != 0) code = static_cast<uint8_t>(code | 8u);
      uint8_t& byte = m.blocks[static_cast<size_t>(g * 16 + j / 2)];
      byte = static_cast<uint8_t>((j % 2 == 0) ? ((byte & 0xf0u) | code)
                                               : ((byte & 0x0fu) | (code << 4)));
    }
  }
  return m;
}

std::vector<double> mxfp4_dequantize(const Mxfp4Matrix& matrix) {
  check_mxfp4_shape(matrix.rows, matrix.cols, "mxfp4_dequantize");
  const int64_t count = matrix.rows * matrix.cols;
  MOEJIT_CHECK(static_cast<int64_t>(matrix.blocks.size()) == count / 2 &&
                   static_cast<int64_t>(matrix.scales.size()) == count / 32,
               kBadArg,
               "mxfp4_dequantize: a [" << matrix.rows << ", " << matrix.cols << "] matrix needs "
                                       << count / 2 << " block bytes and " << count / 32
                                       << " scales; found " << matrix.blocks.size() << " and "
                                       << matrix.scales.size());
  std::vector<double> out(static_cast<size_t>(count));
  for (int64_t i = 0; i < count; ++i) {
    const uint8_t byte = matrix.blocks[static_cast<size_t>(i / 2)];
    const uint8_t code = static_cast<uint8_t>(i % 2 == 0 ? byte & 0x0fu : byte >> 4);
    out[static_cast<size_t>(i)] = static_cast<double>(e2m1_value(code)) *
                                  e8m0_value(matrix.scales[static_cast<size_t>(i / 32)]);
  }
  return out;
}

// ---- activation -----------------------------------------------------------------------------

double activation_reference(const Activation& activation, double gate, double up) {
  const double limit = activation.limit;
  switch (activation.kind) {
    case ActivationKind::kSwiGLU:
      return silu(gate) * up;
    case ActivationKind::kClampedSwiGLU:
      MOEJIT_CHECK(limit > 0, kBadArg,
                   "activation_reference: clamped SwiGLU needs limit > 0; "
                   "found "
                       << limit);
      return silu(min_limit(gate, limit)) * clamp_limit(up, limit);
    case ActivationKind::kGptOss: {
      MOEJIT_CHECK(limit > 0, kBadArg,
                   "activation_reference: gpt-oss activation needs limit > 0; found " << limit);
      const double g = min_limit(gate, limit);
      const double u = clamp_limit(up, limit);
      return g * sigmoid(static_cast<double>(activation.alpha) * g) * (u + 1.0);
    }
    case ActivationKind::kSiTU: {
      const double beta = activation.beta;
      const double linear_beta = activation.linear_beta;
      MOEJIT_CHECK(beta > 0 && linear_beta > 0, kBadArg,
                   "activation_reference: SiTU needs beta > 0 and linear_beta > 0; found beta = "
                       << beta << ", linear_beta = " << linear_beta);
      return beta * std::tanh(gate / beta) * sigmoid(gate) * linear_beta *
             std::tanh(up / linear_beta);
    }
  }
  throw Error(ErrorCode::kInternal, "activation_reference: unknown activation kind");
}

// ---- the layer ------------------------------------------------------------------------------

std::vector<double> moe_layer_reference(const MoeWeightsF64& weights,
                                        const std::vector<float>& hidden,
                                        const std::vector<int32_t>& topk_ids,
                                        const std::vector<float>& topk_weights, int num_tokens,
                                        int top_k, const MoeLayerOptions& options) {
  const int64_t e_count = weights.num_experts;
  const int64_t h = weights.hidden;
  const int64_t inter = weights.intermediate;
  MOEJIT_CHECK(e_count >= 1 && h >= 1 && inter >= 1 && num_tokens >= 0 && top_k >= 1 &&
                   options.expert_offset >= 0,
               kBadArg,
               "moe_layer_reference: expected E, H, I, K >= 1 and T, expert_offset >= 0; found E = "
                   << e_count << ", H = " << h << ", I = " << inter << ", T = " << num_tokens
                   << ", K = " << top_k << ", expert_offset = " << options.expert_offset);
  auto expect_size = [](size_t found, int64_t expected, bool optional, const char* what) {
    MOEJIT_CHECK(static_cast<int64_t>(found) == expected || (optional && found == 0), kBadArg,
                 "moe_layer_reference: " << what << " holds " << found << " values; expected "
                                         << expected << (optional ? " (or 0: none)" : ""));
  };
  expect_size(weights.w13.size(), e_count * 2 * inter * h, false, "w13 [E, 2I, H]");
  expect_size(weights.b13.size(), e_count * 2 * inter, true, "b13 [E, 2I]");
  expect_size(weights.w2.size(), e_count * h * inter, false, "w2 [E, H, I]");
  expect_size(weights.b2.size(), e_count * h, true, "b2 [E, H]");
  const int64_t slots = static_cast<int64_t>(num_tokens) * top_k;
  expect_size(hidden.size(), num_tokens * h, false, "hidden [T, H]");
  expect_size(topk_ids.size(), slots, false, "topk_ids [T, K]");
  expect_size(topk_weights.size(), slots, false, "topk_weights [T, K]");

  std::vector<double> x(hidden.begin(), hidden.end());
  std::vector<double> out(static_cast<size_t>(num_tokens * h), 0.0);
  // Slots grouped by local expert, so each expert's weights are walked once for all its tokens.
  std::vector<std::vector<int64_t>> by_expert(static_cast<size_t>(e_count));
  for (int64_t i = 0; i < slots; ++i) {
    const int64_t id = topk_ids[static_cast<size_t>(i)];
    const int64_t e = id - options.expert_offset;
    if (e >= 0 && e < e_count) by_expert[static_cast<size_t>(e)].push_back(i);
  }
  std::vector<double> fc1;
  std::vector<double> act;
  for (int64_t e = 0; e < e_count; ++e) {
    const std::vector<int64_t>& list = by_expert[static_cast<size_t>(e)];
    if (list.empty()) continue;
    const int64_t m = static_cast<int64_t>(list.size());
    const double* w13 = weights.w13.data() + e * 2 * inter * h;
    fc1.assign(static_cast<size_t>(m * 2 * inter), 0.0);
    for (int64_t row = 0; row < 2 * inter; ++row) {
      const double* w = w13 + row * h;
      const double bias =
          weights.b13.empty() ? 0.0 : weights.b13[static_cast<size_t>(e * 2 * inter + row)];
      for (int64_t s = 0; s < m; ++s) {
        const double* xt = x.data() + (list[static_cast<size_t>(s)] / top_k) * h;
        double acc = 0;
        for (int64_t k = 0; k < h; ++k) acc += w[k] * xt[k];
        fc1[static_cast<size_t>(s * 2 * inter + row)] = acc + bias;
      }
    }
    act.assign(static_cast<size_t>(m * inter), 0.0);
    for (int64_t s = 0; s < m; ++s) {
      const double* f = fc1.data() + s * 2 * inter;
      for (int64_t j = 0; j < inter; ++j) {
        const double gate = weights.gate_up_interleaved ? f[2 * j] : f[j];
        const double up = weights.gate_up_interleaved ? f[2 * j + 1] : f[inter + j];
        double a = activation_reference(options.activation, gate, up);
        if (options.round_intermediate_bf16) a = round_to_bf16(a);
        act[static_cast<size_t>(s * inter + j)] = a;
      }
    }
    const double* w2 = weights.w2.data() + e * h * inter;
    for (int64_t row = 0; row < h; ++row) {
      const double* w = w2 + row * inter;
      const double bias = weights.b2.empty() ? 0.0 : weights.b2[static_cast<size_t>(e * h + row)];
      for (int64_t s = 0; s < m; ++s) {
        const int64_t slot = list[static_cast<size_t>(s)];
        const double* a = act.data() + s * inter;
        double acc = 0;
        for (int64_t j = 0; j < inter; ++j) acc += w[j] * a[j];
        double y = static_cast<double>(topk_weights[static_cast<size_t>(slot)]) * (acc + bias);
        if (options.round_weighted_output_bf16) y = round_to_bf16(y);
        out[static_cast<size_t>((slot / top_k) * h + row)] += y;
      }
    }
  }
  return out;
}

}  // namespace moejit::detail
