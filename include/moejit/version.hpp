// libmoejit: version and cache schema.
#pragma once

namespace moejit {

inline constexpr int kVersionMajor = 0;
inline constexpr int kVersionMinor = 1;
inline constexpr int kVersionPatch = 0;
inline constexpr const char* kVersionString = "0.1.0";

// Bumped whenever the meaning of a cache entry or its key changes.
inline constexpr int kCacheSchemaVersion = 2;

// The MXFP4 kernel layout of repacked weights (moe.hpp) this header was written with. Compare
// repacked weights kept across runs with the library's own value at run time
// (moe_weight_layout_version(), MoeWeightLayout::version, or the C ABI's
// moejit_moe_weight_layout_version()), not with this constant: a shared library can be newer
// than the header a program was built against.
inline constexpr int kMoeWeightLayoutVersion = 1;

}  // namespace moejit
