#include "cache/kernel_store.hpp"

#include <chrono>
#include <exception>
#include <future>
#include <mutex>
#include <optional>
#include <string>
#include <utility>

#include "common/check.hpp"
#include "common/fork.hpp"
#include "common/hash.hpp"
#include "common/log.hpp"
#include "moejit/error.hpp"

namespace moejit::detail {

// One key being resolved: the leader fulfils the promise, everyone else waits on the future.
// `generation` is the leader's process (fork_generation): after a fork the child holds a copy of
// the flight but not the thread that would fulfil it.
struct KernelStore::Flight {
  uint64_t generation = fork_generation();
  std::promise<Result> promise;
  std::shared_future<Result> future = promise.get_future().share();
};

namespace {

using Clock = std::chrono::steady_clock;

double ms_since(Clock::time_point start) {
  return std::chrono::duration<double, std::milli>(Clock::now() - start).count();
}

KernelStore::Result resolve(const DiskCache& disk, const std::string& key,
                            const std::function<Entry()>& build) {
  auto start = Clock::now();
  if (std::optional<Entry> hit = disk.load(key)) {
    return {std::make_shared<const Entry>(std::move(*hit)), CacheOutcome::kDiskHit,
            ms_since(start)};
  }
  // Why: held across build and store, so another process that waits here finds the entry on
  // disk once it gets the lock (or sees it published while waiting), instead of compiling it
  // again.
  start = Clock::now();
  std::optional<Entry> published;
  DiskCache::Lock lock = disk.lock(key, &published);
  if (published) {
    return {std::make_shared<const Entry>(std::move(*published)), CacheOutcome::kDiskHit,
            ms_since(start)};
  }
  if (lock.held()) {
    start = Clock::now();
    if (std::optional<Entry> hit = disk.load(key)) {
      return {std::make_shared<const Entry>(std::move(*hit)), CacheOutcome::kDiskHit,
              ms_since(start)};
    }
    if (lock.holder_failed()) {
      // Why release it: the holder's build threw or its store failed, and what stopped it (a
      // full disk, a failing compile) most likely stops this build too. Held here, every other
      // waiter would compile after this one, one at a time, the last ones near the lock's wait
      // bound; released, the waiters build side by side.
      log().debug(
          "cache entry {}: the process that held its lock failed to build or store it; "
          "building it without the lock",
          key);
      lock = DiskCache::Lock();
    }
  }
  // Why mark: a build that throws, or an entry not stored, leaves the waiters nothing to load
  // (see DiskCache::Lock).
  struct MarkUnlessStored {
    const DiskCache::Lock& lock;
    bool stored = false;
    ~MarkUnlessStored() {
      if (!stored) lock.mark_failed();
    }
  } mark{lock};
  start = Clock::now();
  Entry built = build();
  const double build_ms = ms_since(start);

  Manifest& m = built.manifest;
  if (m.key.empty()) m.key = key;
  MOEJIT_CHECK(m.key == key, ErrorCode::kInternal,
               "the build for cache key " << key << " returned an entry for key " << m.key);
  MOEJIT_CHECK(!built.cubin.empty(), ErrorCode::kInternal,
               "the build for cache key " << key << " (" << m.kernel << ") returned no cubin");
  m.cubin_size = built.cubin.size();
  m.cubin_hash = hash_bytes(built.cubin).hex();
  if (m.created_unix == 0) {
    m.created_unix = std::chrono::duration_cast<std::chrono::seconds>(
                         std::chrono::system_clock::now().time_since_epoch())
                         .count();
  }
  if (m.compile_ms == 0) m.compile_ms = build_ms;

  std::string why_not;
  const bool stored = disk.store(built, &why_not);
  mark.stored = stored;
  log().debug("built {} ({}) in {:.1f} ms, {}", key, m.kernel, build_ms,
              stored ? std::string("stored") : "not stored (" + why_not + ")");
  return {std::make_shared<const Entry>(std::move(built)),
          stored ? CacheOutcome::kCompiled : CacheOutcome::kCompiledNotStored, build_ms};
}

}  // namespace

KernelStore::KernelStore(std::shared_ptr<const DiskCache> disk) : disk_(std::move(disk)) {
  MOEJIT_CHECK(disk_ != nullptr, ErrorCode::kInternal, "KernelStore needs a DiskCache");
  hold_while_alive(&mutex_);
}

KernelStore::~KernelStore() { release_while_alive(&mutex_); }

KernelStore::Result KernelStore::get(const std::string& key,
                                     const std::function<Entry()>& build) {
  const auto start = Clock::now();
  MOEJIT_CHECK(is_cache_key(key), ErrorCode::kInvalidArgument,
               "malformed cache key '" << key << "': expected 32 lowercase hex digits");
  std::shared_ptr<Flight> flight;
  bool leader = false;
  {
    std::lock_guard<std::mutex> guard(mutex_);
    auto hit = memory_.find(key);
    if (hit != memory_.end()) return {hit->second, CacheOutcome::kMemoryHit, ms_since(start)};
    std::shared_ptr<Flight>& slot = flights_[key];
    // A flight of another process is the parent's, copied by a fork: nobody here finishes it.
    if (!slot || slot->generation != fork_generation()) {
      slot = std::make_shared<Flight>();
      leader = true;
    }
    flight = slot;
  }
  if (!leader) return flight->future.get();

  try {
    Result result = resolve(*disk_, key, build);
    {
      // Why: published to memory and the flight retired under one lock, so a caller arriving
      // now finds either the flight or the memory entry, never neither.
      std::lock_guard<std::mutex> guard(mutex_);
      memory_[key] = result.entry;
      flights_.erase(key);
    }
    flight->promise.set_value(result);
    return result;
  } catch (...) {
    {
      std::lock_guard<std::mutex> guard(mutex_);
      flights_.erase(key);
    }
    flight->promise.set_exception(std::current_exception());
    throw;
  }
}

}  // namespace moejit::detail
