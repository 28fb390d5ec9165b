// Added tokens (tokenizer.json "added_tokens"): strings such as "<｜User｜>"
// that are never split by BPE. When a caller asks for them to be parsed, they
// are cut out of the text first, leftmost-longest, as Hugging Face does: the
// tokens marked normalized=false in a first pass, the others in the pieces
// left between those.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace troupe::tokenizer {

struct AddedToken {
  std::string content;
  int32_t id = -1;
  bool special = false;     // removed by decode(skip_special)
  bool normalized = false;  // matched in the second pass
};

// A run of the text: either plain text or one added token.
struct Segment {
  size_t begin = 0, end = 0;
  int32_t token = -1;  // -1: plain text
};

class AddedVocabulary {
 public:
  explicit AddedVocabulary(std::vector<AddedToken> tokens);
  AddedVocabulary(const AddedVocabulary&) = delete;  // the matchers point into tokens_

  // Cuts every added token out of `text`; what remains is plain text.
  std::vector<Segment> split(std::string_view text) const;

  const std::vector<AddedToken>& tokens() const { return tokens_; }

 private:
  // One matcher per pass: candidates by first byte, longest first.
  struct Pass {
    std::array<std::vector<const AddedToken*>, 256> by_first_byte;
    bool any = false;
  };
  void cut(const Pass& pass, std::string_view text, size_t begin, size_t end, std::vector<Segment>& out) const;

  std::vector<AddedToken> tokens_;
  Pass raw_, normalized_;
};

}  // namespace troupe::tokenizer
