// NVRTC compiles of every append_shared variant, compile-failure reports, the traits' asserts
// under NVRTC, and the compile's independence from the CUDA toolkit's headers. Needs NVRTC, no
// GPU.
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <catch2/catch.hpp>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <sstream>
#include <string>
#include <vector>

#include "codegen/codegen.hpp"
#include "codegen/embedded.hpp"
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

}  // namespace

TEST_CASE("every append_shared variant compiles for sm_90a, sm_100a, sm_80 and sm_75", "[nvrtc]") {
  for (const char* arch : {"sm_90a", "sm_100a", "sm_80", "sm_75"}) {
    for (const AppendSharedParams& params : all_variants()) {
      const KernelSpec spec = spec_of(params, arch);
      INFO(spec.display_name());
      const moejit::detail::GeneratedSource src = moejit::detail::render(spec);
      const moejit::detail::CompiledKernel kernel =
          moejit::detail::compile(src, spec.arch, "");
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
        moejit::detail::compile(moejit::detail::render(spec), spec.arch, "");
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
      [&] { moejit::detail::compile(src, spec.arch, failure_dir); });
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
      moejit::detail::compile(library, Arch::parse("sm_90a"), "");
  CHECK(count_faulting_hinted_copies(kernel.cubin) == 0);
  REQUIRE(!kernel.options.empty());
  CHECK(kernel.options.front() == "--gpu-architecture=sm_90a");

  // The same ring with a copy that keeps its hint whatever the macro: the retry cannot help.
  const auto always_hinted =
      moejit::test::copy_ring_source("copy_ring_hinted.cu", moejit::test::kRingHintedCopy);
  bool emits_form = false;
  try {
    const moejit::detail::CompiledKernel hinted =
        moejit::detail::compile(always_hinted, Arch::parse("sm_90a"), "");
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
        moejit::detail::compile(library, Arch::parse(other), "");
    CHECK(count_faulting_hinted_copies(built.cubin) == 0);
  }
}

TEST_CASE("without a failure directory the message says the source was not saved", "[nvrtc]") {
  const KernelSpec spec =
      spec_of(params_of(6, 1, DType::kI32, SharedGate::kConstant, DType::kF32, 128), "sm_80");
  moejit::detail::GeneratedSource src = moejit::detail::render(spec);
  src.source += "\n#error moejit deliberate failure\n";
  const CompileError error =
      expect_throw<CompileError>([&] { moejit::detail::compile(src, spec.arch, ""); });
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
      {"6, 1, int, moejit::kern::SharedGate::kSigmoid, moejit::kern::bf16, 100",
       "BlockThreads must be a multiple of 32 in [32, 1024]"},
      {"0, 1, int, moejit::kern::SharedGate::kSigmoid, float, 128", "TopK must be in [1, 64]"},
      {"6, 9, int, moejit::kern::SharedGate::kSigmoid, float, 128", "NumShared must be in [1, 8]"},
      {"6, 1, unsigned, moejit::kern::SharedGate::kConstant, float, 128",
       "IdT must be int (int32 ids) or long long (int64 ids)"},
      {"6, 1, int, moejit::kern::SharedGate::kSigmoid, double, 128",
       "LogitT must be bf16, f16 or float"},
      {"6, 1, long long, moejit::kern::SharedGate::kGiven, moejit::kern::f16, 128",
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
        [&] { moejit::detail::compile(src, Arch::parse("sm_90a"), ""); });
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
      [&] { moejit::detail::compile(moejit::detail::render(spec), spec.arch, ""); });
  CHECK(contains(error.what(), "sm_990 is not a target of this NVRTC"));
  CHECK(contains(error.what(), "sm_90"));
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

// What a package upgrade does to a library a process has loaded: a new file renamed over its
// path. The key's NVRTC field must keep naming the library the process compiles with.
TEST_CASE("the key's NVRTC field takes the mapped library's size, not the file now at its path",
          "[nvrtc]") {
  moejit::test::TempDir dir;
  const std::string path = fs::canonical(dir.path()).string() + "/libmapped.so.1";
  constexpr std::size_t kMappedBytes = 8192;
  {
    std::ofstream out(path, std::ios::binary);
    out << std::string(kMappedBytes, 'm');
  }
  const int fd = ::open(path.c_str(), O_RDONLY);
  REQUIRE(fd >= 0);
  void* const map = ::mmap(nullptr, kMappedBytes, PROT_READ, MAP_PRIVATE, fd, 0);
  ::close(fd);
  REQUIRE(map != MAP_FAILED);
  {
    std::ofstream out(path + ".new", std::ios::binary);
    out << std::string(100, 'n');
  }
  REQUIRE(std::rename((path + ".new").c_str(), path.c_str()) == 0);
  const auto mapped = moejit::detail::mapped_file([&](const std::string& p) { return p == path; });
  ::munmap(map, kMappedBytes);
  if (!mapped) {
    WARN("SKIPPED: this process can't stat its own mappings (/proc/self/map_files)");
    return;
  }
  CHECK(mapped->path == path);
  CHECK(mapped->size == kMappedBytes);
  CHECK(fs::file_size(path) == 100);
  // And the field names the NVRTC library this process maps, by its size.
  const auto nvrtc = moejit::detail::mapped_file([](const std::string& p) {
    return fs::path(p).filename().string().rfind("libnvrtc.so", 0) == 0;
  });
  REQUIRE(nvrtc.has_value());
  const std::string& identity = moejit::detail::nvrtc_identity();
  INFO(identity);
  CHECK(identity == moejit::detail::nvrtc_version() + " " +
                        fs::path(nvrtc->path).filename().string() + " " +
                        std::to_string(nvrtc->size));
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
    CHECK(o.rfind("-I", 0) != 0);  // no include directory: the kernels include only their own
  }
  const std::string version = moejit::detail::nvrtc_version();
  CHECK(version.find('.') != std::string::npos);
  CHECK(version.find_first_not_of("0123456789.") == std::string::npos);
}

TEST_CASE("the kernels include only embedded headers, and NVRTC gets no include directory",
          "[nvrtc]") {
  // Why it matters: the cache key covers the embedded headers and not the CUDA toolkit's, so a
  // kernel header that reached a toolkit header would let a toolkit change go unnoticed.
  const std::vector<moejit::detail::EmbeddedHeader>& headers = moejit::detail::embedded_headers();
  REQUIRE(headers.size() >= 10);
  auto embedded = [&](const std::string& name) {
    return std::any_of(headers.begin(), headers.end(),
                       [&](const auto& h) { return std::string(h.path) == name; });
  };
  std::size_t directives = 0;
  for (const auto& header : headers) {
    std::istringstream lines{std::string(header.content)};
    std::string line;
    while (std::getline(lines, line)) {
      const std::size_t hash = line.find_first_not_of(" \t");
      if (hash == std::string::npos || line[hash] != '#') continue;
      const std::size_t word = line.find_first_not_of(" \t", hash + 1);
      if (word == std::string::npos || line.compare(word, 7, "include") != 0) continue;
      const std::size_t open = line.find_first_of("<\"", word + 7);
      const std::size_t close = line.find_first_of(">\"", open + 1);
      REQUIRE(open != std::string::npos);
      REQUIRE(close != std::string::npos);
      const std::string name = line.substr(open + 1, close - open - 1);
      INFO(header.path << ": " << line);
      // The host branch of moe/types.cuh includes <cstdint> for the library's own C++ build.
      const bool host_only = std::string(header.path) == "moejit/kern/moe/types.cuh" &&
                             name == "cstdint";
      CHECK((embedded(name) || host_only));
      ++directives;
    }
  }
  CHECK(directives >= 20);

  // A source that reaches for a toolkit header does not compile: there is nothing to find it in.
  moejit::detail::GeneratedSource src;
  src.file_name = "reaches_toolkit.cu";
  src.name_expression = "reaches_toolkit";
  src.source = "#include <cuda_bf16.h>\n__global__ void reaches_toolkit() {}\n";
  const CompileError error = expect_throw<CompileError>(
      [&] { moejit::detail::compile(src, Arch::parse("sm_90a"), ""); });
  CHECK(contains(error.log(), "cuda_bf16.h"));

  CHECK(moejit::detail::nvrtc_self_test().empty());
}
