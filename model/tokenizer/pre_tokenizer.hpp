// The pre-tokenizer of a byte-level BPE tokenizer.json: a sequence of regex
// Splits (and optionally ByteLevel's own GPT-2 regex) that cuts text into
// pieces; BPE then runs inside each piece independently.
#pragma once

#include <nlohmann/json_fwd.hpp>
#include <string_view>
#include <vector>

#include "model/tokenizer/regex.hpp"

namespace troupe::tokenizer {

// A piece: bytes [begin, end) of the text given to split().
struct Span {
  size_t begin = 0, end = 0;
};

class PreTokenizer {
 public:
  // Reads tokenizer.json's "pre_tokenizer" (null means: one piece). Throws
  // troupe::Error(unsupported) for pre-tokenizers this implementation lacks.
  static PreTokenizer from_json(const nlohmann::json& j);

  // Every step runs on each piece the previous step produced, as Hugging Face
  // does: a lookahead never sees past the end of its piece. `text` must be
  // valid UTF-8. Pieces are in order, non-empty and tile the text unless a
  // step removes matches.
  std::vector<Span> split(std::string_view text) const;

  // Whether a ByteLevel step is present (the BPE vocabulary is then byte-level).
  bool byte_level() const { return byte_level_; }

 private:
  enum class Behavior { isolated, removed };
  struct Step {
    Regex regex;
    Behavior behavior;
  };
  std::vector<Step> steps_;
  bool byte_level_ = false;
};

}  // namespace troupe::tokenizer
