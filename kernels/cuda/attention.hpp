// V4 sparse attention on the tensor cores: per query, one softmax over its key
// rows (SWA window + selected CSA or all HCA entries, K = V shared head) plus a
// per-head sink logit that only joins the denominator.
//
// One CTA owns 64 heads of one query (heads padded to 64; or 16, the narrow form for
// few queries) and a range of its keys; 32-key tiles stream through shared memory (cp.async), S = Q K^T and
// O += P V run as mma.sync m16n8k16 with bf16 operands and fp32 accumulation,
// with an online softmax in fp32. Long key lists are split over CTAs
// (flash-decoding) and merged by a second kernel. Optionally the output's
// trailing RoPE channels are turned back (inverse RoPE at the query position).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "kernels/backend.hpp"

namespace troupe::kernels::cuda {

enum class KeyType : uint8_t { f32, bf16 };

struct AttentionArgs {
  const float* q = nullptr;          // [n_queries, heads, dim]
  int64_t n_queries = 0;
  int heads = 0;
  int64_t dim = 0;                   // 64, 128, 256 or 512
  KeyType key_type = KeyType::f32;
  const void* const* rows = nullptr; // key row pointers (16-byte aligned), ragged by offsets
  const int64_t* offsets = nullptr;  // [n_queries + 1]
  int64_t max_keys = 0;              // >= every query's key count
  const float* sinks = nullptr;      // [heads] or null (no sink)
  float scale = 1.f;
  float* out = nullptr;              // [n_queries, heads, dim]
  const RopeTable* derope = nullptr; // optional inverse RoPE of the output at positions[t]
  const int64_t* positions = nullptr;
  int splits = 0;                    // key splits per query; 0 = automatic
  int cta_heads = 0;                 // heads a CTA: 64, or 16 (dim >= 128: four times the CTAs, for few
                                     // queries); 0 = automatic
};

size_t attention_workspace_bytes(const AttentionArgs& a);
void attention(const AttentionArgs& a, void* workspace, cudaStream_t stream);

}  // namespace troupe::kernels::cuda
