// The C ABI's prewarm (moejit::prewarm): what an engine that binds from Python calls when it loads
// a model, before it captures CUDA graphs.
#include <chrono>
#include <functional>
#include <string>
#include <vector>

#include "capi/capi_guard.hpp"
#include "capi/capi_struct.hpp"
#include "moejit/error.hpp"
#include "moejit/moejit.h"
#include "moejit/runtime.hpp"
#include "runtime/runtime_impl.hpp"  // detail::outcome_word, failures_text

namespace {

using moejit::Error;
using moejit::ErrorCode;

constexpr const char* kCall = "moejit_prewarm";

std::vector<moejit::ModelShape> shapes_named(const char* const* names, size_t count) {
  if (names == nullptr || count == 0) {
    const std::string found = names == nullptr ? "null" : "a count of 0";
    throw Error(ErrorCode::kInvalidArgument,
                std::string(kCall) +
                    ": shape_names: expected at least one registered shape name, found " + found);
  }
  // Why no reserve(count): a count past the array (a caller's underflow, say) would fail as an
  // allocation, an internal error naming nothing, before the names are read.
  std::vector<moejit::ModelShape> shapes;
  for (size_t i = 0; i < count; ++i) {
    const std::string where = std::string(kCall) + ": shape_names[" + std::to_string(i) + "]";
    if (names[i] == nullptr) {
      throw Error(ErrorCode::kInvalidArgument,
                  where + ": expected a registered shape's name, found null (shape_count is " +
                      std::to_string(count) + ")");
    }
    try {
      shapes.push_back(moejit::registered_shape(names[i]));
    } catch (const Error& e) {
      throw Error(e.code(), where + ": " + e.what());
    }
  }
  return shapes;
}

moejit::Arch arch_named(const char* arch) {
  if (arch != nullptr) {
    try {
      return moejit::Arch::parse(arch);
    } catch (const Error& e) {
      throw Error(e.code(), std::string(kCall) + ": arch: " + e.what());
    }
  }
  try {
    return moejit::current_arch();
  } catch (const Error& e) {
    throw Error(e.code(), std::string(kCall) +
                              ": arch: null asks for the current CUDA context's device, but " +
                              e.what() + "; or name the arch, e.g. \"sm_90a\"");
  }
}

}  // namespace

extern "C" {

moejit_status moejit_prewarm(const char* const* shape_names, size_t shape_count, const char* arch,
                             int jobs, moejit_prewarm_progress progress, void* user_data,
                             moejit_prewarm_result* result) {
  // Why the names: moejit::prewarm's own errors ("prewarm: arch ...") then read as this call's.
  return moejit::detail::capi_call({kCall, "prewarm"}, [&] {
    const auto start = std::chrono::steady_clock::now();
    if (result != nullptr) moejit::detail::struct_out(kCall, "result", result, {});
    if (jobs < 0) {
      throw Error(ErrorCode::kInvalidArgument,
                  std::string(kCall) +
                      ": jobs: expected 0 (one per hardware thread) or more, found " +
                      std::to_string(jobs));
    }
    const std::vector<moejit::ModelShape> shapes = shapes_named(shape_names, shape_count);
    const moejit::Arch target = arch_named(arch);

    std::function<void(const moejit::BuildResult&, std::size_t, std::size_t)> report;
    if (progress != nullptr) {
      report = [progress, user_data](const moejit::BuildResult& r, std::size_t done,
                                     std::size_t total) {
        const std::string name = r.spec.display_name();
        progress(name.c_str(), moejit::detail::outcome_word(r), r.milliseconds, done, total,
                 user_data);
      };
    }
    const std::vector<moejit::BuildResult> results =
        moejit::prewarm(shapes, {target}, jobs, report);

    moejit_prewarm_result counts{};
    counts.kernels = results.size();
    for (const moejit::BuildResult& r : results) {
      if (!r.error.empty()) {
        ++counts.failed;
      } else if (r.outcome == moejit::CacheOutcome::kCompiled) {
        ++counts.compiled;
      } else if (r.outcome == moejit::CacheOutcome::kCompiledNotStored) {
        ++counts.not_stored;
      } else {
        ++counts.cached;
      }
    }
    counts.milliseconds =
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
    if (result != nullptr) moejit::detail::struct_out(kCall, "result", result, counts);
    if (counts.failed > 0) {
      std::string failures = moejit::detail::failures_text(results);
      failures.pop_back();  // the last line's newline
      throw Error(ErrorCode::kCompileFailed,
                  std::string(kCall) + ": " + std::to_string(counts.failed) + " of " +
                      std::to_string(results.size()) +
                      " kernel(s) failed" +
                      (counts.failed < results.size() ? " (the others are ready)" : "") + ":\n" +
                      failures);
    }
  });
}

}  // extern "C"
