// Decode-step helpers on the device (see Backend::decode_rows and friends in
// kernels/backend.hpp): key lists built from per-sequence row tables, the
// compressor's slot lists, pointer scatter, argmax sampling, fp32 attention of decode size.
// None of them reads anything back to the host, so a decode step built from
// them can be captured into a CUDA graph.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/backend.hpp"

namespace troupe::kernels::cuda {

void decode_rows(int64_t batch, const int64_t* positions, const int32_t* table_of, const float* const* window,
                 int64_t window_stride, int64_t window_slots, int64_t window_len, const float* const* entries,
                 int64_t entry_stride, int64_t rate, const int32_t* picked, const int32_t* picked_count, int k,
                 const float** out_rows, int64_t* out_offsets, const float* store, int64_t store_dim,
                 cudaStream_t s);
void decode_compress_rows(int64_t batch, const int64_t* positions, const int32_t* table_of, int64_t rate, bool overlap,
                          int64_t dim, const float* kv, float* score, const float* bias, float* const* ring,
                          int64_t ring_stride,
                          float* const* entries, int64_t entry_stride, const float** kv_src, const float** score_src,
                          float** out, int64_t* entry_pos, float** ring_dst, const float** ring_src, cudaStream_t s);
void scatter_pointers(void** table, const int64_t* index, void* const* values, int64_t count, cudaStream_t s);
void argmax_rows(const float* x, int64_t rows, int64_t n, int32_t* out, cudaStream_t s);
// The same for long rows over 64 blocks a row: workspace of argmax_split_workspace()
// entries each in ws_v and ws_i (0: use argmax_rows).
int64_t argmax_split_workspace(int64_t rows, int64_t n);
void argmax_rows_split(const float* x, int64_t rows, int64_t n, int32_t* out, float* ws_v, int32_t* ws_i,
                       cudaStream_t s);
// The fp32 attention (CudaBackend::attention) around two batched SGEMMs:
// keys[t, j, :] = rows[offsets[t] + j], zero-padded to max_keys rows a query
// (n_queries <= 65535); and, in place over scores[t, h, 0..max_keys) already
// scaled, the probabilities with the head's sink (nullable) in the denominator,
// zeros past the query's length.
void gather_key_rows(const float* const* rows, const int64_t* offsets, int64_t n_queries, int64_t max_keys,
                     int64_t dim, float* keys, cudaStream_t s);
void attention_softmax(float* scores, int64_t n_queries, int heads, int64_t max_keys, const int64_t* offsets,
                       const float* sinks, cudaStream_t s);
// The same fp32 attention in two launches (a split kernel over groups of 16 keys and 4 heads, then a
// combine), with no gathered copy of the keys: out[t, h, :] for queries t < n_queries whose rows (16-byte
// aligned, dim floats each) are rows[offsets[t] .. offsets[t + 1]), at most max_keys of them. workspace:
// attention_rows_workspace_bytes. attention_rows_takes: the shapes it runs (dim a multiple of 4, <= 512).
// With `positions` (else null), the combine turns each head's output back by the inverse rope of
// `rope` at positions[t] (Backend::attention_derotated; the bits of a rope() call after it).
size_t attention_rows_workspace_bytes(int64_t n_queries, int heads, int64_t dim, int64_t max_keys);
bool attention_rows_takes(int64_t n_queries, int64_t dim, int64_t max_keys);
void attention_rows(const float* q, int64_t n_queries, int heads, int64_t dim, const float* const* rows,
                    const int64_t* offsets, int64_t max_keys, const float* sinks, float scale, void* workspace,
                    float* out, cudaStream_t s, const RopeTable* rope = nullptr, const int64_t* positions = nullptr);
// Several GEMVs over the same rows of x in one launch: y_i[m, w_i.rows] = x[m, k] @ w_i^T,
// every w_i of the same type with k columns, m <= 8.
struct GemvSegment {
  const void* w = nullptr;
  int64_t rows = 0;
  float* y = nullptr;
};

}  // namespace troupe::kernels::cuda
