// model::Decoder (decode steps with no host round trip, replayed from graphs on
// CUDA) against Model::forward over single-token chunks: bit for bit on the CPU
// backend; within bf16 tolerance of the CPU backend on CUDA (skipped without a GPU).
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <random>

#include "base/error.hpp"
#include "kernels/backend.hpp"
#include "model/decoder.hpp"
#include "model/forward.hpp"
#include "model/init.hpp"
#include "model/state.hpp"

#include "tests/model/fixtures.hpp"
#include "tests/support/process.hpp"

namespace troupe::testing {
namespace {

// The tiny preset (window 32, CSA rate 4 with top-16, HCA rate 16, a hash-routed
// layer), generated once per process in a temporary folder removed at its exit.
std::string tiny_model() {
  static const TempDir dir;
  static const std::string model = [] {
    const std::string d = dir.path() + "/tiny";
    model::InitOptions o;
    o.preset = "tiny";
    o.vocab = 700;
    o.seed = 11;
    model::init_model(d, o);
    return d;
  }();
  return model;
}

struct Seq {
  std::vector<int32_t> ids;  // prompt then the fed tokens
  int64_t prompt = 0;
};

std::vector<Seq> make_seqs(int64_t vocab) {
  std::mt19937 rng(7);
  std::vector<Seq> out;
  for (int64_t prompt : {97, 64, 131}) {  // past the top-k (16 entries = 64 tokens), windows open and closed
    Seq s;
    s.prompt = prompt;
    for (int64_t i = 0; i < prompt + 40; ++i) s.ids.push_back(static_cast<int32_t>(rng() % vocab));
    out.push_back(std::move(s));
  }
  return out;
}

double rel_l2(const std::vector<float>& a, const std::vector<float>& b) {
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    num += std::pow(static_cast<double>(a[i]) - b[i], 2);
    den += std::pow(static_cast<double>(b[i]), 2);
  }
  return std::sqrt(num / std::max(den, 1e-30));
}

// Logits of each decode step of each sequence through Model::forward, one chunk
// per sequence per call (all sequences in one call per step).
std::vector<std::vector<float>> reference(model::Model& m, const std::vector<Seq>& seqs, int64_t steps) {
  std::vector<std::unique_ptr<model::SequenceState>> st;
  for (const auto& s : seqs) {
    st.push_back(m.new_dense_state());
    model::Chunk c{st.back().get(), std::span<const int32_t>(s.ids).subspan(0, static_cast<size_t>(s.prompt)),
                   model::LogitsWanted::none};
    m.forward(std::span(&c, 1));
  }
  std::vector<std::vector<float>> out(seqs.size());
  for (int64_t t = 0; t < steps; ++t) {
    std::vector<model::Chunk> chunks;
    for (size_t i = 0; i < seqs.size(); ++i) {
      chunks.push_back({st[i].get(), std::span<const int32_t>(seqs[i].ids).subspan(static_cast<size_t>(seqs[i].prompt + t), 1),
                        model::LogitsWanted::last});
    }
    auto rows = m.forward(chunks);
    const size_t V = rows.size() / seqs.size();
    for (size_t i = 0; i < seqs.size(); ++i) out[i].insert(out[i].end(), rows.begin() + i * V, rows.begin() + (i + 1) * V);
  }
  return out;
}

// The same through the Decoder. With `shuffle` the batch order changes every
// step and one sequence leaves for a step (a Model::forward chunk) and comes
// back (rebound); rows then sit at other batch positions than in the reference.
// `greedy` (the sampled ids) and `replays` (graph replays) may be null.
std::vector<std::vector<float>> decoded(model::Model& m, const std::vector<Seq>& seqs, int64_t steps,
                                        std::vector<std::vector<int32_t>>* greedy, int64_t* replays, bool shuffle) {
  std::vector<std::vector<int32_t>> unused;
  if (greedy == nullptr) greedy = &unused;
  std::vector<std::unique_ptr<model::SequenceState>> st;
  for (const auto& s : seqs) {
    st.push_back(m.new_dense_state());
    model::Chunk c{st.back().get(), std::span<const int32_t>(s.ids).subspan(0, static_cast<size_t>(s.prompt)),
                   model::LogitsWanted::none};
    m.forward(std::span(&c, 1));
  }
  model::Decoder dec(m, {4, 512, true});
  std::vector<int> slot(seqs.size());
  for (size_t i = 0; i < seqs.size(); ++i) slot[i] = dec.bind(*st[i]);
  std::vector<std::vector<float>> out(seqs.size());
  greedy->assign(seqs.size(), {});
  for (int64_t t = 0; t < steps; ++t) {
    if (shuffle && t == 10) {  // sequence 1 leaves for a step: a Model::forward chunk, then rebinds
      dec.unbind(slot[1]);
      model::Chunk c{st[1].get(), std::span<const int32_t>(seqs[1].ids).subspan(static_cast<size_t>(seqs[1].prompt + t), 1),
                     model::LogitsWanted::last};
      auto row = m.forward(std::span(&c, 1));
      out[1].insert(out[1].end(), row.begin(), row.end());
      (*greedy)[1].push_back(static_cast<int32_t>(std::max_element(row.begin(), row.end()) - row.begin()));
    }
    if (shuffle && t == 11) slot[1] = dec.bind(*st[1]);
    std::vector<size_t> order;
    for (size_t i = 0; i < seqs.size(); ++i) {
      if (!shuffle || t != 10 || i != 1) order.push_back(i);
    }
    if (shuffle && t % 2 == 1) std::reverse(order.begin(), order.end());
    std::vector<int> slots;
    std::vector<int32_t> ids;
    for (size_t i : order) {
      slots.push_back(slot[i]);
      ids.push_back(seqs[i].ids[static_cast<size_t>(seqs[i].prompt + t)]);
    }
    dec.step(slots, ids);
    auto rows = dec.logits();
    auto tok = dec.tokens();
    const size_t V = rows.size() / order.size();
    for (size_t j = 0; j < order.size(); ++j) {
      out[order[j]].insert(out[order[j]].end(), rows.begin() + j * V, rows.begin() + (j + 1) * V);
      (*greedy)[order[j]].push_back(tok[j]);
    }
  }
  if (replays != nullptr) *replays = dec.replays();
  return out;
}

TEST(Decoder, cpu_steps_equal_forward_bit_for_bit) {
  auto backend = kernels::make_cpu_backend();
  auto m = model::Model::load(tiny_model(), *backend);
  const auto seqs = make_seqs(m->config().vocab_size);
  const int64_t steps = 40;
  auto want = reference(*m, seqs, steps);
  std::vector<std::vector<int32_t>> greedy;
  int64_t replays = 0;
  auto got = decoded(*m, seqs, steps, &greedy, &replays, false);
  const size_t V = static_cast<size_t>(m->config().vocab_size);
  for (size_t i = 0; i < seqs.size(); ++i) {
    ASSERT_EQ(got[i].size(), want[i].size());
    for (size_t j = 0; j < got[i].size(); ++j) ASSERT_EQ(got[i][j], want[i][j]) << "sequence " << i << " value " << j;
    for (int64_t t = 0; t < steps; ++t) {
      const float* row = want[i].data() + t * V;
      EXPECT_EQ(greedy[i][static_cast<size_t>(t)], std::max_element(row, row + V) - row);
    }
  }
  EXPECT_EQ(replays, 0);  // no graphs on the CPU backend
}

// The Decoder (the GPU's decode path, here on the CPU backend) on every committed
// fixture's config (hc_mult 1-4, windows 2-64, rates 2-128, full rope, FP8/FP4
// weights...): each sequence's steps equal Model::forward's bit for bit.
TEST(Decoder, cpu_steps_equal_forward_on_every_fixture) {
  for (const auto& name : fixture_names()) {
    const Fixture f = load_fixture(name);
    auto backend = kernels::make_cpu_backend();
    auto m = model::Model::load(f.dir, *backend);
    const auto T = static_cast<int64_t>(f.ids.size());
    std::vector<Seq> seqs;
    for (int64_t prompt : {f.meta.at("prefill").get<int64_t>(), T / 3 + 1, int64_t{1}}) {
      Seq s;
      s.prompt = std::min<int64_t>(prompt, T - 24);
      s.ids = f.ids;
      seqs.push_back(std::move(s));
    }
    const int64_t steps = 24;
    auto want = reference(*m, seqs, steps);
    auto got = decoded(*m, seqs, steps, nullptr, nullptr, false);
    for (size_t i = 0; i < seqs.size(); ++i) {
      ASSERT_EQ(got[i].size(), want[i].size()) << name;
      EXPECT_EQ(got[i], want[i]) << name << " sequence " << i << " (prompt " << seqs[i].prompt << ")";
    }
  }
}

// Reordered batches, a sequence leaving and rebinding: the same numbers up to
// the BLAS rounding of a row at another batch position.
TEST(Decoder, cpu_reordered_and_rebound_steps_match_forward) {
  auto backend = kernels::make_cpu_backend();
  auto m = model::Model::load(tiny_model(), *backend);
  const auto seqs = make_seqs(m->config().vocab_size);
  const int64_t steps = 30;
  auto want = reference(*m, seqs, steps);
  auto got = decoded(*m, seqs, steps, nullptr, nullptr, true);
  for (size_t i = 0; i < seqs.size(); ++i) {
    ASSERT_EQ(got[i].size(), want[i].size());
    EXPECT_LT(rel_l2(got[i], want[i]), 1e-5) << "sequence " << i;
  }
}

TEST(Decoder, cpu_chained_greedy_steps_feed_their_samples) {
  auto backend = kernels::make_cpu_backend();
  auto m = model::Model::load(tiny_model(), *backend);
  const auto seqs = make_seqs(m->config().vocab_size);
  // Reference: greedy decoding through Model::forward.
  auto a = m->new_dense_state(), b = m->new_dense_state();
  model::Chunk ca{a.get(), std::span<const int32_t>(seqs[0].ids).subspan(0, 80), model::LogitsWanted::last};
  auto row = m->forward(std::span(&ca, 1));
  model::Chunk cb{b.get(), std::span<const int32_t>(seqs[0].ids).subspan(0, 80), model::LogitsWanted::last};
  m->forward(std::span(&cb, 1));
  std::vector<int32_t> want;
  int32_t tok = static_cast<int32_t>(std::max_element(row.begin(), row.end()) - row.begin());
  const int32_t first = tok;
  for (int t = 0; t < 12; ++t) {
    want.push_back(tok);
    model::Chunk c{a.get(), std::span<const int32_t>(&tok, 1), model::LogitsWanted::last};
    row = m->forward(std::span(&c, 1));
    tok = static_cast<int32_t>(std::max_element(row.begin(), row.end()) - row.begin());
  }
  model::Decoder dec(*m, {2, 256, true});
  const int s = dec.bind(*b);
  std::vector<int32_t> got{first};
  const int slots[1] = {s};
  dec.step(slots, std::span<const int32_t>(&first, 1));
  for (int t = 1; t < 12; ++t) {
    got.push_back(dec.tokens()[0]);
    dec.step(slots, {});
  }
  EXPECT_EQ(got, want);
  EXPECT_EQ(b->length(), 80 + 12);
}

TEST(Decoder, refuses_what_it_cannot_hold) {
  auto backend = kernels::make_cpu_backend();
  auto m = model::Model::load(tiny_model(), *backend);
  model::Decoder dec(*m, {1, 64, true});
  auto st = m->new_dense_state();
  EXPECT_THROW(dec.bind(*st), Error);  // no tokens yet
  std::vector<int32_t> ids(70, 3);
  model::Chunk c{st.get(), ids, model::LogitsWanted::none};
  m->forward(std::span(&c, 1));
  EXPECT_THROW(dec.bind(*st), Error);  // beyond max_context
  auto st2 = m->new_dense_state();
  model::Chunk c2{st2.get(), std::span<const int32_t>(ids).subspan(0, 10), model::LogitsWanted::none};
  m->forward(std::span(&c2, 1));
  EXPECT_EQ(dec.bind(*st2), 0);
  EXPECT_EQ(dec.bind(*st2), -1);  // one slot
}

// DenseState rows never move as the state grows (the decoder keeps them in tables).
TEST(DenseState, rows_stay_put_across_reserve) {
  auto backend = kernels::make_cpu_backend();
  auto m = model::Model::load(tiny_model(), *backend);
  auto st = m->new_dense_state();
  st->reserve(64);
  float* e0 = st->entry_row(1, 0);
  float* e15 = st->entry_row(1, 15);
  st->reserve(4 * 5000);
  EXPECT_EQ(st->entry_row(1, 0), e0);
  EXPECT_EQ(st->entry_row(1, 15), e15);
  // Rows of different blocks are distinct and each block is contiguous.
  EXPECT_EQ(st->entry_row(1, 255) + 64, st->entry_row(1, 255) + m->config().head_dim);
  EXPECT_NE(st->entry_row(1, 256), st->entry_row(1, 255) + m->config().head_dim * 0);
  EXPECT_EQ(st->entry_row(1, 511), st->entry_row(1, 256) + 255 * m->config().head_dim);
  EXPECT_EQ(st->entry_row(1, 1023), st->entry_row(1, 512) + 511 * m->config().head_dim);
}

TEST(DecoderGpu, cuda_steps_match_cpu_forward_within_bf16_tolerance) {
  auto gpu = kernels::make_cuda_backend();
  if (!gpu) GTEST_SKIP() << "no CUDA device (or the build has no CUDA backend): GPU decoder test skipped";
  auto cpu = kernels::make_cpu_backend();
  auto mc = model::Model::load(tiny_model(), *cpu);
  // fp32 weights on the GPU too: the difference is the kernels' (bf16 tensor-core
  // attention operands), not weight rounding.
  auto mg = model::Model::load(tiny_model(), *gpu, kernels::WeightType::f32);
  auto mg16 = model::Model::load(tiny_model(), *gpu);
  const auto seqs = make_seqs(mc->config().vocab_size);
  const int64_t steps = 40;
  auto want = reference(*mc, seqs, steps);
  auto fwd16 = reference(*mg16, seqs, steps);
  std::vector<std::vector<int32_t>> greedy, greedy16;
  int64_t replays = 0, replays16 = 0;
  auto got = decoded(*mg, seqs, steps, &greedy, &replays, true);
  auto got16 = decoded(*mg16, seqs, steps, &greedy16, &replays16, true);
  const size_t V = static_cast<size_t>(mc->config().vocab_size);
  for (size_t i = 0; i < seqs.size(); ++i) {
    const double err = rel_l2(got[i], want[i]), err16 = rel_l2(got16[i], want[i]), err_self = rel_l2(got16[i], fwd16[i]);
    std::cout << "[ decoder  ] sequence " << i << ": rel L2 vs CPU " << err << " (fp32 weights), " << err16
              << " (bf16 weights); bf16 decoder vs bf16 CUDA forward " << err_self << "\n";
    EXPECT_LT(err, 1e-2);
    EXPECT_LT(err_self, 1e-2);
    int agree = 0;
    for (int64_t t = 0; t < steps; ++t) {
      const float* row = got[i].data() + t * V;
      agree += greedy[i][static_cast<size_t>(t)] == std::max_element(row, row + V) - row;
    }
    EXPECT_EQ(agree, steps);  // device argmax = host argmax of the same logits
  }
  EXPECT_GT(replays, 0);  // steps replayed from CUDA graphs
}

}  // namespace
}  // namespace troupe::testing
