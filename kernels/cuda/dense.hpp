// Dense kernels of the CUDA backend with plain types, callable directly by the
// GPU engine: GEMV for few rows (fp32 activations, f32/bf16/f16 weights, exact
// fp32 accumulation, weights streamed once), norms, RoPE, row moves, mHC,
// routing and the MoE pieces. Large GEMMs go through cuBLAS (backend.cu).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/backend.hpp"

namespace troupe::kernels::cuda {

constexpr int kGemvMaxRows = 4;    // rows of x one GEMV pass serves in the tiled form
constexpr int kGemvBatchRows = 8;  // up to this many rows run as one pass (weights read once; more: cuBLAS)

// The scale grid of a quantized weight (kernels/backend.hpp: element (r, c) of the matrix takes
// scale[((r + scale_row) / block_rows) * stride + c / block_cols]).
struct QuantLayout {
  const float* scale = nullptr;
  int64_t stride = 0;
  int32_t block_rows = 1;
  int32_t block_cols = 1;
  int32_t scale_row = 0;
};
inline QuantLayout quant_layout(const Weight& w) {
  return {w.scale, w.scale_stride, w.block_rows, w.block_cols, w.scale_row};
}
// Whether gemv() takes a quantized weight as it is (at most kGemvBatchRows rows of x, rows of whole
// 16-byte chunks, each chunk inside one scale block, x and w 16-byte aligned); else the caller
// dequantizes it first (dequantize_bf16).
bool gemv_takes(const Weight& w, int64_t m, int64_t ldx, const float* x);
// out [w.rows, w.cols] bf16 = a quantized weight's values (code * scale, rounded to bf16: exact for
// power-of-two scales).
void dequantize_bf16(const Weight& w, void* out, cudaStream_t stream);

// y[m, n] (+)= x[m, k] @ w[n, k]^T for any m (x rows are served 4 at a time, each
// pass streams w once). `group_rows` > 0 makes it block-diagonal: output row j reads
// x columns [(j / group_rows) * k, +k) (x has ldx >= groups * k). beta 0: y is not read.
void gemv(const float* x, int64_t ldx, int64_t m, const Weight& w, float* y, int64_t ldy, float beta,
          int64_t group_rows, cudaStream_t stream);

// Several GEMVs over the same x [m <= 8, k] in one launch (weights of one type, k
// columns each, 16-byte aligned, k a multiple of 8): the same per-row math as gemv().
// Returns false (nothing launched) when the shapes do not qualify.
constexpr int kMultiMax = 12;
bool gemv_multi(const float* x, int64_t m, const Weight* w, float* const* y, int count, cudaStream_t stream);

void rmsnorm(const float* x, const float* weight, float* y, int64_t rows, int64_t dim, float eps, cudaStream_t s);
void rope(float* x, int64_t rows, int heads, int64_t head_dim, const RopeTable& rope, const int64_t* positions,
          bool inverse, cudaStream_t s);
// rmsnorm over each head row of x [rows, heads, head_dim], then rope (not inverse): one launch.
void rmsnorm_rope(const float* x, const float* weight, float* y, int64_t rows, int heads, int64_t head_dim, float eps,
                  const RopeTable& rope, const int64_t* positions, cudaStream_t s);
void add_position_bias(float* x, int64_t rows, int64_t dim, const int64_t* positions, const float* bias,
                       int64_t period, cudaStream_t s);
void copy_rows(float* const* dst, const float* const* src, int64_t count, int64_t n, cudaStream_t s);
void embed(const Weight& table, const int32_t* ids, int64_t rows, int copies, float* out, cudaStream_t s);
void gather_rows(const float* x, int64_t dim, const int64_t* index, int64_t count, float* out, cudaStream_t s);
void swiglu(const float* g, const float* u, float* y, int64_t n, float limit, cudaStream_t s);
void add(float* y, const float* x, int64_t n, cudaStream_t s);
// The two products of up to kMaxSplitSums split GEMMs (x as half(x) and half(x - half(x)), each computed as
// one GEMM over the two terms' stacked rows) added in one launch: y[j] = parts[j][0 .. n_j) + parts[j][n_j ..
// 2 n_j) (+ beta y[j]; y is not read when beta is 0), n_j = start[j + 1] - start[j], start[0] = 0.
constexpr int kMaxSplitSums = 8;
struct SplitSums {
  const float* parts[kMaxSplitSums];
  float* y[kMaxSplitSums];
  int64_t start[kMaxSplitSums + 1];
  int count;
  float beta;
};
void add_split_products(const SplitSums& sums, cudaStream_t s);
// bf16 or f16 copy of x; with `lo`, also the rounding residual half(x - out), so that
// W.out + W.lo carries ~16 mantissa bits of x into a half-precision product.
void to_half(const float* x, int64_t n, void* out, WeightType type, cudaStream_t s, void* lo = nullptr);

// mHC: `mix` = X @ fn^T computed beforehand (raw X, not normalised).
void mhc_pre_finish(const float* X, const float* mix, int64_t rows, const float* base, const float* scale,
                    const MhcParams& p, float* y, float* post, float* comb, cudaStream_t s);
void mhc_post(float* X, int64_t rows, const float* f, const float* post, const float* comb, const MhcParams& p,
              cudaStream_t s);
void mhc_head_finish(const float* X, const float* mix, int64_t rows, const float* base, const float* scale,
                     const MhcParams& p, float* y, cudaStream_t s);

// mHC pre (head = false) or head (head = true, pre only) in two launches: the mix
// GEMV split over slices of the X row with its sum of squares, then one block per
// row for the mix, the Sinkhorn and y (with `norm`, then y's RMSNorm times
// norm_weight, bit for bit rmsnorm()'s). `workspace` holds mhc_fused_workspace()
// floats; 0 there (or false here) means the shapes do not qualify: use the
// unfused form.
int64_t mhc_fused_workspace(int64_t rows, const Weight& fn, const MhcParams& p);
bool mhc_fused(const float* X, int64_t rows, const Weight& fn, const float* base, const float* scale,
               const MhcParams& p, bool head, bool norm, const float* norm_weight, float norm_eps, float* y,
               float* post, float* comb, float* workspace, cudaStream_t s);

void route(const float* logits, int64_t rows, int experts, ScoreFn fn, const float* bias, int k,
           const int64_t* hash_table, const int32_t* ids, float route_scale, int32_t* out_idx, float* out_weight,
           cudaStream_t s);

// MoE without a host round trip (few pairs): every (row, slot) pair runs its expert
// as GEMVs through device tables of expert weight pointers.
struct ExpertTables {
  const void* const* gate = nullptr;  // [experts] device pointers
  const void* const* up = nullptr;
  const void* const* down = nullptr;
  WeightType type = WeightType::bf16;
  int64_t inter = 0;  // rows of gate/up
  // Quantized types: each expert's scale grids ([3 * experts] device pointers: gate, up, down) and
  // their layouts (the same for every expert; their `scale` fields unused).
  const float* const* scales = nullptr;
  int experts = 0;
  QuantLayout gate_q, up_q, down_q;
};
// Whether moe_pairs / moe_grouped take these experts (widths whole chunks of the weight type, and
// for quantized types each chunk inside one scale block).
bool moe_widths_fit(const ExpertTables& t, int64_t dim);
// h: [rows*k, inter] scratch, ys: [rows*k, dim] scratch.
void moe_pairs(const float* x, int64_t rows, int64_t dim, const int32_t* idx, const float* weight, int k,
               const ExpertTables& t, float limit, float* h, float* ys, float* out, cudaStream_t s);
// MoE without a host round trip for a few rows (<= 64): the pairs sorted by expert on
// the device, then every expert's rows (up to 8 at a time) through its weights once.
// Scratch: counts [experts], offsets [experts + 1], perm/inv [rows*k], xs/ys [rows*k, dim],
// h [rows*k, inter].
void moe_grouped(const float* x, int64_t rows, int64_t dim, const int32_t* idx, const float* weight, int k,
                 int experts, const ExpertTables& t, float limit, int32_t* counts, int32_t* offsets, int32_t* perm,
                 int32_t* inv, float* xs, float* h, float* ys, float* out, cudaStream_t s);
// Sorted path pieces: counts/offsets/permutation of the pairs by expert
// (counts[e], offsets[e] (experts + 1), perm[pos] = pair, inv[pair] = pos; counts and inv may be null:
// not written). With rank and touched
// (the batched MoE): rank[e] = the touched expert's place among the touched ones in expert order (-1:
// untouched), touched[i] = the i-th touched expert, -1 past the last up to `entries`.
void moe_sort(const int32_t* idx, int64_t pairs, int experts, int32_t* counts, int32_t* offsets, int32_t* perm,
              int32_t* inv, cudaStream_t s, int32_t* rank = nullptr, int32_t* touched = nullptr, int entries = 0);
void moe_gather(const float* x, int64_t dim, const int32_t* perm, int64_t pairs, int k, float* xs, cudaStream_t s);
// The batched MoE's pieces (CudaBackend::moe: the touched experts' rows as batched GEMMs on the tensor
// cores). The GEMMs' batch is `entries` = min(experts, pairs), known without a host round trip; entry
// i serves touched[i], and entries past the touched experts are spares (they read entry 0's rows and
// the first touched expert's weights, so mostly from L2, and write spare blocks nobody reads). Each
// entry's rows sit in a block of `cap` rows (cap >= its count; rows past the count are never written
// nor read back):
// moe_pad_gather: the sorted pairs' rows of x into xh (and their split's second term into xl, when
// given) as half (bf16 or f16, `type`): pair p's row at slot[p] = rank[idx[p]] * cap + its place in the
// expert's rows.
void moe_pad_gather(const float* x, int64_t dim, const int32_t* idx, const int32_t* perm, const int32_t* offsets,
                    const int32_t* rank, int64_t pairs, int k, int64_t cap, WeightType type, void* xh, void* xl,
                    int32_t* slot, cudaStream_t s);
// moe_pad_swiglu: h = swiglu(gate, up) at the pairs' rows (gu: gate blocks of the entries, then their up
// blocks), as half into hh (and the split's second term into hl, when given). lo_rows > 0: each gate and up
// value is the sum of the product at its row and the one lo_rows rows further (a split GEMM over stacked
// terms: see CudaBackend's moe_batched).
void moe_pad_swiglu(const float* gu, int entries, int64_t cap, int64_t inter, const int32_t* slot, int64_t pairs,
                    int64_t lo_rows, float limit, WeightType type, void* hh, void* hl, cudaStream_t s);
// The batched GEMMs' pointer arrays, 9 * entries (n) of them: [0, 2n) gate/up inputs (xh blocks, twice),
// [2n, 4n) gate/up outputs (gu blocks; spares: block 2n), [4n, 5n) down inputs (hh blocks), [5n, 6n) down
// outputs (ys blocks; spares: block n), [6n, 8n) the touched experts' gate then up weights, [8n, 9n) their down
// weights. gu holds 2n + 1 blocks of cap x inter floats, ys n + 1 of cap x dim. (A split's second terms sit in
// the same blocks: see CudaBackend's moe_batched.)
void moe_batch_pointers(int entries, const int32_t* touched, const ExpertTables& t, int64_t cap, int64_t dim,
                        int64_t inter, void* xh, float* gu, void* hh, float* ys, void** ptrs, cudaStream_t s);
// out[r] += sum_j weight[r*k+j] * ys[inv[r*k+j]] (lo_rows > 0: ys[p] + ys[p + lo_rows] for each ys[p])
void moe_combine(const float* ys, const int32_t* inv, const float* weight, int64_t rows, int k, int64_t dim, float* out,
                 cudaStream_t s, int64_t lo_rows = 0);

}  // namespace troupe::kernels::cuda
