// The runtime end to end with real NVRTC, no GPU: memory / disk / compile outcomes, one compile
// across threads and processes, read-only and unusable cache dirs, healing of corrupt entries,
// prewarm of the reference shapes.
#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <catch2/catch.hpp>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <mutex>
#include <sstream>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include <spdlog/sinks/base_sink.h>

#include "common/log.hpp"
#include "compile/nvrtc.hpp"
#include "driver/driver.hpp"
#include "moejit/error.hpp"
#include "moejit/kernel_spec.hpp"
#include "moejit/moejit.h"
#include "moejit/runtime.hpp"
#include "moejit/shape.hpp"
#include "ops/append_shared_spec.hpp"
#include "runtime/runtime_impl.hpp"
#include "support/log_capture.hpp"
#include "support/support.hpp"

extern char** environ;

namespace {

namespace fs = std::filesystem;
using moejit::Arch;
using moejit::BuildResult;
using moejit::CacheMode;
using moejit::CacheOutcome;
using moejit::DType;
using moejit::KernelSpec;
using moejit::SharedGate;

void use_cache(const std::string& dir, CacheMode mode) {
  moejit::RuntimeConfig config;
  config.cache_dir = dir;
  config.cache_mode = mode;
  moejit::configure(config);
}

KernelSpec spec_of(int top_k, int num_shared, DType id = DType::kI32,
                   SharedGate gate = SharedGate::kSigmoid, DType logit = DType::kBF16) {
  KernelSpec spec;
  spec.family = moejit::Family::kAppendShared;
  spec.arch = Arch::parse("sm_90a");
  spec.params = moejit::detail::append_shared_params(top_k, num_shared, id, gate, logit);
  return spec;
}

const char* outcome_word(CacheOutcome outcome) {
  switch (outcome) {
    case CacheOutcome::kMemoryHit: return "memory";
    case CacheOutcome::kDiskHit: return "disk";
    case CacheOutcome::kCompiled: return "compiled";
    case CacheOutcome::kCompiledNotStored: return "notstored";
  }
  return "unknown";
}

// Every file and directory under `dir` with its size and modification time.
std::map<std::string, std::tuple<bool, uintmax_t, long long>> snapshot(const std::string& dir) {
  std::map<std::string, std::tuple<bool, uintmax_t, long long>> out;
  for (const auto& item : fs::recursive_directory_iterator(dir)) {
    struct stat st {};
    REQUIRE(::lstat(item.path().c_str(), &st) == 0);
    const bool is_dir = S_ISDIR(st.st_mode);
    out[item.path().string()] = {
        is_dir, is_dir ? 0 : static_cast<uintmax_t>(st.st_size),
        static_cast<long long>(st.st_mtim.tv_sec) * 1000000000LL + st.st_mtim.tv_nsec};
  }
  return out;
}

using WarnCapture = moejit::test::WarningCapture;

bool any_contains(const std::vector<std::string>& texts, const std::string& part) {
  for (const std::string& text : texts) {
    if (text.find(part) != std::string::npos) return true;
  }
  return false;
}

bool wait_for_file(const std::string& path, std::chrono::seconds limit) {
  const auto deadline = std::chrono::steady_clock::now() + limit;
  while (!fs::exists(path)) {
    if (std::chrono::steady_clock::now() > deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  return true;
}

void write_file(const std::string& path, const std::string& text) {
  const std::string temp = path + ".tmp";
  {
    std::ofstream out(temp, std::ios::binary);
    out << text;
  }
  fs::rename(temp, path);
}

// Starts this test binary on its hidden case tagged `tag` (no brackets; compact reporter) in a
// child process whose stdout and stderr go to `log`, with this process's environment less the
// variables `dropped` and plus `added` ("NAME=value" each) and kChildCaseVariable = `tag`. Returns
// its pid, or -1 if fork failed. Why exec: the child must start without the threads this process
// may already have (a fork of a threaded process may inherit held locks), and gets a runtime of its
// own.
pid_t start_self(const std::string& tag, const std::string& log,
                 const std::vector<std::string>& added,
                 const std::vector<std::string>& dropped = {}) {
  std::vector<std::string> env_strings;
  for (char** e = environ; *e != nullptr; ++e) {
    const std::string entry = *e;
    const bool drop = entry.rfind(std::string(moejit::test::kChildCaseVariable) + "=", 0) == 0 ||
                      std::any_of(dropped.begin(), dropped.end(), [&](const std::string& name) {
                        return entry.rfind(name + "=", 0) == 0;
                      });
    if (!drop) env_strings.push_back(entry);
  }
  env_strings.insert(env_strings.end(), added.begin(), added.end());
  env_strings.push_back(std::string(moejit::test::kChildCaseVariable) + "=" + tag);
  std::vector<char*> envp;
  for (std::string& s : env_strings) envp.push_back(s.data());
  envp.push_back(nullptr);
  std::string self = fs::read_symlink("/proc/self/exe").string();
  std::string tag_arg = "[" + tag + "]";
  std::string quiet = "--reporter=compact";
  std::vector<char*> argv = {self.data(), tag_arg.data(), quiet.data(), nullptr};
  const pid_t pid = ::fork();
  if (pid == 0) {
    // Only async-signal-safe calls between fork and exec.
    const int fd = ::open(log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
    if (fd >= 0) {
      ::dup2(fd, 1);
      ::dup2(fd, 2);
    }
    ::execve(self.c_str(), argv.data(), envp.data());
    ::_exit(127);
  }
  return pid;
}

// The spec the multi-process test races on (no other test builds it).
KernelSpec race_spec() { return spec_of(7, 3, DType::kI64, SharedGate::kSigmoid, DType::kF16); }

constexpr int kRaceThreads = 8;
constexpr int kRaceProcesses = 3;

// The runtime cases' shape, 64 experts and one shared expert: on sm_75 its append_shared, route
// and repack kernels run, its marlin_moe and combine kernels need sm_80.
moejit::ModelShape probe_shape() {
  moejit::ModelShape shape;
  shape.name = "probe";
  shape.num_experts = 64;
  shape.top_k = 8;
  shape.hidden = 2048;
  shape.intermediate = 768;
  shape.shared.count = 1;
  shape.shared.intermediate = 768;
  shape.shared.gate = SharedGate::kConstant;
  return shape;
}

}  // namespace

TEST_CASE("runtime: compile, then memory hit, then disk hit in a fresh store", "[runtime]") {
  moejit::test::TempDir dir;
  const std::string cache = dir.path() + "/cache";
  use_cache(cache, CacheMode::kReadWrite);
  const KernelSpec spec = spec_of(6, 1);

  const BuildResult first = moejit::build_kernel(spec);
  CHECK(first.outcome == CacheOutcome::kCompiled);
  CHECK(first.error.empty());
  CHECK(first.key.size() == 32);
  CHECK(first.spec == spec);
  CHECK(first.milliseconds > 0);
  CHECK(fs::exists(moejit::detail::Runtime::instance().store().disk().entry_path(first.key)));

  const BuildResult second = moejit::build_kernel(spec);
  CHECK(second.outcome == CacheOutcome::kMemoryHit);
  CHECK(second.key == first.key);

  use_cache(cache, CacheMode::kReadWrite);  // a fresh store: empty memory, same disk
  const BuildResult third = moejit::build_kernel(spec);
  CHECK(third.outcome == CacheOutcome::kDiskHit);
  CHECK(third.key == first.key);
  CHECK(moejit::detail::Runtime::instance().cache_key(spec) == first.key);

  CHECK(moejit::config().cache_dir == cache);
  CHECK(moejit::config().cache_mode == CacheMode::kReadWrite);
}

// config() is a copy taken under the configuration's lock, so a thread may read it while another
// configures: every copy is one whole configuration (its cache_dir, mode and check_pointers from
// the same configure() call), never a mix or a string being replaced. Two configurations
// alternate 100000 times (before any load, so each call replaces every field).
TEST_CASE("runtime: config() beside configure() on another thread reads whole configurations",
          "[runtime]") {
  moejit::test::TempDir dir;
  moejit::RuntimeConfig a;
  a.cache_dir = dir.path() + "/a-cache-with-a-name-longer-than-short-string-storage";
  a.cache_mode = CacheMode::kReadWrite;
  a.check_pointers = true;
  moejit::RuntimeConfig b;
  b.cache_dir = dir.path() + "/b";
  b.cache_mode = CacheMode::kMemoryOnly;
  b.check_pointers = false;
  moejit::configure(a);
  std::atomic<bool> reading{false};
  std::atomic<bool> done{false};
  std::thread writer([&] {
    while (!reading.load()) std::this_thread::yield();  // so the reads overlap the writes
    for (int i = 0; i < 100000; ++i) moejit::configure(i % 2 == 0 ? b : a);
    done.store(true);
  });
  std::size_t reads = 0;
  std::size_t mixed = 0;
  reading.store(true);
  while (!done.load()) {
    const moejit::RuntimeConfig now = moejit::config();
    const bool is_a = now.cache_dir == a.cache_dir && now.cache_mode == a.cache_mode &&
                      now.check_pointers == a.check_pointers;
    const bool is_b = now.cache_dir == b.cache_dir && now.cache_mode == b.cache_mode &&
                      now.check_pointers == b.check_pointers;
    if (!is_a && !is_b) ++mixed;
    ++reads;
  }
  writer.join();
  INFO(reads << " reads beside the writes");
  CHECK(mixed == 0);
  CHECK(moejit::config().cache_dir == a.cache_dir);  // the last call (i = 99999) set a
  use_cache(dir.path() + "/cache", CacheMode::kReadWrite);
}

// Run by the case below in a process of its own started with an unusable MOEJIT_CACHE_MODE:
// set_check_pointers changes the checks and keeps the environment's error, which the first build
// still throws (a configure() would have replaced it), and prewarm throws before any kernel.
TEST_CASE("runtime child: set_check_pointers under an unusable environment",
          "[.][runtime_env_child]") {
  if (!moejit::test::started_by_parent(
          "runtime_env_child",
          "runtime: set_check_pointers turns the checks on and off and changes nothing else")) {
    return;
  }
  REQUIRE(std::getenv("MOEJIT_CHECK_POINTERS") == nullptr);
  int previous = -1;
  REQUIRE(moejit_set_check_pointers(1, &previous) == MOEJIT_OK);
  CHECK(previous == 0);
  CHECK(moejit::config().check_pointers);
  try {
    moejit::build_kernel(spec_of(6, 1));
    FAIL("a kernel was built under MOEJIT_CACHE_MODE=sometimes");
  } catch (const moejit::Error& e) {
    CHECK(e.code() == moejit::ErrorCode::kInvalidArgument);
    CHECK(std::string(e.what()).find("MOEJIT_CACHE_MODE=sometimes") != std::string::npos);
  }
  // prewarm says it once, as the call's error, not as each kernel's compile failure.
  std::size_t calls = 0;
  try {
    moejit::prewarm({probe_shape()}, {Arch::parse("sm_90a")}, 2,
                    [&](const BuildResult&, std::size_t, std::size_t) { ++calls; });
    FAIL("prewarm ran under MOEJIT_CACHE_MODE=sometimes");
  } catch (const moejit::Error& e) {
    CHECK(e.code() == moejit::ErrorCode::kInvalidArgument);
    CHECK(std::string(e.what()).rfind("prewarm: ", 0) == 0);
    CHECK(std::string(e.what()).find("MOEJIT_CACHE_MODE=sometimes") != std::string::npos);
  }
  CHECK(calls == 0);
  const char* tiny = R"({"shapes": [{"name": "env-child-tiny", "num_experts": 16, "top_k": 2,
    "hidden": 512, "intermediate": 256, "activation": {"kind": "swiglu"}}]})";
  REQUIRE(moejit_register_shapes(tiny, "env-child") == MOEJIT_OK);
  const char* names[] = {"env-child-tiny"};
  moejit_prewarm_result result{};
  result.struct_size = sizeof(result);
  CHECK(moejit_prewarm(names, 1, "sm_90a", 2, nullptr, nullptr, &result) ==
        MOEJIT_ERROR_INVALID_ARGUMENT);
  CHECK(std::string(moejit_last_error()).rfind("moejit_prewarm: ", 0) == 0);
  CHECK(std::string(moejit_last_error()).find("MOEJIT_CACHE_MODE=sometimes") != std::string::npos);
}

// set_check_pointers (C: moejit_set_check_pointers) changes check_pointers alone, as the ops read
// it (Runtime::check_pointers) and as config() reports it, and returns the previous setting.
TEST_CASE("runtime: set_check_pointers turns the checks on and off and changes nothing else",
          "[runtime]") {
  moejit::test::TempDir dir;
  use_cache(dir.path() + "/cache", CacheMode::kReadWrite);  // check_pointers off
  const moejit::RuntimeConfig before = moejit::config();
  const auto& runtime = moejit::detail::Runtime::instance();
  CHECK_FALSE(moejit::set_check_pointers(true));
  CHECK(runtime.check_pointers());
  const moejit::RuntimeConfig on = moejit::config();
  CHECK(on.check_pointers);
  CHECK(on.cache_dir == before.cache_dir);
  CHECK(on.cache_mode == before.cache_mode);
  CHECK(on.allow_compile_during_capture == before.allow_compile_during_capture);
  CHECK(on.line_info == before.line_info);
  int previous = -1;
  CHECK(moejit_set_check_pointers(0, &previous) == MOEJIT_OK);
  CHECK(previous == 1);
  CHECK_FALSE(runtime.check_pointers());
  CHECK_FALSE(moejit::config().check_pointers);
  CHECK(moejit_set_check_pointers(7, nullptr) == MOEJIT_OK);  // any nonzero value is on
  CHECK(runtime.check_pointers());
  CHECK(moejit::set_check_pointers(false));

  // In a process whose environment the runtime could not use (the case above).
  const std::string log = dir.path() + "/child.log";
  const pid_t pid = start_self("runtime_env_child", log, {"MOEJIT_CACHE_MODE=sometimes"},
                               {"MOEJIT_CACHE_MODE", "MOEJIT_CHECK_POINTERS"});
  REQUIRE(pid >= 0);
  int status = 0;
  REQUIRE(::waitpid(pid, &status, 0) == pid);
  const std::string output = moejit::test::read_text(log);
  INFO("child output:\n" << output);
  CHECK(WIFEXITED(status));
  CHECK(WEXITSTATUS(status) == 0);
  // It ran (Catch2 exits 0 when no test matches, and the case skips without its environment),
  // and passed.
  CHECK(output.find("Passed 1 test case") != std::string::npos);
  CHECK(output.find("SKIPPED") == std::string::npos);
}

// What a forked child (a prefork server, Python multiprocessing) finds: copies of the runtime's
// mutexes, which another thread of the parent takes in a loop (the key memo, the configuration,
// the store's table: a memory hit). Each child gets 10 s (SIGALRM) and exits 0 only with the
// kernel's key from a memory hit and from cache_key().
TEST_CASE("runtime: a forked child never waits on a mutex its parent's thread held", "[runtime]") {
  moejit::test::TempDir dir;
  use_cache(dir.path() + "/cache", CacheMode::kReadWrite);
  const KernelSpec spec = spec_of(6, 1);
  const std::string key = moejit::build_kernel(spec).key;
  REQUIRE(key.size() == 32);
  const auto hammer = [&] {
    (void)moejit::build_kernel(spec);
    (void)moejit::detail::Runtime::instance().cache_key(spec);
  };
  const auto child = [&] {
    const BuildResult hit = moejit::build_kernel(spec);
    return hit.outcome == CacheOutcome::kMemoryHit && hit.key == key &&
           moejit::detail::Runtime::instance().cache_key(spec) == key;
  };
  CHECK(moejit::test::children_failing_under(hammer, child) == 0);
}

// A child forked while a thread of its parent is inside a kernel load inherits the count of loads
// in flight that configure() refuses under, but not the thread that would end that load.
TEST_CASE("runtime: a child forked during its parent's kernel load can configure", "[runtime]") {
  moejit::test::TempDir dir;
  const std::string cache = dir.path() + "/cache";
  use_cache(cache, CacheMode::kReadWrite);
  // Why sm_71 (no NVRTC targets it): the build fails in compile() once it runs, so no machine,
  // with a GPU or without, ever loads it (a loaded kernel would make configure() refuse for good).
  KernelSpec spec = spec_of(5, 2);
  spec.arch.sm = 71;
  spec.arch.arch_specific = false;
  const std::string key = moejit::detail::Runtime::instance().cache_key(spec);
  // Another process's compile lock on the key keeps the load waiting, counted in flight.
  const int held =
      ::open((cache + "/locks/" + key + ".lock").c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600);
  REQUIRE(held >= 0);
  REQUIRE(::flock(held, LOCK_EX | LOCK_NB) == 0);
  std::atomic<bool> waiting{false};
  moejit::detail::CacheTestHooks hooks;
  hooks.lock_waiting = [&] { waiting = true; };
  moejit::detail::set_cache_test_hooks(hooks);
  std::string loader_error;
  std::thread loader([&] {
    try {
      moejit::detail::Runtime::instance().build_and_load(spec);
    } catch (const moejit::Error& e) {
      loader_error = e.what();
    }
  });
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (!waiting && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  moejit::RuntimeConfig other;
  other.cache_dir = dir.path() + "/other";
  other.cache_mode = CacheMode::kReadWrite;
  std::string parent_refusal;
  if (waiting) {
    try {
      moejit::configure(other);  // refused here: the load is in flight in this process
    } catch (const moejit::Error& e) {
      parent_refusal = e.what();
    }
  }
  const bool child_configured = waiting && moejit::test::forked_child_passes([&] {
                                  moejit::configure(other);
                                  return moejit::config().cache_dir == other.cache_dir;
                                });
  ::close(held);  // the lock is free: the loader compiles (and fails, for sm_71)
  loader.join();
  moejit::detail::set_cache_test_hooks({});
  REQUIRE(waiting);
  CHECK(parent_refusal.find("while another thread is loading a kernel") != std::string::npos);
  CHECK(child_configured);
  CHECK(loader_error.find("sm_71") != std::string::npos);
  use_cache(cache, CacheMode::kReadWrite);  // the load has ended: the parent configures again
  CHECK(moejit::config().cache_dir == cache);
}

// The runtime computes a spec's key once per process (Runtime::memoized_key); a later build under
// another configuration must still get that configuration's key, the one cache_key() derives
// afresh.
TEST_CASE("runtime: a build's key follows line_info as cache_key() derives it", "[runtime]") {
  moejit::test::TempDir dir;
  const std::string cache = dir.path() + "/cache";
  const KernelSpec spec = spec_of(6, 1);
  auto build_with = [&](bool line_info) {
    moejit::RuntimeConfig config;
    config.cache_dir = cache;
    config.cache_mode = CacheMode::kReadWrite;
    config.line_info = line_info;
    moejit::configure(config);
    const BuildResult result = moejit::build_kernel(spec);
    CHECK(result.key == moejit::detail::Runtime::instance().cache_key(spec));
    return result;
  };
  const BuildResult plain = build_with(false);
  const BuildResult lines = build_with(true);
  CHECK(lines.key != plain.key);
  CHECK(lines.outcome == CacheOutcome::kCompiled);
  const BuildResult again = build_with(false);  // a fresh store: the entry comes from disk
  CHECK(again.key == plain.key);
  CHECK(again.outcome == CacheOutcome::kDiskHit);
  const BuildResult hit = moejit::build_kernel(spec);
  CHECK(hit.key == plain.key);
  CHECK(hit.outcome == CacheOutcome::kMemoryHit);
  use_cache(cache, CacheMode::kReadWrite);  // line_info back to its default for later cases
}

TEST_CASE("runtime: kernel_source and the key inputs hold no machine path", "[runtime]") {
  moejit::test::TempDir dir;
  use_cache(dir.path() + "/cache", CacheMode::kReadWrite);
  const KernelSpec spec = spec_of(6, 1);
  const std::string source = moejit::kernel_source(spec);
  CHECK(source.find("moejit/kern/append_shared.cuh") != std::string::npos);

  const moejit::detail::KeyInputs in = moejit::detail::Runtime::instance().key_inputs(spec);
  std::vector<std::string> texts = {in.nvrtc_version, in.arch, in.program_name, in.source,
                                    in.name_expression};
  texts.insert(texts.end(), in.options.begin(), in.options.end());
  for (const auto& header : in.headers) texts.emplace_back(header.path);
  for (const std::string& text : texts) {
    INFO("key input: " << text);
    CHECK(text.find(dir.path()) == std::string::npos);
    CHECK(text.find("/usr/") == std::string::npos);
    CHECK(text.rfind("-I", 0) != 0);
  }
  CHECK(in.nvrtc_version == moejit::detail::nvrtc_identity());
  CHECK(in.nvrtc_version.find('/') == std::string::npos);
}

TEST_CASE("runtime: unsupported specs are refused before any compile", "[runtime]") {
  moejit::test::TempDir dir;
  use_cache(dir.path() + "/cache", CacheMode::kReadWrite);
  KernelSpec spec = spec_of(6, 1);
  std::get<moejit::AppendSharedParams>(spec.params).top_k = 1000;
  try {
    moejit::build_kernel(spec);
    FAIL("an unsupported spec was built");
  } catch (const moejit::Error& e) {
    CHECK(e.code() == moejit::ErrorCode::kUnsupported);
    CHECK(std::string(e.what()).find("top_k") != std::string::npos);
  }

}

// Run by the test below in each child process (hidden: selected only by its tag).
TEST_CASE("runtime child: 8 threads build one cold spec", "[.][runtime_child]") {
  if (!moejit::test::started_by_parent(
          "runtime_child",
          "runtime: 8 threads in each of 3 processes compile a cold kernel once")) {
    return;
  }
  const char* cache = std::getenv("MOEJIT_TEST_RACE_CACHE");
  const char* out = std::getenv("MOEJIT_TEST_RACE_OUT");
  const char* go = std::getenv("MOEJIT_TEST_RACE_GO");
  REQUIRE(cache != nullptr);
  REQUIRE(out != nullptr);
  REQUIRE(go != nullptr);
  use_cache(cache, CacheMode::kReadWrite);
  const KernelSpec spec = race_spec();
  write_file(std::string(out) + ".ready", "ready");
  REQUIRE(wait_for_file(go, std::chrono::seconds(300)));

  std::atomic<bool> start{false};
  std::vector<std::string> outcomes(kRaceThreads);
  std::vector<std::thread> threads;
  for (int i = 0; i < kRaceThreads; ++i) {
    threads.emplace_back([&, i] {
      while (!start.load()) std::this_thread::yield();
      try {
        outcomes[static_cast<std::size_t>(i)] = outcome_word(moejit::build_kernel(spec).outcome);
      } catch (const std::exception& e) {
        outcomes[static_cast<std::size_t>(i)] = std::string("error:") + e.what();
      }
    });
  }
  start.store(true);
  for (std::thread& thread : threads) thread.join();
  std::string text;
  for (const std::string& outcome : outcomes) text += outcome + "\n";
  write_file(out, text);
}

TEST_CASE("runtime: 8 threads in each of 3 processes compile a cold kernel once", "[runtime]") {
  moejit::test::TempDir dir;
  const std::string cache = dir.path() + "/cache";
  const std::string go = dir.path() + "/go";

  std::vector<pid_t> children;
  std::vector<std::string> outputs;
  for (int p = 0; p < kRaceProcesses; ++p) {
    const std::string output = dir.path() + "/outcomes." + std::to_string(p);
    outputs.push_back(output);
    const pid_t pid = start_self("runtime_child", output + ".log",
                                 {"MOEJIT_TEST_RACE_CACHE=" + cache,
                                  "MOEJIT_TEST_RACE_OUT=" + output, "MOEJIT_TEST_RACE_GO=" + go});
    REQUIRE(pid >= 0);
    children.push_back(pid);
  }
  bool all_ready = true;
  for (const std::string& output : outputs) {
    all_ready = all_ready && wait_for_file(output + ".ready", std::chrono::seconds(300));
  }
  write_file(go, "go");
  for (std::size_t p = 0; p < children.size(); ++p) {
    int status = 0;
    REQUIRE(::waitpid(children[p], &status, 0) == children[p]);
    INFO("child " << p << " output:\n" << moejit::test::read_text(outputs[p] + ".log"));
    CHECK(WIFEXITED(status));
    CHECK(WEXITSTATUS(status) == 0);
  }
  REQUIRE(all_ready);

  std::map<std::string, int> counts;
  for (const std::string& output : outputs) {
    std::istringstream lines(moejit::test::read_text(output));
    std::string line;
    int n = 0;
    while (std::getline(lines, line)) {
      INFO("child outcome: " << line);
      CHECK(line.rfind("error:", 0) != 0);
      ++counts[line];
      ++n;
    }
    CHECK(n == kRaceThreads);
  }
  INFO("compiled " << counts["compiled"] << ", disk " << counts["disk"] << ", memory "
                   << counts["memory"] << ", not stored " << counts["notstored"]);
  CHECK(counts["compiled"] == 1);
  CHECK(counts["notstored"] == 0);
  CHECK(counts["compiled"] + counts["disk"] + counts["memory"] == kRaceThreads * kRaceProcesses);

  // The one compile was published: a fresh store in this process finds it on disk.
  use_cache(cache, CacheMode::kReadWrite);
  CHECK(moejit::build_kernel(race_spec()).outcome == CacheOutcome::kDiskHit);
}

TEST_CASE("runtime: a read-only cache hits and writes nothing", "[runtime]") {
  moejit::test::TempDir dir;
  const std::string cache = dir.path() + "/cache";
  const KernelSpec spec = spec_of(6, 1);
  use_cache(cache, CacheMode::kReadWrite);
  REQUIRE(moejit::build_kernel(spec).outcome == CacheOutcome::kCompiled);

  const auto before = snapshot(cache);
  use_cache(cache, CacheMode::kReadOnly);
  CHECK(moejit::detail::Runtime::instance().store().disk().effective_mode() ==
        CacheMode::kReadOnly);
  CHECK(moejit::build_kernel(spec).outcome == CacheOutcome::kDiskHit);
  CHECK(moejit::build_kernel(spec).outcome == CacheOutcome::kMemoryHit);
  // A kernel missing from the read-only cache is compiled but not stored.
  const KernelSpec other = spec_of(6, 1, DType::kI32, SharedGate::kGiven, DType::kF32);
  CHECK(moejit::build_kernel(other).outcome == CacheOutcome::kCompiledNotStored);
  CHECK(moejit::build_kernel(other).outcome == CacheOutcome::kMemoryHit);
  CHECK(snapshot(cache) == before);
}

TEST_CASE("runtime: a cache dir that can't be created still builds", "[runtime]") {
  moejit::test::TempDir dir;
  const std::string file = dir.path() + "/not-a-dir";
  write_file(file, "a regular file");
  use_cache(file + "/cache", CacheMode::kReadWrite);
  const KernelSpec spec = spec_of(6, 1);
  const BuildResult first = moejit::build_kernel(spec);
  CHECK(first.error.empty());
  CHECK(first.outcome == CacheOutcome::kCompiledNotStored);
  CHECK(moejit::build_kernel(spec).outcome == CacheOutcome::kMemoryHit);
  CHECK(fs::is_regular_file(file));
}

TEST_CASE("runtime: memory-only mode never touches the disk", "[runtime]") {
  moejit::test::TempDir dir;
  const std::string cache = dir.path() + "/cache";
  use_cache(cache, CacheMode::kMemoryOnly);
  const KernelSpec spec = spec_of(6, 1);
  CHECK(moejit::build_kernel(spec).outcome == CacheOutcome::kCompiledNotStored);
  CHECK(moejit::build_kernel(spec).outcome == CacheOutcome::kMemoryHit);
  CHECK_FALSE(fs::exists(cache));
}

TEST_CASE("runtime: a corrupt entry is healed by the next build", "[runtime]") {
  moejit::test::TempDir dir;
  const std::string cache = dir.path() + "/cache";
  const KernelSpec spec = spec_of(6, 1);
  use_cache(cache, CacheMode::kReadWrite);
  const BuildResult built = moejit::build_kernel(spec);
  REQUIRE(built.outcome == CacheOutcome::kCompiled);
  const std::string entry =
      moejit::detail::Runtime::instance().store().disk().entry_path(built.key);
  REQUIRE(fs::is_regular_file(entry));
  const uintmax_t size = fs::file_size(entry);

  SECTION("truncated") { fs::resize_file(entry, size / 2); }
  SECTION("one byte flipped in the cubin") {
    std::fstream file(entry, std::ios::in | std::ios::out | std::ios::binary);
    file.seekg(static_cast<std::streamoff>(size - 17));
    char byte = 0;
    file.read(&byte, 1);
    byte = static_cast<char>(byte ^ 0x40);
    file.seekp(static_cast<std::streamoff>(size - 17));
    file.write(&byte, 1);
  }
  SECTION("one byte flipped in the header") {
    std::fstream file(entry, std::ios::in | std::ios::out | std::ios::binary);
    file.seekg(20);
    char byte = 0;
    file.read(&byte, 1);
    byte = static_cast<char>(byte ^ 0x01);
    file.seekp(20);
    file.write(&byte, 1);
  }

  WarnCapture warnings;
  use_cache(cache, CacheMode::kReadWrite);
  const BuildResult healed = moejit::build_kernel(spec);
  CHECK(healed.outcome == CacheOutcome::kCompiled);
  CHECK(healed.key == built.key);
  const std::vector<std::string> messages = warnings.messages();
  INFO("warnings: " << messages.size());
  CHECK_FALSE(messages.empty());
  CHECK(any_contains(messages, built.key));

  // The healed entry is whole again.
  use_cache(cache, CacheMode::kReadWrite);
  CHECK(moejit::build_kernel(spec).outcome == CacheOutcome::kDiskHit);
}

TEST_CASE("runtime: the op's spec is the planner's spec", "[runtime]") {
  // A prewarmed kernel is only useful if append_shared looks up exactly the spec prewarm built.
  const Arch arch = Arch::parse("sm_90a");
  for (SharedGate gate : {SharedGate::kSigmoid, SharedGate::kConstant, SharedGate::kGiven}) {
    for (DType id : {DType::kI32, DType::kI64}) {
      for (DType logit : {DType::kBF16, DType::kF16, DType::kF32}) {
        moejit::ModelShape shape = probe_shape();
        shape.id_dtype = id;
        shape.shared.count = 2;
        shape.shared.gate = gate;
        shape.shared.logit_dtype = logit;
        // The logits the op would see: the shape's dtype for sigmoid, fp32 weights for given.
        const DType seen = gate == SharedGate::kGiven ? DType::kF32 : logit;
        KernelSpec expected;
        expected.family = moejit::Family::kAppendShared;
        expected.arch = arch;
        expected.params = moejit::detail::append_shared_params(8, 2, id, gate, seen);
        bool found = false;
        for (const KernelSpec& planned : moejit::plan_kernels(shape, arch)) {
          found = found || planned == expected;
        }
        INFO("expected " << expected.display_name());
        CHECK(found);
      }
    }
  }
}

TEST_CASE("runtime: prewarm of the reference shapes for sm_90a reports no errors", "[runtime]") {
  const std::string reference = moejit::test::shapes_dir() + "/reference.json";
  if (!fs::exists(reference)) {
    WARN("no " << reference << ": nothing to prewarm");
    return;
  }
  moejit::test::TempDir dir;
  use_cache(dir.path() + "/cache", CacheMode::kReadWrite);
  const std::vector<moejit::ModelShape> shapes = moejit::load_shapes_file(reference);
  REQUIRE_FALSE(shapes.empty());

  std::mutex mutex;
  std::vector<std::size_t> dones;
  std::size_t reported_total = 0;
  const int jobs = static_cast<int>(std::max(2u, std::thread::hardware_concurrency()));
  const std::vector<BuildResult> results = moejit::prewarm(
      shapes, {Arch::parse("sm_90a")}, jobs,
      [&](const BuildResult&, std::size_t done, std::size_t total) {
        std::lock_guard<std::mutex> lock(mutex);
        dones.push_back(done);
        reported_total = total;
      });
  REQUIRE_FALSE(results.empty());
  for (const BuildResult& result : results) {
    INFO(result.spec.display_name() << ": " << result.error);
    CHECK(result.error.empty());
    CHECK(result.outcome == CacheOutcome::kCompiled);
    CHECK(result.key.size() == 32);
  }
  CHECK(reported_total == results.size());
  REQUIRE(dones.size() == results.size());
  for (std::size_t i = 0; i < dones.size(); ++i) CHECK(dones[i] == i + 1);

  // Every kernel is distinct, and a second prewarm finds them all in memory.
  for (std::size_t i = 0; i < results.size(); ++i) {
    for (std::size_t j = i + 1; j < results.size(); ++j) {
      CHECK_FALSE(results[i].spec == results[j].spec);
    }
  }
  for (const BuildResult& again : moejit::prewarm(shapes, {Arch::parse("sm_90a")}, 4)) {
    CHECK(again.outcome == CacheOutcome::kMemoryHit);
  }
}

TEST_CASE("runtime: prewarm reports each kernel's failure without throwing", "[runtime]") {
  moejit::test::TempDir dir;
  use_cache(dir.path() + "/cache", CacheMode::kReadWrite);
  const moejit::ModelShape shape = probe_shape();
  // Why sm_75: NVRTC targets it, and some of the shape's kernels can't run there. Those fail
  // with the planner's reason, without a compile; the others compile.
  const Arch sm75 = Arch::parse("sm_75");
  std::size_t calls = 0;
  const std::vector<BuildResult> results = moejit::prewarm(
      {shape}, {sm75}, 2, [&](const BuildResult&, std::size_t, std::size_t) { ++calls; });
  REQUIRE_FALSE(results.empty());
  CHECK(calls == results.size());
  std::size_t failed = 0;
  bool compiled_append_shared = false;
  for (const BuildResult& result : results) {
    INFO(result.spec.display_name() << ": " << result.error);
    CHECK(result.spec.arch == sm75);
    const std::string why = moejit::supports(result.spec);
    if (why.empty()) {
      CHECK(result.error.empty());
      CHECK(result.outcome == CacheOutcome::kCompiled);
      compiled_append_shared =
          compiled_append_shared || result.spec.family == moejit::Family::kAppendShared;
    } else {
      ++failed;
      CHECK(result.error.find(why) != std::string::npos);
      CHECK(result.error.find("needs sm_80 or newer") != std::string::npos);
    }
  }
  CHECK(failed > 0);
  CHECK(failed < results.size());
  CHECK(compiled_append_shared);
  // Nothing reached NVRTC and failed: no source was saved for a failed compile.
  CHECK_FALSE(std::filesystem::exists(dir.path() + "/cache/failed"));
}

TEST_CASE("runtime: prewarm refuses an arch NVRTC can't target before any kernel", "[runtime]") {
  moejit::test::TempDir dir;
  use_cache(dir.path() + "/cache", CacheMode::kReadWrite);
  // Why sm_71: a valid spelling no NVRTC targets; every kernel would fail the same way.
  Arch unknown;
  unknown.sm = 71;
  std::size_t calls = 0;
  try {
    moejit::prewarm({probe_shape()}, {Arch::parse("sm_90a"), unknown}, 2,
                    [&](const BuildResult&, std::size_t, std::size_t) { ++calls; });
    FAIL("prewarm for sm_71 did not throw");
  } catch (const moejit::Error& e) {
    INFO(e.what());
    CHECK(e.code() == moejit::ErrorCode::kInvalidArgument);
    CHECK(std::string(e.what()).rfind("prewarm: arch sm_71: sm_71 is not a target of this NVRTC; "
                                      "it supports: ",
                                      0) == 0);
  }
  CHECK(calls == 0);
  CHECK_FALSE(std::filesystem::exists(dir.path() + "/cache/v2"));
}

TEST_CASE("runtime: configuration from the environment", "[runtime]") {
  struct Saved {
    const char* name;
    std::string value;
    bool set;
  };
  std::vector<Saved> saved;
  for (const char* name :
       {"MOEJIT_CACHE_DIR", "XDG_CACHE_HOME", "HOME", "MOEJIT_CACHE_MODE",
        "MOEJIT_ALLOW_CAPTURE_COMPILE", "MOEJIT_LINEINFO", "MOEJIT_CHECK_POINTERS"}) {
    const char* value = std::getenv(name);
    saved.push_back({name, value ? value : "", value != nullptr});
  }
  ::setenv("MOEJIT_CACHE_DIR", "/srv/moejit-cache", 1);
  ::setenv("XDG_CACHE_HOME", "/xdg", 1);
  ::setenv("HOME", "/home/someone", 1);
  ::setenv("MOEJIT_CACHE_MODE", "ro", 1);
  ::setenv("MOEJIT_ALLOW_CAPTURE_COMPILE", "1", 1);
  ::setenv("MOEJIT_LINEINFO", "1", 1);
  ::setenv("MOEJIT_CHECK_POINTERS", "1", 1);
  moejit::RuntimeConfig config = moejit::RuntimeConfig::from_environment();
  CHECK(config.cache_dir == "/srv/moejit-cache");
  CHECK(config.cache_mode == CacheMode::kReadOnly);
  CHECK(config.allow_compile_during_capture);
  CHECK(config.line_info);
  CHECK(config.check_pointers);

  ::unsetenv("MOEJIT_CACHE_DIR");
  ::setenv("MOEJIT_CACHE_MODE", "memory", 1);
  ::setenv("MOEJIT_ALLOW_CAPTURE_COMPILE", "0", 1);
  ::unsetenv("MOEJIT_LINEINFO");
  ::unsetenv("MOEJIT_CHECK_POINTERS");
  config = moejit::RuntimeConfig::from_environment();
  CHECK(config.cache_dir == "/xdg/moejit");
  CHECK(config.cache_mode == CacheMode::kMemoryOnly);
  CHECK_FALSE(config.allow_compile_during_capture);
  CHECK_FALSE(config.line_info);       // the default
  CHECK_FALSE(config.check_pointers);  // the default

  ::unsetenv("XDG_CACHE_HOME");
  ::setenv("MOEJIT_CACHE_MODE", "rw", 1);
  config = moejit::RuntimeConfig::from_environment();
  CHECK(config.cache_dir == "/home/someone/.cache/moejit");
  CHECK(config.cache_mode == CacheMode::kReadWrite);

  // A value the variable cannot take is refused, naming the variable and the value.
  auto refused = [](const char* name, const char* value) {
    ::setenv(name, value, 1);
    try {
      moejit::RuntimeConfig::from_environment();
      FAIL("a bad " << name << " was accepted");
    } catch (const moejit::Error& e) {
      CHECK(e.code() == moejit::ErrorCode::kInvalidArgument);
      CHECK(std::string(e.what()).find(std::string(name) + "=" + value) != std::string::npos);
    }
  };
  refused("MOEJIT_CACHE_MODE", "sometimes");
  ::setenv("MOEJIT_CACHE_MODE", "rw", 1);
  refused("MOEJIT_LINEINFO", "maybe");
  ::unsetenv("MOEJIT_LINEINFO");
  refused("MOEJIT_CHECK_POINTERS", "always");

  for (const Saved& s : saved) {
    if (s.set) {
      ::setenv(s.name, s.value.c_str(), 1);
    } else {
      ::unsetenv(s.name);
    }
  }
}

TEST_CASE("runtime: without a driver, current_arch says why instead of crashing", "[runtime]") {
  std::string why;
  const moejit::detail::DriverApi* api = moejit::detail::try_driver(&why);
  if (api != nullptr) {
    WARN("a CUDA driver is present here; the no-driver path is not exercised");
    return;
  }
  CHECK_FALSE(why.empty());
  CHECK(why.find("--arch") != std::string::npos);
  try {
    moejit::detail::Runtime::instance().current_arch();
    FAIL("current_arch() succeeded without a driver");
  } catch (const moejit::Error& e) {
    CHECK(e.code() == moejit::ErrorCode::kDriver);
    CHECK(std::string(e.what()).find(why) != std::string::npos);
  }
  try {
    moejit::current_arch();  // the public call, the same answer
    FAIL("moejit::current_arch() succeeded without a driver");
  } catch (const moejit::Error& e) {
    CHECK(e.code() == moejit::ErrorCode::kDriver);
    CHECK(std::string(e.what()).find(why) != std::string::npos);
  }
}

TEST_CASE("runtime: the C ABI maps errors to statuses and clears the message on success",
          "[runtime]") {
  CHECK(moejit_register_shapes_file(nullptr) == MOEJIT_ERROR_INVALID_ARGUMENT);
  CHECK(std::string(moejit_last_error()).find("null") != std::string::npos);

  moejit::test::TempDir dir;
  const std::string missing = dir.path() + "/missing.json";
  CHECK(moejit_register_shapes_file(missing.c_str()) != MOEJIT_OK);
  CHECK(std::string(moejit_last_error()).find("missing.json") != std::string::npos);

  const std::string broken = dir.path() + "/broken.json";
  write_file(broken, "{\"shapes\": [{\"name\": \"capi-broken\", \"top_k\": \"six\"}]}");
  CHECK(moejit_register_shapes_file(broken.c_str()) == MOEJIT_ERROR_INVALID_DESCRIPTOR);
  CHECK(std::string(moejit_last_error()).find("broken.json") != std::string::npos);

  const std::string good = dir.path() + "/good.json";
  write_file(good, R"({"name": "capi-probe-shape", "num_experts": 64, "top_k": 8,
    "hidden": 2048, "intermediate": 768, "activation": {"kind": "swiglu"}})");
  const moejit_status status = moejit_register_shapes_file(good.c_str());
  INFO(moejit_last_error());
  CHECK(status == MOEJIT_OK);
  CHECK(std::string(moejit_last_error()).empty());

  // The message is per thread: another thread's failure leaves this thread's "" alone.
  std::thread other([] { moejit_register_shapes_file(nullptr); });
  other.join();
  CHECK(std::string(moejit_last_error()).empty());

  std::string why;
  if (moejit::detail::try_driver(&why) == nullptr) {
    // No driver: the op fails with a status and says why, it does not crash.
    CHECK(moejit_append_shared(nullptr, nullptr, nullptr, nullptr, nullptr, 0, 1.f,
                               MOEJIT_SHARED_CONSTANT, nullptr) == MOEJIT_ERROR_DRIVER);
    CHECK(std::string(moejit_last_error()).find(why) != std::string::npos);
  }
}

namespace {

// What the C ABI's prewarm reported through its progress callback.
struct ProgressLog {
  std::mutex mutex;
  std::vector<std::string> kernels;
  std::vector<std::string> outcomes;
  std::vector<std::size_t> dones;
  std::size_t total = 0;
};

void record_progress(const char* kernel, const char* outcome, double, size_t done, size_t total,
                     void* user_data) {
  auto* log = static_cast<ProgressLog*>(user_data);
  std::lock_guard<std::mutex> lock(log->mutex);
  log->kernels.emplace_back(kernel);
  log->outcomes.emplace_back(outcome);
  log->dones.push_back(done);
  log->total = total;
}

bool contains(const char* text, const std::string& part) {
  return std::string(text).find(part) != std::string::npos;
}

}  // namespace

TEST_CASE("runtime: the C ABI registers shapes from text and prewarms them", "[runtime]") {
  moejit::test::TempDir dir;
  use_cache(dir.path() + "/cache", CacheMode::kReadWrite);
  const char* tiny = R"({"shapes": [{"name": "capi-prewarm-tiny", "num_experts": 16, "top_k": 2,
    "hidden": 512, "intermediate": 256, "activation": {"kind": "swiglu"}, "max_tokens": 2}]})";

  // Registration from text: errors name the argument or the source name given for the text.
  CHECK(moejit_register_shapes(nullptr, "x") == MOEJIT_ERROR_INVALID_ARGUMENT);
  CHECK(contains(moejit_last_error(), "moejit_register_shapes: json_text"));
  CHECK(moejit_register_shapes(R"({"shapes": [{"name": 5}]})", "engine-config") ==
        MOEJIT_ERROR_INVALID_DESCRIPTOR);
  CHECK(contains(moejit_last_error(), "engine-config"));
  REQUIRE(moejit_register_shapes(tiny, "engine-config") == MOEJIT_OK);
  CHECK(std::string(moejit_last_error()).empty());
  // A name registered twice is refused, naming both sources.
  CHECK(moejit_register_shapes(tiny, nullptr) == MOEJIT_ERROR_INVALID_DESCRIPTOR);
  CHECK(contains(moejit_last_error(), "<text>"));
  CHECK(contains(moejit_last_error(), "engine-config"));

  // Bad arguments: a status naming the argument, and a zeroed result.
  const char* names[] = {"capi-prewarm-tiny", nullptr};
  const char* unknown[] = {"capi-prewarm-no-such-shape"};
  moejit_prewarm_result result{};
  result.struct_size = sizeof(result);
  auto refused = [&](moejit_status status, const std::string& part) {
    INFO(moejit_last_error());
    CHECK(status == MOEJIT_ERROR_INVALID_ARGUMENT);
    CHECK(contains(moejit_last_error(), part));
    CHECK(result.kernels == 0);
    CHECK(result.milliseconds == 0);
    result.kernels = 99;  // must be zeroed again by the next call
    result.milliseconds = 1;
  };
  result.kernels = 99;
  refused(moejit_prewarm(nullptr, 1, "sm_80", 1, nullptr, nullptr, &result),
          "moejit_prewarm: shape_names: expected at least one registered shape name, found null");
  refused(moejit_prewarm(names, 0, "sm_80", 1, nullptr, nullptr, &result), "a count of 0");
  refused(moejit_prewarm(names, 2, "sm_80", 1, nullptr, nullptr, &result),
          "moejit_prewarm: shape_names[1]: expected a registered shape's name, found null");
  refused(moejit_prewarm(unknown, 1, "sm_80", 1, nullptr, nullptr, &result),
          "moejit_prewarm: shape_names[0]: ");
  CHECK(contains(moejit_last_error(), "capi-prewarm-no-such-shape"));
  // A count past the array (an underflowed size_t) reaches the names, not an allocation of that
  // many shapes (which failed as an internal error naming nothing): the first name is unknown,
  // so no name past the array is read.
  refused(moejit_prewarm(unknown, static_cast<size_t>(-1), "sm_80", 1, nullptr, nullptr, &result),
          "moejit_prewarm: shape_names[0]: ");
  refused(moejit_prewarm(names, 1, "sm_80", -1, nullptr, nullptr, &result),
          "moejit_prewarm: jobs: expected 0 (one per hardware thread) or more, found -1");
  refused(moejit_prewarm(names, 1, "sm80", 1, nullptr, nullptr, &result), "moejit_prewarm: arch: ");
  {
    // A result whose struct_size was left unset: refused before any kernel is built.
    moejit_prewarm_result unset{};
    unset.kernels = 99;
    ProgressLog log;
    CHECK(moejit_prewarm(names, 1, "sm_80", 1, record_progress, &log, &unset) ==
          MOEJIT_ERROR_INVALID_ARGUMENT);
    CHECK(contains(moejit_last_error(),
                   "moejit_prewarm: result->struct_size: expected sizeof(moejit_prewarm_result)"));
    CHECK(log.kernels.empty());
    CHECK(unset.kernels == 99);  // not written
  }
  std::string why;
  if (moejit::detail::try_driver(&why) == nullptr) {
    CHECK(moejit_prewarm(names, 1, nullptr, 1, nullptr, nullptr, &result) == MOEJIT_ERROR_DRIVER);
    CHECK(contains(moejit_last_error(),
                   "moejit_prewarm: arch: null asks for the current CUDA "
                   "context's device, but "));
    CHECK(contains(moejit_last_error(), "\"sm_90a\""));
    CHECK(result.kernels == 0);
  }

  // Every kernel the planner names for the arch is compiled once, reported once, in order.
  const moejit::ModelShape shape = moejit::registered_shape("capi-prewarm-tiny");
  std::vector<std::string> planned;
  for (const KernelSpec& spec : moejit::plan_kernels(shape, Arch::parse("sm_80"))) {
    planned.push_back(spec.display_name());
  }
  std::sort(planned.begin(), planned.end());
  REQUIRE_FALSE(planned.empty());
  {
    ProgressLog log;
    const moejit_status status =
        moejit_prewarm(names, 1, "sm_80", 2, record_progress, &log, &result);
    INFO(moejit_last_error());
    REQUIRE(status == MOEJIT_OK);
    CHECK(std::string(moejit_last_error()).empty());
    CHECK(result.kernels == planned.size());
    CHECK(result.compiled == planned.size());
    CHECK(result.cached + result.not_stored + result.failed == 0);
    CHECK(result.milliseconds > 0);
    std::vector<std::string> reported = log.kernels;
    std::sort(reported.begin(), reported.end());
    CHECK(reported == planned);
    CHECK(log.total == planned.size());
    for (std::size_t i = 0; i < log.dones.size(); ++i) CHECK(log.dones[i] == i + 1);
    for (const std::string& outcome : log.outcomes) CHECK(outcome == "compiled");
  }
  {
    // Again, with no callback: everything is found in this process's memory.
    REQUIRE(moejit_prewarm(names, 1, "sm_80", 0, nullptr, nullptr, &result) == MOEJIT_OK);
    CHECK(result.kernels == planned.size());
    CHECK(result.cached == planned.size());
    CHECK(result.compiled + result.not_stored + result.failed == 0);
    CHECK(moejit_prewarm(names, 1, "sm_80", 1, nullptr, nullptr, nullptr) == MOEJIT_OK);
  }
  {
    // Why sm_75: NVRTC targets it, and the shape's marlin_moe and combine kernels need sm_80.
    // They fail with the planner's reason; the others compile and are ready.
    std::vector<std::string> refused_kernels;
    for (const KernelSpec& spec : moejit::plan_kernels(shape, Arch::parse("sm_75"))) {
      if (!moejit::supports(spec).empty()) refused_kernels.push_back(spec.display_name());
    }
    const std::size_t unsupported = refused_kernels.size();
    ProgressLog log;
    const moejit_status status =
        moejit_prewarm(names, 1, "sm_75", 2, record_progress, &log, &result);
    const std::string message = moejit_last_error();
    INFO(message);
    CHECK(status == MOEJIT_ERROR_COMPILE_FAILED);
    REQUIRE(unsupported > 0);
    CHECK(result.kernels > unsupported);
    CHECK(result.failed == unsupported);
    CHECK(result.compiled == result.kernels - unsupported);
    CHECK(result.cached + result.not_stored == 0);
    CHECK(contains(message.c_str(), "moejit_prewarm: " + std::to_string(unsupported) + " of " +
                                        std::to_string(result.kernels) +
                                        " kernel(s) failed (the others are ready)"));
    CHECK(log.kernels.size() == result.kernels);
    for (const std::string& kernel : refused_kernels) {
      CHECK(contains(message.c_str(), "\n  " + kernel + ":\n    "));
    }
    CHECK(contains(message.c_str(), "needs sm_80 or newer"));
    CHECK_FALSE(contains(message.c_str(), "NVRTC"));
    CHECK(std::count(log.outcomes.begin(), log.outcomes.end(), "failed") ==
          static_cast<std::ptrdiff_t>(unsupported));
  }
  {
    // An arch no NVRTC targets is the call's error, before any kernel.
    ProgressLog log;
    CHECK(moejit_prewarm(names, 1, "sm_71", 2, record_progress, &log, &result) ==
          MOEJIT_ERROR_INVALID_ARGUMENT);
    CHECK(contains(moejit_last_error(),
                   "moejit_prewarm: arch sm_71: sm_71 is not a target of this NVRTC"));
    CHECK(log.kernels.empty());
  }
}
