// Every corpus line (and every multi-line document) encodes to the ids
// Hugging Face's `tokenizers` produced, and decodes back to itself.
#include <gtest/gtest.h>

#include <atomic>
#include <thread>

#include "tests/tokenizer/support.hpp"

namespace troupe::tokenizer {
namespace {

using namespace testing;

struct Corpus {
  std::vector<std::string> lines;
  std::vector<std::vector<int32_t>> ids;
};

const Corpus& corpus() {
  static const Corpus c = [] {
    Corpus c;
    c.lines = read_lines(fixture_path("corpus.txt"));
    for (const auto& l : read_lines(fixture_path("corpus.ids"))) c.ids.push_back(parse_ids(l));
    return c;
  }();
  return c;
}

TEST(TokenizerCorpus, fixture_is_the_promised_size) {
  EXPECT_GE(corpus().lines.size(), 2000u);
  ASSERT_EQ(corpus().lines.size(), corpus().ids.size());
}

TEST(TokenizerCorpus, every_line_encodes_to_hugging_face_ids) {
  const auto& c = corpus();
  size_t wrong = 0;
  for (size_t i = 0; i < c.lines.size(); ++i) {
    const auto ids = deepseek().encode(c.lines[i]);
    if (ids != c.ids[i]) {
      if (++wrong <= 10) ADD_FAILURE() << "line " << i + 1 << ": " << c.lines[i] << "\nbytes: " << hex(c.lines[i]);
    }
  }
  EXPECT_EQ(wrong, 0u) << "of " << c.lines.size() << " lines";
}

TEST(TokenizerCorpus, parsing_special_tokens_changes_nothing_without_them) {
  EncodeOptions parse;
  parse.parse_special = true;
  for (size_t i = 0; i < corpus().lines.size(); ++i) {
    ASSERT_EQ(deepseek().encode(corpus().lines[i], parse), corpus().ids[i]) << "line " << i + 1;
  }
}

TEST(TokenizerCorpus, every_line_round_trips) {
  for (size_t i = 0; i < corpus().lines.size(); ++i) {
    const auto& line = corpus().lines[i];
    ASSERT_EQ(deepseek().decode(deepseek().encode(line)), line) << "line " << i + 1;
  }
}

TEST(TokenizerCorpus, documents_with_line_breaks_encode_to_hugging_face_ids) {
  const auto docs = read_jsonl("documents.jsonl");
  ASSERT_GT(docs.size(), 100u);
  for (size_t i = 0; i < docs.size(); ++i) {
    const std::string text = docs[i]["text"];
    ASSERT_EQ(deepseek().encode(text), docs[i]["ids"].get<std::vector<int32_t>>())
        << "document " << i << ": " << hex(text);
    ASSERT_EQ(deepseek().decode(deepseek().encode(text)), text) << "document " << i;
  }
}

TEST(TokenizerCorpus, bos_is_added_only_when_asked) {
  EncodeOptions bos;
  bos.add_bos = true;
  const auto ids = deepseek().encode("Hello", bos);
  ASSERT_EQ(ids.size(), 2u);
  EXPECT_EQ(ids[0], 0);  // <｜begin▁of▁sentence｜>
  EXPECT_EQ(deepseek().encode("Hello").size(), 1u);
  EXPECT_TRUE(deepseek().config().add_bos_token);
  EXPECT_EQ(deepseek().bos_id(), 0);
  EXPECT_EQ(deepseek().eos_id(), 1);
}

TEST(TokenizerCorpus, empty_text_has_no_ids) { EXPECT_TRUE(deepseek().encode("").empty()); }

TEST(TokenizerCorpus, concurrent_encoding_gives_the_same_ids) {
  // The piece cache is shared: threads racing on it must not change results.
  const auto& c = corpus();
  std::vector<std::thread> threads;
  std::atomic<size_t> wrong{0};
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      for (size_t i = t; i < c.lines.size(); i += 2) {
        if (deepseek().encode(c.lines[i]) != c.ids[i]) ++wrong;
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(wrong.load(), 0u);
}

}  // namespace
}  // namespace troupe::tokenizer
