// Sampling semantics: greedy, seeds, top-k, top-p, min/max tokens, stop ids,
// repetition / frequency / presence penalties.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <set>

#include "engine/sampler.hpp"
#include "tests/cache/engine_harness.hpp"

namespace troupe::engine {
namespace {

std::vector<float> random_logits(std::mt19937_64& rng, int n) {
  std::normal_distribution<float> d(0.f, 2.f);
  std::vector<float> l(static_cast<size_t>(n));
  for (auto& x : l) x = d(rng);
  return l;
}

TEST(Sampler, greedy_is_the_first_argmax) {
  std::vector<float> l{1, 5, 2, 5, 0};
  SamplingParams p;
  EXPECT_EQ(sample(l, p, 1, 0, 0, {}), 1);
  p.temperature = 1.0f;
  p.top_k = 1;
  EXPECT_EQ(sample(l, p, 1, 0, 0, {}), 1);
}

TEST(Sampler, a_seed_and_position_fix_the_draw) {
  std::mt19937_64 rng(1);
  const auto l = random_logits(rng, 100);
  SamplingParams p;
  p.temperature = 1.0f;
  std::set<int32_t> seen;
  for (int64_t pos = 0; pos < 50; ++pos) {
    const int32_t t = sample(l, p, 42, pos, 0, {});
    EXPECT_EQ(t, sample(l, p, 42, pos, 0, {}));
    seen.insert(t);
  }
  EXPECT_GT(seen.size(), 5u);  // positions draw differently
  int differ = 0;
  for (int64_t pos = 0; pos < 50; ++pos) differ += sample(l, p, 42, pos, 0, {}) != sample(l, p, 43, pos, 0, {});
  EXPECT_GT(differ, 10);
}

TEST(Sampler, top_k_and_top_p_keep_only_the_head) {
  std::mt19937_64 rng(2);
  for (int trial = 0; trial < 20; ++trial) {
    const auto l = random_logits(rng, 64);
    std::vector<int32_t> order(64);
    std::iota(order.begin(), order.end(), 0);
    std::sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return l[static_cast<size_t>(a)] > l[static_cast<size_t>(b)]; });
    SamplingParams k;
    k.temperature = 1.5f;
    k.top_k = 5;
    const std::set<int32_t> top5(order.begin(), order.begin() + 5);
    // top_p: the smallest head with probability >= p.
    SamplingParams tp;
    tp.temperature = 1.0f;
    tp.top_p = 0.5f;
    std::vector<double> prob(64);
    double sum = 0;
    for (int i = 0; i < 64; ++i) sum += prob[static_cast<size_t>(i)] = std::exp(l[static_cast<size_t>(order[static_cast<size_t>(i)])] - l[static_cast<size_t>(order[0])]);
    size_t head = 0;
    for (double mass = 0; head < 64 && mass < 0.5;) mass += prob[head++] / sum;
    const std::set<int32_t> nucleus(order.begin(), order.begin() + static_cast<long>(head));
    for (int64_t pos = 0; pos < 100; ++pos) {
      EXPECT_TRUE(top5.count(sample(l, k, 7, pos, 0, {})));
      EXPECT_TRUE(nucleus.count(sample(l, tp, 7, pos, 0, {})));
    }
  }
  // min_p: only tokens at least min_p times the likeliest one's probability (after the
  // temperature), every one of them drawn; then top_p over what is left (vLLM's order).
  {
    const std::vector<float> l{2.0f, 0.0f, 1.5f, -3.0f, 1.0f, 2.0f};
    SamplingParams mp;
    mp.temperature = 0.5f;
    mp.min_p = 0.2f;  // exp((x - 2) / 0.5) >= 0.2: x >= 2 + 0.5 ln 0.2 = 1.195
    std::set<int32_t> drawn;
    for (int64_t pos = 0; pos < 400; ++pos) drawn.insert(sample(l, mp, 11, pos, 0, {}));
    EXPECT_EQ(drawn, (std::set<int32_t>{0, 2, 5}));
    mp.top_p = 0.6f;  // of {0, 5, 2} (masses 0.42, 0.42, 0.16): the first two
    drawn.clear();
    for (int64_t pos = 0; pos < 400; ++pos) drawn.insert(sample(l, mp, 11, pos, 0, {}));
    EXPECT_EQ(drawn, (std::set<int32_t>{0, 5}));
    mp.top_p = 1.0f;
    mp.min_p = 1.0f;  // the likeliest alone (ties: both)
    drawn.clear();
    for (int64_t pos = 0; pos < 200; ++pos) drawn.insert(sample(l, mp, 11, pos, 0, {}));
    EXPECT_EQ(drawn, (std::set<int32_t>{0, 5}));
  }
  // Answer prefixes: only the tokens that continue one, greedy or sampled, until one is whole.
  {
    const std::vector<float> l{0.0f, 9.0f, 1.0f, 2.0f, 0.5f, 3.0f, 0.0f, 0.0f, 0.0f, 0.0f};  // token 1 far ahead
    SamplingParams pp;
    pp.answer_prefixes = {{5, 6, 7}, {5, 9}, {8}};
    EXPECT_EQ(prefix_choices(pp, {}), (std::vector<int32_t>{5, 8}));
    EXPECT_EQ(sample(l, pp, 0, 0, 0, {}), 5);  // greedy: the likelier of 5 and 8
    const std::vector<int32_t> a5{5}, a56{5, 6}, a567{5, 6, 7}, a4{4};
    EXPECT_EQ(prefix_choices(pp, a5), (std::vector<int32_t>{6, 9}));
    EXPECT_EQ(sample(l, pp, 0, 0, 1, {}, {}, a56), 7);
    EXPECT_TRUE(prefix_choices(pp, a567).empty());  // whole: free again
    EXPECT_EQ(sample(l, pp, 0, 0, 3, {}, {}, a567), 1);
    EXPECT_TRUE(prefix_choices(pp, a4).empty());  // begins none of them: free
    pp.temperature = 2.0f;
    std::set<int32_t> drawn;
    for (int64_t pos = 0; pos < 200; ++pos) drawn.insert(sample(l, pp, 5, pos, 1, {}, {}, a5));
    EXPECT_EQ(drawn, (std::set<int32_t>{6, 9}));
    SamplingParams bad;
    bad.answer_prefixes = {{}};
    EXPECT_NE(check(bad).find("prefix"), std::string::npos);
  }
  // A tiny top_p is greedy.
  std::vector<float> l{0, 3, 1};
  SamplingParams p;
  p.temperature = 1.0f;
  p.top_p = 1e-6f;
  for (int64_t pos = 0; pos < 20; ++pos) EXPECT_EQ(sample(l, p, 3, pos, 0, {}), 1);
}

TEST(Sampler, min_tokens_masks_stop_ids_and_eos) {
  std::vector<float> l{0, 10, 9, 1};  // 1 is EOS, 2 a stop id
  SamplingParams p;
  p.stop_ids = {2};
  p.min_tokens = 2;
  const std::vector<int64_t> eos{1};
  EXPECT_EQ(sample(l, p, 0, 0, 0, eos), 3);
  EXPECT_EQ(sample(l, p, 0, 0, 2, eos), 1);
  p.ignore_eos = true;
  EXPECT_EQ(sample(l, p, 0, 0, 1, eos), 1);  // EOS is an ordinary token then
  EXPECT_FALSE(check(p).empty() == false);
  p.min_tokens = 99;
  EXPECT_FALSE(check(p).empty());
}

TEST(Sampler, penalties_follow_vllm) {
  const std::vector<float> l{3.f, -2.f, 2.5f, 1.f, 0.f};
  const std::vector<int32_t> seq{0, 1, 3, 0};  // prompt [0, 1], answer [3, 0]
  SamplingParams p;                             // greedy: the penalties decide the argmax
  EXPECT_EQ(sample(l, p, 0, 4, 2, {}, TokenCounts::of(seq, p.answer_begin(2))), 0);
  // Repetition on every token of the sequence, prompt included: positive logits divided,
  // negative ones multiplied.
  p.repetition_penalty = 2.f;
  std::vector<float> x = l;
  adjust_logits(x, p, TokenCounts::of(seq, 2));
  EXPECT_EQ(x, (std::vector<float>{1.5f, -4.f, 2.5f, 0.5f, 0.f}));
  EXPECT_EQ(sample(l, p, 0, 4, 2, {}, TokenCounts::of(seq, p.answer_begin(2))), 2);
  // Frequency counts the answer only: token 0 is there once (3 - 0.3 = 2.7 wins);
  // counted over the whole sequence it is there twice (2.4 loses to 2.5).
  p = SamplingParams{};
  p.frequency_penalty = 0.3f;
  EXPECT_EQ(sample(l, p, 0, 4, 2, {}, TokenCounts::of(seq, p.answer_begin(2))), 0);
  EXPECT_EQ(sample(l, p, 0, 4, 2, {}, TokenCounts::of(seq, p.answer_begin(0))), 2);
  p.answer_start = 0;  // the params' own answer start wins over the prompt's length
  EXPECT_EQ(sample(l, p, 0, 4, 2, {}, TokenCounts::of(seq, p.answer_begin(2))), 2);
  // Presence: once, whatever the count.
  p = SamplingParams{};
  p.presence_penalty = 0.6f;
  x = l;
  adjust_logits(x, p, TokenCounts::of(seq, 0));
  const std::vector<float> want{3.f - 0.6f, -2.f - 0.6f, 2.5f, 1.f - 0.6f, 0.f};
  for (size_t i = 0; i < want.size(); ++i) EXPECT_FLOAT_EQ(x[i], want[i]) << i;
  // Negative values reward repeats.
  p = SamplingParams{};
  p.frequency_penalty = -2.f;
  EXPECT_EQ(sample(l, p, 0, 4, 2, {}, TokenCounts::of(seq, p.answer_begin(2))), 0);
  x = l;
  adjust_logits(x, p, TokenCounts::of(seq, 2));
  EXPECT_FLOAT_EQ(x[3], 3.f);
  // Sampled, not only greedy: the draws follow the penalized logits (0: 3 / 50 - 2,
  // 1: -2 * 50, 3: 1 / 50 - 2; 2 and 4 untouched), so 1 is never drawn and 2 mostly.
  p = SamplingParams{};
  p.temperature = 1.f;
  p.presence_penalty = 2.f;
  p.repetition_penalty = 50.f;
  int twos = 0;
  for (int64_t pos = 0; pos < 200; ++pos) {
    const int32_t t = sample(l, p, 5, pos, 2, {}, TokenCounts::of(seq, p.answer_begin(2)));
    EXPECT_NE(t, 1);
    twos += t == 2;
  }
  EXPECT_GT(twos, 150);  // p(2) = e^2.5 / (e^2.5 + 1 + e^-1.94 + e^-1.98) = 0.90
  // Masked tokens stay masked.
  p = SamplingParams{};
  p.frequency_penalty = -2.f;
  p.stop_ids = {0};
  p.min_tokens = 5;
  EXPECT_EQ(sample(l, p, 0, 4, 2, {}, TokenCounts::of(seq, p.answer_begin(2))), 3);  // 1 + 2
  // No penalties, no history needed.
  EXPECT_FALSE(SamplingParams{}.adjusts_logits());
  EXPECT_EQ(sample(l, SamplingParams{}, 0, 4, 2, {}), 0);
}

TEST(Sampler, token_counts_grow_with_the_sequence_as_counting_afresh_does) {
  std::mt19937_64 rng(6);
  std::uniform_int_distribution<int32_t> tok(0, 40);
  std::vector<int32_t> seq;
  TokenCounts grown;
  for (int step = 0; step < 50; ++step) {
    for (int i = 0; i < 1 + step % 3; ++i) seq.push_back(tok(rng));
    grown.update(seq, 7);
    TokenCounts fresh;
    fresh.update(seq, 7);
    ASSERT_EQ(grown.seen, fresh.seen) << step;
    ASSERT_EQ(grown.answer, fresh.answer) << step;
  }
  grown.update(seq, 0);  // the answer start moved: counted again from the start
  TokenCounts fresh;
  fresh.update(seq, 0);
  EXPECT_EQ(grown.answer, fresh.answer);
  EXPECT_EQ(grown.counted, static_cast<int64_t>(seq.size()));
}

TEST(Sampler, logit_bias_comes_before_the_penalties) {
  const std::vector<float> l{3.f, 1.f, 2.5f, 0.f};
  SamplingParams p;
  p.logit_bias = {{1, 1.f}, {3, -100.f}, {9, 50.f}};  // 9: outside this vocabulary, skipped
  std::vector<float> x = l;
  adjust_logits(x, p, TokenCounts{});
  EXPECT_EQ(x, (std::vector<float>{3.f, 2.f, 2.5f, -100.f}));
  p.logit_bias = {{2, 1.f}};
  EXPECT_EQ(sample(l, p, 0, 0, 0, {}), 2);  // 3.5 > 3
  // Then the repetition penalty divides the biased logit: (2.5 + 1) / 2 = 1.75 < 3 (bias after: 2.25).
  p.repetition_penalty = 2.f;
  const std::vector<int32_t> seq{2};
  x = l;
  adjust_logits(x, p, TokenCounts::of(seq, 1));
  EXPECT_FLOAT_EQ(x[2], 1.75f);
  EXPECT_EQ(sample(l, p, 0, 1, 0, {}, TokenCounts::of(seq, p.answer_begin(1))), 0);
  // A ban holds under sampling too.
  p = SamplingParams{};
  p.temperature = 1.f;
  p.logit_bias = {{0, -100.f}};
  for (int64_t pos = 0; pos < 100; ++pos) EXPECT_NE(sample(l, p, 9, pos, 0, {}), 0);
  EXPECT_TRUE(p.adjusts_logits());
}

TEST(Sampler, penalties_out_of_range_are_refused) {
  auto bad = [](auto set) {
    SamplingParams p;
    set(p);
    return check(p);
  };
  EXPECT_NE(bad([](SamplingParams& p) { p.repetition_penalty = 0.f; }).find("repetition_penalty"), std::string::npos);
  EXPECT_NE(bad([](SamplingParams& p) { p.repetition_penalty = -1.f; }).find("repetition_penalty"), std::string::npos);
  EXPECT_NE(bad([](SamplingParams& p) { p.repetition_penalty = NAN; }).find("repetition_penalty"), std::string::npos);
  EXPECT_NE(bad([](SamplingParams& p) { p.frequency_penalty = 2.5f; }).find("frequency_penalty"), std::string::npos);
  EXPECT_NE(bad([](SamplingParams& p) { p.presence_penalty = -3.f; }).find("presence_penalty"), std::string::npos);
  EXPECT_NE(bad([](SamplingParams& p) { p.min_p = 1.5f; }).find("min_p"), std::string::npos);
  EXPECT_NE(bad([](SamplingParams& p) { p.min_p = NAN; }).find("min_p"), std::string::npos);
  EXPECT_NE(bad([](SamplingParams& p) { p.presence_penalty = NAN; }).find("presence_penalty"), std::string::npos);
  EXPECT_NE(bad([](SamplingParams& p) { p.logit_bias = {{5, 101.f}}; }).find("logit_bias"), std::string::npos);
  EXPECT_NE(bad([](SamplingParams& p) { p.logit_bias = {{-1, 1.f}}; }).find("logit_bias"), std::string::npos);
  EXPECT_NE(bad([](SamplingParams& p) { p.logit_bias.assign(kMaxLogitBiasEntries + 1, {1, 1.f}); }).find("logit_bias"),
            std::string::npos);
  EXPECT_TRUE(bad([](SamplingParams& p) {
                p.logit_bias = {{5, -100.f}, {6, 100.f}};
                p.repetition_penalty = 1.2f;
                p.frequency_penalty = -2.f;
                p.presence_penalty = 2.f;
              }).empty());
}

// The argmax of the penalized logits (first of the maxima), for `history`.
int32_t penalized_argmax(std::vector<float> row, const SamplingParams& p, const std::vector<int32_t>& history,
                         int64_t answer_start) {
  adjust_logits(row, p, TokenCounts::of(history, answer_start));
  return static_cast<int32_t>(std::max_element(row.begin(), row.end()) - row.begin());
}

TEST(EngineSampling, penalties_pick_the_argmax_of_the_penalized_logits_and_survive_a_resubmission) {
  auto& m = *test::shared_model().model;
  std::mt19937_64 rng(5);
  const auto prompt = test::random_ids(rng, 60, m.config().vocab_size);
  const int32_t n = 24;
  auto request = [&](std::vector<int32_t> ids, int32_t max_tokens) {
    auto r = test::greedy(std::move(ids), max_tokens, LogitsMode::sampled);
    r.sampling.repetition_penalty = 1.3f;
    r.sampling.frequency_penalty = 0.5f;
    r.sampling.presence_penalty = 0.3f;
    return r;
  };
  test::Harness h(m, EngineOptions{});
  const auto a = h.submit(request(prompt, n));
  const auto plain = h.submit(test::greedy(prompt, n, LogitsMode::none));
  h.run();
  const auto& got = h[a].generated;
  ASSERT_EQ(got.size(), static_cast<size_t>(n));
  ASSERT_EQ(h[a].rows.size(), static_cast<size_t>(n));
  std::vector<int32_t> history = prompt;
  int changed = 0;  // tokens the raw argmax would have picked differently
  size_t j = 0;
  for (const auto& [pos, row] : h[a].rows) {
    EXPECT_EQ(got[j], penalized_argmax(row, request({}, 1).sampling, history, 60)) << "token " << j;
    changed += got[j] != static_cast<int32_t>(std::max_element(row.begin(), row.end()) - row.begin());
    history.push_back(got[j++]);
  }
  EXPECT_GT(changed, 0) << "the penalties changed no token: the test shows nothing";
  EXPECT_NE(got, h[plain].generated);
  // Resubmitted as a worker loss does (the answer so far appended to the prompt, the
  // original prompt's length kept as the answer start): the same continuation.
  std::vector<int32_t> again = prompt;
  again.insert(again.end(), got.begin(), got.begin() + 8);
  auto r = request(again, n - 8);
  r.sampling.answer_start = static_cast<int64_t>(prompt.size());
  const auto b = h.submit(std::move(r));
  h.run();
  EXPECT_EQ(h[b].generated, std::vector<int32_t>(got.begin() + 8, got.end()));
}

// Priority: with room for one request at a time, the waiting ones are admitted
// larger priority first, by arrival within a priority.
TEST(EngineScheduling, larger_priority_is_admitted_first_then_arrival) {
  auto& m = *test::shared_model().model;
  std::mt19937_64 rng(8);
  EngineOptions o;
  o.max_running = 1;
  test::Harness h(m, o);
  auto request = [&](int32_t priority) {
    auto r = test::greedy(test::random_ids(rng, 20, m.config().vocab_size), 3, LogitsMode::none);
    r.priority = priority;
    return h.submit(std::move(r));
  };
  const auto first = request(0);
  h.engine().step();  // `first` runs; the rest wait
  const std::vector<RequestId> ids{request(0), request(5), request(-1), request(5), request(7), request(0)};
  const std::vector<RequestId> want{first, ids[4], ids[1], ids[3], ids[0], ids[5], ids[2]};
  std::vector<RequestId> started;
  for (int step = 0; step < 200 && started.size() < want.size(); ++step) {
    h.engine().step();
    h.collect();
    for (auto& [id, r] : h.runs()) {
      if (!r.generated.empty() && std::find(started.begin(), started.end(), id) == started.end()) started.push_back(id);
    }
  }
  EXPECT_EQ(started, want);
  h.run();
  for (auto id : want) EXPECT_EQ(h[id].generated.size(), 3u);
}

TEST(EngineSampling, seeded_requests_sample_the_same_batched_alone_and_parked) {
  auto& m = *test::shared_model().model;
  std::mt19937_64 rng(3);
  const auto prompt = test::random_ids(rng, 90, m.config().vocab_size);
  auto request = [&] {
    auto r = test::greedy(prompt, 24, LogitsMode::none);
    r.sampling.temperature = 1.0f;
    r.sampling.top_p = 0.9f;
    r.sampling.top_k = 50;
    r.sampling.seed = 1234;
    return r;
  };
  EngineOptions o;
  o.host_bytes = 16 << 20;
  test::Harness alone(m, o);
  const auto a = alone.submit(request());
  alone.run();
  test::Harness batched(m, o);
  for (int i = 0; i < 5; ++i) batched.submit(test::greedy(test::random_ids(rng, 70, m.config().vocab_size), 30));
  const auto b = batched.submit(request());
  for (int i = 0; i < 6; ++i) batched.engine().step();
  batched.engine().park(b);
  for (int i = 0; i < 6; ++i) batched.engine().step();
  batched.engine().resume(b);
  batched.run();
  EXPECT_EQ(alone[a].generated.size(), 24u);
  EXPECT_EQ(alone[a].generated, batched[b].generated);
  EXPECT_GE(batched.engine().stats().parks, 1);
  // Other seeds: another sequence, unless at every step of a's the nucleus (top 50, then
  // top_p 0.9 of their softmax) is one token, when every seed must give a's.
  std::vector<int32_t> path = prompt;
  path.insert(path.end(), alone[a].generated.begin(), alone[a].generated.end());
  const auto rows = test::dense_logits(m, path);
  const auto V = static_cast<size_t>(m.config().vocab_size);
  bool one_token_nuclei = true;
  for (size_t t = prompt.size() - 1; t + 1 < path.size(); ++t) {
    std::vector<float> row(rows.begin() + static_cast<long>(t * V), rows.begin() + static_cast<long>((t + 1) * V));
    std::partial_sort(row.begin(), row.begin() + 50, row.end(), std::greater<>());
    double mass = 0;
    for (int i = 0; i < 50; ++i) mass += std::exp(static_cast<double>(row[i]) - row[0]);
    one_token_nuclei = one_token_nuclei && 1.0 / mass >= 0.9;
  }
  bool another = false;
  for (uint64_t seed : {99, 7, 2024, 31337}) {
    auto other = request();
    other.sampling.seed = seed;
    const auto c = alone.submit(std::move(other));
    alone.run();
    if (one_token_nuclei) {
      EXPECT_EQ(alone[c].generated, alone[a].generated) << "seed " << seed;
    }
    another = another || alone[c].generated != alone[a].generated;
  }
  if (!one_token_nuclei) {
    EXPECT_TRUE(another) << "four other seeds sampled the same 24 tokens";
  }
}

TEST(EngineSampling, stop_ids_max_tokens_and_min_tokens_end_requests) {
  auto& m = *test::shared_model().model;
  std::mt19937_64 rng(4);
  const auto prompt = test::random_ids(rng, 40, m.config().vocab_size);
  test::Harness h(m, EngineOptions{});
  const auto free = h.submit(test::greedy(prompt, 12, LogitsMode::none));
  h.run();
  const auto& toks = h[free].generated;
  ASSERT_EQ(toks.size(), 12u);
  EXPECT_EQ(h[free].last.reason, FinishReason::length);
  // Stop at the greedy continuation's 5th token.
  auto r = test::greedy(prompt, 12, LogitsMode::none);
  r.sampling.stop_ids = {toks[4]};
  const auto stopped = h.submit(std::move(r));
  // With min_tokens past it, the stop id cannot be sampled that early.
  auto late = test::greedy(prompt, 12, LogitsMode::none);
  late.sampling.stop_ids = {toks[0]};
  late.sampling.min_tokens = 3;
  const auto masked = h.submit(std::move(late));
  h.run();
  const auto first = std::find(toks.begin(), toks.end(), toks[4]) - toks.begin();
  EXPECT_EQ(h[stopped].last.reason, FinishReason::stop);
  EXPECT_EQ(static_cast<int64_t>(h[stopped].generated.size()), first + 1);
  EXPECT_EQ(h[stopped].generated.back(), toks[4]);
  EXPECT_GE(h[masked].generated.size(), 3u);
  EXPECT_NE(h[masked].generated[0], toks[0]);
  // EOS ends a request unless ignore_eos.
  const auto& eos = m.config().eos_token_ids;
  ASSERT_FALSE(eos.empty());
  auto e = test::greedy(prompt, 12, LogitsMode::none);
  e.sampling.ignore_eos = false;
  e.sampling.stop_ids = {};
  const auto plain = h.submit(std::move(e));
  h.run();
  const auto& pt = h[plain].generated;
  const bool hit = std::find(toks.begin(), toks.end(), static_cast<int32_t>(eos[0])) != toks.end();
  EXPECT_EQ(h[plain].last.reason, hit ? FinishReason::stop : FinishReason::length);
  EXPECT_EQ(pt.size(), hit ? static_cast<size_t>(std::find(toks.begin(), toks.end(), static_cast<int32_t>(eos[0])) - toks.begin() + 1) : 12u);
}

}  // namespace
}  // namespace troupe::engine
