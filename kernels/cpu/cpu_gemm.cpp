// Batch-invariant x @ w^T for the CPU backend (see cpu_gemm.hpp for why).
//
// Each output element is one vector accumulator: for k-steps of L floats,
// acc = fma(x[r, kk:kk+L], w[j, kk:kk+L], acc) (the last step masked to zeros),
// then a fixed lane reduction. Register tiles of up to 4 rows x 4 weight rows
// share the loads; the tile shape never changes an element's arithmetic, so
// any m, any blocking and any thread split give the same bits.
#include "kernels/cpu/cpu_gemm.hpp"

#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace troupe::kernels::cpu {
namespace {

enum class Isa { scalar, avx2, avx512 };

Isa detect() {
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f")) return Isa::avx512;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return Isa::avx2;
  return Isa::scalar;
}

const Isa kIsa = detect();

inline void store(float* y, float v, bool accumulate) { *y = accumulate ? *y + v : v; }

#pragma GCC push_options
#pragma GCC target("avx512f")
template <int RM, int RN>
void tile512(const float* x, int64_t ldx, const float* w, int64_t ldw, int64_t k, float* y, int64_t ldy,
             bool accumulate, float* state, bool resume, bool finish) {
  __m512 acc[RM][RN];
  for (int r = 0; r < RM; ++r)
    for (int j = 0; j < RN; ++j) acc[r][j] = resume ? _mm512_loadu_ps(state + (r * RN + j) * 16) : _mm512_setzero_ps();
  int64_t kk = 0;
  for (; kk + 16 <= k; kk += 16) {
    __m512 xv[RM];
    for (int r = 0; r < RM; ++r) xv[r] = _mm512_loadu_ps(x + r * ldx + kk);
    for (int j = 0; j < RN; ++j) {
      const __m512 wv = _mm512_loadu_ps(w + j * ldw + kk);
      for (int r = 0; r < RM; ++r) acc[r][j] = _mm512_fmadd_ps(xv[r], wv, acc[r][j]);
    }
  }
  if (kk < k) {
    const __mmask16 mask = static_cast<__mmask16>((1u << (k - kk)) - 1u);
    __m512 xv[RM];
    for (int r = 0; r < RM; ++r) xv[r] = _mm512_maskz_loadu_ps(mask, x + r * ldx + kk);
    for (int j = 0; j < RN; ++j) {
      const __m512 wv = _mm512_maskz_loadu_ps(mask, w + j * ldw + kk);
      for (int r = 0; r < RM; ++r) acc[r][j] = _mm512_fmadd_ps(xv[r], wv, acc[r][j]);
    }
  }
  if (!finish) {
    for (int r = 0; r < RM; ++r)
      for (int j = 0; j < RN; ++j) _mm512_storeu_ps(state + (r * RN + j) * 16, acc[r][j]);
    return;
  }
  for (int r = 0; r < RM; ++r)
    for (int j = 0; j < RN; ++j) store(y + r * ldy + j, _mm512_reduce_add_ps(acc[r][j]), accumulate);
}
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma")
inline float reduce256(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_shuffle_ps(t, t, 1)));
}

template <int RM, int RN>
void tile256(const float* x, int64_t ldx, const float* w, int64_t ldw, int64_t k, float* y, int64_t ldy,
             bool accumulate, float* state, bool resume, bool finish) {
  __m256 acc[RM][RN];
  for (int r = 0; r < RM; ++r)
    for (int j = 0; j < RN; ++j) acc[r][j] = resume ? _mm256_loadu_ps(state + (r * RN + j) * 8) : _mm256_setzero_ps();
  int64_t kk = 0;
  for (; kk + 8 <= k; kk += 8) {
    __m256 xv[RM];
    for (int r = 0; r < RM; ++r) xv[r] = _mm256_loadu_ps(x + r * ldx + kk);
    for (int j = 0; j < RN; ++j) {
      const __m256 wv = _mm256_loadu_ps(w + j * ldw + kk);
      for (int r = 0; r < RM; ++r) acc[r][j] = _mm256_fmadd_ps(xv[r], wv, acc[r][j]);
    }
  }
  if (kk < k) {
    alignas(32) int lanes[8];
    for (int l = 0; l < 8; ++l) lanes[l] = kk + l < k ? -1 : 0;
    const __m256i mask = _mm256_load_si256(reinterpret_cast<const __m256i*>(lanes));
    __m256 xv[RM];
    for (int r = 0; r < RM; ++r) xv[r] = _mm256_maskload_ps(x + r * ldx + kk, mask);
    for (int j = 0; j < RN; ++j) {
      const __m256 wv = _mm256_maskload_ps(w + j * ldw + kk, mask);
      for (int r = 0; r < RM; ++r) acc[r][j] = _mm256_fmadd_ps(xv[r], wv, acc[r][j]);
    }
  }
  if (!finish) {
    for (int r = 0; r < RM; ++r)
      for (int j = 0; j < RN; ++j) _mm256_storeu_ps(state + (r * RN + j) * 8, acc[r][j]);
    return;
  }
  for (int r = 0; r < RM; ++r)
    for (int j = 0; j < RN; ++j) store(y + r * ldy + j, reduce256(acc[r][j]), accumulate);
}
#pragma GCC pop_options

// Portable fallback: 8 lanes in an array, the same shape of sum.
template <int RM, int RN>
void tile_scalar(const float* x, int64_t ldx, const float* w, int64_t ldw, int64_t k, float* y, int64_t ldy,
                 bool accumulate, float* state, bool resume, bool finish) {
  for (int r = 0; r < RM; ++r) {
    for (int j = 0; j < RN; ++j) {
      float* lane = state + (r * RN + j) * 8;
      if (!resume) std::fill(lane, lane + 8, 0.0f);
      for (int64_t kk = 0; kk < k; ++kk) lane[kk % 8] = std::fma(x[r * ldx + kk], w[j * ldw + kk], lane[kk % 8]);
      if (!finish) continue;
      store(y + r * ldy + j, ((lane[0] + lane[4]) + (lane[1] + lane[5])) + ((lane[2] + lane[6]) + (lane[3] + lane[7])),
            accumulate);
    }
  }
}

// A tile's vector accumulators can be parked in `state` between k-blocks
// (resume: start from them; finish: reduce and store y, else park them): the
// same lane-wise chain of fused multiply-adds as one pass over k.
using TileFn = void (*)(const float*, int64_t, const float*, int64_t, int64_t, float*, int64_t, bool, float*, bool,
                        bool);

// fn[rm - 1][rn == 4]: the kernel for an rm x rn tile (rn is 4 or 1).
struct TileSet {
  TileFn fn[8][2];
  int max_rows;
};

template <int RM>
void fill(TileSet& t) {
  if (kIsa == Isa::avx512) {
    t.fn[RM - 1][0] = tile512<RM, 1>;
    t.fn[RM - 1][1] = tile512<RM, 4>;
  } else if (kIsa == Isa::avx2) {
    t.fn[RM - 1][0] = tile256<RM, 1>;
    t.fn[RM - 1][1] = tile256<RM, 4>;
  } else {
    t.fn[RM - 1][0] = tile_scalar<RM, 1>;
    t.fn[RM - 1][1] = tile_scalar<RM, 4>;
  }
}

TileSet make_tiles() {
  TileSet t{};
  fill<1>(t);
  fill<2>(t);
  fill<3>(t);
  fill<4>(t);
  fill<5>(t);
  fill<6>(t);
  // Registers: AVX-512 has 32 (6 x 4 accumulators + 6 row loads + a weight
  // load), AVX2 16 (2 x 4 + loads).
  t.max_rows = kIsa == Isa::avx512 ? 6 : kIsa == Isa::avx2 ? 2 : 4;
  return t;
}

const TileSet kTiles = make_tiles();

constexpr int64_t kBlockK = 512;   // k per pass: a 4-row x tile (8 KiB) stays in L1
constexpr int64_t kChunkRows = 36;  // rows whose parked accumulators a thread keeps (with nb weight rows)

// Weight rows [j0, j1) against every row of x, in k-blocks of kBlockK with the
// accumulators parked in `state` between blocks (one 64-byte slot per element).
void block(const float* x, int64_t m, int64_t ldx, const float* w, int64_t j0, int64_t j1, int64_t ldw, int64_t k,
           float* y, int64_t ldy, bool accumulate, std::vector<float>& state) {
  const int64_t tile_rows = kTiles.max_rows;
  for (int64_t r0 = 0; r0 < m; r0 += kChunkRows) {
    const int64_t r1 = std::min(m, r0 + kChunkRows);
    const size_t need = static_cast<size_t>((r1 - r0) * (j1 - j0) * 16);
    if (state.size() < need) state.resize(need);
    for (int64_t k0 = 0; k0 < k; k0 += kBlockK) {
      const int64_t kb = std::min(kBlockK, k - k0);
      const bool resume = k0 > 0, finish = k0 + kb >= k;
      for (int64_t r = r0; r < r1; r += tile_rows) {
        const int rm = static_cast<int>(std::min(tile_rows, r1 - r));
        const float* xr = x + r * ldx + k0;
        float* yr = y + r * ldy;
        float* st = state.data() + (r - r0) * (j1 - j0) * 16;
        int64_t j = j0;
        for (; j + 4 <= j1; j += 4) {
          kTiles.fn[rm - 1][1](xr, ldx, w + j * ldw + k0, ldw, kb, yr + j, ldy, accumulate, st + (j - j0) * rm * 16,
                               resume, finish);
        }
        for (; j < j1; ++j) {
          kTiles.fn[rm - 1][0](xr, ldx, w + j * ldw + k0, ldw, kb, yr + j, ldy, accumulate, st + (j - j0) * rm * 16,
                               resume, finish);
        }
      }
    }
  }
}

}  // namespace

const char* gemm_isa() { return kIsa == Isa::avx512 ? "avx512" : kIsa == Isa::avx2 ? "avx2" : "scalar"; }

void gemm_xwt(const float* x, int64_t m, int64_t ldx, const float* w, int64_t n, int64_t ldw, int64_t k, float* y,
              int64_t ldy, bool accumulate) {
  if (m <= 0 || n <= 0) return;
  // Weight blocks of about 128 KiB stay in L2 while every row tile passes over them.
  const int64_t nb = std::clamp<int64_t>((32768 / std::min(std::max<int64_t>(k, 1), kBlockK)) / 4 * 4, 4, 512);
  const int64_t blocks = (n + nb - 1) / nb;
  const double work = static_cast<double>(m) * static_cast<double>(n) * static_cast<double>(k);
  const int threads = work < 262144.0 || blocks < 2 ? 1 : static_cast<int>(std::min<int64_t>(omp_get_max_threads(), blocks));
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
  for (int64_t b = 0; b < blocks; ++b) {
    thread_local std::vector<float> state;
    block(x, m, ldx, w, b * nb, std::min(n, (b + 1) * nb), ldw, k, y, ldy, accumulate, state);
  }
}

}  // namespace troupe::kernels::cpu
