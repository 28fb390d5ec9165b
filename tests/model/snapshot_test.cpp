// A state moved through a snapshot continues exactly as if it had never moved.
#include <gtest/gtest.h>

#include "base/error.hpp"
#include "kernels/backend.hpp"
#include "model/forward.hpp"
#include "model/snapshot.hpp"
#include "tests/model/fixtures.hpp"

namespace troupe::testing {
namespace {

TEST(Snapshot, restored_state_continues_with_identical_logits) {
  const Fixture f = load_fixture("real_rates");  // CSA and HCA layers, window 64
  auto backend = kernels::make_cpu_backend();
  auto m = model::Model::load(f.dir, *backend);
  const auto& c = m->config();
  std::span<const int32_t> ids(f.ids);
  for (int64_t cut : {1, 63, 130, 257}) {  // inside and across windows of both rates
    auto a = m->new_dense_state();
    model::Chunk first{a.get(), ids.subspan(0, static_cast<size_t>(cut)), model::LogitsWanted::none};
    m->forward(std::span(&first, 1));
    const auto snap = model::take_snapshot(c, *a, *backend);
    EXPECT_EQ(snap.length, cut);
    auto b = m->new_dense_state();
    model::restore_snapshot(c, snap, *b, *backend);
    model::Chunk rest{b.get(), ids.subspan(static_cast<size_t>(cut), 40), model::LogitsWanted::all};
    auto got = m->forward(std::span(&rest, 1));
    const double err = max_abs_diff(got.data(), f.logits.data() + cut * f.vocab, got.size());
    EXPECT_LE(err, 1e-3) << "cut at " << cut;
  }
}

TEST(Snapshot, layout_mismatch_is_refused) {
  const Fixture f = load_fixture("basic");
  auto backend = kernels::make_cpu_backend();
  auto m = model::Model::load(f.dir, *backend);
  auto a = m->new_dense_state();
  std::span<const int32_t> ids(f.ids);
  model::Chunk first{a.get(), ids.subspan(0, 50), model::LogitsWanted::none};
  m->forward(std::span(&first, 1));
  auto snap = model::take_snapshot(m->config(), *a, *backend);
  snap.segments[1].rows += 1;
  auto b = m->new_dense_state();
  EXPECT_THROW(model::restore_snapshot(m->config(), snap, *b, *backend), Error);
}

}  // namespace
}  // namespace troupe::testing
