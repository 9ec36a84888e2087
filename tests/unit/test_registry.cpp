// The process shape registry: all-or-nothing per file, a name registered once, safe under
// threads. The registry is process-wide, so every name here is unique to its test.
#include <catch2/catch.hpp>

#include <algorithm>
#include <atomic>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "moejit/error.hpp"
#include "moejit/runtime.hpp"
#include "support/support.hpp"

namespace {

std::string shape(const std::string& name, int hidden = 64) {
  return R"({"name": ")" + name + R"(", "num_experts": 8, "top_k": 2, "hidden": )" +
         std::to_string(hidden) + R"(, "intermediate": 64, "activation": {"kind": "swiglu"}})";
}

std::string file_of(const std::vector<std::string>& shapes) {
  std::string text = "{\"shapes\": [\n";
  for (std::size_t i = 0; i < shapes.size(); ++i) text += (i ? ",\n" : "") + shapes[i];
  return text + "\n]}";
}

bool is_registered(const std::string& name) {
  auto names = moejit::registered_shape_names();
  return std::find(names.begin(), names.end(), name) != names.end();
}

}  // namespace

TEST_CASE("registered shapes can be looked up", "[registry]") {
  auto names = moejit::register_shapes(file_of({shape("reg-lookup-a"), shape("reg-lookup-b", 96)}),
                                       "lookup.json");
  CHECK(names == std::vector<std::string>{"reg-lookup-a", "reg-lookup-b"});
  CHECK(is_registered("reg-lookup-a"));
  CHECK(is_registered("reg-lookup-b"));
  moejit::ModelShape b = moejit::registered_shape("reg-lookup-b");
  CHECK(b.hidden == 96);
  CHECK(b.source == "lookup.json:3");
  auto listed = moejit::registered_shape_names();
  CHECK(std::is_sorted(listed.begin(), listed.end()));
}

TEST_CASE("an unknown name is an invalid argument that lists what is registered", "[registry]") {
  moejit::register_shapes(shape("reg-known"), "known.json");
  try {
    moejit::registered_shape("reg-never-registered");
    FAIL("an unknown name was found");
  } catch (const moejit::Error& e) {
    CHECK(e.code() == moejit::ErrorCode::kInvalidArgument);
    std::string m = e.what();
    CHECK(m.find("\"reg-never-registered\"") != std::string::npos);
    CHECK(m.find("reg-known") != std::string::npos);
  }
}

TEST_CASE("a name registered twice is refused, naming both sources", "[registry]") {
  moejit::register_shapes(file_of({shape("reg-twice")}), "first.json");
  try {
    moejit::register_shapes(file_of({shape("reg-twice-other"), shape("reg-twice")}),
                            "second.json");
    FAIL("a name was registered twice");
  } catch (const moejit::DescriptorError& e) {
    std::string m = e.what();
    CHECK(e.file() == "second.json");
    CHECK(e.pointer() == "/shapes/1/name");
    CHECK(e.line() == 3);
    CHECK(e.column() == 10);
    CHECK(m.rfind("second.json:3:10: /shapes/1/name: ", 0) == 0);
    CHECK(m.find("already registered (from first.json:2)") != std::string::npos);
    CHECK(m.find("second.json:3") != std::string::npos);
  }
  // All or nothing: the new name of the refused file was not registered either.
  CHECK_FALSE(is_registered("reg-twice-other"));
  CHECK(moejit::registered_shape("reg-twice").source == "first.json:2");
}

TEST_CASE("a bad file registers nothing", "[registry]") {
  std::string text = file_of({shape("reg-bad-good"), shape("reg-bad-bad", 65)});
  CHECK_THROWS_AS(moejit::register_shapes(text, "bad.json"), moejit::DescriptorError);
  CHECK_FALSE(is_registered("reg-bad-good"));
  CHECK_FALSE(is_registered("reg-bad-bad"));
}

TEST_CASE("shape files register from disk", "[registry]") {
  moejit::test::TempDir dir;
  std::string path = dir.path() + "/engine.json";
  std::ofstream(path) << file_of({shape("reg-file-a"), shape("reg-file-b")});
  auto names = moejit::register_shapes_file(path);
  CHECK(names == std::vector<std::string>{"reg-file-a", "reg-file-b"});
  CHECK(moejit::registered_shape("reg-file-a").source == path + ":2");
  try {
    moejit::register_shapes_file(dir.path() + "/missing.json");
    FAIL("a missing file registered");
  } catch (const moejit::Error& e) {
    CHECK(e.code() == moejit::ErrorCode::kIo);
  }
}

TEST_CASE("concurrent registration is safe and each name wins once", "[registry]") {
  constexpr int kThreads = 8;
  constexpr int kRounds = 20;
  std::atomic<int> contested_wins{0};
  std::atomic<int> contested_refusals{0};
  std::atomic<int> unexpected{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int r = 0; r < kRounds; ++r) {
        try {
          std::string own = "reg-thread-" + std::to_string(t) + "-" + std::to_string(r);
          moejit::register_shapes(file_of({shape(own)}), "own.json");
          // Every thread tries the same pair of names each round; exactly one may win.
          std::string contested = "reg-contested-" + std::to_string(r);
          try {
            moejit::register_shapes(file_of({shape(contested + "-x"), shape(contested + "-y")}),
                                    "thread" + std::to_string(t) + ".json");
            ++contested_wins;
          } catch (const moejit::DescriptorError&) {
            ++contested_refusals;
          }
          moejit::registered_shape(own);
          moejit::registered_shape_names();
        } catch (...) {
          ++unexpected;
        }
      }
    });
  }
  for (auto& th : threads) th.join();
  CHECK(unexpected == 0);
  CHECK(contested_wins == kRounds);
  CHECK(contested_refusals == kRounds * (kThreads - 1));
  for (int r = 0; r < kRounds; ++r) {
    std::string contested = "reg-contested-" + std::to_string(r);
    // Both names of a file come from the same winner.
    auto file = [](const std::string& source) { return source.substr(0, source.rfind(':')); };
    CHECK(file(moejit::registered_shape(contested + "-x").source) ==
          file(moejit::registered_shape(contested + "-y").source));
    for (int t = 0; t < kThreads; ++t) {
      CHECK(is_registered("reg-thread-" + std::to_string(t) + "-" + std::to_string(r)));
    }
  }
}
