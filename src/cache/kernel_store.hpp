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
  explicit KernelStore(std::shared_ptr<const DiskCache> disk) : disk_(std::move(disk)) {}

  struct Result {
    std::shared_ptr<const Entry> entry;
    CacheOutcome outcome;
    double milliseconds;
  };

  // The entry for `key`: memory, else disk, else `build()` under the in-process single-flight
  // and the inter-process lock (the disk is checked again once the lock is held). No mutex is
  // held while `build` runs. Concurrent callers of one key all get the one result (or error).
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
