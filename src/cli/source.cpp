// `moejit source FILE --shape NAME --kernel FAMILY [--arch ARCH]`: print generated source.
#include <iostream>
#include <string>
#include <vector>

#include "cli/cli.hpp"
#include "moejit/error.hpp"

namespace moejit::cli {

int run_source(const std::string& file, const std::string& shape_name, const std::string& family,
               const std::string& arch_name) {
  std::vector<ModelShape> shapes = load_shape_files({file});
  Family wanted;
  try {
    wanted = parse_family(family);
  } catch (const Error& e) {
    throw Failure{kExitUsage, e.what()};
  }
  const Arch arch = parse_arch_option(arch_name);

  const ModelShape& shape = find_shape(shapes, shape_name, file);
  std::vector<KernelSpec> specs;
  for (const KernelSpec& spec : plan_kernels(shape, arch)) {
    if (spec.family == wanted) specs.push_back(spec);
  }
  if (specs.empty()) {
    throw Failure{kExitUsage, std::string("shape '") + shape_name + "' needs no " +
                                  family_name(wanted) + " kernel on " + arch.name()};
  }
  // Why: generate everything first, so an unsupported spec prints an error, not half an output.
  std::vector<std::string> sources;
  for (const KernelSpec& spec : specs) {
    std::string reason = supports(spec);
    if (!reason.empty()) {
      throw Failure{kExitUsage, spec.display_name() + " is not supported: " + reason};
    }
    sources.push_back(kernel_source(spec));
  }
  for (std::size_t i = 0; i < specs.size(); ++i) {
    if (specs.size() > 1) std::cout << "// ===== " << specs[i].display_name() << "\n";
    std::cout << sources[i];
    if (!sources[i].empty() && sources[i].back() != '\n') std::cout << "\n";
  }
  return kExitOk;
}

}  // namespace moejit::cli
