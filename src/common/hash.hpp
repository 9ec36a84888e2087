// Content hashing (XXH3-128) for cache keys and entry verification.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

namespace moejit::detail {

struct Digest {
  uint64_t high = 0;
  uint64_t low = 0;
  std::string hex() const;  // 32 lowercase hex digits
  friend bool operator==(const Digest& a, const Digest& b) {
    return a.high == b.high && a.low == b.low;
  }
};

Digest hash_bytes(const void* data, std::size_t size);
inline Digest hash_bytes(std::string_view s) { return hash_bytes(s.data(), s.size()); }

// Streaming hasher. Each field added is length-prefixed, so ("ab","c") != ("a","bc").
class Hasher {
 public:
  Hasher();
  ~Hasher();
  Hasher(const Hasher&) = delete;
  Hasher& operator=(const Hasher&) = delete;
  Hasher& field(std::string_view bytes);
  Hasher& field(int64_t value);
  Digest digest() const;

 private:
  void* state_;  // XXH3_state_t
};

}  // namespace moejit::detail
