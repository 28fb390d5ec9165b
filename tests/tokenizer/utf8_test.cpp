// The invalid-UTF-8 policy: encode() refuses it with the offset of the first
// bad byte; decode() replaces ill-formed bytes with U+FFFD like Hugging Face.
#include "model/tokenizer/utf8.hpp"

#include <gtest/gtest.h>

#include "base/error.hpp"
#include "tests/tokenizer/support.hpp"

namespace troupe::tokenizer {
namespace {

using namespace testing;

TEST(TokenizerUtf8, encode_refuses_invalid_utf8_naming_the_offset) {
  const std::vector<std::pair<std::string, size_t>> bad = {
      {"abc\xFF", 3},       {"\x80", 0},
      {"ok \xC3", 3},                                 // stray continuation, truncated
      {"\xC0\xAF", 0},      {"\xE0\x80\xAF", 0},      // overlong forms
      {"x\xED\xA0\x80", 1}, {"\xF4\x90\x80\x80", 0},  // surrogate, above U+10FFFF
      {"日本\xE8\xAA", 6},
  };
  for (const auto& [text, offset] : bad) {
    EXPECT_EQ(find_invalid_utf8(text), offset) << hex(text);
    try {
      deepseek().encode(text);
      ADD_FAILURE() << "no error for " << hex(text);
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::invalid_argument);
      EXPECT_NE(std::string(e.what()).find("offset " + std::to_string(offset)), std::string::npos) << e.what();
    }
  }
}

TEST(TokenizerUtf8, valid_edge_characters_are_accepted) {
  for (std::string text : {std::string("\x7F"), std::string("\xC2\x80"), std::string("\xEF\xBF\xBF"),
                           std::string("\xF4\x8F\xBF\xBF"), std::string("\xED\x9F\xBF"), std::string("\0", 1)}) {
    EXPECT_FALSE(find_invalid_utf8(text)) << hex(text);
    EXPECT_EQ(deepseek().decode(deepseek().encode(text)), text) << hex(text);
  }
}

TEST(TokenizerUtf8, lossy_decoding_replaces_each_maximal_ill_formed_subpart) {
  // The examples of Unicode's "U+FFFD substitution of maximal subparts".
  auto lossy = [](std::string_view s) {
    std::string out;
    append_utf8_lossy(s, out);
    return out;
  };
  const std::string R = "\xEF\xBF\xBD";
  EXPECT_EQ(lossy("a\xF1\x80\x80"
                  "b"),
            "a" + R + "b");                     // truncated 4-byte: one U+FFFD
  EXPECT_EQ(lossy("\xC0\xAF"), R + R);          // invalid lead bytes: one each
  EXPECT_EQ(lossy("\xE0\x80\xAF"), R + R + R);  // overlong: every byte
  EXPECT_EQ(lossy("\xED\xA0\x80"), R + R + R);  // surrogate: every byte
  EXPECT_EQ(lossy("\x61\xF1\x80\x80\xE1\x80\xC2\x62"), "a" + R + R + R + "b");
  EXPECT_EQ(lossy("plain"), "plain");
}

TEST(TokenizerUtf8, incomplete_tail_counts_only_valid_prefixes) {
  EXPECT_EQ(incomplete_utf8_tail("abc"), 0u);
  EXPECT_EQ(incomplete_utf8_tail("a\xE4"), 1u);
  EXPECT_EQ(incomplete_utf8_tail("a\xE4\xBD"), 2u);
  EXPECT_EQ(incomplete_utf8_tail("a\xE4\xBD\xA0"), 0u);  // 你, complete
  EXPECT_EQ(incomplete_utf8_tail("\xF0\x9F\x98"), 3u);
  EXPECT_EQ(incomplete_utf8_tail("\xE0\x80"), 0u);  // can never become valid
  EXPECT_EQ(incomplete_utf8_tail("\xFF"), 0u);
  EXPECT_EQ(incomplete_utf8_tail("\x80\x80"), 0u);
}

}  // namespace
}  // namespace troupe::tokenizer
