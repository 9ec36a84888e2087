#include "descriptor/json_locations.hpp"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <unordered_map>

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
  std::uint32_t node = 0;  // the container (its node says whether it is an object)
  bool expect_key = false;               // object: the next string is a key
  std::size_t key = kNoOffset;           // object: the key of the member whose value comes next
  std::unordered_map<std::string, std::size_t> keys;  // object: each key read, at its offset
};

// The RFC 6901 tokens of `pointer`, unescaped; nullopt when it is neither "" nor "/...".
std::optional<std::vector<std::string>> pointer_tokens(std::string_view pointer) {
  std::vector<std::string> tokens;
  if (pointer.empty()) return tokens;
  if (pointer[0] != '/') return std::nullopt;
  std::size_t pos = 1;
  while (true) {
    const std::size_t slash = std::min(pointer.find('/', pos), pointer.size());
    std::string token;
    for (std::size_t i = pos; i < slash; ++i) {
      if (pointer[i] == '~' && i + 1 < slash && (pointer[i + 1] == '0' || pointer[i + 1] == '1')) {
        token += pointer[i + 1] == '0' ? '~' : '/';
        ++i;
      } else {
        token += pointer[i];
      }
    }
    tokens.push_back(std::move(token));
    if (slash == pointer.size()) return tokens;
    pos = slash + 1;
  }
}

// An array index as RFC 6901 writes it (no sign, no leading zero), or nullopt.
std::optional<std::size_t> array_index(const std::string& token) {
  if (token.empty() || token.size() > 18 || (token.size() > 1 && token[0] == '0')) {
    return std::nullopt;
  }
  std::size_t value = 0;
  for (char c : token) {
    if (c < '0' || c > '9') return std::nullopt;
    value = value * 10 + static_cast<std::size_t>(c - '0');
  }
  return value;
}

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

std::string JsonScan::key_of(const Node& node) const {
  std::string key;
  if (node.span.key < text_.size() && text_[node.span.key] == '"') {
    read_string(text_, node.span.key, &key);
  }
  return key;
}

std::optional<std::uint32_t> JsonScan::node_at(std::string_view pointer) const {
  std::optional<std::vector<std::string>> tokens = pointer_tokens(pointer);
  if (!tokens || nodes_.empty()) return std::nullopt;
  std::uint32_t at = 0;
  for (const std::string& token : *tokens) {
    const Node& node = nodes_[at];
    if (node.children == kNone) return std::nullopt;
    const std::vector<std::uint32_t>& children = children_[node.children];
    if (node.object) {
      // The last member of that name, as nlohmann keeps the last of duplicate keys.
      std::uint32_t found = kNone;
      for (std::uint32_t child : children) {
        if (key_of(nodes_[child]) == token) found = child;
      }
      if (found == kNone) return std::nullopt;
      at = found;
    } else {
      std::optional<std::size_t> index = array_index(token);
      if (!index || *index >= children.size()) return std::nullopt;
      at = children[*index];
    }
  }
  return at;
}

const ValueSpan* JsonScan::find(std::string_view pointer) const {
  std::optional<std::uint32_t> at = node_at(pointer);
  return at ? &nodes_[*at].span : nullptr;
}

std::vector<std::string> JsonScan::keys(std::string_view pointer) const {
  std::vector<std::string> out;
  std::optional<std::uint32_t> at = node_at(pointer);
  if (!at || !nodes_[*at].object || nodes_[*at].children == kNone) return out;
  for (std::uint32_t child : children_[nodes_[*at].children]) out.push_back(key_of(nodes_[child]));
  return out;
}

std::string JsonScan::pointer_of(std::uint32_t node) const {
  std::vector<std::string> tokens;
  for (std::uint32_t at = node; nodes_[at].parent != kNone; at = nodes_[at].parent) {
    const Node& parent = nodes_[nodes_[at].parent];
    if (parent.object) {
      tokens.push_back(key_of(nodes_[at]));
    } else {
      const std::vector<std::uint32_t>& siblings = children_[parent.children];
      const auto it = std::find(siblings.begin(), siblings.end(), at);
      tokens.push_back(std::to_string(it - siblings.begin()));
    }
  }
  std::string pointer;
  for (auto it = tokens.rbegin(); it != tokens.rend(); ++it) {
    pointer = json_pointer_child(pointer, *it);
  }
  return pointer;
}

std::optional<std::pair<std::string, ValueSpan>> JsonScan::first_scalar(
    std::string_view token) const {
  for (std::uint32_t i = 0; i < nodes_.size(); ++i) {
    const ValueSpan& span = nodes_[i].span;
    if (span.end != kNoOffset && text_.substr(span.begin, span.end - span.begin) == token) {
      return std::make_pair(pointer_of(i), span);
    }
  }
  // Why a second pass: a bare value ends only at a JSON delimiter, so a number the parser read
  // up to a stray character ("1e400x") is a longer value here: the token, then a character no
  // number holds ("-2.5" is not the start of "-2.5e3").
  const auto in_number = [](char c) {
    return (c >= '0' && c <= '9') || (c != '\0' && std::strchr(".eE+-", c) != nullptr);
  };
  for (std::uint32_t i = 0; i < nodes_.size(); ++i) {
    const ValueSpan& span = nodes_[i].span;
    if (span.end != kNoOffset && span.end - span.begin > token.size() &&
        text_.substr(span.begin, token.size()) == token &&
        !in_number(text_[span.begin + token.size()])) {
      return std::make_pair(pointer_of(i), span);
    }
  }
  return std::nullopt;
}

JsonScan scan_json(std::string_view text, int max_depth, std::size_t max_values) {
  JsonScan scan;
  scan.text_ = text;
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
      if (!stack.empty() && scan.nodes_[stack.back().node].object) {
        stack.back().expect_key = true;
      }
      ++pos;
      continue;
    }
    if (!stack.empty() && stack.back().expect_key) {
      Frame& top = stack.back();
      std::string key;
      const std::size_t key_begin = pos;
      pos = c == '"' ? read_string(text, pos, &key) : pos + 1;
      top.expect_key = false;
      top.key = key_begin;
      auto [first, fresh] = top.keys.emplace(key, key_begin);
      if (!fresh && !scan.duplicate) {
        scan.duplicate = DuplicateKey{json_pointer_child(scan.pointer_of(top.node), key),
                                      first->second, key_begin};
      }
      continue;
    }

    // A value starts here.
    if (scan.nodes_.size() >= JsonScan::kNone) return scan;  // 4 G values: no text is that big
    if (scan.nodes_.size() >= max_values) {
      scan.too_many = pos;
      return scan;
    }
    const auto index = static_cast<std::uint32_t>(scan.nodes_.size());
    JsonScan::Node node;
    node.span.begin = pos;
    if (!stack.empty()) {
      Frame& top = stack.back();
      node.parent = top.node;
      if (scan.nodes_[top.node].object) node.span.key = top.key;
      scan.children_[scan.nodes_[top.node].children].push_back(index);
    }
    if (c == '{' || c == '[') {
      if (static_cast<int>(stack.size()) > max_depth) {
        scan.too_deep = pos;
        return scan;
      }
      node.object = c == '{';
      node.children = static_cast<std::uint32_t>(scan.children_.size());
      scan.children_.emplace_back();
      scan.nodes_.push_back(node);
      Frame frame;
      frame.node = index;
      frame.expect_key = node.object;
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
    node.span.end = pos;
    scan.nodes_.push_back(node);
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
  if (last_.line == static_cast<int>(line) && last_offset_ >= begin && last_offset_ <= offset) {
    begin = last_offset_;
    column = last_.column;
  }
  for (std::size_t i = begin; i < offset; ++i) {
    // Why: count code points, not bytes, so a name with accents doesn't shift the column.
    if ((static_cast<unsigned char>(text_[i]) & 0xC0) != 0x80) ++column;
  }
  last_offset_ = offset;
  last_ = TextPosition{static_cast<int>(line), column};
  return last_;
}

}  // namespace moejit::detail
