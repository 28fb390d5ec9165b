// UTF-8 facts the tokenizer needs: where input stops being valid, how many
// trailing bytes are an unfinished character, and Hugging Face's lossy decode.
#pragma once

#include <cstddef>
#include <optional>
#include <string>
#include <string_view>

namespace troupe::tokenizer {

// The first byte offset at which `text` is not well-formed UTF-8 (overlong
// forms, surrogates and code points above U+10FFFF count as invalid), or
// nullopt when all of it is valid.
std::optional<size_t> find_invalid_utf8(std::string_view text);

// How many bytes at the end of `bytes` are a proper prefix of a well-formed
// character (0..3): bytes that a later token may still complete.
size_t incomplete_utf8_tail(std::string_view bytes);

// Appends `bytes` to `out`, replacing each maximal ill-formed subpart with
// U+FFFD: the same text Rust's String::from_utf8_lossy (and so the Hugging
// Face ByteLevel decoder) produces.
void append_utf8_lossy(std::string_view bytes, std::string& out);

// The length (1..4) of the well-formed character at the start of `bytes`, or 0
// when the bytes there are not a complete well-formed character.
size_t utf8_char_length(std::string_view bytes);

}  // namespace troupe::tokenizer
