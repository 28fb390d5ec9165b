// SamplingParams::json_schema through the engine: the answers of a random-weight
// model are JSON valid under the schema, greedy and sampled; a resubmitted answer
// goes on as it would have; bad schemas and engines without a vocabulary refuse.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <regex>
#include <set>

#include "engine/json_schema.hpp"
#include "tests/cache/engine_harness.hpp"

namespace troupe::engine {
namespace {

using Json = nlohmann::json;

// The test model's ids as text: printable ASCII, JSON pieces, words and a few
// multi-byte characters; ids 0 and 1 (EOS) write nothing.
std::shared_ptr<const TokenVocabulary> test_vocabulary(int32_t V) {
  std::vector<std::string> bytes(static_cast<size_t>(V));
  for (int32_t id = 2; id < 2 + 95 && id < V; ++id) bytes[static_cast<size_t>(id)] = std::string(1, static_cast<char>(id + 30));
  const char* const pieces[] = {"{\"", "\":", "\": ", "\",", "\", \"", "\"}", "true", "false", "null", " \"", ", \"",
                                "}", "]", "[", "0", "12", ".5", "e+", "mode", "count", "flags", "label", "ab", "cd",
                                "\xC3\xA9", "\xE4\xB8\xAD", "\xE4", "\xB8\xAD", "  ", "\n", "\\n", "\\u00", "}]", "[{"};
  int32_t id = 97;
  for (const char* p : pieces) {
    if (id < V) bytes[static_cast<size_t>(id++)] = p;
  }
  for (int i = 0; id < V; ++id, ++i) bytes[static_cast<size_t>(id)] = "w" + std::to_string(i);
  return std::make_shared<const TokenVocabulary>(std::move(bytes));
}

// Every string bounded, so every answer ends within the test's max_tokens.
const char* const kSchema = R"({
  "type": "object",
  "properties": {
    "mode": {"enum": ["fast", "exact"]},
    "count": {"type": "integer"},
    "flags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3},
    "label": {"type": ["string", "null"], "maxLength": 6}
  },
  "required": ["mode", "count"]
})";

std::string text_of(const TokenVocabulary& v, const std::vector<int32_t>& ids) {
  std::string t;
  for (int32_t id : ids) t += v.bytes(id);
  return t;
}

void expect_valid(const std::string& text) {
  Json j;
  ASSERT_NO_THROW(j = Json::parse(text)) << text;
  ASSERT_TRUE(j.is_object()) << text;
  ASSERT_TRUE(j.contains("mode") && j.contains("count")) << text;
  EXPECT_TRUE(j["mode"] == "fast" || j["mode"] == "exact") << text;
  EXPECT_TRUE(j["count"].is_number_integer()) << text;
  for (const auto& [k, v] : j.items()) {
    EXPECT_TRUE(k == "mode" || k == "count" || k == "flags" || k == "label") << text;
  }
  if (j.contains("flags")) {
    EXPECT_TRUE(j["flags"].is_array() && j["flags"].size() <= 3) << text;
    for (const auto& f : j["flags"]) EXPECT_TRUE(f.is_boolean()) << text;
  }
  if (j.contains("label")) {
    EXPECT_TRUE(j["label"].is_null() || j["label"].is_string()) << text;
  }
}

// Every test: the shared model, an engine that knows its vocabulary's bytes.
class StructuredOutput : public ::testing::Test {
 protected:
  static EngineOptions with_vocabulary(const test::TestModel& model) {
    EngineOptions o;
    o.vocabulary = test_vocabulary(static_cast<int32_t>(model.model->config().vocab_size));
    return o;
  }
  test::TestModel& m = test::shared_model();
  EngineOptions o = with_vocabulary(m);
  test::Harness h{*m.model, o};
};

TEST_F(StructuredOutput, answers_are_json_under_the_schema) {
  const auto& eos = m.model->config().eos_token_ids;
  std::vector<RequestId> ids;
  for (int i = 0; i < 6; ++i) {
    Request r;
    r.prompt = {5, 17, 33, static_cast<int32_t>(40 + i)};
    r.sampling.json_schema = kSchema;
    r.sampling.max_tokens = 3000;
    r.sampling.temperature = i == 0 ? 0.0f : 1.0f;
    r.sampling.seed = static_cast<uint64_t>(i);
    r.sampling.ignore_eos = i == 5;  // finishes when the value is whole
    ids.push_back(h.submit(std::move(r)));
  }
  h.run();
  for (size_t i = 0; i < ids.size(); ++i) {
    const auto& run = h[ids[i]];
    ASSERT_TRUE(run.finished);
    EXPECT_EQ(run.last.reason, FinishReason::stop) << "request " << i;  // with the value whole, not with EOS
    ASSERT_FALSE(run.generated.empty());
    EXPECT_TRUE(std::find(eos.begin(), eos.end(), run.generated.back()) == eos.end()) << "request " << i;
    expect_valid(text_of(*o.vocabulary, run.generated));
  }
  // A value that may end or go on (a number): EOS ends it where it may be sampled;
  // with ignore_eos it goes on to the longest number the grammar takes.
  for (const bool ignore : {false, true}) {
    Request r;
    r.prompt = {7, 7, 7};
    r.sampling.json_schema = R"({"type": "integer"})";
    r.sampling.max_tokens = 100;
    r.sampling.temperature = 1.0f;
    r.sampling.seed = 3;
    r.sampling.ignore_eos = ignore;
    const auto id = h.submit(std::move(r));
    h.run();
    const auto& run = h[id];
    EXPECT_EQ(run.last.reason, FinishReason::stop);
    std::vector<int32_t> answer = run.generated;
    const bool ended = !answer.empty() && std::find(eos.begin(), eos.end(), answer.back()) != eos.end();
    EXPECT_EQ(ended, !ignore);
    if (ended) answer.pop_back();
    const std::string text = text_of(*o.vocabulary, answer);
    EXPECT_TRUE(std::regex_match(text, std::regex("-?(0|[1-9][0-9]*)"))) << text;  // past int64 too
    if (ignore) {
      EXPECT_EQ(text.size(), 32u) << text;
    }
  }
}

// Two "tools": names 'a' (id 67) and 'b!' (68, 3), each followed by its own arguments.
const std::vector<std::vector<int32_t>> kNames = {{67}, {68, 3}};
const std::vector<std::string> kArguments = {R"({"type": "array", "items": {"type": "boolean"}, "maxItems": 2})",
                                             R"({"enum": ["x", "yz"]})"};

// A sampled request whose answer is held to kNames and kArguments.
Request named_request(int32_t prompt_tail, uint64_t seed, int32_t max_tokens) {
  Request r;
  r.prompt = {11, 12, prompt_tail};
  r.sampling.answer_prefixes = kNames;
  r.sampling.answer_schemas = kArguments;
  r.sampling.max_tokens = max_tokens;
  r.sampling.temperature = 1.0f;
  r.sampling.seed = seed;
  return r;
}

// Which of kNames `seg` begins with (kNames.size(): none).
size_t name_of(const std::vector<int32_t>& seg) {
  for (size_t i = 0; i < kNames.size(); ++i) {
    if (seg.size() >= kNames[i].size() && std::equal(kNames[i].begin(), kNames[i].end(), seg.begin())) return i;
  }
  return kNames.size();
}

TEST_F(StructuredOutput, what_follows_an_answer_prefix_is_held_to_its_schema) {
  const auto& prefixes = kNames;
  std::set<size_t> named;
  for (int seed = 0; seed < 8; ++seed) {
    Request r = named_request(13 + seed, static_cast<uint64_t>(seed), 2000);
    const auto id = h.submit(std::move(r));
    h.run();
    const auto& g = h[id].generated;
    EXPECT_EQ(h[id].last.reason, FinishReason::stop);
    const size_t which = name_of(g);
    ASSERT_LT(which, prefixes.size()) << "seed " << seed;
    named.insert(which);
    const std::string rest = text_of(*o.vocabulary, std::vector<int32_t>(g.begin() + static_cast<std::ptrdiff_t>(prefixes[which].size()), g.end()));
    Json v;
    ASSERT_NO_THROW(v = Json::parse(rest)) << rest;
    if (which == 0) {
      EXPECT_TRUE(v.is_array() && v.size() <= 2) << rest;
    } else {
      EXPECT_TRUE(v == "x" || v == "yz") << rest;
    }
  }
  EXPECT_EQ(named.size(), 2u);  // both prefixes drawn over the seeds
  Request bad;
  bad.prompt = {3, 4};
  bad.sampling.answer_prefixes = prefixes;
  bad.sampling.answer_schemas = {"{}"};
  const auto id = h.submit(std::move(bad));
  h.run();
  EXPECT_EQ(h[id].last.reason, FinishReason::error);
  EXPECT_NE(h[id].last.message.find("1 answer schemas for 2 answer prefixes"), std::string::npos) << h[id].last.message;
}

TEST_F(StructuredOutput, after_each_trigger_a_prefix_and_its_schema_hold_the_answer) {
  // Token 0 (it writes nothing: never inside a value) is the trigger, pushed by a bias so that it
  // comes whenever the answer is free: then a name ('a' or 'b!') and its arguments, again and again.
  const auto& prefixes = kNames;
  const auto& schemas = kArguments;
  for (int seed = 0; seed < 4; ++seed) {
    Request r = named_request(23 + seed, static_cast<uint64_t>(seed), 400);
    r.sampling.answer_trigger = {0};
    r.sampling.logit_bias = {{0, 30.0f}};
    const auto id = h.submit(std::move(r));
    h.run();
    const auto& g = h[id].generated;
    EXPECT_EQ(h[id].last.reason, FinishReason::length) << "seed " << seed;  // a trigger's value never ends the answer
    // The answer as segments after each trigger: a prefix, then a whole value (the last may be cut).
    ASSERT_FALSE(g.empty());
    ASSERT_EQ(g[0], 0) << "seed " << seed;
    int calls = 0;
    for (size_t at = 0; at < g.size();) {
      ASSERT_EQ(g[at], 0);
      size_t end = at + 1;
      while (end < g.size() && g[end] != 0) ++end;
      const std::vector<int32_t> seg(g.begin() + static_cast<std::ptrdiff_t>(at + 1), g.begin() + static_cast<std::ptrdiff_t>(end));
      const size_t which = name_of(seg);
      if (end == g.size() && which == prefixes.size()) break;  // cut inside the name
      ASSERT_LT(which, prefixes.size()) << "seed " << seed;
      JsonMatcher mt(JsonGrammar::compile(schemas[which]));
      const std::string rest = text_of(*o.vocabulary, std::vector<int32_t>(seg.begin() + static_cast<std::ptrdiff_t>(prefixes[which].size()), seg.end()));
      EXPECT_TRUE(mt.feed(rest)) << rest;
      if (end < g.size()) {  // another trigger came: the value was whole (the answer was free again)
        EXPECT_TRUE(mt.complete()) << rest;
        ++calls;
      }
      at = end;
    }
    EXPECT_GT(calls, 3) << "seed " << seed;
  }
}

TEST_F(StructuredOutput, a_resubmitted_answer_goes_on_as_it_would_have) {
  Request r;
  r.prompt = {9, 8, 7, 6, 5};
  r.sampling.json_schema = kSchema;
  r.sampling.max_tokens = 3000;
  r.sampling.temperature = 1.0f;
  r.sampling.seed = 11;
  const auto whole = h.submit(r);
  h.run();
  const auto full = h[whole].generated;
  ASSERT_GT(full.size(), 6u);
  // The first tokens appended to the prompt, the answer still starting where it did.
  Request again = r;
  again.prompt.insert(again.prompt.end(), full.begin(), full.begin() + 5);
  again.sampling.answer_start = static_cast<int64_t>(r.prompt.size());
  again.sampling.max_tokens = r.sampling.max_tokens - 5;
  const auto rest = h.submit(again);
  h.run();
  EXPECT_EQ(h[rest].generated, std::vector<int32_t>(full.begin() + 5, full.end()));
}

TEST_F(StructuredOutput, bad_schemas_and_engines_without_a_vocabulary_refuse) {
  Request r;
  r.prompt = {3, 4};
  r.sampling.json_schema = R"({"type": "string", "multipleOf": 3})";
  const auto bad = h.submit(r);
  r.sampling.json_schema = "{}";
  r.sampling.answer_prefixes = {{5}};
  const auto both = h.submit(r);
  h.run();
  EXPECT_EQ(h[bad].last.reason, FinishReason::error);
  EXPECT_EQ(h[bad].last.code, ErrorCode::invalid_argument);
  EXPECT_NE(h[bad].last.message.find("'multipleOf'"), std::string::npos) << h[bad].last.message;
  EXPECT_EQ(h[both].last.reason, FinishReason::error);
  EXPECT_NE(h[both].last.message.find("cannot be combined"), std::string::npos) << h[both].last.message;

  test::Harness bare(*m.model, EngineOptions{});
  Request plain;
  plain.prompt = {3, 4};
  plain.sampling.json_schema = "{}";
  const auto none = bare.submit(plain);
  bare.run();
  EXPECT_EQ(bare[none].last.reason, FinishReason::error);
  EXPECT_NE(bare[none].last.message.find("vocabulary"), std::string::npos) << bare[none].last.message;
  // Both engines still serve: nothing was lost on the way.
  plain.sampling.json_schema.clear();
  plain.sampling.max_tokens = 3;
  const auto ok = bare.submit(plain);
  bare.run();
  EXPECT_EQ(bare[ok].generated.size(), 3u);
}

}  // namespace
}  // namespace troupe::engine
