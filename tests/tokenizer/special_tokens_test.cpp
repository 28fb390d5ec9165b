// Added tokens ("<｜User｜>", "<｜end▁of▁sentence｜>", ...) written in text are
// plain characters unless the caller asks for them to be parsed.
#include <gtest/gtest.h>

#include "tests/tokenizer/support.hpp"

namespace troupe::tokenizer {
namespace {

using namespace testing;

TEST(TokenizerSpecial, text_with_added_tokens_matches_hugging_face_both_ways) {
  const auto rows = read_jsonl("special.jsonl");
  ASSERT_GE(rows.size(), 10u);
  EncodeOptions parse;
  parse.parse_special = true;
  for (const auto& r : rows) {
    const std::string text = r["text"];
    EXPECT_EQ(deepseek().encode(text), r["plain"].get<std::vector<int32_t>>()) << text;
    EXPECT_EQ(deepseek().encode(text, parse), r["parsed"].get<std::vector<int32_t>>()) << text;
    EXPECT_EQ(deepseek().decode(deepseek().encode(text)), text);
    EXPECT_EQ(deepseek().decode(deepseek().encode(text, parse)), text);
  }
}

TEST(TokenizerSpecial, plain_text_never_yields_an_added_token) {
  const std::vector<std::string> texts = {"<｜User｜>",
                                          "<｜Assistant｜>",
                                          "<｜end▁of▁sentence｜>",
                                          "<｜begin▁of▁sentence｜>",
                                          "<｜tool▁sep｜>",
                                          "<|EOT|>",
                                          "a<｜User｜>b<｜end▁of▁sentence｜>c"};
  for (const auto& t : texts) {
    for (int32_t id : deepseek().encode(t)) {
      EXPECT_LT(id, 128000) << t << " gave added token " << id;
      EXPECT_GT(id, 2) << t << " gave BOS/EOS/pad " << id;
    }
  }
}

TEST(TokenizerSpecial, parsed_markers_are_single_ids) {
  EncodeOptions parse;
  parse.parse_special = true;
  EXPECT_EQ(deepseek().encode("<｜User｜>", parse), std::vector<int32_t>{128803});
  EXPECT_EQ(deepseek().encode("<｜Assistant｜>", parse), std::vector<int32_t>{128804});
  EXPECT_EQ(deepseek().encode("<｜end▁of▁sentence｜>", parse), std::vector<int32_t>{1});
  EXPECT_EQ(deepseek().encode("<｜begin▁of▁sentence｜>", parse), std::vector<int32_t>{0});
  EXPECT_EQ(deepseek().token_id("<｜tool▁sep｜>"), 128814);
}

TEST(TokenizerSpecial, skip_special_drops_only_tokens_marked_special) {
  DecodeOptions skip;
  skip.skip_special = true;
  const std::vector<int32_t> ids = {0, 128803, 19923, 1};  // BOS <｜User｜> Hello EOS
  EXPECT_EQ(deepseek().decode(ids), "<｜begin▁of▁sentence｜><｜User｜>Hello<｜end▁of▁sentence｜>");
  // <｜User｜> is an added token but not marked special in tokenizer.json.
  EXPECT_EQ(deepseek().decode(ids, skip), "<｜User｜>Hello");
  EXPECT_TRUE(deepseek().is_special(0));
  EXPECT_FALSE(deepseek().is_special(128803));
}

}  // namespace
}  // namespace troupe::tokenizer
