// moe_forward: argument checks, the config for T (detail::choose_moe_config, the function the
// planner uses, so a prewarmed cache holds every kernel looked up here), the path (decode_moe's
// reset -> fused layer, or [narrow_ids] -> route -> FC1 -> FC2 -> combine), workspace carving,
// and the launches on the caller's stream. The valid path allocates no device memory (host
// memory only for the first launch of a kernel in a thread and context) and never synchronizes:
// it is CUDA-graph capturable.
#include <cuda.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <limits>
#include <moejit/kern/moe/decode_params.cuh>
#include <moejit/kern/moe/layout.cuh>
#include <moejit/kern/moe/params.cuh>
#include <moejit/kern/moe/route_params.cuh>
#include <string>

#include "moejit/error.hpp"
#include "moejit/moe.hpp"
#include "moejit/version.hpp"
#include "ops/decode_forward.hpp"
#include "ops/moe_launch.hpp"
#include "ops/tensor_checks.hpp"
#include "plan/moe_plan.hpp"
#include "runtime/runtime_impl.hpp"

namespace moejit {
namespace {

constexpr const char* kOp = "moe_forward";
constexpr const char* kWorkspaceOp = "moe_workspace_bytes";
constexpr const char* kLayoutOp = "moe_weight_layout";

std::string dims(int64_t rows, int64_t cols) {
  return "[" + std::to_string(rows) + ", " + std::to_string(cols) + "]";
}

[[noreturn]] __attribute__((cold, noinline)) void throw_shape_problem(ErrorCode code,
                                                                      const char* op,
                                                                      const std::string& reason) {
  throw Error(code, std::string(op) + ": " + reason);
}

void check_shape(const char* op, const ModelShape& shape) {
  const std::string reason = detail::moe_shape_problem(shape);
  if (!reason.empty()) throw_shape_problem(ErrorCode::kInvalidDescriptor, op, reason);
}

unsigned ceil_div_u(uint64_t a, uint64_t b) { return static_cast<unsigned>((a + b - 1) / b); }

void check_options(const MoeForwardOptions& options) {
  if (options.path != MoePath::kAuto && options.path != MoePath::kMarlin &&
      options.path != MoePath::kDecode) {
    detail::throw_argument(kOp, "options.path", "MoePath::kAuto, kMarlin or kDecode",
                           std::to_string(static_cast<int>(options.path)));
  }
  if (options.decode_block_n != 0 && options.decode_block_n != 8 && options.decode_block_n != 16 &&
      options.decode_block_n != 32) {
    detail::throw_argument(kOp, "options.decode_block_n",
                           "0 (the planner's choice), 8, 16 or 32 (decode_moe's block_n)",
                           std::to_string(options.decode_block_n));
  }
}

// Why here and cold: only a forced decode path that can't run formats a message.
[[noreturn]] __attribute__((cold, noinline)) void throw_decode_refused(const std::string& reason) {
  throw Error(ErrorCode::kUnsupported,
              std::string(kOp) + ": a forced decode path can't serve this call: " + reason +
                  " (the auto or the marlin path serves it)");
}

}  // namespace

static_assert(kMoeWeightLayoutVersion == kern::moe::layout::kVersion,
              "version.hpp's kMoeWeightLayoutVersion is layout.cuh's kVersion");

int moe_weight_layout_version() { return kern::moe::layout::kVersion; }

MoeWeightLayout moe_weight_layout(const ModelShape& shape) {
  check_shape(kLayoutOp, shape);
  const detail::MoeWeightSizes sizes = detail::moe_weight_sizes(shape);
  MoeWeightLayout layout;
  layout.version = moe_weight_layout_version();
  layout.w13_bytes = sizes.w13;
  layout.w13_scale_bytes = sizes.w13_scales;
  layout.w2_bytes = sizes.w2;
  layout.w2_scale_bytes = sizes.w2_scales;
  layout.b13_bytes = sizes.b13;
  layout.b2_bytes = sizes.b2;
  return layout;
}

std::size_t moe_workspace_bytes(const ModelShape& shape, int max_tokens) {
  check_shape(kWorkspaceOp, shape);
  if (max_tokens < 0 || max_tokens > shape.max_tokens) {
    detail::throw_argument(kWorkspaceOp, "max_tokens",
                           "0.." + std::to_string(shape.max_tokens) + " (the shape's max_tokens)",
                           std::to_string(max_tokens));
  }
  return detail::moe_workspace_bytes_for(shape, max_tokens);
}

std::string moe_decode_problem(const ModelShape& shape) {
  check_shape("moe_decode_problem", shape);
  return detail::decode_moe_problem(shape);
}

void moe_forward(const ModelShape& shape, const MoeForwardArgs& args, Stream stream) {
  moe_forward(shape, args, stream, MoeForwardOptions{});
}

void moe_forward(const ModelShape& shape, const MoeForwardArgs& args, Stream stream,
                 const MoeForwardOptions& options) {
  using detail::Matrix;
  check_shape(kOp, shape);
  check_options(options);
  const bool forced_decode = options.path == MoePath::kDecode;
  if (forced_decode) {
    // Why first: a forced path that can never serve this shape is the caller's error whatever
    // the tensors, T or device are.
    const std::string reason = detail::decode_moe_problem(shape);
    if (!reason.empty()) throw_decode_refused(reason);
  }
  detail::Runtime& runtime = detail::Runtime::instance();
  const detail::OpTarget target = detail::op_target(kOp, runtime, stream);
  const detail::CurrentDevice& device = target.device;
  const int64_t hidden_size = shape.hidden;
  const int64_t top_k = shape.top_k;

  const Matrix hidden = detail::check_matrix(kOp, "hidden", args.hidden, device.ordinal);
  if (hidden.dtype != DType::kBF16) detail::throw_dtype(kOp, "hidden", "bfloat16", *args.hidden);
  if (hidden.cols != hidden_size) {
    detail::throw_shape(
        kOp, "hidden",
        "[T, H] with H = " + std::to_string(hidden_size) + " (shape \"" + shape.name + "\")",
        *args.hidden);
  }
  const int64_t tokens = hidden.rows;

  const Matrix ids = detail::check_matrix(kOp, "topk_ids", args.topk_ids, device.ordinal);
  if (ids.dtype != shape.id_dtype) {
    detail::throw_dtype(kOp, "topk_ids",
                        shape.id_dtype == DType::kI64 ? "int64 (the shape's id_dtype)"
                                                      : "int32 (the shape's id_dtype)",
                        *args.topk_ids);
  }
  if (ids.rows != tokens || ids.cols != top_k) {
    detail::throw_shape(kOp, "topk_ids",
                        "[T, K] = " + dims(tokens, top_k) + " (T from hidden, K from the shape)",
                        *args.topk_ids);
  }
  const Matrix weights =
      detail::check_matrix(kOp, "topk_weights", args.topk_weights, device.ordinal);
  if (weights.dtype != DType::kF32) {
    detail::throw_dtype(kOp, "topk_weights", "float32", *args.topk_weights);
  }
  if (weights.rows != tokens || weights.cols != top_k) {
    detail::throw_shape(kOp, "topk_weights", "[T, K] = " + dims(tokens, top_k), *args.topk_weights);
  }
  const Matrix out = detail::check_matrix(kOp, "out", args.out, device.ordinal);
  if (out.dtype != DType::kBF16) detail::throw_dtype(kOp, "out", "bfloat16", *args.out);
  if (out.rows != tokens || out.cols != hidden_size) {
    detail::throw_shape(kOp, "out", "[T, H] = " + dims(tokens, hidden_size) + " (as hidden)",
                        *args.out);
  }
  if (tokens > shape.max_tokens) {
    detail::throw_argument(kOp, "hidden",
                           "at most the shape's max_tokens = " + std::to_string(shape.max_tokens) +
                               " rows (raise max_tokens in the shape file and prewarm again)",
                           std::to_string(tokens) + " rows");
  }

  const MoeWeights& w = args.weights;
  // Why 16 bytes: the GEMMs and combine move rows with 16-byte cp.async / vector accesses.
  detail::check_device_pointer(kOp, "weights.w13", w.w13, 16);
  detail::check_device_pointer(kOp, "weights.w13_scales", w.w13_scales, 16);
  detail::check_device_pointer(kOp, "weights.w2", w.w2, 16);
  detail::check_device_pointer(kOp, "weights.w2_scales", w.w2_scales, 16);
  if (shape.has_bias) {
    detail::check_device_pointer(kOp, "weights.b13", w.b13, 4);
    detail::check_device_pointer(kOp, "weights.b2", w.b2, 2);
  } else if (w.b13 != nullptr || w.b2 != nullptr) {
    detail::throw_argument(kOp, w.b13 != nullptr ? "weights.b13" : "weights.b2",
                           "null: shape \"" + shape.name + "\" has no biases (has_bias false)",
                           "a bias pointer");
  }
  if (forced_decode) {
    // Why before T = 0: like the shape, the device and a T above 256 never change per call.
    if (device.arch.sm < 90) {
      throw_decode_refused("decode_moe needs sm_90 or newer; device " +
                           std::to_string(device.ordinal) + " is " + device.arch.name());
    }
    if (tokens > detail::kDecodeMaxTokens) {
      throw_decode_refused("T = " + std::to_string(tokens) + " tokens; decode_moe serves T <= " +
                           std::to_string(detail::kDecodeMaxTokens));
    }
  }
  if (tokens == 0) return;
  // Why 16 bytes: FC1 gathers hidden rows and combine writes out rows as 16-byte vectors (the
  // decode path bulk-copies hidden rows and writes out rows with 8-byte stores).
  detail::check_device_pointer(kOp, "hidden (data + byte_offset)", hidden.data, 16);
  detail::check_device_pointer(kOp, "out (data + byte_offset)", out.data, 16);
  detail::check_device_pointer(kOp, "workspace", args.workspace, 256);
  const detail::MoeWeightSizes sizes = detail::moe_weight_sizes(shape);
  {
    const detail::Span scratch{"workspace", args.workspace,
                               static_cast<int64_t>(std::min<std::size_t>(
                                   args.workspace_bytes, std::numeric_limits<int64_t>::max()))};
    const detail::Span output = detail::span_of("out", out);
    // The repacked weights are inputs too: the kernels would read bytes they are overwriting.
    const auto bytes = [](std::size_t n) { return static_cast<int64_t>(n); };
    const detail::Span inputs[] = {detail::span_of("hidden", hidden),
                                   detail::span_of("topk_ids", ids),
                                   detail::span_of("topk_weights", weights),
                                   {"weights.w13", w.w13, bytes(sizes.w13)},
                                   {"weights.w13_scales", w.w13_scales, bytes(sizes.w13_scales)},
                                   {"weights.w2", w.w2, bytes(sizes.w2)},
                                   {"weights.w2_scales", w.w2_scales, bytes(sizes.w2_scales)},
                                   {"weights.b13", w.b13, shape.has_bias ? bytes(sizes.b13) : 0},
                                   {"weights.b2", w.b2, shape.has_bias ? bytes(sizes.b2) : 0}};
    detail::check_disjoint(kOp, scratch, output);
    for (const detail::Span& i : inputs) {
      detail::check_disjoint(kOp, scratch, i);
      detail::check_disjoint(kOp, output, i);
    }
    if (target.check_pointers) {
      const detail::SpanMemoryCheck check(kOp, target);
      check.write(scratch);
      check.write(output);
      for (const detail::Span& i : inputs) check.read(i);
    }
  }

  const int t = static_cast<int>(tokens);
  const detail::MoeForwardConfig config = detail::choose_moe_config(shape, t);
  // The workspace a decode launch pair needs (decode_moe_workspace_bytes of `p`).
  const auto require_decode_workspace = [&](const MoeDecodeParams& p) {
    const std::size_t need = static_cast<std::size_t>(detail::decode_moe_workspace_bytes(p));
    if (args.workspace_bytes < need) {
      detail::throw_argument(kOp, "workspace_bytes",
                             "at least " + std::to_string(need) +
                                 " bytes for decode_moe at T = " + std::to_string(t) +
                                 " (size it with moe_workspace_bytes(shape, max T))",
                             std::to_string(args.workspace_bytes));
    }
  };

  const detail::ForwardChoice choice =
      detail::choose_forward_path(shape, config, options, device.arch);
  if (choice.path == detail::ForwardPath::kPair) {
    require_decode_workspace(choice.decode);
    kern::moe::decode::DecodePairParams params{};
    params.w13 = static_cast<const kern::moe::u8*>(w.w13);
    params.w13_scales = static_cast<const kern::moe::u8*>(w.w13_scales);
    params.w2 = static_cast<const kern::moe::u8*>(w.w2);
    params.w2_scales = static_cast<const kern::moe::u8*>(w.w2_scales);
    params.hidden = static_cast<const kern::moe::u16*>(hidden.data);
    params.topk_ids = ids.data;  // int32, or int64 read directly (PairTraits' Ids64)
    params.topk_weights = static_cast<const float*>(weights.data);
    params.out = static_cast<kern::moe::u16*>(out.data);
    params.inter = static_cast<kern::moe::u16*>(args.workspace);
    params.num_tokens = t;
    params.expert_offset = shape.expert_offset;
    detail::launch_decode_pair(kOp, choice.decode, target, params);
    return;
  }
  if (choice.path == detail::ForwardPath::kPersistent) {
    const MoeDecodeParams& main = choice.decode;
    require_decode_workspace(main);
    kern::moe::decode::DecodeMoeParams params{};
    detail::encode_decode_weight_maps(kOp, main, w.w13, w.w13_scales, w.w2, w.w2_scales, params);
    params.hidden = static_cast<const kern::moe::u16*>(hidden.data);
    params.topk_ids = ids.data;  // int32, or int64 read directly (DecodeTraits' Ids64)
    params.topk_weights = static_cast<const float*>(weights.data);
    params.out = static_cast<kern::moe::u16*>(out.data);
    params.workspace = static_cast<kern::moe::u8*>(args.workspace);
    params.num_tokens = t;
    params.expert_offset = shape.expert_offset;
    detail::launch_decode_moe(kOp, main, target, params);
    return;
  }
  if (forced_decode) {
    if (config.decode) {
      throw_decode_refused(moejit::supports(detail::decode_moe_spec(choice.decode, device.arch)));
    }
    // decode_moe_problem passed and T <= 256, so the planner's tile fits: only a planner bug
    // lands here.
    throw Error(ErrorCode::kInternal,
                std::string(kOp) +
                    ": a forced decode path: the planner chose no decode_moe tile for T = " +
                    std::to_string(t) + " although decode_moe_problem accepts shape \"" +
                    shape.name + "\"");
  }

  const detail::MoeWorkspaceLayout layout = detail::moe_workspace_layout(shape, config);
  if (args.workspace_bytes < layout.marlin_bytes) {
    detail::throw_argument(kOp, "workspace_bytes",
                           "at least " + std::to_string(layout.marlin_bytes) +
                               " bytes for T = " + std::to_string(t) +
                               " (size it with moe_workspace_bytes(shape, max T))",
                           std::to_string(args.workspace_bytes));
  }

  // Every kernel first, so a capture miss (or any build failure) launches nothing.
  const detail::MoeForwardSpecs specs = detail::moe_forward_specs(config, device.arch);
  CUkernel narrow_kernel = nullptr;
  if (specs.has_narrow) narrow_kernel = detail::op_kernel(kOp, runtime, specs.narrow, stream);
  CUkernel route_kernels[3] = {nullptr, nullptr, nullptr};
  for (int i = 0; i < specs.route_count; ++i) {
    route_kernels[i] = detail::op_kernel(kOp, runtime, specs.route[i], stream);
  }
  const CUkernel fc1_kernel = detail::op_kernel(kOp, runtime, specs.fc1, stream);
  const CUkernel fc2_kernel = detail::op_kernel(kOp, runtime, specs.fc2, stream);
  const CUkernel combine_kernel = detail::op_kernel(kOp, runtime, specs.combine, stream);
  const int fc1_smem = static_cast<int>(detail::marlin_moe_smem_bytes(specs.fc1_params));
  const int fc2_smem = static_cast<int>(detail::marlin_moe_smem_bytes(specs.fc2_params));
  detail::ensure_dynamic_smem(kOp, specs.fc1, fc1_kernel, device.ordinal, fc1_smem);
  detail::ensure_dynamic_smem(kOp, specs.fc2, fc2_kernel, device.ordinal, fc2_smem);
  // Here, with the kernels: a failed query must come before the first launch.
  const int sms = detail::multiprocessor_count(kOp, device.ordinal);

  char* const base = static_cast<char*>(args.workspace);
  const int64_t rows = tokens * top_k;

  // 1. int64 ids -> int32 (only when the shape's ids are int64).
  const int* ids32 = static_cast<const int*>(ids.data);
  if (specs.has_narrow) {
    const long long* ids64 = static_cast<const long long*>(ids.data);
    int* narrow_out = reinterpret_cast<int*>(base + layout.ids32);
    long long count = rows;
    void* narrow_args[] = {&ids64, &narrow_out, &count};
    detail::LaunchShape geometry;
    geometry.block = static_cast<unsigned>(config.narrow.block_threads);
    geometry.grid_x = ceil_div_u(static_cast<uint64_t>(rows), geometry.block);
    detail::launch_moe_kernel(kOp, specs.narrow, narrow_kernel, geometry, true, target.stream,
                              narrow_args);
    ids32 = narrow_out;
  }

  // 2. route.
  kern::moe::RouteParams route;
  route.topk_ids = ids32;
  route.num_tokens = t;
  route.expert_offset = shape.expert_offset;
  route.expert_counts = reinterpret_cast<int*>(base + layout.expert_counts);
  route.expert_block_offset = reinterpret_cast<int*>(base + layout.expert_block_offset);
  route.sorted_rows = reinterpret_cast<int*>(base + layout.sorted_rows);
  route.block_expert = reinterpret_cast<int*>(base + layout.block_expert);
  route.slot_row = reinterpret_cast<int*>(base + layout.slot_row);
  route.total_blocks = reinterpret_cast<int*>(base + layout.total_blocks);
  route.chunk_base = reinterpret_cast<int*>(base + layout.chunk_base);
  route.expert_group_offset = reinterpret_cast<int*>(base + layout.expert_group_offset);
  route.group_tiles = reinterpret_cast<int*>(base + layout.group_tiles);
  route.tile_done = reinterpret_cast<unsigned*>(base + layout.tile_done);
  {
    void* route_args[] = {&route};
    const unsigned chunks =
        static_cast<unsigned>(kern::moe::route_num_chunks(rows, config.route.chunk_rows));
    const unsigned scatter_ctas = static_cast<unsigned>(kern::moe::route_scatter_ctas(
        rows, config.route.chunk_rows, shape.num_experts, config.route.block_threads));
    for (int i = 0; i < specs.route_count; ++i) {
      detail::LaunchShape geometry;
      geometry.block = static_cast<unsigned>(config.route.block_threads);
      // single and scan: one CTA; rank: one per chunk; scatter: route_scatter_ctas.
      const RouteKernel kind = std::get<MoeRouteParams>(specs.route[i].params).kernel;
      geometry.grid_x = kind == RouteKernel::kRank      ? chunks
                        : kind == RouteKernel::kScatter ? scatter_ctas
                                                        : 1u;
      detail::launch_moe_kernel(kOp, specs.route[i], route_kernels[i], geometry, true,
                                target.stream, route_args);
    }
  }

  // 3. FC1: W13 x hidden -> activation -> inter.
  // The tiles a GEMM's grid provisions over y and z: the route's groups for the warpgroup tile
  // (moe_gemm_wg.cuh), its blocks otherwise.
  const auto gemm_tiles = [&](const MarlinMoeParams& params) {
    return params.wgmma_n != 0 ? layout.max_groups : layout.max_blocks;
  };
  // A GEMM's grid (moe_gemm.cuh's cta_tile): M tiles in x (fastest), the tiles over y
  // (kGridBlocksY at most) and z.
  const auto gemm_grid = [&](const MarlinMoeParams& params, int m_atoms, int smem) {
    const long long y = kern::moe::kGridBlocksY;
    const long long tiles = gemm_tiles(params);
    detail::LaunchShape geometry;
    geometry.grid_x = static_cast<unsigned>(detail::marlin_moe_m_tiles(params, m_atoms));
    geometry.grid_y = static_cast<unsigned>(std::min<long long>(tiles, y));
    geometry.grid_z = static_cast<unsigned>((tiles + y - 1) / y);
    geometry.block = static_cast<unsigned>(detail::marlin_moe_threads(params));
    geometry.smem = static_cast<unsigned>(smem);
    return geometry;
  };
  kern::moe::MoeGemmParams fc1{};
  fc1.weights = static_cast<const kern::moe::u8*>(w.w13);
  fc1.scales = static_cast<const kern::moe::u8*>(w.w13_scales);
  fc1.bias = static_cast<const kern::moe::u16*>(w.b13);
  fc1.input = static_cast<const kern::moe::u16*>(hidden.data);
  fc1.output = base + layout.inter;
  fc1.sorted_rows = route.sorted_rows;
  fc1.block_expert = route.block_expert;
  fc1.group_tiles = route.group_tiles;
  fc1.topk_weights = static_cast<const float*>(weights.data);
  fc1.ld_input = hidden_size;
  fc1.ld_output = shape.intermediate;
  fc1.out_features = shape.intermediate;
  fc1.in_features = shape.hidden;
  fc1.m_atoms = sizes.fc1_m_atoms;
  fc1.k_atoms = sizes.fc1_k_atoms;
  fc1.top_k = shape.top_k;
  fc1.blocks = static_cast<int>(gemm_tiles(specs.fc1_params));
  const detail::GemmPrefetch prefetch =
      detail::fc1_prefetch(shape, config, specs.fc1_params, sizes, fc1.blocks,
                           sms, device.arch);
  fc1.prefetch_experts = prefetch.experts;
  fc1.prefetch_m_tiles = prefetch.m_tiles;
  fc1.prefetch_k_atoms = prefetch.k_atoms;
  // Where both GEMMs take the same tiles, FC1 counts each tile's M tiles stored and FC2 waits
  // for its own tile's count instead of FC1's whole grid (MoeGemmChain).
  const detail::LaunchShape fc1_geometry = gemm_grid(specs.fc1_params, sizes.fc1_m_atoms, fc1_smem);
  kern::moe::MoeGemmChain fc1_chain{};
  kern::moe::MoeGemmChain fc2_chain{};
  if (specs.gemm_chain) {
    fc1_chain.signal = route.tile_done;
    fc2_chain.wait = route.tile_done;
    fc2_chain.wait_count = fc1_geometry.grid_x;
    fc2_chain.wait_limit_ns = kern::moe::kCounterWaitLimitNs;
  }
  {
    void* fc1_args[] = {&fc1, &fc1_chain};
    detail::launch_moe_kernel(kOp, specs.fc1, fc1_kernel, fc1_geometry, true, target.stream,
                              fc1_args);
  }

  // 4. FC2: W2 x inter -> (+ bias) * top-k weight -> out2 (weights streamed early under PDL).
  kern::moe::MoeGemmParams fc2{};
  fc2.weights = static_cast<const kern::moe::u8*>(w.w2);
  fc2.scales = static_cast<const kern::moe::u8*>(w.w2_scales);
  fc2.bias = static_cast<const kern::moe::u16*>(w.b2);
  fc2.input = reinterpret_cast<const kern::moe::u16*>(base + layout.inter);
  fc2.output = base + layout.out2;
  fc2.sorted_rows = route.sorted_rows;
  fc2.block_expert = route.block_expert;
  fc2.group_tiles = route.group_tiles;
  fc2.topk_weights = static_cast<const float*>(weights.data);
  fc2.ld_input = shape.intermediate;
  fc2.ld_output = hidden_size;
  fc2.out_features = shape.hidden;
  fc2.in_features = shape.intermediate;
  fc2.m_atoms = sizes.fc2_m_atoms;
  fc2.k_atoms = sizes.fc2_k_atoms;
  fc2.top_k = shape.top_k;
  fc2.blocks = static_cast<int>(gemm_tiles(specs.fc2_params));
  {
    void* fc2_args[] = {&fc2, &fc2_chain};
    detail::LaunchShape geometry = gemm_grid(specs.fc2_params, sizes.fc2_m_atoms, fc2_smem);
    // K splits: k_splits CTAs per M tile along x (moe_gemm.cuh), each writing its own set of
    // blocks * block_n rows of out2 (moe_workspace_layout sized k_splits sets).
    geometry.grid_x *= static_cast<unsigned>(specs.fc2_params.k_splits);
    detail::launch_moe_kernel(kOp, specs.fc2, fc2_kernel, geometry, true, target.stream, fc2_args);
  }

  // 5. combine: out[t] = bf16(sum over slots of the FC2 rows), in slot order.
  kern::moe::CombineParams combine;
  combine.fc2_out = base + layout.out2;
  combine.slot_row = route.slot_row;
  combine.out = static_cast<unsigned short*>(out.data);
  combine.ld_in = hidden_size;
  combine.ld_out = hidden_size;
  combine.split_rows = detail::fc2_set_rows(specs.fc2_params, layout);
  combine.num_tokens = t;
  {
    void* combine_args[] = {&combine};
    detail::LaunchShape geometry;
    geometry.block = static_cast<unsigned>(config.combine.block_threads);
    geometry.grid_x = ceil_div_u(
        static_cast<uint64_t>(tokens) * static_cast<uint64_t>(hidden_size / 8), geometry.block);
    detail::launch_moe_kernel(kOp, specs.combine, combine_kernel, geometry, true, target.stream,
                              combine_args);
  }
}

}  // namespace moejit
