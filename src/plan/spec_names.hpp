// The short spellings a KernelSpec uses in its display name, JSON and generated file names.
// Private to the library: one table, so every place that prints a spec agrees.
#pragma once

#include "moejit/shape.hpp"

namespace moejit::detail {

const char* dtype_short_name(DType dtype) noexcept;     // "bf16", "f16", "f32", "i32", "i64"
const char* gate_short_name(SharedGate gate) noexcept;  // "sigmoid", "constant", "given"

}  // namespace moejit::detail
