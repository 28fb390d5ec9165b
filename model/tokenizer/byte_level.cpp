#include "model/tokenizer/byte_level.hpp"

#include "model/tokenizer/utf8.hpp"

namespace troupe::tokenizer {
namespace {

std::string utf8_of(uint32_t cp) {
  std::string s;
  if (cp < 0x80) {
    s.push_back(static_cast<char>(cp));
  } else {  // the alphabet stays below U+0800
    s.push_back(static_cast<char>(0xC0 | (cp >> 6)));
    s.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
  return s;
}

}  // namespace

ByteLevel::ByteLevel() {
  to_byte_.fill(-1);
  uint32_t next = 256;
  for (uint32_t b = 0; b < 256; ++b) {
    const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
    const uint32_t cp = printable ? b : next++;
    to_text_[b] = utf8_of(cp);
    to_byte_[cp] = static_cast<int16_t>(b);
  }
}

std::optional<std::string> ByteLevel::decode(std::string_view token) const {
  std::string out;
  out.reserve(token.size());
  size_t i = 0;
  while (i < token.size()) {
    const size_t len = utf8_char_length(token.substr(i));
    uint32_t cp;
    const auto* s = reinterpret_cast<const unsigned char*>(token.data() + i);
    if (len == 1) {
      cp = s[0];
    } else if (len == 2) {
      cp = ((s[0] & 0x1Fu) << 6) | (s[1] & 0x3Fu);
    } else {
      return std::nullopt;
    }
    if (cp >= to_byte_.size() || to_byte_[cp] < 0) return std::nullopt;
    out.push_back(static_cast<char>(to_byte_[cp]));
    i += len;
  }
  return out;
}

const ByteLevel& byte_level() {
  static const ByteLevel alphabet;
  return alphabet;
}

}  // namespace troupe::tokenizer
