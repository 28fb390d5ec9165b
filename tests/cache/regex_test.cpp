// Regular expressions for structured output (engine/regex.hpp): the DFA against
// std::regex (ECMAScript) on random ASCII patterns and texts, UTF-8 classes, what
// it refuses, and the invariants the matcher relies on (every live state can still
// reach a match; min_chars counts the characters to the nearest one).
#include <gtest/gtest.h>

#include <functional>

#include <random>
#include <regex>
#include <set>
#include <string>
#include <vector>

#include "base/error.hpp"
#include "engine/regex.hpp"

namespace troupe::engine {
namespace {

bool dfa_takes(const ByteDfa& d, const std::string& text) {
  const uint32_t s = d.run(d.start(), text);
  return s != ByteDfa::kDead && d.accepting(s);
}

// A random pattern of ECMAScript constructs both engines read alike.
std::string random_pattern(std::mt19937_64& rng, int depth) {
  auto pick = [&](int n) { return static_cast<int>(rng() % static_cast<uint64_t>(n)); };
  static const char* const kAtoms[] = {"a", "b", "c", "1", "-", ".", "[ab]", "[^a]", "[a-c]", "[^\\n1]", "\\d", "\\D",
                                       "\\w", "\\W", "\\s", "\\S", "\\-", "[-b]", "\\x61", "\\u0062", "[\\d-]"};
  static const char* const kQuantifiers[] = {"*", "+", "?", "{2}", "{1,2}", "{0,}", "{2,3}?", "*?", "{0,1}"};
  const int kind = depth <= 0 ? 0 : pick(7);
  switch (kind) {
    case 1: return random_pattern(rng, depth - 1) + random_pattern(rng, depth - 1);
    case 2: return "(" + random_pattern(rng, depth - 1) + "|" + random_pattern(rng, depth - 1) + ")";
    case 3: return "(?:" + random_pattern(rng, depth - 1) + ")" + kQuantifiers[pick(9)];
    case 4: return std::string(kAtoms[pick(21)]) + kQuantifiers[pick(9)];
    case 5: return pick(2) == 0 ? "^" + random_pattern(rng, depth - 1) : random_pattern(rng, depth - 1) + "$";
    default: return kAtoms[pick(21)];
  }
}

TEST(Regex, agrees_with_std_regex_on_random_patterns) {
  std::mt19937_64 rng(5);
  const std::string alphabet = "abc1- \n";
  int patterns = 0, matched_whole = 0, matched_search = 0, checked = 0;
  for (int i = 0; i < 400; ++i) {
    const std::string p = random_pattern(rng, 4);
    std::shared_ptr<const ByteDfa> whole, search;
    try {
      whole = ByteDfa::compile(p, ByteDfa::Mode::whole);
      search = ByteDfa::compile(p, ByteDfa::Mode::search);
    } catch (const Error& e) {
      // Only a pattern no text matches (say, a$b) may be refused.
      ASSERT_NE(std::string(e.what()).find("matches no text"), std::string::npos) << p << ": " << e.what();
      continue;
    }
    ++patterns;
    const std::regex re(p, std::regex::ECMAScript);
    std::set<std::string> texts = {""};
    for (int t = 0; t < 60; ++t) {
      std::string s;
      for (int k = static_cast<int>(rng() % 8); k > 0; --k) s.push_back(alphabet[rng() % alphabet.size()]);
      texts.insert(s);
    }
    for (const auto& s : texts) {
      const bool w = std::regex_match(s, re), f = std::regex_search(s, re);
      ASSERT_EQ(dfa_takes(*whole, s), w) << "whole /" << p << "/ on '" << s << "'";
      ASSERT_EQ(dfa_takes(*search, s), f) << "search /" << p << "/ on '" << s << "'";
      matched_whole += w;
      matched_search += f;
      ++checked;
    }
  }
  EXPECT_GT(patterns, 350);
  EXPECT_GT(matched_whole, checked / 20);  // the comparison is not all "no"
  EXPECT_GT(matched_search, checked / 5);
  EXPECT_LT(matched_search, checked);
}

TEST(Regex, characters_are_utf8_scalar_values) {
  struct Case {
    const char* pattern;
    const char* text;
    bool ok;
  };
  const Case cases[] = {
      {"^.$", "\xC3\xA9", true},                 // é is one character
      {"^.$", "ab", false},
      {"^..$", "\xE2\x82\xAC\xF0\x9F\x98\x80", true},  // € and an emoji
      {"^[\xC3\xA0-\xC3\xA9]+$", "\xC3\xA0\xC3\xA9", true},
      {"^[\xC3\xA0-\xC3\xA9]+$", "a\xC3\xA9", false},
      {"^[^a]$", "\xF0\x9F\x98\x80", true},
      {"^[^a]$", "a", false},
      {"^\\u00e9$", "\xC3\xA9", true},
      {"^\\u{1F600}$", "\xF0\x9F\x98\x80", true},
      {"^\\uD83D\\uDE00$", "\xF0\x9F\x98\x80", true},  // a surrogate pair is one character
      {"^.$", "\n", false},
      {"^\\s$", "\xE3\x80\x80", true},  // U+3000 is ECMAScript white space
      {"^\\S$", "\xE3\x80\x80", false},
      {"^\\w+$", "ab_9", true},
      {"^\\w$", "\xC3\xA9", false},
      {"^[\\b]$", "\b", true},
      {"^\\cJ$", "\n", true},
      {"^a{3}$", "aaa", true},
      {"^a{3}$", "aaaa", false},
      {"^a{2,}$", "aaaaa", true},
      {"^x{,2}$", "x{,2}", true},  // not a quantifier: literal text (Annex B)
      {"^(?<year>[0-9]{4})-[0-9]{2}$", "2026-12", true},
  };
  for (const auto& c : cases) {
    const auto d = ByteDfa::compile(c.pattern, ByteDfa::Mode::search);
    EXPECT_EQ(dfa_takes(*d, c.text), c.ok) << c.pattern << " on " << c.text;
  }
  // No text a DFA takes is invalid UTF-8: never a lone continuation byte, an overlong
  // form, a surrogate or a lead byte past U+10FFFF.
  const auto any = ByteDfa::compile("[^a]*", ByteDfa::Mode::whole);
  for (const char* bad : {"\x80", "\xC0\x80", "\xC1\xBF", "\xE0\x80\x80", "\xED\xA0\x80", "\xF4\x90\x80\x80", "\xF5\x80\x80\x80", "\xC3"}) {
    EXPECT_FALSE(dfa_takes(*any, bad)) << "bytes of length " << std::string(bad).size();
  }
  EXPECT_TRUE(dfa_takes(*any, "\xED\x9F\xBF\xEE\x80\x80\xF4\x8F\xBF\xBF"));  // U+D7FF, U+E000, U+10FFFF
}

TEST(Regex, every_live_state_reaches_a_match_and_counts_its_characters) {
  for (const char* p : {"^[a-c]{2,4}x$", "(ab|a\xC3\xA9)+$", "\\d{3}-\\d{4}", "^(\xE2\x82\xAC|[0-9])*\\.?$", "a.{3}$"}) {
    for (const auto mode : {ByteDfa::Mode::whole, ByteDfa::Mode::search}) {
      const auto d = ByteDfa::compile(p, mode);
      std::vector<uint32_t> todo{d->start()};
      std::set<uint32_t> seen{d->start()};
      while (!todo.empty()) {
        const uint32_t s = todo.back();
        todo.pop_back();
        ASSERT_TRUE(d->accepting(s) || d->extends(s)) << p;
        if (d->accepting(s)) {
          EXPECT_EQ(d->min_chars(s), 0u) << p;
        }
        // min_chars by its definition: the fewest lead bytes over the shortest ways on.
        uint32_t best = UINT32_MAX;
        for (int c = 0; c < 256; ++c) {
          const uint32_t t = d->next(s, static_cast<uint8_t>(c));
          if (t == ByteDfa::kDead) continue;
          best = std::min(best, d->min_chars(t) + (c < 0x80 || c >= 0xC0 ? 1u : 0u));
          if (seen.insert(t).second) todo.push_back(t);
        }
        if (!d->accepting(s)) {
          EXPECT_EQ(d->min_chars(s), best) << p;  // (0 inside a character: its lead byte was counted)
        }
      }
    }
  }
  const auto d = ByteDfa::compile("^[a-c]{2,4}x$", ByteDfa::Mode::search);
  EXPECT_EQ(d->min_chars(d->start()), 3u);
  EXPECT_EQ(d->min_chars(d->run(d->start(), "ab")), 1u);
}

TEST(Regex, combined_patterns_take_what_their_rule_says) {
  // Random patterns two at a time: A and not B, either but not both, neither (of valid UTF-8 text),
  // each against its parts on random texts; the products keep compile's invariants.
  std::mt19937_64 rng(9);
  const auto any = ByteDfa::compile("[\\s\\S]*", ByteDfa::Mode::whole);
  const std::string alphabet = "abc1- \xC3\xA9";
  using Rule = std::function<bool(const std::vector<bool>&)>;
  const Rule rules[] = {[](const std::vector<bool>& v) { return v[0] && v[1] && !v[2]; },
                        [](const std::vector<bool>& v) { return v[0] && v[1] != v[2]; },
                        [](const std::vector<bool>& v) { return v[0] && !v[1] && !v[2]; }};
  int products = 0, taken = 0;
  for (int i = 0; i < 120; ++i) {
    std::shared_ptr<const ByteDfa> a, b;
    try {
      a = ByteDfa::compile(random_pattern(rng, 3), ByteDfa::Mode::search);
      b = ByteDfa::compile(random_pattern(rng, 3), ByteDfa::Mode::search);
    } catch (const Error&) {
      continue;
    }
    for (const auto& rule : rules) {
      const auto c = ByteDfa::combine({any.get(), a.get(), b.get()}, rule);
      for (int t = 0; t < 80; ++t) {
        std::string text;
        const int n = static_cast<int>(rng() % 6);
        for (int k = 0; k < n; ++k) text += alphabet[rng() % alphabet.size()];
        const bool want = rule({dfa_takes(*any, text), dfa_takes(*a, text), dfa_takes(*b, text)});
        const bool got = c && dfa_takes(*c, text);
        ASSERT_EQ(got, want) << "text '" << text << "'";
        taken += got;
      }
      if (!c) continue;
      ++products;
      std::vector<uint32_t> todo{c->start()};  // every state a text reaches can still end in a match
      std::set<uint32_t> seen{c->start()};
      while (!todo.empty()) {
        const uint32_t s = todo.back();
        todo.pop_back();
        ASSERT_TRUE(c->accepting(s) || c->extends(s));
        for (int x = 0; x < 256; ++x) {
          const uint32_t t = c->next(s, static_cast<uint8_t>(x));
          if (t != ByteDfa::kDead && seen.insert(t).second) todo.push_back(t);
        }
      }
    }
  }
  EXPECT_GT(products, 200);
  EXPECT_GT(taken, 2000);
}

TEST(Regex, refuses_what_it_does_not_hold) {
  const std::pair<const char*, const char*> cases[] = {
      {"(?=a)b", "lookahead"},
      {"(?<!a)b", "lookbehind"},
      {"(a)\\1", "backreferences"},
      {"(?<n>a)\\k<n>", "backreferences"},
      {"\\bword", "word boundary"},
      {"\\p{L}", "property"},
      {"a**", "nothing to repeat"},
      {"*a", "nothing to repeat"},
      {"^*", "after an anchor"},
      {"[b-a]", "out of order"},
      {"[a-\\d]", "class escape"},
      {"(ab", "unclosed '('"},
      {"ab)", "unmatched ')'"},
      {"[ab", "unclosed '['"},
      {"a{3,2}", "m below n"},
      {"a{2000}", "above 1000"},
      {"\\", "trailing backslash"},
      {"\\uD800", "lone surrogate"},
      {"[]", "matches no text"},
      {"a$b", "matches no text"},
      {"\xC3", "not valid UTF-8"},
      {"(?x)", "unknown group"},
      {"(a|b)*a(a|b){16}", "more than 8192"},
      {"((a{1000}){1000}){100}", "too large"},
      {"(((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((a", "nest deeper than 128"},
  };
  for (const auto& [p, why] : cases) {
    try {
      ByteDfa::compile(p, ByteDfa::Mode::whole);
      ADD_FAILURE() << p << " compiled";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::invalid_argument);
      EXPECT_NE(std::string(e.what()).find(why), std::string::npos) << p << ": " << e.what();
    }
  }
  EXPECT_NO_THROW(ByteDfa::compile("a{1000}", ByteDfa::Mode::whole));
  EXPECT_THROW(ByteDfa::compile(std::string(200000, '(') + "a" + std::string(200000, ')'), ByteDfa::Mode::whole), Error);  // no stack overflow
}

}  // namespace
}  // namespace troupe::engine
