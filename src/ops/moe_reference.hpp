// CPU models of the MoE kernels, for the tests: the route model (the exact arrays the route
// kernels write), MXFP4 and bf16 helpers, the activations in fp64, and the whole routed-expert
// layer in fp64. Plain loops, written from the semantics, sharing no code with the kernels.
#pragma once

#include <cstdint>
#include <random>
#include <vector>

#include "moejit/shape.hpp"

namespace moejit::detail {

// ---- route ----------------------------------------------------------------------------------

// What the route kernels write (see kernels/moe/route_params.cuh for the contract).
struct RouteReference {
  std::vector<int32_t> expert_counts;        // [E]
  std::vector<int32_t> expert_block_offset;  // [E + 1], in blocks; [E] = total_blocks
  std::vector<int32_t> sorted_rows;          // [total_blocks * B]: the rows the kernel defines
  std::vector<int32_t> block_expert;         // [max_blocks]: expert of block b, -1 past total
  std::vector<int32_t> slot_row;             // [T * K]: row of entry t * K + s, or -1
  int32_t total_blocks = 0;
  int64_t max_blocks = 0;  // the buffer bound: (N + min(E, N) * (B - 1)) / B, N = T * K
  // With group_rows G > 0 (route_params.cuh's groups; empty without):
  std::vector<int32_t> expert_group_offset;  // [E + 1], in groups; [E] = the groups used
  std::vector<int32_t> group_tiles;          // [2 * max_groups]: {first block, rows << 16 | e}
  int64_t max_groups = 0;                    // the same bound with G for B
};

// The route of `topk_ids` [T, K] onto local experts [expert_offset, expert_offset + E) with
// blocks of `block_m` rows and, where group_rows > 0, groups of group_rows rows (a multiple of
// block_m). Throws Error{kInvalidArgument} when ids.size() != T * K, T < 0, K < 1, E < 1,
// block_m < 1, expert_offset < 0, or group_rows is neither 0 nor a multiple of block_m.
RouteReference route_reference(const std::vector<int32_t>& topk_ids, int num_tokens, int top_k,
                               int num_experts, int expert_offset, int block_m, int group_rows = 0);

// ---- bf16 -----------------------------------------------------------------------------------

uint16_t bf16_bits(float x);      // round to nearest even; NaN stays a (quiet) NaN
float bf16_value(uint16_t bits);  // exact
float round_to_bf16(float x);     // bf16_value(bf16_bits(x))
double round_to_bf16(double x);   // rounded once, straight from fp64 (no fp32 step)

// ---- MXFP4 ----------------------------------------------------------------------------------

// E2M1 code (low 4 bits of `code`): 0, .5, 1, 1.5, 2, 3, 4, 6, then the same negated (8..15).
float e2m1_value(uint8_t code);
// E8M0 scale: 2^(e - 127); 0xFF is NaN.
double e8m0_value(uint8_t e);

// A row-major [rows, cols] MXFP4 matrix in the checkpoint layout: blocks [rows, cols / 32, 16]
// bytes, element 2j in the low nibble of byte j and 2j + 1 in the high nibble; scales
// [rows, cols / 32] E8M0, one per 32 consecutive elements of a row. An expert tensor
// [E, R, cols] is the matrix with E * R rows.
struct Mxfp4Matrix {
  int64_t rows = 0;
  int64_t cols = 0;  // a multiple of 32
  std::vector<uint8_t> blocks;
  std::vector<uint8_t> scales;
};

// Random codes (every one of the 16 equally likely) and scales 2^u with u uniform in
// [min_exponent, max_exponent] (within [-127, 127]).
Mxfp4Matrix mxfp4_random(int64_t rows, int64_t cols, int min_exponent, int max_exponent,
                         std::mt19937_64& rng);
// Quantize row-major values [rows, cols]: per 32 elements the smallest power-of-two scale with
// max |x| / scale <= 6 (so nothing clips), each element to the nearest E2M1 value (ties to the
// even code). An all-zero group gets scale 2^0.
Mxfp4Matrix mxfp4_quantize(const std::vector<float>& values, int64_t rows, int64_t cols);
// The exact values, row-major [rows, cols].
std::vector<double> mxfp4_dequantize(const Mxfp4Matrix& matrix);

// ---- activation -----------------------------------------------------------------------------

// act(gate, up) in fp64 for every ActivationKind (the formulas are in moejit/shape.hpp).
double activation_reference(const Activation& activation, double gate, double up);

// ---- the layer ------------------------------------------------------------------------------

// Dequantized weights of the local experts, fp64.
struct MoeWeightsF64 {
  int num_experts = 0;   // E, local
  int hidden = 0;        // H
  int intermediate = 0;  // I
  // FC1 row order: true = gpt-oss (row 2j is gate j, row 2j + 1 is up j); false = gate rows
  // [0, I), then up rows [I, 2I) (DeepSeek's w1 then w3).
  bool gate_up_interleaved = false;
  std::vector<double> w13;  // [E, 2I, H]
  std::vector<double> b13;  // [E, 2I] in w13's row order, or empty (no FC1 bias)
  std::vector<double> w2;   // [E, H, I]
  std::vector<double> b2;   // [E, H], or empty (no FC2 bias)
};

// Where the reference rounds to bf16, to mirror a kernel's storage points (fp64 elsewhere).
struct MoeLayerOptions {
  Activation activation;
  int expert_offset = 0;  // local experts are [expert_offset, expert_offset + E)
  // The intermediate act(FC1) of each (token, slot) rounded to bf16 before FC2 (what a kernel
  // that stores it in bf16 feeds FC2).
  bool round_intermediate_bf16 = false;
  // The weighted FC2 output w * (W2 a + b2) of each (token, slot) rounded to bf16 before the
  // sum over slots (what a kernel that stores the weighted FC2 output in bf16 sums).
  bool round_weighted_output_bf16 = false;
};

// out[t, :] = sum over slots k with a local id of w[t, k] * (W2_e act(W13_e x_t + b13_e) + b2_e),
// e = id - expert_offset; [T, H] fp64 (never rounded). hidden [T, H] holds the values the kernel
// reads (bf16 values as floats). Throws Error{kInvalidArgument} on any size mismatch.
std::vector<double> moe_layer_reference(const MoeWeightsF64& weights,
                                        const std::vector<float>& hidden,
                                        const std::vector<int32_t>& topk_ids,
                                        const std::vector<float>& topk_weights, int num_tokens,
                                        int top_k, const MoeLayerOptions& options);

}  // namespace moejit::detail
