// NVRTC: find the toolkit headers, fingerprint them, and compile one generated source to a cubin.
#include "compile/nvrtc.hpp"

#include <dlfcn.h>
#include <fcntl.h>
#include <nvrtc.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <sstream>
#include <string_view>
#include <system_error>
#include <utility>

#include "cache/file_io.hpp"
#include "codegen/embedded.hpp"
#include "common/check.hpp"
#include "common/env.hpp"
#include "common/hash.hpp"
#include "common/log.hpp"
#include "compile/cubin_check.hpp"
#include "moejit/error.hpp"

// MOEJIT_NVRTC_CHECK(call): an NVRTC API call that must succeed (not a compile: compile() reads
// nvrtcCompileProgram's result itself and throws CompileError).
#define MOEJIT_NVRTC_CHECK(call)                                                                \
  do {                                                                                          \
    const nvrtcResult moejit_nvrtc_result_ = (call);                                            \
    MOEJIT_CHECK(moejit_nvrtc_result_ == NVRTC_SUCCESS, ::moejit::ErrorCode::kCompileFailed,    \
                 "NVRTC call " #call " failed: " << nvrtcGetErrorString(moejit_nvrtc_result_)); \
  } while (0)

namespace moejit::detail {

namespace fs = std::filesystem;

namespace {

constexpr const char* kProbeHeader = "cuda_bf16.h";
constexpr const char* kProbeCccl = "cuda/std/cstdint";
constexpr const char* kEmbeddedPrefix = "moejit/kern/";
constexpr std::size_t kLogLinesInMessage = 20;

const char* const kHowToFix =
    "set MOEJIT_CUDA_INCLUDE to the toolkit's include directory (the one holding cuda_bf16.h), "
    "or CUDA_HOME to the toolkit root, or RuntimeConfig::cuda_include_dir";

bool is_file(const fs::path& path) {
  std::error_code ec;
  return fs::is_regular_file(path, ec);
}

bool is_dir(const fs::path& path) {
  std::error_code ec;
  return fs::is_directory(path, ec);
}

// "" when `path` is of type `want` (symlinks followed), else what it is instead. Why the
// error_code overload: a candidate that can't be examined (EACCES on a parent, a symlink loop)
// must be reported as that candidate's problem, not end the whole search with an exception.
std::string type_problem(const fs::path& path, fs::file_type want) {
  std::error_code ec;
  const fs::file_status status = fs::status(path, ec);
  if (status.type() == want) return "";
  if (status.type() == fs::file_type::not_found) return "does not exist";
  if (ec) return "cannot be examined (" + ec.message() + ")";
  return want == fs::file_type::directory ? "is not a directory" : "is not a regular file";
}

// Why: symlinked prefixes (/usr/local/cuda -> cuda-13.0) must not make one file two files.
fs::path canonical_or_self(const fs::path& path) {
  std::error_code ec;
  fs::path out = fs::weakly_canonical(path, ec);
  return ec ? path.lexically_normal() : out;
}

std::optional<std::string> read_file(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return std::nullopt;
  std::ostringstream os;
  os << in.rdbuf();
  if (in.bad()) return std::nullopt;
  return os.str();
}

// The include directories of a candidate, or why it does not qualify.
struct Probe {
  std::vector<std::string> include_dirs;
  std::string problem;  // "" when the candidate qualifies
};

Probe probe(const std::string& dir) {
  Probe out;
  const fs::path root(dir);
  out.problem = type_problem(root, fs::file_type::directory);
  if (!out.problem.empty()) return out;
  const fs::path header = root / kProbeHeader;
  out.problem = type_problem(header, fs::file_type::regular);
  if (out.problem == "does not exist") {
    out.problem = std::string("has no ") + kProbeHeader;
    return out;
  }
  if (!out.problem.empty()) {
    out.problem = header.string() + " " + out.problem;
    return out;
  }
  const fs::path base = canonical_or_self(root);
  std::string unusable;  // CCCL candidates that exist but could not be used, and why
  for (const fs::path& cccl_dir : {base, base / "cccl"}) {
    const fs::path cccl = cccl_dir / kProbeCccl;
    const std::string problem = type_problem(cccl, fs::file_type::regular);
    if (problem.empty()) {
      out.include_dirs.push_back(base.string());
      if (cccl_dir != base) out.include_dirs.push_back(cccl_dir.string());
      return out;
    }
    if (problem != "does not exist") unusable += "; " + cccl.string() + " " + problem;
  }
  out.problem = std::string("has ") + kProbeHeader + " but no " + kProbeCccl + " (looked in " +
                base.string() + " and " + (base / "cccl").string() + ")" + unusable;
  return out;
}

}  // namespace

std::vector<std::string> versioned_toolkit_includes(const std::string& parent) {
  std::vector<std::pair<std::vector<int>, std::string>> found;
  std::error_code ec;
  for (fs::directory_iterator it(parent, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    if (name.rfind("cuda-", 0) != 0) continue;
    std::vector<int> version;
    std::istringstream parts(name.substr(5));
    std::string part;
    bool numeric = true;
    while (std::getline(parts, part, '.')) {
      if (part.empty() || part.find_first_not_of("0123456789") != std::string::npos) {
        numeric = false;
        break;
      }
      int number = 0;
      const auto [stop, error] = std::from_chars(part.data(), part.data() + part.size(), number);
      // Why skipped, not thrown: a name like cuda-99999999999 is no toolkit worth failing for.
      if (error != std::errc() || stop != part.data() + part.size()) {
        numeric = false;
        break;
      }
      version.push_back(number);
    }
    if (!numeric || version.empty()) continue;
    found.emplace_back(std::move(version), (it->path() / "include").string());
  }
  std::sort(found.begin(), found.end(), [](const auto& a, const auto& b) {
    return a.first != b.first ? a.first > b.first : a.second < b.second;
  });
  std::vector<std::string> out;
  for (auto& entry : found) out.push_back(std::move(entry.second));
  return out;
}

namespace {

// One `#include` directive found in a file.
struct IncludeRef {
  std::string name;
  bool quoted;
};

// The #include / #include_next directives of `text` with a literal <name> or "name". Conditional
// compilation is not evaluated: every branch counts, so the set is a superset of what a compile
// reads, which is what a cache key wants.
std::vector<IncludeRef> scan_includes(std::string_view text) {
  std::vector<IncludeRef> out;
  std::size_t pos = 0;
  while (pos < text.size()) {
    std::size_t end = text.find('\n', pos);
    if (end == std::string_view::npos) end = text.size();
    std::string_view line = text.substr(pos, end - pos);
    pos = end + 1;
    std::size_t i = line.find_first_not_of(" \t");
    if (i == std::string_view::npos || line[i] != '#') continue;
    i = line.find_first_not_of(" \t", i + 1);
    if (i == std::string_view::npos || line.compare(i, 7, "include") != 0) continue;
    i += 7;
    if (line.compare(i, 5, "_next") == 0) i += 5;
    i = line.find_first_not_of(" \t", i);
    if (i == std::string_view::npos) continue;
    const char open = line[i];
    const char close = open == '<' ? '>' : open == '"' ? '"' : '\0';
    if (close == '\0') continue;  // a macro-named include: nothing literal to follow
    const std::size_t stop = line.find(close, i + 1);
    if (stop == std::string_view::npos || stop == i + 1) continue;
    out.push_back(IncludeRef{std::string(line.substr(i + 1, stop - i - 1)), open == '"'});
  }
  return out;
}

// The include name of `file`: its path relative to the deepest include directory holding it.
std::string include_name(const fs::path& file, const std::vector<std::string>& dirs) {
  std::string best;
  std::size_t best_depth = 0;
  for (const std::string& dir : dirs) {
    const fs::path rel = file.lexically_relative(dir);
    if (rel.empty() || *rel.begin() == "..") continue;
    if (best.empty() || dir.size() > best_depth) {
      best = rel.generic_string();
      best_depth = dir.size();
    }
  }
  if (best.empty()) best = file.lexically_relative(dirs.front()).generic_string();
  return best;
}

// Walk every toolkit file the embedded headers can reach and hash (include name, content) of
// each, in include-name order; names that resolve nowhere are hashed as missing.
// What fingerprint() looked at, so a later process can tell cheaply whether it would see the
// same: every file it read (with its stat) and every include candidate that did not exist.
struct Probes {
  struct Seen {
    std::string path;
    int64_t size = 0;
    int64_t mtime_ns = 0;
    int64_t inode = 0;
  };
  std::vector<Seen> read;
  std::set<std::string> absent;
};

std::optional<Probes::Seen> stat_file(const std::string& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0 || !S_ISREG(st.st_mode)) return std::nullopt;
  return Probes::Seen{path, static_cast<int64_t>(st.st_size),
                      static_cast<int64_t>(st.st_mtim.tv_sec) * 1000000000 + st.st_mtim.tv_nsec,
                      static_cast<int64_t>(st.st_ino)};
}

// What a stamp keeps of the absent include candidates. Why directories: a candidate can only
// appear by an entry being created in (or renamed into) its deepest existing ancestor
// directory, which changes that directory's mtime, and a directory replaced or a symlink on the
// way retargeted changes the inode stat reports. So one stat of each guard directory (two for
// CUDA 13's 62 candidates) stands for one probe per candidate. Not trusted that way, so probed
// one by one as before: a candidate under a dangling symlink (its target could appear without
// any guard changing), and one whose guard was modified in the last few seconds (a file made
// within the same timestamp tick would not move the mtime).
struct AbsentGuards {
  std::map<std::string, Probes::Seen> dirs;  // guard directory -> its stat (size unused)
  std::vector<std::string> files;            // candidates probed one by one
};

std::optional<Probes::Seen> stat_dir(const std::string& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) return std::nullopt;
  return Probes::Seen{path, 0,
                      static_cast<int64_t>(st.st_mtim.tv_sec) * 1000000000 + st.st_mtim.tv_nsec,
                      static_cast<int64_t>(st.st_ino)};
}

AbsentGuards absent_guards(const std::set<std::string>& absent) {
  constexpr int64_t kFreshNs = 5'000'000'000;  // younger guard directories are not trusted
  const int64_t now_ns = std::chrono::duration_cast<std::chrono::nanoseconds>(
                             std::chrono::system_clock::now().time_since_epoch())
                             .count();
  // The deepest existing directory above `candidate` (through symlinks to directories), or
  // nullopt where a symlink on the way leads nowhere.
  auto guard_of = [](const std::string& candidate) -> std::optional<Probes::Seen> {
    for (fs::path dir = fs::path(candidate).parent_path(); !dir.empty(); dir = dir.parent_path()) {
      struct stat st {};
      if (::lstat(dir.c_str(), &st) == 0) {
        if (S_ISDIR(st.st_mode) || S_ISLNK(st.st_mode)) return stat_dir(dir.string());
        // A file on the way: the candidate needs it replaced, an entry change one level up.
      }
      if (dir == dir.root_path()) break;
    }
    return std::nullopt;
  };
  AbsentGuards out;
  for (const std::string& candidate : absent) {
    const std::optional<Probes::Seen> guard = guard_of(candidate);
    // Why probed again after the guard's stat: a candidate created since fingerprint() looked
    // must not be covered by a stat taken after its creation.
    if (guard && now_ns - guard->mtime_ns > kFreshNs && ::access(candidate.c_str(), F_OK) != 0) {
      out.dirs.emplace(guard->path, *guard);
    } else {
      out.files.push_back(candidate);
    }
  }
  return out;
}

void fingerprint(ToolkitHeaders& toolkit, Probes* probes) {
  std::vector<std::pair<fs::path, IncludeRef>> pending;  // (including file's dir, reference)
  for (const EmbeddedHeader& header : embedded_headers()) {
    for (IncludeRef& ref : scan_includes(header.content)) {
      if (ref.name.rfind(kEmbeddedPrefix, 0) == 0) continue;
      ref.quoted = false;  // an embedded header has no directory of its own
      pending.emplace_back(fs::path(), std::move(ref));
    }
  }
  std::map<std::string, std::string> files;  // include name -> content
  std::set<fs::path> seen;
  std::set<std::string> missing;
  while (!pending.empty()) {
    auto [from, ref] = std::move(pending.back());
    pending.pop_back();
    std::optional<fs::path> found;
    auto try_candidate = [&](const fs::path& candidate) {
      if (is_file(candidate)) {
        found = candidate;
      } else {
        probes->absent.insert(candidate.string());
      }
    };
    if (ref.quoted && !from.empty()) try_candidate(from / ref.name);
    for (std::size_t d = 0; !found && d < toolkit.include_dirs.size(); ++d) {
      try_candidate(fs::path(toolkit.include_dirs[d]) / ref.name);
    }
    if (!found) {
      missing.insert(ref.name);
      continue;
    }
    const fs::path file = canonical_or_self(*found);
    if (!seen.insert(file).second) continue;
    if (std::optional<Probes::Seen> seen_stat = stat_file(file.string())) {
      probes->read.push_back(*seen_stat);
    }
    std::optional<std::string> content = read_file(file);
    MOEJIT_CHECK(content.has_value(), ErrorCode::kIo,
                 "could not read toolkit header " << file.string()
                                                  << " while fingerprinting the CUDA headers; "
                                                  << "check its permissions");
    for (IncludeRef& next : scan_includes(*content)) {
      pending.emplace_back(file.parent_path(), std::move(next));
    }
    files.emplace(include_name(file, toolkit.include_dirs), std::move(*content));
  }
  Hasher hasher;
  hasher.field(std::string_view("moejit toolkit headers v1"));
  for (const auto& [name, content] : files) {
    hasher.field(name).field(content);
    toolkit.files.push_back(name);
  }
  for (const std::string& name : missing) hasher.field(std::string_view("missing")).field(name);
  toolkit.digest = hasher.digest();
}

// The digest of the embedded headers: the stamp is only valid for the kernels it was made from.
const std::string& embedded_digest() {
  static const std::string digest = [] {
    Hasher hasher;
    for (const EmbeddedHeader& header : embedded_headers()) {
      hasher.field(header.path).field(header.content);
    }
    return hasher.digest().hex();
  }();
  return digest;
}

fs::path stamp_path(const std::string& stamp_dir, const std::vector<std::string>& include_dirs) {
  Hasher hasher;
  hasher.field(embedded_digest());
  for (const std::string& dir : include_dirs) hasher.field(dir);
  return fs::path(stamp_dir) / ("toolkit-" + hasher.digest().hex() + ".json");
}

// The fingerprint from a stamp whose every recorded probe still holds, else nullopt.
std::optional<ToolkitHeaders> read_stamp(const fs::path& path,
                                         const std::vector<std::string>& include_dirs) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) return std::nullopt;
  const bool trusted_owner = st.st_uid == ::geteuid() || st.st_uid == 0;
  if (!trusted_owner || (st.st_mode & (S_IWGRP | S_IWOTH)) != 0) {
    log().warn("ignoring toolkit stamp {}: not owned by this user or writable by others", path.string());
    return std::nullopt;
  }
  std::optional<std::string> text = read_file(path);
  if (!text) return std::nullopt;
  try {
    const nlohmann::json stamp = nlohmann::json::parse(*text);
    if (stamp.at("embedded").get<std::string>() != embedded_digest() ||
        stamp.at("include_dirs").get<std::vector<std::string>>() != include_dirs) {
      return std::nullopt;
    }
    for (const nlohmann::json& seen : stamp.at("read")) {
      std::optional<Probes::Seen> now = stat_file(seen.at(0).get<std::string>());
      if (!now || now->size != seen.at(1).get<int64_t>() ||
          now->mtime_ns != seen.at(2).get<int64_t>() || now->inode != seen.at(3).get<int64_t>()) {
        return std::nullopt;
      }
    }
    for (const nlohmann::json& guard : stamp.at("absent_dirs")) {
      std::optional<Probes::Seen> now = stat_dir(guard.at(0).get<std::string>());
      if (!now || now->mtime_ns != guard.at(1).get<int64_t>() ||
          now->inode != guard.at(2).get<int64_t>()) {
        return std::nullopt;
      }
    }
    for (const nlohmann::json& absent : stamp.at("absent")) {
      if (::access(absent.get<std::string>().c_str(), F_OK) == 0) return std::nullopt;
    }
    ToolkitHeaders out;
    out.include_dirs = include_dirs;
    out.include_dir = include_dirs.front();
    out.files = stamp.at("files").get<std::vector<std::string>>();
    out.digest.high = std::stoull(stamp.at("digest").get<std::string>().substr(0, 16), nullptr, 16);
    out.digest.low = std::stoull(stamp.at("digest").get<std::string>().substr(16, 16), nullptr, 16);
    return out;
  } catch (const std::exception& e) {
    log().debug("toolkit stamp {} unusable ({}): fingerprinting the headers", path.string(), e.what());
    return std::nullopt;
  }
}

// Best effort: a stamp that can't be written only costs the next process a fingerprint.
void write_stamp(const fs::path& path, const ToolkitHeaders& toolkit, const Probes& probes) {
  nlohmann::json stamp;
  stamp["embedded"] = embedded_digest();
  stamp["include_dirs"] = toolkit.include_dirs;
  stamp["files"] = toolkit.files;
  stamp["digest"] = toolkit.digest.hex();
  nlohmann::json read = nlohmann::json::array();
  for (const Probes::Seen& seen : probes.read) {
    read.push_back(nlohmann::json::array({seen.path, seen.size, seen.mtime_ns, seen.inode}));
  }
  stamp["read"] = std::move(read);
  const AbsentGuards guards = absent_guards(probes.absent);
  nlohmann::json dirs = nlohmann::json::array();
  for (const auto& [dir, seen] : guards.dirs) {
    dirs.push_back(nlohmann::json::array({dir, seen.mtime_ns, seen.inode}));
  }
  stamp["absent_dirs"] = std::move(dirs);
  stamp["absent"] = guards.files;
  const std::string text = stamp.dump();
  // Why the random part: a writer killed mid-write leaves its temp file behind, and a later
  // process with the same pid (common in containers) would then never get past O_EXCL. Why a
  // leading dot and ".tmp": the cache's temp-file form, which `moejit gc` removes once stale.
  const std::string temp =
      (path.parent_path() / ("." + path.filename().string() + "." + std::to_string(::getpid()) +
                             "." + random_hex() + ".tmp"))
          .string();
  Fd fd(::open(temp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600));
  if (!fd.ok()) {
    log().debug("toolkit stamp {} not written: cannot create {}: {}", path.string(), temp,
                errno_text(errno));
    return;
  }
  std::string failed;
  if (int e = write_all(fd.get(), text); e != 0) {
    failed = "writing " + temp + " failed: " + errno_text(e);
  } else if (int c = fd.reset(); c != 0) {
    failed = "closing " + temp + " failed: " + errno_text(c);
  } else if (::rename(temp.c_str(), path.c_str()) != 0) {
    failed = "renaming " + temp + " failed: " + errno_text(errno);
  }
  if (!failed.empty()) {
    fd.reset();
    ::unlink(temp.c_str());
    log().debug("toolkit stamp {} not written: {}", path.string(), failed);
  }
}

ToolkitHeaders locate(const std::string& configured, const std::string& stamp_dir,
                      bool stamp_writable) {
  auto found = [&](Probe&& p) {
    ToolkitHeaders out;
    out.include_dir = p.include_dirs.front();
    out.include_dirs = std::move(p.include_dirs);
    const fs::path stamp = stamp_dir.empty() ? fs::path() : stamp_path(stamp_dir, out.include_dirs);
    if (!stamp.empty()) {
      if (std::optional<ToolkitHeaders> remembered = read_stamp(stamp, out.include_dirs)) {
        log().debug("CUDA headers: {} unchanged since {}", out.include_dir, stamp.string());
        return std::move(*remembered);
      }
    }
    Probes probes;
    fingerprint(out, &probes);
    if (!stamp.empty() && stamp_writable) write_stamp(stamp, out, probes);
    log().debug("CUDA headers: {} ({} files, digest {})", out.include_dir, out.files.size(),
                out.digest.hex());
    return out;
  };

  // The explicit settings: used as given, or an error naming them.
  const std::pair<std::optional<std::string>, const char*> explicit_settings[] = {
      {configured.empty() ? std::nullopt : std::optional<std::string>(configured),
       "RuntimeConfig::cuda_include_dir"},
      {env("MOEJIT_CUDA_INCLUDE"), "MOEJIT_CUDA_INCLUDE"},
  };
  for (const auto& [value, setting] : explicit_settings) {
    if (!value) continue;
    Probe p = probe(*value);
    MOEJIT_CHECK(p.problem.empty(), ErrorCode::kCompileFailed,
                 "CUDA headers not found: " << setting << " = " << *value << " " << p.problem
                                            << " (NVRTC needs " << kProbeHeader << " and "
                                            << kProbeCccl << " from the CUDA toolkit). Fix: point "
                                            << setting << " at the toolkit's include directory, "
                                            << "or unset it to search CUDA_HOME, CUDA_PATH and "
                                            << "the usual prefixes");
    return found(std::move(p));
  }

  std::vector<std::pair<std::string, std::string>> candidates;  // (path, where it came from)
  if (auto home = env("CUDA_HOME"))
    candidates.emplace_back(*home + "/include", "$CUDA_HOME/include");
  if (auto path = env("CUDA_PATH"))
    candidates.emplace_back(*path + "/include", "$CUDA_PATH/include");
  candidates.emplace_back("/usr/local/cuda/include", "default prefix");
  for (std::string& dir : versioned_toolkit_includes("/usr/local"))
    candidates.emplace_back(std::move(dir), "default prefix");
  candidates.emplace_back("/opt/cuda/include", "default prefix");
  candidates.emplace_back("/usr/include", "default prefix");

  std::ostringstream tried;
  for (const auto& [dir, origin] : candidates) {
    Probe p = probe(dir);
    if (p.problem.empty()) return found(std::move(p));
    tried << "\n  " << dir << " (" << origin << "): " << p.problem;
  }
  detail::throw_error(ErrorCode::kCompileFailed,
                      std::string("CUDA headers not found: NVRTC needs ") + kProbeHeader + " and " +
                          kProbeCccl + " from the CUDA toolkit. Tried:" + tried.str() +
                          "\nFix: " + kHowToFix);
}

// The archs this NVRTC can target (e.g. 75, 80, ..., 120), once per process.
const std::vector<int>& supported_archs() {
  static const std::vector<int> archs = [] {
    int count = 0;
    MOEJIT_NVRTC_CHECK(nvrtcGetNumSupportedArchs(&count));
    std::vector<int> out(static_cast<std::size_t>(count));
    if (count > 0) MOEJIT_NVRTC_CHECK(nvrtcGetSupportedArchs(out.data()));
    return out;
  }();
  return archs;
}

// Owns one nvrtcProgram.
class Program {
 public:
  Program(const GeneratedSource& src, const std::vector<const char*>& headers,
          const std::vector<const char*>& names) {
    MOEJIT_NVRTC_CHECK(nvrtcCreateProgram(&program_, src.source.c_str(), src.file_name.c_str(),
                                          static_cast<int>(headers.size()), headers.data(),
                                          names.data()));
  }
  ~Program() {
    if (program_ != nullptr) nvrtcDestroyProgram(&program_);
  }
  Program(const Program&) = delete;
  Program& operator=(const Program&) = delete;
  nvrtcProgram get() const { return program_; }

  std::string log() const {
    std::size_t size = 0;
    MOEJIT_NVRTC_CHECK(nvrtcGetProgramLogSize(program_, &size));
    std::string out(size, '\0');
    if (size > 0) MOEJIT_NVRTC_CHECK(nvrtcGetProgramLog(program_, out.data()));
    while (!out.empty() && (out.back() == '\0' || out.back() == '\n')) out.pop_back();
    return out;
  }

 private:
  nvrtcProgram program_ = nullptr;
};

// Create `dir` and any missing parents with mode 0700. Returns "" or why it failed.
std::string make_private_dirs(const fs::path& dir) {
  fs::path partial;
  for (const fs::path& part : dir) {
    partial /= part;
    if (partial.empty() || is_dir(partial)) continue;
    if (::mkdir(partial.c_str(), 0700) != 0 && errno != EEXIST) {
      return "cannot create " + partial.string() + ": " + std::strerror(errno);
    }
  }
  return is_dir(dir) ? "" : dir.string() + " is not a directory";
}

std::string join(const std::vector<std::string>& parts) {
  std::string out;
  for (const std::string& part : parts) {
    if (!out.empty()) out += ' ';
    out += part;
  }
  return out;
}

std::string kernel_label(const GeneratedSource& src) {
  const std::string& f = src.file_name;
  return f.size() > 3 && f.compare(f.size() - 3, 3, ".cu") == 0 ? f.substr(0, f.size() - 3) : f;
}

[[noreturn]] void throw_compile_error(const GeneratedSource& src, const std::string& what,
                                      const std::vector<std::string>& options,
                                      const std::string& log, const std::string& failure_dir) {
  std::string why_not_saved;
  const std::string saved = save_failed_source(src, failure_dir, &why_not_saved);
  std::ostringstream os;
  os << "NVRTC " << nvrtc_version() << " could not compile kernel " << kernel_label(src) << " ("
     << src.name_expression << "): " << what << "\n  options: " << join(options);
  std::istringstream lines(log);
  std::string line;
  std::size_t shown = 0;
  std::size_t total = 0;
  std::ostringstream head;
  while (std::getline(lines, line)) {
    ++total;
    if (shown < kLogLinesInMessage) {
      head << "\n    " << line;
      ++shown;
    }
  }
  if (total == 0) {
    os << "\n  log: (empty)";
  } else {
    os << "\n  log (" << shown << " of " << total
       << " lines; all in CompileError::log()):" << head.str();
  }
  if (!saved.empty()) {
    os << "\n  source saved to " << saved;
  } else {
    os << "\n  source not saved: " << why_not_saved;
  }
  os << "\n  If the log points into a toolkit header, check that the CUDA headers belong to NVRTC "
     << nvrtc_version() << " (" << kHowToFix << ").";
  throw CompileError(os.str(), kernel_label(src), options, log, saved);
}

}  // namespace

std::string save_failed_source(const GeneratedSource& src, const std::string& failure_dir,
                               std::string* why) {
  why->clear();
  if (failure_dir.empty()) {
    *why = "no failure directory configured";
    return "";
  }
  const std::string& name = src.file_name;
  if (name.empty() || name == "." || name == ".." || name.find('/') != std::string::npos) {
    *why = "the source's file name '" + name + "' is not a plain file name";
    return "";
  }
  *why = make_private_dirs(failure_dir);
  if (!why->empty()) return "";
  // Why: the directory may sit in shared space (/tmp) where another local user can create it
  // first, or plant a symlink in it, to have this user's process overwrite a file of their
  // choosing. So it is opened without following a symlink and used only when it is ours and
  // no one else can add or replace entries in it; every step after that is relative to the
  // opened directory, so the directory checked is the one written in. (O_PATH: openat, renameat
  // and fstat need no read permission on the directory.)
  Fd dir(::open(failure_dir.c_str(), O_PATH | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC));
  if (!dir.ok()) {
    const int error = errno;
    struct stat at_path {};
    if (::lstat(failure_dir.c_str(), &at_path) == 0 && S_ISLNK(at_path.st_mode)) {
      *why = failure_dir + " is a symbolic link; not following it (remove it)";
    } else {
      *why = "cannot open " + failure_dir + ": " + errno_text(error);
    }
    return "";
  }
  struct stat st {};
  if (::fstat(dir.get(), &st) != 0) {
    *why = "cannot inspect " + failure_dir + ": " + errno_text(errno);
    return "";
  }
  if (!S_ISDIR(st.st_mode)) {
    *why = failure_dir + " is not a directory (a symbolic link is not followed; remove it)";
    return "";
  }
  if (st.st_uid != ::geteuid()) {
    *why = failure_dir + " is owned by uid " + std::to_string(st.st_uid) +
           ", not by this user (uid " + std::to_string(::geteuid()) +
           "); its owner could redirect what is written there (remove it; it is then "
           "created again, private to this user)";
    return "";
  }
  if ((st.st_mode & (S_IWGRP | S_IWOTH)) != 0) {
    char mode[8];
    std::snprintf(mode, sizeof(mode), "%04o", static_cast<unsigned>(st.st_mode & 07777));
    *why = failure_dir + " is writable by group or others (mode " + mode +
           "), who could plant a link where the source would go (fix: chmod go-w it)";
    return "";
  }
  const std::string path = (fs::path(failure_dir) / name).string();
  const std::string temp =
      "." + name + "." + std::to_string(::getpid()) + "." + random_hex() + ".tmp";
  Fd out(::openat(dir.get(), temp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC,
                  0600));
  if (!out.ok()) {
    *why = "cannot create " + failure_dir + "/" + temp + ": " + errno_text(errno);
    return "";
  }
  // Why rename: it replaces whatever is at `name` (a planted symlink included) without
  // following it, and a reader never sees a half-written file.
  if (int e = write_all(out.get(), src.source); e != 0) {
    *why = "cannot write " + failure_dir + "/" + temp + ": " + errno_text(e);
  } else if (int c = out.reset(); c != 0) {
    *why = "cannot close " + failure_dir + "/" + temp + ": " + errno_text(c);
  } else if (::renameat(dir.get(), temp.c_str(), dir.get(), name.c_str()) != 0) {
    *why = "cannot rename " + failure_dir + "/" + temp + " to " + path + ": " + errno_text(errno);
  }
  if (!why->empty()) {
    out.reset();
    ::unlinkat(dir.get(), temp.c_str(), 0);
    return "";
  }
  return path;
}

ToolkitHeaders locate_toolkit_headers(const std::string& configured, const std::string& stamp_dir,
                                      bool stamp_writable) {
  return locate(configured, stamp_dir, stamp_writable);
}

const ToolkitHeaders& toolkit_headers(const std::string& configured, const std::string& stamp_dir,
                                      bool stamp_writable) {
  static std::mutex mutex;
  static std::map<std::string, std::unique_ptr<const ToolkitHeaders>> memo;
  // Why: keyed by every input of the search, so a changed environment is searched afresh. The
  // stamp directory is not part of it: a stamp only ever reproduces what fingerprint() computes.
  std::string key = configured;
  for (const char* name : {"MOEJIT_CUDA_INCLUDE", "CUDA_HOME", "CUDA_PATH"}) {
    key += '\0';
    key += env(name).value_or("");
  }
  std::lock_guard<std::mutex> lock(mutex);
  auto it = memo.find(key);
  if (it != memo.end()) return *it->second;
  auto made = std::make_unique<const ToolkitHeaders>(locate(configured, stamp_dir, stamp_writable));
  return *memo.emplace(key, std::move(made)).first->second;
}

std::string nvrtc_version() {
  int major = 0;
  int minor = 0;
  MOEJIT_NVRTC_CHECK(nvrtcVersion(&major, &minor));
  return std::to_string(major) + "." + std::to_string(minor);
}

const std::string& nvrtc_identity() {
  static const std::string identity = [] {
    std::string out = nvrtc_version();
    Dl_info info{};
    // Why nvrtcVersion's address: it lies in whichever NVRTC library this process loaded.
    if (::dladdr(reinterpret_cast<void*>(&nvrtcVersion), &info) == 0 || info.dli_fname == nullptr) {
      return out;
    }
    std::error_code ec;
    const fs::path file = fs::canonical(info.dli_fname, ec);
    if (ec) return out;
    const std::uintmax_t size = fs::file_size(file, ec);
    if (ec) return out;
    return out + " " + file.filename().string() + " " + std::to_string(size);
  }();
  return identity;
}

std::vector<std::string> compile_options(const Arch& arch, bool line_info) {
  // Why: no fast-math (the kernels' accuracy is argued from IEEE expf and division); -Xptxas=-v
  // puts the register and spill report in the log, kept with each cache entry; -default-device
  // makes the kernels' unannotated helpers device functions. -lineinfo only when asked for: it
  // maps SASS to source for profilers without changing an instruction, but quadruples the
  // warpgroup GEMMs' cubins (112 KB to 447 KB for one FC1), which every first request in a
  // process reads, hashes and loads (tools/PERF_LOG.md "line tables on request").
  std::vector<std::string> options{arch.nvrtc_option(), "-std=c++17", "-default-device",
                                   "-Xptxas=-v"};
  if (line_info) options.emplace_back("-lineinfo");
  return options;
}

namespace {

// One NVRTC run of `src` with `options` (include directories included).
CompiledKernel run_nvrtc(const GeneratedSource& src, const Arch& arch,
                         const std::vector<std::string>& options, const std::string& failure_dir) {
  // Why: std::string copies, so each header is NUL-terminated whatever the embedded table holds.
  std::vector<std::string> contents;
  std::vector<std::string> names;
  for (const EmbeddedHeader& header : embedded_headers()) {
    contents.emplace_back(header.content);
    names.emplace_back(header.path);
  }
  std::vector<const char*> content_ptrs;
  std::vector<const char*> name_ptrs;
  for (std::size_t i = 0; i < contents.size(); ++i) {
    content_ptrs.push_back(contents[i].c_str());
    name_ptrs.push_back(names[i].c_str());
  }
  Program program(src, content_ptrs, name_ptrs);
  MOEJIT_NVRTC_CHECK(nvrtcAddNameExpression(program.get(), src.name_expression.c_str()));

  std::vector<const char*> option_ptrs;
  for (const std::string& option : options) option_ptrs.push_back(option.c_str());
  const nvrtcResult result =
      nvrtcCompileProgram(program.get(), static_cast<int>(option_ptrs.size()), option_ptrs.data());
  CompiledKernel out;
  out.log = program.log();
  if (result != NVRTC_SUCCESS) {
    throw_compile_error(src, nvrtcGetErrorString(result), options, out.log, failure_dir);
  }

  const char* lowered = nullptr;
  MOEJIT_NVRTC_CHECK(nvrtcGetLoweredName(program.get(), src.name_expression.c_str(), &lowered));
  MOEJIT_CHECK(
      lowered != nullptr && *lowered != '\0', ErrorCode::kInternal,
      "NVRTC returned no lowered name for " << src.name_expression << " in " << src.file_name);
  out.lowered_name = lowered;

  std::size_t cubin_size = 0;
  MOEJIT_NVRTC_CHECK(nvrtcGetCUBINSize(program.get(), &cubin_size));
  MOEJIT_CHECK(cubin_size > 0, ErrorCode::kCompileFailed,
               "NVRTC produced no cubin for " << src.file_name << " with " << arch.nvrtc_option()
                                              << "; a cubin needs a real sm_ arch");
  out.cubin.resize(cubin_size);
  MOEJIT_NVRTC_CHECK(nvrtcGetCUBIN(program.get(), out.cubin.data()));
  return out;
}

}  // namespace

CompiledKernel compile(const GeneratedSource& src, const Arch& arch, const ToolkitHeaders& toolkit,
                       const std::string& failure_dir, bool line_info) {
  const auto start = std::chrono::steady_clock::now();
  std::vector<std::string> options = compile_options(arch, line_info);
  for (const std::string& dir : toolkit.include_dirs) options.push_back("-I" + dir);

  const std::vector<int>& archs = supported_archs();
  if (std::find(archs.begin(), archs.end(), arch.sm) == archs.end()) {
    std::ostringstream os;
    os << arch.name() << " is not a target of this NVRTC; it supports:";
    for (int sm : archs) os << " sm_" << sm;
    os << ". Choose one of those, or use a toolkit that targets " << arch.name();
    throw_compile_error(src, os.str(), options, "", failure_dir);
  }

  CompiledKernel out = run_nvrtc(src, arch, options, failure_dir);
  out.options = compile_options(arch, line_info);
  // Why: a cubin whose copies fault must never reach the cache (cubin_check.hpp). Without the
  // hint ptxas has no cache-policy operand to encode, so the rebuilt kernel takes the plain form.
  const int faulting = count_faulting_hinted_copies(out.cubin);
  if (faulting > 0) {
    // Why info, not warn: the rebuilt kernel is correct; it only lacks the hint (1-3%).
    log().info(
        "{} for {}: ptxas encoded {} cache-hinted cp.async as the LDGSTS form that faults "
        "(its policy register is never written); compiling it again with {}",
        kernel_label(src), arch.name(), faulting, kNoL2CacheHintOption);
    options.emplace_back(kNoL2CacheHintOption);
    out = run_nvrtc(src, arch, options, failure_dir);
    out.options = compile_options(arch, line_info);
    out.options.emplace_back(kNoL2CacheHintOption);
    const int left = count_faulting_hinted_copies(out.cubin);
    if (left > 0) {
      std::ostringstream os;
      os << "ptxas encoded " << left << " cp.async as the LDGSTS form that faults even with "
         << kNoL2CacheHintOption << "; this NVRTC cannot build the kernel safely";
      throw_compile_error(src, os.str(), options, out.log, failure_dir);
    }
  }

  out.compile_ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
  log().info("compiled {} for {} in {:.0f} ms", kernel_label(src), arch.name(), out.compile_ms);
  return out;
}

}  // namespace moejit::detail
