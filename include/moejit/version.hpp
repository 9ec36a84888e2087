// libmoejit: version and cache schema.
#pragma once

namespace moejit {

inline constexpr int kVersionMajor = 0;
inline constexpr int kVersionMinor = 1;
inline constexpr int kVersionPatch = 0;
inline constexpr const char* kVersionString = "0.1.0";

// Bumped whenever the meaning of a cache entry or its key changes.
inline constexpr int kCacheSchemaVersion = 1;

}  // namespace moejit
