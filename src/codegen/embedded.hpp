// The kernel templates of kernels/, embedded into the library at build time (see
// tools/cmake/embed_kernels.cmake), so an installed library needs no source tree.
#pragma once

#include <cstddef>
#include <string_view>
#include <vector>

namespace moejit::detail {

struct EmbeddedHeader {
  std::string_view path;     // include name, e.g. "moejit/kern/append_shared.cuh"
  std::string_view content;
};

const std::vector<EmbeddedHeader>& embedded_headers();

}  // namespace moejit::detail
