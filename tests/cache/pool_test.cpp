// Page pools: references, slabs moving between pools, budgets.
#include <gtest/gtest.h>

#include "base/check.hpp"
#include "base/error.hpp"
#include "cache/pool/pool_set.hpp"
#include <random>

#include "tests/cache/test_model.hpp"

namespace troupe::cache {
namespace {

const CacheGeometry& geometry() {
  static CacheGeometry g = CacheGeometry::of(test::shared_model().model->config());
  return g;
}

TEST(PagePool, a_page_is_free_again_when_the_last_holder_releases_it) {
  PoolSet set(geometry(), host_memory(true), 8 << 20);
  const PageId p = set.lease(PoolKind::csa_entry);
  ASSERT_NE(p, kNoPage);
  set.retain(PoolKind::csa_entry, p);
  EXPECT_EQ(set.pool(PoolKind::csa_entry).refs(p), 2);
  set.release(PoolKind::csa_entry, p);
  EXPECT_EQ(set.in_use(PoolKind::csa_entry), 1);
  set.release(PoolKind::csa_entry, p);
  EXPECT_EQ(set.in_use(PoolKind::csa_entry), 0);
  EXPECT_THROW(set.release(PoolKind::csa_entry, p), InvariantError);
}

TEST(PagePool, pages_are_distinct_and_hold_what_was_written) {
  PoolSet set(geometry(), host_memory(true), 8 << 20);
  const auto& layout = geometry().pool(PoolKind::window);
  std::vector<PageId> pages;
  for (int i = 0; i < 50; ++i) {
    pages.push_back(set.lease(PoolKind::window));
    ASSERT_NE(pages.back(), kNoPage);
    auto* b = reinterpret_cast<uint32_t*>(set.pool(PoolKind::window).page(pages.back()));
    for (size_t j = 0; j < layout.page_bytes / 4; ++j) b[j] = static_cast<uint32_t>(i);
  }
  for (int i = 0; i < 50; ++i) {
    auto* b = reinterpret_cast<uint32_t*>(set.pool(PoolKind::window).page(pages[static_cast<size_t>(i)]));
    for (size_t j = 0; j < layout.page_bytes / 4; ++j) ASSERT_EQ(b[j], static_cast<uint32_t>(i));
  }
  for (PageId p : pages) set.release(PoolKind::window, p);
}

TEST(PoolSet, empty_slabs_move_to_the_pool_that_needs_them) {
  const size_t slab = PoolSet::default_slab_bytes(geometry());
  PoolSet set(geometry(), host_memory(true), 4 * slab);
  std::vector<PageId> win;
  for (PageId p; (p = set.lease(PoolKind::window)) != kNoPage;) win.push_back(p);
  EXPECT_EQ(set.pool(PoolKind::window).stats().slabs, 4);
  EXPECT_EQ(set.lease(PoolKind::csa_entry), kNoPage);
  EXPECT_FALSE(set.can_lease({0, 1, 0, 0, 0}));
  // Free one slab's worth of window pages (the highest ones): the entry pool can take it.
  const int64_t per = set.pool(PoolKind::window).pages_per_slab();
  std::sort(win.begin(), win.end());
  for (int64_t i = 0; i < per; ++i) {
    set.release(PoolKind::window, win.back());
    win.pop_back();
  }
  EXPECT_TRUE(set.can_lease({0, 1, 0, 0, 0}));
  const PageId e = set.lease(PoolKind::csa_entry);
  EXPECT_NE(e, kNoPage);
  EXPECT_EQ(set.pool(PoolKind::window).stats().slabs, 3);
  EXPECT_EQ(set.pool(PoolKind::csa_entry).stats().slabs, 1);
  set.release(PoolKind::csa_entry, e);
  for (PageId p : win) set.release(PoolKind::window, p);
  EXPECT_EQ(set.total_in_use(), 0);
}

TEST(PoolSet, can_lease_counts_slabs_for_all_pools_together) {
  const size_t slab = PoolSet::default_slab_bytes(geometry());
  PoolSet set(geometry(), host_memory(true), 2 * slab);
  const int64_t per_win = slab / geometry().pool(PoolKind::window).page_bytes;
  const int64_t per_entry = slab / geometry().pool(PoolKind::csa_entry).page_bytes;
  EXPECT_TRUE(set.can_lease({per_win, per_entry, 0, 0, 0}));
  EXPECT_FALSE(set.can_lease({per_win + 1, per_entry, 0, 0, 0}));
  EXPECT_TRUE(set.can_lease({2 * per_win, 0, 0, 0, 0}));
  EXPECT_EQ(set.available(PoolKind::window), 2 * per_win);
}

// Whenever can_lease(need) says yes, leasing all of need succeeds, however
// the pools' slabs are fragmented.
TEST(PoolSet, can_lease_keeps_its_promise) {
  const size_t slab = PoolSet::default_slab_bytes(geometry());
  PoolSet set(geometry(), host_memory(true), 6 * slab);
  std::mt19937_64 rng(7);
  std::vector<std::pair<PoolKind, PageId>> held;
  int promised = 0;
  for (int round = 0; round < 3000; ++round) {
    // Release a random share, then ask for a random mix.
    for (size_t i = 0; i < held.size();) {
      if (rng() % 3 == 0) {
        set.release(held[i].first, held[i].second);
        held[i] = held.back();
        held.pop_back();
      } else {
        ++i;
      }
    }
    PoolCounts need{};
    for (PoolKind k : kAllPools) {
      if (geometry().has(k)) need[static_cast<size_t>(index(k))] = static_cast<int64_t>(rng() % 40);
    }
    if (!set.can_lease(need)) continue;
    ++promised;
    for (PoolKind k : kAllPools) {
      for (int64_t i = 0; i < need[static_cast<size_t>(index(k))]; ++i) {
        const PageId p = set.lease(k);
        ASSERT_NE(p, kNoPage) << "round " << round << " " << to_string(k);
        held.emplace_back(k, p);
      }
    }
  }
  EXPECT_GT(promised, 100);
  for (auto [k, p] : held) set.release(k, p);
  EXPECT_EQ(set.total_in_use(), 0);
}

TEST(CacheGeometry, rejects_pages_that_do_not_close_compression_windows) {
  const auto& c = test::shared_model().model->config();
  const auto g = CacheGeometry::of(c);
  EXPECT_EQ(g.page_tokens % std::max<int64_t>(1, g.hca_rate), 0);
  if (g.hca_rate > 1) {
    EXPECT_THROW(CacheGeometry::of(c, g.hca_rate + 1), Error);
  }
}

}  // namespace
}  // namespace troupe::cache
