// POSIX file helpers for the directories several processes share (the kernel cache, the
// failed-source dumps): an owned descriptor, whole writes, errno text and random parts
// for temp file names.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>

namespace moejit::detail {

// Owns one file descriptor.
class Fd {
 public:
  explicit Fd(int fd = -1) : fd_(fd) {}
  ~Fd() { reset(); }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  int get() const { return fd_; }
  bool ok() const { return fd_ >= 0; }
  int release() {
    const int fd = fd_;
    fd_ = -1;
    return fd;
  }
  // Closes it: 0, or the errno of a failed close (a write may only fail there, on NFS).
  int reset() noexcept;

 private:
  int fd_;
};

// 0 when all of `text` was written (EINTR retried); else errno.
int write_all(int fd, std::string_view text);

// The message of an errno value.
std::string errno_text(int error);

// 16 lowercase hex digits from getrandom. Why not the pid alone in a temp name: a writer killed
// mid-write leaves its temp file behind, and in containers the next process often has the same
// pid, so a pid-only name would collide (O_EXCL) with the leftover forever.
std::string random_hex();

}  // namespace moejit::detail
