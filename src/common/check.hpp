// The check macros: a condition, a driver call, an NVRTC call. All throw moejit::Error.
#pragma once

#include <sstream>
#include <string>

#include "moejit/error.hpp"

namespace moejit::detail {

[[noreturn]] void throw_error(ErrorCode code, const std::string& message);

}  // namespace moejit::detail

// MOEJIT_CHECK(cond, code, message-stream-expression)
#define MOEJIT_CHECK(cond, code, msg)                          \
  do {                                                         \
    if (!(cond)) {                                             \
      std::ostringstream moejit_check_os_;                     \
      moejit_check_os_ << msg;                                 \
      ::moejit::detail::throw_error(code, moejit_check_os_.str()); \
    }                                                          \
  } while (0)
