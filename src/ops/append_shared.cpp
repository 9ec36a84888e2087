// append_shared: argument checks, spec, kernel lookup and one launch on the caller's stream
// (moe_launch.hpp's form). The valid path formats nothing, takes only the kernel table's shared
// lock, and allocates only the first time a thread launches the kernel in a context.
#include <cuda.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <string>

#include "driver/driver.hpp"
#include "moejit/error.hpp"
#include "moejit/kernel_spec.hpp"
#include "moejit/ops.hpp"
#include "ops/append_shared_spec.hpp"
#include "ops/moe_launch.hpp"
#include "ops/tensor_checks.hpp"
#include "runtime/runtime_impl.hpp"

namespace moejit {
namespace {

constexpr const char* kOp = "append_shared";

std::string dims(int64_t rows, int64_t cols) {
  return "[" + std::to_string(rows) + ", " + std::to_string(cols) + "]";
}

}  // namespace

void append_shared(const AppendSharedArgs& args, Stream stream) {
  using detail::Matrix;
  detail::Runtime& runtime = detail::Runtime::instance();
  const detail::OpTarget target = detail::op_target(kOp, runtime, stream);
  const detail::CurrentDevice& device = target.device;

  const Matrix ids = detail::check_matrix(kOp, "topk_ids", args.topk_ids, device.ordinal);
  if (ids.dtype != DType::kI32 && ids.dtype != DType::kI64) {
    detail::throw_dtype(kOp, "topk_ids", "int32 or int64", *args.topk_ids);
  }
  const int64_t tokens = ids.rows;
  const int64_t top_k = ids.cols;

  const Matrix weights = detail::check_matrix(kOp, "topk_weights", args.topk_weights,
                                              device.ordinal);
  if (weights.dtype != DType::kF32) {
    detail::throw_dtype(kOp, "topk_weights", "float32", *args.topk_weights);
  }
  if (weights.rows != tokens || weights.cols != top_k) {
    detail::throw_shape(kOp, "topk_weights",
                        "[T, K] = " + dims(tokens, top_k) + " (T and K from topk_ids)",
                        *args.topk_weights);
  }

  const Matrix out_ids = detail::check_matrix(kOp, "out_ids", args.out_ids, device.ordinal);
  if (out_ids.dtype != ids.dtype) {
    detail::throw_dtype(kOp, "out_ids",
                        ids.dtype == DType::kI32 ? "int32 (the dtype of topk_ids)"
                                                 : "int64 (the dtype of topk_ids)",
                        *args.out_ids);
  }
  if (out_ids.rows != tokens || out_ids.cols <= top_k) {
    detail::throw_shape(kOp, "out_ids",
                        "[T, K + S] with T = " + std::to_string(tokens) + ", K = " +
                            std::to_string(top_k) + " (from topk_ids) and S >= 1 shared experts",
                        *args.out_ids);
  }
  const int64_t num_shared = out_ids.cols - top_k;
  const int64_t width = top_k + num_shared;
  // The widths a kernel serves, refused here by argument whatever T is (at T = 0 nothing would
  // launch, and the same call with rows would fail).
  if (top_k < 1 || top_k > AppendSharedParams::kMaxTopK) {
    detail::throw_shape(kOp, "topk_ids",
                        "[T, K] with K from 1 to " + std::to_string(AppendSharedParams::kMaxTopK) +
                            " routed experts",
                        *args.topk_ids);
  }
  if (num_shared > AppendSharedParams::kMaxShared) {
    detail::throw_shape(kOp, "out_ids",
                        "[T, K + S] with K = " + std::to_string(top_k) +
                            " (from topk_ids) and S "
                            "from 1 to " +
                            std::to_string(AppendSharedParams::kMaxShared) + " shared experts",
                        *args.out_ids);
  }

  const Matrix out_weights = detail::check_matrix(kOp, "out_weights", args.out_weights,
                                                  device.ordinal);
  if (out_weights.dtype != DType::kF32) {
    detail::throw_dtype(kOp, "out_weights", "float32", *args.out_weights);
  }
  if (out_weights.rows != tokens || out_weights.cols != width) {
    detail::throw_shape(kOp, "out_weights",
                        "[T, K + S] = " + dims(tokens, width) + " (the shape of out_ids)",
                        *args.out_weights);
  }

  DType logit_dtype = DType::kF32;
  const void* logits = nullptr;
  switch (args.gate) {
    case SharedGate::kSigmoid:
    case SharedGate::kGiven: {
      const bool sigmoid = args.gate == SharedGate::kSigmoid;
      if (args.shared_logits == nullptr) {
        detail::throw_argument(kOp, "shared_logits",
                               std::string("a [T, S] tensor (gate ") +
                                   (sigmoid ? "sigmoid: the gate logits)" : "given: the weights)"),
                               "a null DLTensor pointer");
      }
      const Matrix m = detail::check_matrix(kOp, "shared_logits", args.shared_logits,
                                            device.ordinal);
      const bool dtype_ok = sigmoid ? (m.dtype == DType::kBF16 || m.dtype == DType::kF16 ||
                                       m.dtype == DType::kF32)
                                    : m.dtype == DType::kF32;
      if (!dtype_ok) {
        detail::throw_dtype(kOp, "shared_logits",
                            sigmoid ? "bfloat16, float16 or float32 (gate sigmoid)"
                                    : "float32 (gate given: the shared weights themselves)",
                            *args.shared_logits);
      }
      if (m.rows != tokens || m.cols != num_shared) {
        detail::throw_shape(kOp, "shared_logits",
                            "[T, S] = " + dims(tokens, num_shared) +
                                " (T from topk_ids, S = out_ids columns - K)",
                            *args.shared_logits);
      }
      logit_dtype = m.dtype;
      logits = m.data;
      break;
    }
    case SharedGate::kConstant:
      break;  // shared_logits is not read and may be null
    default:
      detail::throw_argument(kOp, "gate", "sigmoid, constant or given",
                             "value " + std::to_string(static_cast<int>(args.gate)));
  }

  if (!std::isfinite(args.scale)) {
    detail::throw_argument(kOp, "scale", "a finite number (it multiplies every shared weight)",
                           std::to_string(args.scale));
  }
  if (tokens > std::numeric_limits<int>::max()) {
    detail::throw_argument(kOp, "topk_ids", "at most 2^31 - 1 tokens (rows)",
                           std::to_string(tokens) + " rows");
  }
  // Why >= 0: a negative id means "no expert" to moe_forward, which would drop the shared
  // experts without a word.
  const bool ids_fit =
      args.shared_base >= 0 &&
      (ids.dtype == DType::kI32
           ? args.shared_base <= std::numeric_limits<int32_t>::max() - (num_shared - 1)
           : args.shared_base <= std::numeric_limits<int64_t>::max() - (num_shared - 1));
  if (!ids_fit) {
    detail::throw_argument(
        kOp, "shared_base",
        "shared ids shared_base .. shared_base + S - 1 non-negative and "
        "representable in the id dtype (" +
            std::string(ids.dtype == DType::kI32 ? "int32" : "int64") + ")",
        std::to_string(args.shared_base) + " with S = " + std::to_string(num_shared));
  }
  {
    const detail::Span outputs[] = {detail::span_of("out_ids", out_ids),
                                    detail::span_of("out_weights", out_weights)};
    const detail::Span inputs[] = {
        detail::span_of("topk_ids", ids), detail::span_of("topk_weights", weights),
        detail::Span{
            "shared_logits", logits,
            logits != nullptr ? tokens * num_shared * detail::dtype_size(logit_dtype) : 0}};
    detail::check_disjoint(kOp, outputs[0], outputs[1]);
    for (const detail::Span& o : outputs) {
      for (const detail::Span& i : inputs) detail::check_disjoint(kOp, o, i);
    }
    if (target.check_pointers) {
      const detail::SpanMemoryCheck check(kOp, target);
      for (const detail::Span& o : outputs) check.write(o);
      for (const detail::Span& i : inputs) check.read(i);
    }
  }
  if (tokens == 0) return;

  KernelSpec spec;
  spec.family = Family::kAppendShared;
  spec.arch = device.arch;
  const AppendSharedParams params =
      detail::append_shared_params(static_cast<int>(top_k), static_cast<int>(num_shared),
                                   ids.dtype, args.gate, logit_dtype);
  spec.params = params;
  const CUkernel kernel = detail::op_kernel(kOp, runtime, spec, stream);

  const uint64_t total = static_cast<uint64_t>(tokens) * static_cast<uint64_t>(width);
  const uint64_t block = static_cast<uint64_t>(params.block_threads);
  const uint64_t grid = (total + block - 1) / block;
  if (grid > static_cast<uint64_t>(std::numeric_limits<int>::max())) {
    detail::throw_argument(kOp, "topk_ids", "at most 2^31 - 1 CTAs of output elements",
                           std::to_string(grid) + " CTAs for T = " + std::to_string(tokens));
  }

  // Why PDL: the kernel waits on griddepcontrol before reading anything, so it may be scheduled
  // while the previous kernel in the stream drains (programmatic dependent launch, sm_90+).
  detail::LaunchShape geometry;
  geometry.grid_x = static_cast<unsigned>(grid);
  geometry.block = static_cast<unsigned>(block);

  // Kernel parameters, in the order append_shared_kernel takes them.
  void* topk_ids_ptr = ids.data;
  void* topk_weights_ptr = weights.data;
  const void* logits_ptr = logits;
  void* out_ids_ptr = out_ids.data;
  void* out_weights_ptr = out_weights.data;
  long long shared_base = args.shared_base;
  float scale = args.scale;
  int num_tokens = static_cast<int>(tokens);
  void* kernel_args[] = {&topk_ids_ptr, &topk_weights_ptr, &logits_ptr,  &out_ids_ptr,
                         &out_weights_ptr, &shared_base,    &scale,       &num_tokens};
  detail::launch_moe_kernel(kOp, spec, kernel, geometry, true, target.stream, kernel_args);
}

}  // namespace moejit
