// Batch-invariant x @ w^T for the CPU backend (see cpu_gemm.hpp for why).
//
// Each output element is one vector accumulator: for k-steps of L floats,
// acc = fma(x[r, kk:kk+L], w[j, kk:kk+L], acc) (the last step masked to zeros),
// then a fixed lane reduction. Register tiles of up to 4 rows x 4 weight rows
// share the loads; the tile shape never changes an element's arithmetic, so
// any m, any blocking and any thread split give the same bits.
#include "kernels/cpu/cpu_gemm.hpp"

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdlib>
#include <functional>
#include <mutex>
#include <stdexcept>
#include <thread>
#include <cmath>
#include <cstring>
#include <limits>
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
// GCC 12's _mm512_reduce_add_ps trips -Wmaybe-uninitialized inside its own header.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
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
#pragma GCC diagnostic pop
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
  TileFn fn[6][2];
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

constexpr int64_t kBlockK = 512;   // k per pass: a 6-row x tile (12 KiB) stays in L1
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

// Helper threads for large products. They sleep on a condition variable
// between calls (never spin: on a 2-core machine a spinning team starves the
// engine's other threads), the caller works too, and a second caller that
// finds the pool busy runs its product alone rather than wait. Threads:
// $TROUPE_CPU_THREADS, else the hardware threads.
class Pool {
 public:
  static Pool& get() {
    static Pool pool;
    return pool;
  }
  int threads() const { return static_cast<int>(workers_.size()) + 1; }

  // fn(t) for t in [0, tasks), on the caller and the helpers; returns when all are done.
  void run(int64_t tasks, const std::function<void(int64_t)>& fn) {
    std::unique_lock busy(run_mutex_, std::try_to_lock);
    if (!busy.owns_lock() || workers_.empty() || tasks < 2) {
      for (int64_t t = 0; t < tasks; ++t) fn(t);
      return;
    }
    {
      std::lock_guard lock(mutex_);
      fn_ = &fn;
      tasks_ = tasks;
      next_.store(0);
      active_ = static_cast<int>(workers_.size());
      ++generation_;
    }
    wake_.notify_all();
    work();
    std::unique_lock lock(mutex_);
    done_.wait(lock, [&] { return active_ == 0; });
    fn_ = nullptr;
  }

 private:
  Pool() {
    int n = static_cast<int>(std::thread::hardware_concurrency());
    if (const char* env = std::getenv("TROUPE_CPU_THREADS"); env != nullptr && std::atoi(env) > 0) n = std::atoi(env);
    for (int i = 1; i < n; ++i) workers_.emplace_back([this] { loop(); });
  }
  ~Pool() {
    {
      std::lock_guard lock(mutex_);
      stop_ = true;
    }
    wake_.notify_all();
    for (auto& w : workers_) w.join();
  }

  void work() {
    for (int64_t t = next_.fetch_add(1); t < tasks_; t = next_.fetch_add(1)) (*fn_)(t);
  }

  void loop() {
    uint64_t seen = 0;
    for (;;) {
      {
        std::unique_lock lock(mutex_);
        wake_.wait(lock, [&] { return stop_ || generation_ != seen; });
        if (stop_) return;
        seen = generation_;
      }
      work();
      std::lock_guard lock(mutex_);
      if (--active_ == 0) done_.notify_one();
    }
  }

  std::mutex run_mutex_, mutex_;
  std::condition_variable wake_, done_;
  const std::function<void(int64_t)>* fn_ = nullptr;
  int64_t tasks_ = 0;
  std::atomic<int64_t> next_{0};
  int active_ = 0;
  uint64_t generation_ = 0;
  bool stop_ = false;
  std::vector<std::thread> workers_;
};

// The values of the 256 e4m3fn codes and the 16 e2m1 codes (as base/dtype.cpp
// converts them: the same floats, -0 for the negative zero codes).
struct CodeTables {
  float e4m3[256];
  float e2m1[16];
  CodeTables() {
    for (int v = 0; v < 256; ++v) {
      const int exp = (v >> 3) & 0xf, mant = v & 0x7;
      const float sign = (v & 0x80) ? -1.0f : 1.0f;
      if (exp == 0xf && mant == 0x7) {
        e4m3[v] = std::numeric_limits<float>::quiet_NaN();
      } else if (exp == 0) {
        e4m3[v] = sign * std::ldexp(static_cast<float>(mant), -9);
      } else {
        e4m3[v] = sign * std::ldexp(static_cast<float>(8 + mant), exp - 10);
      }
    }
    static constexpr float kMagnitude[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
    for (int v = 0; v < 16; ++v) e2m1[v] = (v & 0x8) ? -kMagnitude[v & 7] : kMagnitude[v & 7];
  }
};

const CodeTables kCodes;

// Weight blocks of gemm_xwt's products: about 128 KiB of a k-pass stay in L2 while
// every row tile passes over them.
int64_t weight_block_rows(int64_t k) {
  return std::clamp<int64_t>((32768 / std::min(std::max<int64_t>(k, 1), kBlockK)) / 4 * 4, 4, 512);
}

// fn(b) for the blocks [0, blocks), on helper threads where the product
// (about m * n * k multiply-adds) is worth waking them for (about a millisecond).
void run_blocks(double work, int64_t blocks, const std::function<void(int64_t)>& fn) {
  if (work < 4.0e6 || blocks < 2) {
    for (int64_t b = 0; b < blocks; ++b) fn(b);
    return;
  }
  Pool::get().run(blocks, fn);
}

// out[i] = value(code i) * s for n codes from `in` (e4m3: a byte each; e2m1: two a byte from code
// `first`, which is even), as kCodes' tables give them: the vector forms build the same floats (e4m3:
// the exponent and mantissa bits moved into place, subnormals as mant * 2^-9, NaN for S.1111.111; e2m1:
// a 16-entry table) and multiply by s once, so every element has the bits of the scalar form.
#pragma GCC push_options
#pragma GCC target("avx512f")
// GCC 12's AVX-512 conversions trip -Wmaybe-uninitialized inside its own header (as in tile512).
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
// The values of 16 e4m3 codes (the low 16 bytes of b).
inline __m512 e4m3x16(__m128i b) {
  const __m512i v = _mm512_cvtepu8_epi32(b);
  const __m512i e = _mm512_and_si512(_mm512_srli_epi32(v, 3), _mm512_set1_epi32(15));
  const __m512i m = _mm512_and_si512(v, _mm512_set1_epi32(7));
  const __m512i normal = _mm512_or_si512(_mm512_slli_epi32(_mm512_add_epi32(e, _mm512_set1_epi32(120)), 23),
                                         _mm512_slli_epi32(m, 20));
  const __m512 sub = _mm512_mul_ps(_mm512_cvtepi32_ps(m), _mm512_set1_ps(1.0f / 512.0f));
  __m512 mag = _mm512_mask_blend_ps(_mm512_cmpeq_epi32_mask(e, _mm512_setzero_si512()), _mm512_castsi512_ps(normal), sub);
  mag = _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(mag),
                                            _mm512_slli_epi32(_mm512_and_si512(v, _mm512_set1_epi32(0x80)), 24)));
  const __m512i k127 = _mm512_set1_epi32(0x7f);
  return _mm512_mask_blend_ps(_mm512_cmpeq_epi32_mask(_mm512_and_si512(v, k127), k127), mag,
                              _mm512_set1_ps(std::numeric_limits<float>::quiet_NaN()));
}

// The values of 16 e2m1 codes from the low 8 bytes of b (low nibble first), by the 16-entry table.
inline __m512 e2m1x16(__m128i b, __m512 lut) {
  const __m512i shifts = _mm512_set_epi32(4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0);
  const __m512i v = _mm512_cvtepu8_epi32(_mm_unpacklo_epi8(b, b));
  return _mm512_permutexvar_ps(_mm512_and_si512(_mm512_srlv_epi32(v, shifts), _mm512_set1_epi32(15)), lut);
}

int64_t e4m3_run512(const uint8_t* in, int64_t n, float s, float* out) {
  const __m512 scale = _mm512_set1_ps(s);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    _mm512_storeu_ps(out + i, _mm512_mul_ps(e4m3x16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(in + i))), scale));
  }
  return i;
}

int64_t e2m1_run512(const uint8_t* in, int64_t n, float s, float* out, const float* table) {
  const __m512 lut = _mm512_loadu_ps(table), scale = _mm512_set1_ps(s);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(in + i / 2));
    _mm512_storeu_ps(out + i, _mm512_mul_ps(e2m1x16(b, lut), scale));
  }
  return i;
}

// y[r, j] (r < RM) for weight rows [j0, j1) of a quantized w whose scale blocks are whole 16-column
// chunks: each chunk's codes converted in registers (the values dequantize_rows stores) and multiplied
// into the rows of x by tile512<RM, 1>'s chain (fused multiply-adds over k in order, the tail masked to
// zeros, then the lane reduction), so y has gemm_xwt's bits over the dequantized matrix.
template <int RM>
void gemv_quantized512(const float* x, int64_t ldx, const Weight& w, int64_t j0, int64_t j1, float* y, int64_t ldy,
                       bool accumulate) {
  const int64_t k = w.cols, bc = w.block_cols;
  const bool fp4 = w.type == WeightType::e2m1;
  const int64_t row_bytes = fp4 ? k / 2 : k;
  const __m512 lut = _mm512_loadu_ps(kCodes.e2m1);
  for (int64_t j = j0; j < j1; ++j) {
    const uint8_t* codes = static_cast<const uint8_t*>(w.data) + j * row_bytes;
    const float* srow = w.scale + ((j + w.scale_row) / w.block_rows) * w.scale_stride;
    __m512 acc[RM];
    for (int r = 0; r < RM; ++r) acc[r] = _mm512_setzero_ps();
    int64_t kk = 0;
    for (; kk + 16 <= k; kk += 16) {
      const __m128i b = fp4 ? _mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + kk / 2))
                            : _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + kk));
      const __m512 wv = _mm512_mul_ps(fp4 ? e2m1x16(b, lut) : e4m3x16(b), _mm512_set1_ps(srow[kk / bc]));
      for (int r = 0; r < RM; ++r) acc[r] = _mm512_fmadd_ps(_mm512_loadu_ps(x + r * ldx + kk), wv, acc[r]);
    }
    if (kk < k) {  // the last codes from a zeroed copy; lanes past k zero, as tile512's masked loads
      alignas(16) uint8_t tail[16] = {};
      std::memcpy(tail, codes + (fp4 ? kk / 2 : kk), static_cast<size_t>(fp4 ? (k - kk + 1) / 2 : k - kk));
      const __m128i b = _mm_load_si128(reinterpret_cast<const __m128i*>(tail));
      const __mmask16 mask = static_cast<__mmask16>((1u << (k - kk)) - 1u);
      const __m512 wv =
          _mm512_maskz_mov_ps(mask, _mm512_mul_ps(fp4 ? e2m1x16(b, lut) : e4m3x16(b), _mm512_set1_ps(srow[kk / bc])));
      for (int r = 0; r < RM; ++r) acc[r] = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(mask, x + r * ldx + kk), wv, acc[r]);
    }
    for (int r = 0; r < RM; ++r) store(y + r * ldy + j, _mm512_reduce_add_ps(acc[r]), accumulate);
  }
}
#pragma GCC diagnostic pop
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma")
int64_t e4m3_run256(const uint8_t* in, int64_t n, float s, float* out) {
  const __m256i k7 = _mm256_set1_epi32(7), k15 = _mm256_set1_epi32(15), k127 = _mm256_set1_epi32(0x7f),
                k128 = _mm256_set1_epi32(0x80), k120 = _mm256_set1_epi32(120), zero = _mm256_setzero_si256();
  const __m256 sub_unit = _mm256_set1_ps(1.0f / 512.0f), nan = _mm256_set1_ps(std::numeric_limits<float>::quiet_NaN()),
               scale = _mm256_set1_ps(s);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(in + i)));
    const __m256i e = _mm256_and_si256(_mm256_srli_epi32(v, 3), k15), m = _mm256_and_si256(v, k7);
    const __m256i normal = _mm256_or_si256(_mm256_slli_epi32(_mm256_add_epi32(e, k120), 23), _mm256_slli_epi32(m, 20));
    const __m256 sub = _mm256_mul_ps(_mm256_cvtepi32_ps(m), sub_unit);
    __m256 mag = _mm256_blendv_ps(_mm256_castsi256_ps(normal), sub, _mm256_castsi256_ps(_mm256_cmpeq_epi32(e, zero)));
    mag = _mm256_castsi256_ps(_mm256_or_si256(_mm256_castps_si256(mag), _mm256_slli_epi32(_mm256_and_si256(v, k128), 24)));
    mag = _mm256_blendv_ps(mag, nan, _mm256_castsi256_ps(_mm256_cmpeq_epi32(_mm256_and_si256(v, k127), k127)));
    _mm256_storeu_ps(out + i, _mm256_mul_ps(mag, scale));
  }
  return i;
}
#pragma GCC pop_options

void e4m3_run(const uint8_t* in, int64_t n, float s, float* out) {
  int64_t i = kIsa == Isa::avx512 ? e4m3_run512(in, n, s, out) : kIsa == Isa::avx2 ? e4m3_run256(in, n, s, out) : 0;
  for (; i < n; ++i) out[i] = kCodes.e4m3[in[i]] * s;
}

void e2m1_run(const uint8_t* in, int64_t first, int64_t n, float s, float* out) {
  int64_t i = kIsa == Isa::avx512 && first % 2 == 0 ? e2m1_run512(in + first / 2, n, s, out, kCodes.e2m1) : 0;
  for (; i < n; ++i) {
    const int64_t c = first + i;
    const uint8_t code = (c & 1) ? static_cast<uint8_t>(in[c / 2] >> 4) : static_cast<uint8_t>(in[c / 2] & 0xf);
    out[i] = kCodes.e2m1[code] * s;
  }
}

}  // namespace

void dequantize_rows(const Weight& w, int64_t r0, int64_t r1, float* out) {
  const int64_t k = w.cols, bc = w.block_cols;
  const auto* codes = static_cast<const uint8_t*>(w.data);
  for (int64_t r = r0; r < r1; ++r) {
    const float* srow = w.scale + ((r + w.scale_row) / w.block_rows) * w.scale_stride;
    float* o = out + (r - r0) * k;
    for (int64_t c0 = 0; c0 < k; c0 += bc) {
      const int64_t n = std::min(k, c0 + bc) - c0;
      if (w.type == WeightType::e4m3) {
        e4m3_run(codes + r * k + c0, n, srow[c0 / bc], o + c0);
      } else {
        e2m1_run(codes + r * (k / 2), c0, n, srow[c0 / bc], o + c0);
      }
    }
  }
}

void gemm_xwt_quantized(const float* x, int64_t m, int64_t ldx, const Weight& w, float* y, int64_t ldy,
                        bool accumulate) {
  const int64_t n = w.rows, k = w.cols;
  if (m <= 0 || n <= 0) return;
  // Few rows of x (decode): the codes converted in registers, never stored (the same bits).
  if (kIsa == Isa::avx512 && m <= 4 && w.block_cols % 16 == 0) {
    const int64_t nb = 64;
    run_blocks(static_cast<double>(m) * static_cast<double>(n) * static_cast<double>(k), (n + nb - 1) / nb,
               [&](int64_t b) {
                 const int64_t j0 = b * nb, j1 = std::min(n, j0 + nb);
                 switch (m) {
                   case 1: return gemv_quantized512<1>(x, ldx, w, j0, j1, y, ldy, accumulate);
                   case 2: return gemv_quantized512<2>(x, ldx, w, j0, j1, y, ldy, accumulate);
                   case 3: return gemv_quantized512<3>(x, ldx, w, j0, j1, y, ldy, accumulate);
                   default: return gemv_quantized512<4>(x, ldx, w, j0, j1, y, ldy, accumulate);
                 }
               });
    return;
  }
  // A block's dequantized rows (nb x k floats, at most ~256 KiB) are made once a call and
  // read by every row tile.
  const int64_t nb = std::clamp<int64_t>(65536 / std::max<int64_t>(k, 1) / 4 * 4, 4, weight_block_rows(k));
  const int64_t blocks = (n + nb - 1) / nb;
  run_blocks(static_cast<double>(m) * static_cast<double>(n) * static_cast<double>(k), blocks, [&](int64_t b) {
    thread_local std::vector<float> state, rows;
    const int64_t j0 = b * nb, j1 = std::min(n, j0 + nb);
    rows.resize(static_cast<size_t>((j1 - j0) * k));
    dequantize_rows(w, j0, j1, rows.data());
    block(x, m, ldx, rows.data(), 0, j1 - j0, k, k, y + j0, ldy, accumulate, state);
  });
}

void gemm_weight(const float* x, int64_t m, int64_t ldx, const Weight& w, float* y, int64_t ldy, bool accumulate) {
  if (is_quantized(w.type)) {
    gemm_xwt_quantized(x, m, ldx, w, y, ldy, accumulate);
    return;
  }
  if (w.type != WeightType::f32) throw std::invalid_argument("cpu backend: weights must be fp32 or FP8 / FP4 codes");
  gemm_xwt(x, m, ldx, static_cast<const float*>(w.data), w.rows, w.cols, w.cols, y, ldy, accumulate);
}

const char* gemm_isa() { return kIsa == Isa::avx512 ? "avx512" : kIsa == Isa::avx2 ? "avx2" : "scalar"; }

void gemm_xwt(const float* x, int64_t m, int64_t ldx, const float* w, int64_t n, int64_t ldw, int64_t k, float* y,
              int64_t ldy, bool accumulate) {
  if (m <= 0 || n <= 0) return;
  const int64_t nb = weight_block_rows(k);
  const int64_t blocks = (n + nb - 1) / nb;
  run_blocks(static_cast<double>(m) * static_cast<double>(n) * static_cast<double>(k), blocks, [&](int64_t b) {
    thread_local std::vector<float> state;
    block(x, m, ldx, w, b * nb, std::min(n, (b + 1) * nb), ldw, k, y, ldy, accumulate, state);
  });
}

}  // namespace troupe::kernels::cpu
