// Regular expressions for structured output: a pattern compiles to a DFA over the
// bytes of its UTF-8 text, so that a matcher can follow an answer one byte at a time
// and a token mask can run each token's bytes through a table.
//
// The syntax is ECMAScript's (JSON Schema's `pattern` dialect, and what vLLM's
// guided_regex and SGLang's regex users write): literals, `.`, classes `[...]` with
// ranges and negation, the escapes \d \D \w \W \s \S \t \n \v \f \r \0 \xHH \uHHHH
// \u{H...} \cX and escaped punctuation, groups `(...)`, `(?:...)`, `(?<name>...)`,
// alternation, the quantifiers * + ? {n} {n,} {n,m} (greedy or lazy: the same set of
// texts), and the anchors ^ and $ (not multiline). Refused, naming the construct:
// backreferences, lookahead and lookbehind, \b and \B, \p{...}. Characters are Unicode
// scalar values written as UTF-8 (no surrogates), so every text a DFA takes is valid
// UTF-8.
//
// States that cannot reach a match are pruned: from any live state some text leads
// to a match, so a matcher that only takes live steps can always finish.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string_view>
#include <vector>

namespace troupe::engine {

class ByteDfa {
 public:
  enum class Mode {
    whole,   // the text matches the pattern from its first byte to its last (guided_regex)
    search,  // some part of the text matches (JSON Schema's pattern: ^ and $ anchor it)
  };
  // Throws troupe::Error(invalid_argument) naming what is wrong, or that the pattern
  // needs more than kMaxStates states.
  static std::shared_ptr<const ByteDfa> compile(std::string_view pattern, Mode mode);

  // The product of `parts`: a text is taken where `accept` holds of the parts' acceptance
  // of it (accept[i]: parts[i] accepts). `accept` must not hold where no part accepts: a
  // text every part has left (all dead) is in the product's dead state. Pruned as
  // compile's are; nullptr where no text is taken. Throws where the product needs more
  // than kMaxStates states.
  static std::shared_ptr<const ByteDfa> combine(const std::vector<const ByteDfa*>& parts,
                                                const std::function<bool(const std::vector<bool>&)>& accept);

  static constexpr uint32_t kDead = 0;
  static constexpr uint32_t kMaxStates = 8192;

  uint32_t start() const { return 1; }
  uint32_t next(uint32_t s, uint8_t c) const { return table_[s * classes_ + class_of_[c]]; }
  // Runs the bytes from s (kDead as soon as one breaks the pattern).
  uint32_t run(uint32_t s, std::string_view bytes) const {
    for (char c : bytes) {
      s = next(s, static_cast<uint8_t>(c));
      if (s == kDead) break;
    }
    return s;
  }
  bool accepting(uint32_t s) const { return accepting_[s] != 0; }
  // Whether some byte leads on from s (false: a match that nothing can extend).
  bool extends(uint32_t s) const { return extends_[s] != 0; }
  // The fewest characters (UTF-8 lead bytes) still to come before a match.
  uint32_t min_chars(uint32_t s) const { return min_chars_[s]; }
  uint32_t states() const { return static_cast<uint32_t>(accepting_.size()); }

 private:
  friend class DfaBuilder;
  ByteDfa() = default;
  // Steps into states that cannot reach a match go to kDead; extends_ and min_chars_ from
  // the table and accepting_ (rep: a byte of each class). False where state 1 reaches no match.
  bool prune(const std::vector<uint8_t>& rep);
  uint32_t classes_ = 1;
  uint8_t class_of_[256] = {};
  std::vector<uint32_t> table_;  // states x classes
  std::vector<uint8_t> accepting_, extends_;
  std::vector<uint32_t> min_chars_;
};

}  // namespace troupe::engine
