// libmoejit benchmarks: what both bench programs print with (tables go to stdout, one column per
// header cell, the first left-aligned, the rest right-aligned, flushed after each table so a run
// cut short keeps what it measured) and where they find the shape file.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdio>
#include <filesystem>
#include <iostream>
#include <stdexcept>
#include <string>
#include <vector>

namespace moejit::bench {

// `value` with `digits` digits after the point.
inline std::string fixed(double value, int digits) {
  char text[64];
  std::snprintf(text, sizeof(text), "%.*f", digits, value);
  return text;
}

inline void print_table(const std::string& title, const std::vector<std::string>& header,
                        const std::vector<std::vector<std::string>>& rows) {
  std::vector<std::size_t> width(header.size(), 0);
  for (std::size_t c = 0; c < header.size(); ++c) width[c] = header[c].size();
  for (const auto& r : rows) {
    for (std::size_t c = 0; c < r.size() && c < width.size(); ++c) {
      width[c] = std::max(width[c], r[c].size());
    }
  }
  auto line = [&width](const std::vector<std::string>& cells) {
    std::string out = " ";
    for (std::size_t c = 0; c < width.size(); ++c) {
      const std::string cell = c < cells.size() ? cells[c] : "";
      const std::string pad(width[c] - cell.size(), ' ');
      out += " " + (c == 0 ? cell + pad : pad + cell) + " ";
    }
    return out;
  };
  std::cout << "\n" << title << "\n" << line(header) << "\n";
  std::size_t total = 1;
  for (std::size_t w : width) total += w + 2;
  std::cout << " " << std::string(total, '-') << "\n";
  for (const auto& r : rows) std::cout << line(r) << "\n";
  std::cout.flush();
}

// The shape file a bench reads: `given` when set, else tools/shapes/reference.json from the
// current directory, else `built_in` (the source tree's, compiled in).
inline std::string find_shapes_file(const std::string& given, const std::string& built_in) {
  if (!given.empty()) return given;
  for (const std::string& candidate : {std::string("tools/shapes/reference.json"), built_in}) {
    if (std::filesystem::exists(candidate)) return candidate;
  }
  throw std::runtime_error("tools/shapes/reference.json not found from the current directory "
                           "nor at " + built_in + "; pass --shapes PATH");
}

}  // namespace moejit::bench
