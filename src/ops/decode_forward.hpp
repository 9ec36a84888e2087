// The decode path of moe_forward: decode_moe's two launches (counter reset, then the persistent
// fused layer under programmatic dependent launch) and the device fact its grid needs (the
// multiprocessor count, queried once per device). moe_forward.cpp checks the arguments and
// fills the kernel arguments; this unit looks the kernels up and launches them.
#pragma once

#include <cuda.h>

#include <moejit/kern/moe/decode_params.cuh>

#include "moejit/kernel_spec.hpp"
#include "runtime/runtime_impl.hpp"

namespace moejit::detail {

// Multiprocessors of device `ordinal` (CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT): a driver call
// the first time per device, a table read after. Throws Error{kDriver} when the query fails.
int multiprocessor_count(int ordinal);

// Launches decode_moe for `main` (a kMain spec's params; its reset kernel is derived) on
// `stream`: both kernels are looked up (built or loaded on a miss, Error{kCaptureMiss} while
// capturing) and the main kernel's shared memory opted into before anything launches. Grid of
// the main kernel: multiprocessors x Geometry::blocks_per_sm(), 288 threads,
// Geometry::smem_bytes() of dynamic shared memory. `args` points into the caller's buffers,
// args.workspace at least Geometry::workspace_bytes() bytes (checked by the caller).
void launch_decode_moe(const char* op, const MoeDecodeParams& main, const CurrentDevice& device,
                       const kern::moe::decode::DecodeMoeParams& args, CUstream stream);

}  // namespace moejit::detail
