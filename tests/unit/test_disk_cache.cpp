// DiskCache: entry format, atomic publish under SIGKILL, verification and quarantine, trust,
// modes (a full disk included), LRU gc (racing other processes), locks (bounded waits, entries
// published while waiting, forked holders).
#include <fcntl.h>
#include <signal.h>
#include <spdlog/sinks/base_sink.h>
#include <sys/file.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <catch2/catch.hpp>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iostream>
#include <limits>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "cache/disk_cache.hpp"
#include "common/hash.hpp"
#include "common/log.hpp"
#include "moejit/error.hpp"
#include "moejit/version.hpp"
#include "support/log_capture.hpp"
#include "support/support.hpp"

namespace fs = std::filesystem;
using moejit::CacheMode;
using moejit::detail::DiskCache;
using moejit::detail::Entry;

namespace {

using LogCapture = moejit::test::WarningCapture;

std::string key_for(const std::string& name) { return moejit::detail::hash_bytes(name).hex(); }

// Deterministic pseudo-random bytes.
std::string pseudo_random_bytes(std::size_t size, uint64_t seed) {
  std::string out(size, '\0');
  uint64_t x = seed * 0x9e3779b97f4a7c15ull + 0x1234567ull;
  for (std::size_t i = 0; i < size; i += 8) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    std::memcpy(out.data() + i, &x, std::min<std::size_t>(8, size - i));
  }
  return out;
}

// An entry for `key` whose cubin is an ELF image carrying `cubin_size` pseudo-random bytes of
// `seed`.
Entry make_entry(const std::string& key, std::size_t cubin_size, uint64_t seed) {
  Entry e;
  e.manifest.key = key;
  e.manifest.kernel = "append_shared<k6,s1,i32,sigmoid,bf16>@sm_90a";
  e.manifest.spec_json = R"({"family":"append_shared","top_k":6})";
  e.manifest.lowered_name = "_Z13append_sharedILi6ELi1EEvv";
  e.manifest.options = {"--gpu-architecture=sm_90a", "-std=c++17", "-DSEED=" +
                                                                    std::to_string(seed)};
  e.manifest.nvrtc_version = "13.0";
  e.manifest.library_version = moejit::kVersionString;
  e.manifest.compile_ms = 812.5;
  e.manifest.ptxas_info = "ptxas info: Used 40 registers, 0 bytes spill";
  e.manifest.created_unix = 1700000000;
  e.cubin = moejit::test::cubin_image(pseudo_random_bytes(cubin_size, seed));
  return e;
}

void write_file(const std::string& path, const std::string& bytes) {
  int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
  REQUIRE(fd >= 0);
  REQUIRE(::write(fd, bytes.data(), bytes.size()) == static_cast<ssize_t>(bytes.size()));
  ::close(fd);
}

void flip_bit(const std::string& path, uint64_t offset) {
  std::string bytes = moejit::test::read_text(path);
  REQUIRE(offset < bytes.size());
  bytes[offset] = static_cast<char>(bytes[offset] ^ 0x10);
  write_file(path, bytes);
}

void set_mtime(const std::string& path, int64_t unix_seconds) {
  struct timespec times[2];
  times[0].tv_sec = unix_seconds;
  times[0].tv_nsec = 0;
  times[1] = times[0];
  REQUIRE(::utimensat(AT_FDCWD, path.c_str(), times, AT_SYMLINK_NOFOLLOW) == 0);
}

// Binds a Unix socket to `path` and closes it, which leaves the socket file there. Why through
// /proc/self/fd: a socket's address holds at most 107 bytes, which a long TMPDIR would pass.
void make_socket_file(const std::string& path) {
  const std::size_t slash = path.rfind('/');
  const int dir = ::open(path.substr(0, slash).c_str(), O_RDONLY | O_DIRECTORY);
  REQUIRE(dir >= 0);
  const std::string address_path =
      "/proc/self/fd/" + std::to_string(dir) + "/" + path.substr(slash + 1);
  const int fd = ::socket(AF_UNIX, SOCK_STREAM, 0);
  REQUIRE(fd >= 0);
  sockaddr_un address{};
  address.sun_family = AF_UNIX;
  REQUIRE(address_path.size() < sizeof(address.sun_path));
  std::memcpy(address.sun_path, address_path.c_str(), address_path.size() + 1);
  const int bound = ::bind(fd, reinterpret_cast<const sockaddr*>(&address), sizeof(address));
  ::close(fd);
  ::close(dir);
  REQUIRE(bound == 0);
  struct stat st {};
  REQUIRE(::lstat(path.c_str(), &st) == 0);
  REQUIRE(S_ISSOCK(st.st_mode));
}

int64_t now_unix() {
  return std::chrono::duration_cast<std::chrono::seconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

// Every file and dir under `root`: path -> (size, mtime ns, mode). Empty if `root` is absent.
std::map<std::string, std::string> snapshot(const std::string& root) {
  std::map<std::string, std::string> out;
  std::error_code ec;
  if (!fs::exists(root, ec)) return out;
  for (auto it = fs::recursive_directory_iterator(root); it != fs::recursive_directory_iterator();
       ++it) {
    struct stat st {};
    ::lstat(it->path().c_str(), &st);
    out[it->path().string()] = std::to_string(st.st_size) + " " +
                               std::to_string(st.st_mtim.tv_sec) + "." +
                               std::to_string(st.st_mtim.tv_nsec) + " " +
                               std::to_string(st.st_mode);
  }
  return out;
}

std::vector<std::string> files_in(const std::string& dir) {
  std::vector<std::string> out;
  std::error_code ec;
  if (!fs::exists(dir, ec)) return out;
  for (const auto& e : fs::directory_iterator(dir)) out.push_back(e.path().string());
  std::sort(out.begin(), out.end());
  return out;
}

// Writers' temp files anywhere under the cache's version dir.
std::vector<std::string> temp_files(const std::string& cache_dir) {
  std::vector<std::string> out;
  std::string version_dir = cache_dir + "/v" + std::to_string(moejit::kCacheSchemaVersion);
  std::error_code ec;
  if (!fs::exists(version_dir, ec)) return out;
  for (auto it = fs::recursive_directory_iterator(version_dir, ec);
       !ec && it != fs::recursive_directory_iterator(); it.increment(ec)) {
    std::string name = it->path().filename().string();
    if (name.size() > 4 && name[0] == '.' && name.substr(name.size() - 4) == ".tmp") {
      out.push_back(it->path().string());
    }
  }
  std::sort(out.begin(), out.end());
  return out;
}

mode_t mode_of(const std::string& path) {
  struct stat st {};
  REQUIRE(::lstat(path.c_str(), &st) == 0);
  return st.st_mode & 07777;
}

// Kills and reaps a forked child on scope exit, so a failed assertion never leaves it running.
class ChildGuard {
 public:
  explicit ChildGuard(pid_t pid) : pid_(pid) {}
  ~ChildGuard() {
    if (pid_ > 0) kill_and_wait();
  }
  ChildGuard(const ChildGuard&) = delete;
  ChildGuard& operator=(const ChildGuard&) = delete;
  // The wait status.
  int kill_and_wait() {
    ::kill(pid_, SIGKILL);
    int status = 0;
    while (::waitpid(pid_, &status, 0) < 0 && errno == EINTR) {
    }
    pid_ = -1;
    return status;
  }

 private:
  pid_t pid_;
};

bool running_as_root() { return ::geteuid() == 0; }

// The cache's test hooks for the holder's lifetime, none after.
class HooksSet {
 public:
  explicit HooksSet(moejit::detail::CacheTestHooks hooks) {
    moejit::detail::set_cache_test_hooks(std::move(hooks));
  }
  ~HooksSet() { moejit::detail::set_cache_test_hooks({}); }
  HooksSet(const HooksSet&) = delete;
  HooksSet& operator=(const HooksSet&) = delete;
};

void print_skip(const std::string& what, const std::string& why) {
  std::cout << "SKIPPED: " << what << ": " << why << std::endl;
}

}  // namespace

TEST_CASE("an entry round-trips with its manifest; a miss is nullopt", "[cache]") {
  moejit::test::TempDir tmp;
  const std::string dir = tmp.path() + "/nested/cache";
  DiskCache cache(dir, CacheMode::kReadWrite);
  REQUIRE(cache.effective_mode() == CacheMode::kReadWrite);
  REQUIRE(cache.mode_reason().empty());

  const std::string key = key_for("round-trip");
  REQUIRE_FALSE(cache.load(key).has_value());

  const Entry original = make_entry(key, 100003, 7);
  REQUIRE(cache.store(original));

  const std::string path = cache.entry_path(key);
  CHECK(path == dir + "/v" + std::to_string(moejit::kCacheSchemaVersion) + "/" +
                    key.substr(0, 2) + "/" + key + ".mjc");
  REQUIRE(fs::is_regular_file(path));
  CHECK(mode_of(path) == 0600);
  CHECK(mode_of(dir) == 0700);
  CHECK(mode_of(tmp.path() + "/nested") == 0700);
  CHECK(mode_of(fs::path(path).parent_path().string()) == 0700);

  std::optional<Entry> loaded = cache.load(key);
  REQUIRE(loaded.has_value());
  CHECK(loaded->cubin == original.cubin);
  const auto& m = loaded->manifest;
  const auto& o = original.manifest;
  CHECK(m.key == key);
  CHECK(m.kernel == o.kernel);
  CHECK(m.spec_json == o.spec_json);
  CHECK(m.lowered_name == o.lowered_name);
  CHECK(m.options == o.options);
  CHECK(m.nvrtc_version == o.nvrtc_version);
  CHECK(m.library_version == o.library_version);
  CHECK(m.compile_ms == o.compile_ms);
  CHECK(m.ptxas_info == o.ptxas_info);
  CHECK(m.created_unix == o.created_unix);
  CHECK(m.cubin_size == original.cubin.size());
  CHECK(m.cubin_hash == moejit::detail::hash_bytes(original.cubin).hex());
  // The file is the 64-byte header, the manifest, then the cubin.
  CHECK(fs::file_size(path) ==
        64 + moejit::detail::manifest_to_json(m).size() + original.cubin.size());

  // A second, independent instance sees it too, and so does list().
  DiskCache again(dir, CacheMode::kReadWrite);
  REQUIRE(again.load(key).has_value());
  auto listed = again.list(false);
  REQUIRE(listed.size() == 1);
  CHECK(listed[0].path == path);
  CHECK(listed[0].problem.empty());
  CHECK(listed[0].manifest.kernel == o.kernel);
  CHECK(listed[0].file_size == fs::file_size(path));
  REQUIRE(again.list(true).size() == 1);
  CHECK(again.list(true)[0].problem.empty());

  // Another key misses.
  CHECK_FALSE(cache.load(key_for("other")).has_value());

  // Malformed keys are refused before any path is built from them.
  for (const std::string& bad : std::vector<std::string>{
           "", "../../etc/passwd", std::string(32, 'G'), key + "0",
           std::string("ABCDEF") + key.substr(6)}) {
    try {
      (void)cache.load(bad);
      FAIL("load accepted the malformed key '" << bad << "'");
    } catch (const moejit::Error& e) {
      CHECK(e.code() == moejit::ErrorCode::kInvalidArgument);
    }
  }
}

TEST_CASE("a relative cache directory stays where it was when the cache was made", "[cache]") {
  moejit::test::TempDir tmp;
  fs::create_directories(tmp.path() + "/first");
  fs::create_directories(tmp.path() + "/second");
  struct Restore {
    fs::path to;
    ~Restore() {
      std::error_code ignored;
      fs::current_path(to, ignored);
    }
  } restore{fs::current_path()};
  fs::current_path(tmp.path() + "/first");
  const std::string first = fs::current_path().string();  // getcwd's spelling of it

  DiskCache cache("rel/./cache/", CacheMode::kReadWrite);
  REQUIRE(cache.effective_mode() == CacheMode::kReadWrite);
  CHECK(cache.dir() == first + "/rel/cache");
  // A later chdir (a daemon's chdir("/")) must not move the entries, nor the locks.
  fs::current_path(tmp.path() + "/second");
  const std::string key = key_for("relative");
  {
    DiskCache::Lock lock = cache.lock(key);
    CHECK(lock.held());
    REQUIRE(cache.store(make_entry(key, 4096, 3)));
  }
  CHECK(cache.entry_path(key).rfind(first + "/rel/cache/", 0) == 0);
  CHECK(fs::is_regular_file(cache.entry_path(key)));
  CHECK(fs::exists(first + "/rel/cache/locks"));
  CHECK_FALSE(fs::exists(tmp.path() + "/second/rel"));
  CHECK(cache.load(key).has_value());
}

TEST_CASE("corrupt entries are detected, logged, quarantined and reported as misses",
          "[cache]") {
  moejit::test::TempDir tmp;
  const std::string dir = tmp.path() + "/cache";
  DiskCache cache(dir, CacheMode::kReadWrite);
  const std::string quarantine = dir + "/quarantine";

  struct Damage {
    const char* name;
    const char* reason_part;  // expected in the warning
    std::function<void(const std::string& path, const std::string& key)> apply;
  };
  const std::vector<Damage> damages = {
      {"truncated by one byte", "file size",
       [](const std::string& p, const std::string&) {
         REQUIRE(::truncate(p.c_str(), static_cast<off_t>(fs::file_size(p) - 1)) == 0);
       }},
      {"truncated inside the header", "shorter than",
       [](const std::string& p, const std::string&) { REQUIRE(::truncate(p.c_str(), 20) == 0); }},
      {"empty file", "shorter than",
       [](const std::string& p, const std::string&) { REQUIRE(::truncate(p.c_str(), 0) == 0); }},
      {"bit flipped in the magic", "magic",
       [](const std::string& p, const std::string&) { flip_bit(p, 2); }},
      {"bit flipped in the cubin length", "file size",
       [](const std::string& p, const std::string&) { flip_bit(p, 24); }},
      {"bit flipped in the manifest", "manifest hash",
       [](const std::string& p, const std::string&) { flip_bit(p, 64 + 10); }},
      {"bit flipped in the cubin's last byte", "cubin hash",
       [](const std::string& p, const std::string&) { flip_bit(p, fs::file_size(p) - 1); }},
      {"bit flipped in the middle of the cubin", "cubin hash",
       [](const std::string& p, const std::string&) { flip_bit(p, fs::file_size(p) - 5000); }},
      {"extended by garbage", "file size",
       [](const std::string& p, const std::string&) {
         std::string bytes = moejit::test::read_text(p);
         write_file(p, bytes + "garbage");
       }},
      {"another key's entry copied over it", "expected",
       [&](const std::string& p, const std::string& key) {
         const std::string other = key_for("donor-" + key);
         REQUIRE(cache.store(make_entry(other, 9000, 3)));
         write_file(p, moejit::test::read_text(cache.entry_path(other)));
       }},
  };

  int round = 0;
  for (const Damage& damage : damages) {
    SECTION(damage.name) {
      const std::string key = key_for(std::string("victim-") + damage.name);
      REQUIRE(cache.store(make_entry(key, 20000, static_cast<uint64_t>(++round))));
      const std::string path = cache.entry_path(key);
      REQUIRE(cache.load(key).has_value());
      const std::size_t quarantined_before = files_in(quarantine).size();

      damage.apply(path, key);
      LogCapture capture;
      CHECK_FALSE(cache.load(key).has_value());
      INFO(capture.all());
      CHECK(capture.warned({path, damage.reason_part, "quarantine"}));
      CHECK_FALSE(fs::exists(path));
      REQUIRE(files_in(quarantine).size() == quarantined_before + 1);
      CHECK(mode_of(quarantine) == 0700);
      // Once moved away it is an ordinary miss, and a fresh publish heals it.
      CHECK_FALSE(cache.load(key).has_value());
      REQUIRE(cache.store(make_entry(key, 20000, 99)));
      REQUIRE(cache.load(key).has_value());
      CHECK(cache.load(key)->cubin == make_entry(key, 20000, 99).cubin);
    }
  }
}

// Other processes racing the quarantine of a bad entry: one publishes a good entry at its path
// just before the bad file is moved (so the move takes the good one), and with `newer`, another
// publishes yet another entry there before the good one is moved back. Both with the no-replace
// rename and with the link and unlink that stand in for it where a filesystem lacks it (EINVAL).
TEST_CASE("a good entry the quarantine moved goes back, unless a newer one took its path",
          "[cache]") {
  for (const int rename_error : {0, EINVAL}) {
    for (const bool newer : {false, true}) {
      INFO((rename_error == 0 ? "no-replace rename" : "link and unlink (rename: EINVAL)")
           << (newer ? ", a newer entry published before the move back" : ""));
      moejit::test::TempDir tmp;
      const std::string dir = tmp.path() + "/cache";
      const std::string quarantine = dir + "/quarantine";
      DiskCache cache(dir, CacheMode::kReadWrite);
      const std::string key = key_for("quarantine-race");
      const std::string path = cache.entry_path(key);
      REQUIRE(cache.store(make_entry(key, 20000, 1)));
      flip_bit(path, fs::file_size(path) - 1);
      const auto publish = [&](uint64_t seed) {
        DiskCache other(dir, CacheMode::kReadWrite);
        CHECK(other.store(make_entry(key, 20000, seed)));
      };
      moejit::detail::CacheTestHooks hooks;
      hooks.no_replace_rename_error = rename_error;
      hooks.before_quarantine_rename = [&] { publish(2); };
      if (newer) hooks.after_quarantine_rename = [&] { publish(3); };
      {
        HooksSet set(hooks);
        LogCapture capture;
        CHECK_FALSE(cache.load(key).has_value());  // the file checked was the bad one
        INFO(capture.all());
        CHECK(capture.warned({path, "cubin hash", "it had just been replaced"}));
        CHECK_FALSE(capture.warned({"moved to"}));
        CHECK_FALSE(capture.warned({"could not be moved back"}));
      }
      // Neither the good entry the move took nor (once the newer one is there) its redundant
      // copy is left in quarantine/; the bad file went when the first good one replaced it.
      CHECK(fs::is_directory(quarantine));
      CHECK(files_in(quarantine).empty());
      const std::optional<Entry> loaded = cache.load(key);
      REQUIRE(loaded.has_value());
      CHECK(loaded->cubin == make_entry(key, 20000, newer ? 3 : 2).cubin);
      struct stat st {};
      REQUIRE(::lstat(path.c_str(), &st) == 0);
      CHECK(st.st_nlink == 1);
      CHECK(temp_files(dir).empty());
    }
  }
}

// An entry file's 64-byte header for a manifest's text and a cubin of `cubin_length` bytes whose
// digest is `cubin_digest`, as DiskCache::store writes it.
std::string entry_header(const std::string& manifest, uint64_t cubin_length,
                         const moejit::detail::Digest& cubin_digest) {
  const moejit::detail::Digest manifest_digest = moejit::detail::hash_bytes(manifest);
  unsigned char header[64] = {'m', 'o', 'e', 'j', 'i', 't', 'c', '\n'};
  const auto put = [&header](std::size_t at, uint64_t value, int bytes) {
    for (int i = 0; i < bytes; ++i) header[at + i] = static_cast<unsigned char>(value >> (8 * i));
  };
  put(8, static_cast<uint64_t>(moejit::kCacheSchemaVersion), 4);
  put(12, 64, 4);
  put(16, manifest.size(), 8);
  put(24, cubin_length, 8);
  put(32, cubin_digest.high, 8);
  put(40, cubin_digest.low, 8);
  put(48, manifest_digest.high, 8);
  put(56, manifest_digest.low, 8);
  return std::string(reinterpret_cast<const char*>(header), sizeof(header));
}

// The entry file for `key` with a header and manifest that agree with each other, claiming a
// manifest of `manifest_padding` extra spaces and a cubin of `cubin_length` bytes (zeros, with
// the file extended sparsely to match), as a writer that stored such lengths would have left it.
void write_huge_entry(const std::string& path, const std::string& key, std::size_t manifest_padding,
                      uint64_t cubin_length) {
  moejit::detail::Manifest m = make_entry(key, 0, 1).manifest;
  m.cubin_size = cubin_length;
  m.cubin_hash = std::string(32, '0');  // the cubin digest: all zeros
  const std::string manifest =
      moejit::detail::manifest_to_json(m) + std::string(manifest_padding, ' ');
  write_file(path, entry_header(manifest, cubin_length, moejit::detail::Digest{}) + manifest);
  REQUIRE(::truncate(path.c_str(), static_cast<off_t>(64 + manifest.size() + cubin_length)) == 0);
}

// The entry file for `entry` as a writer that skipped the writer's checks would leave it: the
// header's lengths and both digests agree with `manifest` (entry's manifest as JSON, cubin size
// and digest filled in, unless given) and the cubin, so only what they hold can be wrong.
void forge_entry(const std::string& path, const Entry& entry, std::string manifest = "") {
  const moejit::detail::Digest cubin_digest = moejit::detail::hash_bytes(entry.cubin);
  if (manifest.empty()) {
    moejit::detail::Manifest m = entry.manifest;
    m.cubin_size = entry.cubin.size();
    m.cubin_hash = cubin_digest.hex();
    manifest = moejit::detail::manifest_to_json(m);
  }
  write_file(path,
             entry_header(manifest, entry.cubin.size(), cubin_digest) + manifest + entry.cubin);
}

TEST_CASE("a header claiming a huge manifest or cubin is a bad entry, not an allocation",
          "[cache]") {
  moejit::test::TempDir tmp;
  const std::string dir = tmp.path() + "/cache";
  DiskCache cache(dir, CacheMode::kReadWrite);
  struct Case {
    const char* name;
    std::size_t manifest_padding;
    uint64_t cubin_length;
  };
  // Why a 1 TiB cubin: a sparse file takes no space, and no machine that runs this test can
  // allocate it, so without the bound load() throws std::bad_alloc.
  for (const Case& c : {Case{"a manifest just over 1 MiB", std::size_t{1} << 20, 1000},
                        Case{"a cubin of 1 TiB", 0, uint64_t{1} << 40}}) {
    SECTION(c.name) {
      const std::string key = key_for(c.name);
      REQUIRE(cache.store(make_entry(key, 100, 1)));  // makes the shard
      const std::string path = cache.entry_path(key);
      write_huge_entry(path, key, c.manifest_padding, c.cubin_length);
      LogCapture capture;
      std::optional<Entry> loaded;
      REQUIRE_NOTHROW(loaded = cache.load(key));
      CHECK_FALSE(loaded.has_value());
      INFO(capture.all());
      CHECK(capture.warned({path, "an entry holds at most 1048576 and 268435456", "moved to"}));
      CHECK_FALSE(fs::exists(path));
      // list(verify) too: the same check before any allocation.
      write_huge_entry(path, key, c.manifest_padding, c.cubin_length);
      std::vector<moejit::detail::EntryInfo> listed;
      REQUIRE_NOTHROW(listed = cache.list(true));
      REQUIRE(listed.size() == 1);
      CHECK(listed[0].problem.find("an entry holds at most") != std::string::npos);
    }
  }
  // The writer refuses what a reader would reject.
  const std::string big = key_for("a cubin over 256 MiB");
  LogCapture capture;
  CHECK_FALSE(cache.store(make_entry(big, (std::size_t{256} << 20) + 1, 2)));
  CHECK(capture.warned({cache.entry_path(big), "not stored", "larger than a reader accepts"}));
  CHECK_FALSE(fs::exists(cache.entry_path(big)));
}

TEST_CASE("list(verify) checks every entry and quarantines the bad ones", "[cache]") {
  moejit::test::TempDir tmp;
  const std::string dir = tmp.path() + "/cache";
  DiskCache cache(dir, CacheMode::kReadWrite);
  const std::string good = key_for("good"), bad = key_for("bad");
  REQUIRE(cache.store(make_entry(good, 5000, 1)));
  REQUIRE(cache.store(make_entry(bad, 5000, 2)));
  flip_bit(cache.entry_path(bad), fs::file_size(cache.entry_path(bad)) - 1);

  // Without verify the cubin is not read: the flip is not seen, nothing moves.
  auto quick = cache.list(false);
  REQUIRE(quick.size() == 2);
  CHECK(quick[0].problem.empty());
  CHECK(quick[1].problem.empty());

  LogCapture capture;
  auto verified = cache.list(true);
  REQUIRE(verified.size() == 2);
  for (const auto& info : verified) {
    if (info.path == cache.entry_path(bad)) {
      CHECK(info.problem.find("cubin hash") != std::string::npos);
      CHECK(info.problem.find("moved to") != std::string::npos);
    } else {
      CHECK(info.path == cache.entry_path(good));
      CHECK(info.problem.empty());
    }
  }
  CHECK(capture.warned({cache.entry_path(bad), "cubin hash"}));
  CHECK_FALSE(fs::exists(cache.entry_path(bad)));
  CHECK(files_in(dir + "/quarantine").size() == 1);
  CHECK(cache.list(true).size() == 1);
}

TEST_CASE("a publisher killed mid-write never leaves a visible partial entry", "[cache]") {
  moejit::test::TempDir tmp;
  const std::string dir = tmp.path() + "/cache";
  const std::size_t kCubinBytes = std::size_t{64} << 20;
  const std::vector<std::string> keys = {key_for("big-0"), key_for("big-1")};
  {
    DiskCache cache(dir, CacheMode::kReadWrite);
    for (std::size_t i = 0; i < keys.size(); ++i) {
      REQUIRE(cache.store(make_entry(keys[i], kCubinBytes, i)));
    }
  }
  DiskCache cache(dir, CacheMode::kReadWrite);
  LogCapture capture;
  // The (inode, mtime) of each final file last verified: a file that has not changed since
  // need not be read again, which keeps the test quick.
  std::map<std::string, std::string> verified;
  auto identity = [](const std::string& path) {
    struct stat st {};
    REQUIRE(::stat(path.c_str(), &st) == 0);
    return std::to_string(st.st_ino) + "@" + std::to_string(st.st_mtim.tv_sec) + "." +
           std::to_string(st.st_mtim.tv_nsec);
  };
  std::set<std::string> known_temps;
  int rounds_with_leftover = 0;
  int entries_replaced = 0;
  // Delays after a new temp file shows up: from "just opened" to "likely published".
  const std::vector<int> kill_delays_ms = {0, 1, 3, 6, 10, 20, 40, 80, 160, 320, 640};
  for (std::size_t round = 0; round < kill_delays_ms.size(); ++round) {
    const pid_t child = ::fork();
    REQUIRE(child >= 0);
    if (child == 0) {
      // The child publishes big entries until it is killed; it never returns to Catch.
      ::prctl(PR_SET_PDEATHSIG, SIGKILL);
      DiskCache writer(dir, CacheMode::kReadWrite);
      for (uint64_t generation = 1;; ++generation) {
        writer.store(make_entry(keys[generation % keys.size()], kCubinBytes,
                                round * 1000 + generation));
      }
    }
    ChildGuard guard(child);
    // Wait until the child is writing a new temp file, then kill it after a varied delay.
    bool saw_temp = false;
    for (int poll = 0; poll < 100000 && !saw_temp; ++poll) {
      for (const std::string& t : temp_files(dir)) {
        // Only an entry's temp file counts (the writer's writability probe is one too).
        const std::string name = fs::path(t).filename().string();
        const bool entry_temp = std::any_of(keys.begin(), keys.end(), [&](const std::string& k) {
          return name.compare(0, k.size() + 1, "." + k) == 0;
        });
        if (entry_temp && known_temps.count(t) == 0) saw_temp = true;
      }
      if (!saw_temp) std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
    if (round == 3) {
      // A reader running while the writer writes only ever sees a whole entry.
      CHECK(cache.load(keys[0]).has_value());
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(kill_delays_ms[round]));
    REQUIRE(WIFSIGNALED(guard.kill_and_wait()));
    CHECK(saw_temp);

    // Leftovers are temp files, never listed as entries; every final-named file verifies.
    bool new_leftover = false;
    for (const std::string& t : temp_files(dir)) new_leftover |= known_temps.insert(t).second;
    rounds_with_leftover += new_leftover ? 1 : 0;
    auto listed = cache.list(false);
    REQUIRE(listed.size() == keys.size());
    for (const auto& info : listed) {
      CHECK(info.problem.empty());
      CHECK(info.path.find(".tmp") == std::string::npos);
    }
    for (const std::string& key : keys) {
      const std::string path = cache.entry_path(key);
      if (verified[path] == identity(path)) continue;
      if (!verified[path].empty()) ++entries_replaced;
      std::optional<Entry> e = cache.load(key);
      REQUIRE(e.has_value());
      CHECK(e->cubin.size() == kCubinBytes + moejit::test::cubin_image("").size());
      verified[path] = identity(path);
    }
  }
  INFO("rounds that left a temp file: " << rounds_with_leftover
                                        << ", entries replaced by the writer: "
                                        << entries_replaced);
  // The kill landed mid-write at least once (else this test proved nothing).
  CHECK(rounds_with_leftover > 0);
  INFO(capture.all());
  CHECK(capture.warning_count() == 0);
  CHECK(files_in(dir + "/quarantine").empty());
  for (const auto& info : cache.list(true)) CHECK(info.problem.empty());

  // Fresh leftovers may belong to a live writer: gc keeps them. Old ones go.
  const std::vector<std::string> leftovers = temp_files(dir);
  REQUIRE_FALSE(leftovers.empty());
  auto report = cache.gc(UINT64_MAX);
  CHECK(report.stale_temp_removed == 0);
  CHECK(temp_files(dir) == leftovers);
  for (const std::string& t : leftovers) set_mtime(t, now_unix() - 3600);
  report = cache.gc(UINT64_MAX);
  CHECK(report.stale_temp_removed == static_cast<int>(leftovers.size()));
  CHECK(report.removed == 0);
  CHECK(temp_files(dir).empty());
  CHECK(cache.list(false).size() == keys.size());
}

TEST_CASE("read-only mode loads but never writes, touches or moves anything", "[cache]") {
  moejit::test::TempDir tmp;
  const std::string dir = tmp.path() + "/cache";
  const std::string a = key_for("ro-a"), b = key_for("ro-b"), bad = key_for("ro-bad");
  {
    DiskCache writer(dir, CacheMode::kReadWrite);
    REQUIRE(writer.store(make_entry(a, 3000, 1)));
    REQUIRE(writer.store(make_entry(b, 3000, 2)));
    REQUIRE(writer.store(make_entry(bad, 3000, 3)));
    flip_bit(writer.entry_path(bad), 64 + 3);
    for (const std::string& k : {a, b, bad}) set_mtime(writer.entry_path(k), 1600000000);
  }
  const auto before = snapshot(tmp.path());

  DiskCache cache(dir, CacheMode::kReadOnly);
  REQUIRE(cache.effective_mode() == CacheMode::kReadOnly);
  LogCapture capture;
  REQUIRE(cache.load(a).has_value());
  CHECK(cache.load(a)->cubin == make_entry(a, 3000, 1).cubin);
  REQUIRE(cache.load(b).has_value());
  CHECK_FALSE(cache.load(key_for("ro-missing")).has_value());
  CHECK_FALSE(cache.load(bad).has_value());
  CHECK(capture.warned({cache.entry_path(bad), "left in place"}));
  CHECK_FALSE(cache.store(make_entry(key_for("ro-new"), 3000, 4)));
  CHECK_FALSE(cache.lock(a).held());
  auto verified = cache.list(true);
  REQUIRE(verified.size() == 3);
  CHECK_THROWS_AS(cache.gc(0), moejit::Error);
  CHECK_THROWS_AS(cache.clear(), moejit::Error);

  // Nothing created, removed, moved, or touched (mtimes included).
  CHECK(snapshot(tmp.path()) == before);

  // Read-only over a directory that does not exist: every load misses, nothing is created.
  DiskCache absent(tmp.path() + "/absent", CacheMode::kReadOnly);
  CHECK(absent.effective_mode() == CacheMode::kReadOnly);
  CHECK_FALSE(absent.load(a).has_value());
  CHECK(absent.list(true).empty());
  CHECK_FALSE(fs::exists(tmp.path() + "/absent"));
}

TEST_CASE("a cache dir that can't be created or written degrades, never throws", "[cache]") {
  moejit::test::TempDir tmp;
  const std::string key = key_for("unwritable");

  SECTION("a path through a regular file (even root can't create it)") {
    write_file(tmp.path() + "/plain-file", "not a directory");
    const auto before = snapshot(tmp.path());
    moejit::test::WarningCapture warnings;
    DiskCache cache(tmp.path() + "/plain-file/cache", CacheMode::kReadWrite);
    CHECK(cache.effective_mode() == CacheMode::kMemoryOnly);
    CHECK(cache.mode_reason().find("plain-file") != std::string::npos);
    // Said at warn (the default level), not only by `moejit doctor`: nothing compiled is kept.
    INFO(warnings.all());
    CHECK(warnings.warned({"plain-file", "memory-only instead of read-write", "not kept"}));
    CHECK_FALSE(cache.store(make_entry(key, 100, 1)));
    CHECK_FALSE(cache.load(key).has_value());
    CHECK_FALSE(cache.lock(key).held());
    CHECK(cache.list(false).empty());
    CHECK(snapshot(tmp.path()) == before);
  }
  SECTION("the cache path is itself a regular file") {
    write_file(tmp.path() + "/plain-file", "not a directory");
    DiskCache cache(tmp.path() + "/plain-file", CacheMode::kReadWrite);
    CHECK(cache.effective_mode() == CacheMode::kMemoryOnly);
    CHECK_FALSE(cache.store(make_entry(key, 100, 1)));
  }
  SECTION("the version directory is a regular file (even root can't create it)") {
    const std::string dir = tmp.path() + "/cache";
    REQUIRE(::mkdir(dir.c_str(), 0700) == 0);
    write_file(dir + "/v" + std::to_string(moejit::kCacheSchemaVersion), "not a directory");
    moejit::test::WarningCapture warnings;
    DiskCache cache(dir, CacheMode::kReadWrite);
    CHECK(cache.effective_mode() == CacheMode::kReadOnly);
    // A write failure points at the mode for caches meant to be read-only, in the warning only:
    // prewarm, gc and doctor quote mode_reason() where they need to write.
    INFO(warnings.all());
    CHECK(warnings.warned(
        {"cannot create", "MOEJIT_CACHE_MODE=ro", "read-only instead of read-write", "not kept"}));
    CHECK(cache.mode_reason().find("MOEJIT_CACHE_MODE") == std::string::npos);
    CHECK_FALSE(cache.store(make_entry(key, 100, 1)));
  }
  SECTION("a read-only directory (chmod 0500)") {
    if (running_as_root()) {
      print_skip("chmod 0500 cache dir", "running as root, which ignores directory permissions");
      return;
    }
    const std::string dir = tmp.path() + "/cache";
    {
      DiskCache writer(dir, CacheMode::kReadWrite);
      REQUIRE(writer.store(make_entry(key, 100, 1)));
    }
    const std::string version_dir = dir + "/v" + std::to_string(moejit::kCacheSchemaVersion);
    REQUIRE(::chmod(version_dir.c_str(), 0500) == 0);
    REQUIRE(::chmod(dir.c_str(), 0500) == 0);
    DiskCache cache(dir, CacheMode::kReadWrite);
    CHECK(cache.effective_mode() == CacheMode::kReadOnly);
    CHECK(cache.load(key).has_value());
    CHECK_FALSE(cache.store(make_entry(key_for("new"), 100, 2)));
  }
  SECTION("a missing directory under a read-only parent") {
    if (running_as_root()) {
      print_skip("read-only parent dir", "running as root, which ignores directory permissions");
      return;
    }
    REQUIRE(::chmod(tmp.path().c_str(), 0500) == 0);
    DiskCache cache(tmp.path() + "/cache", CacheMode::kReadWrite);
    CHECK(cache.effective_mode() == CacheMode::kMemoryOnly);
    REQUIRE(::chmod(tmp.path().c_str(), 0700) == 0);
  }
}

TEST_CASE("entries owned by others or writable by others are ignored, never deleted",
          "[cache]") {
  moejit::test::TempDir tmp;
  const std::string dir = tmp.path() + "/cache";
  DiskCache cache(dir, CacheMode::kReadWrite);

  SECTION("group-writable entry") {
    const std::string key = key_for("group-writable");
    REQUIRE(cache.store(make_entry(key, 1000, 1)));
    const std::string path = cache.entry_path(key);
    REQUIRE(::chmod(path.c_str(), 0620) == 0);
    LogCapture capture;
    CHECK_FALSE(cache.load(key).has_value());
    CHECK(capture.warned({path, "writable by group or others"}));
    CHECK(fs::exists(path));
    CHECK(files_in(dir + "/quarantine").empty());
    auto listed = cache.list(true);
    REQUIRE(listed.size() == 1);
    CHECK(listed[0].problem.find("untrusted") != std::string::npos);
    CHECK(fs::exists(path));
    // Made private again, it loads.
    REQUIRE(::chmod(path.c_str(), 0600) == 0);
    CHECK(cache.load(key).has_value());
  }
  SECTION("entry owned by another user") {
    if (!running_as_root()) {
      print_skip("foreign-owned entry", "needs root to chown a file to another user");
      return;
    }
    const std::string key = key_for("foreign");
    REQUIRE(cache.store(make_entry(key, 1000, 1)));
    const std::string path = cache.entry_path(key);
    REQUIRE(::chown(path.c_str(), 65534, 65534) == 0);
    LogCapture capture;
    CHECK_FALSE(cache.load(key).has_value());
    CHECK(capture.warned({path, "owned by uid 65534"}));
    CHECK(fs::exists(path));
    CHECK(files_in(dir + "/quarantine").empty());
    // gc and clear never remove another user's file.
    auto report = cache.gc(0);
    CHECK(report.removed == 0);
    CHECK(cache.clear().removed == 0);
    CHECK(fs::exists(path));
  }
  SECTION("a group/world-writable cache root is used read-only") {
    const std::string key = key_for("shared-root");
    REQUIRE(cache.store(make_entry(key, 1000, 1)));
    REQUIRE(::chmod(dir.c_str(), 0777) == 0);
    LogCapture capture;
    DiskCache shared(dir, CacheMode::kReadWrite);
    CHECK(shared.effective_mode() == CacheMode::kReadOnly);
    CHECK(capture.warned({dir, "writable by group or others", "read-only instead of read-write"}));
    CHECK(shared.load(key).has_value());
    CHECK_FALSE(shared.store(make_entry(key_for("injected"), 1000, 2)));
  }
}

TEST_CASE("gc evicts least recently used entries down to the limit", "[cache]") {
  moejit::test::TempDir tmp;
  const std::string dir = tmp.path() + "/cache";
  DiskCache cache(dir, CacheMode::kReadWrite);
  std::vector<std::string> keys;
  uint64_t total = 0;
  const int64_t base = now_unix() - 100000;
  for (int i = 0; i < 10; ++i) {
    keys.push_back(key_for("gc-" + std::to_string(i)));
    REQUIRE(cache.store(make_entry(keys.back(), 50000, static_cast<uint64_t>(i))));
    // Older index = used longer ago.
    set_mtime(cache.entry_path(keys.back()), base + i);
    total += fs::file_size(cache.entry_path(keys.back()));
  }
  // Using 2 and 7 makes them the most recent.
  REQUIRE(cache.load(keys[2]).has_value());
  REQUIRE(cache.load(keys[7]).has_value());
  auto size_of = [&](int i) { return fs::file_size(cache.entry_path(keys[i])); };
  const uint64_t limit = size_of(2) + size_of(7) + size_of(8) + size_of(9);

  auto report = cache.gc(limit);
  CHECK(report.bytes_before == total);
  CHECK(report.bytes_after == limit);
  CHECK(report.removed == 6);
  for (int i = 0; i < 10; ++i) {
    const bool kept = i == 2 || i == 7 || i == 8 || i == 9;
    INFO("entry " << i);
    CHECK(fs::exists(cache.entry_path(keys[i])) == kept);
  }
  CHECK(cache.list(false).size() == 4);

  // Quarantined files are evicted before any entry.
  flip_bit(cache.entry_path(keys[8]), 64 + 1);
  REQUIRE_FALSE(cache.load(keys[8]).has_value());
  REQUIRE(files_in(dir + "/quarantine").size() == 1);
  const uint64_t live = size_of(2) + size_of(7) + size_of(9);
  report = cache.gc(live);
  CHECK(report.removed == 1);
  CHECK(report.bytes_after == live);
  CHECK(files_in(dir + "/quarantine").empty());
  CHECK(cache.list(false).size() == 3);

  // Entries of an older schema version count and, never used, go first.
  const std::string old_shard = dir + "/v0/ab";
  fs::create_directories(old_shard);
  write_file(old_shard + "/ab" + std::string(30, '0') + ".mjc", std::string(1000, 'x'));
  set_mtime(old_shard + "/ab" + std::string(30, '0') + ".mjc", base - 1);
  report = cache.gc(live);
  CHECK(report.bytes_before == live + 1000);
  CHECK(report.removed == 1);
  CHECK(cache.list(false).size() == 3);

  report = cache.gc(0);
  CHECK(report.bytes_after == 0);
  CHECK(report.removed == 3);
  CHECK(cache.list(false).empty());
}

TEST_CASE("gc removes only the files it scanned, as they were, and counts only its own removals",
          "[cache]") {
  moejit::test::TempDir tmp;
  const std::string dir = tmp.path() + "/cache";
  DiskCache cache(dir, CacheMode::kReadWrite);
  std::vector<std::string> keys;
  const int64_t base = now_unix() - 100000;
  for (int i = 0; i < 4; ++i) {
    keys.push_back(key_for("gc-race-" + std::to_string(i)));
    REQUIRE(cache.store(make_entry(keys.back(), 5000, static_cast<uint64_t>(i))));
    set_mtime(cache.entry_path(keys.back()), base + i);
  }
  const auto path = [&](int i) { return cache.entry_path(keys[static_cast<std::size_t>(i)]); };
  // Between gc's scan and its removals, other processes publish a fresh entry at the path of
  // entry 0, use entry 1, and remove entry 2 (another gc); entry 3 is left as scanned.
  HooksSet hooks({0, [&] {
                    DiskCache other(dir, CacheMode::kReadWrite);
                    CHECK(other.store(make_entry(keys[0], 7000, 10)));
                    CHECK(other.load(keys[1]).has_value());
                    CHECK(::unlink(path(2).c_str()) == 0);
                  }});
  const auto report = cache.gc(0);
  CHECK(fs::exists(path(0)));
  CHECK(fs::exists(path(1)));
  CHECK_FALSE(fs::exists(path(2)));
  CHECK_FALSE(fs::exists(path(3)));
  CHECK(report.removed == 1);
  CHECK(report.bytes_after == fs::file_size(path(0)) + fs::file_size(path(1)));
  const std::optional<Entry> fresh = cache.load(keys[0]);
  REQUIRE(fresh.has_value());
  CHECK(fresh->cubin == make_entry(keys[0], 7000, 10).cubin);
}

// Other processes act in the instant between gc's last look at an entry (which finds it as
// scanned) and its removal: one publishes a fresh entry at the path of entry 0, another uses
// entry 1. Both stay, put back by the no-replace rename or by link and unlink (EINVAL).
TEST_CASE("an entry published or used just before gc removes its path stays", "[cache]") {
  for (const int rename_error : {0, EINVAL}) {
    INFO((rename_error == 0 ? "no-replace rename" : "link and unlink (rename: EINVAL)"));
    moejit::test::TempDir tmp;
    const std::string dir = tmp.path() + "/cache";
    DiskCache cache(dir, CacheMode::kReadWrite);
    std::vector<std::string> keys;
    const int64_t base = now_unix() - 100000;
    for (int i = 0; i < 3; ++i) {
      keys.push_back(key_for("gc-instant-" + std::to_string(i)));
      REQUIRE(cache.store(make_entry(keys.back(), 5000, static_cast<uint64_t>(i))));
      set_mtime(cache.entry_path(keys.back()), base + i);
    }
    const auto path = [&](int i) { return cache.entry_path(keys[static_cast<std::size_t>(i)]); };
    moejit::detail::CacheTestHooks hooks;
    hooks.no_replace_rename_error = rename_error;
    std::vector<std::string> looked_at;
    hooks.before_gc_removal = [&](const std::string& p) {
      looked_at.push_back(p);
      if (p == path(0)) {
        DiskCache other(dir, CacheMode::kReadWrite);
        CHECK(other.store(make_entry(keys[0], 7000, 10)));
      } else if (p == path(1)) {
        DiskCache other(dir, CacheMode::kReadWrite);
        CHECK(other.load(keys[1]).has_value());
      }
    };
    moejit::detail::GcReport report;
    {
      HooksSet set(hooks);
      LogCapture capture;
      report = cache.gc(0);
      INFO(capture.all());
      CHECK(capture.warning_count() == 0);
    }
    CHECK(looked_at == std::vector<std::string>{path(0), path(1), path(2)});
    CHECK(report.removed == 1);
    CHECK(fs::exists(path(0)));
    CHECK(fs::exists(path(1)));
    CHECK_FALSE(fs::exists(path(2)));
    CHECK(report.bytes_after == fs::file_size(path(0)) + fs::file_size(path(1)));
    CHECK(temp_files(dir).empty());
    const std::optional<Entry> fresh = cache.load(keys[0]);
    REQUIRE(fresh.has_value());
    CHECK(fresh->cubin == make_entry(keys[0], 7000, 10).cubin);
    const std::optional<Entry> used = cache.load(keys[1]);
    REQUIRE(used.has_value());
    CHECK(used->cubin == make_entry(keys[1], 5000, 1).cubin);
  }
}

TEST_CASE("a cache made read-only by a full disk or quota still lets gc and clear remove",
          "[cache]") {
  moejit::test::TempDir tmp;
  const std::string dir = tmp.path() + "/cache";
  const std::string older = key_for("full-disk-older");
  const std::string newer = key_for("full-disk-newer");
  for (const int error : {ENOSPC, EDQUOT}) {
    INFO(std::strerror(error));
    {
      DiskCache writer(dir, CacheMode::kReadWrite);
      REQUIRE(writer.store(make_entry(older, 1000, 1)));
      REQUIRE(writer.store(make_entry(newer, 1000, 2)));
      set_mtime(writer.entry_path(older), now_unix() - 1000);
    }
    // The write probe fails as it would on a full disk, and so does gc's move of an entry away
    // from its path (a rename needs a directory entry before it frees one): gc unlinks instead.
    moejit::detail::CacheTestHooks hooks;
    hooks.write_error = error;
    hooks.gc_rename_error = error;
    HooksSet full(hooks);
    DiskCache cache(dir, CacheMode::kReadWrite);
    CHECK(cache.effective_mode() == CacheMode::kReadOnly);
    CHECK(cache.mode_reason().find(std::strerror(error)) != std::string::npos);
    CHECK(cache.removals_allowed());
    CHECK_FALSE(cache.store(make_entry(key_for("full-disk-new"), 100, 3)));
    CHECK(cache.load(newer).has_value());
    moejit::detail::GcReport report;
    REQUIRE_NOTHROW(report = cache.gc(fs::file_size(cache.entry_path(newer))));
    CHECK(report.removed == 1);
    CHECK_FALSE(fs::exists(cache.entry_path(older)));
    moejit::detail::ClearReport cleared;
    REQUIRE_NOTHROW(cleared = cache.clear());
    CHECK(cleared.removed == 1);
    CHECK(cache.list(false).empty());
  }
  // A read-only mount, or a directory this user can't write, removes nothing.
  HooksSet read_only({EROFS, {}});
  DiskCache cache(dir, CacheMode::kReadWrite);
  CHECK(cache.effective_mode() == CacheMode::kReadOnly);
  CHECK_FALSE(cache.removals_allowed());
  CHECK_THROWS_AS(cache.gc(0), moejit::Error);
  CHECK_THROWS_AS(cache.clear(), moejit::Error);
  // And one opened read-only on purpose stays so.
  CHECK_FALSE(DiskCache(dir, CacheMode::kReadOnly).removals_allowed());
}

// What writers and lockers leave in a cache, next to the entry of `key` (stored here): a fresh
// temp file (maybe a live writer's) and a stale one in its shard, an idle lock file of `key` and
// a lock of `held_key` still held, both older than kStaleTempSeconds.
struct Leftovers {
  std::string fresh, stale, idle_lock, held_lock;
  DiskCache::Lock held;
};
Leftovers plant_leftovers(const DiskCache& cache, const std::string& dir, const std::string& key,
                          const std::string& held_key) {
  Leftovers l;
  REQUIRE(cache.store(make_entry(key, 1000, 1)));
  const std::string shard = fs::path(cache.entry_path(key)).parent_path().string();
  l.fresh = shard + "/." + key + ".1.aaaa.tmp";
  l.stale = shard + "/." + key + ".2.bbbb.tmp";
  write_file(l.fresh, "partial");
  write_file(l.stale, "partial");
  set_mtime(l.stale, now_unix() - DiskCache::kStaleTempSeconds - 60);
  { auto lock = cache.lock(key); }
  l.idle_lock = dir + "/locks/" + key + ".lock";
  REQUIRE(fs::exists(l.idle_lock));
  set_mtime(l.idle_lock, now_unix() - DiskCache::kStaleTempSeconds - 60);
  l.held = cache.lock(held_key);
  REQUIRE(l.held.held());
  l.held_lock = dir + "/locks/" + held_key + ".lock";
  set_mtime(l.held_lock, now_unix() - DiskCache::kStaleTempSeconds - 60);
  return l;
}

TEST_CASE("temp files and idle lock files are cleaned only when stale", "[cache]") {
  moejit::test::TempDir tmp;
  const std::string dir = tmp.path() + "/cache";
  DiskCache cache(dir, CacheMode::kReadWrite);
  const std::string key = key_for("temps");
  const Leftovers left = plant_leftovers(cache, dir, key, key_for("held"));
  // In the cache root: an older build's toolkit stamp (a leftover, removed whatever its age), a
  // stamp's temp left by a killed writer, and a file that only looks like a stamp (kept).
  const std::string old_stamp = dir + "/toolkit-0123456789abcdef0123456789abcdef.json";
  const std::string stamp = dir + "/toolkit-0123.json";
  const std::string stale_stamp_temp = dir + "/.toolkit-0123.json.7.cccc.tmp";
  write_file(old_stamp, "{}");
  write_file(stamp, "{}");
  write_file(stale_stamp_temp, "{\"part");
  set_mtime(stamp, now_unix() - DiskCache::kStaleTempSeconds - 60);
  set_mtime(stale_stamp_temp, now_unix() - DiskCache::kStaleTempSeconds - 60);

  // Temp files are never entries.
  REQUIRE(cache.list(true).size() == 1);
  CHECK(mode_of(left.idle_lock) == 0600);

  auto report = cache.gc(UINT64_MAX);
  CHECK(report.stale_temp_removed == 3);
  CHECK(report.removed == 0);
  CHECK(fs::exists(left.fresh));
  CHECK_FALSE(fs::exists(left.stale));
  CHECK_FALSE(fs::exists(stale_stamp_temp));
  CHECK_FALSE(fs::exists(old_stamp));
  CHECK(fs::exists(stamp));
  CHECK_FALSE(fs::exists(left.idle_lock));
  CHECK(fs::exists(left.held_lock));
  CHECK(cache.load(key).has_value());

  // clear takes older builds' stamps with the entries.
  write_file(old_stamp, "{}");
  const auto cleared = cache.clear();
  CHECK(cleared.removed == 2);
  CHECK(cleared.not_removed == 0);
  CHECK_FALSE(fs::exists(old_stamp));
  CHECK(fs::exists(stamp));
}

TEST_CASE("gc removes this user's stale symlinks, sockets and idle FIFOs under a lock's name",
          "[cache]") {
  moejit::test::TempDir tmp;
  const std::string dir = tmp.path() + "/cache";
  DiskCache cache(dir, CacheMode::kReadWrite);
  const std::string locks = dir + "/locks/";
  const int64_t stale = now_unix() - DiskCache::kStaleTempSeconds - 60;
  const auto lock_name = [&](const char* what) { return locks + key_for(what) + ".lock"; };
  const std::string victim = tmp.path() + "/victim";
  write_file(victim, "not the cache's");
  const std::string link = lock_name("link"), fifo = lock_name("fifo"),
                    held_fifo = lock_name("held fifo"), socket = lock_name("socket"),
                    fresh_link = lock_name("fresh link"), not_a_lock = locks + "other-program";
  REQUIRE(::symlink(victim.c_str(), link.c_str()) == 0);
  REQUIRE(::symlink(victim.c_str(), fresh_link.c_str()) == 0);
  REQUIRE(::symlink(victim.c_str(), not_a_lock.c_str()) == 0);
  REQUIRE(::mkfifo(fifo.c_str(), 0600) == 0);
  REQUIRE(::mkfifo(held_fifo.c_str(), 0600) == 0);
  make_socket_file(socket);
  for (const std::string& p : {link, not_a_lock, fifo, held_fifo, socket}) set_mtime(p, stale);
  // A FIFO a process holds as its lock (lock() takes one like a file) stays.
  const int holder = ::open(held_fifo.c_str(), O_RDWR | O_NONBLOCK);
  REQUIRE(holder >= 0);
  REQUIRE(::flock(holder, LOCK_EX | LOCK_NB) == 0);

  (void)cache.gc(UINT64_MAX);
  const auto present = [](const std::string& p) {
    struct stat st {};
    return ::lstat(p.c_str(), &st) == 0;
  };
  CHECK_FALSE(present(link));
  CHECK_FALSE(present(fifo));
  CHECK_FALSE(present(socket));
  CHECK(present(held_fifo));
  CHECK(present(fresh_link));
  CHECK(present(not_a_lock));
  CHECK(moejit::test::read_text(victim) == "not the cache's");
  ::close(holder);
  if (running_as_root()) {
    const std::string theirs = lock_name("another user's link");
    REQUIRE(::symlink(victim.c_str(), theirs.c_str()) == 0);
    REQUIRE(::lchown(theirs.c_str(), 12345, 12345) == 0);
    set_mtime(theirs, stale);
    (void)cache.gc(UINT64_MAX);
    CHECK(present(theirs));
  }
}

// A cache and one key's lock path, for planting things there.
struct LockPathCase {
  explicit LockPathCase(const std::string& name)
      : dir(tmp.path() + "/cache"),
        cache(dir, CacheMode::kReadWrite),
        key(key_for(name)),
        path(dir + "/locks/" + key + ".lock") {}
  moejit::test::TempDir tmp;
  const std::string dir;
  DiskCache cache;
  const std::string key;
  const std::string path;
};

// The lock file at `path` is held by someone: a try of this process's own fails.
bool held_by_someone(const std::string& path) {
  struct stat st {};
  REQUIRE(::lstat(path.c_str(), &st) == 0);
  REQUIRE(S_ISREG(st.st_mode));
  const int fd = ::open(path.c_str(), O_RDWR);
  REQUIRE(fd >= 0);
  const bool held = ::flock(fd, LOCK_EX | LOCK_NB) != 0;
  ::close(fd);
  return held;
}

TEST_CASE("a lock path cleared by another process meanwhile keeps that process's lock file",
          "[cache]") {
  LockPathCase c("cleared meanwhile");
  auto& [tmp, dir, cache, key, path] = c;
  REQUIRE(::symlink((tmp.path() + "/nowhere").c_str(), path.c_str()) == 0);
  // Once the remover under test has seen the symlink, another process clears it and takes the
  // lock (its own clearing runs this hook too: it acts only the first time).
  DiskCache::Lock other;
  bool fired = false;
  moejit::detail::CacheTestHooks hooks;
  hooks.before_lock_path_removal = [&](const std::string& at) {
    if (fired) return;
    fired = true;
    CHECK(at == path);
    other = cache.lock(key, nullptr, std::chrono::milliseconds(200));
    REQUIRE(other.held());
  };
  HooksSet set(std::move(hooks));

  SECTION("by lock(): it waits for that lock instead of removing its file") {
    LogCapture capture;
    DiskCache::Lock mine = cache.lock(key, nullptr, std::chrono::milliseconds(200));
    INFO(capture.all());
    CHECK(fired);
    CHECK_FALSE(mine.held());
    CHECK(capture.warned({"still held by another process"}));
  }
  SECTION("by gc") {
    set_mtime(path, now_unix() - DiskCache::kStaleTempSeconds - 60);
    (void)cache.gc(UINT64_MAX);
    CHECK(fired);
  }
  CHECK(other.held());
  CHECK(held_by_someone(path));
}

TEST_CASE(
    "a lock path is cleared only under the locks directory's flock, which is not waited on "
    "for long",
    "[cache]") {
  LockPathCase c("locks directory held");
  auto& [tmp, dir, cache, key, path] = c;
  REQUIRE(::symlink((tmp.path() + "/nowhere").c_str(), path.c_str()) == 0);
  // Held as a remover stopped between its look and its removal would hold it.
  const int locks = ::open((dir + "/locks").c_str(), O_RDONLY | O_DIRECTORY);
  REQUIRE(locks >= 0);
  REQUIRE(::flock(locks, LOCK_EX | LOCK_NB) == 0);
  LogCapture capture;
  const auto start = std::chrono::steady_clock::now();
  DiskCache::Lock lock = cache.lock(key, nullptr, std::chrono::milliseconds(200));
  const double waited =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  INFO(capture.all());
  CHECK_FALSE(lock.held());
  CHECK(capture.warned({path, "cannot be removed", "Resource temporarily unavailable"}));
  CHECK(capture.warned({"cannot open lock file", path, "without the inter-process lock"}));
  struct stat st {};
  REQUIRE(::lstat(path.c_str(), &st) == 0);
  CHECK(S_ISLNK(st.st_mode));
  CHECK(waited > 0.5);
  CHECK(waited < 30.0);
  ::close(locks);
  DiskCache::Lock after = cache.lock(key, nullptr, std::chrono::milliseconds(200));
  CHECK(after.held());
}

// A cache in a directory other programs use too (MOEJIT_CACHE_DIR=~/.cache): their temp files
// in the root and their files under "locks" and "quarantine", however old, are not the cache's
// to remove.
TEST_CASE("gc and clear leave other programs' files in the root, locks/ and quarantine/",
          "[cache]") {
  moejit::test::TempDir tmp;
  const std::string dir = tmp.path() + "/shared";
  DiskCache cache(dir, CacheMode::kReadWrite);
  const std::string key = key_for("shared-dir");
  REQUIRE(cache.store(make_entry(key, 1000, 1)));
  flip_bit(cache.entry_path(key), 64 + 1);
  REQUIRE_FALSE(cache.load(key).has_value());  // quarantined: one file of the cache's own
  REQUIRE(files_in(dir + "/quarantine").size() == 1);
  const int64_t old = now_unix() - DiskCache::kQuarantineKeepSeconds - 60;
  const std::vector<std::string> theirs = {
      dir + "/.editor-state.tmp", dir + "/locks/editor.lock", dir + "/locks/" + key + ".lock.bak",
      dir + "/quarantine/report.txt", dir + "/quarantine/" + key + ".txt"};
  for (const std::string& path : theirs) {
    write_file(path, "not the cache's");
    set_mtime(path, old);
  }
  CHECK(cache.gc(0).removed == 1);  // the quarantined entry only
  for (const std::string& path : theirs) CHECK(fs::exists(path));
  REQUIRE(cache.store(make_entry(key, 1000, 1)));
  CHECK(cache.clear().removed == 1);
  for (const std::string& path : theirs) CHECK(fs::exists(path));
}

TEST_CASE("clear removes every entry and quarantined file", "[cache]") {
  moejit::test::TempDir tmp;
  const std::string dir = tmp.path() + "/cache";
  DiskCache cache(dir, CacheMode::kReadWrite);
  for (int i = 0; i < 5; ++i) {
    REQUIRE(cache.store(make_entry(key_for("clear-" + std::to_string(i)), 1000, 1)));
  }
  flip_bit(cache.entry_path(key_for("clear-0")), 64 + 1);
  REQUIRE_FALSE(cache.load(key_for("clear-0")).has_value());
  CHECK(cache.clear().removed == 5);
  CHECK(cache.list(false).empty());
  CHECK(files_in(dir + "/quarantine").empty());
  CHECK_FALSE(cache.load(key_for("clear-1")).has_value());
}

TEST_CASE("memory-only mode never touches the disk", "[cache]") {
  moejit::test::TempDir tmp;
  const std::string key = key_for("memory-only");
  {
    DiskCache cache(tmp.path() + "/cache", CacheMode::kMemoryOnly);
    CHECK(cache.effective_mode() == CacheMode::kMemoryOnly);
    CHECK_FALSE(cache.store(make_entry(key, 100, 1)));
    CHECK_FALSE(cache.load(key).has_value());
    CHECK_FALSE(cache.lock(key).held());
    CHECK(cache.list(true).empty());
    CHECK_THROWS_AS(cache.gc(0), moejit::Error);
    CHECK_FALSE(fs::exists(tmp.path() + "/cache"));
  }
  // Over a populated cache it still reads nothing.
  {
    DiskCache writer(tmp.path() + "/cache", CacheMode::kReadWrite);
    REQUIRE(writer.store(make_entry(key, 100, 1)));
  }
  const auto before = snapshot(tmp.path());
  DiskCache cache(tmp.path() + "/cache", CacheMode::kMemoryOnly);
  CHECK_FALSE(cache.load(key).has_value());
  CHECK(cache.list(true).empty());
  CHECK(snapshot(tmp.path()) == before);
}

TEST_CASE("lock(key) excludes other holders until released", "[cache]") {
  moejit::test::TempDir tmp;
  DiskCache cache(tmp.path() + "/cache", CacheMode::kReadWrite);
  const std::string key = key_for("lock");
  std::atomic<bool> first_holds{false};
  std::atomic<bool> first_released{false};
  std::atomic<bool> second_saw_release{false};

  DiskCache::Lock first = cache.lock(key);
  REQUIRE(first.held());
  first_holds = true;
  std::thread second([&] {
    DiskCache::Lock lock = cache.lock(key);
    // flock locks belong to the open file, so this waits even within one process.
    second_saw_release = first_released.load();
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  first_released = true;
  first = DiskCache::Lock();  // move-assign releases the held lock
  second.join();
  CHECK(second_saw_release);

  // A moved-from lock releases nothing; the moved-to one holds.
  DiskCache::Lock a = cache.lock(key);
  DiskCache::Lock b(std::move(a));
  CHECK_FALSE(a.held());
  CHECK(b.held());
}

namespace {

// Holds the flock on `key`'s lock file through an open file description of its own, as another
// process (or a forked child that inherited the lock) would: flock locks taken through
// different open file descriptions conflict even within one process.
class ForeignHolder {
 public:
  ForeignHolder(const std::string& cache_dir, const std::string& key)
      : fd_(::open((cache_dir + "/locks/" + key + ".lock").c_str(), O_RDWR | O_CREAT | O_CLOEXEC,
                   0600)) {
    REQUIRE(fd_ >= 0);
    REQUIRE(::flock(fd_, LOCK_EX | LOCK_NB) == 0);
  }
  ~ForeignHolder() { ::close(fd_); }
  ForeignHolder(const ForeignHolder&) = delete;
  ForeignHolder& operator=(const ForeignHolder&) = delete;

 private:
  int fd_;
};

// Whether some open file description holds the lock of `key` (probed through a new one).
bool lock_is_held(const std::string& cache_dir, const std::string& key) {
  const int fd = ::open((cache_dir + "/locks/" + key + ".lock").c_str(), O_RDWR | O_CLOEXEC, 0600);
  REQUIRE(fd >= 0);
  const bool held = ::flock(fd, LOCK_EX | LOCK_NB) != 0 && errno == EWOULDBLOCK;
  ::close(fd);
  return held;
}

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

// A fresh read-write cache whose lock on the key named `name` a ForeignHolder holds.
struct ForeignLockCase {
  explicit ForeignLockCase(const std::string& name)
      : dir(tmp.path() + "/cache"),
        cache(dir, CacheMode::kReadWrite),
        key(key_for(name)),
        holder(dir, key) {}
  moejit::test::TempDir tmp;
  const std::string dir;
  DiskCache cache;
  const std::string key;
  ForeignHolder holder;
};

}  // namespace

TEST_CASE("lock(key) returns an entry published while it waits, the holder still holding",
          "[cache]") {
  ForeignLockCase c("published while waiting");
  const Entry entry = make_entry(c.key, 4096, 7);
  // The holder publishes, then keeps the lock (stopped, hung, or a forked child holding it).
  std::thread publisher([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(150));
    DiskCache other(c.dir, CacheMode::kReadWrite);
    CHECK(other.store(entry));
  });

  const auto start = std::chrono::steady_clock::now();
  std::optional<Entry> published;
  DiskCache::Lock lock = c.cache.lock(c.key, &published);
  const double waited = seconds_since(start);
  publisher.join();
  CHECK_FALSE(lock.held());
  REQUIRE(published.has_value());
  CHECK(published->cubin == entry.cubin);
  CHECK(published->manifest.key == c.key);
  // Returned within the poll interval of the publish, not after any wait bound.
  CHECK(waited >= 0.1);
  CHECK(waited < 10.0);
  CHECK(lock_is_held(c.dir, c.key));
}

TEST_CASE("lock(key) still takes a published entry that gc moved away and back during a poll",
          "[cache]") {
  ForeignLockCase c("moved away and back");
  const Entry entry = make_entry(c.key, 4096, 11);
  {
    DiskCache other(c.dir, CacheMode::kReadWrite);
    REQUIRE(other.store(entry));  // published; the holder keeps the lock
  }
  // The first poll's load finds the path empty (gc's move to a temp name), and the same file (the
  // same inode and mtime) is back before the next poll.
  int loads = 0;
  moejit::detail::CacheTestHooks hooks;
  hooks.before_published_load = [&](const std::string& path) {
    if (loads++ == 0) REQUIRE(std::rename(path.c_str(), (path + ".gc-away").c_str()) == 0);
  };
  hooks.after_published_load = [&](const std::string& path) {
    if (loads == 1) REQUIRE(std::rename((path + ".gc-away").c_str(), path.c_str()) == 0);
  };
  moejit::detail::set_cache_test_hooks(hooks);
  struct Unhook {
    ~Unhook() { moejit::detail::set_cache_test_hooks({}); }
  } unhook;

  const auto start = std::chrono::steady_clock::now();
  std::optional<Entry> published;
  DiskCache::Lock lock = c.cache.lock(c.key, &published, std::chrono::seconds(5));
  const double waited = seconds_since(start);
  CHECK_FALSE(lock.held());
  CHECK(loads == 2);
  REQUIRE(published.has_value());
  CHECK(published->cubin == entry.cubin);
  CHECK(waited < 4.0);  // taken on the next poll, not after the wait bound
}

TEST_CASE("lock(key) gives up on a holder that never releases after the wait bound", "[cache]") {
  ForeignLockCase c("held forever");
  LogCapture capture;

  const auto start = std::chrono::steady_clock::now();
  std::optional<Entry> published;
  DiskCache::Lock lock = c.cache.lock(c.key, &published, std::chrono::milliseconds(300));
  const double waited = seconds_since(start);
  CHECK_FALSE(lock.held());
  CHECK_FALSE(published.has_value());
  CHECK(waited >= 0.3);
  CHECK(waited < 10.0);
  INFO(capture.all());
  CHECK(capture.warned({"waited 300 ms for", c.dir + "/locks/" + c.key + ".lock",
                        "without the inter-process lock"}));
  // The bound is generous by default: minutes, far beyond the slowest compile.
  CHECK(DiskCache::kLockWaitSeconds >= 60);
  CHECK(DiskCache::kLockWaitSeconds < DiskCache::kStaleTempSeconds);

  // Uncontended, the lock is taken at once.
  const std::string free_key = key_for("free");
  const auto free_start = std::chrono::steady_clock::now();
  CHECK(c.cache.lock(free_key, &published, std::chrono::milliseconds(0)).held());
  CHECK(seconds_since(free_start) < 1.0);
}

TEST_CASE("a dropped lock is released even when a forked child shares its descriptor", "[cache]") {
  moejit::test::TempDir tmp;
  const std::string dir = tmp.path() + "/cache";
  DiskCache cache(dir, CacheMode::kReadWrite);
  const std::string key = key_for("forked");
  DiskCache::Lock lock = cache.lock(key);
  REQUIRE(lock.held());
  const pid_t child = ::fork();
  REQUIRE(child >= 0);
  if (child == 0) {
    // Forked without exec: it inherits the lock's open file description and just lives on.
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);
    while (true) ::pause();
  }
  ChildGuard guard(child);
  lock = DiskCache::Lock();
  CHECK_FALSE(lock_is_held(dir, key));
  const auto start = std::chrono::steady_clock::now();
  CHECK(cache.lock(key, nullptr, std::chrono::seconds(5)).held());
  CHECK(seconds_since(start) < 1.0);
}

// A cache of its own user's where one shard can't be read: list, verify, gc and clear skip it,
// name it, and do their work on the rest. Why a child process as uid
// 65534 when this is root: root reads any directory whatever its mode. The child reports one
// line per check; the parent asserts them.
TEST_CASE("list, gc and clear go on past a shard they can't read", "[cache]") {
  moejit::test::TempDir tmp;
  const std::string home = tmp.path() + "/home";
  REQUIRE(::mkdir(home.c_str(), 0700) == 0);
  REQUIRE(::chmod(tmp.path().c_str(), 0711) == 0);  // the child may pass through it
  if (running_as_root() && ::chown(home.c_str(), 65534, 65534) != 0) {
    print_skip("unreadable shard",
               std::string("chown to uid 65534 failed: ") + std::strerror(errno));
    return;
  }
  const std::string dir = home + "/cache";
  const std::string hidden_key = key_for("unreadable-shard-0");
  std::string seen_key = key_for("unreadable-shard-1");
  for (int i = 2; seen_key.compare(0, 2, hidden_key, 0, 2) == 0; ++i) {
    seen_key = key_for("unreadable-shard-" + std::to_string(i));  // another shard
  }
  int out[2];
  REQUIRE(::pipe(out) == 0);
  const pid_t child = ::fork();
  REQUIRE(child >= 0);
  if (child == 0) {
    ::close(out[0]);
    std::string report;
    const auto line = [&report](const std::string& text) { report += text + "\n"; };
    if (running_as_root() && (::setgid(65534) != 0 || ::setuid(65534) != 0)) {
      line(std::string("setuid failed: ") + std::strerror(errno));
    } else {
      try {
        DiskCache cache(dir, CacheMode::kReadWrite);
        const bool stored = cache.store(make_entry(hidden_key, 1000, 1)) &&
                            cache.store(make_entry(seen_key, 1000, 2));
        line("stored " + std::to_string(stored));
        const std::string shard = fs::path(cache.entry_path(hidden_key)).parent_path().string();
        ::chmod(shard.c_str(), 0);
        std::vector<std::string> unreadable;
        for (const auto& info : cache.list(true, &unreadable)) {
          line("listed " + info.path + " key=" + info.key + " problem=" + info.problem);
        }
        for (const std::string& u : unreadable) line("list unreadable " + u);
        const auto gc = cache.gc(0);
        line("gc removed " + std::to_string(gc.removed));
        for (const std::string& u : gc.unreadable) line("gc unreadable " + u);
        const auto cleared = cache.clear();
        line("clear removed " + std::to_string(cleared.removed));
        for (const std::string& u : cleared.unreadable) line("clear unreadable " + u);
        ::chmod(shard.c_str(), 0700);
        line("left " + std::to_string(cache.list(false).size()));
      } catch (const std::exception& e) {
        line(std::string("threw ") + e.what());
      }
    }
    const ssize_t wrote = ::write(out[1], report.data(), report.size());
    ::_exit(wrote == static_cast<ssize_t>(report.size()) ? 0 : 1);
  }
  ::close(out[1]);
  std::string report;
  char buffer[4096];
  for (ssize_t n; (n = ::read(out[0], buffer, sizeof(buffer))) > 0;) report.append(buffer, n);
  ::close(out[0]);
  int status = 0;
  REQUIRE(::waitpid(child, &status, 0) == child);
  INFO(report);
  REQUIRE(WIFEXITED(status));
  CHECK(WEXITSTATUS(status) == 0);
  const std::string shard =
      dir + "/v" + std::to_string(moejit::kCacheSchemaVersion) + "/" + hidden_key.substr(0, 2);
  const auto has = [&report](const std::string& text) {
    return report.find(text) != std::string::npos;
  };
  CHECK(has("stored 1\n"));
  // verify names the shard it skipped, and still verifies the entry of the other shard.
  CHECK(has("list unreadable " + shard + ": Permission denied\n"));
  CHECK(has("/" + seen_key + ".mjc key=" + seen_key + " problem=\n"));
  CHECK_FALSE(has("listed " + shard + " "));
  // gc (to size 0) and clear remove the readable entry, and name the shard they skipped.
  CHECK(has("gc removed 1\n"));
  CHECK(has("gc unreadable " + shard + ": Permission denied\n"));
  CHECK(has("clear removed 0\n"));
  CHECK(has("clear unreadable " + shard + ": Permission denied\n"));
  CHECK(has("left 1\n"));  // the skipped shard's entry, readable again
  CHECK_FALSE(has("threw"));
}

TEST_CASE("clear also takes stale temp files and idle lock files, as gc would", "[cache]") {
  moejit::test::TempDir tmp;
  const std::string dir = tmp.path() + "/cache";
  DiskCache cache(dir, CacheMode::kReadWrite);
  const std::string key = key_for("clear-leftovers");
  const Leftovers left = plant_leftovers(cache, dir, key, key_for("clear-held"));

  const auto report = cache.clear();
  CHECK(report.removed == 1);
  CHECK(report.stale_temp_removed == 1);
  CHECK(report.not_removed == 0);
  CHECK(report.unreadable.empty());
  CHECK_FALSE(fs::exists(cache.entry_path(key)));
  CHECK(fs::exists(left.fresh));
  CHECK_FALSE(fs::exists(left.stale));
  CHECK_FALSE(fs::exists(left.idle_lock));
  CHECK(fs::exists(left.held_lock));
}

TEST_CASE("a lock file others can write is not waited on", "[cache]") {
  moejit::test::TempDir tmp;
  const std::string dir = tmp.path() + "/cache";
  DiskCache cache(dir, CacheMode::kReadWrite);
  const std::string key = key_for("planted-lock");
  const std::string path = dir + "/locks/" + key + ".lock";
  write_file(path, "");
  REQUIRE(::chmod(path.c_str(), 0666) == 0);
  // Held, as a planter would hold it forever.
  const int planted = ::open(path.c_str(), O_RDWR);
  REQUIRE(planted >= 0);
  REQUIRE(::flock(planted, LOCK_EX | LOCK_NB) == 0);
  LogCapture capture;
  DiskCache::Lock lock = cache.lock(key, nullptr, std::chrono::milliseconds(200));
  CHECK_FALSE(lock.held());
  INFO(capture.all());
  CHECK(capture.warned({"not waiting on lock file", path, "writable by group or others"}));
  CHECK_FALSE(capture.warned({"still held by another process"}));
  ::close(planted);
}

TEST_CASE(
    "a symlink, socket or directory of this user's at a lock path is cleared, and the lock taken",
    "[cache]") {
  LockPathCase c("planted at the lock path");
  auto& [tmp, dir, cache, key, path] = c;
  // What lock() leaves at the path either way: a regular file it holds, which excludes others.
  const auto lock_is_taken = [&](const std::vector<std::string>& warned) {
    LogCapture capture;
    DiskCache::Lock lock = cache.lock(key, nullptr, std::chrono::milliseconds(200));
    INFO(capture.all());
    CHECK(lock.held());
    CHECK(capture.warned(warned));
    CHECK_FALSE(capture.warned({"without the inter-process lock"}));
    struct stat st {};
    REQUIRE(::lstat(path.c_str(), &st) == 0);
    CHECK(S_ISREG(st.st_mode));
    const int other = ::open(path.c_str(), O_RDWR);
    REQUIRE(other >= 0);
    CHECK(::flock(other, LOCK_EX | LOCK_NB) != 0);
    ::close(other);
  };

  SECTION("a symlink is removed, never followed: its target keeps its bytes") {
    const std::string victim = tmp.path() + "/victim";
    write_file(victim, "not the cache's");
    REQUIRE(::symlink(victim.c_str(), path.c_str()) == 0);
    lock_is_taken({path, "was a symbolic link", "its target untouched"});
    CHECK(moejit::test::read_text(victim) == "not the cache's");
  }
  SECTION("a dangling symlink is removed too") {
    REQUIRE(::symlink((tmp.path() + "/nowhere").c_str(), path.c_str()) == 0);
    lock_is_taken({path, "was a symbolic link"});
    CHECK_FALSE(fs::exists(tmp.path() + "/nowhere"));
  }
  SECTION("a socket is removed") {
    make_socket_file(path);
    lock_is_taken({path, "was a socket"});
  }
  SECTION("a directory, with a file in it, is moved to quarantine/") {
    REQUIRE(::mkdir(path.c_str(), 0700) == 0);
    write_file(path + "/inside", "kept");
    lock_is_taken({path, "was a directory; moved to", "remove it by hand"});
    std::vector<fs::path> moved;
    for (const auto& e : fs::directory_iterator(dir + "/quarantine")) moved.push_back(e.path());
    REQUIRE(moved.size() == 1);
    CHECK(moejit::test::read_text(moved[0].string() + "/inside") == "kept");
  }
  if (::geteuid() == 0) {
    SECTION(
        "another user's symlink or directory stays, and the compile goes on unlocked (as root)") {
      for (const bool as_dir : {false, true}) {
        INFO((as_dir ? "a directory" : "a symlink"));
        fs::remove_all(path);
        if (as_dir) {
          REQUIRE(::mkdir(path.c_str(), 0700) == 0);
        } else {
          REQUIRE(::symlink((tmp.path() + "/nowhere").c_str(), path.c_str()) == 0);
        }
        REQUIRE(::lchown(path.c_str(), 12345, 12345) == 0);
        LogCapture capture;
        DiskCache::Lock lock = cache.lock(key, nullptr, std::chrono::milliseconds(200));
        INFO(capture.all());
        CHECK_FALSE(lock.held());
        CHECK(capture.warned({path, "of another user; it is left in place"}));
        CHECK(capture.warned({"cannot open lock file", path, "without the inter-process lock"}));
        struct stat st {};
        REQUIRE(::lstat(path.c_str(), &st) == 0);
        CHECK((as_dir ? S_ISDIR(st.st_mode) : S_ISLNK(st.st_mode)));
      }
    }
  }
}

TEST_CASE(
    "the writer refuses a cubin that is not a whole ELF image, and the reader never serves one",
    "[cache]") {
  moejit::test::TempDir tmp;
  const std::string dir = tmp.path() + "/cache";
  DiskCache cache(dir, CacheMode::kReadWrite);
  const std::string whole = make_entry(key_for("whole"), 100, 1).cubin;
  struct Case {
    const char* name;
    std::string cubin;
    const char* problem;
  };
  std::string table_outside = whole;  // e_shoff past the end
  table_outside[0x28] = static_cast<char>(0xf0);
  table_outside[0x29] = static_cast<char>(0xff);
  for (const Case& c : {Case{"empty", "", "not a little-endian ELF64 image (0 bytes)"},
                        Case{"text", "not a cubin", "not a little-endian ELF64 image (11 bytes)"},
                        Case{"a header cut short", whole.substr(0, 63),
                             "not a little-endian ELF64 image (63 bytes)"},
                        Case{"its section table past its end", table_outside,
                             "section table of 2 entries (offset 65520"}}) {
    SECTION(c.name) {
      const std::string key = key_for(c.name);
      Entry entry = make_entry(key, 100, 2);
      entry.cubin = c.cubin;
      LogCapture capture;
      std::string why_not;
      CHECK_FALSE(cache.store(entry, &why_not));
      CHECK(why_not.find(std::string("its cubin is not a whole ELF image: ") + c.problem) !=
            std::string::npos);
      CHECK_FALSE(fs::exists(cache.entry_path(key)));

      // Another writer's file whose hashes all agree with such a cubin: quarantined, not served.
      REQUIRE(cache.store(make_entry(key, 100, 3)));  // makes the shard
      forge_entry(cache.entry_path(key), entry);
      CHECK_FALSE(cache.load(key).has_value());
      INFO(capture.all());
      CHECK(capture.warned({cache.entry_path(key), "the stored cubin is not a whole ELF image",
                            c.problem, "moved to"}));
      CHECK_FALSE(fs::exists(cache.entry_path(key)));
    }
  }
}

TEST_CASE("a manifest the JSON writer can't hold as given is stored as a reader reads it back",
          "[cache]") {
  moejit::test::TempDir tmp;
  DiskCache cache(tmp.path() + "/cache", CacheMode::kReadWrite);
  // Bytes that are not UTF-8 in a compiler's log, and a compile time that is no JSON number.
  const std::string key = key_for("odd manifest");
  Entry entry = make_entry(key, 100, 1);
  entry.manifest.ptxas_info = "ptxas \xe9\xff info";
  entry.manifest.compile_ms = std::numeric_limits<double>::infinity();
  bool stored = false;
  REQUIRE_NOTHROW(stored = cache.store(entry));
  REQUIRE(stored);
  const std::optional<Entry> loaded = cache.load(key);
  REQUIRE(loaded.has_value());
  CHECK(loaded->cubin == entry.cubin);
  CHECK(loaded->manifest.ptxas_info == "ptxas \xef\xbf\xbd\xef\xbf\xbd info");  // U+FFFD twice
  CHECK(loaded->manifest.compile_ms == 0);
  entry.manifest.compile_ms = std::nan("");
  REQUIRE(cache.store(entry));
  REQUIRE(cache.load(key).has_value());
}

TEST_CASE("a manifest's sizes and times that are not integers are a bad entry", "[cache]") {
  moejit::test::TempDir tmp;
  DiskCache cache(tmp.path() + "/cache", CacheMode::kReadWrite);
  for (const char* field : {"cubin_size", "created_unix"}) {
    for (const char* value : {"1e300", "1.5", "-1e300"}) {
      DYNAMIC_SECTION(field << " " << value) {
        const std::string key = key_for(std::string(field) + value);
        const Entry entry = make_entry(key, 100, 1);
        REQUIRE(cache.store(entry));
        // The stored manifest with one number swapped for `value`.
        std::string manifest = moejit::test::read_text(cache.entry_path(key)).substr(64);
        manifest.resize(manifest.size() - entry.cubin.size());
        const std::string name = std::string("\"") + field + "\":";
        const std::size_t named = manifest.find(name);
        REQUIRE(named != std::string::npos);
        const std::size_t at = named + name.size();
        manifest.replace(at, manifest.find_first_of(",}", at) - at, value);
        forge_entry(cache.entry_path(key), entry, manifest);
        LogCapture capture;
        CHECK_FALSE(cache.load(key).has_value());
        INFO(capture.all());
        CHECK(capture.warned({"cubin_size or created_unix is not an integer", "moved to"}));
      }
    }
  }
}

TEST_CASE("an entry path under a shard that is not a directory is a miss that says so", "[cache]") {
  moejit::test::TempDir tmp;
  const std::string dir = tmp.path() + "/cache";
  DiskCache cache(dir, CacheMode::kReadWrite);
  const std::string key = key_for("shard is a file");
  const std::string path = cache.entry_path(key);
  write_file(path.substr(0, path.rfind('/')), "a file where the shard directory goes");
  LogCapture capture;
  CHECK_FALSE(cache.load(key).has_value());
  INFO(capture.all());
  CHECK(capture.warned({path, "a component of its directory is not a directory"}));
  std::string why_not;
  CHECK_FALSE(cache.store(make_entry(key, 100, 1), &why_not));
  CHECK(why_not.find("Not a directory") != std::string::npos);
}

TEST_CASE("a bad entry another process moved away first is reported as moved, not as a failure",
          "[cache]") {
  moejit::test::TempDir tmp;
  const std::string dir = tmp.path() + "/cache";
  DiskCache cache(dir, CacheMode::kReadWrite);
  const std::string key = key_for("moved by another");
  const std::string path = cache.entry_path(key);
  REQUIRE(cache.store(make_entry(key, 2000, 1)));
  flip_bit(path, fs::file_size(path) - 1);
  moejit::detail::CacheTestHooks hooks;
  hooks.before_quarantine_rename = [&] { REQUIRE(::unlink(path.c_str()) == 0); };
  HooksSet set(hooks);
  LogCapture capture;
  CHECK_FALSE(cache.load(key).has_value());
  INFO(capture.all());
  CHECK(capture.warned({path, "cubin hash", "it has already been moved away"}));
  CHECK_FALSE(capture.warned({"cannot move it"}));
}

TEST_CASE("a FIFO, symlink or directory at an entry's path is a miss, and a store replaces it",
          "[cache]") {
  moejit::test::TempDir tmp;
  const std::string dir = tmp.path() + "/cache";
  DiskCache cache(dir, CacheMode::kReadWrite);
  const std::string key = key_for("planted at the entry path");
  const std::string path = cache.entry_path(key);
  const Entry entry = make_entry(key, 1500, 7);
  REQUIRE(fs::create_directories(path.substr(0, path.rfind('/'))));
  // Whatever was planted, the store publishes there and the next load serves the entry.
  const auto store_and_load = [&](const std::vector<std::string>& warned) {
    LogCapture capture;
    std::string why_not;
    CHECK(cache.store(entry, &why_not));
    INFO(why_not << "\n" << capture.all());
    if (!warned.empty()) CHECK(capture.warned(warned));
    struct stat st {};
    REQUIRE(::lstat(path.c_str(), &st) == 0);
    CHECK(S_ISREG(st.st_mode));
    const std::optional<Entry> loaded = cache.load(key);
    REQUIRE(loaded.has_value());
    CHECK(loaded->cubin == entry.cubin);
  };
  const auto load_misses = [&](const std::vector<std::string>& warned) {
    LogCapture capture;
    CHECK_FALSE(cache.load(key).has_value());
    INFO(capture.all());
    CHECK(capture.warned(warned));
  };

  SECTION("a FIFO (opened without blocking)") {
    REQUIRE(::mkfifo(path.c_str(), 0600) == 0);
    load_misses({path, "is not a regular file"});
    store_and_load({});
  }
  SECTION("a symlink, never followed: its target keeps its bytes") {
    const std::string victim = tmp.path() + "/victim";
    write_file(victim, "not the cache's");
    REQUIRE(::symlink(victim.c_str(), path.c_str()) == 0);
    load_misses({path, "is a symbolic link"});
    store_and_load({});
    CHECK(moejit::test::read_text(victim) == "not the cache's");
  }
  SECTION("a directory, with a file in it, is moved to quarantine/ (gc leaves it there)") {
    REQUIRE(::mkdir(path.c_str(), 0700) == 0);
    write_file(path + "/inside", "kept");
    load_misses({path, "is not a regular file"});
    store_and_load({path, "was a directory; moved to", "remove it by hand"});
    std::vector<fs::path> moved;
    for (const auto& e : fs::directory_iterator(dir + "/quarantine")) moved.push_back(e.path());
    REQUIRE(moved.size() == 1);
    CHECK(fs::is_directory(moved[0]));
    CHECK(moejit::test::read_text(moved[0].string() + "/inside") == "kept");
    const auto report = cache.gc(0);
    CHECK(report.removed == 1);  // the entry; the directory stays
    CHECK(fs::is_directory(moved[0]));
  }
  if (::geteuid() == 0) {
    SECTION("another user's directory stays, and the store says why (as root)") {
      REQUIRE(::mkdir(path.c_str(), 0700) == 0);
      REQUIRE(::chown(path.c_str(), 12345, 12345) == 0);
      LogCapture capture;
      std::string why_not;
      CHECK_FALSE(cache.store(entry, &why_not));
      INFO(why_not << "\n" << capture.all());
      CHECK(capture.warned({path, "is a directory of another user"}));
      CHECK(why_not.find("Is a directory") != std::string::npos);
      CHECK(fs::is_directory(path));
    }
  }
}
