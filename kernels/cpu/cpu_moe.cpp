// MoE routing and experts on the CPU backend.
#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "kernels/cpu/cpu_backend.hpp"

namespace troupe::kernels::cpu {

void CpuBackend::route(const float* logits, int64_t rows, int experts, ScoreFn fn, const float* bias, int k,
                       const int64_t* hash_table, const int32_t* ids, float route_scale, int32_t* out_idx,
                       float* out_weight) {
  std::vector<float> scores(static_cast<size_t>(experts));
  std::vector<float> keyed(static_cast<size_t>(experts));
  std::vector<int32_t> order(static_cast<size_t>(experts));
  for (int64_t r = 0; r < rows; ++r) {
    const float* lr = logits + r * experts;
    if (fn == ScoreFn::softmax) {
      float mx = *std::max_element(lr, lr + experts);
      float sum = 0;
      for (int e = 0; e < experts; ++e) sum += (scores[e] = std::exp(lr[e] - mx));
      for (int e = 0; e < experts; ++e) scores[e] /= sum;
    } else if (fn == ScoreFn::sigmoid) {
      for (int e = 0; e < experts; ++e) scores[e] = 1.0f / (1.0f + std::exp(-lr[e]));
    } else {  // sqrt(softplus(x)), softplus with torch's threshold 20
      for (int e = 0; e < experts; ++e) {
        const float sp = lr[e] > 20.0f ? lr[e] : std::log1p(std::exp(lr[e]));
        scores[e] = std::sqrt(sp);
      }
    }
    int32_t* idx = out_idx + r * k;
    if (hash_table != nullptr) {
      for (int j = 0; j < k; ++j) idx[j] = static_cast<int32_t>(hash_table[static_cast<int64_t>(ids[r]) * k + j]);
    } else {
      for (int e = 0; e < experts; ++e) keyed[e] = scores[e] + (bias != nullptr ? bias[e] : 0.0f);
      std::iota(order.begin(), order.end(), 0);
      std::partial_sort(order.begin(), order.begin() + k, order.end(), [&](int32_t a, int32_t b) {
        return keyed[a] > keyed[b] || (keyed[a] == keyed[b] && a < b);
      });
      for (int j = 0; j < k; ++j) idx[j] = order[j];
    }
    float sum = 0;
    for (int j = 0; j < k; ++j) sum += scores[idx[j]];
    for (int j = 0; j < k; ++j) out_weight[r * k + j] = scores[idx[j]] / (sum + 1e-20f) * route_scale;
  }
}

void CpuBackend::moe(const float* x, int64_t rows, int64_t dim, const int32_t* idx, const float* weight, int k,
                     int experts, const Weight* gate, const Weight* up, const Weight* down, float limit, float* out) {
  // Group the (token, slot) pairs by expert, then run each expert as GEMMs.
  std::vector<std::vector<int64_t>> assigned(static_cast<size_t>(experts));
  for (int64_t r = 0; r < rows; ++r) {
    for (int j = 0; j < k; ++j) assigned[idx[r * k + j]].push_back(r * k + j);
  }
  std::vector<float> xs, g, u, h, y;
  for (int e = 0; e < experts; ++e) {
    const auto& pairs = assigned[e];
    if (pairs.empty()) continue;
    const int64_t m = static_cast<int64_t>(pairs.size());
    const int64_t inter = gate[e].rows;
    xs.resize(static_cast<size_t>(m * dim));
    for (int64_t i = 0; i < m; ++i) std::copy(x + (pairs[i] / k) * dim, x + (pairs[i] / k + 1) * dim, xs.begin() + i * dim);
    g.resize(static_cast<size_t>(m * inter));
    u.resize(g.size());
    h.resize(g.size());
    y.resize(static_cast<size_t>(m * dim));
    linear(xs.data(), m, gate[e], g.data(), 0.0f);
    linear(xs.data(), m, up[e], u.data(), 0.0f);
    swiglu(g.data(), u.data(), h.data(), m * inter, limit);
    linear(h.data(), m, down[e], y.data(), 0.0f);
    for (int64_t i = 0; i < m; ++i) {
      const float wgt = weight[pairs[i]];
      float* o = out + (pairs[i] / k) * dim;
      const float* yi = y.data() + i * dim;
      for (int64_t c = 0; c < dim; ++c) o[c] += wgt * yi[c];
    }
  }
}

}  // namespace troupe::kernels::cpu
