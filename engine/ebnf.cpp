// EBNF grammars (vLLM's guided_grammar, SGLang's ebnf: the GBNF dialect llama.cpp and
// xgrammar read) compiled into grammar nodes: rules of alternatives of sequences,
// whose terminals (quoted text, character classes, '.') are byte-level DFAs.
//
//   root   ::= answer ("," ws answer)*
//   answer ::= "yes" | "no" | [0-9]+    # a comment
//   ws     ::= [ \t\n]*
//
// Groups ( ), quantifiers ? * + {m} {m,} {m,n}; a rule may span lines (the next one
// starts at `name ::=`). The answer starts at `root`. Refused, naming the rule: a
// reference to no rule, left recursion (a rule that can reach itself before reading a
// byte, which a matcher would expand for ever), a repeat of something that can be empty.
#include <fmt/format.h>

#include <algorithm>
#include <map>
#include <set>

#include "base/error.hpp"
#include "engine/grammar_parts.hpp"

namespace troupe::engine::grammar {

namespace {

constexpr size_t kMaxNodes = 20'000;
constexpr int kMaxRepeat = 256;
constexpr int kMaxGroupNesting = 128;

using Node = JsonGrammar::Node;

class EbnfParser {
 public:
  EbnfParser(std::string_view text, std::vector<Node>& nodes) : t_(text), nodes_(nodes) {}

  uint32_t parse() {
    skip();
    while (i_ < t_.size()) {
      const size_t at = i_;
      const std::string name = identifier();
      if (name.empty()) fail(at, "a rule must start with a name and '::='");
      skip();
      if (!t_.substr(i_).starts_with("::=")) fail(i_, fmt::format("'::=' after the rule name '{}'", name));
      i_ += 3;
      const uint32_t id = rule_id(name);
      if (defined_.count(name)) fail(at, fmt::format("the rule '{}' is defined twice", name));
      defined_.insert(name);
      nodes_[id].alts = alternatives();
      skip();
    }
    for (const auto& [name, id] : ids_) {
      if (!defined_.count(name)) fail(t_.size(), fmt::format("the rule '{}' is used but not defined", name));
    }
    const auto root = ids_.find("root");
    if (root == ids_.end()) fail(0, "there is no rule 'root' (where the answer starts)");
    return root->second;
  }

 private:
  [[noreturn]] void fail(size_t at, const std::string& why) const {
    size_t line = 1;
    for (size_t k = 0; k < at && k < t_.size(); ++k) line += t_[k] == '\n';
    raise(ErrorCode::invalid_argument, "grammar line {}: {}", line, why);
  }

  // Whitespace, newlines and # comments.
  void skip() {
    while (i_ < t_.size()) {
      if (t_[i_] == '#') {
        while (i_ < t_.size() && t_[i_] != '\n') ++i_;
      } else if (t_[i_] == ' ' || t_[i_] == '\t' || t_[i_] == '\n' || t_[i_] == '\r') {
        ++i_;
      } else {
        break;
      }
    }
  }

  static bool name_char(char c) { return std::isalnum(static_cast<unsigned char>(c)) || c == '_' || c == '-' || c == '.'; }

  std::string identifier() {
    const size_t from = i_;
    while (i_ < t_.size() && name_char(t_[i_]) && !(i_ == from && t_[i_] == '.')) ++i_;
    return std::string(t_.substr(from, i_ - from));
  }

  // Whether a new rule (`name ::=`) starts here.
  bool rule_ahead() const {
    size_t j = i_;
    while (j < t_.size() && name_char(t_[j])) ++j;
    if (j == i_) return false;
    while (j < t_.size() && (t_[j] == ' ' || t_[j] == '\t' || t_[j] == '\n' || t_[j] == '\r')) ++j;
    return t_.substr(j).starts_with("::=");
  }

  uint32_t add(Node n) {
    if (nodes_.size() >= kMaxNodes) fail(i_, fmt::format("the grammar needs more than {} parts", kMaxNodes));
    nodes_.push_back(std::move(n));
    return static_cast<uint32_t>(nodes_.size() - 1);
  }
  uint32_t new_rule(std::vector<std::vector<uint32_t>> alts, std::string name) {
    Node n;
    n.kind = Kind::rule;
    n.alts = std::move(alts);
    n.names = {std::move(name)};
    return add(std::move(n));
  }
  uint32_t rule_id(const std::string& name) {
    if (auto it = ids_.find(name); it != ids_.end()) return it->second;
    const uint32_t id = new_rule({}, name);
    ids_[name] = id;
    return id;
  }
  uint32_t terminal(const std::string& regex, size_t at) {
    Node n;
    n.kind = Kind::terminal;
    try {
      n.pattern = ByteDfa::compile(regex, ByteDfa::Mode::whole);
    } catch (const Error& e) {
      fail(at, e.what());
    }
    return add(std::move(n));
  }

  std::vector<std::vector<uint32_t>> alternatives() {
    std::vector<std::vector<uint32_t>> alts{sequence()};
    while (i_ < t_.size() && t_[i_] == '|') {
      ++i_;
      alts.push_back(sequence());
    }
    return alts;
  }

  std::vector<uint32_t> sequence() {
    std::vector<uint32_t> items;
    for (;;) {
      skip();
      if (i_ >= t_.size() || t_[i_] == '|' || t_[i_] == ')' || rule_ahead()) return items;
      const size_t at = i_;
      uint32_t e = element();
      e = quantified(e, at);
      if (e != kNone) items.push_back(e);
    }
  }

  // One quoted character (after its backslash, if any) as a code point.
  uint32_t quoted_char(size_t at) {
    if (i_ >= t_.size()) fail(at, "an unclosed string");
    const auto b = static_cast<uint8_t>(t_[i_]);
    if (b != '\\') {
      const auto cp = next_code_point(t_, i_);
      if (!cp) fail(i_, "the grammar is not valid UTF-8");
      return *cp;
    }
    if (++i_ >= t_.size()) fail(at, "a trailing backslash");
    const char c = t_[i_++];
    auto hex = [&](size_t digits) {
      uint32_t v = 0;
      for (size_t k = 0; k < digits; ++k, ++i_) {
        if (i_ >= t_.size() || !is_hex(static_cast<uint8_t>(t_[i_]))) fail(i_, fmt::format("\\{} needs {} hex digits", c, digits));
        const char h = t_[i_];
        v = v * 16 + static_cast<uint32_t>(is_digit(static_cast<uint8_t>(h)) ? h - '0' : (h | 0x20) - 'a' + 10);
      }
      if (v > 0x10FFFF || (v >= 0xD800 && v <= 0xDFFF)) fail(i_, "an escape that is no Unicode scalar value");
      return v;
    };
    switch (c) {
      case 'n': return '\n';
      case 'r': return '\r';
      case 't': return '\t';
      case 'x': return hex(2);
      case 'u': return hex(4);
      case 'U': return hex(8);
      default: return static_cast<uint8_t>(c);  // \\ \" \' \] \[ \- ...
    }
  }

  uint32_t element() {
    const size_t at = i_;
    const char c = t_[i_];
    if (c == '"' || c == '\'') {  // text: one terminal; "" is nothing
      ++i_;
      std::string regex;
      while (i_ < t_.size() && t_[i_] != c) regex += fmt::format("\\u{{{:X}}}", quoted_char(at));
      if (i_ >= t_.size()) fail(at, "an unclosed string");
      ++i_;
      return regex.empty() ? kNone : terminal(regex, at);
    }
    if (c == '[') {  // a character class, as the regex reads it
      ++i_;
      std::string regex = "[";
      if (i_ < t_.size() && t_[i_] == '^') {
        regex += '^';
        ++i_;
      }
      while (i_ < t_.size() && t_[i_] != ']') {
        const bool dash = t_[i_] == '-';
        if (dash) {
          regex += '-';
          ++i_;
          continue;
        }
        regex += fmt::format("\\u{{{:X}}}", quoted_char(at));
      }
      if (i_ >= t_.size()) fail(at, "an unclosed '['");
      ++i_;
      return terminal(regex + "]", at);
    }
    if (c == '.') {
      ++i_;
      return terminal("[\\s\\S]", at);
    }
    if (c == '(') {
      ++i_;
      if (++depth_ > kMaxGroupNesting) fail(at, fmt::format("groups nest deeper than {}", kMaxGroupNesting));
      auto alts = alternatives();
      --depth_;
      skip();
      if (i_ >= t_.size() || t_[i_] != ')') fail(at, "an unclosed '('");
      ++i_;
      return new_rule(std::move(alts), "(group)");
    }
    const std::string name = identifier();
    if (name.empty()) fail(at, fmt::format("unexpected '{}'", c));
    return rule_id(name);
  }

  uint32_t quantified(uint32_t e, size_t at) {
    for (;;) {
      if (i_ >= t_.size()) return e;
      const char c = t_[i_];
      int lo = 0, hi = -1;
      if (c == '*') {
        ++i_;
      } else if (c == '+') {
        ++i_;
        lo = 1;
      } else if (c == '?') {
        ++i_;
        hi = 1;
      } else if (c == '{') {
        ++i_;
        auto number = [&]() {
          int v = 0;
          const size_t from = i_;
          while (i_ < t_.size() && is_digit(static_cast<uint8_t>(t_[i_]))) v = std::min(v * 10 + (t_[i_++] - '0'), kMaxRepeat + 1);
          if (i_ == from) fail(at, "a repeat {m,n} needs numbers");
          return v;
        };
        lo = hi = number();
        if (i_ < t_.size() && t_[i_] == ',') {
          ++i_;
          hi = i_ < t_.size() && t_[i_] == '}' ? -1 : number();
        }
        if (i_ >= t_.size() || t_[i_] != '}') fail(at, "an unclosed '{'");
        ++i_;
        if (lo > kMaxRepeat || hi > kMaxRepeat) fail(at, fmt::format("a repeat count above {}", kMaxRepeat));
        if (hi >= 0 && hi < lo) fail(at, "a repeat {m,n} with n below m");
      } else {
        return e;
      }
      if (e == kNone) continue;  // a repeat of "" is ""
      e = repeat(e, lo, hi);
    }
  }

  // e{lo,hi} (hi -1: no bound) as rules: lo copies, then a tail.
  uint32_t repeat(uint32_t e, int lo, int hi) {
    uint32_t tail = kNone;
    if (hi < 0) {  // T ::= e T | ""
      tail = new_rule({}, "(repeat)");
      nodes_[tail].alts = {{e, tail}, {}};
    } else {
      for (int k = lo; k < hi; ++k) {  // T ::= e T' | "" (the last: e | "")
        tail = new_rule(tail == kNone ? std::vector<std::vector<uint32_t>>{{e}, {}} : std::vector<std::vector<uint32_t>>{{e, tail}, {}},
                        "(repeat)");
      }
    }
    std::vector<uint32_t> seq(static_cast<size_t>(lo), e);
    if (tail != kNone) seq.push_back(tail);
    return new_rule({seq}, "(repeat)");
  }

  std::string_view t_;
  size_t i_ = 0;
  std::vector<Node>& nodes_;
  std::map<std::string, uint32_t> ids_;
  std::set<std::string> defined_;
  int depth_ = 0;  // groups open
};

}  // namespace

uint32_t sequence_need(const std::vector<JsonGrammar::Node>& nodes, std::span<const uint32_t> elements) {
  uint32_t v = 1;  // the rule's own frame
  for (size_t j = 0; j < elements.size(); ++j) {
    const JsonGrammar::Node& e = nodes[elements[j]];
    const bool tail = j + 1 == elements.size() && e.kind == Kind::rule;
    v = std::max(v, tail ? e.need : 1 + e.need);  // a tail rule takes the frame's place; others go above it
  }
  return v;
}

uint32_t compile_ebnf(std::string_view text, std::vector<Node>& nodes) {
  const size_t first = nodes.size();
  const uint32_t root = EbnfParser(text, nodes).parse();
  // Which rules can be empty (a fixed point), then left recursion: an edge from a rule
  // to each rule it can start with, past empty ones; a cycle would never read a byte.
  for (bool changed = true; changed;) {
    changed = false;
    for (size_t i = first; i < nodes.size(); ++i) {
      Node& n = nodes[i];
      if (n.kind != Kind::rule || n.nullable) continue;
      for (const auto& alt : n.alts) {
        if (std::all_of(alt.begin(), alt.end(), [&](uint32_t e) { return nodes[e].nullable; })) {
          n.nullable = true;
          changed = true;
          break;
        }
      }
    }
  }
  for (size_t i = first; i < nodes.size(); ++i) {  // T ::= e T | "" with e empty: a repeat of something that can be empty
    const Node& n = nodes[i];
    if (n.kind == Kind::rule && n.names[0] == "(repeat)" && n.alts.size() == 2 && n.alts[0].size() == 2 && n.alts[0][1] == i &&
        nodes[n.alts[0][0]].nullable) {
      raise(ErrorCode::invalid_argument, "grammar: a repeat (* or +) of something that can be empty");
    }
  }
  // The frames each rule needs to read its shortest text (a fixed point from "none").
  constexpr uint32_t kFar = std::numeric_limits<uint32_t>::max() / 2;
  for (size_t i = first; i < nodes.size(); ++i) nodes[i].need = nodes[i].kind == Kind::terminal ? 1 : kFar;
  for (bool changed = true; changed;) {
    changed = false;
    for (size_t i = first; i < nodes.size(); ++i) {
      Node& n = nodes[i];
      if (n.kind != Kind::rule) continue;
      for (const auto& alt : n.alts) {
        const uint32_t v = sequence_need(nodes, alt);
        if (v < n.need) {
          n.need = v;
          changed = true;
        }
      }
    }
  }
  if (nodes[root].need >= kFar) raise(ErrorCode::invalid_argument, "grammar: the rule 'root' derives no text (every way on recurses)");
  if (nodes[root].need > kMaxDepth) {
    raise(ErrorCode::invalid_argument, "grammar: the shortest text nests deeper than {} levels", kMaxDepth);
  }
  std::vector<uint8_t> mark(nodes.size(), 0);  // 0 unvisited, 1 on the path, 2 done
  struct Visit {
    uint32_t rule;
    size_t alt = 0, element = 0;
  };
  for (size_t i = first; i < nodes.size(); ++i) {  // depth first, on a stack of its own (grammars can be long)
    if (nodes[i].kind != Kind::rule || mark[i] != 0) continue;
    std::vector<Visit> path{{static_cast<uint32_t>(i)}};
    mark[i] = 1;
    while (!path.empty()) {
      Visit& v = path.back();
      const auto& alts = nodes[v.rule].alts;
      if (v.alt == alts.size()) {
        mark[v.rule] = 2;
        path.pop_back();
        continue;
      }
      if (v.element == alts[v.alt].size()) {
        ++v.alt;
        v.element = 0;
        continue;
      }
      const uint32_t e = alts[v.alt][v.element];
      if (nodes[e].nullable) {  // the rule can start with what follows e too
        ++v.element;
      } else {
        ++v.alt;
        v.element = 0;
      }
      if (nodes[e].kind != Kind::rule) continue;
      if (mark[e] == 1) {
        raise(ErrorCode::invalid_argument, "grammar: the rule '{}' reaches itself before reading a byte (left recursion)",
              nodes[e].names[0]);
      }
      if (mark[e] == 0) {
        mark[e] = 1;
        path.push_back({e});
      }
    }
  }
  return root;
}

}  // namespace troupe::engine::grammar
