// GPT-2's byte-level alphabet: every byte is shown as one printable code point
// (printable ASCII and Latin-1 map to themselves, the rest to U+0100..U+0143),
// so BPE vocabularies and merges are strings of these code points.
#pragma once

#include <array>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

namespace troupe::tokenizer {

class ByteLevel {
 public:
  ByteLevel();

  // The UTF-8 of the code point that stands for byte `b`.
  const std::string& encode(uint8_t b) const { return to_text_[b]; }

  // The bytes a vocabulary string stands for, or nullopt when one of its code
  // points is not in the alphabet (added tokens such as "<｜User｜>").
  std::optional<std::string> decode(std::string_view token) const;

 private:
  std::array<std::string, 256> to_text_;
  std::array<int16_t, 0x144> to_byte_;  // code point -> byte, -1 where none
};

// The one alphabet, built once.
const ByteLevel& byte_level();

}  // namespace troupe::tokenizer
