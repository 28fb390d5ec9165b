// Decode-step helpers on the device (see decode.hpp).
#include <algorithm>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/decode.hpp"

namespace troupe::kernels::cuda {
namespace {

constexpr int kRowsThreads = 256;
constexpr int kRowsBatch = 4;  // entry pointers a thread loads before it stores them
constexpr int64_t kRowsPerBlock = kRowsThreads * kRowsBatch;  // a chunk of decode_rows' entry pointers

struct RowsArgs {
  const int64_t* positions;
  const int32_t* table_of;
  const float* const* window;
  int64_t window_stride, window_slots, window_len;
  const float* const* entries;
  int64_t entry_stride, rate;
  const int32_t* picked;
  const int32_t* picked_count;
  int k;
  const float** out_rows;
  int64_t* out_offsets;
  const float* store;  // with store_dim: row b goes into query b's own window row
  int64_t store_dim;
};

__device__ __forceinline__ int64_t wlen_of(const RowsArgs& a, int64_t p) {
  return a.window != nullptr && a.window_len > 0 ? p - max(int64_t{0}, p - a.window_len + 1) + 1 : 0;
}
__device__ __forceinline__ int64_t entry_len(const RowsArgs& a, int64_t b, int64_t p) {
  if (a.entries == nullptr) return 0;
  return a.picked != nullptr ? static_cast<int64_t>(a.picked_count[b]) : (p + 1) / a.rate;
}

// grid (batch, Y): block (b, y) writes entry rows [c * kRowsPerBlock, +kRowsPerBlock) of query b for
// chunks c = y, y + Y, ...; blocks with y == 0 also write the window rows and the offset. A thread's
// pointers of a chunk are loaded before any is stored (a plain loop waited a round trip for each:
// the stores might alias the table as far as the compiler knows).
__global__ void decode_rows_kernel(const RowsArgs a, int64_t batch) {
  pdl_entry();  // see launch_kernel
  __shared__ long long partial[32];
  const int64_t b = blockIdx.x;
  // Offset of query b: the lengths of the queries before it.
  long long mine = 0;
  for (int64_t q = threadIdx.x; q < b; q += blockDim.x) {
    const int64_t p = a.positions[q];
    mine += wlen_of(a, p) + entry_len(a, q, p);
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) mine += __shfl_xor_sync(0xffffffffu, mine, o);
  if ((threadIdx.x & 31) == 0) partial[threadIdx.x >> 5] = mine;
  __syncthreads();
  long long off = 0;
  for (int w = 0; w < static_cast<int>((blockDim.x + 31) >> 5); ++w) off += partial[w];
  const int64_t p = a.positions[b];
  const int64_t t = a.table_of != nullptr ? a.table_of[b] : b;
  const int64_t wl = wlen_of(a, p), el = entry_len(a, b, p);
  const float** out = a.out_rows + off;
  if (blockIdx.y == 0) {
    if (a.store != nullptr) {
      float* own = const_cast<float*>(a.window[t * a.window_stride + p % a.window_slots]);
      const float* src = a.store + b * a.store_dim;
      for (int64_t i = threadIdx.x; i < a.store_dim; i += blockDim.x) own[i] = src[i];
    }
    if (threadIdx.x == 0) {
      a.out_offsets[b + 1] = off + wl + el;
      if (b == 0) a.out_offsets[0] = 0;
    }
    const int64_t j0 = p - wl + 1;
    for (int64_t i = threadIdx.x; i < wl; i += blockDim.x) {
      out[i] = a.window[t * a.window_stride + (j0 + i) % a.window_slots];
    }
  }
  const float* const* tab = a.entries + t * a.entry_stride;
  for (int64_t e0 = static_cast<int64_t>(blockIdx.y) * kRowsPerBlock; e0 < el;
       e0 += static_cast<int64_t>(gridDim.y) * kRowsPerBlock) {
    const float* v[kRowsBatch];
#pragma unroll
    for (int j = 0; j < kRowsBatch; ++j) {
      const int64_t i = e0 + j * kRowsThreads + threadIdx.x;
      const int64_t src = i >= el ? 0 : a.picked != nullptr ? static_cast<int64_t>(a.picked[b * a.k + i]) : i;
      v[j] = i < el ? tab[src] : nullptr;
    }
#pragma unroll
    for (int j = 0; j < kRowsBatch; ++j) {
      const int64_t i = e0 + j * kRowsThreads + threadIdx.x;
      if (i < el) out[wl + i] = v[j];
    }
  }
}

__global__ void decode_compress_kernel(const int64_t* positions, const int32_t* table_of, int64_t rate, bool overlap,
                                       int64_t dim, const float* kv, float* score, const float* bias, float* const* ring,
                                       int64_t ring_stride, float* const* entries, int64_t entry_stride,
                                       const float** kv_src, const float** score_src, float** out, int64_t* entry_pos,
                                       float** ring_dst, const float** ring_src) {
  pdl_entry();  // see launch_kernel
  const int64_t b = blockIdx.x;
  const int64_t width = overlap ? 2 * dim : dim;
  const int64_t ring_slots = overlap ? 2 * rate : rate;
  const int64_t p = positions[b];
  const int64_t t = table_of != nullptr ? table_of[b] : b;
  const int64_t i = p / rate;
  const bool closing = (p + 1) % rate == 0;
  float* const* rt = ring + t * ring_stride;
  if (bias != nullptr) {  // the position bias, as add_position_bias (the compress kernel runs after)
    const float* br = bias + (p % rate) * width;
    for (int64_t c = threadIdx.x; c < width; c += blockDim.x) score[b * width + c] += br[c];
  }
  for (int64_t s = threadIdx.x; s < ring_slots; s += blockDim.x) {
    const float* ks = nullptr;
    const float* ss = nullptr;
    if (closing) {
      int64_t j;
      int64_t half = 0;
      bool empty = false;
      if (overlap) {
        if (s < rate) {
          j = (i - 1) * rate + s;
          empty = i == 0;
        } else {
          j = i * rate + (s - rate);
          half = dim;
        }
      } else {
        j = i * rate + s;
      }
      if (!empty) {
        if (j == p) {
          ks = kv + b * width + half;
          ss = score + b * width + half;
        } else {
          const float* r = rt[j % ring_slots];
          ks = r + half;
          ss = r + width + half;
        }
      }
    }
    kv_src[b * ring_slots + s] = ks;
    score_src[b * ring_slots + s] = ss;
  }
  if (threadIdx.x == 0) {
    out[b] = closing ? entries[t * entry_stride + i] : nullptr;
    entry_pos[b] = i * rate;
    float* r = rt[p % ring_slots];
    ring_dst[2 * b] = r;
    ring_dst[2 * b + 1] = r + width;
    ring_src[2 * b] = kv + b * width;
    ring_src[2 * b + 1] = score + b * width;
  }
}

__global__ void scatter_kernel(void** table, const int64_t* index, void* const* values, int64_t count) {
  pdl_entry();  // see launch_kernel
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < count;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t at = index[i];
    if (at >= 0) table[at] = values[i];
  }
}

__device__ __forceinline__ void better(float& bv, int& bi, float v, int i) {
  if (v > bv || (v == bv && i < bi)) {
    bv = v;
    bi = i;
  }
}

__global__ void __launch_bounds__(1024) argmax_kernel(const float* x, int64_t n, int32_t* out) {
  pdl_entry();  // see launch_kernel
  __shared__ float sv[32];
  __shared__ int si[32];
  const float* xr = x + static_cast<int64_t>(blockIdx.x) * n;
  float bv = -INFINITY;
  int bi = 0x7fffffff;
  for (int64_t j = threadIdx.x; j < n; j += blockDim.x) {
    const float v = xr[j];
    if (!isnan(v)) better(bv, bi, v, static_cast<int>(j));
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
    const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
    better(bv, bi, ov, oi);
  }
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
  if (lane == 0) {
    sv[warp] = bv;
    si[warp] = bi;
  }
  __syncthreads();
  if (warp == 0) {
    bv = lane < nw ? sv[lane] : -INFINITY;
    bi = lane < nw ? si[lane] : 0x7fffffff;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
      const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
      better(bv, bi, ov, oi);
    }
    if (lane == 0) out[blockIdx.x] = bi == 0x7fffffff ? 0 : bi;
  }
}

// Long rows (the lm_head's logits): kArgmaxSplits blocks a row, each the best of
// its range, then one warp a row over those (the same winner: the largest value,
// the lowest index among equals, NaN skipped).
constexpr int kArgmaxSplits = 64;
__global__ void __launch_bounds__(256) argmax_split_kernel(const float* x, int64_t n, int64_t per, float* pv,
                                                           int32_t* pi) {
  pdl_entry();  // see launch_kernel
  __shared__ float sv[8];
  __shared__ int si[8];
  const float* xr = x + static_cast<int64_t>(blockIdx.y) * n;
  const int64_t lo = static_cast<int64_t>(blockIdx.x) * per, hi = lo + per < n ? lo + per : n;
  float bv = -INFINITY;
  int bi = 0x7fffffff;
  for (int64_t j = lo + threadIdx.x; j < hi; j += blockDim.x) {
    const float v = xr[j];
    if (!isnan(v)) better(bv, bi, v, static_cast<int>(j));
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
    const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
    better(bv, bi, ov, oi);
  }
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) {
    sv[warp] = bv;
    si[warp] = bi;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < static_cast<int>(blockDim.x >> 5); ++w) better(bv, bi, sv[w], si[w]);
    pv[blockIdx.y * gridDim.x + blockIdx.x] = bv;
    pi[blockIdx.y * gridDim.x + blockIdx.x] = bi;
  }
}

__global__ void argmax_merge_kernel(const float* pv, const int32_t* pi, int splits, int32_t* out) {
  pdl_entry();  // see launch_kernel
  float bv = -INFINITY;
  int bi = 0x7fffffff;
  for (int k = threadIdx.x; k < splits; k += 32) better(bv, bi, pv[blockIdx.x * splits + k], pi[blockIdx.x * splits + k]);
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
    const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
    better(bv, bi, ov, oi);
  }
  if (threadIdx.x == 0) out[blockIdx.x] = bi == 0x7fffffff ? 0 : bi;
}

// keys[t, j, :] = rows[offsets[t] + j] for j below the query's length, zeros
// up to max_keys (so that padded scores are finite and padded products zero).
__global__ void gather_key_rows_kernel(const float* const* rows, const int64_t* offsets, int64_t max_keys,
                                       int64_t dim, float* keys) {
  pdl_entry();  // see launch_kernel
  const int64_t t = blockIdx.y;
  const int64_t beg = offsets[t], n = offsets[t + 1] - beg;
  for (int64_t j = blockIdx.x; j < max_keys; j += gridDim.x) {
    float* dst = keys + (t * max_keys + j) * dim;
    const float* src = j < n ? rows[beg + j] : nullptr;
    for (int64_t c = threadIdx.x; c < dim; c += blockDim.x) dst[c] = src != nullptr ? src[c] : 0.f;
  }
}

// In place over scores[t, h, :] (already scaled): the probabilities of the
// query's keys with the head's sink in the denominator; zeros past its length.
__global__ void attention_softmax_kernel(float* scores, int heads, int64_t max_keys, const int64_t* offsets,
                                         const float* sinks) {
  pdl_entry();  // see launch_kernel
  __shared__ float scratch[32];
  const int64_t t = blockIdx.x;
  const int h = blockIdx.y;
  const int64_t n = offsets[t + 1] - offsets[t];
  float* p = scores + (t * heads + h) * max_keys;
  float mx = sinks != nullptr ? sinks[h] : -INFINITY;
  for (int64_t j = threadIdx.x; j < n; j += blockDim.x) mx = fmaxf(mx, p[j]);
  mx = block_max(mx, scratch);
  float sum = 0.f;
  for (int64_t j = threadIdx.x; j < n; j += blockDim.x) {
    p[j] = expf(p[j] - mx);
    sum += p[j];
  }
  sum = block_sum(sum, scratch);
  if (sinks != nullptr) sum += expf(sinks[h] - mx);
  const float inv = sum > 0.f ? 1.f / sum : 0.f;
  for (int64_t j = threadIdx.x; j < max_keys; j += blockDim.x) p[j] = j < n ? p[j] * inv : 0.f;
}

// ---- fp32 attention of decode size in two launches (the default; TROUPE_ATTENTION_ROWS=0: SGEMMs) -----
// attention_f32's math (scale * q.k over each query's listed rows, softmax with the head's sink in the
// denominator, the probabilities times the same rows: K = V) without the gathered key copy, the score
// matrix in global memory and two SGEMMs: a split kernel, CTA (split s, group g of kArHeads heads,
// query t), takes the query's keys [s * kArKeys, +kArKeys) into shared memory once, scores them for its
// heads (one warp a key, lanes over the dims), keeps each head's local max m and sum l of exp(score - m)
// and the unnormalised sum of p * key; the combine kernel, a block a (head, query), weighs the splits by
// exp(m_s - M) (M: the largest m and the sink) and divides by the total. fp32 throughout; the sums run in
// another order than the SGEMMs' (within fp32 rounding of the CPU). Rows must be 16-byte aligned (dim a
// multiple of 4 over pool pages).
// 4 heads x 16 keys a CTA of 4 warps (run 49, H100: 8 heads x 32 keys in 8 warps ran ~3,600 dependent
// instructions a warp in 40-160 CTAs, 15.7 us a call; a quarter of the work a CTA, four times the CTAs and
// up to 5 CTAs an SM instead of 2).
constexpr int kArHeads = 4, kArKeys = 16, kArThreads = 128, kArMaxDim = 512;

__global__ void __launch_bounds__(kArThreads) attention_rows_split_kernel(const float* q, const float* const* rows,
                                                                        const int64_t* offsets, int heads, int dim,
                                                                        float scale, float* part_o, float* part_ml) {
  pdl_entry();  // see launch_kernel
  extern __shared__ float4 ar_smem[];
  float* ks = reinterpret_cast<float*>(ar_smem);  // [kArKeys][dim]
  float* qs = ks + kArKeys * dim;                 // [kArHeads][dim]
  float* ps = qs + kArHeads * dim;                // [kArHeads][kArKeys]
  const int s = static_cast<int>(blockIdx.x), S = static_cast<int>(gridDim.x);
  const int h0 = static_cast<int>(blockIdx.y) * kArHeads, hn = min(kArHeads, heads - h0);
  const int64_t t = blockIdx.z;
  const int64_t beg = offsets[t], n = offsets[t + 1] - beg, j0 = static_cast<int64_t>(s) * kArKeys;
  const int kn = static_cast<int>(n - j0 < 0 ? 0 : n - j0 < kArKeys ? n - j0 : kArKeys);
  const int d4 = dim / 4, tid = static_cast<int>(threadIdx.x), lane = tid & 31, warp = tid >> 5;
  if (kn == 0) {  // past the query's keys: no partial sums (the combine skips a split whose max is -inf)
    if (tid < hn) {
      float* ml = part_ml + ((t * heads + h0 + tid) * S + s) * 2;
      ml[0] = -INFINITY;
      ml[1] = 0.f;
    }
    return;
  }
  // Every copy in flight before any is waited for (cp.async; the row pointers first, through shared
  // memory, so no copy waits on a pointer load of its own): the first form, a plain load and store a
  // float4, ran one dependent pointer + row round trip after another (21 us a call on the H100, run 49).
  __shared__ const float* kp[kArKeys];
  if (tid < kArKeys) kp[tid] = tid < kn ? rows[beg + j0 + tid] : q;
  for (int i = tid; i < kArHeads * d4; i += kArThreads) {
    const int h = i / d4;
    cp_async16(qs + 4 * i, h < hn ? q + (t * heads + h0 + h) * dim + 4 * (i % d4) : q, h < hn);
  }
  __syncthreads();
  for (int i = tid; i < kArKeys * d4; i += kArThreads) {
    const int jj = i / d4;
    cp_async16(ks + 4 * i, kp[jj] + (jj < kn ? 4 * (i % d4) : 0), jj < kn);
  }
  cp_async_commit();
  cp_async_wait<0>();
  __syncthreads();
  for (int jj = warp; jj < kArKeys; jj += kArThreads / 32) {  // scores: a warp a key
    float acc[kArHeads];
#pragma unroll
    for (int h = 0; h < kArHeads; ++h) acc[h] = 0.f;
    if (jj < kn) {
      for (int c = lane; c < d4; c += 32) {
        const float4 k4 = reinterpret_cast<const float4*>(ks + jj * dim)[c];
#pragma unroll
        for (int h = 0; h < kArHeads; ++h) {
          const float4 q4 = reinterpret_cast<const float4*>(qs + h * dim)[c];
          acc[h] += k4.x * q4.x + k4.y * q4.y + k4.z * q4.z + k4.w * q4.w;
        }
      }
    }
#pragma unroll
    for (int h = 0; h < kArHeads; ++h) {
      const float v = warp_sum(acc[h]);
      if (lane == 0) ps[h * kArKeys + jj] = jj < kn ? v * scale : -INFINITY;
    }
  }
  __syncthreads();
  static_assert(kArKeys <= 32 && kArThreads / 32 == kArHeads, "a warp a head, a lane a key");
  {  // each head's local softmax over the split's keys: warp h, lane jj
    const float v = lane < kArKeys ? ps[warp * kArKeys + lane] : -INFINITY;
    float m = v;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
    const float p = lane < kn ? expf(v - m) : 0.f;
    const float l = warp_sum(p);
    if (lane < kArKeys) ps[warp * kArKeys + lane] = p;
    if (lane == 0 && warp < hn) {
      float* ml = part_ml + ((t * heads + h0 + warp) * S + s) * 2;
      ml[0] = m;  // kn > 0 here
      ml[1] = l;
    }
  }
  __syncthreads();
  constexpr int kPer = kArMaxDim / kArThreads;  // dims a thread sums
  float o[kArHeads][kPer];
#pragma unroll
  for (int h = 0; h < kArHeads; ++h)
#pragma unroll
    for (int c = 0; c < kPer; ++c) o[h][c] = 0.f;
  for (int jj = 0; jj < kn; ++jj) {
    float kv[kPer];
#pragma unroll
    for (int c = 0; c < kPer; ++c) kv[c] = tid + kArThreads * c < dim ? ks[jj * dim + tid + kArThreads * c] : 0.f;
#pragma unroll
    for (int h = 0; h < kArHeads; ++h) {
      const float p = ps[h * kArKeys + jj];
#pragma unroll
      for (int c = 0; c < kPer; ++c) o[h][c] += p * kv[c];
    }
  }
#pragma unroll
  for (int h = 0; h < kArHeads; ++h) {
    if (h >= hn) break;
    float* dst = part_o + ((t * heads + h0 + h) * S + s) * dim;
#pragma unroll
    for (int c = 0; c < kPer; ++c) {
      const int d = tid + kArThreads * c;
      if (d < dim) dst[d] = o[h][c];
    }
  }
}

// Block (head h, query t): out[t, h, :] from the query's splits of attention_rows_split_kernel (those
// holding keys: ceil(n / kArKeys) of the S). Warp 0 weighs them (w_s = exp(m_s - M) / L, L = sum w_s l_s +
// exp(sink - M)) while every thread's first kArBatch splits of its float4 of the head's dims are in flight
// (requested before the weights: run 50's form waited for the weights, then read the splits four at a
// time, 6.8 us a call under ncu); the sum runs in split order. With `positions`, the inverse rope of the
// query's position on the rope slice (the trailing rope.rope_dim dims), as rope_kernel computes it.
constexpr int kArBatch = 16;
static_assert(kArMaxDim / 4 <= kArThreads, "a thread a float4 of the head");

__global__ void __launch_bounds__(kArThreads) attention_rows_combine_kernel(const float* part_o, const float* part_ml,
                                                                          const float* sinks, const int64_t* offsets,
                                                                          int heads, int dim, int S, RopeTable rope,
                                                                          const int64_t* positions, float* out) {
  pdl_entry();  // see launch_kernel
  extern __shared__ float ar_w[];  // [S]
  const int h = static_cast<int>(blockIdx.x);
  const int64_t t = blockIdx.y;
  const int64_t n = offsets[t + 1] - offsets[t];
  const int64_t splits = (n + kArKeys - 1) / kArKeys;
  const int active = static_cast<int>(splits < S ? splits : S);
  const float* ml = part_ml + (t * heads + h) * S * 2;
  const float4* po = reinterpret_cast<const float4*>(part_o + (t * heads + h) * S * dim);
  const int d4 = dim / 4, c = static_cast<int>(threadIdx.x);  // this thread's float4 (dim <= 4 * kArThreads)
  float4 v[kArBatch];
#pragma unroll
  for (int u = 0; u < kArBatch; ++u) v[u] = c < d4 && u < active ? po[u * d4 + c] : make_float4(0.f, 0.f, 0.f, 0.f);
  if (threadIdx.x < 32) {
    const int lane = static_cast<int>(threadIdx.x);
    float M = sinks != nullptr ? sinks[h] : -INFINITY;
    for (int s = lane; s < active; s += 32) M = fmaxf(M, ml[2 * s]);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) M = fmaxf(M, __shfl_xor_sync(0xffffffffu, M, o));
    float L = 0.f;
    for (int s = lane; s < active; s += 32) {
      const float m = ml[2 * s];
      const float w = m == -INFINITY ? 0.f : expf(m - M);
      ar_w[s] = w;
      L += w * ml[2 * s + 1];
    }
    L = warp_sum(L);
    if (sinks != nullptr && M != -INFINITY) L += expf(sinks[h] - M);
    const float inv = L > 0.f ? 1.f / L : 0.f;
    __syncwarp();
    for (int s = lane; s < active; s += 32) ar_w[s] *= inv;
  }
  __syncthreads();
  if (c >= d4) return;
  float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
  for (int s0 = 0; s0 < active; s0 += kArBatch) {
    if (s0 > 0) {
#pragma unroll
      for (int u = 0; u < kArBatch; ++u) {
        v[u] = s0 + u < active ? po[(s0 + u) * d4 + c] : make_float4(0.f, 0.f, 0.f, 0.f);
      }
    }
#pragma unroll
    for (int u = 0; u < kArBatch; ++u) {
      const float w = s0 + u < active ? ar_w[s0 + u] : 0.f;
      if (w == 0.f) continue;  // (a split of no weight adds nothing: its signed zeros stay out of the sum)
      acc.x += w * v[u].x;
      acc.y += w * v[u].y;
      acc.z += w * v[u].z;
      acc.w += w * v[u].w;
    }
  }
  if (positions != nullptr) {
    const int first = dim - static_cast<int>(rope.rope_dim);  // even: dim % 4 == 0, rope_dim even
    const float pos = static_cast<float>(positions[t]);
    const int d = 4 * c;  // pairs (d, d + 1) and (d + 2, d + 3)
    if (d >= first) rope_pair<true>(acc.x, acc.y, rope.inv_freq[(d - first) / 2] * pos, rope.scale, true);
    if (d + 2 >= first) rope_pair<true>(acc.z, acc.w, rope.inv_freq[(d + 2 - first) / 2] * pos, rope.scale, true);
  }
  reinterpret_cast<float4*>(out + (t * heads + h) * dim)[c] = acc;
}

}  // namespace

size_t attention_rows_workspace_bytes(int64_t n_queries, int heads, int64_t dim, int64_t max_keys) {
  const int64_t S = ceil_div(std::max<int64_t>(max_keys, 1), kArKeys);
  return static_cast<size_t>(n_queries * heads * S * (dim + 2)) * sizeof(float);
}

bool attention_rows_takes(int64_t n_queries, int64_t dim, int64_t max_keys) {
  return n_queries <= 65535 && dim % 4 == 0 && dim <= kArMaxDim && dim > 0 && max_keys <= (int64_t{1} << 20);
}

void attention_rows(const float* q, int64_t n_queries, int heads, int64_t dim, const float* const* rows,
                    const int64_t* offsets, int64_t max_keys, const float* sinks, float scale, void* workspace,
                    float* out, cudaStream_t s, const RopeTable* rope, const int64_t* positions) {
  if (n_queries == 0) return;
  TROUPE_REQUIRE(attention_rows_takes(n_queries, dim, max_keys), "attention_rows: shape not taken");
  const int S = static_cast<int>(ceil_div(std::max<int64_t>(max_keys, 1), kArKeys));
  auto* part_o = static_cast<float*>(workspace);
  float* part_ml = part_o + n_queries * heads * S * dim;
  const size_t smem = static_cast<size_t>(kArKeys * dim + kArHeads * dim + kArHeads * kArKeys) * sizeof(float);
  static const bool attr = [] {
    TROUPE_CUDA(cudaFuncSetAttribute(attention_rows_split_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                     static_cast<int>((kArKeys + kArHeads) * kArMaxDim * 4 + kArHeads * kArKeys * 4)));
    return true;
  }();
  (void)attr;
  const dim3 grid(static_cast<unsigned>(S), static_cast<unsigned>(ceil_div(heads, kArHeads)),
                  static_cast<unsigned>(n_queries));
  launch_kernel(attention_rows_split_kernel, grid, kArThreads, smem, s, q, rows, offsets, heads, static_cast<int>(dim),
                scale, part_o, part_ml);
  TROUPE_LAUNCHED();
  TROUPE_REQUIRE(positions == nullptr || (rope != nullptr && rope->rope_dim % 2 == 0 && rope->rope_dim <= dim),
                 "attention_rows: a rope slice must be an even count of the head's dims");
  launch_kernel(attention_rows_combine_kernel, dim3(static_cast<unsigned>(heads), static_cast<unsigned>(n_queries)),
                kArThreads, static_cast<size_t>(S) * sizeof(float), s, part_o, part_ml, sinks, offsets, heads,
                static_cast<int>(dim), S, positions != nullptr ? *rope : RopeTable{}, positions, out);
  TROUPE_LAUNCHED();
}

void gather_key_rows(const float* const* rows, const int64_t* offsets, int64_t n_queries, int64_t max_keys,
                     int64_t dim, float* keys, cudaStream_t s) {
  if (n_queries == 0 || max_keys == 0) return;
  TROUPE_REQUIRE(n_queries <= 65535, "gather_key_rows: too many queries");
  const dim3 grid(static_cast<unsigned>(std::min<int64_t>(max_keys, 1024)), static_cast<unsigned>(n_queries));
  launch_kernel(gather_key_rows_kernel, grid, static_cast<unsigned>(std::min<int64_t>((dim + 31) / 32 * 32, 512)), 0, s,
                rows, offsets, max_keys, dim, keys);
  TROUPE_LAUNCHED();
}

void attention_softmax(float* scores, int64_t n_queries, int heads, int64_t max_keys, const int64_t* offsets,
                       const float* sinks, cudaStream_t s) {
  if (n_queries == 0) return;
  TROUPE_REQUIRE(n_queries <= 0x7fffffff && heads <= 65535, "attention_softmax: too large");
  const dim3 grid(static_cast<unsigned>(n_queries), static_cast<unsigned>(heads));
  launch_kernel(attention_softmax_kernel, grid, 256, 0, s, scores, heads, max_keys, offsets, sinks);
  TROUPE_LAUNCHED();
}

void decode_rows(int64_t batch, const int64_t* positions, const int32_t* table_of, const float* const* window,
                 int64_t window_stride, int64_t window_slots, int64_t window_len, const float* const* entries,
                 int64_t entry_stride, int64_t rate, const int32_t* picked, const int32_t* picked_count, int k,
                 const float** out_rows, int64_t* out_offsets, const float* store, int64_t store_dim,
                 cudaStream_t s) {
  if (batch == 0) return;
  TROUPE_REQUIRE(batch <= 65535, "decode_rows: too many queries");
  TROUPE_REQUIRE(store == nullptr || (window != nullptr && window_len >= 1), "decode_rows: a store needs the window");
  TROUPE_REQUIRE(entries == nullptr || rate > 0 || picked != nullptr, "decode_rows: rate must be positive");
  RowsArgs a{positions, table_of, window, window_stride, window_slots, window_len, entries, entry_stride,
             rate > 0 ? rate : 1, picked, picked_count, k, out_rows, out_offsets, store, store_dim};
  // Entry chunks from the table's capacity (picked lists hold at most k; the table's stride bounds the
  // others, and is the whole slot's table: every layer's), over at most ~two blocks an SM in all.
  const int64_t most = entries == nullptr ? 0 : picked != nullptr ? k : entry_stride;
  static const int sms = sm_count();
  const int64_t chunks = std::clamp<int64_t>(std::min(ceil_div(most, kRowsPerBlock), 2 * sms / batch), 1, 65535);
  launch_kernel(decode_rows_kernel, dim3(static_cast<unsigned>(batch), static_cast<unsigned>(chunks)), kRowsThreads, 0,
                s, a, batch);
  TROUPE_LAUNCHED();
}

void decode_compress_rows(int64_t batch, const int64_t* positions, const int32_t* table_of, int64_t rate, bool overlap,
                          int64_t dim, const float* kv, float* score, const float* bias, float* const* ring,
                          int64_t ring_stride,
                          float* const* entries, int64_t entry_stride, const float** kv_src, const float** score_src,
                          float** out, int64_t* entry_pos, float** ring_dst, const float** ring_src, cudaStream_t s) {
  if (batch == 0) return;
  TROUPE_REQUIRE(rate >= 1 && batch <= 0x7fffffff, "decode_compress_rows: bad arguments");
  const int64_t slots = overlap ? 2 * rate : rate;
  const int threads = static_cast<int>(std::clamp<int64_t>((slots + 31) / 32 * 32, 32, 256));
  launch_kernel(decode_compress_kernel, static_cast<unsigned>(batch), threads, 0, s, positions, table_of, rate, overlap,
                dim, kv, score, bias, ring, ring_stride, entries, entry_stride, kv_src, score_src, out, entry_pos,
                ring_dst, ring_src);
  TROUPE_LAUNCHED();
}

void scatter_pointers(void** table, const int64_t* index, void* const* values, int64_t count, cudaStream_t s) {
  if (count == 0) return;
  const unsigned blocks = static_cast<unsigned>(std::clamp<int64_t>(ceil_div(count, 256), 1, 1024));
  launch_kernel(scatter_kernel, blocks, 256, 0, s, table, index, values, count);
  TROUPE_LAUNCHED();
}

void argmax_rows(const float* x, int64_t rows, int64_t n, int32_t* out, cudaStream_t s) {
  if (rows == 0) return;
  TROUPE_REQUIRE(rows <= 0x7fffffff && n <= 0x7fffffff, "argmax: too large");
  launch_kernel(argmax_kernel, static_cast<unsigned>(rows), 1024, 0, s, x, n, out);
  TROUPE_LAUNCHED();
}

int64_t argmax_split_workspace(int64_t rows, int64_t n) {
  return n >= 16384 && rows <= 65535 ? rows * kArgmaxSplits : 0;
}

void argmax_rows_split(const float* x, int64_t rows, int64_t n, int32_t* out, float* ws_v, int32_t* ws_i,
                       cudaStream_t s) {
  if (rows == 0) return;
  TROUPE_REQUIRE(argmax_split_workspace(rows, n) > 0 && n <= 0x7fffffff, "argmax: split form needs long rows");
  const int64_t per = ceil_div(n, kArgmaxSplits);
  launch_kernel(argmax_split_kernel, dim3(kArgmaxSplits, static_cast<unsigned>(rows)), 256, 0, s, x, n, per, ws_v,
                ws_i);
  TROUPE_LAUNCHED();
  launch_kernel(argmax_merge_kernel, static_cast<unsigned>(rows), 32, 0, s, ws_v, ws_i, kArgmaxSplits, out);
  TROUPE_LAUNCHED();
}

}  // namespace troupe::kernels::cuda
