// Streaming detokenization: token-by-token output concatenates to decode(),
// holds back partial characters, and never shows U+FFFD for valid text.
#include "model/tokenizer/stream_decoder.hpp"

#include <gtest/gtest.h>

#include "model/tokenizer/byte_level.hpp"
#include "model/tokenizer/stop_strings.hpp"
#include "model/tokenizer/utf8.hpp"
#include "tests/tokenizer/support.hpp"

namespace troupe::tokenizer {
namespace {

using namespace testing;

constexpr std::string_view kReplacement = "\xEF\xBF\xBD";

int32_t byte_token(uint8_t b) { return *deepseek().token_id(byte_level().encode(b)); }

TEST(TokenizerStream, every_corpus_line_streams_to_itself_without_replacement_characters) {
  const auto lines = read_lines(fixture_path("corpus.txt"));
  size_t held_back = 0;
  for (size_t i = 0; i < lines.size(); ++i) {
    const std::string& line = lines[i];
    const bool line_has_replacement = line.find(kReplacement) != std::string::npos;
    StreamDecoder stream(deepseek());
    std::string joined;
    for (int32_t id : deepseek().encode(line)) {
      const std::string chunk = stream.push(id);
      ASSERT_FALSE(find_invalid_utf8(chunk)) << "line " << i + 1 << " emitted invalid UTF-8";
      if (!line_has_replacement) {
        ASSERT_EQ(chunk.find(kReplacement), std::string::npos) << "line " << i + 1;
      }
      if (stream.pending() > 0) ++held_back;
      joined += chunk;
    }
    const std::string tail = stream.finish();
    EXPECT_EQ(tail, "") << "line " << i + 1 << " left bytes at the end";
    ASSERT_EQ(joined + tail, line) << "line " << i + 1;
  }
  EXPECT_GT(held_back, 100u) << "the corpus should split characters across tokens";
}

TEST(TokenizerStream, any_id_sequence_streams_to_what_decode_gives) {
  for (const auto& r : read_jsonl("decode.jsonl")) {
    const auto ids = r["ids"].get<std::vector<int32_t>>();
    StreamDecoder stream(deepseek());
    std::string joined;
    for (int32_t id : ids) joined += stream.push(id);
    joined += stream.finish();
    EXPECT_EQ(joined, deepseek().decode(ids)) << r.dump();
    EXPECT_EQ(joined, r["text"].get<std::string>()) << r.dump();
  }
}

TEST(TokenizerStream, a_character_split_over_byte_tokens_comes_out_whole) {
  StreamDecoder stream(deepseek());
  EXPECT_EQ(stream.push(byte_token(0xF0)), "");  // 😀 = F0 9F 98 80
  EXPECT_EQ(stream.push(byte_token(0x9F)), "");
  EXPECT_EQ(stream.push(byte_token(0x98)), "");
  EXPECT_EQ(stream.pending(), 3u);
  EXPECT_EQ(stream.push(byte_token(0x80)), "😀");
  EXPECT_EQ(stream.pending(), 0u);
  EXPECT_EQ(stream.finish(), "");
}

TEST(TokenizerStream, an_unfinished_character_at_the_end_becomes_one_replacement) {
  StreamDecoder stream(deepseek());
  EXPECT_EQ(stream.push(byte_token('a')), "a");
  EXPECT_EQ(stream.push(byte_token(0xE4)), "");
  EXPECT_EQ(stream.push(byte_token(0xBD)), "");
  EXPECT_EQ(stream.finish(), kReplacement);
}

TEST(TokenizerStream, bytes_that_can_never_be_valid_are_replaced_at_once) {
  StreamDecoder stream(deepseek());
  EXPECT_EQ(stream.push(byte_token(0xE4)), "");
  // 'x' cannot continue the character: the stray lead byte is replaced now.
  EXPECT_EQ(stream.push(byte_token('x')), std::string(kReplacement) + "x");
  EXPECT_EQ(stream.push(byte_token(0xFF)), kReplacement);
}

TEST(TokenizerStream, skip_special_drops_bos_and_eos) {
  DecodeOptions skip;
  skip.skip_special = true;
  StreamDecoder stream(deepseek(), skip);
  EXPECT_EQ(stream.push(0), "");
  EXPECT_EQ(stream.push(19923), "Hello");
  EXPECT_EQ(stream.push(1), "");
}

TEST(TokenizerStopStrings, holds_back_a_possible_stop_and_cuts_before_a_complete_one) {
  StopStrings stops({"</answer>", "STOP"});
  auto a = stops.push("The answer is 42</ans");
  EXPECT_EQ(a.text, "The answer is 42");
  EXPECT_FALSE(a.stopped);
  auto b = stops.push("wer> trailing");
  EXPECT_EQ(b.text, "");
  EXPECT_TRUE(b.stopped);
  EXPECT_EQ(stops.push("more").text, "");
}

TEST(TokenizerStopStrings, releases_held_text_that_turned_out_not_to_be_a_stop) {
  StopStrings stops({"STOP"});
  EXPECT_EQ(stops.push("ST").text, "");
  EXPECT_EQ(stops.push("ART ").text, "START ");
  EXPECT_EQ(stops.push("S").text, "");
  EXPECT_EQ(stops.finish(), "S");
}

TEST(TokenizerStopStrings, finds_the_earliest_stop_and_works_after_the_stream_decoder) {
  StopStrings stops({"world", "o w"});
  StreamDecoder stream(deepseek());
  std::string out;
  bool stopped = false;
  for (int32_t id : deepseek().encode("Hello world, goodbye")) {
    auto step = stops.push(stream.push(id));
    out += step.text;
    if (step.stopped) {
      stopped = true;
      break;
    }
  }
  EXPECT_TRUE(stopped);
  EXPECT_EQ(out, "Hell");
}

}  // namespace
}  // namespace troupe::tokenizer
