// The batched engine against DenseState runs: batching, prefix reuse,
// tombstones, admission control.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <random>

#include "tests/cache/engine_harness.hpp"

namespace troupe::engine {
namespace {

using test::greedy;
using test::Harness;

model::Model& tiny() { return *test::shared_model().model; }

// `o` with a device tier of `slabs` of the model's default slab.
EngineOptions with_slabs(EngineOptions o, const cache::CacheGeometry& g, int64_t slabs) {
  o.slab_bytes = cache::PoolSet::default_slab_bytes(g);
  o.device_bytes = static_cast<uint64_t>(slabs) * o.slab_bytes;
  return o;
}

// Whether each of `ids` finished by reaching its max_tokens.
bool all_ran_to_length(Harness& h, const std::vector<RequestId>& ids) {
  return std::ranges::all_of(ids, [&](RequestId id) { return h[id].finished && h[id].last.reason == FinishReason::length; });
}

// 32 sequences of random lengths (1 to 700 tokens) in random prefill chunks,
// batched together, against each run alone through DenseState in one call.
void batched_equal_alone(model::Model& m, float tol, int64_t max_len) {
  EngineOptions o;
  o.step_tokens = 384;
  Harness h(m, o);
  std::mt19937_64 rng(11);
  std::vector<RequestId> ids;
  for (int i = 0; i < 32; ++i) {
    auto r = greedy(test::random_ids(rng, 1 + static_cast<int64_t>(rng() % static_cast<uint64_t>(max_len)), m.config().vocab_size),
                    1 + static_cast<int32_t>(rng() % 4));
    r.max_chunk_tokens = rng() % 3 == 0 ? 0 : 1 + static_cast<int64_t>(rng() % 200);  // random chunkings
    ids.push_back(h.submit(std::move(r)));
  }
  h.run();
  const auto stats = h.engine().stats();
  EXPECT_GT(stats.forward_tokens, 8 * stats.steps);  // many sequences per forward call
  for (auto id : ids) {
    ASSERT_TRUE(h[id].finished);
    EXPECT_EQ(h[id].last.reason, FinishReason::length);
    h.expect_dense_logits(id, tol);
  }
  h.expect_no_leaks(false);
  h.engine().clear_cache();
  h.expect_no_leaks(true);
}

// LogitsMode::prompt (prompt logprobs): every prompt row once, in `logits` events
// before the first token, then each token with its row; max_tokens 0 ends after
// the prompt with no token. Both equal DenseState's rows, with a shared prefix in
// the tree (prefix_cache off: none of it is taken from there) and in company.
TEST(Engine, prompt_rows_then_sampled_rows_and_max_tokens_zero) {
  auto& m = tiny();
  EngineOptions o;
  o.step_tokens = 96;
  Harness h(m, o);
  std::mt19937_64 rng(23);
  const auto prompt = test::random_ids(rng, 300, m.config().vocab_size);
  h.submit(greedy(prompt, 3, LogitsMode::none));  // leaves the prompt in the tree
  h.run();
  std::vector<RequestId> ids;
  for (int32_t max_tokens : {4, 0}) {
    auto r = greedy(prompt, max_tokens, LogitsMode::prompt);
    r.prefix_cache = false;
    r.max_chunk_tokens = 50;
    ids.push_back(h.submit(std::move(r)));
    h.submit(greedy(test::random_ids(rng, 120, m.config().vocab_size), 5, LogitsMode::none));  // company
  }
  h.run();
  for (size_t i = 0; i < ids.size(); ++i) {
    const auto& run = h[ids[i]];
    ASSERT_TRUE(run.finished);
    EXPECT_EQ(run.last.reason, FinishReason::length);
    EXPECT_EQ(run.generated.size(), i == 0 ? 4u : 0u);
    EXPECT_EQ(run.last.usage.cached_tokens, 0);
    const auto first_token = std::find(run.kinds.begin(), run.kinds.end(), EventKind::token);
    EXPECT_EQ(std::count(first_token, run.kinds.end(), EventKind::logits), 0) << "a logits event after a token";
    EXPECT_GE(std::count(run.kinds.begin(), run.kinds.end(), EventKind::logits), 6);  // chunks of at most 50
    h.expect_dense_logits(ids[i]);
  }
  h.expect_no_leaks(false);
}

// The model alone (no cache): a sequence fed in chunks of 1, 7 or 64 tokens,
// each call batched with another sequence, gives the bits of one call.
TEST(Engine, model_rows_do_not_depend_on_chunking_or_batch_company) {
  auto& m = tiny();
  std::mt19937_64 rng(5);
  const auto ids = test::random_ids(rng, 200, m.config().vocab_size);
  const auto company = test::random_ids(rng, 200, m.config().vocab_size);
  const auto want = test::dense_logits(m, ids);
  for (size_t chunk : {1, 7, 64}) {
    const auto got = test::dense_logits_chunked(m, ids, chunk, company);
    ASSERT_EQ(got.size(), want.size());
    EXPECT_EQ(0, std::memcmp(got.data(), want.data(), got.size() * sizeof(float))) << "chunks of " << chunk;
  }
}

// Decode steps through model::Decoder (batches up to 8; more running sequences
// than slots fall back to Model::forward) give the DenseState logits too.
TEST(Engine, decoder_steps_equal_each_alone) {
  auto& m = tiny();
  EngineOptions o;
  o.step_tokens = 384;
  o.decode_batch = 8;
  o.decode_context = 4096;
  Harness h(m, o);
  std::mt19937_64 rng(21);
  std::vector<RequestId> ids;
  for (int i = 0; i < 12; ++i) {
    auto r = greedy(test::random_ids(rng, 1 + static_cast<int64_t>(rng() % 300), m.config().vocab_size),
                    2 + static_cast<int32_t>(rng() % 30));
    r.max_chunk_tokens = rng() % 3 == 0 ? 0 : 1 + static_cast<int64_t>(rng() % 100);
    ids.push_back(h.submit(std::move(r)));
  }
  h.run();
  const auto stats = h.engine().stats();
  EXPECT_GT(stats.decoder_steps, 0);
  for (auto id : ids) {
    ASSERT_TRUE(h[id].finished);
    EXPECT_EQ(h[id].last.reason, FinishReason::length);
    h.expect_dense_logits(id);
  }
  h.expect_no_leaks(false);
  h.engine().clear_cache();
  h.expect_no_leaks(true);
}

// Row by row the math does not depend on the batch (the CPU backend's
// products are batch-invariant): bitwise equal.
TEST(Engine, thirty_two_sequences_batched_equal_each_alone_exactly) { batched_equal_alone(tiny(), 0.0f, 700); }

TEST(Engine, prefix_reuse_computes_the_new_tokens_and_less_than_a_window) {
  auto& m = tiny();
  EngineOptions o;
  o.step_tokens = 128;
  Harness h(m, o);
  const int64_t P = h.engine().geometry().page_tokens;
  std::mt19937_64 rng(12);
  const auto x = test::random_ids(rng, 500, m.config().vocab_size);
  const auto a = h.submit(greedy(x, 3));
  h.run();
  // A finished: the tree keeps its entries and only the windows of its checkpoints.
  const auto after_a = h.engine().stats();
  EXPECT_EQ(after_a.device[0].in_use, after_a.device[0].cached);
  EXPECT_LE(after_a.device[0].in_use, 5);  // chunk ends 128, 256, 384, 500 and the finish
  EXPECT_EQ(after_a.device[1].in_use, 503 / P);

  auto y = test::random_ids(rng, 40, m.config().vocab_size);
  auto b_prompt = x;
  b_prompt.insert(b_prompt.end(), y.begin(), y.end());
  const auto b = h.submit(greedy(b_prompt, 3));
  h.run();
  const auto& u = h[b].last.usage;
  EXPECT_EQ(u.cached_tokens, 500 / P * P);
  EXPECT_EQ(u.computed_tokens, static_cast<int64_t>(b_prompt.size()) + 2 - u.cached_tokens);
  EXPECT_LE(u.computed_tokens - 2, 40 + P);  // the new tokens, plus less than a page (the last boundary's rest)
  h.expect_dense_logits(a);
  h.expect_dense_logits(b);
  // The tokens equal a cold run's.
  Harness cold(m, o);
  auto r = greedy(b_prompt, 3);
  r.prefix_cache = false;
  const auto c = cold.submit(std::move(r));
  cold.run();
  EXPECT_EQ(cold[c].generated, h[b].generated);
  EXPECT_EQ(cold[c].last.usage.cached_tokens, 0);
  h.engine().clear_cache();
  h.expect_no_leaks(true);
}

TEST(Engine, prefix_reuse_after_windows_were_tombstoned) {
  auto& m = tiny();
  EngineOptions o;
  o.step_tokens = 256;
  o.checkpoint_every_pages = 1;  // keep the window of every page boundary, until tombstoned
  Harness h(m, o);
  const int64_t P = h.engine().geometry().page_tokens;
  const int64_t V = m.config().vocab_size;
  std::mt19937_64 rng(13);
  const auto x = test::random_ids(rng, 600, V);
  h.submit(greedy(x, 2));
  h.run();
  const int64_t windows_before = h.engine().stats().device[0].in_use;
  EXPECT_GE(windows_before, 600 / P - 1);
  auto share = [&](int64_t n) {
    std::vector<int32_t> p(x.begin(), x.begin() + n);
    auto y = test::random_ids(rng, 30, V);
    p.insert(p.end(), y.begin(), y.end());
    return p;
  };
  // Sharing 300 tokens, mid-prefix: every boundary is a checkpoint.
  const auto b1 = h.submit(greedy(share(300), 2));
  h.run();
  EXPECT_EQ(h[b1].last.usage.cached_tokens, 300 / P * P);
  EXPECT_LE(h[b1].last.usage.computed_tokens - 1, 30 + P);
  h.expect_dense_logits(b1);

  // Tombstone: windows inside the prefix go; the entries and each node's end window stay.
  const int64_t dropped = h.engine().tombstone_windows(1000);
  EXPECT_GT(dropped, 0);
  const auto after = h.engine().stats();
  EXPECT_LT(after.device[0].in_use, windows_before);
  EXPECT_EQ(after.device[1].in_use, after.device[1].cached);  // entries untouched
  // The whole prefix again: resumes at the node end, less than a window recomputed.
  const auto b2 = h.submit(greedy(share(600), 2));
  // Mid-prefix again: the window is gone there, so the match retreats to the
  // deepest checkpoint left (the node boundary at 300), still exact.
  const auto b3 = h.submit(greedy(share(450), 2));
  h.run();
  EXPECT_EQ(h[b2].last.usage.cached_tokens, 600 / P * P);
  EXPECT_LE(h[b2].last.usage.computed_tokens - 1, 30 + P);
  EXPECT_LT(h[b3].last.usage.cached_tokens, 450 / P * P);
  EXPECT_GT(h[b3].last.usage.recomputed_tokens, 0);
  h.expect_dense_logits(b2);
  h.expect_dense_logits(b3);
  h.engine().clear_cache();
  h.expect_no_leaks(true);
}

TEST(Engine, new_work_waits_when_the_device_tier_is_full_and_says_why) {
  auto& m = tiny();
  const auto g = cache::CacheGeometry::of(m.config());
  std::mt19937_64 rng(14);
  std::vector<std::vector<int32_t>> prompts;
  for (int i = 0; i < 6; ++i) prompts.push_back(test::random_ids(rng, 300, m.config().vocab_size));
  // The smallest device tier that runs each request (4-6 slabs on the tiny model; models of
  // other page sizes need other counts): there the six cannot all run at once.
  for (int64_t slabs = 1; slabs <= 64; ++slabs) {
    EngineOptions o = with_slabs({}, g, slabs);
    o.step_tokens = 64;
    o.prefix_cache = false;
    Harness h(m, o);
    std::vector<RequestId> ids;
    for (const auto& p : prompts) ids.push_back(h.submit(greedy(p, 20)));
    bool waited = false;
    while (!h.engine().idle()) {
      h.engine().step();
      const auto s = h.engine().stats();
      if (s.waiting > 0 && !s.waiting_reason.empty()) waited = true;
    }
    h.collect();
    if (!all_ran_to_length(h, ids)) continue;  // one request alone does not fit this tier: a larger one
    EXPECT_TRUE(waited) << "with " << slabs << " slabs";
    EXPECT_GT(h.engine().stats().admission_waits, 0);
    for (auto id : ids) h.expect_dense_logits(id);
    h.expect_no_leaks(true);
    return;
  }
  FAIL() << "no device tier up to 64 slabs ran the requests";
}

TEST(Engine, a_request_that_can_never_fit_fails_clearly) {
  auto& m = tiny();
  const auto g = cache::CacheGeometry::of(m.config());
  EngineOptions o;
  o.slab_bytes = cache::PoolSet::default_slab_bytes(g);
  o.device_bytes = 2 * o.slab_bytes;
  Harness h(m, o);
  std::mt19937_64 rng(15);
  const auto id = h.submit(greedy(test::random_ids(rng, 3000, m.config().vocab_size), 2));
  h.run();
  ASSERT_TRUE(h[id].finished);
  EXPECT_EQ(h[id].last.reason, FinishReason::error);
  EXPECT_EQ(h[id].last.code, ErrorCode::resource_exhausted);
  EXPECT_NE(h[id].last.message.find("device tier"), std::string::npos) << h[id].last.message;
  h.engine().clear_cache();
  h.expect_no_leaks(true);
}

TEST(Engine, bad_requests_finish_with_invalid_argument) {
  auto& m = tiny();
  Harness h(m, EngineOptions{});
  const auto empty = h.submit(greedy({}, 1));
  const auto range = h.submit(greedy({1, static_cast<int32_t>(m.config().vocab_size)}, 1));
  auto r = greedy({1, 2}, 1);
  r.sampling.top_p = 0;
  const auto top_p = h.submit(std::move(r));
  h.run();
  for (auto id : {empty, range, top_p}) {
    ASSERT_TRUE(h[id].finished);
    EXPECT_EQ(h[id].last.code, ErrorCode::invalid_argument);
    EXPECT_FALSE(h[id].last.message.empty());
  }
}

TEST(Engine, runs_on_its_own_thread) {
  auto& m = tiny();
  std::mutex mu;
  std::condition_variable cv;
  std::map<RequestId, std::vector<int32_t>> tokens;
  int finished = 0;
  Engine e(m, EngineOptions{}, [&](const Event& ev) {
    std::lock_guard lock(mu);
    if (ev.kind == EventKind::token) tokens[ev.id].push_back(ev.token);
    if (ev.kind == EventKind::finished) ++finished;
    cv.notify_all();
  });
  e.start();
  std::mt19937_64 rng(16);
  std::vector<RequestId> ids;
  for (int i = 0; i < 8; ++i) ids.push_back(e.submit(greedy(test::random_ids(rng, 50, m.config().vocab_size), 5)));
  std::unique_lock lock(mu);
  ASSERT_TRUE(cv.wait_for(lock, std::chrono::seconds(60), [&] { return finished == 8; }));
  for (auto id : ids) EXPECT_EQ(tokens[id].size(), 5u);
  lock.unlock();
  e.stop();
}

}  // namespace
}  // namespace troupe::engine

namespace troupe::engine {
namespace {

// The prefill side of a PD handoff: `r` runs on `prefill` until its first
// token, parks, and its state is exported (`id`: the request there).
std::optional<SequenceImage> prefill_and_export(Harness& prefill, Request r, RequestId& id) {
  r.park_after_prefill = true;
  id = prefill.submit(std::move(r));
  prefill.run();
  if (prefill[id].finished || prefill[id].generated.size() != 1u) {
    ADD_FAILURE() << "the prefill did not park after its first token";
    return std::nullopt;
  }
  auto future = prefill.engine().export_parked(id);
  prefill.engine().step();
  return future.get();
}

// The end of a handoff: the prefill side lets go of its parked request once
// the decode side has the state; with the caches cleared, nothing leaks on either.
void release_handoff(Harness& prefill, RequestId id, Harness& decode) {
  prefill.engine().abort(id);
  prefill.run();
  prefill.engine().clear_cache();
  prefill.expect_no_leaks(true);
  decode.engine().clear_cache();
  decode.expect_no_leaks(true);
}

// PD handoff: a prefill engine parks the request after its first token, its
// state is exported as an image and imported by a decode engine, which
// continues with the tokens of a single engine's run.
TEST(EngineHandoff, prefill_then_decode_elsewhere_gives_the_same_tokens) {
  auto& m = tiny();
  std::mt19937_64 rng(17);
  const auto prompt = test::random_ids(rng, 333, m.config().vocab_size);
  auto request = [&] {
    auto r = test::greedy(prompt, 10, LogitsMode::sampled);
    r.sampling.temperature = 0.7f;
    r.sampling.seed = 5;
    return r;
  };
  Harness one(m, EngineOptions{});
  const auto whole = one.submit(request());
  one.run();

  EngineOptions with_host;
  with_host.host_bytes = 32 << 20;
  for (bool decode_host : {true, false}) {
    Harness prefill(m, with_host);
    RequestId id = 0;
    auto image = prefill_and_export(prefill, request(), id);
    ASSERT_TRUE(image.has_value());
    EXPECT_GT(image->bytes(), 0u);
    EXPECT_EQ(image->length, static_cast<int64_t>(prompt.size()));

    EngineOptions o;
    if (decode_host) o.host_bytes = 32 << 20;
    Harness decode(m, o);
    const auto moved = decode.engine().import(std::move(*image));
    decode.run();
    ASSERT_TRUE(decode[moved].finished) << decode[moved].last.message;
    EXPECT_EQ(decode[moved].last.reason, FinishReason::length);
    std::vector<int32_t> tokens = prefill[id].generated;
    tokens.insert(tokens.end(), decode[moved].generated.begin(), decode[moved].generated.end());
    EXPECT_EQ(tokens, one[whole].generated);
    for (const auto& [pos, row] : decode[moved].rows) {
      EXPECT_EQ(row, one[whole].rows.at(pos));
    }
    release_handoff(prefill, id, decode);
  }
}

TEST(EngineHandoff, an_image_waiting_for_device_room_counts_as_waiting) {
  // A decode worker's queue is the handoffs it took and cannot run yet: the
  // scale rule reads it as queue depth, so it must not hide among the parked.
  auto& m = tiny();
  const int64_t V = m.config().vocab_size;
  std::mt19937_64 rng(23);
  const auto prompt = test::random_ids(rng, 300, V);
  std::vector<std::vector<int32_t>> busy_prompts;
  for (int i = 0; i < 6; ++i) busy_prompts.push_back(test::random_ids(rng, 300, V));
  const auto g = cache::CacheGeometry::of(m.config());
  EngineOptions with_host;
  with_host.host_bytes = 32 << 20;
  // Device tiers from the smallest: the first that runs each request and where the busy
  // requests hold the device while the image waits through an audit (the tiny model's 6
  // slabs; models of other page sizes need other counts). Every tier's audits must count
  // a waiting image as waiting.
  for (int64_t slabs = 1; slabs <= 64; ++slabs) {
    Harness prefill(m, with_host);
    RequestId id = 0;
    auto image = prefill_and_export(prefill, test::greedy(prompt, 10), id);
    ASSERT_TRUE(image.has_value());
    EngineOptions o = with_slabs(with_host, g, slabs);
    o.prefix_cache = false;
    Harness decode(m, o);
    // Requests that fill the device tier first.
    std::vector<RequestId> ran;
    for (const auto& p : busy_prompts) ran.push_back(decode.submit(greedy(p, 40)));
    for (int i = 0; i < 8; ++i) decode.engine().step();
    const auto moved = decode.engine().import(std::move(*image));
    ran.push_back(moved);
    bool counted = false;
    while (!decode.engine().idle()) {
      decode.engine().step();
      const auto s = decode.engine().stats();
      if (s.steps % 32 != 0) continue;  // the request list is refreshed with the full audit
      for (const auto& q : s.requests) {
        if (q.id == moved && q.phase == "parked") {
          EXPECT_GE(s.waiting, 1);
          EXPECT_EQ(s.parked, 0);
          counted = true;
        }
      }
    }
    decode.collect();
    if (!all_ran_to_length(decode, ran) || !counted) continue;  // a request did not fit, or the image did not wait: a larger tier
    release_handoff(prefill, id, decode);
    return;
  }
  FAIL() << "no device tier up to 64 slabs made the image wait through an audit";
}

TEST(EngineHandoff, a_bad_image_finishes_with_an_error) {
  auto& m = tiny();
  Harness h(m, EngineOptions{});
  SequenceImage im;
  im.page_tokens = h.engine().geometry().page_tokens + 1;
  im.tokens = {1, 2};
  im.length = 1;
  const auto a = h.engine().import(im);
  im.page_tokens = h.engine().geometry().page_tokens;
  im.length = 1;  // no window pages for the state
  const auto b = h.engine().import(im);
  h.run();
  for (auto id : {a, b}) {
    ASSERT_TRUE(h[id].finished);
    EXPECT_EQ(h[id].last.code, ErrorCode::invalid_argument) << h[id].last.message;
  }
  h.expect_no_leaks(true);
}

}  // namespace
}  // namespace troupe::engine

namespace troupe::engine {
namespace {

TEST(EngineStats, report_requests_pools_and_free_bytes) {
  auto& m = tiny();
  EngineOptions o;
  o.host_bytes = 8 << 20;
  Harness h(m, o);
  std::mt19937_64 rng(18);
  const auto a = h.submit(greedy(test::random_ids(rng, 200, m.config().vocab_size), 50));
  h.engine().step();
  h.engine().park(a);
  h.run();  // idle once parked
  auto s = h.engine().stats();
  ASSERT_EQ(s.requests.size(), 1u);
  EXPECT_EQ(s.requests[0].phase, "parked");
  EXPECT_EQ(s.requests[0].device_bytes, 0);
  EXPECT_GT(s.requests[0].host_bytes, 0);
  EXPECT_EQ(s.requests[0].max_tokens, 250);
  EXPECT_EQ(s.parked, 1);
  EXPECT_LE(s.device_free_bytes, s.device_budget_bytes);
  EXPECT_LT(s.host_free_bytes, s.host_budget_bytes);
  int64_t parked_pages = 0;
  for (const auto& p : s.host) parked_pages += p.parked;
  EXPECT_GT(parked_pages, 0);
  h.engine().resume(a);
  h.run();
  s = h.engine().stats();
  EXPECT_TRUE(s.requests.empty());
  EXPECT_EQ(s.parks, 1);
  EXPECT_EQ(s.resumes, 1);
  EXPECT_EQ(h[a].generated.size(), 50u);
  h.expect_dense_logits(a);
}

}  // namespace
}  // namespace troupe::engine

namespace troupe::engine {
namespace {

// Decode checkpoints on a running sequence's own path give way under pressure:
// a long generation does not run out of window pages.
TEST(Engine, decode_checkpoints_yield_to_a_long_generation) {
  auto& m = tiny();
  const auto g = cache::CacheGeometry::of(m.config());
  // 25 pages in all (100 + 700 tokens with the tiny model's 32-token pages), most of them decoded.
  const int64_t P = g.page_tokens;
  std::mt19937_64 rng(19);
  const auto prompt = test::random_ids(rng, 3 * P + 4, m.config().vocab_size);
  // A device tier of 7 slabs presses the tiny model's checkpoints; other models may
  // need fewer: the smallest that still runs the request shows it.
  for (int64_t slabs = 7; slabs >= 1; --slabs) {
    EngineOptions o = with_slabs({}, g, slabs);
    o.decode_insert_every_pages = 1;  // a checkpoint every page
    Harness h(m, o);
    const auto id = h.submit(greedy(prompt, static_cast<int32_t>(22 * P - 4), LogitsMode::none));
    h.run();
    ASSERT_TRUE(h[id].finished);
    ASSERT_EQ(h[id].last.reason, FinishReason::length)
        << "with " << slabs << " slabs, before any checkpoint gave way: " << h[id].last.message;
    const bool yielded = h.engine().stats().tombstoned_pages > 0;
    h.engine().clear_cache();
    h.expect_no_leaks(true);
    if (yielded) return;
  }
  FAIL() << "no device tier pressed the checkpoints";
}

}  // namespace
}  // namespace troupe::engine

namespace troupe::engine {
namespace {

// A cached prefix pushed out of a small device tier is spilled to the host
// tier and reloaded by a later request that shares it.
TEST(Engine, spilled_prefixes_reload_on_a_later_match) {
  auto& m = tiny();
  const auto g = cache::CacheGeometry::of(m.config());
  const int64_t V = m.config().vocab_size;
  std::mt19937_64 rng(20);
  const auto shared = test::random_ids(rng, 400, V);
  std::vector<std::vector<int32_t>> others;
  for (int i = 0; i < 6; ++i) others.push_back(test::random_ids(rng, 700, V));
  auto prompt = shared;
  const auto tail = test::random_ids(rng, 20, V);
  prompt.insert(prompt.end(), tail.begin(), tail.end());
  // The smallest device tier that runs each request (the tiny model's 8 slabs or fewer;
  // models of other page sizes need other counts): the others' cached prefixes push the
  // shared one out.
  for (int64_t slabs = 1; slabs <= 64; ++slabs) {
    EngineOptions o = with_slabs({}, g, slabs);
    o.host_bytes = 64 << 20;
    o.step_tokens = 256;
    Harness h(m, o);
    std::vector<RequestId> ids{h.submit(greedy(shared, 2))};
    h.run();
    // Others fill the device tier: the shared prefix goes to the host tier.
    for (const auto& p : others) ids.push_back(h.submit(greedy(p, 2)));
    h.run();
    if (!all_ran_to_length(h, ids)) continue;  // one request alone does not fit this tier: a larger one
    auto s = h.engine().stats();
    EXPECT_GT(s.spilled_pages, 0) << "with " << slabs << " slabs";
    const auto b = h.submit(greedy(prompt, 3));
    h.run();
    s = h.engine().stats();
    EXPECT_GT(s.reloaded_pages, 0);
    EXPECT_EQ(h[b].last.usage.cached_tokens, 400 / g.page_tokens * g.page_tokens);
    h.expect_dense_logits(b);
    h.engine().clear_cache();
    h.expect_no_leaks(true);
    return;
  }
  FAIL() << "no device tier up to 64 slabs ran the requests";
}

}  // namespace
}  // namespace troupe::engine
