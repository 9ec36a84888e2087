// The C ABI's structs that can grow (moejit.h, "structs that can grow"): each starts with
// struct_size, and the library reads or writes only the bytes both the caller's size and its own
// hold.
#pragma once

#include <algorithm>
#include <cstddef>  // offsetof
#include <cstring>
#include <string>

#include "moejit/error.hpp"
#include "moejit/moejit.h"
#include "moejit/version.hpp"

namespace moejit::detail {

// Each struct's name for messages and its first size: its size in libmoejit 0.3.0, the first
// version with struct_size. A field added later goes at the struct's end; kFirstSize stays.
template <typename T>
struct CStruct;
template <>
struct CStruct<moejit_prewarm_result> {
  static constexpr const char* kName = "moejit_prewarm_result";
  static constexpr std::size_t kFirstSize = 56;
};
template <>
struct CStruct<moejit_moe_weight_layout> {
  static constexpr const char* kName = "moejit_moe_weight_layout";
  static constexpr std::size_t kFirstSize = 56;
};
template <>
struct CStruct<moejit_moe_weights> {
  static constexpr const char* kName = "moejit_moe_weights";
  static constexpr std::size_t kFirstSize = 56;
};

// The largest struct_size accepted. Why a cap: a struct_size left unset holds whatever the stack
// held, and for an input the library reads the bytes it claims; no struct will grow near 1 KiB.
inline constexpr std::size_t kMaxStructSize = 1024;

// The caller's struct_size of `arg`, checked: at least the struct's first size, a multiple of 8
// (every such struct holds 8-byte fields), at most kMaxStructSize.
template <typename T>
std::size_t checked_struct_size(const char* call, const char* arg, std::size_t size) {
  static_assert(sizeof(T) >= CStruct<T>::kFirstSize, "a struct only grows");
  if (size >= CStruct<T>::kFirstSize && size % 8 == 0 && size <= kMaxStructSize) return size;
  throw Error(ErrorCode::kInvalidArgument,
              std::string(call) + ": " + arg + "->struct_size: expected sizeof(" +
                  CStruct<T>::kName + ") as the caller's header declares it (" +
                  std::to_string(sizeof(T)) + " in this library's), found " +
                  std::to_string(size) + (size == 0 ? " (left unset?)" : ""));
}

// The caller's input struct at `in` (non-null; its struct_size bytes are the caller's) as this
// library reads it: the fields past the caller's struct_size are 0; a byte set past this
// library's own size is kUnsupported (a field it doesn't know).
template <typename T>
T struct_in(const char* call, const char* arg, const void* in) {
  const auto* bytes = static_cast<const unsigned char*>(in);
  std::size_t size = 0;
  std::memcpy(&size, bytes + offsetof(T, struct_size), sizeof(size));
  size = checked_struct_size<T>(call, arg, size);
  T value{};
  std::memcpy(static_cast<void*>(&value), bytes, std::min(size, sizeof(T)));
  for (std::size_t at = sizeof(T); at < size; ++at) {
    if (bytes[at] != 0) {
      throw Error(ErrorCode::kUnsupported,
                  std::string(call) + ": " + arg + ": byte " + std::to_string(at) + " of " +
                      std::to_string(size) + " is set, past the " + std::to_string(sizeof(T)) +
                      " bytes of " + CStruct<T>::kName + " that libmoejit " + library_version() +
                      " knows: a field this library can't honour (leave it 0, or use a newer "
                      "library), or a struct_size left unset");
    }
  }
  return value;
}

// Writes `value` to the caller's `*out`: the bytes both sizes hold; struct_size becomes their
// count. Bytes past this library's size are left as they were.
template <typename T>
void struct_out(const char* call, const char* arg, T* out, T value) {
  const std::size_t size = checked_struct_size<T>(call, arg, out->struct_size);
  value.struct_size = std::min(size, sizeof(T));
  std::memcpy(static_cast<void*>(out), &value, value.struct_size);
}

}  // namespace moejit::detail
