// The fused V4 compressor: bias + per-channel softmax over a window's slots +
// weighted sum + rmsnorm + RoPE in one pass over kv and score (5 memory passes
// of the plain composition become 2: read kv+score once, write the entry).
//
// CSA (overlap): kv/score rows are 2*dim wide (halves a, b); entry i pools the
// previous window's tokens through half a and window i's tokens through half b
// (for i = 0 the previous half is empty). HCA: rows are dim wide, entry i pools
// tokens [i*rate, (i+1)*rate). Entry i is RoPE'd at position i*rate.
//
// The inflight ring of a sequence: ring_slots = (overlap ? 2 : 1) * rate rows of
// 2*width floats; token p lives in row p % ring_slots as kv (width) then score
// (width, position bias included), exactly the layout of model/state.hpp.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/backend.hpp"

namespace troupe::kernels::cuda {

enum class EntryType : uint8_t { f32, bf16 };

struct CompressorShape {
  int rate = 4;
  bool overlap = false;
  int64_t dim = 0;                   // entry width; kv/score rows are (overlap ? 2 : 1) * dim
  const float* ape = nullptr;        // [rate, width] position bias, added to the raw score
  const float* norm_weight = nullptr;  // [dim]
  float eps = 1e-6f;
  RopeTable rope;                    // on the trailing rope.rope_dim channels of each entry
};

// Prefill: tokens [start, start + tokens) of one sequence. kv, score: [tokens, width]
// raw projections (score without the bias). Entries start/rate <= i < (start+tokens)/rate
// are written to out_rows[i - start/rate] (EntryType elements, dim each). Tokens before
// `start` are read from `ring`, which is then updated with the chunk's last tokens.
void compress_prefill(const CompressorShape& s, const float* kv, const float* score, int64_t tokens, int64_t start,
                      float* ring, void* const* out_rows, EntryType out_type, cudaStream_t stream);

// Decode: sequence b appends one token at positions[b] (device) with raw kv/score
// rows b of [batch, width]; rings[b] is its ring (device array of pointers). When the
// token closes a window ((p + 1) % rate == 0) entry p / rate goes to out_rows[b].
// Where the shape allows, a kernel with few dependent round trips (compress_decode_kernel
// in compressor.cu); TROUPE_COMPRESS_DECODE=1 (read at each call; for compress_decode_paged
// too) or any other shape: the one-wave kernel.
void compress_decode(const CompressorShape& s, const float* kv, const float* score, int64_t batch,
                     const int64_t* positions, float* const* rings, void* const* out_rows, EntryType out_type,
                     cudaStream_t stream);

// Backend::decode_compress in one kernel: rings and entries as per-sequence tables of
// row pointers (see there); score gets s.ape (the position bias) of the new token in
// place; entries are f32.
void compress_decode_paged(const CompressorShape& s, int64_t batch, const int64_t* positions, const int32_t* table_of,
                           const float* kv, float* score, float* const* ring, int64_t ring_stride,
                           float* const* entries, int64_t entry_stride, cudaStream_t stream);

// The backend op: `count` entries of `slots` slots given by row pointers (score already
// carries the bias; null slot = empty). See Backend::compress.
void compress_slots(int64_t count, int slots, int64_t dim, const float* const* kv_src, const float* const* score_src,
                    const float* norm_weight, float eps, const int64_t* positions, const RopeTable& rope,
                    float* const* out, cudaStream_t stream);

}  // namespace troupe::kernels::cuda
