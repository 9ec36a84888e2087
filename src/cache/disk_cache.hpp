// The on-disk cubin cache: one file per entry, published atomically, verified on load.
//
// Layout under the cache root `dir`:
//   v<kCacheSchemaVersion>/<key[0:2]>/<key>.mjc        entries
//   v<kCacheSchemaVersion>/<key[0:2]>/.<key>.*.tmp     writes in progress, entries gc is
//                                                      removing (never read)
//   locks/<key>.lock                                   inter-process compile locks (flock)
//   quarantine/<key>.mjc.<time>.<random>               entries that failed verification
//
// An entry file is a fixed 64-byte little-endian header (magic "moejitc\n", format version =
// kCacheSchemaVersion, header size, manifest length, cubin length, XXH3-128 of the cubin,
// XXH3-128 of the manifest), the Manifest as JSON, then the cubin bytes.
//
// Trust rule (a cache is code that will run on the GPU): a file or directory is trusted when it
// is owned by the effective user or by root, and is neither group- nor world-writable.
//  - An untrusted entry is ignored: logged at warn, reported as a miss, never deleted or moved.
//  - An untrusted cache root (or v<N> dir) is used read-only, with a warning naming the fix:
//    entries there are still loaded only when they are themselves trusted, and nothing is
//    written where another user could swap files.
// Why root counts as trusted: a cache baked into an image is typically root-owned and read by
// an unprivileged service; root can replace the library itself anyway (the rule OpenSSH uses).
//
// All methods are const and safe to call from many threads and processes at once.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
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
  uint64_t cubin_size = 0;    // filled by DiskCache::store from the cubin
  std::string cubin_hash;     // hex XXH3-128 of the cubin, filled by DiskCache::store
  int64_t created_unix = 0;   // filled by DiskCache::store when 0
};

struct Entry {
  Manifest manifest;
  std::string cubin;
};

struct EntryInfo {
  std::string path;
  std::string key;            // from the file name (known even when the file can't be read)
  Manifest manifest;          // as far as it could be read (empty when the header is bad)
  uint64_t file_size = 0;
  int64_t last_used_unix = 0; // mtime: load() touches it
  std::string problem;        // non-empty when verification failed or the entry is untrusted
  std::string quarantined_to;  // where list(true) moved a bad entry; empty when it stayed
};

struct GcReport {
  uint64_t bytes_before = 0;  // entries (every schema version) + quarantined files
  uint64_t bytes_after = 0;
  int removed = 0;            // entries and quarantined files removed (stale temp files excluded)
  int stale_temp_removed = 0;  // leftovers: temp files of writers killed mid-publish, and the
                               // toolkit stamps older builds kept in the cache root
  // Directories below the root that could not be read ("path: reason", each logged at warn):
  // their files were neither counted nor removed.
  std::vector<std::string> unreadable;
};

struct ClearReport {
  int removed = 0;      // entries and quarantined files removed
  int not_removed = 0;  // this user's files that could not be removed (each logged at warn)
  int stale_temp_removed = 0;           // temp files of writers taken for dead (as gc's)
  std::vector<std::string> unreadable;  // as GcReport's: their files were not removed
};

// The JSON text stored in an entry (stable field order), e.g. for `moejit cache list --json`.
std::string manifest_to_json(const Manifest& manifest);

// Whether `key` is a cache key: exactly 32 lowercase hex digits.
bool is_cache_key(const std::string& key);

class DiskCache {
 public:
  // Opens `dir` (creating it and its parents 0700 when writable). Never throws for a directory
  // that can't be used; it degrades instead, with a warning:
  //  - kReadWrite: a dir that exists but can't be written -> kReadOnly; one that doesn't exist
  //    and can't be created (read-only parent, a path through a regular file) -> kMemoryOnly.
  //  - kReadOnly: never creates, writes, touches or moves anything.
  //  - kMemoryOnly: never touches the disk.
  DiskCache(std::string dir, CacheMode mode);

  const std::string& dir() const { return dir_; }
  CacheMode effective_mode() const { return mode_; }
  // Why effective_mode() differs from the mode asked for ("" when it doesn't).
  const std::string& mode_reason() const { return mode_reason_; }
  // Whether gc() and clear() may remove files: the cache is read-write, or it was asked for
  // read-write and is read-only only because no file could be created for lack of space or
  // quota (ENOSPC, EDQUOT), which stops creating files, not removing them.
  bool removals_allowed() const { return mode_ == CacheMode::kReadWrite || out_of_space_; }
  // Where the entry for `key` lives (whether or not it exists). Throws Error{kInvalidArgument}
  // for a malformed key.
  std::string entry_path(const std::string& key) const;

  // The verified entry, or nullopt on a miss. An entry that fails verification (bad magic,
  // lengths not matching the file size or beyond what an entry may hold, hash mismatch, wrong
  // key) is quarantined (moved under quarantine/ when writable, else left alone), logged at
  // warn, and reported as a miss. An untrusted entry (foreign owner, group/world writable) is
  // logged and reported as a miss. A hit touches the entry's mtime (LRU) unless the cache is
  // read-only.
  std::optional<Entry> load(const std::string& key) const;

  // Atomic publish: temp file in the same dir (O_EXCL), write, fsync, rename, fsync dir. Returns
  // whether it was stored: false when not writable, or when the write failed or the entry is
  // larger than a reader accepts (logged at warn; the caller still has its cubin), with the
  // cause in *why_not where given. A store that fails for lack of space or quota (ENOSPC,
  // EDQUOT) or on a read-only mount (EROFS) pauses later stores and lock() for
  // kStoresPauseSeconds, said once at warn: each would fail the same way, after a compile under
  // the lock that other processes wait for. The first store after the pause tries again (a gc may
  // have made room); one that succeeds ends the pause (logged at info). Throws
  // Error{kInvalidArgument} for a malformed key.
  bool store(const Entry& entry, std::string* why_not = nullptr) const;

  // Inter-process lock for compiling `key` (flock on locks/<key>.lock). Released by the
  // destructor, also for a child forked (without exec) while it was held. A holder whose build or
  // store failed says so with mark_failed() before it lets go (one byte in the lock file, cleared
  // by the next holder that did not wait): the processes that waited for it then build side by
  // side instead of one after another, while a holder that died (killed, crashed) marks nothing,
  // and its waiters take turns so that the first one's entry serves the rest.
  class Lock {
   public:
    Lock() = default;
    Lock(int fd, bool holder_failed);
    Lock(Lock&& other) noexcept;
    Lock& operator=(Lock&& other) noexcept;
    Lock(const Lock&) = delete;
    Lock& operator=(const Lock&) = delete;
    ~Lock();
    bool held() const { return fd_ >= 0; }
    // Whether this lock was taken after a wait for a holder that released it marked failed.
    bool holder_failed() const { return holder_failed_; }
    // Marks the lock file failed (see the class comment); best effort, and only while held.
    void mark_failed() const noexcept;

   private:
    void release() noexcept;
    int fd_ = -1;
    // The process that took the lock (fork_generation): only it unlocks, others just close.
    uint64_t owner_generation_ = 0;
    bool holder_failed_ = false;
  };

  // How long lock() waits for another holder before compiling without the lock. Why 120 s: the
  // slowest compile measured is 6.1 s (tools/PERF_LOG.md), so a live holder publishes long
  // before, even on a machine slowed many times over by parallel prewarms; a holder that never
  // releases (a stopped process, a hung build) costs each waiter at most this. Well below
  // kStaleTempSeconds, the age after which a writer is taken for dead.
  static constexpr int64_t kLockWaitSeconds = 120;

  // Takes the lock, polling (1 ms between tries, growing to 50 ms) rather than blocking, so that
  // while another process holds it:
  //  - with `published`, an entry for `key` that appears on disk (the holder published it) is
  //    loaded into *published and an empty lock is returned at once, without waiting for the
  //    holder to release (it may be stopped, or be a forked child that inherited the lock);
  //  - after `max_wait` an empty lock is returned (logged at warn): the caller compiles without
  //    it, at worst a duplicate compile, since store() publishes atomically.
  // Also empty when the cache is not writable, while stores are paused (see store()), or when the
  // lock file can't be opened (logged).
  // Throws Error{kInvalidArgument} for a malformed key.
  Lock lock(const std::string& key, std::optional<Entry>* published = nullptr,
            std::chrono::milliseconds max_wait = std::chrono::seconds(kLockWaitSeconds)) const;

  // Entries of this schema version, sorted by path. With `verify`, each is fully checked (cubin
  // hash included) and a bad one is quarantined as load() would; without, only the header and
  // manifest are read. A directory of entries that can't be read (the version's, a shard) is
  // skipped, logged at warn and added to *unreadable ("path: reason") where given. Empty in
  // kMemoryOnly mode.
  std::vector<EntryInfo> list(bool verify, std::vector<std::string>* unreadable = nullptr) const;

  // Removes least recently used entries (all schema versions; quarantined files first) until the
  // total is <= max_bytes; also removes temp files older than kStaleTempSeconds (the shards' and
  // the cache root's), older builds' toolkit stamps (toolkit-<hex>.json) and quarantined
  // files older than kQuarantineKeepSeconds. Files of other users are never removed; a
  // directory below the root that can't be read is skipped (GcReport::unreadable), as by clear.
  // An entry is removed only while it is as scanned: one published at its path or used since
  // stays, also when that happens just before the removal (the entry is moved away to a temp name
  // first, and anything else the move took goes back). Not when gc is killed between the move
  // and the move back, or when the move fails (a full disk or quota: gc then unlinks the path, to
  // free the space): that entry is rebuilt by its next user. (Another gc may take a moved file
  // for a stale temp file, but only one as old as the scan found it, which this gc removes too:
  // a use or a publish gives the file a fresh mtime.)
  // Throws Error{kCache} unless removals_allowed().
  GcReport gc(uint64_t max_bytes) const;
  // Removes every entry (all schema versions), every quarantined file and older builds' toolkit
  // stamps of this user, and what gc takes besides (stale temp files, idle lock files); reports
  // how many, and how many could not be removed. Throws Error{kCache} unless
  // removals_allowed().
  ClearReport clear() const;

  static constexpr int64_t kStaleTempSeconds = 10 * 60;
  static constexpr int64_t kQuarantineKeepSeconds = 7 * 24 * 3600;
  // How long stores and locks pause after a store failed for lack of space (see store()). Why a
  // minute: long enough that a burst of compiles does not try each store in turn, short enough
  // that a server outlives a disk filled for a while.
  static constexpr int kStoresPauseSeconds = 60;

 private:
  // Uses the cache in mode `to` from now on, for `reason` (mode_reason()); logs a warning, with
  // `hint` after the reason when given.
  void degrade(CacheMode to, const std::string& reason, const char* hint = "");
  // A new name under quarantine/ for the file at `path`: "<its name>.<unix time>.<random hex>".
  std::string quarantine_name(const std::string& path) const;
  // Moves a bad entry (still open as `fd`) to quarantine/ when writable; logs at warn. Returns
  // where it went, or "" when it was left in place.
  std::string quarantine(const std::string& path, int fd, const std::string& reason) const;
  // Moves the file or directory at `path` to a new name under quarantine/ (*dest): 0 or an
  // errno.
  int move_to_quarantine(const std::string& path, std::string* dest) const;
  // Moves a directory of this user's found at entry path `path` to quarantine/ (logged at
  // warn), so store() can publish there. Another user's directory stays, as does one that can't
  // be moved, each with a warning; anything else at the path is left to store()'s rename.
  void move_directory_aside(const std::string& path) const;
  // Clears this user's symlink or socket (unlinked; a symlink's target is untouched) or
  // directory (moved to quarantine/) at lock path `path`, where lock() cannot open a lock file,
  // logging it at warn (at debug unless `warn`). True when the path is worth another try: cleared
  // here, or by another process since.
  bool clear_lock_path(const std::string& path, bool warn) const;
  // load(), and on a miss whether it was a file at the path that load() turned down (a link, not
  // a regular file, untrusted, failed verification, or could not be opened or read) rather than
  // no file there at all.
  std::optional<Entry> load(const std::string& key, bool& refused) const;

  std::string dir_;
  CacheMode mode_;
  std::string mode_reason_;
  // The errno of the store that paused stores and locks (see store()), else 0, and until when
  // (steady clock, ms); stores_paused() reads both.
  int stores_paused() const;
  mutable std::atomic<int> stores_off_{0};
  mutable std::atomic<int64_t> stores_paused_until_ms_{0};
  bool out_of_space_ = false;  // read-only because the disk or quota is full (removals_allowed)
  std::string version_dir_;    // dir_/v<kCacheSchemaVersion>
};

// Tests only: what a test can't otherwise make happen, or not at the right moment. Process-wide:
// set them while no other thread uses a cache. Consulted by the constructor's write probe, by
// store(), lock() and gc(), and by the quarantine of a bad entry, never by a lookup that finds a
// good entry or none.
struct CacheTestHooks {
  // Creating the write probe, or writing an entry, fails with this errno (0: never), as on a
  // full disk (ENOSPC) or a read-only mount (EROFS).
  int write_error = 0;
  // Runs in gc() between its scan and its removals, as another process acting meanwhile.
  std::function<void()> after_gc_scan;
  // Runs in lock() when a try finds the lock held, before the first wait, once per lock().
  std::function<void()> lock_waiting;
  // Runs in the quarantine of a bad entry after its check that the path still names the file
  // checked, just before it moves the file at the path to quarantine/, as another process
  // publishing a good entry there meanwhile.
  std::function<void()> before_quarantine_rename;
  // Runs in the quarantine of a bad entry right after that move, before it looks at what it
  // moved (a good entry published since its check goes back), as yet another process publishing
  // meanwhile.
  std::function<void()> after_quarantine_rename;
  // The no-replace rename that moves a file back to an entry's path (quarantine, gc) fails with
  // this errno (0: never), as on a filesystem without RENAME_NOREPLACE (EINVAL), where link and
  // unlink do it instead.
  int no_replace_rename_error = 0;
  // Runs in gc() for each entry it is about to remove (with the entry's path), after its last look
  // finds the file as scanned and before it moves the file away, as another process publishing a
  // fresh entry there, or using the entry, meanwhile.
  std::function<void(const std::string& path)> before_gc_removal;
  // gc()'s move of an entry away from its path (before it removes it) fails with this errno
  // (0: never), as on a full disk or quota (ENOSPC, EDQUOT), where it unlinks the path instead.
  int gc_rename_error = 0;
  // Added to the steady clock (ms) that times the pause of stores and locks (see
  // DiskCache::store()), as if that much more time had passed.
  int64_t steady_clock_shift_ms = 0;
  // Run in lock() around its load of an entry it found at the path while another process holds
  // the lock (with the entry's path), as gc moving the file away and back meanwhile.
  std::function<void(const std::string& path)> before_published_load;
  std::function<void(const std::string& path)> after_published_load;
  // Runs before a removal of this user's file in lock()'s way (a symlink, socket or directory at
  // a lock path) by lock(), or of a stale symlink or socket under a lock's name by gc() and
  // clear() (with the path), as another process clearing the path and taking the lock meanwhile.
  std::function<void(const std::string& path)> before_lock_path_removal;
};
void set_cache_test_hooks(CacheTestHooks hooks);

}  // namespace moejit::detail
