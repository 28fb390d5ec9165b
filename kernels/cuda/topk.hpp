// Exact top-k over fp32 score rows on the GPU (one read of the scores).
//
// Each row (or segment of a long row) is owned by one thread-block cluster; the
// CTAs keep their slice in registers, build radix histograms of an
// order-preserving 32-bit key (11 + 11 + 10 bits, stopping as soon as the
// threshold bucket is taken whole) and reduce them across the cluster through
// distributed shared memory. Elements above the threshold are written
// directly; ties at the k-th value are settled exactly (any k of the tied
// elements, so the set equals a sort-based reference up to ties). Rows longer
// than one cluster's capacity are split into segments whose candidates the
// last-arriving cluster merges (no grid-wide barrier, no second launch). The
// kernel is launched as a programmatic dependent of the previous kernel on the
// stream (PDL), so its launch overlaps the tail of the scores' producer.
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
  int max_cluster = 0;              // 0: the largest the device allows (16 or 8); else 1..16, power of two
  long long* profile = nullptr;     // debugging aid: 12 SM-clock stamps of row 0's first CTA at phase ends
};

// Scratch the call needs (0 when every row fits one cluster). The workspace must be
// zeroed once after allocation (topk_workspace_init); calls leave it zeroed.
size_t topk_workspace_bytes(int rows, int64_t max_len, int k, int max_cluster = 0);
void topk_workspace_init(void* workspace, size_t bytes, cudaStream_t stream);
void topk(const TopkArgs& args, void* workspace, cudaStream_t stream);

// Sorts the first count[r] (or k when count is null) indices of each row ascending, in place.
void sort_rows_ascending(int32_t* idx, int64_t stride, const int32_t* count, int rows, int k, cudaStream_t stream);

}  // namespace troupe::kernels::cuda
