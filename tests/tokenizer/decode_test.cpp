// decode() against Hugging Face's decode, including ids that split characters
// (their bytes become U+FFFD, as HF's lossy UTF-8 decoding does).
#include <gtest/gtest.h>

#include "base/error.hpp"
#include "tests/tokenizer/support.hpp"

namespace troupe::tokenizer {
namespace {

using namespace testing;

TEST(TokenizerDecode, id_sequences_decode_like_hugging_face) {
  const auto rows = read_jsonl("decode.jsonl");
  ASSERT_GE(rows.size(), 100u);
  DecodeOptions skip;
  skip.skip_special = true;
  size_t with_replacement = 0;
  for (const auto& r : rows) {
    const auto ids = r["ids"].get<std::vector<int32_t>>();
    const std::string text = r["text"];
    EXPECT_EQ(deepseek().decode(ids), text) << r.dump();
    EXPECT_EQ(deepseek().decode(ids, skip), r["text_skip_special"].get<std::string>()) << r.dump();
    if (text.find("\xEF\xBF\xBD") != std::string::npos) ++with_replacement;
  }
  EXPECT_GT(with_replacement, 20u) << "the fixture should exercise invalid UTF-8 in decode";
}

TEST(TokenizerDecode, unknown_ids_are_refused) {
  const std::vector<int32_t> too_big = {deepseek().vocab_size()};
  const std::vector<int32_t> negative = {-1};
  EXPECT_THROW(deepseek().decode(too_big), Error);
  EXPECT_THROW(deepseek().decode(negative), Error);
  EXPECT_THROW(deepseek().token_bytes(1 << 30), Error);
  EXPECT_EQ(deepseek().vocab_size(), 128815);
}

}  // namespace
}  // namespace troupe::tokenizer
