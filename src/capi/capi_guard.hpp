// The C ABI's one error path, shared by every src/capi/*.cpp: run a body, turn any exception into
// a moejit_status and this thread's moejit_last_error() message (capi.cpp owns that message).
#pragma once

#include <string>
#include <type_traits>

#include "moejit/moejit.h"

namespace moejit::detail {

// A C++ argument path and how the C caller spells it: a struct the C call takes by pointer
// ("weights.w13" -> "weights->w13"), or a C++ struct field the C call takes as an argument of its
// own ("target.first_expert" -> "first_expert").
struct CapiRename {
  const char* cxx = nullptr;
  const char* c = nullptr;
};

// The C function a call serves, and the C++ op it wraps: a message the op starts with its own
// name ("moe_forward: hidden: ...") is given to the C caller under the name it called
// ("moejit_moe_forward: hidden: ..."). Either may be null: no renaming. `renames`, if not null,
// ends with {nullptr, nullptr}; each path that stands as a whole word in the message (no letter,
// digit, quote or one of "_.-/" next to it on either side, a '.' that ends a sentence aside) is
// replaced by its C spelling, so a shape name or a file path that holds one stays as it is.
struct CapiNames {
  const char* c_call = nullptr;
  const char* cxx_op = nullptr;
  const CapiRename* renames = nullptr;
};

// `message` as the C caller of `names` reads it (see CapiNames).
std::string capi_message(const char* message, CapiNames names);

// Runs body(context) and returns MOEJIT_OK, or the status of what it threw (the message is kept
// for moejit_last_error()). Never throws.
moejit_status capi_guarded(void (*body)(void*), void* context, CapiNames names) noexcept;

// capi_guarded for a lambda.
template <typename Body>
moejit_status capi_call(CapiNames names, Body&& body) noexcept {
  using Stored = std::remove_reference_t<Body>;
  return capi_guarded([](void* context) { (*static_cast<Stored*>(context))(); },
                      const_cast<void*>(static_cast<const void*>(&body)), names);
}

}  // namespace moejit::detail
