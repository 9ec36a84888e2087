// libmoejit benchmarks: what both bench programs print with. Tables go to stdout, one column per
// header cell (the first left-aligned, the rest right-aligned), flushed after each table so a run
// cut short keeps what it measured.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdio>
#include <iostream>
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

}  // namespace moejit::bench
