// V4 attention on the CPU backend: compressor pooling, lightning indexer with
// top-k, and the shared-KV attention with sinks.
#include <cblas.h>

#include <algorithm>
#include <cstring>
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
    if (out[e] == nullptr) continue;
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

namespace {

// Copies a query's key rows into one contiguous [n, dim] block for BLAS.
const float* gather_keys(const RaggedRows& keys, int64_t t, int64_t dim, std::vector<float>& buf, int64_t* n_out) {
  const int64_t begin = keys.offsets[t];
  const int64_t n = keys.offsets[t + 1] - begin;
  buf.resize(static_cast<size_t>(std::max<int64_t>(n, 1) * dim));
  for (int64_t j = 0; j < n; ++j) std::memcpy(buf.data() + j * dim, keys.rows[begin + j], static_cast<size_t>(dim) * 4);
  *n_out = n;
  return buf.data();
}

}  // namespace

void CpuBackend::indexer_topk(const float* q, const float* w, int64_t n_queries, int heads, int64_t dim,
                              float scale, float weight_scale, RaggedRows keys, int k, int32_t* out_idx,
                              int32_t* out_count) {
  std::vector<float> kbuf, dots, scores;
  std::vector<int32_t> order;
  for (int64_t t = 0; t < n_queries; ++t) {
    int64_t n = 0;
    const float* K = gather_keys(keys, t, dim, kbuf, &n);
    scores.assign(static_cast<size_t>(n), 0.0f);
    if (n > 0) {
      dots.resize(static_cast<size_t>(n * heads));  // dots[s, h] = K[s] . q[t, h]
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, static_cast<int>(n), heads, static_cast<int>(dim), 1.0f, K,
                  static_cast<int>(dim), q + t * heads * dim, static_cast<int>(dim), 0.0f, dots.data(), heads);
      for (int64_t s = 0; s < n; ++s) {
        float total = 0;
        for (int h = 0; h < heads; ++h) {
          total += (std::max(dots[s * heads + h], 0.0f) * scale) * (w[t * heads + h] * weight_scale);
        }
        scores[s] = total;
      }
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
  std::vector<float> kbuf, p;
  for (int64_t t = 0; t < n_queries; ++t) {
    int64_t n = 0;
    const float* K = gather_keys(keys, t, dim, kbuf, &n);
    const float* qt = q + t * heads * dim;
    float* ot = out + t * heads * dim;
    p.resize(static_cast<size_t>(std::max<int64_t>(n, 1) * heads));  // p[h, j] = q[h] . K[j]
    if (n > 0) {
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, heads, static_cast<int>(n), static_cast<int>(dim), 1.0f, qt,
                  static_cast<int>(dim), K, static_cast<int>(dim), 0.0f, p.data(), static_cast<int>(n));
    }
    for (int h = 0; h < heads; ++h) {  // softmax over [logits..., sink], the sink only in the denominator
      float* ph = p.data() + h * n;
      float mx = sinks[h];
      for (int64_t j = 0; j < n; ++j) mx = std::max(mx, ph[j] *= scale);
      float denom = std::exp(sinks[h] - mx);
      for (int64_t j = 0; j < n; ++j) denom += (ph[j] = std::exp(ph[j] - mx));
      for (int64_t j = 0; j < n; ++j) ph[j] /= denom;
    }
    if (n > 0) {
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, heads, static_cast<int>(dim), static_cast<int>(n), 1.0f,
                  p.data(), static_cast<int>(n), K, static_cast<int>(dim), 0.0f, ot, static_cast<int>(dim));
    } else {
      std::fill(ot, ot + heads * dim, 0.0f);
    }
  }
}

}  // namespace troupe::kernels::cpu
