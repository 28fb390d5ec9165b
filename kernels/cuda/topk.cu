// Exact cluster top-k (see topk.hpp for the algorithm).
#include <cooperative_groups.h>

#include <algorithm>
#include <climits>
#include <cstddef>
#include <cstdlib>
#include <cub/block/block_radix_sort.cuh>
#include <mutex>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/select.cuh"
#include "kernels/cuda/topk.hpp"

namespace cg = cooperative_groups;

namespace troupe::kernels::cuda {
namespace {

constexpr int kThreads = 512;
constexpr int kEpt = 32;                      // elements per thread, kept in registers
constexpr int kCtaCap = kThreads * kEpt;      // 16,384 elements per CTA
constexpr int kMaxBins = 2048;  // 11-bit digits: 11 + 11 + 10 = 32
constexpr int kMaxK = 2048;
constexpr int kCandCap = 3072;    // threshold-bucket elements the leader finishes alone
constexpr int kMaxSegments = 64;  // segments of one row (16.7 M candidates with 16-CTA clusters)

struct Params {
  const float* scores;
  int64_t row_stride;
  const int32_t* lengths;
  int64_t max_len;
  int k;
  int32_t* out_idx;
  int64_t out_stride;
  int32_t* out_count;
  const int32_t* page_table;
  int64_t page_stride;
  int page_bits;
  int segments;
  int64_t seg_cap;
  bool vec_ok;
  uint32_t* cand_key;   // [rows, segments, k]
  int32_t* cand_idx;    // [rows, segments, k]
  int32_t* cand_cnt;    // [rows, segments]
  uint32_t* arrivals;   // [rows], zero between calls
  long long* profile;   // optional: SM clock at phase boundaries (row 0, segment 0, CTA 0)
};

__device__ __forceinline__ void stamp(long long* prof, int i) {
  if (prof != nullptr && threadIdx.x == 0) prof[i] = clock64();
}

struct Smem {
  uint32_t hist[kMaxBins];   // this CTA's histogram
  uint32_t ghist[kMaxBins];  // the cluster's histogram (every CTA holds a copy)
  uint32_t scan[32];
  uint32_t thr_bin, thr_above, thr_cnt;
  uint32_t above_total, tie_total;  // leader's: cluster-wide reservation counters
  uint32_t above_ctr, tie_ctr;      // this CTA's emission counters
  uint32_t base_above, base_tie;
  uint32_t flag, last;
  uint32_t local_above, local_tie;  // leader's counters for the gathered candidates
  int32_t seg_cnt[kMaxSegments];
  uint32_t cand_key[kCandCap];      // leader: the threshold bucket's elements (gather)
  int32_t cand_idx[kCandCap];
};

constexpr int kKeysOffset = (static_cast<int>(sizeof(Smem)) + 15) / 16 * 16;
constexpr int kSmemBytes = kKeysOffset + kEpt * kThreads * 4;  // ~105 KB: two CTAs per SM

__device__ __forceinline__ int elem_offset(int e) { return (e >> 2) * (kThreads * 4) + threadIdx.x * 4 + (e & 3); }

// The digits of a key the radix rounds look at, most significant first: 11, 11 and
// 10 bits (round 0: bits 31..21, round 1: 20..10, round 2: 9..0).
__host__ __device__ constexpr int digit_shift(int round) { return round == 0 ? 21 : round == 1 ? 10 : 0; }
__host__ __device__ constexpr int digit_bits(int round) { return round == 2 ? 10 : 11; }

__device__ __forceinline__ int32_t translate(const Params& p, int row, int64_t i) {
  return page_translate(p.page_table, p.page_stride, p.page_bits, row, i);
}

// find_threshold over `hist` (2^bits bins), then the bucket narrows to the threshold
// digit: need, cnt (the digit's count), prefix and pbits updated. Ends with a barrier
// (every thread has read sm.thr_*). Every thread of the block calls it.
template <class S>
__device__ __forceinline__ void narrow_to_threshold(const uint32_t* hist, int bits, S& sm, uint32_t& prefix, int& pbits,
                                                    uint32_t& need, uint32_t& cnt) {
  find_threshold<kThreads>(hist, 1u << bits, need, sm);
  need -= sm.thr_above;
  cnt = sm.thr_cnt;
  prefix = (prefix << bits) | sm.thr_bin;
  pbits += bits;
  __syncthreads();
}

// One block-local radix round on the next digit under `prefix` (pbits bits; the digit
// is min(11, 32 - pbits) bits): count_digit(shift, nbins) adds the digit of every
// element still in the bucket into sm.hist; then the bucket narrows to the digit where
// the count from the top reaches `need` (prefix, pbits, need and cnt updated). Every
// thread of the block calls it.
template <class S, class CountDigit>
__device__ __forceinline__ void radix_round(S& sm, uint32_t& prefix, int& pbits, uint32_t& need, uint32_t& cnt,
                                            CountDigit&& count_digit) {
  const int bits = 32 - pbits < 11 ? 32 - pbits : 11;
  const uint32_t nbins = 1u << bits;
  for (uint32_t i = threadIdx.x; i < nbins; i += blockDim.x) sm.hist[i] = 0;
  __syncthreads();
  count_digit(32 - pbits - bits, nbins);
  __syncthreads();
  narrow_to_threshold(sm.hist, bits, sm, prefix, pbits, need, cnt);
}

// Cluster-wide radix rounds over the elements the cluster's CTAs hold (this thread's:
// e = 0 .. kEpt-1 where `mask` says, key key_of(e)): from the whole key down, the bucket
// narrows to the digit where the count from the top reaches `need` (prefix, pbits, need
// and cnt updated), until the bucket is taken whole (cnt == need), holds at most
// `gather_cap` elements (returns true), or is one value (pbits == 32). `prefilled`:
// sm.hist already holds round 0's counts. Every thread of the cluster calls it.
template <class KeyOf>
__device__ __forceinline__ bool cluster_rounds(KeyOf&& key_of, uint32_t mask, uint32_t gather_cap, Smem& sm,
                                               cg::cluster_group& cluster, long long* prof, bool prefilled,
                                               uint32_t& prefix, int& pbits, uint32_t& need, uint32_t& cnt) {
  const int tid = threadIdx.x;
  const unsigned C = cluster.num_blocks(), rank = cluster.block_rank();
#pragma unroll 1
  for (int round = 0; round < 3; ++round) {
    const int shift = digit_shift(round), bits = digit_bits(round);
    const uint32_t nbins = 1u << bits;
    const uint32_t slice = nbins / C;  // bins this CTA reduces for the cluster
    for (uint32_t i = tid; i < slice; i += kThreads) sm.ghist[rank * slice + i] = 0;
    if (round > 0 || !prefilled) {  // (the load already counted round 0's digits)
      for (uint32_t i = tid; i < nbins; i += kThreads) sm.hist[i] = 0;
      __syncthreads();
#pragma unroll
      for (int e = 0; e < kEpt; ++e) {
        if (!((mask >> e) & 1u)) continue;
        const uint32_t key = key_of(e);
        if (pbits == 0 || (key >> (32 - pbits)) == prefix) atomicAdd(&sm.hist[(key >> shift) & (nbins - 1)], 1u);
      }
    }
    if (round == 0) stamp(prof, 3);
    cluster.sync();
    if (round == 0) stamp(prof, 4);
    // Two-shot all-reduce through DSMEM: CTA `rank` sums its slice of bins over the
    // cluster (all remote loads in flight at once), then writes the sums into every
    // CTA's ghist. Nobody else writes this CTA's slice of its own ghist.
    {
      uint32_t v[kMaxBins / kThreads];
#pragma unroll
      for (int j = 0; j < kMaxBins / kThreads; ++j) {
        const uint32_t idx = tid + j * kThreads;
        v[j] = 0;
        if (idx < nbins) v[j] = cluster.map_shared_rank(sm.hist, idx / slice)[rank * slice + idx % slice];
      }
#pragma unroll
      for (int j = 0; j < kMaxBins / kThreads; ++j) {
        const uint32_t idx = tid + j * kThreads;
        if (idx < nbins && v[j] != 0) atomicAdd(&sm.ghist[rank * slice + idx % slice], v[j]);
      }
      __syncthreads();
#pragma unroll
      for (int j = 0; j < kMaxBins / kThreads; ++j) {
        const uint32_t idx = tid + j * kThreads;  // (destination rank, bin of my slice)
        const uint32_t r = idx / slice;
        if (idx < nbins && r != rank) {
          cluster.map_shared_rank(sm.ghist, r)[rank * slice + idx % slice] = sm.ghist[rank * slice + idx % slice];
        }
      }
    }
    if (round == 0) stamp(prof, 5);
    cluster.sync();
    if (round == 0) stamp(prof, 6);
    narrow_to_threshold(sm.ghist, bits, sm, prefix, pbits, need, cnt);
    stamp(prof, 7 + round);
    if (cnt == need) return false;      // the whole threshold bucket is taken
    if (cnt <= gather_cap) return true;  // few enough to finish in one CTA
  }
  return false;
}

// The key that orders equal values by lower index first (the larger key wins).
__device__ __forceinline__ uint32_t index_key(int32_t i) { return ~static_cast<uint32_t>(i); }

// Of the elements in `ties` (this thread's; every one a copy of the k-th value, whose
// keys in sk the caller has replaced with their index keys), the `need` of lowest index
// across the cluster, as a mask: cluster-wide rounds over the index keys (indices
// differ: they end with the bucket taken whole). Out of line, with no lambda: a rare
// path that would cost the common one registers and local memory (measured: 1 x 1 M on
// 16-CTA clusters 47.6 -> 56.2 us inline). Every thread of the cluster calls it.
__device__ __noinline__ uint32_t lowest_index_ties(const uint32_t* sk, uint32_t ties, uint32_t need, Smem* sm) {
  cg::cluster_group cluster = cg::this_cluster();
  const int tid = threadIdx.x;
  uint32_t prefix = 0, cnt = 0;
  int pbits = 0;
  cluster_rounds([&](int e) { return sk[e * kThreads + tid]; }, ties, 0, *sm, cluster, nullptr, false, prefix, pbits,
                 need, cnt);
  uint32_t chosen = 0;
  for (uint32_t m = ties; m != 0; m &= m - 1) {
    const int e = __ffs(m) - 1;
    chosen |= static_cast<uint32_t>((sk[e * kThreads + tid] >> (32 - pbits)) >= prefix) << e;
  }
  return chosen;
}

// Selects the `target` largest keys among the valid elements the cluster's CTAs hold,
// equal keys by lower index (index_of(e)), as a stable sort would. For each chosen
// element, emit(position, key, index) is called once (positions 0 .. target-1).
// Cluster-wide radix rounds run until the threshold bucket is small; its elements are
// then gathered into the leader CTA, which finishes with block-local rounds (no more
// cluster barriers). A bucket of more than kCandCap copies of the k-th value takes
// cluster-wide rounds over its elements' indices instead. Ends with a cluster barrier,
// so the caller may return or call again.
template <class IndexOf, class Emit>
__device__ __forceinline__ void cluster_select(uint32_t* sk, uint32_t vmask, uint32_t target, Smem& sm,
                                               cg::cluster_group& cluster, long long* prof, bool prefilled,
                                               IndexOf&& index_of, Emit&& emit) {
  const int tid = threadIdx.x;
  const unsigned rank = cluster.block_rank();
  if (tid == 0) {
    sm.above_total = sm.tie_total = 0;
    sm.above_ctr = sm.tie_ctr = 0;
    sm.local_above = sm.local_tie = 0;
  }
  uint32_t prefix = 0, need = target, cnt = 0;
  int pbits = 0;
  const bool gather = cluster_rounds([&](int e) { return sk[e * kThreads + tid]; }, vmask, kCandCap, sm, cluster,
                                     prof, prefilled, prefix, pbits, need, cnt);
  const bool take_all = cnt == need;
  const uint32_t total_above = target - need;
  const int drop = 32 - pbits;

  // Chosen elements of this thread as bit masks, then output ranges: warp scans,
  // one shared atomic per warp, one DSMEM atomic per CTA on the leader's counters.
  Chosen ch = chosen_elements<kEpt>([&](int e) { return sk[e * kThreads + tid]; }, vmask, drop, prefix);
  if (!take_all && !gather) {  // more than kCandCap copies of the k-th value (pbits == 32): the `need` lowest indices
    for (uint32_t m = ch.tie_mask; m != 0; m &= m - 1) {
      const int e = __ffs(m) - 1;
      sk[e * kThreads + tid] = index_key(index_of(e));  // the key is `prefix`
    }
    ch = chosen_masks(ch.above_mask, lowest_index_ties(sk, ch.tie_mask, need, &sm));
  }
  const uint2 places = warp_places(ch, &sm.above_ctr, &sm.tie_ctr);
  __syncthreads();
  if (tid == 0) {
    sm.base_above = atomicAdd(cluster.map_shared_rank(&sm.above_total, 0), sm.above_ctr);
    sm.base_tie = atomicAdd(cluster.map_shared_rank(&sm.tie_total, 0), sm.tie_ctr);
  }
  __syncthreads();
  uint32_t pos = sm.base_above + places.x;
  for (uint32_t m = ch.above_mask; m != 0; m &= m - 1) {
    const int e = __ffs(m) - 1;
    emit(pos++, sk[e * kThreads + tid], index_of(e));
  }
  uint32_t g = sm.base_tie + places.y;
  if (gather) {  // the bucket's elements go to the leader's candidate buffer, slot g
    uint32_t* ck = cluster.map_shared_rank(sm.cand_key, 0);
    int32_t* ci = cluster.map_shared_rank(sm.cand_idx, 0);
    for (uint32_t m = ch.tie_mask; m != 0; m &= m - 1, ++g) {
      const int e = __ffs(m) - 1;
      ck[g] = sk[e * kThreads + tid];
      ci[g] = index_of(e);
    }
  } else {  // every tie left in the mask is chosen
    for (uint32_t m = ch.tie_mask; m != 0; m &= m - 1, ++g) {
      const int e = __ffs(m) - 1;
      emit(total_above + g, take_all ? sk[e * kThreads + tid] : prefix, index_of(e));
    }
  }
  stamp(prof, 10);
  cluster.sync();  // candidates are in place; no CTA leaves while others touch its shared memory
  stamp(prof, 11);
  if (!gather) return;
  if (rank == 0) {
    // Block-local radix rounds over the cnt candidates for the `need` largest.
    uint32_t lp = prefix, lneed = need, lcnt = cnt;
    int lbits = pbits;
#pragma unroll 1
    while (lbits < 32 && lcnt != lneed) {
      radix_round(sm, lp, lbits, lneed, lcnt, [&](int shift, uint32_t nbins) {
        for (uint32_t i = tid; i < cnt; i += kThreads) {
          const uint32_t k = sm.cand_key[i];
          if ((k >> (32 - lbits)) == lp) atomicAdd(&sm.hist[(k >> shift) & (nbins - 1)], 1u);
        }
      });
    }
    // Copies of the k-th value past `lneed` (lbits == 32): the lowest indices, by
    // rounds over their index keys (indices differ: these end with icnt == ineed).
    uint32_t ip = 0, ineed = lneed, icnt = lcnt;
    int ibits = 0;
#pragma unroll 1
    while (icnt != ineed) {
      radix_round(sm, ip, ibits, ineed, icnt, [&](int shift, uint32_t nbins) {
        for (uint32_t i = tid; i < cnt; i += kThreads) {
          const uint32_t ik = index_key(sm.cand_idx[i]);
          if (sm.cand_key[i] == lp && (ibits == 0 || (ik >> (32 - ibits)) == ip)) {
            atomicAdd(&sm.hist[(ik >> shift) & (nbins - 1)], 1u);
          }
        }
      });
    }
    const uint32_t base = total_above, tie_base = total_above + (need - lneed);
    for (uint32_t i0 = 0; i0 < cnt; i0 += kThreads) {  // uniform trip count: ballots below
      const uint32_t i = i0 + tid;
      const bool valid = i < cnt;
      const uint32_t k = valid ? sm.cand_key[i] : 0u;
      const uint32_t hi = k >> (32 - lbits);
      const bool is_above = valid && hi > lp;
      const bool is_tie = valid && hi == lp && (ibits == 0 || (index_key(sm.cand_idx[i]) >> (32 - ibits)) >= ip);
      const uint32_t a = warp_take(is_above, &sm.local_above);
      if (is_above) emit(base + a, k, sm.cand_idx[i]);
      const uint32_t t = warp_take(is_tie, &sm.local_tie);
      if (is_tie) emit(tie_base + t, k, sm.cand_idx[i]);
    }
  }
  stamp(prof, 12);
  cluster.sync();
}

// Loads this CTA's chunk of one row: element e of this thread (e = 0 .. EPT-1) is at
// offset elem_offset(e) of src (16-byte loads in batches when the chunk is whole and
// aligned) and its key lives at sk[e * kThreads + tid] (a warp's accesses to one e
// are 32 consecutive words: no bank conflicts). Also counts the round-0 digit (top 11
// bits) of every valid key into `hist` (zeroed by the caller), so the counting
// overlaps the loads still in flight. Returns this thread's valid elements as a mask.
// The scores are read once: streaming loads (ld.global.cs, evict first), so that long
// rows leave in L2 what is reused (the workspace, the kernel's code; measured on the
// H200, run 22: 64 x 262,144 45.5 -> 44.1 us, 64 x 1 M 163 -> 158, one row unchanged).
template <int EPT>
__device__ __forceinline__ uint32_t load_chunk(const float* src, int64_t n_here, bool vec_ok, uint32_t* sk,
                                               uint32_t* hist) {
  const int tid = threadIdx.x;
  if (vec_ok && n_here >= kThreads * EPT) {
    constexpr int kBatch = EPT / 4 < 4 ? EPT / 4 : 4;
#pragma unroll
    for (int q0 = 0; q0 < EPT / 4; q0 += kBatch) {
      float4 v[kBatch];
#pragma unroll
      for (int q = 0; q < kBatch; ++q) v[q] = __ldcs(reinterpret_cast<const float4*>(src) + (q0 + q) * kThreads + tid);
#pragma unroll
      for (int q = 0; q < kBatch; ++q) {
        const uint32_t k4[4] = {order_key(v[q].x), order_key(v[q].y), order_key(v[q].z), order_key(v[q].w)};
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          sk[(4 * (q0 + q) + j) * kThreads + tid] = k4[j];
          atomicAdd(&hist[k4[j] >> 21], 1u);
        }
      }
    }
    return EPT == 32 ? 0xffffffffu : (1u << EPT) - 1u;
  }
  uint32_t vmask = 0;
  constexpr int kBatch = 8;
#pragma unroll
  for (int e0 = 0; e0 < EPT; e0 += kBatch) {
    float f[kBatch];
#pragma unroll
    for (int e = 0; e < kBatch; ++e) {
      const int64_t off = elem_offset(e0 + e);
      f[e] = off < n_here ? __ldcs(src + off) : 0.f;
    }
#pragma unroll
    for (int e = 0; e < kBatch; ++e) {
      const uint32_t key = order_key(f[e]);
      sk[(e0 + e) * kThreads + tid] = key;
      if (elem_offset(e0 + e) < n_here) {
        vmask |= 1u << (e0 + e);
        atomicAdd(&hist[key >> 21], 1u);
      }
    }
  }
  return vmask;
}

__global__ void __launch_bounds__(kThreads, 2) topk_kernel(const Params p) {
  pdl_entry();  // see launch_kernel
  extern __shared__ __align__(16) uint8_t topk_smem[];
  Smem& sm = *reinterpret_cast<Smem*>(topk_smem);
  uint32_t* sk = reinterpret_cast<uint32_t*>(topk_smem + kKeysOffset);  // [kEpt][kThreads] keys
  long long* prof = (p.profile != nullptr && blockIdx.x == 0 && blockIdx.y == 0) ? p.profile : nullptr;
  stamp(prof, 0);
  // Launched as a programmatic dependent: everything above this line may overlap the
  // previous kernel (the scores' producer); nothing below runs before it completes.
  asm volatile("griddepcontrol.wait;" ::: "memory");
  stamp(prof, 1);
  cg::cluster_group cluster = cg::this_cluster();
  const unsigned C = cluster.num_blocks(), rank = cluster.block_rank();
  const int row = blockIdx.y;
  const int seg = blockIdx.x / C;
  const int tid = threadIdx.x;
  int64_t len = p.lengths != nullptr ? p.lengths[row] : p.max_len;
  len = len < 0 ? 0 : (len > p.max_len ? p.max_len : len);
  int32_t* out = p.out_idx + row * p.out_stride;

  if (len <= p.k) {  // every candidate is chosen
    if (seg == 0) {
      for (int64_t i = static_cast<int64_t>(rank) * kThreads + tid; i < p.k; i += static_cast<int64_t>(C) * kThreads) {
        out[i] = i < len ? translate(p, row, i) : -1;
      }
      if (p.out_count != nullptr && rank == 0 && tid == 0) p.out_count[row] = static_cast<int32_t>(len);
    }
    return;
  }

  const int64_t seg_start = static_cast<int64_t>(seg) * p.seg_cap;
  int64_t seg_len = len - seg_start;
  seg_len = seg_len < 0 ? 0 : (seg_len > p.seg_cap ? p.seg_cap : seg_len);
  const int64_t cta_off = static_cast<int64_t>(rank) * kCtaCap;
  const int64_t cbase = (static_cast<int64_t>(row) * p.segments + seg) * p.k;  // this segment's candidates
  const int64_t row_base = static_cast<int64_t>(row) * p.segments * p.k;        // the row's candidates
  for (int i = tid; i < kMaxBins; i += kThreads) sm.hist[i] = 0;
  __syncthreads();
  uint32_t vmask =
      load_chunk<kEpt>(p.scores + row * p.row_stride + seg_start + cta_off, seg_len - cta_off, p.vec_ok, sk, sm.hist);
  stamp(prof, 2);
  uint32_t target = static_cast<uint32_t>(seg_len < p.k ? seg_len : p.k);
  // Phase 0 selects within this cluster's segment: straight to the output when the row
  // is one segment, else into the candidate buffer. Phase 1 (the last cluster of a
  // long row to arrive) selects among all segments' candidates. One call site keeps
  // the register-resident keys out of local memory.
  for (int phase = 0;; ++phase) {
    const bool final_out = p.segments == 1 || phase == 1;
    if (target > 0) {
      cluster_select(
          sk, vmask, target, sm, cluster, phase == 0 ? prof : nullptr, phase == 0,
          [&](int e) -> int32_t {
            const int64_t j = cta_off + elem_offset(e);
            return phase == 0 ? static_cast<int32_t>(seg_start + j) : __ldcg(&p.cand_idx[row_base + j]);
          },
          [&](uint32_t pos, uint32_t key, int32_t idx) {
            if (!final_out) {
              p.cand_key[cbase + pos] = key;
              p.cand_idx[cbase + pos] = idx;
            } else {
              out[pos] = translate(p, row, idx);
            }
          });
    }
    if (final_out) break;
    if (rank == 0 && tid == 0) p.cand_cnt[row * p.segments + seg] = static_cast<int32_t>(target);
    __threadfence();
    cluster.sync();
    if (rank == 0 && tid == 0) {
      const uint32_t prev = atomicAdd(&p.arrivals[row], 1u);
      sm.flag = prev == static_cast<uint32_t>(p.segments - 1);
    }
    cluster.sync();
    if (tid == 0) sm.last = *cluster.map_shared_rank(&sm.flag, 0);
    cluster.sync();
    if (!sm.last) return;
    if (rank == 0 && tid == 0) p.arrivals[row] = 0;  // ready for the next call
    __threadfence();
    const int64_t total = static_cast<int64_t>(p.segments) * p.k;
    for (int i = tid; i < p.segments; i += kThreads) sm.seg_cnt[i] = __ldcg(&p.cand_cnt[row * p.segments + i]);
#pragma unroll
    for (int e = 0; e < kEpt; ++e) {
      const int64_t j = cta_off + elem_offset(e);
      sk[e * kThreads + tid] = j < total ? __ldcg(&p.cand_key[row_base + j]) : 0u;
    }
    __syncthreads();
    vmask = 0;
#pragma unroll
    for (int e = 0; e < kEpt; ++e) {
      const int64_t j = cta_off + elem_offset(e);
      const int s = static_cast<int>(j / p.k);
      if (j < total && j - static_cast<int64_t>(s) * p.k < sm.seg_cnt[s]) vmask |= 1u << e;
    }
    target = static_cast<uint32_t>(p.k);
  }
  if (p.out_count != nullptr && rank == 0 && tid == 0) p.out_count[row] = p.k;
}

struct Plan {
  int cluster;
  int segments;
  int64_t seg_cap;
};

void set_kernel_attributes() {
  static std::once_flag once;
  std::call_once(once, [] {
    TROUPE_CUDA(cudaFuncSetAttribute(topk_kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1));
    TROUPE_CUDA(cudaFuncSetAttribute(topk_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes));
  });
}

int device_max_cluster() {
  static std::once_flag once;
  static int result = 8;
  std::call_once(once, [] {
    set_kernel_attributes();
    cudaLaunchConfig_t cfg{};
    cfg.gridDim = dim3(16, 1, 1);
    cfg.blockDim = dim3(kThreads, 1, 1);
    cfg.dynamicSmemBytes = kSmemBytes;
    cudaLaunchAttribute attr{};
    attr.id = cudaLaunchAttributeClusterDimension;
    attr.val.clusterDim.x = 16;
    attr.val.clusterDim.y = 1;
    attr.val.clusterDim.z = 1;
    cfg.attrs = &attr;
    cfg.numAttrs = 1;
    int n = 0;
    if (cudaOccupancyMaxActiveClusters(&n, topk_kernel, &cfg) == cudaSuccess && n > 0) result = 16;
    (void)cudaGetLastError();
  });
  return result;
}

Plan make_plan(int64_t max_len, int k, int max_cluster) {
  int cap = max_cluster > 0 ? max_cluster : device_max_cluster();
  cap = std::min(cap, 16);
  int c = 1;
  while (c < cap && static_cast<int64_t>(c) * kCtaCap < max_len) c *= 2;
  const int64_t seg_cap = static_cast<int64_t>(c) * kCtaCap;
  const int segments = static_cast<int>(std::max<int64_t>(1, ceil_div(max_len, seg_cap)));
  TROUPE_REQUIRE(segments == 1 || (static_cast<int64_t>(segments) * k <= seg_cap && segments <= kMaxSegments),
                 "top-k row too long for one merge");
  return {c, segments, seg_cap};
}

// ---- grid top-k: every SM, one read, rows co-ordinated through global memory -------
// Each CTA owns a chunk of kThreads * EPT scores of one row, kept in shared memory
// from the one read on (16-byte loads in batches, the round-0 digits counted while
// later loads are in flight). A row of one chunk is selected inside its CTA. Longer
// rows: every CTA adds its radix histogram to the row's histogram in the workspace
// (global atomics), waits at the row's arrival counter until all CTAs of the row
// have added theirs, and finds the threshold bucket itself; elements above it are
// written straight out, the bucket's elements are gathered into the workspace once
// few enough (else one more global round on the next digit), and the last CTA of
// the row to finish selects among them alone and zeroes the row's workspace.
// Waiting on other CTAs is safe because the host launches at most as many CTAs as
// the device holds at once, or hands out chunks by arrival tickets (a CTA takes its
// chunk once resident) with at most half the device's CTAs per row: the lowest
// unfinished row then always has all its CTAs resident.
constexpr int kGBins = 2048;
constexpr int kGRounds = 3;
constexpr int kSmallEPT = 8, kLargeEPT = 32;  // chunks of 4,096 / 16,384 scores
// The most bucket elements a row's CTAs gather for its last CTA (the candidates' scratch
// holds this many whatever the chunk size): a round-0 bucket over a small chunk's 4,096
// (k = 2,048 of a long row: ~5,000 at 1 M) is gathered at round 0, not narrowed by round 1.
constexpr int kGatherMax = kThreads * kLargeEPT;
enum GCounter { kArrive0 = 0, kAbove = kGRounds, kTie, kCand, kDone, kOverflow, kCounters = 8 };
// The workspace (one layout for every call, so that calls of any shape can share it):
// 256 bytes of tickets; then kLaunchRows rows of kZeroWords words that are zero
// between calls (a row's histograms and counters, indexed by the row within its
// launch); then scratch that need not be zero (gathered candidates), rows of
// scratch_words words, whose size depends on the call.
constexpr int kZeroWords = kGRounds * kGBins + kCounters;
constexpr int kLaunchRows = 128;  // rows of one launch with histograms in the workspace

struct GridParams {
  const float* scores;
  int64_t row_stride;
  const int32_t* lengths;
  int64_t max_len;
  int k;
  int32_t* out_idx;
  int64_t out_stride;
  int32_t* out_count;
  const int32_t* page_table;
  int64_t page_stride;
  int page_bits;
  bool vec_ok;
  int row0;            // first row of this launch
  int cpr;             // CTAs per row (chunks of the longest row)
  bool ticketed;       // chunks by arrival ticket (grid larger than the device holds at once)
  uint32_t* ws;        // [kLaunchRows][kZeroWords]; zero between calls
  uint32_t* scratch;   // [rows of the launch][scratch_words]
  int64_t scratch_words;
  int64_t cand_cap;    // streamed and sampled kernels: candidates a row's list holds
  uint32_t* tickets;   // [2]: next ticket, CTAs finished; zero between calls
  long long* profile;  // optional: %globaltimer (ns) at phase ends (row 0)
  bool counted_finish; // TopkArgs::finish == 2: the gathering CTAs also count the bucket's next digit
  bool fused;          // the sampled path's finish after fused_filter_topk_kernel (its candidate histograms)
  int sample_run_bits; // sample_row's runs: 2^bits contiguous scores (3..10)
  bool early_filter;   // filter_topk_kernel requests its scores before it waits on the sample kernel
};

// A one-chunk row's second digit (select_one_chunk): 8 bits under round 0's 11, counted into
// GSmem::hist1 (zeroed with the round-0 histogram) and its threshold found by one warp.
constexpr int kDigit1Bits = 8;
constexpr int kDigit1Bins = 1 << kDigit1Bits;

struct GSmem {
  uint32_t hist[kGBins];
  alignas(16) uint32_t hist1[kDigit1Bins];
  uint32_t scan[32];
  uint32_t thr_bin, thr_above, thr_cnt, thr_old;  // thr_old: scan_places'
  uint32_t above_ctr, tie_ctr, local_above, local_tie;
  uint32_t base_above, base_tie;
  uint32_t ticket, last;
  uint32_t cand_n, overflow;  // streamed kernel's last CTA: the row's candidates, and whether they overflowed
                              // (the sampled finish: its row's count)
  // radix_select's open ties: more elements equal the k-th value than slots remain.
  uint32_t tie_key, tie_need, tie_base;
  uint32_t max_key;  // sample_row's largest sampled key
};

static_assert(offsetof(GSmem, hist) == 0 && kZeroWords % 4 == 0, "load_row_hist's 16-byte reads");

// The grid and streamed kernels' shared memory: GSmem, then the chunk's keys
// [EPT][kThreads] from this 16-byte aligned offset.
constexpr int kGKeysOffset = static_cast<int>((sizeof(GSmem) + 15) / 16 * 16);

__device__ __forceinline__ int32_t translate_g(const GridParams& p, int row, int64_t i) {
  return page_translate(p.page_table, p.page_stride, p.page_bits, row, i);
}

// Block-local radix select over keys[0 .. n) (valid(i) says which exist; all valid keys
// share the top `lbits` bits `lp`): emits the `lneed` largest, emit(position, i) with
// positions 0 .. lneed-1. When more elements equal the last chosen value than
// positions remain, it emits none of those, leaves their key, the count still needed
// and the first free position in sm.tie_* and returns true. Every thread of the
// block calls it.
template <class Valid, class Emit>
__device__ __forceinline__ bool radix_select(const uint32_t* keys, uint32_t n, Valid&& valid, uint32_t lp, int lbits,
                                             uint32_t lneed, GSmem& sm, Emit&& emit) {
  const int tid = threadIdx.x;
  const uint32_t need0 = lneed;
  uint32_t lcnt = 0xffffffffu;
#pragma unroll 1
  while (lbits < 32 && lcnt != lneed) {
    radix_round(sm, lp, lbits, lneed, lcnt, [&](int shift, uint32_t nbins) {
      for (uint32_t i = tid; i < n; i += kThreads) {
        const uint32_t k = keys[i];
        if (valid(i) && (lbits == 0 || (k >> (32 - lbits)) == lp)) atomicAdd(&sm.hist[(k >> shift) & (nbins - 1)], 1u);
      }
    });
  }
  const bool all = lcnt == lneed;
  const uint32_t tie_base = need0 - lneed;
  if (tid == 0) {
    sm.local_above = sm.local_tie = 0;
    sm.tie_key = lp;  // unless all: lbits == 32, so lp is the whole key of the tied value
    sm.tie_need = lneed;
    sm.tie_base = tie_base;
  }
  __syncthreads();
  for (uint32_t i0 = 0; i0 < n; i0 += kThreads) {  // uniform trip count: ballots below
    const uint32_t i = i0 + tid;
    const bool v = i < n && valid(i);
    const uint32_t k = v ? keys[i] : 0u;
    const uint32_t hi = lbits == 0 ? 0u : k >> (32 - lbits);
    const bool is_above = v && hi > lp, is_tie = v && hi == lp;
    const uint32_t a = warp_take(is_above, &sm.local_above);
    if (is_above) emit(a, i);
    const uint32_t t = warp_take(is_tie, &sm.local_tie);
    if (is_tie && all) emit(tie_base + t, i);
  }
  __syncthreads();
  return !all;
}

// radix_select, with ties at the last chosen value settled as a stable sort settles
// them (the CPU backend's rule): of the tied elements, those with the lowest
// index(i), by a second select over their inverted indices (which are distinct).
// Overwrites keys[].
template <class Valid, class Index, class Emit>
__device__ __forceinline__ void block_select(uint32_t* keys, uint32_t n, Valid&& valid, Index&& index, uint32_t lp,
                                             int lbits, uint32_t lneed, GSmem& sm, Emit&& emit) {
  // The tie step is rare (float scores seldom tie at the k-th value): [[likely]] on the
  // return puts its code after the hot path's (see grid_topk_kernel on the instruction cache).
  if (!radix_select(keys, n, valid, lp, lbits, lneed, sm, emit)) [[likely]] return;
  const uint32_t tie_key = sm.tie_key, need = sm.tie_need, base = sm.tie_base;
  __syncthreads();  // every thread has read sm.tie_*
  for (uint32_t i = threadIdx.x; i < n; i += kThreads) {
    keys[i] = valid(i) && keys[i] == tie_key ? ~static_cast<uint32_t>(index(i)) : 0u;  // indices < 2^31: never 0
  }
  __syncthreads();
  radix_select(
      keys, n, [&](uint32_t i) { return keys[i] != 0u; }, 0u, 0, need, sm,
      [&](uint32_t pos, uint32_t i) { emit(base + pos, i); });
}

// Ties at the k-th value settled as a stable sort settles them, for rows where more
// elements than one CTA's chunk share the k-th value: of the row's elements in
// [0, len) whose key is tie_key, the `need` with the lowest indices, to out[0 .. need).
// One block scans the row in index order and stops once it has them.
__device__ __forceinline__ void ties_in_index_order(const GridParams& p, int row, int64_t len, uint32_t tie_key,
                                                 uint32_t need, int32_t* out, GSmem& sm) {
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const unsigned lt = (1u << lane) - 1u;
  const float* src = p.scores + row * p.row_stride;
  uint32_t base = 0;  // the same in every thread
  for (int64_t x0 = 0; x0 < len && base < need; x0 += kThreads) {
    const int64_t x = x0 + tid;
    const bool is_tie = x < len && order_key(__ldcg(src + x)) == tie_key;
    const unsigned m = __ballot_sync(0xffffffffu, is_tie);
    if (lane == 0) sm.scan[warp] = __popc(m);
    __syncthreads();
    uint32_t before = 0, total = 0;
#pragma unroll
    for (int w = 0; w < kThreads / 32; ++w) {
      const uint32_t c = sm.scan[w];
      before += w < warp ? c : 0u;
      total += c;
    }
    const uint32_t pos = base + before + __popc(m & lt);
    if (is_tie && pos < need) out[pos] = translate_g(p, row, x);
    base += total;
    __syncthreads();  // sm.scan is rewritten next round
  }
}

// A row's histogram gh[0 .. nbins) (in the workspace, the row's CTAs' counts added) into
// sm.hist: at 2,048 or 1,024 bins one 16- or 8-byte read a thread (gh and sm.hist are
// 16-byte aligned), so that the block waits one round trip, not one a bin.
__device__ __forceinline__ void load_row_hist(const uint32_t* gh, uint32_t nbins, GSmem& sm) {
  const int tid = threadIdx.x;
  if (nbins == 4u * kThreads) {
    reinterpret_cast<uint4*>(sm.hist)[tid] = __ldcg(reinterpret_cast<const uint4*>(gh) + tid);
  } else if (nbins == 2u * kThreads) {
    reinterpret_cast<uint2*>(sm.hist)[tid] = __ldcg(reinterpret_cast<const uint2*>(gh) + tid);
  } else {
    for (uint32_t i = tid; i < nbins; i += kThreads) sm.hist[i] = __ldcg(&gh[i]);
  }
}

// Where block_select reads a row's cnt gathered candidate keys: copied into sk when they
// fit its sk_cap words, else in place (block_select overwrites them either way).
__device__ __forceinline__ uint32_t* candidate_keys(uint32_t* cand_key, uint32_t cnt, uint32_t* sk, uint32_t sk_cap) {
  if (cnt > sk_cap) return cand_key;
  for (uint32_t i = threadIdx.x; i < cnt; i += kThreads) sk[i] = __ldcg(&cand_key[i]);
  return sk;
}

// The most elements counted_select ranks against each other (n^2 / kThreads
// comparisons each); more than this share the threshold digit: block_select.
constexpr uint32_t kRankMax = 256;

// The `on` elements on a select's threshold digit (on_list: key << 32 | ~index, distinct)
// ranked against each other, larger key then lower index first: those ranked below
// `need` go to out[above + rank]. Every thread of the block calls it, after a barrier.
__device__ __forceinline__ void rank_on_list(const GridParams& p, int row, const uint64_t* on_list, uint32_t on,
                                             uint32_t need, uint32_t above, int32_t* out) {
  for (uint32_t t = threadIdx.x; t < on; t += kThreads) {
    const uint64_t mine = on_list[t];
    uint32_t rank = 0;  // how many go before it
    for (uint32_t j = 0; j < on; ++j) rank += on_list[j] > mine ? 1u : 0u;
    if (rank < need) out[above + rank] = translate_g(p, row, static_cast<int32_t>(~static_cast<uint32_t>(mine)));
  }
}

// Candidates a thread of the last CTA holds in registers per pass of counted_select
// (their keys and indices loaded together: one global round trip a pass; rows that
// gather at most kPass * kThreads candidates, the usual case, take one pass).
constexpr int kPass = 4;

struct CandidatePass {
  uint32_t key[kPass];
  int32_t idx[kPass];
};

__device__ __forceinline__ CandidatePass load_candidates(const uint32_t* cand_key, const int32_t* cand_idx, uint32_t b0,
                                                         uint32_t cnt) {
  CandidatePass c;
#pragma unroll
  for (int j = 0; j < kPass; ++j) {
    const uint32_t i = b0 + j * kThreads + threadIdx.x;
    c.key[j] = i < cnt ? __ldcg(&cand_key[i]) : 0u;
    c.idx[j] = i < cnt ? __ldcg(&cand_idx[i]) : 0;
  }
  return c;
}

// The last CTA's select over the `cnt` gathered candidates (all share the top `pbits`
// bits `prefix`) when every CTA also counted its candidates' next digit (the bits
// under the prefix, `(key >> nshift) & nmask`) into gh_next while gathering: the
// threshold on that digit straight from the count (gh_next, or sm.hist when gh_next is
// null), the candidates above it written out, and those on it ranked against each
// other by key, then lower index (a stable sort's order); their rank is their place.
// Instead of block_select's radix rounds over every candidate (clear, count, scan:
// each round barrier-bound), which it falls back to when more than kRankMax
// candidates share the threshold digit.
// The first pass's candidates are requested with the histogram, before the
// threshold is known. Writes the `need` chosen to out[0 .. need). Every thread of
// the block calls it.
__device__ __forceinline__ void counted_select(const GridParams& p, int row, uint32_t* sk, uint32_t sk_cap,
                                               uint32_t cnt, uint32_t* cand_key, const int32_t* cand_idx,
                                               const uint32_t* gh_next, int nshift, uint32_t nmask, uint32_t prefix,
                                               int pbits, uint32_t need, int32_t* out, GSmem& sm, long long* lprof) {
  const int tid = threadIdx.x;
  const uint32_t nbins = nmask + 1;
  CandidatePass c = load_candidates(cand_key, cand_idx, 0, cnt);
  if (gh_next != nullptr) {  // else the caller counted into sm.hist
    load_row_hist(gh_next, nbins, sm);
  }
  if (tid == 0) sm.local_above = sm.local_tie = 0;
  __syncthreads();
  if (lprof) lprof[7] = global_ns();
  // Ends with a barrier: the histogram is read. The bin count a constant in each call
  // (measured on the H200, run 21: 0.90 -> 0.55 us, against 0.83 for find_threshold's
  // unrolled reads at a run-time count).
  if (nbins == static_cast<uint32_t>(kGBins)) {
    find_threshold<kThreads>(sm.hist, kGBins, need, sm);
  } else if (nbins == static_cast<uint32_t>(kGBins / 2)) {
    find_threshold<kThreads>(sm.hist, kGBins / 2, need, sm);
  } else {
    find_threshold<kThreads>(sm.hist, nbins, need, sm);
  }
  const uint32_t thr = sm.thr_bin, above = sm.thr_above, on = sm.thr_cnt, need_on = need - above;
  const bool all_on = on == need_on;
  if (!all_on && on > kRankMax) [[unlikely]] {  // the same in every thread
    uint32_t* keys = candidate_keys(cand_key, cnt, sk, sk_cap);
    __syncthreads();  // and every thread has read sm.thr_*
    block_select(
        keys, cnt, [](uint32_t) { return true; }, [&](uint32_t i) { return static_cast<uint32_t>(__ldcg(&cand_idx[i])); },
        prefix, pbits, need, sm,
        [&](uint32_t pos, uint32_t i) { out[pos] = translate_g(p, row, __ldcg(&cand_idx[i])); });
    return;
  }
  if (lprof) lprof[8] = global_ns();
  // The candidates on the threshold digit, as key << 32 | ~index (distinct: indices
  // are), in the spent histogram's space (kRankMax 64-bit entries fit in it).
  uint64_t* on_list = reinterpret_cast<uint64_t*>(sm.hist);
  // Every candidate shares `prefix`, so comparing the key's bits down to this digit
  // with prefix:thr compares the digit.
  const uint32_t pthr = (prefix << __popc(nmask)) | thr;
  for (uint32_t b0 = 0; b0 < cnt; b0 += kPass * kThreads) {  // uniform trip counts: shuffles below
    // The next pass's candidates requested before this one's are placed (rows of 1 M
    // gather ~5,000: three passes. Staging the whole list in shared memory first by
    // cp.async measured no faster: run 53, the passes are not waiting on their loads.)
    const CandidatePass cur = c;
    if (b0 + kPass * kThreads < cnt) c = load_candidates(cand_key, cand_idx, b0 + kPass * kThreads, cnt);
    uint32_t vmask = 0;
#pragma unroll
    for (int j = 0; j < kPass; ++j) vmask |= static_cast<uint32_t>(b0 + j * kThreads + tid < cnt) << j;
    // Places: one shared atomic a warp for each kind (warp_take's would be one a
    // warp for each of the pass's elements, each waiting for the last).
    const Chosen ch = chosen_elements<kPass>([&](int j) { return cur.key[j]; }, vmask, nshift, pthr);
    const uint2 places = warp_places(ch, &sm.local_above, &sm.local_tie);
    uint32_t a = places.x, o = places.y;
#pragma unroll
    for (int j = 0; j < kPass; ++j) {
      if ((ch.above_mask >> j) & 1u) out[a++] = translate_g(p, row, cur.idx[j]);
      if ((ch.tie_mask >> j) & 1u) {
        if (all_on) {
          out[above + o] = translate_g(p, row, cur.idx[j]);
        } else {
          on_list[o] = static_cast<uint64_t>(cur.key[j]) << 32 | ~static_cast<uint32_t>(cur.idx[j]);
        }
        ++o;
      }
    }
  }
  if (lprof) lprof[9] = global_ns();
  if (all_on) return;
  __syncthreads();
  rank_on_list(p, row, on_list, on, need_on, above, out);
}

// The row's length (lengths[row], or max_len), clamped to [0, max_len].
__device__ __forceinline__ int64_t row_length(const GridParams& p, int row) {
  const int64_t len = p.lengths != nullptr ? p.lengths[row] : p.max_len;
  return len < 0 ? 0 : (len > p.max_len ? p.max_len : len);
}

// Chunk `chunk` of the row into sk (load_chunk), its round-0 digits counted into
// sm.hist; this thread's valid elements.
template <int EPT>
__device__ __forceinline__ uint32_t load_row_chunk(const GridParams& p, int row, int64_t len, int chunk, uint32_t* sk,
                                                   GSmem& sm) {
  constexpr int kChunk = kThreads * EPT;
  for (int i = threadIdx.x; i < kGBins; i += kThreads) sm.hist[i] = 0;
  if (threadIdx.x < kDigit1Bins) sm.hist1[threadIdx.x] = 0;
  __syncthreads();
  const int64_t c0 = static_cast<int64_t>(chunk) * kChunk;
  const int64_t n_here = len - c0 < kChunk ? len - c0 : kChunk;
  return load_chunk<EPT>(p.scores + row * p.row_stride + c0, n_here, p.vec_ok, sk, sm.hist);
}

// A row of at most k scores: every one is chosen (chunk 0 writes them, -1 after). Whether
// the row is one.
__device__ __forceinline__ bool all_chosen(const GridParams& p, int row, int64_t len, int chunk, int32_t* out) {
  if (len > p.k) return false;
  if (chunk == 0) {
    for (int64_t i = threadIdx.x; i < p.k; i += kThreads) out[i] = i < len ? translate_g(p, row, i) : -1;
    if (p.out_count != nullptr && threadIdx.x == 0) p.out_count[row] = static_cast<int32_t>(len);
  }
  return true;
}

// Counts into hist the next digit ((key >> shift) & (nbins - 1)) of this thread's keys
// (sk[e * kThreads + tid], valid where vmask says) whose bits from `drop` up equal
// `prefix`. The matching keys as a mask first: their reads, with no shared atomic
// between them (which the compiler cannot tell from the keys' memory), are issued
// together (measured on the H200, run 21: 16,384 scores 2.0 -> 1.0 us).
template <int EPT>
__device__ __forceinline__ void count_bucket_digit(const uint32_t* sk, uint32_t vmask, int drop, uint32_t prefix,
                                                   int shift, uint32_t nbins, uint32_t* hist) {
  const int tid = threadIdx.x;
  uint32_t in_bucket = 0;
#pragma unroll
  for (int e = 0; e < EPT; ++e) in_bucket |= static_cast<uint32_t>((sk[e * kThreads + tid] >> drop) == prefix) << e;
  for (uint32_t m = in_bucket & vmask; m != 0; m &= m - 1) {
    atomicAdd(&hist[(sk[(__ffs(m) - 1) * kThreads + tid] >> shift) & (nbins - 1)], 1u);
  }
}

// The row index of a chunk's element held at sk[flat] (flat = e * kThreads + thread: see load_chunk).
__device__ __forceinline__ int64_t chunk_index(int64_t c0, uint32_t flat) {
  const uint32_t e = flat / kThreads, th = flat % kThreads;
  return c0 + (e >> 2) * (kThreads * 4) + th * 4 + (e & 3);
}

// find_threshold over sm.hist1 (kDigit1Bins bins) by warp 0 alone: each lane sums 8 bins
// (from the top), one warp scan, and the lane where the count reaches `need` writes
// sm.thr_*. Ends with a barrier. Against find_threshold's block scan: no barriers but the last.
__device__ __forceinline__ void find_threshold_digit1(uint32_t need, GSmem& sm) {
  static_assert(kDigit1Bins == 8 * 32, "8 bins a lane");
  if (threadIdx.x < 32) {
    const int lane = static_cast<int>(threadIdx.x);
    const int b0 = kDigit1Bins - 8 * (lane + 1);  // lane 0 the highest bins
    const uint4 lo = *reinterpret_cast<const uint4*>(sm.hist1 + b0);
    const uint4 hi = *reinterpret_cast<const uint4*>(sm.hist1 + b0 + 4);
    const uint32_t c[8] = {hi.w, hi.z, hi.y, hi.x, lo.w, lo.z, lo.y, lo.x};  // bin b0 + 7 - j
    uint32_t local = 0;
#pragma unroll
    for (int j = 0; j < 8; ++j) local += c[j];
    const uint32_t incl = warp_inclusive_sum(local);
    uint32_t run = incl - local;
    if (run < need && need <= incl) {
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        if (run < need && need <= run + c[j]) {
          sm.thr_bin = static_cast<uint32_t>(b0 + 7 - j);
          sm.thr_above = run;
          sm.thr_cnt = c[j];
        }
        run += c[j];
      }
    }
  }
  __syncthreads();
}

// A row that is one chunk (at sk, from c0 = 0; vmask: this thread's valid keys; its
// round-0 digits counted into sm.hist by load_row_chunk): selected in this CTA, ties by
// lower index. The threshold bucket of that count; unless the bucket is taken whole, the
// next digit counted over the bucket's elements and its threshold; then one pass writes
// out every element above the two digits' threshold and those on it, ranked against each
// other (larger key, then lower index) when not all are taken. More than kRankMax on it
// (many equal scores): block_select's radix rounds over the chunk. Every thread of the
// block calls it.
template <int EPT>
__device__ __forceinline__ void select_one_chunk(const GridParams& p, int row, int64_t len, uint32_t vmask, uint32_t* sk,
                                                 GSmem& sm, int32_t* out, long long* prof) {
  const int tid = threadIdx.x;
  const uint32_t kk = static_cast<uint32_t>(p.k);
  auto key = [&](int e) { return sk[e * kThreads + tid]; };
  if (tid == 0) sm.local_above = sm.local_tie = 0;  // warp_places' counters, for the emission below
  __syncthreads();  // every thread's round-0 counts
  find_threshold<kThreads>(sm.hist, kGBins, kk, sm);
  if (prof) prof[3] = global_ns();
  const uint32_t t0 = sm.thr_bin;
  uint32_t above = sm.thr_above, on = sm.thr_cnt, prefix = t0;
  int drop = digit_shift(0);
  if (on != kk - above) {  // the bucket's next 8 bits (zeroed by load_row_chunk): 2 barriers, not 6
    constexpr int kShift1 = digit_shift(0) - kDigit1Bits;
    count_bucket_digit<EPT>(sk, vmask, drop, t0, kShift1, kDigit1Bins, sm.hist1);
    __syncthreads();  // and every thread has read sm.thr_*
    find_threshold_digit1(kk - above, sm);
    prefix = (t0 << kDigit1Bits) | sm.thr_bin;
    drop = kShift1;
    above += sm.thr_above;
    on = sm.thr_cnt;
  }
  if (prof) prof[4] = global_ns();
  const uint32_t need_on = kk - above;
  const bool all_on = on == need_on;
  // From here no barrier before the emission: sm.thr_* is not written again (but by block_select), the
  // counters were zeroed above, and sm.hist (the on-list's space) was last read inside find_threshold.
  if (!all_on && on > kRankMax) [[unlikely]] {  // the same in every thread
    __syncthreads();  // every thread has read sm.thr_*
    block_select(
        sk, kThreads * EPT, [&](uint32_t i) { return chunk_index(0, i) < len; },
        [&](uint32_t i) { return static_cast<uint32_t>(chunk_index(0, i)); }, 0u, 0, kk, sm,
        [&](uint32_t pos, uint32_t i) { out[pos] = translate_g(p, row, chunk_index(0, i)); });
  } else {
    // The elements on the threshold, as key << 32 | ~index (distinct), in the spent
    // histogram's space (kRankMax 64-bit entries fit in it).
    uint64_t* on_list = reinterpret_cast<uint64_t*>(sm.hist);
    const Chosen ch = chosen_elements<EPT>(key, vmask, drop, prefix);
    const uint2 places = warp_places(ch, &sm.local_above, &sm.local_tie);
    uint32_t a = places.x;
    for (uint32_t m = ch.above_mask; m != 0; m &= m - 1) {
      const int e = __ffs(m) - 1;
      out[a++] = translate_g(p, row, chunk_index(0, e * kThreads + tid));
    }
    uint32_t o = places.y;
    for (uint32_t m = ch.tie_mask; m != 0; m &= m - 1, ++o) {
      const int e = __ffs(m) - 1;
      const int64_t i = chunk_index(0, e * kThreads + tid);
      if (all_on) {
        out[above + o] = translate_g(p, row, i);
      } else {
        on_list[o] = static_cast<uint64_t>(key(e)) << 32 | ~static_cast<uint32_t>(i);
      }
    }
    if (prof) prof[5] = global_ns();
    if (!all_on) {
      __syncthreads();
      rank_on_list(p, row, on_list, on, need_on, above, out);
    }
  }
  if (p.out_count != nullptr && tid == 0) p.out_count[row] = p.k;
  if (prof) prof[10] = global_ns();
}

// A grid top-k CTA's last step: with tickets, the last CTA of the grid puts them back.
__device__ __forceinline__ void grid_exit(const GridParams& p) {
  if (p.ticketed) {
    __syncthreads();
    if (threadIdx.x == 0) {
      __threadfence();
      if (atomicAdd(&p.tickets[1], 1u) == gridDim.x - 1) {
        p.tickets[0] = 0;
        p.tickets[1] = 0;
      }
    }
  }
}

// BLOCKS: the CTAs an SM holds (launch bounds): 2, or 3 (large chunks only) for launches of
// more than three waves at two an SM (40 registers, 64 bytes spilled; three 74 KB CTAs fill an
// SM's shared memory; see make_grid_plan).
template <int EPT, int BLOCKS>
__global__ void __launch_bounds__(kThreads, BLOCKS) grid_topk_kernel(const GridParams p) {
  pdl_entry();  // see launch_kernel
  constexpr int kChunk = kThreads * EPT;
  extern __shared__ __align__(16) uint8_t gsmem[];
  GSmem& sm = *reinterpret_cast<GSmem*>(gsmem);
  uint32_t* sk = reinterpret_cast<uint32_t*>(gsmem + kGKeysOffset);  // [EPT][kThreads]
  const int tid = threadIdx.x;
  long long* prof = p.profile != nullptr && blockIdx.x == 0 && tid == 0 ? p.profile : nullptr;
  if (prof) prof[0] = global_ns();
  asm volatile("griddepcontrol.wait;" ::: "memory");  // the scores' producer has finished
  if (prof) prof[1] = global_ns();
  int64_t t = blockIdx.x;
  if (p.ticketed) {
    if (tid == 0) sm.ticket = atomicAdd(&p.tickets[0], 1u);
    __syncthreads();
    t = sm.ticket;
  }
  const int lrow = static_cast<int>(t / p.cpr), chunk = static_cast<int>(t % p.cpr);
  const int row = p.row0 + lrow;
  const int64_t len = row_length(p, row);
  int32_t* out = p.out_idx + row * p.out_stride;
  const int64_t nrow = (len + kChunk - 1) / kChunk;
  if (!all_chosen(p, row, len, chunk, out) && chunk < nrow) {
    const uint32_t vmask = load_row_chunk<EPT>(p, row, len, chunk, sk, sm);
    const int64_t c0 = static_cast<int64_t>(chunk) * kChunk;
    if (prof) prof[2] = global_ns();
    auto index_of = [&](uint32_t flat) { return chunk_index(c0, flat); };
    const uint32_t kk = static_cast<uint32_t>(p.k);
    if (nrow == 1) [[unlikely]] {  // the whole row is here: select in this CTA
      select_one_chunk<EPT>(p, row, len, vmask, sk, sm, out, prof);
    } else {
      uint32_t* w = p.ws + static_cast<int64_t>(lrow) * kZeroWords;
      uint32_t* ctr = w + kGRounds * kGBins;
      uint32_t* cand_key = p.scratch + static_cast<int64_t>(lrow) * p.scratch_words;
      int32_t* cand_idx = reinterpret_cast<int32_t*>(cand_key + kGatherMax);
      uint32_t prefix = 0, need = kk, cnt = 0;
      int pbits = 0, gather_round = 0, last_round = kGRounds - 1;
      bool gather = false;
#pragma unroll 1
      for (int round = 0; round < kGRounds; ++round) {
        const int shift = digit_shift(round), bits = digit_bits(round);
        const uint32_t nbins = 1u << bits;
        if (round > 0) {
          for (uint32_t i = tid; i < nbins; i += kThreads) sm.hist[i] = 0;
          __syncthreads();
          count_bucket_digit<EPT>(sk, vmask, 32 - pbits, prefix, shift, nbins, sm.hist);
        }
        __syncthreads();
        uint32_t* gh = w + round * kGBins;
        if (round == 0) {
          // Round 0's counts by adds that return each bin's count before them (add_counts_and_arrive):
          // scan_places turns those into places in the output (the fused indexer's way: no global
          // atomic after the barrier).
          add_counts_and_arrive<kThreads, kGBins>(sm.hist, gh, &ctr[kArrive0], static_cast<uint32_t>(nrow), [&] {
            if (prof) prof[3] = global_ns();
          });
          scan_places<kThreads, kGBins>(gh, need, sm.hist, sm);
          need -= sm.thr_above;
          cnt = sm.thr_cnt;
          prefix = sm.thr_bin;
          pbits = bits;
          if (prof) prof[4] = global_ns();
        } else {
          for (uint32_t i = tid; i < nbins; i += kThreads) {
            const uint32_t v = sm.hist[i];
            if (v != 0) atomicAdd(&gh[i], v);
          }
          grid_arrive_and_wait(&ctr[kArrive0 + round], static_cast<uint32_t>(nrow));
          load_row_hist(gh, nbins, sm);
          __syncthreads();
          narrow_to_threshold(sm.hist, bits, sm, prefix, pbits, need, cnt);
        }
        if (cnt == need) {  // the whole threshold bucket is taken
          last_round = round;
          break;
        }
        // Few enough for one CTA (after the last round: the elements equal to the k-th
        // value, whose ties the last CTA settles by index).
        if (cnt <= static_cast<uint32_t>(kGatherMax)) {
          gather = true;
          gather_round = last_round = round;
          break;
        }
      }
      // counted_select's digit: the next round's, counted into that round's unused histogram.
      const bool counted = gather && p.counted_finish && gather_round + 1 < kGRounds;
      const int nshift = digit_shift(gather_round + 1);
      const uint32_t nmask = (1u << digit_bits(gather_round + 1)) - 1u;
      uint32_t* gh_next = w + (gather_round + 1) * kGBins;
      const bool take_all = cnt == need;
      const uint32_t total_above = kk - need;
      const int drop = 32 - pbits;
      // An element of the threshold bucket (sk[flat]) at place g among the row's.
      auto put_bucket = [&](uint32_t flat, uint32_t g) {
        if (gather) {
          const uint32_t key = sk[flat];
          __stcg(&cand_key[g], key);
          __stcg(&cand_idx[g], static_cast<int32_t>(index_of(flat)));
          if (counted) atomicAdd(&gh_next[(key >> nshift) & nmask], 1u);
        } else if (take_all) {  // otherwise the last CTA settles the ties in index order
          out[total_above + g] = translate_g(p, row, index_of(flat));
        }
      };
      if (last_round == 0) {
        // Places from scan_places: sm.hist[b] is the next place in the output of the CTA's
        // elements in bin b above the threshold bin, and in the bucket for that bin (a
        // shared atomic an element). The chosen ones as a mask first (the keys' reads issued
        // together; see count_bucket_digit).
        uint32_t mine = 0;
#pragma unroll
        for (int e = 0; e < EPT; ++e) mine |= static_cast<uint32_t>((sk[e * kThreads + tid] >> drop) >= prefix) << e;
        for (uint32_t m = mine & vmask; m != 0; m &= m - 1) {
          const uint32_t flat = (__ffs(m) - 1) * kThreads + tid, bin = sk[flat] >> drop;
          const uint32_t pos = atomicAdd(&sm.hist[bin], 1u);
          if (bin > prefix) {
            out[pos] = translate_g(p, row, index_of(flat));
          } else {
            put_bucket(flat, pos);
          }
        }
      } else [[unlikely]] {
        // This thread's chosen elements as masks, then output ranges: warp scans, one
        // shared atomic per warp, one global atomic per CTA.
        const Chosen ch = chosen_elements<EPT>([&](int e) { return sk[e * kThreads + tid]; }, vmask, drop, prefix);
        if (tid == 0) sm.above_ctr = sm.tie_ctr = 0;
        __syncthreads();
        const uint2 places = warp_places(ch, &sm.above_ctr, &sm.tie_ctr);
        __syncthreads();
        if (tid == 0) {
          sm.base_above = sm.above_ctr != 0 ? atomicAdd(&ctr[kAbove], sm.above_ctr) : 0u;
          sm.base_tie = sm.tie_ctr != 0 ? atomicAdd(&ctr[gather ? kCand : kTie], sm.tie_ctr) : 0u;
        }
        __syncthreads();
        uint32_t pos = sm.base_above + places.x;
        for (uint32_t m = ch.above_mask; m != 0; m &= m - 1) {
          const int e = __ffs(m) - 1;
          out[pos++] = translate_g(p, row, index_of(e * kThreads + tid));
        }
        uint32_t g = sm.base_tie + places.y;
        for (uint32_t m = ch.tie_mask; m != 0; m &= m - 1, ++g) put_bucket((__ffs(m) - 1) * kThreads + tid, g);
      }
      if (prof) prof[5] = global_ns();
      // The last CTA of the row to get here finishes it.
      __syncthreads();  // every thread's output and candidate stores before the arrival
      if (tid == 0) sm.last = arrive_acq_rel(&ctr[kDone]) == static_cast<uint32_t>(nrow - 1);
      __syncthreads();
      // Each common path exits where it ends (grid_exit), ahead of the rare paths' code:
      // a jump over that code to one shared exit missed the instruction cache (source
      // counters at 1 x 262,144, session 19: 162 of the exit's 183 samples no_inst).
      if (!sm.last) {
        grid_exit(p);
        return;
      }
      {
        long long* lprof = p.profile != nullptr && row == 0 && tid == 0 ? p.profile : nullptr;
        if (lprof) lprof[6] = global_ns();
        auto row_done = [&] {
          for (int i = tid; i < kZeroWords; i += kThreads) w[i] = 0;  // ready for the next call
          if (p.out_count != nullptr && tid == 0) p.out_count[row] = p.k;
          if (lprof) lprof[10] = global_ns();
        };
        if (counted) {
          counted_select(p, row, sk, kChunk, cnt, cand_key, cand_idx, gh_next, nshift, nmask, prefix, pbits, need,
                         out + total_above, sm, lprof);
          row_done();
          grid_exit(p);
          return;
        }
        if (gather) [[unlikely]] {  // TopkArgs::finish 1, or a gather at the last round
          uint32_t* keys = candidate_keys(cand_key, cnt, sk, kChunk);
          __syncthreads();
          if (lprof) lprof[7] = global_ns();
          block_select(
              keys, cnt, [](uint32_t) { return true; },
              [&](uint32_t i) { return static_cast<uint32_t>(__ldcg(&cand_idx[i])); }, prefix, pbits, need, sm,
              [&](uint32_t pos2, uint32_t i) { out[total_above + pos2] = translate_g(p, row, __ldcg(&cand_idx[i])); });
        } else if (!take_all) [[unlikely]] {  // more than kGatherMax elements equal the k-th value
          ties_in_index_order(p, row, len, prefix, need, out + total_above, sm);
        }
        row_done();
      }
    }
  }
  grid_exit(p);
}

// Rows of one chunk (the grid plan's cpr == 1): CTA r selects row row0 + r alone, as grid_topk_kernel's
// nrow == 1 branch does (rows shorter than the call's longest), in a kernel of its own, without the
// multi-CTA paths' code (46 registers at 4,096 against 64). Measured on the H200, run 28 call 2: 1 / 8 / 64
// x 4,096 4.48 / 4.59 / 4.83 -> 4.08 / 4.22 / 4.54 us; 1 / 8 / 64 x 16,384 6.57 / 6.67 / 7.58 -> 6.32 /
// 6.49 / 7.40; which of the two (code, registers) gains is not measured.
template <int EPT>
__global__ void __launch_bounds__(kThreads, 2) one_chunk_topk_kernel(const GridParams p) {
  pdl_entry();  // see launch_kernel
  extern __shared__ __align__(16) uint8_t gsmem[];
  GSmem& sm = *reinterpret_cast<GSmem*>(gsmem);
  uint32_t* sk = reinterpret_cast<uint32_t*>(gsmem + kGKeysOffset);  // [EPT][kThreads]
  long long* prof = p.profile != nullptr && blockIdx.x == 0 && threadIdx.x == 0 ? p.profile : nullptr;
  if (prof) prof[0] = global_ns();
  asm volatile("griddepcontrol.wait;" ::: "memory");  // the scores' producer has finished
  if (prof) prof[1] = global_ns();
  const int row = p.row0 + static_cast<int>(blockIdx.x);
  const int64_t len = row_length(p, row);
  int32_t* out = p.out_idx + row * p.out_stride;
  if (all_chosen(p, row, len, 0, out)) return;
  const uint32_t vmask = load_row_chunk<EPT>(p, row, len, 0, sk, sm);
  if (prof) prof[2] = global_ns();
  select_one_chunk<EPT>(p, row, len, vmask, sk, sm, out, prof);
}

// ---- streamed top-k: rows in several waves, no CTA waits for another ----------------
// When a call's chunks are more than the device holds at once, the grid kernel's
// resident CTAs wait at their rows' barriers while the next wave cannot start. Here no
// CTA waits: each adds its round-0 histogram to its row's with atomics that return the
// sums so far (a lower bound of the row's final count at every bin, this chunk's own
// included), takes the threshold bucket of that partial histogram (a count from the top
// over lower bounds reaches k no earlier: the bucket is at or below the row's), and
// writes every element at or above it to the row's candidate list. The row's last CTA
// then selects among the candidates with the complete histogram: one read of the
// scores, and the candidates are the elements the partial thresholds kept (later
// chunks of a row see more of it, so keep fewer). A row whose list overflows is
// selected from its scores by its last CTA (one CTA reading the row a few times).

// Candidates a thread of the last CTA loads per pass over the list (one round trip).
constexpr int kListBatch = 8;

// The last CTA's select over a list of n elements (entry_at(i): key, index) that holds
// every element of the row whose round-0 digit is at least the complete histogram's
// threshold bucket; sm.hist holds that histogram. Radix rounds over the list narrow
// the threshold while its bucket is more than chunk_cap elements; one pass then writes
// the elements above it out and takes the bucket's whole, or gathers them (keys and
// indices to bucket_key / bucket_idx) with their next digit counted in shared memory
// for counted_select; a bucket of more than chunk_cap copies of one value:
// ties_in_index_order over the row. Writes p.k indices to out. Every thread of the
// block calls it. The list is read kListBatch entries a thread at a time, every load
// issued before any is used (indices past n clamped to n - 1, then masked).
template <class EntryAt>
__device__ __forceinline__ void select_list(const GridParams& p, int row, int64_t len, uint32_t n, EntryAt&& entry_at,
                                            uint32_t* sk, uint32_t chunk_cap, uint32_t* bucket_key,
                                            int32_t* bucket_idx, int32_t* out, GSmem& sm, long long* lprof) {
  const int tid = threadIdx.x;
  const uint32_t kk = static_cast<uint32_t>(p.k);
  find_threshold<kThreads>(sm.hist, kGBins, kk, sm);
  uint32_t need = kk - sm.thr_above, cnt = sm.thr_cnt, prefix = sm.thr_bin;
  int pbits = digit_bits(0), round = 1;
  __syncthreads();  // every thread has read sm.thr_*
#pragma unroll 1
  for (; round < kGRounds && cnt != need && cnt > chunk_cap; ++round) {
    // radix_round's steps written out: the list's batched loads, counted through its
    // lambda, spilled (12 -> 116 bytes of spill loads).
    const int shift = digit_shift(round), bits = digit_bits(round);
    const uint32_t nbins = 1u << bits;
    for (uint32_t i = tid; i < nbins; i += kThreads) sm.hist[i] = 0;
    __syncthreads();
    for (uint32_t b0 = 0; b0 < n; b0 += kListBatch * kThreads) {
      uint32_t key[kListBatch];
#pragma unroll
      for (int j = 0; j < kListBatch; ++j) key[j] = entry_at(min(b0 + j * kThreads + tid, n - 1)).x;
#pragma unroll
      for (int j = 0; j < kListBatch; ++j) {
        if (b0 + j * kThreads + tid < n && (key[j] >> (32 - pbits)) == prefix) {
          atomicAdd(&sm.hist[(key[j] >> shift) & (nbins - 1)], 1u);
        }
      }
    }
    __syncthreads();
    narrow_to_threshold(sm.hist, bits, sm, prefix, pbits, need, cnt);
  }
  if (lprof) lprof[7] = global_ns();
  const bool take_all = cnt == need, gather = !take_all && cnt <= chunk_cap;
  const bool counted = gather && round < kGRounds;  // a next digit to count (pbits < 32)
  const int nshift = counted ? digit_shift(round) : 0;
  const uint32_t nmask = counted ? (1u << digit_bits(round)) - 1u : 0u;
  const uint32_t above_total = kk - need;
  if (tid == 0) sm.above_ctr = sm.tie_ctr = 0;
  if (counted) {
    for (uint32_t i = tid; i <= nmask; i += kThreads) sm.hist[i] = 0;
  }
  __syncthreads();
  for (uint32_t b0 = 0; b0 < n; b0 += kListBatch * kThreads) {  // uniform trip counts: shuffles below
    uint32_t key[kListBatch];
    int32_t idx[kListBatch];
    uint32_t vmask = 0;
#pragma unroll
    for (int j = 0; j < kListBatch; ++j) {
      const uint32_t i = min(b0 + j * kThreads + tid, n - 1);
      const uint2 e = entry_at(i);
      key[j] = e.x;
      idx[j] = static_cast<int32_t>(e.y);
    }
#pragma unroll
    for (int j = 0; j < kListBatch; ++j) vmask |= static_cast<uint32_t>(b0 + j * kThreads + tid < n) << j;
    const Chosen ch = chosen_elements<kListBatch>([&](int j) { return key[j]; }, vmask, 32 - pbits, prefix);
    if (lprof && b0 == 0) lprof[13] = global_ns();
    const uint2 places = warp_places(ch, &sm.above_ctr, &sm.tie_ctr);
    uint32_t a = places.x, t = places.y;
#pragma unroll
    for (int j = 0; j < kListBatch; ++j) {
      if ((ch.above_mask >> j) & 1u) out[a++] = translate_g(p, row, idx[j]);
      if ((ch.tie_mask >> j) & 1u) {
        if (take_all) {
          out[above_total + t] = translate_g(p, row, idx[j]);
        } else if (gather) {
          bucket_key[t] = key[j];
          bucket_idx[t] = idx[j];
          if (counted) atomicAdd(&sm.hist[(key[j] >> nshift) & nmask], 1u);
        }
        ++t;
      }
    }
    if (lprof && b0 == 0) lprof[14] = global_ns();
  }
  __syncthreads();  // the gathered bucket and its count are written
  if (lprof) lprof[8] = global_ns();
  if (take_all) return;
  if (counted) {
    counted_select(p, row, sk, chunk_cap, cnt, bucket_key, bucket_idx, nullptr, nshift, nmask, prefix, pbits, need,
                   out + above_total, sm, nullptr);
  } else if (gather) [[unlikely]] {  // the bucket is one value (pbits == 32): the lowest indices
    for (uint32_t i = tid; i < cnt; i += kThreads) sk[i] = bucket_key[i];
    __syncthreads();
    block_select(
        sk, cnt, [](uint32_t) { return true; }, [&](uint32_t i) { return static_cast<uint32_t>(bucket_idx[i]); },
        prefix, pbits, need, sm,
        [&](uint32_t pos, uint32_t i) { out[above_total + pos] = translate_g(p, row, bucket_idx[i]); });
  } else [[unlikely]] {  // more than chunk_cap elements equal the k-th value (pbits == 32)
    ties_in_index_order(p, row, len, prefix, need, out + above_total, sm);
  }
}

template <int EPT>
__global__ void __launch_bounds__(kThreads, 2) stream_topk_kernel(const GridParams p) {
  pdl_entry();  // see launch_kernel
  constexpr int kChunk = kThreads * EPT;
  extern __shared__ __align__(16) uint8_t gsmem[];
  GSmem& sm = *reinterpret_cast<GSmem*>(gsmem);
  uint32_t* sk = reinterpret_cast<uint32_t*>(gsmem + kGKeysOffset);  // [EPT][kThreads]
  const int tid = threadIdx.x;
  const int lrow = static_cast<int>(blockIdx.x / p.cpr), chunk = static_cast<int>(blockIdx.x % p.cpr);
  const int row = p.row0 + lrow;
  long long* prof = p.profile != nullptr && lrow == 0 && chunk == 0 && tid == 0 ? p.profile : nullptr;
  if (prof) prof[0] = global_ns();
  const int64_t len = row_length(p, row);
  int32_t* out = p.out_idx + row * p.out_stride;
  const int64_t nrow = (len + kChunk - 1) / kChunk;
  if (all_chosen(p, row, len, chunk, out) || chunk >= nrow) return;
  const uint32_t vmask = load_row_chunk<EPT>(p, row, len, chunk, sk, sm);
  const int64_t c0 = static_cast<int64_t>(chunk) * kChunk;
  if (prof) prof[2] = global_ns();
  auto index_of = [&](uint32_t flat) { return chunk_index(c0, flat); };
  const uint32_t kk = static_cast<uint32_t>(p.k);
  if (nrow == 1) [[unlikely]] {  // the whole row is here: select in this CTA
    // (unstamped: the profile's slots name this kernel's phases, not select_one_chunk's)
    select_one_chunk<EPT>(p, row, len, vmask, sk, sm, out, nullptr);
    return;
  }
  uint32_t* gh = p.ws + static_cast<int64_t>(lrow) * kZeroWords;  // the row's round-0 histogram
  uint32_t* ctr = gh + kGRounds * kGBins;
  // The candidate list: key and index side by side (one 8-byte load brings both).
  uint2* cand = reinterpret_cast<uint2*>(p.scratch + static_cast<int64_t>(lrow) * p.scratch_words);
  uint32_t* bucket_key = reinterpret_cast<uint32_t*>(cand + p.cand_cap);
  int32_t* bucket_idx = reinterpret_cast<int32_t*>(bucket_key + kChunk);
  // The row's histogram so far with this chunk's counts (atomics that return the sums
  // before them; bins this chunk has none of read as they stand): a lower bound of the
  // final one at every bin.
  if (tid == 0) sm.thr_bin = sm.thr_above = sm.thr_cnt = 0;  // fewer than k counted so far: every element
  __syncthreads();
#pragma unroll
  for (int j = 0; j < kGBins / kThreads; ++j) {  // every atomic in flight at once
    const int i = j * kThreads + tid;
    const uint32_t v = sm.hist[i];
    sm.hist[i] = v != 0 ? atomicAdd(&gh[i], v) + v : __ldcg(&gh[i]);
  }
  __syncthreads();
  if (prof) prof[3] = global_ns();
  find_threshold<kThreads>(sm.hist, kGBins, kk, sm);
  const uint32_t thr = sm.thr_bin;
  if (prof) prof[4] = global_ns();
  // Candidates: this chunk's elements whose round-0 digit is at least thr (warp scans,
  // one shared atomic a warp, one global atomic a CTA for their places in the list).
  const auto [above_mask, tie_mask, n_above, n_tie, a_incl, t_incl] =
      chosen_elements<EPT>([&](int e) { return sk[e * kThreads + tid]; }, vmask, 32 - digit_bits(0), thr);
  const uint32_t mine = above_mask | tie_mask, n_mine = n_above + n_tie, incl = a_incl + t_incl;
  const unsigned lane = tid & 31;
  if (tid == 0) sm.above_ctr = 0;
  __syncthreads();
  uint32_t w_base = 0;
  if (lane == 31) w_base = atomicAdd(&sm.above_ctr, incl);
  w_base = __shfl_sync(0xffffffffu, w_base, 31);
  __syncthreads();
  if (tid == 0) {
    const uint32_t total = sm.above_ctr;
    const uint32_t base = total != 0 ? atomicAdd(&ctr[kCand], total) : 0u;
    const bool fits = static_cast<int64_t>(base) + total <= p.cand_cap;
    if (!fits) atomicOr(&ctr[kOverflow], 1u);
    sm.base_above = base;
    sm.overflow = fits ? 0u : 1u;
  }
  __syncthreads();
  if (sm.overflow == 0) {
    uint32_t pos = sm.base_above + w_base + incl - n_mine;
    for (uint32_t m = mine; m != 0; m &= m - 1, ++pos) {
      const int e = __ffs(m) - 1;
      __stcg(&cand[pos], make_uint2(sk[e * kThreads + tid], static_cast<uint32_t>(index_of(e * kThreads + tid))));
    }
  }
  if (prof) prof[5] = global_ns();
  // The last CTA of the row to get here selects among the candidates.
  __syncthreads();  // every thread's candidate stores before the arrival
  if (tid == 0) sm.last = arrive_acq_rel(&ctr[kDone]) == static_cast<uint32_t>(nrow - 1);
  __syncthreads();
  if (!sm.last) return;
  long long* lprof = p.profile != nullptr && lrow == 0 && tid == 0 ? p.profile : nullptr;
  if (lprof) lprof[6] = global_ns();
#pragma unroll
  for (int j = 0; j < kGBins / kThreads; ++j) sm.hist[j * kThreads + tid] = __ldcg(&gh[j * kThreads + tid]);
  if (tid == 0) {
    sm.cand_n = __ldcg(&ctr[kCand]);
    sm.overflow = __ldcg(&ctr[kOverflow]);
  }
  __syncthreads();
  for (int i = tid; i < kGBins; i += kThreads) gh[i] = 0;  // ready for the next call
  if (tid < kCounters) ctr[tid] = 0;
  if (lprof) {
    lprof[11] = sm.cand_n;
    lprof[12] = sm.overflow;
  }
  if (sm.overflow == 0) [[likely]] {
    select_list(
        p, row, len, sm.cand_n, [&](uint32_t i) { return __ldcg(&cand[i]); }, sk, kChunk, bucket_key, bucket_idx,
        out, sm, lprof);
  } else [[unlikely]] {  // the list overflowed: select from the row's scores
    const float* src = p.scores + row * p.row_stride;
    select_list(
        p, row, len, static_cast<uint32_t>(len), [&](uint32_t i) { return make_uint2(order_key(__ldcg(src + i)), i); },
        sk, kChunk, bucket_key, bucket_idx, out, sm, lprof);
  }
  if (p.out_count != nullptr && tid == 0) p.out_count[row] = p.k;
  if (lprof) lprof[10] = global_ns();
}

// ---- sampled top-k: a threshold from a sample, a filter at copy bandwidth, a finish a row ----------
// For calls of many long rows (TopkArgs::sampled; the rule: takes_sampled). The grid kernel's resident
// CTAs wait at their rows' barriers while its later waves cannot start (64 x 262,144: 43-47 us for a
// 16 us read); here the one pass over every score waits for nobody. Three kernels, chained by PDL:
// sample_topk_kernel (a CTA a row) takes from kSample of the row's scores a threshold key that about
// twice k of the row's keys reach; filter_topk_kernel (kFilterSpan scores a CTA, every row at once)
// appends each key at or above its row's threshold to the row's list (one global atomic a warp),
// counting past the list's capacity without writing there; finish_sampled_topk_kernel (a CTA a row)
// selects among the listed candidates when they are at least k and all in the list (every element at
// or above the k-th value is then among them, so the chosen set, ties included, is the row's), else
// from the row's scores. Exact, ties by lower index. Per launch row: the threshold in the first word
// of the row's scratch, the list from word kListOffset (key, index pairs), its count in the row's
// zeroed counters (kCand; the finish reads it and zeroes it for the next call). No profile stamps.

constexpr int kSample = 8192;                   // scores in a row's sample
constexpr int kSampleBits = 13;                 // kSample = 2^13
static_assert(kSample == 1 << kSampleBits, "kSampleBits");
constexpr int kSampleEpt = kSample / kThreads;  // 16 a thread
constexpr int kFilterEpt = 16;  // a thread: 40 registers, three CTAs an SM (32: 64 registers and spills)
constexpr int kFilterSpan = kThreads * kFilterEpt;  // 8,192 scores a filter CTA (and a fallback pass's step)
constexpr int kSampledCap = 16384;  // candidates a row's list holds: the finish's shared memory (128 KB)
constexpr int kListOffset = 4;      // scratch words before a row's list: the threshold (the pairs 16-byte aligned)
constexpr int64_t kSampledScratchWords = kListOffset + 2 * static_cast<int64_t>(kSampledCap);
constexpr int kFinishSmemBytes = kGKeysOffset + 8 * kSampledCap;

// EPT scores from src (n_here of them exist) as keys: element e of this thread at offset elem_offset(e),
// by 16-byte streaming loads where all exist and src is aligned (load_chunk's layout and hint), every
// load issued before a key is used. Returns which exist as a mask.
template <int EPT>
__device__ __forceinline__ uint32_t load_keys(const float* src, int64_t n_here, bool vec_ok, uint32_t (&key)[EPT]) {
  static_assert(EPT % 4 == 0 && EPT <= 32, "whole float4s, one mask");
  if (vec_ok && n_here >= kThreads * EPT) {
    float4 v[EPT / 4];
#pragma unroll
    for (int q = 0; q < EPT / 4; ++q) v[q] = __ldcs(reinterpret_cast<const float4*>(src) + q * kThreads + threadIdx.x);
#pragma unroll
    for (int q = 0; q < EPT / 4; ++q) {
      key[4 * q] = order_key(v[q].x);
      key[4 * q + 1] = order_key(v[q].y);
      key[4 * q + 2] = order_key(v[q].z);
      key[4 * q + 3] = order_key(v[q].w);
    }
    return EPT == 32 ? 0xffffffffu : (1u << EPT) - 1u;
  }
  float f[EPT];
#pragma unroll
  for (int e = 0; e < EPT; ++e) f[e] = elem_offset(e) < n_here ? __ldcs(src + elem_offset(e)) : 0.f;
  uint32_t vmask = 0;
#pragma unroll
  for (int e = 0; e < EPT; ++e) {
    key[e] = order_key(f[e]);
    vmask |= static_cast<uint32_t>(elem_offset(e) < n_here) << e;
  }
  return vmask;
}

// The rank in a row's sample (kSample of its len scores) whose key the filter takes as the threshold:
// twice the sample's expected share m = k * kSample / len of the row's k largest, plus three times the
// square root of that (a Poisson count's standard deviation) and 4. The row's count at or above it falls
// short of k only when r or more of the sample are among the row's k largest (for independent scores a
// Poisson(m) count: at most 6e-8 over k = 1..2,048 and rows of 65,536 to 2.2 M), and passes kSampledCap
// only when fewer than r are among its kSampledCap largest (below 1e-13 up to 1 M; 1e-5 at 2.2 M with
// k = 2,048). Expected candidates r * len / kSample: ~1,700 at 262,144 and k = 512, ~6,800 at 1 M and 2,048.
__device__ __forceinline__ uint32_t sample_rank(int k, int64_t len) {
  const float m2 = 2.f * static_cast<float>(k) * kSample / static_cast<float>(len);
  const uint32_t r = static_cast<uint32_t>(ceilf(m2 + 3.f * sqrtf(m2))) + 4u;
  return r < kSample ? r : kSample;
}

// The sample's bins (sample_row): keys within kGBins << kSampleBinShift of the sample's largest (2^27: 16
// octaves of floats), 1/128 octave a bin.
constexpr int kSampleBinShift = 16;

// A row's threshold for the filter (the first word of the row's scratch): a key that at least
// sample_rank of kSample of its scores reach (runs of 8 at even steps over the row: a thread pair's two
// 16-byte loads are one sector), or k of a row of at most kSample. One pass over the sample: its largest
// key, then a histogram of the keys below it by distance (kSampleBinShift), the threshold the lowest key
// of the bin where the count from the top reaches the rank. When the rank's keys lie further below the
// largest than the bins reach (a sample of many zeros or of a wide range of magnitudes), two radix rounds
// over the keys instead: the lowest key of the rank's 22-bit bucket (11-bit, when the rank is the last of
// that bucket). The second word: the shift that puts the sample's keys at or above the threshold into the
// first 1,024 of kGBins bins of (key - threshold) >> shift (the fused path's candidate histogram,
// candidate_bin). Rows of at most k scores are the finish's alone (nothing written). Every thread of the
// block calls it. (Measured, run 52 on an H100: a sample 4.5-7.6 us -> 4.0-6.1 from the kernel's entry.)
// prof (bench stamps, thread 0's): %globaltimer ns after the loads and largest key, the threshold, the
// radix rounds (when taken).
__device__ __forceinline__ void sample_row(const GridParams& p, int lrow, GSmem& sm, long long* prof = nullptr) {
  const int tid = threadIdx.x, row = p.row0 + lrow;
  const int64_t len = row_length(p, row);
  if (len <= p.k) return;
  constexpr uint32_t kNone = 0xffffffffu;
  for (int i = tid; i < kGBins; i += kThreads) sm.hist[i] = 0;
  if (tid == 0) {
    sm.max_key = 0;
    sm.thr_bin = kNone;
  }
  __syncthreads();
  const float* src = p.scores + row * p.row_stride;
  const bool whole = len <= kSample;
  // Runs of 2^rb scores at even steps over the row (p.sample_run_bits: kSampleRunBits unless
  // TROUPE_TOPK_SAMPLE_RUN says otherwise), kSample >> rb of them.
  const int rb = min(max(p.sample_run_bits, 3), 10);
  const int64_t step = len >> rb;  // whole runs in the row (at least kSample >> rb unless whole)
  // Element 4 q + c of this thread: sample place s = q * kSample / 4 + 4 tid + c, in run s >> rb at offset
  // s % 2^rb.
  float f[kSampleEpt];
#pragma unroll
  for (int q = 0; q < kSampleEpt / 4; ++q) {
    const int s = q * (kSample / 4) + 4 * tid;
    if (whole) {
#pragma unroll
      for (int c = 0; c < 4; ++c) f[4 * q + c] = s + c < len ? __ldcg(src + s + c) : 0.f;
    } else {
      const int64_t at = (static_cast<int64_t>(s >> rb) * step >> (kSampleBits - rb) << rb) + (s & ((1 << rb) - 1));
      if (p.vec_ok) {
        const float4 v = __ldcg(reinterpret_cast<const float4*>(src + at));
        f[4 * q] = v.x;
        f[4 * q + 1] = v.y;
        f[4 * q + 2] = v.z;
        f[4 * q + 3] = v.w;
      } else {
#pragma unroll
        for (int c = 0; c < 4; ++c) f[4 * q + c] = __ldcg(src + at + c);
      }
    }
  }
  uint32_t key[kSampleEpt], vmask = 0, mx = 0;
#pragma unroll
  for (int e = 0; e < kSampleEpt; ++e) {
    key[e] = order_key(f[e]);
    if (!whole || (e / 4) * (kSample / 4) + 4 * tid + (e % 4) < len) {
      vmask |= 1u << e;
      mx = max(mx, key[e]);
    }
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) mx = max(mx, __shfl_xor_sync(0xffffffffu, mx, o));
  if ((tid & 31) == 0) atomicMax(&sm.max_key, mx);
  __syncthreads();  // the largest key
  const uint32_t top = sm.max_key;
  if (prof && tid == 0) prof[0] = global_ns();
#pragma unroll
  for (int e = 0; e < kSampleEpt; ++e) {
    const uint32_t d = top - key[e];  // (top is the largest: no wrap)
    if (((vmask >> e) & 1u) && d < (static_cast<uint32_t>(kGBins) << kSampleBinShift)) {
      atomicAdd(&sm.hist[kGBins - 1 - (d >> kSampleBinShift)], 1u);
    }
  }
  const uint32_t need0 = whole ? static_cast<uint32_t>(p.k) : sample_rank(p.k, len);
  __syncthreads();  // every thread's counts
  find_threshold<kThreads>(sm.hist, kGBins, need0, sm);  // (leaves sm.thr_bin at kNone when the bins hold fewer)
  if (prof && tid == 0) prof[1] = global_ns();
  uint32_t thr;
  if (sm.thr_bin != kNone) [[likely]] {  // (the same in every thread)
    // The bin's lowest key: top + 1 - (kGBins - bin) << kSampleBinShift, or 0 below the keys' range.
    const uint64_t below = static_cast<uint64_t>(kGBins - sm.thr_bin) << kSampleBinShift;
    const uint64_t up = static_cast<uint64_t>(top) + 1u;
    thr = up > below ? static_cast<uint32_t>(up - below) : 0u;
  } else {
    __syncthreads();  // sm.thr_bin read
    uint32_t prefix = 0, need = need0, cnt = 0;
    int pbits = 0;
    radix_round(sm, prefix, pbits, need, cnt, [&](int shift, uint32_t nbins) {
#pragma unroll
      for (int e = 0; e < kSampleEpt; ++e) {
        if ((vmask >> e) & 1u) atomicAdd(&sm.hist[(key[e] >> shift) & (nbins - 1)], 1u);
      }
    });
    if (cnt != need) {  // the same in every thread
      radix_round(sm, prefix, pbits, need, cnt, [&](int shift, uint32_t nbins) {
#pragma unroll
        for (int e = 0; e < kSampleEpt; ++e) {
          if (((vmask >> e) & 1u) && (key[e] >> digit_shift(0)) == prefix) {
            atomicAdd(&sm.hist[(key[e] >> shift) & (nbins - 1)], 1u);
          }
        }
      });
    }
    thr = prefix << (32 - pbits);
    if (prof && tid == 0) prof[2] = global_ns();
  }
  if (tid == 0) {
    const uint32_t range = top - thr;
    uint32_t* scratch = p.scratch + lrow * p.scratch_words;
    scratch[0] = thr;
    scratch[1] = range < 1024u ? 0u : static_cast<uint32_t>(32 - __clz(range) - 10);
  }
}

// The sampled path's first kernel: sample_row, a CTA a row.
// p.profile (bench stamps): row 0's in [40, 44): entry, then sample_row's.
__global__ void __launch_bounds__(kThreads) sample_topk_kernel(const GridParams p) {
  pdl_entry();  // see launch_kernel
  __shared__ GSmem sm;
  long long* prof = p.profile != nullptr && blockIdx.x == 0 && threadIdx.x == 0 ? p.profile + 40 : nullptr;
  if (prof) prof[0] = global_ns();
  sample_row(p, static_cast<int>(blockIdx.x), sm, prof ? prof + 1 : nullptr);
}

// The fused path's candidate histogram bin of a key at or above the row's threshold thr (sample_row).
__device__ __forceinline__ uint32_t candidate_bin(uint32_t key, uint32_t thr, uint32_t shift) {
  return min((key - thr) >> shift, static_cast<uint32_t>(kGBins - 1));
}

// Launch row lrow's words of the workspace that are zero between calls: its candidate count, the flag
// that its threshold is written (the fused path), and (the first kGBins words) its candidate histogram.
__device__ __forceinline__ uint32_t* row_count(const GridParams& p, int lrow) {
  return p.ws + lrow * kZeroWords + kGRounds * kGBins + kCand;
}
__device__ __forceinline__ uint32_t* row_ready(const GridParams& p, int lrow) {
  return p.ws + lrow * kZeroWords + kGRounds * kGBins + kDone;
}
// (TROUPE_TOPK_FUSED_FINISH=1) the row's spans its CTAs are done with, and whether its last CTA finished it.
__device__ __forceinline__ uint32_t* row_spans_done(const GridParams& p, int lrow) {
  return p.ws + lrow * kZeroWords + kGRounds * kGBins + kArrive0 + 1;
}
__device__ __forceinline__ uint32_t* row_finished(const GridParams& p, int lrow) {
  return p.ws + lrow * kZeroWords + kGRounds * kGBins + kArrive0 + 2;
}

// Appends the keys at or above thr among a span's scores (those of vmask; scores i0 + elem_offset(e)) to
// launch row lrow's list: one global atomic a warp for the warp's places; places past the list's capacity
// are counted, not written.
__device__ __forceinline__ void append_hits(const GridParams& p, int lrow, int64_t i0, const uint32_t (&key)[kFilterEpt],
                                            uint32_t vmask, uint32_t thr) {
  uint32_t hits = 0;
#pragma unroll
  for (int e = 0; e < kFilterEpt; ++e) hits |= static_cast<uint32_t>(key[e] >= thr) << e;
  hits &= vmask;
  const unsigned lane = threadIdx.x & 31;
  const uint32_t n = __popc(hits), incl = warp_inclusive_sum(n);
  uint32_t base = 0;
  if (lane == 31 && incl != 0) base = atomicAdd(row_count(p, lrow), incl);
  uint32_t pos = __shfl_sync(0xffffffffu, base, 31) + incl - n;
  uint2* list = reinterpret_cast<uint2*>(p.scratch + lrow * p.scratch_words + kListOffset);
#pragma unroll
  for (int e = 0; e < kFilterEpt; ++e) {
    if ((hits >> e) & 1u) {
      if (pos < p.cand_cap) list[pos] = make_uint2(key[e], static_cast<uint32_t>(i0 + elem_offset(e)));
      ++pos;
    }
  }
}

// Appends the keys at or above the row's threshold among the blockIdx.x-th kFilterSpan scores of the
// launch's row blockIdx.y to the row's list (append_hits). p.early_filter: the scores (and the row's
// length) requested before the wait on the sample kernel, which lets this grid launch only after its own
// wait on the scores' producer, so that they are final; only the threshold (the sample kernel's) and the
// list (written after the wait) depend on it. Measured on an H100 (run 51): faster at 8 rows (8 x 1 M
// 32.4 -> 30.4 us, 8 x 262,144 16.3 -> 14.0), slower at 64 (64 x 1 M 113.2 -> 116.7: the early loads slow
// the 64 sample CTAs, the critical path there).
__global__ void __launch_bounds__(kThreads, 3) filter_topk_kernel(const GridParams p) {
  // pdl-prologue: p (with p.early_filter its scores and the row's length, final by then: see above)
  const bool early = p.early_filter;
  const int lrow = static_cast<int>(blockIdx.y), row = p.row0 + lrow;
  const uint32_t* thr_word = p.scratch + lrow * p.scratch_words;
  uint32_t thr = 0;
  if (!early) {
    pdl_entry();  // see launch_kernel
    thr = __ldcg(thr_word);  // requested with the row's length
  }
  const int64_t len = row_length(p, row);
  const int64_t i0 = static_cast<int64_t>(blockIdx.x) * kFilterSpan;
  if (len <= p.k || i0 >= len) return;
  uint32_t key[kFilterEpt];
  const uint32_t vmask = load_keys<kFilterEpt>(p.scores + row * p.row_stride + i0, len - i0, p.vec_ok, key);
  if (early) {
    pdl_entry();
    thr = __ldcg(thr_word);
  }
  append_hits(p, lrow, i0, key, vmask, thr);
}

// Entries b0 + j * kThreads + tid (j < kListBatch) of a row's candidate list of n, requested together (zero
// past n).
__device__ __forceinline__ void load_list_batch(const uint2* list, uint32_t n, uint32_t b0, uint2 (&c)[kListBatch]) {
#pragma unroll
  for (int j = 0; j < kListBatch; ++j) {
    const uint32_t i = b0 + j * kThreads + threadIdx.x;
    c[j] = i < n ? __ldcg(&list[i]) : make_uint2(0u, 0u);
  }
}

// The sampled path's finish of a row whose list holds all n (k <= n <= capacity) of its candidates, from
// their histogram by candidate_bin (h: this thread's bins 4 tid .. 4 tid + 3, counted from the top): the
// k-th's bin, one pass over the candidates (load_batch(b0, c): entries b0 + j * kThreads + tid, as
// load_list_batch) writing those of higher bins to out[0 .. above) and gathering that bin's into ck / ci,
// then the bin's need = k - above largest, ties by lower index, to out[above .. k): by each one's rank among
// them (at most a candidate a thread) or block_select. False, with nothing written, when that bin holds
// more than bucket_cap candidates. Every thread of the block calls it.
template <class LoadBatch>
__device__ __forceinline__ bool finish_from_histogram(const GridParams& p, int row, int lrow, uint32_t n, uint4 h,
                                                      int32_t* out, GSmem& sm, LoadBatch&& load_batch, uint32_t* ck,
                                                      int32_t* ci, uint32_t bucket_cap, long long* prof = nullptr) {
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const uint32_t kk = static_cast<uint32_t>(p.k);
  const uint32_t* scratch = p.scratch + lrow * p.scratch_words;
  const uint32_t thr = __ldcg(scratch), shift = __ldcg(scratch + 1);
  // Candidates in bins from 4 tid up: a suffix sum over the threads (a warp's by shuffles, then the warps').
  const uint32_t mine = h.x + h.y + h.z + h.w;
  uint32_t suffix = mine;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const uint32_t x = __shfl_down_sync(0xffffffffu, suffix, o);
    if (lane + o < 32) suffix += x;
  }
  if (lane == 0) sm.scan[warp] = suffix;
  if (tid == 0) sm.above_ctr = sm.tie_ctr = 0;
  __syncthreads();
  for (int w = warp + 1; w < kThreads / 32; ++w) suffix += sm.scan[w];
  if (suffix >= kk && suffix - mine < kk) {  // the k-th candidate is in one of this thread's bins
    const uint32_t bins[4] = {h.x, h.y, h.z, h.w};
    uint32_t above = suffix - mine;
#pragma unroll
    for (int j = 3; j >= 0; --j) {
      if (above + bins[j] >= kk) {
        sm.thr_bin = 4u * tid + j;
        sm.thr_above = above;
        sm.thr_cnt = bins[j];
        break;
      }
      above += bins[j];
    }
  }
  __syncthreads();
  const uint32_t bin_k = sm.thr_bin, above = sm.thr_above;
  if (prof) prof[0] = global_ns();
  if (sm.thr_cnt > bucket_cap) return false;  // (the same in every thread)
  // Places: a batch's chosen entries as masks, one shared atomic a warp a batch for each kind (a
  // warp_take an entry was two ballots and, in nearly every warp, a returning atomic on one shared word
  // an entry). Measured with the list's cp.async copy (run 53, H100 stamps, list in hand to end): 64 x 1 M
  // 7.4 -> 4.5 us, 8 x 1 M unchanged at ~5.2 (the pass then ~2.6 us for ~6,800 candidates, the rank of
  // ~10 a further 0.8: steps that look like instruction fetches, not arithmetic).
  for (uint32_t b0 = 0; b0 < n; b0 += kListBatch * kThreads) {  // uniform trip count: shuffles below
    uint2 c[kListBatch];
    load_batch(b0, c);
    uint32_t up_mask = 0, at_mask = 0;
#pragma unroll
    for (int j = 0; j < kListBatch; ++j) {
      const bool valid = b0 + j * kThreads + tid < n;
      const uint32_t bin = candidate_bin(c[j].x, thr, shift);
      up_mask |= static_cast<uint32_t>(valid && bin > bin_k) << j;
      at_mask |= static_cast<uint32_t>(valid && bin == bin_k) << j;
    }
    const uint2 places = warp_places(chosen_masks(up_mask, at_mask), &sm.above_ctr, &sm.tie_ctr);
    uint32_t up_place = places.x, at_place = places.y;
#pragma unroll
    for (int j = 0; j < kListBatch; ++j) {
      if ((up_mask >> j) & 1u) out[up_place++] = translate_g(p, row, c[j].y);
      if ((at_mask >> j) & 1u) {
        ck[at_place] = c[j].x;
        ci[at_place] = static_cast<int32_t>(c[j].y);
        ++at_place;
      }
    }
  }
  __syncthreads();
  const uint32_t m = sm.tie_ctr, need = kk - above;
  if (prof) {
    prof[1] = global_ns();
    prof[3] = m;
  }
  if (m <= static_cast<uint32_t>(kThreads)) {
    if (static_cast<uint32_t>(tid) < m) {
      const uint32_t key = ck[tid];
      const int32_t idx = ci[tid];
      uint32_t rank = 0;
      for (uint32_t j = 0; j < m; ++j) {
        const uint32_t kj = ck[j];
        rank += kj > key || (kj == key && ci[j] < idx);
      }
      if (rank < need) out[above + rank] = translate_g(p, row, idx);
    }
  } else {
    block_select(
        ck, m, [](uint32_t) { return true; }, [&](uint32_t i) { return static_cast<uint32_t>(ci[i]); }, 0u, 0, need,
        sm, [&](uint32_t pos, uint32_t i) { out[above + pos] = translate_g(p, row, ci[i]); });
  }
  if (prof) prof[2] = global_ns();
  return true;
}

// ---- the fused sampled path: samples and filter in one persistent grid ------------
// One CTA an SM streams the launch's spans (kFilterSpan scores, row-major) through a ring of kRingStages
// shared-memory stages filled by bulk copies (cp.async.bulk, completion on an mbarrier a stage), so that
// 160 KB an SM are in flight however long the CTA spends on a span. The CTAs of the first rows also sample
// those rows (sample_row) while their first stages load, and publish each row's threshold with a flag;
// a CTA reaching a row's spans waits for that flag. Candidates go to a staging list and a histogram by
// candidate_bin in shared memory, flushed to the row's list and histogram in the workspace when the CTA
// leaves a row (one global atomic a flush), so that the finish finds the k-th candidate's bin from the
// histogram instead of radix rounds over the list.
constexpr int kRingStages = 5;
constexpr int kStagingCap = 2048;  // candidates a CTA stages before they go straight to the row's list

struct FusedSmem {
  float ring[kRingStages][kFilterSpan];
  uint2 staging[kStagingCap];
  uint32_t hist[kGBins];
  uint64_t full[kRingStages];
  uint32_t staged_n, flush_n, flush_base, thr, shift;
  uint32_t row_last;  // arrive: this CTA completed the row's spans
  float thr_f;
  GSmem g;  // sample_row's
};
constexpr int kFusedSmemBytes = static_cast<int>(sizeof(FusedSmem));
static_assert(kGBins == 4 * kThreads, "finish_from_histogram: four bins a thread");

__device__ __forceinline__ uint32_t smem_addr(const void* ptr) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(ptr));
}
__device__ __forceinline__ void mbar_init(uint64_t* bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(bar)), "r"(count) : "memory");
}
// Arrives on the barrier (its one expected arrival) and expects `bytes` of bulk copies to complete on it.
__device__ __forceinline__ void mbar_arrive_expect(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(bar)), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
  asm volatile(
      "{\n"
      ".reg .pred done;\n"
      "WAIT:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT;\n"
      "}\n" ::"r"(smem_addr(bar)),
      "r"(parity)
      : "memory");
}
// `bytes` (a multiple of 16; both addresses 16-byte aligned) from global src to shared dst, completing on bar.
__device__ __forceinline__ void bulk_load(void* dst, const void* src, uint32_t bytes, uint64_t* bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                   smem_addr(dst)),
               "l"(src), "r"(bytes), "r"(smem_addr(bar))
               : "memory");
}
__device__ __forceinline__ uint32_t load_acquire(const uint32_t* ptr) {
  uint32_t v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(ptr) : "memory");
  return v;
}
__device__ __forceinline__ void store_release(uint32_t* ptr, uint32_t v) {
  asm volatile("st.release.gpu.global.u32 [%0], %1;" ::"l"(ptr), "r"(v) : "memory");
}

// The launch's spans from `start` to `end` of this CTA, in proportion to what each CTA has to do: a span
// costs 1 and sampling a row `sample_cost` (CTA c samples rows c, c + gridDim.x, ...: the first rows %
// gridDim.x CTAs one more than the others), so the samplers take fewer spans. A CTA's end is the next
// one's start by the same expression: the ranges tile the spans.
__device__ __forceinline__ int2 fused_range(int items, int rows, float sample_cost) {
  const int G = static_cast<int>(gridDim.x), b = static_cast<int>(blockIdx.x);
  const int q = rows / G, rem = rows % G;
  const float target = (static_cast<float>(items) + static_cast<float>(rows) * sample_cost) / static_cast<float>(G);
  const float hi = fmaxf(0.f, target - static_cast<float>(q + 1) * sample_cost);  // CTAs c < rem
  const float lo = fmaxf(0.f, target - static_cast<float>(q) * sample_cost);
  const float total = static_cast<float>(rem) * hi + static_cast<float>(G - rem) * lo;
  const auto start = [&](int c) {
    if (c >= G) return items;
    if (total <= 0.f) return static_cast<int>(static_cast<int64_t>(items) * c / G);
    const float before = static_cast<float>(min(c, rem)) * hi + static_cast<float>(max(c - rem, 0)) * lo;
    return min(items, static_cast<int>(static_cast<float>(items) * (before / total)));
  };
  return make_int2(start(b), start(b + 1));
}

__global__ void __launch_bounds__(kThreads, 1) fused_filter_topk_kernel(const GridParams p, int spans_per_row,
                                                                        int rows, float sample_cost,
                                                                        bool finish_rows) {
  pdl_entry();  // see launch_kernel (the scores are read below, by bulk copies too)
  extern __shared__ __align__(128) uint8_t fsmem[];
  FusedSmem& fs = *reinterpret_cast<FusedSmem*>(fsmem);
  const int tid = threadIdx.x, lane = tid & 31;
  const int items = spans_per_row * rows;
  // p.profile (bench stamps, %globaltimer ns; bench/gpu/topk_ncu.py stamps): CTA 0's in [0, 16), the last
  // CTA's in [16, 32): entry, ring issued, samples published, first threshold, first stage, last span, end,
  // its spans; its first sample's stamps (sample_row: loaded, threshold, radix rounds); then sums over
  // the CTA: ns at row changes (flush, arrive, the next row's flag), ns in thread 0's stage waits, the last
  // flush and arrive, row changes, candidates staged
  long long* prof = p.profile != nullptr && tid == 0 && (blockIdx.x == 0 || blockIdx.x + 1 == gridDim.x)
                        ? p.profile + (blockIdx.x == 0 ? 0 : 16)
                        : nullptr;
  if (prof) prof[0] = global_ns();
  const int2 range = fused_range(items, rows, sample_cost);
  // Span j: launch row j / spans_per_row, scores from i0; live: the row has more than k scores and some here.
  struct Span {
    int lrow;
    int64_t i0, n;  // n: scores here (0: not live)
  };
  const auto span_of = [&](int j) {
    Span s;
    s.lrow = j / spans_per_row;
    s.i0 = static_cast<int64_t>(j - s.lrow * spans_per_row) * kFilterSpan;
    const int64_t len = row_length(p, p.row0 + s.lrow);
    s.n = len > p.k && s.i0 < len ? min(static_cast<int64_t>(kFilterSpan), len - s.i0) : 0;
    return s;
  };
  // Stage (j - range.x) % kRingStages gets span j: its whole 16-byte groups by one bulk copy (an arrival
  // with no bytes when there are none, so that the stage's phase still completes). Thread 0 only.
  const auto issue = [&](int j) {
    const Span s = span_of(j);
    const int st = (j - range.x) % kRingStages;
    const uint32_t bytes = static_cast<uint32_t>(s.n / 4 * 16);
    mbar_arrive_expect(&fs.full[st], bytes);
    if (bytes != 0) bulk_load(fs.ring[st], p.scores + (p.row0 + s.lrow) * p.row_stride + s.i0, bytes, &fs.full[st]);
  };
  if (tid == 0) {
    for (int st = 0; st < kRingStages; ++st) mbar_init(&fs.full[st], 1);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    fs.staged_n = 0;
  }
  for (int i = tid; i < kGBins; i += kThreads) fs.hist[i] = 0;
  __syncthreads();
  // (Issuing these only once the first row's threshold is known lets the samples' loads return sooner, but
  // measured no faster in all: run 52.)
  if (tid == 0) {
    for (int j = range.x; j < min(range.y, range.x + kRingStages); ++j) issue(j);
  }
  if (prof) prof[1] = global_ns();
  for (int r = static_cast<int>(blockIdx.x); r < rows; r += static_cast<int>(gridDim.x)) {
    // (nothing for rows of at most k scores: the flag all the same)
    sample_row(p, r, fs.g, prof != nullptr && r == static_cast<int>(blockIdx.x) ? prof + 8 : nullptr);
    __syncthreads();         // thread 0's words written
    if (tid == 0) {
      __threadfence();
      store_release(row_ready(p, r), 1u);
    }
  }
  // The CTA's staged candidates and histogram of launch row lrow to the row's list and histogram.
  const auto flush = [&](int lrow) {
    __syncthreads();  // every warp's candidates staged
    if (tid == 0) {
      const uint32_t n = min(fs.staged_n, static_cast<uint32_t>(kStagingCap));
      if (prof) prof[15] += fs.staged_n;
      fs.staged_n = 0;  // (no warp stages again before the barriers below)
      fs.flush_n = n;
      fs.flush_base = n != 0 ? atomicAdd(row_count(p, lrow), n) : 0u;
    }
    uint32_t* ghist = p.ws + lrow * kZeroWords;
    for (int i = tid; i < kGBins; i += kThreads) {
      const uint32_t v = fs.hist[i];
      if (v != 0) {
        atomicAdd(&ghist[i], v);
        fs.hist[i] = 0;
      }
    }
    __syncthreads();
    uint2* list = reinterpret_cast<uint2*>(p.scratch + lrow * p.scratch_words + kListOffset);
    const uint32_t n = fs.flush_n, base = fs.flush_base;
    for (uint32_t i = tid; i < n; i += kThreads) {
      if (base + i < p.cand_cap) list[base + i] = fs.staging[i];
    }
    if (finish_rows) __threadfence();  // (the row's last CTA reads them: arrive)
    __syncthreads();  // the staging read before it is reused
  };
  // (finish_rows: TROUPE_TOPK_FUSED_FINISH=1) after the flush of launch row lrow, this CTA's `spans` of it are
  // done; the CTA that completes the row's spans finishes it (finish_from_histogram, with the staging
  // memory for the k-th bin's candidates), unless that bin holds more than the staging does or the row's
  // count is out of the list's range: then the finish kernel does.
  const auto arrive = [&](int lrow, int spans) {
    if (tid == 0) {
      const uint32_t before = atomicAdd(row_spans_done(p, lrow), static_cast<uint32_t>(spans));
      fs.row_last = before + static_cast<uint32_t>(spans) == static_cast<uint32_t>(spans_per_row);
    }
    __syncthreads();
    if (fs.row_last == 0u) return;  // (the same in every thread)
    __threadfence();
    const int row = p.row0 + lrow;
    const uint32_t n = __ldcg(row_count(p, lrow)), kk = static_cast<uint32_t>(p.k);
    if (row_length(p, row) <= p.k || n < kk || n > p.cand_cap) return;
    uint4* ghist = reinterpret_cast<uint4*>(p.ws + lrow * kZeroWords);
    const uint4 h = __ldcg(ghist + tid);
    uint32_t* ck = reinterpret_cast<uint32_t*>(fs.staging);
    int32_t* ci = reinterpret_cast<int32_t*>(ck + kStagingCap);
    const uint2* list = reinterpret_cast<const uint2*>(p.scratch + lrow * p.scratch_words + kListOffset);
    int32_t* out = p.out_idx + row * p.out_stride;
    const auto load = [&](uint32_t b0, uint2(&c)[kListBatch]) { load_list_batch(list, n, b0, c); };
    if (finish_from_histogram(p, row, lrow, n, h, out, fs.g, load, ck, ci, kStagingCap)) {
      ghist[tid] = make_uint4(0u, 0u, 0u, 0u);
      if (tid == 0) {
        *row_finished(p, lrow) = 1u;
        if (p.out_count != nullptr) p.out_count[row] = p.k;
      }
    }
    __syncthreads();  // the staging memory free again
  };
  if (prof) prof[2] = global_ns();
  int cur = -1, cur_spans = 0;  // the launch row whose threshold fs holds, and this CTA's spans of it
  for (int j = range.x; j < range.y; ++j) {
    const Span s = span_of(j);
    if (s.lrow != cur) {
      const long long t_change = prof ? global_ns() : 0;
      if (cur >= 0) {
        flush(cur);
        if (finish_rows) arrive(cur, cur_spans);
      }
      cur_spans = 0;
      if (tid == 0) {
        const uint32_t* ready = row_ready(p, s.lrow);
        while (load_acquire(ready) == 0u) __nanosleep(64);
        const uint32_t* scratch = p.scratch + s.lrow * p.scratch_words;
        fs.thr = __ldcg(scratch);
        fs.shift = __ldcg(scratch + 1);
        // the float whose key is the threshold (order_key's inverse)
        fs.thr_f = __uint_as_float(fs.thr & 0x80000000u ? fs.thr & 0x7fffffffu : ~fs.thr);
        if (prof && cur < 0) prof[3] = global_ns();
      }
      __syncthreads();
      if (prof && cur >= 0) {
        prof[11] += global_ns() - t_change;
        ++prof[14];
      }
      cur = s.lrow;
    }
    ++cur_spans;
    const int u = j - range.x, st = u % kRingStages;
    const long long t_wait = prof ? global_ns() : 0;
    mbar_wait(&fs.full[st], static_cast<uint32_t>(u / kRingStages) & 1u);
    if (prof) {
      const long long now = global_ns();
      if (u == 0) prof[4] = now;
      prof[12] += now - t_wait;
    }
    float f[kFilterEpt];
#pragma unroll
    for (int q = 0; q < kFilterEpt / 4; ++q) {
      const float4 v = reinterpret_cast<const float4*>(fs.ring[st])[q * kThreads + tid];
      f[4 * q] = v.x;
      f[4 * q + 1] = v.y;
      f[4 * q + 2] = v.z;
      f[4 * q + 3] = v.w;
    }
    const int n = static_cast<int>(s.n);  // (at most kFilterSpan)
    const bool whole = n == kFilterSpan;
    if (!whole) {
#pragma unroll
      for (int e = 0; e < kFilterEpt; ++e) {  // the row's last 1-3 scores past its last 16-byte group
        const int at = elem_offset(e);
        if (at >= (n & ~3) && at < n) f[e] = __ldcg(p.scores + (p.row0 + s.lrow) * p.row_stride + s.i0 + at);
      }
    }
    __syncthreads();  // every thread has read the stage
    if (tid == 0 && j + kRingStages < range.y) issue(j + kRingStages);
    if (n == 0) continue;
    // Most warps hold no candidate: a float comparison that every candidate passes (NaN too, and either
    // zero at a threshold of zero) clears them. In the rest, a thread looks only at its elements that pass
    // it (a branch an element, no key or mask for the others): the key and the exact test, the candidate's
    // histogram bin, its place in the staging list by a shared atomic; places past the list's capacity
    // mark the element in `over`, and those go straight to the row's list after the loop (one global
    // atomic a warp). Against the first form here (keys and a mask for every element, a warp scan for the
    // places) about half the instructions a warp, but the grid's ~2 us a span barely moved (run 52: 8 x 1 M
    // 44.3 -> 41.0 us): what limits it is the feed, not this.
    const float thr_f = fs.thr_f;
    bool maybe = false;
#pragma unroll
    for (int e = 0; e < kFilterEpt; ++e) maybe |= !(f[e] < thr_f);
    if (!__any_sync(0xffffffffu, maybe)) continue;
    const uint32_t thr = fs.thr, shift = fs.shift;
    uint32_t over = 0;
    if (maybe) {
#pragma unroll
      for (int e = 0; e < kFilterEpt; ++e) {
        if (!(f[e] < thr_f) && (whole || elem_offset(e) < n)) {
          const uint32_t key = order_key(f[e]);
          if (key >= thr) {
            atomicAdd(&fs.hist[candidate_bin(key, thr, shift)], 1u);
            const uint32_t pos = atomicAdd(&fs.staged_n, 1u);
            if (pos < static_cast<uint32_t>(kStagingCap)) {
              fs.staging[pos] = make_uint2(key, static_cast<uint32_t>(s.i0 + elem_offset(e)));
            } else {
              over |= 1u << e;
            }
          }
        }
      }
    }
    if (__any_sync(0xffffffffu, over != 0u)) [[unlikely]] {  // the staging list is full
      const uint32_t nh = __popc(over), incl = warp_inclusive_sum(nh);
      uint32_t base = 0;
      if (lane == 31) base = atomicAdd(row_count(p, s.lrow), incl);
      uint32_t pos = __shfl_sync(0xffffffffu, base, 31) + incl - nh;
      uint2* list = reinterpret_cast<uint2*>(p.scratch + s.lrow * p.scratch_words + kListOffset);
#pragma unroll
      for (int e = 0; e < kFilterEpt; ++e) {
        if ((over >> e) & 1u) {
          if (pos < p.cand_cap) list[pos] = make_uint2(order_key(f[e]), static_cast<uint32_t>(s.i0 + elem_offset(e)));
          ++pos;
        }
      }
    }
  }
  if (prof) prof[5] = global_ns();
  if (cur >= 0) {
    flush(cur);
    if (finish_rows) arrive(cur, cur_spans);
  }
  if (prof) {
    prof[6] = global_ns();
    prof[7] = range.y - range.x;
    prof[13] = prof[6] - prof[5];
  }
}

// The finish's fallback: the k largest of a row straight from its scores, ties by lower index (one CTA;
// each pass over the row at one SM's intake): radix rounds until the threshold bucket is taken whole or
// is one value, one pass writing the elements above it (and the bucket's, when taken whole), then the
// lowest indices of that value in index order (ties_in_index_order). Every thread of the block calls it.
__device__ __forceinline__ void select_row_from_scores(const GridParams& p, int row, int64_t len, int32_t* out,
                                                       GSmem& sm) {
  const float* src = p.scores + row * p.row_stride;
  const uint32_t kk = static_cast<uint32_t>(p.k);
  uint32_t prefix = 0, need = kk, cnt = 0;
  int pbits = 0;
#pragma unroll 1
  for (int round = 0; round < kGRounds && cnt != need; ++round) {
    radix_round(sm, prefix, pbits, need, cnt, [&](int shift, uint32_t nbins) {
      for (int64_t b0 = 0; b0 < len; b0 += kFilterSpan) {
        uint32_t key[kFilterEpt];
        const uint32_t vmask = load_keys<kFilterEpt>(src + b0, len - b0, p.vec_ok, key);
        // A run of equal digits takes one shared atomic: massively tied rows, the usual reason to be
        // here, would send every element to one bin's atomic.
        uint32_t run_bin = 0, run = 0;
#pragma unroll
        for (int e = 0; e < kFilterEpt; ++e) {
          if (((vmask >> e) & 1u) && (pbits == 0 || (key[e] >> (32 - pbits)) == prefix)) {
            const uint32_t bin = (key[e] >> shift) & (nbins - 1);
            if (bin != run_bin && run != 0) {
              atomicAdd(&sm.hist[run_bin], run);
              run = 0;
            }
            run_bin = bin;
            ++run;
          }
        }
        if (run != 0) atomicAdd(&sm.hist[run_bin], run);
      }
    });
  }
  const bool take_all = cnt == need;  // else pbits == 32: the bucket is one value
  const uint32_t above_total = kk - need;
  const int drop = 32 - pbits;
  if (threadIdx.x == 0) sm.above_ctr = sm.tie_ctr = 0;
  __syncthreads();
  for (int64_t b0 = 0; b0 < len; b0 += kFilterSpan) {  // uniform trip count: shuffles below
    uint32_t key[kFilterEpt];
    const uint32_t vmask = load_keys<kFilterEpt>(src + b0, len - b0, p.vec_ok, key);
    const Chosen ch = chosen_elements<kFilterEpt>([&](int e) { return key[e]; }, vmask, drop, prefix);
    const uint2 places = warp_places(ch, &sm.above_ctr, &sm.tie_ctr);
    uint32_t a = places.x, t = above_total + places.y;
#pragma unroll
    for (int e = 0; e < kFilterEpt; ++e) {
      if ((ch.above_mask >> e) & 1u) out[a++] = translate_g(p, row, b0 + elem_offset(e));
      if (take_all && ((ch.tie_mask >> e) & 1u)) out[t++] = translate_g(p, row, b0 + elem_offset(e));
    }
  }
  if (take_all) return;
  __syncthreads();  // sm.scan is ties_in_index_order's
  ties_in_index_order(p, row, len, prefix, need, out + above_total, sm);
}

// A row's k: from its list when the filter counted at least k and no more than the list holds (keys and
// indices into shared memory, then block_select), else (a sample that misjudged the row: scores ordered
// against the sample's steps, or many equal to the threshold) select_row_from_scores. Rows of at most k
// scores: all of them. Reads the row's count and zeroes it for the next call. One CTA a row.
__global__ void __launch_bounds__(kThreads, 1) finish_sampled_topk_kernel(const GridParams p) {
  pdl_entry();  // see launch_kernel (the filter has finished: its list and count are visible)
  extern __shared__ __align__(16) uint8_t gsmem[];
  GSmem& sm = *reinterpret_cast<GSmem*>(gsmem);
  uint32_t* ck = reinterpret_cast<uint32_t*>(gsmem + kGKeysOffset);  // [kSampledCap] candidate keys
  int32_t* ci = reinterpret_cast<int32_t*>(ck + kSampledCap);        // and their indices
  const int tid = threadIdx.x, lrow = static_cast<int>(blockIdx.x), row = p.row0 + lrow;
  // p.profile (bench stamps): row 0's in [32, 40): entry, its count read, its candidates in hand, end; then
  // (finish_from_histogram's) the k-th's bin found, the pass done, the bin ranked, and the bin's count.
  long long* prof = p.profile != nullptr && lrow == 0 && tid == 0 ? p.profile + 32 : nullptr;
  if (prof) prof[0] = global_ns();
  if (tid == 0) {
    sm.cand_n = __ldcg(row_count(p, lrow));
    *row_count(p, lrow) = 0;  // ready for the next call
    sm.last = 0;
    if (p.fused) {
      *row_ready(p, lrow) = 0;
      *row_spans_done(p, lrow) = 0;
      sm.last = __ldcg(row_finished(p, lrow));
      *row_finished(p, lrow) = 0;
    }
  }
  __syncthreads();
  if (prof) prof[1] = global_ns();
  if (sm.last != 0u) return;  // finished by the fused filter's last CTA of the row (which zeroed its histogram)
  const int64_t len = row_length(p, row);
  int32_t* out = p.out_idx + row * p.out_stride;
  if (all_chosen(p, row, len, 0, out)) return;  // (the fused filter adds nothing to such rows' histograms)
  const uint32_t n = sm.cand_n, kk = static_cast<uint32_t>(p.k);
  const uint2* list = reinterpret_cast<const uint2*>(p.scratch + lrow * p.scratch_words + kListOffset);
  uint4 h = make_uint4(0u, 0u, 0u, 0u);  // the fused path's histogram: bins 4 tid .. 4 tid + 3, zeroed here
  if (p.fused) {
    uint4* ghist = reinterpret_cast<uint4*>(p.ws + lrow * kZeroWords);
    h = __ldcg(ghist + tid);
    ghist[tid] = make_uint4(0u, 0u, 0u, 0u);
  }
  if (n >= kk && n <= p.cand_cap && p.fused) [[likely]] {
    if (prof) prof[2] = global_ns();
    const auto load = [&](uint32_t b0, uint2(&c)[kListBatch]) { load_list_batch(list, n, b0, c); };
    finish_from_histogram(p, row, lrow, n, h, out, sm, load, ck, ci, kSampledCap);
  } else if (n >= kk && n <= p.cand_cap) [[likely]] {
    // The list into shared memory (cl: its entries as they are, by 16-byte cp.async, one round trip; batches
    // of loads before it, each waited on, took as long: 1.8-2.2 us at 8 x 1 M, runs 52-53), then its histogram by
    // candidate_bin (the fused filter's, built here) from that copy, then finish_from_histogram over it,
    // gathering the k-th's bin past it. Radix rounds over the list (block_select) instead only when that
    // bin does not fit there: their first digit puts most candidates in a few bins (the top 11 bits of keys
    // in a row's tail), whose counts serialize (measured, run 52 on an H100: 8 x 1 M's finish 9.0 -> 5.1 us,
    // 64 x 1 M 7.9 -> 7.4). (The list is 16-byte aligned and holds an even number of entries: the copy's
    // last 16 bytes may hold one entry past n.)
    uint2* cl = reinterpret_cast<uint2*>(ck);  // [n]
    for (uint32_t i = 2u * tid; i < n; i += 2u * kThreads) cp_async16(cl + i, list + i, true);
    cp_async_commit();
    const uint32_t* scratch = p.scratch + lrow * p.scratch_words;
    const uint32_t thr = __ldcg(scratch), shift = __ldcg(scratch + 1);
    for (int i = tid; i < kGBins; i += kThreads) sm.hist[i] = 0;
    cp_async_wait<0>();
    __syncthreads();
    for (uint32_t i = tid; i < n; i += kThreads) atomicAdd(&sm.hist[candidate_bin(cl[i].x, thr, shift)], 1u);
    __syncthreads();
    if (prof) prof[2] = global_ns();
    const uint4 hl = reinterpret_cast<const uint4*>(sm.hist)[tid];  // (read before finish_from_histogram's barrier)
    const auto load = [&](uint32_t b0, uint2(&c)[kListBatch]) {
#pragma unroll
      for (int j = 0; j < kListBatch; ++j) {
        const uint32_t i = b0 + j * kThreads + tid;
        c[j] = i < n ? cl[i] : make_uint2(0u, 0u);
      }
    };
    uint32_t* gk = reinterpret_cast<uint32_t*>(cl + n);  // the k-th's bin: keys, then indices, past the copy
    int32_t* gi = reinterpret_cast<int32_t*>(gk + (kSampledCap - n));
    if (!finish_from_histogram(p, row, lrow, n, hl, out, sm, load, gk, gi, kSampledCap - n,
                               prof ? prof + 4 : nullptr)) [[unlikely]] {
      __syncthreads();  // (finish_from_histogram's reads of sm and cl done)
      for (uint32_t i = tid; i < n; i += kThreads) {  // keys and indices apart, from the list again
        const uint2 e = __ldcg(&list[i]);
        ck[i] = e.x;
        ci[i] = static_cast<int32_t>(e.y);
      }
      __syncthreads();
      block_select(
          ck, n, [](uint32_t) { return true; }, [&](uint32_t i) { return static_cast<uint32_t>(ci[i]); }, 0u, 0, kk,
          sm, [&](uint32_t pos, uint32_t i) { out[pos] = translate_g(p, row, ci[i]); });
    }
  } else [[unlikely]] {
    select_row_from_scores(p, row, len, out, sm);
  }
  if (p.out_count != nullptr && tid == 0) p.out_count[row] = p.k;
  if (prof) prof[3] = global_ns();
}

template <int EPT>
constexpr int grid_smem_bytes() {
  return kGKeysOffset + kThreads * EPT * 4;
}

template <int EPT, int BLOCKS = 2>
int grid_capacity() {  // CTAs of grid_topk_kernel<EPT, BLOCKS> the device holds at once
  static std::once_flag once;
  static int cap = 0;
  std::call_once(once, [] {
    TROUPE_CUDA(cudaFuncSetAttribute(grid_topk_kernel<EPT, BLOCKS>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                     grid_smem_bytes<EPT>()));
    if constexpr (EPT == 32 && BLOCKS == 2) {  // the streamed kernel's chunks are the large ones
      TROUPE_CUDA(cudaFuncSetAttribute(stream_topk_kernel<EPT>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       grid_smem_bytes<EPT>()));
    }
    if constexpr (BLOCKS == 2) {
      TROUPE_CUDA(cudaFuncSetAttribute(one_chunk_topk_kernel<EPT>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       grid_smem_bytes<EPT>()));
    }
    int per = 0;
    TROUPE_CUDA(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per, grid_topk_kernel<EPT, BLOCKS>, kThreads,
                                                              grid_smem_bytes<EPT>()));
    cap = per * sm_count();
  });
  return cap;
}

// The streamed kernel's candidate list of a row: 65,536 entries at most (rows of 1 M
// scores with k = 2,048 kept 13-16 K on the H200), the whole row when shorter.
int64_t stream_cand_cap(int64_t max_len) { return std::min<int64_t>(ceil_div(max_len, 4) * 4, 65536); }

// Scratch words a row of a launch needs: the grid kernel's gathered candidates (keys
// and indices, kGatherMax of each), or the streamed kernel's list and gathered bucket.
int64_t scratch_words(bool stream, int64_t max_len) {
  return stream ? 2 * stream_cand_cap(max_len) + 2 * kThreads * kLargeEPT : 2 * static_cast<int64_t>(kGatherMax);
}

// TopkArgs::stream, or TROUPE_TOPK_STREAM (read at each call) when it is 0.
int topk_stream(const TopkArgs& a) {
  return a.stream != 0 ? a.stream : env_switch("TROUPE_TOPK_STREAM");
}

// Small chunks for the least latency when every chunk of the call fits on the device
// at once; else large chunks (fewer, fuller CTAs share each row's barriers), handed out
// by tickets when they are more than the device holds at once. The streamed kernel (no
// CTA waits for another) when the call asks for it.
struct GridPlan {
  bool ok = false;  // false: the cluster kernel
  bool stream = false;
  int ept = 0;
  int cpr = 0;
  int rows_per_launch = 0;
  bool ticketed = false;
  int blocks = 2;  // large chunks: grid_topk_kernel's CTAs an SM
  int64_t scratch_words = 0;  // 0: no workspace (one chunk a row)
};

// The most small chunks a row takes (more: large chunks, a quarter as many CTAs at the row's barriers).
// Measured on an H200 (session 25): rows of 65-128 small chunks are faster on them than on 17-32 large ones
// (1 x 262,145 11.9 -> 8.0 us, 1 x 524,288 8.9 -> 8.1, 2 x 262,145 13.2 -> 8.5); at 64 until then, a step
// that put the engine's 1M-context rows (262,144 + a few) on large chunks.
constexpr int64_t kSmallChunksMax = 128;

GridPlan make_grid_plan(int rows, int64_t max_len, int stream) {
  GridPlan g;
  const int64_t c8 = ceil_div(max_len, kThreads * kSmallEPT), c32 = ceil_div(max_len, kThreads * kLargeEPT);
  const int cap8 = grid_capacity<kSmallEPT>(), cap32 = grid_capacity<kLargeEPT>();
  // Rows of at most one large chunk (4,096 < max_len <= 16,384) take it: one CTA a row selects
  // without a row barrier (select_one_chunk), where small chunks would meet at one.
  // Rows over kSmallChunksMax small chunks (524,288 scores) take large chunks too (measured on an H200,
  // run 21: 1 x 1 M 12.2 -> 11.9 us, the longer load paid back by a 64-CTA row barrier instead of 256).
  if (stream != 1 && (c8 == 1 || c32 > 1) && c8 <= kSmallChunksMax && static_cast<int64_t>(rows) * c8 <= cap8) {
    g.ept = kSmallEPT;
    g.cpr = static_cast<int>(c8);
  } else if (stream == 1 || c32 == 1 || 2 * c32 <= cap32) {
    g.ept = kLargeEPT;
    g.cpr = static_cast<int>(c32);
    const int64_t launch_chunks = static_cast<int64_t>(std::min(rows, kLaunchRows)) * c32;
    // More than three waves of two CTAs an SM: three an SM (measured on an H200, session 23: 64 x
    // 262,144 (3.9 waves) 44.3 -> 43.2 us, 64 x 1 M (15.5) 158 -> 139; but 8 x 1 M (1.9) 27.2 -> 29.1).
    int cap = cap32;
    if (c32 > 1 && launch_chunks > 3 * static_cast<int64_t>(cap32) && grid_capacity<kLargeEPT, 3>() > cap32) {
      g.blocks = 3;
      cap = grid_capacity<kLargeEPT, 3>();
    }
    g.ticketed = c32 > 1 && launch_chunks > cap;
    // Streamed only when asked: since round 0's places come from its histogram adds (no
    // global atomic after the row barrier) the grid kernel is the faster at every wave count
    // measured on an H200 (run 21: 64 rows of 262,144, 3.9 waves, 46.0 vs 50.4 us; 64 rows
    // of 1 M, 15.5 waves, 162.8 vs 166.3; session 10 had the streamed one ahead above three).
    g.stream = stream == 1;
    if (g.stream) g.ticketed = false;
  } else {
    return g;  // rows too long for the grid kernel: the cluster kernel
  }
  g.ok = true;
  g.rows_per_launch = g.cpr == 1 ? rows : std::min(rows, kLaunchRows);
  g.scratch_words = g.cpr > 1 ? scratch_words(g.stream, max_len) : 0;
  return g;
}

// Enough for a call of any number of rows up to `rows` with this max_len or less, on
// any path: 256 bytes of tickets, the zeroed rows of one launch, then its scratch (as
// large as the grid kernel's, the streamed kernel's or the sampled path's needs).
size_t grid_workspace_bytes(int rows, int64_t max_len) {
  if (ceil_div(max_len, kThreads * kSmallEPT) <= 1) return 0;
  const int64_t per = std::max({scratch_words(true, max_len), scratch_words(false, max_len), kSampledScratchWords});
  return 256 + (static_cast<size_t>(kLaunchRows) * kZeroWords + std::min(rows, kLaunchRows) * per) * 4;
}

// TopkArgs::finish, or TROUPE_TOPK_FINISH (read at each call) when it is 0; 2 by default.
int topk_finish(const TopkArgs& a) {
  if (a.finish != 0) return a.finish;
  const char* e = std::getenv("TROUPE_TOPK_FINISH");
  return e != nullptr && e[0] == '1' ? 1 : 2;
}

// The call's fields every kernel's parameters share (Params, GridParams), from the arguments.
template <class P>
void set_call(const TopkArgs& a, P& p) {
  p.scores = a.scores;
  p.row_stride = a.row_stride;
  p.lengths = a.lengths;
  p.max_len = a.max_len;
  p.k = a.k;
  p.out_idx = a.out_idx;
  p.out_stride = a.out_stride;
  p.out_count = a.out_count;
  p.page_table = a.page_table;
  p.page_stride = a.page_stride;
  p.page_bits = a.page_bits;
  p.vec_ok = (reinterpret_cast<uintptr_t>(a.scores) % 16 == 0) && (a.row_stride % 4 == 0);
  p.profile = a.profile;
}

void launch_grid_topk(const TopkArgs& a, const GridPlan& g, void* workspace, cudaStream_t stream) {
  GridParams p{};
  set_call(a, p);
  p.cpr = g.cpr;
  p.ticketed = g.ticketed;
  p.counted_finish = topk_finish(a) == 2;
  if (g.scratch_words > 0) {
    TROUPE_REQUIRE(workspace != nullptr, "top-k: this row length needs a workspace");
    p.tickets = static_cast<uint32_t*>(workspace);  // the first 256 bytes
    p.ws = p.tickets + 64;
    p.scratch = p.ws + static_cast<int64_t>(kLaunchRows) * kZeroWords;
    p.scratch_words = g.scratch_words;
    p.cand_cap = stream_cand_cap(a.max_len);
  }
  for (int r0 = 0; r0 < a.rows; r0 += g.rows_per_launch) {
    p.row0 = r0;
    const int rows = std::min(g.rows_per_launch, a.rows - r0);
    const size_t smem =
        static_cast<size_t>(g.ept == kSmallEPT ? grid_smem_bytes<kSmallEPT>() : grid_smem_bytes<kLargeEPT>());
    const dim3 grid(static_cast<unsigned>(static_cast<int64_t>(rows) * g.cpr), 1, 1);
    if (g.stream) {  // large chunks
      launch_kernel(stream_topk_kernel<kLargeEPT>, grid, kThreads, smem, stream, p);
    } else if (g.cpr == 1) {
      if (g.ept == kSmallEPT) {
        launch_kernel(one_chunk_topk_kernel<kSmallEPT>, grid, kThreads, smem, stream, p);
      } else {
        launch_kernel(one_chunk_topk_kernel<kLargeEPT>, grid, kThreads, smem, stream, p);
      }
    } else if (g.ept == kSmallEPT) {
      launch_kernel(grid_topk_kernel<kSmallEPT, 2>, grid, kThreads, smem, stream, p);
    } else if (g.blocks == 3) {
      launch_kernel(grid_topk_kernel<kLargeEPT, 3>, grid, kThreads, smem, stream, p);
    } else {
      launch_kernel(grid_topk_kernel<kLargeEPT, 2>, grid, kThreads, smem, stream, p);
    }
  }
}

// The sample's runs of contiguous scores: 2^kSampleRunBits each (32 runs of 256 scores, 1 KB each). Measured
// on an H200 (run 53, same run, sampled calls): runs of 8 (a 32-byte sector each) -> 256 / 1,024: 64 x 262,144
// 30.56 -> 29.53 / 29.58 us, 64 x 1 M 98.05 -> 96.60 / 96.36, 8 x 262,144 11.93 -> 11.31 / 11.33, 1 x 1 M
// 15.40 -> 14.27 / 14.31; 256 kept (32 runs over the row, not 8: less exposed to scores that vary by place).
constexpr int kSampleRunBits = 8;

// The sampled path's filter requests its scores before it waits for the rows' thresholds in launches of
// at most this many rows (filter_topk_kernel; run 51 on an H100: 8 rows faster, 64 slower).
constexpr int kEarlyFilterRows = 8;

// The sampled path's rule: calls the grid kernel would run over rows of several chunks (not the
// cluster kernel, not rows of one chunk, not the streamed kernel when that is asked for) of at least
// kSampledMinRows rows, the longest at least kSampledMinLen scores. By default it takes those of at
// least kSampledAutoRows rows and kSampledAutoScores scores in all (rows x longest): where the grid
// kernel needs more than about one wave of its CTAs. Measured on an H100 (session 36, run 36), grid
// against sampled: 24 / 32 / 48 / 64 x 262,144 25.2 / 28.6 / 38.6 / 46.1 -> 22.4 / 25.5 / 31.0 / 36.5 us,
// 64 x 131,072 28.8 -> 25.6, 16 x 524,288 27.8 -> 25.9, 16 / 64 x 1 M 49.5 / 148 -> 44.2 / 113; but
// 16 x 262,144 15.2 against 19.9, 8 x 1 M 30.6 against 32.4, 8 x 2 M 46.7 against 47.1, 64 x 65,536 16.1
// against 20.2 (the sample and the finish are latency around a short read). Since the sample's distance
// histogram and the histogram finish (session 52, runs 52 calls 3 and 4, H100): 8 x 1 M 30.3 / 30.2 against
// 29.7 / 29.5, so from 8 rows (8 x 262,144, 2 M scores in all, stays on the grid kernel: 11.2 against 15.3).
constexpr int kSampledMinRows = 1;
constexpr int64_t kSampledMinLen = 65536;
constexpr int kSampledAutoRows = 8;
constexpr int64_t kSampledAutoScores = 6 << 20;

// TopkArgs::sampled, or TROUPE_TOPK_SAMPLED (read at each call) when it is 0: 1 = wherever the path
// applies, -1 (or the variable 0) = never; else the measured rule above.
bool topk_sampled(const TopkArgs& a) {
  const int ask = a.sampled != 0 ? a.sampled : env_switch("TROUPE_TOPK_SAMPLED");
  if (ask != 0) return ask == 1;
  return a.rows >= kSampledAutoRows && static_cast<double>(a.rows) * static_cast<double>(a.max_len) >=
                                           static_cast<double>(kSampledAutoScores);
}

bool takes_sampled(const TopkArgs& a, const GridPlan& g) {
  return g.ok && !g.stream && g.cpr > 1 && a.rows >= kSampledMinRows && a.max_len >= kSampledMinLen &&
         topk_sampled(a);
}

// TROUPE_TOPK_FUSED=1 (read at each call): the fused filter (fused_filter_topk_kernel) instead of the sample
// and filter kernels, for 16-byte aligned rows. Off by default: exact, but slower than the three kernels at
// every shape measured (runs 51-52: its grid streams at ~2.1 TB/s; see docs/kernels-notes.md).
bool topk_fused(const GridParams& p) { return p.vec_ok && env_switch("TROUPE_TOPK_FUSED") == 1; }

// What a row's sample costs the fused filter's CTA that takes it, in spans (fused_range):
// TROUPE_TOPK_SAMPLE_COST (read at each call), else 3.
float fused_sample_cost() {
  const char* e = std::getenv("TROUPE_TOPK_SAMPLE_COST");
  const float v = e != nullptr ? std::strtof(e, nullptr) : 3.f;
  return v >= 0.f && v < 1e6f ? v : 3.f;
}

// The sampled path for each kLaunchRows rows (the launch rows' counters and scratch in the grid kernel's
// workspace layout): the fused filter (samples and filter in one persistent grid, one CTA an SM) or the
// sample and filter kernels, then the finish.
void launch_sampled_topk(const TopkArgs& a, void* workspace, cudaStream_t stream) {
  TROUPE_REQUIRE(workspace != nullptr, "top-k: this row length needs a workspace");
  static const int fused_cap = [] {
    TROUPE_CUDA(cudaFuncSetAttribute(finish_sampled_topk_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                     kFinishSmemBytes));
    TROUPE_CUDA(cudaFuncSetAttribute(fused_filter_topk_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                     kFusedSmemBytes));
    int per = 0;
    TROUPE_CUDA(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per, fused_filter_topk_kernel, kThreads,
                                                              kFusedSmemBytes));
    return per * sm_count();
  }();
  GridParams p{};
  set_call(a, p);
  p.ws = static_cast<uint32_t*>(workspace) + 64;  // after the 256 bytes of tickets
  p.scratch = p.ws + static_cast<int64_t>(kLaunchRows) * kZeroWords;
  p.scratch_words = kSampledScratchWords;
  p.cand_cap = kSampledCap;
  p.fused = topk_fused(p) && fused_cap > 0;  // (its grid: at most what the device holds at once)
  // TROUPE_TOPK_SAMPLE_RUN=N (read at each call): the sample's runs of N contiguous scores (a power of two,
  // 8..1024); kSampleRunBits otherwise.
  p.sample_run_bits = kSampleRunBits;
  if (const char* e = std::getenv("TROUPE_TOPK_SAMPLE_RUN"); e != nullptr) {
    const int n = std::atoi(e);
    for (int b = 3; b <= 10; ++b) {
      if (n == 1 << b) p.sample_run_bits = b;
    }
  }
  // The filter's scores requested before its wait on the sample kernel: for launches of at most
  // kEarlyFilterRows rows (TROUPE_TOPK_EARLY_FILTER=1 / 0, read at each call: always / never).
  const int early = env_switch("TROUPE_TOPK_EARLY_FILTER");
  const float sample_cost = fused_sample_cost();
  // TROUPE_TOPK_FUSED_FINISH=1 (read at each call): rows finished in the fused grid by their last CTA.
  const bool finish_rows = env_switch("TROUPE_TOPK_FUSED_FINISH") == 1;
  const unsigned spans = static_cast<unsigned>(ceil_div(a.max_len, kFilterSpan));
  for (int r0 = 0; r0 < a.rows; r0 += kLaunchRows) {
    p.row0 = r0;
    const unsigned rows = static_cast<unsigned>(std::min(kLaunchRows, a.rows - r0));
    p.early_filter = early != 0 ? early == 1 : rows <= static_cast<unsigned>(kEarlyFilterRows);
    if (p.fused) {
      const int items = static_cast<int>(spans * rows);
      const int grid = std::min(fused_cap, std::max(items, static_cast<int>(rows)));
      launch_kernel(fused_filter_topk_kernel, dim3(static_cast<unsigned>(grid), 1, 1), kThreads,
                    static_cast<size_t>(kFusedSmemBytes), stream, p, static_cast<int>(spans), static_cast<int>(rows),
                    sample_cost, finish_rows);
    } else {
      launch_kernel(sample_topk_kernel, dim3(rows, 1, 1), kThreads, 0, stream, p);
      launch_kernel(filter_topk_kernel, dim3(spans, rows, 1), kThreads, 0, stream, p);
    }
    launch_kernel(finish_sampled_topk_kernel, dim3(rows, 1, 1), kThreads, kFinishSmemBytes, stream, p);
  }
}

}  // namespace

// TROUPE_TOPK_CLUSTER=N (1..16, power of two): calls that leave max_cluster at 0 use the
// cluster kernel with clusters of N CTAs instead of the grid kernel (an A/B switch).
int default_cluster() {
  static const int n = [] {
    const char* e = std::getenv("TROUPE_TOPK_CLUSTER");
    const int v = e != nullptr ? std::atoi(e) : 0;
    return v >= 1 && v <= 16 && (v & (v - 1)) == 0 ? v : 0;
  }();
  return n;
}

size_t topk_workspace_bytes(int rows, int64_t max_len, int k, int max_cluster) {
  if (max_cluster == 0) max_cluster = default_cluster();
  if (max_cluster == 0 && rows > 0) {
    const GridPlan g = make_grid_plan(rows, std::max<int64_t>(max_len, 1), 0);
    if (g.ok) return grid_workspace_bytes(rows, std::max<int64_t>(max_len, 1));
  }
  // Rows too long for the grid kernel: the cluster kernel's candidates, or (TopkArgs::stream) the streamed one's.
  const size_t streamed = max_cluster == 0 ? grid_workspace_bytes(rows, std::max<int64_t>(max_len, 1)) : 0;
  const Plan plan = make_plan(max_len, k, max_cluster);
  if (plan.segments == 1) return streamed;
  const size_t per = static_cast<size_t>(plan.segments) * k;
  return std::max(streamed, static_cast<size_t>(rows) * (per * 8 + plan.segments * 4 + 4) + 256);
}

void topk_workspace_init(void* workspace, size_t bytes, cudaStream_t stream) {
  if (bytes > 0) TROUPE_CUDA(cudaMemsetAsync(workspace, 0, bytes, stream));
}

void topk(const TopkArgs& args, void* workspace, cudaStream_t stream) {
  TopkArgs a = args;
  if (a.max_cluster == 0) a.max_cluster = default_cluster();
  TROUPE_REQUIRE(a.k >= 1 && a.k <= kMaxK, "top-k: k must be in 1..2048");
  TROUPE_REQUIRE(a.out_stride >= a.k, "top-k: out_stride < k");
  TROUPE_REQUIRE(a.rows <= 65535, "top-k: at most 65535 rows per call");
  TROUPE_REQUIRE(a.max_len <= INT32_MAX, "top-k: rows longer than 2^31");
  if (a.rows == 0) return;
  if (a.max_cluster == 0) {
    const GridPlan g = make_grid_plan(a.rows, std::max<int64_t>(a.max_len, 1), topk_stream(a));
    if (takes_sampled(a, g)) {
      launch_sampled_topk(a, workspace, stream);
      return;
    }
    if (g.ok) {
      launch_grid_topk(a, g, workspace, stream);
      return;
    }
  }
  const Plan plan = make_plan(std::max<int64_t>(a.max_len, 1), a.k, a.max_cluster);
  Params p{};
  set_call(a, p);
  p.segments = plan.segments;
  p.seg_cap = plan.seg_cap;
  if (plan.segments > 1) {
    TROUPE_REQUIRE(workspace != nullptr, "top-k: this row length needs a workspace");
    const size_t per = static_cast<size_t>(plan.segments) * a.k;
    auto* base = static_cast<char*>(workspace);
    p.cand_key = reinterpret_cast<uint32_t*>(base);
    p.cand_idx = reinterpret_cast<int32_t*>(base + a.rows * per * 4);
    p.cand_cnt = reinterpret_cast<int32_t*>(base + a.rows * per * 8);
    p.arrivals = reinterpret_cast<uint32_t*>(base + a.rows * per * 8 + static_cast<size_t>(a.rows) * plan.segments * 4);
  }
  set_kernel_attributes();
  cudaLaunchAttribute cluster{};
  cluster.id = cudaLaunchAttributeClusterDimension;
  cluster.val.clusterDim.x = static_cast<unsigned>(plan.cluster);
  cluster.val.clusterDim.y = 1;
  cluster.val.clusterDim.z = 1;
  launch_kernel_ex(topk_kernel,
                   dim3(static_cast<unsigned>(plan.segments * plan.cluster), static_cast<unsigned>(a.rows), 1),
                   kThreads, kSmemBytes, stream, &cluster, 1, p);
}

// ---- ascending order of chosen indices (the backend's contract) -----------------
namespace {
constexpr int kSortThreads = 256;

// A CTA a row: its first min(count, k) indices (each in [0, 2^bits)) sorted ascending, ITEMS a thread
// (k <= 256 * ITEMS), by radix passes over the low `bits` bits only. Run 50 (H100, ncu): 2,048 items
// over all 32 bits took 7.8 us a call at k = 512 and rows of 128.
template <int ITEMS>
__global__ void __launch_bounds__(kSortThreads) sort_rows_kernel(int32_t* idx, int64_t stride, const int32_t* count,
                                                                  int k, int bits) {
  pdl_entry();  // see launch_kernel
  using Sort = cub::BlockRadixSort<uint32_t, kSortThreads, ITEMS>;
  __shared__ typename Sort::TempStorage temp;
  int32_t* row = idx + blockIdx.x * stride;
  const int n = count != nullptr ? min(count[blockIdx.x], k) : k;
  uint32_t keys[ITEMS];
#pragma unroll
  for (int j = 0; j < ITEMS; ++j) {
    const int i = threadIdx.x * ITEMS + j;
    keys[j] = i < n ? static_cast<uint32_t>(row[i]) : (bits < 32 ? (1u << bits) - 1u : 0xffffffffu);
  }
  Sort(temp).Sort(keys, 0, bits);
#pragma unroll
  for (int j = 0; j < ITEMS; ++j) {
    const int i = threadIdx.x * ITEMS + j;
    if (i < n) row[i] = static_cast<int32_t>(keys[j]);
  }
}
}  // namespace

void sort_rows_ascending(int32_t* idx, int64_t stride, const int32_t* count, int rows, int k, int64_t bound,
                         cudaStream_t stream) {
  TROUPE_REQUIRE(k <= kSortThreads * 8, "sort_rows_ascending: k > 2048");
  TROUPE_REQUIRE(bound >= 0 && bound <= (int64_t{1} << 31), "sort_rows_ascending: bound out of range");
  if (rows == 0) return;
  // Padding (past a row's count) sorts last: the largest value of the bits, at or above every index.
  int bits = 1;
  while (bits < 32 && (int64_t{1} << bits) < bound) ++bits;
  const unsigned grid = static_cast<unsigned>(rows);
  if (k <= kSortThreads) {
    launch_kernel(sort_rows_kernel<1>, grid, kSortThreads, 0, stream, idx, stride, count, k, bits);
  } else if (k <= 2 * kSortThreads) {
    launch_kernel(sort_rows_kernel<2>, grid, kSortThreads, 0, stream, idx, stride, count, k, bits);
  } else if (k <= 4 * kSortThreads) {
    launch_kernel(sort_rows_kernel<4>, grid, kSortThreads, 0, stream, idx, stride, count, k, bits);
  } else {
    launch_kernel(sort_rows_kernel<8>, grid, kSortThreads, 0, stream, idx, stride, count, k, bits);
  }
  TROUPE_LAUNCHED();
}

}  // namespace troupe::kernels::cuda
