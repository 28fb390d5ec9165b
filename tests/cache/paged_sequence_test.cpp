// PagedSequence against DenseState through the same forward calls.
#include <gtest/gtest.h>

#include <random>

#include "base/error.hpp"
#include "cache/paged_sequence.hpp"
#include "cache/pool/pool_set.hpp"
#include "tests/cache/test_model.hpp"

namespace troupe::cache {
namespace {

struct Pools {
  explicit Pools(const model::ModelConfig& c, int64_t page_tokens = 0)
      : geometry(CacheGeometry::of(c, page_tokens)),
        device(geometry, host_memory(true), uint64_t{1} << 30),
        tiers(device, nullptr) {}
  CacheGeometry geometry;
  PoolSet device;
  Tiers tiers;
};

// Sequences of random lengths fed in random chunks, many sequences per
// forward call, give the logits of each sequence run alone through DenseState.
void check_random_chunkings(int64_t page_tokens, uint64_t seed, int sequences, int64_t max_len) {
  auto& m = *test::shared_model().model;
  const int64_t V = m.config().vocab_size;
  Pools pools(m.config(), page_tokens);
  std::mt19937_64 rng(seed);
  struct Seq {
    std::vector<int32_t> ids;
    std::unique_ptr<PagedSequence> state;
    std::vector<float> logits;
  };
  std::vector<Seq> seqs(static_cast<size_t>(sequences));
  for (auto& s : seqs) {
    s.ids = test::random_ids(rng, 1 + static_cast<int64_t>(rng() % static_cast<uint64_t>(max_len)), V);
    s.state = std::make_unique<PagedSequence>(pools.tiers, true, static_cast<int64_t>(rng() % 3));
  }
  while (true) {
    std::vector<model::Chunk> chunks;
    std::vector<Seq*> in;
    for (auto& s : seqs) {
      const int64_t at = s.state->length(), left = static_cast<int64_t>(s.ids.size()) - at;
      if (left == 0 || rng() % 4 == 0) continue;
      const int64_t n = rng() % 3 == 0 ? 1 : 1 + static_cast<int64_t>(rng() % static_cast<uint64_t>(left));
      chunks.push_back({s.state.get(), std::span(s.ids).subspan(static_cast<size_t>(at), static_cast<size_t>(std::min(n, left))),
                        model::LogitsWanted::all});
      in.push_back(&s);
    }
    if (chunks.empty()) {
      bool done = true;
      for (auto& s : seqs) done &= s.state->length() == static_cast<int64_t>(s.ids.size());
      if (done) break;
      continue;
    }
    auto rows = m.forward(chunks);
    size_t off = 0;
    for (size_t i = 0; i < chunks.size(); ++i) {
      const size_t n = chunks[i].ids.size() * static_cast<size_t>(V);
      in[i]->logits.insert(in[i]->logits.end(), rows.begin() + static_cast<long>(off), rows.begin() + static_cast<long>(off + n));
      off += n;
      in[i]->state->trim();
    }
  }
  for (auto& s : seqs) {
    const auto want = test::dense_logits(m, s.ids);
    ASSERT_EQ(want.size(), s.logits.size());
    EXPECT_EQ(test::max_abs_diff(want.data(), s.logits.data(), want.size()), 0.0f) << "length " << s.ids.size();
  }
  seqs.clear();
  EXPECT_EQ(pools.device.total_in_use(), 0);
}

TEST(PagedSequence, random_chunkings_in_shared_batches_match_dense_state) { check_random_chunkings(0, 1, 12, 300); }

TEST(PagedSequence, small_pages_match_dense_state) {
  const auto g = CacheGeometry::of(test::shared_model().model->config());
  // The smallest page the rates and the window allow (the default one at the most).
  const int64_t step = std::max<int64_t>(g.hca_rate, 2 * g.csa_rate);
  int64_t page = step;
  for (; page < g.page_tokens; page += step) {
    try {
      CacheGeometry::of(test::shared_model().model->config(), page);
      break;
    } catch (const Error&) {  // not a page this model allows
    }
  }
  check_random_chunkings(std::min(page, g.page_tokens), 2, 6, 200);
}

TEST(PagedSequence, holds_only_windows_and_entries) {
  auto& m = *test::shared_model().model;
  Pools pools(m.config());
  const auto& g = pools.geometry;
  std::mt19937_64 rng(3);
  const auto ids = test::random_ids(rng, 20 * g.page_tokens + 5, m.config().vocab_size);
  PagedSequence s(pools.tiers);
  model::Chunk c{&s, ids, model::LogitsWanted::last};
  m.forward(std::span(&c, 1));
  s.trim();
  // The last window, the window of the last page boundary (the same pages
  // here), and every entry page.
  EXPECT_LE(pools.device.in_use(PoolKind::window), 2);
  EXPECT_EQ(pools.device.in_use(PoolKind::csa_entry), g.has(PoolKind::csa_entry) ? g.pages_for(ids.size()) : 0);
  EXPECT_EQ(pools.device.in_use(PoolKind::hca_ring), g.has(PoolKind::hca_ring) ? 1 : 0);
}

}  // namespace
}  // namespace troupe::cache
