// The decode path of moe_forward: decode_moe's launches (counter reset, the persistent fused
// layer and the top-k sum under programmatic dependent launch, or the pair's FC1 then FC2) and
// the device facts they need (the multiprocessor count and the peak DRAM rate, queried once per
// device).
// moe_forward.cpp checks the arguments and fills the kernel arguments; this unit looks the
// kernels up and launches them.
#pragma once

#include <cuda.h>

#include <cstdint>
#include <moejit/kern/moe/decode_pair_params.cuh>
#include <moejit/kern/moe/decode_params.cuh>

#include "moejit/kernel_spec.hpp"
#include "ops/moe_launch.hpp"
#include "runtime/runtime_impl.hpp"

namespace moejit::detail {

// Multiprocessors of device `ordinal` (CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT): a driver call
// the first time per device, a table read after. Throws Error{kDriver} naming `op` when the query
// fails.
int multiprocessor_count(const char* op, int ordinal);
// Peak DRAM rate of device `ordinal` in bytes per microsecond (peak_dram_bytes_per_second), 0
// where the driver does not report it or reports under 100 GB/s: a driver call the first time
// per device, a table read after.
std::uint32_t dram_bytes_per_us(int ordinal);

// The four weight tensor maps of `main`'s tile (decode_params.cuh: fc1_map_shape and
// fc2_map_shape over the kernel layout) for the weights at w13, w13_scales, w2, w2_scales (device
// pointers, 16-byte aligned: checked by the caller), written into args.w13 .. args.w2_scales.
// The last encoding per tensor and thread is kept, so a steady decode loop encodes nothing.
// Throws Error{kDriver} naming the tensor when the driver refuses one.
void encode_decode_weight_maps(const char* op, const MoeDecodeParams& main, const void* w13,
                               const void* w13_scales, const void* w2, const void* w2_scales,
                               kern::moe::decode::DecodeMoeParams& args);

// Launches decode_moe for `main` (a kMain spec's params; its reset and combine kernels are
// derived) on target.stream: all three kernels are looked up (built or loaded on a miss,
// Error{kCaptureMiss} while capturing) and the main kernel's shared memory opted into before
// anything launches. Grid of the main kernel: multiprocessors x Geometry::blocks_per_sm(), 320
// threads, Geometry::smem_bytes() of dynamic shared memory; of the combine, T x H /
// kCombineColumns threads in CTAs of kCombineThreads. `args` points into the caller's buffers,
// args.workspace at least Geometry::workspace_bytes() bytes (checked by the caller).
void launch_decode_moe(const char* op, const MoeDecodeParams& main, const OpTarget& target,
                       const kern::moe::decode::DecodeMoeParams& args);

// Launches the two-launch tile for `fc1` (a kPairFc1 spec's params; its kPairFc2 is derived):
// both kernels looked up first, shared memory and the largest carveout opted into (one CTA of
// each kernel shares an SM). fc1: one CTA per multiprocessor, 544 threads; fc2:
// PairGeometry::fc2_grid CTAs of 288 threads; both under programmatic dependent launch (each
// waits for the grid before it). args.inter at least PairGeometry::workspace_bytes() bytes
// (checked by the caller); args.dram_bytes_per_us is set here (dram_bytes_per_us).
void launch_decode_pair(const char* op, const MoeDecodeParams& fc1, const OpTarget& target,
                        const kern::moe::decode::DecodePairParams& args);

}  // namespace moejit::detail
