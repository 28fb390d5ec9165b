// The fast CUDA kernels (kernels/cuda/*.hpp) against references computed here
// or by the CPU backend: exact top-k (up to ties at the k-th value), the fused
// compressor's prefill and decode forms, the tensor-core lightning indexer (bf16
// and e4m3 keys), and the tensor-core attention with bf16 keys and de-rotation.
// Skips without a CUDA device.
#include <gtest/gtest.h>

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <numeric>
#include <set>

#include "kernels/cpu/cpu_backend.hpp"
#include "kernels/cuda/attention.hpp"
#include "kernels/cuda/compressor.hpp"
#include "kernels/cuda/cuda_backend.hpp"
#include "kernels/cuda/indexer.hpp"
#include "kernels/cuda/topk.hpp"
#include "tests/kernels/backend_pair.hpp"

namespace troupe::kernels::testing {
namespace {

using cuda::CudaBackend;

// ---- top-k ------------------------------------------------------------------------
// The chosen set is exact up to ties: k_eff distinct indices, every chosen value >= the
// k-th largest, and every value strictly above the k-th largest chosen.
// A call over `rows` rows of at most `len` scores, `stride` apart (lengths: optional), k of each into
// out ([rows, k]) and cnt ([rows]).
cuda::TopkArgs topk_args(const float* scores, int64_t stride, const int32_t* lengths, int rows, int64_t len, int k,
                         int32_t* out, int32_t* cnt) {
  cuda::TopkArgs a;
  a.scores = scores;
  a.row_stride = stride;
  a.lengths = lengths;
  a.rows = rows;
  a.max_len = len;
  a.k = k;
  a.out_idx = out;
  a.out_stride = k;
  a.out_count = cnt;
  return a;
}

void check_topk_row(const float* v, int64_t len, int k, const int32_t* out, int32_t count, const std::string& what) {
  SCOPED_TRACE(what);
  const int64_t keff = std::min<int64_t>(k, len);
  ASSERT_EQ(count, keff);
  for (int64_t i = keff; i < k; ++i) ASSERT_EQ(out[i], -1) << "padding";
  if (keff == 0) return;
  std::vector<float> sorted(v, v + len);
  std::nth_element(sorted.begin(), sorted.begin() + (keff - 1), sorted.end(), std::greater<>());
  const float kth = sorted[keff - 1];
  int64_t above_all = 0;
  for (int64_t i = 0; i < len; ++i) above_all += v[i] > kth;
  std::set<int32_t> seen;
  int64_t above = 0;
  for (int64_t j = 0; j < keff; ++j) {
    const int32_t i = out[j];
    ASSERT_GE(i, 0);
    ASSERT_LT(i, len);
    ASSERT_TRUE(seen.insert(i).second) << "index " << i << " chosen twice";
    ASSERT_GE(v[i], kth) << "chosen value below the k-th";
    above += v[i] > kth;
  }
  ASSERT_EQ(above, above_all) << "a value above the k-th was left out";
}

// Every top-k kernel settles ties as a stable sort does (the CPU backend's rule): the chosen
// set is exactly the first k of the row ordered by value, then by lower index.
void check_topk_row_stable(const float* row, int64_t len, int k, const int32_t* out, int32_t count,
                           const std::string& what) {
  std::vector<int32_t> order(static_cast<size_t>(len));
  std::iota(order.begin(), order.end(), 0);
  const int64_t take = std::min<int64_t>(k, len);
  std::partial_sort(order.begin(), order.begin() + take, order.end(),
                    [&](int32_t a, int32_t b) { return row[a] > row[b] || (row[a] == row[b] && a < b); });
  std::vector<int32_t> want(order.begin(), order.begin() + take), got(out, out + std::min<int64_t>(count, k));
  std::sort(want.begin(), want.end());
  std::sort(got.begin(), got.end());
  ASSERT_EQ(got, want) << what << ": not the stable sort's choice at ties";
}

// ascending, descending: each row's scores sorted (the score is the place); mostly_zeros: all but one in 1,000 zero;
// periodic_peaks: runs of 8 high scores every 256 places, which hold a quarter (rows of 65,536) or all (262,144,
// 1 M) of the sampled path's sample (runs of 8 every len / 1,024 places): the sample overrates the row.
enum TopkDist {
  normal,
  few_values,
  all_equal,
  with_infinities,
  signed_zeros,
  fine_steps,
  coarse_steps,
  ascending,
  descending,
  mostly_zeros,
  periodic_peaks
};
struct TopkCase {
  int rows;
  int64_t len;
  int k;
  TopkDist dist;
  bool ragged;
  int max_cluster;
  int ws_rows = 0;  // workspace sized for this many rows (0: rows), as the backend sizes it once
};

class CudaKernelsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto b = make_cuda_backend(0);
    if (!b) GTEST_SKIP() << "no CUDA device";
    gpu_.reset(static_cast<CudaBackend*>(b.release()));
    cpu_ = make_cpu_backend();
  }
  void TearDown() override {
    for (void* p : owned_) gpu_->free(p);
  }
  static void TearDownTestSuite() {
    if (error_log().empty()) return;
    std::printf("\n%-60s %s\n", "test", "max relative error (L2)");
    for (const auto& [name, rel] : error_log()) std::printf("%-60s %.3e\n", name.c_str(), rel);
    error_log().clear();
  }
  template <class T>
  T* dev(const std::vector<T>& host) {
    T* p = dev<T>(host.size());
    if (!host.empty()) gpu_->to_device(p, host.data(), host.size() * sizeof(T));
    return p;
  }
  template <class T>
  T* dev(size_t n) {
    void* p = gpu_->alloc(std::max<size_t>(n * sizeof(T), 4));
    owned_.push_back(p);
    return static_cast<T*>(p);
  }
  template <class T>
  std::vector<T> host(const T* p, size_t n) {
    std::vector<T> v(n);
    gpu_->synchronize();
    gpu_->to_host(v.data(), p, n * sizeof(T));
    return v;
  }
  void poison(void* p, size_t bytes) { cudaMemsetAsync(p, 0xff, bytes, gpu_->stream()); }  // NaN / -1
  cudaStream_t stream() { return gpu_->stream(); }

  // A case's scores: c.rows rows `stride` apart (the places between rows hold scores too).
  std::vector<float> topk_scores(const TopkCase& c, int64_t stride) {
    std::vector<float> v(c.rows * stride);
    std::normal_distribution<float> nd;
    std::uniform_int_distribution<int> small(0, 9);
    for (size_t at = 0; at < v.size(); ++at) {
      float& x = v[at];
      const int64_t place = static_cast<int64_t>(at) % stride;
      switch (c.dist) {
        case normal: x = nd(rng_); break;
        case few_values: x = static_cast<float>(small(rng_)); break;
        case all_equal: x = 0.5f; break;
        case signed_zeros: {  // mostly +0 and -0 (one value), some positive
          const int r = small(rng_);
          x = r < 4 ? 0.f : r < 8 ? -0.f : std::fabs(nd(rng_));
        } break;
        case fine_steps: x = std::round(nd(rng_) * 16.f) / 16.f; break;
        case coarse_steps: x = std::round(nd(rng_) * 4.f) / 4.f; break;
        case with_infinities: {
          const int r = small(rng_);
          x = r == 0 ? -INFINITY : r == 1 ? INFINITY : nd(rng_);
        } break;
        case ascending: x = static_cast<float>(place); break;
        case descending: x = -static_cast<float>(place); break;
        case mostly_zeros: x = place % 1000 == 7 ? nd(rng_) : 0.f; break;
        case periodic_peaks: x = place % 256 < 8 ? 100.f + nd(rng_) : nd(rng_); break;
      }
    }
    return v;
  }

  // One top-k case: each way of finishing a row on the grid kernel (TopkArgs::finish), the sampled path (the
  // grid kernel where it does not apply), then the streamed kernel, each twice (a cluster case: the cluster
  // kernel twice), checked against a sort. The runs share one workspace: each must leave it zeroed for the next.
  void run_topk_case(const TopkCase& c) {
    const std::string what = "rows " + std::to_string(c.rows) + " len " + std::to_string(c.len) + " k " +
                             std::to_string(c.k) + " dist " + std::to_string(c.dist) + " cluster " +
                             std::to_string(c.max_cluster);
    SCOPED_TRACE(what);
    const int64_t stride = c.len + 4;  // rows not multiples of the vector width apart
    const std::vector<float> v = topk_scores(c, stride);
    std::vector<int32_t> lengths(c.rows);
    for (int r = 0; r < c.rows; ++r) lengths[r] = static_cast<int32_t>(c.ragged ? c.len - (r * int64_t{104729}) % (c.len + 1) : c.len);
    float* dv = dev(v);
    int32_t* dl = dev(lengths);
    int32_t* out = dev<int32_t>(c.rows * c.k);
    int32_t* cnt = dev<int32_t>(c.rows);
    const size_t ws_bytes = cuda::topk_workspace_bytes(c.ws_rows > 0 ? c.ws_rows : c.rows, c.len, c.k, c.max_cluster);
    void* ws = ws_bytes > 0 ? dev<char>(ws_bytes) : nullptr;
    cuda::topk_workspace_init(ws, ws_bytes, stream());
    struct Variant {
      int finish, streamed, sampled;
    };
    const Variant variants[] = {{1, -1, -1}, {2, -1, 1}, {2, -1, -1}, {2, 1, -1}};
    const int runs = c.max_cluster > 0 ? 2 : 8;  // the cluster kernel has no variants: the first, twice
    for (int run = 0; run < runs; ++run) {
      const auto [finish, streamed, sampled] = variants[run / 2];
      const int rep = run % 2;
      poison(out, c.rows * c.k * 4);
      poison(cnt, c.rows * 4);
      cuda::TopkArgs a = topk_args(dv, stride, dl, c.rows, c.len, c.k, out, cnt);
      a.max_cluster = c.max_cluster;
      a.finish = finish;
      a.stream = streamed;
      a.sampled = sampled;
      cuda::topk(a, ws, stream());
      const auto ho = host(out, c.rows * c.k);
      const auto hc = host(cnt, c.rows);
      for (int r = 0; r < c.rows; ++r) {
        const std::string row_what = "row " + std::to_string(r) + " finish " + std::to_string(finish) + " stream " +
                                     std::to_string(streamed) + " sampled " + std::to_string(sampled) + " rep " +
                                     std::to_string(rep);
        check_topk_row(v.data() + r * stride, lengths[r], c.k, ho.data() + r * c.k, hc[r], row_what);
        check_topk_row_stable(v.data() + r * stride, lengths[r], c.k, ho.data() + r * c.k, hc[r], row_what);
      }
    }
  }

  std::unique_ptr<CudaBackend> gpu_;
  std::unique_ptr<Backend> cpu_;
  std::vector<void*> owned_;
  std::mt19937 rng_{77};
};

TEST_F(CudaKernelsTest, topk_equals_a_sort_up_to_ties) {
  // fine_steps / coarse_steps: normal values rounded to 1/16 / 1/4, so that about a hundred / several hundred
  // equal values sit at the k-th place of a 262,144 row (top-k finish 2: ranked, and the radix fallback); at
  // k = 2,048 the row's small chunks gather a round-0 bucket of ~4,600 (more than a chunk's keys: the fallback
  // selects over the candidates in place, ~340 equal values at the k-th place).
  const TopkCase cases[] = {
      {1, 262144, 512, normal, false, 0},      {64, 262144, 512, normal, false, 0},
      {1, 1048576, 2048, normal, false, 0},    {4, 1048576, 512, normal, true, 0},
      {8, 65536, 2048, few_values, false, 0},  {2, 262144, 512, all_equal, false, 0},
      {5, 5000, 512, with_infinities, true, 0}, {3, 100000, 1, normal, false, 0},
      {2, 50, 512, normal, false, 0},          {3, 262144, 512, normal, false, 8},
      {2, 300000, 2048, few_values, true, 4},  {128, 16384, 64, normal, true, 0},
      {150, 8000, 512, normal, true, 0, 300},  {100, 65536, 256, few_values, false, 0, 200},
      {3, 4000, 512, few_values, true, 0},     {2, 1048576, 2048, few_values, false, 0},
      {4, 262144, 512, signed_zeros, true, 0}, {1, 3000, 100, signed_zeros, false, 0},
      {2, 262144, 512, fine_steps, false, 0},  {2, 262144, 512, coarse_steps, true, 0},
      {1, 1048576, 2048, fine_steps, false, 0}, {2, 262144, 2048, fine_steps, false, 0},
      // 65-128 small chunks a row (up to 524,288 scores: the grid kernel's small chunks since session 25)
      {1, 262145, 512, normal, false, 0},      {1, 300000, 512, few_values, true, 0},
      {2, 400000, 2048, fine_steps, false, 0}, {1, 524288, 512, coarse_steps, false, 0},
  };
  for (const auto& c : cases) run_topk_case(c);
}

// The cluster kernel (TopkArgs::max_cluster, and rows longer than the grid kernel takes) settles ties as the
// grid kernel does: a few hundred copies of the k-th value (gathered into the leader CTA, ranked there by
// index), more than it gathers (cluster-wide rounds over their indices), rows of one segment and of several
// (the row's last cluster selects among the segments' candidates), clusters of 1 to 16 CTAs.
TEST_F(CudaKernelsTest, topk_cluster_kernel_settles_ties_by_index) {
  const TopkCase cases[] = {
      {2, 262144, 512, fine_steps, false, 8},   {1, 1048576, 2048, fine_steps, true, 16},
      {2, 200000, 512, all_equal, true, 2},     {1, 262144, 2048, signed_zeros, false, 16},
      {2, 70000, 100, mostly_zeros, false, 1},  {1, 300000, 2048, few_values, false, 4},
  };
  for (const auto& c : cases) run_topk_case(c);
}

// Rows of one chunk, selected inside one CTA (decode at short context): normal values, ~50 / ~200 equal values at
// the k-th place (ranked by index), one value in ten (the radix fallback), ragged rows; the grid kernel's small chunks
// and, on the streamed runs, one large chunk; ~730 equal values at the k-th place of 16,000 on one large chunk (more
// than are ranked against each other: the radix fallback). Small enough for racecheck.
TEST_F(CudaKernelsTest, topk_rows_of_one_chunk) {
  const TopkCase cases[] = {
      {3, 4096, 512, normal, false, 0},     {4, 4096, 512, fine_steps, false, 0}, {2, 4096, 512, coarse_steps, false, 0},
      {2, 4096, 512, few_values, false, 0}, {6, 4000, 64, normal, true, 0},       {3, 16000, 2048, fine_steps, true, 0},
      {3, 16000, 2048, coarse_steps, false, 0},
  };
  for (const auto& c : cases) run_topk_case(c);
}

// sort_rows_ascending: each row's first min(count, k) distinct indices below `bound` come back ascending, the
// slots past them untouched; every ITEMS form (k up to 256, 512, 1,024, 2,048) and bounds from 1 to 2^31
// (padding sorts at the largest value of the bits, which a row may hold too).
TEST_F(CudaKernelsTest, sort_rows_ascending_sorts_each_rows_count) {
  struct Case {
    int k;
    int64_t bound;
  };
  const Case cases[] = {{1, 1},       {7, 8},         {100, 128},      {256, 4096},          {257, 300},
                        {512, 512},   {512, 262144},  {700, 1 << 20},  {1024, 1024},        {1025, 65536},
                        {2048, 2048}, {2048, 1 << 30}, {64, int64_t{1} << 31}};
  for (const auto& c : cases) {
    SCOPED_TRACE("k " + std::to_string(c.k) + ", bound " + std::to_string(c.bound));
    const int rows = 5;
    const int64_t stride = c.k + 3;
    std::vector<int32_t> idx(rows * stride, -7), count(rows);
    for (int r = 0; r < rows; ++r) {
      // counts: k, fewer, none, one, and more than k (only k sorted)
      const int64_t want[] = {c.k, c.k / 2, 0, 1, c.k + 5};
      const int n = static_cast<int>(std::min<int64_t>({want[r], c.k, c.bound}));
      count[r] = static_cast<int32_t>(r == 4 ? c.k + 5 : n);
      // n distinct values below bound, the largest (bound - 1) among them, in random order
      std::set<int64_t> chosen;
      if (n > 0) chosen.insert(c.bound - 1);
      std::uniform_int_distribution<int64_t> pick(0, c.bound - 1);
      while (static_cast<int>(chosen.size()) < n) chosen.insert(pick(rng_));
      std::vector<int32_t> v(chosen.begin(), chosen.end());
      std::shuffle(v.begin(), v.end(), rng_);
      std::copy(v.begin(), v.end(), idx.begin() + r * stride);
    }
    int32_t* d_idx = dev(idx);
    const int32_t* d_cnt = dev(count);
    cuda::sort_rows_ascending(d_idx, stride, d_cnt, rows, c.k, c.bound, stream());
    const auto got = host(d_idx, idx.size());
    for (int r = 0; r < rows; ++r) {
      const int n = std::min(count[r], c.k);
      std::vector<int32_t> want(idx.begin() + r * stride, idx.begin() + r * stride + n);
      std::sort(want.begin(), want.end());
      want.insert(want.end(), idx.begin() + r * stride + n, idx.begin() + (r + 1) * stride);
      ASSERT_EQ(std::vector<int32_t>(got.begin() + r * stride, got.begin() + (r + 1) * stride), want) << "row " << r;
    }
  }
}

// One workspace, sized once, serves calls of every shape within its bounds in any order (as the backend's
// decode steps change batch size and context): each path leaves zeroed what the next may read as counters.
TEST_F(CudaKernelsTest, topk_calls_of_any_shape_share_a_workspace) {
  const int max_rows = 64, k = 512;
  const int64_t max_len = 262144;
  std::vector<float> v = randn(max_rows * max_len, rng_);
  float* dv = dev(v);
  int32_t* out = dev<int32_t>(max_rows * k);
  int32_t* cnt = dev<int32_t>(max_rows);
  const size_t ws_bytes = cuda::topk_workspace_bytes(max_rows, max_len, k);
  void* ws = dev<char>(ws_bytes);
  cuda::topk_workspace_init(ws, ws_bytes, stream());
  struct Call {
    int rows;
    int64_t len;
    int streamed;
    int sampled = -1;
  };
  // 64 rows (large chunks: gathered candidates in the scratch), then 2 rows (small chunks, other row strides),
  // the sampled path's thresholds, lists and counts, the streamed kernel's lists, 3 short rows, and back.
  const Call calls[] = {{64, 262144, -1},   {2, 262144, -1},    {64, 262144, -1, 1}, {64, 262144, 1},
                        {3, 20000, -1},     {8, 100000, -1, 1}, {2, 262144, -1},     {2, 262144, -1, 1},
                        {64, 262144, 0},    {8, 100000, -1},    {64, 262144, -1, 1}, {64, 262144, -1}};
  for (const Call& c : calls) {
    const std::string what = std::to_string(c.rows) + "x" + std::to_string(c.len) + " stream " +
                             std::to_string(c.streamed) + " sampled " + std::to_string(c.sampled);
    poison(out, max_rows * k * 4);
    poison(cnt, max_rows * 4);
    cuda::TopkArgs a = topk_args(dv, max_len, nullptr, c.rows, c.len, k, out, cnt);
    a.stream = c.streamed;
    a.sampled = c.sampled;
    cuda::topk(a, ws, stream());
    const auto ho = host(out, c.rows * k);
    const auto hc = host(cnt, c.rows);
    for (int r = 0; r < c.rows; ++r) {
      const std::string row_what = what + " row " + std::to_string(r);
      check_topk_row(v.data() + r * max_len, c.len, k, ho.data() + r * k, hc[r], row_what);
      check_topk_row_stable(v.data() + r * max_len, c.len, k, ho.data() + r * k, hc[r], row_what);
    }
  }
}

TEST_F(CudaKernelsTest, topk_translates_indices_to_pool_pages) {
  const int64_t len = 262144;
  const int k = 512, bits = 6;
  std::vector<float> v = randn(len, rng_);
  std::vector<int32_t> pages(len >> bits);
  std::iota(pages.begin(), pages.end(), 1000);
  std::shuffle(pages.begin(), pages.end(), rng_);
  std::vector<int32_t> inverse(1000 + pages.size());
  for (size_t i = 0; i < pages.size(); ++i) inverse[pages[i]] = static_cast<int32_t>(i);
  float* dv = dev(v);
  int32_t* dp = dev(pages);
  int32_t* out = dev<int32_t>(k);
  cuda::TopkArgs a = topk_args(dv, len, nullptr, 1, len, k, out, nullptr);
  a.page_table = dp;
  a.page_stride = static_cast<int64_t>(pages.size());
  a.page_bits = bits;
  const size_t ws_bytes = cuda::topk_workspace_bytes(1, len, k);
  void* ws = ws_bytes > 0 ? dev<char>(ws_bytes) : nullptr;
  cuda::topk_workspace_init(ws, ws_bytes, stream());
  for (int variant : {1, 2, 3}) {  // the grid kernel's two finishes, the streamed kernel
    poison(out, k * 4);
    a.finish = variant == 1 ? 1 : 2;
    a.stream = variant == 3 ? 1 : -1;
    cuda::topk(a, ws, stream());
    auto ho = host(out, k);
    for (auto& i : ho) {  // back to row indices (a slot left poisoned stays -1: the check fails)
      if (i >= 0 && (i >> bits) < static_cast<int32_t>(inverse.size())) {
        i = (inverse[i >> bits] << bits) | (i & ((1 << bits) - 1));
      }
    }
    check_topk_row(v.data(), len, k, ho.data(), k, "paged, variant " + std::to_string(variant));
  }
}

// The sampled path (TopkArgs::sampled = 1) against a stable sort on shapes it takes (1 to 40 rows of 65,536 to
// 1 M scores, k 1 / 512 / 2,048): scores its sample judges well, rows sorted either way, and rows that go to the
// finish's fallback over the row's scores: all equal, all but one in 1,000 zero, infinities (more equal to the
// threshold than the list holds), high runs on the sample's own places (fewer than k reach the threshold).
// With and without lengths, rows not 16-byte aligned (scalar loads), indices through page tables. Each case:
// two sampled calls on one workspace, then the grid kernel on it (the sampled path leaves it zeroed).
TEST_F(CudaKernelsTest, topk_sampled_path_equals_a_stable_sort) {
  struct SampledCase {
    TopkCase c;
    bool with_lengths;
    int64_t pad;    // floats between rows past the longest (1: rows not 16-byte aligned)
    int page_bits;  // 0: no page table
  };
  const SampledCase cases[] = {
      {{2, 65536, 512, normal, false, 0}, true, 4, 0},
      {{3, 262144, 2048, normal, true, 0}, true, 4, 0},
      {{2, 1048576, 2048, normal, false, 0}, false, 0, 0},
      {{3, 100000, 1, normal, true, 0}, true, 1, 0},
      {{2, 262144, 512, fine_steps, false, 0}, false, 4, 6},
      {{4, 200000, 512, coarse_steps, true, 0}, true, 4, 5},
      {{2, 262144, 512, ascending, false, 0}, true, 4, 0},
      {{2, 262144, 2048, descending, true, 0}, true, 4, 0},
      {{2, 262144, 512, all_equal, false, 0}, true, 4, 0},
      {{2, 262144, 2048, mostly_zeros, true, 0}, true, 4, 0},
      {{2, 262144, 512, mostly_zeros, false, 0}, false, 1, 6},
      {{3, 262144, 512, with_infinities, true, 0}, true, 4, 0},
      {{2, 65536, 512, periodic_peaks, false, 0}, true, 0, 0},
      {{2, 262144, 512, periodic_peaks, false, 0}, false, 0, 0},
      {{2, 1048576, 2048, periodic_peaks, false, 0}, true, 0, 0},
      {{40, 70000, 512, normal, true, 0}, true, 4, 0},  // the fused filter's CTAs across rows, ragged
      {{1, 1048576, 2048, normal, false, 0}, false, 4, 0},
      {{1, 300001, 512, normal, false, 0}, true, 3, 0},  // rows 16-byte aligned, a score past the last group
  };
  for (const auto& [c, with_lengths, pad, page_bits] : cases) {
    const std::string what = "rows " + std::to_string(c.rows) + " len " + std::to_string(c.len) + " k " +
                             std::to_string(c.k) + " dist " + std::to_string(c.dist) + " lengths " +
                             std::to_string(with_lengths) + " pad " + std::to_string(pad) + " page bits " +
                             std::to_string(page_bits);
    SCOPED_TRACE(what);
    const int64_t stride = c.len + pad;
    const std::vector<float> v = topk_scores(c, stride);
    std::vector<int32_t> lengths(c.rows);
    for (int r = 0; r < c.rows; ++r) {
      lengths[r] = static_cast<int32_t>(c.ragged ? c.len - (r * int64_t{104729}) % (c.len + 1) : c.len);
    }
    // Pages: every row's own pages, numbered from 1,000 in a shuffled order across the rows (inverse: page -> its
    // place in its row).
    const int64_t page_stride = page_bits > 0 ? (c.len + (int64_t{1} << page_bits) - 1) >> page_bits : 0;
    std::vector<int32_t> pages(c.rows * page_stride);
    std::iota(pages.begin(), pages.end(), 1000);
    std::shuffle(pages.begin(), pages.end(), rng_);
    std::vector<int32_t> inverse(1000 + pages.size());
    for (size_t i = 0; i < pages.size(); ++i) inverse[pages[i]] = static_cast<int32_t>(i % page_stride);
    float* dv = dev(v);
    int32_t* dl = dev(lengths);
    int32_t* dp = dev(pages);
    int32_t* out = dev<int32_t>(c.rows * c.k);
    int32_t* cnt = dev<int32_t>(c.rows);
    const size_t ws_bytes = cuda::topk_workspace_bytes(c.rows, c.len, c.k);
    void* ws = dev<char>(ws_bytes);
    cuda::topk_workspace_init(ws, ws_bytes, stream());
    for (int run = 0; run < 3; ++run) {
      poison(out, c.rows * c.k * 4);
      poison(cnt, c.rows * 4);
      cuda::TopkArgs a = topk_args(dv, stride, with_lengths ? dl : nullptr, c.rows, c.len, c.k, out, cnt);
      if (page_bits > 0) {
        a.page_table = dp;
        a.page_stride = page_stride;
        a.page_bits = page_bits;
      }
      a.sampled = run < 2 ? 1 : -1;
      cuda::topk(a, ws, stream());
      auto ho = host(out, c.rows * c.k);
      const auto hc = host(cnt, c.rows);
      if (page_bits > 0) {  // back to row places (a slot left poisoned stays -1: the checks fail)
        for (auto& i : ho) {
          if (i >= 0 && (i >> page_bits) < static_cast<int32_t>(inverse.size())) {
            i = (inverse[i >> page_bits] << page_bits) | (i & ((1 << page_bits) - 1));
          }
        }
      }
      for (int r = 0; r < c.rows; ++r) {
        const int64_t len = with_lengths ? lengths[r] : c.len;
        const std::string row_what = "row " + std::to_string(r) + " sampled " + std::to_string(a.sampled) + " run " +
                                     std::to_string(run);
        check_topk_row(v.data() + r * stride, len, c.k, ho.data() + r * c.k, hc[r], row_what);
        check_topk_row_stable(v.data() + r * stride, len, c.k, ho.data() + r * c.k, hc[r], row_what);
      }
    }
  }
}

// ---- fused compressor ----------------------------------------------------------------
struct CompressCase {
  int rate;
  bool overlap;
  int64_t dim, rope_dim;
  int64_t tokens = 4 * 128 + 300;  // the whole sequence
};

// CPU reference entries for [first, last) from the whole sequence's kv / biased scores.
std::vector<float> reference_entries(Backend& cpu, const CompressCase& c, const std::vector<float>& kv,
                                     const std::vector<float>& sc_biased, int64_t first, int64_t last,
                                     const std::vector<float>& norm, const std::vector<float>& inv_freq) {
  const int64_t width = c.overlap ? 2 * c.dim : c.dim;
  const int slots = c.overlap ? 2 * c.rate : c.rate;
  std::vector<const float*> kvp, scp;
  std::vector<float> out((last - first) * c.dim);
  std::vector<float*> outp;
  std::vector<int64_t> pos;
  for (int64_t i = first; i < last; ++i) {
    for (int s = 0; s < slots; ++s) {
      int64_t j, half = 0;
      if (c.overlap) {
        half = s < c.rate ? 0 : 1;
        j = s < c.rate ? (i - 1) * c.rate + s : i * c.rate + (s - c.rate);
      } else {
        j = i * c.rate + s;
      }
      kvp.push_back(j < 0 ? nullptr : kv.data() + j * width + half * c.dim);
      scp.push_back(j < 0 ? nullptr : sc_biased.data() + j * width + half * c.dim);
    }
    outp.push_back(out.data() + (i - first) * c.dim);
    pos.push_back(i * c.rate);
  }
  RopeTable rope{inv_freq.data(), c.rope_dim, 1.f};
  cpu.compress(last - first, slots, c.dim, kvp.data(), scp.data(), norm.data(), 1e-6f, pos.data(), rope, outp.data());
  return out;
}

TEST_F(CudaKernelsTest, compressor_prefill_and_decode_match_cpu) {
  // The last two: more entries than one wave of CTAs (the launch paths for many waves: CSA, 1,099 entries; HCA,
  // 280 entries of 128 slots read by streaming loads).
  const CompressCase cases[] = {{4, true, 512, 64},          {128, false, 512, 64},
                                {4, true, 128, 64},          {16, false, 64, 16},
                                {4, true, 512, 64, 4096 + 300}, {128, false, 512, 64, 128 * 280 + 77}};
  for (const auto& c : cases) {
    SCOPED_TRACE("rate " + std::to_string(c.rate) + " dim " + std::to_string(c.dim) + " tokens " +
                 std::to_string(c.tokens));
    const int64_t width = c.overlap ? 2 * c.dim : c.dim;
    const int64_t ring_slots = c.overlap ? 2 * c.rate : c.rate;
    const int64_t L = c.tokens;
    std::vector<float> kv = randn(L * width, rng_), sc = randn(L * width, rng_, 2.f), ape = randn(c.rate * width, rng_);
    std::vector<float> biased(sc);
    for (int64_t j = 0; j < L; ++j)
      for (int64_t ch = 0; ch < width; ++ch) biased[j * width + ch] += ape[(j % c.rate) * width + ch];
    std::vector<float> norm = randn(c.dim, rng_);
    std::vector<float> inv(c.rope_dim / 2);
    for (size_t i = 0; i < inv.size(); ++i) inv[i] = std::pow(160000.f, -2.f * i / c.rope_dim);
    float* d_ape = dev(ape);
    float* d_norm = dev(norm);
    float* d_inv = dev(inv);
    cuda::CompressorShape shape;
    shape.rate = c.rate;
    shape.overlap = c.overlap;
    shape.dim = c.dim;
    shape.ape = d_ape;
    shape.norm_weight = d_norm;
    shape.eps = 1e-6f;
    shape.rope = RopeTable{d_inv, c.rope_dim, 1.f};

    // Prefill of tokens [start, L) with the ring holding the tokens before start.
    for (int64_t start : {int64_t{0}, int64_t{300}, int64_t{257}}) {
      const int64_t T = L - start;
      std::vector<float> ring(ring_slots * 2 * width, 0.f);
      for (int64_t j = std::max<int64_t>(0, start - ring_slots); j < start; ++j) {
        std::copy(kv.begin() + j * width, kv.begin() + (j + 1) * width, ring.begin() + (j % ring_slots) * 2 * width);
        std::copy(biased.begin() + j * width, biased.begin() + (j + 1) * width,
                  ring.begin() + (j % ring_slots) * 2 * width + width);
      }
      float* d_ring = dev(ring);
      const int64_t first = start / c.rate, last = L / c.rate;
      for (cuda::EntryType type : {cuda::EntryType::f32, cuda::EntryType::bf16}) {
        const size_t esz = type == cuda::EntryType::f32 ? 4 : 2;
        char* d_out = dev<char>((last - first) * c.dim * esz);
        poison(d_out, (last - first) * c.dim * esz);
        std::vector<void*> rows;
        for (int64_t i = first; i < last; ++i) rows.push_back(d_out + (i - first) * c.dim * esz);
        if (type == cuda::EntryType::bf16) {  // the ring is read again: restore it
          gpu_->to_device(d_ring, ring.data(), ring.size() * 4);
        }
        cuda::compress_prefill(shape, dev(std::vector<float>(kv.begin() + start * width, kv.end())),
                               dev(std::vector<float>(sc.begin() + start * width, sc.end())), T, start, d_ring,
                               dev(rows), type, stream());
        const auto ref = reference_entries(*cpu_, c, kv, biased, first, last, norm, inv);
        std::vector<float> got((last - first) * c.dim);
        if (type == cuda::EntryType::f32) {
          got = host(reinterpret_cast<float*>(d_out), got.size());
        } else {
          const auto b = host(reinterpret_cast<uint16_t*>(d_out), got.size());
          for (size_t i = 0; i < got.size(); ++i) got[i] = from_bf16(b[i]);
        }
        EXPECT_CLOSE(got, ref, type == cuda::EntryType::f32 ? 1e-5 : 5e-3);
        // The ring now holds the last ring_slots tokens.
        const auto r = host(d_ring, ring.size());
        for (int64_t j = L - ring_slots; j < L; ++j) {
          for (int64_t ch = 0; ch < width; ch += 37) {
            ASSERT_EQ(r[(j % ring_slots) * 2 * width + ch], kv[j * width + ch]);
            ASSERT_NEAR(r[(j % ring_slots) * 2 * width + width + ch], biased[j * width + ch], 1e-6);
          }
        }
      }
    }

    // Decode: 64 sequences (copies of the same history) each append token p at different p; the
    // first 1, 8 and all 64 of them, f32 and bf16 entries, rings and entries 16-byte aligned or one
    // element off, on the one-wave kernel (TROUPE_COMPRESS_DECODE=1) and on compress_decode_kernel (the default),
    // each run from the same rings with the entries poisoned.
    const int64_t B = 64;
    std::vector<int64_t> positions(B);
    for (int64_t b = 0; b < B; ++b) positions[b] = ring_slots + (b * 37) % (L - ring_slots - 1);
    positions[0] = c.rate - 1;  // the first window closes
    std::vector<float> rings(B * ring_slots * 2 * width, 0.f), kv_new(B * width), sc_new(B * width);
    for (int64_t b = 0; b < B; ++b) {
      const int64_t p = positions[b];
      for (int64_t j = std::max<int64_t>(0, p - ring_slots); j < p; ++j) {
        std::copy(kv.begin() + j * width, kv.begin() + (j + 1) * width,
                  rings.begin() + (b * ring_slots + j % ring_slots) * 2 * width);
        std::copy(biased.begin() + j * width, biased.begin() + (j + 1) * width,
                  rings.begin() + (b * ring_slots + j % ring_slots) * 2 * width + width);
      }
      std::copy(kv.begin() + p * width, kv.begin() + (p + 1) * width, kv_new.begin() + b * width);
      std::copy(sc.begin() + p * width, sc.begin() + (p + 1) * width, sc_new.begin() + b * width);
    }
    float* d_ring_pool = dev<float>(rings.size() + 1);
    char* d_out_pool = dev<char>(B * c.dim * 4 + 4);
    float* d_kv_new = dev(kv_new);
    float* d_sc_new = dev(sc_new);
    int64_t* d_positions = dev(positions);
    for (const char* form : {"1", static_cast<const char*>(nullptr)}) {
      for (cuda::EntryType type : {cuda::EntryType::f32, cuda::EntryType::bf16}) {
        for (int shift : {0, 1}) {
          const size_t esz = type == cuda::EntryType::f32 ? 4 : 2;
          float* const d_rings = d_ring_pool + shift;
          char* const d_out = d_out_pool + shift * esz;
          std::vector<float*> ring_ptrs;
          std::vector<void*> out_ptrs;
          for (int64_t b = 0; b < B; ++b) {
            ring_ptrs.push_back(d_rings + b * ring_slots * 2 * width);
            out_ptrs.push_back(d_out + b * c.dim * esz);
          }
          float** d_ring_ptrs = dev(ring_ptrs);
          void** d_out_ptrs = dev(out_ptrs);
          for (int64_t n : {int64_t{1}, int64_t{8}, B}) {
            SCOPED_TRACE(std::string("decode form ") + (form != nullptr ? form : "default") + ", " +
                         (esz == 4 ? "f32" : "bf16") + (shift != 0 ? ", rows one element off" : "") + ", batch " +
                         std::to_string(n));
            gpu_->to_device(d_rings, rings.data(), rings.size() * 4);
            poison(d_out, B * c.dim * esz);
            {
              const ScopedEnv env("TROUPE_COMPRESS_DECODE", form);
              cuda::compress_decode(shape, d_kv_new, d_sc_new, n, d_positions, d_ring_ptrs, d_out_ptrs, type,
                                    stream());
            }
            std::vector<float> got(B * c.dim);
            if (type == cuda::EntryType::f32) {
              got = host(reinterpret_cast<float*>(d_out), got.size());
            } else {
              const auto h = host(reinterpret_cast<uint16_t*>(d_out), got.size());
              for (size_t i = 0; i < got.size(); ++i) got[i] = from_bf16(h[i]);
            }
            const auto r = host(d_rings, rings.size());
            int closed = 0;
            for (int64_t b = 0; b < n; ++b) {
              const int64_t p = positions[b];
              for (int64_t ch = 0; ch < width; ch += 13) {
                ASSERT_EQ(r[(b * ring_slots + p % ring_slots) * 2 * width + ch], kv[p * width + ch]);
                ASSERT_NEAR(r[(b * ring_slots + p % ring_slots) * 2 * width + width + ch], biased[p * width + ch],
                            1e-6);
              }
              if ((p + 1) % c.rate != 0) continue;
              ++closed;
              const auto ref = reference_entries(*cpu_, c, kv, biased, p / c.rate, p / c.rate + 1, norm, inv);
              EXPECT_CLOSE(std::vector<float>(got.begin() + b * c.dim, got.begin() + (b + 1) * c.dim), ref,
                           type == cuda::EntryType::f32 ? 1e-5 : 5e-3);
            }
            EXPECT_GT(closed, 0);
            // The sequences past the call's batch keep their rings.
            for (size_t i = static_cast<size_t>(n * ring_slots * 2 * width); i < rings.size(); ++i) {
              ASSERT_EQ(r[i], rings[i]);
            }
          }
        }
      }
    }
  }
}

// Entries whose slots point anywhere (the backend op): many waves of CTAs, slot rows at
// every alignment (an entry with a row not 16-byte aligned takes the checked loads; the
// others read float4s unchecked), some slots empty.
TEST_F(CudaKernelsTest, compressor_slots_at_any_alignment_match_cpu) {
  const int64_t count = 3000, dim = 128, rope_dim = 64;
  const int slots = 8;
  std::vector<float> pool = randn(count * slots * 2 * (dim + 4), rng_), norm = randn(dim, rng_);
  std::vector<float> inv(rope_dim / 2);
  for (size_t i = 0; i < inv.size(); ++i) inv[i] = std::pow(160000.f, -2.f * i / rope_dim);
  float* d_pool = dev(pool);
  std::vector<const float*> kv_h, sc_h, kv_d, sc_d;
  std::vector<int64_t> pos(count);
  std::uniform_int_distribution<int64_t> row(0, count * slots * 2 - 1);
  std::uniform_int_distribution<int> shift(0, 3), empty(0, 7);
  int unaligned = 0;
  for (int64_t e = 0; e < count; ++e) {
    pos[e] = e * 4;
    for (int s = 0; s < slots; ++s) {
      const bool none = empty(rng_) == 0 && s > 0;  // slot 0 always holds a row
      const int sk = e % 2 == 1 ? shift(rng_) : 0, sc = e % 2 == 1 ? shift(rng_) : 0;  // even entries aligned
      const int64_t k = row(rng_) * (dim + 4) + sk, c = row(rng_) * (dim + 4) + sc;
      unaligned += (k % 4 != 0 || c % 4 != 0) && !none;
      kv_h.push_back(none ? nullptr : pool.data() + k);
      sc_h.push_back(none ? nullptr : pool.data() + c);
      kv_d.push_back(none ? nullptr : d_pool + k);
      sc_d.push_back(none ? nullptr : d_pool + c);
    }
  }
  ASSERT_GT(unaligned, 0);
  std::vector<float> ref(count * dim);
  std::vector<float*> ref_rows;
  std::vector<float*> out_rows;
  float* d_out = dev<float>(count * dim);
  poison(d_out, count * dim * 4);
  for (int64_t e = 0; e < count; ++e) {
    ref_rows.push_back(ref.data() + e * dim);
    out_rows.push_back(d_out + e * dim);
  }
  cpu_->compress(count, slots, dim, kv_h.data(), sc_h.data(), norm.data(), 1e-6f, pos.data(),
                 RopeTable{inv.data(), rope_dim, 1.f}, ref_rows.data());
  cuda::compress_slots(count, slots, dim, dev(kv_d), dev(sc_d), dev(norm), 1e-6f, dev(pos),
                       RopeTable{dev(inv), rope_dim, 1.f}, dev(out_rows), stream());
  EXPECT_CLOSE(host(d_out, count * dim), ref, 1e-5);
}

// ---- lightning indexer ------------------------------------------------------------------
float e4m3_to_float(uint8_t b) {
  const int sign = b >> 7, exp = (b >> 3) & 0xf, mant = b & 7;
  float v = exp == 0 ? std::ldexp(static_cast<float>(mant), -9) : std::ldexp(1.f + mant / 8.f, exp - 7);
  return sign ? -v : v;
}

TEST_F(CudaKernelsTest, indexer_scores_and_topk_match_a_reference) {
  struct Case {
    int heads;
    std::vector<int32_t> lengths;
    bool paged;
    cuda::IndexKeyType type;
    int distinct = 0;  // > 0: the keys repeat this many rows (ties at the k-th score: many, or all equal)
    bool query_e4m3 = false;  // e4m3 keys: the query quantized too (the fp8 tensor cores)
  };
  // Every case runs fused (scores and top-k in one kernel) and as two kernels (TROUPE_INDEXER_FUSED=0).
  // The tie cases: 40 distinct keys put ~2,500 equal scores at the k-th (the fused kernel's candidate
  // list, each element ranked by its index); one distinct key makes every score equal (more than the
  // list holds: selected from the row's scores).
  const Case cases[] = {{64, {262144}, false, cuda::IndexKeyType::bf16},
                        {64, {0, 7, 5000, 100000}, false, cuda::IndexKeyType::bf16},
                        {64, {70000, 4096}, true, cuda::IndexKeyType::bf16},
                        {64, {262144}, false, cuda::IndexKeyType::e4m3},
                        {40, {3000, 17}, true, cuda::IndexKeyType::e4m3},
                        {64, {262144}, false, cuda::IndexKeyType::e4m3, 0, true},
                        {40, {3000, 17, 70000}, true, cuda::IndexKeyType::e4m3, 0, true},
                        {4, {1000}, false, cuda::IndexKeyType::bf16},
                        {64, {100000, 600}, false, cuda::IndexKeyType::bf16, 40},
                        {64, {30000}, true, cuda::IndexKeyType::bf16, 1}};
  int fused_runs = 0;
  for (const auto& c : cases) {
    for (const bool fused : {true, false}) {
      SCOPED_TRACE("heads " + std::to_string(c.heads) + " type " + std::to_string(static_cast<int>(c.type)) +
                   (c.query_e4m3 ? " e4m3 query" : "") +
                   (c.paged ? " paged" : "") + (fused ? " fused" : " two kernels") +
                   (c.distinct > 0 ? " distinct keys " + std::to_string(c.distinct) : ""));
      if (fused) {  // fused wherever it fits (by default more than 131,072 keys a query take two kernels)
        setenv("TROUPE_INDEXER_FUSED", "1", 1);
      } else {
        setenv("TROUPE_INDEXER_FUSED", "0", 1);
      }
      const int B = static_cast<int>(c.lengths.size());
      const int64_t max_keys = *std::max_element(c.lengths.begin(), c.lengths.end());
      const int page = 64;
      // Pool: each query's keys in its own range (contiguous) or in shuffled pages.
      std::vector<int64_t> start(B);
      std::vector<int32_t> table;
      const int64_t pages_per_q = (max_keys + page - 1) / page;
      int64_t pool_rows = 0;
      for (int b = 0; b < B; ++b) {
        start[b] = pool_rows;
        pool_rows += c.paged ? pages_per_q * page : c.lengths[b];
      }
      pool_rows = std::max<int64_t>(pool_rows, 1);
      if (c.paged) {
        std::vector<int32_t> perm(pool_rows / page);
        std::iota(perm.begin(), perm.end(), 0);
        std::shuffle(perm.begin(), perm.end(), rng_);
        table = perm;  // query b's page j is perm[b * pages_per_q + j]
      }
      auto row_of = [&](int b, int64_t s) -> int64_t {
        return c.paged ? static_cast<int64_t>(table[b * pages_per_q + s / page]) * page + s % page : start[b] + s;
      };
      std::vector<float> keys = randn(pool_rows * 128, rng_);
      if (c.distinct > 0) {
        for (int64_t r = 0; r < pool_rows; ++r) {
          const int64_t from = static_cast<int64_t>(rng_() % static_cast<uint32_t>(c.distinct));
          std::copy_n(keys.begin() + from * 128, 128, keys.begin() + r * 128);
        }
      }
      std::vector<float> q = randn(B * c.heads * 128, rng_), w = randn(B * c.heads, rng_);
      // Device keys and the values the kernel actually multiplies (for the reference).
      std::vector<float> kref(keys.size()), scales(pool_rows, 1.f);
      void* d_keys;
      float* d_scales = nullptr;
      if (c.type == cuda::IndexKeyType::bf16) {
        std::vector<uint16_t> kb(keys.size());
        for (size_t i = 0; i < keys.size(); ++i) {
          kb[i] = bf16_bits(keys[i]);
          kref[i] = from_bf16(kb[i]);
        }
        d_keys = dev(kb);
      } else {
        float* d_f = dev(keys);
        uint8_t* d_q = dev<uint8_t>(keys.size());
        d_scales = dev<float>(pool_rows);
        cuda::quantize_keys_e4m3(d_f, pool_rows, d_q, d_scales, stream());
        const auto qb = host(d_q, keys.size());
        scales = host(d_scales, pool_rows);
        for (size_t i = 0; i < keys.size(); ++i) kref[i] = e4m3_to_float(qb[i]) * scales[i / 128];
        d_keys = d_q;
      }
      const float scale = 1.f / std::sqrt(128.f), wscale = 1.f / std::sqrt(static_cast<float>(c.heads));
      float* d_scores = dev<float>(B * max_keys);
      poison(d_scores, B * max_keys * 4);
      cuda::IndexerArgs a;
      a.q = dev(q);
      a.w = dev(w);
      a.batch = B;
      a.heads = c.heads;
      a.scale = scale;
      a.weight_scale = wscale;
      a.key_type = c.type;
      a.query_e4m3 = c.query_e4m3;
      a.keys = d_keys;
      a.key_scales = d_scales;
      if (c.paged) {
        a.page_table = dev(table);
        a.page_stride = pages_per_q;
        a.page_size = page;
      } else {
        a.key_start = dev(start);
      }
      a.n_keys = dev(c.lengths);
      a.max_keys = max_keys;
      a.scores = d_scores;
      a.score_stride = max_keys;
      const int k = 512;
      int32_t* d_idx = dev<int32_t>(B * k);
      int32_t* d_cnt = dev<int32_t>(B);
      const size_t ws_bytes = cuda::indexer_topk_workspace_bytes(B, max_keys, k);
      void* ws = ws_bytes > 0 ? dev<char>(ws_bytes) : nullptr;
      cuda::topk_workspace_init(ws, ws_bytes, stream());
      cuda::IndexerTopk t;
      t.k = k;
      t.out_idx = d_idx;
      t.out_stride = k;
      t.out_count = d_cnt;
      if (!fused) {
        ASSERT_FALSE(cuda::indexer_topk_is_fused(a, t)) << "TROUPE_INDEXER_FUSED=0";
      } else {
        unsetenv("TROUPE_INDEXER_FUSED");
        const bool by_default = cuda::indexer_topk_is_fused(a, t);
        setenv("TROUPE_INDEXER_FUSED", "1", 1);
        if (max_keys > 131072) {
          EXPECT_FALSE(by_default) << "more than 131,072 keys a query take two kernels";
        } else {
          EXPECT_EQ(by_default, cuda::indexer_topk_is_fused(a, t)) << "the default fuses wherever it fits";
        }
      }
      fused_runs += cuda::indexer_topk_is_fused(a, t) ? 1 : 0;
      cuda::indexer_topk(a, t, ws, stream());
      const auto scores = host(d_scores, B * max_keys);
      const auto idx = host(d_idx, B * k);
      const auto cnt = host(d_cnt, B);
      // The query as the tensor cores see it: bf16 (with bf16 keys), f16 (with e4m3 keys) or, with
      // query_e4m3, each head's row as quantize_keys_e4m3 makes it (the kernel quantizes the same way).
      std::vector<float> qr(q.size());
      if (c.query_e4m3) {
        const int64_t rows = static_cast<int64_t>(q.size()) / 128;
        uint8_t* d_q8 = dev<uint8_t>(q.size());
        float* d_qs = dev<float>(rows);
        cuda::quantize_keys_e4m3(a.q, rows, d_q8, d_qs, stream());
        const auto q8 = host(d_q8, q.size());
        const auto qs = host(d_qs, rows);
        for (size_t i = 0; i < q.size(); ++i) qr[i] = e4m3_to_float(q8[i]) * qs[i / 128];
      } else {
        for (size_t i = 0; i < q.size(); ++i) {
          qr[i] = c.type == cuda::IndexKeyType::bf16 ? round_bf16(q[i]) : from_f16(f16_bits(q[i]));
        }
      }
      for (int b = 0; b < B; ++b) {
        const int64_t n = c.lengths[b];
        // Reference on a sample of keys (all of them when few).
        const int64_t step = std::max<int64_t>(1, n / 4000);
        std::vector<float> got, ref;
        for (int64_t s = 0; s < n; s += step) {
          double total = 0;
          for (int h = 0; h < c.heads; ++h) {
            double dot = 0;
            for (int i = 0; i < 128; ++i)
              dot += static_cast<double>(qr[(b * c.heads + h) * 128 + i]) * kref[row_of(b, s) * 128 + i];
            total += std::max(dot, 0.0) * scale * w[b * c.heads + h] * wscale;
          }
          ref.push_back(static_cast<float>(total));
          got.push_back(scores[b * max_keys + s]);
        }
        // An e4m3 query's dot products run on the fp8 tensor cores, whose sums keep fewer mantissa bits
        // than fp32 (the benchmark's relative errors: 1.0-1.4e-4, against 1.4-2.7e-7 for the f16 and bf16 forms;
        // this test's worst case 1.6e-4).
        if (!ref.empty()) EXPECT_CLOSE(got, ref, c.query_e4m3 ? 5e-4 : 2e-4);
        // The top-k is exact on the kernel's own scores, ties by lower index.
        check_topk_row(scores.data() + b * max_keys, n, k, idx.data() + b * k, cnt[b], "query " + std::to_string(b));
        check_topk_row_stable(scores.data() + b * max_keys, n, k, idx.data() + b * k, cnt[b],
                              "query " + std::to_string(b));
      }
      {  // again on the same workspace (the words the last call left for the next): the same choice
        poison(d_idx, B * k * 4);
        cuda::indexer_topk(a, t, ws, stream());
        const auto again = host(d_idx, B * k);
        for (int b = 0; b < B; ++b) {
          const int64_t take = std::min<int64_t>(k, c.lengths[b]);
          std::vector<int32_t> x(idx.begin() + b * k, idx.begin() + b * k + take),
              y(again.begin() + b * k, again.begin() + b * k + take);
          std::sort(x.begin(), x.end());
          std::sort(y.begin(), y.end());
          EXPECT_EQ(x, y) << "query " << b << ": a second call on the same workspace chose differently";
        }
      }
      if (c.paged) {  // the same call with the indices translated to pool rows through the page table
        t.translate_pages = true;
        cuda::indexer_topk(a, t, ws, stream());
        const auto rows = host(d_idx, B * k);
        for (int b = 0; b < B; ++b) {  // the chosen set, translated (the order of a row's slots is free)
          std::vector<int64_t> want, got;
          for (int j = 0; j < std::min<int64_t>(k, c.lengths[b]); ++j) {
            want.push_back(row_of(b, idx[b * k + j]));
            got.push_back(rows[b * k + j]);
          }
          std::sort(want.begin(), want.end());
          std::sort(got.begin(), got.end());
          ASSERT_EQ(got, want) << "query " << b << ": translated rows";
        }
      }
    }
  }
  unsetenv("TROUPE_INDEXER_FUSED");
  EXPECT_GT(fused_runs, 0) << "no case took the fused kernel";
}

TEST_F(CudaKernelsTest, indexer_rejects_an_e4m3_query_it_cannot_run) {
  const std::vector<int32_t> lengths = {100};
  cuda::IndexerArgs a;
  a.q = dev<float>(64 * 128);
  a.w = dev<float>(64);
  a.batch = 1;
  a.heads = 64;
  a.key_type = cuda::IndexKeyType::bf16;
  a.query_e4m3 = true;
  a.keys = dev<uint16_t>(100 * 128);
  a.key_start = dev(std::vector<int64_t>{0});
  a.n_keys = dev(lengths);
  a.max_keys = 100;
  a.scores = dev<float>(100);
  a.score_stride = 100;
  auto message_of = [&] {
    try {
      cuda::indexer_scores(a, stream());
    } catch (const std::invalid_argument& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_NE(message_of().find("an e4m3 query needs e4m3 keys"), std::string::npos) << message_of();
  a.key_type = cuda::IndexKeyType::e4m3;
  a.keys = dev<uint8_t>(100 * 128);
  a.key_scales = dev<float>(100);
  setenv("TROUPE_INDEXER_WGMMA", "0", 1);
  const std::string mma_sync = message_of();
  unsetenv("TROUPE_INDEXER_WGMMA");
  EXPECT_NE(mma_sync.find("wgmma only"), std::string::npos) << mma_sync;
  EXPECT_EQ(message_of(), "no error");
  gpu_->synchronize();
}

// The backend op's scoring over fp32 keys named by row pointers, in both forms: the split-bf16
// tensor-core form (128 channels) within 2e-5 of a double reference (bf16 alone: ~3e-3), the fp32
// CUDA-core form within 1e-6; outputs NaN-poisoned, ragged lists (empty, one key, unit edges), head
// counts under 64, and rows in pool order unrelated to the key order.
TEST_F(CudaKernelsTest, indexer_ragged_forms_match_a_reference) {
  struct Case {
    int heads;
    std::vector<int64_t> lengths;
  };
  const Case cases[] = {{64, {0, 1, 63, 64, 65, 1000, 20000}}, {40, {3000, 129}}, {64, {70000}}, {7, {500, 2}}};
  const int64_t dim = 128;
  for (const auto& c : cases) {
    const int64_t n = static_cast<int64_t>(c.lengths.size());
    const int64_t total = std::accumulate(c.lengths.begin(), c.lengths.end(), int64_t{0});
    const int64_t pool_rows = total + 101, max_len = *std::max_element(c.lengths.begin(), c.lengths.end());
    const std::vector<float> pool = randn(pool_rows * dim, rng_), q = randn(n * c.heads * dim, rng_),
                             w = randn(n * c.heads, rng_);
    const float* gpool = dev(pool);
    std::vector<const float*> rows;
    std::vector<int64_t> offsets{0}, row_id;
    for (int64_t t = 0; t < n; ++t) {
      for (int64_t s = 0; s < c.lengths[t]; ++s) {
        row_id.push_back((row_id.size() * 7919 + 13) % pool_rows);
        rows.push_back(gpool + row_id.back() * dim);
      }
      offsets.push_back(static_cast<int64_t>(rows.size()));
    }
    const float scale = 1.f / std::sqrt(static_cast<float>(dim)), wscale = 1.f / std::sqrt(static_cast<float>(c.heads));
    std::vector<float> ref(static_cast<size_t>(n * max_len), 0.f);
    for (int64_t t = 0; t < n; ++t) {
      const std::vector<int64_t> ids(row_id.begin() + offsets[t], row_id.begin() + offsets[t + 1]);
      const std::vector<double> sc = index_scores(q, w, t, c.heads, dim, pool, ids, scale, wscale);
      for (size_t s = 0; s < sc.size(); ++s) ref[t * max_len + s] = static_cast<float>(sc[s]);
    }
    const RaggedRows keys{dev(rows), dev(offsets), max_len};
    const float *gq = dev(q), *gw = dev(w);
    float* scores = dev<float>(n * max_len);
    for (const auto form : {cuda::RaggedForm::split, cuda::RaggedForm::fp32}) {
      const bool split = form == cuda::RaggedForm::split;
      SCOPED_TRACE(std::string(split ? "split" : "fp32") + " heads " + std::to_string(c.heads));
      cudaMemsetAsync(scores, 0, n * max_len * 4, stream());  // entries past a query's list compare as 0
      for (int64_t t = 0; t < n; ++t) poison(scores + t * max_len, c.lengths[t] * 4);
      cuda::indexer_scores_ragged(gq, gw, n, c.heads, dim, scale, wscale, keys, scores, max_len, max_len, stream(),
                                  form);
      ASSERT_EQ(cudaGetLastError(), cudaSuccess);
      EXPECT_CLOSE(host(scores, n * max_len), ref, split ? 2e-5 : 1e-6);
    }
  }
  // The split form takes 128-channel keys only: a clear error for others (automatic falls back to fp32).
  const RaggedRows none{dev<const float*>(1), dev(std::vector<int64_t>{0, 0}), 1};
  try {
    cuda::indexer_scores_ragged(dev<float>(64 * 96), dev<float>(64), 1, 64, 96, 1.f, 1.f, none, dev<float>(4), 4, 1,
                                stream(), cuda::RaggedForm::split);
    ADD_FAILURE() << "no error";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("128-channel"), std::string::npos) << e.what();
  }
  gpu_->synchronize();
}

// ---- attention --------------------------------------------------------------------------
// Both forms (64 heads a CTA, and the narrow 16), with and without key splits, against the CPU; heads
// that are no multiple of 16 or 64 leave the last CTA's rows past them unused.
TEST_F(CudaKernelsTest, attention_with_bf16_keys_and_derotation_matches_cpu) {
  const int64_t dim = 512, rope_dim = 64, n = 5;
  const std::vector<int64_t> lengths = {640, 128, 8320, 1, 0};
  const int64_t pool_rows = 9000;
  std::vector<float> pool = randn(pool_rows * dim, rng_);
  std::vector<uint16_t> pool_b(pool.size());
  for (size_t i = 0; i < pool.size(); ++i) {
    pool_b[i] = bf16_bits(pool[i]);
    pool[i] = from_bf16(pool_b[i]);
  }
  std::vector<int64_t> positions = {1000, 5, 1048000, 77, 3};
  std::vector<float> inv(rope_dim / 2);
  for (size_t i = 0; i < inv.size(); ++i) inv[i] = std::pow(160000.f, -2.f * i / rope_dim);
  std::vector<const float*> crows;
  std::vector<const void*> grows;
  std::vector<int64_t> offsets{0};
  uint16_t* d_pool = dev(pool_b);
  for (int64_t t = 0; t < n; ++t) {
    for (int64_t s = 0; s < lengths[t]; ++s) {
      const int64_t r = (s * 17 + t) % pool_rows;
      crows.push_back(pool.data() + r * dim);
      grows.push_back(d_pool + r * dim);
    }
    offsets.push_back(static_cast<int64_t>(crows.size()));
  }
  float* d_inv = dev(inv);
  RopeTable rc{inv.data(), rope_dim, 1.f}, rg{d_inv, rope_dim, 1.f};
  const float scale = 1.f / std::sqrt(static_cast<float>(dim));
  for (int heads : {64, 40}) {
    std::vector<float> q = randn(n * heads * dim, rng_, 0.5f), sinks = randn(heads, rng_);
    // CPU reference: attention, then the inverse RoPE of the output.
    std::vector<float> ref(n * heads * dim);
    cpu_->attention(q.data(), n, heads, dim, {crows.data(), offsets.data()}, sinks.data(), scale, ref.data());
    cpu_->rope(ref.data(), n, heads, dim, rc, positions.data(), true);
    float* d_out = dev<float>(n * heads * dim);
    std::vector<float> first;
    for (int form : {64, 16}) {
      for (int splits : {0, 1, 7}) {
        SCOPED_TRACE("heads " + std::to_string(heads) + " form " + std::to_string(form) + " splits " +
                     std::to_string(splits));
        poison(d_out, n * heads * dim * 4);
        cuda::AttentionArgs a;
        a.q = dev(q);
        a.n_queries = n;
        a.heads = heads;
        a.dim = dim;
        a.key_type = cuda::KeyType::bf16;
        a.rows = dev(grows);
        a.offsets = dev(offsets);
        a.max_keys = *std::max_element(lengths.begin(), lengths.end());
        a.sinks = dev(sinks);
        a.scale = scale;
        a.out = d_out;
        a.derope = &rg;
        a.positions = dev(positions);
        a.splits = splits;
        a.cta_heads = form;
        const size_t ws = cuda::attention_workspace_bytes(a);
        cuda::attention(a, ws > 0 ? dev<char>(ws) : nullptr, stream());
        const auto got = host(d_out, n * heads * dim);
        EXPECT_CLOSE(got, ref, 1e-2);
        if (first.empty()) {
          first = got;
        } else {
          EXPECT_CLOSE(got, first, 5e-3);  // the form and the key splits change only rounding (P is bf16)
        }
      }
    }
  }
}

}  // namespace
}  // namespace troupe::kernels::testing
