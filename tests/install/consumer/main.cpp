// Built against the installed package only: parses an inline shape, generates the source of its
// append_shared kernel and compiles it (in memory) from the kernel templates embedded in the
// library.
#include <iostream>
#include <moejit/moejit.hpp>
#include <string>
#include <vector>

namespace {

const char* kShapes = R"({
  "shapes": [
    {
      "name": "consumer-moe",
      "num_experts": 64,
      "top_k": 8,
      "hidden": 3584,
      "intermediate": 2560,
      "activation": {"kind": "swiglu"},
      "shared_experts": {"count": 1, "intermediate": 20480, "gate": "sigmoid", "logit_dtype": "bf16"}
    }
  ]
})";

}  // namespace

int main() {
  try {
    // The installed shared library is the one this program was built against.
    if (std::string(moejit::library_version()) != moejit::kVersionString) {
      std::cerr << "consumer: built against libmoejit " << moejit::kVersionString
                << " but loaded " << moejit::library_version() << "\n";
      return 1;
    }
    std::vector<moejit::ModelShape> shapes = moejit::parse_shapes(kShapes, "consumer.json");
    if (shapes.size() != 1 || shapes[0].name != "consumer-moe") {
      std::cerr << "consumer: expected one shape named consumer-moe, got " << shapes.size() << "\n";
      return 1;
    }
    moejit::RuntimeConfig config = moejit::RuntimeConfig::from_environment();
    config.cache_mode = moejit::CacheMode::kMemoryOnly;
    moejit::configure(config);
    const moejit::Arch arch = moejit::Arch::parse("sm_90a");
    int generated = 0;
    for (const moejit::KernelSpec& spec : moejit::plan_kernels(shapes[0], arch)) {
      if (spec.family != moejit::Family::kAppendShared) continue;
      const std::string reason = moejit::supports(spec);
      if (!reason.empty()) {
        std::cerr << "consumer: " << spec.display_name() << " unsupported: " << reason << "\n";
        return 1;
      }
      const std::string source = moejit::kernel_source(spec);
      if (source.empty() || source.find("append_shared") == std::string::npos) {
        std::cerr << "consumer: kernel_source(" << spec.display_name()
                  << ") returned no append_shared source\n";
        return 1;
      }
      std::cout << "consumer: " << spec.display_name() << ": " << source.size()
                << " bytes of source (libmoejit " << moejit::kVersionString << ")\n";
      // NVRTC resolves the source's includes from the templates embedded in the library; in
      // memory mode nothing is written anywhere.
      const moejit::BuildResult built = moejit::build_kernel(spec);
      std::cout << "consumer: compiled " << spec.display_name() << " in " << built.milliseconds
                << " ms\n";
      ++generated;
    }
    if (generated == 0) {
      std::cerr << "consumer: the shape planned no append_shared kernel\n";
      return 1;
    }
  } catch (const moejit::Error& e) {
    std::cerr << "consumer: error [" << moejit::error_code_name(e.code()) << "]: " << e.what()
              << "\n";
    return 1;
  }
  return 0;
}
