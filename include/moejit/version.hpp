// libmoejit: version and cache schema.
#pragma once

namespace moejit {

// The one place the version is written: CMakeLists.txt reads the four lines below. While the major
// version is 0, a minor release may change the C++ ABI (and names a new shared-library soname).
inline constexpr int kVersionMajor = 0;
inline constexpr int kVersionMinor = 4;
inline constexpr int kVersionPatch = 0;
inline constexpr const char* kVersionString = "0.4.0";

// The version of the library this process runs, which can differ from the header's kVersionString
// a program was built against (a shared library replaced under it). Never null.
const char* library_version();

// Bumped whenever the meaning of a cache entry or its key changes.
inline constexpr int kCacheSchemaVersion = 2;

// The MXFP4 kernel layout of repacked weights (moe.hpp) this header was written with. Compare
// repacked weights kept across runs with the library's own value at run time
// (moe_weight_layout_version(), MoeWeightLayout::version, or the C ABI's
// moejit_moe_weight_layout_version()), not with this constant: a shared library can be newer
// than the header a program was built against.
inline constexpr int kMoeWeightLayoutVersion = 1;

}  // namespace moejit
