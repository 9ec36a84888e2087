// libmoejit: model shape descriptors, as read from shape files (see tools/shapes/schema.json).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace moejit {

enum class ActivationKind {
  kSwiGLU,         // silu(g) * u
  kClampedSwiGLU,  // g = min(g, limit), u = clamp(u, -limit, limit), silu(g) * u
  kGptOss,         // g = min(g, limit), u = clamp(u, -limit, limit), g * sigmoid(alpha g) * (u + 1)
  kSiTU,           // beta tanh(g / beta) sigmoid(g) * linear_beta tanh(u / linear_beta)
};

struct Activation {
  ActivationKind kind = ActivationKind::kSwiGLU;
  float limit = 0.f;        // clamped SwiGLU and gpt-oss
  float alpha = 0.f;        // gpt-oss (1.702)
  float beta = 0.f;         // SiTU
  float linear_beta = 0.f;  // SiTU
};

enum class DType { kBF16, kF16, kF32, kI32, kI64 };
enum class WeightFormat { kMXFP4 };

// How the weights of appended shared experts are produced.
enum class SharedGate {
  kSigmoid,   // sigmoid(logit[T, S]) * scale
  kConstant,  // scale (e.g. 1, or 1 / ep_size under all-reduce EP)
  kGiven,     // weights[T, S] fp32, copied
};

struct SharedExperts {
  int count = 0;          // S; 0 = no shared experts
  int intermediate = 0;   // the shared expert's intermediate size
  SharedGate gate = SharedGate::kConstant;
  DType logit_dtype = DType::kBF16;  // for kSigmoid
  float scale = 1.f;
};

struct ModelShape {
  std::string name;
  int num_experts = 0;       // local experts E on this rank
  int top_k = 0;             // k
  int hidden = 0;            // H
  int intermediate = 0;      // I per rank
  int expert_offset = 0;     // local experts are [expert_offset, expert_offset + E)
  int global_experts = 0;    // routed experts across all ranks (shared ids start here)
  Activation activation;
  bool has_bias = false;     // FC1/FC2 biases (gpt-oss)
  SharedExperts shared;
  WeightFormat weight_format = WeightFormat::kMXFP4;
  DType activation_dtype = DType::kBF16;
  DType id_dtype = DType::kI32;  // dtype of topk_ids the engine passes
  int max_tokens = 16384;        // largest T a forward call may see

  // Where this shape came from, for messages ("file:line").
  std::string source;
};

// Parse a shape file's text: one shape object, an array of them, or {"shapes": [...]}. Every rule
// is checked before anything is returned; the first broken rule throws a DescriptorError naming
// `source_name`, the line and column, and the JSON pointer of the field.
std::vector<ModelShape> parse_shapes(const std::string& text, const std::string& source_name);

// Read and parse a shape file (throws Error{kIo} if it can't be read).
std::vector<ModelShape> load_shapes_file(const std::string& path);

const char* activation_kind_name(ActivationKind kind) noexcept;
const char* dtype_name(DType dtype) noexcept;
const char* shared_gate_name(SharedGate gate) noexcept;

}  // namespace moejit
