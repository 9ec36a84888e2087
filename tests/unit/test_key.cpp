// The cache key: every input counts, nothing else does, and nothing machine-specific goes in.
#include <algorithm>
#include <catch2/catch.hpp>
#include <cctype>
#include <cstdlib>
#include <functional>
#include <regex>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "cache/key.hpp"
#include "codegen/codegen.hpp"
#include "compile/nvrtc.hpp"
#include "moejit/kernel_spec.hpp"
#include "moejit/version.hpp"
#include "runtime/runtime_impl.hpp"

namespace {

using moejit::detail::compute_key;
using moejit::detail::KeyHeader;
using moejit::detail::KeyInputs;

KeyInputs base_inputs() {
  KeyInputs in;
  in.schema_version = 1;
  in.pipeline_version = 1;
  in.nvrtc_version = "13.0";
  in.options = {"--gpu-architecture=sm_90a", "-std=c++17", "-lineinfo"};
  in.arch = "sm_90a";
  in.program_name = "append_shared_k6_s1_i32_sigmoid_bf16_t128_sm_90a.cu";
  in.source = "#include <moejit/kern/append_shared.cuh>\n";
  in.name_expression = "moejit::kern::append_shared_kernel<T>";
  in.headers = {KeyHeader{"moejit/kern/append_shared.cuh", "template <int K> struct A {};\n"},
                KeyHeader{"moejit/kern/common/ptx.cuh", "namespace ptx {}\n"}};
  return in;
}

bool is_hex32(const std::string& key) {
  if (key.size() != 32) return false;
  for (char c : key) {
    if (!std::isdigit(static_cast<unsigned char>(c)) && (c < 'a' || c > 'f')) return false;
  }
  return true;
}

}  // namespace

TEST_CASE("key: 32 lowercase hex digits, identical for identical inputs", "[key]") {
  const std::string key = compute_key(base_inputs());
  CHECK(is_hex32(key));
  CHECK(compute_key(base_inputs()) == key);
  KeyInputs copy = base_inputs();
  CHECK(compute_key(copy) == key);
}

TEST_CASE("key: a change to any single input changes the key", "[key]") {
  using Mutation = std::pair<const char*, std::function<void(KeyInputs&)>>;
  const std::vector<Mutation> mutations = {
      {"schema version", [](KeyInputs& in) { in.schema_version += 1; }},
      {"compile pipeline version", [](KeyInputs& in) { in.pipeline_version += 1; }},
      {"nvrtc version", [](KeyInputs& in) { in.nvrtc_version = "13.1"; }},
      {"one option changed", [](KeyInputs& in) { in.options[1] = "-std=c++20"; }},
      {"one option added", [](KeyInputs& in) { in.options.push_back("-G"); }},
      {"one option removed", [](KeyInputs& in) { in.options.pop_back(); }},
      {"options reordered", [](KeyInputs& in) { std::swap(in.options[1], in.options[2]); }},
      {"arch", [](KeyInputs& in) { in.arch = "sm_100a"; }},
      {"program name", [](KeyInputs& in) { in.program_name = "other.cu"; }},
      {"generated source", [](KeyInputs& in) { in.source += " "; }},
      {"name expression", [](KeyInputs& in) { in.name_expression += " "; }},
      {"one byte of one embedded header",
       [](KeyInputs& in) {
         static const std::string flipped = [&] {
           std::string s(in.headers[1].content);
           s[3] = static_cast<char>(s[3] ^ 1);
           return s;
         }();
         in.headers[1].content = flipped;
       }},
      {"an embedded header's path",
       [](KeyInputs& in) {
         static const std::string longer = std::string(in.headers[0].path) + "x";
         in.headers[0].path = longer;
       }},
      {"an embedded header added",
       [](KeyInputs& in) {
         in.headers.push_back(KeyHeader{"moejit/kern/new.cuh", ""});
       }},
      {"an embedded header removed", [](KeyInputs& in) { in.headers.pop_back(); }},
  };
  const std::string base = compute_key(base_inputs());
  std::set<std::string> seen = {base};
  for (const Mutation& mutation : mutations) {
    KeyInputs in = base_inputs();
    mutation.second(in);
    const std::string key = compute_key(in);
    INFO("mutation: " << mutation.first);
    CHECK(key != base);
    CHECK(is_hex32(key));
    // Every mutation lands on its own key, not merely a different one.
    CHECK(seen.insert(key).second);
  }
}

TEST_CASE("key: field boundaries are not ambiguous", "[key]") {
  KeyInputs a = base_inputs();
  KeyInputs b = base_inputs();
  a.options = {"ab", "c"};
  b.options = {"a", "bc"};
  CHECK(compute_key(a) != compute_key(b));

  // An option moved into the arch field, or text moved between source and name expression.
  a = base_inputs();
  b = base_inputs();
  a.options.push_back("sm_90a");
  a.arch = "";
  b.arch = "sm_90a";
  CHECK(compute_key(a) != compute_key(b));
  a = base_inputs();
  b = base_inputs();
  a.source = "xy";
  a.name_expression = "z";
  b.source = "x";
  b.name_expression = "yz";
  CHECK(compute_key(a) != compute_key(b));

  // A header's content moved into its path.
  a = base_inputs();
  b = base_inputs();
  a.headers = {KeyHeader{"p", "qr"}};
  b.headers = {KeyHeader{"pq", "r"}};
  CHECK(compute_key(a) != compute_key(b));
}

TEST_CASE("key: stable across builds and machines (golden value)", "[key]") {
  // Why a golden value: a silent change to the key's encoding would orphan every cache already
  // deployed. Changing it on purpose means updating this value and saying so: every entry is
  // then built again once, and gc collects the old ones (a change of the entry file's format
  // also bumps kCacheSchemaVersion). Last change: the compile pipeline's version joined the key.
  CHECK(compute_key(base_inputs()) == "1019aab5c15904373925b9ee09f83d50");
}

TEST_CASE("key: the runtime's inputs hold no machine-specific path", "[key]") {
  moejit::KernelSpec spec;
  spec.family = moejit::Family::kAppendShared;
  spec.arch = moejit::Arch::parse("sm_90a");
  moejit::AppendSharedParams params;
  params.top_k = 6;
  params.num_shared = 1;
  params.block_threads = 128;
  spec.params = params;

  const moejit::detail::GeneratedSource source = moejit::detail::render(spec);
  const KeyInputs in = moejit::detail::make_key_inputs(source, spec.arch);
  CHECK(in.schema_version == moejit::kCacheSchemaVersion);
  CHECK(in.pipeline_version == moejit::detail::kCompilePipelineVersion);
  CHECK(in.arch == "sm_90a");
  CHECK(in.source == source.source);
  CHECK(in.name_expression == source.name_expression);
  CHECK_FALSE(in.headers.empty());

  std::vector<std::string> texts = {in.nvrtc_version, in.arch, in.program_name, in.source,
                                    in.name_expression};
  texts.insert(texts.end(), in.options.begin(), in.options.end());
  for (const KeyHeader& header : in.headers) {
    texts.emplace_back(header.path);
    CHECK(header.path.rfind("moejit/kern/", 0) == 0);
  }
  std::vector<std::string> machine = {"/opt/", "/usr/", "/tmp", "/home"};
  if (const char* home = std::getenv("HOME"); home != nullptr && std::string(home).size() > 1) {
    machine.push_back(home);
  }
  const std::regex absolute_path(R"((^|[\s"'<=(:])/[A-Za-z_.~])");
  REQUIRE(std::regex_search(std::string("#include </usr/include/x.h>"), absolute_path));
  REQUIRE(std::regex_search(std::string("/usr/local/cuda/include"), absolute_path));
  for (const std::string& text : texts) {
    INFO("key input: " << text);
    for (const std::string& path : machine) CHECK(text.find(path) == std::string::npos);
    CHECK(text.rfind("-I", 0) != 0);
    // An absolute path: a "/" that starts a word and is followed by a name ("// comment" and
    // "moejit/kern/x.cuh" are not paths of the machine).
    CHECK_FALSE(std::regex_search(text, absolute_path));
  }
  // Header contents are the embedded templates themselves: no build-machine path inside.
  for (const KeyHeader& header : in.headers) {
    INFO("embedded header " << header.path);
    for (const std::string& path : machine) CHECK(header.content.find(path) == std::string::npos);
  }

  // Line tables (RuntimeConfig::line_info) are an option of the compile, so a kernel built with
  // them is another entry: neither setting is ever served the other's cubin.
  const KeyInputs with_lines = moejit::detail::make_key_inputs(source, spec.arch, true);
  CHECK(std::count(in.options.begin(), in.options.end(), "-lineinfo") == 0);
  CHECK(std::count(with_lines.options.begin(), with_lines.options.end(), "-lineinfo") == 1);
  CHECK(compute_key(with_lines) != compute_key(in));
}
