// decode_moe's kernel Geometry (kernels/moe/decode_params.cuh) of a spec's params: the one place
// the host turns MoeDecodeParams into the constexpr sizes the kernel static_asserts on. Kept out
// of decode_plan.hpp and moe_plan.hpp, which stay free of kernel headers.
#pragma once

#include <moejit/kern/moe/decode_pair_params.cuh>
#include <moejit/kern/moe/decode_params.cuh>

#include "moejit/kernel_spec.hpp"

namespace moejit::detail {

inline kern::moe::decode::Geometry decode_geometry(const MoeDecodeParams& p) {
  return kern::moe::decode::Geometry{p.num_experts, p.top_k,      p.hidden,     p.intermediate,
                                     p.block_n,     p.fc1_strips, p.fc2_strips, p.stages};
}

// The same for the pair kernels (PairGeometry, kernels/moe/decode_pair_params.cuh).
inline kern::moe::decode::PairGeometry decode_pair_geometry(const MoeDecodeParams& p) {
  return kern::moe::decode::PairGeometry{p.num_experts, p.top_k, p.hidden, p.intermediate,
                                         p.max_tokens};
}

}  // namespace moejit::detail
