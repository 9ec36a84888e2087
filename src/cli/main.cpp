// `moejit`: prewarm the kernel cache, inspect and maintain it, print generated source, diagnose.
#include <CLI/CLI.hpp>
#include <iostream>
#include <string>
#include <thread>
#include <vector>

#include "cli/cli.hpp"
#include "moejit/error.hpp"
#include "moejit/version.hpp"

namespace {

int default_jobs() {
  unsigned n = std::thread::hardware_concurrency();
  return n == 0 ? 1 : static_cast<int>(n);
}

}  // namespace

int main(int argc, char** argv) {
  using namespace moejit::cli;

  CLI::App app{"moejit: JIT kernel cache tool for libmoejit (prewarm, inspect, maintain)",
               "moejit"};
  app.footer(help_footer());
  app.set_version_flag("--version", std::string("libmoejit ") + moejit::kVersionString);
  app.require_subcommand(1);
  app.fallthrough(false);

  // prewarm
  std::vector<std::string> prewarm_files;
  std::vector<std::string> prewarm_archs;
  int prewarm_jobs = default_jobs();
  CLI::App* prewarm = app.add_subcommand(
      "prewarm",
      "Compile every kernel the shapes in FILE... need into the cache (MOEJIT_CACHE_DIR). Every "
      "file is validated before anything compiles; kernels already cached are not recompiled.");
  prewarm->add_option("files", prewarm_files, "Shape files (JSON, see tools/shapes/schema.json)")
      ->required();
  prewarm
      ->add_option("--arch", prewarm_archs,
                   "Target archs, comma separated (e.g. sm_90a,sm_100a). Default: the archs of the "
                   "visible GPUs; on a machine without a GPU it must be given. May be repeated.")
      ->delimiter(',')
      // Why: one value per --arch, so `--arch sm_90a a.json b.json` leaves both files to FILE...
      // (by default a vector option takes every argument up to the next flag).
      ->allow_extra_args(false);
  prewarm
      ->add_option("-j,--jobs", prewarm_jobs,
                   "Parallel compiles (default: hardware threads, " + std::to_string(prewarm_jobs) +
                       " here)")
      ->check(CLI::Range(1, 65536));
  bool prewarm_readable = false;
  prewarm->add_flag(
      "--readable", prewarm_readable,
      "Afterwards make the cache readable by every user, writable only by its owner (it is "
      "created private): for a cache prewarmed as root into an image and read by a service user");
  prewarm->footer(help_footer());

  // source
  std::string source_file;
  std::string source_shape;
  std::string source_kernel;
  std::string source_arch = "sm_90a";
  CLI::App* source = app.add_subcommand(
      "source", "Print the generated CUDA translation unit of one kernel of a shape.");
  source->add_option("file", source_file, "Shape file holding the shape")->required();
  source->add_option("--shape", source_shape, "Name of the shape in FILE")->required();
  source->add_option("--kernel", source_kernel, "Kernel family, e.g. append_shared")->required();
  source->add_option("--arch", source_arch, "Target arch (default sm_90a)");
  source->footer(help_footer());

  // plan
  std::string plan_file;
  std::string plan_shape;
  std::string plan_arch = "sm_90a";
  CLI::App* plan = app.add_subcommand(
      "plan",
      "Print what each shape in FILE runs, without compiling: repacked weight and workspace "
      "sizes, whether decode_moe serves it, and per range of T the kernels moe_forward "
      "launches (the automatic path, and the path a call can force).");
  plan->add_option("file", plan_file, "Shape file (JSON, see tools/shapes/schema.json)")
      ->required();
  plan->add_option("--shape", plan_shape, "Only the shape of this name (default: every shape)");
  plan->add_option("--arch", plan_arch, "Target arch (default sm_90a)");
  plan->footer(help_footer());

  // list / verify / gc / clear
  CLI::App* list = app.add_subcommand(
      "list", "List cache entries: kernel, arch, size, last used, compile time.");
  list->footer(help_footer());
  CLI::App* verify = app.add_subcommand(
      "verify",
      "Verify every cache entry (size and content hash); corrupt ones are quarantined. Exit 1 if "
      "any was bad.");
  verify->footer(help_footer());
  std::string gc_max_size;
  CLI::App* gc = app.add_subcommand(
      "gc", "Remove least recently used entries until the cache fits in --max-size.");
  gc->add_option("--max-size", gc_max_size,
                 "Size limit: bytes, or with a K/M/G/T suffix (powers of 1024), e.g. 500M, 2G")
      ->required();
  gc->footer(help_footer());
  CLI::App* clear = app.add_subcommand("clear", "Remove every cache entry.");
  clear->footer(help_footer());

  // doctor
  CLI::App* doctor = app.add_subcommand(
      "doctor",
      "Report the library version, CUDA driver, GPUs and their arch, NVRTC (its version and "
      "library, and whether it compiles), and the cache (dir, mode, writable, entries, size).");
  doctor->footer(help_footer());

  // Why before parsing: CLI11 answers an unknown first word, command or option, with only "A
  // subcommand is required"; name it, and the commands.
  if (argc > 1) {
    const std::string first = argv[1];
    std::string names;
    bool known = first == "-h" || first == "--help" || first == "--version";
    for (const CLI::App* sub : app.get_subcommands([](CLI::App*) { return true; })) {
      names += (names.empty() ? "" : ", ") + sub->get_name();
      known = known || first == sub->get_name();
    }
    if (!known) {
      std::cerr << "moejit: unknown " << (first.rfind('-', 0) == 0 ? "option" : "command")
                << " '" << first << "'; the commands are " << names
                << " (moejit --help, moejit COMMAND --help)\n";
      return kExitUsage;
    }
  }

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    int code = app.exit(e);
    // Why: CLI11's own codes (105, 106, 109...) are not ours; every parse problem is a usage
    // error, while --help and --version succeed.
    return code == 0 ? kExitOk : kExitUsage;
  }

  try {
    if (prewarm->parsed()) {
      return run_prewarm(prewarm_files, prewarm_archs, prewarm_jobs, prewarm_readable);
    }
    if (source->parsed()) return run_source(source_file, source_shape, source_kernel, source_arch);
    if (plan->parsed()) return run_plan(plan_file, plan_shape, plan_arch);
    if (list->parsed()) return run_list();
    if (verify->parsed()) return run_verify();
    if (gc->parsed()) return run_gc(gc_max_size);
    if (clear->parsed()) return run_clear();
    if (doctor->parsed()) return run_doctor();
  } catch (const Failure& f) {
    std::cerr << "moejit: " << f.message << "\n";
    return f.exit_code;
  } catch (const moejit::Error& e) {
    std::cerr << "moejit: error [" << moejit::error_code_name(e.code()) << "]: " << e.what()
              << "\n";
    return exit_code_for(e.code());
  } catch (const std::exception& e) {
    std::cerr << "moejit: error [internal]: " << e.what() << "\n";
    return kExitWorkFailed;
  }
  std::cerr << "moejit: no subcommand ran (a bug in the CLI)\n";
  return kExitUsage;
}
