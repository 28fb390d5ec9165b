// Exact top-k over fp32 score rows on the GPU (one read of the scores).
//
// Both kernels select by radix histograms of an order-preserving 32-bit key
// (11 + 11 + 10 bits, stopping as soon as the threshold bucket is taken whole);
// elements above the threshold are written directly. Ties at the k-th value: every
// kernel settles them as a stable sort does (lower index first, -0 equal to +0, the
// CPU backend's rule), so the set is deterministic and equals the CPU's (the cluster
// kernel by radix rounds over the tied elements' indices, since session 40). Both are
// launched as programmatic dependents of the
// previous kernel on the stream (PDL), so the launch overlaps the producer's tail.
//
// Grid kernel (the default): every SM. Each CTA keeps a chunk of 4,096 (or, for
// many rows, 16,384) scores of one row in shared memory; the CTAs of a row add
// their histograms in the workspace with global atomics and meet at a per-row
// arrival counter, the threshold bucket's elements are gathered and the row's
// last CTA finishes them. Used while a row needs at most half the CTAs the device
// holds at once (rows up to ~3 M scores on an H200). Rows of one chunk (at most
// 16,384 scores) take a kernel of their own, one CTA a row selecting alone.
//
// Streamed kernel (the grid kernel's large chunks, when a call has more than three
// times as many as the device holds at once, e.g. 64 rows of 262,144): no CTA waits
// for another. Each adds
// its histogram to the row's with atomics that return the sums so far and writes the
// elements at or above that partial histogram's threshold bucket (never above the
// row's) to the row's candidate list; the row's last CTA selects among them. Ties as
// the grid kernel settles them.
//
// Sampled path (TopkArgs::sampled; off by default, compiled but not yet measured): for calls of many
// long rows, where the grid kernel's CTAs wait at their rows' barriers while its later waves cannot
// start. Three kernels: one CTA a row takes a threshold from a sample of 8,192 of its scores (about
// twice k of the row above it, with a margin); a filter reads every score once, with no CTA waiting
// for another, and appends those at or above their row's threshold to the row's candidate list
// (16,384 at most); one CTA a row selects among the candidates, ties as the grid kernel settles them,
// or, when the sample misjudged the row (fewer than k or more than the list holds: scores laid out
// against the sample's steps, many equal values), from the row's scores in that CTA (exact, slow).
//
// Cluster kernel (max_cluster != 0, or longer rows): each row (or segment of a
// long row) is owned by one thread-block cluster whose CTAs reduce their
// histograms through distributed shared memory; rows longer than one cluster's
// capacity are split into segments whose candidates the last-arriving cluster
// merges (no grid-wide barrier, no second launch).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace troupe::kernels::cuda {

struct TopkArgs {
  const float* scores = nullptr;    // [rows, row_stride]
  int64_t row_stride = 0;           // floats between rows
  const int32_t* lengths = nullptr; // device [rows]; null: every row has max_len candidates
  int rows = 0;
  int64_t max_len = 0;              // upper bound of every row's length
  int k = 0;                        // 1 .. 2048
  int32_t* out_idx = nullptr;       // [rows, out_stride]; slots past min(k, len) get -1; unordered
  int64_t out_stride = 0;
  int32_t* out_count = nullptr;     // optional [rows]: min(k, len)
  // Optional page translation fused into the store:
  //   out = page_table[row * page_stride + (i >> page_bits)] << page_bits | (i & (2^page_bits - 1))
  const int32_t* page_table = nullptr;
  int64_t page_stride = 0;
  int page_bits = 0;
  int max_cluster = 0;              // 0: the grid kernel (cluster kernel for longer rows, or the cluster size
                                    // in TROUPE_TOPK_CLUSTER); else the cluster kernel with clusters of 1..16
                                    // CTAs (power of two)
  long long* profile = nullptr;     // debugging aid: phase-end stamps of row 0 (cluster kernel: 12 SM clocks;
                                    // grid and streamed kernels: 11 %globaltimer ns values, see
                                    // bench/gpu/bench.py; the streamed kernel then the row's candidates,
                                    // whether they overflowed, and two stamps of its list pass: 15 values;
                                    // the sampled path: 48, see bench/gpu/topk_ncu.py stamps)
  int finish = 0;                   // the grid kernel's last step over a row's gathered bucket: 1 = radix rounds
                                    // in the row's last CTA; 2 = every CTA also counts the bucket's next digit,
                                    // the last CTA takes the threshold from that count and ranks the few on it;
                                    // 0 = TROUPE_TOPK_FINISH (2 unless it is 1). Both exact, ties by lower index
  int stream = 0;                   // the streamed kernel: 1 = whenever the grid kernel would run; -1 = never;
                                    // 0 = TROUPE_TOPK_STREAM (1 / 0), else never (the grid kernel measured
                                    // faster at every wave count since run 21)
  int sampled = 0;                  // the sampled path: 1 = where it applies (rows of which the longest is
                                    // at least 65,536 scores, where the grid kernel would run over rows of
                                    // several chunks; a streamed call stays streamed); -1 = never;
                                    // 0 = TROUPE_TOPK_SAMPLED (read at each call: 1 = on, 0 = never), else
                                    // calls of at least 8 rows and 6 M scores (rows x longest) where it
                                    // applies (measured faster there, topk.cu)
};

// Scratch the call needs (enough for any call with at most `rows` rows and this
// max_len; may be 0). The workspace must be zeroed once after allocation
// (topk_workspace_init); grid, streamed and sampled calls of any shape within those bounds may
// share it (each leaves the part that must be zero zeroed; the cluster kernel's layout
// is its own). One call at a time per workspace.
size_t topk_workspace_bytes(int rows, int64_t max_len, int k, int max_cluster = 0);
void topk_workspace_init(void* workspace, size_t bytes, cudaStream_t stream);
void topk(const TopkArgs& args, void* workspace, cudaStream_t stream);

// Sorts the first min(count[r], k) (or k when count is null) indices of each row ascending, in place;
// every one of them in [0, bound) (radix passes over the bits below bound only).
void sort_rows_ascending(int32_t* idx, int64_t stride, const int32_t* count, int rows, int k, int64_t bound,
                         cudaStream_t stream);

}  // namespace troupe::kernels::cuda
