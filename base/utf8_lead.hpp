// UTF-8 lead bytes, by the Unicode well-formedness table (3-7): what the tokenizer's
// decoder and the structured-output matcher both need to know of a character's first byte.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string_view>

namespace troupe {

struct Utf8Lead {
  uint32_t length = 0;             // bytes of the whole character; 0: not a lead byte
  uint8_t second_lo = 0x80;        // the range of the second byte (no overlong forms,
  uint8_t second_hi = 0xBF;        // surrogates or code points past U+10FFFF); later ones 0x80-0xBF
};

inline Utf8Lead utf8_lead(uint8_t b) {
  if (b < 0x80) return {1, 0x80, 0xBF};
  if (b >= 0xC2 && b <= 0xDF) return {2, 0x80, 0xBF};
  if (b >= 0xE0 && b <= 0xEF) return {3, static_cast<uint8_t>(b == 0xE0 ? 0xA0 : 0x80), static_cast<uint8_t>(b == 0xED ? 0x9F : 0xBF)};
  if (b >= 0xF0 && b <= 0xF4) return {4, static_cast<uint8_t>(b == 0xF0 ? 0x90 : 0x80), static_cast<uint8_t>(b == 0xF4 ? 0x8F : 0xBF)};
  return {};
}

// The well-formed character at text[i], moving i past it; nullopt (i unmoved) where the
// bytes there are not one (a stray continuation byte, an overlong form, a surrogate, a
// code point past U+10FFFF, a character cut short).
inline std::optional<uint32_t> next_code_point(std::string_view text, size_t& i) {
  if (i >= text.size()) return std::nullopt;
  const auto b = static_cast<uint8_t>(text[i]);
  const Utf8Lead lead = utf8_lead(b);
  if (lead.length == 0 || i + lead.length > text.size()) return std::nullopt;
  uint32_t cp = lead.length == 1 ? b : b & (0x7Fu >> lead.length);
  for (uint32_t k = 1; k < lead.length; ++k) {
    const auto c = static_cast<uint8_t>(text[i + k]);
    if (c < (k == 1 ? lead.second_lo : 0x80) || c > (k == 1 ? lead.second_hi : 0xBF)) return std::nullopt;
    cp = cp << 6 | (c & 0x3Fu);
  }
  i += lead.length;
  return cp;
}

}  // namespace troupe
