// Fused compressor kernels (see compressor.hpp). One CTA per entry: each thread
// pools 4 channels (or 1 when dim % 4 != 0) with an online softmax over the
// slots, loads of several slots in flight; then rmsnorm and RoPE over the entry.
#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <type_traits>

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
  // compress_decode_kernel's view: the sequence's first round trip (its position, ring and
  // entry row), then its rows by ring row r (ring_slots rows of kv then score).
  struct Sequence {
    int64_t p;
    float* ring;
    void* out;
  };
  __device__ Sequence sequence(int64_t b) const { return {positions[b], rings[b], out[b]}; }
  // (in 32 bits: compress_decode_kernel's rings are at most 4,096 rows of 4,096 floats)
  __device__ float* ring_row(const Sequence& q, int r) const { return q.ring + r * static_cast<int>(2 * g.width); }
  __device__ void* entry_row(const Sequence& q, int64_t) const { return q.out; }
  __device__ const float* bias_row(int rem) const { return g.ape + static_cast<int64_t>(rem) * g.width; }
  __device__ float* score_out(int64_t) const { return nullptr; }
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
  // compress_decode_kernel's view (see DecodeSource): the table row comes with the position,
  // each ring row and the entry row are one more load.
  struct Sequence {
    int64_t p;
    int64_t row;
  };
  __device__ Sequence sequence(int64_t b) const { return {positions[b], row(b)}; }
  __device__ float* ring_row(const Sequence& q, int r) const { return ring[q.row * ring_stride + r]; }
  __device__ void* entry_row(const Sequence& q, int64_t i) const { return entries[q.row * entry_stride + i]; }
  __device__ const float* bias_row(int rem) const {
    return bias != nullptr ? bias + static_cast<int64_t>(rem) * g.width : nullptr;
  }
  __device__ float* score_out(int64_t b) const { return bias != nullptr ? score + b * g.width : nullptr; }
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

// ---- the decode form as a short chain of round trips (the default; TROUPE_COMPRESS_DECODE=1: the one-wave form)
// compress_kernel's decode launch waits, one after another, on: the position; the ring pointer
// (loaded behind the branch on the position); the slot table in shared memory and its barrier; the
// slots' copies in two chunks; the norm's sum (two barriers); the RoPE sin and cos; the ring row's
// staged copy and a barrier before its store (session 18's stamps: ~5.1 us a CTA at batch 64).
// compress_decode_kernel, a CTA a sequence as there, waits on:
//   1. one round trip for the position with the ring and entry pointers (DecodeSource) or the
//      table row (PagedDecodeSource, whose ring rows' and entry's pointers are one more), the new
//      token's kv and score, the norm weights and the RoPE frequencies, all issued together;
//   2. one round trip for CHUNK slots of the window a thread, into registers, with the new token's
//      position bias: each thread works out the slots' rows itself (no table, no barrier);
//   3. the online softmax over those registers, one barrier for the norm's sum, the entry's store.
// The RoPE turns are computed while 2 is in flight, and the threads that loaded the new token's
// channels store its ring row from registers as soon as the bias is in: no other thread reads
// those channels, and the row it writes is none of the entry's slots (see PagedDecodeSource).

// 4 floats at p: one 16-byte access where `vec`, else four.
__device__ __forceinline__ float4 load4(const float* p, bool vec) {
  if (vec) return *reinterpret_cast<const float4*>(p);
  return make_float4(p[0], p[1], p[2], p[3]);
}
__device__ __forceinline__ void store4(float* p, float4 v, bool vec) {
  if (vec) {
    *reinterpret_cast<float4*>(p) = v;
  } else {
    p[0] = v.x;
    p[1] = v.y;
    p[2] = v.z;
    p[3] = v.w;
  }
}
__device__ __forceinline__ float4 add4(float4 a, float4 b) {
  return make_float4(a.x + b.x, a.y + b.y, a.z + b.z, a.w + b.w);
}

// p / rate and p % rate, in 32 bits where p fits: a 64-bit division is a long instruction
// sequence, and it stands between the position's load and the slots' loads.
struct WindowOf {
  int64_t entry;
  int rem;
};
__device__ __forceinline__ WindowOf window_of(int64_t p, int rate) {
  if (p >= 0 && p <= 0xffffffffll) {
    const uint32_t q = static_cast<uint32_t>(p) / static_cast<uint32_t>(rate);
    return {q, static_cast<int>(static_cast<uint32_t>(p) - q * static_cast<uint32_t>(rate))};
  }
  const int64_t q = p / rate;
  return {q, static_cast<int>(p - q * rate)};
}

// The entry's 4 channels at c0 (a multiple of 4), 16 (f32) or 8 (bf16) bytes at a time where aligned.
template <class OutT>
__device__ __forceinline__ void store_entry4(void* out, int c0, const float (&o)[4]) {
  if constexpr (std::is_same_v<OutT, float>) {
    float* p = static_cast<float*>(out) + c0;
    store4(p, make_float4(o[0], o[1], o[2], o[3]), aligned16(p));
  } else {
    __nv_bfloat16* p = static_cast<__nv_bfloat16*>(out) + c0;
    if ((reinterpret_cast<uintptr_t>(p) & 7) == 0) {
      *reinterpret_cast<uint2*>(p) = make_uint2(pack_bf16x2(o[0], o[1]), pack_bf16x2(o[2], o[3]));
    } else {
#pragma unroll
      for (int i = 0; i < 4; ++i) p[i] = __float2bfloat16_rn(o[i]);
    }
  }
}

// A CTA of slot_groups x tpg threads a sequence (decode sources; dim % 4 == 0, dim <= 1,024; kv,
// score, the bias and the norm weights 16-byte aligned: the launch checks). Thread t of a group
// owns the entry's channels c0 = 4 (t % tpg) .. c0 + 3 and, of the new token's row, those of each
// half. CHUNK: ring slots a thread has in flight together; ONE_PASS: one group, the window's slots
// (at most CHUNK + 1 with the new token) in one pass, their indices known at compile time; else
// each group goes through its share of the slots CHUNK at a time, and group 0 merges the groups'
// states through shared memory. MAXT: the launch bound (registers: a pass's kv and score are
// 8 (CHUNK + 1) of them).
template <class Source, class OutT, int CHUNK, bool ONE_PASS, int MAXT>
__global__ void __launch_bounds__(MAXT) compress_decode_kernel(const Source src, const NormRope nr) {
  pdl_entry();  // see launch_kernel
  __shared__ float warp_ss[32];                  // the norm's sum of squares, a partial a warp
  extern __shared__ __align__(16) float part[];  // [slot_groups][3][dim]: the groups' m, l, acc
  const WindowGeometry& g = src.g;
  const int64_t b = blockIdx.x;
  const int slots = g.overlap ? 2 * g.rate : g.rate;  // = ring_slots
  const int dim = static_cast<int>(nr.dim);
  const int tpg = ONE_PASS ? blockDim.x : blockDim.x / nr.slot_groups;
  const int sgrp = ONE_PASS ? 0 : threadIdx.x / tpg;
  const int c0 = (threadIdx.x % tpg) * 4;
  const bool chans = c0 < dim;
  const int per_group = ONE_PASS ? CHUNK + 1 : (slots + nr.slot_groups - 1) / nr.slot_groups;
  const int s_begin = sgrp * per_group, s_end = min(slots, s_begin + per_group);
  // The group of the window's last slot (the new token) loads the token's row and stores it into
  // the ring; group 0 writes the entry.
  const bool owner = chans && s_begin <= slots - 1 && slots - 1 < s_end;
  const bool emits = chans && sgrp == 0;
  const int halves = g.overlap ? 2 : 1;  // of the new token's row; the entry pools the last

  // Round trip 1.
  const auto q = src.sequence(b);
  float4 kv_new[2] = {}, sc_new[2] = {};
  if (owner) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      if (h < halves) {
        kv_new[h] = load4(src.kv + b * g.width + h * dim + c0, true);
        sc_new[h] = load4(src.score + b * g.width + h * dim + c0, true);
      }
    }
  }
  const int rope_begin = dim - static_cast<int>(nr.rope.rope_dim);
  float4 w = {};
  float freq[2] = {};
  if (emits) {
    w = load4(nr.weight + c0, true);
#pragma unroll
    for (int k = 0; k < 2; ++k) {
      if (c0 + 2 * k >= rope_begin) freq[k] = nr.rope.inv_freq[(c0 + 2 * k - rope_begin) / 2];
    }
  }
  const WindowOf win = window_of(q.p, g.rate);
  const bool closing = win.rem == g.rate - 1;
  const int pr = g.overlap && (win.entry & 1) ? win.rem + g.rate : win.rem;  // p % ring_slots

  // The new token's ring row (kv, then score + bias) and, paged, its biased score back into
  // `score`. The bias comes with round trip 2 (with the ring row's pointer, paged).
  const float* bias = src.bias_row(win.rem);
  float4 bias_new[2] = {};
  if (owner && bias != nullptr) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      if (h < halves) bias_new[h] = load4(bias + h * dim + c0, true);
    }
  }
  float* const dst = owner ? src.ring_row(q, pr) : nullptr;
  float* const score_out = owner ? src.score_out(b) : nullptr;
  float4 biased[2] = {};  // the new token's score + bias, by half
  auto store_ring = [&] {
    const bool vec = aligned16(dst);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      if (h < halves) {
        biased[h] = bias != nullptr ? add4(sc_new[h], bias_new[h]) : sc_new[h];
        store4(dst + h * dim + c0, kv_new[h], vec);
        store4(dst + g.width + h * dim + c0, biased[h], vec);
        if (score_out != nullptr) store4(score_out + h * dim + c0, biased[h], true);
      }
    }
  };
  if (!closing) {
    if (owner) store_ring();
    return;
  }
  void* const out = emits ? src.entry_row(q, win.entry) : nullptr;  // paged: a load, used at the end

  // Slot s < slots - 1 is token p - (slots - 1) + s, none for s below `empty` (the first window),
  // in ring row (p + 1 + s) % ring_slots, half 1 where overlap && s >= rate; slot slots - 1 is
  // the new token. A pass's terms: CHUNK ring slots from s0 on, then the new token where the pass
  // holds it; a term with nothing to read stays 0 and -inf (a zero weight).
  const int empty = q.p >= slots - 1 ? 0 : static_cast<int>(slots - 1 - q.p);
  const int r0 = pr + 1 == slots ? 0 : pr + 1;
  float4 kvs[CHUNK + 1], scs[CHUNK + 1];
  const float* rows[CHUNK];
  // Every row pointer is worked out (paged: loaded) without a branch, then dropped where the slot
  // is none of the group's ring slots; past the window, s stands in for the last ring slot.
  auto ring_rows = [&](int s0) {
#pragma unroll
    for (int u = 0; u < CHUNK; ++u) {
      const int s = min(s0 + u, slots - 1);
      const int r = r0 + s < slots ? r0 + s : r0 + s - slots;
      const float* const row = src.ring_row(q, r) + ((g.overlap && s >= g.rate ? dim : 0) + c0);
      rows[u] = chans && s0 + u < s_end && s0 + u < slots - 1 && s0 + u >= empty ? row : nullptr;
    }
  };
  auto load_chunk = [&] {
    uintptr_t bits = 0;
#pragma unroll
    for (int u = 0; u < CHUNK; ++u) bits |= reinterpret_cast<uintptr_t>(rows[u]);
    const bool vec = (bits & 15) == 0;
#pragma unroll
    for (int u = 0; u <= CHUNK; ++u) {
      kvs[u] = make_float4(0.f, 0.f, 0.f, 0.f);
      scs[u] = make_float4(-INFINITY, -INFINITY, -INFINITY, -INFINITY);
      if (u < CHUNK && rows[u] != nullptr) {
        kvs[u] = load4(rows[u], vec);
        scs[u] = load4(rows[u] + g.width, vec);
      }
    }
  };
  ring_rows(s_begin);
  load_chunk();
  // Round trip 2 is in flight: the RoPE turns of this thread's pairs, then the ring row.
  const float pos = static_cast<float>(win.entry * g.rate);
  float rc[2] = {}, rs[2] = {};
#pragma unroll
  for (int k = 0; k < 2; ++k) {
    if (emits && c0 + 2 * k >= rope_begin) {
      sincosf(freq[k] * pos, &rs[k], &rc[k]);
      rc[k] *= nr.rope.scale;
      rs[k] *= nr.rope.scale;
    }
  }
  if (owner) store_ring();

  float m[4], l[4], acc[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    m[i] = -INFINITY;
    l[i] = 0.f;
    acc[i] = 0.f;
  }
  for (int s0 = s_begin;; s0 += CHUNK) {
    const bool more = !ONE_PASS && s0 + CHUNK < s_end;
    if (more) ring_rows(s0 + CHUNK);  // paged: the next chunk's pointers under this chunk's loads
    if (owner && (ONE_PASS || (s0 <= slots - 1 && slots - 1 < s0 + CHUNK))) {
      kvs[CHUNK] = g.overlap ? kv_new[1] : kv_new[0];
      scs[CHUNK] = g.overlap ? biased[1] : biased[0];
    }
    // compress_kernel's online softmax step, in the log2 domain
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      float kvf[CHUNK + 1], scf[CHUNK + 1];
#pragma unroll
      for (int u = 0; u <= CHUNK; ++u) {
        kvf[u] = Vec<4>::get(kvs[u], i);
        scf[u] = Vec<4>::get(scs[u], i) * kLog2e;
      }
      float mn = m[i];
#pragma unroll
      for (int u = 0; u <= CHUNK; ++u) mn = fmaxf(mn, scf[u]);
      if (mn > -INFINITY) {
        const float f = fast_exp2(m[i] - mn);  // 0 while m is -inf
        float a = acc[i] * f, ls = l[i] * f;
#pragma unroll
        for (int u = 0; u <= CHUNK; ++u) {
          const float e = fast_exp2(scf[u] - mn);  // 0 for empty terms
          a = fmaf(e, kvf[u], a);
          ls += e;
        }
        acc[i] = a;
        l[i] = ls;
        m[i] = mn;
      }
    }
    if (!more) break;
    load_chunk();
  }

  float v[4] = {};
  if constexpr (ONE_PASS) {
#pragma unroll
    for (int i = 0; i < 4; ++i) v[i] = l[i] > 0.f ? acc[i] / l[i] : 0.f;
  } else {  // merge the groups' softmax states per channel (compress_kernel's merge)
    if (chans) {
      float* const mine = part + sgrp * 3 * dim + c0;
      store4(mine, make_float4(m[0], m[1], m[2], m[3]), true);
      store4(mine + dim, make_float4(l[0], l[1], l[2], l[3]), true);
      store4(mine + 2 * dim, make_float4(acc[0], acc[1], acc[2], acc[3]), true);
    }
    __syncthreads();
    if (emits) {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const float* const st = part + c0 + i;
        float mx = -INFINITY;
        for (int q3 = 0; q3 < nr.slot_groups; ++q3) mx = fmaxf(mx, st[q3 * 3 * dim]);
        float lsum = 0.f, asum = 0.f;
        if (mx > -INFINITY) {
          for (int q3 = 0; q3 < nr.slot_groups; ++q3) {
            const float f = fast_exp2(st[q3 * 3 * dim] - mx);
            lsum += st[(q3 * 3 + 1) * dim] * f;
            asum += st[(q3 * 3 + 2) * dim] * f;
          }
        }
        v[i] = lsum > 0.f ? asum / lsum : 0.f;
      }
    }
  }
  float ss = 0.f;
  if (emits) {
#pragma unroll
    for (int i = 0; i < 4; ++i) ss += v[i] * v[i];
  }
  ss = warp_sum(ss);
  if ((threadIdx.x & 31) == 0) warp_ss[threadIdx.x >> 5] = ss;
  __syncthreads();
  if (!emits) return;
  float total = 0.f;
  for (int i = 0; i < tpg / 32; ++i) total += warp_ss[i];  // group 0's warps
  const float inv = 1.0f / sqrtf(total / static_cast<float>(dim) + nr.eps);
  const float wv[4] = {w.x, w.y, w.z, w.w};
  float o[4];
#pragma unroll
  for (int k = 0; k < 2; ++k) {
    float x = wv[2 * k] * (v[2 * k] * inv);
    float y = wv[2 * k + 1] * (v[2 * k + 1] * inv);
    if (c0 + 2 * k >= rope_begin) {  // rope_pair's turn, with its sin and cos from above
      const float x0 = x;
      x = x0 * rc[k] - y * rs[k];
      y = y * rc[k] + x0 * rs[k];
    }
    o[2 * k] = x;
    o[2 * k + 1] = y;
  }
  store_entry4<OutT>(out, c0, o);
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

// The decode sources on compress_decode_kernel (the default since session 36: 5.8 -> 4.1 us at batch 64,
// docs/kernels-notes.md) where it takes the shape (entries of up to 1,024 channels, a multiple of 4, and
// the rows the host hands over 16-byte aligned; the ring and entry rows are checked on the device);
// anything else, or TROUPE_COMPRESS_DECODE=1 (read at each call): compress_kernel's one-wave form.
bool decode_chain(const CompressorShape& s, const float* kv, const float* score) {
  const char* e = std::getenv("TROUPE_COMPRESS_DECODE");
  if (e != nullptr && std::strcmp(e, "1") == 0) return false;
  const auto a16 = [](const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; };
  return s.dim > 0 && s.dim % 4 == 0 && s.dim <= 1024 && a16(kv) && a16(score) && a16(s.ape) && a16(s.norm_weight);
}

template <class Source>
void launch_decode_chain(const Source& src, int64_t batch, const CompressorShape& s, EntryType type,
                         cudaStream_t stream) {
  if (batch == 0) return;
  const int slots = s.overlap ? 2 * s.rate : s.rate;
  TROUPE_REQUIRE(s.rope.rope_dim <= s.dim, "compressor: bad dim");
  TROUPE_REQUIRE(batch <= 0x7fffffff, "compressor: too many entries");
  TROUPE_REQUIRE(slots >= 1 && slots <= 4096, "compressor: 1..4096 slots");
  const int tpg = static_cast<int>((s.dim / 4 + 31) / 32 * 32);
  // A short window (CSA) in one pass of its 7 ring slots and the new token, up to 256 threads; a
  // long one (HCA) over up to 4 groups of threads (512 at most), 4 ring slots a pass at the
  // kernel's 128 registers.
  const bool one_pass = slots <= 8;
  const int groups = one_pass ? 1 : std::max(1, std::min(4, 512 / tpg));
  const NormRope nr{s.dim, s.norm_weight, s.eps, s.rope, groups};
  const size_t smem = one_pass ? 0 : static_cast<size_t>(groups) * 3 * s.dim * 4;  // <= 48 KB
  const bool f32 = type == EntryType::f32;
  const auto kernel = one_pass ? (f32 ? compress_decode_kernel<Source, float, 7, true, 256>
                                      : compress_decode_kernel<Source, __nv_bfloat16, 7, true, 256>)
                               : (f32 ? compress_decode_kernel<Source, float, 4, false, 512>
                                      : compress_decode_kernel<Source, __nv_bfloat16, 4, false, 512>);
  launch_kernel(kernel, dim3(static_cast<unsigned>(batch)), tpg * groups, smem, stream, src, nr);
  TROUPE_LAUNCHED();
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
  if (decode_chain(s, kv, score)) {
    launch_decode_chain(src, batch, s, out_type, stream);
    return;
  }
  launch(src, batch, s.overlap ? 2 * s.rate : s.rate, NormRope{s.dim, s.norm_weight, s.eps, s.rope, 1}, out_type,
         stream, src.g.width);
}

void compress_decode_paged(const CompressorShape& s, int64_t batch, const int64_t* positions, const int32_t* table_of,
                           const float* kv, float* score, float* const* ring, int64_t ring_stride,
                           float* const* entries, int64_t entry_stride, cudaStream_t stream) {
  TROUPE_REQUIRE(s.rate >= 1, "compress_decode_paged: bad rate");
  PagedDecodeSource src{geometry(s), kv, score, s.ape, positions, table_of, ring, ring_stride, entries, entry_stride};
  if (decode_chain(s, kv, score)) {
    launch_decode_chain(src, batch, s, EntryType::f32, stream);
    return;
  }
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
