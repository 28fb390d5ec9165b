// mHC (manifold-constrained hyper-connections) on the CPU backend.
#include <cmath>
#include <vector>

#include "kernels/cpu/cpu_backend.hpp"
#include "kernels/cpu/cpu_gemm.hpp"

namespace troupe::kernels::cpu {
namespace {

float sigmoid(float x) { return 1.0f / (1.0f + std::exp(-x)); }

// mix[rows, n_mix] = rmsnorm_unweighted(X.flat) @ fn^T
std::vector<float> hc_mix(const float* X, int64_t rows, const Weight& fn, const MhcParams& p) {
  const int64_t width = p.hc * p.dim;
  std::vector<float> flat(static_cast<size_t>(rows * width));
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = X + r * width;
    double ss = 0;
    for (int64_t i = 0; i < width; ++i) ss += static_cast<double>(xr[i]) * xr[i];
    const float inv = 1.0f / std::sqrt(static_cast<float>(ss / static_cast<double>(width)) + p.norm_eps);
    for (int64_t i = 0; i < width; ++i) flat[r * width + i] = xr[i] * inv;
  }
  std::vector<float> mix(static_cast<size_t>(rows * fn.rows));
  gemm_weight(flat.data(), rows, width, fn, mix.data(), fn.rows, false);
  return mix;
}

void collapse(const float* X, const float* pre, int hc, int64_t dim, float* y) {
  for (int64_t i = 0; i < dim; ++i) y[i] = 0;
  for (int j = 0; j < hc; ++j) {
    const float* xj = X + j * dim;
    for (int64_t i = 0; i < dim; ++i) y[i] += pre[j] * xj[i];
  }
}

}  // namespace

void CpuBackend::mhc_pre(const float* X, int64_t rows, const Weight& fn, const float* base, const float* scale,
                         const MhcParams& p, float* y, float* post, float* comb) {
  const int hc = p.hc;
  const int n_mix = (2 + hc) * hc;
  std::vector<float> mix = hc_mix(X, rows, fn, p);
  std::vector<float> pre(hc);
  for (int64_t r = 0; r < rows; ++r) {
    const float* m = mix.data() + r * n_mix;
    for (int j = 0; j < hc; ++j) pre[j] = sigmoid(m[j] * scale[0] + base[j]) + p.hc_eps;
    float* po = post + r * hc;
    for (int j = 0; j < hc; ++j) po[j] = 2.0f * sigmoid(m[hc + j] * scale[1] + base[hc + j]);
    float* c = comb + r * hc * hc;
    for (int a = 0; a < hc; ++a) {  // row softmax + eps
      float mx = -INFINITY;
      for (int b = 0; b < hc; ++b) {
        c[a * hc + b] = m[2 * hc + a * hc + b] * scale[2] + base[2 * hc + a * hc + b];
        mx = std::max(mx, c[a * hc + b]);
      }
      float sum = 0;
      for (int b = 0; b < hc; ++b) {
        c[a * hc + b] = std::exp(c[a * hc + b] - mx);
        sum += c[a * hc + b];
      }
      for (int b = 0; b < hc; ++b) c[a * hc + b] = c[a * hc + b] / sum + p.hc_eps;
    }
    auto normalize_cols = [&] {
      for (int b = 0; b < hc; ++b) {
        float s = 0;
        for (int a = 0; a < hc; ++a) s += c[a * hc + b];
        for (int a = 0; a < hc; ++a) c[a * hc + b] /= (s + p.hc_eps);
      }
    };
    auto normalize_rows = [&] {
      for (int a = 0; a < hc; ++a) {
        float s = 0;
        for (int b = 0; b < hc; ++b) s += c[a * hc + b];
        for (int b = 0; b < hc; ++b) c[a * hc + b] /= (s + p.hc_eps);
      }
    };
    normalize_cols();
    for (int it = 0; it < p.sinkhorn_iters - 1; ++it) {
      normalize_rows();
      normalize_cols();
    }
    collapse(X + r * hc * p.dim, pre.data(), hc, p.dim, y + r * p.dim);
  }
}

void CpuBackend::mhc_post(float* X, int64_t rows, const float* f, const float* post, const float* comb,
                          const MhcParams& p) {
  const int hc = p.hc;
  const int64_t dim = p.dim;
  std::vector<float> out(static_cast<size_t>(hc * dim));
  for (int64_t r = 0; r < rows; ++r) {
    float* x = X + r * hc * dim;
    const float* fr = f + r * dim;
    const float* c = comb + r * hc * hc;
    for (int k = 0; k < hc; ++k) {
      float* ok = out.data() + k * dim;
      const float pk = post[r * hc + k];
      for (int64_t i = 0; i < dim; ++i) ok[i] = pk * fr[i];
      for (int j = 0; j < hc; ++j) {
        const float cjk = c[j * hc + k];
        const float* xj = x + j * dim;
        for (int64_t i = 0; i < dim; ++i) ok[i] += cjk * xj[i];
      }
    }
    std::copy(out.begin(), out.end(), x);
  }
}

void CpuBackend::mhc_head(const float* X, int64_t rows, const Weight& fn, const float* base, const float* scale,
                          const MhcParams& p, float* y) {
  const int hc = p.hc;
  std::vector<float> mix = hc_mix(X, rows, fn, p);
  std::vector<float> pre(hc);
  for (int64_t r = 0; r < rows; ++r) {
    for (int j = 0; j < hc; ++j) pre[j] = sigmoid(mix[r * hc + j] * scale[0] + base[j]) + p.hc_eps;
    collapse(X + r * hc * p.dim, pre.data(), hc, p.dim, y + r * p.dim);
  }
}

}  // namespace troupe::kernels::cpu
