// The library's leaf mutexes across fork(): the logger's console sinks, the shape registry and
// decode_moe_problem's memo. A child forked while a thread of its parent holds one must not wait
// on its copy (the stores' and the runtime's mutexes are tested with them: test_kernel_store.cpp,
// tests/nvrtc/test_runtime.cpp). No NVRTC or GPU needed.
#include <catch2/catch.hpp>
#include <fcntl.h>
#include <unistd.h>

#include <string>

#include "common/fork.hpp"
#include "common/log.hpp"
#include "moejit/error.hpp"
#include "moejit/runtime.hpp"
#include "plan/decode_plan.hpp"
#include "support/support.hpp"

namespace {

// stderr goes to /dev/null for the holder's lifetime (the lines the test writes by the thousand).
class SilencedStderr {
 public:
  SilencedStderr() : saved_(::dup(STDERR_FILENO)) {
    const int null_fd = ::open("/dev/null", O_WRONLY);
    ok_ = saved_ >= 0 && null_fd >= 0 && ::dup2(null_fd, STDERR_FILENO) == STDERR_FILENO;
    if (null_fd >= 0) ::close(null_fd);
  }
  ~SilencedStderr() {
    if (saved_ < 0) return;
    ::dup2(saved_, STDERR_FILENO);
    ::close(saved_);
  }
  SilencedStderr(const SilencedStderr&) = delete;
  SilencedStderr& operator=(const SilencedStderr&) = delete;
  bool ok() const { return ok_; }

 private:
  int saved_;
  bool ok_ = false;
};

}  // namespace

TEST_CASE("a forked child logs, looks up shapes and asks decode_moe_problem while its parent's "
          "thread does",
          "[fork]") {
  const moejit::ModelShape shape =
      moejit::test::find_shape(moejit::test::reference_shapes(), "qwen3-30b-a3b");
  moejit::ModelShape other = shape;
  other.hidden = 2880;  // a second memo entry, refused (not a multiple of 256)
  const auto use_all = [&] {
    moejit::detail::log().error("a line");
    bool refused = false;
    try {
      (void)moejit::registered_shape("fork-test-no-such-shape");
    } catch (const moejit::Error&) {
      refused = true;
    }
    return refused && moejit::detail::decode_moe_problem(shape).empty() &&
           !moejit::detail::decode_moe_problem(other).empty();
  };
  int failed = 0;
  {
    SilencedStderr silenced;
    REQUIRE(silenced.ok());
    // Why first: the library's singletons (the logger, the memo) are made on first use, under the
    // C++ runtime's guard for a function-local static, which no fork handler can hold; a child
    // forked while another thread was making one would wait on that guard forever.
    REQUIRE(use_all());
    // (With the leaves left unregistered, children blocked until their alarm.)
    failed = moejit::test::children_failing_under([&] { (void)use_all(); }, use_all);
  }
  CHECK(failed == 0);
}

// What KernelStore's flights and DiskCache's locks recognise their own process by: equal in the
// process that recorded it, different in its children and theirs, whatever pids they get.
TEST_CASE("the fork generation tells a process from every process forked from it", "[fork]") {
  const uint64_t mine = moejit::detail::fork_generation();
  CHECK(moejit::test::forked_child_passes([mine] {
    const uint64_t child = moejit::detail::fork_generation();
    const bool grandchild_differs = moejit::test::forked_child_passes([mine, child] {
      const uint64_t grandchild = moejit::detail::fork_generation();
      return grandchild != mine && grandchild != child;
    });
    return child != mine && grandchild_differs && moejit::detail::fork_generation() == child;
  }));
  CHECK(moejit::detail::fork_generation() == mine);
}
