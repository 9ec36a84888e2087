#include "cache/file_io.hpp"

#include <sys/random.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <system_error>

namespace moejit::detail {

int Fd::reset() noexcept {
  int error = 0;
  if (fd_ >= 0 && ::close(fd_) != 0) error = errno;
  fd_ = -1;
  return error;
}

int write_all(int fd, std::string_view text) {
  while (!text.empty()) {
    const ssize_t n = ::write(fd, text.data(), text.size());
    if (n < 0) {
      if (errno == EINTR) continue;
      return errno;
    }
    text.remove_prefix(static_cast<std::size_t>(n));
  }
  return 0;
}

std::string errno_text(int error) {
  return std::error_code(error, std::generic_category()).message();
}

std::string random_hex() {
  uint64_t value = 0;
  if (::getrandom(&value, sizeof(value), GRND_NONBLOCK) != static_cast<ssize_t>(sizeof(value))) {
    // Why: getrandom can only fail this early in boot; names must still differ between
    // processes and threads, and O_EXCL catches any collision that remains.
    static std::atomic<uint64_t> counter{0};
    value = static_cast<uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count()) ^
            (static_cast<uint64_t>(::getpid()) << 40) ^
            (counter.fetch_add(1) * 0x9e3779b97f4a7c15ull);
  }
  char text[17];
  std::snprintf(text, sizeof(text), "%016llx", static_cast<unsigned long long>(value));
  return text;
}

}  // namespace moejit::detail
