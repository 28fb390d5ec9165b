// FP8 (e4m3) and FP4 (e2m1) weights with block scales on the CPU backend: every op
// that takes a Weight gives the same bits as it gives over the dequantized fp32
// matrix (each element code * scale, converted by base/dtype, the loader's
// converter), for whole matrices, row views that start inside a scale block,
// grouped products, experts and embedding rows. And the CUDA kernels' conversions of
// codes (kernels/cuda/codes.hpp, host and device alike) against base/dtype on every code.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "base/dtype.hpp"
#include "kernels/backend.hpp"
#include "kernels/cuda/codes.hpp"

namespace troupe::kernels {
namespace {

// A random quantized matrix and its dequantized twin, both in host (= CPU backend) memory.
struct Quantized {
  std::vector<uint8_t> codes;
  std::vector<float> scales;
  std::vector<float> dense;  // [rows, cols]: code * scale
  Weight w;                  // over codes / scales
  Weight f32;                // over dense
};

Quantized make(WeightType type, int64_t rows, int64_t cols, int bm, int bn, std::mt19937& rng, int exp_lo = -12,
               int exp_hi = 3) {
  Quantized q;
  const bool fp4 = type == WeightType::e2m1;
  const int64_t row_bytes = fp4 ? cols / 2 : cols;
  const int64_t sr = (rows + bm - 1) / bm, sc = (cols + bn - 1) / bn;
  q.codes.resize(static_cast<size_t>(rows * row_bytes));
  for (auto& c : q.codes) {
    do {
      c = static_cast<uint8_t>(rng());
    } while (!fp4 && (c & 0x7f) == 0x7f);  // e4m3fn's NaN codes
  }
  std::uniform_real_distribution<float> mant(0.5f, 1.0f);
  std::uniform_int_distribution<int> exp(exp_lo, exp_hi);
  q.scales.resize(static_cast<size_t>(sr * sc));
  for (auto& s : q.scales) s = std::ldexp(mant(rng), exp(rng));
  q.dense.resize(static_cast<size_t>(rows * cols));
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) {
      const float s = q.scales[static_cast<size_t>((r / bm) * sc + c / bn)];
      float v;
      if (fp4) {
        const uint8_t byte = q.codes[static_cast<size_t>(r * row_bytes + c / 2)];
        v = e2m1_to_f32((c & 1) ? static_cast<uint8_t>(byte >> 4) : static_cast<uint8_t>(byte & 0xf));
      } else {
        v = e4m3_to_f32(q.codes[static_cast<size_t>(r * cols + c)]);
      }
      q.dense[static_cast<size_t>(r * cols + c)] = v * s;
    }
  }
  q.w.data = q.codes.data();
  q.w.type = type;
  q.w.rows = rows;
  q.w.cols = cols;
  q.w.scale = q.scales.data();
  q.w.scale_stride = sc;
  q.w.block_rows = bm;
  q.w.block_cols = bn;
  q.f32.data = q.dense.data();
  q.f32.rows = rows;
  q.f32.cols = cols;
  return q;
}

std::vector<float> randn(int64_t n, std::mt19937& rng) {
  std::normal_distribution<float> d;
  std::vector<float> v(static_cast<size_t>(n));
  for (auto& x : v) x = d(rng);
  return v;
}

void expect_same_bits(const std::vector<float>& a, const std::vector<float>& b, const std::string& what) {
  ASSERT_EQ(a.size(), b.size()) << what;
  ASSERT_EQ(0, std::memcmp(a.data(), b.data(), a.size() * 4)) << what;
}

struct Case {
  WeightType type;
  int64_t rows, cols;
  int bm, bn;
};

const Case kCases[] = {
    {WeightType::e4m3, 300, 520, 128, 128},  // partial blocks both ways, k past one 512 pass
    {WeightType::e4m3, 64, 4096, 128, 128},  // V4's blocks, a product big enough for the helper threads
    {WeightType::e4m3, 37, 131, 32, 64},     // the fp8_fp4 fixture's blocks, odd shapes
    {WeightType::e4m3, 5, 7, 1, 1},          // a scale an element
    {WeightType::e2m1, 50, 256, 1, 32},      // V4's FP4 experts: a scale per 32 inputs of a row
    {WeightType::e2m1, 130, 1030, 1, 2},
    {WeightType::e2m1, 3, 64, 3, 64},
};

std::string name(const Case& c) {
  return std::string(c.type == WeightType::e4m3 ? "e4m3 " : "e2m1 ") + std::to_string(c.rows) + "x" +
         std::to_string(c.cols) + " blocks " + std::to_string(c.bm) + "x" + std::to_string(c.bn);
}

TEST(CpuQuantized, linear_equals_the_dequantized_matrix_bit_for_bit) {
  auto be = make_cpu_backend();
  ASSERT_TRUE(be->takes_quantized());
  std::mt19937 rng(11);
  for (const Case& c : kCases) {
    Quantized q = make(c.type, c.rows, c.cols, c.bm, c.bn, rng);
    for (int64_t m : {1, 2, 5, 13, 70}) {
      auto x = randn(m * c.cols, rng);
      std::vector<float> want(static_cast<size_t>(m * c.rows)), got(want.size());
      be->linear(x.data(), m, q.f32, want.data(), 0.0f);
      be->linear(x.data(), m, q.w, got.data(), 0.0f);
      expect_same_bits(got, want, name(c) + " m=" + std::to_string(m));
      // beta = 1 accumulates the same way
      auto base = randn(m * c.rows, rng);
      std::vector<float> want_acc = base, got_acc = base;
      be->linear(x.data(), m, q.f32, want_acc.data(), 1.0f);
      be->linear(x.data(), m, q.w, got_acc.data(), 1.0f);
      expect_same_bits(got_acc, want_acc, name(c) + " accumulate m=" + std::to_string(m));
    }
  }
}

TEST(CpuQuantized, row_views_start_inside_scale_blocks) {
  auto be = make_cpu_backend();
  std::mt19937 rng(12);
  for (const Case& c : kCases) {
    Quantized q = make(c.type, c.rows, c.cols, c.bm, c.bn, rng);
    const int64_t m = 3;
    auto x = randn(m * c.cols, rng);
    for (int64_t r0 : {int64_t{0}, int64_t{1}, c.rows / 3, c.rows - 1}) {
      for (int64_t n : {int64_t{1}, c.rows - r0}) {
        if (r0 + n > c.rows || n < 1) continue;
        const Weight view = weight_rows(q.w, r0, n);
        // A view of a view lands where one view of the sum does.
        const int64_t half = r0 / 2;
        const Weight nested = weight_rows(weight_rows(q.w, half, c.rows - half), r0 - half, n);
        std::vector<float> want(static_cast<size_t>(m * n)), got(want.size()), got_nested(want.size());
        be->linear(x.data(), m, weight_rows(q.f32, r0, n), want.data(), 0.0f);
        be->linear(x.data(), m, view, got.data(), 0.0f);
        be->linear(x.data(), m, nested, got_nested.data(), 0.0f);
        const std::string what = name(c) + " rows " + std::to_string(r0) + "+" + std::to_string(n);
        expect_same_bits(got, want, what);
        expect_same_bits(got_nested, want, what + " (nested view)");
      }
    }
  }
}

TEST(CpuQuantized, grouped_products_embedding_and_mhc_mixing) {
  auto be = make_cpu_backend();
  std::mt19937 rng(13);
  for (const Case& c : {Case{WeightType::e4m3, 256, 96, 32, 64}, Case{WeightType::e2m1, 120, 64, 1, 32}}) {
    Quantized q = make(c.type, c.rows, c.cols, c.bm, c.bn, rng);
    for (int groups : {1, 2, 4, 8}) {
      const int64_t m = 7;
      auto x = randn(m * groups * c.cols, rng);
      std::vector<float> want(static_cast<size_t>(m * c.rows)), got(want.size());
      be->linear_grouped(x.data(), m, q.f32, groups, want.data());
      be->linear_grouped(x.data(), m, q.w, groups, got.data());
      expect_same_bits(got, want, name(c) + " groups " + std::to_string(groups));
    }
    const std::vector<int32_t> ids = {0, 5, static_cast<int32_t>(c.rows - 1), 5, 31};
    for (int copies : {1, 3}) {
      std::vector<float> want(ids.size() * copies * c.cols), got(want.size());
      be->embed(q.f32, ids.data(), static_cast<int64_t>(ids.size()), copies, want.data());
      be->embed(q.w, ids.data(), static_cast<int64_t>(ids.size()), copies, got.data());
      expect_same_bits(got, want, name(c) + " embed copies " + std::to_string(copies));
    }
  }
  // mHC's mixing matrix [(2 + hc) * hc, hc * dim]
  MhcParams p;
  p.hc = 2;
  p.dim = 48;
  p.sinkhorn_iters = 5;
  // small scales keep the mix where sigmoids and the softmax differ
  Quantized fn = make(WeightType::e4m3, (2 + p.hc) * p.hc, p.hc * p.dim, 4, 32, rng, -16, -10);
  const int64_t rows = 5;
  auto X = randn(rows * p.hc * p.dim, rng);
  const std::vector<float> base(static_cast<size_t>((2 + p.hc) * p.hc), 0.1f), scale = {1.0f, 0.5f, 0.25f};
  std::vector<float> y1(static_cast<size_t>(rows * p.dim)), y2(y1.size()), post1(rows * p.hc), post2(post1.size()),
      comb1(rows * p.hc * p.hc), comb2(comb1.size());
  be->mhc_pre(X.data(), rows, fn.f32, base.data(), scale.data(), p, y1.data(), post1.data(), comb1.data());
  be->mhc_pre(X.data(), rows, fn.w, base.data(), scale.data(), p, y2.data(), post2.data(), comb2.data());
  expect_same_bits(y2, y1, "mhc_pre y");
  expect_same_bits(post2, post1, "mhc_pre post");
  expect_same_bits(comb2, comb1, "mhc_pre comb");
}

TEST(CpuQuantized, experts_from_one_stacked_gate_up_tensor) {
  // The loader's form of transformers' merged experts: gate_up [2I, D] per expert,
  // gate = rows [0, I), up = rows [I, 2I) (I not a multiple of the block's rows, so
  // `up` starts inside a scale block).
  auto be = make_cpu_backend();
  std::mt19937 rng(14);
  const int experts = 4, k = 2;
  const int64_t D = 64, I = 40, rows = 9;
  for (WeightType type : {WeightType::e4m3, WeightType::e2m1}) {
    const int bm = type == WeightType::e4m3 ? 32 : 1, bn = 32;
    std::vector<Quantized> gate_up, down;
    std::vector<Weight> gq, uq, dq, gf, uf, df;
    for (int e = 0; e < experts; ++e) {
      gate_up.push_back(make(type, 2 * I, D, bm, bn, rng));
      down.push_back(make(type, D, I, bm, bn, rng));
    }
    for (int e = 0; e < experts; ++e) {
      gq.push_back(weight_rows(gate_up[e].w, 0, I));
      uq.push_back(weight_rows(gate_up[e].w, I, I));
      dq.push_back(down[e].w);
      gf.push_back(weight_rows(gate_up[e].f32, 0, I));
      uf.push_back(weight_rows(gate_up[e].f32, I, I));
      df.push_back(down[e].f32);
    }
    auto x = randn(rows * D, rng);
    std::vector<int32_t> idx(rows * k);
    std::vector<float> weight(rows * k);
    for (int64_t r = 0; r < rows; ++r) {
      idx[r * k] = static_cast<int32_t>(r % experts);
      idx[r * k + 1] = static_cast<int32_t>((r + 1 + r / 3) % experts);
      weight[r * k] = 0.7f;
      weight[r * k + 1] = 0.3f;
    }
    std::vector<float> want(static_cast<size_t>(rows * D), 0.0f), got(want.size(), 0.0f);
    be->moe(x.data(), rows, D, idx.data(), weight.data(), k, experts, gf.data(), uf.data(), df.data(), 7.0f,
            want.data());
    be->moe(x.data(), rows, D, idx.data(), weight.data(), k, experts, gq.data(), uq.data(), dq.data(), 7.0f,
            got.data());
    expect_same_bits(got, want, type == WeightType::e4m3 ? "moe e4m3" : "moe e2m1");
  }
}

// The CUDA kernels read e2m1 and e4m3 codes by placing bits and multiplying by a power of two; those very
// functions, here on the host, give base/dtype's values for every code at every position of a word (-0 for e2m1
// code 8 and e4m3 code 0x80 included; e4m3's NaN codes aside).
TEST(CudaCodes, bit_placement_gives_every_code_its_value) {
  uint32_t checked = 0;
  for (uint32_t c = 0; c < 16; ++c) {
    for (int j = 0; j < 8; ++j) {
      const uint32_t word = (c << (4 * j)) | (((c + 5u) & 15u) << (4 * ((j + 3) % 8)));  // a neighbour too
      const float got = cuda::e2m1_at(word, j), want = e2m1_to_f32(static_cast<uint8_t>(c));
      ASSERT_EQ(got, want) << "e2m1 code " << c << " at nibble " << j;
      ASSERT_EQ(std::signbit(got), std::signbit(want)) << "e2m1 code " << c << " at nibble " << j;
      ++checked;
    }
  }
  for (uint32_t c = 0; c < 256; ++c) {
    if ((c & 0x7fu) == 0x7fu) continue;  // NaN codes: read as finite by the kernels (codes.hpp)
    for (int j = 0; j < 4; ++j) {
      const uint32_t word = (c << (8 * j)) | (((c * 37u + 11u) & 255u) << (8 * ((j + 1) % 4)));  // a neighbour too
      const float got = cuda::e4m3_at(word, j), want = e4m3_to_f32(static_cast<uint8_t>(c));
      ASSERT_EQ(got, want) << "e4m3 code " << c << " at byte " << j;
      ASSERT_EQ(std::signbit(got), std::signbit(want)) << "e4m3 code " << c << " at byte " << j;
      ++checked;
    }
  }
  EXPECT_EQ(checked, 16u * 8u + 254u * 4u);
}

}  // namespace
}  // namespace troupe::kernels
