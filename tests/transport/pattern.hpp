// Deterministic byte patterns for page tests and the test service.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <vector>

namespace troupe::test {

// Deterministic bytes for page tests: byte i of a buffer tagged `seed`.
inline void fill_pattern(std::byte* p, size_t n, uint64_t seed) {
  uint64_t x = seed * 0x9E3779B97F4A7C15ull + 1;
  for (size_t i = 0; i < n; i += 8) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    size_t k = std::min<size_t>(8, n - i);
    std::memcpy(p + i, &x, k);
  }
}
inline bool check_pattern(const std::byte* p, size_t n, uint64_t seed) {
  std::vector<std::byte> want(n);
  fill_pattern(want.data(), n, seed);
  return std::memcmp(want.data(), p, n) == 0;
}

}  // namespace troupe::test
