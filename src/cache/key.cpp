#include "cache/key.hpp"

#include <cstdint>

#include "common/hash.hpp"

namespace moejit::detail {

std::string compute_key(const KeyInputs& inputs) {
  Hasher hasher;
  // Why a tag and counts before each list: every field is length-prefixed by the Hasher, and the
  // counts keep a moved boundary between lists (an option becoming a header) from colliding.
  hasher.field("moejit-cache-key");
  hasher.field(static_cast<int64_t>(inputs.schema_version));
  hasher.field(static_cast<int64_t>(inputs.pipeline_version));
  hasher.field(inputs.nvrtc_version);
  hasher.field(static_cast<int64_t>(inputs.options.size()));
  for (const std::string& option : inputs.options) hasher.field(option);
  hasher.field(inputs.arch);
  hasher.field(inputs.program_name);
  hasher.field(inputs.source);
  hasher.field(inputs.name_expression);
  hasher.field(static_cast<int64_t>(inputs.headers.size()));
  for (const KeyHeader& header : inputs.headers) {
    hasher.field(header.path);
    hasher.field(header.content);
  }
  return hasher.digest().hex();
}

}  // namespace moejit::detail
