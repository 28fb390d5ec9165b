// The CPU forward pass against transformers' logits, stateless and fed in pieces.
#include <gtest/gtest.h>

#include <random>

#include "kernels/backend.hpp"
#include "model/forward.hpp"
#include "tests/model/fixtures.hpp"

namespace troupe::testing {
namespace {

constexpr double kTolerance = 1e-3;  // issue bound; the measured error is ~1e-5

// Runs the ids through `model` in chunks of the given sizes (one chunk per call)
// and returns all logits rows.
std::vector<float> run_chunked(model::Model& m, const std::vector<int32_t>& ids, const std::vector<int64_t>& sizes) {
  auto state = m.new_dense_state();
  std::vector<float> out;
  size_t at = 0;
  for (int64_t n : sizes) {
    model::Chunk c{state.get(), std::span<const int32_t>(ids).subspan(at, static_cast<size_t>(n)),
                   model::LogitsWanted::all};
    auto rows = m.forward(std::span(&c, 1));
    out.insert(out.end(), rows.begin(), rows.end());
    at += static_cast<size_t>(n);
  }
  return out;
}

class GoldenTest : public ::testing::TestWithParam<std::string> {};

TEST_P(GoldenTest, stateless_and_every_split_match_transformers) {
  const Fixture f = load_fixture(GetParam());
  auto backend = kernels::make_cpu_backend();
  auto m = model::Model::load(f.dir, *backend);
  const auto T = static_cast<int64_t>(f.ids.size());
  ASSERT_EQ(m->config().vocab_size, f.vocab);

  std::vector<std::pair<std::string, std::vector<int64_t>>> splits;
  splits.push_back({"stateless", {T}});
  const int64_t p = f.meta.at("prefill").get<int64_t>();
  std::vector<int64_t> prefill_then_decode{p};
  for (int64_t t = p; t < T; ++t) prefill_then_decode.push_back(1);
  splits.push_back({"prefill " + std::to_string(p) + " then decode", prefill_then_decode});
  std::mt19937 rng(static_cast<uint32_t>(T));
  for (int r = 0; r < 2; ++r) {  // random chunkings: lengths not multiples of any rate
    std::vector<int64_t> sizes;
    for (int64_t left = T; left > 0;) {
      int64_t n = std::min<int64_t>(left, 1 + static_cast<int64_t>(rng() % 97));
      sizes.push_back(n);
      left -= n;
    }
    splits.push_back({"random chunking " + std::to_string(r), sizes});
  }
  for (const auto& [what, sizes] : splits) {
    auto got = run_chunked(*m, f.ids, sizes);
    ASSERT_EQ(got.size(), f.logits.size()) << what;
    const double err = max_abs_diff(got.data(), f.logits.data(), got.size());
    EXPECT_LE(err, kTolerance) << f.name << " " << what;
    std::cout << "[ fixture  ] " << f.name << " " << what << ": max |logit - transformers| = " << err << "\n";
  }
}

INSTANTIATE_TEST_SUITE_P(Fixtures, GoldenTest, ::testing::ValuesIn(fixture_names()),
                         [](const auto& info) { return info.param; });

// The bf16 checkpoint: exact against transformers running the same (bf16-rounded)
// weights in fp32, and as far from its fp32 twin as transformers' own bf16 copy is.
TEST(Bf16Checkpoint, matches_rounded_oracle_and_fp32_twin_within_bf16_tolerance) {
  const Fixture f = load_fixture("basic_bf16");
  auto fp32_twin = read_npy(f.dir + "/fp32_logits.npy").as_f32();
  auto backend = kernels::make_cpu_backend();
  auto m = model::Model::load(f.dir, *backend);
  auto got = run_chunked(*m, f.ids, {static_cast<int64_t>(f.ids.size())});
  EXPECT_LE(max_abs_diff(got.data(), f.logits.data(), got.size()), kTolerance);
  double num = 0, den = 0, hf_num = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    num += std::pow(got[i] - fp32_twin[i], 2);
    hf_num += std::pow(f.logits[i] - fp32_twin[i], 2);
    den += std::pow(fp32_twin[i], 2);
  }
  const double rel = std::sqrt(num / den), hf_rel = std::sqrt(hf_num / den);
  std::cout << "[ bf16     ] relative error vs fp32 twin: troupe " << rel << ", transformers " << hf_rel << "\n";
  EXPECT_LT(rel, 0.2);
  EXPECT_NEAR(rel, hf_rel, 0.01 * hf_rel + 1e-6);
}

}  // namespace
}  // namespace troupe::testing
