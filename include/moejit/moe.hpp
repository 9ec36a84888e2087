// libmoejit: the routed-expert MoE layer (MXFP4 weights, bf16 activations) for an engine.
//
//   1. once per model load: size the kernel-layout weight buffers (moe_weight_layout), allocate
//      them, and repack the checkpoint into them on the GPU (moe_repack_gpt_oss or
//      moe_repack_separate);
//   2. once per engine: allocate moe_workspace_bytes(shape, max_tokens) bytes of device memory;
//   3. every layer, every step: moe_forward(shape, args, stream): route + FC1 (+ activation) +
//      FC2 + top-k weighted combine, on `stream`, with no allocation and no host sync, so it can
//      be captured in a CUDA graph. Run moejit::prewarm on the shape first, with the device's
//      context current: every kernel moe_forward can pick for any T <= shape.max_tokens is then
//      built and loaded in this process (`moejit prewarm` only fills the disk cache; a kernel
//      not loaded in the process when its stream captures is refused, kCaptureMiss).
//
// Two paths compute the same layer: decode_moe, one fused persistent kernel (after a tiny reset,
// before the top-k sum) for T <= 256 on sm_90 or newer, for shapes that meet its rules
// (moe_decode_problem), or for T <= 2 two kernels (FC1, then FC2 with the top-k sum) where H is
// also a multiple of 512; and marlin_moe, route -> FC1 -> FC2 -> combine, for every shape and every
// T. MoePath::kAuto takes the faster one (decode_moe's two-kernel tile for T = 1 where it serves;
// see MoePath); MoeForwardOptions can force either.
//
// All pointers are device pointers of the device of the current CUDA context; every tensor is
// contiguous (row-major, strides null or compact). The ops check raw pointers for null and
// alignment only; RuntimeConfig::check_pointers (MOEJIT_CHECK_POINTERS=1) also asks the driver
// whether each buffer's first and last byte are mapped memory of that device within one
// allocation, for debugging. Shapes use
// E = shape.num_experts (local), K = shape.top_k, H = shape.hidden, I = shape.intermediate,
// T = tokens of the call.
#pragma once

#include <dlpack/dlpack.h>

#include <cstddef>
#include <cstdint>
#include <string>

#include "moejit/ops.hpp"
#include "moejit/shape.hpp"

namespace moejit {

// Bytes of each kernel-layout buffer of one rank's experts. The layout does not depend on T or
// on the kernel configuration: one repack serves every call. It is this library build's, not a
// storage format: repack again after an upgrade, or, where repacked buffers are kept across runs,
// keep `version` beside them and repack when the library's differs.
struct MoeWeightLayout {
  std::size_t w13_bytes = 0;        // FC1 nibbles (gate and up rows fused)
  std::size_t w13_scale_bytes = 0;  // FC1 E8M0 scales
  std::size_t w2_bytes = 0;         // FC2 nibbles
  std::size_t w2_scale_bytes = 0;   // FC2 E8M0 scales
  std::size_t b13_bytes = 0;        // FC1 bias, bf16 [E, 2I]; 0 when !shape.has_bias
  std::size_t b2_bytes = 0;         // FC2 bias, bf16 [E, H]; 0 when !shape.has_bias
  int version = 0;                  // moe_weight_layout_version() of the library that sized it
};

// Throws Error{kInvalidDescriptor} when the shape breaks a rule, Error{kUnsupported} when no
// kernel serves it (the message says which rule).
MoeWeightLayout moe_weight_layout(const ModelShape& shape);

// The version of the kernel layout this library's repack writes and its kernels read: buffers
// repacked under another version must be repacked again (they would be misread, not refused).
int moe_weight_layout_version();

// The repacked weights moe_forward reads (sizes from moe_weight_layout). w13, w13_scales, w2 and
// w2_scales must be 16-byte aligned (256 is what an allocator gives), b13 4 and b2 2.
struct MoeWeights {
  void* w13 = nullptr;
  void* w13_scales = nullptr;
  void* w2 = nullptr;
  void* w2_scales = nullptr;
  // Biases need no repack: bf16, used as the checkpoint stores them. b13 [E, 2I] in gpt-oss row
  // order (b13[e, 2j] = gate j, b13[e, 2j + 1] = up j); b2 [E, H]. Both required when
  // shape.has_bias, both null otherwise.
  const void* b13 = nullptr;
  const void* b2 = nullptr;
};

// gpt-oss checkpoint (uint8 tensors as stored): w13 gate/up interleaved by row (row 2j = gate j,
// row 2j + 1 = up j).
//   w13_blocks [n, 2I, H/32, 16], w13_scales [n, 2I, H/32]
//   w2_blocks  [n, H, I/32, 16],  w2_scales  [n, H, I/32]
// n experts are written to local experts [first_expert, first_expert + n).
struct GptOssCheckpoint {
  const DLTensor* w13_blocks = nullptr;
  const DLTensor* w13_scales = nullptr;
  const DLTensor* w2_blocks = nullptr;
  const DLTensor* w2_scales = nullptr;
};

// DeepSeek-style checkpoint: w1 (gate), w3 (up) and w2 separate (uint8 as stored). Each tensor is
// either one expert (w1_blocks [I, H/32, 16], w1_scales [I, H/32], ...) or a stack of n experts
// ([n, I, H/32, 16], [n, I, H/32]); all six agree on n.
//   w1, w3: blocks [I, H/32, 16], scales [I, H/32];  w2: blocks [H, I/32, 16], scales [H, I/32]
struct SeparateCheckpoint {
  const DLTensor* w1_blocks = nullptr;
  const DLTensor* w1_scales = nullptr;
  const DLTensor* w3_blocks = nullptr;
  const DLTensor* w3_scales = nullptr;
  const DLTensor* w2_blocks = nullptr;
  const DLTensor* w2_scales = nullptr;
};

struct MoeRepackTarget {
  MoeWeights weights;    // w13, w13_scales, w2, w2_scales written (biases untouched), each
                         // 16-byte aligned as moe_forward reads them
  int first_expert = 0;  // local expert that checkpoint expert 0 becomes
  // Optional int32 [1] device counter: repack adds the number of scale bytes it cannot
  // dequantize exactly (0xFF = NaN, or a scale outside 2^-62 .. 2^64). Zero it first, read it
  // after the stream finishes; nonzero means the checkpoint should be refused. Null = not counted.
  int32_t* bad_scale_count = nullptr;
};

// Repack on `stream` (no allocation, no host sync). Throws Error{kInvalidArgument} naming the
// tensor and the expected vs found shape, dtype or device when an input does not match `shape`,
// when [first_expert, first_expert + n) leaves [0, E), or for a stream of another device than
// the current context's.
void moe_repack_gpt_oss(const ModelShape& shape, const GptOssCheckpoint& checkpoint,
                        const MoeRepackTarget& target, Stream stream);
void moe_repack_separate(const ModelShape& shape, const SeparateCheckpoint& checkpoint,
                         const MoeRepackTarget& target, Stream stream);

// Device workspace (bytes, 256-byte aligned base) moe_forward needs for any T <= max_tokens on
// either path, with any MoeForwardOptions: route arrays, the FC1 output and the FC2 output (and
// decode_moe's counters and buffers). Throws Error{kInvalidArgument} when max_tokens < 0 or
// exceeds shape.max_tokens.
std::size_t moe_workspace_bytes(const ModelShape& shape, int max_tokens);

struct MoeForwardArgs {
  // [T, H] bf16, 16-byte aligned.
  const DLTensor* hidden = nullptr;
  // [T, K] global expert ids, int32 (int64 when shape.id_dtype is kI64); -1 or another rank's
  // id contributes nothing.
  const DLTensor* topk_ids = nullptr;
  // [T, K] fp32.
  const DLTensor* topk_weights = nullptr;
  MoeWeights weights;
  // At least moe_workspace_bytes(shape, T) bytes (any larger max_tokens works), 256-byte aligned.
  // Scratch of this call from its launch until `stream` has run its kernels: every call writes
  // what it reads before reading it, so between calls the bytes may hold anything (another op may
  // reuse the buffer in stream order). Two calls in flight at once (on two streams) need two
  // workspaces: the kernels of one call wait on counters in it, and a second call resetting them
  // would corrupt the first call's output or stall its kernels. A kernel that waits on such a
  // counter for 10 s (kern::moe::kCounterWaitLimitNs; a layer takes milliseconds) traps: the
  // stream then reports a launch failure instead of hanging.
  void* workspace = nullptr;
  std::size_t workspace_bytes = 0;
  // [T, H] bf16, 16-byte aligned; written completely (0 for a token with no local expert).
  // Neither out nor the workspace may share a byte with hidden, topk_ids, topk_weights, the
  // repacked weights (their MoeWeightLayout sizes) or each other (refused: the kernels read the
  // inputs while they write).
  DLTensor* out = nullptr;
};

// Which kernels compute the layer.
enum class MoePath {
  kAuto,    // the faster path on the H200 (tools/PERF_LOG.md): decode_moe for T = 1 where its
            // two-kernel tile serves the shape (0.85-0.93x marlin_moe's time), marlin_moe
            // otherwise (decode_moe's persistent tile took 1.14-1.59x marlin_moe's time at T = 1
            // on the shapes the two-kernel tile refuses, and from T = 2 decode_moe is mostly
            // slower: up to 1.27x at T = 2)
  kMarlin,  // route -> FC1 -> FC2 -> combine (every shape, every T, sm_80 or newer)
  kDecode,  // decode_moe; Error{kUnsupported} where it can't serve (shape, T > 256, arch < sm_90)
};

struct MoeForwardOptions {
  MoePath path = MoePath::kAuto;
  // decode_moe's positions per virtual expert: 0 = the planner's choice, 8, 16 or 32 forces it
  // (the persistent tile at that block_n, also at T <= 2; used whenever the call takes the decode
  // path, and where kAuto's tile at that block_n fits no pipeline depth for the shape, kAuto takes
  // marlin_moe; prewarm builds only the planner's choices, so a forced value that differs is
  // compiled on first use). Anything else: Error{kInvalidArgument}.
  int decode_block_n = 0;
};

// out[t] = sum over slots s with a local id e of topk_weights[t, s] *
//          (W2_e act(W13_e hidden[t] + b13_e) + b2_e),
// summed in slot order (deterministic: same inputs, same path, same bits). T = 0 launches
// nothing. Throws Error{kInvalidArgument} on a mismatched tensor, a short workspace, bad options
// or a stream of another device than the current context's, Error{kUnsupported} when a forced path
// can't serve the call (the message names the rule), Error{kCaptureMiss} when a kernel is not built
// and the stream is capturing (prewarm first). The three-argument form is options.path = kAuto.
void moe_forward(const ModelShape& shape, const MoeForwardArgs& args, Stream stream);
void moe_forward(const ModelShape& shape, const MoeForwardArgs& args, Stream stream,
                 const MoeForwardOptions& options);

// "" when decode_moe serves `shape` for T <= 256 (on sm_90 or newer); otherwise the reason, e.g.
// "hidden = 2880 is not a multiple of 256 (...)", or that it has biases. Such shapes use
// marlin_moe on every T.
std::string moe_decode_problem(const ModelShape& shape);

}  // namespace moejit
