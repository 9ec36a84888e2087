// The C ABI: every call catches everything, maps the error code to a moejit_status and keeps the
// message for moejit_last_error() on the calling thread.
#include <cctype>
#include <cstddef>
#include <exception>
#include <new>
#include <string>

#include "capi/capi_guard.hpp"
#include "moejit/error.hpp"
#include "moejit/moejit.h"
#include "moejit/ops.hpp"
#include "moejit/runtime.hpp"
#include "moejit/version.hpp"

namespace {

// Why thread_local: each thread reads its own last message, and a success clears only its own.
thread_local std::string last_error;
// A message that needs no allocation, for when storing the real one fails (out of memory):
// moejit_last_error() returns it while it is set.
thread_local const char* fixed_error = nullptr;

moejit_status status_of(moejit::ErrorCode code) {
  switch (code) {
    case moejit::ErrorCode::kInvalidDescriptor: return MOEJIT_ERROR_INVALID_DESCRIPTOR;
    case moejit::ErrorCode::kInvalidArgument: return MOEJIT_ERROR_INVALID_ARGUMENT;
    case moejit::ErrorCode::kUnsupported: return MOEJIT_ERROR_UNSUPPORTED;
    case moejit::ErrorCode::kCompileFailed: return MOEJIT_ERROR_COMPILE_FAILED;
    case moejit::ErrorCode::kCacheCorrupt: return MOEJIT_ERROR_CACHE_CORRUPT;
    case moejit::ErrorCode::kCache: return MOEJIT_ERROR_CACHE;
    case moejit::ErrorCode::kDriver: return MOEJIT_ERROR_DRIVER;
    case moejit::ErrorCode::kCaptureMiss: return MOEJIT_ERROR_CAPTURE_MISS;
    case moejit::ErrorCode::kIo: return MOEJIT_ERROR_IO;
    case moejit::ErrorCode::kInternal: return MOEJIT_ERROR_INTERNAL;
  }
  return MOEJIT_ERROR_INTERNAL;
}

// Records `message` as the C caller reads it (moejit::detail::capi_message); never throws (a
// failed assignment leaves a fixed text).
moejit_status fail(moejit_status status, const char* message,
                   moejit::detail::CapiNames names = {}) noexcept {
  try {
    last_error = moejit::detail::capi_message(message, names);
    fixed_error = nullptr;
  } catch (...) {
    fixed_error = "libmoejit: out of host memory while recording an error";
  }
  return status;
}

// Runs `body`, turning every exception into a status and this thread's message.
template <typename Body>
moejit_status guarded(moejit::detail::CapiNames names, Body&& body) noexcept {
  try {
    body();
    last_error.clear();
    fixed_error = nullptr;
    return MOEJIT_OK;
  } catch (const moejit::Error& e) {
    return fail(status_of(e.code()), e.what(), names);
  } catch (const std::bad_alloc&) {
    return fail(MOEJIT_ERROR_INTERNAL, "out of host memory");
  } catch (const std::exception& e) {
    return fail(MOEJIT_ERROR_INTERNAL, e.what());
  } catch (...) {
    return fail(MOEJIT_ERROR_INTERNAL, "unknown exception inside libmoejit");
  }
}

}  // namespace

std::string moejit::detail::capi_message(const char* message, CapiNames names) {
  std::string text = message;
  if (names.c_call != nullptr && names.cxx_op != nullptr) {
    const std::string prefix = std::string(names.cxx_op) + ": ";
    if (text.compare(0, prefix.size(), prefix) == 0)
      text.replace(0, prefix.size() - 2, names.c_call);
  }
  // A letter, digit or one of "_.-/" next to a path makes it part of a longer word: a shape
  // name, a file path, another field; a quote, part of a quoted name (argument paths are never
  // quoted).
  const auto joins = [](char c) {
    return std::isalnum(static_cast<unsigned char>(c)) != 0 || c == '_' || c == '.' || c == '-' ||
           c == '/' || c == '"' || c == '\'';
  };
  for (const CapiRename* r = names.renames; r != nullptr && r->cxx != nullptr; ++r) {
    const std::string cxx = r->cxx;
    const std::string c = r->c;
    if (cxx.empty()) continue;
    for (std::size_t at = text.find(cxx); at != std::string::npos; at = text.find(cxx, at)) {
      const std::size_t end = at + cxx.size();
      const bool whole = (at == 0 || !joins(text[at - 1])) &&
                         (end == text.size() || !joins(text[end]) ||
                          (text[end] == '.' && (end + 1 == text.size() || !joins(text[end + 1]))));
      if (!whole) {
        at = end;
        continue;
      }
      text.replace(at, cxx.size(), c);
      at += c.size();
    }
  }
  return text;
}

moejit_status moejit::detail::capi_guarded(void (*body)(void*), void* context,
                                           CapiNames names) noexcept {
  return guarded(names, [&] { body(context); });
}

extern "C" {

const char* moejit_last_error(void) {
  return fixed_error != nullptr ? fixed_error : last_error.c_str();
}

const char* moejit_version(void) { return moejit::library_version(); }

moejit_status moejit_set_check_pointers(int on, int* previous) {
  return guarded({}, [&] {
    const bool was = moejit::set_check_pointers(on != 0);
    if (previous != nullptr) *previous = was ? 1 : 0;
  });
}

moejit_status moejit_register_shapes_file(const char* path) {
  return guarded({}, [&] {
    if (path == nullptr) {
      throw moejit::Error(moejit::ErrorCode::kInvalidArgument,
                          "moejit_register_shapes_file: path is null");
    }
    moejit::register_shapes_file(path);
  });
}

moejit_status moejit_register_shapes(const char* json_text, const char* source_name) {
  return guarded({}, [&] {
    if (json_text == nullptr) {
      throw moejit::Error(moejit::ErrorCode::kInvalidArgument,
                          "moejit_register_shapes: json_text: expected shape file text, found "
                          "null");
    }
    moejit::register_shapes(json_text, source_name != nullptr ? source_name : "<text>");
  });
}

moejit_status moejit_append_shared(const DLTensor* topk_ids, const DLTensor* topk_weights,
                                   const DLTensor* shared_logits, DLTensor* out_ids,
                                   DLTensor* out_weights, int64_t shared_base, float scale,
                                   moejit_shared_gate gate, void* stream) {
  return guarded({"moejit_append_shared", "append_shared"}, [&] {
    moejit::AppendSharedArgs args;
    args.topk_ids = topk_ids;
    args.topk_weights = topk_weights;
    args.shared_logits = shared_logits;
    args.out_ids = out_ids;
    args.out_weights = out_weights;
    args.shared_base = shared_base;
    args.scale = scale;
    switch (gate) {
      case MOEJIT_SHARED_SIGMOID: args.gate = moejit::SharedGate::kSigmoid; break;
      case MOEJIT_SHARED_CONSTANT: args.gate = moejit::SharedGate::kConstant; break;
      case MOEJIT_SHARED_GIVEN: args.gate = moejit::SharedGate::kGiven; break;
      default:
        throw moejit::Error(moejit::ErrorCode::kInvalidArgument,
                            "moejit_append_shared: gate: expected MOEJIT_SHARED_SIGMOID (0), "
                            "MOEJIT_SHARED_CONSTANT (1) or MOEJIT_SHARED_GIVEN (2), found " +
                                std::to_string(static_cast<int>(gate)));
    }
    moejit::append_shared(args, static_cast<moejit::Stream>(stream));
  });
}

}  // extern "C"
