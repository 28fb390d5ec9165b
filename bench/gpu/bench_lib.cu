// C entry points over the fast kernels, for bench/gpu/bench.py (ctypes, torch
// tensors' data pointers and torch's current stream). Each returns 0, or -1 after
// printing the exception.
#include <cstdio>
#include <exception>
#include <stdexcept>

#include "kernels/cuda/attention.hpp"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/compressor.hpp"
#include "kernels/cuda/dense.hpp"
#include "kernels/cuda/indexer.hpp"
#include "kernels/cuda/topk.hpp"

using namespace troupe::kernels;
using namespace troupe::kernels::cuda;

// The launch floor of the kernels here: one CTA of 512 threads that does nothing but
// PDL's entry (griddepcontrol.wait / launch_dependents, as every kernel here does) and
// one store, launched as they are (launch_kernel: with the PDL attribute) or without it.
__global__ void __launch_bounds__(512) floor_kernel(int* flag) {
  pdl_entry();
  if (threadIdx.x == 0) *flag += 1;
}

template <class F>
static int guarded(F&& f) {
  try {
    f();
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "troupe bench: %s\n", e.what());
    return -1;
  }
}

extern "C" {

int tb_floor(int* flag, int pdl, void* stream) {
  return guarded([&] {
    const cudaStream_t s = static_cast<cudaStream_t>(stream);
    if (pdl != 0) {
      launch_kernel(floor_kernel, dim3(1), dim3(512), 0, s, flag);
    } else {
      floor_kernel<<<1, 512, 0, s>>>(flag);
      TROUPE_LAUNCHED();
    }
  });
}

long tb_indexer_topk_ws(int batch, long max_keys, int k) {
  return static_cast<long>(indexer_topk_workspace_bytes(batch, max_keys, k));
}

long tb_topk_ws(int rows, long max_len, int k, int max_cluster) {
  return static_cast<long>(topk_workspace_bytes(rows, max_len, k, max_cluster));
}

int tb_ws_init(void* ws, long bytes, void* stream) {
  return guarded([&] { topk_workspace_init(ws, static_cast<size_t>(bytes), static_cast<cudaStream_t>(stream)); });
}

int tb_topk_profiled(const float* scores, long stride, const int* lengths, int rows, long max_len, int k, int* out,
                     int* count, void* ws, int max_cluster, long long* profile, void* stream) {
  return guarded([&] {
    TopkArgs a;
    a.scores = scores;
    a.row_stride = stride;
    a.lengths = lengths;
    a.rows = rows;
    a.max_len = max_len;
    a.k = k;
    a.out_idx = out;
    a.out_stride = k;
    a.out_count = count;
    a.max_cluster = max_cluster;
    a.profile = profile;
    topk(a, ws, static_cast<cudaStream_t>(stream));
  });
}

int tb_topk(const float* scores, long stride, const int* lengths, int rows, long max_len, int k, int* out, int* count,
            void* ws, int max_cluster, void* stream) {
  return guarded([&] {
    TopkArgs a;
    a.scores = scores;
    a.row_stride = stride;
    a.lengths = lengths;
    a.rows = rows;
    a.max_len = max_len;
    a.k = k;
    a.out_idx = out;
    a.out_stride = k;
    a.out_count = count;
    a.max_cluster = max_cluster;
    topk(a, ws, static_cast<cudaStream_t>(stream));
  });
}

static CompressorShape shape(int rate, int overlap, long dim, const float* ape, const float* norm, float eps,
                             const float* inv_freq, long rope_dim, float rope_scale) {
  CompressorShape s;
  s.rate = rate;
  s.overlap = overlap != 0;
  s.dim = dim;
  s.ape = ape;
  s.norm_weight = norm;
  s.eps = eps;
  s.rope = RopeTable{inv_freq, rope_dim, rope_scale};
  return s;
}

int tb_compress_prefill(int rate, int overlap, long dim, const float* ape, const float* norm, float eps,
                        const float* inv_freq, long rope_dim, float rope_scale, const float* kv, const float* score,
                        long tokens, long start, float* ring, void* const* out_rows, int out_bf16, void* stream) {
  return guarded([&] {
    compress_prefill(shape(rate, overlap, dim, ape, norm, eps, inv_freq, rope_dim, rope_scale), kv, score, tokens,
                     start, ring, out_rows, out_bf16 ? EntryType::bf16 : EntryType::f32,
                     static_cast<cudaStream_t>(stream));
  });
}

int tb_compress_decode(int rate, int overlap, long dim, const float* ape, const float* norm, float eps,
                       const float* inv_freq, long rope_dim, float rope_scale, const float* kv, const float* score,
                       long batch, const long* positions, float* const* rings, void* const* out_rows, int out_bf16,
                       void* stream) {
  return guarded([&] {
    compress_decode(shape(rate, overlap, dim, ape, norm, eps, inv_freq, rope_dim, rope_scale), kv, score, batch,
                    reinterpret_cast<const int64_t*>(positions), rings, out_rows,
                    out_bf16 ? EntryType::bf16 : EntryType::f32, static_cast<cudaStream_t>(stream));
  });
}

int tb_quantize_e4m3(const float* x, long rows, unsigned char* q, float* scales, void* stream) {
  return guarded([&] { quantize_keys_e4m3(x, rows, q, scales, static_cast<cudaStream_t>(stream)); });
}

static IndexerArgs indexer_args(const float* q, const float* w, int batch, int heads, float scale, float wscale,
                                int fp8, const void* keys, const float* key_scales, const long* key_start,
                                const int* n_keys, long max_keys, float* scores) {
  IndexerArgs a;
  a.q = q;
  a.w = w;
  a.batch = batch;
  a.heads = heads;
  a.scale = scale;
  a.weight_scale = wscale;
  a.key_type = fp8 ? IndexKeyType::e4m3 : IndexKeyType::bf16;
  a.query_e4m3 = fp8 == 2;  // 2: the query in e4m3 too (fp8 tensor cores)
  a.keys = keys;
  a.key_scales = key_scales;
  a.key_start = reinterpret_cast<const int64_t*>(key_start);
  a.n_keys = n_keys;
  a.max_keys = max_keys;
  a.scores = scores;
  a.score_stride = max_keys;
  return a;
}

int tb_indexer_scores(const float* q, const float* w, int batch, int heads, float scale, float wscale, int fp8,
                      const void* keys, const float* key_scales, const long* key_start, const int* n_keys,
                      long max_keys, float* scores, void* stream) {
  return guarded([&] {
    indexer_scores(indexer_args(q, w, batch, heads, scale, wscale, fp8, keys, key_scales, key_start, n_keys, max_keys,
                                scores),
                   static_cast<cudaStream_t>(stream));
  });
}

int tb_indexer_topk_profiled(const float* q, const float* w, int batch, int heads, float scale, float wscale, int fp8,
                             const void* keys, const float* key_scales, const long* key_start, const int* n_keys,
                             long max_keys, float* scores, int k, int* out, int* count, void* ws, long long* profile,
                             void* stream) {
  return guarded([&] {
    IndexerTopk t;
    t.k = k;
    t.out_idx = out;
    t.out_stride = k;
    t.out_count = count;
    t.profile = profile;
    indexer_topk(indexer_args(q, w, batch, heads, scale, wscale, fp8, keys, key_scales, key_start, n_keys, max_keys,
                              scores),
                 t, ws, static_cast<cudaStream_t>(stream));
  });
}

int tb_indexer_topk(const float* q, const float* w, int batch, int heads, float scale, float wscale, int fp8,
                    const void* keys, const float* key_scales, const long* key_start, const int* n_keys, long max_keys,
                    float* scores, int k, int* out, int* count, void* ws, void* stream) {
  return tb_indexer_topk_profiled(q, w, batch, heads, scale, wscale, fp8, keys, key_scales, key_start, n_keys,
                                  max_keys, scores, k, out, count, ws, nullptr, stream);
}

// The backend op's scoring: fp32 keys by row pointers (form 0 automatic, 1 fp32, 2 split bf16).
int tb_indexer_ragged(const float* q, const float* w, long batch, int heads, long dim, float scale, float wscale,
                      const void* const* rows, const long* offsets, long max_keys, float* scores, long stride,
                      int form, void* stream) {
  return guarded([&] {
    RaggedRows r;
    r.rows = reinterpret_cast<const float* const*>(rows);
    r.offsets = reinterpret_cast<const int64_t*>(offsets);
    r.max_rows = max_keys;
    indexer_scores_ragged(q, w, batch, heads, dim, scale, wscale, r, scores, stride, max_keys,
                          static_cast<cudaStream_t>(stream), static_cast<RaggedForm>(form));
  });
}

static AttentionArgs attention_args(const float* q, long n, int heads, long dim, int bf16_keys, const void* const* rows,
                                    const long* offsets, long max_keys, const float* sinks, float scale, float* out,
                                    int splits) {
  AttentionArgs a;
  a.q = q;
  a.n_queries = n;
  a.heads = heads;
  a.dim = dim;
  a.key_type = bf16_keys ? KeyType::bf16 : KeyType::f32;
  a.rows = rows;
  a.offsets = reinterpret_cast<const int64_t*>(offsets);
  a.max_keys = max_keys;
  a.sinks = sinks;
  a.scale = scale;
  a.out = out;
  a.splits = splits;
  return a;
}

long tb_attention_ws(long n, int heads, long dim, int bf16_keys, long max_keys, int splits) {
  return static_cast<long>(attention_workspace_bytes(
      attention_args(nullptr, n, heads, dim, bf16_keys, nullptr, nullptr, max_keys, nullptr, 1.f, nullptr, splits)));
}

int tb_attention(const float* q, long n, int heads, long dim, int bf16_keys, const void* const* rows,
                 const long* offsets, long max_keys, const float* sinks, float scale, float* out, int splits, void* ws,
                 void* stream) {
  return guarded([&] {
    attention(attention_args(q, n, heads, dim, bf16_keys, rows, offsets, max_keys, sinks, scale, out, splits), ws,
              static_cast<cudaStream_t>(stream));
  });
}

int tb_gemv(const float* x, long m, const void* w, long n, long k, int wtype, float* y, void* stream) {
  return guarded([&] {
    Weight wt{w, static_cast<WeightType>(wtype), n, k};
    gemv(x, k, m, wt, y, n, 0.f, 0, static_cast<cudaStream_t>(stream));
  });
}

// wtype 3: e4m3 codes, 4: e2m1 codes (two a byte), with fp32 scales per block_rows x block_cols.
int tb_gemv_quantized(const float* x, long m, const void* codes, const float* scales, long n, long k, int wtype,
                      int block_rows, int block_cols, float* y, void* stream) {
  return guarded([&] {
    Weight wt{codes, static_cast<WeightType>(wtype), n, k};
    wt.scale = scales;
    wt.scale_stride = (k + block_cols - 1) / block_cols;
    wt.block_rows = block_rows;
    wt.block_cols = block_cols;
    if (!gemv_takes(wt, m, k, x)) throw std::invalid_argument("tb_gemv_quantized: a shape the GEMV does not take");
    gemv(x, k, m, wt, y, n, 0.f, 0, static_cast<cudaStream_t>(stream));
  });
}

}  // extern "C"
