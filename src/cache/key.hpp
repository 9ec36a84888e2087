// The cache key: a digest of everything that can change a cubin, and nothing else.
#pragma once

#include <string>
#include <string_view>
#include <vector>

namespace moejit::detail {

// One header the generated source can include, by the name it is included as. Views, not
// copies: the runtime's point at embedded_headers(), which live as long as the process. Why:
// copying the ~280 KB of kernel headers into every key's inputs cost more than hashing them.
struct KeyHeader {
  std::string_view path;  // include name, e.g. "moejit/kern/append_shared.cuh" (never a disk path)
  std::string_view content;
};

// Every input of a compile. Nothing machine- or time-specific belongs here: no absolute path,
// no host name, no time, so two machines with the same NVRTC share keys and nothing is missed.
// Nothing from the CUDA toolkit's headers either: the kernels include none (NVRTC compiles them
// with no include directory, so one that did would not compile).
struct KeyInputs {
  int schema_version = 0;            // kCacheSchemaVersion
  int pipeline_version = 0;          // kCompilePipelineVersion: compile()'s checks and retries
  std::string nvrtc_version;         // nvrtc_identity(): "13.0 libnvrtc.so.13 109338064"
  std::vector<std::string> options;  // compile_options(arch)
  std::string arch;                  // "sm_90a"
  std::string program_name;          // GeneratedSource::file_name (NVRTC's name for the program)
  std::string source;                // the generated translation unit
  std::string name_expression;       // what nvrtcAddNameExpression instantiates
  std::vector<KeyHeader> headers;    // every embedded kernel header, in a fixed order
};

// 32 lowercase hex digits (XXH3-128 over the length-prefixed fields, in a fixed order).
std::string compute_key(const KeyInputs& inputs);

}  // namespace moejit::detail
