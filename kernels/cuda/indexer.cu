// Lightning indexer scoring (see indexer.hpp), and its fused top-k.
//
// Two forms of the tensor-core scoring: the warpgroup form (wgmma, sm_90a; the
// default, below: `indexer_wgmma_kernel` for bf16 keys, `indexer_wgmma_e4m3_kernel`
// for e4m3), which also selects the top k in the same kernel when a call's keys fit
// its CTAs; and the older mma.sync form
// (TROUPE_INDEXER_WGMMA=0), described here: A = the query's heads (4 m-tiles of 16
// heads, all 128 channels, held in registers for the whole scan), B = 8 keys per n-tile.
// The 128 channels are permuted so that one thread's B fragments for all 8
// k-steps are 64 contiguous bytes of a key row (32 for e4m3): every 16-byte
// load of a warp covers 8 rows x 64 contiguous bytes, and the query carries
// the same permutation. Each warp streams its keys through a private
// 4-stage cp.async ring (a thread reads back only what it copied itself,
// so no barriers are needed).
#include <cuda_fp8.h>

#include <algorithm>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/indexer.hpp"
#include "kernels/cuda/select.cuh"
#include "kernels/cuda/topk.hpp"

namespace troupe::kernels::cuda {
namespace {

constexpr int kDim = 128;
constexpr int kWarps = 8;
constexpr int kStages = 6;  // cp.async ring depth per warp (5 stages of 16 keys in flight)
constexpr int kTiles = 2;  // n-tiles (8 keys each) per stage

struct ScoreParams {
  const float* q;
  const float* w;
  int heads;
  float wscale;  // weight_scale * scale
  const uint8_t* keys;
  const float* key_scales;
  const int64_t* key_start;
  const int32_t* page_table;
  int64_t page_stride;
  int page_size;
  const int32_t* n_keys;
  float* scores;
  int64_t score_stride;
};

__device__ __forceinline__ uint32_t e4m3x2_to_f16x2(uint32_t v16) {
  uint32_t r;
  const unsigned short h = static_cast<unsigned short>(v16 & 0xffffu);
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(r) : "h"(h));
  return r;
}

// The e4m3 quantization of a row of 128 (keys by quantize_keys_e4m3, the query by the wgmma kernel's
// kQ8 form: the same numbers either way): scale amax / 448 (1 for a row of zeros), each value times its
// inverse rounded to nearest, saturated.
__device__ __forceinline__ float e4m3_row_scale(float amax) { return amax > 0.f ? amax / 448.f : 1.f; }
__device__ __forceinline__ float abs_max4(float4 v) {
  return fmaxf(fmaxf(fabsf(v.x), fabsf(v.y)), fmaxf(fabsf(v.z), fabsf(v.w)));
}
__device__ __forceinline__ uint32_t pack_e4m3x4(float4 v, float inv) {
  const uint32_t lo = __nv_cvt_float2_to_fp8x2(make_float2(v.x * inv, v.y * inv), __NV_SATFINITE, __NV_E4M3);
  const uint32_t hi = __nv_cvt_float2_to_fp8x2(make_float2(v.z * inv, v.w * inv), __NV_SATFINITE, __NV_E4M3);
  return lo | (hi << 16);
}

__device__ __forceinline__ int64_t key_row(const ScoreParams& p, int b, int64_t s) {
  if (p.page_table != nullptr) {
    const int64_t page = p.page_table[b * p.page_stride + s / p.page_size];
    return page * p.page_size + s % p.page_size;
  }
  return p.key_start[b] + s;
}

// key_row through the page table on the wgmma scans' path: 32-bit division (a sequence is < 2^31
// keys); 0 for keys past the query's n.
__device__ __forceinline__ int64_t paged_row32(const ScoreParams& p, int b, int64_t s, int64_t n) {
  const uint32_t ps = static_cast<uint32_t>(p.page_size), s32 = static_cast<uint32_t>(s);
  return s < n ? static_cast<int64_t>(p.page_table[b * p.page_stride + s32 / ps]) * ps + s32 % ps : 0;
}

// FP8: false = bf16 keys (256-byte rows), true = e4m3 keys (128-byte rows).
template <bool FP8>
__global__ void __launch_bounds__(kWarps * 32, 1) indexer_mma_kernel(const ScoreParams p) {
  pdl_entry();  // see launch_kernel
  constexpr int kLoads = FP8 ? 2 : 4;     // 16-byte loads per thread per n-tile
  constexpr int kRowBytes = FP8 ? 128 : 256;
  extern __shared__ __align__(16) uint8_t smem[];
  const int b = blockIdx.y;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int g = lane >> 2, c = lane & 3;
  const int64_t n = p.n_keys[b];
  const int64_t units = (n + 8 * kTiles - 1) / (8 * kTiles);
  const int64_t gw = static_cast<int64_t>(blockIdx.x) * kWarps + warp;
  const int64_t W = static_cast<int64_t>(gridDim.x) * kWarps;
  uint8_t* ring = smem + warp * (kStages * kTiles * kLoads * 512);
  // The query's heads, staged once per CTA with coalesced loads (rows past `heads` are 0).
  float* qs = reinterpret_cast<float*>(smem + kWarps * (kStages * kTiles * kLoads * 512));
  const float4* qg = reinterpret_cast<const float4*>(p.q + static_cast<int64_t>(b) * p.heads * kDim);
  for (int i = threadIdx.x; i < 64 * kDim / 4; i += kWarps * 32) {
    reinterpret_cast<float4*>(qs)[i] = i < p.heads * kDim / 4 ? qg[i] : make_float4(0.f, 0.f, 0.f, 0.f);
  }
  // Let a dependent top-k (PDL) get resident as this grid drains.
  asm volatile("griddepcontrol.launch_dependents;");
  __syncthreads();
  if (gw >= units) return;

  // Query fragments (A operand), permuted channel order, and the head weights.
  uint32_t qa[4][8][4];
  float wv[4][2];
#pragma unroll
  for (int mt = 0; mt < 4; ++mt) {
    const int r0 = 16 * mt + g, r1 = r0 + 8;
    wv[mt][0] = r0 < p.heads ? p.w[b * p.heads + r0] * p.wscale : 0.f;
    wv[mt][1] = r1 < p.heads ? p.w[b * p.heads + r1] * p.wscale : 0.f;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const int d0 = FP8 ? 64 * (j >> 2) + 16 * c + 4 * (j & 3) : 32 * (j >> 1) + 8 * c + 4 * (j & 1);
      const float4 v0 = *reinterpret_cast<const float4*>(qs + r0 * kDim + d0);
      const float4 v1 = *reinterpret_cast<const float4*>(qs + r1 * kDim + d0);
      if constexpr (FP8) {
        qa[mt][j][0] = pack_f16x2(v0.x, v0.y);
        qa[mt][j][1] = pack_f16x2(v1.x, v1.y);
        qa[mt][j][2] = pack_f16x2(v0.z, v0.w);
        qa[mt][j][3] = pack_f16x2(v1.z, v1.w);
      } else {
        qa[mt][j][0] = pack_bf16x2(v0.x, v0.y);
        qa[mt][j][1] = pack_bf16x2(v1.x, v1.y);
        qa[mt][j][2] = pack_bf16x2(v0.z, v0.w);
        qa[mt][j][3] = pack_bf16x2(v1.z, v1.w);
      }
    }
  }

  auto issue = [&](int stage, int64_t unit) {
#pragma unroll
    for (int t = 0; t < kTiles; ++t) {
      const int64_t s = (unit * kTiles + t) * 8 + g;
      const bool valid = s < n;
      const uint8_t* row = valid ? p.keys + key_row(p, b, s) * kRowBytes : p.keys;
#pragma unroll
      for (int i = 0; i < kLoads; ++i) {
        cp_async16(ring + ((stage * kTiles + t) * kLoads + i) * 512 + lane * 16, row + (valid ? i * 64 + c * 16 : 0),
                   valid);
      }
    }
  };

#pragma unroll
  for (int st = 0; st < kStages - 1; ++st) {
    const int64_t u = gw + st * W;
    if (u < units) issue(st, u);
    cp_async_commit();
  }
  float* out = p.scores + b * p.score_stride;
  for (int64_t it = 0;; ++it) {
    const int64_t u = gw + it * W;
    if (u >= units) break;
    const int64_t un = gw + (it + kStages - 1) * W;
    if (un < units) issue(static_cast<int>((it + kStages - 1) % kStages), un);
    cp_async_commit();
    cp_async_wait<kStages - 1>();
    const int stage = static_cast<int>(it % kStages);
#pragma unroll
    for (int t = 0; t < kTiles; ++t) {
      uint32_t bw[kLoads * 4];
#pragma unroll
      for (int i = 0; i < kLoads; ++i) {
        const uint4 v = *reinterpret_cast<const uint4*>(ring + ((stage * kTiles + t) * kLoads + i) * 512 + lane * 16);
        bw[4 * i + 0] = v.x;
        bw[4 * i + 1] = v.y;
        bw[4 * i + 2] = v.z;
        bw[4 * i + 3] = v.w;
      }
      float acc[4][4];
#pragma unroll
      for (int mt = 0; mt < 4; ++mt) acc[mt][0] = acc[mt][1] = acc[mt][2] = acc[mt][3] = 0.f;
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        uint32_t b0, b1;
        if constexpr (FP8) {
          const uint32_t word = bw[j];  // k-step j: bytes {0,1} -> b0, {2,3} -> b1
          b0 = e4m3x2_to_f16x2(word);
          b1 = e4m3x2_to_f16x2(word >> 16);
        } else {
          b0 = bw[2 * j];
          b1 = bw[2 * j + 1];
        }
#pragma unroll
        for (int mt = 0; mt < 4; ++mt) mma_16816<!FP8>(acc[mt], qa[mt][j], b0, b1);  // e4m3 keys: as f16
      }
      float s0 = 0.f, s1 = 0.f;
#pragma unroll
      for (int mt = 0; mt < 4; ++mt) {
        s0 += wv[mt][0] * fmaxf(acc[mt][0], 0.f) + wv[mt][1] * fmaxf(acc[mt][2], 0.f);
        s1 += wv[mt][0] * fmaxf(acc[mt][1], 0.f) + wv[mt][1] * fmaxf(acc[mt][3], 0.f);
      }
#pragma unroll
      for (int o = 4; o < 32; o <<= 1) {
        s0 += __shfl_xor_sync(0xffffffffu, s0, o);
        s1 += __shfl_xor_sync(0xffffffffu, s1, o);
      }
      if (g == 0) {
        const int64_t key = (u * kTiles + t) * 8 + 2 * c;
        if (key < n) {
          if constexpr (FP8) s0 *= p.key_scales[key_row(p, b, key)];
          out[key] = s0;
        }
        if (key + 1 < n) {
          if constexpr (FP8) s1 *= p.key_scales[key_row(p, b, key + 1)];
          out[key + 1] = s1;
        }
      }
    }
  }
  cp_async_wait<0>();
}

// ---- the warpgroup tensor cores (sm_90a wgmma) ---------------------------------------------
// bf16 keys (indexer_wgmma_kernel): A = the query (64 heads x 128 channels, bf16, in shared memory
// for the whole scan), B = a unit of 64 keys; both K-major in the 128-byte-swizzled layout wgmma
// reads: a 128-channel row is two 128-byte halves, each half of a tile is 64 rows of 128 bytes
// (8-row groups of 1,024 bytes), and row r's 16-byte chunk j of a half sits at chunk j ^ (r % 8).
// Each warpgroup streams its units through a private ring of kBf16Stages units filled by cp.async
// (its 128 threads copy a unit together, so one named barrier a unit), issues 8 wgmma (k = 16 each)
// into 32 fp32 accumulators a thread, and reduces relu(q.k) * w over the heads: within a thread (2
// heads), across the 8 lanes that share a column group (a reduce-scatter of 14 shuffles that leaves
// each lane the sums of two keys), then across the 4 warps in shared memory in a fixed order.
// e4m3 keys (indexer_wgmma_e4m3_kernel): A = the unit of keys in registers, converted to f16 there,
// B = the query (f16) in the same swizzled tile. Warp w of a warpgroup holds keys 16w .. 16w + 15 as
// wgmma's A fragments: lane (g = lane / 4, c = lane % 4) keys 16w + g and 16w + g + 8, channels 2c,
// 2c + 1, 2c + 8, 2c + 9 of every 16. The channels are permuted (the query carries the same
// permutation) so that those are the 16-byte chunks at bytes 16c and 64 + 16c of each of its two key
// rows. Each thread copies its own chunks by cp.async into its warpgroup's ring and reads back only
// those, so the scan has no barrier: wait for the unit's copies, convert, 8 wgmma into 32 fp32
// accumulators (keys x heads 8j + 2c + {0, 1}), relu(q.k) * w summed over the thread's 16 heads,
// then over the 4 lanes of the key (two shuffles), times the key's scale. Until session 15 the e4m3
// keys were B too, converted into a second tile after they landed: three warpgroup barriers, a fence
// and the cross-warp sums a unit, one unit in flight a warpgroup (indexer + top-k at 1M keys x 1:
// ~30 -> ~22 us, docs/kernel-runs/run15-indexer.md). The same register form for bf16 keys measured
// slower (27.7 -> 29.3-30.4 us; its 16 KB units leave one in flight a warpgroup), so bf16 keys stay
// on the shared-memory form.
// e4m3 keys with the query in e4m3 too (IndexerArgs::query_e4m3, the kernel's kQ8: DeepSeek's fp8
// indexer numerics): the same copies and reads, no conversion, 4 wgmma of k = 32 on the fp8 tensor
// cores (twice the f16 rate). Each CTA quantizes the query itself, per head (scale amax / 448, as
// quantize_keys_e4m3), into one 64 x 128-byte swizzled tile; the head's scale joins its weight. For
// step st a thread's A bytes are words 2 st (logical channels 4c .. 4c + 3 of the step) and 2 st + 1
// (16 + 4c ..) of each of its rows' 32 bytes, word m at key byte e4m3_word_channel(c, m); the query's
// tile puts the same physical channels at those logical places.
constexpr int kWgKeys = 64;                  // keys a unit
constexpr int kWgGroups = 4;                 // warpgroups a CTA
constexpr int kTileHalf = 64 * 128;          // one 64-channel half of a 64-row tile, bytes
constexpr int kUnitBytes = 2 * kTileHalf;    // a 64 x 128 16-bit tile (the query, or a unit of bf16 keys)
// Shared memory: the query's tile, the warpgroups' rings, then (fused) the CTA's scores and FuseSmem.
// bf16: a ring of kBf16Stages swizzled units a warpgroup, then the warps' partial sums.
constexpr int kBf16Stages = 2;
constexpr int kBf16Rings = kWgGroups * kBf16Stages * kUnitBytes + kWgGroups * 4 * kWgKeys * 4;
// e4m3: a unit in a warpgroup's ring is each thread's 4 16-byte chunks chunk-major ([chunk][128
// threads]: a warp's copies and reads are conflict-free), then the unit's 64 scales.
// Units a warpgroup's ring holds (one fewer in flight): four with the f16 query, two with the e4m3
// query (measured on an H200, session 24, 1M x 1 scores: four 14.9-15.0 us, three 13.3-13.7, two
// 12.4-12.5, and at batch 32 285 against 290-315 us; five were slower for both query forms; the f16
// query on three: batch 1 -0.7 us but batch 32, where its conversions bind it, +10 %).
template <bool kQ8>
constexpr int kE4m3Stages = kQ8 ? 2 : 4;
constexpr int kE4m3Chunks = 4 * 128 * 16;  // the stage's chunks; its scales follow
constexpr int kE4m3Stage = kE4m3Chunks + kWgKeys * 4;
template <bool kQ8>
constexpr int kE4m3Region = (kE4m3Stages<kQ8> * kE4m3Stage + 1023) / 1024 * 1024;
template <bool kQ8>
constexpr int kE4m3Rings = kWgGroups * kE4m3Region<kQ8>;
template <bool FP8, bool kQ8 = false>
constexpr int kScoreOffset = kUnitBytes + (FP8 ? kE4m3Rings<kQ8> : kBf16Rings);  // the fused form's scores

// The first physical channel of word m (0 .. 7) of lane column c's 32 key bytes (its chunks at bytes 16c
// and 64 + 16c).
__device__ __forceinline__ int e4m3_word_channel(int c, int m) { return 16 * c + 4 * m + (m >= 4 ? 48 : 0); }
__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
// Byte offset of row r's 16-byte chunk j (of its 256 bytes) in a swizzled 64 x 128 tile.
__device__ __forceinline__ int swizzled(int r, int j) {
  return (j >> 3) * kTileHalf + r * 128 + (((j & 7) ^ (r & 7)) << 4);
}
// Shared-memory matrix descriptor: 128-byte swizzle, 1,024 bytes between 8-row groups.
__device__ __forceinline__ uint64_t wgmma_desc(uint32_t addr) {
  return static_cast<uint64_t>((addr & 0x3ffff) >> 4) | (uint64_t{1} << 16) | (uint64_t{1024 >> 4} << 32) |
         (uint64_t{1} << 62);
}
// D (64 x 64 fp32, 32 registers a thread) += A (64 x 16) * B (16 x 64), both from shared memory;
// `accumulate` 0 overwrites D. f16 or bf16 operands.
#define TROUPE_WGMMA_D32                                                                                 \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, " \
  "%22, %23, %24, %25, %26, %27, %28, %29, %30, %31}"
#define TROUPE_WGMMA_OUT32                                                                                \
  "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), \
      "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]),  \
      "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), \
      "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
template <bool kF16>
__device__ __forceinline__ void wgmma_m64n64k16(float (&d)[32], uint64_t a, uint64_t b, int accumulate) {
  if constexpr (kF16) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 " TROUPE_WGMMA_D32
                 ", %32, %33, p, 1, 1, 0, 0;\n}\n"
                 : TROUPE_WGMMA_OUT32
                 : "l"(a), "l"(b), "r"(accumulate));
  } else {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 " TROUPE_WGMMA_D32
                 ", %32, %33, p, 1, 1, 0, 0;\n}\n"
                 : TROUPE_WGMMA_OUT32
                 : "l"(a), "l"(b), "r"(accumulate));
  }
}
// D (64 x 64 fp32) += A (64 x 16 f16, or bf16 with kBf16; registers: a[0..3] as mma.sync's m16n8k16
// fragments, warp w's rows 16w .. 16w + 15) * B (16 x 64, the same type, shared memory); `accumulate` 0
// overwrites D.
template <bool kBf16 = false>
__device__ __forceinline__ void wgmma_m64n64k16_ra(float (&d)[32], const uint32_t (&a)[4], uint64_t b, int accumulate) {
  if constexpr (kBf16) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 " TROUPE_WGMMA_D32
                 ", {%32, %33, %34, %35}, %36, p, 1, 1, 0;\n}\n"
                 : TROUPE_WGMMA_OUT32
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(accumulate));
  } else {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 " TROUPE_WGMMA_D32
                 ", {%32, %33, %34, %35}, %36, p, 1, 1, 0;\n}\n"
                 : TROUPE_WGMMA_OUT32
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(accumulate));
  }
}
// D (64 x 64 fp32) += A (64 x 32 e4m3, registers: a[0] row g bytes 4c .. 4c + 3, a[1] row g + 8 the same,
// a[2] row g bytes 16 + 4c .., a[3] row g + 8 the same, of warp w's rows 16w ..) * B (32 x 64 e4m3, shared
// memory, K-major); `accumulate` 0 overwrites D.
__device__ __forceinline__ void wgmma_m64n64k32_e4m3_ra(float (&d)[32], const uint32_t (&a)[4], uint64_t b,
                                                        int accumulate) {
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
               "wgmma.mma_async.sync.aligned.m64n64k32.f32.e4m3.e4m3 " TROUPE_WGMMA_D32
               ", {%32, %33, %34, %35}, %36, p, 1, 1;\n}\n"
               : TROUPE_WGMMA_OUT32
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(accumulate));
}
#undef TROUPE_WGMMA_D32
#undef TROUPE_WGMMA_OUT32
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }
// Barrier of warpgroup wg's 128 threads (ids 1-4: immediates, so the CTA holds 5 barriers, not 16).
__device__ __forceinline__ void warpgroup_barrier(int wg) {
  if (wg == 0) {
    asm volatile("bar.sync 1, 128;" ::: "memory");
  } else if (wg == 1) {
    asm volatile("bar.sync 2, 128;" ::: "memory");
  } else if (wg == 2) {
    asm volatile("bar.sync 3, 128;" ::: "memory");
  } else {
    asm volatile("bar.sync 4, 128;" ::: "memory");
  }
}
// One step of a reduce-scatter over lane bit log2(HALF) + 1: lanes with the bit set keep the upper
// HALF values, the others the lower, each adding its partner's copy of what it keeps.
template <int HALF>
__device__ __forceinline__ void reduce_half(float (&v)[16], int lane) {
  const bool upper = (lane & (2 * HALF)) != 0;
#pragma unroll
  for (int i = 0; i < HALF; ++i) {
    const float keep = upper ? v[HALF + i] : v[i], send = upper ? v[i] : v[HALF + i];
    v[i] = keep + __shfl_xor_sync(0xffffffffu, send, 2 * HALF);
  }
}

// The register-A forms (keys as wgmma's A operand: the e4m3 and split kernels) put key rows g and g + 8 of
// the thread's warp in its accumulators against heads 8j + 2c + {0, 1} (acc[4j + e]: row g for e < 2).
// The weights of those heads (times wscale; 0 past `heads`):
__device__ __forceinline__ void ra_head_weights(const float* w, int b, int heads, float wscale, int c, float (&wv)[16]) {
#pragma unroll
  for (int j = 0; j < 8; ++j) {
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int h = 8 * j + 2 * c + e;
      wv[2 * j + e] = h < heads ? w[b * heads + h] * wscale : 0.f;
    }
  }
}
// and sum_h w_h relu(q_h . k) of rows g (x) and g + 8 (y): the thread's 16 heads, then the 4 lanes of the rows.
__device__ __forceinline__ float2 ra_head_sums(const float (&acc)[32], const float (&wv)[16]) {
  float s0 = 0.f, s1 = 0.f;
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    s0 += wv[2 * j] * fmaxf(acc[4 * j], 0.f) + wv[2 * j + 1] * fmaxf(acc[4 * j + 1], 0.f);
    s1 += wv[2 * j] * fmaxf(acc[4 * j + 2], 0.f) + wv[2 * j + 1] * fmaxf(acc[4 * j + 3], 0.f);
  }
  s0 += __shfl_xor_sync(0xffffffffu, s0, 1);
  s1 += __shfl_xor_sync(0xffffffffu, s1, 1);
  s0 += __shfl_xor_sync(0xffffffffu, s0, 2);
  s1 += __shfl_xor_sync(0xffffffffu, s1, 2);
  return make_float2(s0, s1);
}

// ---- the fused top-k (queries whose keys fit the scoring CTAs) ------------------------------
// The scoring CTAs of a row select its top k themselves, ties by lower index: each counts
// the round-0 digit (the top 11 bits of the order-preserving key) of the scores it wrote
// into a shared histogram, adds it to the row's histogram in the workspace and meets the
// row's other CTAs at an arrival counter (they are all resident: at most one CTA an SM,
// and a grid of at most as many CTAs as SMs whenever a row has more than one). Each then
// finds the threshold bucket, writes its scores above it straight out and its scores in
// it to the row's list (or, when the bucket is taken whole, out), and the row's CTAs meet
// again. The places come with the histogram: its adds return the bin's count before them,
// so a CTA's elements in a bin have a range of the row's elements in that bin, and after the
// arrival the counts above each bin (a block scan of the row's histogram) put every bin's
// range in the output (or the bucket's in the list); no other global atomic. (Until session
// 16 each CTA reserved its output and list ranges with two more atomics after the threshold:
// one more round trip, on two words every CTA of the row added to.) Then each CTA places its
// own bucket elements: an element's rank among the bucket (by key, then lower index) is its
// place after the elements above, if below what is still needed. (Until session 12 the row's
// last CTA selected the whole bucket by radix rounds after the others left: ~2.6 us of
// block-barrier chains, where ranking a CTA's few elements against the list takes ~0.3.) A bucket larger than the list is selected from
// the row's scores by CTA 0 (ties of very many equal values).
constexpr int kFuseBins = 2048;
constexpr int kFuseUnits = 16;  // units a warpgroup scores in the fused form (kept in shared memory)
constexpr int kFuseScoreBytes = kWgGroups * kFuseUnits * kWgKeys * 4;
constexpr int kFuseCandCap = 4096;  // a row's candidate list ((key, index) pairs)
// The rings hold the list and the CTA's own bucket elements, as 64-bit composites.
static_assert(kFuseCandCap * 8 + kWgGroups * kFuseUnits * kWgKeys * 8 <=
                  std::min({kBf16Rings, kE4m3Rings<false>, kE4m3Rings<true>}),
              "the rings hold the list and the CTA's bucket elements");
constexpr int kRankMax = 32;  // candidates one warp ranks
enum FuseCounter { kFArrive = 0, kFDone, kFCounters = 8 };
// A row's words, zero between calls but kFDone (left at the CTA count; each call's CTA 0 resets it).
constexpr int kFuseZeroWords = kFuseBins + kFCounters;
// The workspace of indexer_topk: kFuseRows rows of [kFuseZeroWords zeroed words, then the list
// (keys, then indices)] at fixed places (calls of any shape share it), then the top-k's workspace.
constexpr int kFuseRows = 64;  // calls of more queries take the two-kernel path
constexpr int64_t kFuseRowWords = kFuseZeroWords + 2 * kFuseCandCap;
constexpr size_t kFuseWorkspaceBytes = static_cast<size_t>(kFuseRows) * kFuseRowWords * 4;

struct FuseParams {
  TopkArgs out;  // k, out_idx, out_stride, out_count and the page translation (as the two-kernel path's top-k)
  uint32_t* ws = nullptr;  // [kFuseRows][kFuseRowWords]
  long long* profile = nullptr;  // IndexerTopk::profile
};

struct FuseSmem {
  uint32_t hist[kFuseBins];
  uint32_t scan[32];
  uint32_t thr_bin, thr_above, thr_cnt, thr_old;
  uint32_t pos, gathered;
  uint64_t few[kRankMax];
};
// The shared memory of a form of the wgmma kernels (1,024 for the alignment of the swizzled tiles).
template <bool kFused, bool FP8, bool kQ8 = false>
constexpr size_t kWgSmemOf = 1024 + kScoreOffset<FP8, kQ8> + (kFused ? kFuseScoreBytes + sizeof(FuseSmem) : 0);

// A scored key to the scores and (fused) to the CTA's scores (at `slot`) and round-0 histogram.
template <bool kFused>
__device__ __forceinline__ void put_score(float* out, float* cta_scores, FuseSmem& fs, int64_t key, int64_t n,
                                          int64_t slot, float sum) {
  if (key < n) {
    out[key] = sum;
    if constexpr (kFused) {
      cta_scores[slot] = sum;
      atomicAdd(&fs.hist[order_key(sum) >> 21], 1u);
    }
  }
}

__device__ __forceinline__ int32_t translate_out(const FuseParams& f, int b, int64_t i) {
  return page_translate(f.out.page_table, f.out.page_stride, f.out.page_bits, b, i);
}

// Out of line: a rare path (a bucket larger than the list), which inlined sat between the fused tail's
// hot steps, and the instruction fetch after the jump over it missed (ncu source counters, session
// 17: bf16 1M x 1 -0.4 to -0.9 us, e4m3 -0.4 to -0.6, 128K -0.3).
// CTA 0 of a row whose bucket outgrew the list: the `need` largest of m elements (elem(j) -> (key, index)) whose composite
// (key << 32 | ~index: larger key, then lower index) starts with the pbits bits `prefix` (cnt of them),
// written to out[fs.pos ...]. Radix rounds of 11 bits while more than kRankMax remain, then one warp
// ranks the rest. Every thread of the block calls it.
template <class Elem>
__device__ __noinline__ void select_composite(const FuseParams& f, int b, int32_t* out, int64_t m, Elem&& elem,
                                                 uint64_t prefix, int pbits, uint32_t need, uint32_t cnt,
                                                 FuseSmem& fs, long long* prof) {
  constexpr int kT = kWgGroups * 128;
  const int tid = threadIdx.x;
  auto matches = [&](uint64_t v) { return (v >> (64 - pbits)) == prefix; };
  auto composite = [&](int64_t j) {
    const uint2 e = elem(j);
    return (static_cast<uint64_t>(e.x) << 32) | (0xffffffffu - e.y);
  };
  // Passes over the elements in which every thread runs every step (warp_take's shuffles):
  // visit(v, in) with element j's composite (0 past m).
  auto each = [&](auto&& visit) {
    for (int64_t j0 = 0; j0 < m; j0 += kT) {
      const bool in = j0 + tid < m;
      visit(in ? composite(j0 + tid) : uint64_t{0}, in);
    }
  };
  auto emit_if = [&](bool pred, uint64_t v) {
    const uint32_t slot = warp_take(pred, &fs.pos);
    if (pred) out[slot] = translate_out(f, b, 0xffffffffu - static_cast<uint32_t>(v));
  };
  while (cnt > need && cnt > static_cast<uint32_t>(kRankMax)) {
    const int bits = 64 - pbits < 11 ? 64 - pbits : 11, shift = 64 - pbits - bits;
    const uint32_t nbins = 1u << bits;
    for (int i = tid; i < kFuseBins; i += kT) fs.hist[i] = 0;
    __syncthreads();
    each([&](uint64_t v, bool in) {
      if (in && matches(v)) atomicAdd(&fs.hist[(v >> shift) & (nbins - 1)], 1u);
    });
    __syncthreads();
    if (prof) prof[12] = global_ns();
    find_threshold<kT>(fs.hist, nbins, need, fs);
    if (prof) prof[13] = global_ns();
    const uint32_t t = fs.thr_bin;
    each([&](uint64_t v, bool in) {  // the digits above t are chosen
      emit_if(in && matches(v) && ((v >> shift) & (nbins - 1)) > t, v);
    });
    need -= fs.thr_above;
    cnt = fs.thr_cnt;
    prefix = (prefix << bits) | t;
    pbits += bits;
    __syncthreads();  // every thread has read fs.thr_*
    if (prof) prof[14] = global_ns();
  }
  if (cnt == need) {  // the bucket is taken whole
    each([&](uint64_t v, bool in) { emit_if(in && matches(v), v); });
    return;
  }
  if (tid == 0) fs.gathered = 0;
  __syncthreads();
  each([&](uint64_t v, bool in) {
    const bool pred = in && matches(v);
    const uint32_t slot = warp_take(pred, &fs.gathered);
    if (pred) fs.few[slot] = v;
  });
  __syncthreads();
  if (tid < static_cast<int>(cnt)) {  // composites are distinct: rank = elements above
    const uint64_t v = fs.few[tid];
    uint32_t rank = 0;
    for (uint32_t j = 0; j < cnt; ++j) rank += fs.few[j] > v;
    if (rank < need) out[fs.pos + rank] = translate_out(f, b, 0xffffffffu - static_cast<uint32_t>(v));
  }
}

// After a row's CTAs scored: the selection (see above). `ring` is the CTA's free ring (the
// list and the CTA's own bucket elements).
__device__ __forceinline__ void fused_select(const ScoreParams& p, const FuseParams& f, int b, int64_t n, int64_t units,
                                          int64_t W, const float* cta_scores, FuseSmem& fs, uint32_t* ring) {
  constexpr int kT = kWgGroups * 128;
  const int tid = threadIdx.x;
  const uint32_t k = static_cast<uint32_t>(f.out.k);
  int32_t* out = f.out.out_idx + b * f.out.out_stride;
  if (n <= static_cast<int64_t>(k)) {  // every key is chosen
    if (blockIdx.x == 0) {
      for (int64_t i = tid; i < k; i += kT) out[i] = i < n ? translate_out(f, b, i) : -1;
      if (f.out.out_count != nullptr && tid == 0) f.out.out_count[b] = static_cast<int32_t>(n);
    }
    return;
  }
  // Phase stamps of row 0 (IndexerTopk::profile): CTA 0's at [1..7], the latest of any CTA at [9] and [15].
  long long* prof = f.profile != nullptr && b == 0 && tid == 0 ? f.profile : nullptr;
  long long* prof0 = prof != nullptr && blockIdx.x == 0 ? prof : nullptr;
  auto latest = [&](int i) {
    if (prof) atomicMax(reinterpret_cast<unsigned long long*>(prof + i), static_cast<unsigned long long>(global_ns()));
  };
  if (prof0) prof0[1] = global_ns();
  latest(15);
  uint32_t* w = f.ws + static_cast<int64_t>(b) * kFuseRowWords;
  uint32_t* ctr = w + kFuseBins;
  // The done counter is reset here, before this CTA's arrival below releases it: the row's CTAs
  // add to it only after that arrival (the counter the last call left at its CTA count).
  if (blockIdx.x == 0 && tid == 0) ctr[kFDone] = 0;
  // The CTA's counts into the row's histogram; fs.hist[i] then holds the CTA's first place among the
  // row's elements in bin i (add_counts_and_arrive).
  add_counts_and_arrive<kT, kFuseBins>(fs.hist, w, ctr + kFArrive, gridDim.x, [] {});
  if (prof0) prof0[2] = global_ns();
  // The threshold bin t and every bin's first place (see scan_places): each element above t then has
  // its place in the output without a global atomic, a shared atomic on its bin's place.
  scan_places<kT, kFuseBins>(w, k, fs.hist, fs);
  const uint32_t t = fs.thr_bin, above = fs.thr_above, cnt = fs.thr_cnt, need = k - above, tie0 = fs.thr_old;
  if (prof0) {
    prof0[3] = global_ns();
    prof0[10] = cnt;
    prof0[11] = above;
  }
  const bool take_all = cnt == need, listed = cnt <= static_cast<uint32_t>(kFuseCandCap);
  uint32_t* cand_key = w + kFuseZeroWords;
  uint32_t* cand_idx = cand_key + kFuseCandCap;
  // This thread's scores: position q of cta_scores is unit j = (q / 64) % kFuseUnits of warpgroup q / (64 kFuseUnits).
  constexpr int kPositions = kWgGroups * kFuseUnits * kWgKeys, kPer = kPositions / kT;
  auto key_at = [&](int x) {
    const int q = tid + x * kT;
    const int64_t u = static_cast<int64_t>(blockIdx.x) * kWgGroups + q / (kFuseUnits * kWgKeys) +
                      ((q / kWgKeys) % kFuseUnits) * W;
    return u < units ? u * kWgKeys + q % kWgKeys : n;  // n: no key
  };
  // The CTA's own bucket elements also go to `mine` (shared, as composites): it ranks them below.
  uint64_t* list = reinterpret_cast<uint64_t*>(ring);
  uint64_t* mine = list + kFuseCandCap;
#pragma unroll
  for (int x = 0; x < kPer; ++x) {
    const int64_t i = key_at(x);
    if (i >= n) continue;
    const uint32_t key = order_key(cta_scores[tid + x * kT]), bin = key >> 21;
    if (bin < t) continue;
    const uint32_t pos = atomicAdd(&fs.hist[bin], 1u);
    if (bin > t || take_all) {
      out[pos + (bin > t ? 0u : above)] = translate_out(f, b, i);
    } else if (listed) {
      __stcg(&cand_key[pos], key);
      __stcg(&cand_idx[pos], static_cast<uint32_t>(i));
      mine[pos - tie0] = static_cast<uint64_t>(key) << 32 | (0xffffffffu - static_cast<uint32_t>(i));
    }
  }
  if (prof0) prof0[4] = global_ns();
  // Every CTA's outputs and list entries are in before any CTA goes on (all resident, as above).
  grid_arrive_and_wait(ctr + kFDone, gridDim.x);
  if (prof0) prof0[5] = global_ns();
  // The row's words for the next call (each read before the arrival just met): the histogram in
  // slices over the CTAs, the counters but kFDone (reset at the next call's start) by CTA 0.
  for (int i = blockIdx.x * kT + tid; i < kFuseBins; i += gridDim.x * kT) w[i] = 0;
  if (blockIdx.x == 0 && tid == 0) {
    ctr[kFArrive] = 0;
    if (f.out.out_count != nullptr) f.out.out_count[b] = static_cast<int32_t>(k);
  }
  const uint32_t mine_n = fs.hist[t] - tie0;  // the CTA's elements in the bucket (its places in it, all taken)
  if (!take_all && listed && mine_n > 0) {
    // Each of the CTA's own bucket elements takes place `above + rank`, its rank among the row's
    // bucket (distinct composites: the larger key, then the lower index, first) if that is below
    // `need`: the bucket from the list into shared memory, then a warp an element counts the
    // bucket's larger ones. No CTA waits for another's select.
    for (uint32_t i = tid; i < cnt; i += kT) {
      list[i] = static_cast<uint64_t>(__ldcg(&cand_key[i])) << 32 | (0xffffffffu - __ldcg(&cand_idx[i]));
    }
    __syncthreads();
    if (prof0) prof0[6] = global_ns();
    const int warp = tid >> 5, lane = tid & 31;
    for (uint32_t e = warp; e < mine_n; e += kT / 32) {
      const uint64_t c = mine[e];
      uint32_t r = 0;
      for (uint32_t i = lane; i < cnt; i += 32) r += list[i] > c ? 1u : 0u;
      r = __reduce_add_sync(0xffffffffu, r);
      if (lane == 0 && r < need) out[above + r] = translate_out(f, b, 0xffffffffu - static_cast<uint32_t>(c));
    }
  } else if (!take_all && !listed && blockIdx.x == 0) {
    // More than the list holds are in the bucket (ties of very many equal values): CTA 0
    // selects them from the row's scores.
    const float* row = p.scores + b * p.score_stride;
    if (tid == 0) fs.pos = above;
    __syncthreads();
    select_composite(f, b, out, n,
                     [&](int64_t j) { return make_uint2(order_key(__ldcg(&row[j])), static_cast<uint32_t>(j)); },
                     t, 11, need, cnt, fs, prof);
  }
  if (prof0) prof0[7] = global_ns();
  latest(9);
}

// After the query's stores, by every thread of the CTA: the fence for wgmma's reads of them, the next
// kernel's launch, and the CTA's scores (kFuseUnits units a warpgroup at most) and their round-0
// histogram, zeroed when fused.
struct ScanShared {
  float* scores;
  FuseSmem* fs;
};
// The first two, and the barrier after them (every wgmma kernel, after its query's stores).
__device__ __forceinline__ void scan_start() {
  fence_proxy_async();  // generic-proxy stores, read by wgmma (async proxy)
  asm volatile("griddepcontrol.launch_dependents;");
  __syncthreads();
}
template <bool kFused, bool FP8, bool kQ8 = false>
__device__ __forceinline__ ScanShared begin_scan(uint8_t* qs) {
  scan_start();
  const ScanShared sh{reinterpret_cast<float*>(qs + kScoreOffset<FP8, kQ8>),
                      reinterpret_cast<FuseSmem*>(qs + kScoreOffset<FP8, kQ8> + kFuseScoreBytes)};
  if constexpr (kFused) {
    for (int i = threadIdx.x; i < kFuseBins; i += kWgGroups * 128) sh.fs->hist[i] = 0;
    __syncthreads();
  }
  return sh;
}

// bf16 keys: wgmma's B operand in a swizzled tile (see above).
template <bool kFused>
__global__ void __launch_bounds__(kWgGroups * 128, 1) indexer_wgmma_kernel(const ScoreParams p, const FuseParams f) {
  pdl_entry();  // see launch_kernel
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  uint8_t* qs = smem_raw + ((1024 - (smem_u32(smem_raw) & 1023)) & 1023);  // swizzled tiles need 1,024 alignment
  const int wg = threadIdx.x >> 7, tid = threadIdx.x & 127;
  uint8_t* region = qs + kUnitBytes + wg * kBf16Stages * kUnitBytes;
  auto slot = [&](int stage) { return region + stage * kUnitBytes; };
  float* red = reinterpret_cast<float*>(qs + kUnitBytes + kWgGroups * kBf16Stages * kUnitBytes) + wg * 4 * kWgKeys;
  const int b = blockIdx.y;
  if constexpr (kFused) {
    if (f.profile != nullptr && b == 0 && blockIdx.x == 0 && threadIdx.x == 0) f.profile[0] = global_ns();
  }
  const int warp = tid >> 5, lane = tid & 31, g = lane >> 2, c = lane & 3;
  const int h0 = 16 * warp + g, h1 = h0 + 8;
  const float w0 = h0 < p.heads ? p.w[b * p.heads + h0] * p.wscale : 0.f;
  const float w1 = h1 < p.heads ? p.w[b * p.heads + h1] * p.wscale : 0.f;
  const int64_t n = p.n_keys[b];
  const int64_t base = p.page_table == nullptr ? p.key_start[b] : 0;
  // The query, bf16, swizzled (rows past `heads` are 0): every load of a thread issued before any store.
  constexpr int kQChunks = (64 * 16 + kWgGroups * 128 - 1) / (kWgGroups * 128);  // 16-byte chunks a thread
  const float* qg = p.q + static_cast<int64_t>(b) * p.heads * kDim;
  float4 qv[kQChunks][2];
#pragma unroll
  for (int x = 0; x < kQChunks; ++x) {
    const int i = threadIdx.x + x * kWgGroups * 128, h = i >> 4, j = i & 15;
    const float4 zero = make_float4(0.f, 0.f, 0.f, 0.f);
    qv[x][0] = h < p.heads ? *reinterpret_cast<const float4*>(qg + h * kDim + 8 * j) : zero;
    qv[x][1] = h < p.heads ? *reinterpret_cast<const float4*>(qg + h * kDim + 8 * j + 4) : zero;
  }
  const int64_t units = (n + kWgKeys - 1) / kWgKeys;
  const int64_t gw = static_cast<int64_t>(blockIdx.x) * kWgGroups + wg;
  const int64_t W = static_cast<int64_t>(gridDim.x) * kWgGroups;

  // A unit's copies: 16 threads a key row (16-byte chunks), so thread tid copies chunk tid % 16 of rows
  // tid / 16 + 8i. Paged keys: the rows' page lookups (32-bit: a sequence is < 2^31 keys) are all
  // issued before the copies.
  constexpr int kChunks = 16, kStep = 128 / kChunks, kRowsPerThread = kWgKeys / kStep;
  const int r0 = tid / kChunks, jc = tid % kChunks;
  const uint8_t* src0 = p.keys + jc * 16;
  auto issue = [&](int stage, int64_t unit) {
    uint8_t* dst = slot(stage);
    const int64_t s0 = unit * kWgKeys + r0;
    int64_t row[kRowsPerThread];
    if (p.page_table != nullptr) {
#pragma unroll
      for (int i = 0; i < kRowsPerThread; ++i) row[i] = paged_row32(p, b, s0 + kStep * i, n);
    } else {
#pragma unroll
      for (int i = 0; i < kRowsPerThread; ++i) row[i] = base + s0 + kStep * i;
    }
#pragma unroll
    for (int i = 0; i < kRowsPerThread; ++i) {
      const bool valid = s0 + kStep * i < n;
      cp_async16(dst + swizzled(r0 + kStep * i, jc), src0 + (valid ? row[i] : 0) * 256, valid);
    }
  };
  // The first units' copies go out before the query is converted and stored (its loads are in flight
  // already): the query's staging hides under the keys' latency.
#pragma unroll
  for (int st = 0; st < kBf16Stages - 1; ++st) {
    const int64_t u = gw + st * W;
    if (u < units) issue(st, u);
    cp_async_commit();
  }
#pragma unroll
  for (int x = 0; x < kQChunks; ++x) {
    const int i = threadIdx.x + x * kWgGroups * 128;
    if (i >= 64 * 16) break;
    const float4 lo = qv[x][0], hi = qv[x][1];
    *reinterpret_cast<uint4*>(qs + swizzled(i >> 4, i & 15)) =
        make_uint4(pack_bf16x2(lo.x, lo.y), pack_bf16x2(lo.z, lo.w), pack_bf16x2(hi.x, hi.y), pack_bf16x2(hi.z, hi.w));
  }
  const ScanShared sh = begin_scan<kFused, false>(qs);
  float* cta_scores = sh.scores;
  FuseSmem& fs = *sh.fs;
  if (!kFused && gw >= units) return;  // the whole warpgroup: its barriers count only its own threads
  float* out = p.scores + b * p.score_stride;
  const uint32_t qa = smem_u32(qs);
  float acc[32];
#pragma unroll
  for (int i = 0; i < 32; ++i) acc[i] = 0.f;
  // Every warpgroup of the CTA runs as many iterations as its first (which has the most units), the
  // idle ones only meeting their barriers: the fused form's CTA-wide barriers after the loop then
  // follow the same number of named barriers in every warpgroup (compute-sanitizer's racecheck
  // reported hazards across those CTA barriers when the counts differed).
  const int64_t first = static_cast<int64_t>(blockIdx.x) * kWgGroups;
  const int64_t iters = units > first ? (units - first + W - 1) / W : 0;
  for (int64_t it = 0; it < iters; ++it) {
    const int64_t u = gw + it * W;
    if (u >= units) {
      warpgroup_barrier(wg);
      warpgroup_barrier(wg);
      continue;
    }
    cp_async_wait<kBf16Stages - 2>();  // (cp.async writes need no proxy fence before wgmma reads them)
    warpgroup_barrier(wg);  // the unit's copies landed; every warp is done with the slot refilled next
    const int64_t un = gw + (it + kBf16Stages - 1) * W;
    if (un < units) issue(static_cast<int>((it + kBf16Stages - 1) % kBf16Stages), un);
    cp_async_commit();
    const uint32_t ba = smem_u32(slot(static_cast<int>(it % kBf16Stages)));
    asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
#pragma unroll
    for (int k = 0; k < kDim / 16; ++k) {
      const uint32_t off = (k >> 2) * kTileHalf + (k & 3) * 32;
      wgmma_m64n64k16<false>(acc, wgmma_desc(qa + off), wgmma_desc(ba + off), k > 0);
    }
    asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
    asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
#pragma unroll
    for (int i = 0; i < 32; ++i) asm volatile("" : "+f"(acc[i])::"memory");  // reads stay after the wait
    // acc[4j + e]: head h0 (e < 2) or h1, key 8j + 2c + (e & 1).
    float v[16];
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      v[2 * j] = w0 * fmaxf(acc[4 * j], 0.f) + w1 * fmaxf(acc[4 * j + 2], 0.f);
      v[2 * j + 1] = w0 * fmaxf(acc[4 * j + 1], 0.f) + w1 * fmaxf(acc[4 * j + 3], 0.f);
    }
    // Sum over g (lane bits 2-4), halving the values each step: lane g keeps keys 8g + 2c + {0, 1}.
    reduce_half<8>(v, lane);
    reduce_half<4>(v, lane);
    reduce_half<2>(v, lane);
    *reinterpret_cast<float2*>(red + warp * kWgKeys + 8 * g + 2 * c) = make_float2(v[0], v[1]);
    warpgroup_barrier(wg);
    if (tid < kWgKeys) {
      const float sum = red[tid] + red[kWgKeys + tid] + red[2 * kWgKeys + tid] + red[3 * kWgKeys + tid];
      put_score<kFused>(out, cta_scores, fs, u * kWgKeys + tid, n, (wg * kFuseUnits + it) * kWgKeys + tid, sum);
    }
  }
  cp_async_wait<0>();
  if constexpr (kFused) {
    __syncthreads();  // every warpgroup's scores and counts; the ring is free from here
    fused_select(p, f, b, n, units, W, cta_scores, fs, reinterpret_cast<uint32_t*>(qs + kUnitBytes));
  }
}

// e4m3 keys: wgmma's A operand in registers, converted to f16 there (see above; the query in f16), or
// (kQ8) as they are, the query quantized to e4m3 by each CTA.
template <bool kFused, bool kQ8>
__global__ void __launch_bounds__(kWgGroups * 128, 1) indexer_wgmma_e4m3_kernel(const ScoreParams p,
                                                                                const FuseParams f) {
  pdl_entry();  // see launch_kernel
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  uint8_t* qs = smem_raw + ((1024 - (smem_u32(smem_raw) & 1023)) & 1023);  // swizzled tiles need 1,024 alignment
  const int wg = threadIdx.x >> 7, tid = threadIdx.x & 127;
  constexpr int kRing = kE4m3Stages<kQ8>;  // units in the warpgroup's ring
  uint8_t* ring = qs + kUnitBytes + wg * kE4m3Region<kQ8>;
  const int b = blockIdx.y;
  if constexpr (kFused) {
    if (f.profile != nullptr && b == 0 && blockIdx.x == 0 && threadIdx.x == 0) f.profile[0] = global_ns();
  }
  const int warp = tid >> 5, lane = tid & 31, g = lane >> 2, c = lane & 3;
  const int64_t n = p.n_keys[b];
  const int64_t base = p.page_table == nullptr ? p.key_start[b] : 0;
  // The query, f16, swizzled and permuted (see above; rows past `heads` are 0): channel pairs, every
  // load of a thread issued before any store. Item i: head i / 64, lane column cq = (i / 16) % 4,
  // pair tp = i % 16 of that lane's 32 channels, its physical channels 16 cq + 64 (tp / 8) +
  // 2 (tp % 8) + {0, 1} stored at logical channel 16 (tp / 2) + 8 (tp % 2) + 2 cq.
  constexpr int kQPairs = kQ8 ? 1 : 64 * 64 / (kWgGroups * 128);
  const float* qg = p.q + static_cast<int64_t>(b) * p.heads * kDim;
  float2 qv[kQPairs];
  // kQ8: thread i stages logical chunk j = i % 8 (step j / 2, half j % 2) of head i / 8: word m = j of
  // each lane column's bytes, four channels each.
  static_assert(!kQ8 || kWgGroups * 128 == 64 * 8, "kQ8: one 16-byte query chunk a thread");
  const int qh = threadIdx.x >> 3, qj = threadIdx.x & 7;
  float4 q8v[kQ8 ? 4 : 1];
  if constexpr (kQ8) {
#pragma unroll
    for (int c4 = 0; c4 < 4; ++c4) {
      q8v[c4] = qh < p.heads ? *reinterpret_cast<const float4*>(qg + qh * kDim + e4m3_word_channel(c4, qj))
                             : make_float4(0.f, 0.f, 0.f, 0.f);
    }
  } else {
#pragma unroll
    for (int x = 0; x < kQPairs; ++x) {
      const int i = threadIdx.x + x * kWgGroups * 128, h = i >> 6, cq = (i >> 4) & 3, tp = i & 15;
      const int ch = 16 * cq + 64 * (tp >> 3) + 2 * (tp & 7);
      qv[x] = h < p.heads ? *reinterpret_cast<const float2*>(qg + h * kDim + ch) : make_float2(0.f, 0.f);
    }
  }
  float wv[16];
  ra_head_weights(p.w, b, p.heads, p.wscale, c, wv);
  const int64_t units = (n + kWgKeys - 1) / kWgKeys;
  const int64_t gw = static_cast<int64_t>(blockIdx.x) * kWgGroups + wg;
  const int64_t W = static_cast<int64_t>(gridDim.x) * kWgGroups;

  // A unit's copies by this thread: its two key rows (unit key 16 warp + g + 8 rs), chunks q at
  // bytes 16c + 64q (q < 2); lane c == rs also copies row rs's scale. Pool rows are looked up one
  // unit ahead of their copies (paged keys: the page-table loads are not waited for in the issue).
  const int rkey = 16 * warp + g;
  auto rows_of = [&](int64_t unit, int64_t (&row)[2]) {
#pragma unroll
    for (int rs = 0; rs < 2; ++rs) {
      const int64_t s = unit * kWgKeys + rkey + 8 * rs;
      row[rs] = p.page_table != nullptr ? paged_row32(p, b, s, n) : base + s;
    }
  };
  auto issue = [&](int stage, int64_t unit, const int64_t (&row)[2]) {
    uint8_t* dst = ring + stage * kE4m3Stage;
#pragma unroll
    for (int rs = 0; rs < 2; ++rs) {
      const bool valid = unit * kWgKeys + rkey + 8 * rs < n;
      const int64_t r = valid ? row[rs] : 0;
      const uint8_t* src = p.keys + r * 128 + 16 * c;
#pragma unroll
      for (int q = 0; q < 2; ++q) cp_async16(dst + ((2 * rs + q) * 128 + tid) * 16, src + 64 * q, valid);
      if (c == rs) cp_async4(dst + kE4m3Chunks + (rkey + 8 * rs) * 4, p.key_scales + r, valid);
    }
  };
  // The first units' copies go out before the query is converted and stored (its loads are in flight
  // already): the query's staging hides under the keys' latency.
  int64_t rows_next[2] = {0, 0};  // of unit gw + (kRing - 1) W, the next to be issued
#pragma unroll
  for (int st = 0; st < kRing - 1; ++st) {
    const int64_t u = gw + st * W;
    if (u < units) {
      rows_of(u, rows_next);
      issue(st, u, rows_next);
    }
    cp_async_commit();
  }
  if (gw + (kRing - 1) * W < units) rows_of(gw + (kRing - 1) * W, rows_next);
  float* qscale = reinterpret_cast<float*>(qs + kTileHalf);  // kQ8: the heads' scales after the 8 KB tile
  if constexpr (kQ8) {  // quantized as quantize_keys_e4m3 quantizes a key row
    float amax = 0.f;
#pragma unroll
    for (int c4 = 0; c4 < 4; ++c4) amax = fmaxf(amax, abs_max4(q8v[c4]));
#pragma unroll
    for (int o = 1; o < 8; o <<= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));  // the head's 8
    const float sc = e4m3_row_scale(amax), inv = 1.f / sc;
    *reinterpret_cast<uint4*>(qs + swizzled(qh, qj)) = make_uint4(pack_e4m3x4(q8v[0], inv), pack_e4m3x4(q8v[1], inv),
                                                                 pack_e4m3x4(q8v[2], inv), pack_e4m3x4(q8v[3], inv));
    if (qj == 0) qscale[qh] = qh < p.heads ? sc : 0.f;
  } else {
#pragma unroll
    for (int x = 0; x < kQPairs; ++x) {
      const int i = threadIdx.x + x * kWgGroups * 128, h = i >> 6, cq = (i >> 4) & 3, tp = i & 15;
      const int k = 16 * (tp >> 1) + 8 * (tp & 1) + 2 * cq;
      *reinterpret_cast<uint32_t*>(qs + swizzled(h, k >> 3) + 2 * (k & 7)) = pack_f16x2(qv[x].x, qv[x].y);
    }
  }
  const ScanShared sh = begin_scan<kFused, true, kQ8>(qs);
  if constexpr (kQ8) {
#pragma unroll
    for (int j = 0; j < 8; ++j) {
#pragma unroll
      for (int e = 0; e < 2; ++e) wv[2 * j + e] *= qscale[8 * j + 2 * c + e];
    }
  }
  float* cta_scores = sh.scores;
  FuseSmem& fs = *sh.fs;
  float* out = p.scores + b * p.score_stride;
  const uint32_t qb = smem_u32(qs);
  float acc[32];
#pragma unroll 1
  for (int64_t it = 0; gw + it * W < units; ++it) {
    const int64_t u = gw + it * W, un = u + (kRing - 1) * W;
    // The slot refilled held unit it - 1, which only this thread read, and is done with.
    if (un < units) issue(static_cast<int>((it + kRing - 1) % kRing), un, rows_next);
    cp_async_commit();
    if (un + W < units) rows_of(un + W, rows_next);
    cp_async_wait<kRing - 1>();  // this thread's copies of unit it have landed
    const uint8_t* cur = ring + static_cast<int>(it % kRing) * kE4m3Stage;
    // The thread's 32 bytes of each of its two rows (words m: e4m3_word_channel).
    uint32_t v[2][8];
#pragma unroll
    for (int rs = 0; rs < 2; ++rs) {
#pragma unroll
      for (int q = 0; q < 2; ++q) {
        const uint4 x = *reinterpret_cast<const uint4*>(cur + ((2 * rs + q) * 128 + tid) * 16);
        v[rs][4 * q] = x.x;
        v[rs][4 * q + 1] = x.y;
        v[rs][4 * q + 2] = x.z;
        v[rs][4 * q + 3] = x.w;
      }
    }
    if constexpr (kQ8) {
      asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
#pragma unroll
      for (int st = 0; st < kDim / 32; ++st) {
        const uint32_t a[4] = {v[0][2 * st], v[1][2 * st], v[0][2 * st + 1], v[1][2 * st + 1]};
        wgmma_m64n64k32_e4m3_ra(acc, a, wgmma_desc(qb + st * 32), st > 0);
      }
    } else {
      // A fragments of k-step st: a[st] = {row g: 2c, 2c + 1; row g + 8: the same; row g: 2c + 8, 2c + 9;
      // row g + 8: the same}, i.e. the thread's channel pairs 2 st (first two) and 2 st + 1 of each row.
      uint32_t a[8][4];
#pragma unroll
      for (int rs = 0; rs < 2; ++rs) {
#pragma unroll
        for (int st = 0; st < 8; ++st) {  // word st holds the step's four channels
          a[st][rs] = e4m3x2_to_f16x2(v[rs][st]);
          a[st][2 + rs] = e4m3x2_to_f16x2(v[rs][st] >> 16);
        }
      }
      asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
#pragma unroll
      for (int st = 0; st < kDim / 16; ++st) {
        wgmma_m64n64k16_ra(acc, a[st], wgmma_desc(qb + (st >> 2) * kTileHalf + (st & 3) * 32), st > 0);
      }
    }
    asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
    asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
#pragma unroll
    for (int i = 0; i < 32; ++i) asm volatile("" : "+f"(acc[i])::"memory");  // reads stay after the wait
    const float2 sums = ra_head_sums(acc, wv);
    if (c < 2) {  // lane c writes row g + 8c (whose scale it copied)
      const int r = rkey + 8 * c;
      const float sum = (c == 0 ? sums.x : sums.y) * reinterpret_cast<const float*>(cur + kE4m3Chunks)[r];  // s relu(q.k)
      put_score<kFused>(out, cta_scores, fs, u * kWgKeys + r, n, (wg * kFuseUnits + it) * kWgKeys + r, sum);
    }
  }
  cp_async_wait<0>();
  if constexpr (kFused) {
    __syncthreads();  // every warpgroup's scores and counts; the ring is free from here
    fused_select(p, f, b, n, units, W, cta_scores, fs, reinterpret_cast<uint32_t*>(qs + kUnitBytes));
  }
}

// ---- fp32 keys by row pointers on the tensor cores (the backend op's 128-channel form) -------------
// indexer_scores_ragged's keys are fp32 rows named by pointers (the engine's pools). Each value x
// (query and key) is split into two bf16, hi = bf16(x) and lo = bf16(x - hi), and q . k is summed as
// qh . kh + qh . kl + ql . kh on wgmma with fp32 accumulation: what is left out (ql . kl, and each
// value's rounding past its 16 bits) is ~2^-16 of each product, where bf16 alone would leave ~2^-8.
// The structure is the e4m3 kernel's: warp w of a warpgroup holds keys 16w + g and 16w + g + 8 of a
// unit of 64 as wgmma's A fragments in registers, each thread copying (cp.async, into its
// warpgroup's ring) and reading back only its own bytes, so the scan has no barrier; B is the query
// (hi and lo tiles, swizzled as above). A thread's bytes of a key row are the 16-byte chunks at
// 64 j + 16 c (j < 8; the four lanes of a row cover 64 contiguous bytes a copy): physical channels
// 16 j + 4 c + {0, 1, 2, 3}, which k-step j takes as its logical channels 2c, 2c + 1 (the first pair)
// and 2c + 8, 2c + 9 (the second); the query's tiles carry the same permutation (split_channel).
// 32 KB units in rings of three, two warpgroups a CTA (225 KB of shared memory, one CTA an SM); a slot is
// refilled as soon as its unit is in registers, so three units a warpgroup are in flight during the tensor steps.
constexpr int kSplitGroups = 2;
constexpr int kSplitRing = 3;
constexpr int kSplitUnit = kWgKeys * kDim * 4;  // [16 chunks (j, rs)][128 threads][16 bytes]
constexpr size_t kSplitSmem = 1024 + 2 * kUnitBytes + static_cast<size_t>(kSplitGroups) * kSplitRing * kSplitUnit;

// The physical channel at logical channel k (see above).
__device__ __forceinline__ int split_channel(int k) {
  const int i = k & 15;
  return (k & ~15) + 4 * ((i & 7) >> 1) + 2 * (i >> 3) + (i & 1);
}
// x = hi + lo (two bf16 pairs of a float pair: the first value in the low half).
__device__ __forceinline__ void split_bf16x2(float x0, float x1, uint32_t& hi, uint32_t& lo) {
  hi = pack_bf16x2(x0, x1);
  const float h0 = __uint_as_float(hi << 16), h1 = __uint_as_float(hi & 0xffff0000u);
  lo = pack_bf16x2(x0 - h0, x1 - h1);
}

__global__ void __launch_bounds__(kSplitGroups * 128, 1)
    indexer_split_kernel(const float* q, const float* w, int heads, float wscale, RaggedRows keys, float* scores,
                         int64_t score_stride, int32_t* lengths) {
  pdl_entry();  // see launch_kernel
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  uint8_t* qs = smem_raw + ((1024 - (smem_u32(smem_raw) & 1023)) & 1023);  // swizzled tiles need 1,024 alignment
  uint8_t* qlo = qs + kUnitBytes;
  const int wg = threadIdx.x >> 7, tid = threadIdx.x & 127;
  uint8_t* ring = qs + 2 * kUnitBytes + wg * (kSplitRing * kSplitUnit);
  const int b = blockIdx.y;
  const int64_t begin = keys.offsets[b], n = keys.offsets[b + 1] - begin;
  if (lengths != nullptr && blockIdx.x == 0 && threadIdx.x == 0) lengths[b] = static_cast<int32_t>(n);
  const int64_t units = (n + kWgKeys - 1) / kWgKeys;
  if (static_cast<int64_t>(blockIdx.x) * kSplitGroups >= units) return;  // the whole CTA: nothing to score
  const int64_t gw = static_cast<int64_t>(blockIdx.x) * kSplitGroups + wg;
  const int64_t W = static_cast<int64_t>(gridDim.x) * kSplitGroups;
  const int warp = tid >> 5, lane = tid & 31, g = lane >> 2, c = lane & 3;
  const int rkey = 16 * warp + g;
  // The query's loads, all issued before the first keys' copies (behind those they would wait as long as
  // the copies): this thread's logical channel pairs of the hi and lo tiles, split_channel's order.
  constexpr int kQPairs = 64 * kDim / 2 / (kSplitGroups * 128);
  const float* qg = q + static_cast<int64_t>(b) * heads * kDim;
  auto qpair = [&](int x) {  // pair x of this thread: its head and first logical channel
    const int i = threadIdx.x + x * kSplitGroups * 128;
    return make_int2(i / (kDim / 2), 2 * (i % (kDim / 2)));
  };
  float2 qv[kQPairs];
#pragma unroll
  for (int x = 0; x < kQPairs; ++x) {
    const int2 hk = qpair(x);
    qv[x] = hk.x < heads ? *reinterpret_cast<const float2*>(qg + hk.x * kDim + split_channel(hk.y))
                         : make_float2(0.f, 0.f);
  }
  const float* const* rows = keys.rows + begin;
  // This thread's two key rows of a unit (null past n). A row pointer loaded after a unit's copies
  // waits behind them (~4 us with the memory busy, more than an iteration: ncu, session 25), so each
  // unit's pointers are loaded two iterations before its copies, into one of two register pairs.
  auto rows_of = [&](int64_t unit, const float* (&r)[2]) {
#pragma unroll
    for (int rs = 0; rs < 2; ++rs) {
      const int64_t s = unit * kWgKeys + rkey + 8 * rs;
      r[rs] = s < n ? rows[s] : nullptr;
    }
  };
  auto issue = [&](int stage, const float* const (&r)[2]) {
    uint8_t* dst = ring + stage * kSplitUnit;
#pragma unroll
    for (int rs = 0; rs < 2; ++rs) {
      const bool valid = r[rs] != nullptr;
      const uint8_t* src = reinterpret_cast<const uint8_t*>(valid ? r[rs] : q) + (valid ? 16 * c : 0);
#pragma unroll
      for (int j = 0; j < 8; ++j) cp_async16(dst + ((2 * j + rs) * 128 + tid) * 16, src + (valid ? 64 * j : 0), valid);
    }
  };
  // Every slot of the ring is in flight from the start; a unit's slot is refilled (with the unit three
  // after it) as soon as its chunks are in registers, so three units a warpgroup are in flight while
  // the tensor cores work (two until 2589e86: the refill waited for the next iteration, and the scan
  // was bound by its bytes in flight, ncu session 25).
  static_assert(kSplitRing == 3, "units are issued three ahead, their pointers two iterations before that");
  const float* ra[2] = {nullptr, nullptr};  // of units gw + 3W, gw + 5W, ... (even iterations issue them)
  const float* rb[2] = {nullptr, nullptr};  // of units gw + 4W, gw + 6W, ...
#pragma unroll
  for (int st = 0; st < kSplitRing; ++st) {
    const int64_t u = gw + st * W;
    if (u < units) {
      rows_of(u, ra);
      issue(st, ra);
    }
    cp_async_commit();
  }
  if (gw + 3 * W < units) rows_of(gw + 3 * W, ra);
  if (gw + 4 * W < units) rows_of(gw + 4 * W, rb);
#pragma unroll
  for (int x = 0; x < kQPairs; ++x) {
    const int2 hk = qpair(x);
    uint32_t hi, lo;
    split_bf16x2(qv[x].x, qv[x].y, hi, lo);
    const int at = swizzled(hk.x, hk.y >> 3) + 2 * (hk.y & 7);
    *reinterpret_cast<uint32_t*>(qs + at) = hi;
    *reinterpret_cast<uint32_t*>(qlo + at) = lo;
  }
  scan_start();
  float wv[16];
  ra_head_weights(w, b, heads, wscale, c, wv);
  float* out = scores + b * score_stride;
  const uint32_t qh_addr = smem_u32(qs), ql_addr = smem_u32(qlo);
  float acc[32];
  // Iteration it: wait for unit it's copies (in ring slot `slot`), take its chunks into registers, start
  // the tensor steps, refill the slot with unit it + 3 (its pointers in `next`, loaded two iterations ago;
  // then `next` takes unit it + 5's), and sum the unit's scores. Whether unit it exists.
  auto step = [&](int64_t it, int slot, const float* (&next)[2]) {
    const int64_t u = gw + it * W;
    if (u >= units) return false;
    cp_async_wait<kSplitRing - 1>();  // this thread's copies of unit it have landed (it + 1, it + 2 in flight)
    const uint8_t* cur = ring + slot * kSplitUnit;
    // A fragments of k-step j: {row g: 2c, 2c + 1; row g + 8: the same; row g: 2c + 8, 2c + 9; row g + 8: the
    // same}: chunk j of each row, its first float pair then its second.
    uint32_t ah[8][4], al[8][4];
#pragma unroll
    for (int j = 0; j < 8; ++j) {
#pragma unroll
      for (int rs = 0; rs < 2; ++rs) {
        const float4 x = *reinterpret_cast<const float4*>(cur + ((2 * j + rs) * 128 + tid) * 16);
        split_bf16x2(x.x, x.y, ah[j][rs], al[j][rs]);
        split_bf16x2(x.z, x.w, ah[j][2 + rs], al[j][2 + rs]);
      }
    }
    asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
#pragma unroll
    for (int j = 0; j < kDim / 16; ++j) {
      const uint32_t off = (j >> 2) * kTileHalf + (j & 3) * 32;
      wgmma_m64n64k16_ra<true>(acc, ah[j], wgmma_desc(qh_addr + off), j > 0);
      wgmma_m64n64k16_ra<true>(acc, ah[j], wgmma_desc(ql_addr + off), 1);
      wgmma_m64n64k16_ra<true>(acc, al[j], wgmma_desc(qh_addr + off), 1);
    }
    asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
    // The slot's chunks are consumed (the tensor steps' registers were computed from them): refill it
    // while the steps run. Only this thread read those chunks and writes them.
    if (u + 3 * W < units) issue(slot, next);
    cp_async_commit();
    if (u + 5 * W < units) rows_of(u + 5 * W, next);
    asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
#pragma unroll
    for (int i = 0; i < 32; ++i) asm volatile("" : "+f"(acc[i])::"memory");  // reads stay after the wait
    const float2 sums = ra_head_sums(acc, wv);
    const int64_t key = u * kWgKeys + rkey + 8 * (c & 1);
    if (c < 2 && key < n) out[key] = c == 0 ? sums.x : sums.y;
    return true;
  };
  // Two iterations a trip, so that each pointer pair is read two iterations after its loads with no
  // register move between (a move would wait for the loads). Unit it sits in ring slot it % 3.
  int slot = 0;  // of unit it (it even)
#pragma unroll 1
  for (int64_t it = 0;; it += 2) {
    const int slot1 = slot == 2 ? 0 : slot + 1;
    if (!step(it, slot, ra)) break;
    if (!step(it + 1, slot1, rb)) break;
    slot = slot1 == 2 ? 0 : slot1 + 1;
  }
  cp_async_wait<0>();
}

// ---- fp32 ragged scoring (the backend op) ------------------------------------
// A CTA scores CHUNK keys of one query against every head (<= 64). Thread (kg, hg) of
// KG key groups x 256 / KG head groups holds a register tile of keys kg, kg + KG, ...
// (CHUNK / KG of them) by heads hg, hg + 256 / KG, ...: per 4 channels it reads those
// key and query vectors from shared memory. Long key lists take 64 keys a CTA (the
// query, staged once per CTA, is amortised over more keys), as a 4 x 4 tile (KG 16) or,
// under TROUPE_INDEXER_TILE=0, one key by 16 heads (KG 64); a grid that would not fill
// the GPU (decode: one query, a few hundred keys) takes 16 keys a CTA, one key by 4
// heads a thread, four times the CTAs. The keys are staged `dpass` channels at a time
// (the 64-key CTAs: 64, so four CTAs fit an SM: with the whole 128-channel rows three
// did, and 32,768 keys ran as 1.3 waves); the sums run over the channels in the same
// order either way.
constexpr int kThreadsRagged = 256;

template <int CHUNK, int KG>
__global__ void __launch_bounds__(kThreadsRagged, CHUNK == 64 && KG == 16 ? 4 : 1)  // 4: 64 registers a thread
    indexer_ragged_kernel(const float* q, const float* w, int heads, int dim, int dpass, float scale,
                          float weight_scale, RaggedRows keys, float* scores, int64_t score_stride,
                          int32_t* lengths) {
  pdl_entry();  // see launch_kernel
  constexpr int HG = kThreadsRagged / KG;
  constexpr int KPT = CHUNK / KG;  // keys a thread scores
  constexpr int HPT = 64 / HG;     // heads a thread sums
  extern __shared__ __align__(16) float sm[];
  const int ks = dpass + 4;
  float* q_s = sm;                 // [heads][dim]
  float* k_s = q_s + heads * dim;  // [CHUNK][dpass + 4], then the head groups' partial sums
  float* red = k_s;                // [HG][CHUNK], after the last pass
  const int64_t t = blockIdx.y;
  const int64_t begin = keys.offsets[t];
  const int64_t n = keys.offsets[t + 1] - begin;
  if (lengths != nullptr && blockIdx.x == 0 && threadIdx.x == 0) lengths[t] = static_cast<int32_t>(n);
  const int64_t s0 = static_cast<int64_t>(blockIdx.x) * CHUNK;
  if (s0 >= n) return;
  for (int i = threadIdx.x; i < heads * (dim / 4); i += blockDim.x) {
    reinterpret_cast<float4*>(q_s)[i] = reinterpret_cast<const float4*>(q + t * heads * dim)[i];
  }
  const int kg = threadIdx.x % KG, hg = threadIdx.x / KG;
  float acc[KPT][HPT];
#pragma unroll
  for (int i = 0; i < KPT; ++i)
#pragma unroll
    for (int j = 0; j < HPT; ++j) acc[i][j] = 0.f;
  for (int p0 = 0; p0 < dim; p0 += dpass) {
    const int dn = dim - p0 < dpass ? dim - p0 : dpass, d4 = dn / 4;
    if (p0 > 0) __syncthreads();  // every thread is done with the last pass's keys
    for (int i = threadIdx.x; i < CHUNK * d4; i += blockDim.x) {
      const int r = i / d4, c4 = i % d4;
      float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
      if (s0 + r < n) v = reinterpret_cast<const float4*>(keys.rows[begin + s0 + r] + p0)[c4];
      *reinterpret_cast<float4*>(k_s + r * ks + 4 * c4) = v;
    }
    __syncthreads();
    for (int d = 0; d < dn; d += 4) {
      float4 kv[KPT], qv[HPT];
#pragma unroll
      for (int i = 0; i < KPT; ++i) kv[i] = *reinterpret_cast<const float4*>(k_s + (kg + KG * i) * ks + d);
#pragma unroll
      for (int j = 0; j < HPT; ++j) {
        const int h = hg + HG * j;
        qv[j] = h < heads ? *reinterpret_cast<const float4*>(q_s + h * dim + p0 + d) : make_float4(0.f, 0.f, 0.f, 0.f);
      }
#pragma unroll
      for (int i = 0; i < KPT; ++i)
#pragma unroll
        for (int j = 0; j < HPT; ++j)
          acc[i][j] += qv[j].x * kv[i].x + qv[j].y * kv[i].y + qv[j].z * kv[i].z + qv[j].w * kv[i].w;
    }
  }
  float wh[HPT];
#pragma unroll
  for (int j = 0; j < HPT; ++j) {
    const int h = hg + HG * j;
    wh[j] = h < heads ? w[t * heads + h] * weight_scale : 0.f;
  }
  __syncthreads();  // every thread is done with the keys: red takes their place
#pragma unroll
  for (int i = 0; i < KPT; ++i) {
    float part = 0.f;
#pragma unroll
    for (int j = 0; j < HPT; ++j) part += (fmaxf(acc[i][j], 0.f) * scale) * wh[j];
    red[hg * CHUNK + kg + KG * i] = part;
  }
  __syncthreads();
  if (threadIdx.x < CHUNK && s0 + threadIdx.x < n) {
    const int i = threadIdx.x;
    float sum = 0.f;
#pragma unroll
    for (int g = 0; g < HG; ++g) sum += red[g * CHUNK + i];
    scores[t * score_stride + s0 + i] = sum;
  }
}

__global__ void quantize_e4m3_kernel(const float* x, int64_t rows, uint8_t* q, float* scales) {
  pdl_entry();  // see launch_kernel
  const int64_t r = static_cast<int64_t>(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
  if (r >= rows) return;
  const int lane = threadIdx.x & 31;
  const float4 v = reinterpret_cast<const float4*>(x + r * kDim)[lane];
  const float sc = e4m3_row_scale(warp_max(abs_max4(v)));
  reinterpret_cast<uint32_t*>(q + r * kDim)[lane] = pack_e4m3x4(v, 1.f / sc);
  if (lane == 0) scales[r] = sc;
}

__global__ void to_bf16_kernel(const float* x, int64_t n, __nv_bfloat16* out) {
  pdl_entry();  // see launch_kernel
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    out[i] = __float2bfloat16_rn(x[i]);
  }
}

// The wgmma kernel of the key type (its shared-memory size set once per form).
template <bool kFused>
void launch_wgmma(const IndexerArgs& a, dim3 grid, cudaStream_t stream, const ScoreParams& p, const FuseParams& f) {
  static bool attr = [] {
    TROUPE_CUDA(cudaFuncSetAttribute(indexer_wgmma_kernel<kFused>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                     static_cast<int>(kWgSmemOf<kFused, false>)));
    TROUPE_CUDA(cudaFuncSetAttribute(indexer_wgmma_e4m3_kernel<kFused, false>,
                                     cudaFuncAttributeMaxDynamicSharedMemorySize,
                                     static_cast<int>(kWgSmemOf<kFused, true>)));
    TROUPE_CUDA(cudaFuncSetAttribute(indexer_wgmma_e4m3_kernel<kFused, true>,
                                     cudaFuncAttributeMaxDynamicSharedMemorySize,
                                     static_cast<int>(kWgSmemOf<kFused, true, true>)));
    return true;
  }();
  (void)attr;
  if (a.key_type == IndexKeyType::bf16) {
    launch_kernel(indexer_wgmma_kernel<kFused>, grid, kWgGroups * 128, kWgSmemOf<kFused, false>, stream, p, f);
  } else if (a.query_e4m3) {
    launch_kernel(indexer_wgmma_e4m3_kernel<kFused, true>, grid, kWgGroups * 128, kWgSmemOf<kFused, true, true>,
                  stream, p, f);
  } else {
    launch_kernel(indexer_wgmma_e4m3_kernel<kFused, false>, grid, kWgGroups * 128, kWgSmemOf<kFused, true>, stream, p,
                  f);
  }
}

// The checks of every indexer call's arguments.
void require_valid(const IndexerArgs& a) {
  TROUPE_REQUIRE(a.heads >= 1 && a.heads <= 64, "indexer: 1..64 heads");
  TROUPE_REQUIRE(a.key_start != nullptr || a.page_table != nullptr, "indexer: key_start or page_table");
  TROUPE_REQUIRE(a.page_table == nullptr || (a.page_size > 0 && a.page_size % 8 == 0), "indexer: page_size % 8");
  TROUPE_REQUIRE(a.key_type == IndexKeyType::bf16 || a.key_scales != nullptr, "indexer: e4m3 keys need scales");
  TROUPE_REQUIRE(!a.query_e4m3 || a.key_type == IndexKeyType::e4m3, "indexer: an e4m3 query needs e4m3 keys");
  TROUPE_REQUIRE(!a.query_e4m3 || !env_off("TROUPE_INDEXER_WGMMA"),
                 "indexer: an e4m3 query runs on wgmma only (TROUPE_INDEXER_WGMMA=0 is set)");
}

// The SMs a query gets (all of them shared by the batch's queries).
int64_t sms_per_query(int batch) {
  static const int sms = sm_count();
  return std::max<int64_t>(1, sms / std::max(batch, 1));
}

// CTAs a query of the wgmma kernel: its share of the SMs, and no more than one a kWgGroups units.
int64_t wgmma_ctas(const IndexerArgs& a) {
  return std::max<int64_t>(1, std::min<int64_t>(sms_per_query(a.batch),
                                                ceil_div(ceil_div(a.max_keys, kWgKeys), kWgGroups)));
}

ScoreParams score_params(const IndexerArgs& a) {
  ScoreParams p{};
  p.q = a.q;
  p.w = a.w;
  p.heads = a.heads;
  p.wscale = a.weight_scale * a.scale;
  p.keys = static_cast<const uint8_t*>(a.keys);
  p.key_scales = a.key_scales;
  p.key_start = a.key_start;
  p.page_table = a.page_table;
  p.page_stride = a.page_stride;
  p.page_size = a.page_size;
  p.n_keys = a.n_keys;
  p.scores = a.scores;
  p.score_stride = a.score_stride;
  return p;
}

}  // namespace

void indexer_scores(const IndexerArgs& a, cudaStream_t stream) {
  require_valid(a);
  if (a.batch == 0 || a.max_keys == 0) return;
  const ScoreParams p = score_params(a);
  // TROUPE_INDEXER_WGMMA=0 (read at each call, for A/B in one process): the keys on mma.sync.
  if (!env_off("TROUPE_INDEXER_WGMMA")) {
    launch_wgmma<false>(a, dim3(static_cast<unsigned>(wgmma_ctas(a)), static_cast<unsigned>(a.batch)),
                        stream, p, FuseParams{});
    TROUPE_LAUNCHED();
    return;
  }
  const int64_t units = ceil_div(a.max_keys, 8 * kTiles);
  const int64_t ctas = std::max<int64_t>(1, std::min<int64_t>(sms_per_query(a.batch), ceil_div(units, kWarps)));
  const dim3 grid(static_cast<unsigned>(ctas), static_cast<unsigned>(a.batch));
  if (a.key_type == IndexKeyType::bf16) {
    const size_t smem = static_cast<size_t>(kWarps) * kStages * kTiles * 4 * 512 + 64 * kDim * 4;
    static bool attr = [&] {
      TROUPE_CUDA(cudaFuncSetAttribute(indexer_mma_kernel<false>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       static_cast<int>(smem)));
      return true;
    }();
    (void)attr;
    launch_kernel(indexer_mma_kernel<false>, grid, kWarps * 32, smem, stream, p);
  } else {
    const size_t smem = static_cast<size_t>(kWarps) * kStages * kTiles * 2 * 512 + 64 * kDim * 4;
    static bool attr = [&] {
      TROUPE_CUDA(cudaFuncSetAttribute(indexer_mma_kernel<true>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       static_cast<int>(smem)));
      return true;
    }();
    (void)attr;
    launch_kernel(indexer_mma_kernel<true>, grid, kWarps * 32, smem, stream, p);
  }
  TROUPE_LAUNCHED();
}

size_t indexer_topk_workspace_bytes(int batch, int64_t max_keys, int k) {
  return kFuseWorkspaceBytes + topk_workspace_bytes(batch, max_keys, k);
}

namespace {
// Keys a query above which the two kernels are the faster (measured on an H200, session 23, batch 1, fused
// against two kernels: bf16 12.0-12.5 / 14.0-14.4 us at 32,768 keys, 14.3-14.7 / 16.1-16.5 at 65,536,
// 19.3-19.8 / 20.0-20.5 at 131,072, but 30.0-33.2 / 29.1-30.3 at 262,144 over nine inputs; e4m3 at
// 262,144 24.0-26.9 / 24.2-25.6 over the same nine, the two kernels ahead on six, by 1.3 us on the
// inputs with the largest round-0 bucket): the fused tail's steps grow with the keys (the bucket each
// CTA ranks against, the scan's skew across CTAs) while the top-k kernel's barely do. At batch 32 the
// two are within noise. The e4m3 query too (session 24, six inputs at 262,144 x 1): fused ahead by 0.3-0.8
// us on the five with round-0 buckets of 568-1,041, behind by 1.1 on the one of 2,482, and behind at
// batch 32 (340 / 320 us), so the same limit.
constexpr int64_t kFuseMaxKeys = 131072;

// The fused kernel's grid for this call, or 0 CTAs a query when the call takes the two-kernel path:
// the wgmma kernel (bf16 or e4m3 keys), at most kFuseRows queries, k <= 2048, every warpgroup's units
// fit its shared memory, and at most kFuseMaxKeys keys a query. TROUPE_INDEXER_FUSED (read at each
// call): 0 always two kernels, 1 fused whenever it fits (the A/B switches).
int64_t fused_ctas(const IndexerArgs& a, const IndexerTopk& t) {
  const int fused = env_switch("TROUPE_INDEXER_FUSED");
  if (fused < 0 || env_off("TROUPE_INDEXER_WGMMA")) return 0;
  if (a.batch > kFuseRows || t.k > 2048) return 0;
  if (a.max_keys > kFuseMaxKeys && fused != 1) return 0;
  const int64_t ctas = wgmma_ctas(a);
  return ceil_div(ceil_div(a.max_keys, kWgKeys), ctas * kWgGroups) <= kFuseUnits ? ctas : 0;
}
}  // namespace

bool indexer_topk_is_fused(const IndexerArgs& a, const IndexerTopk& t) { return a.batch > 0 && fused_ctas(a, t) > 0; }

void indexer_topk(const IndexerArgs& a, const IndexerTopk& t, void* workspace, cudaStream_t stream) {
  TROUPE_REQUIRE(a.score_stride >= a.max_keys, "indexer_topk: score_stride < max_keys");
  TROUPE_REQUIRE(t.k >= 1 && t.k <= 2048, "indexer_topk: k must be in 1..2048");
  TROUPE_REQUIRE(t.out_stride >= t.k, "indexer_topk: out_stride < k");
  TROUPE_REQUIRE(!t.translate_pages || (a.page_table != nullptr && (a.page_size & (a.page_size - 1)) == 0),
                 "indexer_topk: page translation needs a power-of-two page size");
  int page_bits = 0;
  while (t.translate_pages && (1 << page_bits) < a.page_size) ++page_bits;
  if (a.batch == 0) return;
  // The selection over the scores, as the fused kernel writes it or as the top-k runs it.
  TopkArgs ta;
  ta.scores = a.scores;
  ta.row_stride = a.score_stride;
  ta.lengths = a.n_keys;
  ta.rows = a.batch;
  ta.max_len = a.max_keys;
  ta.k = t.k;
  ta.out_idx = t.out_idx;
  ta.out_stride = t.out_stride;
  ta.out_count = t.out_count;
  if (t.translate_pages) {
    ta.page_table = a.page_table;
    ta.page_stride = a.page_stride;
    ta.page_bits = page_bits;
  }
  if (const int64_t ctas = fused_ctas(a, t); ctas > 0) {
    TROUPE_REQUIRE(workspace != nullptr, "indexer_topk: a workspace of indexer_topk_workspace_bytes is needed");
    require_valid(a);
    FuseParams f;
    f.out = ta;
    f.ws = static_cast<uint32_t*>(workspace);
    f.profile = t.profile;
    launch_wgmma<true>(a, dim3(static_cast<unsigned>(ctas), static_cast<unsigned>(a.batch)), stream,
                       score_params(a), f);
    TROUPE_LAUNCHED();
    return;
  }
  indexer_scores(a, stream);
  topk(ta, workspace != nullptr ? static_cast<char*>(workspace) + kFuseWorkspaceBytes : nullptr, stream);
}

static bool ragged_split(int64_t dim, RaggedForm form) {
  static const bool on = !env_off("TROUPE_INDEXER_SPLIT");
  return dim == kDim && (form == RaggedForm::split || (form == RaggedForm::automatic && on));
}

void indexer_scores_ragged(const float* q, const float* w, int64_t n_queries, int heads, int64_t dim, float scale,
                           float weight_scale, RaggedRows keys, float* scores, int64_t score_stride, int64_t max_keys,
                           cudaStream_t stream, RaggedForm form, int32_t* lengths) {
  TROUPE_REQUIRE(heads >= 1 && heads <= 64, "indexer: 1..64 heads");
  TROUPE_REQUIRE(dim % 4 == 0 && dim <= 512, "indexer: dim must be a multiple of 4, <= 512");
  TROUPE_REQUIRE(form != RaggedForm::split || dim == kDim, "indexer: the split form takes 128-channel keys");
  // No keys: nothing to score, but the lengths (all 0) are still written, by one CTA a query.
  if (n_queries == 0 || (max_keys == 0 && lengths == nullptr)) return;
  if (ragged_split(dim, form)) {
    static bool split_attr = [] {
      TROUPE_CUDA(cudaFuncSetAttribute(indexer_split_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       static_cast<int>(kSplitSmem)));
      return true;
    }();
    (void)split_attr;
    // One CTA an SM: a query's units over at most as many CTAs as leave every query one wave's share.
    static const int sms = sm_count();
    const int64_t per_query = std::max<int64_t>(1, sms / n_queries);
    const int64_t ctas = std::max<int64_t>(1, std::min(ceil_div(ceil_div(max_keys, kWgKeys), kSplitGroups), per_query));
    const dim3 grid(static_cast<unsigned>(ctas), static_cast<unsigned>(n_queries));
    launch_kernel(indexer_split_kernel, grid, kSplitGroups * 128, kSplitSmem, stream, q, w, heads,
                  weight_scale * scale, keys, scores, score_stride, lengths);
    TROUPE_LAUNCHED();
    return;
  }
  static const bool tile = !env_off("TROUPE_INDEXER_TILE");
  static bool attr = [] {
    for (auto f : {indexer_ragged_kernel<64, 16>, indexer_ragged_kernel<64, 64>, indexer_ragged_kernel<16, 16>}) {
      TROUPE_CUDA(cudaFuncSetAttribute(f, cudaFuncAttributeMaxDynamicSharedMemorySize, 227 * 1024));
    }
    return true;
  }();
  (void)attr;
  // 64 keys a CTA when that makes two CTAs per SM or more, else 16.
  static const int sms = sm_count();
  const bool wide = ceil_div(max_keys, 64) * n_queries >= 2 * sms;
  const int chunk = wide ? 64 : 16;
  const int head_groups = wide && !tile ? 4 : 16;
  const int dpass = wide ? static_cast<int>(std::min<int64_t>(dim, 64)) : static_cast<int>(dim);
  const size_t smem = (static_cast<size_t>(heads) * dim +
                       static_cast<size_t>(chunk) * std::max(dpass + 4, head_groups)) * sizeof(float);
  const dim3 grid(static_cast<unsigned>(std::max<int64_t>(1, ceil_div(max_keys, chunk))),
                  static_cast<unsigned>(n_queries));
  const auto kernel = !wide  ? indexer_ragged_kernel<16, 16>
                      : tile ? indexer_ragged_kernel<64, 16>
                             : indexer_ragged_kernel<64, 64>;
  launch_kernel(kernel, grid, kThreadsRagged, smem, stream, q, w, heads, static_cast<int>(dim), dpass, scale,
                weight_scale, keys, scores, score_stride, lengths);
  TROUPE_LAUNCHED();
}

void quantize_keys_e4m3(const float* x, int64_t rows, uint8_t* q, float* scales, cudaStream_t stream) {
  if (rows == 0) return;
  launch_kernel(quantize_e4m3_kernel, static_cast<unsigned>(ceil_div(rows, 8)), 256, 0, stream, x, rows, q, scales);
  TROUPE_LAUNCHED();
}

void convert_to_bf16(const float* x, int64_t n, void* out, cudaStream_t stream) {
  if (n == 0) return;
  const int64_t blocks = std::min<int64_t>(ceil_div(n, 256), 4096);
  launch_kernel(to_bf16_kernel, static_cast<unsigned>(blocks), 256, 0, stream, x, n, static_cast<__nv_bfloat16*>(out));
  TROUPE_LAUNCHED();
}

}  // namespace troupe::kernels::cuda
