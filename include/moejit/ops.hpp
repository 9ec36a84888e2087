// libmoejit: operators an engine calls every layer. Tensors are DLPack DLTensors on a CUDA device;
// streams are CUstream / cudaStream_t handles. No host sync, no allocation, graph capturable.
#pragma once

#include <dlpack/dlpack.h>

#include <cstdint>

#include "moejit/shape.hpp"

struct CUstream_st;

namespace moejit {

using Stream = CUstream_st*;

// append_shared: out_ids[t, :K] = topk_ids[t], out_ids[t, K + s] = shared_base + s;
// out_weights[t, :K] = topk_weights[t], out_weights[t, K + s] = the shared weight:
//   kSigmoid: sigmoid(float(shared_logits[t, s])) * scale   (logits bf16, fp16 or fp32)
//   kConstant: scale                                        (shared_logits unused, may be null)
//   kGiven: shared_logits[t, s] (fp32 weights)               (scale unused)
// Shapes: topk_ids, topk_weights [T, K]; shared_logits [T, S]; out_ids, out_weights [T, K + S],
// with K from 1 to 64 and S from 1 to 8 (AppendSharedParams::kMaxTopK, kMaxShared).
// ids are int32 or int64 (out_ids has the same type), weights fp32; every tensor contiguous on the
// device of the current CUDA context. S comes from out_ids.shape[1] - K. The outputs share no
// byte with each other or with the inputs (refused otherwise); shared_base >= 0; scale finite.
struct AppendSharedArgs {
  const DLTensor* topk_ids = nullptr;
  const DLTensor* topk_weights = nullptr;
  const DLTensor* shared_logits = nullptr;
  DLTensor* out_ids = nullptr;
  DLTensor* out_weights = nullptr;
  int64_t shared_base = 0;  // id of the first shared expert (N_BASE)
  float scale = 1.f;
  SharedGate gate = SharedGate::kSigmoid;
};

// Throws Error{kInvalidArgument} naming the argument for a mismatched tensor, or for a stream of
// another device than the current context's.
void append_shared(const AppendSharedArgs& args, Stream stream);

}  // namespace moejit
