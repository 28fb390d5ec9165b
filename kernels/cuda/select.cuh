// Device pieces of the radix selects shared by the top-k kernels (topk.cu) and the
// indexer's fused top-k (indexer.cu): the order-preserving key, page translation, block scans and the
// threshold bucket, warp-aggregated places (one atomic a warp: warp_take, or for a
// thread's several elements chosen_elements + warp_places), and the gpu-scope arrivals
// of the row barriers. Plain CUDA.
#pragma once

#include <cstdint>

namespace troupe::kernels::cuda {

// Order-preserving map of fp32 to uint32 (larger float -> larger key).
__device__ __forceinline__ uint32_t order_key(float f) {
  const uint32_t u = __float_as_uint(f) == 0x80000000u ? 0u : __float_as_uint(f);  // -0 ties with +0
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// The sum of v over lanes 0 .. this lane of the warp. Every lane of the warp calls it.
__device__ __forceinline__ uint32_t warp_inclusive_sum(uint32_t v) {
  const unsigned lane = threadIdx.x & 31;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const uint32_t t = __shfl_up_sync(0xffffffffu, v, o);
    if (lane >= static_cast<unsigned>(o)) v += t;
  }
  return v;
}

// The sum of v over the block's threads before this one (warp_tot: 32 words of shared
// memory). Every thread of the block calls it; three barriers.
__device__ __forceinline__ uint32_t block_exclusive_scan(uint32_t v, uint32_t* warp_tot) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const uint32_t incl = warp_inclusive_sum(v);
  if (lane == 31) warp_tot[warp] = incl;
  __syncthreads();
  if (warp == 0) {
    const uint32_t t = warp_tot[lane];
    warp_tot[lane] = warp_inclusive_sum(t) - t;
  }
  __syncthreads();
  const uint32_t r = warp_tot[warp] + incl - v;
  __syncthreads();
  return r;
}

// Element i of row `row`, translated to its pool row through the row's page table (pages
// of 2^bits elements, `stride` entries a row), or i itself without a table.
__device__ __forceinline__ int32_t page_translate(const int32_t* table, int64_t stride, int bits, int row, int64_t i) {
  if (table == nullptr) return static_cast<int32_t>(i);
  const int32_t page = table[row * stride + (i >> bits)];
  return (page << bits) | static_cast<int32_t>(i & ((int64_t{1} << bits) - 1));
}

// The lanes of a warp where `pred` holds take consecutive places from a shared
// counter, one atomic a warp: returns this lane's place (meaningful where pred
// holds). Every lane of the warp calls it.
__device__ __forceinline__ uint32_t warp_take(bool pred, uint32_t* ctr) {
  const unsigned m = __ballot_sync(0xffffffffu, pred);
  if (m == 0) return 0;  // the same in every lane
  const unsigned lane = threadIdx.x & 31;
  const int leader = __ffs(m) - 1;
  uint32_t b = 0;
  if (lane == static_cast<unsigned>(leader)) b = atomicAdd(ctr, __popc(m));
  b = __shfl_sync(0xffffffffu, b, leader);
  return b + __popc(m & ((1u << lane) - 1u));
}

// This thread's elements (e = 0 .. EPT-1, key(e); valid where vmask says) whose
// key's top 32 - drop bits are above / equal to `prefix`, as bit masks, with their
// counts and the warp's inclusive scans of those counts (the callers then take
// output ranges: one shared atomic per warp, then one per CTA).
struct Chosen {
  uint32_t above_mask = 0, tie_mask = 0;
  uint32_t n_above = 0, n_tie = 0, a_incl = 0, t_incl = 0;
};

// Chosen from its two masks: the counts and the warp's inclusive scans of them. Every
// lane of the warp calls it.
__device__ __forceinline__ Chosen chosen_masks(uint32_t above_mask, uint32_t tie_mask) {
  Chosen c;
  c.above_mask = above_mask;
  c.tie_mask = tie_mask;
  c.n_above = __popc(above_mask);
  c.n_tie = __popc(tie_mask);
  const unsigned lane = threadIdx.x & 31;
  c.a_incl = c.n_above;
  c.t_incl = c.n_tie;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const uint32_t x = __shfl_up_sync(0xffffffffu, c.a_incl, o);
    const uint32_t y = __shfl_up_sync(0xffffffffu, c.t_incl, o);
    if (lane >= static_cast<unsigned>(o)) {
      c.a_incl += x;
      c.t_incl += y;
    }
  }
  return c;
}

// Chosen for the elements whose key(e)'s top 32 - drop bits are above / equal to `prefix`.
template <int EPT, class Key>
__device__ __forceinline__ Chosen chosen_elements(Key&& key, uint32_t vmask, int drop, uint32_t prefix) {
  uint32_t above = 0, tie = 0;
#pragma unroll
  for (int e = 0; e < EPT; ++e) {
    const uint32_t hi = key(e) >> drop;
    const uint32_t v = (vmask >> e) & 1u;
    above |= (v & static_cast<uint32_t>(hi > prefix)) << e;
    tie |= (v & static_cast<uint32_t>(hi == prefix)) << e;
  }
  return chosen_masks(above, tie);
}

// This thread's first places for its chosen elements above / on the prefix in two
// shared counters: one atomic a warp for each kind. Every lane of the warp calls it.
__device__ __forceinline__ uint2 warp_places(const Chosen& c, uint32_t* above_ctr, uint32_t* tie_ctr) {
  uint32_t a = 0, t = 0;
  if ((threadIdx.x & 31) == 31) {
    a = atomicAdd(above_ctr, c.a_incl);
    t = atomicAdd(tie_ctr, c.t_incl);
  }
  return make_uint2(__shfl_sync(0xffffffffu, a, 31) + c.a_incl - c.n_above,
                    __shfl_sync(0xffffffffu, t, 31) + c.t_incl - c.n_tie);
}

// The bucket where a running count from the top reaches `need`: on return
// sm.thr_bin / thr_above (elements in higher buckets) / thr_cnt (in the bucket).
// Every thread of the block (NT threads) calls it; `hist` holds nbins counts; S has
// scan[32] and thr_bin / thr_above / thr_cnt. Ends with a barrier. Thread t sums bins
// [nbins - per (t + 1), nbins - per t); up to four a thread are read unrolled (predicated),
// so that the reads are issued together where nbins is known only at run time (a loop
// waited on each). A compile-time nbins does better still (measured on the H200, run 21,
// a top-k row's last-CTA threshold: loop 0.90 us, unrolled 0.83, constant 0.55): hot
// callers pass one.
template <int NT, class S>
__device__ __forceinline__ void find_threshold(const uint32_t* hist, uint32_t nbins, uint32_t need, S& sm) {
  const int tid = threadIdx.x;
  const uint32_t per = nbins >= NT ? nbins / NT : 1;
  const uint32_t rb0 = tid * per;
  uint32_t local = 0;
  if (rb0 < nbins) {
    if (per <= 4) {
#pragma unroll
      for (uint32_t j = 0; j < 4; ++j) local += j < per ? hist[nbins - 1 - (rb0 + j)] : 0u;
    } else {
      for (uint32_t j = 0; j < per; ++j) local += hist[nbins - 1 - (rb0 + j)];
    }
  }
  uint32_t run = block_exclusive_scan(local, sm.scan);
  if (rb0 < nbins && run < need && need <= run + local) {
    for (uint32_t j = 0; j < per; ++j) {
      const uint32_t b = nbins - 1 - (rb0 + j);
      const uint32_t c = hist[b];
      if (run < need && need <= run + c) {
        sm.thr_bin = b;
        sm.thr_above = run;
        sm.thr_cnt = c;
      }
      run += c;
    }
  }
  __syncthreads();
}

// After a row's histogram gh (NBINS bins, every CTA's counts in) is met: the bin t where the count
// from the top reaches `need` (sm.thr_bin; sm.thr_above elements in the bins above it, sm.thr_cnt in
// it, sm.thr_old = hist[t]) and every other bin's first place in the output: hist[i] (this CTA's
// first place among the row's elements in bin i: the return of its add) += the row's elements
// above bin i. Each of the NT threads reads NBINS / NT (4 or 8) contiguous bins (thread 0 the
// highest) and the counts above them come from one block scan. Ends with a barrier.
template <int NT, int NBINS, class S>
__device__ __forceinline__ void scan_places(const uint32_t* gh, uint32_t need, uint32_t* hist, S& sm) {
  constexpr int kPer = NBINS / NT;
  static_assert(NBINS % NT == 0 && kPer % 4 == 0 && kPer <= 8, "4 or 8 whole bins a thread");
  const int r0 = NBINS - kPer * static_cast<int>(threadIdx.x + 1);
  uint32_t h[kPer];
  if (reinterpret_cast<uintptr_t>(gh) % 16 == 0) {  // 16-byte loads: a warp's are whole lines
#pragma unroll
    for (int q = 0; q < kPer / 4; ++q) {
      const uint4 v = __ldcg(reinterpret_cast<const uint4*>(gh + r0) + q);
      h[4 * q] = v.x;
      h[4 * q + 1] = v.y;
      h[4 * q + 2] = v.z;
      h[4 * q + 3] = v.w;
    }
  } else {
#pragma unroll
    for (int j = 0; j < kPer; ++j) h[j] = __ldcg(&gh[r0 + j]);
  }
  uint32_t sum = 0;
#pragma unroll
  for (int j = 0; j < kPer; ++j) sum += h[j];
  uint32_t run = block_exclusive_scan(sum, sm.scan);  // the row's elements in the bins above these
#pragma unroll
  for (int j = kPer - 1; j >= 0; --j) {
    const int i = r0 + j;
    if (run < need && need <= run + h[j]) {
      sm.thr_bin = i;
      sm.thr_above = run;
      sm.thr_cnt = h[j];
      sm.thr_old = hist[i];
    } else {
      hist[i] += run;
    }
    run += h[j];
  }
  __syncthreads();
}

__device__ __forceinline__ long long global_ns() {
  long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// Row barriers: the block's barrier, then one thread's acquire-release add at gpu scope,
// as cooperative groups' grid sync orders a block's writes (its fence after the barrier),
// with the ordering in the arrival atomic instead of a sequentially consistent fence in
// every thread.
__device__ __forceinline__ uint32_t arrive_acq_rel(uint32_t* ctr) {
  uint32_t old;
  asm volatile("atom.add.acq_rel.gpu.global.u32 %0, [%1], 1;" : "=r"(old) : "l"(ctr) : "memory");
  return old;
}

// The last block to arrive sees every other arrival in its acquire-release add and does not
// poll: the barrier's latest block leaves one global round trip sooner.
__device__ __forceinline__ void grid_arrive_and_wait(uint32_t* ctr, uint32_t expected) {
  __syncthreads();  // every thread's histogram atomics before the arrival
  if (threadIdx.x == 0 && arrive_acq_rel(ctr) + 1 < expected) {
    uint32_t v;
    do {
      asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(ctr) : "memory");
    } while (v < expected);
  }
  __syncthreads();
}

// A CTA's counts hist[0 .. NBINS) added into its row's histogram gh by adds that return the
// bin's count before them, then the row's barrier (grid_arrive_and_wait on arrive_ctr): on
// return hist[i] is that count where the CTA has elements in bin i (its elements take places
// [hist[i], hist[i] + count) of the row's elements in the bin, the CTAs in the order their adds
// reached it; scan_places turns these into places in the output), 0 elsewhere. The returns are
// stored only after the arrival, which does not wait for them (the block barrier and the
// arrival's release order the adds before it all the same). after_adds() runs once the adds
// are issued (a stamp). Every thread of the block (NT threads) calls it; ends with a barrier.
template <int NT, int NBINS, class AfterAdds>
__device__ __forceinline__ void add_counts_and_arrive(uint32_t* hist, uint32_t* gh, uint32_t* arrive_ctr,
                                                      uint32_t expected, AfterAdds&& after_adds) {
  static_assert(NBINS % NT == 0, "whole bins a thread");
  constexpr int kPer = NBINS / NT;
  const int tid = threadIdx.x;
  uint32_t old[kPer];
#pragma unroll
  for (int j = 0; j < kPer; ++j) {
    const uint32_t v = hist[tid + j * NT];
    old[j] = v != 0 ? atomicAdd(&gh[tid + j * NT], v) : 0u;
  }
  after_adds();
  grid_arrive_and_wait(arrive_ctr, expected);
#pragma unroll
  for (int j = 0; j < kPer; ++j) hist[tid + j * NT] = old[j];
  __syncthreads();
}

}  // namespace troupe::kernels::cuda
