// `moejit prewarm` and the cache subcommands end to end, on a CPU-only machine: compile the
// reference shapes for two archs into a private cache, then list, verify, heal, gc and clear it.
#include <unistd.h>

#include <algorithm>
#include <catch2/catch.hpp>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <iterator>
#include <map>
#include <regex>
#include <string>
#include <vector>

#include "cache/disk_cache.hpp"
#include "moejit/kernel_spec.hpp"
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

int cli(const std::string& cache_dir, const std::string& args, std::string* output) {
  const char* path = std::getenv("MOEJIT_TEST_CLI");
  if (path == nullptr) throw std::runtime_error("MOEJIT_TEST_CLI is not set (run via ctest)");
  return run_command("env -u MOEJIT_CACHE_MODE MOEJIT_CACHE_DIR=" + quote(cache_dir) + " " +
                         quote(path) + " " + args,
                     output);
}

struct Summary {
  bool found = false;
  int kernels = 0;
  int compiled = 0;
  int cached = 0;
  int failed = 0;
};

// "prewarm: 4 kernel(s) for sm_90a,sm_100a: 4 compiled, 0 already cached, 0 failed in ..."
Summary parse_summary(const std::string& out) {
  static const std::regex pattern(
      R"(prewarm: (\d+) kernel\(s\) for [^:]*: (\d+) compiled, )"
      R"((\d+) already cached, (\d+) failed)");
  Summary s;
  std::smatch m;
  if (std::regex_search(out, m, pattern)) {
    s.found = true;
    s.kernels = std::stoi(m[1]);
    s.compiled = std::stoi(m[2]);
    s.cached = std::stoi(m[3]);
    s.failed = std::stoi(m[4]);
  }
  return s;
}

std::vector<moejit::detail::EntryInfo> entries(const std::string& dir) {
  return moejit::detail::DiskCache(dir, moejit::CacheMode::kReadOnly).list(false);
}

uint64_t total_bytes(const std::vector<moejit::detail::EntryInfo>& list) {
  uint64_t total = 0;
  for (const auto& e : list) total += e.file_size;
  return total;
}

// The distinct kernels the reference shapes need on `archs` (what prewarm must compile).
std::size_t distinct_kernels(const std::string& file, const std::vector<std::string>& archs) {
  std::vector<moejit::KernelSpec> specs;
  for (const moejit::ModelShape& shape : moejit::load_shapes_file(file)) {
    for (const std::string& arch : archs) {
      for (const moejit::KernelSpec& spec :
           moejit::plan_kernels(shape, moejit::Arch::parse(arch))) {
        if (!moejit::supports(spec).empty()) continue;
        if (std::find(specs.begin(), specs.end(), spec) == specs.end()) specs.push_back(spec);
      }
    }
  }
  return specs.size();
}

// Flips the last byte of a file (inside the cubin), keeping its permissions.
void corrupt(const std::string& path) {
  namespace fs = std::filesystem;
  fs::perms before = fs::status(path).permissions();
  fs::permissions(path, fs::perms::owner_read | fs::perms::owner_write, fs::perm_options::add);
  std::string bytes;
  {
    std::ifstream in(path, std::ios::binary);
    bytes.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  }
  REQUIRE_FALSE(bytes.empty());
  bytes.back() = static_cast<char>(~static_cast<unsigned char>(bytes.back()));
  {
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    REQUIRE(out.good());
  }
  fs::permissions(path, before, fs::perm_options::replace);
}

}  // namespace

TEST_CASE("prewarm fills a cache that list, verify, gc and clear then maintain", "[cli]") {
  TempDir root;
  const std::string cache = root.path() + "/cache";
  const std::string shapes = moejit::test::shapes_dir() + "/reference.json";
  const std::size_t expected = distinct_kernels(shapes, {"sm_90a", "sm_100a"});
  REQUIRE(expected > 0);
  const std::string prewarm = "prewarm " + quote(shapes) + " --arch sm_90a,sm_100a -j 2";
  std::string out;

  // First run: everything compiles.
  int rc = cli(cache, prewarm, &out);
  {
    INFO(out);
    REQUIRE(rc == 0);
    Summary s = parse_summary(out);
    REQUIRE(s.found);
    CHECK(s.compiled == static_cast<int>(expected));
    CHECK(s.failed == 0);
    CHECK(s.compiled + s.cached == s.kernels);
    CHECK(out.find("] compiled ") != std::string::npos);  // progress lines
    CHECK(out.find("@sm_100a") != std::string::npos);
  }

  // The cache is created private: directories 0700, entries 0600.
  namespace fs = std::filesystem;
  const auto modes = [&cache] {
    std::map<std::string, fs::perms> out;
    out[cache] = fs::status(cache).permissions();
    for (const auto& e : fs::recursive_directory_iterator(cache)) {
      if (!e.is_symlink()) out[e.path().string()] = e.symlink_status().permissions();
    }
    return out;
  };
  const fs::perms others = fs::perms::group_all | fs::perms::others_all;
  for (const auto& [path, perms] : modes()) {
    INFO(path);
    CHECK((perms & others) == fs::perms::none);
  }

  // Second run: nothing to do; --readable opens the cache to reading, never to writing.
  rc = cli(cache, prewarm + " --readable", &out);
  {
    INFO(out);
    REQUIRE(rc == 0);
    Summary s = parse_summary(out);
    REQUIRE(s.found);
    CHECK(s.compiled == 0);
    CHECK(s.cached == s.kernels);
    CHECK(s.failed == 0);
    CHECK(out.find("readable by every user") != std::string::npos);
    // Entries not owned by root are trusted by their owner alone, which prewarm says.
    CHECK((out.find("other users will not trust these entries") != std::string::npos) ==
          (::geteuid() != 0));
  }
  for (const auto& [path, perms] : modes()) {
    INFO(path);
    const bool dir = fs::is_directory(path);
    CHECK((perms & fs::perms::others_read) != fs::perms::none);
    CHECK((perms & fs::perms::group_read) != fs::perms::none);
    if (dir) CHECK((perms & fs::perms::others_exec) != fs::perms::none);
    CHECK((perms & (fs::perms::group_write | fs::perms::others_write)) == fs::perms::none);
  }

  // list shows every entry, with its arch.
  rc = cli(cache, "list", &out);
  {
    INFO(out);
    REQUIRE(rc == 0);
    CHECK(out.find(std::to_string(expected) + " entr") != std::string::npos);
    CHECK(out.find("sm_90a") != std::string::npos);
    CHECK(out.find("sm_100a") != std::string::npos);
    CHECK(out.find("append_shared") != std::string::npos);
  }
  std::vector<moejit::detail::EntryInfo> listed = entries(cache);
  REQUIRE(listed.size() == expected);

  // verify: all good.
  rc = cli(cache, "verify", &out);
  {
    INFO(out);
    CHECK(rc == 0);
    CHECK(out.find("0 bad") != std::string::npos);
  }

  // A corrupt entry: verify exits 1 and names it; it is quarantined, and prewarm heals it.
  // Why the smallest: healing recompiles it, and the smallest entry is the quickest to compile.
  const std::string victim =
      std::min_element(listed.begin(), listed.end(), [](const auto& a, const auto& b) {
        return a.file_size < b.file_size;
      })->path;
  corrupt(victim);
  rc = cli(cache, "verify", &out);
  {
    INFO(out);
    CHECK(rc == 1);
    CHECK(out.find(victim) != std::string::npos);
    CHECK(out.find("1 bad") != std::string::npos);
  }
  rc = cli(cache, "verify", &out);
  {
    INFO(out);
    CHECK(rc == 0);  // quarantined: no longer among the entries
    CHECK(entries(cache).size() == expected - 1);
  }
  rc = cli(cache, prewarm, &out);
  {
    INFO(out);
    REQUIRE(rc == 0);
    Summary s = parse_summary(out);
    CHECK(s.compiled == 1);
    CHECK(entries(cache).size() == expected);
  }

  // A copy of the full cache, for clear (so nothing is compiled again after gc).
  const std::string copy = root.path() + "/copy";
  std::filesystem::copy(cache, copy, std::filesystem::copy_options::recursive);
  REQUIRE(entries(copy).size() == expected);

  // gc to half the size, then to 1 byte: the cache ends under each limit.
  const uint64_t full = total_bytes(entries(cache));
  const uint64_t half = full / 2;
  rc = cli(cache, "gc --max-size " + std::to_string(half), &out);
  {
    INFO(out);
    CHECK(rc == 0);
    CHECK(out.find("gc: removed") != std::string::npos);
    CHECK(total_bytes(entries(cache)) <= half);
    CHECK(entries(cache).size() < expected);
  }
  rc = cli(cache, "gc --max-size 1", &out);
  {
    INFO(out);
    CHECK(rc == 0);
    CHECK(total_bytes(entries(cache)) <= 1);
  }

  // clear empties a full cache.
  rc = cli(copy, "clear", &out);
  {
    INFO(out);
    CHECK(rc == 0);
    std::smatch m;
    REQUIRE(std::regex_search(out, m, std::regex(R"(clear: removed (\d+))")));
    CHECK(std::stoul(m[1]) >= expected);  // the entries, and the quarantined file
    CHECK(entries(copy).empty());
  }
  rc = cli(copy, "list", &out);
  INFO(out);
  CHECK(rc == 0);
  CHECK(out.find("0 entries") != std::string::npos);
}

TEST_CASE("prewarm without --arch takes the GPUs' archs, or asks for one", "[cli]") {
  TempDir root;
  std::string out;
  int rc =
      cli(root.path(), "prewarm " + quote(moejit::test::shapes_dir() + "/reference.json"), &out);
  INFO(out);
  std::string why;
  if (moejit::test::gpu_available(&why)) {
    CHECK(rc == 0);
    CHECK(parse_summary(out).found);
    CHECK(out.find("kernel(s) for sm_") != std::string::npos);
  } else {
    CHECK(rc == 2);
    CHECK(out.find("--arch sm_90a") != std::string::npos);
  }
}

TEST_CASE("prewarm refuses a cache it can't write, with exit 4", "[cli]") {
  TempDir root;
  std::string out;
  // A cache dir below a regular file can never be created.
  std::ofstream(root.path() + "/file") << "x";
  int rc = cli(
      root.path() + "/file/cache",
      "prewarm " + quote(moejit::test::shapes_dir() + "/reference.json") + " --arch sm_90a", &out);
  INFO(out);
  CHECK(rc == 4);
  CHECK(out.find("writable") != std::string::npos);
}

TEST_CASE("the cache commands never report work they did not do", "[cli]") {
  namespace fs = std::filesystem;
  TempDir root;
  // One small shape: a handful of kernels, compiled in about a second.
  const std::string shapes = root.path() + "/tiny.json";
  std::ofstream(shapes) << R"({"shapes": [{"name": "tiny", "num_experts": 8, "top_k": 2,
    "hidden": 512, "intermediate": 256, "activation": {"kind": "swiglu"}, "max_tokens": 1}]})";
  const std::string prewarm = "prewarm " + quote(shapes) + " --arch sm_90a -j 2";
  std::string out;

  SECTION("prewarm whose kernels the cache can't take exits 4 and counts them apart") {
    // Every shard name taken by a regular file: the cache is writable, but no entry can be
    // published (root included).
    const std::string cache = root.path() + "/cache";
    fs::create_directories(cache + "/v" + std::to_string(moejit::kCacheSchemaVersion));
    fs::permissions(cache, fs::perms::owner_all, fs::perm_options::replace);
    for (int i = 0; i < 256; ++i) {
      char shard[3];
      std::snprintf(shard, sizeof(shard), "%02x", i);
      std::ofstream(cache + "/v" + std::to_string(moejit::kCacheSchemaVersion) + "/" + shard);
    }
    const int rc = cli(cache, prewarm, &out);
    INFO(out);
    CHECK(rc == 4);
    CHECK(std::regex_search(out, std::regex(R"(0 compiled, \d+ compiled but not stored)")));
    CHECK(out.find("the next process that needs them compiles them again") != std::string::npos);
    CHECK(entries(cache).empty());
  }

  SECTION("verify leaves an untrusted entry in place and says so; list names it") {
    const std::string cache = root.path() + "/cache";
    REQUIRE(cli(cache, prewarm, &out) == 0);
    std::vector<moejit::detail::EntryInfo> listed = entries(cache);
    REQUIRE(listed.size() >= 2);
    // Group-writable: another user could have written it, so it is never loaded, and verify
    // must not claim to have quarantined it.
    const std::string untrusted = listed[0].path;
    fs::permissions(untrusted, fs::perms::group_write, fs::perm_options::add);
    corrupt(listed[1].path);
    const int rc = cli(cache, "verify", &out);
    {
      INFO(out);
      CHECK(rc == 1);
      CHECK(out.find("2 bad; 1 quarantined") != std::string::npos);
      CHECK(out.find("1 left in place and never loaded") != std::string::npos);
      CHECK(out.find("(entry " + listed[0].key + ")") != std::string::npos);
      CHECK(fs::exists(untrusted));
      CHECK_FALSE(fs::exists(listed[1].path));
    }
    CHECK(cli(cache, "list", &out) == 0);
    INFO(out);
    CHECK(out.find(listed[0].key) != std::string::npos);  // the key, from the file name
    CHECK(out.find("untrusted") != std::string::npos);
    CHECK(out.find("1 with a problem") != std::string::npos);
  }

  SECTION("gc and clear exit 1 when files can't be removed") {
    if (::geteuid() == 0) {
      std::cout << "SKIPPED: gc and clear with a read-only shard: running as root, which "
                   "ignores directory permissions\n";
      return;
    }
    const std::string cache = root.path() + "/cache";
    REQUIRE(cli(cache, prewarm, &out) == 0);
    std::vector<moejit::detail::EntryInfo> listed = entries(cache);
    REQUIRE_FALSE(listed.empty());
    const fs::path shard = fs::path(listed[0].path).parent_path();
    fs::permissions(shard, fs::perms::owner_read | fs::perms::owner_exec,
                    fs::perm_options::replace);
    int rc = cli(cache, "gc --max-size 0", &out);
    {
      INFO(out);
      CHECK(rc == 1);
      CHECK(out.find("still over the limit") != std::string::npos);
    }
    rc = cli(cache, "clear", &out);
    {
      INFO(out);
      CHECK(rc == 1);
      CHECK(out.find("could not be removed") != std::string::npos);
    }
    fs::permissions(shard, fs::perms::owner_all, fs::perm_options::replace);
  }
}

TEST_CASE("prewarm's --arch takes one value each time, before, between or after the files",
          "[cli]") {
  TempDir root;
  const std::string cache = root.path() + "/cache";
  std::string files;
  for (const char* name : {"tiny-a", "tiny-b"}) {
    const std::string path = root.path() + "/" + name + ".json";
    std::ofstream(path) << R"({"shapes": [{"name": ")" << name << R"(", "num_experts": 8,
      "top_k": 2, "hidden": 512, "intermediate": 256, "activation": {"kind": "swiglu"},
      "max_tokens": 1}]})";
    files += " " + quote(path);
  }
  // Why: a vector option takes every argument up to the next flag by default, so the first file
  // after `--arch sm_90a` used to be read as an arch.
  for (const std::string& args :
       {"--arch sm_90a" + files, files + " --arch sm_90a", "--arch sm_90a --arch sm_100a" + files,
        files + " --arch sm_90a,sm_100a -j 2"}) {
    std::string out;
    const int rc = cli(cache, "prewarm " + args, &out);
    INFO(args << "\n" << out);
    CHECK(rc == 0);
    const Summary s = parse_summary(out);
    REQUIRE(s.found);
    CHECK(s.failed == 0);
    CHECK(out.find("2 shape(s)") != std::string::npos);
  }
}
