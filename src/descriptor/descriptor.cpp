// Shape files: JSON text -> validated ModelShapes, or one DescriptorError that says where
// (file, line, column, JSON pointer) and which rule. Nothing is returned unless every shape of
// the file is valid.
#include "descriptor/descriptor.hpp"

#include <algorithm>
#include <cerrno>
#include <cfloat>
#include <climits>
#include <cctype>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>

#include "descriptor/json_locations.hpp"
#include "moejit/error.hpp"

namespace moejit {
namespace detail {
namespace {

using Json = nlohmann::json;

template <class T>
struct EnumName {
  const char* name;
  T value;
};

const std::vector<EnumName<ActivationKind>> kActivationKinds = {
    {"swiglu", ActivationKind::kSwiGLU},
    {"clamped_swiglu", ActivationKind::kClampedSwiGLU},
    {"gpt_oss", ActivationKind::kGptOss},
    {"situ", ActivationKind::kSiTU}};
const std::vector<EnumName<SharedGate>> kGates = {
    {"sigmoid", SharedGate::kSigmoid}, {"constant", SharedGate::kConstant},
    {"given", SharedGate::kGiven}};
const std::vector<EnumName<DType>> kLogitDTypes = {
    {"bf16", DType::kBF16}, {"fp16", DType::kF16}, {"fp32", DType::kF32}};
const std::vector<EnumName<DType>> kActivationDTypes = {{"bf16", DType::kBF16}};
const std::vector<EnumName<DType>> kIdDTypes = {{"int32", DType::kI32}, {"int64", DType::kI64}};
const std::vector<EnumName<WeightFormat>> kWeightFormats = {{"mxfp4", WeightFormat::kMXFP4}};

// The constants each activation kind takes, in activation_fields() order.
std::vector<std::string> activation_constants(ActivationKind kind) {
  switch (kind) {
    case ActivationKind::kSwiGLU: return {};
    case ActivationKind::kClampedSwiGLU: return {"limit"};
    case ActivationKind::kGptOss: return {"limit", "alpha"};
    case ActivationKind::kSiTU: return {"beta", "linear_beta"};
  }
  return {};
}

std::string join(const std::vector<std::string>& items, const char* last_sep = ", ") {
  std::string out;
  for (std::size_t i = 0; i < items.size(); ++i) {
    if (i > 0) out += i + 1 == items.size() ? last_sep : ", ";
    out += items[i];
  }
  return out;
}

// Why printable: a key or value from the file may be long or hold control characters.
std::string in_quotes(const std::string& s) { return "\"" + printable(s, 60) + "\""; }

template <class T>
std::string enum_choices(const std::vector<EnumName<T>>& names) {
  std::vector<std::string> items;
  for (const auto& n : names) items.push_back(in_quotes(n.name));
  return items.size() == 1 ? items[0] : "one of " + join(items);
}

std::size_t edit_distance(const std::string& a, const std::string& b) {
  std::vector<std::size_t> row(b.size() + 1);
  for (std::size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (std::size_t i = 1; i <= a.size(); ++i) {
    std::size_t diagonal = row[0];
    row[0] = i;
    for (std::size_t j = 1; j <= b.size(); ++j) {
      std::size_t above = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diagonal + (a[i - 1] == b[j - 1] ? 0 : 1)});
      diagonal = above;
    }
  }
  return row[b.size()];
}

// The longest unknown key matched against the accepted ones for a "did you mean" hint: the edit
// distance costs its length times theirs, and a key this long is no typo of a field name.
constexpr std::size_t kMaxHintedKey = 64;

class ShapeFileParser {
 public:
  ShapeFileParser(const std::string& text, const std::string& file)
      : text_(text), file_(file), lines_(text) {}

  std::vector<LocatedShape> parse() {
    scan_ = scan_json(text_, kMaxJsonDepth, kMaxJsonValues);
    // Why before the parser: it takes a NUL byte for the end of the input, so whatever followed
    // one after the root value would be dropped without a word (JSON text has none, not even in
    // a string).
    if (const std::size_t nul = text_.find('\0'); nul != std::string::npos) {
      fail_at(nul, "", "the file holds a NUL byte, which JSON text never does",
              "valid JSON (RFC 8259) text", "a NUL byte");
    }
    // Why: a file whose scan stopped (too deep, too many values) is refused for that unless the
    // JSON reader finds an error first, which accept() learns without building the tree
    // (millions of nested arrays in a file under the size cap made a tree of hundreds of MB).
    if ((scan_.too_deep || scan_.too_many) && Json::accept(text_)) fail_if_scan_stopped();
    Json root;
    try {
      root = Json::parse(text_);
    } catch (const Json::parse_error& e) {
      std::string reason = parser_reason(e);
      std::size_t offset = e.byte > 0 ? e.byte - 1 : 0;
      // Why: nlohmann places an unexpected token at its last character; point at its first.
      if (reason.find("unexpected ") != std::string::npos &&
          reason.find("last read") == std::string::npos) {
        offset = token_start(offset);
      }
      bool bad_word = reason.find("invalid literal") != std::string::npos ||
                      reason.find("invalid number") != std::string::npos;
      if (bad_word && offset <= text_.size()) {
        // Why: the lexer stops one past a word broken partway ("tru}" at the brace); show the word
        // from its start. A word whose first character is already wrong ("NaN", "//", anything
        // after the root value) stops on that character: stepping back would name the one before
        // it, on the line before where the word starts a line.
        if (offset > 0 && is_bare(text_[offset - 1])) --offset;
        offset = token_start(offset);
        reason.erase(std::min(reason.find("; last read: "), reason.size()),
                     std::min(reason.find("; expected "), reason.size()) -
                         std::min(reason.find("; last read: "), reason.size()));
      }
      // nlohmann says "<what>[; last read: '<text>'][; expected <what>]"; keep our layout.
      std::string expected = "valid JSON (RFC 8259: no comments, no trailing commas)";
      std::string found = token_text(offset);
      if (std::size_t at = reason.find("; expected "); at != std::string::npos) {
        expected = reason.substr(at + 11);
        reason.erase(at);
      }
      if (std::size_t at = reason.find("; last read: "); at != std::string::npos) {
        found = reason.substr(at + 13);
        reason.erase(at);
      }
      fail_at(offset, "", "the file is not valid JSON: " + reason, expected, found);
    } catch (const Json::out_of_range& e) {
      // Why the depth first: a number that overflows inside nesting too deep is reported at the
      // nesting, the rule the file breaks first (its scan stopped there).
      fail_if_scan_stopped();
      fail_overflow(e);
    }
    fail_if_scan_stopped();
    if (scan_.duplicate) {
      const DuplicateKey& d = *scan_.duplicate;
      TextPosition first = lines_.at(d.first);
      std::string key = printable(d.pointer.substr(d.pointer.rfind('/') + 1), 60);
      fail_at(d.second, d.pointer, "key \"" + key + "\" appears twice in one object",
              "each key once (JSON readers disagree on which copy wins)",
              "a second \"" + key + "\" (the first is at line " + std::to_string(first.line) +
                  ", column " + std::to_string(first.column) + ")");
    }
    return read_file(root);
  }

 private:
  // --- where, and how to say it -----------------------------------------------------------

  static std::string parser_reason(const Json::parse_error& e) {
    // Why: nlohmann's text starts "[json.exception.parse_error.101] parse error at line 3,
    // column 5: "; our own prefix already says where.
    std::string what = e.what();
    std::size_t at = what.find("column ");
    if (at != std::string::npos) at = what.find(": ", at);
    return at == std::string::npos ? what : what.substr(at + 2);
  }

  // A character of a bare word: a literal or a number.
  static bool is_bare(char c) {
    return std::isalnum(static_cast<unsigned char>(c)) || c == '.' || c == '+' || c == '-';
  }

  // The first byte of the JSON token whose last byte is at `offset`.
  std::size_t token_start(std::size_t offset) const {
    if (offset >= text_.size()) return offset;
    if (text_[offset] == '"') {
      // Back to the opening quote: the first quote before it not escaped by a backslash.
      for (std::size_t i = offset; i-- > 0;) {
        if (text_[i] != '"') continue;
        std::size_t slashes = 0;
        while (slashes < i && text_[i - 1 - slashes] == '\\') ++slashes;
        if (slashes % 2 == 0) return i;
      }
      return offset;
    }
    while (offset > 0 && is_bare(text_[offset]) && is_bare(text_[offset - 1])) --offset;
    return offset;
  }

  // The token at `offset`, shortened, for a syntax error.
  std::string token_text(std::size_t offset) const {
    if (offset >= text_.size()) return "the end of the file";
    std::size_t end = offset + 1;
    if (text_[offset] == '"') {
      while (end < text_.size() && text_[end] != '"' && text_[end] != '\n') {
        end += text_[end] == '\\' ? 2 : 1;
      }
      end = std::min(end + 1, text_.size());
    } else if (std::isalnum(static_cast<unsigned char>(text_[offset])) || text_[offset] == '-') {
      while (end < text_.size() && (std::isalnum(static_cast<unsigned char>(text_[end])) ||
                                    std::strchr(".+-", text_[end]) != nullptr)) {
        ++end;
      }
    }
    // A character of more than one UTF-8 byte (a typographic quote pasted from a document) is
    // shown whole, not as its first byte.
    while (end < text_.size() && (static_cast<unsigned char>(text_[end]) & 0xC0) == 0x80) ++end;
    constexpr std::size_t kMax = 40;
    return "'" + printable(std::string_view(text_).substr(offset, end - offset), kMax) + "'";
  }

  // The scan stops at the first value too deep or past kMaxJsonValues: its places past there are
  // unknown, so no other rule may be checked.
  void fail_if_scan_stopped() const {
    if (scan_.too_deep) {
      fail_at(*scan_.too_deep, "", "the JSON nests too deeply for a shape file",
              "at most " + std::to_string(kMaxJsonDepth) + " levels", "deeper nesting");
    }
    if (scan_.too_many) {
      fail_at(*scan_.too_many, "", "the file holds more JSON values than a shape file needs",
              "at most " + std::to_string(kMaxJsonValues) + " values", "more");
    }
  }

  // nlohmann refuses a number that overflows a double (out_of_range 406) without a place; the
  // message names the token, so find its first occurrence as a value.
  [[noreturn]] void fail_overflow(const Json::out_of_range& e) const {
    std::string what = e.what();
    std::size_t open = what.find("parsing '");
    std::size_t close = what.rfind('\'');
    std::string number = open != std::string::npos && close > open + 9
                             ? what.substr(open + 9, close - open - 9)
                             : std::string();
    const std::optional<std::pair<std::string, ValueSpan>> first =
        number.empty() ? std::nullopt : scan_.first_scalar(number);
    // Why shortened: the number is as long as the file wrote it (a file of nines overflows too).
    const std::string found = printable(number, 60);
    if (!first) {
      fail_at(0, "", "a number overflows a double", "finite numbers", found);
    }
    const std::string& pointer = first->first;
    std::string key = pointer.substr(pointer.rfind('/') + 1);
    if (key.empty() || key.find_first_not_of("0123456789") == std::string::npos) key = "the number";
    fail_at(first->second.begin, pointer, key + " is not finite (it overflows to infinity)",
            "a finite number", found);
  }

  [[noreturn]] void fail_at(std::size_t offset, const std::string& pointer,
                            const std::string& what, const std::string& expected,
                            const std::string& found, const std::string& hint = {}) const {
    TextPosition p = lines_.at(offset);
    throw DescriptorError(
        descriptor_message(file_, p.line, p.column, pointer, what, expected, found, hint), file_,
        p.line, p.column, pointer);
  }

  // Where `pointer` starts (its key when `at_key`); a value that isn't in the text (a default)
  // is placed at its nearest enclosing value.
  std::size_t offset_of(std::string pointer, bool at_key) const {
    while (true) {
      if (const ValueSpan* s = scan_.find(pointer)) {
        if (at_key && s->key != kNoOffset) return s->key;
        if (s->begin != kNoOffset) return s->begin;
      }
      if (pointer.empty()) return 0;
      pointer.erase(pointer.rfind('/'));
      at_key = false;
    }
  }

  [[noreturn]] void fail(const std::string& pointer, const std::string& what,
                         const std::string& expected, const std::string& found,
                         const std::string& hint = {}, bool at_key = false) const {
    fail_at(offset_of(pointer, at_key), pointer, what, expected, found, hint);
  }

  // The value as written in the file (shortened), or nothing for containers and defaults.
  std::optional<std::string> token(const std::string& pointer) const {
    const ValueSpan* span = scan_.find(pointer);
    if (span == nullptr || span->end == kNoOffset) return std::nullopt;
    std::string t = text_.substr(span->begin, span->end - span->begin);
    constexpr std::size_t kMax = 60;
    if (t.size() > kMax) {
      std::size_t cut = kMax;
      while (cut > 0 && (static_cast<unsigned char>(t[cut]) & 0xC0) == 0x80) --cut;
      t = t.substr(0, cut) + "...";
    }
    return t;
  }

  std::string describe(const Json& v, const std::string& pointer) const {
    std::string t = token(pointer).value_or(std::string());
    switch (v.type()) {
      case Json::value_t::object: return "an object";
      case Json::value_t::array: return "an array";
      case Json::value_t::string: return t + " (a string)";
      case Json::value_t::boolean: return t + " (a boolean)";
      case Json::value_t::null: return "null";
      case Json::value_t::number_float:
        // Integer digits too many for 64 bits are read as a double.
        return t + (t.find_first_of(".eE") == std::string::npos ? " (too large for an integer)"
                                                                 : " (a number with a fraction "
                                                                   "or exponent)");
      default: return t;
    }
  }

  // Keys of `obj` in the order the file writes them.
  // Why from the scan's list and not a lookup per key: a lookup walks the object's keys, so an
  // object of many keys would take quadratic time.
  std::vector<std::string> keys_in_order(const Json& obj, const std::string& pointer) const {
    std::vector<std::string> keys;
    for (std::string& key : scan_.keys(pointer)) {
      if (obj.contains(key)) keys.push_back(std::move(key));
    }
    // Only a scan that disagrees with the parse leaves keys out; they go last.
    if (keys.size() != obj.size()) {
      for (const auto& item : obj.items()) {
        if (std::find(keys.begin(), keys.end(), item.key()) == keys.end()) {
          keys.push_back(item.key());
        }
      }
    }
    return keys;
  }

  std::string present_fields(const Json& obj, const std::string& pointer) const {
    std::vector<std::string> keys = keys_in_order(obj, pointer);
    for (std::string& key : keys) key = printable(key, 60);
    return keys.empty() ? "an empty object" : "fields " + join(keys);
  }

  void check_fields(const Json& obj, const std::string& pointer,
                    const std::vector<std::string>& accepted, const std::string& object_name,
                    const std::vector<std::string>& misplaced = {},
                    const std::string& misplaced_hint = {}) const {
    for (const std::string& key : keys_in_order(obj, pointer)) {
      if (std::find(accepted.begin(), accepted.end(), key) != accepted.end()) continue;
      std::string hint;
      if (std::find(misplaced.begin(), misplaced.end(), key) != misplaced.end()) {
        hint = misplaced_hint;
      } else if (key.size() <= kMaxHintedKey) {
        std::size_t best = 3;
        for (const std::string& a : accepted) {
          std::size_t d = edit_distance(key, a);
          if (d < best && d < std::max<std::size_t>(a.size(), 2) / 2 + 1) {
            best = d;
            hint = "did you mean \"" + a + "\"?";
          }
        }
      }
      fail(json_pointer_child(pointer, key), "unknown field " + in_quotes(key) + " in " + object_name,
           "one of " + join(accepted), in_quotes(key), hint, true);
    }
  }

  // --- typed reads ------------------------------------------------------------------------

  const Json* member(const Json& obj, const char* key) const {
    auto it = obj.find(key);
    return it == obj.end() ? nullptr : &*it;
  }

  [[noreturn]] void missing(const Json& obj, const std::string& pointer, const std::string& key,
               const std::string& expected) const {
    fail(pointer, "missing required field \"" + key + "\"", expected,
         present_fields(obj, pointer));
  }

  void expect_object(const Json& v, const std::string& pointer, const std::string& what) const {
    if (!v.is_object()) {
      fail(pointer, what + " is not an object", "an object", describe(v, pointer));
    }
  }

  // An integer field. The range is checked with the shape rules; here only that the value is
  // an integer literal that fits an int (lo..hi only words the expectation).
  std::optional<int> read_int(const Json& obj, const std::string& obj_ptr, const char* key,
                              long long lo, long long hi) const {
    const Json* v = member(obj, key);
    if (v == nullptr) return std::nullopt;
    std::string pointer = json_pointer_child(obj_ptr, key);
    std::string expected = "an integer in " + std::to_string(lo) + ".." + std::to_string(hi);
    if (!v->is_number_integer()) {
      fail(pointer, std::string(key) + " must be an integer", expected, describe(*v, pointer));
    }
    bool fits = v->is_number_unsigned() ? v->get<unsigned long long>() <= INT_MAX
                                        : v->get<long long>() >= INT_MIN &&
                                              v->get<long long>() <= INT_MAX;
    if (!fits) {
      fail(pointer, std::string(key) + " is out of range", expected, token(pointer).value_or("?"),
           "a size this large is almost certainly a typo");
    }
    return static_cast<int>(v->get<long long>());
  }

  std::optional<float> read_float(const Json& obj, const std::string& obj_ptr,
                                  const char* key) const {
    const Json* v = member(obj, key);
    if (v == nullptr) return std::nullopt;
    std::string pointer = json_pointer_child(obj_ptr, key);
    const std::string expected = "a finite number > 0";
    if (!v->is_number()) {
      fail(pointer, std::string(key) + " must be a number", expected, describe(*v, pointer));
    }
    double d = v->get<double>();
    if (!std::isfinite(d)) {
      fail(pointer, std::string(key) + " is not finite (the number overflows to infinity)",
           expected, token(pointer).value_or("?"));
    }
    if (std::fabs(d) > FLT_MAX) {
      fail(pointer, std::string(key) + " does not fit a 32-bit float", expected + " up to 3.4e38",
           token(pointer).value_or("?"));
    }
    if (d != 0 && std::fabs(d) < FLT_MIN) {
      fail(pointer, std::string(key) + " is too small for a 32-bit float (it would round to 0)",
           expected + " of at least 1.2e-38", token(pointer).value_or("?"));
    }
    return static_cast<float>(d);
  }

  std::optional<bool> read_bool(const Json& obj, const std::string& obj_ptr,
                                const char* key) const {
    const Json* v = member(obj, key);
    if (v == nullptr) return std::nullopt;
    std::string pointer = json_pointer_child(obj_ptr, key);
    if (!v->is_boolean()) {
      fail(pointer, std::string(key) + " must be a boolean", "true or false",
           describe(*v, pointer));
    }
    return v->get<bool>();
  }

  std::optional<std::string> read_string(const Json& obj, const std::string& obj_ptr,
                                         const char* key, const std::string& expected) const {
    const Json* v = member(obj, key);
    if (v == nullptr) return std::nullopt;
    std::string pointer = json_pointer_child(obj_ptr, key);
    if (!v->is_string()) {
      fail(pointer, std::string(key) + " must be a string", expected, describe(*v, pointer));
    }
    return v->get<std::string>();
  }

  template <class T>
  std::optional<T> read_enum(const Json& obj, const std::string& obj_ptr, const char* key,
                             const std::vector<EnumName<T>>& names) const {
    std::string expected = enum_choices(names);
    std::optional<std::string> text = read_string(obj, obj_ptr, key, expected);
    if (!text) return std::nullopt;
    for (const auto& n : names) {
      if (*text == n.name) return n.value;
    }
    std::string hint;
    for (const auto& n : names) {
      std::string lower = *text;
      std::transform(lower.begin(), lower.end(), lower.begin(),
                     [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
      if (lower == n.name) hint = std::string("names are lower case: \"") + n.name + "\"";
    }
    std::string pointer = json_pointer_child(obj_ptr, key);
    fail(pointer, std::string(key) + " is not a known value", expected, in_quotes(*text), hint);
  }

  // --- the file ---------------------------------------------------------------------------

  std::vector<LocatedShape> read_file(const Json& root) {
    std::vector<std::pair<const Json*, std::string>> objects;  // shape value, its pointer
    const std::string layouts =
        "{\"shapes\": [ shape, ... ]}, one shape object, or an array of shape objects";
    if (root.is_object() && (root.contains("shapes") || root.contains("$schema"))) {
      check_fields(root, "", file_fields(), "a shape file", shape_fields(),
                   "shape fields go inside \"shapes\": [ { ... } ]");
      read_string(root, "", "$schema", "a string (the schema's URI or path)");
      const Json* shapes = member(root, "shapes");
      if (shapes == nullptr) missing(root, "", "shapes", "a file with \"shapes\": [ ... ]");
      collect(*shapes, "/shapes", &objects);
    } else if (root.is_array()) {
      collect(root, "", &objects);
    } else if (root.is_object()) {
      objects.emplace_back(&root, "");
    } else {
      fail("", "the file holds no shapes", layouts, describe(root, ""));
    }

    std::vector<LocatedShape> shapes;
    std::map<std::string, std::size_t> by_name;
    for (const auto& [value, pointer] : objects) {
      LocatedShape s = read_shape(*value, pointer);
      auto [it, inserted] = by_name.emplace(s.shape.name, shapes.size());
      if (!inserted) {
        const LocatedShape& first = shapes[it->second];
        fail(s.name_pointer, "shape name \"" + s.shape.name + "\" is used twice in this file",
             "names unique within a file", in_quotes(s.shape.name) + " again (first at line " +
                 std::to_string(first.name_line) + ", " + first.name_pointer + ")");
      }
      shapes.push_back(std::move(s));
    }
    return shapes;
  }

  void collect(const Json& array, const std::string& pointer,
               std::vector<std::pair<const Json*, std::string>>* objects) const {
    if (!array.is_array()) {
      fail(pointer, "\"shapes\" is not an array", "an array of shape objects",
           describe(array, pointer));
    }
    if (array.empty()) {
      fail(pointer, "the file lists no shapes", "at least one shape object", "an empty array");
    }
    for (std::size_t i = 0; i < array.size(); ++i) {
      objects->emplace_back(&array[i], json_pointer_child(pointer, std::to_string(i)));
    }
  }

  LocatedShape read_shape(const Json& obj, const std::string& pointer) {
    if (!obj.is_object()) {
      fail(pointer, "a shape is not an object", "a shape object", describe(obj, pointer));
    }
    check_fields(obj, pointer, shape_fields(), "a shape");
    const std::string required = "a shape with name, num_experts, top_k, hidden, intermediate "
                                 "and activation";

    LocatedShape located;
    located.pointer = pointer;
    located.name_pointer = json_pointer_child(pointer, "name");
    ModelShape& s = located.shape;
    auto req_int = [&](const char* key, long long lo, long long hi) {
      std::optional<int> v = read_int(obj, pointer, key, lo, hi);
      if (!v) missing(obj, pointer, key, required);
      return *v;
    };

    std::optional<std::string> name =
        read_string(obj, pointer, "name", "a string of A-Z a-z 0-9 . _ -");
    if (!name) missing(obj, pointer, "name", required);
    s.name = *name;
    s.num_experts = req_int("num_experts", 1, kMaxRoutedLocalExperts);
    s.top_k = req_int("top_k", 1, kMaxTopK);
    s.hidden = req_int("hidden", 1, kMaxDim);
    s.intermediate = req_int("intermediate", 1, kMaxDim);
    s.expert_offset = read_int(obj, pointer, "expert_offset", 0, kMaxGlobalExperts - 1).value_or(0);
    std::optional<int> global = read_int(obj, pointer, "global_experts", 1, kMaxGlobalExperts);
    // Why: without expert parallelism the routed experts are exactly the local ones.
    // (Summed wide and clamped: the ranges are checked after, by the shape rules, which name an
    // expert_offset too large for what it is.)
    s.global_experts = global
                           ? *global
                           : static_cast<int>(std::min<long long>(
                                 INT_MAX, static_cast<long long>(s.expert_offset) + s.num_experts));

    const Json* activation = member(obj, "activation");
    if (activation == nullptr) missing(obj, pointer, "activation", required);
    s.activation = read_activation(*activation, json_pointer_child(pointer, "activation"));
    s.has_bias = read_bool(obj, pointer, "has_bias").value_or(false);
    if (const Json* shared = member(obj, "shared_experts")) {
      s.shared = read_shared(*shared, json_pointer_child(pointer, "shared_experts"));
    }
    s.weight_format =
        read_enum(obj, pointer, "weight_format", kWeightFormats).value_or(WeightFormat::kMXFP4);
    s.activation_dtype =
        read_enum(obj, pointer, "activation_dtype", kActivationDTypes).value_or(DType::kBF16);
    s.id_dtype = read_enum(obj, pointer, "id_dtype", kIdDTypes).value_or(DType::kI32);
    s.max_tokens =
        read_int(obj, pointer, "max_tokens", 1, kMaxTokensLimit).value_or(kDefaultMaxTokens);

    if (auto v = find_shape_violation(s)) {
      std::string field = pointer + v->field;
      std::string found = v->found;
      if (v->found_is_value) {
        if (auto t = token(field)) found = *t;
      }
      if (v->field == "/global_experts" && !global) {
        v->hint = "global_experts defaults to expert_offset + num_experts = " +
                  std::to_string(s.global_experts);
      }
      fail(field, v->what, v->expected, found, v->hint);
    }

    TextPosition at = lines_.at(offset_of(pointer, false));
    s.source = file_ + ":" + std::to_string(at.line);
    TextPosition name_at = lines_.at(offset_of(located.name_pointer, false));
    located.name_line = name_at.line;
    located.name_column = name_at.column;
    return located;
  }

  Activation read_activation(const Json& obj, const std::string& pointer) const {
    expect_object(obj, pointer, "activation");
    check_fields(obj, pointer, activation_fields(), "an activation");
    std::optional<ActivationKind> kind = read_enum(obj, pointer, "kind", kActivationKinds);
    if (!kind) {
      missing(obj, pointer, "kind", "an activation with kind " + enum_choices(kActivationKinds));
    }
    Activation a;
    a.kind = *kind;
    std::vector<std::string> taken = activation_constants(a.kind);
    std::vector<std::string> wanted = {"kind"};
    wanted.insert(wanted.end(), taken.begin(), taken.end());
    const std::string kind_text = in_quotes(activation_kind_name(a.kind));
    for (const std::string& key : keys_in_order(obj, pointer)) {
      if (std::find(wanted.begin(), wanted.end(), key) != wanted.end()) continue;
      std::string hint;
      if (key == "limit") hint = "a clamp needs kind \"clamped_swiglu\" or \"gpt_oss\"";
      fail(json_pointer_child(pointer, key),
           "activation " + kind_text + " takes no constant " + in_quotes(key),
           "only " + join(wanted, " and "), in_quotes(key), hint, true);
    }
    for (const std::string& key : taken) {
      if (member(obj, key.c_str()) == nullptr) {
        fail(pointer, "activation " + kind_text + " needs constant \"" + key + "\"",
             join(wanted, " and "), present_fields(obj, pointer));
      }
    }
    a.limit = read_float(obj, pointer, "limit").value_or(0.f);
    a.alpha = read_float(obj, pointer, "alpha").value_or(0.f);
    a.beta = read_float(obj, pointer, "beta").value_or(0.f);
    a.linear_beta = read_float(obj, pointer, "linear_beta").value_or(0.f);
    return a;
  }

  SharedExperts read_shared(const Json& obj, const std::string& pointer) const {
    expect_object(obj, pointer, "shared_experts");
    check_fields(obj, pointer, shared_experts_fields(), "shared_experts");
    SharedExperts s;
    std::optional<int> count = read_int(obj, pointer, "count", 0, kMaxSharedExperts);
    if (!count) missing(obj, pointer, "count", "shared_experts with a count");
    s.count = *count;
    // Why: an out-of-range count is reported as such by the shape rules, not as a missing
    // intermediate or a field without effect.
    if (s.count < 0 || s.count > kMaxSharedExperts) return s;
    if (s.count == 0) {
      for (const std::string& key : keys_in_order(obj, pointer)) {
        if (key == "count") continue;
        fail(json_pointer_child(pointer, key),
             "shared_experts." + printable(key, 60) + " has no effect when count is 0",
             "only count", in_quotes(key), "set count, or remove " + printable(key, 60), true);
      }
      return s;
    }
    std::optional<int> intermediate = read_int(obj, pointer, "intermediate", 1, kMaxDim);
    if (!intermediate) {
      missing(obj, pointer, "intermediate", "shared_experts with count > 0 and an intermediate");
    }
    s.intermediate = *intermediate;
    s.gate = read_enum(obj, pointer, "gate", kGates).value_or(SharedGate::kConstant);
    const std::string gate_text = in_quotes(shared_gate_name(s.gate));
    if (s.gate != SharedGate::kSigmoid && member(obj, "logit_dtype") != nullptr) {
      fail(
          json_pointer_child(pointer, "logit_dtype"),
          "logit_dtype has no effect with gate " + gate_text + ": only a sigmoid gate reads logits",
          "no logit_dtype, or gate \"sigmoid\"", in_quotes("logit_dtype"), {}, true);
    }
    if (s.gate == SharedGate::kGiven && member(obj, "scale") != nullptr) {
      fail(json_pointer_child(pointer, "scale"),
           "scale has no effect with gate \"given\": the given weights are copied as they are",
           "no scale, or gate \"sigmoid\" or \"constant\"", in_quotes("scale"), {}, true);
    }
    s.logit_dtype = read_enum(obj, pointer, "logit_dtype", kLogitDTypes).value_or(DType::kBF16);
    s.scale = read_float(obj, pointer, "scale").value_or(1.f);
    return s;
  }

  const std::string& text_;
  const std::string& file_;
  LineIndex lines_;
  JsonScan scan_;
};

}  // namespace

const std::vector<std::string>& file_fields() {
  static const std::vector<std::string> fields = {"$schema", "shapes"};
  return fields;
}

const std::vector<std::string>& shape_fields() {
  static const std::vector<std::string> fields = {
      "name",       "num_experts",    "top_k",         "hidden",
      "intermediate", "expert_offset", "global_experts", "activation",
      "has_bias",   "shared_experts", "weight_format", "activation_dtype",
      "id_dtype",   "max_tokens"};
  return fields;
}

const std::vector<std::string>& activation_fields() {
  static const std::vector<std::string> fields = {"kind", "limit", "alpha", "beta",
                                                  "linear_beta"};
  return fields;
}

const std::vector<std::string>& shared_experts_fields() {
  static const std::vector<std::string> fields = {"count", "intermediate", "gate", "logit_dtype",
                                                  "scale"};
  return fields;
}

std::vector<LocatedShape> parse_shapes_located(const std::string& text,
                                               const std::string& source_name) {
  try {
    return ShapeFileParser(text, source_name).parse();
  } catch (const Json::exception& e) {
    // Why: every access above is type-checked first; reaching this is a bug, not bad input.
    throw Error(ErrorCode::kInternal,
                source_name + ": unexpected JSON error while reading shapes: " + e.what());
  }
}

std::string read_shapes_text(const std::string& path) {
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec)) {
    throw Error(ErrorCode::kIo, "cannot read shape file \"" + path +
                                    "\": it is a directory; expected a JSON file");
  }
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    throw Error(ErrorCode::kIo, "cannot read shape file \"" + path + "\": " +
                                    std::strerror(errno));
  }
  // Why a cap and a chunked read: a path such as /dev/zero or a mistaken multi-GB file would
  // otherwise be read until memory runs out.
  std::string text;
  char chunk[64 * 1024];
  while (in.read(chunk, sizeof(chunk)) || in.gcount() > 0) {
    text.append(chunk, static_cast<std::size_t>(in.gcount()));
    if (text.size() > static_cast<std::size_t>(kMaxShapeFileBytes)) {
      throw Error(ErrorCode::kIo, "cannot read shape file \"" + path + "\": larger than " +
                                      std::to_string(kMaxShapeFileBytes >> 20) +
                                      " MiB (a shape is a few hundred bytes); is it a shape file?");
    }
  }
  if (in.bad()) {
    throw Error(ErrorCode::kIo, "cannot read shape file \"" + path + "\": read failed");
  }
  return text;
}

}  // namespace detail

std::vector<ModelShape> parse_shapes(const std::string& text, const std::string& source_name) {
  std::vector<ModelShape> shapes;
  for (auto& located : detail::parse_shapes_located(text, source_name)) {
    shapes.push_back(std::move(located.shape));
  }
  return shapes;
}

std::vector<ModelShape> load_shapes_file(const std::string& path) {
  return parse_shapes(detail::read_shapes_text(path), path);
}

}  // namespace moejit
