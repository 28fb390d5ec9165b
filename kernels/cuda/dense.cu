// Dense kernels of the CUDA backend (see dense.hpp).
#include <algorithm>
#include <type_traits>

#include <cuda_fp8.h>

#include "kernels/cuda/codes.hpp"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/dense.hpp"

namespace troupe::kernels::cuda {
namespace {

constexpr int kGemvThreads = 256;

// FP8 e4m3 / FP4 e2m1 codes (kernels/backend.hpp) as gemv_core's weight types: a byte holds one / two.
struct E4m3Codes {
  uint8_t v;
};
struct E2m1Codes {
  uint8_t v;
};

// 16 bytes of weights -> VEC floats. kPer: values a stored element holds; kQuant: the values still
// take their block's scale (QuantLayout).
template <class WT>
struct WLoad;
template <>
struct WLoad<float> {
  static constexpr int kVec = 4, kPer = 1;
  static constexpr bool kQuant = false;
  __device__ static void cvt(const uint4& v, float (&f)[4]) {
    f[0] = __uint_as_float(v.x);
    f[1] = __uint_as_float(v.y);
    f[2] = __uint_as_float(v.z);
    f[3] = __uint_as_float(v.w);
  }
};
template <>
struct WLoad<__nv_bfloat16> {
  static constexpr int kVec = 8, kPer = 1;
  static constexpr bool kQuant = false;
  __device__ static void cvt(const uint4& v, float (&f)[8]) {
    const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float2 t = bf16x2_to_f32(w[i]);
      f[2 * i] = t.x;
      f[2 * i + 1] = t.y;
    }
  }
};
template <>
struct WLoad<__half> {
  static constexpr int kVec = 8, kPer = 1;
  static constexpr bool kQuant = false;
  __device__ static void cvt(const uint4& v, float (&f)[8]) {
    const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float2 t = f16x2_to_f32(w[i]);
      f[2 * i] = t.x;
      f[2 * i + 1] = t.y;
    }
  }
};

// Chunks of codes as floats, converted as kernels/cuda/codes.hpp says.

template <>
struct WLoad<E4m3Codes> {  // NaN codes (0x7f / 0xff) read as finite
  static constexpr int kVec = 16, kPer = 1;
  static constexpr bool kQuant = true;
  __device__ static void cvt(const uint4& v, float (&f)[16]) {
    const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
      for (int j = 0; j < 4; ++j) f[4 * i + j] = e4m3_at(w[i], j);
  }
};

template <>
struct WLoad<E2m1Codes> {  // element 2j in the low nibble
  static constexpr int kVec = 32, kPer = 2;
  static constexpr bool kQuant = true;
  __device__ static void cvt(const uint4& v, float (&f)[32]) {
    const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
      for (int j = 0; j < 8; ++j) f[8 * i + j] = e2m1_at(w[i], j);
  }
};

// fn(T{}) for the storage type T of weights of type `type` (gemv_core's and the MoE kernels' WT).
template <class Fn>
auto by_weight_type(WeightType type, Fn&& fn) -> decltype(fn(float{})) {
  switch (type) {
    case WeightType::f32: return fn(float{});
    case WeightType::bf16: return fn(__nv_bfloat16{});
    case WeightType::f16: return fn(__half{});
    case WeightType::e4m3: return fn(E4m3Codes{});
    case WeightType::e2m1: return fn(E2m1Codes{});
  }
  return fn(float{});
}

// fn(HT{}) for the half type HT that activations take before products with weights of type `type` in
// cuBLAS (to_half, the batched MoE): __half for f16 weights, else __nv_bfloat16.
template <class Fn>
void by_half_type(WeightType type, Fn&& fn) {
  if (type == WeightType::f16) {
    fn(__half{});
  } else {
    fn(__nv_bfloat16{});
  }
}

// Values of weights of type t that 16 bytes hold (WLoad's kVec): the chunk gemv_core reads.
int chunk_values(WeightType t) {
  return by_weight_type(t, [](auto tag) { return WLoad<decltype(tag)>::kVec; });
}

// The scale of weight row `row`, columns [col, col + VEC) (one block: block_cols % VEC == 0).
__device__ __forceinline__ float quant_scale(const QuantLayout& q, int64_t row, int64_t col) {
  return q.scale[((row + q.scale_row) / q.block_rows) * q.stride + col / q.block_cols];
}

// Accumulates acc[r][mm] = w[row0 + r, :] . x[mm, :] over this thread's share of k,
// then reduces over the block; returns true on threads t < G*M holding the sum of
// (r = t / M, mm = t % M) in `out`. PREFETCH: the kernel has not called pdl_entry()
// yet; this thread's first weights are requested before it does (weights are never
// written by a kernel), so they stream in while the previous kernel finishes.
// Element (row, col) of a quantized matrix of `cols` columns: its code's value times its block's scale.
__device__ __forceinline__ float quantized_value(const uint8_t* codes, bool fp4, int64_t row, int64_t col, int64_t cols,
                                                 const QuantLayout& q) {
  float v;
  if (fp4) {
    const uint32_t byte = codes[row * (cols / 2) + col / 2];
    v = e2m1_at((col & 1) ? byte >> 4 : byte, 0);
  } else {
    const auto code = static_cast<__nv_fp8_storage_t>(codes[row * cols + col]);
    v = __half2float(__half(__nv_cvt_fp8_to_halfraw(code, __NV_E4M3)));
  }
  return v * q.scale[((row + q.scale_row) / q.block_rows) * q.stride + col / q.block_cols];
}

// Quantized WT (FP8 / FP4 codes): each chunk's values times its block's scale from `q`.
template <class WT, int M, int G, bool PREFETCH = false>
__device__ __forceinline__ bool gemv_core(const float* x, int64_t ldx, int mh, const WT* __restrict__ w, int64_t n,
                                          int64_t k, int64_t row0, float& out, const QuantLayout q = {}) {
  constexpr int VEC = WLoad<WT>::kVec, PER = WLoad<WT>::kPer;
  __shared__ float red[kGemvThreads / 32][G * M];
  float acc[G][M];
#pragma unroll
  for (int r = 0; r < G; ++r)
#pragma unroll
    for (int mm = 0; mm < M; ++mm) acc[r][mm] = 0.f;
  const int64_t chunks = k / VEC;
  bool waited = !PREFETCH;
  for (int64_t ci = threadIdx.x; ci < chunks; ci += 2 * kGemvThreads) {
    uint4 raw[2][G];
    float qs[2][G];
    const bool second = ci + kGemvThreads < chunks;
#pragma unroll
    for (int u = 0; u < 2; ++u) {
#pragma unroll
      for (int r = 0; r < G; ++r) {
        const int64_t c = ci + u * kGemvThreads;
        const bool live = row0 + r < n && (u == 0 || second);
        raw[u][r] = live ? ld_stream(w + ((row0 + r) * k + c * VEC) / PER) : make_uint4(0u, 0u, 0u, 0u);
        if constexpr (WLoad<WT>::kQuant) qs[u][r] = live ? quant_scale(q, row0 + r, c * VEC) : 0.f;
      }
    }
    if (!waited) {
      pdl_entry();
      waited = true;
    }
#pragma unroll
    for (int u = 0; u < 2; ++u) {
      if (u == 1 && !second) break;
      const int64_t c = ci + u * kGemvThreads;
      float wf[G][VEC];
#pragma unroll
      for (int r = 0; r < G; ++r) {
        WLoad<WT>::cvt(raw[u][r], wf[r]);
        if constexpr (WLoad<WT>::kQuant) {
#pragma unroll
          for (int i = 0; i < VEC; ++i) wf[r][i] *= qs[u][r];
        }
      }
#pragma unroll
      for (int mm = 0; mm < M; ++mm) {
        if (mm < mh) {
          float xv[VEC];
          const float4* xp = reinterpret_cast<const float4*>(x + mm * ldx + c * VEC);
#pragma unroll
          for (int q = 0; q < VEC / 4; ++q) {
            const float4 t = xp[q];  // a plain load: x is an earlier kernel's output (see pdl_entry)
            xv[4 * q] = t.x;
            xv[4 * q + 1] = t.y;
            xv[4 * q + 2] = t.z;
            xv[4 * q + 3] = t.w;
          }
#pragma unroll
          for (int r = 0; r < G; ++r)
#pragma unroll
            for (int i = 0; i < VEC; ++i) acc[r][mm] = fmaf(wf[r][i], xv[i], acc[r][mm]);
        }
      }
    }
  }
  if (!waited) pdl_entry();
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
#pragma unroll
  for (int r = 0; r < G; ++r)
#pragma unroll
    for (int mm = 0; mm < M; ++mm) {
      const float v = warp_sum(acc[r][mm]);
      if (lane == 0) red[warp][r * M + mm] = v;
    }
  __syncthreads();
  if (threadIdx.x < G * M) {
    float s = 0.f;
#pragma unroll
    for (int i = 0; i < kGemvThreads / 32; ++i) s += red[i][threadIdx.x];
    out = s;
    return true;
  }
  return false;
}

template <class WT, int M, int G>
__global__ void __launch_bounds__(kGemvThreads) gemv_kernel(const float* x, int64_t ldx, int64_t m, const WT* w,
                                                            int64_t n, int64_t k, float* y, int64_t ldy, float beta,
                                                            int64_t group_rows, QuantLayout q) {
  // pdl_entry() inside gemv_core, after this thread's first weight loads
  const int64_t row0 = static_cast<int64_t>(blockIdx.x) * G;
  const int64_t m0 = static_cast<int64_t>(blockIdx.y) * M;
  const int64_t left = m - m0;
  const int mh = left < M ? static_cast<int>(left) : M;
  const int64_t xoff = group_rows > 0 ? (row0 / group_rows) * k : 0;
  float s;
  if (gemv_core<WT, M, G, true>(x + m0 * ldx + xoff, ldx, mh, w, n, k, row0, s, q)) {
    const int r = threadIdx.x / M, mm = threadIdx.x % M;
    if (row0 + r < n && mm < mh) {
      float* yy = y + (m0 + mm) * ldy + row0 + r;
      *yy = beta == 0.f ? s : s + beta * *yy;
    }
  }
}

// ---- bf16 weights, 4 to 8 rows of x: the tensor cores (mma.sync m16n8k16) ----------------
// gemv_core's FMAs cost 4-8 instructions a weight at 4-8 rows of x, so it fell below the memory
// rate there (m = 4: 53 % of copy, m = 8 on lm_head 619 us); the tensor cores take those products
// off the issue slots. Two or three blocks of weights a warp are in flight (registers: kAhead); a
// form with a ring of four blocks in shared memory (cp.async) measured ~2x slower and was not kept
// (session 16; gemv_mma_ring_kernel's per-warp ring of six blocks with whole-line copies, session 27,
// is faster past one wave of tiles).
// A CTA computes 16 output rows for 8 rows of x (zero past m):
// A = the 16 weight rows, B = x's rows as columns; its 8 warps split k in blocks of 64 (warp w:
// blocks w, w + 8, ...) and sum their 16 x 8 tiles in shared memory in a fixed order. In a block,
// lane (g, c) holds elements [8c, 8c + 8) and [32 + 8c, 40 + 8c) of weight rows g and g + 8 and of
// x row g, in that order: k-steps 0-3's columns 2c, 2c + 1, 2c + 8, 2c + 9, four a step (the k
// order inside a block is permuted, which the dot product does not see). Every load is 16
// contiguous bytes, and each load instruction covers whole 32-byte sectors (8 rows x 64 bytes;
// lanes taking bytes [32c, 32c + 32) in two loads split every sector between both, which read each
// twice through L2: m = 8 lm_head 296 -> 274 us, 4096 x 4096 14.1 -> 12.8 when changed).
// x enters as two bf16 terms, hi = bf16(x) and lo = bf16(x - hi), each a
// mma: the weights are exact in bf16, so the products keep ~16 of x's 24 bits (within 2^-17 of
// fp32 x, the tests' 2e-5 with room); accumulation in fp32. bf16 weights, k a multiple of 64.
constexpr int kMmaWarps = 8;
constexpr int kMmaBlock = 64;  // k a block (4 k-steps of 16)
// Lane (g, c)'s 16 elements of x row g in a block (xr: the row at the block's element 8c) as bf16 hi / lo
// words, word j = elements 2j, 2j + 1 of [8c, 8c + 8) then [32 + 8c, 40 + 8c); zeros when !ok. Plain loads:
// x is an earlier kernel's output (see pdl_entry).
__device__ __forceinline__ void x_words(const float* xr, bool ok, uint32_t (&hi)[8], uint32_t (&lo)[8]) {
  float xv[16];
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    const float4 t = ok ? *reinterpret_cast<const float4*>(xr + 32 * (q >> 1) + 4 * (q & 1))
                        : make_float4(0.f, 0.f, 0.f, 0.f);
    xv[4 * q] = t.x;
    xv[4 * q + 1] = t.y;
    xv[4 * q + 2] = t.z;
    xv[4 * q + 3] = t.w;
  }
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    hi[j] = pack_bf16x2(xv[2 * j], xv[2 * j + 1]);
    const float2 h = bf16x2_to_f32(hi[j]);
    lo[j] = pack_bf16x2(xv[2 * j] - h.x, xv[2 * j + 1] - h.y);
  }
}
// d += a block's 16 x 64 weights (cur: rows g and g + 8, 2 x 16 bytes each) times x's hi and lo words.
__device__ __forceinline__ void mma_block(float (&d)[4], const uint4 (&cur)[4], const uint32_t (&hi)[8],
                                          const uint32_t (&lo)[8]) {
  const uint32_t r0w[8] = {cur[0].x, cur[0].y, cur[0].z, cur[0].w, cur[1].x, cur[1].y, cur[1].z, cur[1].w};
  const uint32_t r1w[8] = {cur[2].x, cur[2].y, cur[2].z, cur[2].w, cur[3].x, cur[3].y, cur[3].z, cur[3].w};
#pragma unroll
  for (int st = 0; st < 4; ++st) {
    const uint32_t a[4] = {r0w[2 * st], r1w[2 * st], r0w[2 * st + 1], r1w[2 * st + 1]};
    mma_16816<true>(d, a, hi[2 * st], hi[2 * st + 1]);
    mma_16816<true>(d, a, lo[2 * st], lo[2 * st + 1]);
  }
}
// The weight ring moves on a block: buf[0] (just used) out, `after` in at the back.
template <int kAhead>
__device__ __forceinline__ void ring_shift(uint4 (&buf)[kAhead][4], const uint4 (&after)[4]) {
#pragma unroll
  for (int i = 0; i < 4; ++i) {
#pragma unroll
    for (int a = 0; a + 1 < kAhead; ++a) buf[a][i] = buf[a + 1][i];
    buf[kAhead - 1][i] = after[i];
  }
}

// A tile's sums: every warp's 16 x 8 products d (zeroed after) into pt, one barrier, then 128 threads add
// the warps' parts in a fixed order and store y's rows row0 .. row0 + 15 of x rows m0 .. m0 + mh - 1 (y = sum,
// or sum + beta y; with `add`, y + sum: a later window of k, whose element the same thread stored before).
// pt must not be read by any thread still before this barrier (the persistent kernels alternate two).
template <int kWarps>
__device__ __forceinline__ void tile_sums(float (&d)[4], float (&pt)[kWarps][4][32], int64_t row0, int64_t n,
                                          int64_t m0, int mh, float* y, int64_t ldy, float beta, bool add = false) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
#pragma unroll
  for (int u = 0; u < 4; ++u) {
    pt[warp][u][lane] = d[u];
    d[u] = 0.f;
  }
  __syncthreads();
  if (threadIdx.x < 128) {  // d[u] of lane l: row g(l) + 8 (u / 2), column 2 c(l) + u % 2
    const int u = threadIdx.x >> 5, l = threadIdx.x & 31;
    float sum = 0.f;
#pragma unroll
    for (int v = 0; v < kWarps; ++v) sum += pt[v][u][l];
    const int64_t row = row0 + (l >> 2) + 8 * (u >> 1);
    const int col = 2 * (l & 3) + (u & 1);
    if (row < n && col < mh) {
      float* yy = y + (m0 + col) * ldy + row;
      *yy = add ? *yy + sum : beta == 0.f ? sum : sum + beta * *yy;
    }
  }
}

// kAhead: blocks of weights a warp has in flight while it multiplies one (registers: 2 keep 3 CTAs an SM,
// 3 two); kWarps: warps a CTA (16 with kAhead 4: one CTA an SM, for grids the device holds at once).
template <int kAhead, int kWarps = kMmaWarps>
__global__ void __launch_bounds__(kWarps * 32) gemv_mma_kernel(const float* x, int64_t ldx, int64_t m,
                                                                  const __nv_bfloat16* w, int64_t n, int64_t k,
                                                                  float* y, int64_t ldy, float beta,
                                                                  int64_t group_rows) {
  // pdl-prologue: w (the first weights are requested before pdl_entry: no kernel writes them)
  __shared__ float part[kWarps][4][32];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
  const int64_t row0 = static_cast<int64_t>(blockIdx.x) * 16, m0 = static_cast<int64_t>(blockIdx.y) * 8;
  const int mh = m - m0 < 8 ? static_cast<int>(m - m0) : 8;
  const int64_t xoff = group_rows > 0 ? (row0 / group_rows) * k : 0;
  const int64_t blocks = k / kMmaBlock;
  const bool ok0 = row0 + g < n, ok1 = row0 + g + 8 < n, xok = g < mh;
  const __nv_bfloat16* w0 = w + (row0 + g) * k + 8 * c;
  const __nv_bfloat16* w1 = w0 + 8 * k;
  const uint4 zero = make_uint4(0u, 0u, 0u, 0u);
  // Weight rows g and g + 8 of a block: 2 x 16 bytes each.
  auto load_w = [&](int64_t blk, uint4 (&r)[4]) {
    const int64_t o = blk * kMmaBlock;
    r[0] = ok0 ? ld_stream(w0 + o) : zero;
    r[1] = ok0 ? ld_stream(w0 + o + 32) : zero;
    r[2] = ok1 ? ld_stream(w1 + o) : zero;
    r[3] = ok1 ? ld_stream(w1 + o + 32) : zero;
  };
  float d[4] = {0.f, 0.f, 0.f, 0.f};
  int64_t blk = warp;
  uint4 buf[kAhead][4];  // this block's weights and the next ones'; one more is requested before the math
#pragma unroll
  for (int a = 0; a < kAhead; ++a) {  // weights are no kernel's output: requested before the wait
    if (blk + a * kWarps < blocks) load_w(blk + a * kWarps, buf[a]);
  }
  pdl_entry();
  const float* xr = x + (m0 + g) * ldx + xoff + 8 * c;
  for (; blk < blocks; blk += kWarps) {
    uint4 after[4];
    if (blk + kAhead * kWarps < blocks) load_w(blk + kAhead * kWarps, after);
    uint32_t hi[8], lo[8];
    x_words(xr + blk * kMmaBlock, xok, hi, lo);
    mma_block(d, buf[0], hi, lo);
    ring_shift<kAhead>(buf, after);
  }
  tile_sums<kWarps>(d, part, row0, n, m0, mh, y, ldy, beta);
}

// Where a CTA of a persistent tensor-core GEMV stands (x rows m0 .. m0 + mh - 1; tiles blockIdx.x, + gridDim.x,
// ...: my_tiles of them) and this warp's blocks of k a tile (warp, + kWarps, ...: nb), items = my_tiles nb.
template <int kWarps>
struct PersistPlace {
  int64_t m0, my_tiles, items;
  int mh, nb;
  __device__ __forceinline__ PersistPlace(int64_t m, int64_t n, int64_t k) {
    m0 = static_cast<int64_t>(blockIdx.y) * 8;
    mh = m - m0 < 8 ? static_cast<int>(m - m0) : 8;
    const int64_t blocks = k / kMmaBlock, tiles = (n + 15) / 16;
    my_tiles = (tiles - blockIdx.x + gridDim.x - 1) / gridDim.x;
    nb = static_cast<int>((blocks - (threadIdx.x >> 5) + kWarps - 1) / kWarps);
    items = my_tiles * nb;
  }
};

// The same products over grids larger than the device holds at twice (lm_head: 8,080 tiles of 16
// rows), persistent: each CTA takes tiles blockIdx.x, + gridDim.x, ..., and each warp streams its
// blocks of every one of its CTA's tiles as one sequence, kAhead blocks in flight across the tiles'
// boundaries (a CTA's first and last blocks no longer leave its SM's loads idle at every 16 rows: one-
// tile CTAs turned over ~20 times a slot on lm_head). The warps' sums of a tile meet in part[tile %
// 2] at one barrier a tile. kXs: x staged once a CTA in shared memory as its bf16 hi / lo words in
// the order the lanes read them ([block][q][lane with g < mh], 16 bytes: q 0-1 hi, 2-3 lo; 4 mh k
// bytes), so the loop reads 4 conflict-free 16-byte words a block instead of loading and converting
// 16 floats of x. Needs k / 64 >= kWarps (every warp has a block of every tile). group_rows is always 0
// (gemv_typed takes this form only without row groups, and launch_persist passes 0); it stays a parameter
// because ptxas spills 24 bytes in the <2, 8, false> form without it (sessions 18 and 19).
template <int kAhead, int kWarps, bool kXs>
__global__ void __launch_bounds__(kWarps * 32, kWarps == 16 ? 1 : 3)
    gemv_mma_persist_kernel(const float* x, int64_t ldx, int64_t m, const __nv_bfloat16* w, int64_t n, int64_t k,
                            float* y, int64_t ldy, float beta, int64_t group_rows) {
  // pdl-prologue: w (the first weights are requested before pdl_entry: no kernel writes them)
  __shared__ float part[2][kWarps][4][32];
  extern __shared__ uint4 xs[];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
  const PersistPlace<kWarps> at(m, n, k);
  const int64_t m0 = at.m0, my_tiles = at.my_tiles, items = at.items;
  const int mh = at.mh, nb = at.nb;
  const bool xok = g < mh;
  const uint4 zero = make_uint4(0u, 0u, 0u, 0u);
  // Item i: tile blockIdx.x + (i / nb) gridDim.x, block warp + (i % nb) kWarps.
  auto load_w = [&](int64_t ti, int j, uint4 (&r)[4]) {
    const int64_t row0 = (blockIdx.x + ti * gridDim.x) * 16;
    const int64_t o = (warp + static_cast<int64_t>(j) * kWarps) * kMmaBlock;
    const __nv_bfloat16* w0 = w + (row0 + g) * k + 8 * c + o;
    const bool ok0 = row0 + g < n, ok1 = row0 + g + 8 < n;
    r[0] = ok0 ? ld_stream(w0) : zero;
    r[1] = ok0 ? ld_stream(w0 + 32) : zero;
    r[2] = ok1 ? ld_stream(w0 + 8 * k) : zero;
    r[3] = ok1 ? ld_stream(w0 + 8 * k + 32) : zero;
  };
  uint4 buf[kAhead][4];
  int64_t ati = 0;  // item i + kAhead's tile (of this CTA's) and block (of this warp's)
  int aj = 0;
#pragma unroll
  for (int a = 0; a < kAhead; ++a) {  // weights are no kernel's output: requested before the wait
    if (a < items) load_w(ati, aj, buf[a]);
    if (++aj == nb) aj = 0, ++ati;
  }
  pdl_entry();
  if constexpr (kXs) {
    // Staging item t: block t / (4 mh), lane' = t % (4 mh) = 4 g + c: its 16 elements of x row g.
    const int per = 4 * mh;
    for (int64_t t = threadIdx.x; t < k / kMmaBlock * per; t += kWarps * 32) {
      const int64_t blk = t / per;
      const int l = static_cast<int>(t % per), gg = l >> 2, cc = l & 3;
      uint32_t hi[8], lo[8];
      x_words(x + (m0 + gg) * ldx + blk * kMmaBlock + 8 * cc, true, hi, lo);
      uint4* dst = xs + blk * 4 * per + l;
      dst[0] = make_uint4(hi[0], hi[1], hi[2], hi[3]);
      dst[per] = make_uint4(hi[4], hi[5], hi[6], hi[7]);
      dst[2 * per] = make_uint4(lo[0], lo[1], lo[2], lo[3]);
      dst[3 * per] = make_uint4(lo[4], lo[5], lo[6], lo[7]);
    }
    __syncthreads();
  }
  float d[4] = {0.f, 0.f, 0.f, 0.f};
  int64_t ti = 0;
  int j = 0;
  for (int64_t i = 0; i < items; ++i) {
    uint4 after[4];
    if (i + kAhead < items) load_w(ati, aj, after);
    if (++aj == nb) aj = 0, ++ati;
    const int64_t blk = warp + static_cast<int64_t>(j) * kWarps;
    uint32_t hi[8], lo[8];  // word j: elements 2j, 2j + 1
    if constexpr (kXs) {
      uint4 q[4] = {zero, zero, zero, zero};
      if (xok) {
        const int per = 4 * mh;
        const uint4* src = xs + blk * 4 * per + lane;
#pragma unroll
        for (int u = 0; u < 4; ++u) q[u] = src[u * per];
      }
      hi[0] = q[0].x, hi[1] = q[0].y, hi[2] = q[0].z, hi[3] = q[0].w;
      hi[4] = q[1].x, hi[5] = q[1].y, hi[6] = q[1].z, hi[7] = q[1].w;
      lo[0] = q[2].x, lo[1] = q[2].y, lo[2] = q[2].z, lo[3] = q[2].w;
      lo[4] = q[3].x, lo[5] = q[3].y, lo[6] = q[3].z, lo[7] = q[3].w;
    } else {
      const int64_t row0 = (blockIdx.x + ti * gridDim.x) * 16;
      const int64_t xoff = group_rows > 0 ? (row0 / group_rows) * k : 0;
      x_words(x + (m0 + g) * ldx + xoff + 8 * c + blk * kMmaBlock, xok, hi, lo);
    }
    mma_block(d, buf[0], hi, lo);
    ring_shift<kAhead>(buf, after);
    if (++j == nb) {  // this warp's last block of the tile: the tile's sums (part[ti & 1] was last read
                      // before the previous tile's barrier)
      tile_sums<kWarps>(d, part[ti & 1], (blockIdx.x + ti * gridDim.x) * 16, n, m0, mh, y, ldy, beta);
      j = 0;
      ++ti;
    }
  }
}

// The persistent form with each warp's weight blocks in flight in a ring of kSlots blocks in shared memory
// (cp.async) instead of registers: the register ring held gemv_mma_persist_kernel to four blocks a warp
// (128 KB an SM in flight, ~4.0 TB/s on lm_head whatever the math: 256 us with the mma replaced by an
// xor, run 27 call 1), and each of its load instructions covered half of 8 rows' 128-byte lines (whole
// lines of 4 rows: 264 -> 257 us). Here lane l copies chunk l & 7 (16 bytes) of rows (l >> 3) + 4q of a
// block, whole lines a copy instruction, and reads back the lanes' mma layout (rows g and g + 8, chunks c
// and 4 + c) after its wait and a warp barrier; row r's chunk j lies at j ^ 4 (r & 1) so that the reads'
// 8-lane phases (rows g, g + 1) meet no bank twice. x's words of the warp's blocks stay in registers: k is
// taken in windows of kRingWindow blocks (4,096 elements; kRingXBlocks a warp a tile), the CTA's tiles window
// by window, x's words of a window loaded at its start (read from x for every block instead, at k = 6,144:
// 8192 x 6144 m = 3 28.3 -> 30.3 us against the register ring's; not kept). Window 0 stores y (sum, or sum +
// beta y), later ones add to it. Tiles, sums and barriers as in gemv_mma_persist_kernel.
// kWindows: k may take more than one window (a kernel of its own, so that k <= 4,096 runs the one-window
// code: with the loop over windows there, 4096 x 4096 m = 8 took 11.5 -> 12.0 us, run 28 call 1).
constexpr int kRingSlots = 6, kRingXBlocks = 4, kRingWindow = 16 * kRingXBlocks;
template <int kSlots = kRingSlots, bool kWindows = false>
__global__ void __launch_bounds__(512, 1)
    gemv_mma_ring_kernel(const float* x, int64_t ldx, int64_t m, const __nv_bfloat16* w, int64_t n, int64_t k,
                         float* y, int64_t ldy, float beta) {
  // pdl-prologue: w (the first weights are copied before pdl_entry: no kernel writes them)
  constexpr int kWarps = 16;
  __shared__ float part[2][kWarps][4][32];
  extern __shared__ uint4 ring[];  // [warp][slot][16 rows][8 chunks]
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
  const PersistPlace<kWarps> at(m, n, k);
  const int64_t m0 = at.m0, my_tiles = at.my_tiles, blocks = k / kMmaBlock;
  const int mh = at.mh, windows = kWindows ? static_cast<int>((blocks + kRingWindow - 1) / kRingWindow) : 1;
  // This warp's blocks a tile in window v (0 where the last window is shorter than the warp's index).
  auto nb_of = [&](int v) {
    const int wb = static_cast<int>(std::min<int64_t>(kRingWindow, blocks - static_cast<int64_t>(v) * kRingWindow));
    return wb > warp ? (wb - warp + kWarps - 1) / kWarps : 0;
  };
  int64_t items = my_tiles * at.nb;
  if constexpr (kWindows) {
    items = 0;
    for (int v = 0; v < windows; ++v) items += my_tiles * nb_of(v);
  }
  const bool xok = g < mh;
  uint4* const mine = ring + warp * kSlots * 128;
  const int cr = lane >> 3, cj = lane & 7, sw = (g & 1) << 2;
  int cw = 0, cjb = 0, cnb = at.nb;  // the next item to copy: window cw, this CTA's tile cti, block cjb
  int64_t cti = 0;
  if constexpr (kWindows) {
    cnb = nb_of(0);
    while (cnb == 0 && cw + 1 < windows) cnb = nb_of(++cw);
  }
  auto copy_item = [&](int slot) {
    const int64_t row0 = (blockIdx.x + cti * gridDim.x) * 16;
    const int64_t o = (static_cast<int64_t>(cw) * kRingWindow + warp + cjb * kWarps) * kMmaBlock + 8 * cj;
    uint4* dst = mine + slot * 128 + (cj ^ ((cr & 1) << 2));
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      const int r = cr + 4 * q;
      const bool ok = row0 + r < n;
      cp_async16(dst + r * 8, ok ? w + (row0 + r) * k + o : w, ok);
    }
    if (++cjb == cnb) {
      cjb = 0;
      ++cti;
      if constexpr (kWindows) {
        if (cti == my_tiles) {
          cti = 0;
          do cnb = ++cw < windows ? nb_of(cw) : 1;
          while (cnb == 0);
        }
      }
    }
  };
#pragma unroll
  for (int s = 0; s < kSlots; ++s) {  // weights are no kernel's output: copied before the wait
    if (s < items) copy_item(s);
    cp_async_commit();
  }
  pdl_entry();
  float d[4] = {0.f, 0.f, 0.f, 0.f};
  int slot = 0;
  int64_t i = 0;
  // One block: item i's weights from its slot (after its group's wait), the slot refilled, the products.
  auto step = [&](const uint32_t (&hi)[8], const uint32_t (&lo)[8]) {
    cp_async_wait<kSlots - 1>();  // item i's group (one group an item, empty ones past the end)
    __syncwarp();
    const uint4* src = mine + slot * 128;
    const uint4 cur[4] = {src[g * 8 + (c ^ sw)], src[g * 8 + ((4 + c) ^ sw)], src[(g + 8) * 8 + (c ^ sw)],
                          src[(g + 8) * 8 + ((4 + c) ^ sw)]};
    __syncwarp();  // every lane has read the slot before it is copied over
    if (i + kSlots < items) copy_item(slot);
    cp_async_commit();
    mma_block(d, cur, hi, lo);
    if (++slot == kSlots) slot = 0;
    ++i;
  };
  int64_t done = 0;  // tiles summed (part[done & 1] alternates across windows too)
  for (int v = 0; v < windows; ++v) {
    const int nb = kWindows ? nb_of(v) : at.nb;
    const float* xr = x + (m0 + g) * ldx + 8 * c + (static_cast<int64_t>(v) * kRingWindow + warp) * kMmaBlock;
    uint32_t xh[kRingXBlocks][8], xl[kRingXBlocks][8];
#pragma unroll
    for (int j = 0; j < kRingXBlocks; ++j) x_words(xr + j * kWarps * kMmaBlock, xok && j < nb, xh[j], xl[j]);
    for (int64_t ti = 0; ti < my_tiles; ++ti, ++done) {
#pragma unroll
      for (int j = 0; j < kRingXBlocks; ++j) {
        if (j < nb) step(xh[j], xl[j]);
      }
      // (part[done & 1] was last read before the previous tile's barrier)
      tile_sums<kWarps>(d, part[done & 1], (blockIdx.x + ti * gridDim.x) * 16, n, m0, mh, y, ldy, beta, v > 0);
    }
  }
  cp_async_wait<0>();
}

struct MultiSegments {
  const void* w[kMultiMax];
  float* y[kMultiMax];
  int64_t rows[kMultiMax];
  int64_t cta_end[kMultiMax];  // cumulative CTAs (4 rows each)
  int count;
};

template <class WT, int M>
__global__ void __launch_bounds__(kGemvThreads) gemv_multi_kernel(const float* x, int64_t k, int mh,
                                                                  const MultiSegments seg) {
  // pdl_entry() inside gemv_core, after this thread's first weight loads
  int i = 0;
  while (i < seg.count - 1 && static_cast<int64_t>(blockIdx.x) >= seg.cta_end[i]) ++i;
  const int64_t first = i == 0 ? 0 : seg.cta_end[i - 1];
  const int64_t row0 = (static_cast<int64_t>(blockIdx.x) - first) * 4;
  const int64_t n = seg.rows[i];
  float s;
  if (gemv_core<WT, M, 4, true>(x, k, mh, static_cast<const WT*>(seg.w[i]), n, k, row0, s)) {
    const int r = threadIdx.x / M, mm = threadIdx.x % M;
    if (row0 + r < n && mm < mh) seg.y[i][mm * n + row0 + r] = s;
  }
}

// Any shape, any alignment: one block per (output row, x row).
template <class WT>
__global__ void gemv_scalar_kernel(const float* x, int64_t ldx, const WT* w, int64_t k, float* y, int64_t ldy,
                                   float beta, int64_t group_rows) {
  pdl_entry();  // see launch_kernel
  __shared__ float scratch[32];
  const int64_t row = blockIdx.x, mm = blockIdx.y;
  const int64_t xoff = group_rows > 0 ? (row / group_rows) * k : 0;
  float acc = 0.f;
  for (int64_t i = threadIdx.x; i < k; i += blockDim.x) acc += to_f32(w[row * k + i]) * x[mm * ldx + xoff + i];
  acc = block_sum(acc, scratch);
  if (threadIdx.x == 0) {
    float* yy = y + mm * ldy + row;
    *yy = beta == 0.f ? acc : acc + beta * *yy;
  }
}

// TROUPE_GEMV_MMA=0: bf16 weights with 4-8 rows of x on gemv_core's FMAs too (an A/B switch).
bool gemv_mma_enabled() {
  static const bool on = !env_off("TROUPE_GEMV_MMA");
  return on;
}

// TROUPE_GEMV_PERSIST=0: grids larger than twice the device on gemv_mma_kernel<2> (an A/B switch).
bool gemv_persist_enabled() {
  static const bool on = !env_off("TROUPE_GEMV_PERSIST");
  return on;
}

// x staged in shared memory (4 mh k bytes) up to this much.
constexpr size_t kPersistXsMax = 160 * 1024;

// CTAs of `kernel` one SM holds at once with `threads` threads and `smem` bytes of dynamic shared memory (the
// kernel's dynamic shared memory limit raised to smem first).
template <class... A>
int resident_per_sm(void (*kernel)(A...), int threads, size_t smem) {
  TROUPE_CUDA(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
  int per = 0;
  TROUPE_CUDA(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per, kernel, threads, smem));
  return per;
}

// One form of gemv_mma_persist_kernel over the device: as many CTAs as it holds at once (or tiles). The
// occupancy is asked once a form, at the form's largest shared memory (the staged form is held to one
// CTA an SM by its registers whatever x's size).
template <int kAhead, int kWarps, bool kXs>
void launch_persist(const float* x, int64_t ldx, int64_t m, const __nv_bfloat16* w, int64_t n, int64_t k, float* y,
                    int64_t ldy, float beta, size_t smem, cudaStream_t s) {
  auto* kernel = gemv_mma_persist_kernel<kAhead, kWarps, kXs>;
  static const int64_t ctas =
      static_cast<int64_t>(std::max(resident_per_sm(kernel, kWarps * 32, kXs ? kPersistXsMax : 0), 1)) * sm_count();
  const dim3 grid(static_cast<unsigned>(std::min(ceil_div(n, 16), ctas)), static_cast<unsigned>(ceil_div(m, 8)));
  launch_kernel(kernel, grid, kWarps * 32, smem, s, x, ldx, m, w, n, k, y, ldy, beta, int64_t{0});
  TROUPE_LAUNCHED();
}

// gemv_mma_persist_kernel's forms (run 18 calls 5-6, 4 and 8 rows, against gemv_mma_kernel<2>):
// with >= 64 blocks of k (4 a warp a tile at 16 warps), 16 warps four blocks ahead at one CTA an SM, x
// staged in shared memory where it fits (4 mh k bytes <= kPersistXsMax): lm_head 271 / 281 -> 264 / 266
// us, 16384 x 4096 42 / 43 -> 36 / 37 (x from global memory instead: 267 / 284, 37 / 37; 8 warps at three
// CTAs an SM with x staged: 395 at 4 rows). Fewer blocks (k 1,024-4,032): 8 warps two ahead at three
// CTAs an SM, x from global memory (32768 x 1024 22 -> 18.5, 8192 x 1024 7.5 -> 6.5-6.9; 16 warps
// there, one block a warp a tile, barrier-bound: 19.4, 7.3). Since session 27 the shared-memory ring
// takes k of 2,048 to 4,096 and since session 28 any larger k (gemv_typed), so these run at k < 2,048
// (and with TROUPE_GEMV_RING=0).

// TROUPE_GEMV_RING=0: gemv_mma_ring_kernel's shapes on the forms before it (an A/B switch).
bool gemv_ring_enabled() {
  static const bool on = !env_off("TROUPE_GEMV_RING");
  return on;
}

// gemv_mma_ring_kernel over the device at one CTA an SM (or one a tile).
template <int kSlots, bool kWindows>
void launch_ring_slots(const float* x, int64_t ldx, int64_t m, const __nv_bfloat16* w, int64_t n, int64_t k, float* y,
                       int64_t ldy, float beta, cudaStream_t s) {
  auto* kernel = gemv_mma_ring_kernel<kSlots, kWindows>;
  constexpr size_t smem = static_cast<size_t>(16) * kSlots * 2048;
  static const int64_t ctas = [&] {
    const int per = resident_per_sm(kernel, 512, smem);
    TROUPE_REQUIRE(per >= 1, "gemv: the ring kernel does not fit an SM");
    return static_cast<int64_t>(per) * sm_count();
  }();
  TROUPE_REQUIRE(ceil_div(m, 8) <= 65535, "gemv: too many rows");
  const dim3 grid(static_cast<unsigned>(std::min(ceil_div(n, 16), ctas)), static_cast<unsigned>(ceil_div(m, 8)));
  launch_kernel(kernel, grid, 512, smem, s, x, ldx, m, w, n, k, y, ldy, beta);
  TROUPE_LAUNCHED();
}
// TROUPE_GEMV_RING_SLOTS=2 / 4: that many blocks a warp in the ring instead of six (an A/B switch).
template <bool kWindows>
void launch_ring_windows(const float* x, int64_t ldx, int64_t m, const __nv_bfloat16* w, int64_t n, int64_t k,
                         float* y, int64_t ldy, float beta, cudaStream_t s) {
  static const int slots = [] {
    const char* e = std::getenv("TROUPE_GEMV_RING_SLOTS");
    return e != nullptr && (e[0] == '2' || e[0] == '4') ? e[0] - '0' : kRingSlots;
  }();
  if (slots == 2) return launch_ring_slots<2, kWindows>(x, ldx, m, w, n, k, y, ldy, beta, s);
  if (slots == 4) return launch_ring_slots<4, kWindows>(x, ldx, m, w, n, k, y, ldy, beta, s);
  launch_ring_slots<kRingSlots, kWindows>(x, ldx, m, w, n, k, y, ldy, beta, s);
}
void launch_ring(const float* x, int64_t ldx, int64_t m, const __nv_bfloat16* w, int64_t n, int64_t k, float* y,
                 int64_t ldy, float beta, cudaStream_t s) {
  if (k / kMmaBlock > kRingWindow) return launch_ring_windows<true>(x, ldx, m, w, n, k, y, ldy, beta, s);
  launch_ring_windows<false>(x, ldx, m, w, n, k, y, ldy, beta, s);
}

void gemv_mma_persist(const float* x, int64_t ldx, int64_t m, const __nv_bfloat16* w, int64_t n, int64_t k, float* y,
                      int64_t ldy, float beta, cudaStream_t s) {
  const size_t xs = static_cast<size_t>(4 * std::min<int64_t>(m, 8)) * static_cast<size_t>(k);
  if (k / kMmaBlock < 64) {
    launch_persist<2, kMmaWarps, false>(x, ldx, m, w, n, k, y, ldy, beta, 0, s);
  } else if (xs <= kPersistXsMax) {
    launch_persist<4, 16, true>(x, ldx, m, w, n, k, y, ldy, beta, xs, s);
  } else {
    launch_persist<4, 16, false>(x, ldx, m, w, n, k, y, ldy, beta, 0, s);
  }
}

template <class WT>
void gemv_typed(const float* x, int64_t ldx, int64_t m, const WT* w, int64_t n, int64_t k, float* y, int64_t ldy,
                float beta, int64_t group_rows, cudaStream_t s, const QuantLayout q = {}) {
  constexpr int VEC = WLoad<WT>::kVec;
  const bool aligned = k % VEC == 0 && ldx % 4 == 0 && reinterpret_cast<uintptr_t>(w) % 16 == 0 &&
                       reinterpret_cast<uintptr_t>(x) % 16 == 0 && (k / WLoad<WT>::kPer * sizeof(WT)) % 16 == 0;
  if constexpr (WLoad<WT>::kQuant) {
    TROUPE_REQUIRE(aligned && q.block_cols % VEC == 0 && m <= kGemvBatchRows,
                   "gemv: quantized weights need 16-byte rows of whole chunks a scale block (gemv_takes)");
  } else if (!aligned) {
    TROUPE_REQUIRE(m <= 65535, "gemv: too many rows");
    launch_kernel(gemv_scalar_kernel<WT>, dim3(static_cast<unsigned>(n), static_cast<unsigned>(m)), 128, 0, s, x, ldx,
                  w, k, y, ldy, beta, group_rows);
    TROUPE_LAUNCHED();
    return;
  }
  if constexpr (std::is_same_v<WT, __nv_bfloat16>) {
    // Where it measured faster than gemv_core (docs/kernels-notes.md session 16): 5-8 rows of x at every
    // shape (lm_head 619 -> 293 us, 4096 x 4096 24.3 -> 14.2), and 4 rows over >= 4,096 outputs (lm_head
    // 355 -> 261 us, 4096 x 4096 15.1 -> 12.8); with 2-3 rows, or 4 over fewer outputs, gemv_core's many
    // small CTAs keep more bytes in flight (4 rows x 2048 x 4096: 9.9 against 10.2 us).
    // Since session 18 also 3-4 rows over 1,024 outputs or more that the device holds at one CTA an SM
    // (the 16-warp form below; run 18 call 5, m = 4 / 3: 2048 x 4096 10.0 -> 7.3 / 8.8 -> 7.2 us, 1024 x
    // 4096 7.4 -> 4.9 / 6.3 -> 4.9; over 512 outputs, 32 CTAs, slower: 4.1 -> 4.3 / 3.6 -> 4.4).
    // Since session 26 also 3 rows over grids of more than two waves of 16-row tiles, the persistent form
    // (run 26 call 3: lm_head m = 3 on gemv_core 295 us against cuBLAS's 245); since session 27 3 rows over
    // >= 4,096 outputs (run 27 call 1: 4096 x 4096 13.5 -> 12.9 us).
    static const int sms = sm_count();
    const bool one_wave_m = n >= 1024 && ceil_div(n, 16) <= sms;
    const bool persist_m = ceil_div(n, 16) > 2 * static_cast<int64_t>(sms);
    const bool mma_wins = m > kGemvMaxRows || (m >= 3 && (n >= 4096 || one_wave_m || persist_m));
    if (mma_wins && k % kMmaBlock == 0 && (group_rows == 0 || group_rows % 16 == 0) && gemv_mma_enabled()) {
      TROUPE_REQUIRE(ceil_div(m, 8) <= 65535, "gemv: too many rows");
      const dim3 grid(static_cast<unsigned>(ceil_div(n, 16)), static_cast<unsigned>(ceil_div(m, 8)));
      // Grids the device holds at one CTA an SM: 16 warps, four blocks each in flight (2048 x 4096,
      // m = 8: 10.3 -> 7.3 us; 16 warps on larger grids were slower: 4096 x 4096 13.0 -> 13.8, lm_head
      // 282 -> 385). Three blocks a warp in flight when the CTAs fit the device at two an SM (4096 x
      // 4096, m = 4: 15.1 -> 12.8 us); else two, and three CTAs an SM (lm_head m = 8: 3 in flight 370
      // us, 2 293 us).
      const int64_t ctas = static_cast<int64_t>(grid.x) * grid.y;
      const bool one_wave = ctas <= sms;
      // More than one wave of CTAs with k of 2,048 or more: the shared-memory ring (gemv_mma_ring_kernel;
      // run 27 calls 2-4 against the forms below: lm_head m = 3 / 4 / 8 264 / 265 / 267 -> 240 / 241 / 245
      // us, 16384 x 4096 36 -> 31.5, 16384 x 2048 19.3 -> 16.3, 4096 x 4096 12.6 -> 10.5 (m = 8 13.0 ->
      // 11.3), 4096 x 2048 6.9 -> 6.4; k = 1,024, one block a warp a tile, 8192 x 1024 6.4 -> 6.6, not
      // taken). k > 4,096 in windows (run 28 calls 1-2: 4096 x 8192 m = 3 / 4 / 8 22.7 / 23.1 / 23.9 ->
      // 19.8 / 20.6 / 22.0 us, cuBLAS 22.1-22.4; 8192 x 6144 28.2 / 28.3 / 32.5 -> 27.3 / 27.8 / 30.0, cuBLAS
      // 26.3; x read for every block instead, run 27: 8192 x 6144 28.3 -> 30.3).
      // TROUPE_GEMV_RING_WIDE (an A/B switch): 0 = the ring past two waves only; w = past one wave only where
      // k takes more than one window.
      static const int ring_wide = [] {
        const char* e = std::getenv("TROUPE_GEMV_RING_WIDE");
        return e == nullptr ? 1 : e[0] == '0' ? 0 : e[0] == 'w' ? 2 : 1;
      }();
      const int64_t blocks = k / kMmaBlock;
      const bool ring_past_one = ring_wide == 1 || (ring_wide == 2 && blocks > kRingWindow);
      if (blocks >= 32 && group_rows == 0 &&
          ctas > (ring_past_one ? 1 : 2) * static_cast<int64_t>(sms) && gemv_ring_enabled()) {
        launch_ring(x, ldx, m, w, n, k, y, ldy, beta, s);
        return;
      }
      // More than two waves of CTAs (lm_head): the persistent form (see gemv_mma_persist).
      if (ctas > 2 * static_cast<int64_t>(sms) && blocks >= 16 && group_rows == 0 && gemv_persist_enabled()) {
        gemv_mma_persist(x, ldx, m, w, n, k, y, ldy, beta, s);
        return;
      }
      auto* kernel = one_wave ? gemv_mma_kernel<4, 16>
                              : ctas <= 2 * static_cast<int64_t>(sms) ? gemv_mma_kernel<3> : gemv_mma_kernel<2>;
      launch_kernel(kernel, grid, (one_wave ? 16 : kMmaWarps) * 32, 0, s, x, ldx, m, w, n, k, y, ldy, beta, group_rows);
      TROUPE_LAUNCHED();
      return;
    }
  }
  const bool one = m == 1;
  const bool wide = m > kGemvMaxRows && m <= kGemvBatchRows;  // one pass of up to 8 rows
  const int64_t mtiles = one || wide ? 1 : ceil_div(m, kGemvMaxRows);
  TROUPE_REQUIRE(mtiles <= 65535, "gemv: too many rows");
  const bool g4 = ceil_div(n, 4) * mtiles >= 264 && (group_rows == 0 || group_rows % 4 == 0);
  const int G = g4 ? 4 : 1;
  const dim3 grid(static_cast<unsigned>(ceil_div(n, G)), static_cast<unsigned>(mtiles));
  if (wide && g4) {
    launch_kernel(gemv_kernel<WT, kGemvBatchRows, 4>, grid, kGemvThreads, 0, s, x, ldx, m, w, n, k, y, ldy, beta,
                  group_rows, q);
  } else if (wide) {
    launch_kernel(gemv_kernel<WT, kGemvBatchRows, 1>, grid, kGemvThreads, 0, s, x, ldx, m, w, n, k, y, ldy, beta,
                  group_rows, q);
  } else if (one && g4) {
    launch_kernel(gemv_kernel<WT, 1, 4>, grid, kGemvThreads, 0, s, x, ldx, m, w, n, k, y, ldy, beta, group_rows, q);
  } else if (one) {
    launch_kernel(gemv_kernel<WT, 1, 1>, grid, kGemvThreads, 0, s, x, ldx, m, w, n, k, y, ldy, beta, group_rows, q);
  } else if (m == 2 || m == 3) {
    // Exactly m rows: gemv_core's loops over M with no runtime bound inside them (2 rows on the 4-row
    // kernel: lm_head 261 -> 232 us, expert 2048 x 4096 7.9 -> 6.1).
    auto* kernel = g4 ? (m == 2 ? gemv_kernel<WT, 2, 4> : gemv_kernel<WT, 3, 4>)
                      : (m == 2 ? gemv_kernel<WT, 2, 1> : gemv_kernel<WT, 3, 1>);
    launch_kernel(kernel, grid, kGemvThreads, 0, s, x, ldx, m, w, n, k, y, ldy, beta, group_rows, q);
  } else if (g4) {
    launch_kernel(gemv_kernel<WT, kGemvMaxRows, 4>, grid, kGemvThreads, 0, s, x, ldx, m, w, n, k, y, ldy, beta,
                  group_rows, q);
  } else {
    launch_kernel(gemv_kernel<WT, kGemvMaxRows, 1>, grid, kGemvThreads, 0, s, x, ldx, m, w, n, k, y, ldy, beta,
                  group_rows, q);
  }
  TROUPE_LAUNCHED();
}

// ---- elementwise -----------------------------------------------------------------
// 1 / rms of a row of `width` floats (the block's threads stride over it, then block_sum); every thread
// gets it. rmsnorm_kernel's order, which the fused kernels that promise its bits follow.
__device__ __forceinline__ float row_inv_rms(const float* xr, int64_t width, float eps, float* scratch) {
  float ss = 0.f;
  for (int64_t i = threadIdx.x; i < width; i += blockDim.x) ss += xr[i] * xr[i];
  ss = block_sum(ss, scratch);
  return 1.0f / sqrtf(ss / static_cast<float>(width) + eps);
}

__global__ void rmsnorm_kernel(const float* x, const float* weight, float* y, int64_t dim, float eps) {
  pdl_entry();  // see launch_kernel
  __shared__ float scratch[32];
  const float* xr = x + blockIdx.x * dim;
  float* yr = y + blockIdx.x * dim;
  const float inv = row_inv_rms(xr, dim, eps, scratch);
  for (int64_t i = threadIdx.x; i < dim; i += blockDim.x) {
    yr[i] = weight != nullptr ? weight[i] * (xr[i] * inv) : xr[i] * inv;
  }
}

__global__ void rope_kernel(float* x, int64_t rows, int heads, int64_t head_dim, RopeTable rope,
                            const int64_t* positions, bool inverse) {
  pdl_entry();  // see launch_kernel
  const int64_t half = rope.rope_dim / 2;
  const int64_t total = rows * heads * half;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t pair = i % half, rh = i / half, row = rh / heads;
    float* slice = x + rh * head_dim + (head_dim - rope.rope_dim);
    const float angle = rope.inv_freq[pair] * static_cast<float>(positions[row]);
    rope_pair<true>(slice[2 * pair], slice[2 * pair + 1], angle, rope.scale, inverse);
  }
}

// rmsnorm_kernel over each head row of x [rows, heads, head_dim] (block = head row), then RoPE on the
// row's trailing rope_dim channels as rope_kernel turns them: the same sums in the same order and the
// same products, so y holds the bits of rmsnorm() then rope() (checked bit for bit in the backend
// tests), in one launch instead of two.
__global__ void rmsnorm_rope_kernel(const float* x, const float* weight, float* y, int64_t dim, float eps, int heads,
                                    RopeTable rope, const int64_t* positions) {
  pdl_entry();  // see launch_kernel
  __shared__ float scratch[32];
  const float* xr = x + blockIdx.x * dim;
  float* yr = y + blockIdx.x * dim;
  const float inv = row_inv_rms(xr, dim, eps, scratch);
  const int64_t plain = dim - rope.rope_dim;
  auto normed = [&](int64_t i) { return weight != nullptr ? weight[i] * (xr[i] * inv) : xr[i] * inv; };
  for (int64_t i = threadIdx.x; i < plain; i += blockDim.x) yr[i] = normed(i);
  const float pos = static_cast<float>(positions[blockIdx.x / static_cast<unsigned>(heads)]);
  for (int64_t pair = threadIdx.x; pair < rope.rope_dim / 2; pair += blockDim.x) {
    float a = normed(plain + 2 * pair), b = normed(plain + 2 * pair + 1);
    rope_pair<true>(a, b, rope.inv_freq[pair] * pos, rope.scale, false);
    yr[plain + 2 * pair] = a;
    yr[plain + 2 * pair + 1] = b;
  }
}

__global__ void position_bias_kernel(float* x, int64_t rows, int64_t dim, const int64_t* positions, const float* bias,
                                     int64_t period) {
  pdl_entry();  // see launch_kernel
  const int64_t r = blockIdx.x;
  const float* b = bias + (positions[r] % period) * dim;
  for (int64_t i = threadIdx.x; i < dim; i += blockDim.x) x[r * dim + i] += b[i];
}

__global__ void copy_rows_kernel(float* const* dst, const float* const* src, int64_t n) {
  pdl_entry();  // see launch_kernel
  float* d = dst[blockIdx.x];
  const float* s = src[blockIdx.x];
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) d[i] = s[i];
}

// The embedding kernels: CTA b takes row b / chunks, its columns [(b % chunks) * blockDim, +blockDim), an
// element a thread, so that every load of a row is in flight at once (a CTA a row looping over the columns
// waited for each load before the next: 10.9 us for one row of 4,096 under ncu, run 50).
template <class WT>
__global__ void embed_kernel(const WT* table, int64_t cols, const int32_t* ids, int copies, int64_t chunks,
                             float* out) {
  pdl_entry();  // see launch_kernel
  const int64_t r = blockIdx.x / chunks, i = (blockIdx.x % chunks) * blockDim.x + threadIdx.x;
  if (i >= cols) return;
  const float v = to_f32(table[static_cast<int64_t>(ids[r]) * cols + i]);
  for (int c = 0; c < copies; ++c) out[(r * copies + c) * cols + i] = v;
}

// Rows of an FP8 / FP4 table (code * scale).
__global__ void embed_quantized_kernel(const uint8_t* codes, bool fp4, int64_t cols, QuantLayout q, const int32_t* ids,
                                       int copies, int64_t chunks, float* out) {
  pdl_entry();  // see launch_kernel
  const int64_t r = blockIdx.x / chunks, i = (blockIdx.x % chunks) * blockDim.x + threadIdx.x;
  if (i >= cols) return;
  const float v = quantized_value(codes, fp4, ids[r], i, cols, q);
  for (int c = 0; c < copies; ++c) out[(r * copies + c) * cols + i] = v;
}

__global__ void gather_rows_kernel(const float* x, int64_t dim, const int64_t* index, float* out) {
  pdl_entry();  // see launch_kernel
  const float* s = x + index[blockIdx.x] * dim;
  for (int64_t i = threadIdx.x; i < dim; i += blockDim.x) out[blockIdx.x * dim + i] = s[i];
}

__device__ __forceinline__ float swiglu1(float g, float u, float limit) {
  const float gv = fminf(g, limit);
  const float uv = fminf(fmaxf(u, -limit), limit);
  return gv / (1.0f + expf(-gv)) * uv;
}

__global__ void swiglu_kernel(const float* g, const float* u, float* y, int64_t n, float limit) {
  pdl_entry();  // see launch_kernel
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    y[i] = swiglu1(g[i], u[i], limit);
  }
}

__global__ void add_kernel(float* y, const float* x, int64_t n) {
  pdl_entry();  // see launch_kernel
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    y[i] += x[i];
  }
}

// The split GEMMs' sums (see SplitSums): segment j's elements are i in [start[j], start[j + 1]) of the call's
// range, y[j][at] = parts[j][at] + parts[j][n_j + at] (+ beta y[j][at]; unread when beta is 0), at = i -
// start[j], n_j = start[j + 1] - start[j].
__global__ void add_split_products_kernel(const SplitSums s) {
  pdl_entry();  // see launch_kernel
  const int64_t total = s.start[s.count];
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    int j = 0;
    while (i >= s.start[j + 1]) ++j;
    const int64_t at = i - s.start[j], n = s.start[j + 1] - s.start[j];
    const float v = s.parts[j][at] + s.parts[j][n + at];
    s.y[j][at] = s.beta == 0.f ? v : v + s.beta * s.y[j][at];
  }
}

template <class HT>
__device__ __forceinline__ HT round_half(float v) {
  if constexpr (std::is_same_v<HT, __half>) {
    return __float2half_rn(v);
  } else {
    return __float2bfloat16_rn(v);
  }
}

// out[i] = half(v); lo[i] (when lo is given) = half(v - out[i]): the two terms of a split product.
template <class HT>
__device__ __forceinline__ void store_half_split(float v, HT* out, HT* lo, int64_t i) {
  const HT h = round_half<HT>(v);
  out[i] = h;
  if (lo != nullptr) lo[i] = round_half<HT>(v - static_cast<float>(h));
}

// out = half(x); lo (when given) = half(x - out).
template <class HT>
__global__ void to_half_kernel(const float* x, int64_t n, HT* out, HT* lo) {
  pdl_entry();  // see launch_kernel
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    store_half_split(x[i], out, lo, i);
  }
}

unsigned grid_for(int64_t n, int threads = 256) {
  return static_cast<unsigned>(std::clamp<int64_t>(ceil_div(n, threads), 1, 65536));
}

// ---- mHC ---------------------------------------------------------------------------
constexpr int kMaxHc = 8;

__device__ __forceinline__ float sigmoidf(float x) { return 1.0f / (1.0f + expf(-x)); }

// HC = p.hc as a compile-time constant: the Sinkhorn matrix stays in registers
// (with a run-time hc it went to local memory, and the one thread that runs the
// 20 iterations took ~30 us a call, most of an mHC step at batch 1).
// comb = Sinkhorn(softmax_rows(z)) for z[e] = logits[e] * inv * scale + base[e], e < hc * hc,
// by one warp (every lane calls it): lane l holds entries l and l + 32 and reads the
// others by shuffles; every sum runs in the serial form's order (rows then columns,
// index ascending), so the result is the same as one thread's loops.
template <int HC>
__device__ __forceinline__ void sinkhorn_warp(const float* logits, float inv, float scale, const float* base,
                                              const MhcParams& p, float* comb) {
  constexpr int hc = HC;
  constexpr int K = (HC * HC + 31) / 32;  // entries a lane holds
  const int lane = threadIdx.x & 31;
  bool own[K];
  int a[K], b[K];
  float v[K], nv[K];
#pragma unroll
  for (int k = 0; k < K; ++k) {
    const int e = lane + 32 * k;
    own[k] = e < hc * hc;
    a[k] = own[k] ? e / hc : 0;
    b[k] = own[k] ? e % hc : 0;
    v[k] = own[k] ? logits[e] * inv * scale + base[e] : 0.f;
  }
  const auto entry = [&](int i) {
    float x = 0.f;
#pragma unroll
    for (int k = 0; k < K; ++k) {
      const float y = __shfl_sync(0xffffffffu, v[k], i & 31);
      if (i >> 5 == k) x = y;
    }
    return x;
  };
#pragma unroll
  for (int k = 0; k < K; ++k) {  // softmax over each row
    float mx = -INFINITY;
    for (int j = 0; j < hc; ++j) mx = fmaxf(mx, entry(a[k] * hc + j));
    float sum = 0.f;
    for (int j = 0; j < hc; ++j) sum += expf(entry(a[k] * hc + j) - mx);
    nv[k] = expf(v[k] - mx) / sum + p.hc_eps;
  }
#pragma unroll
  for (int k = 0; k < K; ++k) v[k] = nv[k];
  const auto normalise = [&](bool by_column) {
#pragma unroll
    for (int k = 0; k < K; ++k) {
      float s = 0.f;
      for (int j = 0; j < hc; ++j) s += entry(by_column ? j * hc + b[k] : a[k] * hc + j);
      nv[k] = v[k] / (s + p.hc_eps);
    }
#pragma unroll
    for (int k = 0; k < K; ++k) v[k] = nv[k];
  };
  normalise(true);
  for (int it = 0; it < p.sinkhorn_iters - 1; ++it) {
    normalise(false);
    normalise(true);
  }
#pragma unroll
  for (int k = 0; k < K; ++k) {
    if (own[k]) comb[lane + 32 * k] = v[k];
  }
}

template <int HC>
__global__ void mhc_pre_kernel(const float* X, const float* mix, const float* base, const float* scale, MhcParams p,
                               float* y, float* post, float* comb) {
  pdl_entry();  // see launch_kernel
  __shared__ float scratch[32];
  __shared__ float pre[kMaxHc];
  constexpr int hc = HC;
  const int64_t r = blockIdx.x;
  const float* xr = X + r * hc * p.dim;
  const float inv = row_inv_rms(xr, hc * p.dim, p.norm_eps, scratch);
  if (threadIdx.x == 0) {
    const int n_mix = (2 + hc) * hc;
    const float* m = mix + r * n_mix;
    for (int j = 0; j < hc; ++j) pre[j] = sigmoidf(m[j] * inv * scale[0] + base[j]) + p.hc_eps;
    for (int j = 0; j < hc; ++j) post[r * hc + j] = 2.0f * sigmoidf(m[hc + j] * inv * scale[1] + base[hc + j]);
  }
  if (threadIdx.x < 32) {
    sinkhorn_warp<HC>(mix + r * (2 + hc) * hc + 2 * hc, inv, scale[2], base + 2 * hc, p, comb + r * hc * hc);
  }
  __syncthreads();
  for (int64_t i = threadIdx.x; i < p.dim; i += blockDim.x) {
    float acc = 0.f;
    for (int j = 0; j < hc; ++j) acc += pre[j] * xr[j * p.dim + i];
    y[r * p.dim + i] = acc;
  }
}

__global__ void mhc_head_kernel(const float* X, const float* mix, const float* base, const float* scale, MhcParams p,
                                float* y) {
  pdl_entry();  // see launch_kernel
  __shared__ float scratch[32];
  __shared__ float pre[kMaxHc];
  const int hc = p.hc;
  const int64_t r = blockIdx.x;
  const float* xr = X + r * hc * p.dim;
  const float inv = row_inv_rms(xr, hc * p.dim, p.norm_eps, scratch);
  if (threadIdx.x < hc) pre[threadIdx.x] = sigmoidf(mix[r * hc + threadIdx.x] * inv * scale[0] + base[threadIdx.x]) + p.hc_eps;
  __syncthreads();
  for (int64_t i = threadIdx.x; i < p.dim; i += blockDim.x) {
    float acc = 0.f;
    for (int j = 0; j < hc; ++j) acc += pre[j] * xr[j * p.dim + i];
    y[r * p.dim + i] = acc;
  }
}

// ---- mHC, fused (rows of X read once, many blocks) ------------------------------------
// The unfused form above runs the mix GEMV (24 rows of fn: few blocks), then one
// block per row that re-reads the 16K-wide X row for its RMS, runs the Sinkhorn in
// one thread and re-reads X for y: ~40 us a call at batch 1, far over its bytes.
// Here kernel 1 splits the width into slices of kMixSlice columns, one block per
// (slice, tile of M rows): each block stages its X slice in shared memory and
// writes, per row, the slice's share of every mix dot and of the sum of squares.
// Kernel 2 (a block per row) sums the slices in order, runs the Sinkhorn with one
// thread per matrix entry (the same operations in the same order as the serial
// form) and forms y from X (now in L2). The per-row arithmetic does not depend on
// how many rows run together (M only shares the weight loads).
constexpr int kMixThreads = 256;
constexpr int kMixSlice = 512;  // columns of X per block of kernel 1

// partial[(row * slices + s) * (n_mix + 1) + j]: slice s's share of fn row j . X row
// (j < n_mix) and of X row's sum of squares (j = n_mix).
template <class WT, int M>
__global__ void __launch_bounds__(kMixThreads)
    mhc_mix_kernel(const float* X, int64_t rows, int64_t width, const WT* __restrict__ fn, int n_mix, float* partial) {
  // pdl-prologue: fn (the warp's first fn rows are requested before pdl_entry: no kernel writes them)
  constexpr int VEC = WLoad<WT>::kVec;
  constexpr int CPL = kMixSlice / (32 * VEC);  // 16-byte weight chunks per lane and fn row
  constexpr int kWarps = kMixThreads / 32;
  static_assert(M <= kWarps, "one warp per row for the sum of squares");
  const int s = static_cast<int>(blockIdx.x), slices = static_cast<int>(gridDim.x);
  const int64_t c0 = static_cast<int64_t>(s) * kMixSlice;
  const int len = width - c0 < kMixSlice ? static_cast<int>(width - c0) : kMixSlice;  // a multiple of 4
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  // Warp w takes fn rows w, w + kWarps, ... two at a time (their loads in flight together).
  const auto load_rows = [&](int j0, uint4 (&raw)[2][CPL]) {
#pragma unroll
    for (int u = 0; u < 2; ++u) {
      const int j = j0 + u * kWarps;
#pragma unroll
      for (int q = 0; q < CPL; ++q) {
        const int col = (lane + 32 * q) * VEC;
        raw[u][q] = j < n_mix && col < len ? ld_stream(fn + static_cast<int64_t>(j) * width + c0 + col)
                                           : make_uint4(0u, 0u, 0u, 0u);
      }
    }
  };
  uint4 first[2][CPL];
  load_rows(warp, first);
  pdl_entry();  // see launch_kernel
  __shared__ __align__(16) float xs[M][kMixSlice];
  const int64_t r0 = static_cast<int64_t>(blockIdx.y) * M;
  const int mh = rows - r0 < M ? static_cast<int>(rows - r0) : M;
  for (int i = threadIdx.x; i < M * (kMixSlice / 4); i += kMixThreads) {
    const int mm = i / (kMixSlice / 4), c = (i % (kMixSlice / 4)) * 4;
    float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
    if (mm < mh && c < len) v = *reinterpret_cast<const float4*>(X + (r0 + mm) * width + c0 + c);
    *reinterpret_cast<float4*>(&xs[mm][c]) = v;
  }
  __syncthreads();
  const int stride = n_mix + 1;
  if (warp < mh) {
    float ss = 0.f;
    for (int c = lane; c < kMixSlice; c += 32) ss = fmaf(xs[warp][c], xs[warp][c], ss);
    ss = warp_sum(ss);
    if (lane == 0) partial[((r0 + warp) * slices + s) * stride + n_mix] = ss;
  }
  const auto rows_times_x = [&](int j0, const uint4 (&raw)[2][CPL]) {
    float acc[2][M];
#pragma unroll
    for (int u = 0; u < 2; ++u)
#pragma unroll
      for (int mm = 0; mm < M; ++mm) acc[u][mm] = 0.f;
#pragma unroll
    for (int q = 0; q < CPL; ++q) {
      const int col = (lane + 32 * q) * VEC;
      float wf[2][VEC];
#pragma unroll
      for (int u = 0; u < 2; ++u) WLoad<WT>::cvt(raw[u][q], wf[u]);
#pragma unroll
      for (int mm = 0; mm < M; ++mm) {
        float xv[VEC];
#pragma unroll
        for (int h = 0; h < VEC / 4; ++h) {
          const float4 t = *reinterpret_cast<const float4*>(&xs[mm][col + 4 * h]);
          xv[4 * h] = t.x;
          xv[4 * h + 1] = t.y;
          xv[4 * h + 2] = t.z;
          xv[4 * h + 3] = t.w;
        }
#pragma unroll
        for (int u = 0; u < 2; ++u)
#pragma unroll
          for (int i = 0; i < VEC; ++i) acc[u][mm] = fmaf(wf[u][i], xv[i], acc[u][mm]);
      }
    }
#pragma unroll
    for (int u = 0; u < 2; ++u) {
      const int j = j0 + u * kWarps;
#pragma unroll
      for (int mm = 0; mm < M; ++mm) {
        const float v = warp_sum(acc[u][mm]);
        if (lane == 0 && j < n_mix && mm < mh) partial[((r0 + mm) * slices + s) * stride + j] = v;
      }
    }
  };
  if (warp < n_mix) rows_times_x(warp, first);
  for (int j0 = warp + 2 * kWarps; j0 < n_mix; j0 += 2 * kWarps) {
    uint4 raw[2][CPL];
    load_rows(j0, raw);
    rows_times_x(j0, raw);
  }
}

// The mHC finish kernels' shared memory for a row's mix (finish_mix).
template <int HC, bool HEAD>
struct FinishMix {
  static constexpr int kMix = HEAD ? HC : (2 + HC) * HC;
  static constexpr int kSl = 32;  // slices staged in shared memory at a time
  float m[kMix + 1];
  float pre[HC];
  float buf[kSl * (kMix + 1)];
};

// The mix of a row from the mix kernel's partials (summed in slice order: thread j keeps mix j's running sum;
// the loads of a group of slices all in flight together), then pre and (unless HEAD) post. Returns the
// row's 1 / rms; fm.m and fm.pre are set for every thread of the block (ends with a barrier). Every thread
// of the block calls it.
template <int HC, bool HEAD>
__device__ __forceinline__ float finish_mix(const float* partial, int slices, const float* base, const float* scale,
                                            const MhcParams& p, int64_t r, float* post, FinishMix<HC, HEAD>& fm) {
  constexpr int n_mix = FinishMix<HC, HEAD>::kMix, kSl = FinishMix<HC, HEAD>::kSl;
  const int t = threadIdx.x;
  const float* pr = partial + r * slices * (n_mix + 1);
  float run = 0.f;
  for (int k0 = 0; k0 < slices; k0 += kSl) {
    const int nk = slices - k0 < kSl ? slices - k0 : kSl;
    for (int i = t; i < nk * (n_mix + 1); i += blockDim.x) fm.buf[i] = pr[k0 * (n_mix + 1) + i];
    __syncthreads();
    if (t <= n_mix)
      for (int k = 0; k < nk; ++k) run += fm.buf[k * (n_mix + 1) + t];
    __syncthreads();
  }
  if (t <= n_mix) fm.m[t] = run;
  __syncthreads();
  const float inv = 1.0f / sqrtf(fm.m[n_mix] / static_cast<float>(HC * p.dim) + p.norm_eps);
  if (t < HC) {
    fm.pre[t] = sigmoidf(fm.m[t] * inv * scale[0] + base[t]) + p.hc_eps;
    if (!HEAD) post[r * HC + t] = 2.0f * sigmoidf(fm.m[HC + t] * inv * scale[1] + base[HC + t]);
  }
  __syncthreads();  // pre and m are read after it by every warp
  return inv;
}

// One block per row: the mix from the partials, then (HEAD: pre only) pre, post and
// the Sinkhorn-normalised comb, then y = sum_j pre[j] * X[j].
// With `norm`, y is then RMS-normalised (times norm_weight when not null) exactly as
// rmsnorm_kernel does with `norm_threads` threads (the same sums in the same order).
template <int HC, bool HEAD>
__global__ void __launch_bounds__(256)
    mhc_fused_finish_kernel(const float* X, const float* partial, int slices, const float* base, const float* scale,
                            MhcParams p, float* y, float* post, float* comb, bool norm, const float* norm_weight,
                            float norm_eps, int norm_threads) {
  pdl_entry();  // see launch_kernel
  constexpr int hc = HC;
  __shared__ FinishMix<HC, HEAD> fm;
  __shared__ float scratch[32];
  const int64_t r = blockIdx.x;
  const int t = threadIdx.x;
  const float inv = finish_mix(partial, slices, base, scale, p, r, post, fm);
  const float* pre = fm.pre;
  // Warp 0 runs the Sinkhorn normalisation of comb while the other warps form y.
  if constexpr (!HEAD) {
    if ((t >> 5) == 0) sinkhorn_warp<HC>(fm.m + 2 * hc, inv, scale[2], base + 2 * hc, p, comb + r * hc * hc);
  }
  // y = sum_j pre[j] * X[j] on the threads not busy with the warp Sinkhorn.
  const int y0 = HEAD ? 0 : 32;
  const int yn = static_cast<int>(blockDim.x) - y0;
  const float* xr = X + r * hc * p.dim;
  float* yr = y + r * p.dim;
  if (t >= y0) {
    if (p.dim % 4 == 0) {
      for (int64_t i = t - y0; i < p.dim / 4; i += yn) {
        float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
        for (int j = 0; j < hc; ++j) {
          const float4 v = reinterpret_cast<const float4*>(xr + j * p.dim)[i];
          acc.x += pre[j] * v.x;
          acc.y += pre[j] * v.y;
          acc.z += pre[j] * v.z;
          acc.w += pre[j] * v.w;
        }
        reinterpret_cast<float4*>(yr)[i] = acc;
      }
    } else {
      for (int64_t i = t - y0; i < p.dim; i += yn) {
        float acc = 0.f;
        for (int j = 0; j < hc; ++j) acc += pre[j] * xr[j * p.dim + i];
        yr[i] = acc;
      }
    }
  }
  if (!norm) return;
  __syncthreads();  // y of every thread written
  float ss = 0.f;
  if (t < norm_threads)
    for (int64_t i = t; i < p.dim; i += norm_threads) ss += yr[i] * yr[i];
  ss = block_sum(ss, scratch);
  const float inv_y = 1.0f / sqrtf(ss / static_cast<float>(p.dim) + norm_eps);
  __syncthreads();  // every sum read y before it is overwritten
  for (int64_t i = t; i < p.dim; i += blockDim.x) {
    yr[i] = norm_weight != nullptr ? norm_weight[i] * (yr[i] * inv_y) : yr[i] * inv_y;
  }
}

// mhc_finish_rows_kernel's y threads (a Sinkhorn warp beside them unless HEAD), and the largest row
// (hc x dim floats) it stages in shared memory (Flash 4 x 4,096: 64 KB; 4 x 7,168: 112 KB).
constexpr int kFinishYThreads = 512;
constexpr size_t kFinishStageBytes = 128 * 1024;
constexpr int kFinishWPre = 4;  // norm-weight float4s a thread requests before the mix (dim <= 8,192)

// The y threads' sum with named barrier 1 (the Sinkhorn warp runs on): block_sum's order over those
// threads, so the same bits as block_sum in a block of nt <= 256 threads whose others hold 0 (the
// butterfly adds exact zeros for the warps past nt).
__device__ __forceinline__ float y_threads_sum(float v, float* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  v = warp_sum(v);
  if (lane == 0) scratch[warp] = v;
  asm volatile("bar.sync 1, %0;" ::"n"(kFinishYThreads) : "memory");
  const float t = lane < kFinishYThreads / 32 ? scratch[lane] : 0.f;
  return warp_sum(t);
}

// mhc_fused_finish_kernel's work for rows whose dim is a multiple of 4: one block a row. The y threads
// request the row's X (staged: cp.async into shared memory, every copy in flight at once) and their
// norm-weight float4s, then the block sums the mix from the partials (pre, post); for !HEAD an extra warp
// (threads kFinishYThreads ..) then runs the Sinkhorn of comb, joining no barrier after the mix. y is
// formed a float4 a thread (each element's sum in j order, as before) into shared memory, its sum of
// squares taken by threads 0 .. nt-1 (nt: rmsnorm_kernel's block size for the dim) over i = t, t + nt, ...
// in rmsnorm_kernel's order, and written (normalised with `norm`) a float4 a thread. Same bits as
// mhc_fused_finish_kernel. Run 49 (H100, batch 1, 4 x 4,096): the first form (256 threads, y elements
// t + 256c in registers, X from global memory) ran one round trip to X an element (ptxas kept each
// element's loads behind its bounds test) and ~2,000 dependent instructions a warp: 10.1 us a call under
// ncu; staging X alone: 8.5.
template <int HC, bool HEAD>
__global__ void __launch_bounds__(kFinishYThreads + 32, 1)
    mhc_finish_rows_kernel(const float* X, const float* partial, int slices, const float* base, const float* scale,
                           MhcParams p, float* y, float* post, float* comb, bool norm, const float* norm_weight,
                           float norm_eps, int nt, bool staged) {
  pdl_entry();  // see launch_kernel
  constexpr int hc = HC;
  __shared__ FinishMix<HC, HEAD> fm;
  __shared__ float scratch[32];
  extern __shared__ float4 fin_smem[];  // staged: the row's X [hc][dim], y then in its first dim; else y [dim]
  float* xs = reinterpret_cast<float*>(fin_smem);
  const int64_t r = blockIdx.x;
  const int t = threadIdx.x;
  const int64_t dim = p.dim, d4 = dim / 4;
  const float* xr = X + r * hc * dim;
  const bool ythread = t < kFinishYThreads;
  if (staged && ythread) {
    for (int64_t i = t; i < hc * d4; i += kFinishYThreads) cp_async16(xs + 4 * i, xr + 4 * i, true);
    cp_async_commit();
  }
  const bool scaled = norm && norm_weight != nullptr;
  float4 wv[kFinishWPre];
#pragma unroll
  for (int c = 0; c < kFinishWPre; ++c) {
    const int64_t i = t + static_cast<int64_t>(kFinishYThreads) * c;
    wv[c] = scaled && ythread && i < d4 ? reinterpret_cast<const float4*>(norm_weight)[i]
                                        : make_float4(1.f, 1.f, 1.f, 1.f);
  }
  const float inv = finish_mix(partial, slices, base, scale, p, r, post, fm);
  if constexpr (!HEAD) {
    if (!ythread) {
      sinkhorn_warp<HC>(fm.m + 2 * hc, inv, scale[2], base + 2 * hc, p, comb + r * hc * hc);
      return;
    }
  }
  float pj[hc];
#pragma unroll
  for (int j = 0; j < hc; ++j) pj[j] = fm.pre[j];
  if (staged) {
    cp_async_wait<0>();
    asm volatile("bar.sync 1, %0;" ::"n"(kFinishYThreads) : "memory");  // every y thread's copies landed
  }
  const float* xsrc = staged ? xs : xr;
  float4* ys4 = reinterpret_cast<float4*>(xs);
  float4* yr4 = reinterpret_cast<float4*>(y + r * dim);
  for (int64_t i = t; i < d4; i += kFinishYThreads) {  // a thread reads and writes only its own column
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
    for (int j = 0; j < hc; ++j) {
      const float4 v = reinterpret_cast<const float4*>(xsrc + j * dim)[i];
      acc.x += pj[j] * v.x;
      acc.y += pj[j] * v.y;
      acc.z += pj[j] * v.z;
      acc.w += pj[j] * v.w;
    }
    if (norm)
      ys4[i] = acc;
    else
      yr4[i] = acc;
  }
  if (!norm) return;
  asm volatile("bar.sync 1, %0;" ::"n"(kFinishYThreads) : "memory");  // y complete in shared memory
  float ss = 0.f;
  if (t < nt)
    for (int64_t i = t; i < dim; i += nt) ss += xs[i] * xs[i];
  ss = y_threads_sum(ss, scratch);
  const float inv_y = 1.0f / sqrtf(ss / static_cast<float>(dim) + norm_eps);
  const auto out = [&](float4 v, float4 w) {
    return scaled ? make_float4(w.x * (v.x * inv_y), w.y * (v.y * inv_y), w.z * (v.z * inv_y), w.w * (v.w * inv_y))
                  : make_float4(v.x * inv_y, v.y * inv_y, v.z * inv_y, v.w * inv_y);
  };
#pragma unroll
  for (int c = 0; c < kFinishWPre; ++c) {
    const int64_t i = t + static_cast<int64_t>(kFinishYThreads) * c;
    if (i < d4) yr4[i] = out(ys4[i], wv[c]);
  }
  for (int64_t i = t + static_cast<int64_t>(kFinishYThreads) * kFinishWPre; i < d4; i += kFinishYThreads)
    yr4[i] = out(ys4[i], scaled ? reinterpret_cast<const float4*>(norm_weight)[i] : make_float4(1.f, 1.f, 1.f, 1.f));
}

// HC = p.hc as a compile-time constant: a thread's hc values of X stay in registers (as a runtime count they
// went to the stack).
template <int HC>
__global__ void mhc_post_kernel(float* X, int64_t rows, const float* f, const float* post, const float* comb,
                                MhcParams p) {
  pdl_entry();  // see launch_kernel
  constexpr int hc = HC;
  const int64_t total = rows * p.dim;
  for (int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; idx < total;
       idx += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = idx / p.dim, i = idx % p.dim;
    float* x = X + r * hc * p.dim;
    float xs[hc];
#pragma unroll
    for (int j = 0; j < hc; ++j) xs[j] = x[j * p.dim + i];
    const float fv = f[r * p.dim + i];
    const float* c = comb + r * hc * hc;
#pragma unroll
    for (int k = 0; k < hc; ++k) {
      float o = post[r * hc + k] * fv;
#pragma unroll
      for (int j = 0; j < hc; ++j) o += c[j * hc + k] * xs[j];
      x[k * p.dim + i] = o;
    }
  }
}

// ---- routing --------------------------------------------------------------------------
// The most experts route_kernel picks by rank (each thread ranks its experts against every other:
// experts^2 / threads comparisons); more take k rounds of a block argmax.
constexpr int kRouteRankMax = 256;

// A CTA a row, blockDim a multiple of 32 (up to 256). Scores, then the k largest keyed scores (score +
// bias), larger first, ties by lower index (the CPU's partial_sort order); hash layers take the table's.
// Up to kRouteRankMax experts each expert's place is its rank (how many keyed scores go before it; NaN
// keys count as -inf, so the ranks are a permutation): one barrier, where the rounds took two a pick
// (run 50, H100: 8.1 us a call under ncu at 16 experts, k = 6, 256 threads). Weights: each pick's
// score over the picks' sum (summed in pick order) times route_scale.
__global__ void route_kernel(const float* logits, int experts, ScoreFn fn, const float* bias, int k,
                             const int64_t* hash_table, const int32_t* ids, float route_scale, int32_t* out_idx,
                             float* out_weight) {
  pdl_entry();  // see launch_kernel
  extern __shared__ float sm[];
  float* score = sm;               // [experts]
  float* keyed = sm + experts;     // [experts]
  __shared__ float scratch[32];
  __shared__ int picked[64];
  __shared__ float picked_score[64];
  __shared__ float best_v[32];
  __shared__ int best_i[32];
  const int64_t r = blockIdx.x;
  const float* lr = logits + r * experts;
  if (fn == ScoreFn::softmax) {
    float mx = -INFINITY;
    for (int e = threadIdx.x; e < experts; e += blockDim.x) mx = fmaxf(mx, lr[e]);
    mx = block_max(mx, scratch);
    float sum = 0.f;
    for (int e = threadIdx.x; e < experts; e += blockDim.x) {
      score[e] = expf(lr[e] - mx);
      sum += score[e];
    }
    sum = block_sum(sum, scratch);
    for (int e = threadIdx.x; e < experts; e += blockDim.x) score[e] /= sum;
  } else if (fn == ScoreFn::sigmoid) {
    for (int e = threadIdx.x; e < experts; e += blockDim.x) score[e] = 1.0f / (1.0f + expf(-lr[e]));
  } else {
    for (int e = threadIdx.x; e < experts; e += blockDim.x) {
      const float sp = lr[e] > 20.0f ? lr[e] : log1pf(expf(lr[e]));
      score[e] = sqrtf(sp);
    }
  }
  if (hash_table != nullptr) {
    __syncthreads();  // score[] complete
    if (threadIdx.x < k) {
      const int e = static_cast<int>(hash_table[static_cast<int64_t>(ids[r]) * k + threadIdx.x]);
      picked[threadIdx.x] = e;
      picked_score[threadIdx.x] = score[e];
    }
  } else if (experts <= kRouteRankMax) {
    for (int e = threadIdx.x; e < experts; e += blockDim.x) {
      const float v = score[e] + (bias != nullptr ? bias[e] : 0.f);
      keyed[e] = v != v ? -INFINITY : v;
    }
    __syncthreads();
    for (int e = threadIdx.x; e < experts; e += blockDim.x) {
      const float v = keyed[e];
      int before = 0;
#pragma unroll 4
      for (int o = 0; o < experts; ++o) {  // the same address in every lane: broadcast reads
        const float w = keyed[o];
        before += (w > v || (w == v && o < e)) ? 1 : 0;
      }
      if (before < k) {
        picked[before] = e;
        picked_score[before] = score[e];
      }
    }
  } else {
    for (int e = threadIdx.x; e < experts; e += blockDim.x) keyed[e] = score[e] + (bias != nullptr ? bias[e] : 0.f);
    __syncthreads();
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = (blockDim.x + 31) >> 5;
    for (int j = 0; j < k; ++j) {
      float bv = -INFINITY;
      int bi = 0x7fffffff;
      for (int e = threadIdx.x; e < experts; e += blockDim.x) {
        bool taken = false;
        for (int q = 0; q < j; ++q) taken |= picked[q] == e;
        if (!taken && (keyed[e] > bv || (keyed[e] == bv && e < bi))) {
          bv = keyed[e];
          bi = e;
        }
      }
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
        const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
        if (ov > bv || (ov == bv && oi < bi)) {
          bv = ov;
          bi = oi;
        }
      }
      if (lane == 0) {
        best_v[warp] = bv;
        best_i[warp] = bi;
      }
      __syncthreads();
      if (threadIdx.x == 0) {
        float v = best_v[0];
        int ix = best_i[0];
        for (int w = 1; w < nwarps; ++w) {
          if (best_v[w] > v || (best_v[w] == v && best_i[w] < ix)) {
            v = best_v[w];
            ix = best_i[w];
          }
        }
        picked[j] = ix;
        picked_score[j] = score[ix];
      }
      __syncthreads();
    }
  }
  __syncthreads();  // picked[], picked_score[] complete
  if (threadIdx.x < k) {  // each writer sums the picks in pick order (the CPU's)
    float sum = 0.f;
    for (int j = 0; j < k; ++j) sum += picked_score[j];
    const int j = static_cast<int>(threadIdx.x);
    out_idx[r * k + j] = picked[j];
    out_weight[r * k + j] = picked_score[j] / (sum + 1e-20f) * route_scale;
  }
}

// ---- MoE ------------------------------------------------------------------------------------
// Expert e's scale layout of gate (0), up (1) or down (2); unused for plain weight types.
__device__ __forceinline__ QuantLayout expert_quant(const ExpertTables& t, int which, int e) {
  QuantLayout q = which == 0 ? t.gate_q : which == 1 ? t.up_q : t.down_q;
  if (t.scales != nullptr) q.scale = t.scales[which * t.experts + e];
  return q;
}
template <class WT>
__global__ void __launch_bounds__(kGemvThreads) moe_gate_up_kernel(const float* x, int64_t dim, const int32_t* idx,
                                                                   int k, ExpertTables t, float limit, float* h) {
  pdl_entry();  // see launch_kernel
  const int64_t p = blockIdx.y;
  const int e = idx[p];
  const int64_t row0 = static_cast<int64_t>(blockIdx.x) * 4;
  const float* xr = x + (p / k) * dim;
  float g, u;
  const bool has_g = gemv_core<WT, 1, 4>(xr, dim, 1, static_cast<const WT*>(t.gate[e]), t.inter, dim, row0, g,
                                         expert_quant(t, 0, e));
  __syncthreads();  // red[] is reused
  const bool has_u = gemv_core<WT, 1, 4>(xr, dim, 1, static_cast<const WT*>(t.up[e]), t.inter, dim, row0, u,
                                         expert_quant(t, 1, e));
  if (has_g && has_u && row0 + threadIdx.x < t.inter) h[p * t.inter + row0 + threadIdx.x] = swiglu1(g, u, limit);
}

template <class WT>
__global__ void __launch_bounds__(kGemvThreads) moe_down_kernel(const float* h, int64_t dim, const int32_t* idx,
                                                                 ExpertTables t, float* ys) {
  pdl_entry();  // see launch_kernel
  const int64_t p = blockIdx.y;
  const int e = idx[p];
  const int64_t row0 = static_cast<int64_t>(blockIdx.x) * 4;
  float v;
  if (gemv_core<WT, 1, 4>(h + p * t.inter, t.inter, 1, static_cast<const WT*>(t.down[e]), dim, t.inter, row0, v,
                          expert_quant(t, 2, e))) {
    if (row0 + threadIdx.x < dim) ys[p * dim + row0 + threadIdx.x] = v;
  }
}

// Rows [m0, m0 + 8) of expert blockIdx.y (sorted pairs xs[offsets[e] ..]) through gate/up.
template <class WT>
__global__ void __launch_bounds__(kGemvThreads) moe_grouped_gate_up_kernel(const float* xs, int64_t dim,
                                                                           const int32_t* counts,
                                                                           const int32_t* offsets, ExpertTables t,
                                                                           float limit, float* h) {
  pdl_entry();  // see launch_kernel
  const int e = blockIdx.y;
  const int64_t m0 = static_cast<int64_t>(blockIdx.z) * kGemvBatchRows;
  const int64_t cnt = counts[e];
  if (m0 >= cnt) return;  // the whole block
  const int mh = static_cast<int>(cnt - m0 < kGemvBatchRows ? cnt - m0 : kGemvBatchRows);
  const int64_t r0 = offsets[e] + m0;
  const int64_t row0 = static_cast<int64_t>(blockIdx.x) * 4;
  float g = 0.f, u = 0.f;
  const bool has_g = gemv_core<WT, kGemvBatchRows, 4>(xs + r0 * dim, dim, mh, static_cast<const WT*>(t.gate[e]),
                                                      t.inter, dim, row0, g, expert_quant(t, 0, e));
  __syncthreads();  // red[] is reused
  const bool has_u = gemv_core<WT, kGemvBatchRows, 4>(xs + r0 * dim, dim, mh, static_cast<const WT*>(t.up[e]),
                                                      t.inter, dim, row0, u, expert_quant(t, 1, e));
  if (has_g && has_u) {
    const int r = threadIdx.x / kGemvBatchRows, mm = threadIdx.x % kGemvBatchRows;
    if (row0 + r < t.inter && mm < mh) h[(r0 + mm) * t.inter + row0 + r] = swiglu1(g, u, limit);
  }
}

template <class WT>
__global__ void __launch_bounds__(kGemvThreads) moe_grouped_down_kernel(const float* h, int64_t dim,
                                                                         const int32_t* counts,
                                                                         const int32_t* offsets, ExpertTables t,
                                                                         float* ys) {
  pdl_entry();  // see launch_kernel
  const int e = blockIdx.y;
  const int64_t m0 = static_cast<int64_t>(blockIdx.z) * kGemvBatchRows;
  const int64_t cnt = counts[e];
  if (m0 >= cnt) return;
  const int mh = static_cast<int>(cnt - m0 < kGemvBatchRows ? cnt - m0 : kGemvBatchRows);
  const int64_t r0 = offsets[e] + m0;
  const int64_t row0 = static_cast<int64_t>(blockIdx.x) * 4;
  float v = 0.f;
  if (gemv_core<WT, kGemvBatchRows, 4>(h + r0 * t.inter, t.inter, mh, static_cast<const WT*>(t.down[e]), dim,
                                       t.inter, row0, v, expert_quant(t, 2, e))) {
    const int r = threadIdx.x / kGemvBatchRows, mm = threadIdx.x % kGemvBatchRows;
    if (row0 + r < dim && mm < mh) ys[(r0 + mm) * dim + row0 + r] = v;
  }
}

__global__ void moe_combine_kernel(const float* ys, const int32_t* inv, const float* weight, int64_t rows, int k,
                                   int64_t dim, int64_t lo_rows, float* out) {
  pdl_entry();  // see launch_kernel
  const int64_t total = rows * dim;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = i / dim, c = i % dim;
    float acc = out[i];
    for (int j = 0; j < k; ++j) {
      const int64_t pair = r * k + j;
      const int64_t pos = inv != nullptr ? inv[pair] : pair;
      const float y = lo_rows > 0 ? ys[pos * dim + c] + ys[(pos + lo_rows) * dim + c] : ys[pos * dim + c];
      acc += weight[pair] * y;
    }
    out[i] = acc;
  }
}

__global__ void moe_sort_kernel(const int32_t* idx, int64_t pairs, int experts, int32_t* counts, int32_t* offsets,
                                int32_t* perm, int32_t* inv, int32_t* rank, int32_t* touched, int entries) {
  pdl_entry();  // see launch_kernel
  extern __shared__ int32_t cur[];  // [experts]
  for (int e = threadIdx.x; e < experts; e += blockDim.x) cur[e] = 0;
  __syncthreads();
  for (int64_t p = threadIdx.x; p < pairs; p += blockDim.x) atomicAdd(&cur[idx[p]], 1);
  __syncthreads();
  if (threadIdx.x == 0) {
    int32_t run = 0, n = 0;
    for (int e = 0; e < experts; ++e) {
      if (counts != nullptr) counts[e] = cur[e];
      offsets[e] = run;
      const int32_t c = cur[e];
      cur[e] = run;
      run += c;
      if (rank != nullptr) {
        rank[e] = c > 0 ? n : -1;
        if (c > 0) touched[n++] = e;
      }
    }
    offsets[experts] = run;
    for (int i = n; rank != nullptr && i < entries; ++i) touched[i] = -1;
  }
  __syncthreads();
  for (int64_t p = threadIdx.x; p < pairs; p += blockDim.x) {
    const int32_t pos = atomicAdd(&cur[idx[p]], 1);
    perm[pos] = static_cast<int32_t>(p);
    if (inv != nullptr) inv[p] = pos;
  }
}

__global__ void moe_gather_kernel(const float* x, int64_t dim, const int32_t* perm, int k, float* xs) {
  pdl_entry();  // see launch_kernel
  const float* s = x + static_cast<int64_t>(perm[blockIdx.x] / k) * dim;
  for (int64_t i = threadIdx.x; i < dim; i += blockDim.x) xs[blockIdx.x * dim + i] = s[i];
}

// ---- the batched MoE's pieces (see dense.hpp) ----
template <class HT>
__global__ void moe_pad_gather_kernel(const float* x, int64_t dim, const int32_t* idx, const int32_t* perm,
                                      const int32_t* offsets, const int32_t* rank, int k, int64_t cap, HT* xh, HT* xl,
                                      int32_t* slot) {
  pdl_entry();  // see launch_kernel
  const int64_t pos = blockIdx.x;  // sorted place
  const int32_t p = perm[pos];
  const int32_t e = idx[p];
  const int64_t row = static_cast<int64_t>(rank[e]) * cap + (pos - offsets[e]);
  if (threadIdx.x == 0) slot[p] = static_cast<int32_t>(row);
  const float* src = x + static_cast<int64_t>(p / k) * dim;
  for (int64_t i = threadIdx.x; i < dim; i += blockDim.x) store_half_split(src[i], xh, xl, row * dim + i);
}

template <class HT>
__global__ void moe_pad_swiglu_kernel(const float* gu, int64_t up_base, int64_t inter, const int32_t* slot,
                                      int64_t lo_rows, float limit, HT* hh, HT* hl) {
  pdl_entry();  // see launch_kernel
  const int64_t row = slot[blockIdx.x];
  const float* g = gu + row * inter;
  const float* u = gu + (up_base + row) * inter;
  for (int64_t i = threadIdx.x; i < inter; i += blockDim.x) {
    const float gv = lo_rows > 0 ? g[i] + g[lo_rows * inter + i] : g[i];
    const float uv = lo_rows > 0 ? u[i] + u[lo_rows * inter + i] : u[i];
    store_half_split(swiglu1(gv, uv, limit), hh, hl, row * inter + i);
  }
}

__global__ void moe_batch_pointers_kernel(int entries, const int32_t* touched, ExpertTables t, int64_t cap,
                                          int64_t dim, int64_t inter, char* xh, float* gu, char* hh, float* ys,
                                          void** ptrs) {
  pdl_entry();  // see launch_kernel
  const int64_t half = 2;  // bytes of a bf16 / f16 value
  const int n = entries;
  for (int i = static_cast<int>(threadIdx.x); i < n; i += static_cast<int>(blockDim.x)) {
    const int32_t e = touched[i];
    const bool real = e >= 0;
    const int64_t in = real ? i : 0;  // a spare entry reads entry 0's rows and writes the spare blocks
    for (int gate_or_up = 0; gate_or_up < 2; ++gate_or_up) {
      const int j = gate_or_up * n + i;
      ptrs[j] = xh + in * cap * dim * half;
      ptrs[2 * n + j] = gu + (real ? j : 2 * n) * cap * inter;
      // one table of void* for cuBLAS's A, B and C arrays (it reads A and B through const pointers)
      ptrs[6 * n + j] = const_cast<void*>((gate_or_up == 0 ? t.gate : t.up)[real ? e : touched[0]]);
    }
    ptrs[4 * n + i] = hh + in * cap * inter * half;
    ptrs[5 * n + i] = ys + (real ? i : n) * cap * dim;
    ptrs[8 * n + i] = const_cast<void*>(t.down[real ? e : touched[0]]);
  }
}

int threads_for(int64_t n) { return static_cast<int>(std::clamp<int64_t>((n + 31) / 32 * 32, 32, 256)); }

}  // namespace

void gemv(const float* x, int64_t ldx, int64_t m, const Weight& w, float* y, int64_t ldy, float beta,
          int64_t group_rows, cudaStream_t s) {
  if (m == 0 || w.rows == 0) return;
  switch (w.type) {
    case WeightType::f32:
      return gemv_typed(x, ldx, m, static_cast<const float*>(w.data), w.rows, w.cols, y, ldy, beta, group_rows, s);
    case WeightType::bf16:
      return gemv_typed(x, ldx, m, static_cast<const __nv_bfloat16*>(w.data), w.rows, w.cols, y, ldy, beta,
                        group_rows, s);
    case WeightType::f16:
      return gemv_typed(x, ldx, m, static_cast<const __half*>(w.data), w.rows, w.cols, y, ldy, beta, group_rows, s);
    case WeightType::e4m3:
      return gemv_typed(x, ldx, m, static_cast<const E4m3Codes*>(w.data), w.rows, w.cols, y, ldy, beta, group_rows, s,
                        quant_layout(w));
    case WeightType::e2m1:
      return gemv_typed(x, ldx, m, static_cast<const E2m1Codes*>(w.data), w.rows, w.cols, y, ldy, beta, group_rows, s,
                        quant_layout(w));
  }
}

bool gemv_takes(const Weight& w, int64_t m, int64_t ldx, const float* x) {
  if (!is_quantized(w.type)) return true;
  const int vec = chunk_values(w.type);
  const int64_t row_bytes = w.type == WeightType::e4m3 ? w.cols : w.cols / 2;
  return m >= 1 && m <= kGemvBatchRows && w.cols % vec == 0 && row_bytes % 16 == 0 && w.block_cols % vec == 0 &&
         ldx % 4 == 0 && reinterpret_cast<uintptr_t>(w.data) % 16 == 0 && reinterpret_cast<uintptr_t>(x) % 16 == 0;
}

__global__ void dequantize_bf16_kernel(const uint8_t* codes, bool fp4, int64_t rows, int64_t cols, QuantLayout q,
                                       __nv_bfloat16* out) {
  pdl_entry();  // see launch_kernel
  const int64_t n = rows * cols;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = i / cols, c = i % cols;
    out[i] = __float2bfloat16(quantized_value(codes, fp4, r, c, cols, q));
  }
}

void dequantize_bf16(const Weight& w, void* out, cudaStream_t s) {
  TROUPE_REQUIRE(is_quantized(w.type), "dequantize_bf16: not a quantized weight");
  const int64_t n = w.rows * w.cols;
  if (n == 0) return;
  const unsigned blocks = static_cast<unsigned>(std::min<int64_t>(ceil_div(n, 256), 4096));
  launch_kernel(dequantize_bf16_kernel, blocks, 256, 0, s, static_cast<const uint8_t*>(w.data),
                w.type == WeightType::e2m1, w.rows, w.cols, quant_layout(w), static_cast<__nv_bfloat16*>(out));
  TROUPE_LAUNCHED();
}

template <class WT>
void gemv_multi_typed(const float* x, int64_t m, int64_t k, const MultiSegments& seg, cudaStream_t s) {
  const dim3 grid(static_cast<unsigned>(seg.cta_end[seg.count - 1]));
  const int mh = static_cast<int>(m);
  if (m == 1) {
    launch_kernel(gemv_multi_kernel<WT, 1>, grid, kGemvThreads, 0, s, x, k, mh, seg);
  } else if (m == 2 || m == 3) {  // exactly m rows, as in gemv_typed
    launch_kernel(m == 2 ? gemv_multi_kernel<WT, 2> : gemv_multi_kernel<WT, 3>, grid, kGemvThreads, 0, s, x, k, mh, seg);
  } else if (m <= kGemvMaxRows) {
    launch_kernel(gemv_multi_kernel<WT, kGemvMaxRows>, grid, kGemvThreads, 0, s, x, k, mh, seg);
  } else {
    launch_kernel(gemv_multi_kernel<WT, kGemvBatchRows>, grid, kGemvThreads, 0, s, x, k, mh, seg);
  }
  TROUPE_LAUNCHED();
}

bool gemv_multi(const float* x, int64_t m, const Weight* w, float* const* y, int count, cudaStream_t s) {
  if (count < 1 || count > kMultiMax || m < 1 || m > kGemvBatchRows) return false;
  for (int i = 0; i < count; ++i) {
    if (is_quantized(w[i].type)) return false;  // one launch per weight (gemv), not this form
  }
  const int64_t k = w[0].cols;
  const int vec = chunk_values(w[0].type);
  if (k % vec != 0 || reinterpret_cast<uintptr_t>(x) % 16 != 0) return false;
  MultiSegments seg{};
  seg.count = count;
  int64_t ctas = 0;
  for (int i = 0; i < count; ++i) {
    if (w[i].type != w[0].type || w[i].cols != k || w[i].rows < 1 || reinterpret_cast<uintptr_t>(w[i].data) % 16 != 0) {
      return false;
    }
    seg.w[i] = w[i].data;
    seg.y[i] = y[i];
    seg.rows[i] = w[i].rows;
    ctas += ceil_div(w[i].rows, 4);
    seg.cta_end[i] = ctas;
  }
  if (ctas > 0x7fffffff) return false;
  switch (w[0].type) {
    case WeightType::f32: gemv_multi_typed<float>(x, m, k, seg, s); break;
    case WeightType::bf16: gemv_multi_typed<__nv_bfloat16>(x, m, k, seg, s); break;
    case WeightType::f16: gemv_multi_typed<__half>(x, m, k, seg, s); break;
    case WeightType::e4m3:
    case WeightType::e2m1:
      TROUPE_REQUIRE(false, "FP8 / FP4 weights are dequantized before they reach this backend");
  }
  return true;
}

void rmsnorm(const float* x, const float* weight, float* y, int64_t rows, int64_t dim, float eps, cudaStream_t s) {
  if (rows == 0) return;
  TROUPE_REQUIRE(rows <= 0x7fffffff, "rmsnorm: too many rows");
  launch_kernel(rmsnorm_kernel, static_cast<unsigned>(rows), threads_for(dim), 0, s, x, weight, y, dim, eps);
  TROUPE_LAUNCHED();
}

void rope(float* x, int64_t rows, int heads, int64_t head_dim, const RopeTable& r, const int64_t* positions,
          bool inverse, cudaStream_t s) {
  const int64_t total = rows * heads * (r.rope_dim / 2);
  if (total == 0) return;
  launch_kernel(rope_kernel, grid_for(total), 256, 0, s, x, rows, heads, head_dim, r, positions, inverse);
  TROUPE_LAUNCHED();
}

void rmsnorm_rope(const float* x, const float* weight, float* y, int64_t rows, int heads, int64_t head_dim, float eps,
                  const RopeTable& r, const int64_t* positions, cudaStream_t s) {
  const int64_t blocks = rows * heads;
  if (blocks == 0) return;
  TROUPE_REQUIRE(blocks <= 0x7fffffff, "rmsnorm_rope: too many rows");
  TROUPE_REQUIRE(r.rope_dim <= head_dim && r.rope_dim % 2 == 0, "rmsnorm_rope: rope_dim must be even and fit the head");
  launch_kernel(rmsnorm_rope_kernel, static_cast<unsigned>(blocks), threads_for(head_dim), 0, s, x, weight, y,
                head_dim, eps, heads, r, positions);
  TROUPE_LAUNCHED();
}

void add_position_bias(float* x, int64_t rows, int64_t dim, const int64_t* positions, const float* bias,
                       int64_t period, cudaStream_t s) {
  if (rows == 0) return;
  launch_kernel(position_bias_kernel, static_cast<unsigned>(rows), threads_for(dim), 0, s, x, rows, dim, positions,
                bias, period);
  TROUPE_LAUNCHED();
}

void copy_rows(float* const* dst, const float* const* src, int64_t count, int64_t n, cudaStream_t s) {
  if (count == 0) return;
  launch_kernel(copy_rows_kernel, static_cast<unsigned>(count), threads_for(n), 0, s, dst, src, n);
  TROUPE_LAUNCHED();
}

void embed(const Weight& table, const int32_t* ids, int64_t rows, int copies, float* out, cudaStream_t s) {
  if (rows == 0 || table.cols == 0) return;
  const int threads = threads_for(table.cols);
  const int64_t chunks = ceil_div(table.cols, threads);
  TROUPE_REQUIRE(rows * chunks <= INT32_MAX, "embed: too many rows for one launch");
  const unsigned grid = static_cast<unsigned>(rows * chunks);
  switch (table.type) {
    case WeightType::f32:
      launch_kernel(embed_kernel<float>, grid, threads, 0, s, static_cast<const float*>(table.data), table.cols, ids,
                    copies, chunks, out);
      break;
    case WeightType::bf16:
      launch_kernel(embed_kernel<__nv_bfloat16>, grid, threads, 0, s, static_cast<const __nv_bfloat16*>(table.data),
                    table.cols, ids, copies, chunks, out);
      break;
    case WeightType::f16:
      launch_kernel(embed_kernel<__half>, grid, threads, 0, s, static_cast<const __half*>(table.data), table.cols, ids,
                    copies, chunks, out);
      break;
    case WeightType::e4m3:
    case WeightType::e2m1:
      launch_kernel(embed_quantized_kernel, grid, threads, 0, s, static_cast<const uint8_t*>(table.data),
                    table.type == WeightType::e2m1, table.cols, quant_layout(table), ids, copies, chunks, out);
      break;
  }
  TROUPE_LAUNCHED();
}

void gather_rows(const float* x, int64_t dim, const int64_t* index, int64_t count, float* out, cudaStream_t s) {
  if (count == 0) return;
  launch_kernel(gather_rows_kernel, static_cast<unsigned>(count), threads_for(dim), 0, s, x, dim, index, out);
  TROUPE_LAUNCHED();
}

void swiglu(const float* g, const float* u, float* y, int64_t n, float limit, cudaStream_t s) {
  if (n == 0) return;
  launch_kernel(swiglu_kernel, grid_for(n), 256, 0, s, g, u, y, n, limit);
  TROUPE_LAUNCHED();
}

void add(float* y, const float* x, int64_t n, cudaStream_t s) {
  if (n == 0) return;
  launch_kernel(add_kernel, grid_for(n), 256, 0, s, y, x, n);
  TROUPE_LAUNCHED();
}

void add_split_products(const SplitSums& sums, cudaStream_t s) {
  TROUPE_REQUIRE(sums.count >= 1 && sums.count <= kMaxSplitSums, "add_split_products: 1 to 8 products");
  const int64_t total = sums.start[sums.count];
  if (total == 0) return;
  launch_kernel(add_split_products_kernel, grid_for(total), 256, 0, s, sums);
  TROUPE_LAUNCHED();
}

void to_half(const float* x, int64_t n, void* out, WeightType type, cudaStream_t s, void* lo) {
  if (n == 0) return;
  by_half_type(type, [&](auto tag) {
    using HT = decltype(tag);
    launch_kernel(to_half_kernel<HT>, grid_for(n), 256, 0, s, x, n, static_cast<HT*>(out), static_cast<HT*>(lo));
  });
  TROUPE_LAUNCHED();
}

void mhc_pre_finish(const float* X, const float* mix, int64_t rows, const float* base, const float* scale,
                    const MhcParams& p, float* y, float* post, float* comb, cudaStream_t s) {
  TROUPE_REQUIRE(p.hc >= 1 && p.hc <= kMaxHc, "mhc: hc_mult must be 1..8");
  if (rows == 0) return;
  static constexpr decltype(&mhc_pre_kernel<1>) kByHc[kMaxHc] = {
      mhc_pre_kernel<1>, mhc_pre_kernel<2>, mhc_pre_kernel<3>, mhc_pre_kernel<4>,
      mhc_pre_kernel<5>, mhc_pre_kernel<6>, mhc_pre_kernel<7>, mhc_pre_kernel<8>};
  launch_kernel(kByHc[p.hc - 1], static_cast<unsigned>(rows), 256, 0, s, X, mix, base, scale, p, y, post, comb);
  TROUPE_LAUNCHED();
}

void mhc_post(float* X, int64_t rows, const float* f, const float* post, const float* comb, const MhcParams& p,
              cudaStream_t s) {
  TROUPE_REQUIRE(p.hc >= 1 && p.hc <= kMaxHc, "mhc: hc_mult must be 1..8");
  if (rows == 0) return;
  static constexpr decltype(&mhc_post_kernel<1>) kPostByHc[kMaxHc] = {
      mhc_post_kernel<1>, mhc_post_kernel<2>, mhc_post_kernel<3>, mhc_post_kernel<4>,
      mhc_post_kernel<5>, mhc_post_kernel<6>, mhc_post_kernel<7>, mhc_post_kernel<8>};
  launch_kernel(kPostByHc[p.hc - 1], grid_for(rows * p.dim), 256, 0, s, X, rows, f, post, comb, p);
  TROUPE_LAUNCHED();
}

void mhc_head_finish(const float* X, const float* mix, int64_t rows, const float* base, const float* scale,
                     const MhcParams& p, float* y, cudaStream_t s) {
  TROUPE_REQUIRE(p.hc >= 1 && p.hc <= kMaxHc, "mhc: hc_mult must be 1..8");
  if (rows == 0) return;
  launch_kernel(mhc_head_kernel, static_cast<unsigned>(rows), 256, 0, s, X, mix, base, scale, p, y);
  TROUPE_LAUNCHED();
}

namespace {
template <class WT>
void mhc_mix_typed(const float* X, int64_t rows, const WT* fn, int64_t n_mix, int64_t width, float* partial,
                   cudaStream_t s) {
  const auto slices = static_cast<unsigned>(ceil_div(width, kMixSlice));
  if (rows == 1) {
    launch_kernel(mhc_mix_kernel<WT, 1>, dim3(slices, 1), kMixThreads, 0, s, X, rows, width, fn,
                  static_cast<int>(n_mix), partial);
  } else {
    const int64_t tiles = ceil_div(rows, 4);
    TROUPE_REQUIRE(tiles <= 65535, "mhc: too many rows");
    launch_kernel(mhc_mix_kernel<WT, 4>, dim3(slices, static_cast<unsigned>(tiles)), kMixThreads, 0, s, X, rows, width,
                  fn, static_cast<int>(n_mix), partial);
  }
  TROUPE_LAUNCHED();
}

template <bool HEAD>
void mhc_fused_finish(const float* X, const float* partial, int64_t rows, int slices, const float* base,
                      const float* scale, const MhcParams& p, float* y, float* post, float* comb, bool norm,
                      const float* norm_weight, float norm_eps, cudaStream_t s) {
  const int nt = threads_for(p.dim);  // rmsnorm_kernel's block size for this dim
  static constexpr decltype(&mhc_fused_finish_kernel<1, HEAD>) kByHc[kMaxHc] = {
      mhc_fused_finish_kernel<1, HEAD>, mhc_fused_finish_kernel<2, HEAD>, mhc_fused_finish_kernel<3, HEAD>,
      mhc_fused_finish_kernel<4, HEAD>, mhc_fused_finish_kernel<5, HEAD>, mhc_fused_finish_kernel<6, HEAD>,
      mhc_fused_finish_kernel<7, HEAD>, mhc_fused_finish_kernel<8, HEAD>};
  static constexpr decltype(&mhc_finish_rows_kernel<1, HEAD>) kRowsByHc[kMaxHc] = {
      mhc_finish_rows_kernel<1, HEAD>, mhc_finish_rows_kernel<2, HEAD>, mhc_finish_rows_kernel<3, HEAD>,
      mhc_finish_rows_kernel<4, HEAD>, mhc_finish_rows_kernel<5, HEAD>, mhc_finish_rows_kernel<6, HEAD>,
      mhc_finish_rows_kernel<7, HEAD>, mhc_finish_rows_kernel<8, HEAD>};
  if (p.hc < 1 || p.hc > kMaxHc) return;
  // mhc_finish_rows_kernel for dims that are a multiple of 4 (y in shared memory, float4 rows and norm weights),
  // X staged where a row fits kFinishStageBytes (TROUPE_MHC_STAGE=0: never); TROUPE_MHC_FINISH=1: the older
  // finish (y and its norm through global memory). Run 47 (H100; the first rows form): the decode step -16 to
  // -18 us at batch 1, -22 to -25 at batch 16.
  static const bool old_finish = env_switch("TROUPE_MHC_FINISH") > 0;
  static const bool may_stage = !env_off("TROUPE_MHC_STAGE");
  const size_t row_bytes = static_cast<size_t>(p.hc * p.dim) * sizeof(float);
  const bool staged = may_stage && row_bytes <= kFinishStageBytes;
  const size_t smem = staged ? row_bytes : static_cast<size_t>(p.dim) * sizeof(float);
  const bool aligned = reinterpret_cast<uintptr_t>(norm_weight) % 16 == 0;  // X and y: checked by mhc_fused
  if (!old_finish && p.dim % 4 == 0 && aligned && smem <= kFinishStageBytes) {
    static const bool attr = [&] {
      for (auto* k : kRowsByHc)
        TROUPE_CUDA(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         static_cast<int>(kFinishStageBytes)));
      return true;
    }();
    (void)attr;
    launch_kernel(kRowsByHc[p.hc - 1], static_cast<unsigned>(rows), HEAD ? kFinishYThreads : kFinishYThreads + 32,
                  smem, s, X, partial, slices, base, scale, p, y, post, comb, norm, norm_weight, norm_eps, nt, staged);
  } else {
    launch_kernel(kByHc[p.hc - 1], static_cast<unsigned>(rows), 256, 0, s, X, partial, slices, base, scale, p, y,
                  post, comb, norm, norm_weight, norm_eps, nt);
  }
  TROUPE_LAUNCHED();
}
}  // namespace

int64_t mhc_fused_workspace(int64_t rows, const Weight& fn, const MhcParams& p) {
  const int vec = chunk_values(fn.type);
  const int64_t width = static_cast<int64_t>(p.hc) * p.dim;
  if (p.hc < 1 || p.hc > kMaxHc || fn.cols != width || width % vec != 0 ||
      reinterpret_cast<uintptr_t>(fn.data) % 16 != 0 || rows < 1 || rows > 65535) {
    return 0;
  }
  return rows * ceil_div(width, kMixSlice) * (fn.rows + 1);
}

bool mhc_fused(const float* X, int64_t rows, const Weight& fn, const float* base, const float* scale,
               const MhcParams& p, bool head, bool norm, const float* norm_weight, float norm_eps, float* y,
               float* post, float* comb, float* workspace, cudaStream_t s) {
  if (rows == 0) return true;
  if (mhc_fused_workspace(rows, fn, p) == 0 || reinterpret_cast<uintptr_t>(X) % 16 != 0 ||
      reinterpret_cast<uintptr_t>(y) % 16 != 0) {
    return false;
  }
  const int64_t n_mix = head ? p.hc : (2 + p.hc) * p.hc;
  TROUPE_REQUIRE(fn.rows == n_mix, "mhc: fn must have (2 + hc) * hc rows (hc for the head)");
  const int64_t width = static_cast<int64_t>(p.hc) * p.dim;
  switch (fn.type) {
    case WeightType::f32: mhc_mix_typed(X, rows, static_cast<const float*>(fn.data), n_mix, width, workspace, s); break;
    case WeightType::bf16:
      mhc_mix_typed(X, rows, static_cast<const __nv_bfloat16*>(fn.data), n_mix, width, workspace, s);
      break;
    case WeightType::f16: mhc_mix_typed(X, rows, static_cast<const __half*>(fn.data), n_mix, width, workspace, s); break;
    case WeightType::e4m3:
    case WeightType::e2m1:
      TROUPE_REQUIRE(false, "FP8 / FP4 weights are dequantized before they reach this backend");
  }
  const int slices = static_cast<int>(ceil_div(width, kMixSlice));
  if (head) {
    mhc_fused_finish<true>(X, workspace, rows, slices, base, scale, p, y, post, comb, norm, norm_weight, norm_eps, s);
  } else {
    mhc_fused_finish<false>(X, workspace, rows, slices, base, scale, p, y, post, comb, norm, norm_weight, norm_eps, s);
  }
  return true;
}

void route(const float* logits, int64_t rows, int experts, ScoreFn fn, const float* bias, int k,
           const int64_t* hash_table, const int32_t* ids, float route_scale, int32_t* out_idx, float* out_weight,
           cudaStream_t s) {
  TROUPE_REQUIRE(k >= 1 && k <= 64 && k <= experts, "route: k must be 1..64 and <= experts");
  TROUPE_REQUIRE(experts <= 16384, "route: too many experts");
  if (rows == 0) return;
  // One warp for every 32 experts, up to 8 (a row of 16 experts on one warp: its barriers cost least).
  const unsigned threads = static_cast<unsigned>(std::min(256, (experts + 31) / 32 * 32));
  launch_kernel(route_kernel, static_cast<unsigned>(rows), threads, static_cast<size_t>(experts) * 8, s, logits,
                experts, fn, bias, k, hash_table, ids, route_scale, out_idx, out_weight);
  TROUPE_LAUNCHED();
}

bool moe_widths_fit(const ExpertTables& t, int64_t dim) {
  const int vec = chunk_values(t.type);
  const bool blocks = !is_quantized(t.type) || (t.gate_q.block_cols % vec == 0 && t.up_q.block_cols % vec == 0 &&
                                                t.down_q.block_cols % vec == 0);
  return dim % vec == 0 && t.inter % vec == 0 && blocks;
}

void moe_pairs(const float* x, int64_t rows, int64_t dim, const int32_t* idx, const float* weight, int k,
               const ExpertTables& t, float limit, float* h, float* ys, float* out, cudaStream_t s) {
  const int64_t pairs = rows * k;
  if (pairs == 0) return;
  TROUPE_REQUIRE(pairs <= 65535, "moe_pairs: too many pairs");
  TROUPE_REQUIRE(moe_widths_fit(t, dim), "moe_pairs: widths must be multiples of 8 (FP8: 16, FP4: 32)");
  const dim3 g1(static_cast<unsigned>(ceil_div(t.inter, 4)), static_cast<unsigned>(pairs));
  const dim3 g2(static_cast<unsigned>(ceil_div(dim, 4)), static_cast<unsigned>(pairs));
  by_weight_type(t.type, [&](auto tag) {
    using WT = decltype(tag);
    launch_kernel(moe_gate_up_kernel<WT>, g1, kGemvThreads, 0, s, x, dim, idx, k, t, limit, h);
    TROUPE_LAUNCHED();
    launch_kernel(moe_down_kernel<WT>, g2, kGemvThreads, 0, s, h, dim, idx, t, ys);
  });
  TROUPE_LAUNCHED();
  moe_combine(ys, nullptr, weight, rows, k, dim, out, s);
}

void moe_grouped(const float* x, int64_t rows, int64_t dim, const int32_t* idx, const float* weight, int k,
                 int experts, const ExpertTables& t, float limit, int32_t* counts, int32_t* offsets, int32_t* perm,
                 int32_t* inv, float* xs, float* h, float* ys, float* out, cudaStream_t s) {
  const int64_t pairs = rows * k;
  if (pairs == 0) return;
  TROUPE_REQUIRE(experts <= 65535, "moe_grouped: too many experts");
  TROUPE_REQUIRE(moe_widths_fit(t, dim), "moe_grouped: widths must be multiples of 8 (FP8: 16, FP4: 32)");
  moe_sort(idx, pairs, experts, counts, offsets, perm, inv, s);
  moe_gather(x, dim, perm, pairs, k, xs, s);
  // An expert serves each row at most once (route picks distinct experts), so at most `rows` rows.
  const unsigned ztiles = static_cast<unsigned>(ceil_div(rows, kGemvBatchRows));
  const dim3 g1(static_cast<unsigned>(ceil_div(t.inter, 4)), static_cast<unsigned>(experts), ztiles);
  const dim3 g2(static_cast<unsigned>(ceil_div(dim, 4)), static_cast<unsigned>(experts), ztiles);
  by_weight_type(t.type, [&](auto tag) {
    using WT = decltype(tag);
    launch_kernel(moe_grouped_gate_up_kernel<WT>, g1, kGemvThreads, 0, s, xs, dim, counts, offsets, t, limit, h);
    TROUPE_LAUNCHED();
    launch_kernel(moe_grouped_down_kernel<WT>, g2, kGemvThreads, 0, s, h, dim, counts, offsets, t, ys);
  });
  TROUPE_LAUNCHED();
  moe_combine(ys, inv, weight, rows, k, dim, out, s);
}

void moe_sort(const int32_t* idx, int64_t pairs, int experts, int32_t* counts, int32_t* offsets, int32_t* perm,
              int32_t* inv, cudaStream_t s, int32_t* rank, int32_t* touched, int entries) {
  launch_kernel(moe_sort_kernel, 1, 1024, static_cast<size_t>(experts) * 4, s, idx, pairs, experts, counts, offsets,
                perm, inv, rank, touched, entries);
  TROUPE_LAUNCHED();
}

void moe_gather(const float* x, int64_t dim, const int32_t* perm, int64_t pairs, int k, float* xs, cudaStream_t s) {
  if (pairs == 0) return;
  launch_kernel(moe_gather_kernel, static_cast<unsigned>(pairs), threads_for(dim), 0, s, x, dim, perm, k, xs);
  TROUPE_LAUNCHED();
}

void moe_pad_gather(const float* x, int64_t dim, const int32_t* idx, const int32_t* perm, const int32_t* offsets,
                    const int32_t* rank, int64_t pairs, int k, int64_t cap, WeightType type, void* xh, void* xl,
                    int32_t* slot, cudaStream_t s) {
  if (pairs == 0) return;
  TROUPE_REQUIRE(pairs <= 2147483647, "moe_pad_gather: too many pairs");
  by_half_type(type, [&](auto tag) {
    using HT = decltype(tag);
    launch_kernel(moe_pad_gather_kernel<HT>, static_cast<unsigned>(pairs), threads_for(dim), 0, s, x, dim, idx, perm,
                  offsets, rank, k, cap, static_cast<HT*>(xh), static_cast<HT*>(xl), slot);
  });
  TROUPE_LAUNCHED();
}

void moe_pad_swiglu(const float* gu, int entries, int64_t cap, int64_t inter, const int32_t* slot, int64_t pairs,
                    int64_t lo_rows, float limit, WeightType type, void* hh, void* hl, cudaStream_t s) {
  if (pairs == 0) return;
  const int64_t up_base = static_cast<int64_t>(entries) * cap;
  by_half_type(type, [&](auto tag) {
    using HT = decltype(tag);
    launch_kernel(moe_pad_swiglu_kernel<HT>, static_cast<unsigned>(pairs), threads_for(inter), 0, s, gu, up_base,
                  inter, slot, lo_rows, limit, static_cast<HT*>(hh), static_cast<HT*>(hl));
  });
  TROUPE_LAUNCHED();
}

void moe_batch_pointers(int entries, const int32_t* touched, const ExpertTables& t, int64_t cap, int64_t dim,
                        int64_t inter, void* xh, float* gu, void* hh, float* ys, void** ptrs, cudaStream_t s) {
  launch_kernel(moe_batch_pointers_kernel, 1, 256, 0, s, entries, touched, t, cap, dim, inter, static_cast<char*>(xh),
                gu, static_cast<char*>(hh), ys, ptrs);
  TROUPE_LAUNCHED();
}

void moe_combine(const float* ys, const int32_t* inv, const float* weight, int64_t rows, int k, int64_t dim, float* out,
                 cudaStream_t s, int64_t lo_rows) {
  if (rows == 0) return;
  launch_kernel(moe_combine_kernel, grid_for(rows * dim), 256, 0, s, ys, inv, weight, rows, k, dim, lo_rows, out);
  TROUPE_LAUNCHED();
}

}  // namespace troupe::kernels::cuda
