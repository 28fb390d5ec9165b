// The host tier lets one sequence outgrow a capped device tier: cold entry
// pages move to the host tier (read in place), with the logits of an uncapped run.
#include <gtest/gtest.h>

#include <random>

#include "tests/cache/engine_harness.hpp"

namespace troupe::engine {
namespace {

using test::Harness;

// A device tier of 9 small slabs: about a thousand tokens of the tiny model.
EngineOptions capped(bool host) {
  EngineOptions o;
  o.step_tokens = 512;
  o.slab_bytes = 64 << 10;
  o.device_bytes = 9 * o.slab_bytes;
  o.host_bytes = host ? uint64_t{256} << 20 : 0;
  o.prefix_cache = false;
  return o;
}

TEST(Offload, one_sequence_reaches_four_times_the_context_with_identical_logits) {
  auto& m = *test::plain_model().model;  // capped and uncapped run the same batches: bitwise equal
  std::mt19937_64 rng(21);
  const auto long_prompt = test::random_ids(rng, 20000, m.config().vocab_size);

  // Without the host tier the sequence stops where the device tier is full.
  int64_t reached = 0;
  {
    Harness h(m, capped(false));
    const auto id = h.submit(test::greedy(long_prompt, 1, LogitsMode::none));
    h.run();
    ASSERT_TRUE(h[id].finished);
    ASSERT_EQ(h[id].last.reason, FinishReason::error);
    EXPECT_EQ(h[id].last.code, ErrorCode::resource_exhausted);
    reached = h[id].last.usage.computed_tokens;
    h.expect_no_leaks(true);
  }
  ASSERT_GT(reached, 0);
  const int64_t target = 4 * reached + 64;
  ASSERT_LE(target, static_cast<int64_t>(long_prompt.size()));
  std::vector<int32_t> prompt(long_prompt.begin(), long_prompt.begin() + target);
  RecordProperty("context_without_host", static_cast<int>(reached));
  RecordProperty("context_with_host", static_cast<int>(target));

  // With it, four times as far, decoding at the end.
  Harness capped_run(m, capped(true));
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
  EXPECT_LE(device_bytes, static_cast<int64_t>(capped(true).device_bytes));

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
