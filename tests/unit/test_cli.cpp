// The `moejit` CLI as a user meets it: help, exit codes, shape file errors, source, plan, doctor,
// and the README's shape example (so the README can't rot). Runs the binary at $MOEJIT_TEST_CLI.
#include <catch2/catch.hpp>
#include <cstdlib>
#include <fstream>
#include <set>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "codegen/embedded.hpp"
#include "moejit/kernel_spec.hpp"
#include "moejit/moe.hpp"
#include "moejit/moejit.h"
#include "moejit/runtime.hpp"
#include "moejit/shape.hpp"
#include "moejit/version.hpp"
#include "support/support.hpp"

namespace {

using moejit::test::run_command;
using moejit::test::TempDir;

std::string quote(const std::string& s) {
  std::string out = "'";
  for (char c : s) out += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return out + "'";
}

std::string cli_path() {
  const char* path = std::getenv("MOEJIT_TEST_CLI");
  if (path == nullptr) throw std::runtime_error("MOEJIT_TEST_CLI is not set (run via ctest)");
  return path;
}

std::string source_dir() {
  const char* path = std::getenv("MOEJIT_TEST_SOURCE_DIR");
  if (path == nullptr)
    throw std::runtime_error("MOEJIT_TEST_SOURCE_DIR is not set (run via ctest)");
  return path;
}

// Runs `moejit <args>` with a private cache unless `cache_dir` names one, and with `env`'s
// NAME=value assignments (space separated) added to its environment.
int cli(const std::string& args, std::string* output, const std::string& cache_dir = "",
        const std::string& env = "") {
  static TempDir default_cache;
  std::string dir = cache_dir.empty() ? default_cache.path() : cache_dir;
  return run_command("env -u MOEJIT_CACHE_MODE " + env + " MOEJIT_CACHE_DIR=" + quote(dir) + " " +
                         quote(cli_path()) + " " + args,
                     output);
}

void write_file(const std::string& path, const std::string& text) {
  std::ofstream file(path);
  file << text;
  REQUIRE(file.good());
}

std::string reference_shapes() { return moejit::test::shapes_dir() + "/reference.json"; }

}  // namespace

TEST_CASE("moejit --help lists the subcommands and the exit codes", "[cli]") {
  std::string out;
  REQUIRE(cli("--help", &out) == 0);
  INFO(out);
  for (const char* word :
       {"prewarm", "plan", "list", "verify", "gc", "clear", "source", "doctor"}) {
    CHECK(out.find(word) != std::string::npos);
  }
  CHECK(out.find("Exit codes") != std::string::npos);
  for (const char* code : {"0  success", "1  some work failed", "2  usage error",
                           "3  invalid shape file", "4  environment problem"}) {
    CHECK(out.find(code) != std::string::npos);
  }
  CHECK(out.find("MOEJIT_CACHE_DIR") != std::string::npos);
}

TEST_CASE("every subcommand's --help exits 0 and names its options", "[cli]") {
  struct Case {
    const char* command;
    std::vector<const char*> mentions;
  };
  const std::vector<Case> cases = {
      {"prewarm", {"--arch", "-j", "--jobs", "files", "Exit codes"}},
      {"source", {"--shape", "--kernel", "--arch", "Exit codes"}},
      {"plan", {"--shape", "--arch", "file", "Exit codes"}},
      {"list", {"Exit codes"}},
      {"verify", {"quarantine", "Exit codes"}},
      {"gc", {"--max-size", "500M", "Exit codes"}},
      {"clear", {"Exit codes"}},
      {"doctor", {"NVRTC", "Exit codes"}},
  };
  for (const Case& c : cases) {
    std::string out;
    int rc = cli(std::string(c.command) + " --help", &out);
    INFO(c.command << " --help:\n" << out);
    CHECK(rc == 0);
    for (const char* word : c.mentions) CHECK(out.find(word) != std::string::npos);
  }
}

TEST_CASE("usage errors exit 2", "[cli]") {
  auto usage_error = [](const std::string& args) {
    std::string out;
    int rc = cli(args, &out);
    INFO("moejit " << args << "\n" << out);
    CHECK(rc == 2);
    return out;
  };
  const std::string shapes = quote(reference_shapes());
  // An unknown first word is named, with the commands there are.
  std::string first = usage_error("frobnicate");
  CHECK(first.find("unknown command 'frobnicate'") != std::string::npos);
  CHECK(first.find("prewarm, ") != std::string::npos);
  CHECK(usage_error("--frobnicate").find("unknown option '--frobnicate'") != std::string::npos);
  usage_error("");              // no subcommand
  usage_error("list --bogus");  // unknown flag
  for (const char* jobs : {"0", "-1", "abc"}) {  // -j must be a positive whole number
    const std::string said = usage_error("prewarm " + shapes + " --arch sm_90a -j " + jobs);
    CHECK(said.find("--jobs") != std::string::npos);
    CHECK(said.size() < 300);  // not the range's upper bound as a 300-digit number
  }
  // An arch the MoE kernels can't run on (marlin_moe needs sm_80) is refused before anything
  // is planned or compiled, as is one this NVRTC can't target (which sm_70 is for NVRTC 13).
  for (const char* arch : {"sm_70", "sm_75"}) {
    for (const std::string& said : {usage_error("plan " + shapes + " --arch " + arch),
                                    usage_error("prewarm " + shapes + " --arch sm_90a," + arch)}) {
      INFO(said);
      CHECK((said.find("needs sm_80") != std::string::npos ||
             said.find(std::string(arch) + " is not a target of this NVRTC") != std::string::npos));
    }
  }
  // A well-formed arch no NVRTC targets is named as such, with the archs there are, by every
  // command that takes one.
  for (const std::string& command :
       {"plan " + shapes, "prewarm " + shapes,
        "source " + shapes + " --shape qwen2-57b-a14b --kernel route"}) {
    const std::string said = usage_error(command + " --arch sm_999");
    INFO(said);
    CHECK(said.find("bad --arch: sm_999 is not a target of this NVRTC; it supports: sm_") !=
          std::string::npos);
    CHECK(said.find("sm_90") != std::string::npos);
  }
  usage_error("gc");                                         // --max-size is required
  CHECK(usage_error("gc --max-size 12Q").find("12Q") != std::string::npos);
  CHECK(usage_error("prewarm " + shapes + " --arch sm_nine").find("sm_nine") != std::string::npos);
  std::string out =
      usage_error("source " + shapes + " --shape no-such-model --kernel append_shared");
  CHECK(out.find("no-such-model") != std::string::npos);
  CHECK(out.find("qwen2-57b-a14b") != std::string::npos);  // the names there are
  CHECK(usage_error("source " + shapes + " --shape qwen2-57b-a14b --kernel no_such_family")
            .find("no_such_family") != std::string::npos);
  out = usage_error("plan " + shapes + " --shape no-such-model");
  CHECK(out.find("no-such-model") != std::string::npos);
  CHECK(out.find("qwen2-57b-a14b") != std::string::npos);
  CHECK(usage_error("plan " + shapes + " --arch sm_nine").find("sm_nine") != std::string::npos);
  usage_error("plan");  // FILE is required

  // A file of many shapes: the names there are, the first 20 of them and the count.
  moejit::test::TempDir tmp;
  std::string many = "{\"shapes\": [";
  for (int i = 0; i < 25; ++i) {
    many += std::string(i == 0 ? "" : ",") + "{\"name\": \"shape-" + std::to_string(i) +
            "\", \"num_experts\": 8, \"top_k\": 2, \"hidden\": 256, \"intermediate\": 256, "
            "\"activation\": {\"kind\": \"swiglu\"}}";
  }
  const std::string many_path = tmp.path() + "/many.json";
  moejit::test::write_text(many_path, many + "]}");
  out = usage_error("plan " + quote(many_path) + " --shape no-such-model");
  CHECK(out.find("shape-0, shape-1, ") != std::string::npos);
  CHECK(out.find("shape-19, ... (25 in all)") != std::string::npos);
  CHECK(out.find("shape-20") == std::string::npos);
}

TEST_CASE("an invalid shape file exits 3 naming file:line:column, before anything compiles",
          "[cli]") {
  TempDir dir;
  std::string cache = dir.path() + "/cache";
  std::string bad = dir.path() + "/bad.json";
  std::string out;

  SECTION("a JSON syntax error") {
    write_file(bad, "{\n  \"shapes\": [\n    {\"name\": \"x\",, \"top_k\": 2}\n  ]\n}\n");
    int rc = cli("prewarm " + quote(reference_shapes()) + " " + quote(bad) + " --arch sm_90a", &out,
                 cache);
    INFO(out);
    CHECK(rc == 3);
    CHECK(out.find(bad + ":3:") != std::string::npos);
  }
  SECTION("a rule broken (top_k larger than the experts)") {
    write_file(bad,
               "{\n"
               "  \"shapes\": [\n"
               "    {\n"
               "      \"name\": \"broken\",\n"
               "      \"num_experts\": 4,\n"
               "      \"top_k\": 8,\n"
               "      \"hidden\": 2048,\n"
               "      \"intermediate\": 768,\n"
               "      \"activation\": {\"kind\": \"swiglu\"}\n"
               "    }\n"
               "  ]\n"
               "}\n");
    int rc = cli("prewarm " + quote(bad) + " --arch sm_90a", &out, cache);
    INFO(out);
    CHECK(rc == 3);
    CHECK(out.find(bad + ":") != std::string::npos);
    CHECK(out.find("top_k") != std::string::npos);
  }
  SECTION("a name defined by two files, or one file passed twice") {
    const std::string shape =
        "{\"shapes\": [{\"name\": \"twice\", \"num_experts\": 8, \"top_k\": 2, \"hidden\": 256, "
        "\"intermediate\": 128, \"activation\": {\"kind\": \"swiglu\"}}]}\n";
    const std::string other = dir.path() + "/other.json";
    write_file(bad, shape);
    write_file(other, shape);
    for (const std::string& second : {other, bad}) {
      int rc = cli("prewarm " + quote(bad) + " " + quote(second) + " --arch sm_90a", &out, cache);
      INFO(out);
      CHECK(rc == 3);
      // The second definition's name value: file, line and column, then its JSON pointer.
      CHECK(out.find(second + ":1:22: /shapes/0/name: shape \"twice\" is also defined at " + bad +
                     ":1;") != std::string::npos);
    }
  }
  SECTION("a missing file") {
    int rc = cli("prewarm " + quote(dir.path() + "/missing.json") + " --arch sm_90a", &out, cache);
    INFO(out);
    CHECK(rc == 3);
    CHECK(out.find("missing.json") != std::string::npos);
  }
  SECTION("source refuses it too") {
    write_file(bad, "[{\"name\": \"x\"]\n");
    int rc = cli("source " + quote(bad) + " --shape x --kernel append_shared", &out, cache);
    INFO(out);
    CHECK(rc == 3);
    CHECK(out.find(bad + ":1:") != std::string::npos);
  }
  SECTION("plan refuses it too") {
    write_file(bad, "[{\"name\": \"x\"]\n");
    int rc = cli("plan " + quote(bad), &out, cache);
    INFO(out);
    CHECK(rc == 3);
    CHECK(out.find(bad + ":1:") != std::string::npos);
  }
  // All-or-nothing: nothing was compiled into the cache.
  std::string listing;
  REQUIRE(cli("list", &listing, cache) == 0);
  INFO(listing);
  CHECK(listing.find("0 entries") != std::string::npos);
}

TEST_CASE("source prints the append_shared translation unit of qwen2-57b-a14b", "[cli]") {
  std::string header;
  for (const moejit::detail::EmbeddedHeader& h : moejit::detail::embedded_headers()) {
    std::string path(h.path);
    if (path.size() >= 17 && path.compare(path.size() - 17, 17, "append_shared.cuh") == 0) {
      header = path;
    }
  }
  REQUIRE_FALSE(header.empty());
  std::string out;
  int rc = cli("source " + quote(reference_shapes()) +
                   " --shape qwen2-57b-a14b --kernel append_shared --arch sm_90a",
               &out);
  INFO(out);
  REQUIRE(rc == 0);
  CHECK(out.find("#include") != std::string::npos);
  CHECK(out.find(header) != std::string::npos);
  CHECK(out.find("append_shared") != std::string::npos);

  SECTION("a shape without shared experts needs no append_shared kernel") {
    rc = cli("source " + quote(reference_shapes()) + " --shape gpt-oss-120b --kernel append_shared",
             &out);
    CHECK(rc == 2);
    CHECK(out.find("gpt-oss-120b") != std::string::npos);
  }
}

namespace {

// What `moejit plan` printed for one shape: the kernel names (lines ending in "@<arch>"), the T
// ranges ("T = a:" or "T = a..b:"), and the lines that name what a range runs.
struct PlanOutput {
  std::vector<std::string> kernels;
  std::vector<std::pair<int, int>> ranges;
  std::vector<std::string> paths;
};

PlanOutput parse_plan(const std::string& out, const std::string& arch) {
  PlanOutput plan;
  std::istringstream lines(out);
  std::string line;
  while (std::getline(lines, line)) {
    const std::size_t start = line.find_first_not_of(' ');
    if (start == std::string::npos) continue;
    const std::string text = line.substr(start);
    const std::string suffix = "@" + arch;
    if (text.size() > suffix.size() &&
        text.compare(text.size() - suffix.size(), suffix.size(), suffix) == 0 &&
        text.find(' ') == std::string::npos) {
      plan.kernels.push_back(text);
    } else if (text.rfind("T = ", 0) == 0 && text.back() == ':') {
      const std::string range = text.substr(4, text.size() - 5);
      const std::size_t dots = range.find("..");
      const int first = std::stoi(range.substr(0, dots));
      const int last = dots == std::string::npos ? first : std::stoi(range.substr(dots + 2));
      plan.ranges.emplace_back(first, last);
    } else if (text.rfind("decode_moe, ", 0) == 0 || text.rfind("marlin_moe (", 0) == 0) {
      plan.paths.push_back(text);
    }
  }
  return plan;
}

}  // namespace

TEST_CASE("plan names every kernel prewarm compiles, per range of T, and the sizes to allocate",
          "[cli]") {
  const std::vector<moejit::ModelShape> shapes = moejit::load_shapes_file(reference_shapes());
  for (const char* arch_name : {"sm_90a", "sm_80"}) {
    const moejit::Arch arch = moejit::Arch::parse(arch_name);
    for (const moejit::ModelShape& shape : shapes) {
      std::string out;
      const int rc = cli("plan " + quote(reference_shapes()) + " --shape " + quote(shape.name) +
                             " --arch " + arch_name,
                         &out);
      INFO(shape.name << " on " << arch_name << ":\n" << out);
      REQUIRE(rc == 0);
      const PlanOutput plan = parse_plan(out, arch.name());

      // The kernels named are exactly those prewarm compiles (each path of each range listed).
      std::set<std::string> expected;
      for (const moejit::KernelSpec& spec : moejit::plan_kernels(shape, arch)) {
        expected.insert(spec.display_name());
      }
      const std::set<std::string> named(plan.kernels.begin(), plan.kernels.end());
      CHECK(named == expected);

      // The ranges cover T = 1..max_tokens in order, with no gap and no overlap.
      REQUIRE_FALSE(plan.ranges.empty());
      CHECK(plan.ranges.front().first == 1);
      CHECK(plan.ranges.back().second == shape.max_tokens);
      for (std::size_t i = 0; i < plan.ranges.size(); ++i) {
        CHECK(plan.ranges[i].first <= plan.ranges[i].second);
        if (i > 0) CHECK(plan.ranges[i].first == plan.ranges[i - 1].second + 1);
      }

      // One automatic path per range; decode_moe only where it serves the shape and the arch.
      const std::string decode_problem = moejit::moe_decode_problem(shape);
      const bool decode = decode_problem.empty() && arch.sm >= 90;
      int automatic = 0;
      bool any_decode = false;
      for (const std::string& path : plan.paths) {
        automatic += path.find("(automatic)") != std::string::npos ? 1 : 0;
        any_decode = any_decode || path.rfind("decode_moe", 0) == 0;
      }
      CHECK(automatic == static_cast<int>(plan.ranges.size()));
      CHECK(any_decode == decode);
      if (!decode_problem.empty()) CHECK(out.find(decode_problem) != std::string::npos);

      // The sizes an engine allocates, as the library's own queries give them.
      const moejit::MoeWeightLayout layout = moejit::moe_weight_layout(shape);
      const std::size_t weights = layout.w13_bytes + layout.w13_scale_bytes + layout.w2_bytes +
                                  layout.w2_scale_bytes + layout.b13_bytes + layout.b2_bytes;
      CHECK(out.find("repacked weights: " + std::to_string(weights) + " bytes") !=
            std::string::npos);
      CHECK(out.find("workspace: " +
                     std::to_string(moejit::moe_workspace_bytes(shape, shape.max_tokens)) +
                     " bytes") != std::string::npos);
    }
  }

  SECTION("no forced decode path where moe_forward refuses it for the whole shape") {
    // decode_moe's tiles fit this shape at T = 6..16 but not at T = 1 with block_n 8, so
    // decode_moe_problem names it and moe_forward refuses MoePath::kDecode at every T.
    TempDir dir;
    const std::string file = dir.path() + "/wide.json";
    write_file(file,
               R"({"shapes": [{"name": "wide", "num_experts": 3509, "top_k": 64, "hidden": 4096,)"
               R"( "intermediate": 512, "activation": {"kind": "swiglu"}, "max_tokens": 300}]})");
    const moejit::ModelShape wide = moejit::load_shapes_file(file).front();
    REQUIRE_FALSE(moejit::moe_decode_problem(wide).empty());
    std::string out;
    REQUIRE(cli("plan " + quote(file) + " --arch sm_90a", &out) == 0);
    INFO(out);
    CHECK(out.find("(MoePath::kDecode)") == std::string::npos);
  }

  SECTION("without --shape, every shape of the file") {
    std::string out;
    REQUIRE(cli("plan " + quote(reference_shapes()), &out) == 0);
    for (const moejit::ModelShape& shape : shapes) {
      CHECK(out.find(shape.name + " on sm_90a: ") != std::string::npos);
    }
  }
}

TEST_CASE("the library, the C ABI and the CLI name the header's version", "[cli]") {
  const std::string header = std::to_string(moejit::kVersionMajor) + "." +
                             std::to_string(moejit::kVersionMinor) + "." +
                             std::to_string(moejit::kVersionPatch);
  CHECK(std::string(moejit::kVersionString) == header);
  CHECK(std::string(moejit::library_version()) == header);
  CHECK(std::string(moejit_version()) == header);
  std::string out;
  CHECK(cli("--version", &out) == 0);
  CHECK(out.find("libmoejit " + header) != std::string::npos);
}

TEST_CASE("doctor runs without a GPU and says what it found", "[cli]") {
  TempDir cache;
  std::string out;
  int rc = cli("doctor", &out, cache.path());
  INFO(out);
  CHECK(rc == 0);
  CHECK(out.find(std::string("libmoejit")) != std::string::npos);
  CHECK(out.find("weight layout " + std::to_string(moejit::moe_weight_layout_version())) !=
        std::string::npos);
  CHECK(out.find("NVRTC") != std::string::npos);
  CHECK(out.find("(compiles)") != std::string::npos);
  CHECK(out.find(cache.path()) != std::string::npos);
  CHECK(out.find("writable:") != std::string::npos);
  CHECK(out.find("entries:") != std::string::npos);
  std::string why;
  if (moejit::test::gpu_available(&why)) {
    CHECK(out.find("sm_") != std::string::npos);
  } else {
    CHECK(out.find("none visible") != std::string::npos);
  }
}

TEST_CASE("doctor reports a bad environment variable and the rest with the defaults", "[cli]") {
  TempDir cache;
  for (const char* bad :
       {"MOEJIT_CACHE_MODE=bogus", "MOEJIT_LINEINFO=maybe", "MOEJIT_LOG_LEVEL=bogus"}) {
    std::string out;
    const int rc = cli("doctor", &out, cache.path(), bad);
    INFO(bad << "\n" << out);
    CHECK(rc == 4);  // an environment problem, not a crash of the report
    CHECK(out.find(std::string(bad)) != std::string::npos);
    // The report goes on past the bad variable, with the defaults.
    CHECK(out.find("cache dir:") != std::string::npos);
    CHECK(out.find("entries:") != std::string::npos);
    CHECK(out.find("problem(s)") != std::string::npos);
  }
}

TEST_CASE("MOEJIT_LOG_LEVEL is read in any case; a name that is no level keeps the warnings",
          "[cli]") {
  // A cache "directory" that is a file: the cache says so at warn, and runs memory-only.
  TempDir tmp;
  const std::string file = tmp.path() + "/not-a-dir";
  write_file(file, "x");
  const std::string warned = "is not a directory";
  for (const char* level : {"WARN", "Warning", "warn", "DEBUG", "bogus", "Off"}) {
    std::string out;
    cli("list", &out, file, std::string("MOEJIT_LOG_LEVEL=") + level);
    INFO(level << "\n" << out);
    const std::string name = level;
    if (name == "Off") {
      CHECK(out.find("[moejit ") == std::string::npos);
    } else {
      CHECK(out.find("[moejit W] " + file + " " + warned) != std::string::npos);
    }
    CHECK((out.find("[moejit D]") != std::string::npos) == (name == "DEBUG"));
    CHECK((out.find("MOEJIT_LOG_LEVEL=bogus is not a level") != std::string::npos) ==
          (name == "bogus"));
  }
}

TEST_CASE("doctor: NVRTC compiles with no CUDA toolkit to be found", "[cli]") {
  // The kernels include no toolkit header, so nothing the environment says about a toolkit
  // matters to a compile.
  TempDir cache;
  std::string out;
  const int rc = cli("doctor", &out, cache.path(),
                     "CUDA_HOME=/nonexistent-toolkit CUDA_PATH=/nonexistent-toolkit");
  INFO(out);
  CHECK(rc == 0);
  CHECK(out.find("libnvrtc") != std::string::npos);
  CHECK(out.find("(compiles)") != std::string::npos);
  // No toolkit include directory is looked for or reported (the driver line may still name the
  // toolkit's libcuda stub, as under CI's sanitizer run).
  CHECK(out.find("CUDA include") == std::string::npos);
  CHECK(out.find("cuda_bf16.h") == std::string::npos);
}

TEST_CASE("gc --max-size takes every size below 2^64 and refuses the rest", "[cli]") {
  TempDir cache;
  std::string out;
  // 10^19 bytes is past a long long but below 2^64: 9094947.0 TiB, not 2^63; 8388608T is 2^63.
  for (const auto& [size, limit] :
       {std::pair<const char*, const char*>{"10000000000000000000", "(limit 9094947.0 TiB)"},
        {"8388608T", "(limit 8388608.0 TiB)"}}) {
    const int rc = cli(std::string("gc --max-size ") + size, &out, cache.path());
    INFO(size << "\n" << out);
    CHECK(rc == 0);
    CHECK(out.find(limit) != std::string::npos);
  }
  for (const char* bad : {"18446744073709551616", "16777216T", "-1", "1e30", "nan"}) {
    const int rc = cli(std::string("gc --max-size ") + bad, &out, cache.path());
    INFO(bad << "\n" << out);
    CHECK(rc == 2);
    CHECK(out.find("bad --max-size") != std::string::npos);
  }
}

TEST_CASE("doctor names the toolkit's driver stub as a stub, not an old driver", "[cli]") {
  // The stub libcuda.so (for linking only) first on the library path, as a misconfigured
  // container has it.
  std::string stub;
  for (const char* root : {static_cast<const char*>(std::getenv("CUDA_HOME")), "/usr/local/cuda"}) {
    if (root == nullptr) continue;
    for (const char* lib : {"lib64", "lib", "targets/x86_64-linux/lib"}) {
      const std::string path = std::string(root) + "/" + lib + "/stubs/libcuda.so";
      if (stub.empty() && std::ifstream(path).good()) stub = path;
    }
  }
  if (stub.empty()) {
    WARN(
        "SKIPPED: no CUDA toolkit driver stub (stubs/libcuda.so) under $CUDA_HOME or "
        "/usr/local/cuda");
    return;
  }
  TempDir dir;
  std::string out;
  REQUIRE(run_command("ln -s " + quote(stub) + " " + quote(dir.path() + "/libcuda.so.1"), &out) ==
          0);
  const int rc = run_command("env LD_LIBRARY_PATH=" + quote(dir.path()) + " MOEJIT_CACHE_DIR=" +
                                 quote(dir.path() + "/cache") + " " + quote(cli_path()) + " doctor",
                             &out);
  INFO(out);
  CHECK(rc == 0);
  CHECK(out.find("the CUDA toolkit's stub") != std::string::npos);
  CHECK(out.find("update the NVIDIA driver") == std::string::npos);
  CHECK(out.find("--arch") != std::string::npos);
}

TEST_CASE("README's shape example is a valid shape file", "[cli]") {
  std::string readme = moejit::test::read_text(source_dir() + "/README.md");
  REQUIRE_FALSE(readme.empty());
  const std::string open = "```json\n";
  std::size_t begin = readme.find(open);
  REQUIRE(begin != std::string::npos);
  begin += open.size();
  std::size_t end = readme.find("```", begin);
  REQUIRE(end != std::string::npos);
  std::string example = readme.substr(begin, end - begin);

  std::vector<moejit::ModelShape> shapes = moejit::parse_shapes(example, "README.md");
  REQUIRE_FALSE(shapes.empty());

  // And the CLI takes it: the first shape's kernels generate.
  TempDir dir;
  std::string path = dir.path() + "/readme-example.json";
  write_file(path, example);
  REQUIRE(shapes[0].shared.count > 0);
  std::string out;
  int rc =
      cli("source " + quote(path) + " --shape " + quote(shapes[0].name) + " --kernel append_shared",
          &out);
  INFO(out);
  CHECK(rc == 0);
}
