// Where each value of a JSON text starts: nlohmann::json keeps no positions, so shape-file
// messages get their line and column from this small scanner, which also finds duplicate keys
// (nlohmann keeps the last one silently).
#pragma once

#include <cstddef>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace moejit::detail {

inline constexpr std::size_t kNoOffset = static_cast<std::size_t>(-1);

// Byte offsets of one value in the text.
struct ValueSpan {
  std::size_t begin = kNoOffset;  // first byte of the value
  std::size_t end = kNoOffset;    // one past the last byte of a scalar; kNoOffset for containers
  std::size_t key = kNoOffset;    // first byte (the quote) of its key, when an object member
};

struct DuplicateKey {
  std::string pointer;      // JSON pointer of the member named twice
  std::size_t first = 0;    // offset of the first key
  std::size_t second = 0;   // offset of the repeated key
};

struct JsonScan {
  std::unordered_map<std::string, ValueSpan> spans;  // JSON pointer -> span
  std::optional<DuplicateKey> duplicate;             // the first key repeated in its object
  std::optional<std::size_t> too_deep;               // where nesting first exceeded max_depth
};

// Scan `text`. Meant for text nlohmann::json accepted; on any other text it still terminates
// without fault, but the spans are then meaningless. Scanning stops at the first container
// nested deeper than `max_depth` (the root is depth 0; its members are depth 1).
JsonScan scan_json(std::string_view text, int max_depth);

// `parent` + "/" + `token` with "~" and "/" escaped as RFC 6901 asks.
std::string json_pointer_child(const std::string& parent, std::string_view token);

// 1-based line and column (in code points, so an editor agrees) of a byte offset.
struct TextPosition {
  int line = 0;
  int column = 0;
};

class LineIndex {
 public:
  explicit LineIndex(std::string_view text);
  TextPosition at(std::size_t offset) const;

 private:
  std::string_view text_;
  std::vector<std::size_t> starts_;  // offset of the first byte of each line
};

}  // namespace moejit::detail
