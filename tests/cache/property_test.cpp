// Random interleavings of submit / step / abort / park / resume over random
// prompts that share prefixes: every request that finishes normally has the
// logits of a DenseState run of its tokens, and no page leaks.
#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <random>
#include <set>

#include "tests/cache/engine_harness.hpp"

namespace troupe::engine {
namespace {

using test::Harness;

EngineStats interleave(uint64_t seed, EngineOptions o, int requests) {
  auto& m = *test::shared_model().model;
  const int64_t V = m.config().vocab_size;
  Harness h(m, o);
  std::mt19937_64 rng(seed);
  std::vector<std::vector<int32_t>> bases;
  for (int i = 0; i < 3; ++i) bases.push_back(test::random_ids(rng, 100 + static_cast<int64_t>(rng() % 200), V));
  auto pick = [&](const std::vector<RequestId>& v) { return v[rng() % v.size()]; };

  std::vector<RequestId> ids, live, parked;
  std::set<RequestId> aborted;
  int submitted = 0;
  while (submitted < requests || !live.empty()) {
    const int action = static_cast<int>(rng() % 10);
    if (action < 2 && submitted < requests) {
      Request r;
      if (rng() % 2 == 0) {  // a shared prefix and a fresh tail
        const auto& b = bases[rng() % bases.size()];
        r.prompt.assign(b.begin(), b.begin() + 1 + static_cast<int64_t>(rng() % b.size()));
      }
      auto tail = test::random_ids(rng, 1 + static_cast<int64_t>(rng() % 80), V);
      r.prompt.insert(r.prompt.end(), tail.begin(), tail.end());
      r.sampling.max_tokens = 1 + static_cast<int32_t>(rng() % (o.device_bytes < (16u << 20) ? 60 : 12));
      r.sampling.ignore_eos = true;
      if (rng() % 2 == 0) {
        r.sampling.temperature = 0.8f;
        r.sampling.top_k = 20;
        r.sampling.seed = rng();
      }
      r.max_chunk_tokens = rng() % 2 == 0 ? 0 : 1 + static_cast<int64_t>(rng() % 64);
      r.logits = LogitsMode::all;
      const auto id = h.submit(std::move(r));
      ids.push_back(id);
      live.push_back(id);
      ++submitted;
    } else if (action == 2 && !live.empty() && rng() % 3 == 0) {
      const auto id = pick(live);
      h.engine().abort(id);
      aborted.insert(id);
    } else if (action == 3 && !live.empty() && o.host_bytes > 0) {
      const auto id = pick(live);
      h.engine().park(id);
      parked.push_back(id);
    } else if (action == 4 && !parked.empty()) {
      const auto id = pick(parked);
      h.engine().resume(id);
      std::erase(parked, id);
    } else {
      h.engine().step();
    }
    h.collect();
    std::erase_if(live, [&](RequestId id) { return h[id].finished; });
    std::erase_if(parked, [&](RequestId id) { return h[id].finished; });
    if (live.size() == parked.size() && !parked.empty() && submitted == requests) {
      for (auto id : parked) h.engine().resume(id);
      parked.clear();
    }
  }
  h.run();
  for (auto id : ids) {
    const auto& r = h[id];
    EXPECT_TRUE(r.finished) << "request " << id;
    if (!r.finished || (aborted.count(id) > 0 && r.last.reason == FinishReason::abort)) continue;
    EXPECT_NE(r.last.reason, FinishReason::error) << "request " << id << ": " << r.last.message;
    if (r.last.reason == FinishReason::error) continue;
    EXPECT_EQ(static_cast<int32_t>(r.generated.size()), r.last.usage.generated_tokens);
    h.expect_dense_logits(id);
  }
  const auto s = h.engine().stats();
  h.expect_no_leaks(false);
  h.engine().clear_cache();
  h.expect_no_leaks(true);
  std::printf("seed %lu: steps %ld cached %ld recomputed %ld parks %ld resumes %ld preemptions %ld aborted %ld spilled %ld reloaded %ld cold %ld tombstoned %ld erased %ld waits %ld\n",
              seed, s.steps, s.cached_tokens, s.recomputed_tokens, s.parks, s.resumes, s.preemptions, s.aborted,
              s.spilled_pages, s.reloaded_pages, s.cold_pages, s.tombstoned_pages, s.erased_nodes, s.admission_waits);
  return s;
}

EngineOptions roomy_with_host() {
  EngineOptions o;
  o.step_tokens = 96;
  o.host_bytes = 64 << 20;
  return o;
}

// Tight device tier: admission waits, preemption, spills and cold pages happen.
EngineOptions tight(bool host) {
  const auto g = cache::CacheGeometry::of(test::shared_model().model->config());
  EngineOptions o;
  o.step_tokens = 64;
  o.slab_bytes = cache::PoolSet::default_slab_bytes(g);
  o.device_bytes = 6 * o.slab_bytes;
  o.checkpoint_every_pages = 1;  // many checkpoint windows: tombstones happen
  o.host_bytes = host ? 64 << 20 : 0;
  return o;
}

// TROUPE_STRESS=N runs N more seeds per test (not in CI).
std::vector<uint64_t> seeds(std::vector<uint64_t> base) {
  if (const char* n = std::getenv("TROUPE_STRESS")) {
    for (uint64_t i = 0; i < std::strtoull(n, nullptr, 10); ++i) base.push_back(1000 + i * 7919 + base.front());
  }
  return base;
}

TEST(EngineProperty, park_resume_abort_interleavings_keep_logits_and_pages) {
  for (uint64_t seed : seeds({1, 2, 3})) interleave(seed, roomy_with_host(), 10);
}

TEST(EngineProperty, a_tight_device_tier_without_host_preempts_by_recompute) {
  for (uint64_t seed : seeds({4, 5})) interleave(seed, tight(false), 10);
}

TEST(EngineProperty, a_tight_device_tier_with_host_parks_spills_and_reloads) {
  for (uint64_t seed : seeds({6, 7})) interleave(seed, tight(true), 10);
}

// Pages shorter than the window (a window spans two pages) and a device
// tier so small that preemption, spills and cold pages are routine.
TEST(EngineProperty, small_pages_and_a_tiny_device_tier) {
  const auto& c = test::shared_model().model->config();
  const auto g = cache::CacheGeometry::of(c);
  const int64_t small = std::max<int64_t>(g.hca_rate, 2 * g.csa_rate);
  if (small >= c.sliding_window || c.sliding_window % small != 0) GTEST_SKIP() << "the model allows no smaller page";
  EngineOptions o = tight(true);
  o.page_tokens = small;
  o.slab_bytes = 0;
  const auto gs = cache::CacheGeometry::of(c, small);
  o.device_bytes = 7 * cache::PoolSet::default_slab_bytes(gs);
  o.checkpoint_every_pages = 2;
  o.decode_insert_every_pages = 3;
  for (uint64_t seed : seeds({8, 9})) interleave(seed, o, 10);
}

// The same with decode steps through model::Decoder (tables in backend memory,
// key lists and picks made by backend ops; on the CPU backend without graphs):
// tables refresh after prefill chunks and page moves (park, resume, reload, cold pages).
TEST(EngineProperty, decoder_steps_keep_logits_and_pages_through_moves) {
  for (uint64_t seed : {1, 6}) {
    EngineOptions o = seed == 1 ? roomy_with_host() : tight(true);
    o.decode_batch = 4;
    o.decode_context = 2048;
    const auto s = interleave(seed, o, 10);
    EXPECT_GT(s.decoder_steps, 0);
  }
}

}  // namespace
}  // namespace troupe::engine
