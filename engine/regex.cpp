#include "engine/regex.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cctype>
#include <deque>
#include <limits>
#include <map>
#include <string>
#include <utility>

#include "base/error.hpp"
#include "base/utf8_lead.hpp"

namespace troupe::engine {

namespace {

constexpr uint32_t kMaxCodePoint = 0x10FFFF;
constexpr size_t kMaxNfaStates = 200'000;
constexpr int kMaxRepeat = 1000;
constexpr int kMaxGroupNesting = 128;

// Code point ranges, inclusive.
using Ranges = std::vector<std::pair<uint32_t, uint32_t>>;

Ranges normalized(Ranges r) {
  std::sort(r.begin(), r.end());
  Ranges out;
  for (const auto& [lo, hi] : r) {
    if (!out.empty() && lo <= out.back().second + 1) {
      out.back().second = std::max(out.back().second, hi);
    } else {
      out.emplace_back(lo, hi);
    }
  }
  return out;
}

Ranges complement(const Ranges& r) {
  Ranges out;
  uint32_t from = 0;
  for (const auto& [lo, hi] : normalized(r)) {
    if (lo > from) out.emplace_back(from, lo - 1);
    from = hi + 1;
  }
  if (from <= kMaxCodePoint) out.emplace_back(from, kMaxCodePoint);
  return out;
}

// The scalar values of r (UTF-8 has no surrogates).
Ranges without_surrogates(const Ranges& r) {
  Ranges out;
  for (const auto& [lo, hi] : normalized(r)) {
    if (hi < 0xD800 || lo > 0xDFFF) {
      out.emplace_back(lo, hi);
      continue;
    }
    if (lo < 0xD800) out.emplace_back(lo, 0xD7FF);
    if (hi > 0xDFFF) out.emplace_back(0xE000, hi);
  }
  return out;
}

Ranges digits() { return {{'0', '9'}}; }
Ranges word() { return normalized({{'0', '9'}, {'A', 'Z'}, {'_', '_'}, {'a', 'z'}}); }
Ranges space() {  // ECMAScript's WhiteSpace and LineTerminator
  return normalized({{0x09, 0x0D}, {0x20, 0x20}, {0xA0, 0xA0}, {0x1680, 0x1680}, {0x2000, 0x200A},
                     {0x2028, 0x2029}, {0x202F, 0x202F}, {0x205F, 0x205F}, {0x3000, 0x3000}, {0xFEFF, 0xFEFF}});
}

std::string encode(uint32_t cp) {
  std::string s;
  if (cp < 0x80) {
    s.push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    s.push_back(static_cast<char>(0xC0 | (cp >> 6)));
    s.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else if (cp < 0x10000) {
    s.push_back(static_cast<char>(0xE0 | (cp >> 12)));
    s.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    s.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else {
    s.push_back(static_cast<char>(0xF0 | (cp >> 18)));
    s.push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
    s.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    s.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
  return s;
}

// The code points lo..hi (scalar values, one encoded length or several) as sequences of
// byte ranges, every combination of a sequence's ranges one of those code points.
using ByteSeq = std::vector<std::pair<uint8_t, uint8_t>>;
void utf8_sequences(uint32_t lo, uint32_t hi, std::vector<ByteSeq>& out) {
  if (lo > hi) return;
  for (uint32_t edge : {0x7Fu, 0x7FFu, 0xFFFFu}) {  // one encoded length at a time
    if (lo <= edge && hi > edge) {
      utf8_sequences(lo, edge, out);
      utf8_sequences(edge + 1, hi, out);
      return;
    }
  }
  const int n = hi < 0x80 ? 1 : hi < 0x800 ? 2 : hi < 0x10000 ? 3 : 4;
  for (int i = 1; i < n; ++i) {  // then split until each trailing byte spans its whole range or a single value
    const uint32_t m = (1u << (6 * i)) - 1;
    if ((lo & ~m) != (hi & ~m)) {
      if ((lo & m) != 0) {
        utf8_sequences(lo, lo | m, out);
        utf8_sequences((lo | m) + 1, hi, out);
        return;
      }
      if ((hi & m) != m) {
        utf8_sequences(lo, (hi & ~m) - 1, out);
        utf8_sequences(hi & ~m, hi, out);
        return;
      }
    }
  }
  const std::string a = encode(lo), b = encode(hi);
  ByteSeq seq;
  for (size_t i = 0; i < a.size(); ++i) seq.emplace_back(static_cast<uint8_t>(a[i]), static_cast<uint8_t>(b[i]));
  out.push_back(std::move(seq));
}

// ---- syntax ---------------------------------------------------------------------------

struct Re {
  enum Kind : uint8_t { empty, set, cat, alt, repeat, bol, eol };
  Kind kind = empty;
  Ranges chars;          // set
  std::vector<Re> kids;  // cat, alt, repeat (one)
  int min = 0, max = -1; // repeat (-1: no bound)
};

class Parser {
 public:
  explicit Parser(std::string_view p) : p_(p) {}

  Re parse() {
    Re r = alternation();
    if (!at_end()) fail("an unmatched ')'");
    return r;
  }

 private:
  [[noreturn]] void fail(const std::string& why) const {
    const std::string shown = p_.size() > 80 ? std::string(p_.substr(0, 77)) + "..." : std::string(p_);
    raise(ErrorCode::invalid_argument, "regex '{}' at offset {}: {}", shown, i_, why);
  }
  bool at_end() const { return i_ >= p_.size(); }
  char peek() const { return p_[i_]; }
  bool ahead(std::string_view s) const { return p_.substr(i_).starts_with(s); }

  // One code point of the pattern's UTF-8 text.
  uint32_t code_point() {
    const auto cp = next_code_point(p_, i_);
    if (!cp) fail("the pattern is not valid UTF-8");
    return *cp;
  }

  static Re one_of(Ranges r) {
    Re x;
    x.kind = Re::set;
    x.chars = normalized(std::move(r));
    return x;
  }

  Re alternation() {
    std::vector<Re> options{concatenation()};
    while (!at_end() && peek() == '|') {
      ++i_;
      options.push_back(concatenation());
    }
    if (options.size() == 1) return std::move(options[0]);
    Re r;
    r.kind = Re::alt;
    r.kids = std::move(options);
    return r;
  }

  Re concatenation() {
    Re r;
    r.kind = Re::cat;
    while (!at_end() && peek() != '|' && peek() != ')') r.kids.push_back(quantified());
    if (r.kids.size() == 1) return std::move(r.kids[0]);
    return r;
  }

  // {n}, {n,} or {n,m} at i_ (moved past it); false, i_ unmoved, where the text is no
  // such quantifier (then '{' is a literal, as ECMAScript's Annex B reads it).
  bool braces(int& lo, int& hi) {
    size_t j = i_ + 1;
    auto number = [&](int& v) {
      const size_t from = j;
      int64_t x = 0;
      while (j < p_.size() && p_[j] >= '0' && p_[j] <= '9') x = std::min<int64_t>(x * 10 + (p_[j++] - '0'), kMaxRepeat + 1);
      v = static_cast<int>(x);
      return j > from;
    };
    if (!number(lo)) return false;
    hi = lo;
    if (j < p_.size() && p_[j] == ',') {
      ++j;
      if (!number(hi)) hi = -1;
    }
    if (j >= p_.size() || p_[j] != '}') return false;
    i_ = j + 1;
    return true;
  }

  bool quantifier_ahead() {
    if (at_end()) return false;
    if (peek() == '*' || peek() == '+' || peek() == '?') return true;
    if (peek() != '{') return false;
    const size_t keep = i_;
    int lo = 0, hi = 0;
    const bool q = braces(lo, hi);
    i_ = keep;
    return q;
  }

  Re quantified() {
    Re a = atom();
    if (!quantifier_ahead()) return a;
    if (a.kind == Re::bol || a.kind == Re::eol) fail("nothing to repeat (a quantifier after an anchor)");
    int lo = 0, hi = -1;
    switch (peek()) {
      case '*': ++i_; break;
      case '+': ++i_; lo = 1; break;
      case '?': ++i_; hi = 1; break;
      default: braces(lo, hi);
    }
    if (!at_end() && peek() == '?') ++i_;  // lazy: the same texts
    if (lo > kMaxRepeat || hi > kMaxRepeat) fail(fmt::format("a repeat count above {}", kMaxRepeat));
    if (hi >= 0 && hi < lo) fail("a repeat {n,m} with m below n");
    if (quantifier_ahead()) fail("nothing to repeat (a quantifier after a quantifier)");
    Re r;
    r.kind = Re::repeat;
    r.min = lo;
    r.max = hi;
    r.kids.push_back(std::move(a));
    return r;
  }

  Re atom() {
    switch (peek()) {
      case '(': {
        ++i_;
        if (ahead("?=") || ahead("?!")) fail("lookahead is not supported");
        if (ahead("?<=") || ahead("?<!")) fail("lookbehind is not supported");
        if (ahead("?:")) {
          i_ += 2;
        } else if (ahead("?<")) {  // a named group: the name does not change the texts
          const size_t close = p_.find('>', i_);
          if (close == std::string_view::npos) fail("an unclosed group name");
          i_ = close + 1;
        } else if (ahead("?")) {
          fail("an unknown group form '(?'");
        }
        if (++depth_ > kMaxGroupNesting) fail(fmt::format("groups nest deeper than {}", kMaxGroupNesting));
        Re r = alternation();
        --depth_;
        if (at_end() || peek() != ')') fail("an unclosed '('");
        ++i_;
        return r;
      }
      case '[':
        return one_of(bracket());
      case '.':
        ++i_;
        return one_of(complement({{'\n', '\n'}, {'\r', '\r'}, {0x2028, 0x2029}}));
      case '^': {
        ++i_;
        Re r;
        r.kind = Re::bol;
        return r;
      }
      case '$': {
        ++i_;
        Re r;
        r.kind = Re::eol;
        return r;
      }
      case '\\': {
        ++i_;
        Ranges r;
        escape(false, r);
        return one_of(std::move(r));
      }
      case '*':
      case '+':
      case '?':
        fail("nothing to repeat");
      case '{':
        if (quantifier_ahead()) fail("nothing to repeat");
        ++i_;
        return one_of({{'{', '{'}});
      default: {
        const uint32_t cp = code_point();
        return one_of({{cp, cp}});
      }
    }
  }

  uint32_t hex(size_t digits, bool& ok) {
    uint32_t v = 0;
    for (size_t k = 0; k < digits; ++k) {
      if (i_ + k >= p_.size() || !std::isxdigit(static_cast<unsigned char>(p_[i_ + k]))) {
        ok = false;
        return 0;
      }
      const char c = p_[i_ + k];
      v = v * 16 + static_cast<uint32_t>(c <= '9' ? c - '0' : (c | 0x20) - 'a' + 10);
    }
    ok = true;
    i_ += digits;
    return v;
  }

  // After a backslash: the characters it stands for, added to r. Returns whether it was
  // one character (a class range may end at it) rather than a class escape.
  bool escape(bool in_class, Ranges& r) {
    if (at_end()) fail("a trailing backslash");
    const char c = peek();
    auto add = [&](uint32_t cp) {
      r.emplace_back(cp, cp);
      return true;
    };
    auto add_set = [&](const Ranges& s) {
      r.insert(r.end(), s.begin(), s.end());
      return false;
    };
    switch (c) {
      case 'd': ++i_; return add_set(digits());
      case 'D': ++i_; return add_set(complement(digits()));
      case 'w': ++i_; return add_set(word());
      case 'W': ++i_; return add_set(complement(word()));
      case 's': ++i_; return add_set(space());
      case 'S': ++i_; return add_set(complement(space()));
      case 't': ++i_; return add('\t');
      case 'n': ++i_; return add('\n');
      case 'v': ++i_; return add('\v');
      case 'f': ++i_; return add('\f');
      case 'r': ++i_; return add('\r');
      case 'b':
        if (!in_class) fail("\\b (a word boundary) is not supported");
        ++i_;
        return add('\b');
      case 'B': fail("\\B (a non-boundary) is not supported");
      case 'p':
      case 'P': fail("Unicode property escapes (\\p{...}) are not supported");
      case 'k': fail("backreferences are not supported");
      case '0':
        ++i_;
        if (!at_end() && peek() >= '0' && peek() <= '9') fail("octal escapes are not supported");
        return add(0);
      case 'c': {
        if (i_ + 1 < p_.size() && std::isalpha(static_cast<unsigned char>(p_[i_ + 1]))) {
          const auto letter = static_cast<uint32_t>(p_[i_ + 1]);
          i_ += 2;
          return add(letter % 32);
        }
        fail("\\c must be followed by a letter");
      }
      case 'x': {
        ++i_;
        bool ok = false;
        const uint32_t v = hex(2, ok);
        return add(ok ? v : 'x');  // Annex B: a lone \x is 'x'
      }
      case 'u': {
        ++i_;
        bool ok = false;
        uint32_t v = 0;
        if (!at_end() && peek() == '{') {
          const size_t keep = i_++;
          const size_t close = p_.find('}', i_);
          if (close != std::string_view::npos && close > i_ && close - i_ <= 6) {
            v = hex(close - i_, ok);
            if (ok) ++i_;
          }
          if (!ok || v > kMaxCodePoint) {
            i_ = keep;
            ok = false;
          }
        } else {
          v = hex(4, ok);
          if (ok && v >= 0xD800 && v <= 0xDBFF && ahead("\\u")) {  // a surrogate pair
            const size_t keep = i_;
            i_ += 2;
            bool ok2 = false;
            const uint32_t low = hex(4, ok2);
            if (ok2 && low >= 0xDC00 && low <= 0xDFFF) {
              v = 0x10000 + ((v - 0xD800) << 10) + (low - 0xDC00);
            } else {
              i_ = keep;
            }
          }
        }
        if (!ok) return add('u');  // Annex B: \u without hex digits is 'u'
        if (v >= 0xD800 && v <= 0xDFFF) fail("a lone surrogate (no UTF-8 text holds one)");
        return add(v);
      }
      default:
        if (c >= '1' && c <= '9') fail("backreferences are not supported");
        return add(code_point());  // an escaped character stands for itself
    }
  }

  Ranges bracket() {
    ++i_;  // '['
    bool negated = false;
    if (!at_end() && peek() == '^') {
      negated = true;
      ++i_;
    }
    Ranges r;
    for (;;) {
      if (at_end()) fail("an unclosed '['");
      if (peek() == ']') {
        ++i_;
        break;
      }
      Ranges first;
      const bool single = class_atom(first);
      if (single && !at_end() && peek() == '-' && i_ + 1 < p_.size() && p_[i_ + 1] != ']') {
        ++i_;
        Ranges last;
        if (!class_atom(last)) fail("a class range ending in a class escape");
        if (last[0].first < first[0].first) fail("a class range out of order");
        r.emplace_back(first[0].first, last[0].first);
      } else {
        r.insert(r.end(), first.begin(), first.end());
      }
    }
    return negated ? complement(r) : normalized(r);
  }

  bool class_atom(Ranges& r) {
    if (peek() == '\\') {
      ++i_;
      return escape(true, r);
    }
    const uint32_t cp = code_point();
    r.emplace_back(cp, cp);
    return true;
  }

  std::string_view p_;
  size_t i_ = 0;
  int depth_ = 0;  // groups open
};

// ---- automata -------------------------------------------------------------------------

struct NfaState {
  struct Edge {
    uint8_t lo, hi;
    uint32_t to;
  };
  std::vector<Edge> bytes;
  std::vector<uint32_t> eps, at_begin, at_end;  // at_begin / at_end: only where the text begins / ends
  bool match = false;
};

class Nfa {
 public:
  struct Frag {
    uint32_t in, out;
  };
  std::vector<NfaState> s;

  uint32_t add() {
    if (s.size() >= kMaxNfaStates) raise(ErrorCode::invalid_argument, "regex: the pattern is too large (over {} automaton states)", kMaxNfaStates);
    s.emplace_back();
    return static_cast<uint32_t>(s.size() - 1);
  }

  Frag emit(const Re& r) {
    switch (r.kind) {
      case Re::empty: {
        const uint32_t a = add();
        return {a, a};
      }
      case Re::set: {
        const uint32_t in = add(), out = add();
        std::vector<ByteSeq> seqs;
        for (const auto& [lo, hi] : without_surrogates(r.chars)) utf8_sequences(lo, hi, seqs);
        for (const auto& seq : seqs) {
          uint32_t at = in;
          for (size_t k = 0; k < seq.size(); ++k) {
            const uint32_t to = k + 1 == seq.size() ? out : add();
            s[at].bytes.push_back({seq[k].first, seq[k].second, to});
            at = to;
          }
        }
        return {in, out};
      }
      case Re::cat: {
        if (r.kids.empty()) return emit(Re{});
        const Frag first = emit(r.kids[0]);
        uint32_t out = first.out;
        for (size_t k = 1; k < r.kids.size(); ++k) {
          const Frag f = emit(r.kids[k]);
          s[out].eps.push_back(f.in);
          out = f.out;
        }
        return {first.in, out};
      }
      case Re::alt: {
        const uint32_t in = add(), out = add();
        for (const Re& k : r.kids) {
          const Frag f = emit(k);
          s[in].eps.push_back(f.in);
          s[f.out].eps.push_back(out);
        }
        return {in, out};
      }
      case Re::bol:
      case Re::eol: {
        const uint32_t in = add(), out = add();
        (r.kind == Re::bol ? s[in].at_begin : s[in].at_end).push_back(out);
        return {in, out};
      }
      case Re::repeat: {
        const uint32_t in = add();
        uint32_t at = in;
        for (int k = 0; k < r.min; ++k) {
          const Frag f = emit(r.kids[0]);
          s[at].eps.push_back(f.in);
          at = f.out;
        }
        if (r.max < 0) {  // then any number more
          const uint32_t loop = add();
          s[at].eps.push_back(loop);
          const Frag f = emit(r.kids[0]);
          s[loop].eps.push_back(f.in);
          s[f.out].eps.push_back(loop);
          return {in, loop};
        }
        const uint32_t end = add();
        for (int k = r.min; k < r.max; ++k) {  // then up to max - min more, each one optional
          s[at].eps.push_back(end);
          const Frag f = emit(r.kids[0]);
          s[at].eps.push_back(f.in);
          at = f.out;
        }
        s[at].eps.push_back(end);
        return {in, end};
      }
    }
    return emit(Re{});
  }
};

}  // namespace

class DfaBuilder {
 public:
  DfaBuilder(const Nfa& nfa, uint32_t start) : n_(nfa), mark_(nfa.s.size(), 0) {
    // Byte classes: bytes no edge tells apart share a column; lead and continuation
    // bytes never share one (min_chars counts lead bytes).
    std::vector<bool> cut(257, false);
    cut[0] = cut[0x80] = cut[0xC0] = cut[256] = true;
    for (const auto& st : n_.s) {
      for (const auto& e : st.bytes) cut[e.lo] = cut[static_cast<size_t>(e.hi) + 1] = true;
    }
    uint32_t k = 0;
    for (size_t b = 0; b < 256; ++b) {
      if (b > 0 && cut[b]) ++k;
      dfa_.class_of_[b] = static_cast<uint8_t>(k);
      if (b == 0 || cut[b]) rep_.push_back(static_cast<uint8_t>(b));
    }
    dfa_.classes_ = k + 1;
    sets_.emplace_back();  // 0: the dead state, every step back to it
    dfa_.table_.assign(dfa_.classes_, ByteDfa::kDead);
    dfa_.accepting_.push_back(0);
    add_state(closure({start}, true), true);
  }

  std::shared_ptr<const ByteDfa> build() {
    for (uint32_t id = 1; id < sets_.size(); ++id) {
      for (uint32_t k = 0; k < dfa_.classes_; ++k) {
        std::vector<uint32_t> move;
        const uint8_t b = rep_[k];
        for (uint32_t q : sets_[id]) {
          for (const auto& e : n_.s[q].bytes) {
            if (e.lo <= b && b <= e.hi) move.push_back(e.to);
          }
        }
        uint32_t to = ByteDfa::kDead;
        if (!move.empty()) {
          auto set = closure(move, false);
          const auto key = std::make_pair(set, false);
          if (auto it = ids_.find(key); it != ids_.end()) {
            to = it->second;
          } else {
            to = add_state(std::move(set), false);
          }
        }
        dfa_.table_[static_cast<size_t>(id) * dfa_.classes_ + k] = to;
      }
    }
    prune();
    return std::shared_ptr<const ByteDfa>(new ByteDfa(std::move(dfa_)));
  }

 private:
  uint32_t add_state(std::vector<uint32_t> set, bool at_start) {
    const auto id = static_cast<uint32_t>(sets_.size());
    if (id >= ByteDfa::kMaxStates) {
      raise(ErrorCode::invalid_argument, "regex: the pattern needs more than {} automaton states (write it with fewer counted or overlapping repeats)",
            ByteDfa::kMaxStates);
    }
    dfa_.accepting_.push_back(accepts(set, at_start) ? 1 : 0);
    dfa_.table_.resize(dfa_.table_.size() + dfa_.classes_, ByteDfa::kDead);
    ids_.emplace(std::make_pair(set, at_start), id);
    sets_.push_back(std::move(set));
    return id;
  }

  // The states reachable without a byte (and through ^ at the text's start), sorted.
  std::vector<uint32_t> closure(const std::vector<uint32_t>& seeds, bool at_start) {
    ++generation_;
    std::vector<uint32_t> out, todo(seeds);
    while (!todo.empty()) {
      const uint32_t q = todo.back();
      todo.pop_back();
      if (mark_[q] == generation_) continue;
      mark_[q] = generation_;
      out.push_back(q);
      for (uint32_t t : n_.s[q].eps) todo.push_back(t);
      if (at_start) {
        for (uint32_t t : n_.s[q].at_begin) todo.push_back(t);
      }
    }
    std::sort(out.begin(), out.end());
    return out;
  }

  // Whether the text may end here: a match through empty steps and $ (and ^ at the start).
  bool accepts(const std::vector<uint32_t>& set, bool at_start) {
    ++generation_;
    std::vector<uint32_t> todo(set);
    while (!todo.empty()) {
      const uint32_t q = todo.back();
      todo.pop_back();
      if (mark_[q] == generation_) continue;
      mark_[q] = generation_;
      if (n_.s[q].match) return true;
      for (uint32_t t : n_.s[q].eps) todo.push_back(t);
      for (uint32_t t : n_.s[q].at_end) todo.push_back(t);
      if (at_start) {
        for (uint32_t t : n_.s[q].at_begin) todo.push_back(t);
      }
    }
    return false;
  }

  void prune() {
    if (!dfa_.prune(rep_)) raise(ErrorCode::invalid_argument, "regex: the pattern matches no text");
  }

  const Nfa& n_;
  ByteDfa dfa_;
  std::vector<uint8_t> rep_;  // a byte of each class
  std::vector<std::vector<uint32_t>> sets_;
  std::map<std::pair<std::vector<uint32_t>, bool>, uint32_t> ids_;
  std::vector<uint32_t> mark_;
  uint32_t generation_ = 0;
};

// Steps into states that cannot reach a match go to the dead state; then each state's
// fewest characters to a match.
bool ByteDfa::prune(const std::vector<uint8_t>& rep) {
  const uint32_t states = static_cast<uint32_t>(accepting_.size());
  const uint32_t classes = classes_;
  auto& table = table_;
  std::vector<std::vector<std::pair<uint32_t, uint32_t>>> from(states);  // (state, class) into each state
  for (uint32_t s = 1; s < states; ++s) {
    for (uint32_t k = 0; k < classes; ++k) {
      const uint32_t t = table[static_cast<size_t>(s) * classes + k];
      if (t != ByteDfa::kDead) from[t].emplace_back(s, k);
    }
  }
  constexpr uint32_t kFar = std::numeric_limits<uint32_t>::max();
  std::vector<uint32_t> dist(states, kFar);
  std::deque<uint32_t> todo;
  for (uint32_t s = 1; s < states; ++s) {
    if (accepting_[s]) {
      dist[s] = 0;
      todo.push_back(s);
    }
  }
  while (!todo.empty()) {  // 0-1 breadth first: a lead byte's step costs a character
    const uint32_t t = todo.front();
    todo.pop_front();
    for (const auto& [s, k] : from[t]) {
      const uint8_t b = rep[k];
      const uint32_t w = b < 0x80 || b >= 0xC0 ? 1 : 0;
      if (dist[t] + w < dist[s]) {
        dist[s] = dist[t] + w;
        if (w == 0) {
          todo.push_front(s);
        } else {
          todo.push_back(s);
        }
      }
    }
  }
  if (dist[1] == kFar) return false;
  extends_.assign(states, 0);
  for (uint32_t s = 1; s < states; ++s) {
    for (uint32_t k = 0; k < classes; ++k) {
      uint32_t& t = table[static_cast<size_t>(s) * classes + k];
      if (dist[t] == kFar) t = ByteDfa::kDead;
      if (t != ByteDfa::kDead) extends_[s] = 1;
    }
  }
  min_chars_ = std::move(dist);
  return true;
}

std::shared_ptr<const ByteDfa> ByteDfa::combine(const std::vector<const ByteDfa*>& parts,
                                                const std::function<bool(const std::vector<bool>&)>& accept) {
  // Byte classes: bytes every part treats alike share one (lead and continuation bytes never do).
  ByteDfa out;
  std::map<std::vector<uint8_t>, uint8_t> class_ids;
  std::vector<uint8_t> rep;
  for (int b = 0; b < 256; ++b) {
    std::vector<uint8_t> key;
    for (const ByteDfa* p : parts) key.push_back(p->class_of_[b]);
    key.push_back(b < 0x80 ? 0 : b < 0xC0 ? 1 : 2);
    auto [it, fresh] = class_ids.emplace(std::move(key), static_cast<uint8_t>(class_ids.size()));
    if (fresh) rep.push_back(static_cast<uint8_t>(b));
    out.class_of_[b] = it->second;
  }
  out.classes_ = static_cast<uint32_t>(class_ids.size());
  // States: tuples of the parts' states, from the starts; 0 is the dead state (every part dead).
  std::map<std::vector<uint32_t>, uint32_t> ids;
  std::vector<std::vector<uint32_t>> tuples;
  auto add = [&](std::vector<uint32_t> t) -> uint32_t {
    if (std::all_of(t.begin(), t.end(), [](uint32_t x) { return x == kDead; })) return kDead;
    if (auto it = ids.find(t); it != ids.end()) return it->second;
    const auto id = static_cast<uint32_t>(tuples.size());
    if (id >= kMaxStates) {
      raise(ErrorCode::invalid_argument, "regex: the combined patterns need more than {} automaton states", kMaxStates);
    }
    std::vector<bool> acc;
    for (size_t i = 0; i < parts.size(); ++i) acc.push_back(parts[i]->accepting(t[i]));
    out.accepting_.push_back(accept(acc) ? 1 : 0);
    out.table_.resize(out.table_.size() + out.classes_, kDead);
    ids.emplace(t, id);
    tuples.push_back(std::move(t));
    return id;
  };
  tuples.emplace_back();  // 0: dead
  out.accepting_.push_back(0);
  out.table_.assign(out.classes_, kDead);
  std::vector<uint32_t> start;
  for (const ByteDfa* p : parts) start.push_back(p->start());
  if (add(start) != 1) return nullptr;  // (every part dead at the start: none is)
  for (uint32_t id = 1; id < tuples.size(); ++id) {
    for (uint32_t k = 0; k < out.classes_; ++k) {
      std::vector<uint32_t> next;
      for (size_t i = 0; i < parts.size(); ++i) next.push_back(parts[i]->next(tuples[id][i], rep[k]));
      const uint32_t to = add(std::move(next));
      out.table_[static_cast<size_t>(id) * out.classes_ + k] = to;
    }
  }
  if (!out.prune(rep)) return nullptr;
  return std::shared_ptr<const ByteDfa>(new ByteDfa(std::move(out)));
}

std::shared_ptr<const ByteDfa> ByteDfa::compile(std::string_view pattern, Mode mode) {
  const Re re = Parser(pattern).parse();
  Nfa nfa;
  const Nfa::Frag body = nfa.emit(re);
  uint32_t start = body.in;
  if (mode == Mode::search) {  // any text, the pattern, any text
    Re any;
    any.kind = Re::set;
    any.chars = {{0, kMaxCodePoint}};
    const uint32_t before = nfa.add();
    const Nfa::Frag a = nfa.emit(any);
    nfa.s[before].eps.push_back(a.in);
    nfa.s[a.out].eps.push_back(before);
    nfa.s[before].eps.push_back(body.in);
    start = before;
    const uint32_t after = nfa.add();
    const Nfa::Frag z = nfa.emit(any);
    nfa.s[body.out].eps.push_back(after);
    nfa.s[after].eps.push_back(z.in);
    nfa.s[z.out].eps.push_back(after);
    nfa.s[after].match = true;
  } else {
    nfa.s[body.out].match = true;
  }
  return DfaBuilder(nfa, start).build();
}

}  // namespace troupe::engine
