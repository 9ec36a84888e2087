// NVRTC compiles of every append_shared variant, compile-failure reports, the traits' asserts
// under NVRTC, and the toolkit header search (unusable candidates, versioned prefixes) and
// digest. Needs the CUDA toolkit, no GPU.
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <catch2/catch.hpp>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iostream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "codegen/codegen.hpp"
#include "compile/cubin_check.hpp"
#include "compile/nvrtc.hpp"
#include "moejit/error.hpp"
#include "moejit/kernel_spec.hpp"
#include "support/support.hpp"

namespace {

namespace fs = std::filesystem;
using moejit::AppendSharedParams;
using moejit::Arch;
using moejit::CompileError;
using moejit::DType;
using moejit::Error;
using moejit::ErrorCode;
using moejit::KernelSpec;
using moejit::SharedGate;
using moejit::test::read_text;
using moejit::test::write_text;

bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

KernelSpec spec_of(const AppendSharedParams& params, const std::string& arch) {
  KernelSpec spec;
  spec.family = moejit::Family::kAppendShared;
  spec.arch = Arch::parse(arch);
  spec.params = params;
  return spec;
}

AppendSharedParams params_of(int top_k, int num_shared, DType id, SharedGate gate, DType logit,
                             int threads) {
  AppendSharedParams p;
  p.top_k = top_k;
  p.num_shared = num_shared;
  p.id_dtype = id;
  p.gate = gate;
  p.logit_dtype = logit;
  p.block_threads = threads;
  return p;
}

// Every (id dtype, gate, logit dtype) combination the kernel serves.
std::vector<AppendSharedParams> all_variants() {
  std::vector<AppendSharedParams> out;
  for (DType id : {DType::kI32, DType::kI64}) {
    for (DType logit : {DType::kBF16, DType::kF16, DType::kF32}) {
      out.push_back(params_of(6, 1, id, SharedGate::kSigmoid, logit, 128));
    }
    out.push_back(params_of(8, 2, id, SharedGate::kConstant, DType::kF32, 256));
    out.push_back(params_of(4, 1, id, SharedGate::kGiven, DType::kF32, 128));
  }
  return out;
}

const moejit::detail::ToolkitHeaders& toolkit() { return moejit::detail::toolkit_headers(""); }

// Runs `body`, which must throw E; returns the exception.
template <class E>
E expect_throw(const std::function<void()>& body) {
  try {
    body();
  } catch (const E& e) {
    return e;
  }
  FAIL("expected an exception that was not thrown");
  throw std::logic_error("unreachable");
}

// A minimal fake toolkit: the probe files plus one header reached only transitively.
void write_fake_toolkit(const fs::path& root, const std::string& inner_text) {
  write_text(root / "cuda_bf16.h", "#pragma once\n#include \"cuda_fp16.h\"\n");
  write_text(root / "cuda_fp16.h", "#pragma once\n  #  include \"inner.h\"\n");
  write_text(root / "inner.h", inner_text);
  write_text(root / "cccl/cuda/std/cstdint", "#pragma once\n#include <cuda/std/__fake/detail>\n");
  write_text(root / "cccl/cuda/std/__fake/detail", "// detail\n");
}

// Set an environment variable for one scope.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) {
    if (const char* old = std::getenv(name)) {
      old_ = old;
      had_ = true;
    }
    if (value != nullptr) {
      ::setenv(name, value, 1);
    } else {
      ::unsetenv(name);
    }
  }
  ~ScopedEnv() {
    if (had_) {
      ::setenv(name_, old_.c_str(), 1);
    } else {
      ::unsetenv(name_);
    }
  }
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;

 private:
  const char* name_;
  std::string old_;
  bool had_ = false;
};

}  // namespace

TEST_CASE("every append_shared variant compiles for sm_90a, sm_100a and sm_80", "[nvrtc]") {
  for (const char* arch : {"sm_90a", "sm_100a", "sm_80"}) {
    for (const AppendSharedParams& params : all_variants()) {
      const KernelSpec spec = spec_of(params, arch);
      INFO(spec.display_name());
      const moejit::detail::GeneratedSource src = moejit::detail::render(spec);
      const moejit::detail::CompiledKernel kernel =
          moejit::detail::compile(src, spec.arch, toolkit(), "");
      REQUIRE(kernel.cubin.size() > 4);
      CHECK(kernel.cubin.compare(0, 4,
                                 "\x7f"
                                 "ELF") == 0);
      CHECK(!kernel.lowered_name.empty());
      CHECK(contains(kernel.lowered_name, "append_shared"));
      CHECK(contains(kernel.log, "ptxas"));
      CHECK(contains(kernel.log, "registers"));
      CHECK(kernel.compile_ms > 0);
    }
  }
}

TEST_CASE("append_shared compiles at the edges of its ranges", "[nvrtc]") {
  for (const AppendSharedParams& params :
       {params_of(64, 8, DType::kI64, SharedGate::kSigmoid, DType::kF16, 1024),
        params_of(1, 1, DType::kI32, SharedGate::kSigmoid, DType::kBF16, 32)}) {
    const KernelSpec spec = spec_of(params, "sm_90a");
    INFO(spec.display_name());
    const auto kernel =
        moejit::detail::compile(moejit::detail::render(spec), spec.arch, toolkit(), "");
    CHECK(kernel.cubin.compare(0, 4,
                               "\x7f"
                               "ELF") == 0);
    CHECK(contains(kernel.lowered_name, "append_shared"));
  }
}

TEST_CASE("a broken source throws a CompileError that names the kernel and saves the source",
          "[nvrtc]") {
  moejit::test::TempDir dir;
  const std::string failure_dir = dir.path() + "/failed/nested";
  const KernelSpec spec =
      spec_of(params_of(6, 1, DType::kI32, SharedGate::kSigmoid, DType::kBF16, 128), "sm_90a");
  moejit::detail::GeneratedSource src = moejit::detail::render(spec);
  src.source += "\nmoejit_not_a_type broken_declaration = ;\n";

  const CompileError error = expect_throw<CompileError>(
      [&] { moejit::detail::compile(src, spec.arch, toolkit(), failure_dir); });
  const std::string message = error.what();
  INFO(message);
  CHECK(error.code() == ErrorCode::kCompileFailed);
  const std::string label = src.file_name.substr(0, src.file_name.size() - 3);
  CHECK(error.kernel() == label);
  CHECK(contains(message, label));
  CHECK(contains(message, src.name_expression));
  CHECK(contains(message, "--gpu-architecture=sm_90a"));
  CHECK(contains(message, "-std=c++17"));
  CHECK(contains(message, "moejit_not_a_type"));  // a log line, quoted in the message
  CHECK(contains(error.log(), "error"));
  CHECK(contains(error.log(), "moejit_not_a_type"));
  REQUIRE(!error.options().empty());
  CHECK(error.options().front() == "--gpu-architecture=sm_90a");

  REQUIRE(!error.source_path().empty());
  CHECK(error.source_path() == failure_dir + "/" + src.file_name);
  CHECK(contains(message, error.source_path()));
  REQUIRE(fs::exists(error.source_path()));
  CHECK(read_text(error.source_path()) == src.source);
  struct stat info {};
  REQUIRE(::stat(failure_dir.c_str(), &info) == 0);
  CHECK((info.st_mode & 0777) == 0700);
  REQUIRE(::stat((dir.path() + "/failed").c_str(), &info) == 0);
  CHECK((info.st_mode & 0777) == 0700);
}

namespace {

bool hint_dropped(const moejit::detail::CompiledKernel& kernel) {
  return std::find(kernel.options.begin(), kernel.options.end(),
                   moejit::detail::kNoL2CacheHintOption) != kernel.options.end();
}

}  // namespace

TEST_CASE("a cubin with the faulting cp.async form is compiled again without the L2 hint",
          "[nvrtc]") {
  using moejit::detail::count_faulting_hinted_copies;
  // The library's copy (ptx.cuh), which MOEJIT_NO_L2_CACHE_HINT turns into a plain one.
  const auto library =
      moejit::test::copy_ring_source("copy_ring_library.cu", moejit::test::kRingLibraryCopy);
  const moejit::detail::CompiledKernel kernel =
      moejit::detail::compile(library, Arch::parse("sm_90a"), toolkit(), "");
  CHECK(count_faulting_hinted_copies(kernel.cubin) == 0);
  REQUIRE(!kernel.options.empty());
  CHECK(kernel.options.front() == "--gpu-architecture=sm_90a");

  // The same ring with a copy that keeps its hint whatever the macro: the retry cannot help.
  const auto always_hinted =
      moejit::test::copy_ring_source("copy_ring_hinted.cu", moejit::test::kRingHintedCopy);
  bool emits_form = false;
  try {
    const moejit::detail::CompiledKernel hinted =
        moejit::detail::compile(always_hinted, Arch::parse("sm_90a"), toolkit(), "");
    CHECK(count_faulting_hinted_copies(hinted.cubin) == 0);
    CHECK_FALSE(hint_dropped(hinted));
  } catch (const CompileError& error) {
    emits_form = true;
    const std::string message = error.what();
    INFO(message);
    CHECK(contains(message, "form that faults"));
    CHECK(contains(message, moejit::detail::kNoL2CacheHintOption));
    CHECK(contains(message, "copy_ring_hinted"));
  }
  // Where ptxas emits the form, the library's copy was retried without its hint; where it does
  // not, nothing was retried and the check above had nothing to catch.
  CHECK(hint_dropped(kernel) == emits_form);
  if (!emits_form) WARN("this NVRTC does not emit the faulting form: the retry is not exercised");

  // Every arch is scanned: whichever of its cubins ptxas gives the form (for this ring: sm_80
  // in its remainder loop, not sm_100a, with ptxas 13.0) comes back rebuilt and clean.
  for (const char* other : {"sm_80", "sm_100a"}) {
    INFO(other);
    const moejit::detail::CompiledKernel built =
        moejit::detail::compile(library, Arch::parse(other), toolkit(), "");
    CHECK(count_faulting_hinted_copies(built.cubin) == 0);
  }
}

TEST_CASE("without a failure directory the message says the source was not saved", "[nvrtc]") {
  const KernelSpec spec =
      spec_of(params_of(6, 1, DType::kI32, SharedGate::kConstant, DType::kF32, 128), "sm_80");
  moejit::detail::GeneratedSource src = moejit::detail::render(spec);
  src.source += "\n#error moejit deliberate failure\n";
  const CompileError error =
      expect_throw<CompileError>([&] { moejit::detail::compile(src, spec.arch, toolkit(), ""); });
  CHECK(error.source_path().empty());
  CHECK(contains(error.what(), "source not saved"));
  CHECK(contains(error.what(), "moejit deliberate failure"));
}

TEST_CASE("the append_shared traits' static_asserts fire under NVRTC", "[nvrtc]") {
  struct Case {
    const char* traits_args;
    const char* message;
  };
  const Case cases[] = {
      {"6, 1, int, moejit::kern::SharedGate::kSigmoid, __nv_bfloat16, 100",
       "BlockThreads must be a multiple of 32 in [32, 1024]"},
      {"0, 1, int, moejit::kern::SharedGate::kSigmoid, float, 128", "TopK must be in [1, 64]"},
      {"6, 9, int, moejit::kern::SharedGate::kSigmoid, float, 128", "NumShared must be in [1, 8]"},
      {"6, 1, unsigned, moejit::kern::SharedGate::kConstant, float, 128",
       "IdT must be int (int32 ids) or long long (int64 ids)"},
      {"6, 1, int, moejit::kern::SharedGate::kSigmoid, double, 128",
       "LogitT must be __nv_bfloat16, __half or float"},
      {"6, 1, long long, moejit::kern::SharedGate::kGiven, __half, 128",
       "kGiven copies fp32 weights"},
  };
  for (const Case& c : cases) {
    INFO(c.traits_args);
    moejit::detail::GeneratedSource src;
    src.file_name = "append_shared_bad_traits.cu";
    src.source = "#include <moejit/kern/append_shared.cuh>\n";
    src.name_expression = std::string(
                              "moejit::kern::append_shared_kernel<moejit::kern::"
                              "AppendSharedTraits<") +
                          c.traits_args + ">>";
    const CompileError error = expect_throw<CompileError>(
        [&] { moejit::detail::compile(src, Arch::parse("sm_90a"), toolkit(), ""); });
    CHECK(contains(error.log(), c.message));
    CHECK(contains(error.what(), c.message));
  }
}

TEST_CASE("an unsupported spec is refused before codegen", "[nvrtc]") {
  const KernelSpec spec =
      spec_of(params_of(65, 1, DType::kI32, SharedGate::kSigmoid, DType::kBF16, 128), "sm_90a");
  const Error error = expect_throw<Error>([&] { moejit::detail::render(spec); });
  CHECK(error.code() == ErrorCode::kUnsupported);
  CHECK(contains(error.what(), "top_k = 65"));
}

TEST_CASE("an arch this NVRTC cannot target is a CompileError listing the supported ones",
          "[nvrtc]") {
  KernelSpec spec =
      spec_of(params_of(6, 1, DType::kI32, SharedGate::kSigmoid, DType::kBF16, 128), "sm_90a");
  spec.arch.sm = 990;  // well-formed, but no NVRTC targets it
  spec.arch.arch_specific = false;
  const CompileError error = expect_throw<CompileError>(
      [&] { moejit::detail::compile(moejit::detail::render(spec), spec.arch, toolkit(), ""); });
  CHECK(contains(error.what(), "sm_990 is not a target of this NVRTC"));
  CHECK(contains(error.what(), "sm_90"));
}

TEST_CASE("toolkit headers: a configured directory that does not qualify is an error naming it",
          "[nvrtc]") {
  moejit::test::TempDir dir;
  const std::string missing = dir.path() + "/no-such-include";
  const Error gone = expect_throw<Error>([&] { moejit::detail::toolkit_headers(missing); });
  CHECK(gone.code() == ErrorCode::kCompileFailed);
  CHECK(contains(gone.what(), missing));
  CHECK(contains(gone.what(), "RuntimeConfig::cuda_include_dir"));
  CHECK(contains(gone.what(), "does not exist"));

  const Error empty = expect_throw<Error>([&] { moejit::detail::toolkit_headers(dir.path()); });
  CHECK(contains(empty.what(), dir.path()));
  CHECK(contains(empty.what(), "has no cuda_bf16.h"));

  // cuda_bf16.h without CCCL: both places looked in are named.
  write_text(fs::path(dir.path()) / "partial/cuda_bf16.h", "#pragma once\n");
  const Error partial =
      expect_throw<Error>([&] { moejit::detail::toolkit_headers(dir.path() + "/partial"); });
  CHECK(contains(partial.what(), "cuda/std/cstdint"));
  CHECK(contains(partial.what(), "/partial/cccl"));
}

TEST_CASE("toolkit headers: MOEJIT_CUDA_INCLUDE is used as given", "[nvrtc]") {
  moejit::test::TempDir dir;
  const std::string bogus = dir.path() + "/bogus";
  {
    ScopedEnv env("MOEJIT_CUDA_INCLUDE", bogus.c_str());
    const Error error = expect_throw<Error>([&] { moejit::detail::toolkit_headers(""); });
    CHECK(contains(error.what(), "MOEJIT_CUDA_INCLUDE"));
    CHECK(contains(error.what(), bogus));
  }
  write_fake_toolkit(fs::path(dir.path()) / "fake", "int inner;\n");
  ScopedEnv env("MOEJIT_CUDA_INCLUDE", (dir.path() + "/fake").c_str());
  const auto& found = moejit::detail::toolkit_headers("");
  CHECK(found.include_dir == fs::weakly_canonical(dir.path() + "/fake").string());
}

TEST_CASE("toolkit headers: a candidate that cannot be examined is reported and skipped",
          "[nvrtc]") {
  using moejit::detail::locate_toolkit_headers;
  moejit::test::TempDir dir;
  // A symlink to itself: stat fails with ELOOP, for root too.
  const std::string loop = dir.path() + "/loop";
  REQUIRE(::symlink(loop.c_str(), loop.c_str()) == 0);
  const std::string loop_include = loop + "/include";

  // An explicit setting is reported with the system's reason.
  const Error configured =
      expect_throw<Error>([&] { locate_toolkit_headers(loop_include, "", false); });
  INFO(configured.what());
  CHECK(configured.code() == ErrorCode::kCompileFailed);
  CHECK(contains(configured.what(), loop_include + " cannot be examined (Too many levels of "
                                                   "symbolic links)"));

  // A probe header that can't be examined is named, not reported as missing.
  const fs::path looped_header = fs::path(dir.path()) / "tk";
  fs::create_directories(looped_header);
  REQUIRE(::symlink((looped_header / "cuda_bf16.h").c_str(),
                    (looped_header / "cuda_bf16.h").c_str()) == 0);
  const Error header =
      expect_throw<Error>([&] { locate_toolkit_headers(looped_header.string(), "", false); });
  CHECK(contains(header.what(), (looped_header / "cuda_bf16.h").string() + " cannot be examined"));

  // From CUDA_HOME the search reports that candidate and goes on to the default prefixes.
  ScopedEnv no_include("MOEJIT_CUDA_INCLUDE", nullptr);
  ScopedEnv no_path("CUDA_PATH", nullptr);
  std::string by_default;  // what the default prefixes give, "" when none qualifies
  {
    ScopedEnv no_home("CUDA_HOME", nullptr);
    try {
      by_default = locate_toolkit_headers("", "", false).include_dir;
    } catch (const Error&) {
    }
  }
  ScopedEnv home("CUDA_HOME", loop.c_str());
  if (!by_default.empty()) {
    CHECK(locate_toolkit_headers("", "", false).include_dir == by_default);
  } else {
    const Error none = expect_throw<Error>([&] { locate_toolkit_headers("", "", false); });
    INFO(none.what());
    CHECK(contains(none.what(), loop_include + " ($CUDA_HOME/include): cannot be examined"));
    CHECK(contains(none.what(), "/usr/local/cuda/include"));
  }

  // An unreadable parent (EACCES) only fails for a user that permissions apply to.
  if (::geteuid() == 0) {
    std::cout << "SKIPPED: toolkit candidate under a mode-000 directory: running as root, which "
                 "ignores directory permissions (the symlink loop above covers the path)"
              << std::endl;
    return;
  }
  const fs::path locked = fs::path(dir.path()) / "locked";
  write_fake_toolkit(locked / "include", "int inner;\n");
  fs::permissions(locked, fs::perms::none);
  const Error denied = expect_throw<Error>(
      [&] { locate_toolkit_headers((locked / "include").string(), "", false); });
  fs::permissions(locked, fs::perms::owner_all);
  CHECK(contains(denied.what(), "cannot be examined (Permission denied)"));
}

TEST_CASE("toolkit headers: versioned prefixes sort newest first and skip other names", "[nvrtc]") {
  moejit::test::TempDir dir;
  for (const char* name :
       {"cuda-12.4", "cuda-13.0", "cuda-13.0.1", "cuda-9.2", "cuda-99999999999",
        "cuda-13.99999999999", "cuda-x", "cuda-", "cuda-13.a", "cuda-12..1", "cudnn-9.1", "cuda"}) {
    fs::create_directories(fs::path(dir.path()) / name);
  }
  const std::string root = dir.path();
  CHECK(moejit::detail::versioned_toolkit_includes(root) ==
        std::vector<std::string>{root + "/cuda-13.0.1/include", root + "/cuda-13.0/include",
                                 root + "/cuda-12.4/include", root + "/cuda-9.2/include"});
  CHECK(moejit::detail::versioned_toolkit_includes(root + "/absent").empty());
}

TEST_CASE("toolkit headers: the digest follows includes and ignores where the toolkit lives",
          "[nvrtc]") {
  moejit::test::TempDir dir;
  const fs::path a = fs::path(dir.path()) / "a";
  const fs::path b = fs::path(dir.path()) / "b";
  const fs::path c = fs::path(dir.path()) / "c";
  write_fake_toolkit(a, "int inner = 1;\n");
  write_fake_toolkit(b, "int inner = 1;\n");
  write_fake_toolkit(c, "int inner = 2;\n");
  const auto& ta = moejit::detail::toolkit_headers(a.string());
  const auto& tb = moejit::detail::toolkit_headers(b.string());
  const auto& tc = moejit::detail::toolkit_headers(c.string());

  const std::string canonical_a = fs::weakly_canonical(a).string();
  CHECK(ta.include_dir == canonical_a);
  CHECK(ta.include_dirs == std::vector<std::string>{canonical_a, canonical_a + "/cccl"});
  CHECK(ta.files == std::vector<std::string>{"cuda/std/__fake/detail", "cuda/std/cstdint",
                                             "cuda_bf16.h", "cuda_fp16.h", "inner.h"});
  CHECK(ta.digest == tb.digest);     // same content elsewhere: same digest
  CHECK(!(ta.digest == tc.digest));  // a header reached only transitively changed
  CHECK(&moejit::detail::toolkit_headers(a.string()) == &ta);  // memoized
}

TEST_CASE("toolkit headers: the installed toolkit's digest is stable and covers cuda_bf16.h",
          "[nvrtc]") {
  const auto& first = toolkit();
  const auto& second = moejit::detail::toolkit_headers("");
  CHECK(&first == &second);
  CHECK(first.digest == second.digest);
  auto has = [&](const std::string& name) {
    for (const std::string& file : first.files) {
      if (file == name) return true;
    }
    return false;
  };
  CHECK(has("cuda_bf16.h"));
  CHECK(has("cuda_bf16.hpp"));  // reached through cuda_bf16.h
  CHECK(has("cuda_fp16.h"));
  CHECK(has("cuda/std/cstdint"));
  CHECK(has("nv/target"));
  // The same directory named explicitly is searched afresh, and hashes the same.
  const auto& explicit_dir = moejit::detail::toolkit_headers(first.include_dir);
  CHECK(explicit_dir.digest == first.digest);
  CHECK(explicit_dir.files == first.files);
}

TEST_CASE("the key's NVRTC field names the loaded library's patch build, never a path", "[nvrtc]") {
  const std::string& identity = moejit::detail::nvrtc_identity();
  INFO(identity);
  // This build links libnvrtc dynamically: the version, then the file's name and size.
  CHECK(identity.rfind(moejit::detail::nvrtc_version() + " libnvrtc", 0) == 0);
  CHECK(identity.find('/') == std::string::npos);
  const std::string size = identity.substr(identity.rfind(' ') + 1);
  CHECK(std::all_of(size.begin(), size.end(), [](char c) { return c >= '0' && c <= '9'; }));
  CHECK(std::stoull(size) > 1000000);
}

TEST_CASE("compile options: arch first, C++17, ptxas report, never fast-math", "[nvrtc]") {
  const std::vector<std::string> options = moejit::detail::compile_options(Arch::parse("sm_90a"));
  REQUIRE(!options.empty());
  CHECK(options.front() == "--gpu-architecture=sm_90a");
  auto has = [&](const std::string& option) {
    for (const std::string& o : options) {
      if (o == option) return true;
    }
    return false;
  };
  CHECK(has("-std=c++17"));
  CHECK(has("-Xptxas=-v"));
  // Line tables only on request (RuntimeConfig::line_info).
  CHECK_FALSE(has("-lineinfo"));
  const std::vector<std::string> with_lines =
      moejit::detail::compile_options(Arch::parse("sm_90a"), true);
  CHECK(std::count(with_lines.begin(), with_lines.end(), "-lineinfo") == 1);
  CHECK(with_lines.size() == options.size() + 1);
  for (const std::string& o : options) {
    CHECK(!contains(o, "fast-math"));
    CHECK(!contains(o, "fast_math"));
    CHECK(o.rfind("-I", 0) != 0);  // include paths are machine-specific: not in the options
  }
  const std::string version = moejit::detail::nvrtc_version();
  CHECK(version.find('.') != std::string::npos);
  CHECK(version.find_first_not_of("0123456789.") == std::string::npos);
}

TEST_CASE("toolkit fingerprint: a stamp in the cache dir is reused only while it holds",
          "[nvrtc]") {
  using moejit::detail::locate_toolkit_headers;
  moejit::test::TempDir dir;
  const auto& reference = moejit::detail::toolkit_headers("");
  const moejit::detail::ToolkitHeaders first = locate_toolkit_headers("", dir.path(), true);
  CHECK(first.digest == reference.digest);
  std::vector<std::filesystem::path> stamps;
  for (const auto& e : std::filesystem::directory_iterator(dir.path())) stamps.push_back(e.path());
  REQUIRE(stamps.size() == 1);
  CHECK(stamps[0].filename().string().rfind("toolkit-", 0) == 0);

  // Read back: same fingerprint, taken from the stamp (a forged digest shows it was read).
  auto rewrite = [&](const std::function<void(nlohmann::json&)>& edit) {
    std::ifstream in(stamps[0]);
    nlohmann::json stamp = nlohmann::json::parse(in);
    in.close();
    edit(stamp);
    std::ofstream(stamps[0], std::ios::trunc) << stamp.dump();
  };
  const moejit::detail::ToolkitHeaders second = locate_toolkit_headers("", dir.path(), false);
  CHECK(second.digest == first.digest);
  CHECK(second.files == first.files);
  rewrite([](nlohmann::json& s) { s["digest"] = std::string(32, 'a'); });
  CHECK(locate_toolkit_headers("", dir.path(), false).digest.hex() == std::string(32, 'a'));

  // A recorded file that changed (here: its recorded size no longer matches) voids the stamp.
  rewrite([](nlohmann::json& s) { s["read"][0][1] = s["read"][0][1].get<int64_t>() + 1; });
  CHECK(locate_toolkit_headers("", dir.path(), false).digest == reference.digest);
  // A candidate recorded as absent that now exists voids it too.
  moejit::test::TempDir other;
  const std::string appeared = other.path() + "/appeared.h";
  std::ofstream(appeared) << "// new\n";
  rewrite([&](nlohmann::json& s) {
    s["read"][0][1] = s["read"][0][1].get<int64_t>() - 1;
    s["digest"] = std::string(32, 'b');
    s["absent"].push_back(appeared);
  });
  CHECK(locate_toolkit_headers("", dir.path(), false).digest == reference.digest);
  // Absent candidates are guarded by their deepest existing directory: the stamp holds while the
  // directory's mtime and inode do, and an entry created there voids it. (The directory's mtime
  // is set back first, so the new entry cannot fall in the same timestamp tick.)
  {
    std::ifstream in(stamps[0]);
    const nlohmann::json written = nlohmann::json::parse(in);
    REQUIRE(written.contains("absent_dirs"));
    CHECK(written.at("absent_dirs").size() + written.at("absent").size() > 0);
    for (const nlohmann::json& guard : written.at("absent_dirs")) {
      CHECK(std::filesystem::is_directory(guard.at(0).get<std::string>()));
    }
  }
  moejit::test::TempDir guarded;
  std::filesystem::last_write_time(
      guarded.path(), std::filesystem::file_time_type::clock::now() - std::chrono::hours(1));
  struct stat guard_stat {};
  REQUIRE(::stat(guarded.path().c_str(), &guard_stat) == 0);
  const int64_t guard_mtime =
      static_cast<int64_t>(guard_stat.st_mtim.tv_sec) * 1000000000 + guard_stat.st_mtim.tv_nsec;
  rewrite([&](nlohmann::json& s) {
    s["absent"].erase(s["absent"].size() - 1);
    s["digest"] = std::string(32, 'c');
    s["absent_dirs"].push_back(nlohmann::json::array(
        {guarded.path(), guard_mtime, static_cast<int64_t>(guard_stat.st_ino)}));
  });
  CHECK(locate_toolkit_headers("", dir.path(), false).digest.hex() == std::string(32, 'c'));
  std::ofstream(guarded.path() + "/shadow.h") << "// new\n";
  CHECK(locate_toolkit_headers("", dir.path(), false).digest == reference.digest);
  // A stamp others can write is never trusted.
  rewrite([&](nlohmann::json& s) { s["absent_dirs"].erase(s["absent_dirs"].size() - 1); });
  CHECK(locate_toolkit_headers("", dir.path(), false).digest.hex() == std::string(32, 'c'));
  std::filesystem::permissions(stamps[0], std::filesystem::perms::group_write,
                               std::filesystem::perm_options::add);
  CHECK(locate_toolkit_headers("", dir.path(), false).digest == reference.digest);
}
