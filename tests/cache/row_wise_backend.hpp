// A backend whose every op computes each row on its own: the CPU backend,
// with linear, the mHC mixes and MoE called one row at a time. A row's result
// then depends on that row's inputs only, never on which other rows share the
// call, so the same tokens give bitwise the same logits however they are
// batched, chunked, cached, parked or recomputed. The cache tests use it to
// demand exact equality with a DenseState run: any difference is a cache
// error, never a top-k near-tie tipped by another BLAS summation order.
#pragma once

#include <cblas.h>

#include <memory>

#include "kernels/backend.hpp"

namespace troupe::test {

class RowWiseBackend final : public kernels::Backend {
 public:
  RowWiseBackend() : in_(kernels::make_cpu_backend()) { openblas_set_num_threads(1); }
  std::string name() const override { return in_->name(); }  // "cpu": weights load as f32

  void* alloc(size_t bytes) override { return in_->alloc(bytes); }
  void free(void* p) override { in_->free(p); }
  void to_device(void* d, const void* s, size_t n) override { in_->to_device(d, s, n); }
  void to_host(void* d, const void* s, size_t n) override { in_->to_host(d, s, n); }
  void copy(void* d, const void* s, size_t n) override { in_->copy(d, s, n); }
  void synchronize() override { in_->synchronize(); }

  // One matrix-vector product per row (f32 weights, as the CPU backend loads them).
  void linear(const float* x, int64_t m, const kernels::Weight& w, float* y, float beta) override {
    if (w.type != kernels::WeightType::f32) {
      for (int64_t r = 0; r < m; ++r) in_->linear(x + r * w.cols, 1, w, y + r * w.rows, beta);
      return;
    }
    for (int64_t r = 0; r < m; ++r) {
      cblas_sgemv(CblasRowMajor, CblasNoTrans, static_cast<int>(w.rows), static_cast<int>(w.cols), 1.0f,
                  static_cast<const float*>(w.data), static_cast<int>(w.cols), x + r * w.cols, 1, beta, y + r * w.rows, 1);
    }
  }
  void linear_grouped(const float* x, int64_t m, const kernels::Weight& w, int groups, float* y) override {
    if (w.type != kernels::WeightType::f32) {
      for (int64_t r = 0; r < m; ++r) in_->linear_grouped(x + r * groups * w.cols, 1, w, groups, y + r * w.rows);
      return;
    }
    const int64_t out = w.rows / groups;
    const auto* wd = static_cast<const float*>(w.data);
    for (int64_t r = 0; r < m; ++r) {
      for (int g = 0; g < groups; ++g) {
        cblas_sgemv(CblasRowMajor, CblasNoTrans, static_cast<int>(out), static_cast<int>(w.cols), 1.0f,
                    wd + g * out * w.cols, static_cast<int>(w.cols), x + r * groups * w.cols + g * w.cols, 1, 0.0f,
                    y + r * w.rows + g * out, 1);
      }
    }
  }
  void rmsnorm(const float* x, const float* wt, float* y, int64_t rows, int64_t dim, float eps) override {
    in_->rmsnorm(x, wt, y, rows, dim, eps);
  }
  void rope(float* x, int64_t rows, int heads, int64_t hd, const kernels::RopeTable& r, const int64_t* pos,
            bool inverse) override {
    in_->rope(x, rows, heads, hd, r, pos, inverse);
  }
  void add_position_bias(float* x, int64_t rows, int64_t dim, const int64_t* pos, const float* bias,
                         int64_t period) override {
    in_->add_position_bias(x, rows, dim, pos, bias, period);
  }
  void copy_rows(float* const* d, const float* const* s, int64_t count, int64_t n) override { in_->copy_rows(d, s, count, n); }
  void embed(const kernels::Weight& t, const int32_t* ids, int64_t rows, int copies, float* out) override {
    in_->embed(t, ids, rows, copies, out);
  }
  void gather_rows(const float* x, int64_t dim, const int64_t* index, int64_t count, float* out) override {
    in_->gather_rows(x, dim, index, count, out);
  }
  void mhc_pre(const float* X, int64_t rows, const kernels::Weight& fn, const float* base, const float* scale,
               const kernels::MhcParams& p, float* y, float* post, float* comb) override {
    for (int64_t r = 0; r < rows; ++r) {
      in_->mhc_pre(X + r * p.hc * p.dim, 1, fn, base, scale, p, y + r * p.dim, post + r * p.hc, comb + r * p.hc * p.hc);
    }
  }
  void mhc_post(float* X, int64_t rows, const float* f, const float* post, const float* comb,
                const kernels::MhcParams& p) override {
    for (int64_t r = 0; r < rows; ++r) in_->mhc_post(X + r * p.hc * p.dim, 1, f + r * p.dim, post + r * p.hc, comb + r * p.hc * p.hc, p);
  }
  void mhc_head(const float* X, int64_t rows, const kernels::Weight& fn, const float* base, const float* scale,
                const kernels::MhcParams& p, float* y) override {
    for (int64_t r = 0; r < rows; ++r) in_->mhc_head(X + r * p.hc * p.dim, 1, fn, base, scale, p, y + r * p.dim);
  }
  void compress(int64_t count, int slots, int64_t dim, const float* const* kv, const float* const* score,
                const float* norm, float eps, const int64_t* pos, const kernels::RopeTable& r, float* const* out) override {
    in_->compress(count, slots, dim, kv, score, norm, eps, pos, r, out);
  }
  void indexer_topk(const float* q, const float* w, int64_t n, int heads, int64_t dim, float scale, float ws,
                    kernels::RaggedRows keys, int k, int32_t* idx, int32_t* cnt) override {
    in_->indexer_topk(q, w, n, heads, dim, scale, ws, keys, k, idx, cnt);
  }
  void attention(const float* q, int64_t n, int heads, int64_t dim, kernels::RaggedRows keys, const float* sinks,
                 float scale, float* out) override {
    in_->attention(q, n, heads, dim, keys, sinks, scale, out);
  }
  void route(const float* logits, int64_t rows, int experts, kernels::ScoreFn fn, const float* bias, int k,
             const int64_t* hash, const int32_t* ids, float rs, int32_t* idx, float* wt) override {
    in_->route(logits, rows, experts, fn, bias, k, hash, ids, rs, idx, wt);
  }
  void moe(const float* x, int64_t rows, int64_t dim, const int32_t* idx, const float* wt, int k, int experts,
           const kernels::Weight* gate, const kernels::Weight* up, const kernels::Weight* down, float limit,
           float* out) override {
    for (int64_t r = 0; r < rows; ++r) {
      in_->moe(x + r * dim, 1, dim, idx + r * k, wt + r * k, k, experts, gate, up, down, limit, out + r * dim);
    }
  }
  void swiglu(const float* g, const float* u, float* y, int64_t n, float limit) override { in_->swiglu(g, u, y, n, limit); }
  void add(float* y, const float* x, int64_t n) override { in_->add(y, x, n); }
  // Decoding ops: per sequence already (pointer lists, argmax per row).
  void decode_rows(int64_t batch, const int64_t* pos, const int32_t* table_of, const float* const* window,
                   int64_t window_stride, int64_t window_slots, int64_t window_len, const float* const* entries,
                   int64_t entry_stride, int64_t rate, const int32_t* picked, const int32_t* picked_count, int k,
                   const float** out_rows, int64_t* out_offsets) override {
    in_->decode_rows(batch, pos, table_of, window, window_stride, window_slots, window_len, entries, entry_stride, rate,
                     picked, picked_count, k, out_rows, out_offsets);
  }
  void decode_compress_rows(int64_t batch, const int64_t* pos, const int32_t* table_of, int64_t rate, bool overlap,
                            int64_t dim, const float* kv, float* score, const float* bias, float* const* ring,
                            int64_t ring_stride, float* const* entries, int64_t entry_stride, const float** kv_src,
                            const float** score_src, float** out, int64_t* entry_pos, float** ring_dst,
                            const float** ring_src) override {
    in_->decode_compress_rows(batch, pos, table_of, rate, overlap, dim, kv, score, bias, ring, ring_stride, entries,
                              entry_stride, kv_src, score_src, out, entry_pos, ring_dst, ring_src);
  }
  void scatter_pointers(void** table, const int64_t* index, void* const* values, int64_t count) override {
    in_->scatter_pointers(table, index, values, count);
  }
  void argmax(const float* x, int64_t rows, int64_t n, int32_t* out) override { in_->argmax(x, rows, n, out); }

 private:
  std::unique_ptr<kernels::Backend> in_;
};

}  // namespace troupe::test
