// Why: header-only xxHash, so the library carries no runtime dependency on libxxhash.
#define XXH_INLINE_ALL
#include <spdlog/details/console_globals.h>
#include <spdlog/sinks/stdout_color_sinks.h>
#include <xxhash.h>

#include <cctype>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>

#include "common/check.hpp"
#include "common/env.hpp"
#include "common/fork.hpp"
#include "common/hash.hpp"
#include "common/log.hpp"
#include "common/text.hpp"
#include "moejit/error.hpp"
#include "moejit/version.hpp"

namespace moejit {

const char* library_version() { return kVersionString; }

const char* error_code_name(ErrorCode code) noexcept {
  switch (code) {
    case ErrorCode::kInvalidDescriptor: return "invalid descriptor";
    case ErrorCode::kInvalidArgument: return "invalid argument";
    case ErrorCode::kUnsupported: return "unsupported";
    case ErrorCode::kCompileFailed: return "compile failed";
    case ErrorCode::kCacheCorrupt: return "cache corrupt";
    case ErrorCode::kCache: return "cache";
    case ErrorCode::kDriver: return "driver";
    case ErrorCode::kCaptureMiss: return "compile during capture";
    case ErrorCode::kIo: return "io";
    case ErrorCode::kInternal: return "internal";
  }
  return "unknown";
}

namespace detail {

void throw_error(ErrorCode code, const std::string& message) { throw Error(code, message); }

std::optional<std::string> env(const char* name) {
  const char* value = std::getenv(name);
  if (value == nullptr || *value == '\0') return std::nullopt;
  return std::string(value);
}

namespace {

// MOEJIT_LOG_LEVEL's level, any case; nullopt for a name that is none. Why not spdlog's
// from_str alone: it is case-sensitive and takes an unknown name for "off", so WARN or a typo
// would silence every warning (healed corruption, a degraded cache) without a word.
std::optional<spdlog::level::level_enum> log_level_named(std::string name) {
  for (char& c : name) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  // spdlog's own names (warning, error, ...) and their short forms.
  if (name == "warn") return spdlog::level::warn;
  if (name == "err") return spdlog::level::err;
  for (int level = spdlog::level::trace; level < spdlog::level::n_levels; ++level) {
    const auto named = static_cast<spdlog::level::level_enum>(level);
    const auto text = spdlog::level::to_string_view(named);
    if (std::string_view(text.data(), text.size()) == name) return named;
  }
  return std::nullopt;
}

}  // namespace

std::string log_level_problem() {
  const std::optional<std::string> text = env("MOEJIT_LOG_LEVEL");
  if (!text || log_level_named(*text)) return "";
  return "MOEJIT_LOG_LEVEL=" + *text +
         " is not a level (trace, debug, info, warn, error, critical or off, in any case): "
         "logging at warn";
}

spdlog::logger& log() {
  static std::shared_ptr<spdlog::logger> logger = [] {
    // Why: a child forked while a thread of its parent was writing a line would copy the console
    // sinks' mutex locked, and wait on it forever at its own first line. Nothing is taken under
    // it (the sinks only write), so the fork handlers take it last. (A logger the host registered
    // as "moejit" keeps whatever other sinks it has, unguarded.)
    hold_across_fork_last(&spdlog::details::console_mutex::mutex());
    auto existing = spdlog::get("moejit");
    if (existing) return existing;
    auto made = spdlog::stderr_color_mt("moejit");
    made->set_pattern("[moejit %L] %v");
    const std::optional<std::string> text = env("MOEJIT_LOG_LEVEL");
    const auto level = text ? log_level_named(*text) : std::nullopt;
    made->set_level(level.value_or(spdlog::level::warn));
    if (text && !level) made->warn(log_level_problem());
    return made;
  }();
  return *logger;
}

std::string float_text(float value) {
  char text[32];
  for (int precision = 6; precision <= 9; ++precision) {
    std::snprintf(text, sizeof(text), "%.*g", precision, static_cast<double>(value));
    if (std::strtof(text, nullptr) == value) break;
  }
  return text;
}

std::string Digest::hex() const {
  char text[33];
  std::snprintf(text, sizeof(text), "%016llx%016llx", static_cast<unsigned long long>(high),
                static_cast<unsigned long long>(low));
  return text;
}

Digest hash_bytes(const void* data, std::size_t size) {
  XXH128_hash_t h = XXH3_128bits(data, size);
  return Digest{h.high64, h.low64};
}

Hasher::Hasher() : state_(XXH3_createState()) {
  if (state_ == nullptr) {
    throw Error(ErrorCode::kInternal, "XXH3_createState failed (out of memory)");
  }
  XXH3_128bits_reset(static_cast<XXH3_state_t*>(state_));
}
Hasher::~Hasher() { XXH3_freeState(static_cast<XXH3_state_t*>(state_)); }

Hasher& Hasher::field(std::string_view bytes) {
  field(static_cast<int64_t>(bytes.size()));
  XXH3_128bits_update(static_cast<XXH3_state_t*>(state_), bytes.data(), bytes.size());
  return *this;
}

Hasher& Hasher::field(int64_t value) {
  XXH3_128bits_update(static_cast<XXH3_state_t*>(state_), &value, sizeof(value));
  return *this;
}

Digest Hasher::digest() const {
  XXH128_hash_t h = XXH3_128bits_digest(static_cast<XXH3_state_t*>(state_));
  return Digest{h.high64, h.low64};
}

}  // namespace detail
}  // namespace moejit
