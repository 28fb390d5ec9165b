// The host tier lets one sequence outgrow a capped device tier: cold entry
// pages move to the host tier (read in place), with the logits of an uncapped run.
// On the CPU backend (the tier is the kernels' own memory) and, where there is a
// GPU, on CUDA (mapped pinned memory read over the bus; CSA entries only).
#include <gtest/gtest.h>

#include <cmath>
#include <random>

#include "cache/planner.hpp"
#include "tests/cache/engine_harness.hpp"

namespace troupe::engine {
namespace {

using test::Harness;

// A device tier of `bytes` in slabs of one page of the largest pool (fine
// steps); 576 KiB is about a thousand tokens of the tiny model.
EngineOptions capped(const model::Model& m, bool host, uint64_t bytes) {
  const auto g = cache::CacheGeometry::of(m.config());
  EngineOptions o;
  o.step_tokens = std::min<int64_t>(512, g.page_tokens);  // (a chunk's pages stay well inside the tier)
  o.slab_bytes = (g.largest_page_bytes() + 4095) / 4096 * 4096;
  o.device_bytes = bytes;
  o.host_bytes = host ? uint64_t{256} << 20 : 0;
  o.prefix_cache = false;
  return o;
}

// The case on model m: the tier that stops the sequence (found by bisection), the
// capped run with a host tier `factor` times as far, and the same request uncapped with
// the same step size. bitwise: the logits must be the same bits (the CPU backend is
// batch-invariant; on CUDA the two runs take the same steps, so they are expected to
// be too, but only the tokens and 1e-6 are required).
void reaches_further(model::Model& m, double factor, bool bitwise) {
  std::mt19937_64 rng(21);
  const int64_t longest = std::min<int64_t>(20000, m.config().max_position_embeddings - 16);
  const auto long_prompt = test::random_ids(rng, longest, m.config().vocab_size);

  // Without the host tier the sequence stops where the device tier is full. The
  // tier (576 KiB, or found by bisection) stops it after 4 pages and before a
  // factor-th of the model's positions.
  auto reach = [&](uint64_t bytes) -> int64_t {  // tokens computed before the tier was full; longest: it all fit
    Harness h(m, capped(m, false, bytes));
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
  auto fits = [&](int64_t r) { return r >= 4 * P && static_cast<int64_t>(factor * r) + 64 <= longest; };
  uint64_t bytes = 576 << 10, too_big = 0, too_small = 0;
  int64_t reached = reach(bytes);
  for (int i = 0; i < 24 && !fits(reached); ++i) {
    (reached < 4 * P ? too_small : too_big) = bytes;
    bytes = too_small == 0 ? bytes / 2 : (too_small + too_big) / 2;
    reached = reach(bytes);
  }
  if (!fits(reached)) {  // (a model whose per-page state is small next to its window: a tier holds 1 page or all)
    GTEST_SKIP() << "no device tier stops a " << longest << "-token prompt between 4 pages and 1/" << factor << " of it "
                 << "(last: " << reached << " tokens with " << bytes << " bytes): the case cannot be set up";
  }
  // `troupe plan` says how far one sequence gets alone on that tier: whole slabs per pool, as the engine found
  // (to a page: the engine stops at the chunk that does not fit, one page a chunk here).
  cache::PlanInput in;
  in.bytes = bytes;
  in.slab_bytes = capped(m, false, bytes).slab_bytes;
  in.mix = cache::parse_mix(cache::kDefaultMix);
  const int64_t planned = cache::plan_pools(cache::CacheGeometry::of(m.config()), in).max_context;
  EXPECT_GE(planned, reached);
  EXPECT_LE(planned, reached + P);
  const int64_t target = static_cast<int64_t>(factor * reached) + 64;
  ASSERT_LE(target, longest);
  std::vector<int32_t> prompt(long_prompt.begin(), long_prompt.begin() + target);
  ::testing::Test::RecordProperty("context_without_host", static_cast<int>(reached));
  ::testing::Test::RecordProperty("context_with_host", static_cast<int>(target));

  // With it, `factor` times as far, decoding at the end.
  Harness capped_run(m, capped(m, true, bytes));
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
  roomy.step_tokens = capped(m, true, bytes).step_tokens;
  roomy.prefix_cache = false;
  Harness free_run(m, roomy);
  const auto b = free_run.submit(test::greedy(prompt, 8, LogitsMode::sampled));
  free_run.run();
  ASSERT_EQ(free_run[b].generated, capped_run[a].generated);
  ASSERT_EQ(free_run[b].rows.size(), capped_run[a].rows.size());
  double worst = 0;
  for (const auto& [pos, row] : free_run[b].rows) {
    const auto& other = capped_run[a].rows.at(pos);
    if (bitwise) {
      EXPECT_EQ(row, other) << "position " << pos;  // same batches, same kernels: bitwise equal
    } else {
      ASSERT_EQ(row.size(), other.size());
      for (size_t i = 0; i < row.size(); ++i) {
        worst = std::max(worst, std::abs(static_cast<double>(row[i]) - other[i]) / (std::abs(row[i]) + 1e-3));
      }
    }
  }
  EXPECT_LE(worst, 1e-6);
  ::testing::Test::RecordProperty("cold_pages", static_cast<int>(stats.cold_pages));
  std::cout << "[ offload  ] " << m.backend().name() << ": " << reached << " tokens without the host tier, " << target
            << " with it; " << stats.cold_pages << " cold pages; largest relative logit difference " << worst << "\n";
  capped_run.expect_no_leaks(true);
  free_run.expect_no_leaks(true);
}

TEST(Offload, one_sequence_reaches_four_times_the_context_with_identical_logits) {
  reaches_further(*test::shared_model().model, 4, true);
}

// The same on CUDA: the host tier in mapped pinned memory, the CSA entries the
// indexer selects read from it in place by the attention kernels. Only the CSA
// entries go cold there (engine/tiering.cpp): 60 % of the test model's entry
// state a token (head_dim 64 against an indexer key of 32; V4-Flash's 512
// against 128: ~78 %). In this test's small tier the windows take a fifth and
// the pools' slabs round up, so the case asks for 1.5x (run 43 on an H100: the
// host tier took it from 1,792 tokens to past 3,500; bench/gpu/offload_bench.py
// measures a Flash-shaped model's reach and decode rate).
TEST(OffloadGpu, one_sequence_reaches_further_on_cuda) {
  auto gpu = kernels::make_cuda_backend();
  if (!gpu) GTEST_SKIP() << "no CUDA device (or the build has no CUDA backend): GPU offload test skipped";
  if (!gpu->host_mapped()) GTEST_SKIP() << "this GPU cannot read mapped host memory at its host address";
  auto m = model::Model::load(test::test_model_dir(), *gpu, kernels::WeightType::f32);
  reaches_further(*m, 1.5, false);
}

}  // namespace
}  // namespace troupe::engine
