// Shape files: every refusal with its message (file, line, column, pointer, the rule), valid
// files to the expected values, the bundled reference shapes, and the schema in step with the
// parser.
#include <catch2/catch.hpp>

#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "descriptor/descriptor.hpp"
#include "descriptor/json_locations.hpp"
#include "moejit/error.hpp"
#include "moejit/shape.hpp"
#include "support/support.hpp"

namespace {

using moejit::DescriptorError;
using moejit::ModelShape;
using moejit::parse_shapes;

const char* const kBase = R"({
  "$schema": "./schema.json",
  "shapes": [
    {
      "name": "alpha",
      "num_experts": 64,
      "top_k": 8,
      "hidden": 2048,
      "intermediate": 768,
      "activation": {"kind": "swiglu"}
    }
  ]
})";

// `text` with the first `from` replaced by `to` (the test fails if `from` is absent).
std::string edit(const std::string& text, const std::string& from, const std::string& to) {
  std::size_t at = text.find(from);
  REQUIRE(at != std::string::npos);
  return text.substr(0, at) + to + text.substr(at + from.size());
}

std::string base_with(const std::string& from, const std::string& to) {
  return edit(kBase, from, to);
}

struct Position {
  int line = 0;
  int column = 0;
};

// 1-based line and column of the `nth` occurrence of `needle`, counted the plain way (the
// texts here are ASCII), independently of the scanner under test.
Position position_of(const std::string& text, const std::string& needle, int nth = 1) {
  std::size_t at = std::string::npos;
  for (int i = 0; i < nth; ++i) {
    at = text.find(needle, at == std::string::npos ? 0 : at + 1);
    REQUIRE(at != std::string::npos);
  }
  Position p{1, 1};
  for (std::size_t i = 0; i < at; ++i) {
    if (text[i] == '\n') {
      ++p.line;
      p.column = 1;
    } else {
      ++p.column;
    }
  }
  return p;
}

struct Refusal {
  bool refused = false;
  std::string message;
  std::string file;
  std::string pointer;
  int line = 0;
  int column = 0;
  moejit::ErrorCode code = moejit::ErrorCode::kInternal;
};

Refusal refuse(const std::string& text, const std::string& file = "model.json") {
  Refusal r;
  try {
    parse_shapes(text, file);
  } catch (const DescriptorError& e) {
    r.refused = true;
    r.message = e.what();
    r.file = e.file();
    r.pointer = e.pointer();
    r.line = e.line();
    r.column = e.column();
    r.code = e.code();
  }
  return r;
}

// The text is refused at `at` (line and column) for `pointer`, and the message names the file,
// the place, the pointer and carries every one of `words`.
void expect_refusal(const std::string& text, Position at, const std::string& pointer,
                    const std::vector<std::string>& words) {
  INFO("text:\n" << text);
  Refusal r = refuse(text);
  REQUIRE(r.refused);
  INFO("message: " << r.message);
  CHECK(r.code == moejit::ErrorCode::kInvalidDescriptor);
  CHECK(r.file == "model.json");
  CHECK(r.pointer == pointer);
  CHECK(r.line == at.line);
  CHECK(r.column == at.column);
  std::string where = "model.json:" + std::to_string(at.line) + ":" + std::to_string(at.column) +
                      ": " + (pointer.empty() ? "(root)" : pointer) + ": ";
  CHECK(r.message.rfind(where, 0) == 0);
  CHECK(r.message.find("; expected ") != std::string::npos);
  CHECK(r.message.find(", found ") != std::string::npos);
  for (const std::string& w : words) {
    INFO("word: " << w);
    CHECK(r.message.find(w) != std::string::npos);
  }
}

// Refused at the value `value` (first occurrence) that replaced `from`.
void expect_value_refusal(const std::string& from, const std::string& to,
                          const std::string& needle, const std::string& pointer,
                          const std::vector<std::string>& words) {
  std::string text = base_with(from, to);
  expect_refusal(text, position_of(text, needle), pointer, words);
}

}  // namespace

TEST_CASE("a valid file parses to the expected values", "[descriptor]") {
  std::string text = R"({"shapes": [
  {
    "name": "full.shape_1",
    "num_experts": 32,
    "top_k": 4,
    "hidden": 2880,
    "intermediate": 2880,
    "expert_offset": 32,
    "global_experts": 128,
    "activation": {"kind": "gpt_oss", "limit": 7, "alpha": 1.702},
    "has_bias": true,
    "shared_experts": {"count": 2, "intermediate": 1024, "gate": "sigmoid",
                       "logit_dtype": "fp32", "scale": 0.25},
    "weight_format": "mxfp4",
    "activation_dtype": "bf16",
    "id_dtype": "int64",
    "max_tokens": 4096
  },
  {"name": "defaults", "num_experts": 8, "top_k": 2, "hidden": 64, "intermediate": 32,
   "expert_offset": 8, "activation": {"kind": "situ", "beta": 4, "linear_beta": 25}}
]})";
  std::vector<ModelShape> shapes = parse_shapes(text, "dir/full.json");
  REQUIRE(shapes.size() == 2);
  const ModelShape& s = shapes[0];
  CHECK(s.name == "full.shape_1");
  CHECK(s.num_experts == 32);
  CHECK(s.top_k == 4);
  CHECK(s.hidden == 2880);
  CHECK(s.intermediate == 2880);
  CHECK(s.expert_offset == 32);
  CHECK(s.global_experts == 128);
  CHECK(s.activation.kind == moejit::ActivationKind::kGptOss);
  CHECK(s.activation.limit == 7.f);
  CHECK(s.activation.alpha == 1.702f);
  CHECK(s.activation.beta == 0.f);
  CHECK(s.has_bias);
  CHECK(s.shared.count == 2);
  CHECK(s.shared.intermediate == 1024);
  CHECK(s.shared.gate == moejit::SharedGate::kSigmoid);
  CHECK(s.shared.logit_dtype == moejit::DType::kF32);
  CHECK(s.shared.scale == 0.25f);
  CHECK(s.weight_format == moejit::WeightFormat::kMXFP4);
  CHECK(s.activation_dtype == moejit::DType::kBF16);
  CHECK(s.id_dtype == moejit::DType::kI64);
  CHECK(s.max_tokens == 4096);
  CHECK(s.source == "dir/full.json:2");

  const ModelShape& d = shapes[1];
  CHECK(d.name == "defaults");
  CHECK(d.expert_offset == 8);
  CHECK(d.global_experts == 16);  // expert_offset + num_experts
  CHECK(d.activation.kind == moejit::ActivationKind::kSiTU);
  CHECK(d.activation.beta == 4.f);
  CHECK(d.activation.linear_beta == 25.f);
  CHECK_FALSE(d.has_bias);
  CHECK(d.shared.count == 0);
  CHECK(d.shared.intermediate == 0);
  CHECK(d.shared.gate == moejit::SharedGate::kConstant);
  CHECK(d.shared.scale == 1.f);
  CHECK(d.id_dtype == moejit::DType::kI32);
  CHECK(d.max_tokens == 16384);
  CHECK(d.source == "dir/full.json:19");
}

TEST_CASE("the three layouts of a shape file", "[descriptor]") {
  const std::string shape =
      R"({"name": "one", "num_experts": 4, "top_k": 2, "hidden": 32, "intermediate": 32,
          "activation": {"kind": "clamped_swiglu", "limit": 10}})";
  auto single = parse_shapes(shape, "single.json");
  REQUIRE(single.size() == 1);
  CHECK(single[0].name == "one");
  CHECK(single[0].activation.limit == 10.f);
  CHECK(single[0].source == "single.json:1");

  auto array =
      parse_shapes("[" + shape + ",\n" + edit(shape, "\"one\"", "\"two\"") + "]", "a.json");
  REQUIRE(array.size() == 2);
  CHECK(array[1].name == "two");
  CHECK(array[1].source == "a.json:3");  // the first shape takes two lines

  auto wrapped = parse_shapes("{\"shapes\": [" + shape + "]}", "w.json");
  REQUIRE(wrapped.size() == 1);
  // A UTF-8 byte order mark is allowed.
  CHECK(parse_shapes("\xEF\xBB\xBF" + shape, "bom.json").size() == 1);
}

TEST_CASE("the bundled reference shapes parse", "[descriptor]") {
  std::string path = moejit::test::shapes_dir() + "/reference.json";
  std::vector<ModelShape> shapes = moejit::load_shapes_file(path);
  std::vector<std::string> names;
  for (const auto& s : shapes) names.push_back(s.name);
  CHECK(names == std::vector<std::string>{"gpt-oss-120b", "gpt-oss-20b", "kimi-k3.1-tp8",
                                          "kimi-k3.1-tp4-ep2", "kimi-k3.1-tp4-ep2-rank1",
                                          "deepseek-v4-flash-tp4", "deepseek-v4.1-flash-tp4",
                                          "qwen3-30b-a3b", "qwen2-57b-a14b"});
  REQUIRE(shapes.size() == 9);
  const ModelShape& g = shapes[0];
  CHECK((g.num_experts == 128 && g.top_k == 4 && g.hidden == 2880 && g.intermediate == 2880));
  CHECK(g.activation.kind == moejit::ActivationKind::kGptOss);
  CHECK(g.activation.limit == 7.f);
  CHECK(g.activation.alpha == 1.702f);
  CHECK(g.has_bias);
  const ModelShape& k1 = shapes[4];
  CHECK((k1.num_experts == 448 && k1.expert_offset == 448 && k1.global_experts == 896));
  CHECK(k1.activation.kind == moejit::ActivationKind::kSiTU);
  CHECK(k1.shared.scale == 0.5f);
  const ModelShape& d = shapes[5];
  CHECK((d.num_experts == 256 && d.top_k == 6 && d.hidden == 4096 && d.intermediate == 512));
  CHECK(d.activation.kind == moejit::ActivationKind::kClampedSwiGLU);
  CHECK(d.activation.limit == 10.f);
  const ModelShape& q = shapes[8];
  CHECK((q.num_experts == 64 && q.top_k == 8 && q.hidden == 3584 && q.intermediate == 2560));
  CHECK(q.shared.count == 1);
  CHECK(q.shared.intermediate == 20480);
  CHECK(q.shared.gate == moejit::SharedGate::kSigmoid);
  CHECK(q.shared.logit_dtype == moejit::DType::kBF16);
  for (const auto& s : shapes) CHECK(s.source.rfind(path + ":", 0) == 0);
}

TEST_CASE("the schema lists exactly the fields the parser accepts", "[descriptor]") {
  std::string dir = moejit::test::shapes_dir();
  const std::string schema_text = moejit::test::read_text(dir + "/schema.json");
  REQUIRE_FALSE(schema_text.empty());
  nlohmann::json schema = nlohmann::json::parse(schema_text);
  CHECK(schema.at("$schema") == "https://json-schema.org/draft/2020-12/schema");
  auto keys = [&](const char* def) {
    std::set<std::string> out;
    for (const auto& item : schema.at("$defs").at(def).at("properties").items()) {
      out.insert(item.key());
    }
    return out;
  };
  auto as_set = [](const std::vector<std::string>& v) {
    return std::set<std::string>(v.begin(), v.end());
  };
  CHECK(keys("file") == as_set(moejit::detail::file_fields()));
  CHECK(keys("shape") == as_set(moejit::detail::shape_fields()));
  CHECK(keys("activation") == as_set(moejit::detail::activation_fields()));
  CHECK(keys("shared_experts") == as_set(moejit::detail::shared_experts_fields()));
  for (const char* def : {"file", "shape", "shared_experts"}) {
    INFO(def);
    CHECK(schema.at("$defs").at(def).at("additionalProperties") == false);
  }
  // Each activation kind is a closed branch with exactly its constants.
  std::set<std::string> kinds;
  for (const auto& branch : schema.at("$defs").at("activation").at("oneOf")) {
    CHECK(branch.at("additionalProperties") == false);
    kinds.insert(branch.at("properties").at("kind").at("const").get<std::string>());
  }
  CHECK(kinds == std::set<std::string>{"swiglu", "clamped_swiglu", "gpt_oss", "situ"});
  // The bound a file is refused past, not the parser's wider typo guard.
  CHECK(schema.at("$defs").at("shape").at("properties").at("num_experts").at("maximum") ==
        moejit::detail::kMaxRoutedLocalExperts);
  // An activation constant at either bound is one the parser takes; the next float past it not.
  const nlohmann::json& constant = schema.at("$defs").at("activation_constant");
  const auto limit = [](const std::string& value) {
    return base_with("{\"kind\": \"swiglu\"}",
                     "{\"kind\": \"clamped_swiglu\", \"limit\": " + value + "}");
  };
  for (const char* bound : {"minimum", "maximum"}) {
    INFO(bound << " " << constant.at(bound).dump());
    CHECK_NOTHROW(parse_shapes(limit(constant.at(bound).dump()), "ok.json"));
  }
  CHECK(refuse(limit("4.6566128730773926e-10")).message.find("no exact int ratio") !=
        std::string::npos);  // 2^-31
  CHECK(refuse(limit("2147483648")).message.find("no exact int ratio") != std::string::npos);
  const std::string reference_text = moejit::test::read_text(dir + "/reference.json");
  REQUIRE_FALSE(reference_text.empty());
  nlohmann::json reference = nlohmann::json::parse(reference_text);
  CHECK(reference.at("$schema") == "./schema.json");
}

TEST_CASE("JSON that is not valid is refused with its place", "[descriptor]") {
  std::string trailing = base_with(R"({"kind": "swiglu"})", R"({"kind": "swiglu",})");
  // The place is the character the JSON reader stopped at: the brace after the comma.
  Position brace = position_of(trailing, ",}");
  ++brace.column;
  expect_refusal(trailing, brace, "", {"not valid JSON", "expected string literal"});

  std::string comment = base_with("\"top_k\": 8,", "\"top_k\": 8, // eight");
  Refusal c = refuse(comment);
  REQUIRE(c.refused);
  CHECK(c.line == position_of(comment, "//").line);
  CHECK(c.message.find("not valid JSON") != std::string::npos);

  Refusal empty = refuse("");
  REQUIRE(empty.refused);
  CHECK((empty.line == 1 && empty.column == 1));
  CHECK(empty.message.rfind("model.json:1:1: (root): the file is not valid JSON", 0) == 0);

  // A NUL byte ends the input for the JSON reader: what follows one is refused, not dropped.
  const std::string nul(1, '\0');
  const std::string after_root = base_with("", "") + nul + "{\"shapes\": [{\"name\": 7}]}";
  expect_refusal(after_root, position_of(after_root, nul), "", {"NUL byte", "found a NUL byte"});
  const std::string in_value = base_with("\"top_k\": 8", "\"top_k\": 8" + nul);
  expect_refusal(in_value, position_of(in_value, nul), "", {"NUL byte"});

  Refusal bad_utf8 = refuse(base_with("\"alpha\"", "\"al\xFFpha\""));
  REQUIRE(bad_utf8.refused);
  CHECK(bad_utf8.line == 5);
}

TEST_CASE("JSON syntax errors give the column of the offending character", "[descriptor]") {
  std::string text = base_with("\"top_k\": 8,", "\"top_k\": 8");
  Refusal r = refuse(text);
  REQUIRE(r.refused);
  Position hidden = position_of(text, "\"hidden\"");
  CHECK(r.line == hidden.line);
  CHECK(r.column == hidden.column);
  CHECK(r.message.find("expected '}', found '\"hidden\"'") != std::string::npos);

  // A broken word is shown from its first character.
  std::string word = base_with("\"top_k\": 8", "\"top_k\": tru");
  expect_refusal(word, position_of(word, "tru"), "", {"invalid literal", "found 'tru'"});
  std::string number = base_with("\"top_k\": 8", "\"top_k\": 1.5e");
  expect_refusal(number, position_of(number, "1.5e"), "", {"invalid number", "found '1.5e'"});

  // A word wrong from its first character is placed at that character, not the one before it,
  // also where it starts a line.
  std::string nan = base_with("\"top_k\": 8", "\"top_k\":NaN");
  expect_refusal(nan, position_of(nan, "NaN"), "", {"invalid literal", "found 'NaN'"});
  std::string infinity = base_with("\"top_k\": 8", "\"top_k\":\n      Infinity");
  expect_refusal(infinity, position_of(infinity, "Infinity"), "",
                 {"invalid literal", "found 'Infinity'"});
  std::string own_line = base_with("\"top_k\": 8,", "\"top_k\": 8,\n// eight\n");
  expect_refusal(own_line, position_of(own_line, "//"), "", {"invalid literal", "found '/'"});
  std::string after_root = base_with("", "") + "\nx";
  Position x = position_of(after_root, "\nx");
  ++x.line;
  x.column = 1;
  expect_refusal(after_root, x, "", {"found 'x'"});

  // A character of several UTF-8 bytes (a typographic quote pasted from a document) is shown
  // whole, not as its first byte.
  std::string quote = base_with("\"swiglu\"", "\xE2\x80\x9Cswiglu\xE2\x80\x9D");
  Refusal q = refuse(quote);
  REQUIRE(q.refused);
  CHECK(q.line == position_of(quote, "\xE2\x80\x9C").line);
  CHECK(q.message.find("found '\xE2\x80\x9C'") != std::string::npos);
}

TEST_CASE("a file of more JSON values than a shape file needs is refused at the first too many",
          "[descriptor]") {
  const std::size_t values = moejit::detail::kMaxJsonValues;  // the root array and its members
  std::string text = "[0";
  for (std::size_t i = 2; i < values; ++i) text += ",0";  // values - 1 zeros: exactly the limit
  // At the limit the rules are checked (and find no shape here).
  CHECK_THROWS_WITH(parse_shapes(text + "]", "many.json"),
                    Catch::Contains("many.json:1:2: /0: a shape is not an object"));
  Refusal r = refuse(text + ",[]]", "many.json");
  REQUIRE(r.refused);
  CHECK(r.line == 1);
  CHECK(r.column == static_cast<int>(text.size()) + 2);  // the "[" after the last ","
  CHECK(r.message.find("holds more JSON values than a shape file needs; expected at most " +
                       std::to_string(values) + " values") != std::string::npos);
  // Invalid JSON past the limit is refused for its syntax, as a file that is not JSON at all.
  CHECK(refuse(text + ",]").message.find("not valid JSON") != std::string::npos);
}

TEST_CASE("a number that overflows is placed at its value and shown shortened", "[descriptor]") {
  // The JSON reader refuses the number before the stray character after it; the place is the
  // number's.
  expect_value_refusal("\"top_k\": 8", "\"top_k\": 1e400x", "1e400x", "/shapes/0/top_k",
                       {"top_k is not finite", "found 1e400"});
  // However many digits it has, the message shows the first of them.
  std::string nines = base_with("\"top_k\": 8", "\"top_k\": " + std::string(100000, '9'));
  Refusal n = refuse(nines);
  REQUIRE(n.refused);
  CHECK(n.pointer == "/shapes/0/top_k");
  CHECK(n.line == position_of(nines, "999").line);
  CHECK(n.message.find("found " + std::string(60, '9') + "...") != std::string::npos);
  CHECK(n.message.size() < 400);
}

TEST_CASE("unknown fields are refused with the accepted ones", "[descriptor]") {
  std::string text = base_with("\"hidden\": 2048", "\"hiden\": 2048");
  expect_refusal(text, position_of(text, "\"hiden\""), "/shapes/0/hiden",
                 {"unknown field \"hiden\"", "did you mean \"hidden\"", "num_experts",
                  "max_tokens", "shared_experts"});

  std::string act = base_with(R"({"kind": "swiglu"})", R"({"kind": "swiglu", "gamma": 1})");
  expect_refusal(act, position_of(act, "\"gamma\""), "/shapes/0/activation/gamma",
                 {"unknown field \"gamma\"", "kind, limit, alpha, beta, linear_beta"});

  std::string top = edit(kBase, "\"shapes\": [", "\"version\": 2,\n  \"shapes\": [");
  expect_refusal(top, position_of(top, "\"version\""), "/version",
                 {"unknown field \"version\"", "$schema, shapes"});

  std::string shape_at_root = R"({"$schema": "./schema.json", "name": "x"})";
  expect_refusal(shape_at_root, position_of(shape_at_root, "\"name\""), "/name",
                 {"unknown field \"name\"", "shape fields go inside \"shapes\""});
}

TEST_CASE("a key twice in one object is refused", "[descriptor]") {
  std::string text = base_with("\"top_k\": 8,", "\"top_k\": 8, \"top_k\": 4,");
  expect_refusal(text, position_of(text, "\"top_k\"", 2), "/shapes/0/top_k",
                 {"\"top_k\" appears twice", "first is at line 7, column 7"});
}

TEST_CASE("a shape name twice in one file is refused", "[descriptor]") {
  std::string text = R"({"shapes": [
  {"name": "same", "num_experts": 8, "top_k": 2, "hidden": 64, "intermediate": 64,
   "activation": {"kind": "swiglu"}},
  {"name": "other", "num_experts": 8, "top_k": 2, "hidden": 64, "intermediate": 64,
   "activation": {"kind": "swiglu"}},
  {"name": "same", "num_experts": 8, "top_k": 2, "hidden": 64, "intermediate": 64,
   "activation": {"kind": "swiglu"}}
]})";
  expect_refusal(text, position_of(text, "\"same\"", 2), "/shapes/2/name",
                 {"\"same\" is used twice", "first at line 2, /shapes/0/name",
                  "names unique"});
}

TEST_CASE("fields of the wrong JSON type are refused", "[descriptor]") {
  expect_value_refusal("\"top_k\": 8", "\"top_k\": 2.5", "2.5", "/shapes/0/top_k",
                       {"top_k must be an integer", "an integer in 1..64", "found 2.5"});
  expect_value_refusal("\"top_k\": 8", "\"top_k\": \"4\"", "\"4\"", "/shapes/0/top_k",
                       {"must be an integer", "found \"4\" (a string)"});
  expect_value_refusal("\"top_k\": 8", "\"top_k\": true", "true", "/shapes/0/top_k",
                       {"must be an integer", "found true (a boolean)"});
  expect_value_refusal("\"hidden\": 2048", "\"hidden\": 2048.0", "2048.0", "/shapes/0/hidden",
                       {"must be an integer", "fraction or exponent"});
  expect_value_refusal("\"hidden\": 2048", "\"hidden\": null", "null", "/shapes/0/hidden",
                       {"must be an integer", "found null"});
  expect_value_refusal("\"alpha\"", "42", "42", "/shapes/0/name",
                       {"name must be a string", "found 42"});
  expect_value_refusal("\"activation\": {\"kind\": \"swiglu\"}", "\"activation\": \"swiglu\"",
                       "\"swiglu\"", "/shapes/0/activation",
                       {"activation is not an object", "expected an object"});
  expect_value_refusal("\"activation\": {\"kind\": \"swiglu\"}",
                       "\"activation\": {\"kind\": \"swiglu\"}, \"has_bias\": 1", "1",
                       "/shapes/0/has_bias", {"has_bias must be a boolean", "true or false"});
  expect_value_refusal("{\"kind\": \"swiglu\"}", "{\"kind\": \"clamped_swiglu\", \"limit\": \"7\"}",
                       "\"7\"", "/shapes/0/activation/limit",
                       {"limit must be a number", "a finite number > 0"});
}

TEST_CASE("zero, negative and absurd sizes are refused", "[descriptor]") {
  expect_value_refusal("\"num_experts\": 64", "\"num_experts\": 0", "0,", "/shapes/0/num_experts",
                       {"num_experts must be positive", "an integer in 1..3509", "found 0"});
  expect_value_refusal("\"hidden\": 2048", "\"hidden\": -32", "-32", "/shapes/0/hidden",
                       {"hidden must be positive", "found -32"});
  expect_value_refusal("\"intermediate\": 768", "\"intermediate\": 0", "0,",
                       "/shapes/0/intermediate", {"intermediate must be positive"});
  expect_value_refusal("\"num_experts\": 64", "\"num_experts\": 5000", "5000",
                       "/shapes/0/num_experts",
                       {"larger than any model", "1..3509", "found 5000", "typo"});
  expect_value_refusal("\"num_experts\": 64", "\"num_experts\": 3510", "3510",
                       "/shapes/0/num_experts",
                       {"more local experts than the route kernel serves", "at most 3509",
                        "found 3510", "expert_offset and global_experts"});
  CHECK(parse_shapes(base_with("\"num_experts\": 64", "\"num_experts\": 3509"), "ok.json")
            .at(0)
            .num_experts == 3509);
  expect_value_refusal("\"top_k\": 8", "\"top_k\": 65", "65", "/shapes/0/top_k",
                       {"top_k is larger than any model", "1..64"});
  expect_value_refusal("\"hidden\": 2048", "\"hidden\": 131072", "131072", "/shapes/0/hidden",
                       {"hidden is larger than any model", "1..65536"});
  expect_value_refusal("\"intermediate\": 768", "\"intermediate\": 99999999999", "99999999999",
                       "/shapes/0/intermediate", {"intermediate is out of range", "1..65536"});
  expect_value_refusal("\"hidden\": 2048", "\"hidden\": 99999999999999999999999",
                       "99999999999999999999999", "/shapes/0/hidden",
                       {"must be an integer", "(too large for an integer)"});
  expect_value_refusal("\"hidden\": 2048", "\"hidden\": 18446744073709551615",
                       "18446744073709551615", "/shapes/0/hidden", {"out of range"});
  expect_value_refusal("\"top_k\": 8,", "\"top_k\": 8, \"max_tokens\": 0,", "0,",
                       "/shapes/0/max_tokens", {"max_tokens must be positive", "1..1048576"});
  expect_value_refusal("\"top_k\": 8,", "\"top_k\": 8, \"max_tokens\": 2000000,", "2000000",
                       "/shapes/0/max_tokens", {"larger than any model", "found 2000000"});
  expect_value_refusal("\"top_k\": 8,", "\"top_k\": 8, \"expert_offset\": -1,", "-1",
                       "/shapes/0/expert_offset", {"expert_offset is too small", "0..65535"});
  // The largest int: no overflow on the way to its refusal (the default global_experts adds
  // num_experts to it; the sanitizer build would flag a wrapped sum).
  expect_value_refusal("\"top_k\": 8,", "\"top_k\": 8, \"expert_offset\": 2147483647,",
                       "2147483647", "/shapes/0/expert_offset",
                       {"expert_offset", "0..65535", "found 2147483647"});
}

TEST_CASE("top_k above the number of experts is refused", "[descriptor]") {
  expect_value_refusal("\"num_experts\": 64", "\"num_experts\": 4", "8,", "/shapes/0/top_k",
                       {"top_k exceeds the number of routed experts", "at most global_experts = 4",
                        "found 8"});
  // Under expert parallelism a rank may hold fewer experts than top_k: the bound is global.
  auto shapes = parse_shapes(
      base_with("\"num_experts\": 64", "\"num_experts\": 4, \"global_experts\": 256"), "ep.json");
  CHECK(shapes.at(0).top_k == 8);
}

TEST_CASE("global_experts must cover the rank's experts", "[descriptor]") {
  expect_value_refusal("\"num_experts\": 64", "\"num_experts\": 64, \"expert_offset\": 64, "
                       "\"global_experts\": 100", "100", "/shapes/0/global_experts",
                       {"does not cover this rank's experts", "[64, 128)",
                        "at least expert_offset + num_experts = 128", "found 100"});
  // The default of an absent global_experts can break the range; the message says so.
  std::string text =
      base_with("\"num_experts\": 64", "\"num_experts\": 3000, \"expert_offset\": 65000");
  expect_refusal(text, position_of(text, "{\n      \"name\""), "/shapes/0/global_experts",
                 {"global_experts is larger than any model",
                  "defaults to expert_offset + "
                  "num_experts = 68000"});
}

TEST_CASE("sizes that break the MXFP4 block invariant are refused", "[descriptor]") {
  expect_value_refusal("\"hidden\": 2048", "\"hidden\": 2050", "2050", "/shapes/0/hidden",
                       {"MXFP4 block invariant", "FC1 reduces over K = hidden",
                        "one E8M0 scale per 32", "a multiple of 32", "found 2050",
                        "2048 and 2080"});
  expect_value_refusal(
      "\"intermediate\": 768", "\"intermediate\": 770", "770", "/shapes/0/intermediate",
      {"MXFP4 block invariant", "FC2 reduces over K = intermediate", "768 and 800"});
  expect_value_refusal("\"hidden\": 2048", "\"hidden\": 16", "16", "/shapes/0/hidden",
                       {"a multiple of 32", "the nearest valid values are 32"});
  expect_value_refusal("{\"kind\": \"swiglu\"}",
                       "{\"kind\": \"swiglu\"}, \"shared_experts\": {\"count\": 1, "
                       "\"intermediate\": 100}",
                       "100", "/shapes/0/shared_experts/intermediate",
                       {"the shared expert's FC2", "a multiple of 32"});
}

TEST_CASE("activation kinds and their constants", "[descriptor]") {
  expect_value_refusal("{\"kind\": \"swiglu\"}", "{\"kind\": \"swiglu\", \"limit\": 7}",
                       "\"limit\"", "/shapes/0/activation/limit",
                       {"activation \"swiglu\" takes no constant \"limit\"", "only kind",
                        "clamped_swiglu"});
  expect_value_refusal("{\"kind\": \"swiglu\"}",
                       "{\"kind\": \"clamped_swiglu\", \"limit\": 7, \"beta\": 4}", "\"beta\"",
                       "/shapes/0/activation/beta",
                       {"\"clamped_swiglu\" takes no constant \"beta\"", "only kind and limit"});
  expect_value_refusal("{\"kind\": \"swiglu\"}", "{\"kind\": \"gpt_oss\", \"limit\": 7}",
                       "{\"kind\": \"gpt_oss\"", "/shapes/0/activation",
                       {"\"gpt_oss\" needs constant \"alpha\"", "kind, limit and alpha",
                        "found fields kind, limit"});
  expect_value_refusal("{\"kind\": \"swiglu\"}", "{\"kind\": \"situ\", \"linear_beta\": 25}",
                       "{\"kind\": \"situ\"", "/shapes/0/activation",
                       {"needs constant \"beta\""});
  expect_value_refusal("{\"kind\": \"swiglu\"}", "{\"limit\": 7}", "{\"limit\"",
                       "/shapes/0/activation", {"missing required field \"kind\""});
  expect_value_refusal("{\"kind\": \"swiglu\"}", "{\"kind\": \"relu\"}", "\"relu\"",
                       "/shapes/0/activation/kind",
                       {"kind is not a known value",
                        "one of \"swiglu\", \"clamped_swiglu\", \"gpt_oss\", \"situ\"",
                        "found \"relu\""});
  expect_value_refusal("{\"kind\": \"swiglu\"}", "{\"kind\": \"SwiGLU\"}", "\"SwiGLU\"",
                       "/shapes/0/activation/kind", {"names are lower case: \"swiglu\""});
}

TEST_CASE("non-finite and non-positive constants are refused", "[descriptor]") {
  auto limit = [](const std::string& value) {
    return "{\"kind\": \"clamped_swiglu\", \"limit\": " + value + "}";
  };
  const std::string act = "{\"kind\": \"swiglu\"}";
  const std::string ptr = "/shapes/0/activation/limit";
  expect_value_refusal(
      act, limit("1e999"), "1e999", ptr,
      {"limit is not finite", "overflows to infinity", "a finite number", "found 1e999"});
  expect_value_refusal(act, limit("-1e999"), "-1e999", ptr, {"limit is not finite"});
  expect_value_refusal(act, limit("1e39"), "1e39", ptr, {"does not fit a 32-bit float"});
  expect_value_refusal(act, limit("1e-50"), "1e-50", ptr, {"too small for a 32-bit float"});
  expect_value_refusal(act, limit("0"), "0}", ptr,
                       {"limit must be finite and positive", "found 0"});
  expect_value_refusal(act, limit("-7.5"), "-7.5", ptr,
                       {"limit must be finite and positive", "found -7.5"});
  expect_value_refusal(act, "{\"kind\": \"gpt_oss\", \"limit\": 7, \"alpha\": 0.0}", "0.0",
                       "/shapes/0/activation/alpha", {"alpha must be finite and positive"});
  // Finite and positive, but no int ratio num / den (the kernels' template form) rounds to it.
  expect_value_refusal(act, limit("1e10"), "1e10", ptr,
                       {"limit has no exact int ratio", "about 1e-9 to 2e9", "found 1e10"});
  expect_value_refusal(act, limit("1e-20"), "1e-20", ptr, {"limit has no exact int ratio"});
  CHECK(parse_shapes(base_with(act, limit("1e9")), "ok.json").at(0).activation.limit == 1e9f);
  expect_value_refusal(act, "{\"kind\": \"swiglu\"}, \"shared_experts\": {\"count\": 1, "
                       "\"intermediate\": 64, \"scale\": 1e400}", "1e400",
                       "/shapes/0/shared_experts/scale", {"scale is not finite"});
  expect_value_refusal(act, "{\"kind\": \"swiglu\"}, \"shared_experts\": {\"count\": 1, "
                       "\"intermediate\": 64, \"scale\": -1}", "-1",
                       "/shapes/0/shared_experts/scale",
                       {"shared_experts.scale must be finite and positive", "found -1"});
}

TEST_CASE("shared experts rules", "[descriptor]") {
  const std::string act = "{\"kind\": \"swiglu\"}";
  auto shared = [&](const std::string& body) {
    return act + ", \"shared_experts\": " + body;
  };
  const std::string ptr = "/shapes/0/shared_experts";
  expect_value_refusal(act, shared("{\"count\": 9, \"intermediate\": 64}"), "9", ptr + "/count",
                       {"shared_experts.count is larger than any model", "0..8"});
  expect_value_refusal(act, shared("{\"count\": -1}"), "-1", ptr + "/count",
                       {"shared_experts.count is too small", "0..8"});
  expect_value_refusal(act, shared("{\"count\": 1}"), "{\"count\": 1}", ptr,
                       {"missing required field \"intermediate\"", "found fields count"});
  expect_value_refusal(act, shared("{\"intermediate\": 64}"), "{\"intermediate\"", ptr,
                       {"missing required field \"count\""});
  expect_value_refusal(act, shared("{\"count\": 0, \"intermediate\": 64}"), "\"intermediate\": 64",
                       ptr + "/intermediate", {"has no effect when count is 0"});
  expect_value_refusal(act,
                       shared("{\"count\": 1, \"intermediate\": 64, \"logit_dtype\": \"fp32\"}"),
                       "\"logit_dtype\"", ptr + "/logit_dtype",
                       {"logit_dtype has no effect with gate \"constant\"", "only a sigmoid gate"});
  expect_value_refusal(act, shared("{\"count\": 1, \"intermediate\": 64, \"gate\": \"given\", "
                                   "\"scale\": 2}"),
                       "\"scale\"", ptr + "/scale", {"scale has no effect with gate \"given\""});
  expect_value_refusal(act, shared("{\"count\": 1, \"intermediate\": 64, \"gate\": \"relu\"}"),
                       "\"relu\"", ptr + "/gate", {"one of \"sigmoid\", \"constant\", \"given\""});
  expect_value_refusal(act, shared("{\"count\": 1, \"intermediate\": 64, \"gate\": \"sigmoid\", "
                                   "\"logit_dtype\": \"fp8\"}"),
                       "\"fp8\"", ptr + "/logit_dtype", {"one of \"bf16\", \"fp16\", \"fp32\""});
  expect_value_refusal(act, shared("[1]"), "[1]", ptr, {"shared_experts is not an object"});
  // count 0 alone is fine.
  auto shapes = parse_shapes(base_with(act, shared("{\"count\": 0}")), "s.json");
  CHECK(shapes.at(0).shared.count == 0);
}

TEST_CASE("formats and names", "[descriptor]") {
  const std::string top = "\"top_k\": 8,";
  expect_value_refusal(top, top + " \"weight_format\": \"fp8\",", "\"fp8\"",
                       "/shapes/0/weight_format", {"expected \"mxfp4\"", "found \"fp8\""});
  expect_value_refusal(top, top + " \"activation_dtype\": \"fp16\",", "\"fp16\"",
                       "/shapes/0/activation_dtype", {"expected \"bf16\""});
  expect_value_refusal(top, top + " \"id_dtype\": \"int16\",", "\"int16\"", "/shapes/0/id_dtype",
                       {"one of \"int32\", \"int64\""});
  expect_value_refusal("\"alpha\"", "\"has space\"", "\"has space\"", "/shapes/0/name",
                       {"not a valid shape name", "A-Z a-z 0-9 . _ -"});
  expect_value_refusal("\"alpha\"", "\"../etc\"", "\"../etc\"", "/shapes/0/name",
                       {"not a valid shape name"});
  expect_value_refusal("\"alpha\"", "\"\"", "\"\",", "/shapes/0/name", {"not a valid shape name"});
  expect_value_refusal("\"alpha\"", "\"" + std::string(129, 'a') + "\"", "\"aaa",
                       "/shapes/0/name", {"1 to 128 characters", "..."});
}

TEST_CASE("a missing required field points at the object holding it", "[descriptor]") {
  std::string text = base_with("      \"hidden\": 2048,\n", "");
  expect_refusal(text, position_of(text, "{\n      \"name\""), "/shapes/0",
                 {"missing required field \"hidden\"",
                  "found fields name, num_experts, top_k, intermediate, activation"});
  std::string no_act = base_with(",\n      \"activation\": {\"kind\": \"swiglu\"}", "");
  expect_refusal(no_act, position_of(no_act, "{\n      \"name\""), "/shapes/0",
                 {"missing required field \"activation\""});
  std::string no_shapes = R"({"$schema": "./schema.json"})";
  expect_refusal(no_shapes, {1, 1}, "", {"missing required field \"shapes\""});
}

TEST_CASE("files that hold no shapes are refused", "[descriptor]") {
  expect_refusal("42", {1, 1}, "", {"the file holds no shapes", "found 42"});
  expect_refusal("\n  []", {2, 3}, "", {"the file lists no shapes", "found an empty array"});
  std::string empty = R"({"shapes": []})";
  expect_refusal(empty, position_of(empty, "[]"), "/shapes", {"lists no shapes"});
  std::string not_array = R"({"shapes": {"name": "x"}})";
  expect_refusal(not_array, position_of(not_array, "{\"name"), "/shapes",
                 {"\"shapes\" is not an array", "found an object"});
  std::string not_object = R"({"shapes": [7]})";
  expect_refusal(not_object, position_of(not_object, "7"), "/shapes/0",
                 {"a shape is not an object", "found 7"});
}

TEST_CASE("nesting beyond any shape file is refused", "[descriptor]") {
  std::string deep = std::string(40, '[') + std::string(40, ']');
  Refusal r = refuse(deep);
  REQUIRE(r.refused);
  CHECK(r.message.find("nests too deeply") != std::string::npos);
  CHECK(r.line == 1);
  CHECK(r.column == moejit::detail::kMaxJsonDepth + 2);
  // Very deep input is refused without exhausting the stack.
  std::string very_deep = std::string(200000, '[') + std::string(200000, ']');
  CHECK(refuse(very_deep).refused);
}

TEST_CASE("the first broken shape stops the whole file", "[descriptor]") {
  std::string text = R"([
  {"name": "good", "num_experts": 8, "top_k": 2, "hidden": 64, "intermediate": 64,
   "activation": {"kind": "swiglu"}},
  {"name": "bad", "num_experts": 8, "top_k": 2, "hidden": 65, "intermediate": 64,
   "activation": {"kind": "swiglu"}}
])";
  expect_refusal(text, position_of(text, "65"), "/1/hidden", {"a multiple of 32"});
}

TEST_CASE("load_shapes_file reports unreadable files as I/O errors", "[descriptor]") {
  moejit::test::TempDir dir;
  try {
    moejit::load_shapes_file(dir.path() + "/absent.json");
    FAIL("a missing file was accepted");
  } catch (const moejit::Error& e) {
    CHECK(e.code() == moejit::ErrorCode::kIo);
    CHECK(std::string(e.what()).find("absent.json") != std::string::npos);
  }
  try {
    moejit::load_shapes_file(dir.path());
    FAIL("a directory was accepted");
  } catch (const moejit::Error& e) {
    CHECK(e.code() == moejit::ErrorCode::kIo);
    CHECK(std::string(e.what()).find("directory") != std::string::npos);
  }
  // An endless device, and a file past the cap: refused, not read until memory runs out.
  for (const std::string& huge : {std::string("/dev/zero"), dir.path() + "/huge.json"}) {
    if (huge != "/dev/zero") {
      std::ofstream(huge) << std::string(
          static_cast<std::size_t>(moejit::detail::kMaxShapeFileBytes) + 1, ' ');
    }
    try {
      moejit::load_shapes_file(huge);
      FAIL("an oversized file was read: " << huge);
    } catch (const moejit::Error& e) {
      CHECK(e.code() == moejit::ErrorCode::kIo);
      CHECK(std::string(e.what()).find("larger than 16 MiB") != std::string::npos);
    }
  }
  std::string path = dir.path() + "/bad.json";
  std::ofstream(path) << base_with("2048", "2047");
  try {
    moejit::load_shapes_file(path);
    FAIL("a bad shape was accepted");
  } catch (const DescriptorError& e) {
    CHECK(e.file() == path);
    CHECK(std::string(e.what()).rfind(path + ":8:17: /shapes/0/hidden: ", 0) == 0);
  }
}

TEST_CASE("check_shape applies the same rules to shapes built in code", "[descriptor]") {
  ModelShape s;
  s.name = "code";
  s.num_experts = 8;
  s.top_k = 2;
  s.hidden = 64;
  s.intermediate = 64;
  s.global_experts = 8;
  CHECK_NOTHROW(moejit::detail::check_shape(s));
  s.hidden = 100;
  s.source = "engine.json:12";
  try {
    moejit::detail::check_shape(s);
    FAIL("hidden 100 was accepted");
  } catch (const DescriptorError& e) {
    CHECK(e.pointer() == "/hidden");
    CHECK(e.file() == "engine.json");
    CHECK(e.line() == 12);
    CHECK(std::string(e.what()).rfind("engine.json:12: /hidden: ", 0) == 0);
  }
  s.hidden = 64;
  s.activation.limit = 3.f;  // swiglu takes no limit
  auto v = moejit::detail::find_shape_violation(s);
  REQUIRE(v);
  CHECK(v->field == "/activation/limit");
}

TEST_CASE("enum names match the file spellings", "[descriptor]") {
  using moejit::ActivationKind;
  CHECK(std::string(moejit::activation_kind_name(ActivationKind::kSwiGLU)) == "swiglu");
  CHECK(std::string(moejit::activation_kind_name(ActivationKind::kClampedSwiGLU)) ==
        "clamped_swiglu");
  CHECK(std::string(moejit::activation_kind_name(ActivationKind::kGptOss)) == "gpt_oss");
  CHECK(std::string(moejit::activation_kind_name(ActivationKind::kSiTU)) == "situ");
  CHECK(std::string(moejit::dtype_name(moejit::DType::kBF16)) == "bf16");
  CHECK(std::string(moejit::dtype_name(moejit::DType::kF16)) == "fp16");
  CHECK(std::string(moejit::dtype_name(moejit::DType::kF32)) == "fp32");
  CHECK(std::string(moejit::dtype_name(moejit::DType::kI32)) == "int32");
  CHECK(std::string(moejit::dtype_name(moejit::DType::kI64)) == "int64");
  CHECK(std::string(moejit::shared_gate_name(moejit::SharedGate::kSigmoid)) == "sigmoid");
  CHECK(std::string(moejit::shared_gate_name(moejit::SharedGate::kConstant)) == "constant");
  CHECK(std::string(moejit::shared_gate_name(moejit::SharedGate::kGiven)) == "given");
}

TEST_CASE("damaged files are refused with a DescriptorError, never anything else",
          "[descriptor]") {
  std::string text = moejit::test::read_text(moejit::test::shapes_dir() + "/reference.json");
  REQUIRE_FALSE(text.empty());
  // Every prefix of a valid file is invalid JSON.
  for (std::size_t n = 0; n < text.size(); n += 7) {
    INFO("prefix length " << n);
    Refusal r = refuse(text.substr(0, n));
    CHECK(r.refused);
    CHECK(r.line >= 1);
  }
  // Random byte damage: either still a valid file, or refused with a place.
  std::mt19937 rng(12345);
  const std::string alphabet = "{}[]:,\"\\ 0123456789.eE-+truefalsnl\xC3\xA9~/";
  for (int trial = 0; trial < 1500; ++trial) {
    std::string damaged = text;
    int edits = 1 + static_cast<int>(rng() % 3);
    for (int i = 0; i < edits; ++i) {
      damaged[rng() % damaged.size()] = alphabet[rng() % alphabet.size()];
    }
    INFO("trial " << trial);
    try {
      parse_shapes(damaged, "damaged.json");
    } catch (const DescriptorError& e) {
      CHECK(e.line() >= 1);
      CHECK(e.column() >= 1);
    }
  }
}

TEST_CASE("a number that overflows inside nesting too deep is refused for the nesting",
          "[descriptor]") {
  std::string text = "{\"shapes\": ";
  for (int i = 0; i < 20; ++i) text += "[";
  text += "1e999";
  for (int i = 0; i < 20; ++i) text += "]";
  text += "}";
  try {
    parse_shapes(text, "deep.json");
    FAIL("accepted");
  } catch (const DescriptorError& e) {
    const std::string what = e.what();
    INFO(what);
    CHECK(what.find("nests too deeply") != std::string::npos);
    CHECK(e.column() > 1);
  }
}

TEST_CASE("the position scanner", "[descriptor]") {
  using moejit::detail::scan_json;
  std::string text =
      "\xEF\xBB\xBF{\"a/b~c\": [1, {\"x\": \"s\\\"}\"}],\r\n"
      "  \"\\u00e9t\\u00e9\": true, \"caf\xC3\xA9\": null, \"\\ud83d\\ude00\": -2.5e3}";
  auto scan = scan_json(text, 8);
  CHECK_FALSE(scan.duplicate);
  CHECK_FALSE(scan.too_deep);
  moejit::detail::LineIndex lines(text);
  auto at = [&](const std::string& pointer) {
    const moejit::detail::ValueSpan* span = scan.find(pointer);
    REQUIRE(span != nullptr);
    auto p = lines.at(span->begin);
    return std::make_pair(p.line, p.column);
  };
  CHECK(at("") == std::make_pair(1, 1));  // the BOM takes no column
  CHECK(at("/a~1b~0c") == std::make_pair(1, 11));
  CHECK(at("/a~1b~0c/0") == std::make_pair(1, 12));
  CHECK(at("/a~1b~0c/1") == std::make_pair(1, 15));
  CHECK(at("/a~1b~0c/1/x") == std::make_pair(1, 21));
  CHECK(at("/\xC3\xA9t\xC3\xA9") == std::make_pair(2, 20));
  CHECK(at("/caf\xC3\xA9") == std::make_pair(2, 34));  // é counts as one column
  CHECK(at("/\xF0\x9F\x98\x80") == std::make_pair(2, 56));
  // Asked again, out of order: the line index's memory of its last answer must not leak.
  CHECK(at("/a~1b~0c/1") == std::make_pair(1, 15));
  CHECK(at("/caf\xC3\xA9") == std::make_pair(2, 34));
  CHECK(at("/\xC3\xA9t\xC3\xA9") == std::make_pair(2, 20));
  CHECK(at("") == std::make_pair(1, 1));
  REQUIRE(scan.find("/a~1b~0c/1/x") != nullptr);
  auto s = *scan.find("/a~1b~0c/1/x");
  CHECK(text.substr(s.begin, s.end - s.begin) == "\"s\\\"}\"");
  auto n = *scan.find("/\xF0\x9F\x98\x80");
  CHECK(text.substr(n.begin, n.end - n.begin) == "-2.5e3");
  // Not in the text: a missing key, an index past the end, an index with a leading zero, a
  // member of a scalar, a pointer that does not start with "/".
  CHECK(scan.find("/nope") == nullptr);
  CHECK(scan.find("/a~1b~0c/2") == nullptr);
  CHECK(scan.find("/a~1b~0c/01") == nullptr);
  CHECK(scan.find("/a~1b~0c/0/x") == nullptr);
  CHECK(scan.find("a~1b~0c") == nullptr);
  CHECK(scan.keys("") == std::vector<std::string>{"a/b~c", "\xC3\xA9t\xC3\xA9", "caf\xC3\xA9",
                                                  "\xF0\x9F\x98\x80"});
  CHECK(scan.keys("/a~1b~0c").empty());  // an array
  auto first = scan.first_scalar("-2.5e3");
  REQUIRE(first);
  CHECK(first->first == "/\xF0\x9F\x98\x80");
  CHECK(first->second.begin == n.begin);
  CHECK_FALSE(scan.first_scalar("-2.5"));  // the start of a number is not the number

  auto dup = scan_json(R"({"a": {"k": 1, "j": 2, "k": 3}})", 8);
  REQUIRE(dup.duplicate);
  CHECK(dup.duplicate->pointer == "/a/k");
  CHECK(dup.duplicate->first == 7);
  CHECK(dup.duplicate->second == 23);
  // The same key in sibling objects is not a duplicate; "\u006b" is "k".
  CHECK_FALSE(scan_json(R"([{"k": 1}, {"k": 2}])", 8).duplicate);
  CHECK(scan_json(R"({"k": 1, "\u006b": 2})", 8).duplicate);

  CHECK_FALSE(scan_json("[1, [2]]", 8, 4).too_many);  // four values: the root, 1, [2] and 2
  const auto many = scan_json("[1, [2], 3]", 8, 4);
  REQUIRE(many.too_many);
  CHECK(*many.too_many == 9);  // the fifth value, 3
  CHECK_FALSE(scan_json("[[[]]]", 2).too_deep);
  auto deep = scan_json("[[[[]]]]", 2);
  REQUIRE(deep.too_deep);
  CHECK(*deep.too_deep == 3);

  CHECK(moejit::detail::json_pointer_child("/a", "b/c~d") == "/a/b~1c~0d");
}

// A long key over a large array: a scanner that keeps each value's whole JSON pointer needs
// key length x elements bytes (here 20 GB); the tree needs about the text's size. And a
// minified file (one line): its column lookups count on from the last one.
TEST_CASE("the position scanner stays linear in the text", "[descriptor]") {
  using moejit::detail::scan_json;
  const std::string key(100000, 'k');
  std::string text = "{\"" + key + "\": [";
  for (int i = 0; i < 200000; ++i) text += i == 0 ? "0" : ",0";
  text += "]}";
  auto scan = scan_json(text, 8);
  const moejit::detail::ValueSpan* last = scan.find("/" + key + "/199999");
  REQUIRE(last != nullptr);
  CHECK(last->begin == text.size() - 3);
  CHECK(scan.find("/" + key + "/200000") == nullptr);
  auto first = scan.first_scalar("0");
  REQUIRE(first);
  CHECK(first->first == "/" + key + "/0");

  moejit::detail::LineIndex lines(text);
  for (std::size_t offset = 0; offset < text.size(); offset += 7) {
    REQUIRE(lines.at(offset).column == static_cast<int>(offset) + 1);
  }
  CHECK(lines.at(5).column == 6);  // and backwards

  // Through the parser: the file is refused at its unknown key, the key shortened.
  try {
    parse_shapes(text, "long_key.json");
    FAIL("a file whose only key is unknown was accepted");
  } catch (const DescriptorError& e) {
    const std::string what = e.what();
    CHECK(what.size() < 2000);
    CHECK(what.find("unknown field \"kkkk") != std::string::npos);
    CHECK(what.find("...") != std::string::npos);
  }
}

TEST_CASE("shape-file messages escape control characters and shorten long keys",
          "[descriptor]") {
  CHECK(moejit::detail::printable("a\nb\tc", 100) == "a\\nb\\tc");
  CHECK(moejit::detail::printable(std::string("a\0b", 3), 100) == "a\\u0000b");
  CHECK(moejit::detail::printable("\x1b[31m", 100) == "\\u001b[31m");
  CHECK(moejit::detail::printable("abcdef", 3) == "abc...");
  CHECK(moejit::detail::printable("\xC3\xA9\xC3\xA9", 3) == "\xC3\xA9...");  // cut at a character
  for (const std::string& key : {std::string("a\\u0000b"), std::string("\\u001b[31mred"),
                                 std::string("x\\ny")}) {
    const std::string text = R"({"name": "s", ")" + key + R"(": 1})";
    try {
      parse_shapes(text, "control.json");
      FAIL("an unknown key was accepted: " << key);
    } catch (const DescriptorError& e) {
      const std::string what = e.what();
      CAPTURE(what);
      CHECK(what.find("unknown field") != std::string::npos);
      CHECK(what.find("; expected") != std::string::npos);  // nothing after a NUL was lost
      for (char c : what) CHECK(static_cast<unsigned char>(c) >= 0x20);
    }
  }
}

TEST_CASE("messages list the first 20 shape names and how many there are", "[descriptor]") {
  using moejit::detail::listed_names;
  CHECK(listed_names({}).empty());
  CHECK(listed_names({"a", "b"}) == "a, b");
  std::vector<std::string> names;
  for (int i = 0; i < 21; ++i) names.push_back("s" + std::to_string(i));
  const std::string listed = listed_names(names);
  CHECK(listed.rfind("s0, s1, ", 0) == 0);
  CHECK(listed.find("s19, ... (21 in all)") != std::string::npos);
  CHECK(listed.find("s20") == std::string::npos);
  names.pop_back();
  CHECK(listed_names(names).find("in all") == std::string::npos);  // 20: all of them
}
