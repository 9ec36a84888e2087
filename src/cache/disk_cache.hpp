// The on-disk cubin cache: one file per entry, published atomically, verified on load.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "moejit/runtime.hpp"

namespace moejit::detail {

// What an entry records besides its cubin (stored as JSON inside the entry).
struct Manifest {
  std::string key;            // 32 hex digits
  std::string kernel;         // KernelSpec::display_name()
  std::string spec_json;      // KernelSpec::to_json()
  std::string lowered_name;
  std::vector<std::string> options;
  std::string nvrtc_version;
  std::string library_version;
  double compile_ms = 0;
  std::string ptxas_info;     // register / spill report lines from the NVRTC log
  uint64_t cubin_size = 0;
  std::string cubin_hash;     // hex digest of the cubin
  int64_t created_unix = 0;
};

struct Entry {
  Manifest manifest;
  std::string cubin;
};

struct EntryInfo {
  std::string path;
  Manifest manifest;
  uint64_t file_size = 0;
  int64_t last_used_unix = 0;
  std::string problem;        // non-empty when verification failed
};

struct GcReport {
  uint64_t bytes_before = 0;
  uint64_t bytes_after = 0;
  int removed = 0;
};

class DiskCache {
 public:
  // Opens (creating 0700 when writable) `dir`. In kReadWrite mode a dir that can't be created or
  // written falls back to read-only (logged); kMemoryOnly never touches the disk.
  DiskCache(std::string dir, CacheMode mode);

  const std::string& dir() const { return dir_; }
  CacheMode effective_mode() const { return mode_; }

  // The verified entry, or nullopt on a miss. An entry that fails verification (bad magic,
  // truncated, hash mismatch, foreign owner, group/world writable) is quarantined (moved under
  // quarantine/ when writable), logged at warn, and reported as a miss.
  std::optional<Entry> load(const std::string& key) const;

  // Atomic publish: temp file in the same dir, write, fsync, rename, fsync dir. No-op unless
  // writable. Returns whether it was stored.
  bool store(const Entry& entry) const;

  // Inter-process lock for compiling `key` (flock on locks/<key>.lock). Returns a held lock, or
  // an empty one when the cache is not writable. Released by the destructor.
  class Lock {
   public:
    Lock() = default;
    explicit Lock(int fd) : fd_(fd) {}
    Lock(Lock&& other) noexcept : fd_(other.fd_) { other.fd_ = -1; }
    Lock& operator=(Lock&& other) noexcept;
    ~Lock();
   private:
    int fd_ = -1;
  };
  Lock lock(const std::string& key) const;

  std::vector<EntryInfo> list(bool verify) const;
  GcReport gc(uint64_t max_bytes) const;  // removes least recently used entries first
  int clear() const;                      // removes every entry, returns how many

 private:
  std::string dir_;
  CacheMode mode_;
};

}  // namespace moejit::detail
