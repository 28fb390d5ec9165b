// What a compiled grammar is made of, shared by the code that builds it
// (json_schema.cpp: JSON Schema, choices, regular expressions) and the code that
// follows an answer through it (grammar_step.cpp). Not a public header.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <unordered_set>
#include <vector>

#include "base/utf8_lead.hpp"
#include "engine/json_schema.hpp"
#include "engine/regex.hpp"

namespace troupe::engine {
namespace grammar {

inline constexpr uint16_t kMaxWhitespace = 64;  // consecutive whitespace bytes
inline constexpr uint32_t kMaxNumberBytes = 32;
inline constexpr size_t kMaxDepth = 32;         // frames on a stack
inline constexpr uint32_t kNoFit = 1u << 20;    // Node::depth of a value no stack can hold
inline uint64_t low_bits(size_t n) { return n >= 64 ? ~uint64_t{0} : (uint64_t{1} << n) - 1; }
inline constexpr size_t kMaxStacks = 1024;      // readings of one answer at once (an ambiguous EBNF grammar's)
inline constexpr size_t kMaxNames = 64;         // properties of an object (a 64-bit set of those seen)
inline constexpr size_t kMaxMasks = 512;        // cached masks a grammar (16 KB each at a 129K vocabulary: 8 MB)
inline constexpr uint32_t kNone = std::numeric_limits<uint32_t>::max();

inline bool is_ws(uint8_t c) { return c == ' ' || c == '\n' || c == '\t' || c == '\r'; }
inline bool is_digit(uint8_t c) { return c >= '0' && c <= '9'; }
inline bool is_hex(uint8_t c) { return is_digit(c) || (c >= 'a' && c <= 'f') || (c >= 'A' && c <= 'F'); }

// UTF-8: for a lead byte, how many continuation bytes follow and the range of the
// first of them (the rest are 0x80-0xBF); false for a byte that cannot lead one.
inline bool utf8_lead(uint8_t c, uint32_t& more, uint8_t& lo, uint8_t& hi) {
  const Utf8Lead lead = troupe::utf8_lead(c);
  if (lead.length < 2) return false;
  more = lead.length - 1;
  lo = lead.second_lo;
  hi = lead.second_hi;
  return true;
}

// rule, terminal: an EBNF grammar's (engine/ebnf.cpp).
enum class Kind : uint8_t { object, array, string, number, integer, literal, any_of, rule, terminal };

}  // namespace grammar

struct JsonGrammar::Node {
  grammar::Kind kind = grammar::Kind::any_of;
  // object: property names as they are written after the opening quote (closing
  // quote included), sorted, and each one's value; names required.
  std::vector<std::string> names;
  std::vector<uint32_t> values;
  uint64_t required = 0;
  // object: the string nodes other keys (not names) follow, each with the value its keys
  // take; string: as such a key, that value (kNone: not a key).
  std::vector<uint32_t> keys;
  uint32_t value = grammar::kNone;
  uint32_t items = grammar::kNone;                     // array: items past prefix_items (kNone: none)
  std::vector<uint32_t> prefix_items;         // array: the first items' own schemas
  bool unique = false;                        // array: uniqueItems (its items one literal node; the frame's seen: those used)
  int64_t min_count = 0, max_count = -1;      // array items, object properties, string characters (-1: no bound)
  // number / integer: the value's range (JSON Schema's minimum / maximum and their
  // exclusive forms, as doubles: the value a reader parses from the text is compared).
  bool bounded = false;
  double lo = -std::numeric_limits<double>::infinity(), hi = std::numeric_limits<double>::infinity();
  bool lo_open = false, hi_open = false;
  uint64_t multiple = 0;  // integer: multipleOf (0: none); bounded then, its text kept
  std::shared_ptr<const ByteDfa> pattern;     // string: what its text must match (pattern, format); a regex_grammar()'s text
  std::vector<std::string> texts;             // literal: the values as JSON, compact, sorted
  std::vector<uint32_t> options;              // any_of
  // rule: its alternatives, each a sequence of rules and terminals (names[0]: the
  // rule's name); whether it can match no text. A terminal's text is its pattern.
  std::vector<std::vector<uint32_t>> alts;
  bool nullable = false;
  // rule, terminal: the fewest frames a stack needs to read the shortest text this
  // derives, its own frame included (a repeat's tail takes its rule's place).
  uint32_t need = 0;
  // JSON nodes: the fewest frames a value needs to be written whole, its own included (its
  // required properties' and minItems' values nested in it; kNoFit: none can be within
  // kMaxDepth); object: the most any of its values (named or other keys') needs. A value, key or item is begun only
  // where it fits, so no answer is led into nesting it could not close.
  uint32_t depth = 1;
  uint32_t deepest = 0;
};

namespace grammar {

// One open value (JsonGrammar::Frame). Frames are plain bytes so that a state can be a cache key.
// kRaw: a regex_grammar()'s text, its bytes straight into the pattern.
// kRule: an EBNF rule, in its alternative a at element b; kTerm: a terminal, its pattern in state d.
enum FrameKind : uint8_t { kValue, kObject, kArray, kString, kNumber, kLiteral, kKey, kRaw, kRule, kTerm };
// kObject subs
enum : uint8_t { kObjOpen, kObjKeyNext, kObjInKey, kObjColon, kObjInValue, kObjAfterValue };
// kArray subs
enum : uint8_t { kArrOpen, kArrNext, kArrInValue, kArrAfterValue };
// kString subs
enum : uint8_t { kStrText, kStrEscape, kStrHex, kStrUtf8 };
// kNumber subs (the digits of JSON's number grammar; `whole` ones may end the number)
enum : uint8_t { kNumStart, kNumMinus, kNumZero, kNumInt, kNumDot, kNumFrac, kNumExp, kNumExpSign, kNumExpDigits };
inline bool number_whole(uint8_t sub) { return sub == kNumZero || sub == kNumInt || sub == kNumFrac || sub == kNumExpDigits; }

// A value interval [a, b] (an end open where its flag says) meets the node's range.
bool meets(const JsonGrammar::Node& n, double a, bool a_open, double b, bool b_open);
// Whether some number that begins with `t` (no exponent) lies in the node's range,
// and whether `t` itself does.
bool reachable(const JsonGrammar::Node& n, std::string_view t);
bool in_range(const JsonGrammar::Node& n, std::string_view t);

}  // namespace grammar

struct JsonGrammar::Frame {
  uint32_t node = 0;
  uint8_t kind = grammar::kValue;
  uint8_t sub = 0;
  uint16_t ws = 0;  // whitespace bytes in a row
  // kObject: the key being read or just read (kNone: a free key); kArray: items so
  // far; kString: characters so far (only where the node bounds them); kNumber:
  // bytes so far; kLiteral / kKey: the first text still possible.
  uint32_t a = 0;
  // kObject: the keys read; kLiteral / kKey: one past the last text still possible; kString: in an escape,
  // hex digits read; in a character, continuation bytes still due; kNumber: exponent digits.
  // A bounded number keeps its text, 4 bits a byte, in c, d and seen.
  uint32_t b = 0;
  // kLiteral / kKey: bytes matched; kString in a character: the next byte's range;
  // in a \u escape of a string with a pattern: the hex digits' value so far.
  uint32_t c = 0;
  uint32_t d = 0;       // kString with a pattern, kRaw: the pattern's state (else zero: frames compare as bytes)

  uint64_t seen = 0;    // kObject: the names read
};
static_assert(sizeof(JsonGrammar::Frame) == 32);

struct JsonGrammar::State {
  std::vector<Frame> frames;  // the stacks one after another
  std::vector<uint32_t> ends; // each stack's end in frames
  void clear() {
    frames.clear();
    ends.clear();
  }
  void push(const std::vector<Frame>& s) {
    frames.insert(frames.end(), s.begin(), s.end());
    ends.push_back(static_cast<uint32_t>(frames.size()));
  }
  size_t stacks() const { return ends.size(); }
  std::span<const Frame> stack(size_t i) const {
    const uint32_t begin = i == 0 ? 0 : ends[i - 1];
    return std::span(frames).subspan(begin, ends[i] - begin);
  }
  std::string key() const {
    std::string k(reinterpret_cast<const char*>(frames.data()), frames.size() * sizeof(Frame));
    k.append(reinterpret_cast<const char*>(ends.data()), ends.size() * sizeof(uint32_t));
    return k;
  }
  // Drops stacks equal to an earlier one, in place (the kept ones move down).
  void dedup() {
    if (ends.size() < 2) return;
    thread_local std::unordered_set<std::string_view> kept;
    kept.clear();
    const bool hashed = ends.size() > 8;  // else each stack is compared with the kept ones
    uint32_t w = 0, r = 0, n = 0;         // frames written, frames read, stacks kept
    for (size_t i = 0; i < ends.size(); ++i) {
      const uint32_t len = ends[i] - r;
      const std::string_view bytes(reinterpret_cast<const char*>(frames.data() + r), len * sizeof(Frame));
      bool seen = false;
      if (hashed) {
        seen = kept.contains(bytes);
      } else {
        for (uint32_t j = 0, b = 0; j < n && !seen; b = ends[j++]) {
          seen = ends[j] - b == len && std::memcmp(frames.data() + b, frames.data() + r, len * sizeof(Frame)) == 0;
        }
      }
      r = ends[i];
      if (seen) continue;
      std::copy(frames.begin() + (r - len), frames.begin() + r, frames.begin() + w);  // w <= r - len: a forward copy is safe
      if (hashed) kept.emplace(reinterpret_cast<const char*>(frames.data() + w), len * sizeof(Frame));
      w += len;
      ends[n++] = w;
    }
    frames.resize(w);
    ends.resize(n);
  }
};

namespace grammar {
// An EBNF grammar's rules and terminals, added to `nodes`; returns its root rule. Throws
// troupe::Error(invalid_argument) naming what is wrong (engine/ebnf.cpp).
uint32_t compile_ebnf(std::string_view text, std::vector<JsonGrammar::Node>& nodes);
// The frames a rule's frame needs (counting itself as 1) to read `elements` (the rest of
// one of its alternatives): each goes above it, but a last one that is a rule takes its place.
uint32_t sequence_need(const std::vector<JsonGrammar::Node>& nodes, std::span<const uint32_t> elements);
// A bounded number's text, kept in its frame.
void put_number_byte(JsonGrammar::Frame& f, uint32_t i, uint8_t c);
std::string number_text(const JsonGrammar::Frame& f);
}  // namespace grammar

}  // namespace troupe::engine
