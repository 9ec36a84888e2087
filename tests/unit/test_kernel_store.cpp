// KernelStore: memory / disk / compile, single flight across threads and processes, healing of
// corrupt entries, read-only and unwritable caches, full disks, lock holders that fail, pid reuse.
#include <catch2/catch.hpp>
#include <fcntl.h>
#include <linux/sched.h>
#include <signal.h>
#include <spdlog/sinks/base_sink.h>
#include <sys/file.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iostream>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "cache/disk_cache.hpp"
#include "cache/kernel_store.hpp"
#include "common/hash.hpp"
#include "common/log.hpp"
#include "moejit/error.hpp"
#include "support/log_capture.hpp"
#include "support/support.hpp"

namespace fs = std::filesystem;
using moejit::CacheMode;
using moejit::CacheOutcome;
using moejit::detail::DiskCache;
using moejit::detail::Entry;
using moejit::detail::KernelStore;
using moejit::test::cubin_image;

namespace {

using moejit::test::WarningCapture;

std::string key_for(const std::string& name) { return moejit::detail::hash_bytes(name).hex(); }

// An entry for `key` whose cubin is an ELF image carrying `cubin` (cubin_image).
Entry built_entry(const std::string& key, const std::string& cubin) {
  Entry e;
  e.manifest.key = key;
  e.manifest.kernel = "test-kernel";
  e.manifest.lowered_name = "_Z4testv";
  e.manifest.options = {"--gpu-architecture=sm_90a"};
  e.cubin = cubin_image(cubin);
  return e;
}

void write_file(const std::string& path, const std::string& bytes) {
  int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
  REQUIRE(fd >= 0);
  REQUIRE(::write(fd, bytes.data(), bytes.size()) == static_cast<ssize_t>(bytes.size()));
  ::close(fd);
}

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

std::size_t count_files(const std::string& dir) {
  std::error_code ec;
  if (!fs::exists(dir, ec)) return 0;
  return static_cast<std::size_t>(std::distance(fs::directory_iterator(dir),
                                                fs::directory_iterator()));
}

std::shared_ptr<const DiskCache> open_disk(const std::string& dir, CacheMode mode) {
  return std::make_shared<const DiskCache>(dir, mode);
}

// Writing a cache entry fails with `error` for the holder's lifetime, as on a full disk (set
// after the caches are opened: their write probes would fail too).
class WritesFail {
 public:
  explicit WritesFail(int error) { moejit::detail::set_cache_test_hooks({error, {}}); }
  ~WritesFail() { moejit::detail::set_cache_test_hooks({}); }
  WritesFail(const WritesFail&) = delete;
  WritesFail& operator=(const WritesFail&) = delete;
};

// Writing a cache entry fails with `write_error` (0: it doesn't), and the clock that times the
// stores pause (DiskCache::store()) runs `clock_shift_ms` ahead, for the holder's lifetime; no
// hooks after. Set after the caches are opened, as WritesFail.
class DiskAndClock {
 public:
  DiskAndClock(int write_error, int64_t clock_shift_ms) {
    moejit::detail::CacheTestHooks hooks;
    hooks.write_error = write_error;
    hooks.steady_clock_shift_ms = clock_shift_ms;
    moejit::detail::set_cache_test_hooks(hooks);
  }
  ~DiskAndClock() { moejit::detail::set_cache_test_hooks({}); }
  DiskAndClock(const DiskAndClock&) = delete;
  DiskAndClock& operator=(const DiskAndClock&) = delete;
};

// Runs in a forked process: `threads` threads, released together once `start_fd` reaches EOF,
// each calling get(key) on one store. Writes "<outcome> <cubin hash>" per caller to
// `result_path`. Returns the process exit code.
int contend_in_child(const std::string& dir, const std::string& key,
                     const std::string& counter_path, const std::string& result_path,
                     int start_fd, int threads) {
  try {
    KernelStore store(open_disk(dir, CacheMode::kReadWrite));
    auto build = [&]() {
      int fd = ::open(counter_path.c_str(), O_WRONLY | O_CREAT | O_APPEND, 0600);
      if (fd < 0 || ::write(fd, "b", 1) != 1) throw std::runtime_error("counter write failed");
      ::close(fd);
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
      // Each build makes a different cubin, so two builds could never look like one.
      return built_entry(key, "cubin built by pid " + std::to_string(::getpid()) + " at " +
                                  std::to_string(std::chrono::steady_clock::now()
                                                     .time_since_epoch()
                                                     .count()));
    };
    std::mutex mutex;
    std::condition_variable cv;
    bool go = false;
    std::vector<std::string> lines(static_cast<std::size_t>(threads));
    std::vector<std::thread> pool;
    for (int t = 0; t < threads; ++t) {
      pool.emplace_back([&, t] {
        {
          std::unique_lock<std::mutex> lock(mutex);
          cv.wait(lock, [&] { return go; });
        }
        try {
          KernelStore::Result r = store.get(key, build);
          lines[static_cast<std::size_t>(t)] =
              std::to_string(static_cast<int>(r.outcome)) + " " +
              moejit::detail::hash_bytes(r.entry->cubin).hex();
        } catch (const std::exception& e) {
          lines[static_cast<std::size_t>(t)] = std::string("error ") + e.what();
        }
      });
    }
    char byte = 0;
    while (::read(start_fd, &byte, 1) < 0 && errno == EINTR) {
    }
    {
      std::lock_guard<std::mutex> lock(mutex);
      go = true;
    }
    cv.notify_all();
    for (auto& thread : pool) thread.join();
    std::string text;
    for (const std::string& line : lines) text += line + "\n";
    std::ofstream(result_path) << text;
    return 0;
  } catch (const std::exception& e) {
    std::ofstream(result_path) << "error " << e.what() << "\n";
    return 1;
  }
}

}  // namespace

TEST_CASE("get compiles once, then hits memory, then disk in a new process state", "[store]") {
  moejit::test::TempDir tmp;
  const std::string dir = tmp.path() + "/cache";
  const std::string key = key_for("outcomes");
  int builds = 0;
  auto build = [&] {
    ++builds;
    return built_entry(key, std::string(4096, 'c'));
  };

  KernelStore store(open_disk(dir, CacheMode::kReadWrite));
  KernelStore::Result first = store.get(key, build);
  CHECK(first.outcome == CacheOutcome::kCompiled);
  CHECK(builds == 1);
  REQUIRE(first.entry != nullptr);
  CHECK(first.entry->cubin == cubin_image(std::string(4096, 'c')));
  CHECK(first.entry->manifest.key == key);
  CHECK(first.entry->manifest.cubin_size == cubin_image(std::string(4096, 'c')).size());
  CHECK(first.entry->manifest.cubin_hash ==
        moejit::detail::hash_bytes(cubin_image(std::string(4096, 'c'))).hex());
  CHECK(first.entry->manifest.created_unix > 0);
  CHECK(first.milliseconds >= 0);

  KernelStore::Result second = store.get(key, build);
  CHECK(second.outcome == CacheOutcome::kMemoryHit);
  CHECK(second.entry == first.entry);
  CHECK(builds == 1);

  KernelStore fresh(open_disk(dir, CacheMode::kReadWrite));
  KernelStore::Result third = fresh.get(key, build);
  CHECK(third.outcome == CacheOutcome::kDiskHit);
  CHECK(builds == 1);
  CHECK(third.entry->cubin == first.entry->cubin);
  CHECK(third.entry->manifest.kernel == "test-kernel");
  CHECK(fresh.get(key, build).outcome == CacheOutcome::kMemoryHit);

  // A build answering for another key is a bug, reported as such; a malformed key is refused.
  const std::string other = key_for("other");
  try {
    (void)store.get(other, [&] { return built_entry(key, "x"); });
    FAIL("a build returning the wrong key was accepted");
  } catch (const moejit::Error& e) {
    CHECK(e.code() == moejit::ErrorCode::kInternal);
  }
  CHECK_THROWS_AS(store.get("not-a-key", build), moejit::Error);
}

TEST_CASE("24 callers in 3 processes on one cold key compile it exactly once", "[store]") {
  moejit::test::TempDir tmp;
  const std::string dir = tmp.path() + "/cache";
  const std::string key = key_for("cold-contended");
  const std::string counter = tmp.path() + "/builds";
  const int kProcesses = 3;
  const int kThreads = 8;

  int start_pipe[2];
  REQUIRE(::pipe(start_pipe) == 0);
  // Processes are forked before any thread exists; each makes its own threads.
  std::vector<pid_t> children;
  for (int p = 0; p < kProcesses; ++p) {
    const pid_t pid = ::fork();
    REQUIRE(pid >= 0);
    if (pid == 0) {
      ::prctl(PR_SET_PDEATHSIG, SIGKILL);
      ::close(start_pipe[1]);
      const std::string result = tmp.path() + "/result-" + std::to_string(p);
      ::_exit(contend_in_child(dir, key, counter, result, start_pipe[0], kThreads));
    }
    children.push_back(pid);
  }
  ::close(start_pipe[0]);
  // Give every child time to park its threads, then release them all at once (EOF).
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  ::close(start_pipe[1]);
  for (pid_t pid : children) {
    int status = 0;
    REQUIRE(::waitpid(pid, &status, 0) == pid);
    CHECK(WIFEXITED(status));
    CHECK(WEXITSTATUS(status) == 0);
  }

  CHECK(moejit::test::read_text(counter) == "b");  // exactly one build, machine-wide

  const std::string compiled = std::to_string(static_cast<int>(CacheOutcome::kCompiled));
  const std::string disk_hit = std::to_string(static_cast<int>(CacheOutcome::kDiskHit));
  const std::string memory_hit = std::to_string(static_cast<int>(CacheOutcome::kMemoryHit));
  std::vector<std::string> hashes;
  int compiling_processes = 0;
  for (int p = 0; p < kProcesses; ++p) {
    std::ifstream in(tmp.path() + "/result-" + std::to_string(p));
    std::string outcome, hash;
    int lines = 0;
    bool compiled_here = false;
    while (in >> outcome >> hash) {
      INFO("process " << p << ": " << outcome << " " << hash);
      REQUIRE(outcome != "error");
      CHECK((outcome == compiled || outcome == disk_hit || outcome == memory_hit));
      compiled_here |= outcome == compiled;
      ++lines;
      hashes.push_back(hash);
    }
    CHECK(lines == kThreads);
    compiling_processes += compiled_here ? 1 : 0;
  }
  REQUIRE(hashes.size() == static_cast<std::size_t>(kProcesses * kThreads));
  CHECK(std::all_of(hashes.begin(), hashes.end(), [&](const std::string& h) {
    return h == hashes.front();
  }));
  // Waiters share their process leader's result; only one process reports a compile.
  CHECK(compiling_processes == 1);
  // And the published entry is the one everybody got.
  DiskCache disk(dir, CacheMode::kReadWrite);
  auto entry = disk.load(key);
  REQUIRE(entry.has_value());
  CHECK(moejit::detail::hash_bytes(entry->cubin).hex() == hashes.front());
}

TEST_CASE("a failing build reaches every waiter, and the key is retried later", "[store]") {
  moejit::test::TempDir tmp;
  KernelStore store(open_disk(tmp.path() + "/cache", CacheMode::kReadWrite));
  const std::string key = key_for("failing");
  std::atomic<int> builds{0};
  auto failing = [&]() -> Entry {
    ++builds;
    std::this_thread::sleep_for(std::chrono::milliseconds(150));
    throw moejit::Error(moejit::ErrorCode::kCompileFailed, "nvrtc said no");
  };
  std::vector<std::string> errors(8);
  std::vector<std::thread> threads;
  for (std::size_t t = 0; t < errors.size(); ++t) {
    threads.emplace_back([&, t] {
      try {
        (void)store.get(key, failing);
        errors[t] = "no error";
      } catch (const moejit::Error& e) {
        errors[t] = std::string(moejit::error_code_name(e.code())) + ": " + e.what();
      }
    });
  }
  for (auto& thread : threads) thread.join();
  // Callers that arrive after a failure try again, so more than one build may run; every
  // caller sees the error, none a result.
  CHECK(builds >= 1);
  for (const std::string& e : errors) CHECK(e == "compile failed: nvrtc said no");

  const int failed_builds = builds;
  KernelStore::Result r = store.get(key, [&] { return built_entry(key, "now it works"); });
  CHECK(r.outcome == CacheOutcome::kCompiled);
  CHECK(r.entry->cubin == cubin_image("now it works"));
  CHECK(builds == failed_builds);
}

TEST_CASE("concurrent callers in one process share one build", "[store]") {
  moejit::test::TempDir tmp;
  KernelStore store(open_disk(tmp.path() + "/cache", CacheMode::kReadWrite));
  const std::string key = key_for("threads");
  std::atomic<int> builds{0};
  std::atomic<bool> go{false};
  std::vector<std::shared_ptr<const Entry>> got(16);
  std::vector<std::thread> threads;
  for (std::size_t t = 0; t < got.size(); ++t) {
    threads.emplace_back([&, t] {
      while (!go) std::this_thread::yield();
      got[t] = store.get(key, [&] {
                      ++builds;
                      std::this_thread::sleep_for(std::chrono::milliseconds(100));
                      return built_entry(key, "built " + std::to_string(t));
                    }).entry;
    });
  }
  go = true;
  for (auto& thread : threads) thread.join();
  CHECK(builds == 1);
  for (const auto& e : got) CHECK(e == got.front());
}

TEST_CASE("corrupt entries are logged, quarantined, rebuilt and republished", "[store]") {
  moejit::test::TempDir tmp;
  const std::string dir = tmp.path() + "/cache";
  const std::string key = key_for("heal");
  const std::string good(10000, 'g');
  {
    KernelStore store(open_disk(dir, CacheMode::kReadWrite));
    REQUIRE(store.get(key, [&] { return built_entry(key, good); }).outcome ==
            CacheOutcome::kCompiled);
  }
  const std::string path = DiskCache(dir, CacheMode::kReadWrite).entry_path(key);

  auto damage_and_heal = [&](const std::string& what, auto&& damage) {
    INFO(what);
    damage();
    WarningCapture capture;
    int builds = 0;
    KernelStore store(open_disk(dir, CacheMode::kReadWrite));
    KernelStore::Result r = store.get(key, [&] {
      ++builds;
      return built_entry(key, good);
    });
    CHECK(r.outcome == CacheOutcome::kCompiled);
    CHECK(builds == 1);
    CHECK(r.entry->cubin == cubin_image(good));
    CHECK(capture.warned({path, "failed verification", "quarantine"}));
    // Republished: a new store finds a verified entry on disk.
    KernelStore next(open_disk(dir, CacheMode::kReadWrite));
    KernelStore::Result again = next.get(key, [&]() -> Entry {
      FAIL("rebuilt although the healed entry is on disk");
      return {};
    });
    CHECK(again.outcome == CacheOutcome::kDiskHit);
    CHECK(again.entry->cubin == cubin_image(good));
  };

  damage_and_heal("truncated", [&] {
    REQUIRE(::truncate(path.c_str(), static_cast<off_t>(fs::file_size(path) - 100)) == 0);
  });
  CHECK(count_files(dir + "/quarantine") == 1);
  damage_and_heal("bit flipped", [&] {
    std::string bytes = moejit::test::read_text(path);
    bytes[bytes.size() / 2] = static_cast<char>(bytes[bytes.size() / 2] ^ 0x01);
    write_file(path, bytes);
  });
  CHECK(count_files(dir + "/quarantine") == 2);
}

TEST_CASE("read-only cache: hits load, misses compile without storing", "[store]") {
  moejit::test::TempDir tmp;
  const std::string dir = tmp.path() + "/cache";
  const std::string cached = key_for("baked"), missing = key_for("not-baked");
  {
    KernelStore writer(open_disk(dir, CacheMode::kReadWrite));
    writer.get(cached, [&] { return built_entry(cached, "baked cubin"); });
  }
  const auto before = snapshot(tmp.path());
  KernelStore store(open_disk(dir, CacheMode::kReadOnly));
  int builds = 0;
  auto build = [&] {
    ++builds;
    return built_entry(missing, "fresh cubin");
  };
  KernelStore::Result hit = store.get(cached, build);
  CHECK(hit.outcome == CacheOutcome::kDiskHit);
  CHECK(hit.entry->cubin == cubin_image("baked cubin"));
  KernelStore::Result miss = store.get(missing, build);
  CHECK(miss.outcome == CacheOutcome::kCompiledNotStored);
  CHECK(miss.entry->cubin == cubin_image("fresh cubin"));
  CHECK(store.get(missing, build).outcome == CacheOutcome::kMemoryHit);
  CHECK(builds == 1);
  CHECK(snapshot(tmp.path()) == before);
}

TEST_CASE("an unwritable cache dir still builds, without storing", "[store]") {
  moejit::test::TempDir tmp;
  const std::string key = key_for("unwritable-store");
  auto build = [&] { return built_entry(key, "cubin"); };

  SECTION("a path through a regular file") {
    write_file(tmp.path() + "/regular", "x");
    KernelStore store(open_disk(tmp.path() + "/regular/cache", CacheMode::kReadWrite));
    CHECK(store.disk().effective_mode() == CacheMode::kMemoryOnly);
    CHECK(store.get(key, build).outcome == CacheOutcome::kCompiledNotStored);
    CHECK(store.get(key, build).outcome == CacheOutcome::kMemoryHit);
  }
  SECTION("a chmod 0500 cache dir") {
    if (::geteuid() == 0) {
      std::cout << "SKIPPED: chmod 0500 cache dir: running as root, which ignores directory "
                   "permissions"
                << std::endl;
      return;
    }
    const std::string dir = tmp.path() + "/cache";
    const std::string cached = key_for("cached-before-chmod");
    {
      KernelStore writer(open_disk(dir, CacheMode::kReadWrite));
      writer.get(cached, [&] { return built_entry(cached, "old"); });
    }
    for (const auto& e : fs::recursive_directory_iterator(dir)) {
      if (e.is_directory()) REQUIRE(::chmod(e.path().c_str(), 0500) == 0);
    }
    REQUIRE(::chmod(dir.c_str(), 0500) == 0);
    KernelStore store(open_disk(dir, CacheMode::kReadWrite));
    CHECK(store.disk().effective_mode() == CacheMode::kReadOnly);
    CHECK(store.get(key, build).outcome == CacheOutcome::kCompiledNotStored);
    CHECK(store.get(cached, build).outcome == CacheOutcome::kDiskHit);
  }
}

// What a forked child (a prefork server, Python multiprocessing) finds: its parent's flights and
// a copy of the store's mutex.
TEST_CASE("a forked child neither waits for its parent's flight nor for a copied mutex",
          "[store]") {
  moejit::test::TempDir tmp;
  KernelStore store(open_disk(tmp.path() + "/cache", CacheMode::kMemoryOnly));

  // A key the parent is still compiling when it forks.
  const std::string slow = key_for("parent-in-flight");
  std::atomic<bool> started{false};
  std::thread leader([&] {
    store.get(slow, [&] {
      started = true;
      std::this_thread::sleep_for(std::chrono::milliseconds(1500));
      return built_entry(slow, "parent");
    });
  });
  while (!started) std::this_thread::yield();
  // (A child that waited on the parent's flight is killed by its alarm.)
  CHECK(moejit::test::forked_child_passes([&] {
    KernelStore::Result r = store.get(slow, [&] { return built_entry(slow, "child"); });
    return r.outcome == CacheOutcome::kCompiledNotStored && r.entry->cubin == cubin_image("child");
  }));
  leader.join();
  CHECK(store.get(slow, [&] { return built_entry(slow, "again"); }).entry->cubin ==
        cubin_image("parent"));

  // Forks while another thread takes the store's mutex in a loop (memory hits).
  const std::string hot = key_for("memory-hot");
  store.get(hot, [&] { return built_entry(hot, "hot"); });
  const auto hit = [&] {
    return store.get(hot, [&] { return built_entry(hot, "unused"); }).entry->cubin ==
           cubin_image("hot");
  };
  // (Without the fork handlers about half of these children block, each until its alarm.)
  CHECK(moejit::test::children_failing_under([&] { (void)hit(); }, hit) == 0);
}

namespace {

// Runs in the process forked from the one that had `key` in flight (`ancestor`, which exits):
// once that pid is free, makes a process with it (clone3 with set_tid), which asks `store` for
// `key` and writes "led" to `out` when it is not made to wait. Writes one line of what happened.
void reuse_ancestor_pid(KernelStore& store, const std::string& key, pid_t ancestor, int out) {
  const auto say = [out](const std::string& line) {
    const std::string text = line + "\n";
    if (::write(out, text.data(), text.size()) < 0) ::_exit(2);
  };
  clone_args args{};
  args.exit_signal = SIGCHLD;
  pid_t wanted = ancestor;
  args.set_tid = reinterpret_cast<uint64_t>(&wanted);
  args.set_tid_size = 1;
  long made = -1;
  // EEXIST while the ancestor is still running or not yet reaped.
  for (int attempt = 0; attempt < 1000; ++attempt) {
    made = ::syscall(SYS_clone3, &args, sizeof(args));
    if (made >= 0 || errno != EEXIST) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  if (made < 0) {
    say(std::string("skip: clone3 with set_tid failed: ") + std::strerror(errno));
    return;
  }
  if (made == 0) {
    ::alarm(5);  // a process that waits for the ancestor's flight is killed here
    const bool same_pid = ::getpid() == ancestor;
    const KernelStore::Result r = store.get(key, [&] { return built_entry(key, "reused"); });
    say(std::string(same_pid ? "same pid, " : "other pid, ") +
        (r.entry->cubin == cubin_image("reused") ? "led" : "got another's entry"));
    ::_exit(0);
  }
  int status = 0;
  ::waitpid(static_cast<pid_t>(made), &status, 0);
  say(WIFEXITED(status) ? "exit " + std::to_string(WEXITSTATUS(status))
                        : "killed by signal " + std::to_string(WTERMSIG(status)));
}

}  // namespace

// A process forks while one of its threads compiles a key and exits; a process forked from that
// child later gets the first one's pid. Why clone3 with set_tid: it picks the pid, which needs
// root (else SKIPPED); the process it makes skips the fork handlers, which a copy of a
// single-threaded process does not need.
TEST_CASE("a process that got its ancestor's pid does not wait for the ancestor's flight",
          "[store]") {
  const std::string key = key_for("flight of an exited ancestor");
  int out[2];
  REQUIRE(::pipe(out) == 0);
  const pid_t reaper = ::fork();
  REQUIRE(reaper >= 0);
  if (reaper == 0) {
    // Reaps the ancestor (freeing its pid) and adopts the child it leaves behind.
    ::close(out[0]);
    ::alarm(30);
    ::prctl(PR_SET_CHILD_SUBREAPER, 1);
    const pid_t ancestor = ::fork();
    if (ancestor == 0) {
      KernelStore store(open_disk("", CacheMode::kMemoryOnly));
      std::atomic<bool> started{false};
      std::thread leader([&] {
        store.get(key, [&]() -> Entry {
          started = true;
          std::this_thread::sleep_for(std::chrono::seconds(20));
          return built_entry(key, "never");
        });
      });
      while (!started) std::this_thread::yield();
      const pid_t me = ::getpid();
      if (::fork() == 0) {
        reuse_ancestor_pid(store, key, me, out[1]);
        ::_exit(0);
      }
      ::_exit(0);  // with the compile still in flight
    }
    while (::wait(nullptr) > 0 || errno == EINTR) {
    }
    ::_exit(0);
  }
  ::close(out[1]);
  std::string report;
  char buffer[256];
  for (ssize_t n; (n = ::read(out[0], buffer, sizeof(buffer))) > 0;) report.append(buffer, n);
  ::close(out[0]);
  int status = 0;
  REQUIRE(::waitpid(reaper, &status, 0) == reaper);
  if (report.rfind("skip: ", 0) == 0) {
    std::cout << "SKIPPED: pid reuse: " << report.substr(6) << std::flush;
    return;
  }
  INFO(report);
  CHECK(report == "same pid, led\nexit 0\n");
}

TEST_CASE("memory-only store never touches the disk", "[store]") {
  moejit::test::TempDir tmp;
  const std::string key = key_for("memory-only-store");
  const auto before = snapshot(tmp.path());
  KernelStore store(open_disk(tmp.path() + "/cache", CacheMode::kMemoryOnly));
  int builds = 0;
  auto build = [&] {
    ++builds;
    return built_entry(key, "in memory");
  };
  CHECK(store.get(key, build).outcome == CacheOutcome::kCompiledNotStored);
  CHECK(store.get(key, build).outcome == CacheOutcome::kMemoryHit);
  CHECK(builds == 1);
  CHECK(snapshot(tmp.path()) == before);
  CHECK_FALSE(fs::exists(tmp.path() + "/cache"));
}

TEST_CASE("a key published while another process still holds its lock is a disk hit", "[store]") {
  moejit::test::TempDir tmp;
  const std::string dir = tmp.path() + "/cache";
  const std::string key = key_for("published under a held lock");
  KernelStore store(open_disk(dir, CacheMode::kReadWrite));
  // The other process: takes the lock through its own open file description, publishes, and
  // then never releases (stopped, hung, or a child it forked still holds the descriptor).
  const int holder =
      ::open((dir + "/locks/" + key + ".lock").c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600);
  REQUIRE(holder >= 0);
  REQUIRE(::flock(holder, LOCK_EX | LOCK_NB) == 0);
  std::thread publisher([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(150));
    CHECK(open_disk(dir, CacheMode::kReadWrite)->store(built_entry(key, "their cubin")));
  });
  int builds = 0;
  const auto start = std::chrono::steady_clock::now();
  KernelStore::Result result = store.get(key, [&] {
    ++builds;
    return built_entry(key, "our cubin");
  });
  const double waited =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  publisher.join();
  ::close(holder);
  CHECK(builds == 0);
  CHECK(result.outcome == CacheOutcome::kDiskHit);
  CHECK(result.entry->cubin == cubin_image("their cubin"));
  CHECK(waited < 10.0);  // well before the lock wait bound
}

TEST_CASE("a store that fails for lack of space pauses stores and locks, said once", "[store]") {
  moejit::test::TempDir tmp;
  const std::string dir = tmp.path() + "/cache";
  auto disk = open_disk(dir, CacheMode::kReadWrite);
  REQUIRE(disk->effective_mode() == CacheMode::kReadWrite);
  KernelStore store(disk);
  const std::string cached = key_for("stored before the disk filled");
  const std::string first = key_for("first after the disk filled");
  const std::string second = key_for("second after the disk filled");
  auto build = [](const std::string& key) { return [key] { return built_entry(key, "cubin"); }; };
  REQUIRE(store.get(cached, build(cached)).outcome == CacheOutcome::kCompiled);

  WritesFail full(ENOSPC);
  WarningCapture warnings;
  // The debug line of the build names the cause, not "not writable".
  moejit::test::LogWatch cause("not stored (writing");
  CHECK(store.get(first, build(first)).outcome == CacheOutcome::kCompiledNotStored);
  CHECK(cause.seen());
  CHECK(store.get(second, build(second)).outcome == CacheOutcome::kCompiledNotStored);
  INFO(warnings.all());
  CHECK(warnings.warning_count() == 1);
  CHECK(warnings.warned(
      {"not stored", "No space left on device", "for the next 60 s", "stores no entries", dir}));
  // No lock is taken for a compile that can't be published.
  CHECK(fs::exists(dir + "/locks/" + first + ".lock"));
  CHECK_FALSE(fs::exists(dir + "/locks/" + second + ".lock"));
  // Entries already on disk still load (in a store that has not seen them yet).
  KernelStore reader(disk);
  CHECK(reader.get(cached, build(cached)).outcome == CacheOutcome::kDiskHit);
}

TEST_CASE("once the stores pause is over a store is tried again; one that succeeds ends the pause",
          "[store]") {
  moejit::test::TempDir tmp;
  const std::string dir = tmp.path() + "/cache";
  auto disk = open_disk(dir, CacheMode::kReadWrite);
  REQUIRE(disk->effective_mode() == CacheMode::kReadWrite);
  KernelStore store(disk);
  auto build = [](const std::string& key) { return [key] { return built_entry(key, "cubin"); }; };
  const auto get = [&](const std::string& key) { return store.get(key, build(key)).outcome; };
  const auto lock_taken = [&](const std::string& key) {
    return fs::exists(dir + "/locks/" + key + ".lock");
  };
  std::vector<std::string> keys;
  for (int i = 0; i < 6; ++i) keys.push_back(key_for("pause ends " + std::to_string(i)));
  const int64_t pause_ms = int64_t{DiskCache::kStoresPauseSeconds} * 1000;

  WarningCapture warnings;
  {
    DiskAndClock full(ENOSPC, 0);
    CHECK(get(keys[0]) == CacheOutcome::kCompiledNotStored);  // pauses stores and locks
    CHECK(lock_taken(keys[0]));
  }
  {
    // Past the pause, the disk still full: the next store is tried again, under a compile lock,
    // fails the same way and pauses stores again, with no second warning.
    DiskAndClock full(ENOSPC, pause_ms + 1000);
    moejit::test::LogWatch tried("not stored (writing");
    CHECK(get(keys[1]) == CacheOutcome::kCompiledNotStored);
    CHECK(tried.seen());
    CHECK(lock_taken(keys[1]));
    moejit::test::LogWatch paused("not stored (a store in this process failed less than 60 s ago");
    CHECK(get(keys[2]) == CacheOutcome::kCompiledNotStored);
    CHECK(paused.seen());
    CHECK_FALSE(lock_taken(keys[2]));
  }
  {
    INFO(warnings.all());
    CHECK(warnings.warning_count() == 1);
  }
  {
    // Room again, but the new pause (from the retry) is not over: nothing is tried.
    DiskAndClock room(0, pause_ms + 1000);
    CHECK(get(keys[3]) == CacheOutcome::kCompiledNotStored);
    CHECK_FALSE(lock_taken(keys[3]));
  }
  {
    // Past the new pause too, a store succeeds and ends the pause.
    DiskAndClock room(0, 2 * pause_ms + 2000);
    moejit::test::LogWatch resumed("stores resumed");
    CHECK(get(keys[4]) == CacheOutcome::kCompiled);
    CHECK(resumed.seen());
    CHECK(lock_taken(keys[4]));
  }
  KernelStore fresh(open_disk(dir, CacheMode::kReadWrite));
  CHECK(fresh.get(keys[4], build(keys[4])).outcome == CacheOutcome::kDiskHit);
  {
    // The pause ended, the next store that fails for lack of space warns again.
    DiskAndClock full(ENOSPC, 2 * pause_ms + 2000);
    CHECK(get(keys[5]) == CacheOutcome::kCompiledNotStored);
    CHECK(lock_taken(keys[5]));
  }
  INFO(warnings.all());
  REQUIRE(warnings.warning_count() == 2);
  CHECK(warnings.warned({keys[5], "No space left on device", "for the next 60 s"}));
}

// Other processes waiting for a key's lock while its holder fails (its build throws, or its
// store fails, and it marks the lock file) or dies (it marks nothing).
TEST_CASE("waiters of a holder that failed build side by side; of one that died, one at a time",
          "[store]") {
  for (const bool holder_marks : {true, false}) {
    INFO((holder_marks ? "the holder failed and marked the lock" : "the holder died"));
    moejit::test::TempDir tmp;
    const std::string dir = tmp.path() + "/cache";
    const std::string key = key_for("holder failed");
    auto disk_a = open_disk(dir, CacheMode::kReadWrite);
    auto disk_b = open_disk(dir, CacheMode::kReadWrite);
    KernelStore waiter_a(disk_a);
    KernelStore waiter_b(disk_b);
    const int holder =
        ::open((dir + "/locks/" + key + ".lock").c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600);
    REQUIRE(holder >= 0);
    REQUIRE(::flock(holder, LOCK_EX | LOCK_NB) == 0);
    // Both waiters are on the lock before the holder lets go.
    std::mutex m;
    std::condition_variable both_waiting;
    int waiting = 0;
    moejit::detail::CacheTestHooks hooks;
    hooks.lock_waiting = [&] {
      std::lock_guard<std::mutex> guard(m);
      ++waiting;
      both_waiting.notify_all();
    };
    moejit::detail::set_cache_test_hooks(hooks);
    std::atomic<int> builds{0};
    std::atomic<int> building{0};
    std::atomic<int> most_building{0};
    auto build = [&] {
      ++builds;
      const int now = ++building;
      int most = most_building.load();
      while (now > most && !most_building.compare_exchange_weak(most, now)) {
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
      --building;
      return built_entry(key, "cubin");
    };
    CacheOutcome outcome_a = CacheOutcome::kMemoryHit;
    CacheOutcome outcome_b = CacheOutcome::kMemoryHit;
    std::thread a([&] { outcome_a = waiter_a.get(key, build).outcome; });
    std::thread b([&] { outcome_b = waiter_b.get(key, build).outcome; });
    {
      std::unique_lock<std::mutex> guard(m);
      REQUIRE(both_waiting.wait_for(guard, std::chrono::seconds(30), [&] { return waiting == 2; }));
    }
    if (holder_marks) REQUIRE(::ftruncate(holder, 1) == 0);
    ::close(holder);  // released without publishing
    a.join();
    b.join();
    moejit::detail::set_cache_test_hooks({});
    if (holder_marks) {
      // Under the lock the second build would start only once the first had stored.
      CHECK(builds == 2);
      CHECK(most_building == 2);
    } else {
      // The first waiter's entry serves the second.
      CHECK(builds == 1);
      CHECK(((outcome_a == CacheOutcome::kCompiled && outcome_b == CacheOutcome::kDiskHit) ||
             (outcome_b == CacheOutcome::kCompiled && outcome_a == CacheOutcome::kDiskHit)));
    }
  }
}
