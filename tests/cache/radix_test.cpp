// The shadow radix tree: matches, splits, checkpoints, tombstones, and exact
// resumption of a sequence from a matched prefix.
#include <gtest/gtest.h>

#include <random>

#include "cache/paged_sequence.hpp"
#include "cache/radix/shadow_radix.hpp"
#include "tests/cache/test_model.hpp"

namespace troupe::cache {
namespace {

struct Fixture {
  model::Model& m = *test::shared_model().model;
  CacheGeometry g = CacheGeometry::of(m.config());
  PoolSet device{g, host_memory(true), uint64_t{1} << 30};
  Tiers tiers{device, nullptr};
  int64_t P = g.page_tokens;

  // Runs ids through a fresh sequence in the given chunk sizes, inserting the
  // prefix into `tree` after each chunk as the engine does.
  std::unique_ptr<PagedSequence> run(const std::vector<int32_t>& ids, std::vector<int64_t> chunks,
                                     ShadowRadix* tree = nullptr) {
    auto s = std::make_unique<PagedSequence>(tiers);
    feed(*s, ids, chunks, tree);
    return s;
  }
  std::vector<float> feed(PagedSequence& s, const std::vector<int32_t>& ids, std::vector<int64_t> chunks,
                          ShadowRadix* tree = nullptr) {
    std::vector<float> logits;
    for (int64_t n : chunks) {
      model::Chunk c{&s, std::span(ids).subspan(static_cast<size_t>(s.length()), static_cast<size_t>(n)),
                     model::LogitsWanted::all};
      auto rows = m.forward(std::span(&c, 1));
      logits.insert(logits.end(), rows.begin(), rows.end());
      s.trim();
      if (tree != nullptr) insert(*tree, ids, s);
    }
    return logits;
  }
  ShadowRadix::Node* insert(ShadowRadix& t, const std::vector<int32_t>& ids, const PagedSequence& s) {
    return t.insert(ids, s.prefix_for_tree(0));
  }
};

TEST(ShadowRadix, match_is_whole_pages_and_splits_keep_both_branches) {
  Fixture f;
  std::mt19937_64 rng(1);
  auto a = test::random_ids(rng, 5 * f.P + 3, f.m.config().vocab_size);
  auto sa = f.run(a, {static_cast<int64_t>(a.size())});
  ShadowRadix t(f.tiers);
  f.insert(t, a, *sa);
  EXPECT_EQ(t.node_count(), 1);
  // b shares 3 pages and a half, and has a whole page of its own after them.
  auto b = a;
  b.resize(static_cast<size_t>(3 * f.P + f.P / 2));
  for (int64_t i = 0; i < f.P; ++i) b.push_back(7);
  auto m = t.match(b, static_cast<int64_t>(b.size()));
  EXPECT_EQ(m.matched, 3 * f.P);
  auto sb = f.run(b, {static_cast<int64_t>(b.size())});
  f.insert(t, b, *sb);
  EXPECT_EQ(t.node_count(), 3);  // split at page 3: the shared part, then a's and b's tails
  EXPECT_EQ(t.match(a, static_cast<int64_t>(a.size())).matched, 5 * f.P);
  EXPECT_EQ(t.match(b, static_cast<int64_t>(b.size())).matched, static_cast<int64_t>(b.size()) / f.P * f.P);
  EXPECT_EQ(t.match(a, 2 * f.P + 1).matched, 2 * f.P);
  t.clear();
  sa.reset();
  sb.reset();
  EXPECT_EQ(f.device.total_in_use(), 0);
}

TEST(ShadowRadix, a_match_retreats_to_the_deepest_checkpoint) {
  Fixture f;
  std::mt19937_64 rng(2);
  auto a = test::random_ids(rng, 10 * f.P, f.m.config().vocab_size);
  // Chunks end at 4.5 and 10 pages: checkpoints at pages 4 and 10.
  ShadowRadix t(f.tiers);
  auto sa = f.run(a, {4 * f.P + f.P / 2, 5 * f.P + f.P / 2}, &t);
  EXPECT_EQ(t.match(a, 10 * f.P).resumable, 10 * f.P);
  // Only the windows of the two checkpoints are held by the tree and sequence.
  EXPECT_LE(f.device.in_use(PoolKind::window), 3);
  auto m = t.match(a, 8 * f.P);
  EXPECT_EQ(m.matched, 8 * f.P);
  EXPECT_EQ(m.resumable, 4 * f.P);  // the first chunk's checkpoint
  EXPECT_EQ(t.match(a, 4 * f.P - 1).resumable, 0);
}

TEST(ShadowRadix, resuming_from_a_match_gives_the_cold_logits) {
  Fixture f;
  auto& m = f.m;
  std::mt19937_64 rng(3);
  const int64_t V = m.config().vocab_size;
  auto a = test::random_ids(rng, 12 * f.P + 5, V);
  ShadowRadix t(f.tiers);
  auto sa = f.run(a, {3 * f.P + 1, 5 * f.P + 9, static_cast<int64_t>(a.size()) - 8 * f.P - 10}, &t);
  sa.reset();  // a finished: only the tree holds its pages
  // Checkpoints at 3, 8 and 12 pages (the chunk ends rounded down).
  for (auto [share, resume] : {std::pair{12 * f.P + 5, 12 * f.P}, {9 * f.P, 8 * f.P}, {3 * f.P + 1, 3 * f.P}}) {
    auto b = a;
    b.resize(static_cast<size_t>(share));
    const auto extra = test::random_ids(rng, 37, V);
    b.insert(b.end(), extra.begin(), extra.end());
    auto match = t.match(b, static_cast<int64_t>(b.size()) - 1);
    ASSERT_EQ(match.resumable, resume);
    PagedSequence sb(f.tiers);
    sb.adopt(match.pages, match.resumable);
    const auto got = f.feed(sb, b, {static_cast<int64_t>(b.size()) - match.resumable});
    const auto want = test::dense_logits(m, b);
    const size_t off = static_cast<size_t>(match.resumable * V);
    ASSERT_EQ(got.size(), want.size() - off);
    EXPECT_EQ(test::max_abs_diff(got.data(), want.data() + off, got.size()), 0.0f) << "shared " << share;
  }
}

TEST(ShadowRadix, tombstones_keep_entries_and_drop_windows) {
  Fixture f;
  std::mt19937_64 rng(4);
  auto a = test::random_ids(rng, 8 * f.P, f.m.config().vocab_size);
  auto sa = f.run(a, {4 * f.P, 4 * f.P});
  ShadowRadix t(f.tiers);
  auto* node = f.insert(t, a, *sa);
  EXPECT_EQ(t.match(a, 8 * f.P).resumable, 8 * f.P);
  t.lock(node);
  EXPECT_EQ(t.tombstone(100, true), 0);  // a locked node keeps the windows its sequence holds
  sa.reset();
  t.unlock(node);
  EXPECT_EQ(t.tombstone(100, true), 0);  // an unused leaf keeps its tail window
  // A child makes the tail droppable.
  auto b = a;
  auto tail = test::random_ids(rng, 2 * f.P, f.m.config().vocab_size);
  b.insert(b.end(), tail.begin(), tail.end());
  auto sb = f.run(b, {10 * f.P});
  f.insert(t, b, *sb);
  sb.reset();
  EXPECT_EQ(t.node_count(), 2);
  EXPECT_GT(t.tombstone(100, true), 0);
  EXPECT_EQ(t.match(b, 10 * f.P).resumable, 10 * f.P);  // the child's tail still serves
  t.erase(const_cast<ShadowRadix::Node*>(t.eviction_order(Tier::device).front()));
  EXPECT_EQ(f.device.in_use(PoolKind::window), 0);
  auto m = t.match(a, 8 * f.P);
  EXPECT_EQ(m.matched, 8 * f.P);  // the entries still match ...
  EXPECT_EQ(m.resumable, 0);      // ... but nothing is resumable without a window
  EXPECT_GT(f.device.in_use(PoolKind::csa_entry), 0);
  t.clear();
  EXPECT_EQ(f.device.total_in_use(), 0);
}

TEST(ShadowRadix, eviction_order_is_least_recent_unlocked_leaves) {
  Fixture f;
  std::mt19937_64 rng(5);
  const int64_t V = f.m.config().vocab_size;
  auto a = test::random_ids(rng, 4 * f.P, V);
  auto b = a;
  b.resize(static_cast<size_t>(2 * f.P));
  auto tail = test::random_ids(rng, 2 * f.P, V);
  b.insert(b.end(), tail.begin(), tail.end());
  auto sa = f.run(a, {4 * f.P});
  auto sb = f.run(b, {4 * f.P});
  ShadowRadix t(f.tiers);
  auto* na = f.insert(t, a, *sa);
  auto* nb = f.insert(t, b, *sb);
  t.match(a, 4 * f.P);  // a used last
  auto order = t.eviction_order(Tier::device);
  ASSERT_EQ(order.size(), 2u);
  EXPECT_EQ(order[0], nb);
  EXPECT_EQ(order[1], na);
  t.lock(na);
  order = t.eviction_order(Tier::device);
  ASSERT_EQ(order.size(), 1u);
  t.erase(order[0]);
  t.unlock(na);
  EXPECT_EQ(t.match(b, 4 * f.P).matched, 2 * f.P);
}

}  // namespace
}  // namespace troupe::cache
