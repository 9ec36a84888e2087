// moe_repack_*: checkpoint MXFP4 tensors (gpt-oss's interleaved w13, or DeepSeek's separate w1,
// w3) to the kernel layout of kernels/moe/layout.cuh, on the caller's stream. One kernel per
// matrix serves both layouts: the layouts differ only in the source strides passed here.
#include <cuda.h>

#include <climits>
#include <initializer_list>
#include <iterator>
#include <cstdint>
#include <moejit/kern/moe/params.cuh>
#include <string>

#include "moejit/error.hpp"
#include "moejit/moe.hpp"
#include "ops/moe_launch.hpp"
#include "ops/tensor_checks.hpp"
#include "plan/moe_plan.hpp"
#include "runtime/runtime_impl.hpp"

namespace moejit {
namespace {

constexpr const char* kGptOssOp = "moe_repack_gpt_oss";
constexpr const char* kSeparateOp = "moe_repack_separate";

// A checkpoint matrix view: base pointers and byte strides (params.cuh's Mxfp4Source).
kern::moe::Mxfp4Source source(const std::uint8_t* blocks, const std::uint8_t* scales,
                              int64_t row_bytes, int64_t expert_bytes, int64_t scale_row_bytes,
                              int64_t scale_expert_bytes) {
  kern::moe::Mxfp4Source s{};
  s.blocks = blocks;
  s.scales = scales;
  s.blocks_row_stride = row_bytes;
  s.blocks_expert_stride = expert_bytes;
  s.scales_row_stride = scale_row_bytes;
  s.scales_expert_stride = scale_expert_bytes;
  return s;
}

std::string extents(std::initializer_list<int64_t> values) {
  std::string out = "[n";
  for (int64_t v : values) out += ", " + std::to_string(v);
  return out + "]";
}

struct RepackContext {
  detail::Runtime& runtime;
  detail::OpTarget target;  // device, stream, check_pointers
  detail::MoeWeightSizes sizes;
};

RepackContext begin(const char* op, const ModelShape& shape, const MoeRepackTarget& target,
                    Stream stream) {
  const std::string reason = detail::moe_shape_problem(shape);
  if (!reason.empty()) throw Error(ErrorCode::kInvalidDescriptor, std::string(op) + ": " + reason);
  detail::Runtime& runtime = detail::Runtime::instance();
  RepackContext context{runtime, detail::op_target(op, runtime, stream),
                        detail::moe_weight_sizes(shape)};
  // Why 16: each thread writes its lane's 16 weight bytes with one store (the scales' 32-bit
  // stores would do with 4), and moe_forward reads all four buffers 16 bytes at a time: a target
  // it would refuse is refused here, before the repack fills it.
  detail::check_device_pointer(op, "target.weights.w13", target.weights.w13, 16);
  detail::check_device_pointer(op, "target.weights.w13_scales", target.weights.w13_scales, 16);
  detail::check_device_pointer(op, "target.weights.w2", target.weights.w2, 16);
  detail::check_device_pointer(op, "target.weights.w2_scales", target.weights.w2_scales, 16);
  if (target.bad_scale_count != nullptr) {
    detail::check_device_pointer(op, "target.bad_scale_count", target.bad_scale_count, 4);
  }
  return context;
}

// `count` is the leading extent n of the checkpoint's tensors (`count_arg` the first of them).
void check_experts(const char* op, const ModelShape& shape, const MoeRepackTarget& target,
                   int64_t count, const char* count_arg) {
  const std::string range = "[first_expert, first_expert + n) inside the shape's local experts "
                            "[0, " + std::to_string(shape.num_experts) + ")";
  const std::string found = "first_expert = " + std::to_string(target.first_expert) +
                            " with n = " + std::to_string(count) + " experts";
  // Why >=: n is at least 1 (the tensor checks), so first_expert = E leaves no room at all.
  if (target.first_expert < 0 || target.first_expert >= shape.num_experts) {
    detail::throw_argument(op, "target.first_expert", range, found);
  }
  // Why count against the room left, not first_expert + count: count is the caller's tensor
  // dimension and the sum could overflow. A first_expert in range leaves n to blame.
  if (count < 0 || count > static_cast<int64_t>(shape.num_experts) - target.first_expert) {
    detail::throw_argument(op, count_arg, "a leading extent n with " + range, found);
  }
}

// The repacked tensors (the shape's whole buffers, moe_weight_layout) and the counter are
// written while the checkpoint is read: no two may share a byte (as the forward op refuses for
// its buffers), or the experts come out corrupt, silently.
void check_repack_disjoint(const char* op, const RepackContext& context,
                           const MoeRepackTarget& target,
                           std::initializer_list<detail::Span> reads) {
  const detail::MoeWeightSizes& z = context.sizes;
  const detail::Span writes[] = {
      {"target.weights.w13", target.weights.w13, static_cast<int64_t>(z.w13)},
      {"target.weights.w13_scales", target.weights.w13_scales,
       static_cast<int64_t>(z.w13_scales)},
      {"target.weights.w2", target.weights.w2, static_cast<int64_t>(z.w2)},
      {"target.weights.w2_scales", target.weights.w2_scales, static_cast<int64_t>(z.w2_scales)},
      {"target.bad_scale_count", target.bad_scale_count,
       target.bad_scale_count != nullptr ? 4 : 0}};
  for (std::size_t a = 0; a < std::size(writes); ++a) {
    for (std::size_t b = a + 1; b < std::size(writes); ++b) {
      detail::check_disjoint(op, writes[a], writes[b]);
    }
    for (const detail::Span& read : reads) detail::check_disjoint(op, read, writes[a]);
  }
  if (context.target.check_pointers) {
    const detail::SpanMemoryCheck check(op, context.target);
    for (const detail::Span& write : writes) check.write(write);
    for (const detail::Span& read : reads) check.read(read);
  }
}

// One repack_mxfp4 launch over `p.num_experts` experts, its kernel looked up and its grid checked.
struct RepackLaunch {
  KernelSpec spec;
  CUkernel kernel = nullptr;
  detail::LaunchShape geometry;
  kern::moe::RepackParams params{};
};

RepackLaunch prepare_repack(const char* op, RepackContext& context, bool gate_up,
                            const kern::moe::RepackParams& p) {
  RepackLaunch launch;
  launch.spec.family = Family::kRepack;
  launch.spec.arch = context.target.device.arch;
  launch.spec.params = detail::moe_repack_params(gate_up);
  const MoeRepackParams& params = std::get<MoeRepackParams>(launch.spec.params);
  launch.kernel = detail::op_kernel(op, context.runtime, launch.spec, context.target.stream.handle);
  const uint64_t threads = static_cast<uint64_t>(p.num_experts) * static_cast<uint64_t>(p.m_atoms) *
                           static_cast<uint64_t>(p.k_atoms) * 32u;
  const uint64_t block = static_cast<uint64_t>(params.block_threads);
  const uint64_t grid = (threads + block - 1) / block;
  if (grid > static_cast<uint64_t>(INT_MAX)) {
    detail::throw_argument(op, "checkpoint", "at most 2^31 - 1 CTAs per launch",
                           std::to_string(grid) + " CTAs for " + std::to_string(p.num_experts) +
                               " experts: repack fewer experts per call");
  }
  launch.geometry.grid_x = static_cast<unsigned>(grid);
  launch.geometry.block = static_cast<unsigned>(block);
  launch.params = p;
  return launch;
}

// Launches FC1's repack, then FC2's. Why both prepared before either launches: a kernel the
// second can't have (a failed compile, a capture miss) or a grid over the limit must be refused
// before the first has written half of the target.
void launch_repacks(const char* op, RepackContext& context, const kern::moe::RepackParams& fc1,
                    const kern::moe::RepackParams& fc2) {
  RepackLaunch launches[] = {prepare_repack(op, context, true, fc1),
                             prepare_repack(op, context, false, fc2)};
  for (RepackLaunch& launch : launches) {
    void* args[] = {&launch.params};
    // Why no PDL: repack_mxfp4 does not wait on griddepcontrol; plain stream order it is.
    detail::launch_moe_kernel(op, launch.spec, launch.kernel, launch.geometry, false,
                              context.target.stream, args);
  }
}

kern::moe::RepackParams fc1_params(const ModelShape& shape, const RepackContext& c,
                                   const MoeRepackTarget& target, int64_t count) {
  kern::moe::RepackParams p{};
  p.weights = static_cast<kern::moe::u8*>(target.weights.w13);
  p.scales = static_cast<kern::moe::u8*>(target.weights.w13_scales);
  p.rows = shape.intermediate;
  p.k = shape.hidden;
  p.m_atoms = c.sizes.fc1_m_atoms;
  p.k_atoms = c.sizes.fc1_k_atoms;
  p.num_experts = static_cast<int>(count);
  p.expert_offset = target.first_expert;
  p.bad_scales = target.bad_scale_count;
  return p;
}

kern::moe::RepackParams fc2_params(const ModelShape& shape, const RepackContext& c,
                                   const MoeRepackTarget& target, int64_t count,
                                   const std::uint8_t* blocks, const std::uint8_t* scales) {
  const int64_t h = shape.hidden;
  const int64_t i = shape.intermediate;
  kern::moe::RepackParams p{};
  // w2 [n, H, I/32, 16]: row h is I/2 bytes, one scale per 32 of I.
  p.src[0] = source(blocks, scales, i / 2, h * i / 2, i / 32, h * i / 32);
  p.weights = static_cast<kern::moe::u8*>(target.weights.w2);
  p.scales = static_cast<kern::moe::u8*>(target.weights.w2_scales);
  p.rows = shape.hidden;
  p.k = shape.intermediate;
  p.m_atoms = c.sizes.fc2_m_atoms;
  p.k_atoms = c.sizes.fc2_k_atoms;
  p.num_experts = static_cast<int>(count);
  p.expert_offset = target.first_expert;
  p.bad_scales = target.bad_scale_count;
  return p;
}

[[noreturn]] void throw_count_mismatch(const char* op, const char* arg, int64_t found,
                                       int64_t expected) {
  detail::throw_argument(
      op, arg, "the same expert count n as the first tensor (" + std::to_string(expected) + ")",
      "n = " + std::to_string(found));
}

}  // namespace

void moe_repack_gpt_oss(const ModelShape& shape, const GptOssCheckpoint& checkpoint,
                        const MoeRepackTarget& target, Stream stream) {
  const char* op = kGptOssOp;
  RepackContext context = begin(op, shape, target, stream);
  const int ordinal = context.target.device.ordinal;
  const int64_t h = shape.hidden;
  const int64_t i = shape.intermediate;
  const std::string w13_text = "[n, 2I, H/32, 16] = " + extents({2 * i, h / 32, 16});
  const std::string s13_text = "[n, 2I, H/32] = " + extents({2 * i, h / 32});
  const std::string w2_text = "[n, H, I/32, 16] = " + extents({h, i / 32, 16});
  const std::string s2_text = "[n, H, I/32] = " + extents({h, i / 32});
  const detail::ByteTensor w13 =
      detail::check_byte_tensor(op, "w13_blocks", checkpoint.w13_blocks, ordinal,
                                {2 * i, h / 32, 16}, false, w13_text.c_str());
  const detail::ByteTensor s13 = detail::check_byte_tensor(
      op, "w13_scales", checkpoint.w13_scales, ordinal, {2 * i, h / 32}, false, s13_text.c_str());
  const detail::ByteTensor w2 = detail::check_byte_tensor(
      op, "w2_blocks", checkpoint.w2_blocks, ordinal, {h, i / 32, 16}, false, w2_text.c_str());
  const detail::ByteTensor s2 = detail::check_byte_tensor(
      op, "w2_scales", checkpoint.w2_scales, ordinal, {h, i / 32}, false, s2_text.c_str());
  const int64_t n = w13.count;
  if (s13.count != n) throw_count_mismatch(op, "w13_scales", s13.count, n);
  if (w2.count != n) throw_count_mismatch(op, "w2_blocks", w2.count, n);
  if (s2.count != n) throw_count_mismatch(op, "w2_scales", s2.count, n);
  check_experts(op, shape, target, n, "w13_blocks");
  check_repack_disjoint(op, context, target,
                        {{"w13_blocks", w13.data, n * 2 * i * h / 2},
                         {"w13_scales", s13.data, n * 2 * i * h / 32},
                         {"w2_blocks", w2.data, n * h * i / 2},
                         {"w2_scales", s2.data, n * h * i / 32}});

  // w13 row r of expert e: gate j = row 2j, up j = row 2j + 1 (openai's x[..., ::2] and
  // x[..., 1::2]), each H/2 bytes of nibbles and H/32 scales. So gate and up are both views with
  // a row stride of two rows, up starting one row later.
  kern::moe::RepackParams fc1 = fc1_params(shape, context, target, n);
  fc1.src[0] = source(w13.data, s13.data, h, 2 * i * h / 2, h / 16, 2 * i * h / 32);
  fc1.src[1] =
      source(w13.data + h / 2, s13.data + h / 32, h, 2 * i * h / 2, h / 16, 2 * i * h / 32);
  launch_repacks(op, context, fc1, fc2_params(shape, context, target, n, w2.data, s2.data));
}

void moe_repack_separate(const ModelShape& shape, const SeparateCheckpoint& checkpoint,
                         const MoeRepackTarget& target, Stream stream) {
  const char* op = kSeparateOp;
  RepackContext context = begin(op, shape, target, stream);
  const int ordinal = context.target.device.ordinal;
  const int64_t h = shape.hidden;
  const int64_t i = shape.intermediate;
  const std::string w13_text = "[n, I, H/32, 16] = " + extents({i, h / 32, 16});
  const std::string s13_text = "[n, I, H/32] = " + extents({i, h / 32});
  const std::string w2_text = "[n, H, I/32, 16] = " + extents({h, i / 32, 16});
  const std::string s2_text = "[n, H, I/32] = " + extents({h, i / 32});
  const detail::ByteTensor w1 = detail::check_byte_tensor(
      op, "w1_blocks", checkpoint.w1_blocks, ordinal, {i, h / 32, 16}, true, w13_text.c_str());
  const detail::ByteTensor s1 = detail::check_byte_tensor(
      op, "w1_scales", checkpoint.w1_scales, ordinal, {i, h / 32}, true, s13_text.c_str());
  const detail::ByteTensor w3 = detail::check_byte_tensor(
      op, "w3_blocks", checkpoint.w3_blocks, ordinal, {i, h / 32, 16}, true, w13_text.c_str());
  const detail::ByteTensor s3 = detail::check_byte_tensor(
      op, "w3_scales", checkpoint.w3_scales, ordinal, {i, h / 32}, true, s13_text.c_str());
  const detail::ByteTensor w2 = detail::check_byte_tensor(
      op, "w2_blocks", checkpoint.w2_blocks, ordinal, {h, i / 32, 16}, true, w2_text.c_str());
  const detail::ByteTensor s2 = detail::check_byte_tensor(
      op, "w2_scales", checkpoint.w2_scales, ordinal, {h, i / 32}, true, s2_text.c_str());
  const int64_t n = w1.count;
  if (s1.count != n) throw_count_mismatch(op, "w1_scales", s1.count, n);
  if (w3.count != n) throw_count_mismatch(op, "w3_blocks", w3.count, n);
  if (s3.count != n) throw_count_mismatch(op, "w3_scales", s3.count, n);
  if (w2.count != n) throw_count_mismatch(op, "w2_blocks", w2.count, n);
  if (s2.count != n) throw_count_mismatch(op, "w2_scales", s2.count, n);
  check_experts(op, shape, target, n, "w1_blocks");
  check_repack_disjoint(op, context, target,
                        {{"w1_blocks", w1.data, n * i * h / 2},
                         {"w1_scales", s1.data, n * i * h / 32},
                         {"w3_blocks", w3.data, n * i * h / 2},
                         {"w3_scales", s3.data, n * i * h / 32},
                         {"w2_blocks", w2.data, n * h * i / 2},
                         {"w2_scales", s2.data, n * h * i / 32}});

  // w1 / w3 [n, I, H/32, 16]: row j is H/2 bytes of nibbles and H/32 scales.
  kern::moe::RepackParams fc1 = fc1_params(shape, context, target, n);
  fc1.src[0] = source(w1.data, s1.data, h / 2, i * h / 2, h / 32, i * h / 32);
  fc1.src[1] = source(w3.data, s3.data, h / 2, i * h / 2, h / 32, i * h / 32);
  launch_repacks(op, context, fc1, fc2_params(shape, context, target, n, w2.data, s2.data));
}

}  // namespace moejit
