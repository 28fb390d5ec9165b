// The CPU backend's products are batch-invariant: a row's result has the same
// bits whatever else is in the batch, and matches a double-precision sum.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "kernels/backend.hpp"
#include "kernels/cpu/cpu_gemm.hpp"

namespace troupe::kernels::cpu {
namespace {

struct Shape {
  int64_t n, k;
};

TEST(CpuGemm, every_row_has_the_same_bits_at_every_batch_size) {
  std::mt19937 rng(7);
  std::normal_distribution<float> dist;
  std::printf("gemm kernel: %s\n", gemm_isa());
  for (Shape s : {Shape{64, 2048}, Shape{1024, 256}, Shape{37, 131}, Shape{5, 7}, Shape{4099, 64}, Shape{3, 1}}) {
    const int64_t rows = 70;
    std::vector<float> w(static_cast<size_t>(s.n * s.k)), x(static_cast<size_t>(rows * s.k));
    for (auto& v : w) v = dist(rng);
    for (auto& v : x) v = dist(rng);
    // Each row alone: the reference bits, and against a double-precision dot.
    std::vector<float> alone(static_cast<size_t>(rows * s.n));
    for (int64_t r = 0; r < rows; ++r) {
      gemm_xwt(x.data() + r * s.k, 1, s.k, w.data(), s.n, s.k, s.k, alone.data() + r * s.n, s.n, false);
      for (int64_t j = 0; j < s.n; ++j) {
        double ref = 0, mag = 0;
        for (int64_t c = 0; c < s.k; ++c) {
          ref += static_cast<double>(x[r * s.k + c]) * w[j * s.k + c];
          mag += std::fabs(static_cast<double>(x[r * s.k + c]) * w[j * s.k + c]);
        }
        ASSERT_NEAR(alone[r * s.n + j], ref, 1e-6 * mag + 1e-30) << "n=" << s.n << " k=" << s.k;
      }
    }
    for (int64_t m : {2, 3, 4, 5, 8, 13, 64, 70}) {
      for (int64_t first : {int64_t{0}, rows - m}) {
        std::vector<float> y(static_cast<size_t>(m * s.n));
        gemm_xwt(x.data() + first * s.k, m, s.k, w.data(), s.n, s.k, s.k, y.data(), s.n, false);
        ASSERT_EQ(0, std::memcmp(y.data(), alone.data() + first * s.n, y.size() * 4))
            << "n=" << s.n << " k=" << s.k << " m=" << m << " first=" << first;
      }
    }
  }
}

TEST(CpuGemm, strided_operands_and_accumulation) {
  // linear_grouped's form: x and y with row strides wider than k and n.
  std::mt19937 rng(3);
  std::uniform_real_distribution<float> dist(-1, 1);
  const int64_t m = 9, n = 6, k = 21, ldx = 50, ldw = 30, ldy = 11;
  std::vector<float> x(m * ldx), w(n * ldw), y(m * ldy, 0.5f);
  for (auto& v : x) v = dist(rng);
  for (auto& v : w) v = dist(rng);
  std::vector<float> before = y;
  gemm_xwt(x.data(), m, ldx, w.data(), n, ldw, k, y.data(), ldy, true);
  for (int64_t r = 0; r < m; ++r) {
    for (int64_t j = 0; j < ldy; ++j) {
      if (j >= n) {
        EXPECT_EQ(y[r * ldy + j], before[r * ldy + j]) << "wrote outside the product";
        continue;
      }
      double ref = 0.5;
      for (int64_t c = 0; c < k; ++c) ref += static_cast<double>(x[r * ldx + c]) * w[j * ldw + c];
      EXPECT_NEAR(y[r * ldy + j], ref, 1e-5);
    }
  }
}

TEST(CpuGemm, backend_linear_is_batch_invariant_through_the_interface) {
  auto be = make_cpu_backend();
  std::mt19937 rng(11);
  std::normal_distribution<float> dist;
  const int64_t n = 300, k = 96;
  std::vector<float> wd(n * k), x(40 * k);
  for (auto& v : wd) v = dist(rng);
  for (auto& v : x) v = dist(rng);
  Weight w;
  w.type = WeightType::f32;
  w.data = wd.data();
  w.rows = n;
  w.cols = k;
  std::vector<float> all(40 * n), one(n);
  be->linear(x.data(), 40, w, all.data(), 0.f);
  for (int64_t r = 0; r < 40; ++r) {
    be->linear(x.data() + r * k, 1, w, one.data(), 0.f);
    ASSERT_EQ(0, std::memcmp(one.data(), all.data() + r * n, n * 4)) << "row " << r;
  }
}

}  // namespace
}  // namespace troupe::kernels::cpu
