// The C ABI's one error path, shared by every src/capi/*.cpp: run a body, turn any exception into
// a moejit_status and this thread's moejit_last_error() message (capi.cpp owns that message).
#pragma once

#include <type_traits>

#include "moejit/moejit.h"

namespace moejit::detail {

// The C function a call serves, and the C++ op it wraps: a message the op starts with its own
// name ("moe_forward: hidden: ...") is given to the C caller under the name it called
// ("moejit_moe_forward: hidden: ..."). Either may be null: no renaming.
struct CapiNames {
  const char* c_call = nullptr;
  const char* cxx_op = nullptr;
};

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
