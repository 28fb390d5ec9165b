// Helpers for checking the CUDA backend against the CPU backend (the oracle):
// random inputs, buffers mirrored on both backends, NaN-poisoned outputs and
// error norms.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "kernels/backend.hpp"

namespace troupe::kernels::testing {

inline uint16_t bf16_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest even
  return static_cast<uint16_t>(u >> 16);
}
inline float from_bf16(uint16_t b) {
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline float round_bf16(float f) { return from_bf16(bf16_bits(f)); }
inline uint16_t f16_bits(float f) {  // round to nearest even, normal range only (test data is small)
  uint32_t u;
  std::memcpy(&u, &f, 4);
  const uint32_t sign = (u >> 16) & 0x8000u;
  const int exp = static_cast<int>((u >> 23) & 0xff) - 127 + 15;
  uint32_t mant = u & 0x7fffffu;
  if (exp <= 0) return static_cast<uint16_t>(sign);  // flush tiny values
  uint32_t h = sign | (static_cast<uint32_t>(exp) << 10) | (mant >> 13);
  const uint32_t rest = mant & 0x1fffu;
  if (rest > 0x1000u || (rest == 0x1000u && (h & 1u))) ++h;
  return static_cast<uint16_t>(h);
}
inline float from_f16(uint16_t h) {
  const uint32_t sign = (h & 0x8000u) << 16;
  const int exp = (h >> 10) & 0x1f;
  const uint32_t mant = h & 0x3ffu;
  uint32_t u = exp == 0 ? sign : sign | (static_cast<uint32_t>(exp - 15 + 127) << 23) | (mant << 13);
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// An A/B switch the kernels read at each call (TROUPE_...), set for a scope (value null: unset)
// and put back as it was after.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) {
    if (const char* old = std::getenv(name)) {
      had_ = true;
      old_ = old;
    }
    if (value != nullptr) {
      ::setenv(name, value, 1);
    } else {
      ::unsetenv(name);
    }
  }
  ~ScopedEnv() {
    if (had_) {
      ::setenv(name_.c_str(), old_.c_str(), 1);
    } else {
      ::unsetenv(name_.c_str());
    }
  }
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;

 private:
  std::string name_, old_;
  bool had_ = false;
};

inline std::vector<float> randn(size_t n, std::mt19937& rng, float scale = 1.f) {
  std::normal_distribution<float> d(0.f, scale);
  std::vector<float> v(n);
  for (auto& x : v) x = d(rng);
  return v;
}

struct Errors {
  double rel = 0;       // ||a - b|| / ||b||
  double max_abs = 0;   // max |a - b|
  double ref_max = 0;   // max |b|
  size_t nan = 0;       // non-finite entries of a
};
inline Errors compare(const std::vector<float>& got, const std::vector<float>& ref) {
  Errors e;
  double num = 0, den = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    if (!std::isfinite(got[i])) {
      ++e.nan;
      continue;
    }
    const double d = static_cast<double>(got[i]) - ref[i];
    num += d * d;
    den += static_cast<double>(ref[i]) * ref[i];
    e.max_abs = std::max(e.max_abs, std::fabs(d));
    e.ref_max = std::max(e.ref_max, std::fabs(static_cast<double>(ref[i])));
  }
  e.rel = den > 0 ? std::sqrt(num / den) : std::sqrt(num);
  return e;
}

#define EXPECT_CLOSE(got, ref, tol)                                                                    \
  do {                                                                                                 \
    const auto troupe_e_ = ::troupe::kernels::testing::compare((got), (ref));                          \
    EXPECT_EQ(troupe_e_.nan, 0u) << "non-finite outputs";                                              \
    EXPECT_LE(troupe_e_.rel, (tol)) << "max abs err " << troupe_e_.max_abs << " of " << troupe_e_.ref_max; \
    ::troupe::kernels::testing::record_error(::testing::UnitTest::GetInstance()->current_test_info()->name(), \
                                             troupe_e_.rel);                                           \
  } while (0)

// Largest relative error seen per test (printed at the end of a run: the table of max errors).
inline std::vector<std::pair<std::string, double>>& error_log() {
  static std::vector<std::pair<std::string, double>> log;
  return log;
}
inline void record_error(const std::string& test, double rel) {
  for (auto& [name, worst] : error_log()) {
    if (name == test) {
      worst = std::max(worst, rel);
      return;
    }
  }
  error_log().emplace_back(test, rel);
}

// Reference indexer scores in double (for judging near-ties): query t's (q [t, heads, dim], w [t, heads])
// against pool rows `rows`.
inline std::vector<double> index_scores(const std::vector<float>& q, const std::vector<float>& w, int64_t t,
                                        int heads, int64_t dim, const std::vector<float>& pool,
                                        const std::vector<int64_t>& rows, float scale, float wscale) {
  std::vector<double> s(rows.size());
  for (size_t j = 0; j < rows.size(); ++j) {
    double total = 0;
    for (int h = 0; h < heads; ++h) {
      double dot = 0;
      for (int64_t i = 0; i < dim; ++i) dot += static_cast<double>(q[(t * heads + h) * dim + i]) * pool[rows[j] * dim + i];
      total += std::max(dot, 0.0) * scale * w[t * heads + h] * wscale;
    }
    s[j] = total;
  }
  return s;
}

// A buffer mirrored on two backends.
class Mirror {
 public:
  Mirror(Backend& cpu, Backend& gpu, size_t bytes) : cpu_(cpu), gpu_(gpu), bytes_(std::max<size_t>(bytes, 4)) {
    c_ = cpu_.alloc(bytes_);
    g_ = gpu_.alloc(bytes_);
  }
  template <class T>
  Mirror(Backend& cpu, Backend& gpu, const std::vector<T>& host) : Mirror(cpu, gpu, host.size() * sizeof(T)) {
    set(host);
  }
  ~Mirror() {
    cpu_.free(c_);
    gpu_.free(g_);
  }
  Mirror(const Mirror&) = delete;
  Mirror& operator=(const Mirror&) = delete;
  template <class T>
  void set(const std::vector<T>& host) {
    if (host.empty()) return;
    cpu_.to_device(c_, host.data(), host.size() * sizeof(T));
    gpu_.to_device(g_, host.data(), host.size() * sizeof(T));
  }
  void poison() {
    std::vector<float> nan(bytes_ / 4, std::numeric_limits<float>::quiet_NaN());
    set(nan);
  }
  template <class T = float>
  T* cpu() const {
    return static_cast<T*>(c_);
  }
  template <class T = float>
  T* gpu() const {
    return static_cast<T*>(g_);
  }
  template <class T = float>
  std::vector<T> cpu_host(size_t n) const {
    std::vector<T> v(n);
    cpu_.to_host(v.data(), c_, n * sizeof(T));
    return v;
  }
  template <class T = float>
  std::vector<T> gpu_host(size_t n) const {
    std::vector<T> v(n);
    gpu_.synchronize();
    gpu_.to_host(v.data(), g_, n * sizeof(T));
    return v;
  }

 private:
  Backend& cpu_;
  Backend& gpu_;
  size_t bytes_;
  void* c_ = nullptr;
  void* g_ = nullptr;
};

// A weight matrix: fp32 values for the CPU, the same values in `type` for the GPU
// (values are rounded to the type first, so both backends see identical weights).
class MirrorWeight {
 public:
  MirrorWeight(Backend& cpu, Backend& gpu, int64_t rows, int64_t cols, WeightType type, std::mt19937& rng,
               float scale = 0.05f)
      : cpu_(cpu), gpu_(gpu) {
    std::vector<float> v = randn(static_cast<size_t>(rows * cols), rng, scale);
    std::vector<uint16_t> half(type == WeightType::f32 ? 0 : v.size());
    for (size_t i = 0; i < half.size(); ++i) {
      half[i] = type == WeightType::bf16 ? bf16_bits(v[i]) : f16_bits(v[i]);
      v[i] = type == WeightType::bf16 ? from_bf16(half[i]) : from_f16(half[i]);
    }
    c_ = cpu_.alloc(v.size() * 4);
    cpu_.to_device(c_, v.data(), v.size() * 4);
    const size_t gbytes = type == WeightType::f32 ? v.size() * 4 : half.size() * 2;
    g_ = gpu_.alloc(gbytes);
    if (type == WeightType::f32) {
      gpu_.to_device(g_, v.data(), gbytes);
    } else {
      gpu_.to_device(g_, half.data(), gbytes);
    }
    cw = Weight{c_, WeightType::f32, rows, cols};
    gw = Weight{g_, type, rows, cols};
  }
  ~MirrorWeight() {
    cpu_.free(c_);
    gpu_.free(g_);
  }
  MirrorWeight(const MirrorWeight&) = delete;
  MirrorWeight& operator=(const MirrorWeight&) = delete;
  Weight cw, gw;

 private:
  Backend& cpu_;
  Backend& gpu_;
  void* c_ = nullptr;
  void* g_ = nullptr;
};

// A random FP8 (e4m3) or FP4 (e2m1) matrix with power-of-two block scales (DeepSeek's ue8m0; so
// every value is exact in bf16) in both backends' memory: cw / gw over the same codes and scales.
class MirrorQuantized {
 public:
  MirrorQuantized(Backend& cpu, Backend& gpu, int64_t rows, int64_t cols, WeightType type, int block_rows,
                  int block_cols, std::mt19937& rng)
      : codes_(cpu, gpu, static_cast<size_t>(rows * (type == WeightType::e2m1 ? cols / 2 : cols))),
        scales_(cpu, gpu, static_cast<size_t>(((rows + block_rows - 1) / block_rows) *
                                              ((cols + block_cols - 1) / block_cols) * 4)) {
    std::vector<uint8_t> c(static_cast<size_t>(rows * (type == WeightType::e2m1 ? cols / 2 : cols)));
    for (auto& b : c) {
      do {
        b = static_cast<uint8_t>(rng());
      } while (type == WeightType::e4m3 && (b & 0x7f) == 0x7f);  // e4m3fn's NaN codes
    }
    const int64_t sr = (rows + block_rows - 1) / block_rows, sc = (cols + block_cols - 1) / block_cols;
    std::vector<float> s(static_cast<size_t>(sr * sc));
    std::uniform_int_distribution<int> exp(type == WeightType::e4m3 ? -13 : -6, type == WeightType::e4m3 ? -10 : -3);
    for (auto& v : s) v = std::ldexp(1.0f, exp(rng));
    codes_.set(c);
    scales_.set(s);
    for (Weight* w : {&cw, &gw}) {
      const bool g = w == &gw;
      w->data = g ? codes_.gpu<uint8_t>() : codes_.cpu<uint8_t>();
      w->type = type;
      w->rows = rows;
      w->cols = cols;
      w->scale = g ? scales_.gpu() : scales_.cpu();
      w->scale_stride = sc;
      w->block_rows = block_rows;
      w->block_cols = block_cols;
    }
  }
  Weight cw, gw;

 private:
  Mirror codes_, scales_;
};

}  // namespace troupe::kernels::testing
