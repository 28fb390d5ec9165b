// Fused compressor kernels (see compressor.hpp). One CTA per entry: each thread
// pools 4 channels (or 1 when dim % 4 != 0) with an online softmax over the
// slots, loads of several slots in flight; then rmsnorm and RoPE over the entry.
#include <algorithm>
#include <cstdlib>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/compressor.hpp"

namespace troupe::kernels::cuda {
namespace {

constexpr int kUnroll = 8;  // slots whose loads are in flight together

struct Slot {
  const float* kv = nullptr;    // channel 0 of this slot's half; null = empty slot
  const float* sc = nullptr;
  const float* bias = nullptr;  // optional, added to sc
};

struct NormRope {
  int64_t dim;
  const float* weight;
  float eps;
  RopeTable rope;
  int slot_groups;  // thread groups that split an entry's slots (merged through shared memory)
};

// A decode step's ring store for one sequence (Source::ring_job): the new token's kv and
// score (+ bias; with score_out, the biased score also written there) into ring row `dst`,
// after every slot of the entry was read. dst null: none (the Source's after() does it).
struct RingJob {
  float* dst = nullptr;
  const float* kv = nullptr;
  const float* score = nullptr;
  const float* bias = nullptr;
  float* score_out = nullptr;
  int64_t width = 0;
};

// Whether every pointer is 16-byte aligned (null counts as aligned).
template <class... P>
__device__ __forceinline__ bool aligned16(const P*... p) {
  return ((... | reinterpret_cast<uintptr_t>(p)) & 15) == 0;
}

// Slots of the backend op: row pointers, bias already applied.
struct PointerSource {
  const float* const* kv;
  const float* const* sc;
  const int64_t* positions;
  float* const* out;
  int slots;
  __device__ bool active(int64_t e) const { return out[e] != nullptr; }  // null: skipped
  __device__ int num_slots() const { return slots; }
  __device__ Slot slot(int64_t e, int s) const {
    Slot r;
    r.sc = sc[e * slots + s];
    if (r.sc != nullptr) r.kv = kv[e * slots + s];
    return r;
  }
  __device__ int64_t position(int64_t e) const { return positions[e]; }
  __device__ void* out_row(int64_t e) const { return out[e]; }
  __device__ RingJob ring_job(int64_t) const { return {}; }
  __device__ void after(int64_t, int64_t) const {}
};

// Token j's slot in half h: from the chunk (raw score + bias) or from the ring.
struct WindowGeometry {
  int rate;
  bool overlap;
  int64_t dim, width, ring_slots;
  const float* ape;
  // token index of slot s of entry i, and the half it reads
  __device__ int64_t token(int64_t i, int s, int& half) const {
    if (overlap) {
      half = s < rate ? 0 : 1;
      return s < rate ? (i - 1) * rate + s : i * rate + (s - rate);
    }
    half = 0;
    return i * rate + s;
  }
  __device__ Slot from_ring(const float* ring, int64_t j, int half) const {
    return in_row(ring + (j % ring_slots) * 2 * width, half);
  }
  // Half `half` of a ring row (kv, then score + bias).
  __device__ Slot in_row(const float* r, int half) const {
    return Slot{r + half * dim, r + width + half * dim, nullptr};
  }
  // Slot s of the entry that token p (a decode step's new token) closes: the token's own
  // row (kv_p, score_p, its position bias bias_p or none) or ring_row(j) for token j < p.
  template <class RingRow>
  __device__ Slot decode_slot(int64_t p, int s, const float* kv_p, const float* score_p, const float* bias_p,
                              RingRow ring_row) const {
    int half;
    const int64_t j = token(p / rate, s, half);
    if (j < 0) return Slot{};
    if (j == p) return Slot{kv_p + half * dim, score_p + half * dim, bias_p != nullptr ? bias_p + half * dim : nullptr};
    return in_row(ring_row(j), half);
  }
};

struct PrefillSource {
  WindowGeometry g;
  const float* kv;
  const float* score;
  int64_t start;
  int64_t first_entry;
  const float* ring;
  void* const* out;
  int64_t count;       // entries; CTAs past them store token ring_first + (e - count) into the ring
  float* ring_out;     // null: the ring is stored by ring_update_kernel after every entry read it
  int64_t ring_first;
  __device__ bool active(int64_t e) const { return e < count; }
  __device__ int num_slots() const { return g.overlap ? 2 * g.rate : g.rate; }
  __device__ Slot slot(int64_t e, int s) const {
    int half;
    const int64_t j = g.token(first_entry + e, s, half);
    if (j < 0) return Slot{};
    if (j >= start) {
      const int64_t r = (j - start) * g.width + half * g.dim;
      return Slot{kv + r, score + r, g.ape + (s % g.rate) * g.width + half * g.dim};  // s % rate == j % rate
    }
    return g.from_ring(ring, j, half);
  }
  __device__ int64_t position(int64_t e) const { return (first_entry + e) * g.rate; }
  __device__ void* out_row(int64_t e) const { return out[e]; }
  __device__ RingJob ring_job(int64_t) const { return {}; }
  // The CTAs past the entries (a chunk no entry of which reads the ring): one ring row each.
  __device__ void after(int64_t e, int64_t) const;
};

// Token p's ring row: r[c] = kv[c], r[width + c] = score[c] + bias[c] (bias may be
// null); with `score_out`, the biased score is also written there. Every thread's
// loads of a pass are issued before its stores (a store could alias the next loads,
// so a plain loop waits for each load in turn: 8 round trips for a CSA row).
__device__ __forceinline__ void store_ring_row(float* r, const float* kv, const float* score, const float* bias,
                                               float* score_out, int64_t width) {
  const bool vec = width % 4 == 0 && aligned16(r, kv, score, bias, score_out);
  if (vec) {
    constexpr int kPass = 2;  // float4s a thread has in flight per array
    const int64_t n4 = width / 4;
    const auto* kv4 = reinterpret_cast<const float4*>(kv);
    const auto* sc4 = reinterpret_cast<const float4*>(score);
    const auto* b4 = reinterpret_cast<const float4*>(bias);
    auto* r4 = reinterpret_cast<float4*>(r);
    for (int64_t i0 = threadIdx.x; i0 < n4; i0 += kPass * blockDim.x) {
      float4 k[kPass], sc[kPass];
#pragma unroll
      for (int u = 0; u < kPass; ++u) {
        const int64_t i = i0 + u * blockDim.x;
        if (i < n4) {
          k[u] = kv4[i];
          sc[u] = sc4[i];
          if (bias != nullptr) {
            const float4 b = b4[i];
            sc[u] = make_float4(sc[u].x + b.x, sc[u].y + b.y, sc[u].z + b.z, sc[u].w + b.w);
          }
        }
      }
#pragma unroll
      for (int u = 0; u < kPass; ++u) {
        const int64_t i = i0 + u * blockDim.x;
        if (i < n4) {
          r4[i] = k[u];
          r4[n4 + i] = sc[u];
          if (score_out != nullptr) reinterpret_cast<float4*>(score_out)[i] = sc[u];
        }
      }
    }
    return;
  }
  for (int64_t c = threadIdx.x; c < width; c += blockDim.x) {
    const float sc = score[c] + (bias != nullptr ? bias[c] : 0.f);
    r[c] = kv[c];
    r[width + c] = sc;
    if (score_out != nullptr) score_out[c] = sc;
  }
}

__device__ void PrefillSource::after(int64_t e, int64_t) const {
  if (e < count || ring_out == nullptr) return;
  const int64_t j = ring_first + (e - count), t = j - start;
  store_ring_row(ring_out + (j % g.ring_slots) * 2 * g.width, kv + t * g.width, score + t * g.width,
                 g.ape + (j % g.rate) * g.width, nullptr, g.width);
}

struct DecodeSource {
  WindowGeometry g;
  const float* kv;     // [batch, width]
  const float* score;  // [batch, width]
  const int64_t* positions;
  float* const* rings;
  void* const* out;
  __device__ bool active(int64_t b) const { return (positions[b] + 1) % g.rate == 0; }
  __device__ int num_slots() const { return g.overlap ? 2 * g.rate : g.rate; }
  __device__ Slot slot(int64_t b, int s) const {
    const int64_t p = positions[b];
    const float* ring = rings[b];
    return g.decode_slot(p, s, kv + b * g.width, score + b * g.width, g.ape + (p % g.rate) * g.width,
                         [&](int64_t j) { return ring + (j % g.ring_slots) * 2 * g.width; });
  }
  __device__ int64_t position(int64_t b) const { return (positions[b] / g.rate) * g.rate; }
  __device__ void* out_row(int64_t b) const { return out[b]; }
  // The new token goes into its ring row once every slot has been read.
  __device__ RingJob ring_job(int64_t b) const {
    const int64_t p = positions[b];
    return {rings[b] + (p % g.ring_slots) * 2 * g.width, kv + b * g.width, score + b * g.width,
            g.ape + (p % g.rate) * g.width, nullptr, g.width};
  }
  __device__ void after(int64_t b, int64_t) const {
    const RingJob j = ring_job(b);
    store_ring_row(j.dst, j.kv, j.score, j.bias, j.score_out, j.width);
  }
};

// The Decoder's form of DecodeSource: rings and entries are per-sequence tables of row
// pointers (row t = table_of[b] of tables `ring_stride` / `entry_stride` apart), the new
// token's score gets the position bias on the fly, and after() stores the token into
// its ring row and its biased score back into `score` (Backend::decode_compress).
struct PagedDecodeSource {
  WindowGeometry g;
  const float* kv;    // [batch, width]
  float* score;       // [batch, width], raw
  const float* bias;  // [rate, width] or null
  const int64_t* positions;
  const int32_t* table_of;
  float* const* ring;
  int64_t ring_stride;
  float* const* entries;
  int64_t entry_stride;
  __device__ int64_t row(int64_t b) const { return table_of != nullptr ? table_of[b] : b; }
  __device__ bool active(int64_t b) const { return (positions[b] + 1) % g.rate == 0; }
  __device__ int num_slots() const { return g.overlap ? 2 * g.rate : g.rate; }
  __device__ Slot slot(int64_t b, int s) const {
    const int64_t p = positions[b];
    float* const* rows = ring + row(b) * ring_stride;
    return g.decode_slot(p, s, kv + b * g.width, score + b * g.width,
                         bias != nullptr ? bias + (p % g.rate) * g.width : nullptr,
                         [&](int64_t j) { return rows[j % g.ring_slots]; });
  }
  __device__ int64_t position(int64_t b) const { return (positions[b] / g.rate) * g.rate; }
  __device__ void* out_row(int64_t b) const { return entries[row(b) * entry_stride + positions[b] / g.rate]; }
  // Token p's ring row is not one of the window's other slots (they are the ring_slots - 1
  // tokens before p at most), so no entry of this call reads what this writes.
  __device__ RingJob ring_job(int64_t b) const {
    const int64_t p = positions[b];
    return {ring[row(b) * ring_stride + p % g.ring_slots], kv + b * g.width, score + b * g.width,
            bias != nullptr ? bias + (p % g.rate) * g.width : nullptr, bias != nullptr ? score + b * g.width : nullptr,
            g.width};
  }
  __device__ void after(int64_t b, int64_t) const {
    const RingJob j = ring_job(b);
    store_ring_row(j.dst, j.kv, j.score, j.bias, j.score_out, j.width);
  }
};

template <int VEC>
struct Vec;
template <>
struct Vec<4> {
  using T = float4;
  __device__ static float4 load(const float* p) {
    if (aligned16(p)) return *reinterpret_cast<const float4*>(p);
    return make_float4(p[0], p[1], p[2], p[3]);
  }
  __device__ static float get(const float4& v, int i) { return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w; }
};
template <>
struct Vec<1> {
  using T = float;
  __device__ static float load(const float* p) { return *p; }
  __device__ static float get(const float& v, int) { return v; }
};

// Four floats read once (evict first), 16 bytes at a time where aligned.
__device__ __forceinline__ float4 load_streaming(const float* p) {
  if (aligned16(p)) return __ldcs(reinterpret_cast<const float4*>(p));
  return make_float4(p[0], p[1], p[2], p[3]);
}

template <class OutT>
__device__ __forceinline__ void store_out(void* out, int64_t i, float v);
template <>
__device__ __forceinline__ void store_out<float>(void* out, int64_t i, float v) { static_cast<float*>(out)[i] = v; }
template <>
__device__ __forceinline__ void store_out<__nv_bfloat16>(void* out, int64_t i, float v) {
  static_cast<__nv_bfloat16*>(out)[i] = __float2bfloat16_rn(v);
}

// The softmax over the slots runs in base 2: scores times log2(e), weights 2^(s - max) by
// one ex2.approx each (expf's range reduction was ~6 instructions a weight, and the
// prefill kernel issues an instruction every other cycle on each scheduler). ex2.approx
// is within 2 ulp; its flush of results under 2^-126 to zero drops only weights that
// vanish next to the max's 1.
constexpr float kLog2e = 1.4426950408889634f;
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// MAXT / MINB: launch bounds; UNROLL: slots whose loads are in flight together per thread.
// ASYNC (VEC 4, one slot group): each chunk's kv and scores are copied into shared memory
// (cp.async), the next chunk's copies issued before this one is pooled, so two chunks'
// loads are in flight without holding them in registers (2 x UNROLL x 32 bytes a thread).
// RING (with ASYNC; the launch gives it 3 x width floats more of shared memory): the
// entry's ring row (Source::ring_job) is copied into shared memory by cp.async at the
// start, under the slots' loads, and stored from there at the end. ASYNC kernels also
// load the epilogue's first norm weights and RoPE frequencies into registers at the
// start. A decode entry's chain was: slots, epilogue weights, ring row sources: three
// round trips after the slot table, now one.
// STREAMING: the slots' kv and scores by cache-streaming loads (ld.global.cs).
template <class Source, class OutT, int VEC, int MAXT = 512, int MINB = 1, int UNROLL = kUnroll, bool ASYNC = false,
          bool STREAMING = false, bool RING = false>
__global__ void __launch_bounds__(MAXT, MINB) compress_kernel(const Source src, const NormRope nr) {
  pdl_entry();  // see launch_kernel
  extern __shared__ __align__(16) float pooled[];  // [dim], 32 floats of reduction scratch, the slot table
  float* scratch = pooled + nr.dim;
  Slot* table = reinterpret_cast<Slot*>(scratch + 32);
  const int64_t e = blockIdx.x;
  if (!src.active(e)) {
    src.after(e, 0);
    return;
  }
  using V = Vec<VEC>;
  const int slots = src.num_slots();
  float4* const stage = reinterpret_cast<float4*>((reinterpret_cast<uintptr_t>(table + slots) + 15) & ~uintptr_t{15});
  const int64_t rope_begin = nr.dim - nr.rope.rope_dim;
  auto freq_of = [&](int64_t c) { return c >= rope_begin ? nr.rope.inv_freq[(c - rope_begin) / 2] : 0.f; };
  constexpr int kPre = 2;  // epilogue pairs a thread prefetches (ASYNC)
  float pre_w[kPre][2] = {}, pre_f[kPre] = {};
  RingJob job{};
  const float* ring_src = nullptr;  // staged kv, score, bias of the ring row (RING)
  if constexpr (RING) job = src.ring_job(e);
  if constexpr (ASYNC) {
    if (job.dst != nullptr && job.width % 4 == 0 && aligned16(job.kv, job.score, job.bias)) {
      auto* ring_stage = reinterpret_cast<float*>(stage + 2 * UNROLL * 2 * blockDim.x);
      for (int64_t i = threadIdx.x; i < job.width / 4; i += blockDim.x) {
        cp_async16(ring_stage + 4 * i, job.kv + 4 * i, true);
        cp_async16(ring_stage + job.width + 4 * i, job.score + 4 * i, true);
        if (job.bias != nullptr) cp_async16(ring_stage + 2 * job.width + 4 * i, job.bias + 4 * i, true);
      }
      cp_async_commit();  // the oldest group: complete by the main loop's first wait
      ring_src = ring_stage;
    }
#pragma unroll
    for (int k = 0; k < kPre; ++k) {
      const int64_t c = 2 * (threadIdx.x + static_cast<int64_t>(k) * blockDim.x);
      if (c < nr.dim) {
        pre_w[k][0] = nr.weight[c];
        pre_w[k][1] = nr.weight[c + 1];
        pre_f[k] = freq_of(c);
      }
    }
  }
  // Where each slot lives, worked out once per entry (not per channel group), and
  // whether every slot's rows are 16-byte aligned (then read without per-load checks).
  int aligned = 1;
  for (int s = threadIdx.x; s < slots; s += blockDim.x) {
    const Slot sl = src.slot(e, s);
    table[s] = sl;
    aligned &= aligned16(sl.kv, sl.sc, sl.bias);
  }
  const bool all_aligned = __syncthreads_and(aligned) != 0 && VEC == 4;
  const int64_t groups = nr.dim / VEC;
  // Thread t pools channel groups t % tpg, ... over the slots of slot group t / tpg.
  const int tpg = blockDim.x / nr.slot_groups;
  const int sgrp = threadIdx.x / tpg;
  const int per_group = (slots + nr.slot_groups - 1) / nr.slot_groups;
  const int s_begin = sgrp * per_group;
  const int s_end = min(slots, s_begin + per_group);
  float* part = reinterpret_cast<float*>(table + slots);  // [slot_groups][3][dim] when slot_groups > 1
  float ss = 0.f;
  for (int64_t g = threadIdx.x % tpg; g < groups; g += tpg) {
    const int64_t c0 = g * VEC;
    float m[VEC], l[VEC], acc[VEC];
#pragma unroll
    for (int i = 0; i < VEC; ++i) {
      m[i] = -INFINITY;
      l[i] = 0.f;
      acc[i] = 0.f;
    }
    // This thread's staged chunk `b` (ASYNC): slot u's kv then scores, one float4 each.
    auto staged = [&](int b, int u, int a) -> float4& {
      return stage[((b * UNROLL + u) * 2 + a) * blockDim.x + threadIdx.x];
    };
    auto issue = [&](int s0, int b) {
#pragma unroll
      for (int u = 0; u < UNROLL; ++u) {
        const int s = s0 + u;
        const Slot sl = s < s_end ? table[s] : Slot{};
        const bool valid = sl.kv != nullptr;  // else zeros, nothing read
        if (valid && ((reinterpret_cast<uintptr_t>(sl.kv + c0) | reinterpret_cast<uintptr_t>(sl.sc + c0)) & 15)) {
          staged(b, u, 0) = Vec<4>::load(sl.kv + c0);  // not 16-byte aligned: a plain copy
          staged(b, u, 1) = Vec<4>::load(sl.sc + c0);
        } else {
          cp_async16(&staged(b, u, 0), valid ? sl.kv + c0 : nr.weight, valid);
          cp_async16(&staged(b, u, 1), valid ? sl.sc + c0 : nr.weight, valid);
        }
      }
      cp_async_commit();
    };
    int buf = 0;
    if constexpr (ASYNC) issue(s_begin, 0);
    // Online softmax over chunks of UNROLL slots: every load of a chunk in flight
    // together, one rescale per chunk, no data-dependent branches.
    for (int s0 = s_begin; s0 < s_end; s0 += UNROLL) {
      if constexpr (ASYNC) {
        if (s0 + UNROLL < s_end) {
          issue(s0 + UNROLL, buf ^ 1);
          cp_async_wait<1>();
        } else {
          cp_async_wait<0>();
        }
      }
      float kvf[UNROLL][VEC], scf[UNROLL][VEC];
#pragma unroll
      for (int u = 0; u < UNROLL; ++u) {
        const int s = s0 + u;
        const Slot sl = s < s_end ? table[s] : Slot{};
        if (sl.kv != nullptr) {
          typename V::T kv, sc, bias{};
          if constexpr (ASYNC) {
            kv = staged(buf, u, 0);
            sc = staged(buf, u, 1);
          } else if constexpr (STREAMING && VEC == 4) {
            kv = load_streaming(sl.kv + c0);
            sc = load_streaming(sl.sc + c0);
          } else if constexpr (VEC == 4) {
            kv = all_aligned ? *reinterpret_cast<const float4*>(sl.kv + c0) : V::load(sl.kv + c0);
            sc = all_aligned ? *reinterpret_cast<const float4*>(sl.sc + c0) : V::load(sl.sc + c0);
          } else {
            kv = V::load(sl.kv + c0);
            sc = V::load(sl.sc + c0);
          }
          if (sl.bias != nullptr) {
            if constexpr (VEC == 4) {
              bias = all_aligned ? *reinterpret_cast<const float4*>(sl.bias + c0) : V::load(sl.bias + c0);
            } else {
              bias = V::load(sl.bias + c0);
            }
          }
#pragma unroll
          for (int i = 0; i < VEC; ++i) {
            kvf[u][i] = V::get(kv, i);
            scf[u][i] = (V::get(sc, i) + (sl.bias != nullptr ? V::get(bias, i) : 0.f)) * kLog2e;
          }
        } else {
#pragma unroll
          for (int i = 0; i < VEC; ++i) {
            kvf[u][i] = 0.f;
            scf[u][i] = -INFINITY;
          }
        }
      }
      buf ^= 1;
#pragma unroll
      for (int i = 0; i < VEC; ++i) {
        float mn = m[i];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) mn = fmaxf(mn, scf[u][i]);
        if (mn > -INFINITY) {
          const float f = fast_exp2(m[i] - mn);  // 0 while m is -inf
          float a = acc[i] * f, ls = l[i] * f;
#pragma unroll
          for (int u = 0; u < UNROLL; ++u) {
            const float pr = fast_exp2(scf[u][i] - mn);  // 0 for empty slots
            a = fmaf(pr, kvf[u][i], a);
            ls += pr;
          }
          acc[i] = a;
          l[i] = ls;
          m[i] = mn;
        }
      }
    }
    if (nr.slot_groups == 1) {
#pragma unroll
      for (int i = 0; i < VEC; ++i) {
        const float v = l[i] > 0.f ? acc[i] / l[i] : 0.f;
        pooled[c0 + i] = v;
        ss += v * v;
      }
    } else {
#pragma unroll
      for (int i = 0; i < VEC; ++i) {
        part[(sgrp * 3 + 0) * nr.dim + c0 + i] = m[i];
        part[(sgrp * 3 + 1) * nr.dim + c0 + i] = l[i];
        part[(sgrp * 3 + 2) * nr.dim + c0 + i] = acc[i];
      }
    }
  }
  if (nr.slot_groups > 1) {  // merge the groups' softmax states per channel
    __syncthreads();
    for (int64_t c = threadIdx.x; c < nr.dim; c += blockDim.x) {
      float mx = -INFINITY;
      for (int q = 0; q < nr.slot_groups; ++q) mx = fmaxf(mx, part[(q * 3) * nr.dim + c]);
      float lsum = 0.f, asum = 0.f;
      if (mx > -INFINITY) {
        for (int q = 0; q < nr.slot_groups; ++q) {
          const float f = fast_exp2(part[(q * 3) * nr.dim + c] - mx);
          lsum += part[(q * 3 + 1) * nr.dim + c] * f;
          asum += part[(q * 3 + 2) * nr.dim + c] * f;
        }
      }
      const float v = lsum > 0.f ? asum / lsum : 0.f;
      pooled[c] = v;
      ss += v * v;
    }
  }
  ss = block_sum(ss, scratch);  // also orders the pooled writes before the reads below
  const float inv = 1.0f / sqrtf(ss / static_cast<float>(nr.dim) + nr.eps);
  const int64_t pos = src.position(e);
  void* out = src.out_row(e);
  auto emit = [&](int64_t c, float w0, float w1, float freq) {
    float a = w0 * (pooled[c] * inv);
    float b = w1 * (pooled[c + 1] * inv);
    if (c >= rope_begin) rope_pair(a, b, freq * static_cast<float>(pos), nr.rope.scale, false);
    store_out<OutT>(out, c, a);
    store_out<OutT>(out, c + 1, b);
  };
  int64_t pi = threadIdx.x;
  if constexpr (ASYNC) {
#pragma unroll
    for (int k = 0; k < kPre; ++k, pi += blockDim.x) {
      if (pi < nr.dim / 2) emit(2 * pi, pre_w[k][0], pre_w[k][1], pre_f[k]);
    }
  }
  for (; pi < nr.dim / 2; pi += blockDim.x) {
    const int64_t c = 2 * pi;
    emit(c, nr.weight[c], nr.weight[c + 1], freq_of(c));
  }
  if constexpr (RING) {
    if (ring_src != nullptr) {
      cp_async_wait<0>();  // a thread without a channel group never waited in the loop
      __syncthreads();
      store_ring_row(job.dst, ring_src, ring_src + job.width, job.bias != nullptr ? ring_src + 2 * job.width : nullptr,
                     job.score_out, job.width);
      return;
    }
  }
  __syncthreads();
  src.after(e, 0);
}

// The chunk's last ring_slots tokens go into the ring (kv, then score + bias).
__global__ void ring_update_kernel(const float* kv, const float* score, WindowGeometry g, int64_t start,
                                   int64_t first_token, float* ring) {
  pdl_entry();  // see launch_kernel
  const int64_t j = first_token + blockIdx.x;
  const int64_t t = j - start;
  float* r = ring + (j % g.ring_slots) * 2 * g.width;
  const float* bias = g.ape + (j % g.rate) * g.width;
  for (int64_t c = threadIdx.x; c < g.width; c += blockDim.x) {
    r[c] = kv[t * g.width + c];
    r[g.width + c] = score[t * g.width + c] + bias[c];
  }
}

int block_for(int64_t dim, int vec) {
  const int64_t groups = dim / vec;
  int threads = static_cast<int>(std::min<int64_t>(256, (groups + 31) / 32 * 32));
  return std::max(threads, 32);
}

// ring_width: the width of the decode sources' ring rows (RingJob), 0 for the others.
template <class Source>
void launch(const Source& src, int64_t count, int slots, const NormRope& nr, EntryType type, cudaStream_t stream,
            int64_t ring_width = 0) {
  if (count == 0) return;
  TROUPE_REQUIRE(nr.dim % 2 == 0 && nr.rope.rope_dim <= nr.dim && nr.dim <= 12288, "compressor: bad dim");
  TROUPE_REQUIRE(count <= 0x7fffffff, "compressor: too many entries");
  const bool vec = nr.dim % 4 == 0;
  const int tpg = block_for(nr.dim, vec ? 4 : 1);
  TROUPE_REQUIRE(slots >= 1 && slots <= 4096, "compressor: 1..4096 slots");
  // Long windows (HCA): split the slots over up to 4 thread groups, so that 4x the
  // loads are in flight per entry; short ones (CSA) keep one group.
  NormRope n2 = nr;
  n2.slot_groups = slots >= 64 ? std::max(1, std::min(4, 512 / tpg)) : 1;
  const int threads = tpg * n2.slot_groups;
  const size_t smem = static_cast<size_t>(nr.dim + 32) * 4 + static_cast<size_t>(slots) * sizeof(Slot) +
                      (n2.slot_groups > 1 ? static_cast<size_t>(n2.slot_groups) * 3 * nr.dim * 4 : 0);
  TROUPE_REQUIRE(smem <= 200 * 1024, "compressor: entry too wide");
  static bool attr = [] {
    for (auto f : {compress_kernel<Source, float, 4>, compress_kernel<Source, float, 1>,
                   compress_kernel<Source, __nv_bfloat16, 4>, compress_kernel<Source, __nv_bfloat16, 1>,
                   compress_kernel<Source, float, 4, 128, 8, 4>, compress_kernel<Source, __nv_bfloat16, 4, 128, 8, 4>,
                   compress_kernel<Source, float, 4, 128, 6, 4, true>,
                   compress_kernel<Source, __nv_bfloat16, 4, 128, 6, 4, true>,
                   compress_kernel<Source, float, 4, 128, 4, 4, true, false, true>,
                   compress_kernel<Source, __nv_bfloat16, 4, 128, 4, 4, true, false, true>,
                   compress_kernel<Source, float, 4, 512, 2, 4>, compress_kernel<Source, __nv_bfloat16, 4, 512, 2, 4>,
                   compress_kernel<Source, float, 4, 512, 2, 4, false, true>,
                   compress_kernel<Source, __nv_bfloat16, 4, 512, 2, 4, false, true>}) {
      TROUPE_CUDA(cudaFuncSetAttribute(f, cudaFuncAttributeMaxDynamicSharedMemorySize, 200 * 1024));
    }
    return true;
  }();
  (void)attr;
  // TROUPE_COMPRESSOR_UNROLL8=1: the 8-slot-chunk kernels only (an A/B switch for the
  // 64-register variants below, whose 4-slot chunks round the online softmax differently).
  static const bool only8 = [] {
    const char* e = std::getenv("TROUPE_COMPRESSOR_UNROLL8");
    return e != nullptr && e[0] == '1';
  }();
  const dim3 grid(static_cast<unsigned>(count));
  size_t async_smem = smem + 16 + 2 * 4 * 2 * static_cast<size_t>(threads) * 16;
  bool stage_ring = false;
  if (ring_width > 0) {  // the ring row staged too, where the CTAs of the one wave still fit
    const size_t with_ring = async_smem + 3 * static_cast<size_t>(ring_width) * 4;
    const int64_t per_sm = (count + sm_count() - 1) / sm_count();
    if (per_sm <= 4 && static_cast<size_t>(per_sm) * (with_ring + 1024) <= 227 * 1024) {
      async_smem = with_ring;
      stage_ring = true;
    }
  }
  if (!only8 && vec && threads <= 128 && smem <= 24 * 1024 && count <= 6 * static_cast<int64_t>(sm_count())) {
    // Short windows (CSA), one wave of CTAs (decode): each chunk of 4 slots staged in
    // shared memory by cp.async with the next chunk's copies in flight, one round trip
    // for an entry's loads instead of two (batch 64: 6.7 -> 6.15 us); 6 CTAs an SM. Not
    // for many waves, where the staging's lower occupancy costs (65,536 tokens: 174 ->
    // 215 us). Staging the ring row too leaves room for 4 CTAs an SM: 128 registers.
    if (stage_ring) {
      if (type == EntryType::f32) {
        launch_kernel(compress_kernel<Source, float, 4, 128, 4, 4, true, false, true>, grid, threads, async_smem, stream,
                      src, n2);
      } else {
        launch_kernel(compress_kernel<Source, __nv_bfloat16, 4, 128, 4, 4, true, false, true>, grid, threads,
                      async_smem, stream, src, n2);
      }
    } else if (type == EntryType::f32) {
      launch_kernel(compress_kernel<Source, float, 4, 128, 6, 4, true>, grid, threads, async_smem, stream, src, n2);
    } else {
      launch_kernel(compress_kernel<Source, __nv_bfloat16, 4, 128, 6, 4, true>, grid, threads, async_smem, stream,
                    src, n2);
    }
  } else if (!only8 && vec && threads <= 128 && smem <= 24 * 1024) {
    // Short windows (CSA): 128-thread CTAs held to 64 registers, 8 per SM (was 4 at 114
    // registers), so twice the warps keep loads in flight through each entry's epilogue.
    if (type == EntryType::f32) {
      launch_kernel(compress_kernel<Source, float, 4, 128, 8, 4>, grid, threads, smem, stream, src, n2);
    } else {
      launch_kernel(compress_kernel<Source, __nv_bfloat16, 4, 128, 8, 4>, grid, threads, smem, stream, src, n2);
    }
  } else if (!only8 && vec && smem <= 100 * 1024 && count > 2 * static_cast<int64_t>(sm_count())) {
    // Long windows (HCA, up to 512 threads), more than a wave (prefill): as below, the
    // slots read by cache-streaming loads (65,536 tokens at rate 128: 76.9 -> 73.3 us;
    // 2.4 us slower at batch 64, so not for one wave).
    if (type == EntryType::f32) {
      launch_kernel(compress_kernel<Source, float, 4, 512, 2, 4, false, true>, grid, threads, smem, stream, src, n2);
    } else {
      launch_kernel(compress_kernel<Source, __nv_bfloat16, 4, 512, 2, 4, false, true>, grid, threads, smem, stream,
                    src, n2);
    }
  } else if (!only8 && vec && smem <= 100 * 1024) {
    // Long windows (HCA, up to 512 threads): held to 64 registers, two CTAs per SM (was one).
    if (type == EntryType::f32) {
      launch_kernel(compress_kernel<Source, float, 4, 512, 2, 4>, grid, threads, smem, stream, src, n2);
    } else {
      launch_kernel(compress_kernel<Source, __nv_bfloat16, 4, 512, 2, 4>, grid, threads, smem, stream, src, n2);
    }
  } else if (type == EntryType::f32) {
    if (vec) {
      launch_kernel(compress_kernel<Source, float, 4>, grid, threads, smem, stream, src, n2);
    } else {
      launch_kernel(compress_kernel<Source, float, 1>, grid, threads, smem, stream, src, n2);
    }
  } else {
    if (vec) {
      launch_kernel(compress_kernel<Source, __nv_bfloat16, 4>, grid, threads, smem, stream, src, n2);
    } else {
      launch_kernel(compress_kernel<Source, __nv_bfloat16, 1>, grid, threads, smem, stream, src, n2);
    }
  }
  TROUPE_LAUNCHED();
}

WindowGeometry geometry(const CompressorShape& s) {
  WindowGeometry g{};
  g.rate = s.rate;
  g.overlap = s.overlap;
  g.dim = s.dim;
  g.width = s.overlap ? 2 * s.dim : s.dim;
  g.ring_slots = s.overlap ? 2 * s.rate : s.rate;
  g.ape = s.ape;
  return g;
}

}  // namespace

void compress_prefill(const CompressorShape& s, const float* kv, const float* score, int64_t tokens, int64_t start,
                      float* ring, void* const* out_rows, EntryType out_type, cudaStream_t stream) {
  TROUPE_REQUIRE(s.rate >= 1 && tokens >= 0 && start >= 0, "compress_prefill: bad arguments");
  const WindowGeometry g = geometry(s);
  const int64_t count = (start + tokens) / s.rate - start / s.rate;
  // The chunk's last ring_slots tokens go into the ring. Entries read the ring only for
  // tokens before the chunk (start > 0); then the ring is rewritten by a second kernel
  // once every entry has read it (stream order), else by CTAs past the entries' in the
  // same launch.
  const int64_t first = std::max(start, start + tokens - g.ring_slots);
  const int64_t n = ring != nullptr ? start + tokens - first : 0;
  const bool fused = start == 0 && n > 0;
  PrefillSource src{g, kv, score, start, start / s.rate, ring, out_rows, count, fused ? ring : nullptr, first};
  launch(src, count + (fused ? n : 0), g.overlap ? 2 * g.rate : g.rate,
         NormRope{s.dim, s.norm_weight, s.eps, s.rope, 1}, out_type, stream);
  if (n > 0 && !fused) {
    launch_kernel(ring_update_kernel, static_cast<unsigned>(n), 256, 0, stream, kv, score, g, start, first, ring);
    TROUPE_LAUNCHED();
  }
}

void compress_decode(const CompressorShape& s, const float* kv, const float* score, int64_t batch,
                     const int64_t* positions, float* const* rings, void* const* out_rows, EntryType out_type,
                     cudaStream_t stream) {
  TROUPE_REQUIRE(s.rate >= 1, "compress_decode: bad rate");
  DecodeSource src{geometry(s), kv, score, positions, rings, out_rows};
  launch(src, batch, s.overlap ? 2 * s.rate : s.rate, NormRope{s.dim, s.norm_weight, s.eps, s.rope, 1}, out_type,
         stream, src.g.width);
}

void compress_decode_paged(const CompressorShape& s, int64_t batch, const int64_t* positions, const int32_t* table_of,
                           const float* kv, float* score, float* const* ring, int64_t ring_stride,
                           float* const* entries, int64_t entry_stride, cudaStream_t stream) {
  TROUPE_REQUIRE(s.rate >= 1, "compress_decode_paged: bad rate");
  PagedDecodeSource src{geometry(s), kv, score, s.ape, positions, table_of, ring, ring_stride, entries, entry_stride};
  launch(src, batch, s.overlap ? 2 * s.rate : s.rate, NormRope{s.dim, s.norm_weight, s.eps, s.rope, 1}, EntryType::f32,
         stream, src.g.width);
}

void compress_slots(int64_t count, int slots, int64_t dim, const float* const* kv_src, const float* const* score_src,
                    const float* norm_weight, float eps, const int64_t* positions, const RopeTable& rope,
                    float* const* out, cudaStream_t stream) {
  PointerSource src{kv_src, score_src, positions, out, slots};
  launch(src, count, slots, NormRope{dim, norm_weight, eps, rope, 1}, EntryType::f32, stream);
}

}  // namespace troupe::kernels::cuda
