// The C ABI's one error path, shared by every src/capi/*.cpp: run a body, turn any exception into
// a moejit_status and this thread's moejit_last_error() message (capi.cpp owns that message).
#pragma once

#include <type_traits>

#include "moejit/moejit.h"

namespace moejit::detail {

// Runs body(context) and returns MOEJIT_OK, or the status of what it threw (the message is kept
// for moejit_last_error()). Never throws.
moejit_status capi_guarded(void (*body)(void*), void* context) noexcept;

// capi_guarded for a lambda.
template <typename Body>
moejit_status capi_call(Body&& body) noexcept {
  using Stored = std::remove_reference_t<Body>;
  return capi_guarded([](void* context) { (*static_cast<Stored*>(context))(); },
                      const_cast<void*>(static_cast<const void*>(&body)));
}

}  // namespace moejit::detail
