// The process-wide shape registry: shape files registered at run time by an engine or the CLI.
// All-or-nothing per file; a name is registered once.
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "common/fork.hpp"
#include "common/log.hpp"
#include "descriptor/descriptor.hpp"
#include "moejit/error.hpp"
#include "moejit/runtime.hpp"

namespace moejit {
namespace {

class ShapeRegistry {
 public:
  static ShapeRegistry& instance() {
    // Why leaked, as the runtime is: ops may run from threads that outlive static destruction.
    static ShapeRegistry* registry = new ShapeRegistry;
    return *registry;
  }

  std::vector<std::string> add(std::vector<detail::LocatedShape> shapes,
                               const std::string& source_name) {
    std::vector<std::string> names;
    std::lock_guard<std::mutex> lock(mutex_);
    // Why: check every name before inserting any, so a refused file leaves nothing behind.
    for (const detail::LocatedShape& s : shapes) {
      auto it = shapes_.find(s.shape.name);
      if (it == shapes_.end()) continue;
      std::string message = detail::descriptor_message(
          source_name, s.name_line, s.name_column, s.name_pointer,
          "shape \"" + s.shape.name + "\" is already registered (from " + it->second.source + ")",
          "a name not yet registered", "\"" + s.shape.name + "\" (here: " + s.shape.source + ")",
          "rename the shape, or register its file only once");
      throw DescriptorError(message, source_name, s.name_line, s.name_column, s.name_pointer);
    }
    for (detail::LocatedShape& s : shapes) {
      names.push_back(s.shape.name);
      std::string name = s.shape.name;
      shapes_.emplace(std::move(name), std::move(s.shape));
    }
    return names;
  }

  ModelShape get(const std::string& name) const {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = shapes_.find(name);
    if (it != shapes_.end()) return it->second;
    if (shapes_.empty()) {
      throw Error(ErrorCode::kInvalidArgument,
                  "no shape named \"" + name + "\": no shapes are registered; register a shape "
                  "file first (register_shapes_file)");
    }
    std::vector<std::string> known;
    for (const auto& entry : shapes_) known.push_back(entry.first);
    throw Error(ErrorCode::kInvalidArgument,
                "no shape named \"" + name +
                    "\" is registered; registered: " + detail::listed_names(known));
  }

  std::vector<std::string> names() const {
    std::lock_guard<std::mutex> lock(mutex_);
    std::vector<std::string> out;
    out.reserve(shapes_.size());
    for (const auto& entry : shapes_) out.push_back(entry.first);
    return out;
  }

 private:
  // Why: a fork must not copy the table's mutex locked (it is a leaf: nothing is taken under it).
  ShapeRegistry() { detail::hold_across_fork_last(&mutex_); }
  mutable std::mutex mutex_;
  std::map<std::string, ModelShape> shapes_;  // sorted, so listings are stable
};

}  // namespace

std::vector<std::string> register_shapes(const std::string& text, const std::string& source_name) {
  // Parsing happens outside the lock: it is the slow part and touches nothing shared.
  std::vector<detail::LocatedShape> shapes = detail::parse_shapes_located(text, source_name);
  std::vector<std::string> names = ShapeRegistry::instance().add(std::move(shapes), source_name);
  detail::log().debug("registered {} shape(s) from {}", names.size(), source_name);
  return names;
}

std::vector<std::string> register_shapes_file(const std::string& path) {
  return register_shapes(detail::read_shapes_text(path), path);
}

ModelShape registered_shape(const std::string& name) {
  return ShapeRegistry::instance().get(name);
}

std::vector<std::string> registered_shape_names() { return ShapeRegistry::instance().names(); }

}  // namespace moejit
