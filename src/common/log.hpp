// The library's one logger, "moejit". Level from MOEJIT_LOG_LEVEL (trace, debug, info, warn,
// error, off; default warn). Never touches the host application's default logger.
#pragma once

#include <spdlog/spdlog.h>

namespace moejit::detail {

spdlog::logger& log();

}  // namespace moejit::detail
