// MoE routing on the CPU backend against a direct computation, for the three
// scoring functions (transformers 5.17 cannot run "softmax", so it has no fixture).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>

#include "kernels/backend.hpp"

namespace troupe::kernels {
namespace {

struct Case {
  ScoreFn fn;
  const char* name;
};

float score(ScoreFn fn, const std::vector<float>& logits, int e) {
  switch (fn) {
    case ScoreFn::sigmoid: return 1.0f / (1.0f + std::exp(-logits[e]));
    case ScoreFn::sqrtsoftplus: return std::sqrt(std::log1p(std::exp(logits[e])));
    case ScoreFn::softmax: {
      double z = 0;
      for (float l : logits) z += std::exp(static_cast<double>(l));
      return static_cast<float>(std::exp(static_cast<double>(logits[e])) / z);
    }
  }
  return 0;
}

TEST(Route, picks_top_k_by_score_plus_bias_and_weights_by_score) {
  auto b = make_cpu_backend();
  std::mt19937 rng(7);
  std::normal_distribution<float> n01;
  const int rows = 64, experts = 16, k = 4;
  for (Case c : {Case{ScoreFn::softmax, "softmax"}, Case{ScoreFn::sigmoid, "sigmoid"},
                 Case{ScoreFn::sqrtsoftplus, "sqrtsoftplus"}}) {
    std::vector<float> logits(rows * experts), bias(experts);
    for (auto& v : logits) v = n01(rng);
    for (auto& v : bias) v = 0.3f * n01(rng);
    std::vector<int32_t> idx(rows * k);
    std::vector<float> w(rows * k);
    b->route(logits.data(), rows, experts, c.fn, bias.data(), k, nullptr, nullptr, 2.5f, idx.data(), w.data());
    for (int r = 0; r < rows; ++r) {
      std::vector<float> lr(logits.begin() + r * experts, logits.begin() + (r + 1) * experts), s(experts);
      for (int e = 0; e < experts; ++e) s[e] = score(c.fn, lr, e);
      std::vector<int> order(experts);
      std::iota(order.begin(), order.end(), 0);
      std::sort(order.begin(), order.end(), [&](int a, int bb) { return s[a] + bias[a] > s[bb] + bias[bb]; });
      std::vector<int> want(order.begin(), order.begin() + k), got(idx.begin() + r * k, idx.begin() + (r + 1) * k);
      float sum = 0;
      for (int e : want) sum += s[e];
      std::sort(want.begin(), want.end());
      auto sorted = got;
      std::sort(sorted.begin(), sorted.end());
      ASSERT_EQ(sorted, want) << c.name << " row " << r;
      for (int j = 0; j < k; ++j) EXPECT_NEAR(w[r * k + j], s[got[j]] / sum * 2.5f, 1e-5) << c.name;
    }
  }
}

TEST(Route, hash_routing_takes_experts_from_the_table) {
  auto b = make_cpu_backend();
  const int rows = 3, experts = 8, k = 2;
  std::vector<float> logits(rows * experts, 0.5f);
  logits[experts + 1] = 2.0f;  // row 1, expert 1
  std::vector<int64_t> table{0, 1, 2, 3, 4, 5, 6, 7};  // vocab 4, k 2
  std::vector<int32_t> ids{1, 0, 3};
  std::vector<int32_t> idx(rows * k);
  std::vector<float> w(rows * k);
  b->route(logits.data(), rows, experts, ScoreFn::sigmoid, nullptr, k, table.data(), ids.data(), 1.0f, idx.data(),
           w.data());
  EXPECT_EQ(idx, (std::vector<int32_t>{2, 3, 0, 1, 6, 7}));
  const float s1 = 1 / (1 + std::exp(-2.0f)), s0 = 1 / (1 + std::exp(-0.5f));
  EXPECT_NEAR(w[2], s0 / (s0 + s1), 1e-6);  // row 1 picks experts 0 and 1
  EXPECT_NEAR(w[3], s1 / (s0 + s1), 1e-6);
}

}  // namespace
}  // namespace troupe::kernels
