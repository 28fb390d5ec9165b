// Incremental detokenization for streaming: text comes out as tokens arrive,
// but a character split across tokens is held back until it is complete, so a
// stream of valid text never shows U+FFFD. Concatenating every push() and the
// final finish() gives exactly Tokenizer::decode() of all the ids.
#pragma once

#include <cstdint>
#include <string>

#include "model/tokenizer/tokenizer.hpp"

namespace troupe::tokenizer {

class StreamDecoder {
 public:
  // `tokenizer` must outlive the decoder.
  explicit StreamDecoder(const Tokenizer& tokenizer, DecodeOptions options = {})
      : tokenizer_(tokenizer), options_(options) {}

  // The text that `id` completes (often empty or several characters). Bytes
  // that cannot become valid UTF-8 whatever follows are replaced by U+FFFD
  // right away, as decode() would. Throws troupe::Error for an unknown id.
  std::string push(int32_t id);

  // At the end of the stream: the held-back bytes of an unfinished character,
  // as one U+FFFD (what decode() makes of them), or "" when none.
  std::string finish();

  // Bytes held back now (0..3).
  size_t pending() const { return pending_.size(); }

 private:
  const Tokenizer& tokenizer_;
  DecodeOptions options_;
  std::string pending_;
};

}  // namespace troupe::tokenizer
