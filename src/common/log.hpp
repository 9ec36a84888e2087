// The library's one logger, "moejit". Level from MOEJIT_LOG_LEVEL (trace, debug, info, warn,
// error, critical, off, in any case; default warn). Never touches the host application's default
// logger.
#pragma once

#include <spdlog/spdlog.h>

#include <string>

namespace moejit::detail {

spdlog::logger& log();

// What is wrong with MOEJIT_LOG_LEVEL ("" when it is unset or names a level). The logger then
// logs at warn and says so in its first line; `moejit doctor` counts it as a problem.
std::string log_level_problem();

}  // namespace moejit::detail
