// The C ABI of the MoE layer (moejit/moe.hpp): a handle per registered shape, so the per-layer
// call copies no shape and looks up no name.
#include <string>

#include "capi/capi_guard.hpp"
#include "capi/capi_struct.hpp"
#include "moejit/error.hpp"
#include "moejit/moe.hpp"
#include "moejit/moejit.h"
#include "moejit/runtime.hpp"

struct moejit_moe {
  moejit::ModelShape shape;
  std::string decode_problem;  // moe_decode_problem(shape), computed once
};

namespace {

using moejit::Error;
using moejit::ErrorCode;

const moejit::ModelShape& shape_of(const char* call, const moejit_moe* moe) {
  if (moe == nullptr) {
    throw Error(ErrorCode::kInvalidArgument,
                std::string(call) + ": moe: expected a handle from moejit_moe_create, found null");
  }
  return moe->shape;
}

moejit::MoeWeights weights_of(const char* call, const char* arg, const moejit_moe_weights* w) {
  if (w == nullptr) {
    throw Error(ErrorCode::kInvalidArgument,
                std::string(call) + ": " + arg + ": expected a moejit_moe_weights, found null");
  }
  const auto known = moejit::detail::struct_in<moejit_moe_weights>(call, arg, w);
  moejit::MoeWeights out;
  out.w13 = known.w13;
  out.w13_scales = known.w13_scales;
  out.w2 = known.w2;
  out.w2_scales = known.w2_scales;
  out.b13 = known.b13;
  out.b2 = known.b2;
  return out;
}

using moejit::detail::CapiNames;
using moejit::detail::CapiRename;

// The C++ argument paths of the forward and repack ops as their C callers spell them:
// moejit_moe_weights comes by pointer, and the repack target's first expert and counter are
// arguments of their own.
constexpr CapiRename kForwardRenames[] = {{"weights.w13", "weights->w13"},
                                          {"weights.w13_scales", "weights->w13_scales"},
                                          {"weights.w2", "weights->w2"},
                                          {"weights.w2_scales", "weights->w2_scales"},
                                          {"weights.b13", "weights->b13"},
                                          {"weights.b2", "weights->b2"},
                                          {nullptr, nullptr}};
constexpr CapiRename kRepackRenames[] = {{"target.weights.w13", "target->w13"},
                                         {"target.weights.w13_scales", "target->w13_scales"},
                                         {"target.weights.w2", "target->w2"},
                                         {"target.weights.w2_scales", "target->w2_scales"},
                                         {"target.first_expert", "first_expert"},
                                         {"target.bad_scale_count", "bad_scale_count"},
                                         {nullptr, nullptr}};
constexpr CapiNames kForward{"moejit_moe_forward", "moe_forward", kForwardRenames};
constexpr CapiNames kForwardEx{"moejit_moe_forward_ex", "moe_forward", kForwardRenames};
constexpr CapiNames kRepackGptOss{"moejit_moe_repack_gpt_oss", "moe_repack_gpt_oss",
                                  kRepackRenames};
constexpr CapiNames kRepackSeparate{"moejit_moe_repack_separate", "moe_repack_separate",
                                    kRepackRenames};

// Where a repack writes: the target weights, its first expert and the bad-scale counter.
moejit::MoeRepackTarget repack_target(const char* call, const moejit_moe_weights* target,
                                      int first_expert, int32_t* bad_scale_count) {
  moejit::MoeRepackTarget into;
  into.weights = weights_of(call, "target", target);
  into.first_expert = first_expert;
  into.bad_scale_count = bad_scale_count;
  return into;
}

void require_out(const char* call, const void* out) {
  if (out == nullptr) {
    throw Error(ErrorCode::kInvalidArgument,
                std::string(call) + ": out: expected a pointer to write the result to, found null");
  }
}

moejit::MoePath path_of(const char* call, moejit_moe_path path) {
  switch (path) {
    case MOEJIT_MOE_PATH_AUTO:
      return moejit::MoePath::kAuto;
    case MOEJIT_MOE_PATH_MARLIN:
      return moejit::MoePath::kMarlin;
    case MOEJIT_MOE_PATH_DECODE:
      return moejit::MoePath::kDecode;
    default:
      break;
  }
  throw Error(ErrorCode::kInvalidArgument,
              std::string(call) +
                  ": path: expected MOEJIT_MOE_PATH_AUTO (0), MOEJIT_MOE_PATH_MARLIN (1) or "
                  "MOEJIT_MOE_PATH_DECODE (2), found " +
                  std::to_string(static_cast<int>(path)));
}

void forward(const char* call, const moejit_moe* moe, const DLTensor* hidden,
             const DLTensor* topk_ids, const DLTensor* topk_weights,
             const moejit_moe_weights* weights, void* workspace, size_t workspace_bytes,
             DLTensor* out, moejit_moe_path path, int decode_block_n, void* stream) {
  const moejit::ModelShape& shape = shape_of(call, moe);
  moejit::MoeForwardArgs args;
  args.hidden = hidden;
  args.topk_ids = topk_ids;
  args.topk_weights = topk_weights;
  args.weights = weights_of(call, "weights", weights);
  args.workspace = workspace;
  args.workspace_bytes = workspace_bytes;
  args.out = out;
  moejit::MoeForwardOptions options;
  options.path = path_of(call, path);
  // Checked here so the message names the C argument (moe_forward's names the C++ field).
  if (decode_block_n != 0 && decode_block_n != 8 && decode_block_n != 16 && decode_block_n != 32) {
    throw Error(
        ErrorCode::kInvalidArgument,
        std::string(call) +
            ": decode_block_n: expected 0 (the planner's choice), 8, 16 or 32 (decode_moe's "
            "block_n), found " +
            std::to_string(decode_block_n));
  }
  options.decode_block_n = decode_block_n;
  moejit::moe_forward(shape, args, static_cast<moejit::Stream>(stream), options);
}

}  // namespace

extern "C" {

moejit_status moejit_moe_create(const char* shape_name, moejit_moe** out) {
  return moejit::detail::capi_call({"moejit_moe_create", "moe_weight_layout"}, [&] {
    require_out("moejit_moe_create", out);
    *out = nullptr;
    if (shape_name == nullptr) {
      throw Error(ErrorCode::kInvalidArgument,
                  "moejit_moe_create: shape_name: expected a registered shape's name, found null");
    }
    moejit::ModelShape shape;
    try {
      shape = moejit::registered_shape(shape_name);
    } catch (const Error& e) {
      throw Error(e.code(), std::string("moejit_moe_create: shape_name: ") + e.what());
    }
    // Why here: a shape the MoE kernels can't serve is refused when the handle is made, not on
    // the first forward.
    moejit::moe_weight_layout(shape);
    std::string decode_problem = moejit::moe_decode_problem(shape);
    *out = new moejit_moe{std::move(shape), std::move(decode_problem)};
  });
}

void moejit_moe_destroy(moejit_moe* moe) { delete moe; }

int moejit_moe_weight_layout_version(void) { return moejit::moe_weight_layout_version(); }

moejit_status moejit_moe_get_weight_layout(const moejit_moe* moe, moejit_moe_weight_layout* out) {
  return moejit::detail::capi_call({"moejit_moe_get_weight_layout", "moe_weight_layout"}, [&] {
    const char* call = "moejit_moe_get_weight_layout";
    const moejit::ModelShape& shape = shape_of(call, moe);
    require_out(call, out);
    const moejit::MoeWeightLayout layout = moejit::moe_weight_layout(shape);
    moejit_moe_weight_layout sizes{};
    sizes.w13_bytes = layout.w13_bytes;
    sizes.w13_scale_bytes = layout.w13_scale_bytes;
    sizes.w2_bytes = layout.w2_bytes;
    sizes.w2_scale_bytes = layout.w2_scale_bytes;
    sizes.b13_bytes = layout.b13_bytes;
    sizes.b2_bytes = layout.b2_bytes;
    moejit::detail::struct_out(call, "out", out, sizes);
  });
}

moejit_status moejit_moe_repack_gpt_oss(const moejit_moe* moe, const DLTensor* w13_blocks,
                                        const DLTensor* w13_scales, const DLTensor* w2_blocks,
                                        const DLTensor* w2_scales, const moejit_moe_weights* target,
                                        int first_expert, int32_t* bad_scale_count, void* stream) {
  return moejit::detail::capi_call(kRepackGptOss, [&] {
    const char* call = "moejit_moe_repack_gpt_oss";
    const moejit::ModelShape& shape = shape_of(call, moe);
    moejit::GptOssCheckpoint checkpoint;
    checkpoint.w13_blocks = w13_blocks;
    checkpoint.w13_scales = w13_scales;
    checkpoint.w2_blocks = w2_blocks;
    checkpoint.w2_scales = w2_scales;
    moejit::moe_repack_gpt_oss(shape, checkpoint,
                               repack_target(call, target, first_expert, bad_scale_count),
                               static_cast<moejit::Stream>(stream));
  });
}

moejit_status moejit_moe_repack_separate(const moejit_moe* moe, const DLTensor* w1_blocks,
                                         const DLTensor* w1_scales, const DLTensor* w3_blocks,
                                         const DLTensor* w3_scales, const DLTensor* w2_blocks,
                                         const DLTensor* w2_scales,
                                         const moejit_moe_weights* target, int first_expert,
                                         int32_t* bad_scale_count, void* stream) {
  return moejit::detail::capi_call(kRepackSeparate, [&] {
    const char* call = "moejit_moe_repack_separate";
    const moejit::ModelShape& shape = shape_of(call, moe);
    moejit::SeparateCheckpoint checkpoint;
    checkpoint.w1_blocks = w1_blocks;
    checkpoint.w1_scales = w1_scales;
    checkpoint.w3_blocks = w3_blocks;
    checkpoint.w3_scales = w3_scales;
    checkpoint.w2_blocks = w2_blocks;
    checkpoint.w2_scales = w2_scales;
    moejit::moe_repack_separate(shape, checkpoint,
                                repack_target(call, target, first_expert, bad_scale_count),
                                static_cast<moejit::Stream>(stream));
  });
}

moejit_status moejit_moe_workspace_bytes(const moejit_moe* moe, int max_tokens, size_t* out) {
  return moejit::detail::capi_call({"moejit_moe_workspace_bytes", "moe_workspace_bytes"}, [&] {
    const char* call = "moejit_moe_workspace_bytes";
    const moejit::ModelShape& shape = shape_of(call, moe);
    require_out(call, out);
    *out = moejit::moe_workspace_bytes(shape, max_tokens);
  });
}

moejit_status moejit_moe_forward(const moejit_moe* moe, const DLTensor* hidden,
                                 const DLTensor* topk_ids, const DLTensor* topk_weights,
                                 const moejit_moe_weights* weights, void* workspace,
                                 size_t workspace_bytes, DLTensor* out, void* stream) {
  return moejit::detail::capi_call(kForward, [&] {
    forward("moejit_moe_forward", moe, hidden, topk_ids, topk_weights, weights, workspace,
            workspace_bytes, out, MOEJIT_MOE_PATH_AUTO, 0, stream);
  });
}

moejit_status moejit_moe_forward_ex(const moejit_moe* moe, const DLTensor* hidden,
                                    const DLTensor* topk_ids, const DLTensor* topk_weights,
                                    const moejit_moe_weights* weights, void* workspace,
                                    size_t workspace_bytes, DLTensor* out, moejit_moe_path path,
                                    int decode_block_n, void* stream) {
  return moejit::detail::capi_call(kForwardEx, [&] {
    forward("moejit_moe_forward_ex", moe, hidden, topk_ids, topk_weights, weights, workspace,
            workspace_bytes, out, path, decode_block_n, stream);
  });
}

moejit_status moejit_moe_decode_problem(const moejit_moe* moe, const char** out) {
  return moejit::detail::capi_call({}, [&] {
    const char* call = "moejit_moe_decode_problem";
    shape_of(call, moe);
    require_out(call, out);
    *out = moe->decode_problem.c_str();
  });
}

}  // extern "C"
