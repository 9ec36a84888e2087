#include "cache/disk_cache.hpp"

#include <dirent.h>
#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <functional>
#include <nlohmann/json.hpp>
#include <string_view>
#include <system_error>
#include <thread>
#include <utility>

#include "cache/file_io.hpp"
#include "common/check.hpp"
#include "common/fork.hpp"
#include "common/hash.hpp"
#include "common/log.hpp"
#include "compile/cubin_check.hpp"
#include "moejit/error.hpp"
#include "moejit/version.hpp"

namespace moejit::detail {
namespace {

constexpr unsigned char kMagic[8] = {'m', 'o', 'e', 'j', 'i', 't', 'c', '\n'};
constexpr std::size_t kHeaderSize = 64;
constexpr std::size_t kKeyLength = 32;
constexpr const char* kEntrySuffix = ".mjc";
constexpr const char* kTempSuffix = ".tmp";
// The largest manifest and cubin an entry may hold, checked by store() and by every read before
// anything is allocated, so a file whose header claims a huge length (with a size to match) is
// a bad entry, not an allocation failure. Why these: a manifest is a few KB of JSON (options,
// ptxas lines), a cubin tens of KB (a few hundred with -lineinfo); both bounds leave orders of
// magnitude of room.
constexpr uint64_t kMaxManifestBytes = uint64_t{1} << 20;
constexpr uint64_t kMaxCubinBytes = uint64_t{256} << 20;

// A temp file's path in `dir`: "." + `stem` + ".<pid>.<random>.tmp". Why this form: a name
// that starts with '.' and ends with ".tmp" is never taken for an entry ("<key>.mjc"), gc removes
// it once stale, and the pid and random part keep writers apart.
std::string temp_path(const std::string& dir, const std::string& stem) {
  return dir + "/." + stem + "." + std::to_string(::getpid()) + "." + random_hex() + kTempSuffix;
}

CacheTestHooks& test_hooks() {
  static CacheTestHooks hooks;
  return hooks;
}

// The steady clock (ms) that times the pause of stores and locks.
int64_t steady_ms() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
             .count() +
         test_hooks().steady_clock_shift_ms;
}

int64_t now_unix() {
  return std::chrono::duration_cast<std::chrono::seconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

const char* mode_name(CacheMode mode) {
  switch (mode) {
    case CacheMode::kReadWrite: return "read-write";
    case CacheMode::kReadOnly: return "read-only";
    case CacheMode::kMemoryOnly: return "memory-only";
  }
  return "unknown";
}

int open_file(const std::string& path, int flags, mode_t mode = 0) {
  int fd = -1;
  do {
    fd = ::open(path.c_str(), flags | O_CLOEXEC, mode);
  } while (fd < 0 && errno == EINTR);
  return fd;
}

// 0 when all `size` bytes were read at `offset`; -1 at an early end of file; else errno.
int pread_all(int fd, char* data, std::size_t size, uint64_t offset) {
  std::size_t done = 0;
  while (done < size) {
    ssize_t n = ::pread(fd, data + done, size - done, static_cast<off_t>(offset + done));
    if (n < 0) {
      if (errno == EINTR) continue;
      return errno;
    }
    if (n == 0) return -1;
    done += static_cast<std::size_t>(n);
  }
  return 0;
}

bool is_lower_hex(char c) { return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'); }

bool ends_with(const std::string& text, const std::string& suffix) {
  return text.size() >= suffix.size() &&
         text.compare(text.size() - suffix.size(), suffix.size(), suffix) == 0;
}

// "<32 hex>.mjc": sets *key.
bool is_entry_name(const std::string& name, std::string* key) {
  if (name.size() != kKeyLength + 4 || !ends_with(name, kEntrySuffix)) return false;
  std::string k = name.substr(0, kKeyLength);
  if (!is_cache_key(k)) return false;
  *key = std::move(k);
  return true;
}

// What quarantine() and lock() name their files: "<32 hex>.mjc.<anything>" and "<32 hex>.lock".
// Why gc and clear look at the names: a cache set up in a directory shared with other programs
// (MOEJIT_CACHE_DIR=~/.cache) has "locks" and "quarantine" names others may use too.
bool is_quarantined_name(const std::string& name) {
  return name.size() > kKeyLength + 5 && is_cache_key(name.substr(0, kKeyLength)) &&
         name.compare(kKeyLength, 5, ".mjc.") == 0;
}
bool is_lock_name(const std::string& name) {
  return name.size() == kKeyLength + 5 && is_cache_key(name.substr(0, kKeyLength)) &&
         ends_with(name, ".lock");
}

// Writers' temp files (and the writability probe): ".<anything>.tmp".
bool is_temp_name(const std::string& name) {
  return name.size() > 5 && name[0] == '.' && ends_with(name, kTempSuffix);
}

// The temp files older builds wrote their toolkit stamps through, in the cache root:
// ".toolkit-<anything>.tmp". Why no other temp name there: the root is the directory a cache
// shares with other programs when one is set up in, say, ~/.cache, and the library writes no
// other file in it.
bool is_old_stamp_temp(const std::string& name) {
  return is_temp_name(name) && name.compare(0, 9, ".toolkit-") == 0;
}

// "toolkit-<32 hex>.json": the CUDA header fingerprint older builds (whose kernels included
// toolkit headers) kept in the cache root. Nothing reads it now; gc and clear remove it.
bool is_old_toolkit_stamp(const std::string& name) {
  constexpr std::string_view kPrefix = "toolkit-";
  constexpr std::string_view kSuffix = ".json";
  if (name.size() != kPrefix.size() + kKeyLength + kSuffix.size()) return false;
  if (name.compare(0, kPrefix.size(), kPrefix) != 0 || !ends_with(name, std::string(kSuffix))) {
    return false;
  }
  return is_cache_key(name.substr(kPrefix.size(), kKeyLength));
}

bool is_shard_name(const std::string& name) {
  return name.size() == 2 && is_lower_hex(name[0]) && is_lower_hex(name[1]);
}

bool is_version_name(const std::string& name) {
  if (name.size() < 2 || name[0] != 'v') return false;
  return std::all_of(name.begin() + 1, name.end(), [](char c) { return c >= '0' && c <= '9'; });
}

std::string octal_mode(mode_t mode) {
  char text[8];
  std::snprintf(text, sizeof(text), "%04o", static_cast<unsigned>(mode & 07777));
  return text;
}

// "" when `st` may be trusted: owned by us or root, not writable by group or others.
std::string distrust_reason(const struct stat& st) {
  if (st.st_uid != ::geteuid() && st.st_uid != 0) {
    return "owned by uid " + std::to_string(st.st_uid) + ", not by this user (uid " +
           std::to_string(::geteuid()) + ") or root";
  }
  if ((st.st_mode & (S_IWGRP | S_IWOTH)) != 0) {
    return "writable by group or others (mode " + octal_mode(st.st_mode) + ")";
  }
  return "";
}

int64_t age_seconds(const struct stat& st, int64_t now) {
  return now - static_cast<int64_t>(st.st_mtim.tv_sec);
}

// mkdir -p with 0700 for every directory created. 0, or errno with *failed naming the path.
int make_dirs(const std::string& path, std::string* failed) {
  std::size_t pos = 0;
  while (true) {
    std::size_t slash = path.find('/', pos);
    std::string prefix = path.substr(0, slash);
    if (!prefix.empty() && prefix.back() != '/') {
      if (::mkdir(prefix.c_str(), 0700) != 0 && errno != EEXIST) {
        *failed = prefix;
        return errno;
      }
    }
    if (slash == std::string::npos) return 0;
    pos = slash + 1;
  }
}

// 0 when `path` is (now) a directory; else errno.
// `created`: set when this call made the directory.
int ensure_dir(const std::string& path, bool* created = nullptr) {
  if (::mkdir(path.c_str(), 0700) == 0) {
    if (created != nullptr) *created = true;
    return 0;
  }
  if (errno != EEXIST) return errno;
  struct stat st {};
  if (::lstat(path.c_str(), &st) != 0) return errno;
  return S_ISDIR(st.st_mode) ? 0 : ENOTDIR;
}

struct DirEntry {
  std::string name;
  std::string path;
  struct stat st {};
};

// The entries of `dir` (lstat: symlinks are reported as links, never followed). A missing dir
// reads as empty; another failure sets *error.
std::vector<DirEntry> read_dir(const std::string& dir, int* error) {
  std::vector<DirEntry> out;
  *error = 0;
  DIR* handle = ::opendir(dir.c_str());
  if (handle == nullptr) {
    if (errno != ENOENT) *error = errno;
    return out;
  }
  while (true) {
    errno = 0;
    dirent* e = ::readdir(handle);
    if (e == nullptr) {
      if (errno != 0) *error = errno;
      break;
    }
    std::string name = e->d_name;
    if (name == "." || name == "..") continue;
    DirEntry item;
    item.path = dir + "/" + name;
    item.name = std::move(name);
    if (::fstatat(::dirfd(handle), e->d_name, &item.st, AT_SYMLINK_NOFOLLOW) != 0) continue;
    out.push_back(std::move(item));
  }
  ::closedir(handle);
  return out;
}

std::vector<DirEntry> read_dir_or_throw(const std::string& dir) {
  int error = 0;
  std::vector<DirEntry> out = read_dir(dir, &error);
  MOEJIT_CHECK(error == 0, ErrorCode::kIo,
               "cannot read cache directory " << dir << ": " << errno_text(error));
  return out;
}

// A directory below the cache root for the maintenance walks: one that can't be read (another
// user's private shard, say) is logged at warn by `what` and added to *unreadable, and the walk
// goes on without it, so one such directory does not stop list, verify, gc or clear.
std::vector<DirEntry> read_dir_or_skip(const std::string& dir, const char* what,
                                       std::vector<std::string>* unreadable) {
  int error = 0;
  std::vector<DirEntry> out = read_dir(dir, &error);
  if (error != 0) {
    unreadable->push_back(dir + ": " + errno_text(error));
    log().warn("cache {}: cannot read {}: {}; its files are skipped", what, dir, errno_text(error));
  }
  return out;
}

// This user's temp file left by a writer taken for dead (older than kStaleTempSeconds): removed.
bool remove_stale_temp(const DirEntry& file, uid_t me, int64_t now) {
  return S_ISREG(file.st.st_mode) && file.st.st_uid == me && is_temp_name(file.name) &&
         age_seconds(file.st, now) > DiskCache::kStaleTempSeconds &&
         ::unlink(file.path.c_str()) == 0;
}

// remove_if_unchanged's result when the path no longer names the file seen: nothing removed.
constexpr int kPathChanged = -1;

// Runs `remove` (an unlink or a move away of `path`, in locks/; 0 or an errno) only while `path`
// still names the file `seen` describes (device, inode, type, owner, ctime), holding an flock on
// the locks directory, which every remover of a non-lock-file there takes: kPathChanged if it does
// not. Why: a remover that looked earlier would otherwise remove what took the path since, such as
// the lock file another process made there once the path was clear, and holds.
int remove_if_unchanged(const std::string& path, const struct stat& seen,
                        const std::function<int()>& remove) {
  Fd dir(open_file(path.substr(0, path.rfind('/')), O_RDONLY | O_DIRECTORY | O_NOFOLLOW));
  if (!dir.ok()) return errno;
  // Why not a blocking flock: a holder keeps it for an lstat and one unlink or rename, so a
  // second's wait means a holder stopped mid-way; better to leave the file than hang.
  for (int tries = 0; ::flock(dir.get(), LOCK_EX | LOCK_NB) != 0; ++tries) {
    if (errno != EWOULDBLOCK && errno != EINTR) return errno;
    if (tries == 1000) return EWOULDBLOCK;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  // Why LOCK_UN before close, on every way out: a child forked meanwhile shares the open file
  // description (see DiskCache::Lock::~Lock).
  struct Unlock {
    int fd;
    ~Unlock() { ::flock(fd, LOCK_UN); }
  } unlock{dir.get()};
  // Why the owner and ctime too: a freed inode is often the next file's, even of the same type.
  struct stat now {};
  const bool same =
      ::lstat(path.c_str(), &now) == 0 && now.st_dev == seen.st_dev && now.st_ino == seen.st_ino &&
      (now.st_mode & S_IFMT) == (seen.st_mode & S_IFMT) && now.st_uid == seen.st_uid &&
      now.st_ctim.tv_sec == seen.st_ctim.tv_sec && now.st_ctim.tv_nsec == seen.st_ctim.tv_nsec;
  return same ? remove() : kPathChanged;
}

// This user's lock file that no process holds, older than kStaleTempSeconds: removed while held
// here (see DiskCache::lock()), and only if the path still names the file locked. A FIFO locks
// like a file (without the failed holder's mark: it holds no bytes). A symlink or socket under a
// lock's name, which lock() cannot open (it clears one itself), is removed as scanned.
void remove_idle_lock(const DirEntry& file, uid_t me, int64_t now) {
  const mode_t type = file.st.st_mode & S_IFMT;
  if (file.st.st_uid != me || !is_lock_name(file.name) ||
      age_seconds(file.st, now) <= DiskCache::kStaleTempSeconds) {
    return;
  }
  if (type == S_IFLNK || type == S_IFSOCK) {
    if (test_hooks().before_lock_path_removal) test_hooks().before_lock_path_removal(file.path);
    (void)remove_if_unchanged(file.path, file.st,
                              [&] { return ::unlink(file.path.c_str()) == 0 ? 0 : errno; });
    return;
  }
  if (type != S_IFREG && type != S_IFIFO) return;
  Fd fd(open_file(file.path, O_RDWR | O_NOFOLLOW | O_NONBLOCK));
  if (!fd.ok() || ::flock(fd.get(), LOCK_EX | LOCK_NB) != 0) return;
  // Why check the path still names the locked file: another gc may have unlinked it after this
  // one opened it, and a process may have locked a new file at the path since.
  struct stat held {};
  struct stat at_path {};
  if (::fstat(fd.get(), &held) == 0 && ::lstat(file.path.c_str(), &at_path) == 0 &&
      held.st_dev == at_path.st_dev && held.st_ino == at_path.st_ino) {
    ::unlink(file.path.c_str());
  }
}

// Moves `from` (a file just moved away from `path`, on the same filesystem) back to `path`,
// unless the path has been taken since: never replaces what is there. Returns 0 when it
// went back; EEXIST when another file has taken the path, which makes `from` redundant: it is
// removed; else the errno, with `from` left where it is.
int move_back_unless_taken(const std::string& from, const std::string& path) {
  int error = test_hooks().no_replace_rename_error;
  if (error == 0 &&
      ::renameat2(AT_FDCWD, from.c_str(), AT_FDCWD, path.c_str(), RENAME_NOREPLACE) != 0) {
    error = errno;
  }
  // Why link and unlink: a filesystem without RENAME_NOREPLACE (EINVAL, or ENOSYS from an old
  // kernel) still refuses to replace through link(), which fails with EEXIST too.
  if (error == EINVAL || error == ENOSYS) {
    error = ::link(from.c_str(), path.c_str()) == 0 ? 0 : errno;
    if (error == 0) ::unlink(from.c_str());
  }
  if (error == EEXIST) ::unlink(from.c_str());
  return error;
}

// What gc and clear meet, by where it is in the cache (dir entries as read_dir reports them:
// any owner, any type; each callback decides). Directories below the root that can't be read
// are skipped and named in *unreadable (read_dir_or_skip).
struct CacheWalk {
  std::function<void(const DirEntry&)> root_file;     // toolkit stamps and their temp files
  std::function<void(const DirEntry&)> version_file;  // the writability probe's temp files
  std::function<void(const DirEntry&, bool entry)> shard_file;  // entry: named <key>.mjc
  std::function<void(const DirEntry&)> quarantined;
  std::function<void(const DirEntry&)> lock_file;
};

void walk_cache(const std::string& root, const char* what, const CacheWalk& visit,
                std::vector<std::string>* unreadable) {
  for (const DirEntry& version : read_dir_or_throw(root)) {
    if (!S_ISDIR(version.st.st_mode)) {
      visit.root_file(version);
      continue;
    }
    if (!is_version_name(version.name)) continue;
    for (const DirEntry& shard : read_dir_or_skip(version.path, what, unreadable)) {
      if (!S_ISDIR(shard.st.st_mode)) {
        visit.version_file(shard);
        continue;
      }
      if (!is_shard_name(shard.name)) continue;
      for (const DirEntry& file : read_dir_or_skip(shard.path, what, unreadable)) {
        std::string key;
        visit.shard_file(file, is_entry_name(file.name, &key));
      }
    }
  }
  for (const DirEntry& file : read_dir_or_skip(root + "/quarantine", what, unreadable)) {
    visit.quarantined(file);
  }
  for (const DirEntry& file : read_dir_or_skip(root + "/locks", what, unreadable)) {
    visit.lock_file(file);
  }
}

// ---- entry format ----

void put_u32(unsigned char* p, uint32_t v) {
  for (int i = 0; i < 4; ++i) p[i] = static_cast<unsigned char>(v >> (8 * i));
}
void put_u64(unsigned char* p, uint64_t v) {
  for (int i = 0; i < 8; ++i) p[i] = static_cast<unsigned char>(v >> (8 * i));
}
uint32_t get_u32(const unsigned char* p) {
  uint32_t v = 0;
  for (int i = 3; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}
uint64_t get_u64(const unsigned char* p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}

// Header byte offsets.
constexpr std::size_t kOffVersion = 8;
constexpr std::size_t kOffHeaderSize = 12;
constexpr std::size_t kOffManifestLength = 16;
constexpr std::size_t kOffCubinLength = 24;
constexpr std::size_t kOffCubinDigest = 32;
constexpr std::size_t kOffManifestDigest = 48;

nlohmann::ordered_json manifest_json(const Manifest& m) {
  nlohmann::ordered_json j;
  j["key"] = m.key;
  j["kernel"] = m.kernel;
  j["spec"] = m.spec_json;
  j["lowered_name"] = m.lowered_name;
  j["options"] = m.options;
  j["nvrtc_version"] = m.nvrtc_version;
  j["library_version"] = m.library_version;
  j["compile_ms"] = m.compile_ms;
  j["ptxas_info"] = m.ptxas_info;
  j["cubin_size"] = m.cubin_size;
  j["cubin_hash"] = m.cubin_hash;
  j["created_unix"] = m.created_unix;
  return j;
}

// Parses the stored manifest; "" on success, else what is wrong.
std::string parse_manifest(const std::string& text, Manifest* m) {
  nlohmann::json j = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) return "manifest is not a JSON object";
  try {
    m->key = j.at("key").get<std::string>();
    m->kernel = j.at("kernel").get<std::string>();
    m->spec_json = j.at("spec").get<std::string>();
    m->lowered_name = j.at("lowered_name").get<std::string>();
    m->options = j.at("options").get<std::vector<std::string>>();
    m->nvrtc_version = j.at("nvrtc_version").get<std::string>();
    m->library_version = j.at("library_version").get<std::string>();
    m->compile_ms = j.at("compile_ms").get<double>();
    m->ptxas_info = j.at("ptxas_info").get<std::string>();
    // Why the kinds first: get<> converts a float to an integer, undefined where it is out of
    // range (1e300), where a writer only ever stores integers.
    if (!j.at("cubin_size").is_number_unsigned() || !j.at("created_unix").is_number_integer()) {
      return "manifest cubin_size or created_unix is not an integer";
    }
    m->cubin_size = j.at("cubin_size").get<uint64_t>();
    m->cubin_hash = j.at("cubin_hash").get<std::string>();
    m->created_unix = j.at("created_unix").get<int64_t>();
  } catch (const nlohmann::json::exception& e) {
    return std::string("manifest field missing or of the wrong type: ") + e.what();
  }
  return "";
}

struct ReadResult {
  bool io_error = false;  // the file could not be read (not evidence of corruption)
  std::string problem;    // "" = verified
};

ReadResult corrupt(std::string problem) { return ReadResult{false, std::move(problem)}; }

ReadResult read_failure(int error, uint64_t file_size) {
  if (error == -1) {
    return corrupt("file ended early (" + std::to_string(file_size) + " bytes expected)");
  }
  return ReadResult{true, "read failed: " + errno_text(error)};
}

// Reads and checks the entry open as `fd` (`file_size` bytes) for `key`. The manifest is stored
// in *out as soon as it parses; with `with_cubin` the cubin is read and its hash checked too.
ReadResult read_entry(int fd, uint64_t file_size, const std::string& key, bool with_cubin,
                      Entry* out) {
  if (file_size < kHeaderSize) {
    return corrupt("file is " + std::to_string(file_size) + " bytes, shorter than the " +
                   std::to_string(kHeaderSize) + "-byte header (truncated)");
  }
  unsigned char header[kHeaderSize];
  if (int e = pread_all(fd, reinterpret_cast<char*>(header), kHeaderSize, 0); e != 0) {
    return read_failure(e, file_size);
  }
  if (std::memcmp(header, kMagic, sizeof(kMagic)) != 0) {
    return corrupt("bad magic: not a moejit cache entry");
  }
  const uint32_t version = get_u32(header + kOffVersion);
  if (version != static_cast<uint32_t>(kCacheSchemaVersion)) {
    return corrupt("format version " + std::to_string(version) + ", expected " +
                   std::to_string(kCacheSchemaVersion));
  }
  const uint32_t header_size = get_u32(header + kOffHeaderSize);
  if (header_size != kHeaderSize) {
    return corrupt("header size field is " + std::to_string(header_size) + ", expected " +
                   std::to_string(kHeaderSize));
  }
  const uint64_t manifest_length = get_u64(header + kOffManifestLength);
  const uint64_t cubin_length = get_u64(header + kOffCubinLength);
  const Digest cubin_digest{get_u64(header + kOffCubinDigest),
                            get_u64(header + kOffCubinDigest + 8)};
  const Digest manifest_digest{get_u64(header + kOffManifestDigest),
                               get_u64(header + kOffManifestDigest + 8)};
  // Why: each length is bounded by the file size first, so the sum below cannot overflow.
  if (manifest_length > file_size || cubin_length > file_size ||
      kHeaderSize + manifest_length + cubin_length != file_size) {
    return corrupt("header " + std::to_string(kHeaderSize) + " + manifest " +
                   std::to_string(manifest_length) + " + cubin " + std::to_string(cubin_length) +
                   " bytes != file size " + std::to_string(file_size) +
                   " (truncated or overwritten)");
  }
  if (manifest_length > kMaxManifestBytes || cubin_length > kMaxCubinBytes) {
    return corrupt("header claims a manifest of " + std::to_string(manifest_length) +
                   " bytes and a cubin of " + std::to_string(cubin_length) +
                   " bytes; an entry holds at most " + std::to_string(kMaxManifestBytes) + " and " +
                   std::to_string(kMaxCubinBytes));
  }
  std::string manifest_text(static_cast<std::size_t>(manifest_length), '\0');
  if (int e = pread_all(fd, manifest_text.data(), manifest_text.size(), kHeaderSize); e != 0) {
    return read_failure(e, file_size);
  }
  if (!(hash_bytes(manifest_text) == manifest_digest)) {
    return corrupt("manifest hash mismatch (content changed on disk)");
  }
  Manifest manifest;
  if (std::string why = parse_manifest(manifest_text, &manifest); !why.empty()) {
    return corrupt(why);
  }
  out->manifest = manifest;
  if (manifest.key != key) {
    return corrupt("entry holds key " + manifest.key + ", expected " + key + " (misplaced file)");
  }
  if (manifest.cubin_size != cubin_length || manifest.cubin_hash != cubin_digest.hex()) {
    return corrupt("manifest cubin size/hash (" + std::to_string(manifest.cubin_size) + ", " +
                   manifest.cubin_hash + ") disagree with the header (" +
                   std::to_string(cubin_length) + ", " + cubin_digest.hex() + ")");
  }
  if (!with_cubin) return {};
  out->cubin.resize(static_cast<std::size_t>(cubin_length));
  if (int e = pread_all(fd, out->cubin.data(), out->cubin.size(), kHeaderSize + manifest_length);
      e != 0) {
    out->cubin.clear();
    return read_failure(e, file_size);
  }
  const Digest actual = hash_bytes(out->cubin);
  if (!(actual == cubin_digest)) {
    out->cubin.clear();
    return corrupt("cubin hash mismatch: recorded " + cubin_digest.hex() + ", computed " +
                   actual.hex() + " (content changed on disk)");
  }
  // Why, though the hash matched: the hash shows the bytes are the ones written, not that the
  // writer wrote a cubin, and the driver reads whatever an ELF header points at.
  if (std::string why = elf_image_problem(out->cubin); !why.empty()) {
    out->cubin.clear();
    return corrupt("the stored cubin is not a whole ELF image: " + why);
  }
  return {};
}

}  // namespace

// Why replace: a compiler's log (ptxas_info) may hold bytes that are not UTF-8, which dump()
// would otherwise throw on; they are stored as U+FFFD.
std::string manifest_to_json(const Manifest& manifest) {
  return manifest_json(manifest).dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

void set_cache_test_hooks(CacheTestHooks hooks) { test_hooks() = std::move(hooks); }

bool is_cache_key(const std::string& key) {
  return key.size() == kKeyLength && std::all_of(key.begin(), key.end(), is_lower_hex);
}

// ---- DiskCache ----

DiskCache::DiskCache(std::string dir, CacheMode mode) : dir_(std::move(dir)), mode_(mode) {
  // Why absolute, taken against the working directory of now: every path below is built from
  // dir_, so a relative one would follow a later chdir() (a daemon's chdir("/")) to a directory
  // whose ownership and permissions were never checked.
  std::string unresolved;
  if (!dir_.empty() && dir_.front() != '/' && mode_ != CacheMode::kMemoryOnly) {
    std::error_code error;
    const std::filesystem::path absolute = std::filesystem::absolute(dir_, error);
    if (error) {
      unresolved = "cannot resolve the relative cache directory " + dir_ + ": " + error.message();
    } else {
      dir_ = absolute.lexically_normal().string();
    }
  }
  while (dir_.size() > 1 && dir_.back() == '/') dir_.pop_back();
  version_dir_ = dir_ + "/v" + std::to_string(kCacheSchemaVersion);
  if (mode_ == CacheMode::kMemoryOnly) return;
  if (dir_.empty() || !unresolved.empty()) {
    degrade(CacheMode::kMemoryOnly, dir_.empty() ? "no cache directory was given" : unresolved);
    return;
  }

  struct stat st {};
  if (::stat(dir_.c_str(), &st) != 0) {
    const int error = errno;
    if (mode_ == CacheMode::kReadOnly) {
      if (error == ENOENT) {
        log().info("cache directory {} does not exist; read-only cache, every lookup misses",
                   dir_);
      } else {
        degrade(CacheMode::kMemoryOnly, "cannot use " + dir_ + ": " + errno_text(error));
      }
      return;
    }
    std::string failed;
    if (int made = make_dirs(dir_, &failed); made != 0) {
      degrade(CacheMode::kMemoryOnly,
              "cannot create cache directory " + failed + ": " + errno_text(made));
      return;
    }
    if (::stat(dir_.c_str(), &st) != 0) {
      degrade(CacheMode::kMemoryOnly, "cannot use " + dir_ + ": " + errno_text(errno));
      return;
    }
  }
  if (!S_ISDIR(st.st_mode)) {
    degrade(CacheMode::kMemoryOnly, dir_ + " is not a directory");
    return;
  }
  if (std::string why = distrust_reason(st); !why.empty()) {
    const std::string reason = "cache directory " + dir_ + " is " + why +
                               "; a cache others can write lets them inject GPU code (fix: "
                               "chmod go-w it, or set MOEJIT_CACHE_DIR to a private directory)";
    if (mode_ == CacheMode::kReadWrite) {
      degrade(CacheMode::kReadOnly, reason);
    } else {
      log().warn("{}; only entries owned by you or root, and not writable by others, are loaded",
                 reason);
    }
  }
  if (mode_ != CacheMode::kReadWrite) return;

  // A cache that can't be written may be meant read-only (an image, a read-only mount): said in
  // the warning only, not in mode_reason(), which commands that need to write quote.
  const char* const meant = " (for a cache meant to be read-only, set MOEJIT_CACHE_MODE=ro)";
  // Why: a full disk or quota stops creating files, not removing them, and gc or clear is what
  // such a cache needs.
  const auto out_of_space = [](int error) { return error == ENOSPC || error == EDQUOT; };
  if (int e = ensure_dir(version_dir_); e != 0) {
    out_of_space_ = out_of_space(e);
    degrade(CacheMode::kReadOnly, "cannot create " + version_dir_ + ": " + errno_text(e), meant);
    return;
  }
  if (::lstat(version_dir_.c_str(), &st) == 0) {
    if (std::string why = distrust_reason(st); !why.empty()) {
      degrade(CacheMode::kReadOnly, "cache directory " + version_dir_ + " is " + why +
                                        " (fix: chmod go-w it, or remove it)");
      return;
    }
  }
  if (int e = ensure_dir(dir_ + "/locks"); e != 0) {
    out_of_space_ = out_of_space(e);
    degrade(CacheMode::kReadOnly, "cannot create " + dir_ + "/locks: " + errno_text(e), meant);
    return;
  }
  // Why: permissions alone don't tell (root ignores them, a read-only mount overrides them);
  // creating a file is the test that matters.
  const std::string probe = temp_path(version_dir_, "probe");
  int error = test_hooks().write_error;
  Fd fd(error != 0 ? -1 : open_file(probe, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW, 0600));
  if (!fd.ok()) {
    if (error == 0) error = errno;
    out_of_space_ = out_of_space(error);
    degrade(CacheMode::kReadOnly, "cannot write in " + version_dir_ + ": " + errno_text(error),
            meant);
    return;
  }
  fd.reset();
  ::unlink(probe.c_str());
}

void DiskCache::degrade(CacheMode to, const std::string& reason, const char* hint) {
  // Why a warning whatever the cause: the mode asked for is not what runs, and kernels compiled
  // from now on are not kept, so every process compiles its own, which a service would otherwise
  // find only by its start-up time. A cache meant to be read-only (an image) says so with
  // MOEJIT_CACHE_MODE=ro, and is then not degraded for being unwritable (the write failures'
  // hint says so).
  const CacheMode asked = mode_;
  mode_ = to;
  mode_reason_ = reason;
  log().warn("{}{}; using the cache {} instead of {}{}", reason, hint, mode_name(to),
             mode_name(asked),
             asked == CacheMode::kReadWrite ? " (kernels compiled now are not kept)" : "");
}

std::string DiskCache::entry_path(const std::string& key) const {
  MOEJIT_CHECK(is_cache_key(key), ErrorCode::kInvalidArgument,
               "malformed cache key '" << key << "': expected 32 lowercase hex digits");
  return version_dir_ + "/" + key.substr(0, 2) + "/" + key + kEntrySuffix;
}

std::optional<Entry> DiskCache::load(const std::string& key) const {
  bool refused = false;
  return load(key, refused);
}

std::optional<Entry> DiskCache::load(const std::string& key, bool& refused) const {
  refused = false;
  const std::string path = entry_path(key);
  if (mode_ == CacheMode::kMemoryOnly) return std::nullopt;

  // Why: O_NONBLOCK so a FIFO planted at the path can't hang us; O_NOFOLLOW so a symlink is
  // never followed to a file we did not check.
  Fd fd(open_file(path, O_RDONLY | O_NOFOLLOW | O_NONBLOCK));
  if (!fd.ok()) {
    const int error = errno;
    refused = error != ENOENT && error != ENOTDIR;
    if (error == ENOENT) {
      log().debug("cache miss {}", key);
    } else if (error == ENOTDIR) {
      log().warn(
          "cache entry {}: a component of its directory is not a directory; treated as a "
          "miss, and entries under it cannot be stored",
          path);
    } else if (error == ELOOP) {
      log().warn("cache entry {} is a symbolic link; ignored (treated as a miss)", path);
    } else {
      log().warn("cache entry {} cannot be opened: {}; treated as a miss{}", path,
                 errno_text(error),
                 error == EACCES ? " (a cache is private to the user who wrote it unless it "
                                   "was prewarmed with `moejit prewarm --readable`)"
                                 : "");
    }
    return std::nullopt;
  }
  refused = true;  // from here every miss is the file's
  struct stat st {};
  if (::fstat(fd.get(), &st) != 0) {
    log().warn("cache entry {} cannot be inspected: {}; treated as a miss", path,
               errno_text(errno));
    return std::nullopt;
  }
  if (!S_ISREG(st.st_mode)) {
    log().warn("cache entry {} is not a regular file; ignored (treated as a miss)", path);
    return std::nullopt;
  }
  if (std::string why = distrust_reason(st); !why.empty()) {
    log().warn("cache entry {} is {}; ignored, not deleted (treated as a miss)", path, why);
    return std::nullopt;
  }

  Entry entry;
  ReadResult result = read_entry(fd.get(), static_cast<uint64_t>(st.st_size), key, true, &entry);
  if (!result.problem.empty()) {
    if (result.io_error) {
      log().warn("cache entry {}: {}; treated as a miss", path, result.problem);
    } else {
      quarantine(path, fd.get(), result.problem);
    }
    return std::nullopt;
  }
  if (mode_ == CacheMode::kReadWrite) {
    // Why: the mtime is the LRU clock for gc(); a failure only makes eviction less precise.
    ::futimens(fd.get(), nullptr);
  }
  log().debug("cache hit {} ({} bytes)", path, entry.cubin.size());
  return entry;
}

std::string DiskCache::quarantine_name(const std::string& path) const {
  return dir_ + "/quarantine/" + path.substr(path.rfind('/') + 1) + "." +
         std::to_string(now_unix()) + "." + random_hex();
}

std::string DiskCache::quarantine(const std::string& path, int fd,
                                  const std::string& reason) const {
  if (mode_ != CacheMode::kReadWrite) {
    log().warn("cache entry {} failed verification ({}); ignored and left in place (the cache is "
               "{})",
               path, reason, mode_name(mode_));
    return "";
  }
  // Why: another process may have quarantined this very file and published a good entry at the
  // same path since we opened it; move only the file that was checked.
  struct stat at_path {}, checked {};
  if (::lstat(path.c_str(), &at_path) != 0 || ::fstat(fd, &checked) != 0 ||
      at_path.st_dev != checked.st_dev || at_path.st_ino != checked.st_ino) {
    log().warn("cache entry {} failed verification ({}); it has already been replaced", path,
               reason);
    return "";
  }
  const std::string quarantine_dir = dir_ + "/quarantine";
  if (int e = ensure_dir(quarantine_dir); e != 0) {
    log().warn("cache entry {} failed verification ({}); ignored (cannot create {}: {})", path,
               reason, quarantine_dir, errno_text(e));
    return "";
  }
  const std::string dest = quarantine_name(path);
  if (test_hooks().before_quarantine_rename) test_hooks().before_quarantine_rename();
  if (::rename(path.c_str(), dest.c_str()) != 0) {
    const int error = errno;
    struct stat gone {};
    if (error == ENOENT && ::lstat(path.c_str(), &gone) != 0 && errno == ENOENT) {
      // The entry, not the destination, is missing: another process moved it first.
      log().warn("cache entry {} failed verification ({}); it has already been moved away", path,
                 reason);
    } else {
      log().warn("cache entry {} failed verification ({}); ignored (cannot move it to {}: {})",
                 path, reason, dest, errno_text(error));
    }
    return "";
  }
  if (test_hooks().after_quarantine_rename) test_hooks().after_quarantine_rename();
  // Why check again: a good entry published between the check above and the rename is what the
  // rename moved. It goes back unless yet another one has taken its place.
  struct stat moved {};
  if (::lstat(dest.c_str(), &moved) == 0 &&
      (moved.st_dev != checked.st_dev || moved.st_ino != checked.st_ino)) {
    // Only EEXIST says a newer entry has taken the path, which makes this one redundant (it is
    // removed). After any other failure it stays in quarantine/ (gc ages it out), and the key is
    // rebuilt.
    if (const int error = move_back_unless_taken(dest, path); error != 0 && error != EEXIST) {
      log().warn(
          "cache entry {} failed verification ({}); the good entry published there since "
          "could not be moved back from {}: {}",
          path, reason, dest, errno_text(error));
      return "";
    }
    log().warn("cache entry {} failed verification ({}); it had just been replaced", path, reason);
    return "";
  }
  // Why: gc ages quarantined files from when they were quarantined, not from their last use.
  ::futimens(fd, nullptr);
  log().warn("cache entry {} failed verification ({}); moved to {}, it will be rebuilt", path,
             reason, dest);
  return dest;
}

int DiskCache::move_to_quarantine(const std::string& path, std::string* dest) const {
  *dest = quarantine_name(path);
  if (int error = ensure_dir(dir_ + "/quarantine"); error != 0) return error;
  return ::rename(path.c_str(), dest->c_str()) == 0 ? 0 : errno;
}

void DiskCache::move_directory_aside(const std::string& path) const {
  struct stat st {};
  if (::lstat(path.c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) return;
  // Why only this user's: another user's files are theirs to deal with (gc and clear never
  // touch them either).
  if (st.st_uid != ::geteuid()) {
    log().warn("cache entry {} is a directory of another user; it is left in place", path);
    return;
  }
  std::string dest;
  const int error = move_to_quarantine(path, &dest);
  // Why ENOENT is no failure: another process's store may have moved it first.
  if (error == ENOENT) return;
  if (error != 0) {
    log().warn("cache entry {} is a directory and cannot be moved to {}/quarantine: {}", path, dir_,
               errno_text(error));
    return;
  }
  log().warn(
      "cache entry {} was a directory; moved to {} so the entry can be stored (gc removes files "
      "only: remove it by hand)",
      path, dest);
}

bool DiskCache::clear_lock_path(const std::string& path, bool warn) const {
  struct stat seen {};
  if (::lstat(path.c_str(), &seen) != 0) return errno == ENOENT;  // gone since: try again
  const mode_t type = seen.st_mode & S_IFMT;
  // Why: open() failed on something else, so another process cleared the path since.
  if (type == S_IFREG || type == S_IFIFO) return true;
  const char* const kind = type == S_IFDIR    ? "directory"
                           : type == S_IFLNK  ? "symbolic link"
                           : type == S_IFSOCK ? "socket"
                                              : nullptr;
  if (kind == nullptr) return false;
  if (seen.st_uid != ::geteuid()) {
    log().warn("lock file {} is a {} of another user; it is left in place", path, kind);
    return false;
  }
  if (test_hooks().before_lock_path_removal) test_hooks().before_lock_path_removal(path);
  std::string dest;
  const int error = remove_if_unchanged(path, seen, [&] {
    if (type == S_IFDIR) return move_to_quarantine(path, &dest);
    return ::unlink(path.c_str()) == 0 ? 0 : errno;
  });
  if (error == kPathChanged) return true;  // another process cleared it first
  if (error != 0) {
    log().warn("lock file {} is a {} and cannot be {}: {}", path, kind,
               type == S_IFDIR ? "moved to quarantine/" : "removed", errno_text(error));
    return false;
  }
  const auto level = warn ? spdlog::level::warn : spdlog::level::debug;
  if (type == S_IFDIR) {
    log().log(level,
              "lock file {} was a directory; moved to {} so a lock file can take its place (gc "
              "removes files only: remove it by hand)",
              path, dest);
  } else {
    log().log(level, "lock file {} was a {} (never followed); removed it{}", path, kind,
              type == S_IFLNK ? ", its target untouched" : "");
  }
  return true;
}

int DiskCache::stores_paused() const {
  const int off = stores_off_.load();
  return off != 0 && steady_ms() < stores_paused_until_ms_.load() ? off : 0;
}

bool DiskCache::store(const Entry& entry, std::string* why_not) const {
  const std::string& key = entry.manifest.key;
  const std::string path = entry_path(key);
  std::string unused;
  if (why_not == nullptr) why_not = &unused;
  if (mode_ != CacheMode::kReadWrite) {
    *why_not = std::string("the cache is ") + mode_name(mode_) +
               (mode_reason_.empty() ? "" : " (" + mode_reason_ + ")");
    return false;
  }
  if (const int off = stores_paused(); off != 0) {
    *why_not = "a store in this process failed less than " + std::to_string(kStoresPauseSeconds) +
               " s ago: " + errno_text(off);
    return false;
  }
  // Logs a failed store at warn and returns false. A full disk or quota, or a read-only mount
  // (`error`), would fail the next stores the same way: it pauses stores and locks for
  // kStoresPauseSeconds, which its warning says (one warning per pause).
  const auto refuse = [&](const std::string& what, int error) {
    *why_not = what + (error != 0 ? ": " + errno_text(error) : std::string());
    if (error == ENOSPC || error == EDQUOT || error == EROFS) {
      const int64_t until = steady_ms() + int64_t{kStoresPauseSeconds} * 1000;
      stores_paused_until_ms_.store(until);
      if (stores_off_.exchange(error) == 0) {
        log().warn(
            "cache entry {} not stored: {}; for the next {} s this process stores no entries in "
            "{} and takes no compile locks there (cached entries are still loaded)",
            path, *why_not, kStoresPauseSeconds, dir_);
      }
      return false;
    }
    log().warn("cache entry {} not stored: {}", path, *why_not);
    return false;
  };

  if (std::string why = elf_image_problem(entry.cubin); !why.empty()) {
    return refuse("its cubin is not a whole ELF image: " + why, 0);
  }
  Manifest manifest = entry.manifest;
  // Why: JSON has no NaN or infinity (dump() writes null, which no reader takes as a number).
  if (!std::isfinite(manifest.compile_ms)) manifest.compile_ms = 0;
  const Digest cubin_digest = hash_bytes(entry.cubin);
  manifest.cubin_size = entry.cubin.size();
  manifest.cubin_hash = cubin_digest.hex();
  if (manifest.created_unix == 0) manifest.created_unix = now_unix();
  const std::string manifest_text = manifest_to_json(manifest);
  if (manifest_text.size() > kMaxManifestBytes || entry.cubin.size() > kMaxCubinBytes) {
    return refuse("its manifest (" + std::to_string(manifest_text.size()) + " bytes) or cubin (" +
                      std::to_string(entry.cubin.size()) + " bytes) is larger than a reader " +
                      "accepts (" + std::to_string(kMaxManifestBytes) + " and " +
                      std::to_string(kMaxCubinBytes) + " bytes)",
                  0);
  }
  const Digest manifest_digest = hash_bytes(manifest_text);

  unsigned char header[kHeaderSize] = {};
  std::memcpy(header, kMagic, sizeof(kMagic));
  put_u32(header + kOffVersion, static_cast<uint32_t>(kCacheSchemaVersion));
  put_u32(header + kOffHeaderSize, static_cast<uint32_t>(kHeaderSize));
  put_u64(header + kOffManifestLength, manifest_text.size());
  put_u64(header + kOffCubinLength, entry.cubin.size());
  put_u64(header + kOffCubinDigest, cubin_digest.high);
  put_u64(header + kOffCubinDigest + 8, cubin_digest.low);
  put_u64(header + kOffManifestDigest, manifest_digest.high);
  put_u64(header + kOffManifestDigest + 8, manifest_digest.low);

  const std::string shard = version_dir_ + "/" + key.substr(0, 2);
  bool shard_created = false;
  if (int e = ensure_dir(shard, &shard_created); e != 0) {
    return refuse("cannot create " + shard, e);
  }
  struct stat shard_st {};
  if (::lstat(shard.c_str(), &shard_st) == 0) {
    if (std::string why = distrust_reason(shard_st); !why.empty()) {
      return refuse(shard + " is " + why, 0);
    }
  }

  std::string temp;
  int raw_fd = -1;
  for (int attempt = 0; attempt < 4 && raw_fd < 0; ++attempt) {
    temp = temp_path(shard, key);
    raw_fd = open_file(temp, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW, 0600);
    if (raw_fd < 0 && errno != EEXIST) {
      const int error = errno;
      return refuse("cannot create " + temp, error);
    }
  }
  if (raw_fd < 0) return refuse("every temp name tried was taken", 0);
  Fd fd(raw_fd);

  auto fail = [&](const char* step, int error) {
    fd.reset();
    ::unlink(temp.c_str());
    return refuse(std::string(step) + " " + temp + " failed", error);
  };
  if (int e = test_hooks().write_error; e != 0) return fail("writing", e);
  if (int e =
          write_all(fd.get(), std::string_view(reinterpret_cast<const char*>(header), kHeaderSize));
      e != 0) {
    return fail("writing", e);
  }
  if (int e = write_all(fd.get(), manifest_text); e != 0) {
    return fail("writing", e);
  }
  if (int e = write_all(fd.get(), entry.cubin); e != 0) {
    return fail("writing", e);
  }
  if (::fsync(fd.get()) != 0) return fail("fsync of", errno);
  if (::close(fd.release()) != 0) return fail("closing", errno);
  int published = ::rename(temp.c_str(), path.c_str()) == 0 ? 0 : errno;
  // Why: a directory at the entry's path (rename's EISDIR; ENOTEMPTY or EEXIST where the
  // filesystem says so) would turn away every store of this key, and the key would compile in
  // every process from then on. A FIFO, socket or symlink there is replaced by the rename. The
  // second try also covers another process's store having moved the directory first.
  if (published == EISDIR || published == ENOTEMPTY || published == EEXIST) {
    move_directory_aside(path);
    published = ::rename(temp.c_str(), path.c_str()) == 0 ? 0 : errno;
  }
  if (published != 0) {
    ::unlink(temp.c_str());
    return refuse("rename from " + temp + " failed", published);
  }
  // Why: the rename is durable only once the directory itself is synced, and a shard made just
  // now only once its parent is.
  for (const std::string& dir : {shard, shard_created ? version_dir_ : std::string()}) {
    if (dir.empty()) continue;
    Fd dir_fd(open_file(dir, O_RDONLY | O_DIRECTORY));
    if (!dir_fd.ok() || ::fsync(dir_fd.get()) != 0) {
      log().debug("cache entry {} published, but syncing {} failed: {}", path, dir,
                  errno_text(errno));
    }
  }
  log().debug("cache stored {} ({} bytes of cubin)", path, entry.cubin.size());
  if (const int was = stores_off_.exchange(0); was != 0) {
    log().info("cache {}: stores resumed ({} is past)", dir_, errno_text(was));
  }
  return true;
}

// ---- Lock ----

DiskCache::Lock::Lock(int fd, bool holder_failed)
    : fd_(fd), owner_generation_(fork_generation()), holder_failed_(holder_failed) {}

DiskCache::Lock::Lock(Lock&& other) noexcept
    : fd_(other.fd_),
      owner_generation_(other.owner_generation_),
      holder_failed_(other.holder_failed_) {
  other.fd_ = -1;
}

DiskCache::Lock& DiskCache::Lock::operator=(Lock&& other) noexcept {
  if (this != &other) {
    release();
    fd_ = other.fd_;
    owner_generation_ = other.owner_generation_;
    holder_failed_ = other.holder_failed_;
    other.fd_ = -1;
  }
  return *this;
}

DiskCache::Lock::~Lock() { release(); }

void DiskCache::Lock::mark_failed() const noexcept {
  if (fd_ >= 0 && fork_generation() == owner_generation_) (void)::ftruncate(fd_, 1);
}

void DiskCache::Lock::release() noexcept {
  if (fd_ < 0) return;
  // Why LOCK_UN before close: a flock belongs to the open file description, which a child forked
  // without exec shares; closing only our descriptor would leave the lock held for as long as
  // that child lives. Only the taker unlocks, so such a child closing its copy takes nothing away
  // from the parent.
  if (fork_generation() == owner_generation_) ::flock(fd_, LOCK_UN);
  ::close(fd_);
  fd_ = -1;
}

DiskCache::Lock DiskCache::lock(const std::string& key, std::optional<Entry>* published,
                                std::chrono::milliseconds max_wait) const {
  using Clock = std::chrono::steady_clock;
  MOEJIT_CHECK(is_cache_key(key), ErrorCode::kInvalidArgument,
               "malformed cache key '" << key << "': expected 32 lowercase hex digits");
  // Why not after a store failed for lack of space or a read-only mount: the lock serves a
  // publish, and none can happen.
  if (mode_ != CacheMode::kReadWrite || stores_paused() != 0) return Lock();
  const std::string lock_path = dir_ + "/locks/" + key + ".lock";
  if (int e = ensure_dir(dir_ + "/locks"); e != 0) {
    log().warn("cannot lock {}: cannot create {}/locks: {}; compiling without the "
               "inter-process lock",
               key, dir_, errno_text(e));
    return Lock();
  }
  const std::string path = entry_path(key);
  const Clock::time_point deadline = Clock::now() + max_wait;
  std::chrono::milliseconds pause(1);
  // The entry file load() last refused (device, inode, mtime), so a bad file is not loaded (and
  // logged) again on every poll. Why not a file load() found gone: gc may move an entry away and
  // back between the lstat below and the load; skipping the holder's good entry after that would
  // leave it unseen for the rest of the wait.
  struct stat rejected {};
  // Whether the holder has published the entry; loads it into *published if so.
  auto take_published = [&]() {
    struct stat st {};
    if (published == nullptr || ::lstat(path.c_str(), &st) != 0) return false;
    if (st.st_dev == rejected.st_dev && st.st_ino == rejected.st_ino &&
        st.st_mtim.tv_sec == rejected.st_mtim.tv_sec &&
        st.st_mtim.tv_nsec == rejected.st_mtim.tv_nsec) {
      return false;
    }
    bool refused = false;
    if (test_hooks().before_published_load) test_hooks().before_published_load(path);
    *published = load(key, refused);
    if (test_hooks().after_published_load) test_hooks().after_published_load(path);
    if (!published->has_value() && refused) rejected = st;
    return published->has_value();
  };

  bool waited = false;   // another holder had the lock when it was first tried
  bool cleared = false;  // a file in the lock's way was cleared (warned once a lock())
  // Why: gc may unlink an idle lock file; a lock taken on the unlinked inode would exclude no
  // one, so after flock the path must still name the locked file, else try again.
  for (int attempt = 0; attempt < 100; ++attempt) {
    Fd fd(open_file(lock_path, O_RDWR | O_CREAT | O_NOFOLLOW, 0600));
    if (!fd.ok()) {
      const int error = errno;
      // Why: a symlink (ELOOP under O_NOFOLLOW), a directory or a socket (ENXIO) at the lock path
      // would make every compile of this key run without the lock from then on. Cleared, then
      // tried again; the attempt bound ends it should another process keep planting one.
      if ((error == ELOOP || error == EISDIR || error == ENXIO) &&
          clear_lock_path(lock_path, /*warn=*/!cleared)) {
        cleared = true;
        continue;
      }
      log().warn("cannot open lock file {}: {}; compiling without the inter-process lock",
                 lock_path, errno_text(error));
      return Lock();
    }
    // Why: a lock file someone else could write (made by another user in a locks directory they
    // can write) lets them hold every compile of the key for the full wait.
    struct stat opened {};
    if (::fstat(fd.get(), &opened) == 0) {
      if (std::string why = distrust_reason(opened); !why.empty()) {
        log().warn(
            "not waiting on lock file {}: it is {}; compiling without the inter-process "
            "lock",
            lock_path, why);
        return Lock();
      }
    }
    // Why not a blocking flock: a holder that never releases (stopped, hung, or a forked child
    // that inherited the lock) would block every later process forever, even once the entry it
    // was building is on disk.
    while (::flock(fd.get(), LOCK_EX | LOCK_NB) != 0) {
      const int error = errno;
      if (error == EINTR) continue;
      if (error != EWOULDBLOCK) {
        log().warn("cannot lock {}: {}; compiling without the inter-process lock", lock_path,
                   errno_text(error));
        return Lock();
      }
      if (!waited && test_hooks().lock_waiting) test_hooks().lock_waiting();
      waited = true;
      if (take_published()) {
        log().debug("cache entry {} published by the lock holder while waiting for {}", path,
                    lock_path);
        return Lock();
      }
      const Clock::time_point now = Clock::now();
      if (now >= deadline) {
        log().warn(
            "waited {} ms for {}, still held by another process (stopped or hung, or a "
            "child forked while it was held); compiling {} without the inter-process "
            "lock (a second compile of it is harmless: publishing is atomic)",
            max_wait.count(), lock_path, key);
        return Lock();
      }
      std::this_thread::sleep_for(std::min<Clock::duration>(pause, deadline - now));
      pause = std::min(pause * 2, std::chrono::milliseconds(50));
    }
    struct stat held {}, at_path {};
    if (::fstat(fd.get(), &held) == 0 && ::stat(lock_path.c_str(), &at_path) == 0 &&
        held.st_dev == at_path.st_dev && held.st_ino == at_path.st_ino) {
      // A mark left by a holder this process did not wait for is old news: cleared, so the
      // waiters of this holder read only its own.
      const bool holder_failed = waited && held.st_size > 0;
      if (!holder_failed && held.st_size > 0) (void)::ftruncate(fd.get(), 0);
      return Lock(fd.release(), holder_failed);
    }
  }
  log().warn("cannot lock {}: the lock file keeps being replaced; compiling without the "
             "inter-process lock",
             lock_path);
  return Lock();
}

// ---- listing and maintenance ----

std::vector<EntryInfo> DiskCache::list(bool verify, std::vector<std::string>* unreadable) const {
  std::vector<EntryInfo> out;
  if (mode_ == CacheMode::kMemoryOnly) return out;
  std::vector<std::string> skipped;
  if (unreadable == nullptr) unreadable = &skipped;
  const char* what = verify ? "verify" : "list";
  for (const DirEntry& shard : read_dir_or_skip(version_dir_, what, unreadable)) {
    if (!S_ISDIR(shard.st.st_mode) || !is_shard_name(shard.name)) continue;
    const std::vector<DirEntry> files = read_dir_or_skip(shard.path, what, unreadable);
    for (const DirEntry& file : files) {
      std::string key;
      if (!is_entry_name(file.name, &key) || key.compare(0, 2, shard.name) != 0) continue;
      EntryInfo info;
      info.path = file.path;
      info.key = key;
      info.file_size = static_cast<uint64_t>(file.st.st_size);
      info.last_used_unix = static_cast<int64_t>(file.st.st_mtim.tv_sec);
      Fd fd(open_file(file.path, O_RDONLY | O_NOFOLLOW | O_NONBLOCK));
      struct stat st {};
      if (!fd.ok()) {
        if (errno == ENOENT) continue;  // removed since the directory was read
        info.problem = "cannot open: " + errno_text(errno);
      } else if (::fstat(fd.get(), &st) != 0) {
        info.problem = "cannot inspect: " + errno_text(errno);
      } else if (!S_ISREG(st.st_mode)) {
        info.problem = "not a regular file (ignored)";
      } else if (std::string why = distrust_reason(st); !why.empty()) {
        info.problem = "untrusted: " + why + " (ignored)";
      } else {
        info.file_size = static_cast<uint64_t>(st.st_size);
        info.last_used_unix = static_cast<int64_t>(st.st_mtim.tv_sec);
        Entry entry;
        ReadResult result = read_entry(fd.get(), info.file_size, key, verify, &entry);
        info.manifest = std::move(entry.manifest);
        info.problem = result.problem;
        if (!result.problem.empty() && verify && !result.io_error) {
          info.quarantined_to = quarantine(file.path, fd.get(), result.problem);
          if (!info.quarantined_to.empty()) info.problem += "; moved to " + info.quarantined_to;
        }
      }
      out.push_back(std::move(info));
    }
  }
  std::sort(out.begin(), out.end(),
            [](const EntryInfo& a, const EntryInfo& b) { return a.path < b.path; });
  return out;
}

GcReport DiskCache::gc(uint64_t max_bytes) const {
  MOEJIT_CHECK(removals_allowed(), ErrorCode::kCache,
               "cannot garbage-collect the cache at "
                   << dir_ << ": it is " << mode_name(mode_) << (mode_reason_.empty() ? "" : " (")
                   << mode_reason_ << (mode_reason_.empty() ? "" : ")"));
  const int64_t now = now_unix();
  const uid_t me = ::geteuid();
  GcReport report;

  struct Candidate {
    std::string path;
    uint64_t size;
    bool quarantined;
    int64_t mtime_sec;
    long mtime_nsec;
    dev_t dev;
    ino_t ino;
  };
  std::vector<Candidate> candidates;
  const auto remove_temp = [&](const DirEntry& file) {
    if (remove_stale_temp(file, me, now)) ++report.stale_temp_removed;
  };
  CacheWalk walk;
  walk.root_file = [&](const DirEntry& file) {
    if (S_ISREG(file.st.st_mode) && file.st.st_uid == me && is_old_toolkit_stamp(file.name) &&
        ::unlink(file.path.c_str()) == 0) {
      ++report.stale_temp_removed;
    } else if (is_old_stamp_temp(file.name)) {
      remove_temp(file);  // older builds wrote their toolkit stamps' temp files here
    }
  };
  walk.version_file = remove_temp;
  walk.shard_file = [&](const DirEntry& file, bool entry) {
    // Why: never remove other users' files, whatever they are.
    if (!S_ISREG(file.st.st_mode) || file.st.st_uid != me) return;
    if (!entry) {
      remove_temp(file);
      return;
    }
    candidates.push_back({file.path, static_cast<uint64_t>(file.st.st_size), false,
                          static_cast<int64_t>(file.st.st_mtim.tv_sec), file.st.st_mtim.tv_nsec,
                          file.st.st_dev, file.st.st_ino});
  };
  walk.quarantined = [&](const DirEntry& file) {
    if (!S_ISREG(file.st.st_mode) || file.st.st_uid != me || !is_quarantined_name(file.name)) {
      return;
    }
    const uint64_t size = static_cast<uint64_t>(file.st.st_size);
    if (age_seconds(file.st, now) > kQuarantineKeepSeconds && ::unlink(file.path.c_str()) == 0) {
      report.bytes_before += size;
      ++report.removed;
      return;
    }
    candidates.push_back({file.path, size, true, static_cast<int64_t>(file.st.st_mtim.tv_sec),
                          file.st.st_mtim.tv_nsec, file.st.st_dev, file.st.st_ino});
  };
  walk.lock_file = [&](const DirEntry& file) { remove_idle_lock(file, me, now); };
  walk_cache(dir_, "gc", walk, &report.unreadable);

  uint64_t total = 0;
  for (const Candidate& c : candidates) total += c.size;
  report.bytes_before += total;
  // Quarantined files go first, then entries from the least recently used.
  std::sort(candidates.begin(), candidates.end(), [](const Candidate& a, const Candidate& b) {
    if (a.quarantined != b.quarantined) return a.quarantined;
    if (a.mtime_sec != b.mtime_sec) return a.mtime_sec < b.mtime_sec;
    if (a.mtime_nsec != b.mtime_nsec) return a.mtime_nsec < b.mtime_nsec;
    return a.path < b.path;
  });
  // Whether `st` is the file scanned as `c`, as it was then (not used since).
  const auto as_scanned = [](const Candidate& c, const struct stat& st) {
    return st.st_dev == c.dev && st.st_ino == c.ino && st.st_mtim.tv_sec == c.mtime_sec &&
           st.st_mtim.tv_nsec == c.mtime_nsec;
  };
  // The file scanned as `c` has left the total; `instead`, found at its path (when given), joins
  // it if it is this user's regular file.
  const auto replaced = [&](const Candidate& c, const struct stat* instead) {
    total -= c.size;
    if (instead != nullptr && S_ISREG(instead->st_mode) && instead->st_uid == me) {
      total += static_cast<uint64_t>(instead->st_size);
    }
  };
  // Removes `file` (c's file, at its path or moved away) and counts it; one already gone leaves
  // the total uncounted; `note` follows the file's name in a failure's warning.
  const auto remove_counted = [&](const Candidate& c, const std::string& file,
                                  const std::string& note) {
    if (::unlink(file.c_str()) == 0) {
      total -= c.size;
      ++report.removed;
    } else if (errno == ENOENT) {
      total -= c.size;
    } else {
      log().warn("cache gc: cannot remove {}{}: {}", file, note, errno_text(errno));
    }
  };
  if (test_hooks().after_gc_scan) test_hooks().after_gc_scan();
  for (const Candidate& c : candidates) {
    if (total <= max_bytes) break;
    // Why look again: since the scan another process may have published a fresh entry at this
    // path, used it (load() sets the mtime) or removed it (another gc). Only a file still as it
    // was scanned is removed; one removed by someone else leaves the total without being
    // counted.
    struct stat st {};
    if (::lstat(c.path.c_str(), &st) != 0) {
      if (errno == ENOENT) {
        total -= c.size;
      } else {
        log().warn("cache gc: cannot inspect {}: {}", c.path, errno_text(errno));
      }
      continue;
    }
    if (!as_scanned(c, st)) {
      replaced(c, &st);
      continue;
    }
    if (test_hooks().before_gc_removal) test_hooks().before_gc_removal(c.path);
    // Why a plain unlink for a quarantined file: nothing is ever published at its name (each
    // quarantine makes a new one), so no other file can have taken its place since the look.
    if (c.quarantined) {
      remove_counted(c, c.path, "");
      continue;
    }
    // Why move the entry away first: a fresh entry published at the path between the look above
    // and an unlink of the path would be lost (and rebuilt). The rename takes whatever is at the
    // path to a temp name in the same directory, which is removed only if it is the file scanned;
    // anything else goes back (a reader looking meanwhile misses, as it would while the entry is
    // rebuilt). A gc killed in between leaves a temp file that a later gc removes as stale.
    const std::size_t slash = c.path.rfind('/');
    const std::string away = temp_path(c.path.substr(0, slash), c.path.substr(slash + 1) + ".gc");
    int renamed = test_hooks().gc_rename_error;
    if (renamed == 0 && ::rename(c.path.c_str(), away.c_str()) != 0) renamed = errno;
    if (renamed == ENOENT) {
      total -= c.size;
      continue;
    }
    if (renamed != 0) {
      // Why unlink the path after all: a rename adds a directory entry before it drops one,
      // which a full disk or quota can refuse (ENOSPC, EDQUOT) where an unlink still frees the
      // entry's space, and freeing space is what gc is for. The instant the rename closes is
      // open again for this entry.
      remove_counted(c, c.path, " (nor move it away: " + errno_text(renamed) + ")");
      continue;
    }
    struct stat moved {};
    if (::lstat(away.c_str(), &moved) != 0) {
      // Gone already: another gc took it for a stale temp file (the file scanned may be that old).
      if (errno != ENOENT) {
        log().warn("cache gc: cannot inspect {} (moved from {}): {}", away, c.path,
                   errno_text(errno));
      }
      total -= c.size;
      continue;
    }
    if (as_scanned(c, moved)) {
      remove_counted(c, away, " (moved from " + c.path + ")");
      continue;
    }
    // A fresh entry published at the path, or the entry used, since the look: it goes back, unless
    // a newer entry has taken the path since the rename (EEXIST: the one moved is removed, and
    // the newer one counts instead).
    const int error = move_back_unless_taken(away, c.path);
    if (error == 0) {
      replaced(c, &moved);
    } else if (error == EEXIST) {
      struct stat at_path {};
      replaced(c, ::lstat(c.path.c_str(), &at_path) == 0 ? &at_path : nullptr);
    } else {
      // ENOENT: the moved file is gone already (another process removed it): nothing goes back.
      if (error != ENOENT) {
        log().warn(
            "cache gc: the entry published at {} or used since its scan could not be moved "
            "back from {}: {}; removed, it will be rebuilt",
            c.path, away, errno_text(error));
        ::unlink(away.c_str());
      }
      total -= c.size;
    }
  }
  report.bytes_after = total;
  log().debug("cache gc {}: {} -> {} bytes, {} removed, {} stale temp files removed", dir_,
              report.bytes_before, report.bytes_after, report.removed,
              report.stale_temp_removed);
  return report;
}

ClearReport DiskCache::clear() const {
  MOEJIT_CHECK(removals_allowed(), ErrorCode::kCache,
               "cannot clear the cache at " << dir_ << ": it is " << mode_name(mode_)
                                            << (mode_reason_.empty() ? "" : " (") << mode_reason_
                                            << (mode_reason_.empty() ? "" : ")"));
  const uid_t me = ::geteuid();
  const int64_t now = now_unix();
  ClearReport report;
  auto remove = [&](const DirEntry& file) {
    if (!S_ISREG(file.st.st_mode) || file.st.st_uid != me) return;
    if (::unlink(file.path.c_str()) == 0) {
      ++report.removed;
    } else if (errno != ENOENT) {
      ++report.not_removed;
      log().warn("cache clear: cannot remove {}: {}", file.path, errno_text(errno));
    }
  };
  // What gc would also take goes too (temp files of writers taken for dead, idle lock files), so
  // a cleared cache holds nothing of this user's that a later gc would remove.
  const auto remove_temp = [&](const DirEntry& file) {
    if (remove_stale_temp(file, me, now)) ++report.stale_temp_removed;
  };
  CacheWalk walk;
  walk.root_file = [&](const DirEntry& file) {
    if (is_old_toolkit_stamp(file.name)) {
      remove(file);
    } else if (is_old_stamp_temp(file.name)) {
      remove_temp(file);
    }
  };
  walk.version_file = remove_temp;
  walk.shard_file = [&](const DirEntry& file, bool entry) {
    if (entry) {
      remove(file);
    } else {
      remove_temp(file);
    }
  };
  walk.quarantined = [&](const DirEntry& file) {
    if (is_quarantined_name(file.name)) remove(file);
  };
  walk.lock_file = [&](const DirEntry& file) { remove_idle_lock(file, me, now); };
  walk_cache(dir_, "clear", walk, &report.unreadable);
  return report;
}

}  // namespace moejit::detail
