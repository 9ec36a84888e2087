// Saving a failed compile's source (compile/nvrtc.hpp save_failed_source): the failure directory
// may be a per-user directory under /tmp that another local user created first, so a link or a
// shared directory must never redirect the write. No NVRTC or toolkit needed.
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <catch2/catch.hpp>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

#include "codegen/codegen.hpp"
#include "compile/nvrtc.hpp"
#include "moejit/error.hpp"
#include "support/support.hpp"

namespace {

namespace fs = std::filesystem;
using moejit::detail::GeneratedSource;
using moejit::detail::save_failed_source;
using moejit::test::read_text;
using moejit::test::write_text;

bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

GeneratedSource failed_source() {
  GeneratedSource src;
  src.file_name = "append_shared_k6_s1_i32_sigmoid_bf16.cu";
  src.source = "// generated\nmoejit_not_a_type broken_declaration = ;\n";
  src.name_expression = "&moejit::kern::append_shared<6>";
  return src;
}

// The names in `dir`, sorted.
std::vector<std::string> names_in(const std::string& dir) {
  std::vector<std::string> out;
  for (const auto& e : fs::directory_iterator(dir)) out.push_back(e.path().filename().string());
  std::sort(out.begin(), out.end());
  return out;
}

bool is_symlink(const std::string& path) {
  struct stat st {};
  return ::lstat(path.c_str(), &st) == 0 && S_ISLNK(st.st_mode);
}

// A failure directory that this user owns, holding a symlink at the source's name that points
// at a file outside it (the victim), as another local user would plant it.
struct PlantedLink {
  std::string dir;
  std::string link;
  std::string victim;
};

PlantedLink plant_link(const std::string& root, const GeneratedSource& src, mode_t dir_mode) {
  PlantedLink out;
  out.dir = root + "/moejit-failed";
  out.victim = root + "/victim.txt";
  out.link = out.dir + "/" + src.file_name;
  write_text(out.victim, "precious\n");
  REQUIRE(::mkdir(out.dir.c_str(), 0700) == 0);
  REQUIRE(::chmod(out.dir.c_str(), dir_mode) == 0);
  REQUIRE(::symlink(out.victim.c_str(), out.link.c_str()) == 0);
  return out;
}

}  // namespace

TEST_CASE("a failed source is saved 0600 in a private directory made 0700", "[compile]") {
  moejit::test::TempDir tmp;
  const GeneratedSource src = failed_source();
  const std::string dir = tmp.path() + "/failed/nested";
  std::string why = "stale";
  const std::string saved = save_failed_source(src, dir, &why);
  INFO(why);
  REQUIRE(saved == dir + "/" + src.file_name);
  CHECK(why.empty());
  CHECK(read_text(saved) == src.source);
  struct stat st {};
  REQUIRE(::lstat(saved.c_str(), &st) == 0);
  CHECK(S_ISREG(st.st_mode));
  CHECK((st.st_mode & 0777) == 0600);
  for (const std::string& made : {dir, tmp.path() + "/failed"}) {
    REQUIRE(::lstat(made.c_str(), &st) == 0);
    CHECK((st.st_mode & 0777) == 0700);
  }

  // Saved again (the same kernel failing in a later process): replaced, and no temp file left.
  GeneratedSource again = src;
  again.source += "// second attempt\n";
  CHECK(save_failed_source(again, dir, &why) == saved);
  CHECK(read_text(saved) == again.source);
  CHECK(names_in(dir) == std::vector<std::string>{src.file_name});
}

TEST_CASE("a symlink planted at the source's name is replaced, never followed", "[compile]") {
  moejit::test::TempDir tmp;
  const GeneratedSource src = failed_source();
  const PlantedLink planted = plant_link(tmp.path(), src, 0700);
  std::string why;
  const std::string saved = save_failed_source(src, planted.dir, &why);
  INFO(why);
  CHECK(read_text(planted.victim) == "precious\n");  // the link's target was not written
  REQUIRE(saved == planted.link);
  CHECK_FALSE(is_symlink(saved));  // the link itself was replaced by the saved file
  CHECK(read_text(saved) == src.source);
  CHECK(names_in(planted.dir) == std::vector<std::string>{src.file_name});
}

TEST_CASE("a failure directory others could write, or reach through a link, is refused",
          "[compile]") {
  moejit::test::TempDir tmp;
  const GeneratedSource src = failed_source();

  SECTION("group-writable: another group member could plant the link") {
    const PlantedLink planted = plant_link(tmp.path(), src, 0770);
    std::string why;
    CHECK(save_failed_source(src, planted.dir, &why).empty());
    INFO(why);
    CHECK(contains(why, planted.dir));
    CHECK(contains(why, "writable by group or others (mode 0770)"));
    CHECK(read_text(planted.victim) == "precious\n");
    CHECK(is_symlink(planted.link));
  }

  SECTION("world-writable without the sticky bit") {
    const PlantedLink planted = plant_link(tmp.path(), src, 0703);
    std::string why;
    CHECK(save_failed_source(src, planted.dir, &why).empty());
    CHECK(contains(why, "writable by group or others (mode 0703)"));
    CHECK(read_text(planted.victim) == "precious\n");
  }

  SECTION("the directory itself is a symlink (to a directory of the attacker's choosing)") {
    const std::string target = tmp.path() + "/elsewhere";
    REQUIRE(::mkdir(target.c_str(), 0700) == 0);
    const std::string dir = tmp.path() + "/moejit-failed";
    REQUIRE(::symlink(target.c_str(), dir.c_str()) == 0);
    std::string why;
    CHECK(save_failed_source(src, dir, &why).empty());
    INFO(why);
    CHECK(contains(why, dir + " is a symbolic link"));
    CHECK(names_in(target).empty());
  }

  SECTION("owned by another user") {
    if (::geteuid() != 0) {
      std::cout << "SKIPPED: failure directory owned by another user: needs root to chown it "
                   "(the mode checks above cover the refusal path)"
                << std::endl;
      return;
    }
    const PlantedLink planted = plant_link(tmp.path(), src, 0700);
    if (::lchown(planted.dir.c_str(), 65534, 65534) != 0) {
      std::cout << "SKIPPED: failure directory owned by another user: chown to uid 65534 failed: "
                << std::strerror(errno) << std::endl;
      return;
    }
    std::string why;
    CHECK(save_failed_source(src, planted.dir, &why).empty());
    INFO(why);
    CHECK(contains(why, "owned by uid 65534"));
    CHECK(read_text(planted.victim) == "precious\n");
    CHECK(is_symlink(planted.link));
  }

  SECTION("a path through a regular file: the reason names it with the system's error") {
    write_text(tmp.path() + "/plain", "x");
    std::string why;
    CHECK(save_failed_source(src, tmp.path() + "/plain/failed", &why).empty());
    CHECK(contains(why, tmp.path() + "/plain"));
    CHECK(contains(why, "Not a directory"));
  }

  SECTION("no directory, or a file name that is not a plain name") {
    std::string why;
    CHECK(save_failed_source(src, "", &why).empty());
    CHECK(contains(why, "no failure directory configured"));
    GeneratedSource escaping = src;
    escaping.file_name = "../escape.cu";
    CHECK(save_failed_source(escaping, tmp.path() + "/failed", &why).empty());
    CHECK(contains(why, "'../escape.cu' is not a plain file name"));
    CHECK_FALSE(fs::exists(tmp.path() + "/escape.cu"));
  }
}

// An NVRTC API call that fails, or a cubin the faulting-copy check can't read, is a
// CompileError like a failed compile: it names the kernel, the call or the check, and saves the
// source.
TEST_CASE("an NVRTC call's failure and an unreadable cubin name the kernel and keep its source",
          "[compile]") {
  moejit::test::TempDir tmp;
  const GeneratedSource src = failed_source();
  const std::vector<std::string> options{"--gpu-architecture=sm_90a", "-std=c++17"};
  const std::string dir = tmp.path() + "/failed";
  const std::string saved = dir + "/" + src.file_name;
  // Success passes silently.
  moejit::detail::require_nvrtc(0, "nvrtcGetCUBIN", src, options, "", dir);
  CHECK_FALSE(fs::exists(saved));

  const auto expect_compile_error = [&](const std::function<void()>& call,
                                        const std::vector<std::string>& parts) {
    fs::remove_all(dir);
    try {
      call();
      FAIL("no error");
    } catch (const moejit::CompileError& e) {
      const std::string what = e.what();
      INFO(what);
      CHECK(e.code() == moejit::ErrorCode::kCompileFailed);
      CHECK(e.kernel() == "append_shared_k6_s1_i32_sigmoid_bf16");
      CHECK(e.options() == options);
      CHECK(e.source_path() == saved);
      CHECK(e.log() == "ptxas info");  // the compile's log, where there was one
      CHECK(contains(what, "log (1 of 1 lines"));
      CHECK(contains(what, "could not compile kernel append_shared_k6_s1_i32_sigmoid_bf16"));
      for (const std::string& part : parts) CHECK(contains(what, part));
      CHECK(read_text(saved) == src.source);
    }
  };
  // 2: NVRTC_ERROR_PROGRAM_CREATION_FAILURE.
  expect_compile_error(
      [&] {
        moejit::detail::require_nvrtc(2, "nvrtcCreateProgram", src, options, "ptxas info", dir);
      },
      {"nvrtcCreateProgram failed: NVRTC_ERROR_PROGRAM_CREATION_FAILURE"});
  expect_compile_error(
      [&] {
        moejit::detail::faulting_copies(src,
                                        std::string("\x7f"
                                                    "ELX and more",
                                                    12),
                                        options, "ptxas info", dir);
      },
      {"the cubin NVRTC returned can't be checked", "not a little-endian ELF64 image (12 bytes)"});
}
