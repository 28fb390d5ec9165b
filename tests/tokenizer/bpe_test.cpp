// The building blocks: both merge loops agree, merges apply lowest rank and
// leftmost first, and regexes are translated from Oniguruma faithfully.
#include "model/tokenizer/bpe.hpp"

#include <gtest/gtest.h>

#include <random>

#include "base/error.hpp"
#include "model/tokenizer/regex.hpp"

namespace troupe::tokenizer {
namespace {

// A toy vocabulary over "abcd": ids 0..3 are the letters, each merge makes a new id.
struct Toy {
  std::array<int32_t, 256> byte_ids;
  std::vector<Bpe::Merge> merges;
  Toy(uint32_t seed, int n) {
    byte_ids.fill(-1);
    for (int c = 0; c < 4; ++c) byte_ids['a' + c] = c;
    std::mt19937 rng(seed);
    int32_t next = 4;
    for (int i = 0; i < n; ++i) {
      std::uniform_int_distribution<int32_t> pick(0, next - 1);
      merges.push_back({pick(rng), pick(rng), next++});
    }
  }
};

TEST(TokenizerBpe, scanning_and_heap_merge_loops_agree) {
  for (uint32_t seed = 1; seed <= 20; ++seed) {
    Toy toy(seed, 60);
    Bpe bpe(toy.byte_ids, toy.merges);
    std::mt19937 rng(seed * 7);
    for (int k = 0; k < 300; ++k) {
      std::string s(std::uniform_int_distribution<int>(1, Bpe::kShortPiece)(rng), 'a');
      for (char& c : s) c = static_cast<char>('a' + std::uniform_int_distribution<int>(0, 3)(rng));
      ASSERT_EQ(bpe.merge_uncached(s, Bpe::Loop::scan), bpe.merge_uncached(s, Bpe::Loop::heap)) << s;
    }
  }
}

TEST(TokenizerBpe, lowest_rank_first_then_leftmost) {
  std::array<int32_t, 256> bytes;
  bytes.fill(-1);
  bytes['a'] = 0;
  bytes['b'] = 1;
  // rank 0: a+a -> 2; rank 1: a+b -> 3; rank 2: 2+3 ("aaab") -> 4
  Bpe bpe(bytes, {{0, 0, 2}, {0, 1, 3}, {2, 3, 4}});
  EXPECT_EQ(bpe.merge_uncached("aaa"), (std::vector<int32_t>{2, 0}));  // leftmost pair first
  EXPECT_EQ(bpe.merge_uncached("aab"), (std::vector<int32_t>{2, 1}));  // a+a outranks a+b
  EXPECT_EQ(bpe.merge_uncached("aaab"), (std::vector<int32_t>{4}));    // then a+b, then 2+3
  EXPECT_EQ(bpe.merge_uncached("ab"), (std::vector<int32_t>{3}));
  EXPECT_EQ(bpe.merge_uncached("xa"), (std::vector<int32_t>{0}));  // a byte without a token is dropped
}

TEST(TokenizerBpe, cached_and_uncached_pieces_agree) {
  Toy toy(5, 80);
  Bpe bpe(toy.byte_ids, toy.merges);
  for (const char* s : {"abcd", "aaaa", "abcdabcd", "dcba", "abcdabcd"}) {
    std::vector<int32_t> out;
    bpe.encode_piece(s, out);
    EXPECT_EQ(out, bpe.merge_uncached(s)) << s;
  }
}

TEST(TokenizerRegex, whitespace_classes_follow_oniguruma) {
  // Oniguruma's \s is Unicode White_Space: U+180E is not in it, U+0085 is.
  Regex space("\\s+", false);
  EXPECT_FALSE(space.find("\xE1\xA0\x8E", 0));  // U+180E
  EXPECT_TRUE(space.find("\xC2\x85", 0));       // U+0085
  EXPECT_TRUE(space.find("\xE3\x80\x80", 0));   // U+3000
  Regex not_space("\\S", false);
  EXPECT_TRUE(not_space.find("\xE1\xA0\x8E", 0));
  EXPECT_EQ(
      translate_oniguruma("[\\s]"),
      "[\\t\\n\\x{0B}\\f\\r \\x{85}\\x{A0}\\x{1680}\\x{2000}-\\x{200A}\\x{2028}\\x{2029}\\x{202F}\\x{205F}\\x{3000}]");
}

TEST(TokenizerRegex, categories_know_unicode_16_like_oniguruma) {
  Regex letter("\\p{L}", false), symbol("[\\p{P}\\p{S}]", false), not_letter("\\P{L}", false);
  EXPECT_TRUE(letter.find("\xE1\xB2\x89", 0));  // U+1C89, a letter since Unicode 16
  EXPECT_FALSE(not_letter.find("\xE1\xB2\x89", 0));
  EXPECT_TRUE(symbol.find("\xE2\xBF\xBC", 0));       // U+2FFC, a symbol since Unicode 15.1
  EXPECT_FALSE(letter.find("\xF0\x90\xA5\x80", 0));  // U+10940: Unicode 17, unknown to both engines
  EXPECT_TRUE(letter.find("a", 0));
}

TEST(TokenizerRegex, escapes_that_differ_between_engines_are_refused) {
  EXPECT_THROW(Regex("\\w+", false), Error);
  EXPECT_THROW(Regex("\\h", false), Error);
  EXPECT_THROW(Regex("[^\\S]", false), Error);
  EXPECT_THROW(Regex("(", false), Error);
}

TEST(TokenizerRegex, lookahead_stays_inside_the_subject) {
  Regex r("\\s+(?!\\S)", false);
  auto m = r.find("   x", 0);
  ASSERT_TRUE(m);
  EXPECT_EQ(m->begin, 0u);
  EXPECT_EQ(m->end, 2u);  // the last space stays with x
  m = r.find(std::string_view("   x").substr(0, 3), 0);
  ASSERT_TRUE(m);
  EXPECT_EQ(m->end, 3u);  // the piece ends before x: nothing follows the spaces
}

}  // namespace
}  // namespace troupe::tokenizer

namespace troupe::tokenizer {
namespace {

TEST(TokenizerRegex, a_whitespace_run_of_megabytes_still_matches) {
  // \s*[\r\n]+ backtracks over the whole run once: past PCRE2's default match
  // limit (10M steps) unless the limit grows with the piece.
  Regex r("\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+", false);
  const std::string run(12'000'000, ' ');
  auto m = r.find(run, 0);
  ASSERT_TRUE(m);
  EXPECT_EQ(m->begin, 0u);
  EXPECT_EQ(m->end, run.size());
}

}  // namespace
}  // namespace troupe::tokenizer
