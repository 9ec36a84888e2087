// Codegen: a KernelSpec becomes one translation unit and the name expression of its kernel.
#pragma once

#include <string>

#include "moejit/kernel_spec.hpp"

namespace moejit::detail {

struct GeneratedSource {
  std::string file_name;        // e.g. "append_shared_k6_s1_i32_sigmoid_bf16.cu"
  std::string source;           // the translation unit (includes embedded headers by name)
  std::string name_expression;  // for nvrtcAddNameExpression, e.g. "&moejit::kern::f<T>"
};

// Throws Error{kUnsupported} with supports()'s reason when the spec can't be served.
GeneratedSource render(const KernelSpec& spec);

}  // namespace moejit::detail
