// The memory planner.
#include <gtest/gtest.h>

#include <algorithm>

#include "base/error.hpp"
#include "cache/planner.hpp"
#include "cache/pool/pool_set.hpp"
#include "tests/cache/test_model.hpp"

namespace troupe::cache {
namespace {

const CacheGeometry& geometry() {
  static CacheGeometry g = CacheGeometry::of(test::shared_model().model->config());
  return g;
}

uint64_t total(const Plan& p) {
  uint64_t b = 0;
  for (const auto& x : p.pools) b += static_cast<uint64_t>(x.slabs) * p.slab_bytes;
  return b;
}

TEST(Planner, pools_fill_the_budget_in_whole_slabs) {
  PlanInput in;
  in.bytes = 64 << 20;
  in.mix = {{4096, 0.7}, {32768, 0.3}};
  const auto p = plan_pools(geometry(), in);
  EXPECT_LE(total(p), in.bytes);
  EXPECT_GT(total(p), in.bytes - p.slab_bytes);
  EXPECT_GT(p.sequences, 1);
  // The pools it sizes fit that many sequences of the mix.
  for (PoolKind k : kAllPools) {
    const auto& x = p.pools[static_cast<size_t>(index(k))];
    if (x.per_sequence > 0) {
      EXPECT_GE(static_cast<double>(x.pages), x.per_sequence * std::floor(p.sequences));
    }
  }
  // A PoolSet built from the plan starts with those pages.
  PoolSet set(geometry(), host_memory(true), in.bytes, p.slab_bytes, p.initial_pages());
  for (PoolKind k : kAllPools) {
    EXPECT_EQ(set.pool(k).stats().capacity, p.pools[static_cast<size_t>(index(k))].pages) << to_string(k);
  }
}

TEST(Planner, long_contexts_shift_bytes_to_entry_pools) {
  PlanInput chat, longer;
  chat.bytes = longer.bytes = 256 << 20;
  chat.mix = {{1024, 1}};
  longer.mix = {{65536, 1}};
  const auto a = plan_pools(geometry(), chat), b = plan_pools(geometry(), longer);
  const auto win = static_cast<size_t>(index(PoolKind::window));
  const auto csa = static_cast<size_t>(index(PoolKind::csa_entry));
  EXPECT_GT(a.pools[win].bytes, b.pools[win].bytes);
  EXPECT_LT(a.pools[csa].bytes, b.pools[csa].bytes);
  EXPECT_GT(a.sequences, b.sequences);
  EXPECT_EQ(a.max_context, b.max_context);  // one sequence alone does not depend on the mix
}

TEST(Planner, explicit_ratios_are_honoured) {
  PlanInput in;
  in.bytes = 128 << 20;
  in.ratios = std::array<double, kPoolKinds>{0.1, 0.6, 0.2, 0.05, 0.05};
  // Enough slabs that each share rounds within 2 % whatever this model's slab size.
  in.bytes = std::max<uint64_t>(in.bytes, 100 * PoolSet::default_slab_bytes(geometry()));
  const auto p = plan_pools(geometry(), in);
  // The ratios of the pools this model has, in proportion; none for the others.
  double used = 0;
  for (PoolKind k : kAllPools) used += geometry().pool(k).page_bytes > 0 ? (*in.ratios)[static_cast<size_t>(index(k))] : 0;
  for (PoolKind k : kAllPools) {
    const auto i = static_cast<size_t>(index(k));
    const double share = static_cast<double>(p.pools[i].slabs * p.slab_bytes) / static_cast<double>(in.bytes);
    const double want = geometry().pool(k).page_bytes > 0 ? (*in.ratios)[i] / used : 0.0;
    EXPECT_NEAR(share, want, 0.02) << to_string(k);
  }
  // Ratios only for pools the model lacks: an error that says so.
  const bool lacks_one = std::ranges::any_of(kAllPools, [](PoolKind k) { return geometry().pool(k).page_bytes == 0; });
  if (lacks_one) {
    PlanInput none = in;
    for (PoolKind k : kAllPools) (*none.ratios)[static_cast<size_t>(index(k))] = geometry().pool(k).page_bytes > 0 ? 0 : 1;
    EXPECT_THROW(plan_pools(geometry(), none), Error);
  }
}

TEST(Planner, parses_sizes_and_mixes) {
  EXPECT_EQ(parse_bytes("80GiB"), uint64_t{80} << 30);
  EXPECT_EQ(parse_bytes("1.5MiB"), uint64_t{3} << 19);
  EXPECT_EQ(parse_bytes("2GB"), uint64_t{2000000000});
  EXPECT_EQ(parse_bytes("4096"), 4096u);
  EXPECT_THROW(parse_bytes("lots"), Error);
  EXPECT_THROW(parse_bytes("3 parsecs"), Error);
  const auto mix = parse_mix("4K:0.7,32768:0.25,1M");
  ASSERT_EQ(mix.size(), 3u);
  EXPECT_EQ(mix[0].tokens, 4096);
  EXPECT_DOUBLE_EQ(mix[0].weight, 0.7);
  EXPECT_EQ(mix[2].tokens, 1 << 20);
  EXPECT_DOUBLE_EQ(mix[2].weight, 1.0);
  EXPECT_THROW(parse_mix("4K:-1"), Error);
  EXPECT_THROW(parse_mix("x"), Error);
  EXPECT_THROW(parse_mix("4K:inf"), Error);
  EXPECT_THROW(parse_mix("99999999999M"), Error);  // would overflow
  EXPECT_THROW(parse_mix(""), Error);
  try {
    parse_mix("4K:x", "--pool-mix");
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("--pool-mix: '4K:x'"), std::string::npos) << e.what();
  }
  const auto r = parse_ratios("window=0.25,hca_ring=0.75");
  EXPECT_DOUBLE_EQ(r[index(PoolKind::window)], 0.25);
  EXPECT_DOUBLE_EQ(r[index(PoolKind::hca_ring)], 0.75);
  EXPECT_DOUBLE_EQ(r[index(PoolKind::csa_entry)], 0.0);
  for (const char* bad : {"window", "window=", "window=x", "window=1.5", "window=-0.1", "window=nan", "swa=0.5",
                          "window=0.5,window=0.5", "window=0,csa_entry=0"}) {
    EXPECT_THROW(parse_ratios(bad), Error) << bad;
  }
  PlanInput none;
  none.bytes = 1 << 20;
  EXPECT_THROW(plan_pools(geometry(), none), Error);
}

}  // namespace
}  // namespace troupe::cache
