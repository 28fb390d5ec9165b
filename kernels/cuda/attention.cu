// Tensor-core sparse attention with sinks (see attention.hpp).
//
// CTA = 8 warps, 64 heads x one key range of one query. Per 32-key tile (its keys copied by
// cp.async while the previous tile is computed, their row pointers a tile earlier still):
//   S phase:  warp w computes S[16 heads (w % 4), all 32 keys] over channel half w / 4;
//   softmax:  4 threads per head row sum the two halves, online max/sum in fp32 (log2
//             domain), P -> bf16;
//   PV phase: warp w accumulates O[64 heads, dim/8 channels (w)] in registers.
// Then O goes through shared memory to 16-byte row stores. Shared-memory rows are padded by
// 16 bytes so ldmatrix phases hit 32 banks.
#include <algorithm>
#include <cstdlib>

#include "kernels/cuda/attention.hpp"
#include "kernels/cuda/common.cuh"

namespace troupe::kernels::cuda {
namespace {

constexpr int kHeads = 64;        // the wide form's heads a CTA
constexpr int kNarrowHeads = 16;  // the narrow form's (few queries: four times the CTAs, a quarter of Q and O each)
constexpr int kKeys = 32;
constexpr int kThreads = 256;
constexpr float kLog2e = 1.4426950408889634f;

struct Params {
  const float* q;
  int64_t n_queries;
  int heads;
  const void* const* rows;
  const int64_t* offsets;
  const float* sinks;
  float qscale;  // scale * log2(e)
  float* out;
  float* part_o;  // [splits, n_queries, heads, dim] (splits > 1)
  float* part_ml; // [splits, n_queries, heads, 2]
  int64_t keys_per_split;
  bool derope;
  RopeTable rope;
  const int64_t* positions;
};

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_u32(p)));
}
__device__ __forceinline__ void ldsm_x4_trans(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_u32(p)));
}
__device__ __forceinline__ void ldsm_x2_trans(uint32_t (&r)[2], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0,%1}, [%2];"
               : "=r"(r[0]), "=r"(r[1])
               : "r"(smem_u32(p)));
}

template <int DIM, bool BF16, int HEADS>
struct Layout {
  static constexpr int kParts = 8 / (HEADS / 16);  // the score phase's channel parts (a warp each per m-tile)
  static constexpr int kRow = DIM + 8;          // bf16 elements per padded row
  static constexpr int kQ = 0;                  // [HEADS][kRow] bf16
  static constexpr int kK = kQ + HEADS * kRow * 2;
  static constexpr int kKBufs = BF16 ? 2 : 1;   // bf16 keys: double buffer; fp32: one + staging
  static constexpr int kStage = kK + kKBufs * kKeys * kRow * 2;  // fp32 staging [32][DIM]
  static constexpr int kS = kStage + (BF16 ? 0 : kKeys * DIM * 4);  // [kParts][HEADS][33] fp32
  static constexpr int kP = kS + kParts * HEADS * 33 * 4;           // [HEADS][40] bf16
  static constexpr int kAlpha = kP + HEADS * 40 * 2;                // [HEADS] fp32
  static constexpr int kML = kAlpha + HEADS * 4;                    // [HEADS][2] fp32
  static constexpr int kPtrs = kML + HEADS * 8;  // [2][32]: the row pointers of the next tile (ring)
  static constexpr int kBytes = kPtrs + 2 * kKeys * 8;
};

// HEADS: 64 (the wide form) or 16 (the narrow form; DIM >= 128).
template <int DIM, bool BF16, int HEADS>
__global__ void __launch_bounds__(kThreads, HEADS == kHeads ? 1 : 2) attention_kernel(const Params p) {
  pdl_entry();  // see launch_kernel
  using L = Layout<DIM, BF16, HEADS>;
  constexpr int kRow = L::kRow;
  constexpr int kNTW = DIM / 64;  // n-tiles (8 channels) per warp in the PV phase
  constexpr int kMT = HEADS / 16;               // m-tiles (16 heads)
  constexpr int kChan = DIM / L::kParts;        // channels of a score-phase warp
  constexpr int kSub = kThreads / HEADS;        // softmax threads a head row
  constexpr int kKPT = kKeys / kSub;            // keys a softmax thread
  static_assert(kChan % 16 == 0 && kKPT % 2 == 0, "the narrow form needs DIM >= 128");
  extern __shared__ __align__(16) uint8_t smem[];
  auto* Qs = reinterpret_cast<__nv_bfloat16*>(smem + L::kQ);
  auto* Ks0 = reinterpret_cast<__nv_bfloat16*>(smem + L::kK);
  auto* stage = reinterpret_cast<float*>(smem + L::kStage);
  auto* Ss = reinterpret_cast<float*>(smem + L::kS);
  auto* Ps = reinterpret_cast<__nv_bfloat16*>(smem + L::kP);
  auto* alpha_s = reinterpret_cast<float*>(smem + L::kAlpha);
  auto* ml_s = reinterpret_cast<float*>(smem + L::kML);
  auto* kptr = reinterpret_cast<const void**>(smem + L::kPtrs);

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int g = lane >> 2, c = lane & 3;
  const int split = blockIdx.x;
  const int64_t t = blockIdx.y;
  const int h0 = blockIdx.z * HEADS;
  const int64_t kbeg = p.offsets[t];
  const int64_t n = p.offsets[t + 1] - kbeg;
  const int64_t beg = static_cast<int64_t>(split) * p.keys_per_split;
  const int64_t end = min(n, beg + p.keys_per_split);
  const int ntiles = end > beg ? static_cast<int>((end - beg + kKeys - 1) / kKeys) : 0;

  // Tile u's row pointers: loaded directly for tile 0, else copied into ring slot u & 1 with the
  // previous tile's keys (so issuing a tile's copies never waits for a global load).
  auto row_ptr = [&](int tile, int r, int64_t t0) -> const void* {
    return tile == 0 ? p.rows[kbeg + t0 + r] : kptr[(tile & 1) * kKeys + r];
  };
  auto issue_tile = [&](int tile, int buf) {
    const int64_t t0 = beg + static_cast<int64_t>(tile) * kKeys;
    if (tid < kKeys) {  // the next tile's row pointers, in this tile's group
      const int64_t i = t0 + kKeys + tid;
      const bool valid = i < end;
      cp_async8(kptr + ((tile + 1) & 1) * kKeys + tid, valid ? static_cast<const void*>(p.rows + kbeg + i)
                                                             : static_cast<const void*>(p.rows), valid);
    }
    if constexpr (BF16) {
      constexpr int kChunks = DIM / 8;  // 16-byte chunks per row
      __nv_bfloat16* Kb = Ks0 + buf * kKeys * kRow;
#pragma unroll
      for (int i = 0; i < kKeys * kChunks / kThreads; ++i) {
        const int q = tid + i * kThreads;
        const int r = q / kChunks, ch = q % kChunks;
        const bool valid = t0 + r < end;
        const auto* src = valid ? static_cast<const __nv_bfloat16*>(row_ptr(tile, r, t0)) + ch * 8
                                : static_cast<const __nv_bfloat16*>(nullptr);
        cp_async16(Kb + r * kRow + ch * 8, valid ? static_cast<const void*>(src) : static_cast<const void*>(p.q), valid);
      }
    } else {
      constexpr int kChunks = DIM / 4;
#pragma unroll 4
      for (int i = 0; i < kKeys * kChunks / kThreads; ++i) {
        const int q = tid + i * kThreads;
        const int r = q / kChunks, ch = q % kChunks;
        const bool valid = t0 + r < end;
        const float* src = valid ? static_cast<const float*>(row_ptr(tile, r, t0)) + ch * 4 : p.q;
        cp_async16(stage + r * DIM + ch * 4, src, valid);
      }
    }
    cp_async_commit();
  };
  if (ntiles > 0) issue_tile(0, 0);

  // Q (scaled into the log2 domain) -> bf16 rows; rows past `heads` are zero. Sixteen
  // 16-byte loads per thread in flight at a time (the loop is latency-bound otherwise).
  constexpr int kQ4 = HEADS * DIM / 4;
  constexpr int kBatch = 16;
  for (int base = 0; base < kQ4; base += kBatch * kThreads) {
    float4 v[kBatch];
#pragma unroll
    for (int j = 0; j < kBatch; ++j) {
      const int i = base + j * kThreads + tid;
      const int r = i / (DIM / 4), c4 = i % (DIM / 4);
      v[j] = (i < kQ4 && h0 + r < p.heads) ? reinterpret_cast<const float4*>(p.q + (t * p.heads + h0 + r) * DIM)[c4]
                                           : make_float4(0.f, 0.f, 0.f, 0.f);
    }
#pragma unroll
    for (int j = 0; j < kBatch; ++j) {
      const int i = base + j * kThreads + tid;
      if (i < kQ4) {
        const int r = i / (DIM / 4), c4 = i % (DIM / 4);
        uint2 packed;
        packed.x = pack_bf16x2(v[j].x * p.qscale, v[j].y * p.qscale);
        packed.y = pack_bf16x2(v[j].z * p.qscale, v[j].w * p.qscale);
        *reinterpret_cast<uint2*>(Qs + r * kRow + 4 * c4) = packed;
      }
    }
  }

  // Softmax state of head row tid / kSub (each of its kSub threads keeps a copy).
  const unsigned utid = static_cast<unsigned>(tid);  // unsigned: / and % by powers of two are shifts and masks
  const int srow = static_cast<int>(utid / kSub), ssub = static_cast<int>(utid % kSub);
  const bool has_sink = p.sinks != nullptr && split == 0 && h0 + srow < p.heads;
  float m_run = has_sink ? p.sinks[h0 + srow] * kLog2e : -INFINITY;
  float l_run = has_sink ? 1.f : 0.f;

  float o[kMT][kNTW][4];
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
    for (int nt = 0; nt < kNTW; ++nt) o[mt][nt][0] = o[mt][nt][1] = o[mt][nt][2] = o[mt][nt][3] = 0.f;

  for (int tile = 0; tile < ntiles; ++tile) {
    cp_async_wait<0>();
    __syncthreads();
    const __nv_bfloat16* Ks;
    if constexpr (BF16) {
      Ks = Ks0 + (tile & 1) * kKeys * kRow;
      if (tile + 1 < ntiles) issue_tile(tile + 1, (tile + 1) & 1);
    } else {
      for (int i = tid; i < kKeys * DIM / 4; i += kThreads) {
        const int r = i / (DIM / 4), c4 = i % (DIM / 4);
        const float4 v = *reinterpret_cast<const float4*>(stage + r * DIM + 4 * c4);
        uint2 packed;
        packed.x = pack_bf16x2(v.x, v.y);
        packed.y = pack_bf16x2(v.z, v.w);
        *reinterpret_cast<uint2*>(Ks0 + r * kRow + 4 * c4) = packed;
      }
      __syncthreads();
      if (tile + 1 < ntiles) issue_tile(tile + 1, 0);
      Ks = Ks0;
    }
    const int64_t remaining = end - (beg + static_cast<int64_t>(tile) * kKeys);
    const int nvalid = remaining < kKeys ? static_cast<int>(remaining) : kKeys;

    // ---- S = Q K^T: warp w takes m-tile w % kMT (16 heads), all 32 keys, channel part w / kMT ----
    // (wide form: 16 x 32 over half the channels, a quarter fewer shared-memory reads than 16 x 16
    // over all of them, which bounded this phase; the parts are summed by the softmax.)
    {
      const unsigned uw = static_cast<unsigned>(warp);
      const int mt = static_cast<int>(uw % kMT), kh = static_cast<int>(uw / kMT);
      float s[4][4] = {};
      const int mi = lane >> 3;
      const __nv_bfloat16* qrow =
          Qs + (16 * mt + (lane & 7) + ((mi & 1) ? 8 : 0)) * kRow + ((mi >> 1) ? 8 : 0) + kh * kChan;
      const __nv_bfloat16* krow = Ks + ((lane & 7) + ((mi >> 1) ? 8 : 0)) * kRow + ((mi & 1) ? 8 : 0) + kh * kChan;
#pragma unroll 4
      for (int ks = 0; ks < kChan / 16; ++ks) {
        uint32_t a[4], b0[4], b1[4];
        ldsm_x4(a, qrow + ks * 16);
        ldsm_x4(b0, krow + ks * 16);
        ldsm_x4(b1, krow + 16 * kRow + ks * 16);
        mma_16816<true>(s[0], a, b0[0], b0[1]);
        mma_16816<true>(s[1], a, b0[2], b0[3]);
        mma_16816<true>(s[2], a, b1[0], b1[1]);
        mma_16816<true>(s[3], a, b1[2], b1[3]);
      }
      float* Sh = Ss + kh * HEADS * 33;
#pragma unroll
      for (int nt = 0; nt < 4; ++nt) {
        const int col = 8 * nt + 2 * c;
        Sh[(16 * mt + g) * 33 + col] = s[nt][0];
        Sh[(16 * mt + g) * 33 + col + 1] = s[nt][1];
        Sh[(16 * mt + g + 8) * 33 + col] = s[nt][2];
        Sh[(16 * mt + g + 8) * 33 + col + 1] = s[nt][3];
      }
    }
    __syncthreads();

    // ---- online softmax: row srow, keys kKPT * ssub ... ----
    {
      float sv[kKPT];
      float mx = -INFINITY;
#pragma unroll
      for (int j = 0; j < kKPT; ++j) {
        const int k = kKPT * ssub + j;
        auto parts_sum = [&] {  // read only for valid keys
          float v = Ss[srow * 33 + k];
#pragma unroll
          for (int part = 1; part < L::kParts; ++part) v += Ss[(part * HEADS + srow) * 33 + k];
          return v;
        };
        sv[j] = k < nvalid ? parts_sum() : -INFINITY;
        mx = fmaxf(mx, sv[j]);
      }
#pragma unroll
      for (int d = 1; d < kSub; d <<= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, d));
      const float m_new = fmaxf(m_run, mx);
      float alpha = 1.f, sum = 0.f;
      uint32_t packed[kKPT / 2];
      if (m_new == -INFINITY) {
#pragma unroll
        for (int j = 0; j < kKPT / 2; ++j) packed[j] = 0u;
      } else {
        alpha = exp2f(m_run - m_new);
        float pv[kKPT];
#pragma unroll
        for (int j = 0; j < kKPT; ++j) {
          pv[j] = exp2f(sv[j] - m_new);
          sum += pv[j];
        }
#pragma unroll
        for (int j = 0; j < kKPT / 2; ++j) packed[j] = pack_bf16x2(pv[2 * j], pv[2 * j + 1]);
      }
#pragma unroll
      for (int d = 1; d < kSub; d <<= 1) sum += __shfl_xor_sync(0xffffffffu, sum, d);
      l_run = l_run * alpha + sum;
      m_run = m_new;
      if constexpr (kKPT == 8) {
        *reinterpret_cast<uint4*>(Ps + srow * 40 + 8 * ssub) = make_uint4(packed[0], packed[1], packed[2], packed[3]);
      } else {
#pragma unroll
        for (int j = 0; j < kKPT / 2; ++j) reinterpret_cast<uint32_t*>(Ps + srow * 40 + kKPT * ssub)[j] = packed[j];
      }
      if (ssub == 0) alpha_s[srow] = alpha;
    }
    __syncthreads();

    // ---- O = O * alpha + P V for channels [warp * dim/8, ...) ----
    {
#pragma unroll
      for (int mt = 0; mt < kMT; ++mt) {
        const float a0 = alpha_s[16 * mt + g], a1 = alpha_s[16 * mt + g + 8];
#pragma unroll
        for (int nt = 0; nt < kNTW; ++nt) {
          o[mt][nt][0] *= a0;
          o[mt][nt][1] *= a0;
          o[mt][nt][2] *= a1;
          o[mt][nt][3] *= a1;
        }
      }
      const int mi = lane >> 3;
      const int cbase = warp * (DIM / 8);
#pragma unroll
      for (int kk = 0; kk < 2; ++kk) {
        uint32_t a[kMT][4];
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt) {
          ldsm_x4(a[mt], Ps + (16 * mt + (lane & 7) + ((mi & 1) ? 8 : 0)) * 40 + 16 * kk + ((mi >> 1) ? 8 : 0));
        }
        const __nv_bfloat16* vrow = Ks + (16 * kk + (lane & 7) + ((mi & 1) ? 8 : 0)) * kRow + cbase;
        if constexpr (kNTW % 2 == 0) {
#pragma unroll
          for (int np = 0; np < kNTW / 2; ++np) {
            uint32_t b[4];
            ldsm_x4_trans(b, vrow + 16 * np + ((mi >> 1) ? 8 : 0));
#pragma unroll
            for (int mt = 0; mt < kMT; ++mt) {
              mma_16816<true>(o[mt][2 * np], a[mt], b[0], b[1]);
              mma_16816<true>(o[mt][2 * np + 1], a[mt], b[2], b[3]);
            }
          }
        } else {
#pragma unroll
          for (int nt = 0; nt < kNTW; ++nt) {
            uint32_t b[2];
            ldsm_x2_trans(b, vrow + 8 * nt);
#pragma unroll
            for (int mt = 0; mt < kMT; ++mt) mma_16816<true>(o[mt][nt], a[mt], b[0], b[1]);
          }
        }
      }
    }
  }

  // ---- epilogue: O (over l when not split) staged in shared memory, then written a row at a time ----
  // Staged so that the stores (and the de-rotation) are one short loop: written from the fragments
  // with the rope inline, the 64 unrolled (m-tile, half, n-tile) steps were ~120 KB of code run
  // once a CTA, and instruction-cache misses took ~half of the kernel's stall samples (ncu, call 2).
  if (ssub == 0) {
    ml_s[2 * srow] = m_run;
    ml_s[2 * srow + 1] = l_run;
  }
  __syncthreads();  // and every warp is done with Qs and Ks, which the staging reuses
  constexpr int kORow = DIM + 8;  // padded: the fragments' float2 stores hit distinct banks
  static_assert(HEADS * kORow * 4 <= L::kS, "the O staging fits under the score tile");
  float* Os = reinterpret_cast<float*>(smem);
  const bool single = gridDim.x == 1;
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int r = 16 * mt + g + 8 * half;
      const float l = ml_s[2 * r + 1];
      const float inv = single ? (l > 0.f ? 1.f / l : 0.f) : 1.f;
#pragma unroll
      for (int nt = 0; nt < kNTW; ++nt) {
        const int col = warp * (DIM / 8) + 8 * nt + 2 * c;
        *reinterpret_cast<float2*>(Os + r * kORow + col) =
            make_float2(o[mt][nt][2 * half] * inv, o[mt][nt][2 * half + 1] * inv);
      }
    }
  }
  __syncthreads();
  const int rows = min(HEADS, p.heads - h0);
  const bool derope = single && p.derope;
  const int64_t pos = derope ? p.positions[t] : 0;
  const int rope_begin = DIM - static_cast<int>(p.rope.rope_dim);
#pragma unroll 1
  for (int i = tid; i < rows * (DIM / 4); i += kThreads) {
    const int r = i / (DIM / 4), col = 4 * (i % (DIM / 4));
    float e[4];
    *reinterpret_cast<float4*>(e) = *reinterpret_cast<const float4*>(Os + r * kORow + col);
    if (derope) {
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const int cc = col + 2 * j;
        if (cc >= rope_begin) {
          rope_pair(e[2 * j], e[2 * j + 1], p.rope.inv_freq[(cc - rope_begin) / 2] * static_cast<float>(pos),
                    p.rope.scale, true);
        }
      }
    }
    const int64_t h = h0 + r;
    float* dst = single ? p.out + (t * p.heads + h) * DIM
                        : p.part_o + ((static_cast<int64_t>(split) * p.n_queries + t) * p.heads + h) * DIM;
    *reinterpret_cast<float4*>(dst + col) = *reinterpret_cast<const float4*>(e);
  }
  if (!single) {
    for (int r = tid; r < rows; r += kThreads) {
      float* ml = p.part_ml + ((static_cast<int64_t>(split) * p.n_queries + t) * p.heads + h0 + r) * 2;
      ml[0] = ml_s[2 * r];
      ml[1] = ml_s[2 * r + 1];
    }
  }
}

// Merges the splits of (query, head): O = sum_s 2^(m_s - M) O_s / sum_s 2^(m_s - M) l_s, a CTA
// each (query, head, column range of `cols`: few queries take the rows in several ranges, so
// that the CTAs fill the device; one query, 64 heads: four of 128 columns).
// The splits' (m, l) into shared memory first, every split's in one round trip (a thread
// a split), M and the denominator by the first warp; then `groups` groups of cols / 4 threads
// each sum every groups-th split's partial row (a float4 of channels a thread,
// kCombineUnroll splits' loads in flight, no branch on loaded data), merged through shared
// memory. groups grows with the splits (a group per kCombineUnroll splits, at most 512
// threads): few splits (many queries) keep small CTAs. (It was a thread a channel pair
// walking the splits, two dependent round trips a split: ~25 of the 60 us of a batch-1
// decode over 8,320 keys in 64 splits.)
constexpr int kCombineMaxThreads = 512;
constexpr int kCombineUnroll = 4;
int combine_groups(int splits, int64_t cols) {
  const int most = std::max<int>(1, kCombineMaxThreads / static_cast<int>(cols / 4));
  return std::clamp<int>(static_cast<int>(ceil_div(splits, kCombineUnroll)), 1, most);
}
// Columns a combine CTA: the row halved while the CTAs would still fit the device twice over (ranges of
// at least 64 columns).
int64_t combine_cols(int64_t rows, int64_t dim) {
  static const int64_t sms = sm_count();
  int64_t cols = dim;
  while (cols % 128 == 0 && rows * (dim / cols) * 2 <= 2 * sms) cols /= 2;
  return cols;
}
size_t combine_smem(int splits, int64_t cols) {
  return (2 * static_cast<size_t>(splits) + 4 + static_cast<size_t>(combine_groups(splits, cols)) * cols) * 4;
}
__global__ void __launch_bounds__(kCombineMaxThreads) combine_kernel(const Params p, int splits, int dim, int cols) {
  pdl_entry();  // see launch_kernel
  extern __shared__ __align__(16) float cs[];  // [splits] m, [splits] l, [groups][cols] sums
  float* m_s = cs;
  float* l_s = cs + splits;
  float* sums = cs + ((2 * splits + 3) & ~3);  // 16-byte aligned
  __shared__ float max_inv[2];
  const int per_group = cols / 4, groups = blockDim.x / per_group;
  const int64_t t = blockIdx.x;
  const int h = blockIdx.y, tid = threadIdx.x, col0 = blockIdx.z * cols;
  auto row = [&](int s) { return (static_cast<int64_t>(s) * p.n_queries + t) * p.heads + h; };
  for (int s = tid; s < splits; s += blockDim.x) {
    const float2 ml = *reinterpret_cast<const float2*>(p.part_ml + row(s) * 2);
    m_s[s] = ml.x;
    l_s[s] = ml.y;
  }
  __syncthreads();
  if (tid < 32) {  // M and 1 / sum_s 2^(m_s - M) l_s, a lane every 32nd split
    float mx = -INFINITY;
    for (int s = tid; s < splits; s += 32) mx = fmaxf(mx, m_s[s]);
#pragma unroll
    for (int d = 16; d > 0; d >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, d));
    float l = 0.f;
    for (int s = tid; s < splits; s += 32) l += m_s[s] > -INFINITY ? exp2f(m_s[s] - mx) * l_s[s] : 0.f;
#pragma unroll
    for (int d = 16; d > 0; d >>= 1) l += __shfl_xor_sync(0xffffffffu, l, d);
    if (tid == 0) {
      max_inv[0] = mx;
      max_inv[1] = l > 0.f ? 1.f / l : 0.f;
    }
  }
  __syncthreads();
  const float mx = max_inv[0], inv = max_inv[1];
  auto weight = [&](int s) { return m_s[s] > -INFINITY ? exp2f(m_s[s] - mx) : 0.f; };
  const int grp = tid / per_group, c4 = tid % per_group;
  float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
  for (int s0 = grp; s0 < splits; s0 += groups * kCombineUnroll) {
    float4 v[kCombineUnroll];
#pragma unroll
    for (int u = 0; u < kCombineUnroll; ++u) {
      const int s = s0 + u * groups;
      v[u] = s < splits ? reinterpret_cast<const float4*>(p.part_o + row(s) * dim + col0)[c4]
                        : make_float4(0.f, 0.f, 0.f, 0.f);
    }
#pragma unroll
    for (int u = 0; u < kCombineUnroll; ++u) {
      const int s = s0 + u * groups;
      const float w = s < splits ? weight(s) : 0.f;
      acc.x = fmaf(w, v[u].x, acc.x);
      acc.y = fmaf(w, v[u].y, acc.y);
      acc.z = fmaf(w, v[u].z, acc.z);
      acc.w = fmaf(w, v[u].w, acc.w);
    }
  }
  reinterpret_cast<float4*>(sums + grp * cols)[c4] = acc;
  __syncthreads();
  const int64_t pos = p.derope ? p.positions[t] : 0;
  const int rope_begin = dim - static_cast<int>(p.rope.rope_dim);
  for (int c = 2 * tid; c < cols; c += 2 * blockDim.x) {
    float x = 0.f, y = 0.f;
    for (int g = 0; g < groups; ++g) {
      x += sums[g * cols + c];
      y += sums[g * cols + c + 1];
    }
    x *= inv;
    y *= inv;
    const int col = col0 + c;
    if (p.derope && col >= rope_begin) {
      rope_pair(x, y, p.rope.inv_freq[(col - rope_begin) / 2] * static_cast<float>(pos), p.rope.scale, true);
    }
    *reinterpret_cast<float2*>(p.out + (t * p.heads + h) * dim + col) = make_float2(x, y);
  }
}

// A call's form and key splits.
struct Plan {
  int heads_cta;  // kHeads (the wide form) or kNarrowHeads
  int splits;
};

// The key splits of one form: the count with the least estimated time, in 1/16 of a wide tile's: waves
// x tiles a split (the wide form one CTA an SM, its shared memory; the narrow form two with bf16 keys,
// one with fp32 keys and their staging; its tile kNarrowTileCost of a wide one's 16: run 26 call 4,
// 64 queries of 640 keys, 20 narrow tiles a CTA at two an SM took 59 us, 10 wide ones 49), plus for the
// combine a tile's time (its launch) and a 16th of one a query-split's 64 heads (their partial rows,
// 256 KB read and written at 64 heads x 512); the fewest on a tie, at least two tiles a split, at most
// 64. The first plan (enough CTAs to fill the device twice) ran 64 queries in three waves: CSA 640 keys
// 114 -> 67 us, HCA 8,320 keys 669 -> 541 us in one; up to 256 splits at one query made the partials
// dominate (HCA 38 -> 53 us).
constexpr int64_t kNarrowTileCost = 12;
Plan plan_form(const AttentionArgs& a, int heads_cta) {
  static const int sms = sm_count();
  const bool narrow = heads_cta == kNarrowHeads;
  const int64_t per_sm = narrow && a.key_type == KeyType::bf16 ? 2 : 1, tile_cost = narrow ? kNarrowTileCost : 16;
  const int64_t blocks = std::max<int64_t>(1, a.n_queries * ceil_div(a.heads, heads_cta));
  const int64_t tiles = std::max<int64_t>(1, ceil_div(a.max_keys, kKeys));
  auto cost = [&](int64_t s) {
    return tile_cost * ceil_div(blocks * s, per_sm * sms) * ceil_div(tiles, s) +
           (s > 1 ? 16 + blocks * s * heads_cta / kHeads : 0);
  };
  if (a.splits > 0) return {heads_cta, a.splits};
  // TROUPE_ATTENTION_SPLITS=N: N splits (at most one a tile) for calls of one query instead of the plan (an
  // A/B switch for batch-1 decode)
  static const int64_t forced = [] {
    const char* e = std::getenv("TROUPE_ATTENTION_SPLITS");
    return e == nullptr ? int64_t{0} : std::clamp<int64_t>(std::atoll(e), 0, 4096);
  }();
  if (forced > 0 && a.n_queries == 1) return {heads_cta, static_cast<int>(std::min(forced, tiles))};
  const int64_t most = std::clamp<int64_t>(ceil_div(tiles, 2), 1, 64);
  int64_t best = 1, best_cost = INT64_MAX;
  for (int64_t s = 1; s <= most; ++s) {
    const int64_t c = cost(s);
    if (c < best_cost) {
      best = s;
      best_cost = c;
    }
  }
  return {heads_cta, static_cast<int>(best)};
}

// The form: AttentionArgs::cta_heads, else TROUPE_ATTENTION_HEADS (16 or 64: an A/B switch), else the
// narrow one where the wide plan's CTAs would fill less than half the device (a tile's time is mostly its
// keys' round trip, not its 64 heads' math, so a lone query wants more CTAs with less each; run 26 call
// 4, one query: CSA 640 keys 17.0 -> 10.4 us, HCA 8,320 keys 29.2 -> 27.2, 34.5 -> 32.2-34.0 with fp32
// keys; with 64 queries the narrow form lost, 49 -> 59 and 367 -> 673 us, where the costs above, which
// overweight the combine, chose it). The narrow form needs dim >= 128.
Plan plan(const AttentionArgs& a) {
  static const int forced = [] {
    const char* e = std::getenv("TROUPE_ATTENTION_HEADS");
    const int v = e == nullptr ? 0 : std::atoi(e);
    return v == kNarrowHeads || v == kHeads ? v : 0;
  }();
  TROUPE_REQUIRE(a.cta_heads == 0 || a.cta_heads == kHeads || a.cta_heads == kNarrowHeads,
                 "attention: cta_heads must be 0 (automatic), 64 or 16");
  const int want = a.cta_heads != 0 ? a.cta_heads : forced;
  if (a.dim < 128 || want == kHeads) return plan_form(a, kHeads);
  if (want == kNarrowHeads) return plan_form(a, kNarrowHeads);
  static const int64_t sms = sm_count();
  const Plan wide = plan_form(a, kHeads);
  const int64_t ctas = a.n_queries * ceil_div(a.heads, kHeads) * wide.splits;
  return 2 * ctas < sms ? plan_form(a, kNarrowHeads) : wide;
}

template <int DIM, bool BF16, int HEADS>
void launch_dim(const Params& p, dim3 grid, cudaStream_t stream) {
  using L = Layout<DIM, BF16, HEADS>;
  static bool attr = [] {
    TROUPE_CUDA(cudaFuncSetAttribute(attention_kernel<DIM, BF16, HEADS>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                     L::kBytes));
    return true;
  }();
  (void)attr;
  launch_kernel(attention_kernel<DIM, BF16, HEADS>, grid, kThreads, L::kBytes, stream, p);
  TROUPE_LAUNCHED();
}

template <bool BF16>
void launch(int64_t dim, int heads_cta, const Params& p, dim3 grid, cudaStream_t stream) {
  if (heads_cta == kNarrowHeads) {
    switch (dim) {
      case 128: return launch_dim<128, BF16, kNarrowHeads>(p, grid, stream);
      case 256: return launch_dim<256, BF16, kNarrowHeads>(p, grid, stream);
      case 512: return launch_dim<512, BF16, kNarrowHeads>(p, grid, stream);
      default: TROUPE_REQUIRE(false, "attention: the 16-head form needs dim 128, 256 or 512");
    }
  }
  switch (dim) {
    case 64: return launch_dim<64, BF16, kHeads>(p, grid, stream);
    case 128: return launch_dim<128, BF16, kHeads>(p, grid, stream);
    case 256: return launch_dim<256, BF16, kHeads>(p, grid, stream);
    case 512: return launch_dim<512, BF16, kHeads>(p, grid, stream);
    default: TROUPE_REQUIRE(false, "attention: dim must be 64, 128, 256 or 512");
  }
}

}  // namespace

size_t attention_workspace_bytes(const AttentionArgs& a) {
  const int splits = plan(a).splits;
  if (splits <= 1) return 0;
  return static_cast<size_t>(splits) * a.n_queries * a.heads * (a.dim + 2) * 4 + 256;
}

void attention(const AttentionArgs& a, void* workspace, cudaStream_t stream) {
  if (a.n_queries == 0) return;
  TROUPE_REQUIRE(a.n_queries <= 65535, "attention: at most 65535 queries per call");
  const Plan pl = plan(a);
  const int heads_cta = pl.heads_cta, splits = pl.splits;
  TROUPE_REQUIRE(splits <= 4096, "attention: at most 4096 key splits");
  Params p{};
  p.q = a.q;
  p.n_queries = a.n_queries;
  p.heads = a.heads;
  p.rows = a.rows;
  p.offsets = a.offsets;
  p.sinks = a.sinks;
  p.qscale = a.scale * kLog2e;
  p.out = a.out;
  p.keys_per_split = splits == 1 ? std::max<int64_t>(a.max_keys, 1) : ceil_div(ceil_div(a.max_keys, splits), kKeys) * kKeys;
  p.derope = a.derope != nullptr;
  if (p.derope) {
    p.rope = *a.derope;
    p.positions = a.positions;
  }
  if (splits > 1) {
    TROUPE_REQUIRE(workspace != nullptr, "attention: split keys need a workspace");
    p.part_o = static_cast<float*>(workspace);
    p.part_ml = p.part_o + static_cast<int64_t>(splits) * a.n_queries * a.heads * a.dim;
  }
  const dim3 grid(static_cast<unsigned>(splits), static_cast<unsigned>(a.n_queries),
                  static_cast<unsigned>(ceil_div(a.heads, heads_cta)));
  if (a.key_type == KeyType::bf16) {
    launch<true>(a.dim, heads_cta, p, grid, stream);
  } else {
    launch<false>(a.dim, heads_cta, p, grid, stream);
  }
  if (splits > 1) {
    const int64_t cols = combine_cols(a.n_queries * a.heads, a.dim);
    launch_kernel(combine_kernel,
                  dim3(static_cast<unsigned>(a.n_queries), static_cast<unsigned>(a.heads),
                       static_cast<unsigned>(a.dim / cols)),
                  static_cast<unsigned>(combine_groups(splits, cols) * (cols / 4)), combine_smem(splits, cols), stream, p,
                  splits, static_cast<int>(a.dim), static_cast<int>(cols));
    TROUPE_LAUNCHED();
  }
}

}  // namespace troupe::kernels::cuda
