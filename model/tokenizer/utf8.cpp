#include "model/tokenizer/utf8.hpp"

#include <cstdint>

#include "base/utf8_lead.hpp"

namespace troupe::tokenizer {
namespace {

// The Unicode "maximal subpart" rules (Table 3-7, well-formed byte sequences):
// how many bytes of a sequence starting at `s` are a valid prefix, and whether
// that prefix is a whole character. `n` bytes are available.
struct Prefix {
  size_t valid = 0;   // bytes that are a valid (possibly partial) prefix
  size_t needed = 0;  // bytes a whole character starting here needs (0: lead byte invalid)
};

Prefix scan(const unsigned char* s, size_t n) {
  const Utf8Lead lead = utf8_lead(s[0]);
  const size_t need = lead.length;
  if (need == 0) return {0, 0};
  if (need == 1) return {1, 1};
  const unsigned char lo = lead.second_lo, hi = lead.second_hi;  // allowed range of the second byte
  size_t valid = 1;
  for (size_t i = 1; i < need && i < n; ++i) {
    const unsigned char b = s[i];
    const unsigned char l = i == 1 ? lo : 0x80, h = i == 1 ? hi : 0xBF;
    if (b < l || b > h) break;
    ++valid;
  }
  return {valid, need};
}

}  // namespace

size_t utf8_char_length(std::string_view bytes) {
  if (bytes.empty()) return 0;
  auto p = scan(reinterpret_cast<const unsigned char*>(bytes.data()), bytes.size());
  return p.needed != 0 && p.valid == p.needed ? p.needed : 0;
}

std::optional<size_t> find_invalid_utf8(std::string_view text) {
  const auto* s = reinterpret_cast<const unsigned char*>(text.data());
  const size_t n = text.size();
  size_t i = 0;
  while (i < n) {
    // ASCII runs dominate most text: skip them eight bytes at a time.
    while (i + 8 <= n) {
      uint64_t w;
      __builtin_memcpy(&w, s + i, 8);
      if (w & 0x8080808080808080ull) break;
      i += 8;
    }
    if (i >= n) break;
    if (s[i] < 0x80) {
      ++i;
      continue;
    }
    auto p = scan(s + i, n - i);
    if (p.needed == 0 || p.valid != p.needed) return i;
    i += p.needed;
  }
  return std::nullopt;
}

size_t incomplete_utf8_tail(std::string_view bytes) {
  const auto* s = reinterpret_cast<const unsigned char*>(bytes.data());
  const size_t n = bytes.size();
  // A partial character is at most 3 bytes: look for its lead byte.
  for (size_t back = 1; back <= 3 && back <= n; ++back) {
    const unsigned char b = s[n - back];
    if ((b & 0xC0) == 0x80) continue;  // continuation byte: keep looking
    auto p = scan(s + n - back, back);
    return p.needed > back && p.valid == back ? back : 0;
  }
  return 0;
}

void append_utf8_lossy(std::string_view bytes, std::string& out) {
  static constexpr std::string_view kReplacement = "\xEF\xBF\xBD";
  const auto* s = reinterpret_cast<const unsigned char*>(bytes.data());
  const size_t n = bytes.size();
  size_t i = 0, run = 0;  // [run, i) is valid text not yet appended
  while (i < n) {
    if (s[i] < 0x80) {
      ++i;
      continue;
    }
    auto p = scan(s + i, n - i);
    if (p.needed != 0 && p.valid == p.needed) {
      i += p.needed;
      continue;
    }
    out.append(bytes.substr(run, i - run));
    out.append(kReplacement);
    i += p.valid == 0 ? 1 : p.valid;
    run = i;
  }
  out.append(bytes.substr(run));
}

}  // namespace troupe::tokenizer
