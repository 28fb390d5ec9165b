// Structured output: answers held to a JSON Schema, token by token.
//
// A schema compiles to a JsonGrammar (a tree of value kinds). A JsonMatcher
// follows one answer through it byte by byte: its state is a set of stacks of
// frames (one per way the bytes so far can still be read; several only where
// anyOf, a type list or an enum leaves the reading open), and the tokens that may
// come next are those whose bytes the state accepts whole. Token masks are cached
// per state in the grammar, so an answer that revisits a state (every property
// of every array element, every token inside a long string) pays once.
//
// What is held: the JSON syntax (RFC 8259; strings valid UTF-8), and of JSON
// Schema: type (a name or a list), properties / required (properties given, even
// none: no others, as OpenAI's strict mode and xgrammar's default, unless
// additionalProperties says), additionalProperties, patternProperties (a key one
// pattern alone matches), propertyNames (a string schema, or an enum of names),
// minProperties / maxProperties, items, prefixItems, minItems / maxItems,
// minLength / maxLength, minimum / maximum / exclusiveMinimum / exclusiveMaximum
// (numbers and integers; a bounded number is written without an exponent, and
// only digits that can still lead into the range are taken), multipleOf (a whole
// number up to 10^9: integers, digits that can still lead to a multiple), pattern (a regular
// expression some part of the string's value matches, engine/regex.hpp; in such a
// string no \u escape of a surrogate is written), format date, time, date-time, uuid,
// ipv4 and email (held where no pattern is given), uniqueItems (items of at most 64
// values: enum, const, boolean), enum, const,
// anyOf / oneOf (oneOf as anyOf), allOf of one schema, $ref into the document
// ($defs, definitions, recursion), nullable. Annotations (title, description,
// default, examples, other formats, discriminator, $schema, $id, $comment, ...) are read
// past. Anything that would narrow the values further (multipleOf by a fraction,
// uniqueItems over other items, propertyNames beside properties, a key two
// patternProperties match, ...) is refused when the schema compiles, naming
// the keyword and where it is: an answer is never claimed to follow a rule that
// was not applied. Bounds that keep a runaway answer finite (and every number a
// double): at most 64 consecutive whitespace bytes, 32 bytes of one number and two
// digits of its exponent, 32 levels of nesting (no key, item or option is begun
// whose value could not close within them), 64 properties an object.
//
// Not thread-safe: a grammar and its matchers belong to one engine thread.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include <nlohmann/json.hpp>

namespace troupe::engine {

// What each token id writes, as the masks see it.
class TokenVocabulary {
 public:
  // bytes[id]: the token's bytes; empty for ids that structured output never
  // samples (special and added tokens, ids the tokenizer does not have).
  explicit TokenVocabulary(std::vector<std::string> bytes);
  int32_t size() const { return static_cast<int32_t>(bytes_.size()); }
  std::string_view bytes(int32_t id) const { return bytes_[static_cast<size_t>(id)]; }
  // Ids in their bytes' order (unsigned; a prefix before what extends it), so that tokens
  // sharing a prefix are neighbours; lcp[i]: how many first bytes ids[i] shares with
  // ids[i - 1] (0 at 0).
  struct Sorted {
    std::vector<int32_t> ids;
    std::vector<uint32_t> lcp;
  };
  // Every id with bytes.
  const Sorted& sorted() const { return sorted_; }
  // The ids with bytes that are not plain_chars() text.
  const Sorted& sorted_not_plain() const { return not_plain_; }
  // How many characters the token writes when it is text a JSON string takes as it is
  // (no quote, backslash or control byte; whole UTF-8 characters), else -1.
  int32_t plain_chars(int32_t id) const { return plain_chars_[static_cast<size_t>(id)]; }

 private:
  std::vector<std::string> bytes_;
  Sorted sorted_, not_plain_;
  std::vector<int32_t> plain_chars_;
};

// Allowed token ids as bits (bit id % 64 of word id / 64).
using TokenMask = std::vector<uint64_t>;

// A grammar text for SamplingParams::json_schema whose answer is exactly one of `texts`
// (raw text, not JSON: vLLM's guided_choice): a tag no JSON text starts with, then the
// texts as a JSON list. The texts must be non-empty.
inline constexpr std::string_view kChoiceTag{"\0choice ", 8};
inline std::string choice_grammar(const std::vector<std::string>& texts) {
  return std::string(kChoiceTag) + nlohmann::json(texts).dump();
}

// A grammar text for SamplingParams::json_schema whose answer is a text the regular
// expression matches whole (raw text, not JSON: vLLM's guided_regex, SGLang's regex;
// the syntax in engine/regex.hpp).
inline constexpr std::string_view kRegexTag{"\0regex  ", 8};
inline std::string regex_grammar(std::string_view pattern) { return std::string(kRegexTag) + std::string(pattern); }

// A grammar text for SamplingParams::json_schema whose answer is a text an EBNF grammar
// derives from its rule `root` (vLLM's guided_grammar, SGLang's ebnf; GBNF syntax:
// engine/ebnf.cpp).
inline constexpr std::string_view kEbnfTag{"\0ebnf   ", 8};
inline std::string ebnf_grammar(std::string_view text) { return std::string(kEbnfTag) + std::string(text); }

class JsonGrammar {
 public:
  // `schema`: a JSON Schema, a choice_grammar(), regex_grammar() or ebnf_grammar(). Throws troupe::Error(invalid_argument)
  // for text that is not JSON, a schema that matches nothing, or a keyword this grammar
  // does not hold (the message names it and its JSON pointer).
  static std::shared_ptr<JsonGrammar> compile(std::string_view schema);
  ~JsonGrammar();

  struct Node;
  struct Frame;
  struct State;

 private:
  friend class JsonMatcher;
  JsonGrammar();
  void step_all(const State& in, uint8_t c, State& out) const;
  void step(std::vector<Frame>& s, uint8_t c, State& out) const;
  void finish_child(std::vector<Frame>& s) const;
  void expand(std::vector<Frame>& s, uint32_t rule, bool tail, uint8_t c, State& out) const;
  bool rules_may_end(std::span<const Frame> stack) const;
  bool rule_fits(size_t below, uint32_t rule, uint32_t alt) const;
  bool accepting(const State& s) const;
  // Whether a value of `node` begun with `below` frames under it can close within kMaxDepth.
  bool fits(size_t below, uint32_t node) const;
  // The names of object `n` whose values would not fit with `below` frames under them.
  uint64_t unfit_names(const Node& n, size_t below) const;
  const TokenMask& mask(const State& s, const TokenVocabulary& vocab);

  std::vector<Node> nodes_;
  uint32_t root_ = 0;
  bool raw_ = false;  // a choice_grammar(), regex_grammar() or ebnf_grammar(): the root is its text from the first byte, no whitespace before
  // Masks by state (the state's frames as bytes), for one vocabulary.
  const TokenVocabulary* mask_vocab_ = nullptr;
  std::unordered_map<std::string, TokenMask> masks_;
};

// One answer's place in a grammar.
class JsonMatcher {
 public:
  explicit JsonMatcher(std::shared_ptr<JsonGrammar> grammar);
  ~JsonMatcher();
  JsonMatcher(const JsonMatcher& other);  // the same place, followed apart from here on
  JsonMatcher& operator=(const JsonMatcher& other);
  JsonMatcher(JsonMatcher&&) noexcept;
  JsonMatcher& operator=(JsonMatcher&&) noexcept;

  // Reads `bytes` on. False when they break the schema: the matcher is then dead.
  bool feed(std::string_view bytes);
  bool dead() const;
  // The answer is one whole value: nothing but its end may follow.
  bool complete() const;
  // Whether the answer may end here, or go on (a number can do both).
  bool may_end() const;
  // The tokens of `vocab` whose bytes the state accepts whole (valid until the
  // next call on this grammar).
  const TokenMask& allowed(const TokenVocabulary& vocab);

 private:
  std::shared_ptr<JsonGrammar> grammar_;
  std::unique_ptr<JsonGrammar::State> state_, next_;
};

// Compiled grammars by schema text, for one engine (bounded: the oldest half goes
// when it is full).
class GrammarCache {
 public:
  std::shared_ptr<JsonGrammar> get(const std::string& schema);

 private:
  std::unordered_map<std::string, std::pair<uint64_t, std::shared_ptr<JsonGrammar>>> grammars_;
  uint64_t uses_ = 0;
};

}  // namespace troupe::engine
