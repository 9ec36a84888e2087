// Where each value of a JSON text starts: nlohmann::json keeps no positions, so shape-file
// messages get their line and column from this small scanner, which also finds duplicate keys
// (nlohmann keeps the last one silently).
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
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

// The values of a scanned text as a tree, in text order. Why a tree and not a map from each
// value's JSON pointer: a pointer repeats its parent's, so a long key over a large array made
// the map quadratic in the text (a 300 KB file took 6 GB); the tree is linear in it.
// The scan keeps a view of the text: the text must outlive it.
class JsonScan {
 public:
  // The span of the value at `pointer` (RFC 6901, "" for the root), or null when the text has
  // none. An object member is found by a walk over its object's keys.
  const ValueSpan* find(std::string_view pointer) const;
  // The keys of the object at `pointer`, decoded, in the order the text writes them; empty when
  // it is not an object.
  std::vector<std::string> keys(std::string_view pointer) const;
  // The pointer and span of the first scalar (in text order) written exactly as `token`, else of
  // the first written as `token` and then a character no number holds ("1e400x").
  std::optional<std::pair<std::string, ValueSpan>> first_scalar(std::string_view token) const;

  std::optional<DuplicateKey> duplicate;  // the first key repeated in its object
  std::optional<std::size_t> too_deep;    // where nesting first exceeded max_depth
  std::optional<std::size_t> too_many;    // where the value past max_values starts

 private:
  friend JsonScan scan_json(std::string_view text, int max_depth, std::size_t max_values);
  static constexpr std::uint32_t kNone = static_cast<std::uint32_t>(-1);
  struct Node {
    ValueSpan span;
    std::uint32_t parent = kNone;
    std::uint32_t children = kNone;  // containers: their index in children_
    bool object = false;
  };
  std::optional<std::uint32_t> node_at(std::string_view pointer) const;
  std::string key_of(const Node& node) const;
  std::string pointer_of(std::uint32_t node) const;

  std::string_view text_;
  std::vector<Node> nodes_;                           // nodes_[0] is the root
  std::vector<std::vector<std::uint32_t>> children_;  // each container's values, in order
};

// Scan `text`. Meant for text nlohmann::json accepted; on any other text it still terminates
// without fault, but the spans are then meaningless. Scanning stops at the first container
// nested deeper than `max_depth` (the root is depth 0; its members are depth 1), or at the value
// past the first `max_values`.
JsonScan scan_json(std::string_view text, int max_depth,
                   std::size_t max_values = static_cast<std::size_t>(-1));

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
  // The last answer. Why: a minified file is one line, and a parse asks for offsets that grow,
  // so counting on from the last answer keeps a file's lookups linear, not quadratic.
  mutable std::size_t last_offset_ = 0;
  mutable TextPosition last_{};
};

}  // namespace moejit::detail
