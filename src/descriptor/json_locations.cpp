#include "descriptor/json_locations.hpp"

#include <algorithm>
#include <cstdint>
#include <unordered_set>

namespace moejit::detail {
namespace {

bool has_bom(std::string_view text) { return text.substr(0, 3) == "\xEF\xBB\xBF"; }

bool is_space(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r'; }

// Ends a bare scalar (number, true, false, null).
bool ends_scalar(char c) {
  return is_space(c) || c == ',' || c == ':' || c == '[' || c == ']' || c == '{' || c == '}' ||
         c == '"';
}

int hex_digit(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

// Four hex digits at text[pos..pos+4), or -1.
long hex4(std::string_view text, std::size_t pos) {
  if (pos + 4 > text.size()) return -1;
  long value = 0;
  for (std::size_t i = 0; i < 4; ++i) {
    int d = hex_digit(text[pos + i]);
    if (d < 0) return -1;
    value = value * 16 + d;
  }
  return value;
}

void append_utf8(std::string& out, uint32_t cp) {
  if (cp < 0x80) {
    out += static_cast<char>(cp);
  } else if (cp < 0x800) {
    out += static_cast<char>(0xC0 | (cp >> 6));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    out += static_cast<char>(0xE0 | (cp >> 12));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else {
    out += static_cast<char>(0xF0 | (cp >> 18));
    out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  }
}

// Decode the string literal whose opening quote is at `pos`, as nlohmann does, so keys compare
// equal to the keys of the parsed object. Returns one past the closing quote.
std::size_t read_string(std::string_view text, std::size_t pos, std::string* decoded) {
  ++pos;
  while (pos < text.size()) {
    char c = text[pos];
    if (c == '"') return pos + 1;
    if (c != '\\') {
      if (decoded != nullptr) *decoded += c;
      ++pos;
      continue;
    }
    if (pos + 1 >= text.size()) return text.size();
    char e = text[pos + 1];
    pos += 2;
    if (decoded == nullptr) continue;
    switch (e) {
      case 'b': *decoded += '\b'; break;
      case 'f': *decoded += '\f'; break;
      case 'n': *decoded += '\n'; break;
      case 'r': *decoded += '\r'; break;
      case 't': *decoded += '\t'; break;
      case 'u': {
        long cp = hex4(text, pos);
        if (cp < 0) break;
        pos += 4;
        // A high surrogate followed by an escaped low one is one code point.
        if (cp >= 0xD800 && cp <= 0xDBFF && pos + 1 < text.size() && text[pos] == '\\' &&
            text[pos + 1] == 'u') {
          long low = hex4(text, pos + 2);
          if (low >= 0xDC00 && low <= 0xDFFF) {
            cp = 0x10000 + ((cp - 0xD800) << 10) + (low - 0xDC00);
            pos += 6;
          }
        }
        append_utf8(*decoded, static_cast<uint32_t>(cp));
        break;
      }
      default: *decoded += e; break;  // \" \\ \/
    }
  }
  return text.size();
}

struct Frame {
  bool object = false;
  bool expect_key = false;  // object: the next string is a key
  std::string pointer;      // of the container
  std::size_t index = 0;    // array: index of the next element
  std::string member;       // object: pointer of the member whose value comes next
  std::unordered_set<std::string> keys;
};

}  // namespace

std::string json_pointer_child(const std::string& parent, std::string_view token) {
  std::string out = parent;
  out += '/';
  for (char c : token) {
    if (c == '~') {
      out += "~0";
    } else if (c == '/') {
      out += "~1";
    } else {
      out += c;
    }
  }
  return out;
}

JsonScan scan_json(std::string_view text, int max_depth) {
  JsonScan scan;
  std::vector<Frame> stack;
  bool root_done = false;
  std::size_t pos = has_bom(text) ? 3 : 0;
  const std::size_t n = text.size();

  while (pos < n && !root_done) {
    char c = text[pos];
    if (is_space(c) || c == ':') {
      ++pos;
      continue;
    }
    if (c == '}' || c == ']') {
      if (!stack.empty()) stack.pop_back();
      root_done = stack.empty();
      ++pos;
      continue;
    }
    if (c == ',') {
      if (!stack.empty()) {
        Frame& top = stack.back();
        if (top.object) {
          top.expect_key = true;
        } else {
          ++top.index;
        }
      }
      ++pos;
      continue;
    }
    if (!stack.empty() && stack.back().object && stack.back().expect_key) {
      Frame& top = stack.back();
      std::string key;
      std::size_t key_begin = pos;
      pos = c == '"' ? read_string(text, pos, &key) : pos + 1;
      top.expect_key = false;
      top.member = json_pointer_child(top.pointer, key);
      if (!top.keys.insert(key).second) {
        if (!scan.duplicate) {
          scan.duplicate = DuplicateKey{top.member, scan.spans[top.member].key, key_begin};
        }
      }
      scan.spans[top.member] = ValueSpan{kNoOffset, kNoOffset, key_begin};
      continue;
    }

    // A value starts here.
    std::string pointer;
    if (!stack.empty()) {
      Frame& top = stack.back();
      pointer =
          top.object ? top.member : json_pointer_child(top.pointer, std::to_string(top.index));
    }
    ValueSpan& span = scan.spans[pointer];
    span.begin = pos;
    if (c == '{' || c == '[') {
      if (static_cast<int>(stack.size()) > max_depth) {
        scan.too_deep = pos;
        return scan;
      }
      Frame frame;
      frame.object = c == '{';
      frame.expect_key = frame.object;
      frame.pointer = std::move(pointer);
      stack.push_back(std::move(frame));
      ++pos;
      continue;
    }
    if (c == '"') {
      pos = read_string(text, pos, nullptr);
    } else {
      ++pos;
      while (pos < n && !ends_scalar(text[pos])) ++pos;
    }
    span.end = pos;
    root_done = stack.empty();
  }
  return scan;
}

LineIndex::LineIndex(std::string_view text) : text_(text) {
  starts_.push_back(0);
  for (std::size_t i = 0; i < text.size(); ++i) {
    if (text[i] == '\n') starts_.push_back(i + 1);
  }
}

TextPosition LineIndex::at(std::size_t offset) const {
  offset = std::min(offset, text_.size());
  auto it = std::upper_bound(starts_.begin(), starts_.end(), offset);
  std::size_t line = static_cast<std::size_t>(it - starts_.begin());  // >= 1: starts_[0] = 0
  std::size_t begin = starts_[line - 1];
  if (line == 1 && has_bom(text_)) begin = std::min<std::size_t>(3, offset);
  int column = 1;
  for (std::size_t i = begin; i < offset; ++i) {
    // Why: count code points, not bytes, so a name with accents doesn't shift the column.
    if ((static_cast<unsigned char>(text_[i]) & 0xC0) != 0x80) ++column;
  }
  return TextPosition{static_cast<int>(line), column};
}

}  // namespace moejit::detail
