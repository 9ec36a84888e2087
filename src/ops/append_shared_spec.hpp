// The one definition of which append_shared kernel serves a call: the op builds its spec from the
// tensors with this, and the planner must produce the same spec from a ModelShape, or a prewarmed
// kernel would not be the one the op looks up (tests/nvrtc/test_runtime.cpp checks they agree).
#pragma once

#include "moejit/kernel_spec.hpp"
#include "moejit/shape.hpp"

namespace moejit::detail {

// Why 128: the kernel moves a few bytes per thread and waits on one memory round trip; small
// CTAs spread mid-sized batches over more SMs (src/plan/planner.cpp uses the same value).
inline constexpr int kAppendSharedBlockThreads = 128;

inline AppendSharedParams append_shared_params(int top_k, int num_shared, DType id_dtype,
                                               SharedGate gate, DType logit_dtype) {
  AppendSharedParams params;
  params.top_k = top_k;
  params.num_shared = num_shared;
  params.id_dtype = id_dtype;
  params.gate = gate;
  // Only a sigmoid gate reads logits of a chosen dtype; given weights are fp32 and a constant
  // gate reads nothing, so both are f32 and equal specs mean one kernel.
  params.logit_dtype = gate == SharedGate::kSigmoid ? logit_dtype : DType::kF32;
  params.block_threads = kAppendSharedBlockThreads;
  return params;
}

}  // namespace moejit::detail
