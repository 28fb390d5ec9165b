// The lightning indexer: score[b, s] = sum_h (w[b,h] * weight_scale) * relu(q[b,h,:] . key_s) * scale,
// then the exact top-k of each query's scores (topk.hpp).
//
// Fast form: keys are bf16 (or fp8 e4m3 with one positive fp32 scale per key)
// rows of 128 channels in a pool, streamed once through cp.async rings; the dot
// products run on the tensor cores with fp32 accumulation, on wgmma (sm_90a; the keys
// as the register A operand, each thread copying and reading back only its own
// fragments; e4m3 keys converted to f16 in registers, the query in f16, the query the
// shared-memory B operand; or, with query_e4m3, the query quantized per head and both on the
// fp8 tensor cores). TROUPE_INDEXER_WGMMA=0: the older mma.sync kernel, the
// query heads held in registers.
//
// indexer_topk with at most 64 queries of at most 131,072 keys (TROUPE_INDEXER_FUSED=1:
// whatever fits the scoring CTAs' shared memory, up to ~540 K keys for one query on an
// H200) runs as one kernel: the scoring CTAs of a query select its top k themselves (see
// indexer.cu); other calls score, then run the top-k (topk.hpp) as a second kernel.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "kernels/backend.hpp"

namespace troupe::kernels::cuda {

enum class IndexKeyType : uint8_t { bf16, e4m3 };

struct IndexerArgs {
  const float* q = nullptr;           // [batch, heads, 128]
  const float* w = nullptr;           // [batch, heads]
  int batch = 0;
  int heads = 0;                      // 1 .. 64
  float scale = 1.f;                  // on relu(q . k)
  float weight_scale = 1.f;           // on w
  IndexKeyType key_type = IndexKeyType::bf16;
  // e4m3 keys: the query quantized to e4m3 too, per head (scale amax / 448, as quantize_keys_e4m3), the
  // dot products on the fp8 tensor cores (DeepSeek's fp8 indexer numerics); else the query in f16.
  bool query_e4m3 = false;
  const void* keys = nullptr;         // pool rows of 128 channels (256 B bf16, 128 B e4m3), 16-byte aligned
  const float* key_scales = nullptr;  // e4m3: [pool rows], > 0
  // Key s of query b is pool row key_start[b] + s, or, with a page table,
  // page_table[b * page_stride + s / page_size] * page_size + s % page_size (page_size % 8 == 0).
  const int64_t* key_start = nullptr;
  const int32_t* page_table = nullptr;
  int64_t page_stride = 0;
  int page_size = 0;
  const int32_t* n_keys = nullptr;    // [batch]
  int64_t max_keys = 0;               // >= every n_keys[b]
  float* scores = nullptr;            // [batch, score_stride]
  int64_t score_stride = 0;
};

void indexer_scores(const IndexerArgs& a, cudaStream_t stream);

// Scores (into `scores`, which must hold batch * max_keys floats at stride max_keys)
// then top-k: out_idx [batch, out_stride] holds the logical key indices (or, with
// translate_pages, the pool rows through the page table, fused into the top-k store).
struct IndexerTopk {
  int k = 512;
  int32_t* out_idx = nullptr;
  int64_t out_stride = 0;
  int32_t* out_count = nullptr;
  bool translate_pages = false;
  long long* profile = nullptr;  // debugging aid (the fused kernel): %globaltimer ns of row 0's phases, CTA 0's
                                 // entry, scoring end, arrival, threshold, emission, second arrival, list loaded,
                                 // end [0..7]; the latest end of any CTA [9]; the bucket's count and the count above
                                 // it [10, 11]; CTA 0's radix rounds when the bucket outgrows the list [12..14];
                                 // the latest scoring end of any CTA [15] (16 words; [9] and [15] start at 0)
};
// The workspace (zeroed once by topk_workspace_init; calls of any shape within these bounds
// share it, one call at a time): the fused kernel's rows at fixed places, then the top-k's.
size_t indexer_topk_workspace_bytes(int batch, int64_t max_keys, int k);
// Whether indexer_topk runs this call as one kernel (else scores, then the top-k).
bool indexer_topk_is_fused(const IndexerArgs& a, const IndexerTopk& t);
void indexer_topk(const IndexerArgs& a, const IndexerTopk& t, void* workspace, cudaStream_t stream);

// The backend op's scoring: fp32 keys given as ragged row pointers (any head count and dim; rows
// 16-byte aligned, as the pools' rows are: both forms read them in 16-byte pieces).
// scores[t, s] for s < n_t at stride score_stride. Two forms: `fp32`, CUDA-core products in
// fp32 (any dim); `split`, 128-channel keys on the tensor cores with query and keys split into
// two bf16 each (x = hi + lo; q . k = qh . kh + qh . kl + ql . kh, fp32 sums: within ~2^-16 of
// each product). `automatic`: split wherever dim is 128, unless TROUPE_INDEXER_SPLIT=0.
// `lengths` (optional, [n_queries]): each query's key count as int32, written by the scoring launch
// (offsets[t + 1] - offsets[t]; no launch of its own: run 50 had one at ~2.4 us a call under ncu).
enum class RaggedForm : uint8_t { automatic, fp32, split };
void indexer_scores_ragged(const float* q, const float* w, int64_t n_queries, int heads, int64_t dim, float scale,
                           float weight_scale, RaggedRows keys, float* scores, int64_t score_stride,
                           int64_t max_keys, cudaStream_t stream, RaggedForm form = RaggedForm::automatic,
                           int32_t* lengths = nullptr);

// rows x 128 fp32 -> e4m3 with one scale per row (amax / 448).
void quantize_keys_e4m3(const float* x, int64_t rows, uint8_t* q, float* scales, cudaStream_t stream);
// rows x n fp32 -> bf16
void convert_to_bf16(const float* x, int64_t n, void* out, cudaStream_t stream);

}  // namespace troupe::kernels::cuda
