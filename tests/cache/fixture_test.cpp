// The engine on the committed transformers fixtures (tests/fixtures/model/<case>/:
// an HF model dir with ids.npy and logits.npy): the fixture's ids, fed in
// random chunks next to other sequences, give the fixture's logits.
#include <gtest/gtest.h>

#include <filesystem>
#include <random>

#include "base/npy.hpp"
#include "tests/cache/engine_harness.hpp"

namespace troupe::engine {
namespace {

namespace fs = std::filesystem;

std::vector<fs::path> fixture_cases() {
  std::vector<fs::path> out;
  const fs::path root = fs::path(TROUPE_SOURCE_DIR) / "tests" / "fixtures" / "model";
  if (!fs::exists(root)) return out;
  for (const auto& e : fs::directory_iterator(root)) {
    if (fs::exists(e.path() / "ids.npy") && fs::exists(e.path() / "logits.npy") && fs::exists(e.path() / "config.json")) {
      out.push_back(e.path());
    }
  }
  std::sort(out.begin(), out.end());
  return out;
}

TEST(EngineFixtures, batched_random_chunks_give_the_transformers_logits) {
  const auto cases = fixture_cases();
  if (cases.empty()) GTEST_SKIP() << "no fixtures under tests/fixtures/model yet";
  for (const auto& dir : cases) {
    auto backend = kernels::make_cpu_backend();
    auto m = model::Model::load(dir.string(), *backend);
    const auto ids64 = read_npy((dir / "ids.npy").string()).as_i64();
    const auto want = read_npy((dir / "logits.npy").string()).as_f32();
    const int64_t V = m->config().vocab_size;
    std::vector<int32_t> ids(ids64.begin(), ids64.end());
    ASSERT_EQ(want.size(), ids.size() * static_cast<size_t>(V)) << dir;
    EngineOptions o;
    o.step_tokens = 64;
    test::Harness h(*m, o);
    std::mt19937_64 rng(ids.size());
    // Neighbours in the same batches.
    for (int i = 0; i < 4; ++i) h.submit(test::greedy(test::random_ids(rng, 1 + static_cast<int64_t>(rng() % 100), V), 3));
    auto r = test::greedy(ids, 1);
    r.max_chunk_tokens = 1 + static_cast<int64_t>(rng() % 16);
    const auto id = h.submit(std::move(r));
    h.run();
    ASSERT_TRUE(h[id].finished) << dir;
    ASSERT_EQ(h[id].rows.size(), ids.size()) << dir;
    float worst = 0;
    for (const auto& [pos, row] : h[id].rows) {
      worst = std::max(worst, test::max_abs_diff(row.data(), want.data() + pos * V, static_cast<size_t>(V)));
    }
    EXPECT_LE(worst, 1e-4f) << dir;
    h.engine().clear_cache();
    h.expect_no_leaks(true);
  }
}

}  // namespace
}  // namespace troupe::engine
