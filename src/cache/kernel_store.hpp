// The layers above the disk: an in-memory table of built cubins, and single-flight so each key
// is compiled once per process (and, through DiskCache::lock, once per machine).
#pragma once

#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>

#include "cache/disk_cache.hpp"
#include "moejit/runtime.hpp"

namespace moejit::detail {

class KernelStore {
 public:
  // `disk` must not be null (use a kMemoryOnly DiskCache for no disk).
  explicit KernelStore(std::shared_ptr<const DiskCache> disk);
  ~KernelStore();
  KernelStore(const KernelStore&) = delete;
  KernelStore& operator=(const KernelStore&) = delete;

  struct Result {
    std::shared_ptr<const Entry> entry;
    CacheOutcome outcome = CacheOutcome::kMemoryHit;
    // The memory lookup, the disk load (with the wait for the lock when another process
    // published the entry meanwhile), or build() alone.
    double milliseconds = 0;
  };

  // The entry for `key`: memory, else (once per key at a time in this process) disk, else, under
  // the inter-process lock, disk again (another process may have published it meanwhile), else
  // `build()` and publish. An entry published while waiting for the lock is taken at once; a
  // lock still held after DiskCache::kLockWaitSeconds is given up and `build()` runs without it,
  // as it does when the lock, taken after a wait, finds the entry still missing (its holder
  // failed to build or store it). No mutex is held while the disk is read or `build` runs.
  // Callers that arrive while a key is in flight wait and get the leader's Result (same entry,
  // outcome and time), or the leader's exception rethrown; a failed key is tried again on the
  // next call. The entry `build` returns gets manifest.key = `key` when empty (another key is an
  // Error{kInternal}); cubin_size, cubin_hash, created_unix and (when 0) compile_ms are filled.
  // Throws Error{kInvalidArgument} for a malformed key, and whatever `build` throws.
  // Fork: a child process does not wait for a key its parent had in flight at the fork (no
  // thread of the child would ever finish it); its first caller for that key leads anew. And a
  // fork never copies the table's mutex locked (pthread_atfork).
  Result get(const std::string& key, const std::function<Entry()>& build);

  const DiskCache& disk() const { return *disk_; }

 private:
  std::shared_ptr<const DiskCache> disk_;
  std::mutex mutex_;
  std::unordered_map<std::string, std::shared_ptr<const Entry>> memory_;
  struct Flight;
  std::unordered_map<std::string, std::shared_ptr<Flight>> flights_;
};

}  // namespace moejit::detail
