// V4 attention on the CPU backend: compressor pooling, lightning indexer with
// top-k, and the shared-KV attention with sinks.
#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "kernels/cpu/cpu_backend.hpp"

namespace troupe::kernels::cpu {

void CpuBackend::compress(int64_t count, int slots, int64_t dim, const float* const* kv_src,
                          const float* const* score_src, const float* norm_weight, float eps,
                          const int64_t* positions, const RopeTable& rope, float* const* out) {
  std::vector<float> pooled(static_cast<size_t>(dim));
  for (int64_t e = 0; e < count; ++e) {
    const float* const* kv = kv_src + e * slots;
    const float* const* sc = score_src + e * slots;
    for (int64_t ch = 0; ch < dim; ++ch) {
      float mx = -INFINITY;
      for (int s = 0; s < slots; ++s) {
        if (sc[s] != nullptr) mx = std::max(mx, sc[s][ch]);
      }
      float denom = 0;
      for (int s = 0; s < slots; ++s) {
        if (sc[s] != nullptr) denom += std::exp(sc[s][ch] - mx);
      }
      float acc = 0;
      for (int s = 0; s < slots; ++s) {
        if (sc[s] != nullptr) acc += (std::exp(sc[s][ch] - mx) / denom) * kv[s][ch];
      }
      pooled[ch] = acc;
    }
    rmsnorm(pooled.data(), norm_weight, out[e], 1, dim, eps);
    rope_row(out[e] + (dim - rope.rope_dim), rope, positions[e], false);
  }
}

void CpuBackend::indexer_topk(const float* q, const float* w, int64_t n_queries, int heads, int64_t dim,
                              float scale, float weight_scale, RaggedRows keys, int k, int32_t* out_idx,
                              int32_t* out_count) {
  std::vector<float> scores;
  std::vector<int32_t> order;
  for (int64_t t = 0; t < n_queries; ++t) {
    const int64_t begin = keys.offsets[t];
    const int64_t n = keys.offsets[t + 1] - begin;
    scores.assign(static_cast<size_t>(n), 0.0f);
    for (int64_t s = 0; s < n; ++s) {
      const float* key = keys.rows[begin + s];
      float total = 0;
      for (int h = 0; h < heads; ++h) {
        const float* qh = q + (t * heads + h) * dim;
        float dot = 0;
        for (int64_t i = 0; i < dim; ++i) dot += qh[i] * key[i];
        total += (std::max(dot, 0.0f) * scale) * (w[t * heads + h] * weight_scale);
      }
      scores[s] = total;
    }
    const int64_t take = std::min<int64_t>(k, n);
    order.resize(static_cast<size_t>(n));
    std::iota(order.begin(), order.end(), 0);
    // Highest score first; equal scores by lower index (any choice is valid at ties).
    std::partial_sort(order.begin(), order.begin() + take, order.end(), [&](int32_t a, int32_t b) {
      return scores[a] > scores[b] || (scores[a] == scores[b] && a < b);
    });
    std::sort(order.begin(), order.begin() + take);
    for (int64_t i = 0; i < take; ++i) out_idx[t * k + i] = order[i];
    out_count[t] = static_cast<int32_t>(take);
  }
}

void CpuBackend::attention(const float* q, int64_t n_queries, int heads, int64_t dim, RaggedRows keys,
                           const float* sinks, float scale, float* out) {
  std::vector<float> logits;
  for (int64_t t = 0; t < n_queries; ++t) {
    const int64_t begin = keys.offsets[t];
    const int64_t n = keys.offsets[t + 1] - begin;
    logits.resize(static_cast<size_t>(n));
    for (int h = 0; h < heads; ++h) {
      const float* qh = q + (t * heads + h) * dim;
      float mx = sinks[h];
      for (int64_t j = 0; j < n; ++j) {
        const float* key = keys.rows[begin + j];
        float dot = 0;
        for (int64_t i = 0; i < dim; ++i) dot += qh[i] * key[i];
        logits[j] = dot * scale;
        mx = std::max(mx, logits[j]);
      }
      float denom = std::exp(sinks[h] - mx);
      for (int64_t j = 0; j < n; ++j) {
        logits[j] = std::exp(logits[j] - mx);
        denom += logits[j];
      }
      float* oh = out + (t * heads + h) * dim;
      std::fill(oh, oh + dim, 0.0f);
      for (int64_t j = 0; j < n; ++j) {
        const float p = logits[j] / denom;
        const float* key = keys.rows[begin + j];
        for (int64_t i = 0; i < dim; ++i) oh[i] += p * key[i];
      }
    }
  }
}

}  // namespace troupe::kernels::cpu
