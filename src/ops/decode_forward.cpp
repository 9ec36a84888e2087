#include "ops/decode_forward.hpp"

#include <algorithm>
#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <sstream>

#include "driver/driver.hpp"
#include "moejit/error.hpp"
#include "ops/moe_launch.hpp"
#include "plan/decode_geometry.hpp"
#include "plan/moe_plan.hpp"

namespace moejit::detail {

namespace {

// Facts of each device by ordinal, each queried once: the multiprocessor count, and the peak
// DRAM rate (stored plus one, so an unknown rate, 0, is remembered too); 0 = not queried yet. Why
// atomics and no lock: a fact never changes for a device, so two threads that race both store
// the same number.
class DeviceFacts {
 public:
  static DeviceFacts& instance() {
    static DeviceFacts table;
    return table;
  }
  int multiprocessors(const char* op, int ordinal) {
    const bool cached = ordinal >= 0 && ordinal < kDevices;
    if (cached) {
      const int count = sms_[static_cast<std::size_t>(ordinal)].load(std::memory_order_acquire);
      if (count > 0) return count;
    }
    int count = 0;
    const CUresult result =
        driver().cuDeviceGetAttribute(&count, CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, ordinal);
    if (result != CUDA_SUCCESS || count < 1) {
      std::ostringstream os;
      os << op << ": querying the multiprocessor count of device " << ordinal
         << " failed: " << (result != CUDA_SUCCESS ? describe(result) : "the driver returned 0");
      throw Error(ErrorCode::kDriver, os.str());
    }
    if (cached) sms_[static_cast<std::size_t>(ordinal)].store(count, std::memory_order_release);
    return count;
  }
  std::uint32_t dram_bytes_per_us(int ordinal) {
    const bool cached = ordinal >= 0 && ordinal < kDevices;
    if (cached) {
      const std::uint32_t stored =
          dram_[static_cast<std::size_t>(ordinal)].load(std::memory_order_acquire);
      if (stored > 0) return stored - 1;
    }
    long long per_us = peak_dram_bytes_per_second(driver(), ordinal) / 1000000;
    // Why: below 100 GB/s the attributes are wrong (no GPU these kernels serve is that slow),
    // and the pair's hold, which divides by the rate, would grow to milliseconds.
    if (per_us < kLeastPlausibleBytesPerUs) per_us = 0;
    const auto rate = static_cast<std::uint32_t>(
        std::min<long long>(per_us, std::numeric_limits<std::uint32_t>::max() - 1));
    if (cached) dram_[static_cast<std::size_t>(ordinal)].store(rate + 1, std::memory_order_release);
    return rate;
  }

 private:
  static constexpr int kDevices = 64;
  static constexpr long long kLeastPlausibleBytesPerUs = 100000;  // 100 GB/s
  std::array<std::atomic<int>, kDevices> sms_{};
  std::array<std::atomic<std::uint32_t>, kDevices> dram_{};
};

// One tensor map, encoded once per (thread, role) until its inputs change. Why a per-thread
// memo: cuTensorMapEncodeTiled is host work on every call, and an engine's decode loop passes the
// same weights every step.
struct EncodedMap {
  const void* base = nullptr;
  kern::moe::decode::TensorMapShape shape{};
  kern::moe::decode::TensorMap map{};
  bool valid = false;
};

bool same_shape(const kern::moe::decode::TensorMapShape& a,
                const kern::moe::decode::TensorMapShape& b) {
  return a.inner == b.inner && a.rows == b.rows && a.row_bytes == b.row_bytes &&
         a.box_inner == b.box_inner && a.box_rows == b.box_rows;
}

void encode_map(const char* op, const char* name, const void* base,
                const kern::moe::decode::TensorMapShape& shape, EncodedMap& memo,
                kern::moe::decode::TensorMap& out) {
  if (!(memo.valid && memo.base == base && same_shape(memo.shape, shape))) {
    static_assert(sizeof(CUtensorMap) == sizeof(kern::moe::decode::TensorMap) &&
                      alignof(CUtensorMap) == alignof(kern::moe::decode::TensorMap),
                  "decode_params.cuh's TensorMap is cuda.h's CUtensorMap");
    CUtensorMap map;
    const cuuint64_t dims[2] = {static_cast<cuuint64_t>(shape.inner),
                                static_cast<cuuint64_t>(shape.rows)};
    const cuuint64_t strides[1] = {static_cast<cuuint64_t>(shape.row_bytes)};
    const cuuint32_t box[2] = {static_cast<cuuint32_t>(shape.box_inner),
                               static_cast<cuuint32_t>(shape.box_rows)};
    const cuuint32_t element_strides[2] = {1, 1};
    static_assert(kern::moe::decode::kMapElementBytes == 8, "UINT64 elements");
    const CUresult result = driver().cuTensorMapEncodeTiled(
        &map, CU_TENSOR_MAP_DATA_TYPE_UINT64, 2, const_cast<void*>(base), dims, strides, box,
        element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_NONE,
        CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    if (result != CUDA_SUCCESS) {
      std::ostringstream os;
      os << op << ": decode_moe: encoding the tensor map of " << name << " (" << shape.rows
         << " rows of " << shape.row_bytes << " bytes at " << base << ", boxes of "
         << shape.box_rows << " x " << shape.box_inner * kern::moe::decode::kMapElementBytes
         << " bytes) failed: " << describe(result);
      throw Error(ErrorCode::kDriver, os.str());
    }
    memo.base = base;
    memo.shape = shape;
    std::memcpy(&memo.map, &map, sizeof(map));
    memo.valid = true;
  }
  out = memo.map;
}

}  // namespace

void encode_decode_weight_maps(const char* op, const MoeDecodeParams& main, const void* w13,
                               const void* w13_scales, const void* w2, const void* w2_scales,
                               kern::moe::decode::DecodeMoeParams& args) {
  namespace decode = kern::moe::decode;
  thread_local std::array<EncodedMap, 4> memo;
  const decode::Geometry g = decode_geometry(main);
  encode_map(op, "weights.w13", w13, decode::fc1_map_shape(g, false), memo[0], args.w13);
  encode_map(op, "weights.w13_scales", w13_scales, decode::fc1_map_shape(g, true), memo[1],
             args.w13_scales);
  encode_map(op, "weights.w2", w2, decode::fc2_map_shape(g, false), memo[2], args.w2);
  encode_map(op, "weights.w2_scales", w2_scales, decode::fc2_map_shape(g, true), memo[3],
             args.w2_scales);
}

int multiprocessor_count(const char* op, int ordinal) {
  return DeviceFacts::instance().multiprocessors(op, ordinal);
}

std::uint32_t dram_bytes_per_us(int ordinal) {
  return DeviceFacts::instance().dram_bytes_per_us(ordinal);
}

void launch_decode_moe(const char* op, const MoeDecodeParams& main, const OpTarget& target,
                       const kern::moe::decode::DecodeMoeParams& args) {
  Runtime& runtime = Runtime::instance();
  const CurrentDevice& device = target.device;
  const CUstream stream = target.stream.handle;
  const KernelSpec reset_spec = decode_moe_spec(decode_reset_params(main), device.arch);
  const KernelSpec main_spec = decode_moe_spec(main, device.arch);
  const KernelSpec combine_spec = decode_moe_spec(decode_combine_params(main), device.arch);
  // Every kernel first, so a capture miss (or any build failure) launches nothing.
  const CUkernel reset_kernel = op_kernel(op, runtime, reset_spec, stream);
  const CUkernel main_kernel = op_kernel(op, runtime, main_spec, stream);
  const CUkernel combine_kernel = op_kernel(op, runtime, combine_spec, stream);
  const int smem = static_cast<int>(decode_moe_smem_bytes(main));
  ensure_dynamic_smem(op, main_spec, main_kernel, device.ordinal, smem);
  const int sms = multiprocessor_count(op, device.ordinal);

  kern::moe::decode::DecodeMoeParams params = args;
  void* kernel_args[] = {&params};
  // Why PDL for the reset, as for the route that heads the marlin chain: it is scheduled while the
  // kernel before it drains, and it waits for that kernel's grid (griddepcontrol.wait) before it
  // zeroes the counters (the previous layer may still read this workspace). Only then does it let
  // the main kernel launch, which reads hidden and topk_ids before its own wait, so those reads
  // come after everything before the reset. The main kernel waits for the reset's grid before
  // touching the counters.
  LaunchShape reset_shape;
  reset_shape.block = static_cast<unsigned>(kDecodeThreads);
  launch_moe_kernel(op, reset_spec, reset_kernel, reset_shape, true, target.stream, kernel_args);

  LaunchShape main_shape;
  main_shape.grid_x = static_cast<unsigned>(sms * decode_moe_blocks_per_sm(main));
  main_shape.block = static_cast<unsigned>(kDecodeThreads);
  main_shape.smem = static_cast<unsigned>(smem);
  launch_moe_kernel(op, main_spec, main_kernel, main_shape, true, target.stream, kernel_args);

  // The top-k sum over the whole GPU: the main kernel lets it launch once every CTA of it runs,
  // and it waits for that grid before it reads a row.
  const long long combine_threads =
      static_cast<long long>(args.num_tokens) * main.hidden / kern::moe::decode::kCombineColumns;
  LaunchShape combine_shape;
  combine_shape.grid_x =
      static_cast<unsigned>((combine_threads + kern::moe::decode::kCombineThreads - 1) /
                            kern::moe::decode::kCombineThreads);
  combine_shape.block = static_cast<unsigned>(kern::moe::decode::kCombineThreads);
  launch_moe_kernel(op, combine_spec, combine_kernel, combine_shape, true, target.stream,
                    kernel_args);
}

void launch_decode_pair(const char* op, const MoeDecodeParams& fc1, const OpTarget& target,
                        const kern::moe::decode::DecodePairParams& args) {
  Runtime& runtime = Runtime::instance();
  const CurrentDevice& device = target.device;
  const CUstream stream = target.stream.handle;
  const MoeDecodeParams fc2 = decode_pair_fc2_params(fc1);
  const KernelSpec fc1_spec = decode_moe_spec(fc1, device.arch);
  const KernelSpec fc2_spec = decode_moe_spec(fc2, device.arch);
  // Both kernels first, so a capture miss (or any build failure) launches nothing.
  const CUkernel fc1_kernel = op_kernel(op, runtime, fc1_spec, stream);
  const CUkernel fc2_kernel = op_kernel(op, runtime, fc2_spec, stream);
  const int fc1_smem = static_cast<int>(decode_moe_smem_bytes(fc1));
  const int fc2_smem = static_cast<int>(decode_moe_smem_bytes(fc2));
  ensure_dynamic_smem(op, fc1_spec, fc1_kernel, device.ordinal, fc1_smem, true);
  ensure_dynamic_smem(op, fc2_spec, fc2_kernel, device.ordinal, fc2_smem, true);
  const int sms = multiprocessor_count(op, device.ordinal);

  kern::moe::decode::DecodePairParams params = args;
  params.dram_bytes_per_us = dram_bytes_per_us(device.ordinal);
  void* kernel_args[] = {&params};
  // Why PDL for fc1, as for the route that heads the marlin chain: it is scheduled while the
  // kernel before it drains, and its first instruction waits for that kernel's grid
  // (griddepcontrol.wait), before it reads hidden and topk_ids and before it overwrites the
  // intermediate rows the previous forward's fc2 may still read.
  LaunchShape fc1_shape;
  fc1_shape.grid_x = static_cast<unsigned>(sms);
  fc1_shape.block = static_cast<unsigned>(kDecodePairFc1Threads);
  fc1_shape.smem = static_cast<unsigned>(fc1_smem);
  launch_moe_kernel(op, fc1_spec, fc1_kernel, fc1_shape, true, target.stream, kernel_args);

  LaunchShape fc2_shape;
  fc2_shape.grid_x = static_cast<unsigned>(decode_pair_geometry(fc2).fc2_grid(sms));
  fc2_shape.block = static_cast<unsigned>(kDecodePairFc2Threads);
  fc2_shape.smem = static_cast<unsigned>(fc2_smem);
  launch_moe_kernel(op, fc2_spec, fc2_kernel, fc2_shape, true, target.stream, kernel_args);
}

}  // namespace moejit::detail
