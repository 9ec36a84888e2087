/* libmoejit C ABI: for engines that bind from Python or C. Every call that can fail returns a
 * moejit_status; on failure moejit_last_error() gives this thread's message. No call throws.
 * The runtime takes its settings from the environment when it first starts (README's table):
 * e.g. MOEJIT_CHECK_POINTERS=1 makes every op ask the driver about each buffer it is given
 * (first and last byte) and refuse one the kernels can't reach with
 * MOEJIT_ERROR_INVALID_ARGUMENT naming it. */
#ifndef MOEJIT_MOEJIT_H_
#define MOEJIT_MOEJIT_H_

#include <dlpack/dlpack.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef enum moejit_status {
  MOEJIT_OK = 0,
  MOEJIT_ERROR_INVALID_DESCRIPTOR = 1,
  MOEJIT_ERROR_INVALID_ARGUMENT = 2,
  MOEJIT_ERROR_UNSUPPORTED = 3,
  MOEJIT_ERROR_COMPILE_FAILED = 4,
  MOEJIT_ERROR_CACHE_CORRUPT = 5,
  MOEJIT_ERROR_CACHE = 6,
  MOEJIT_ERROR_DRIVER = 7,
  MOEJIT_ERROR_CAPTURE_MISS = 8,
  MOEJIT_ERROR_IO = 9,
  MOEJIT_ERROR_INTERNAL = 10,
} moejit_status;

/* The *_RANGE_MIN_ and *_RANGE_MAX_ members name no choice: they make the enum's range every int
 * (in C++ an enum holds only the values its members span), so a wrong value passed from C reaches
 * the library's check and its error instead of undefined behaviour. */
typedef enum moejit_shared_gate {
  MOEJIT_SHARED_SIGMOID = 0,
  MOEJIT_SHARED_CONSTANT = 1,
  MOEJIT_SHARED_GIVEN = 2,
  MOEJIT_SHARED_GATE_RANGE_MIN_ = -2147483647 - 1,
  MOEJIT_SHARED_GATE_RANGE_MAX_ = 2147483647
} moejit_shared_gate;

/* ---- Structs that can grow ----------------------------------------------------------------------
 * moejit_prewarm_result, moejit_moe_weight_layout and moejit_moe_weights start with struct_size,
 * which the caller sets to the size of the struct as its header declares it, e.g. in C
 *   moejit_moe_weights weights = {.struct_size = sizeof(weights)};
 * (in C++: `moejit_moe_weights weights{}; weights.struct_size = sizeof(weights);`),
 * so that a later library can add fields at a struct's end and still serve programs built against
 * an earlier header, and the reverse:
 * - an input (moejit_moe_weights): fields past the caller's struct_size read as 0 (their
 *   default); bytes past the library's own size must be 0, else MOEJIT_ERROR_UNSUPPORTED (the
 *   caller set a field this library doesn't know);
 * - an output (moejit_prewarm_result, moejit_moe_weight_layout): the library fills the fields both
 *   sizes hold, leaves any bytes past its own size as they were, and sets struct_size to the bytes
 *   it filled.
 * A struct_size below the struct's first size (its size in libmoejit 0.3.0, this header's), not a
 * multiple of 8, or over 1024 is MOEJIT_ERROR_INVALID_ARGUMENT naming the struct: most often a
 * struct_size left unset. */

/* This thread's last error message ("" after a success). Valid until the thread's next call. */
const char* moejit_last_error(void);

/* The running library's version, "MAJOR.MINOR.PATCH" (moejit::library_version): compare it with
 * the version a binding was written for, since the shared library can be replaced under it. */
const char* moejit_version(void);

/* Turn the pointer checks on (nonzero) or off for the ops' later calls, from any thread, at any
 * time (moejit::set_check_pointers; MOEJIT_CHECK_POINTERS sets them at start-up): each op then asks
 * the driver about every buffer it is given before it launches, and refuses memory a kernel
 * can't reach (README, "Environment variables"). `previous` (may be NULL) receives the setting
 * before the call, 0 or 1. */
moejit_status moejit_set_check_pointers(int on, int* previous);

/* Register a shape file; names are then usable by name. */
moejit_status moejit_register_shapes_file(const char* path);

/* Register shapes from JSON text (the shape file format, e.g. built from a model's config at run
 * time); source_name stands for the file in error messages (NULL: "<text>"). */
moejit_status moejit_register_shapes(const char* json_text, const char* source_name);

/* ---- Prewarm (moejit::prewarm) ------------------------------------------------------------------
 * Compile, or find in the cache, every kernel the registered shapes need, so that no op compiles
 * afterwards (an op that misses while its stream captures a CUDA graph fails with
 * MOEJIT_ERROR_CAPTURE_MISS). The kernels for the current CUDA context's device are also loaded
 * into that context, so a graph captured next needs no load either. */

typedef struct moejit_prewarm_result {
  size_t struct_size; /* sizeof(moejit_prewarm_result), set by the caller (structs that can grow) */
  size_t kernels;     /* distinct kernels the shapes need for the arch */
  size_t compiled;    /* compiled by NVRTC and stored in the disk cache */
  size_t not_stored;  /* compiled, held in memory, not stored (read-only or memory-only cache,
                       * or the store failed: the log says why) */
  size_t cached;      /* found in this process's memory or in the disk cache */
  size_t failed;      /* failed to compile or load; moejit_last_error() names each */
  double milliseconds; /* wall time of the call */
} moejit_prewarm_result;

/* Called once per kernel as it is ready or has failed, done = 1..total, from the call's worker
 * threads one at a time. kernel: its display name; outcome: "compiled", "compiled (not stored)",
 * "cached" or "failed". Both strings live until the callback returns. */
typedef void (*moejit_prewarm_progress)(const char* kernel, const char* outcome,
                                        double milliseconds, size_t done, size_t total,
                                        void* user_data);

/* shape_names: shape_count >= 1 registered names. arch: "sm_90a", ...; NULL = the arch of the
 * current CUDA context's device. jobs: compiles at once, 0 = one per hardware thread. progress
 * and result may be NULL. Returns MOEJIT_OK when every kernel is ready; when some failed,
 * MOEJIT_ERROR_COMPILE_FAILED with each failure in moejit_last_error() (the others are ready, and
 * *result counts both; a kernel the arch can't run fails with the reason, without a compile).
 * MOEJIT_ERROR_INVALID_ARGUMENT, before any kernel, for an arch this NVRTC can't target or an
 * environment the runtime can't use (a bad MOEJIT_CACHE_MODE, ...). */
moejit_status moejit_prewarm(const char* const* shape_names, size_t shape_count, const char* arch,
                             int jobs, moejit_prewarm_progress progress, void* user_data,
                             moejit_prewarm_result* result);
/* ---- end of prewarm -------------------------------------------------------------------------- */

/* See moejit::append_shared in moejit/ops.hpp. stream is a CUstream / cudaStream_t. */
moejit_status moejit_append_shared(const DLTensor* topk_ids, const DLTensor* topk_weights,
                                   const DLTensor* shared_logits, DLTensor* out_ids,
                                   DLTensor* out_weights, int64_t shared_base, float scale,
                                   moejit_shared_gate gate, void* stream);

/* ---- MoE layer (moejit/moe.hpp) ---------------------------------------------------------------
 * A moejit_moe is a registered shape resolved once (moejit_register_shapes_file first), so the
 * per-layer call looks nothing up by name. Tensors are DLTensors on the current CUDA context's
 * device; stream is a CUstream / cudaStream_t of that device (another device's is refused,
 * MOEJIT_ERROR_INVALID_ARGUMENT). */

typedef struct moejit_moe moejit_moe;

/* Resolves the registered shape `shape_name`; *out must be released with moejit_moe_destroy.
 * Using a moejit_moe after its destroy, or destroying it twice, is undefined (as for free). */
moejit_status moejit_moe_create(const char* shape_name, moejit_moe** out);
void moejit_moe_destroy(moejit_moe* moe);

/* Bytes of each repacked weight buffer (b13 / b2 are 0 when the shape has no biases). */
typedef struct moejit_moe_weight_layout {
  size_t struct_size; /* sizeof(moejit_moe_weight_layout), set by the caller */
  size_t w13_bytes;
  size_t w13_scale_bytes;
  size_t w2_bytes;
  size_t w2_scale_bytes;
  size_t b13_bytes;
  size_t b2_bytes;
} moejit_moe_weight_layout;
moejit_status moejit_moe_get_weight_layout(const moejit_moe* moe, moejit_moe_weight_layout* out);

/* The version of the kernel layout this library repacks into (moejit::moe_weight_layout_version):
 * repacked buffers kept across runs must be repacked again when it differs from theirs. */
int moejit_moe_weight_layout_version(void);

/* Repacked weights (device pointers); b13 / b2: bf16 biases as the checkpoint stores them, null
 * when the shape has none. */
typedef struct moejit_moe_weights {
  size_t struct_size; /* sizeof(moejit_moe_weights), set by the caller */
  void* w13;
  void* w13_scales;
  void* w2;
  void* w2_scales;
  const void* b13;
  const void* b2;
} moejit_moe_weights;

/* Repack a gpt-oss checkpoint (w13 interleaved) or a separate w1 / w3 / w2 one into `target`'s
 * w13, w13_scales, w2, w2_scales (each 16-byte aligned, as moejit_moe_forward reads them);
 * checkpoint expert 0 becomes local expert first_expert.
 * bad_scale_count: optional int32 device counter, incremented by the scale bytes that can't be
 * dequantized exactly. Shapes of the tensors: see moejit/moe.hpp. */
moejit_status moejit_moe_repack_gpt_oss(const moejit_moe* moe, const DLTensor* w13_blocks,
                                        const DLTensor* w13_scales, const DLTensor* w2_blocks,
                                        const DLTensor* w2_scales, const moejit_moe_weights* target,
                                        int first_expert, int32_t* bad_scale_count, void* stream);
moejit_status moejit_moe_repack_separate(const moejit_moe* moe, const DLTensor* w1_blocks,
                                         const DLTensor* w1_scales, const DLTensor* w3_blocks,
                                         const DLTensor* w3_scales, const DLTensor* w2_blocks,
                                         const DLTensor* w2_scales,
                                         const moejit_moe_weights* target, int first_expert,
                                         int32_t* bad_scale_count, void* stream);

/* Device workspace bytes moejit_moe_forward needs for any T <= max_tokens. */
moejit_status moejit_moe_workspace_bytes(const moejit_moe* moe, int max_tokens, size_t* out);

/* out [T, H] bf16 = the routed-expert layer of hidden [T, H] bf16 with topk_ids [T, K] (int32, or
 * int64 when the shape says) and topk_weights [T, K] fp32. No allocation, no host sync, CUDA-graph
 * capturable after a prewarm. The workspace is the call's scratch until the stream has run its
 * kernels (its bytes may hold anything between calls); two calls in flight at once need two
 * workspaces (moejit::MoeForwardArgs::workspace). out and the workspace share no byte with the
 * inputs (the weights included, at their layout sizes) or each other. Alignment: workspace 256
 * bytes; hidden, out, w13, w13_scales, w2 and w2_scales 16; b13 4; b2 2. Either broken:
 * MOEJIT_ERROR_INVALID_ARGUMENT, naming the argument. */
moejit_status moejit_moe_forward(const moejit_moe* moe, const DLTensor* hidden,
                                 const DLTensor* topk_ids, const DLTensor* topk_weights,
                                 const moejit_moe_weights* weights, void* workspace,
                                 size_t workspace_bytes, DLTensor* out, void* stream);

/* Which kernels compute the layer (moejit::MoePath). */
typedef enum moejit_moe_path {
  MOEJIT_MOE_PATH_AUTO = 0,   /* the faster path (moejit::MoePath::kAuto) */
  MOEJIT_MOE_PATH_MARLIN = 1, /* route -> FC1 -> FC2 -> combine, every shape and T */
  MOEJIT_MOE_PATH_DECODE = 2, /* decode_moe; MOEJIT_ERROR_UNSUPPORTED where it can't serve */
  MOEJIT_MOE_PATH_RANGE_MIN_ = -2147483647 - 1, /* not a path: see moejit_shared_gate */
  MOEJIT_MOE_PATH_RANGE_MAX_ = 2147483647
} moejit_moe_path;

/* moejit_moe_forward with moejit::MoeForwardOptions: `path`, and decode_block_n (0 = the
 * planner's choice, 8, 16 or 32 forces decode_moe's positions per virtual expert). */
moejit_status moejit_moe_forward_ex(const moejit_moe* moe, const DLTensor* hidden,
                                    const DLTensor* topk_ids, const DLTensor* topk_weights,
                                    const moejit_moe_weights* weights, void* workspace,
                                    size_t workspace_bytes, DLTensor* out, moejit_moe_path path,
                                    int decode_block_n, void* stream);

/* *out = "" when decode_moe serves the shape (T <= 256, sm_90 or newer), else the reason
 * (moejit::moe_decode_problem). The text lives as long as the handle. */
moejit_status moejit_moe_decode_problem(const moejit_moe* moe, const char** out);
/* ---- end of MoE layer ------------------------------------------------------------------------ */

#ifdef __cplusplus
}
#endif

#endif /* MOEJIT_MOEJIT_H_ */
