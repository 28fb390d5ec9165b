// UTF-8 lead bytes, by the Unicode well-formedness table (3-7): what the tokenizer's
// decoder and the structured-output matcher both need to know of a character's first byte.
#pragma once

#include <cstdint>

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

}  // namespace troupe
