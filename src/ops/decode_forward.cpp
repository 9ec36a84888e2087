#include "ops/decode_forward.hpp"

#include <array>
#include <atomic>
#include <cstddef>
#include <sstream>

#include "driver/driver.hpp"
#include "moejit/error.hpp"
#include "ops/moe_launch.hpp"
#include "plan/moe_plan.hpp"

namespace moejit::detail {

namespace {

// Multiprocessor counts by device ordinal; 0 = not queried yet. Why atomics and no lock: the
// value never changes for a device, so two threads that race both store the same number.
class MultiprocessorCounts {
 public:
  static MultiprocessorCounts& instance() {
    static MultiprocessorCounts table;
    return table;
  }
  int get(int ordinal) {
    const bool cached = ordinal >= 0 && ordinal < kDevices;
    if (cached) {
      const int count = counts_[static_cast<std::size_t>(ordinal)].load(std::memory_order_acquire);
      if (count > 0) return count;
    }
    int count = 0;
    const CUresult result =
        driver().cuDeviceGetAttribute(&count, CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, ordinal);
    if (result != CUDA_SUCCESS || count < 1) {
      std::ostringstream os;
      os << "decode_moe: querying the multiprocessor count of device " << ordinal
         << " failed: " << (result != CUDA_SUCCESS ? describe(result) : "the driver returned 0");
      throw Error(ErrorCode::kDriver, os.str());
    }
    if (cached) {
      counts_[static_cast<std::size_t>(ordinal)].store(count, std::memory_order_release);
    }
    return count;
  }

 private:
  static constexpr int kDevices = 64;
  std::array<std::atomic<int>, kDevices> counts_{};
};

}  // namespace

int multiprocessor_count(int ordinal) { return MultiprocessorCounts::instance().get(ordinal); }

void launch_decode_moe(const char* op, const MoeDecodeParams& main, const CurrentDevice& device,
                       const kern::moe::decode::DecodeMoeParams& args, CUstream stream) {
  Runtime& runtime = Runtime::instance();
  const KernelSpec reset_spec = decode_moe_spec(decode_reset_params(main), device.arch);
  const KernelSpec main_spec = decode_moe_spec(main, device.arch);
  // Both kernels first, so a capture miss (or any build failure) launches nothing.
  const CUkernel reset_kernel = runtime.kernel(reset_spec, stream);
  const CUkernel main_kernel = runtime.kernel(main_spec, stream);
  const int smem = static_cast<int>(decode_moe_smem_bytes(main));
  ensure_dynamic_smem(op, main_spec, main_kernel, device.ordinal, smem);
  const int sms = multiprocessor_count(device.ordinal);

  kern::moe::decode::DecodeMoeParams params = args;
  void* kernel_args[] = {&params};
  // Why no PDL for the reset: it must start after everything before it in the stream (the
  // previous layer may still read this workspace, and the main kernel reads hidden and topk_ids
  // before it waits). It lets the main kernel launch early; that one waits for it
  // (griddepcontrol.wait) before touching the counters.
  LaunchShape reset_shape;
  reset_shape.block = static_cast<unsigned>(kDecodeThreads);
  launch_moe_kernel(op, reset_spec, reset_kernel, reset_shape, false, stream, kernel_args);

  LaunchShape main_shape;
  main_shape.grid_x = static_cast<unsigned>(sms * decode_moe_blocks_per_sm(main));
  main_shape.block = static_cast<unsigned>(kDecodeThreads);
  main_shape.smem = static_cast<unsigned>(smem);
  launch_moe_kernel(op, main_spec, main_kernel, main_shape, true, stream, kernel_args);
}

}  // namespace moejit::detail
