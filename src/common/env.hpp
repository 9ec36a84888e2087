// Environment switches (all listed in README's table).
#pragma once

#include <optional>
#include <string>

namespace moejit::detail {

// The variable's value, or nullopt when unset or empty.
std::optional<std::string> env(const char* name);

}  // namespace moejit::detail
