// The host tier lets one sequence outgrow a capped device tier: cold entry
// pages move to the host tier (read in place), with the logits of an uncapped run.
#include <gtest/gtest.h>

#include <random>

#include "tests/cache/engine_harness.hpp"

namespace troupe::engine {
namespace {

using test::Harness;

// A device tier of `bytes` in slabs of one page of the largest pool (fine
// steps); 576 KiB is about a thousand tokens of the tiny model.
EngineOptions capped(bool host, uint64_t bytes) {
  const auto g = cache::CacheGeometry::of(test::shared_model().model->config());
  EngineOptions o;
  o.step_tokens = std::min<int64_t>(512, g.page_tokens);  // (a chunk's pages stay well inside the tier)
  o.slab_bytes = (g.largest_page_bytes() + 4095) / 4096 * 4096;
  o.device_bytes = bytes;
  o.host_bytes = host ? uint64_t{256} << 20 : 0;
  o.prefix_cache = false;
  return o;
}

TEST(Offload, one_sequence_reaches_four_times_the_context_with_identical_logits) {
  auto& m = *test::shared_model().model;
  std::mt19937_64 rng(21);
  const int64_t longest = std::min<int64_t>(20000, m.config().max_position_embeddings - 16);
  const auto long_prompt = test::random_ids(rng, longest, m.config().vocab_size);

  // Without the host tier the sequence stops where the device tier is full. The
  // tier (576 KiB, or found by bisection) stops it after 4 pages and before a
  // quarter of the model's positions.
  auto reach = [&](uint64_t bytes) -> int64_t {  // tokens computed before the tier was full; longest: it all fit
    Harness h(m, capped(false, bytes));
    const auto id = h.submit(test::greedy(long_prompt, 1, LogitsMode::none));
    h.run();
    EXPECT_TRUE(h[id].finished);
    h.expect_no_leaks(true);
    if (h[id].last.reason == FinishReason::length) return longest;
    EXPECT_EQ(h[id].last.reason, FinishReason::error);
    EXPECT_EQ(h[id].last.code, ErrorCode::resource_exhausted);
    return h[id].last.usage.computed_tokens;
  };
  // (At least 4 pages: the host-tier run keeps the last two on the device.)
  const int64_t P = cache::CacheGeometry::of(m.config()).page_tokens;
  auto fits = [&](int64_t r) { return r >= 4 * P && 4 * r + 64 <= longest; };
  uint64_t bytes = 576 << 10, too_big = 0, too_small = 0;
  int64_t reached = reach(bytes);
  for (int i = 0; i < 24 && !fits(reached); ++i) {
    (reached < 4 * P ? too_small : too_big) = bytes;
    bytes = too_small == 0 ? bytes / 2 : (too_small + too_big) / 2;
    reached = reach(bytes);
  }
  if (!fits(reached)) {  // (a model whose per-page state is small next to its window: a tier holds 1 page or all)
    GTEST_SKIP() << "no device tier stops a " << longest << "-token prompt between 4 pages and a quarter of it "
                 << "(last: " << reached << " tokens with " << bytes << " bytes): the case cannot be set up";
  }
  const int64_t target = 4 * reached + 64;
  ASSERT_LE(target, longest);
  std::vector<int32_t> prompt(long_prompt.begin(), long_prompt.begin() + target);
  RecordProperty("context_without_host", static_cast<int>(reached));
  RecordProperty("context_with_host", static_cast<int>(target));

  // With it, four times as far, decoding at the end.
  Harness capped_run(m, capped(true, bytes));
  const auto a = capped_run.submit(test::greedy(prompt, 8, LogitsMode::sampled));
  capped_run.run();
  ASSERT_TRUE(capped_run[a].finished);
  ASSERT_EQ(capped_run[a].last.reason, FinishReason::length) << capped_run[a].last.message;
  const auto stats = capped_run.engine().stats();
  EXPECT_GT(stats.cold_pages, 0);
  int64_t device_bytes = 0;  // the cap held
  for (auto k : cache::kAllPools) {
    device_bytes += stats.device[static_cast<size_t>(cache::index(k))].capacity *
                    static_cast<int64_t>(capped_run.engine().geometry().pool(k).page_bytes);
  }
  EXPECT_LE(device_bytes, static_cast<int64_t>(bytes));

  // The same request uncapped.
  EngineOptions roomy;
  roomy.step_tokens = 512;
  roomy.prefix_cache = false;
  Harness free_run(m, roomy);
  const auto b = free_run.submit(test::greedy(prompt, 8, LogitsMode::sampled));
  free_run.run();
  ASSERT_EQ(free_run[b].generated, capped_run[a].generated);
  ASSERT_EQ(free_run[b].rows.size(), capped_run[a].rows.size());
  for (const auto& [pos, row] : free_run[b].rows) {
    const auto& other = capped_run[a].rows.at(pos);
    EXPECT_EQ(row, other) << "position " << pos;  // same batches, same kernels: bitwise equal
  }
  capped_run.expect_no_leaks(true);
  free_run.expect_no_leaks(true);
}

}  // namespace
}  // namespace troupe::engine
