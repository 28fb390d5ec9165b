// Decode-step helpers of the CPU backend: row lists from per-sequence pointer
// tables, the compressor's slot lists, pointer scatter, argmax (see backend.hpp).
#include <algorithm>
#include <cmath>
#include <stdexcept>

#include "kernels/cpu/cpu_backend.hpp"

namespace troupe::kernels::cpu {

void CpuBackend::decode_rows(int64_t batch, const int64_t* positions, const int32_t* table_of,
                             const float* const* window, int64_t window_stride, int64_t window_slots, int64_t win,
                             const float* const* entries, int64_t entry_stride, int64_t rate, const int32_t* picked,
                             const int32_t* picked_count, int k, const float** out_rows, int64_t* out_offsets,
                             const float* store, int64_t store_dim) {
  if (store != nullptr && (window == nullptr || win < 1)) {
    throw std::invalid_argument("decode_rows: a store needs the window");
  }
  int64_t o = 0;
  out_offsets[0] = 0;
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t p = positions[b];
    const int64_t t = table_of != nullptr ? table_of[b] : b;
    if (store != nullptr) {
      float* own = const_cast<float*>(window[t * window_stride + p % window_slots]);
      std::copy(store + b * store_dim, store + (b + 1) * store_dim, own);
    }
    if (window != nullptr && win > 0) {
      for (int64_t j = std::max<int64_t>(0, p - win + 1); j <= p; ++j) {
        out_rows[o++] = window[t * window_stride + j % window_slots];
      }
    }
    if (entries != nullptr) {
      if (picked != nullptr) {
        for (int32_t s = 0; s < picked_count[b]; ++s) out_rows[o++] = entries[t * entry_stride + picked[b * k + s]];
      } else {
        for (int64_t i = 0; i < (p + 1) / rate; ++i) out_rows[o++] = entries[t * entry_stride + i];
      }
    }
    out_offsets[b + 1] = o;
  }
}

void CpuBackend::decode_compress_rows(int64_t batch, const int64_t* positions, const int32_t* table_of, int64_t rate,
                                      bool overlap, int64_t dim, const float* kv, float* score,
                                      const float* bias, float* const* ring, int64_t ring_stride, float* const* entries,
                                      int64_t entry_stride, const float** kv_src, const float** score_src, float** out,
                                      int64_t* entry_pos, float** ring_dst, const float** ring_src) {
  const int64_t width = overlap ? 2 * dim : dim;
  const int64_t ring_slots = overlap ? 2 * rate : rate;
  const int64_t slots = ring_slots;
  if (bias != nullptr) {
    for (int64_t b = 0; b < batch; ++b) {
      const float* br = bias + (positions[b] % rate) * width;
      for (int64_t c = 0; c < width; ++c) score[b * width + c] += br[c];
    }
  }
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t p = positions[b];
    const int64_t t = table_of != nullptr ? table_of[b] : b;
    const int64_t i = p / rate;
    const bool closing = (p + 1) % rate == 0;
    auto row = [&](int64_t j) -> const float* {
      return j == p ? kv + b * width : ring[t * ring_stride + j % ring_slots];
    };
    auto srow = [&](int64_t j) -> const float* {
      return j == p ? score + b * width : ring[t * ring_stride + j % ring_slots] + width;
    };
    const float** ks = kv_src + b * slots;
    const float** ss = score_src + b * slots;
    for (int64_t s = 0; s < slots; ++s) {
      ks[s] = nullptr;
      ss[s] = nullptr;
    }
    if (closing) {
      if (overlap) {
        for (int64_t s = 0; s < rate; ++s) {
          const int64_t j = (i - 1) * rate + s;
          if (i > 0) {
            ks[s] = row(j);
            ss[s] = srow(j);
          }
          const int64_t j2 = i * rate + s;
          ks[rate + s] = row(j2) + dim;
          ss[rate + s] = srow(j2) + dim;
        }
      } else {
        for (int64_t s = 0; s < rate; ++s) {
          ks[s] = row(i * rate + s);
          ss[s] = srow(i * rate + s);
        }
      }
    }
    out[b] = closing ? entries[t * entry_stride + i] : nullptr;
    entry_pos[b] = i * rate;
    float* r = ring[t * ring_stride + p % ring_slots];
    ring_dst[2 * b] = r;
    ring_dst[2 * b + 1] = r + width;
    ring_src[2 * b] = kv + b * width;
    ring_src[2 * b + 1] = score + b * width;
  }
}

void CpuBackend::scatter_pointers(void** table, const int64_t* index, void* const* values, int64_t count) {
  for (int64_t i = 0; i < count; ++i) {
    if (index[i] >= 0) table[index[i]] = values[i];
  }
}

void CpuBackend::argmax(const float* x, int64_t rows, int64_t n, int32_t* out) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * n;
    int64_t best = 0;
    for (int64_t j = 1; j < n; ++j) {
      if (xr[j] > xr[best] || (std::isnan(xr[best]) && !std::isnan(xr[j]))) best = j;
    }
    out[r] = static_cast<int32_t>(best);
  }
}

}  // namespace troupe::kernels::cpu
