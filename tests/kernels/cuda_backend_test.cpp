// The CUDA backend against the CPU backend (the oracle), op by op, on random
// inputs of many shapes including V4-Flash's (hidden 4096, 64 heads x 512,
// indexer 64 x 128 with top-512, window 128). GPU outputs are NaN-poisoned
// before every run. Skips without a CUDA device.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <cstdio>
#include <cstring>
#include <limits>
#include <numeric>
#include <set>
#include <stdexcept>

#include "tests/kernels/backend_pair.hpp"

namespace troupe::kernels::testing {
namespace {

class CudaBackendTest : public ::testing::Test {
 protected:
  void SetUp() override {
    gpu_ = make_cuda_backend(0);
    if (!gpu_) GTEST_SKIP() << "no CUDA device";
    cpu_ = make_cpu_backend();
  }
  static void TearDownTestSuite() {
    if (error_log().empty()) return;
    std::printf("\n%-60s %s\n", "test", "max relative error (L2)");
    for (const auto& [name, rel] : error_log()) std::printf("%-60s %.3e\n", name.c_str(), rel);
  }
  Backend& cpu() { return *cpu_; }
  Backend& gpu() { return *gpu_; }

  template <class T>
  T* upload(Backend& b, const std::vector<T>& host) {
    void* p = b.alloc(std::max<size_t>(host.size() * sizeof(T), 4));
    if (!host.empty()) b.to_device(p, host.data(), host.size() * sizeof(T));
    owned_.push_back({&b, p});
    return static_cast<T*>(p);
  }
  void TearDown() override {
    for (auto& [b, p] : owned_) b->free(p);
  }

  std::unique_ptr<Backend> cpu_, gpu_;
  std::vector<std::pair<Backend*, void*>> owned_;
  std::mt19937 rng_{20261130};
};

// Whether CudaBackend's half-precision cuBLAS GEMMs of m rows take x as two 16-bit terms (backend.cu's
// gemm_split; then fp32-exact up to the terms' ~16 bits): TROUPE_GEMM_SPLIT unset or 1 at every m, 2 from
// 128 rows, 0 never. gemm_split(1): at every shape.
bool gemm_split(int64_t m) {
  const char* e = std::getenv("TROUPE_GEMM_SPLIT");
  const char mode = e == nullptr ? '1' : e[0];
  return mode != '0' && (mode != '2' || m >= 128);
}

// linear_multi: several weights over the same x in one launch (the decode step's projections),
// for every row count the fused form takes (1, exact 2 and 3, 4-row tiles) and those it leaves to
// cuBLAS (9 and 40: x converted once for the half weights, the split products' halves added in one
// launch; 130: two passes); and a list of mixed types (an f32 weight and a 64-row one among bf16 ones:
// the half GEMMs grouped, the others one by one).
TEST_F(CudaBackendTest, linear_multi_matches_cpu_for_every_row_count) {
  const int64_t k = 1024;
  struct Case {
    std::vector<WeightType> types;
    std::vector<int64_t> outs;
  };
  const Case cases[] = {{{WeightType::bf16, WeightType::bf16, WeightType::bf16}, {1536, 512, 64}},
                        {{WeightType::f32, WeightType::f32, WeightType::f32}, {1536, 512, 64}},
                        {{WeightType::bf16, WeightType::f32, WeightType::bf16, WeightType::bf16}, {1536, 512, 64, 700}}};
  for (const Case& c : cases) {
    for (int64_t m : {1, 2, 3, 4, 9, 40, 130}) {
      SCOPED_TRACE("types " + std::to_string(c.types.size()) + " first " +
                   std::to_string(static_cast<int>(c.types[0])) + " m " + std::to_string(m));
      std::vector<std::unique_ptr<MirrorWeight>> ws;
      std::vector<std::unique_ptr<Mirror>> ys;
      std::vector<Weight> cw, gw;
      std::vector<float*> cy, gy;
      for (size_t i = 0; i < c.outs.size(); ++i) {
        ws.push_back(std::make_unique<MirrorWeight>(cpu(), gpu(), c.outs[i], k, c.types[i], rng_));
        ys.push_back(std::make_unique<Mirror>(cpu(), gpu(), m * c.outs[i] * 4));
        ys.back()->poison();
        cw.push_back(ws.back()->cw);
        gw.push_back(ws.back()->gw);
        cy.push_back(ys.back()->cpu());
        gy.push_back(ys.back()->gpu());
      }
      Mirror x(cpu(), gpu(), randn(m * k, rng_));
      cpu().linear_multi(x.cpu(), m, cw.data(), cy.data(), static_cast<int>(cw.size()));
      gpu().linear_multi(x.gpu(), m, gw.data(), gy.data(), static_cast<int>(gw.size()));
      for (size_t i = 0; i < ys.size(); ++i) {
        const bool exact = m <= 8 || c.types[i] == WeightType::f32 || gemm_split(m);  // as in the linear test
        EXPECT_CLOSE(ys[i]->gpu_host(m * c.outs[i]), ys[i]->cpu_host(m * c.outs[i]), exact ? 2e-5 : 1e-2);
      }
    }
  }
}

TEST_F(CudaBackendTest, linear_matches_cpu_for_every_weight_type_and_shape) {
  struct Shape {
    int64_t m, n, k;
  };
  const Shape shapes[] = {{1, 64, 256},  {1, 4096, 4096}, {3, 1000, 520}, {8, 2048, 1024}, {5, 24, 16384},
                          {17, 1024, 4096}, {64, 4096, 1024}, {300, 512, 256}, {2, 7, 12},
                          {4, 4096, 1024}, {3, 2500, 512}, {4, 2000, 512}, {4, 16400, 128}, {7, 1000, 320},
                          {2, 4096, 1024}, {2, 300, 256}, {3, 2048, 1024}, {4, 600, 512},
                          {4, 16388, 1024}, {6, 4500, 4096}, {8, 4400, 6144}, {3, 4500, 4096}, {8, 4400, 6208},
                          {8, 4400, 2112}, {3, 4500, 2048}, {4, 4096, 8192}, {5, 4500, 4416},
                          {127, 1024, 4096}, {128, 1024, 4096}, {24, 1000, 1024}, {40, 4100, 2048}};
  // (3 x 2500, 4 x 600: x rows 3-4 on gemv_core's 4-row tiles (more outputs than one wave of 16-row tensor-core
  // CTAs, or fewer than 1,024); 3 x 2048 and 4 x 2000 on the tensor cores' one-wave form (16 warps); 4 and 7 rows
  // on the tensor cores, three blocks in flight (4 x 4096 x 1024, 7 x 1000: partial 16-row tiles) and two (4 x
  // 16400 x 128); 2 rows on the exact-row kernels, 4-row tiles and one-row tiles (2 x 300); the persistent
  // register-ring form past two waves of tiles with k < 2,048 (4 x 16388 x 1024, a partial last tile); past one
  // wave with k >= 2,048 the shared-memory ring form (6 / 3 x 4500 x 4096, 3 x 4500 x 2048, 8 x 4400 x 2112: warp
  // 0 has three blocks a tile, the others two) and its windows of k (4 x 4096 x 8192; 8 x 4400 x 6144 and 6208:
  // a second window of 32 / 33 blocks; 5 x 4500 x 4416: a second window of 5 blocks, most warps none))
  for (WeightType type : {WeightType::f32, WeightType::bf16, WeightType::f16}) {
    for (const auto& s : shapes) {
      SCOPED_TRACE("type " + std::to_string(static_cast<int>(type)) + " m " + std::to_string(s.m) + " n " +
                   std::to_string(s.n) + " k " + std::to_string(s.k));
      MirrorWeight w(cpu(), gpu(), s.n, s.k, type, rng_);
      Mirror x(cpu(), gpu(), randn(s.m * s.k, rng_));
      Mirror y(cpu(), gpu(), s.m * s.n * 4);
      y.poison();
      cpu().linear(x.cpu(), s.m, w.cw, y.cpu(), 0.f);
      gpu().linear(x.gpu(), s.m, w.gw, y.gpu(), 0.f);
      // Exact fp32 activations on the GEMV path and for fp32 weights; on the cuBLAS path activations split
      // into two 16-bit terms (gemm_split: the terms' rows stacked into one GEMM below 128 rows, as 17 x 1024
      // x 4096, 64 x 4096 x 1024 and 127 x 1024 x 4096; two passes from 128 rows), else rounded.
      const bool exact = s.m <= 8 || s.n <= 64 || type == WeightType::f32 || gemm_split(s.m);
      EXPECT_CLOSE(y.gpu_host(s.m * s.n), y.cpu_host(s.m * s.n), exact ? 2e-5 : 1e-2);
    }
  }
}

TEST_F(CudaBackendTest, linear_accumulates_with_beta_one) {
  struct Shape {
    int64_t m, n, k;
  };
  // (4 x 4500 x 1024: the persistent tensor-core GEMV; 5 x 4500 x 4096: its shared-memory ring form; 3 x 4500 x
  // 8192: the ring's two windows of k, the second adding to the first)
  for (const auto& s : {Shape{1, 384, 512}, Shape{6, 384, 512}, Shape{40, 384, 512}, Shape{4, 4500, 1024},
                        Shape{5, 4500, 4096}, Shape{3, 4500, 8192}, Shape{40, 384, 4096}}) {
    MirrorWeight w(cpu(), gpu(), s.n, s.k, WeightType::bf16, rng_);
    Mirror x(cpu(), gpu(), randn(s.m * s.k, rng_));
    Mirror y(cpu(), gpu(), randn(s.m * s.n, rng_));
    cpu().linear(x.cpu(), s.m, w.cw, y.cpu(), 1.f);
    gpu().linear(x.gpu(), s.m, w.gw, y.gpu(), 1.f);
    EXPECT_CLOSE(y.gpu_host(s.m * s.n), y.cpu_host(s.m * s.n), s.m <= 8 || gemm_split(s.m) ? 2e-5 : 1e-2);
  }
}

TEST_F(CudaBackendTest, linear_grouped_matches_cpu) {
  struct Shape {
    int64_t m, groups, out, k;
  };
  for (const auto& s : {Shape{1, 8, 1024, 4096}, Shape{3, 8, 256, 512}, Shape{6, 4, 256, 512}, Shape{40, 4, 64, 128},
                        Shape{9, 2, 64, 64}, Shape{24, 4, 256, 512}, Shape{33, 8, 128, 1024}}) {
    for (WeightType type : {WeightType::f32, WeightType::bf16}) {
      MirrorWeight w(cpu(), gpu(), s.groups * s.out, s.k, type, rng_);
      Mirror x(cpu(), gpu(), randn(s.m * s.groups * s.k, rng_));
      Mirror y(cpu(), gpu(), s.m * s.groups * s.out * 4);
      y.poison();
      cpu().linear_grouped(x.cpu(), s.m, w.cw, static_cast<int>(s.groups), y.cpu());
      gpu().linear_grouped(x.gpu(), s.m, w.gw, static_cast<int>(s.groups), y.gpu());
      const bool exact = s.m <= 8 || type == WeightType::f32 || gemm_split(s.m);  // GEMV: fp32 activations
      EXPECT_CLOSE(y.gpu_host(s.m * s.groups * s.out), y.cpu_host(s.m * s.groups * s.out), exact ? 2e-5 : 1e-2);
    }
  }
}

TEST_F(CudaBackendTest, rmsnorm_matches_cpu_in_place_and_unweighted) {
  struct Shape {
    int64_t rows, dim;
  };
  for (const auto& s : {Shape{64 * 3, 512}, Shape{3, 4096}, Shape{5, 7}, Shape{2, 1024}}) {
    Mirror x(cpu(), gpu(), randn(s.rows * s.dim, rng_, 3.f));
    Mirror w(cpu(), gpu(), randn(s.dim, rng_));
    Mirror y(cpu(), gpu(), s.rows * s.dim * 4);
    y.poison();
    cpu().rmsnorm(x.cpu(), w.cpu(), y.cpu(), s.rows, s.dim, 1e-6f);
    gpu().rmsnorm(x.gpu(), w.gpu(), y.gpu(), s.rows, s.dim, 1e-6f);
    EXPECT_CLOSE(y.gpu_host(s.rows * s.dim), y.cpu_host(s.rows * s.dim), 1e-5);
    cpu().rmsnorm(x.cpu(), nullptr, x.cpu(), s.rows, s.dim, 1e-6f);
    gpu().rmsnorm(x.gpu(), nullptr, x.gpu(), s.rows, s.dim, 1e-6f);
    EXPECT_CLOSE(x.gpu_host(s.rows * s.dim), x.cpu_host(s.rows * s.dim), 1e-5);
  }
}

TEST_F(CudaBackendTest, rope_turns_and_unturns_like_cpu) {
  const int64_t rows = 6, hd = 512, rope_dim = 64;
  for (int heads : {64, 1}) {
    std::vector<float> inv(rope_dim / 2);
    for (int64_t i = 0; i < rope_dim / 2; ++i) inv[i] = std::pow(160000.f, -2.f * i / rope_dim);
    Mirror f(cpu(), gpu(), inv);
    std::vector<int64_t> pos = {0, 1, 127, 4096, 262143, 1048575};
    Mirror p(cpu(), gpu(), pos);
    Mirror x(cpu(), gpu(), randn(rows * heads * hd, rng_));
    for (bool inverse : {false, true}) {
      RopeTable tc{f.cpu(), rope_dim, 1.25f}, tg{f.gpu(), rope_dim, 1.25f};
      cpu().rope(x.cpu(), rows, heads, hd, tc, p.cpu<int64_t>(), inverse);
      gpu().rope(x.gpu(), rows, heads, hd, tg, p.gpu<int64_t>(), inverse);
      EXPECT_CLOSE(x.gpu_host(rows * heads * hd), x.cpu_host(rows * heads * hd), 1e-5);
    }
  }
}

// The fused norm and RoPE: within rounding of the CPU's two calls, and bit for bit the GPU's own
// rmsnorm() then rope() (the decode step and prefill take the fused form).
TEST_F(CudaBackendTest, rmsnorm_rope_matches_cpu_and_the_two_calls) {
  struct Shape {
    int64_t rows;
    int heads;
    int64_t hd, rope_dim;
    bool weighted, in_place;
  };
  for (const auto& s : {Shape{6, 64, 512, 64, false, true}, Shape{5, 1, 512, 64, true, true},
                        Shape{3, 8, 48, 24, true, false}, Shape{2, 3, 1032, 64, false, false},
                        Shape{4, 2, 64, 64, true, true}, Shape{1, 5, 16, 0, false, false}}) {
    const int64_t n = s.rows * s.heads * s.hd;
    std::vector<float> inv(std::max<int64_t>(s.rope_dim / 2, 1));
    for (size_t i = 0; i < inv.size(); ++i) inv[i] = std::pow(10000.f, -2.f * i / std::max<int64_t>(s.rope_dim, 2));
    Mirror f(cpu(), gpu(), inv);
    std::vector<int64_t> pos = {0, 1, 127, 4096, 262143, 1048575};
    pos.resize(s.rows);
    Mirror p(cpu(), gpu(), pos);
    Mirror x(cpu(), gpu(), randn(n, rng_, 3.f));
    Mirror w(cpu(), gpu(), randn(s.hd, rng_));
    Mirror y(cpu(), gpu(), n * 4);
    Mirror two(cpu(), gpu(), n * 4);  // the GPU's rmsnorm() then rope()
    y.poison();
    two.poison();
    const float* wc = s.weighted ? w.cpu() : nullptr;
    const float* wg = s.weighted ? w.gpu() : nullptr;
    RopeTable tc{f.cpu(), s.rope_dim, 1.25f}, tg{f.gpu(), s.rope_dim, 1.25f};
    gpu().rmsnorm(x.gpu(), wg, two.gpu(), s.rows * s.heads, s.hd, 1e-6f);
    gpu().rope(two.gpu(), s.rows, s.heads, s.hd, tg, p.gpu<int64_t>(), false);
    float* yc = s.in_place ? x.cpu() : y.cpu();
    float* yg = s.in_place ? x.gpu() : y.gpu();
    const auto x_before = x.gpu_host(n);
    cpu().rmsnorm_rope(x.cpu(), wc, yc, s.rows, s.heads, s.hd, 1e-6f, tc, p.cpu<int64_t>());
    gpu().rmsnorm_rope(x.gpu(), wg, yg, s.rows, s.heads, s.hd, 1e-6f, tg, p.gpu<int64_t>());
    const auto got = s.in_place ? x.gpu_host(n) : y.gpu_host(n);
    EXPECT_CLOSE(got, s.in_place ? x.cpu_host(n) : y.cpu_host(n), 1e-5);
    const auto ref = two.gpu_host(n);
    size_t differ = 0;
    for (int64_t i = 0; i < n; ++i) differ += std::memcmp(&got[i], &ref[i], 4) != 0;
    EXPECT_EQ(differ, 0u) << "rows " << s.rows << " heads " << s.heads << " hd " << s.hd;
    if (!s.in_place) {
      EXPECT_EQ(x.gpu_host(n), x_before);
    }
  }
}

TEST_F(CudaBackendTest, row_moves_match_cpu) {
  const int64_t rows = 5, dim = 4096, vocab = 300;
  // add_position_bias
  Mirror x(cpu(), gpu(), randn(rows * dim, rng_));
  Mirror bias(cpu(), gpu(), randn(4 * dim, rng_));
  Mirror pos(cpu(), gpu(), std::vector<int64_t>{0, 5, 6, 7, 1000});
  cpu().add_position_bias(x.cpu(), rows, dim, pos.cpu<int64_t>(), bias.cpu(), 4);
  gpu().add_position_bias(x.gpu(), rows, dim, pos.gpu<int64_t>(), bias.gpu(), 4);
  EXPECT_CLOSE(x.gpu_host(rows * dim), x.cpu_host(rows * dim), 1e-6);
  // gather_rows
  Mirror idx(cpu(), gpu(), std::vector<int64_t>{4, 0, 2});
  Mirror out(cpu(), gpu(), 3 * dim * 4);
  out.poison();
  cpu().gather_rows(x.cpu(), dim, idx.cpu<int64_t>(), 3, out.cpu());
  gpu().gather_rows(x.gpu(), dim, idx.gpu<int64_t>(), 3, out.gpu());
  EXPECT_CLOSE(out.gpu_host(3 * dim), out.cpu_host(3 * dim), 0.0);
  // copy_rows: rows of x into out in another order
  std::vector<const float*> cs, gs;
  std::vector<float*> cd, gd;
  for (int i = 0; i < 3; ++i) {
    cs.push_back(x.cpu() + (i + 1) * dim);
    gs.push_back(x.gpu() + (i + 1) * dim);
    cd.push_back(out.cpu() + (2 - i) * dim);
    gd.push_back(out.gpu() + (2 - i) * dim);
  }
  out.poison();
  cpu().copy_rows(upload(cpu(), cd), upload(cpu(), cs), 3, dim);
  gpu().copy_rows(upload(gpu(), gd), upload(gpu(), gs), 3, dim);
  EXPECT_CLOSE(out.gpu_host(3 * dim), out.cpu_host(3 * dim), 0.0);
  // embed (bf16 table, 4 copies)
  MirrorWeight table(cpu(), gpu(), vocab, 256, WeightType::bf16, rng_);
  Mirror ids(cpu(), gpu(), std::vector<int32_t>{3, 299, 0, 17});
  Mirror e(cpu(), gpu(), 4 * 4 * 256 * 4);
  e.poison();
  cpu().embed(table.cw, ids.cpu<int32_t>(), 4, 4, e.cpu());
  gpu().embed(table.gw, ids.gpu<int32_t>(), 4, 4, e.gpu());
  EXPECT_CLOSE(e.gpu_host(4 * 4 * 256), e.cpu_host(4 * 4 * 256), 0.0);
  // rows wider than a CTA's columns, the last chunk partial (4,100 = 16 x 256 + 4)
  MirrorWeight wide(cpu(), gpu(), 40, 4100, WeightType::bf16, rng_);
  Mirror wide_ids(cpu(), gpu(), std::vector<int32_t>{39, 0, 7});
  Mirror we(cpu(), gpu(), 3 * 2 * 4100 * 4);
  we.poison();
  cpu().embed(wide.cw, wide_ids.cpu<int32_t>(), 3, 2, we.cpu());
  gpu().embed(wide.gw, wide_ids.gpu<int32_t>(), 3, 2, we.gpu());
  EXPECT_CLOSE(we.gpu_host(3 * 2 * 4100), we.cpu_host(3 * 2 * 4100), 0.0);
}

TEST_F(CudaBackendTest, mhc_pre_post_head_match_cpu) {
  // hc 4 x 4096: V4's shape (the fused kernels, width split in 32 slices, the row staged in shared memory);
  // 200: a partial last slice; hc 8 x 1032: the most streams; hc 2 x 8200: more norm-weight float4s a thread
  // than the finish requests early; hc 8 x 4200: a row too wide to stage (X read from global memory); hc 3 x 6:
  // a width the fused form refuses (the unfused path).
  const std::pair<int, int64_t> shapes[] = {{4, 4096}, {4, 256}, {4, 200},  {3, 1000},
                                            {8, 1032}, {2, 8200}, {8, 4200}, {3, 6}};
  for (const auto& [hc, dim] : shapes) {
    for (int64_t rows : {1, 5, 33}) {
      SCOPED_TRACE("hc " + std::to_string(hc) + " dim " + std::to_string(dim) + " rows " + std::to_string(rows));
      MhcParams p{hc, dim, 20, 1e-6f, 1e-6f};
      MirrorWeight fn(cpu(), gpu(), (2 + hc) * hc, hc * dim, WeightType::bf16, rng_, 0.02f);
      MirrorWeight head_fn(cpu(), gpu(), hc, hc * dim, WeightType::bf16, rng_, 0.02f);
      Mirror base(cpu(), gpu(), randn((2 + hc) * hc, rng_, 0.5f));
      Mirror scale(cpu(), gpu(), std::vector<float>{0.7f, 1.3f, 2.0f});
      Mirror X(cpu(), gpu(), randn(rows * hc * dim, rng_));
      Mirror y(cpu(), gpu(), rows * dim * 4), post(cpu(), gpu(), rows * hc * 4), comb(cpu(), gpu(), rows * hc * hc * 4);
      y.poison();
      post.poison();
      comb.poison();
      cpu().mhc_pre(X.cpu(), rows, fn.cw, base.cpu(), scale.cpu(), p, y.cpu(), post.cpu(), comb.cpu());
      gpu().mhc_pre(X.gpu(), rows, fn.gw, base.gpu(), scale.gpu(), p, y.gpu(), post.gpu(), comb.gpu());
      EXPECT_CLOSE(y.gpu_host(rows * dim), y.cpu_host(rows * dim), 1e-5);
      EXPECT_CLOSE(post.gpu_host(rows * hc), post.cpu_host(rows * hc), 1e-5);
      EXPECT_CLOSE(comb.gpu_host(rows * hc * hc), comb.cpu_host(rows * hc * hc), 1e-5);
      // mhc_pre with the layer's RMSNorm in one call: bit for bit mhc_pre then rmsnorm.
      Mirror normw(cpu(), gpu(), randn(dim, rng_, 0.5f)), yn(cpu(), gpu(), rows * dim * 4);
      yn.poison();
      cpu().mhc_pre_norm(X.cpu(), rows, fn.cw, base.cpu(), scale.cpu(), p, normw.cpu(), 1e-6f, yn.cpu(), post.cpu(),
                         comb.cpu());
      gpu().mhc_pre_norm(X.gpu(), rows, fn.gw, base.gpu(), scale.gpu(), p, normw.gpu(), 1e-6f, yn.gpu(), post.gpu(),
                         comb.gpu());
      EXPECT_CLOSE(yn.gpu_host(rows * dim), yn.cpu_host(rows * dim), 1e-5);
      {
        Mirror yp(cpu(), gpu(), rows * dim * 4);
        gpu().rmsnorm(y.gpu(), normw.gpu(), yp.gpu(), rows, dim, 1e-6f);
        const auto fused = yn.gpu_host(rows * dim), pair = yp.gpu_host(rows * dim);
        EXPECT_TRUE(fused == pair) << "mhc_pre_norm differs from mhc_pre + rmsnorm";
      }
      if (rows > 1) {  // a row's result does not depend on the rows run with it (decode = forward)
        Mirror y1(cpu(), gpu(), dim * 4), post1(cpu(), gpu(), hc * 4), comb1(cpu(), gpu(), hc * hc * 4);
        y1.poison();
        const int64_t last = rows - 1;
        gpu().mhc_pre(X.gpu() + last * hc * dim, 1, fn.gw, base.gpu(), scale.gpu(), p, y1.gpu(), post1.gpu(),
                      comb1.gpu());
        const auto all_y = y.gpu_host(rows * dim), all_comb = comb.gpu_host(rows * hc * hc);
        const auto one_y = y1.gpu_host(dim), one_comb = comb1.gpu_host(hc * hc);
        EXPECT_TRUE(std::equal(one_y.begin(), one_y.end(), all_y.begin() + last * dim));
        EXPECT_TRUE(std::equal(one_comb.begin(), one_comb.end(), all_comb.begin() + last * hc * hc));
      }
      Mirror f(cpu(), gpu(), randn(rows * dim, rng_));
      cpu().mhc_post(X.cpu(), rows, f.cpu(), post.cpu(), comb.cpu(), p);
      gpu().mhc_post(X.gpu(), rows, f.gpu(), post.gpu(), comb.gpu(), p);
      EXPECT_CLOSE(X.gpu_host(rows * hc * dim), X.cpu_host(rows * hc * dim), 1e-5);
      MhcParams hp{hc, dim, 0, 1e-6f, 1e-6f};
      y.poison();
      cpu().mhc_head(X.cpu(), rows, head_fn.cw, base.cpu(), scale.cpu(), hp, y.cpu());
      gpu().mhc_head(X.gpu(), rows, head_fn.gw, base.gpu(), scale.gpu(), hp, y.gpu());
      EXPECT_CLOSE(y.gpu_host(rows * dim), y.cpu_host(rows * dim), 1e-5);
      yn.poison();
      cpu().mhc_head_norm(X.cpu(), rows, head_fn.cw, base.cpu(), scale.cpu(), hp, nullptr, 1e-6f, yn.cpu());
      gpu().mhc_head_norm(X.gpu(), rows, head_fn.gw, base.gpu(), scale.gpu(), hp, nullptr, 1e-6f, yn.gpu());
      EXPECT_CLOSE(yn.gpu_host(rows * dim), yn.cpu_host(rows * dim), 1e-5);
      {
        Mirror yp(cpu(), gpu(), rows * dim * 4);
        gpu().rmsnorm(y.gpu(), nullptr, yp.gpu(), rows, dim, 1e-6f);
        const auto fused = yn.gpu_host(rows * dim), pair = yp.gpu_host(rows * dim);
        EXPECT_TRUE(fused == pair) << "mhc_head_norm differs from mhc_head + rmsnorm";
      }
    }
  }
}

TEST_F(CudaBackendTest, compress_matches_cpu_for_csa_and_hca_windows) {
  struct Case {
    int slots;
    int64_t dim, rope_dim, entries;
  };
  for (const auto& c : {Case{8, 512, 64, 37}, Case{8, 128, 64, 64}, Case{128, 512, 64, 5}, Case{16, 64, 16, 9},
                        Case{4, 6, 2, 3}}) {
    const int64_t pool_rows = c.entries * c.slots;
    Mirror kv(cpu(), gpu(), randn(pool_rows * c.dim, rng_));
    Mirror sc(cpu(), gpu(), randn(pool_rows * c.dim, rng_, 2.f));
    Mirror w(cpu(), gpu(), randn(c.dim, rng_));
    std::vector<float> inv(c.rope_dim / 2);
    for (size_t i = 0; i < inv.size(); ++i) inv[i] = std::pow(160000.f, -2.f * i / c.rope_dim);
    Mirror f(cpu(), gpu(), inv);
    std::vector<int64_t> positions(c.entries);
    for (int64_t e = 0; e < c.entries; ++e) positions[e] = e * 4 + (e % 3) * 100000;
    Mirror pos(cpu(), gpu(), positions);
    Mirror out(cpu(), gpu(), c.entries * c.dim * 4);
    out.poison();
    std::vector<const float*> ckv, csc, gkv, gsc;
    std::vector<float*> cout, gout;
    for (int64_t e = 0; e < c.entries; ++e) {
      for (int s = 0; s < c.slots; ++s) {
        const int64_t r = (e * c.slots + (s * 7) % c.slots);
        const bool empty = (e == 0 && s < c.slots / 2) || (e == 2 && s == 1);  // CSA's first window, a hole
        ckv.push_back(empty ? nullptr : kv.cpu() + r * c.dim);
        csc.push_back(empty ? nullptr : sc.cpu() + r * c.dim);
        gkv.push_back(empty ? nullptr : kv.gpu() + r * c.dim);
        gsc.push_back(empty ? nullptr : sc.gpu() + r * c.dim);
      }
      cout.push_back(out.cpu() + (c.entries - 1 - e) * c.dim);
      gout.push_back(out.gpu() + (c.entries - 1 - e) * c.dim);
    }
    RopeTable tc{f.cpu(), c.rope_dim, 1.f}, tg{f.gpu(), c.rope_dim, 1.f};
    cpu().compress(c.entries, c.slots, c.dim, upload(cpu(), ckv), upload(cpu(), csc), w.cpu(), 1e-6f,
                   pos.cpu<int64_t>(), tc, upload(cpu(), cout));
    gpu().compress(c.entries, c.slots, c.dim, upload(gpu(), gkv), upload(gpu(), gsc), w.gpu(), 1e-6f,
                   pos.gpu<int64_t>(), tg, upload(gpu(), gout));
    EXPECT_CLOSE(out.gpu_host(c.entries * c.dim), out.cpu_host(c.entries * c.dim), 1e-5);
  }
}

TEST_F(CudaBackendTest, indexer_topk_picks_the_cpu_set) {
  struct Case {
    int heads;
    int64_t dim;
    int k;
    std::vector<int64_t> lengths;
  };
  const Case cases[] = {{64, 128, 512, {0, 100, 512, 513, 3000, 20000}}, {4, 32, 16, {3, 64, 65, 1000}},
                        {64, 128, 2048, {5000}},
                        // 64-key CTAs staging the keys 64 channels at a time: a last pass of 32
                        {16, 96, 64, {5, 40000}}};
  for (const auto& c : cases) {
    const int64_t n = static_cast<int64_t>(c.lengths.size());
    const int64_t pool_rows = *std::max_element(c.lengths.begin(), c.lengths.end()) + 7;
    std::vector<float> pool = randn(pool_rows * c.dim, rng_);
    std::vector<float> q = randn(n * c.heads * c.dim, rng_), w = randn(n * c.heads, rng_);
    Mirror P(cpu(), gpu(), pool), Q(cpu(), gpu(), q), Wt(cpu(), gpu(), w);
    std::vector<const float*> crows, grows;
    std::vector<int64_t> offsets{0};
    std::vector<std::vector<int64_t>> row_ids(n);
    for (int64_t t = 0; t < n; ++t) {
      for (int64_t s = 0; s < c.lengths[t]; ++s) {
        const int64_t r = (s * 13 + t) % pool_rows;
        row_ids[t].push_back(r);
        crows.push_back(P.cpu() + r * c.dim);
        grows.push_back(P.gpu() + r * c.dim);
      }
      offsets.push_back(static_cast<int64_t>(crows.size()));
    }
    Mirror idx(cpu(), gpu(), n * c.k * 4), cnt(cpu(), gpu(), n * 4);
    idx.poison();
    cnt.poison();
    const float scale = 1.f / std::sqrt(static_cast<float>(c.dim)), wscale = 1.f / std::sqrt(static_cast<float>(c.heads));
    cpu().indexer_topk(Q.cpu(), Wt.cpu(), n, c.heads, c.dim, scale, wscale, {upload(cpu(), crows), upload(cpu(), offsets)},
                       c.k, idx.cpu<int32_t>(), cnt.cpu<int32_t>());
    gpu().indexer_topk(Q.gpu(), Wt.gpu(), n, c.heads, c.dim, scale, wscale, {upload(gpu(), grows), upload(gpu(), offsets)},
                       c.k, idx.gpu<int32_t>(), cnt.gpu<int32_t>());
    const auto gi = idx.gpu_host<int32_t>(n * c.k), ci = idx.cpu_host<int32_t>(n * c.k);
    const auto gc = cnt.gpu_host<int32_t>(n), cc = cnt.cpu_host<int32_t>(n);
    for (int64_t t = 0; t < n; ++t) {
      SCOPED_TRACE("query " + std::to_string(t) + " of " + std::to_string(c.lengths[t]) + " keys");
      ASSERT_EQ(gc[t], cc[t]);
      const auto ref = index_scores(q, w, t, c.heads, c.dim, pool, row_ids[t], scale, wscale);
      std::vector<double> sorted = ref;
      std::sort(sorted.begin(), sorted.end(), std::greater<>());
      const double kth = gc[t] > 0 ? sorted[gc[t] - 1] : 0;
      std::set<int32_t> cpu_set(ci.begin() + t * c.k, ci.begin() + t * c.k + cc[t]);
      int common = 0;
      for (int32_t j = 0; j < gc[t]; ++j) {
        const int32_t i = gi[t * c.k + j];
        ASSERT_GE(i, 0);
        ASSERT_LT(i, c.lengths[t]);
        if (j > 0) {
          ASSERT_LT(gi[t * c.k + j - 1], i) << "indices ascending and distinct";
        }
        EXPECT_GE(ref[i], kth - 1e-4 * (std::fabs(kth) + 1e-3)) << "chosen key scores below the k-th";
        common += cpu_set.count(i) > 0;
      }
      EXPECT_GE(common, gc[t] - std::max(2, gc[t] / 100)) << "sets differ beyond near-ties";
    }
  }
}

// Key lists of queries with these lengths over a pool of rows of `dim` floats (key s of query t: row
// (s * 31 + t * 7) % pool_rows), as row pointers on each side and the offsets.
struct KeyLists {
  std::vector<const float*> cpu, gpu;
  std::vector<int64_t> offsets{0};
};
KeyLists key_lists(const float* cpu_pool, const float* gpu_pool, int64_t dim, int64_t pool_rows,
                   const std::vector<int64_t>& lengths) {
  KeyLists kl;
  for (int64_t t = 0; t < static_cast<int64_t>(lengths.size()); ++t) {
    for (int64_t s = 0; s < lengths[t]; ++s) {
      const int64_t r = (s * 31 + t * 7) % pool_rows;
      kl.cpu.push_back(cpu_pool + r * dim);
      kl.gpu.push_back(gpu_pool + r * dim);
    }
    kl.offsets.push_back(static_cast<int64_t>(kl.cpu.size()));
  }
  return kl;
}

TEST_F(CudaBackendTest, attention_with_sinks_matches_cpu) {
  struct Case {
    int64_t n, dim;
    int heads;
    std::vector<int64_t> lengths;
  };
  const Case cases[] = {{4, 512, 64, {128 + 512, 1, 0, 700}},   // CSA decode: window + top-512
                        {2, 512, 64, {128 + 8192, 300}},        // HCA: window + every entry (split keys)
                        {3, 64, 8, {33, 64, 5}},                // tiny model shapes
                        {2, 128, 80, {100, 40}},                // heads padded past 64
                        {1, 256, 16, {257}},
                        // more than kAttentionF32Queries queries: the bf16 tensor-core kernel
                        {12, 512, 64, {640, 1, 0, 700, 129, 640, 640, 33, 8300, 640, 2, 640}},
                        {10, 64, 8, {33, 64, 5, 1, 0, 90, 64, 64, 64, 7}}};
  for (const auto& c : cases) {
    const int64_t pool_rows = 9000;
    Mirror P(cpu(), gpu(), randn(pool_rows * c.dim, rng_));
    Mirror Q(cpu(), gpu(), randn(c.n * c.heads * c.dim, rng_, 0.5f));
    Mirror sinks(cpu(), gpu(), randn(c.heads, rng_));
    const KeyLists kl = key_lists(P.cpu(), P.gpu(), c.dim, pool_rows, c.lengths);
    const auto& [crows, grows, offsets] = kl;
    Mirror out(cpu(), gpu(), c.n * c.heads * c.dim * 4);
    out.poison();
    const float scale = 1.f / std::sqrt(static_cast<float>(c.dim));
    cpu().attention(Q.cpu(), c.n, c.heads, c.dim, {upload(cpu(), crows), upload(cpu(), offsets)}, sinks.cpu(), scale,
                    out.cpu());
    gpu().attention(Q.gpu(), c.n, c.heads, c.dim, {upload(gpu(), grows), upload(gpu(), offsets)}, sinks.gpu(), scale,
                    out.gpu());
    // Decode-sized calls (<= 8 queries, lists up to 2,048 keys) and widths the tensor cores
    // do not take run in fp32; the rest on the tensor cores: bf16 operands, fp32
    // accumulation and softmax.
    const int64_t longest = *std::max_element(c.lengths.begin(), c.lengths.end());
    const bool tc = (c.n > 8 || longest > 2048) && (c.dim == 64 || c.dim == 128 || c.dim == 256 || c.dim == 512);
    SCOPED_TRACE("n " + std::to_string(c.n) + " dim " + std::to_string(c.dim));
    EXPECT_CLOSE(out.gpu_host(c.n * c.heads * c.dim), out.cpu_host(c.n * c.heads * c.dim), tc ? 1e-2 : 1e-5);
  }
}

// attention then the inverse rope on its output as one call: within rounding of the CPU's, and bit for bit the
// GPU's own attention() then rope() (the rows form turns the output back in its combine; the other forms call
// rope after). Rope slices of the whole head, of 64 of 512 dims, and of 6 of 64 (starting in a float4's middle).
TEST_F(CudaBackendTest, attention_derotated_matches_cpu_and_the_two_calls) {
  struct Case {
    int64_t n, dim, rope_dim;
    int heads;
    std::vector<int64_t> lengths;
  };
  const Case cases[] = {{2, 512, 64, 64, {128 + 512, 300}}, {3, 64, 6, 8, {33, 64, 0}}, {1, 128, 128, 80, {100}},
                        // more than kAttentionF32Queries queries: the bf16 tensor-core kernel, then rope()
                        {10, 64, 16, 8, {33, 64, 5, 1, 0, 90, 64, 64, 64, 7}}};
  for (const auto& c : cases) {
    SCOPED_TRACE("n " + std::to_string(c.n) + " dim " + std::to_string(c.dim) + " rope " + std::to_string(c.rope_dim));
    const int64_t pool_rows = 1000, total = c.n * c.heads * c.dim;
    Mirror P(cpu(), gpu(), randn(pool_rows * c.dim, rng_));
    Mirror Q(cpu(), gpu(), randn(total, rng_, 0.5f));
    Mirror sinks(cpu(), gpu(), randn(c.heads, rng_));
    std::vector<float> inv(c.rope_dim / 2);
    for (size_t i = 0; i < inv.size(); ++i) inv[i] = std::pow(10000.f, -2.f * i / c.rope_dim);
    Mirror f(cpu(), gpu(), inv);
    std::vector<int64_t> pos = {7, 1048575, 4096, 0, 1, 2, 3, 4, 5, 6};
    pos.resize(c.n);
    Mirror positions(cpu(), gpu(), pos);
    const KeyLists kl = key_lists(P.cpu(), P.gpu(), c.dim, pool_rows, c.lengths);
    const auto& [crows, grows, offsets] = kl;
    const RaggedRows ck{upload(cpu(), crows), upload(cpu(), offsets)}, gk{upload(gpu(), grows), upload(gpu(), offsets)};
    const RopeTable tc{f.cpu(), c.rope_dim, 1.25f}, tg{f.gpu(), c.rope_dim, 1.25f};
    const float scale = 1.f / std::sqrt(static_cast<float>(c.dim));
    Mirror out(cpu(), gpu(), total * 4), two(cpu(), gpu(), total * 4);
    out.poison();
    two.poison();
    cpu().attention_derotated(Q.cpu(), c.n, c.heads, c.dim, ck, sinks.cpu(), scale, tc, positions.cpu<int64_t>(),
                              out.cpu());
    gpu().attention_derotated(Q.gpu(), c.n, c.heads, c.dim, gk, sinks.gpu(), scale, tg, positions.gpu<int64_t>(),
                              out.gpu());
    gpu().attention(Q.gpu(), c.n, c.heads, c.dim, gk, sinks.gpu(), scale, two.gpu());
    gpu().rope(two.gpu(), c.n, c.heads, c.dim, tg, positions.gpu<int64_t>(), true);
    const bool tc_form = c.n > 8;
    EXPECT_CLOSE(out.gpu_host(total), out.cpu_host(total), tc_form ? 1e-2 : 1e-5);
    const auto fused = out.gpu_host(total), apart = two.gpu_host(total);
    for (int64_t i = 0; i < total; ++i) {
      ASSERT_EQ(std::memcmp(&fused[i], &apart[i], 4), 0) << "element " << i << ": " << fused[i] << " vs " << apart[i];
    }
  }
}

// Expert counts on both of the kernel's ways of picking (by rank up to 256, by rounds past it), at one warp
// and several; `ties`: logits and bias on coarse steps, so that many keyed scores are equal (lower index first).
TEST_F(CudaBackendTest, route_matches_cpu_for_every_score_function) {
  const int64_t rows = 9;
  for (int experts : {256, 16, 8, 48, 300}) {
    const int k = experts == 8 ? 2 : experts == 300 ? 8 : 6;
    for (ScoreFn fn : {ScoreFn::sqrtsoftplus, ScoreFn::sigmoid, ScoreFn::softmax}) {
      for (int variant = 0; variant < 3; ++variant) {
        const bool hash = variant == 1, ties = variant == 2;
        SCOPED_TRACE(std::to_string(experts) + " experts, fn " + std::to_string(static_cast<int>(fn)) +
                     (hash ? ", hash" : ties ? ", ties" : ""));
        std::vector<float> lg = randn(rows * experts, rng_, 2.f), bs = randn(experts, rng_, 0.1f);
        if (ties) {
          for (float& x : lg) x = std::round(x * 2.f) / 2.f;
          for (float& x : bs) x = std::round(x * 4.f) / 4.f;
        }
        Mirror logits(cpu(), gpu(), lg);
        Mirror bias(cpu(), gpu(), bs);
        std::vector<int64_t> table(50 * k);
        for (size_t i = 0; i < table.size(); ++i) table[i] = static_cast<int64_t>((i * 7919) % experts);
        Mirror tab(cpu(), gpu(), table);
        std::vector<int32_t> id_host(rows);
        for (int64_t r = 0; r < rows; ++r) id_host[r] = static_cast<int32_t>((r * 11) % 50);
        Mirror ids(cpu(), gpu(), id_host);
        Mirror idx(cpu(), gpu(), rows * k * 4), wt(cpu(), gpu(), rows * k * 4);
        idx.poison();
        wt.poison();
        cpu().route(logits.cpu(), rows, experts, fn, bias.cpu(), k, hash ? tab.cpu<int64_t>() : nullptr,
                    ids.cpu<int32_t>(), 1.5f, idx.cpu<int32_t>(), wt.cpu());
        gpu().route(logits.gpu(), rows, experts, fn, bias.gpu(), k, hash ? tab.gpu<int64_t>() : nullptr,
                    ids.gpu<int32_t>(), 1.5f, idx.gpu<int32_t>(), wt.gpu());
        EXPECT_EQ(idx.gpu_host<int32_t>(rows * k), idx.cpu_host<int32_t>(rows * k));
        EXPECT_CLOSE(wt.gpu_host(rows * k), wt.cpu_host(rows * k), 1e-5);
      }
    }
  }
}

// k distinct random experts for each of `rows` rows ([rows, k]).
std::vector<int32_t> random_routes(int64_t rows, int k, int experts, std::mt19937& rng) {
  std::vector<int32_t> idx(static_cast<size_t>(rows * k));
  for (int64_t r = 0; r < rows; ++r) {
    std::vector<int32_t> perm(experts);
    std::iota(perm.begin(), perm.end(), 0);
    std::shuffle(perm.begin(), perm.end(), rng);
    for (int j = 0; j < k; ++j) idx[static_cast<size_t>(r * k + j)] = perm[static_cast<size_t>(j)];
  }
  return idx;
}

// One MoE call on both backends over the same experts ([experts] weights each side), its output
// within `tol` of the CPU's.
struct ExpertSet {
  std::vector<Weight> cg, cu, cd, gg, gu, gd;
};
void expect_moe_like_cpu(Backend& cpu, Backend& gpu, std::mt19937& rng, const ExpertSet& e, int64_t rows, int64_t dim,
                         int k, double tol) {
  const int experts = static_cast<int>(e.cg.size());
  Mirror x(cpu, gpu, randn(rows * dim, rng));
  Mirror idx(cpu, gpu, random_routes(rows, k, experts, rng));
  Mirror wt(cpu, gpu, randn(rows * k, rng, 0.5f));
  Mirror out(cpu, gpu, randn(rows * dim, rng));
  cpu.moe(x.cpu(), rows, dim, idx.cpu<int32_t>(), wt.cpu(), k, experts, e.cg.data(), e.cu.data(), e.cd.data(), 10.f,
          out.cpu());
  gpu.moe(x.gpu(), rows, dim, idx.gpu<int32_t>(), wt.gpu(), k, experts, e.gg.data(), e.gu.data(), e.gd.data(), 10.f,
          out.gpu());
  EXPECT_CLOSE(out.gpu_host(rows * dim), out.cpu_host(rows * dim), tol);
}

// Whether CudaBackend::moe takes its batched GEMMs (bf16-rounded activations) for this bf16 call:
// TROUPE_MOE_BATCHED unset or 1, 2 to 64 rows; 0 never; 2 up to 64 rows.
bool moe_batched(int64_t rows) {
  const char* e = std::getenv("TROUPE_MOE_BATCHED");
  const char mode = e == nullptr ? '1' : e[0];
  return mode != '0' && rows <= 64 && rows >= (mode == '2' ? 1 : 2);
}

TEST_F(CudaBackendTest, moe_matches_cpu_on_the_pair_and_sorted_paths) {
  struct Case {
    int experts, k;
    int64_t dim;
    WeightType type;
  };
  // 64 experts, top-2: the batched path's entries (min(experts, pairs)) past the touched experts are spares
  // whenever two rows share an expert.
  // 4 experts, top-3 at 1,280: each expert takes about three rows in four (the batched path's blocks nearly
  // full, up to 64 rows).
  const Case cases[] = {{16, 6, 1024, WeightType::bf16}, {16, 6, 256, WeightType::bf16}, {64, 2, 256, WeightType::bf16},
                        {4, 3, 1280, WeightType::bf16},
                        {16, 6, 1024, WeightType::f32},  {16, 6, 256, WeightType::f32}};
  for (const Case& c : cases) {
    const int64_t dim = c.dim, inter = dim / 2;
    std::vector<std::unique_ptr<MirrorWeight>> g, u, d;
    ExpertSet set;
    for (int e = 0; e < c.experts; ++e) {
      g.push_back(std::make_unique<MirrorWeight>(cpu(), gpu(), inter, dim, c.type, rng_));
      u.push_back(std::make_unique<MirrorWeight>(cpu(), gpu(), inter, dim, c.type, rng_));
      d.push_back(std::make_unique<MirrorWeight>(cpu(), gpu(), dim, inter, c.type, rng_));
      set.cg.push_back(g.back()->cw);
      set.cu.push_back(u.back()->cw);
      set.cd.push_back(d.back()->cw);
      set.gg.push_back(g.back()->gw);
      set.gu.push_back(u.back()->gw);
      set.gd.push_back(d.back()->gw);
    }
    for (int64_t rows : {1, 2, 3, 8, 10, 40, 64, 100}) {
      SCOPED_TRACE("rows " + std::to_string(rows) + " dim " + std::to_string(dim) + " experts " +
                   std::to_string(c.experts));
      // GEMVs on fp32 activations up to 64 rows (pair path for one row, grouped by expert on the device
      // otherwise); past that, cuBLAS (one GEMM chain an expert). bf16 calls of 2 to 64 rows run as batched
      // GEMMs over the touched experts' rows (ctest's kernels_cuda_moe_grouped turns that off;
      // kernels_cuda_moe_batched_always takes it at one row too). The cuBLAS GEMMs of both are exact where
      // they split x (gemm_split(1): at every shape), else on bf16-rounded activations.
      const bool exact = c.type == WeightType::f32 || gemm_split(1) || (rows <= 64 && !moe_batched(rows));
      expect_moe_like_cpu(cpu(), gpu(), rng_, set, rows, dim, c.k, exact ? 2e-5 : 1e-2);
    }
  }
}

// FP8 / FP4 weights (TROUPE_CUDA_QUANTIZED's path): the GEMVs and MoE kernels that convert the codes in
// registers (exact fp32 products, as the CPU backend's), and the products that dequantize into bf16 first
// (more than 8 rows of x, or shapes whose chunks cross a scale block: cuBLAS, on split activations unless
// TROUPE_GEMM_SPLIT says otherwise: see gemm_split).
TEST_F(CudaBackendTest, quantized_weights_match_cpu) {
  struct Shape {
    int64_t m, n, k;
    WeightType type;
    int bm, bn;
    int64_t r0;  // a row view from r0 (0: the whole matrix)
  };
  const Shape shapes[] = {
      {1, 4096, 4096, WeightType::e4m3, 128, 128, 0}, {3, 1000, 512, WeightType::e4m3, 128, 128, 0},
      {8, 2048, 1024, WeightType::e4m3, 128, 128, 0}, {5, 300, 384, WeightType::e4m3, 128, 128, 37},
      {2, 600, 96, WeightType::e4m3, 64, 32, 70},     {1, 100, 40, WeightType::e4m3, 128, 128, 0},
      {17, 1024, 4096, WeightType::e4m3, 128, 128, 0}, {1, 2048, 4096, WeightType::e2m1, 1, 32, 0},
      {4, 700, 256, WeightType::e2m1, 1, 32, 3},      {8, 300, 96, WeightType::e2m1, 1, 32, 0},
      {40, 512, 1024, WeightType::e2m1, 1, 32, 0},    {3, 64, 48, WeightType::e2m1, 1, 16, 0}};
  for (const auto& s : shapes) {
    const int64_t rows = s.n + s.r0;
    SCOPED_TRACE("type " + std::to_string(static_cast<int>(s.type)) + " m " + std::to_string(s.m) + " n " +
                 std::to_string(s.n) + " k " + std::to_string(s.k) + " from row " + std::to_string(s.r0));
    MirrorQuantized w(cpu(), gpu(), rows, s.k, s.type, s.bm, s.bn, rng_);
    const Weight cw = weight_rows(w.cw, s.r0, s.n), gw = weight_rows(w.gw, s.r0, s.n);
    Mirror x(cpu(), gpu(), randn(s.m * s.k, rng_));
    for (float beta : {0.f, 1.f}) {
      Mirror y(cpu(), gpu(), randn(s.m * s.n, rng_));
      cpu().linear(x.cpu(), s.m, cw, y.cpu(), beta);
      gpu().linear(x.gpu(), s.m, gw, y.gpu(), beta);
      // Up to 8 rows: fp32 products (codes converted in registers, or dequantized into bf16, exact for
      // power-of-two scales, then the bf16 GEMV); more: cuBLAS over the dequantized weights (gemm_split).
      EXPECT_CLOSE(y.gpu_host(s.m * s.n), y.cpu_host(s.m * s.n), s.m <= 8 || gemm_split(s.m) ? 2e-5 : 1e-2);
    }
  }
  // embedding rows of a quantized table (the same floats: code * scale)
  for (WeightType type : {WeightType::e4m3, WeightType::e2m1}) {
    const bool fp8 = type == WeightType::e4m3;
    MirrorQuantized t(cpu(), gpu(), 300, 256, type, fp8 ? 128 : 1, fp8 ? 128 : 32, rng_);
    const std::vector<int32_t> ids_host = {0, 5, 299, 128, 5};
    Mirror ids(cpu(), gpu(), ids_host);
    Mirror out(cpu(), gpu(), ids_host.size() * 2 * 256 * 4);
    out.poison();
    cpu().embed(t.cw, ids.cpu<int32_t>(), 5, 2, out.cpu());
    gpu().embed(t.gw, ids.gpu<int32_t>(), 5, 2, out.gpu());
    EXPECT_CLOSE(out.gpu_host(5 * 2 * 256), out.cpu_host(5 * 2 * 256), 1e-7);
  }
  // linear_grouped (the grouped output projection): 8 groups of 64 outputs
  for (int64_t m : {3, 20}) {
    MirrorQuantized w(cpu(), gpu(), 512, 128, WeightType::e4m3, 128, 128, rng_);
    Mirror x(cpu(), gpu(), randn(m * 8 * 128, rng_));
    Mirror y(cpu(), gpu(), m * 512 * 4);
    y.poison();
    cpu().linear_grouped(x.cpu(), m, w.cw, 8, y.cpu());
    gpu().linear_grouped(x.gpu(), m, w.gw, 8, y.gpu());
    EXPECT_CLOSE(y.gpu_host(m * 512), y.cpu_host(m * 512), m <= 8 || gemm_split(m) ? 2e-5 : 1e-2);
  }
  // MoE: gate and up as rows [0, I) and [I, 2I) of one stacked matrix (up starts inside a 64-row block)
  const int experts = 8, k = 3;
  const int64_t dim = 256, inter = 96;
  for (WeightType type : {WeightType::e4m3, WeightType::e2m1}) {
    const int bm = type == WeightType::e4m3 ? 64 : 1, bn = type == WeightType::e4m3 ? 128 : 32;
    std::vector<std::unique_ptr<MirrorQuantized>> gate_up, down;
    ExpertSet set;
    for (int e = 0; e < experts; ++e) {
      gate_up.push_back(std::make_unique<MirrorQuantized>(cpu(), gpu(), 2 * inter, dim, type, bm, bn, rng_));
      down.push_back(std::make_unique<MirrorQuantized>(cpu(), gpu(), dim, inter, type, bm, bn, rng_));
      set.cg.push_back(weight_rows(gate_up.back()->cw, 0, inter));
      set.cu.push_back(weight_rows(gate_up.back()->cw, inter, inter));
      set.cd.push_back(down.back()->cw);
      set.gg.push_back(weight_rows(gate_up.back()->gw, 0, inter));
      set.gu.push_back(weight_rows(gate_up.back()->gw, inter, inter));
      set.gd.push_back(down.back()->gw);
    }
    for (int64_t rows : {1, 3, 8, 40, 100}) {
      SCOPED_TRACE(std::string(type == WeightType::e4m3 ? "e4m3" : "e2m1") + " moe rows " + std::to_string(rows));
      expect_moe_like_cpu(cpu(), gpu(), rng_, set, rows, dim, k, rows <= 64 || gemm_split(1) ? 2e-5 : 1e-2);
    }
  }
}

TEST_F(CudaBackendTest, swiglu_and_add_match_cpu) {
  const int64_t n = 100003;
  Mirror g(cpu(), gpu(), randn(n, rng_, 8.f)), u(cpu(), gpu(), randn(n, rng_, 8.f));
  Mirror y(cpu(), gpu(), n * 4);
  y.poison();
  cpu().swiglu(g.cpu(), u.cpu(), y.cpu(), n, 10.f);
  gpu().swiglu(g.gpu(), u.gpu(), y.gpu(), n, 10.f);
  EXPECT_CLOSE(y.gpu_host(n), y.cpu_host(n), 1e-6);
  cpu().add(y.cpu(), g.cpu(), n);
  gpu().add(y.gpu(), g.gpu(), n);
  EXPECT_CLOSE(y.gpu_host(n), y.cpu_host(n), 1e-6);
}

// ---- decode-step helpers ---------------------------------------------------------------

// Row pointers of a backend turned into row numbers of its pool (-1: null).
std::vector<int64_t> row_numbers(const std::vector<const float*>& rows, const float* pool, int64_t width) {
  std::vector<int64_t> out;
  for (const float* r : rows) out.push_back(r == nullptr ? -1 : (r - pool) / width * 1000000 + (r - pool) % width);
  return out;
}

TEST_F(CudaBackendTest, decode_rows_and_compress_lists_match_cpu) {
  const int64_t width = 8, pool_rows = 5000, stride = 3000;  // table row stride (pointers)
  Mirror pool(cpu(), gpu(), pool_rows * width * 4);
  const int64_t W = 16, cap = 1500, k = 12;
  // Tables of 3 slots: window (W) at 0, ring (16 slots) at W, entries (cap) at W + 16.
  const int64_t off_w = 0, off_ring = W, off_e = W + 16;
  std::vector<int64_t> table_rows(3 * stride, 0);
  for (int64_t t = 0; t < 3; ++t) {
    for (int64_t i = 0; i < stride; ++i) table_rows[t * stride + i] = (t * 977 + i * 13) % pool_rows;
  }
  auto tables_for = [&](Backend& b, float* base) {
    std::vector<const float*> v(table_rows.size());
    for (size_t i = 0; i < v.size(); ++i) v[i] = base + table_rows[i] * width;
    return upload(b, v);
  };
  const float* const* ct = tables_for(cpu(), pool.cpu());
  const float* const* gt = tables_for(gpu(), pool.gpu());
  // Five queries, then 300 (one block a query, which then walks the chunks of its list itself).
  std::vector<int64_t> many_pos(300);
  std::vector<int32_t> many_tof(300);
  for (size_t i = 0; i < many_pos.size(); ++i) {
    many_pos[i] = static_cast<int64_t>((i * 2654435761u) % 6000);
    many_tof[i] = static_cast<int32_t>(i % 3);
  }
  const std::pair<std::vector<int64_t>, std::vector<int32_t>> sets[] = {{{0, 3, 5000, 95, 7}, {2, 0, 1, 0, 2}},
                                                                         {many_pos, many_tof}};
  for (const auto& [lists_pos, lists_tof] : sets) {
    const int64_t n = static_cast<int64_t>(lists_pos.size());
    SCOPED_TRACE(std::to_string(n) + " queries");
    Mirror pos(cpu(), gpu(), lists_pos), tof(cpu(), gpu(), lists_tof);
    std::vector<int32_t> picked_host(n * k), count_host(n);
    for (int64_t b = 0; b < n; ++b) {
      count_host[b] = static_cast<int32_t>(std::min<int64_t>(k, (lists_pos[b] + 1) / 4));
      for (int64_t j = 0; j < count_host[b]; ++j) {
        picked_host[b * k + j] = static_cast<int32_t>(j * 3 % ((lists_pos[b] + 1) / 4));
      }
    }
    Mirror picked(cpu(), gpu(), picked_host), count(cpu(), gpu(), count_host);
    for (int mode = 0; mode < 3; ++mode) {  // all entries (rate 4), picked entries, window only
      SCOPED_TRACE("mode " + std::to_string(mode));
      const int64_t most = W + (mode == 0 ? cap : mode == 1 ? k : 0);
      Mirror rows(cpu(), gpu(), n * most * 8), offs(cpu(), gpu(), (n + 1) * 8);
      rows.poison();
      offs.poison();
      for (Backend* b : {&cpu(), &gpu()}) {
        const bool g = b == &gpu();
        const float* const* t = g ? gt : ct;
        b->decode_rows(n, g ? pos.gpu<int64_t>() : pos.cpu<int64_t>(), g ? tof.gpu<int32_t>() : tof.cpu<int32_t>(),
                       t + off_w, stride, W, W, mode == 2 ? nullptr : t + off_e, stride, 4,
                       mode == 1 ? (g ? picked.gpu<int32_t>() : picked.cpu<int32_t>()) : nullptr,
                       mode == 1 ? (g ? count.gpu<int32_t>() : count.cpu<int32_t>()) : nullptr, static_cast<int>(k),
                       g ? rows.gpu<const float*>() : rows.cpu<const float*>(),
                       g ? offs.gpu<int64_t>() : offs.cpu<int64_t>());
      }
      const auto co = offs.cpu_host<int64_t>(n + 1), go = offs.gpu_host<int64_t>(n + 1);
      ASSERT_EQ(go, co);
      const auto cr = rows.cpu_host<const float*>(co[n]), gr = rows.gpu_host<const float*>(co[n]);
      EXPECT_EQ(row_numbers(gr, pool.gpu(), width), row_numbers(cr, pool.cpu(), width));
    }
  }
  // The listing with a store: each query's new row written into its own window row (five queries, each
  // (table, p % W) once), the rows around it untouched.
  {
    pool.set(randn(pool_rows * width, rng_));
    const std::vector<int64_t> sp{0, 3, 5000, 95, 7};
    const std::vector<int32_t> st{2, 0, 1, 0, 2};
    const int64_t n = static_cast<int64_t>(sp.size());
    Mirror pos(cpu(), gpu(), sp), tof(cpu(), gpu(), st);
    const auto src = randn(n * width, rng_);
    Mirror kv(cpu(), gpu(), src);
    Mirror rows(cpu(), gpu(), n * W * 8), offs(cpu(), gpu(), (n + 1) * 8);
    const auto before = pool.cpu_host(pool_rows * width);
    for (Backend* b : {&cpu(), &gpu()}) {
      const bool g = b == &gpu();
      b->decode_rows(n, g ? pos.gpu<int64_t>() : pos.cpu<int64_t>(), g ? tof.gpu<int32_t>() : tof.cpu<int32_t>(),
                     (g ? gt : ct) + off_w, stride, W, W, nullptr, stride, 1, nullptr, nullptr, 0,
                     g ? rows.gpu<const float*>() : rows.cpu<const float*>(), g ? offs.gpu<int64_t>() : offs.cpu<int64_t>(),
                     g ? kv.gpu() : kv.cpu(), width);
    }
    const auto after = pool.cpu_host(pool_rows * width);
    EXPECT_EQ(pool.gpu_host(pool_rows * width), after);
    std::vector<float> expect = before;
    for (int64_t b = 0; b < n; ++b) {
      const int64_t row = table_rows[st[b] * stride + off_w + sp[b] % W];
      std::copy(src.begin() + b * width, src.begin() + (b + 1) * width, expect.begin() + row * width);
    }
    EXPECT_EQ(after, expect);
    const auto co = offs.cpu_host<int64_t>(n + 1);
    EXPECT_EQ(offs.gpu_host<int64_t>(n + 1), co);
    EXPECT_EQ(row_numbers(rows.gpu_host<const float*>(co[n]), pool.gpu(), width),
              row_numbers(rows.cpu_host<const float*>(co[n]), pool.cpu(), width));
    EXPECT_THROW(cpu().decode_rows(n, pos.cpu<int64_t>(), tof.cpu<int32_t>(), nullptr, stride, W, W, nullptr, stride, 1,
                                   nullptr, nullptr, 0, rows.cpu<const float*>(), offs.cpu<int64_t>(), kv.cpu(), width),
                 std::invalid_argument);
  }
  // The compressor's lists: the five queries.
  const std::vector<int64_t> pos_host{0, 3, 5000, 95, 7};
  const std::vector<int32_t> table_of_host{2, 0, 1, 0, 2};
  const int64_t n = static_cast<int64_t>(pos_host.size());
  Mirror pos(cpu(), gpu(), pos_host), tof(cpu(), gpu(), table_of_host);
  for (bool overlap : {true, false}) {
    SCOPED_TRACE(overlap ? "CSA" : "HCA");
    const int64_t rate = overlap ? 4 : 8, dim = 4, w = overlap ? 2 * dim : dim, slots = overlap ? 2 * rate : rate;
    Mirror kv(cpu(), gpu(), randn(n * w, rng_)), sc(cpu(), gpu(), randn(n * w, rng_)),
        bias(cpu(), gpu(), randn(rate * w, rng_));
    Mirror ks(cpu(), gpu(), n * slots * 8), ss(cpu(), gpu(), n * slots * 8), out(cpu(), gpu(), n * 8),
        epos(cpu(), gpu(), n * 8), rd(cpu(), gpu(), 2 * n * 8), rs(cpu(), gpu(), 2 * n * 8);
    for (Mirror* m : {&ks, &ss, &out, &epos, &rd, &rs}) m->poison();
    for (Backend* b : {&cpu(), &gpu()}) {
      const bool g = b == &gpu();
      const float* const* t = g ? gt : ct;
      auto P = [&](Mirror& m) { return g ? m.gpu() : m.cpu(); };
      b->decode_compress_rows(n, g ? pos.gpu<int64_t>() : pos.cpu<int64_t>(), g ? tof.gpu<int32_t>() : tof.cpu<int32_t>(),
                              rate, overlap, dim, P(kv), P(sc), P(bias), const_cast<float* const*>(t + off_ring), stride,
                              const_cast<float* const*>(t + off_e), stride,
                              g ? ks.gpu<const float*>() : ks.cpu<const float*>(),
                              g ? ss.gpu<const float*>() : ss.cpu<const float*>(), g ? out.gpu<float*>() : out.cpu<float*>(),
                              g ? epos.gpu<int64_t>() : epos.cpu<int64_t>(), g ? rd.gpu<float*>() : rd.cpu<float*>(),
                              g ? rs.gpu<const float*>() : rs.cpu<const float*>());
    }
    // Pointers into the step rows (kv, score) or the pool, as comparable numbers.
    auto numbers = [&](const std::vector<const float*>& v, bool g) {
      std::vector<int64_t> o;
      const float* pl = g ? pool.gpu() : pool.cpu();
      const float* k0 = g ? kv.gpu() : kv.cpu();
      const float* s0 = g ? sc.gpu() : sc.cpu();
      for (const float* r : v) {
        if (r == nullptr) o.push_back(-1);
        else if (r >= k0 && r < k0 + n * w) o.push_back(-1000 - (r - k0));
        else if (r >= s0 && r < s0 + n * w) o.push_back(-100000 - (r - s0));
        else o.push_back(r - pl);
      }
      return o;
    };
    EXPECT_EQ(numbers(ks.gpu_host<const float*>(n * slots), true), numbers(ks.cpu_host<const float*>(n * slots), false));
    EXPECT_EQ(numbers(ss.gpu_host<const float*>(n * slots), true), numbers(ss.cpu_host<const float*>(n * slots), false));
    EXPECT_EQ(numbers(out.gpu_host<const float*>(n), true), numbers(out.cpu_host<const float*>(n), false));
    EXPECT_EQ(epos.gpu_host<int64_t>(n), epos.cpu_host<int64_t>(n));
    EXPECT_EQ(sc.gpu_host<float>(n * w), sc.cpu_host<float>(n * w));  // the position bias added in place
    EXPECT_EQ(numbers(rd.gpu_host<const float*>(2 * n), true), numbers(rd.cpu_host<const float*>(2 * n), false));
    EXPECT_EQ(numbers(rs.gpu_host<const float*>(2 * n), true), numbers(rs.cpu_host<const float*>(2 * n), false));
  }
}

// Backend::decode_compress: the CUDA backend's one fused kernel (the one-wave form by
// TROUPE_COMPRESS_DECODE=1, then the default compress_decode_kernel) against the CPU backend's composition
// (decode_compress_rows, compress, copy_rows), over paged rings and entry tables shared by
// several sequences' rows, windows closing and not.
TEST_F(CudaBackendTest, fused_decode_compress_matches_cpu_composition) {
  struct Case {
    bool overlap;
    int64_t rate, dim, rope_dim;
    std::vector<int64_t> positions;
  };
  for (const auto& c : {Case{true, 4, 512, 64, {3, 2402, 95, 7, 6, 0}}, Case{true, 4, 128, 64, {11, 1, 99}},
                        Case{false, 128, 512, 64, {127, 255, 1000, 3}}, Case{false, 8, 6, 2, {7, 2399, 13}}}) {
    for (const char* form : {"1", static_cast<const char*>(nullptr)}) {
      SCOPED_TRACE((c.overlap ? "CSA dim " : "HCA dim ") + std::to_string(c.dim) + ", form " +
                   (form != nullptr ? form : "default"));
      const int64_t n = static_cast<int64_t>(c.positions.size()), w = c.overlap ? 2 * c.dim : c.dim;
      const int64_t ring_slots = c.overlap ? 2 * c.rate : c.rate, slots = ring_slots, cap = 700;
      const int64_t stride = ring_slots + cap;                  // per table row: the ring, then the entries
      const int64_t rows = 3 * stride + 8, row_floats = 2 * w;  // pool rows fit a ring row (kv, score)
      Mirror pool(cpu(), gpu(), randn(rows * row_floats, rng_));
      std::vector<int64_t> row_of(3 * stride);
      for (int64_t i = 0; i < 3 * stride; ++i) row_of[i] = (i * 37 + 5) % rows;
      std::sort(row_of.begin(), row_of.end());
      row_of.erase(std::unique(row_of.begin(), row_of.end()), row_of.end());
      ASSERT_EQ(static_cast<int64_t>(row_of.size()), 3 * stride);  // distinct rows
      std::shuffle(row_of.begin(), row_of.end(), rng_);
      auto table = [&](Backend& b, float* base) {
        std::vector<float*> v(row_of.size());
        for (size_t i = 0; i < v.size(); ++i) v[i] = base + row_of[i] * row_floats;
        return upload(b, v);
      };
      float* const* ct = table(cpu(), pool.cpu());
      float* const* gt = table(gpu(), pool.gpu());
      const int64_t calls = (n + 2) / 3;
      Mirror kv(cpu(), gpu(), randn(n * w, rng_)), sc(cpu(), gpu(), randn(n * w, rng_, 2.f)),
          bias(cpu(), gpu(), randn(c.rate * w, rng_)), nw(cpu(), gpu(), randn(c.dim, rng_));
      std::vector<float> inv(c.rope_dim / 2);
      for (size_t i = 0; i < inv.size(); ++i) inv[i] = std::pow(160000.f, -2.f * i / c.rope_dim);
      Mirror f(cpu(), gpu(), inv);
      std::set<int64_t> entry_rows;  // pool rows of the entries the calls close
      // Sequences in calls of at most 3 (each table row once per call).
      for (int64_t call = 0; call < calls; ++call) {
        const int64_t b0 = call * 3, m = std::min<int64_t>(3, n - b0);
        std::vector<int64_t> pos_host(c.positions.begin() + b0, c.positions.begin() + b0 + m);
        std::vector<int32_t> t_host(m);  // distinct table rows within a call; later calls reuse them
        for (int64_t i = 0; i < m; ++i) t_host[i] = static_cast<int32_t>((i + 2 * call) % 3);
        Mirror pos(cpu(), gpu(), pos_host), tof(cpu(), gpu(), t_host);
        for (int64_t i = 0; i < m; ++i) {
          if ((pos_host[i] + 1) % c.rate == 0) {
            entry_rows.insert(row_of[t_host[i] * stride + ring_slots + pos_host[i] / c.rate]);
          }
        }
        Mirror ks(cpu(), gpu(), m * slots * 8), ss(cpu(), gpu(), m * slots * 8), out(cpu(), gpu(), m * 8),
            epos(cpu(), gpu(), m * 8), rd(cpu(), gpu(), 2 * m * 8), rs(cpu(), gpu(), 2 * m * 8);
        for (Backend* b : {&cpu(), &gpu()}) {
          const bool g = b == &gpu();
          float* const* t = g ? gt : ct;
          const RopeTable rope{g ? f.gpu() : f.cpu(), c.rope_dim, 1.f};
          const Backend::DecodeCompressScratch scratch{g ? ks.gpu<const float*>() : ks.cpu<const float*>(),
                                                       g ? ss.gpu<const float*>() : ss.cpu<const float*>(),
                                                       g ? out.gpu<float*>() : out.cpu<float*>(),
                                                       g ? epos.gpu<int64_t>() : epos.cpu<int64_t>(),
                                                       g ? rd.gpu<float*>() : rd.cpu<float*>(),
                                                       g ? rs.gpu<const float*>() : rs.cpu<const float*>()};
          const ScopedEnv env("TROUPE_COMPRESS_DECODE", g ? form : nullptr);
          b->decode_compress(m, g ? pos.gpu<int64_t>() : pos.cpu<int64_t>(),
                             g ? tof.gpu<int32_t>() : tof.cpu<int32_t>(), c.rate, c.overlap, c.dim,
                             (g ? kv.gpu() : kv.cpu()) + b0 * w,
                             (g ? sc.gpu() : sc.cpu()) + b0 * w, g ? bias.gpu() : bias.cpu(), t, stride, t + ring_slots,
                             stride, g ? nw.gpu() : nw.cpu(), 1e-6f, rope, scratch);
        }
      }
      // The entries within fp32 rounding; every other pool row (the rings' new rows, the
      // rest untouched) exactly.
      ASSERT_FALSE(entry_rows.empty());
      const auto gp = pool.gpu_host(rows * row_floats), cp = pool.cpu_host(rows * row_floats);
      std::vector<float> ge, ce, grest, crest;
      for (int64_t r = 0; r < rows; ++r) {
        const bool entry = entry_rows.count(r) > 0;
        for (int64_t i = 0; i < row_floats; ++i) {
          if (entry && i >= c.dim) continue;  // past the entry's dim floats: not written
          (entry ? ge : grest).push_back(gp[r * row_floats + i]);
          (entry ? ce : crest).push_back(cp[r * row_floats + i]);
        }
      }
      EXPECT_CLOSE(ge, ce, 1e-5);
      EXPECT_EQ(grest, crest);
      EXPECT_EQ(sc.gpu_host(n * w), sc.cpu_host(n * w));  // the position bias added in place
    }
  }
}

TEST_F(CudaBackendTest, scatter_and_argmax_match_cpu) {
  std::vector<void*> table_host(100, nullptr);
  Mirror table(cpu(), gpu(), table_host);
  const std::vector<int64_t> index{5, -1, 99, 0, 42};
  std::vector<void*> values;
  for (size_t i = 0; i < index.size(); ++i) values.push_back(reinterpret_cast<void*>(0x1000 * (i + 1)));
  Mirror ix(cpu(), gpu(), index), vals(cpu(), gpu(), values);
  cpu().scatter_pointers(table.cpu<void*>(), ix.cpu<int64_t>(), vals.cpu<void*>(), 5);
  gpu().scatter_pointers(table.gpu<void*>(), ix.gpu<int64_t>(), vals.gpu<void*>(), 5);
  EXPECT_EQ(table.gpu_host<void*>(100), table.cpu_host<void*>(100));
  for (int64_t n : {1, 1000, 129280}) {
    const int64_t rows = 5;
    auto x = randn(rows * n, rng_);
    x[1 * n + n / 2] = 50.f;  // ties: the lowest index wins
    x[1 * n + n - 1] = 50.f;
    x[2 * n] = std::numeric_limits<float>::quiet_NaN();
    for (int64_t j = 0; j < n; ++j) x[3 * n + j] = 1.f;
    Mirror X(cpu(), gpu(), x), out(cpu(), gpu(), rows * 4);
    out.poison();
    cpu().argmax(X.cpu(), rows, n, out.cpu<int32_t>());
    gpu().argmax(X.gpu(), rows, n, out.gpu<int32_t>());
    EXPECT_EQ(out.gpu_host<int32_t>(rows), out.cpu_host<int32_t>(rows)) << "n " << n;
  }
}

// Bounded lists (RaggedRows::max_rows) give the same results as unbounded ones, with no round trip.
TEST_F(CudaBackendTest, bounded_attention_and_indexer_match_cpu) {
  const int64_t dim = 512, heads = 64, pool_rows = 3000;
  Mirror P(cpu(), gpu(), randn(pool_rows * dim, rng_));
  const std::vector<int64_t> lengths{640, 1, 0, 300};
  const int64_t n = static_cast<int64_t>(lengths.size());
  Mirror Q(cpu(), gpu(), randn(n * heads * dim, rng_, 0.5f)), sinks(cpu(), gpu(), randn(heads, rng_));
  std::vector<const float*> crows, grows;
  std::vector<int64_t> offsets{0};
  for (int64_t t = 0; t < n; ++t) {
    for (int64_t s = 0; s < lengths[t]; ++s) {
      const int64_t r = (s * 31 + t * 7) % pool_rows;
      crows.push_back(P.cpu() + r * dim);
      grows.push_back(P.gpu() + r * dim);
    }
    offsets.push_back(static_cast<int64_t>(crows.size()));
  }
  Mirror out(cpu(), gpu(), n * heads * dim * 4);
  out.poison();
  const float scale = 1.f / std::sqrt(static_cast<float>(dim));
  cpu().attention(Q.cpu(), n, heads, dim, {upload(cpu(), crows), upload(cpu(), offsets)}, sinks.cpu(), scale, out.cpu());
  gpu().attention(Q.gpu(), n, heads, dim, {upload(gpu(), grows), upload(gpu(), offsets), 2000}, sinks.gpu(), scale,
                  out.gpu());
  EXPECT_CLOSE(out.gpu_host(n * heads * dim), out.cpu_host(n * heads * dim), 1e-2);

  // Indexer: 128-wide keys from the same pool rows, top-512 of up to 640 keys, bound 4096.
  const int ih = 64, idim = 128, k = 512;
  Mirror iq(cpu(), gpu(), randn(n * ih * idim, rng_)), iw(cpu(), gpu(), randn(n * ih, rng_));
  std::vector<const float*> ci, gi;
  for (size_t i = 0; i < crows.size(); ++i) {
    ci.push_back(crows[i]);
    gi.push_back(grows[i]);
  }
  Mirror idx(cpu(), gpu(), n * k * 4), cnt(cpu(), gpu(), n * 4);
  idx.poison();
  cnt.poison();
  cpu().indexer_topk(iq.cpu(), iw.cpu(), n, ih, idim, 0.1f, 0.125f, {upload(cpu(), ci), upload(cpu(), offsets)}, k,
                     idx.cpu<int32_t>(), cnt.cpu<int32_t>());
  gpu().indexer_topk(iq.gpu(), iw.gpu(), n, ih, idim, 0.1f, 0.125f, {upload(gpu(), gi), upload(gpu(), offsets), 4096}, k,
                     idx.gpu<int32_t>(), cnt.gpu<int32_t>());
  const auto gc = cnt.gpu_host<int32_t>(n), cc = cnt.cpu_host<int32_t>(n);
  EXPECT_EQ(gc, cc);
  const auto gx = idx.gpu_host<int32_t>(n * k), cx = idx.cpu_host<int32_t>(n * k);
  for (int64_t t = 0; t < n; ++t) {
    std::set<int32_t> a(gx.begin() + t * k, gx.begin() + t * k + gc[t]), b(cx.begin() + t * k, cx.begin() + t * k + cc[t]);
    int common = 0;
    for (int32_t i : a) common += b.count(i) > 0;
    EXPECT_GE(common, cc[t] - std::max(2, cc[t] / 100)) << "query " << t;
  }
}

// A recorded graph replays its ops on new inputs.
TEST_F(CudaBackendTest, recorded_graph_replays_on_new_inputs) {
  const int64_t m = 3, n = 4096, kdim = 1024;
  MirrorWeight w(cpu(), gpu(), n, kdim, WeightType::bf16, rng_);
  Mirror x(cpu(), gpu(), randn(m * kdim, rng_)), y(cpu(), gpu(), m * n * 4), ids(cpu(), gpu(), m * 4);
  gpu().linear(x.gpu(), m, w.gw, y.gpu(), 0.f);  // warm
  ASSERT_TRUE(gpu().capture_begin());
  gpu().linear(x.gpu(), m, w.gw, y.gpu(), 0.f);
  gpu().rmsnorm(y.gpu(), nullptr, y.gpu(), m, n, 1e-6f);
  gpu().argmax(y.gpu(), m, n, ids.gpu<int32_t>());
  auto graph = gpu().capture_end();
  ASSERT_NE(graph, nullptr);
  for (int r = 0; r < 3; ++r) {
    x.set(randn(m * kdim, rng_));
    y.poison();
    graph->launch();
    cpu().linear(x.cpu(), m, w.cw, y.cpu(), 0.f);
    cpu().rmsnorm(y.cpu(), nullptr, y.cpu(), m, n, 1e-6f);
    cpu().argmax(y.cpu(), m, n, ids.cpu<int32_t>());
    EXPECT_CLOSE(y.gpu_host(m * n), y.cpu_host(m * n), 2e-5);
    EXPECT_EQ(ids.gpu_host<int32_t>(m), ids.cpu_host<int32_t>(m));
  }
}

// The copy queue moves bytes both ways beside the compute stream.
TEST_F(CudaBackendTest, copy_queue_moves_bytes_both_ways) {
  std::vector<float> host = randn(1 << 20, rng_), back(1 << 20, 0.f);
  void* dev = gpu().alloc(host.size() * 4);
  gpu().copy_queue(dev, host.data(), host.size() * 4, false);
  gpu().copy_queue(back.data(), dev, host.size() * 4, true);
  gpu().copy_queue_wait();
  EXPECT_EQ(back, host);
  gpu().free(dev);
}

TEST(CudaBackendPresence, reports_whether_it_was_compiled) {
  if (!cuda_backend_compiled()) GTEST_SKIP() << "built without the CUDA backend";
  auto b = make_cuda_backend(0);
  if (!b) GTEST_SKIP() << "no CUDA device";
  EXPECT_EQ(b->name(), "cuda");
}

}  // namespace
}  // namespace troupe::kernels::testing
