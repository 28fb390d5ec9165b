// The CUDA backend (see cuda_backend.hpp): owns the stream, the cuBLAS handle
// and scratch memory, and maps every Backend op onto the kernels of this folder.
#include <cublas_v2.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <new>
#include <vector>

#include "kernels/cuda/attention.hpp"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/compressor.hpp"
#include "kernels/cuda/cuda_backend.hpp"
#include "kernels/cuda/decode.hpp"
#include "kernels/cuda/dense.hpp"
#include "kernels/cuda/indexer.hpp"
#include "kernels/cuda/topk.hpp"

namespace troupe::kernels::cuda {
namespace {

#define TROUPE_CUBLAS(call)                                                                          \
  do {                                                                                               \
    cublasStatus_t troupe_st_ = (call);                                                              \
    if (troupe_st_ != CUBLAS_STATUS_SUCCESS)                                                         \
      ::troupe::kernels::cuda::fail(#call, __FILE__, __LINE__, cublasGetStatusString(troupe_st_));   \
  } while (0)

// RAII owners of CUDA handles: made through out(), destroyed with Destroy.
template <class H, auto Destroy>
class Owned {
 public:
  Owned() = default;
  ~Owned() {
    if (h_ != nullptr) Destroy(h_);
  }
  Owned(const Owned&) = delete;
  Owned& operator=(const Owned&) = delete;
  H get() const { return h_; }

 protected:
  H* out() { return &h_; }

 private:
  H h_ = nullptr;
};

class Stream : public Owned<cudaStream_t, cudaStreamDestroy> {
 public:
  Stream() { TROUPE_CUDA(cudaStreamCreateWithFlags(out(), cudaStreamNonBlocking)); }
};

class Cublas : public Owned<cublasHandle_t, cublasDestroy> {
 public:
  explicit Cublas(cudaStream_t s) {
    TROUPE_CUBLAS(cublasCreate(out()));
    TROUPE_CUBLAS(cublasSetStream(get(), s));
    TROUPE_CUBLAS(cublasSetMathMode(get(), CUBLAS_DEFAULT_MATH));  // no TF32 for fp32 GEMMs
  }
};

// Memory that recorded graphs may still point at: freed only when the backend
// dies once any graph was made (set by capture_end).
struct Keep {
  bool graphs = false;
  std::vector<void*> retired;
  void release(void* p) {
    if (p == nullptr) return;
    if (graphs) {
      retired.push_back(p);
    } else {
      cudaFree(p);
    }
  }
  ~Keep() {
    for (void* p : retired) cudaFree(p);
  }
};

class DeviceBuffer {
 public:
  explicit DeviceBuffer(Keep* keep = nullptr) : keep_(keep) {}
  ~DeviceBuffer() { reset(); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  void* get() const { return p_; }
  size_t size() const { return bytes_; }
  // Grows to at least `bytes` (contents are lost when it grows).
  bool reserve(size_t bytes) {
    if (bytes <= bytes_) return false;
    reset();
    TROUPE_CUDA(cudaMalloc(&p_, bytes));
    bytes_ = bytes;
    return true;
  }
  void reset() {
    if (keep_ != nullptr) {
      keep_->release(p_);
    } else if (p_ != nullptr) {
      cudaFree(p_);
    }
    p_ = nullptr;
    bytes_ = 0;
  }

 private:
  Keep* keep_;
  void* p_ = nullptr;
  size_t bytes_ = 0;
};

// Scratch of one op. Regions handed out in one epoch never move; an epoch that
// needed several chunks is consolidated into one at the next begin() (cudaFree
// waits for the device, so queued work never loses its memory). An epoch takes
// from the chunks in order, from the first, and adds one only past the last: while
// chunks are not consolidated (graphs live) an op of any size reuses them, where
// taking from the last chunk alone added a chunk at every call of an op larger
// than it.
class Arena {
 public:
  explicit Arena(Keep* keep) : keep_(keep) {}
  ~Arena() {
    for (auto& c : chunks_) keep_->release(c.first);
  }
  // While graphs live (or one is being recorded) chunks are never consolidated:
  // recorded ops keep pointing at them.
  bool frozen = false;
  void begin() {
    if (chunks_.size() > 1 && !frozen && !keep_->graphs) {
      size_t total = 0;
      for (auto& c : chunks_) {
        total += c.second;
        cudaFree(c.first);
      }
      chunks_.clear();
      add_chunk(total);
    }
    at_ = 0;
    used_ = 0;
  }
  template <class T>
  T* take(int64_t n) {
    const size_t bytes = (static_cast<size_t>(std::max<int64_t>(n, 1)) * sizeof(T) + 255) / 256 * 256;
    while (at_ < chunks_.size() && used_ + bytes > chunks_[at_].second) {
      ++at_;
      used_ = 0;
    }
    if (at_ == chunks_.size()) {
      add_chunk(std::max<size_t>(bytes, size_t{64} << 20));
      used_ = 0;
    }
    void* p = static_cast<char*>(chunks_[at_].first) + used_;
    used_ += bytes;
    return static_cast<T*>(p);
  }

 private:
  void add_chunk(size_t bytes) {
    void* p = nullptr;
    TROUPE_CUDA(cudaMalloc(&p, bytes));
    chunks_.emplace_back(p, bytes);
  }
  Keep* keep_;
  std::vector<std::pair<void*, size_t>> chunks_;
  size_t at_ = 0;    // the chunk this epoch takes from
  size_t used_ = 0;  // bytes of it taken
};

cudaDataType_t cuda_type(WeightType t) {
  switch (t) {
    case WeightType::f32: return CUDA_R_32F;
    case WeightType::bf16: return CUDA_R_16BF;
    case WeightType::f16: return CUDA_R_16F;
    case WeightType::e4m3:
    case WeightType::e2m1:
      TROUPE_REQUIRE(false, "FP8 / FP4 weights are dequantized before they reach this backend");
  }
  return CUDA_R_32F;
}

// TROUPE_MHC_UNFUSED=1: the mix GEMV and the one-block-per-row finish (the form
// before the fused kernels), for comparisons.
bool mhc_unfused() {
  static const bool off = [] {
    const char* e = std::getenv("TROUPE_MHC_UNFUSED");
    return e != nullptr && std::strcmp(e, "1") == 0;
  }();
  return off;
}

// Half-precision GEMMs (cuBLAS, past kGemvBatchRows rows) take the activations as two terms, half(x) and
// half(x - half(x)), two products summed in fp32: ~16 mantissa bits of x instead of 8, as the tensor-core
// GEMV keeps at up to 8 rows, so that no batch shape rounds x to bf16. Below kSplitMinRows rows (decode
// batches, the batched MoE, a prefill's per-expert GEMMs of few rows) the two terms' rows are stacked
// into one GEMM of twice the rows, which reads the weights once (those GEMMs are bound by the weights'
// bytes), and a small kernel (or the MoE's swiglu and combine) adds the two products; from kSplitMinRows
// rows (prefill) two passes, the second accumulating: it doubles the tensor-core work, 17-25 % of prefill
// throughput (run 41, H100, prompts of 512), taken for exactness. Why: with bf16-rounded activations the
// prefill's products moved the Flash-shaped model's logits off transformers' fp32 run enough to flip
// its top-1 on 1.0 % of 2,304 positions on an H100 (run 41: 98.96 %); split from 128 rows 99.83 %, split
// everywhere 99.91 % (run 44), with the greedy tokens of a request the same in batches of 16 and 64 where
// the rounded forms' were not, for +4.5 % / +10.4 % a decode step at batch 16 / 64 against split from 128
// rows (docs/kernel-runs/run44-split.md; at batch 64 nearly all of it in the dense products, the routed
// experts +18 of +328 us, run45-xsplit.md; H200, run 46, with linear_multi's grouped conversions and adds:
// +4.2 % / +8.6 %). TROUPE_GEMM_SPLIT=0: no split
// (x rounded to half); =2: from kSplitMinRows rows only (session 41's rule: faster decode at 9-127 rows);
// unset or else: every half-precision GEMM.
constexpr int64_t kSplitMinRows = 128;
bool gemm_split(int64_t rows) {
  static const char mode = [] {
    const char* e = std::getenv("TROUPE_GEMM_SPLIT");
    return e == nullptr ? '1' : e[0];
  }();
  return mode != '0' && (mode != '2' || rows >= kSplitMinRows);
}

constexpr int64_t kAttentionF32Queries = kGemvBatchRows;  // attention calls this small run in fp32,
// when their key lists are bounded by this: the fp32 path pads every list to the bound
// (a Decoder's HCA bound is the window plus every entry max_context allows), so a
// long bound would cost its full length at any context.
constexpr int64_t kAttentionF32MaxKeys = 2048;
constexpr int64_t kPairsWithoutSync = 64;  // MoE pairs of one row handled pair by pair
constexpr int64_t kRowsWithoutSync = 64;   // MoE rows handled without a host round trip
// MoE calls of 2 to kRowsWithoutSync rows over bf16 / f16 experts run as batched GEMMs on the tensor
// cores over the touched experts (moe_batched): each touched expert's weights read once, at ~2.4-2.8
// TB/s, where the grouped GEMVs read them once per 8 rows at 0.3-1.5 TB/s. H100, run 39, Backend::moe
// alone, 4096 x 2048 experts, top-6, us a call: 16 experts, 2 / 8 / 64 rows 343 / 558 / 2,466 -> 211 /
// 306 / 339; 256 experts 914 / 1,907 / 10,420 -> 237 / 831 / 4,123. At one row the pair path (moe_pairs,
// ~3 TB/s) stays: 101 us against 132-137 batched. TROUPE_MOE_BATCHED=0 turns it off; =2 takes it at one
// row too, for measuring.
constexpr int64_t kBatchedMinRows = 2;

}  // namespace

struct CudaBackend::Impl {
  explicit Impl(int dev) : device(dev), stream(), blas(stream.get()), arena(&keep), topk_ws(&keep) {
    // cuBLAS gets its workspace up front: no allocation while a graph is recorded.
    TROUPE_CUDA(cudaMalloc(&blas_ws, kBlasWorkspace));
    TROUPE_CUBLAS(cublasSetWorkspace(blas.get(), blas_ws, kBlasWorkspace));
  }
  ~Impl() {
    cudaStreamSynchronize(stream.get());
    if (copy_stream != nullptr) cudaStreamDestroy(copy_stream);
    keep.release(blas_ws);
  }
  static constexpr size_t kBlasWorkspace = size_t{32} << 20;
  Keep keep;  // first member destroyed last
  int device;
  Stream stream;
  Cublas blas;
  void* blas_ws = nullptr;
  Arena arena;
  DeviceBuffer topk_ws;  // zero between calls
  // Device tables of expert weight pointers, one per distinct expert set (layer).
  std::map<std::vector<const void*>, std::unique_ptr<DeviceBuffer>> expert_tables;
  cudaStream_t copy_stream = nullptr;
  bool capturing = false;

  cudaStream_t s() const { return stream.get(); }

  // Whether m rows of x (row stride ldx) past one GEMV pass read fewer bytes as passes of kGemvBatchRows rows
  // over the codes (each reads them once) than through dequantized(w): its kernel reads the codes and writes 2
  // bytes a value, which cuBLAS reads again: FP4 up to 64 rows, FP8 up to 32.
  static bool codes_in_passes(const Weight& w, int64_t m, int64_t ldx, const float* x) {
    const double code_bytes = w.type == WeightType::e4m3 ? 1.0 : 0.5;
    const int64_t passes = (m + kGemvBatchRows - 1) / kGemvBatchRows;
    return m > kGemvBatchRows && ldx % 4 == 0 && gemv_takes(w, kGemvBatchRows, ldx, x) &&
           static_cast<double>(passes) * code_bytes < code_bytes + 4.0;
  }

  // gemv over m rows as passes of kGemvBatchRows rows (each reads the weight once; codes_in_passes).
  void gemv_in_passes(const float* x, int64_t ldx, int64_t m, const Weight& w, float* y, int64_t ldy, float beta,
                      int64_t group_rows) {
    for (int64_t m0 = 0; m0 < m; m0 += kGemvBatchRows) {
      gemv(x + m0 * ldx, ldx, std::min<int64_t>(kGemvBatchRows, m - m0), w, y + m0 * ldy, ldy, beta, group_rows, s());
    }
  }

  // A quantized weight's values in bf16, in the arena (taken after the op's arena.begin()).
  Weight dequantized(const Weight& w) {
    auto* p = arena.take<uint16_t>(w.rows * w.cols);
    dequantize_bf16(w, p, s());
    Weight d;
    d.data = p;
    d.type = WeightType::bf16;
    d.rows = w.rows;
    d.cols = w.cols;
    return d;
  }

  // y[m, w.rows] = x[m, ldx.. w.cols] @ w^T (+ beta y), any m.
  void linear(const float* x, int64_t m, const Weight& w, float* y, float beta) {
    if (m == 0 || w.rows == 0) return;
    if (is_quantized(w.type) && !gemv_takes(w, m, w.cols, x)) {
      if (codes_in_passes(w, m, w.cols, x)) {
        gemv_in_passes(x, w.cols, m, w, y, w.rows, beta, 0);
        return;
      }
      linear(x, m, dequantized(w), y, beta);
      return;
    }
    if (m <= kGemvBatchRows || w.rows <= 64) {
      gemv(x, w.cols, m, w, y, w.rows, beta, 0, s());
      return;
    }
    if (w.type == WeightType::f32) {
      const float one = 1.f;
      const int N = static_cast<int>(w.rows), K = static_cast<int>(w.cols), M = static_cast<int>(m);
      TROUPE_CUBLAS(cublasSgemm(blas.get(), CUBLAS_OP_T, CUBLAS_OP_N, N, M, K, &one,
                                static_cast<const float*>(w.data), K, x, K, &beta, y, N));
      return;
    }
    half_products(x, m, w.cols, w.type, 1, &w.rows, &y, beta,
                  [&](int, const void* xp, int64_t rows, const float* b, float* out) { half_gemm(w, xp, rows, b, out); });
  }

  // y[i] (m rows of outs[i] floats), i < count: the products of x (m rows of `cols` floats) in the weights'
  // half `type`, with the activations split as gemm_split says (or rounded), + beta y[i] (unread when beta
  // is 0); x converted once for all of them. gemm(i, xp, rows, beta, out): the caller's cuBLAS GEMM of
  // product i over `rows` rows of half activations at xp into out (out = beta out + the product). Below
  // kSplitMinRows the two terms' rows in one GEMM a product, then their halves added (one launch for all
  // products); else the rounded term, and the split's second term accumulated in a second pass.
  template <class Gemm>
  void half_products(const float* x, int64_t m, int64_t cols, WeightType type, int count, const int64_t* outs,
                     float* const* y, float beta, Gemm&& gemm) {
    const float one = 1.f, zero = 0.f;
    if (gemm_split(m) && m < kSplitMinRows) {
      TROUPE_REQUIRE(count <= kMaxSplitSums, "half_products: at most 8 products");
      auto* x2 = arena.take<uint16_t>(2 * m * cols);
      to_half(x, m * cols, x2, type, s(), x2 + m * cols);
      SplitSums sums{};
      sums.count = count;
      sums.beta = beta;
      for (int i = 0; i < count; ++i) {
        float* parts = arena.take<float>(2 * m * outs[i]);
        gemm(i, x2, 2 * m, &zero, parts);
        sums.parts[i] = parts;
        sums.y[i] = y[i];
        sums.start[i + 1] = sums.start[i] + m * outs[i];
      }
      add_split_products(sums, s());
      return;
    }
    void* xh = arena.take<uint16_t>(m * cols);
    void* xl = gemm_split(m) ? arena.take<uint16_t>(m * cols) : nullptr;
    to_half(x, m * cols, xh, type, s(), xl);
    for (int i = 0; i < count; ++i) {
      gemm(i, xh, m, &beta, y[i]);
      if (xl != nullptr) gemm(i, xl, m, &one, y[i]);
    }
  }

  // The cuBLAS GEMM of linear(): y^T [n x rows] = W [n x K] . x^T [K x rows] (column-major views).
  void half_gemm(const Weight& w, const void* xp, int64_t rows, const float* beta, float* out) {
    const float one = 1.f;
    const int N = static_cast<int>(w.rows), K = static_cast<int>(w.cols);
    TROUPE_CUBLAS(cublasGemmEx(blas.get(), CUBLAS_OP_T, CUBLAS_OP_N, N, static_cast<int>(rows), K, &one, w.data,
                               cuda_type(w.type), K, xp, cuda_type(w.type), K, beta, out, CUDA_R_32F, N,
                               CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
  }

  // Whether linear(x, m, w) runs as half_products' cuBLAS GEMM (a half-precision matrix of more than 64
  // rows, past the GEMV's rows), so that linear_multi can convert x once for several such weights.
  static bool linear_takes_half_gemm(int64_t m, const Weight& w) {
    return m > kGemvBatchRows && w.rows > 64 && (w.type == WeightType::bf16 || w.type == WeightType::f16);
  }

  // Whether moe() takes moe_batched for these rows (see kBatchedMinRows).
  static bool moe_batched_takes(WeightType type, int64_t rows) {
    // TROUPE_MOE_BATCHED: 0 never, 2 from one row (an A/B of the pair path), unset or else from kBatchedMinRows.
    static const char mode = [] {
      const char* e = std::getenv("TROUPE_MOE_BATCHED");
      return e == nullptr ? '1' : e[0];
    }();
    if (mode == '0' || (type != WeightType::bf16 && type != WeightType::f16)) return false;
    return rows >= (mode == '2' ? 1 : kBatchedMinRows);
  }

  // MoE as batched GEMMs over the touched experts: the pairs sorted by expert on the device, each touched
  // expert's rows gathered (as half) into a block of `rows` rows (the most an expert can have: route picks
  // distinct experts), gate and up of every entry in one batched GEMM, swiglu at the pairs' rows, down in
  // a second, then the weighted sum. The batch is min(experts, pairs) entries, a bound on the touched
  // experts known here; entries past them are spares (see moe_batch_pointers). Rows of a block past its
  // expert's count are computed and never read. No host round trip: graph-safe. With the split (see
  // gemm_split) a block holds the rows' first terms, then their second terms: one GEMM over twice the rows
  // reads each expert's weights once, and swiglu and the weighted sum add the two products.
  void moe_batched(const float* x, int64_t rows, int64_t dim, const int32_t* idx, const float* weight, int k,
                   int experts, const ExpertTables& t, float limit, float* out) {
    const int64_t pairs = rows * k, cap = rows, inter = t.inter;
    const int n = static_cast<int>(std::min<int64_t>(experts, pairs));
    const bool split = gemm_split(rows);
    const int64_t block = split ? 2 * cap : cap;  // rows of an entry's block
    auto* offsets = arena.take<int32_t>(experts + 1);
    auto* perm = arena.take<int32_t>(pairs);
    auto* slot = arena.take<int32_t>(pairs);
    auto* rank = arena.take<int32_t>(experts);
    auto* touched = arena.take<int32_t>(n);
    const int64_t block_x = n * block * dim, block_h = n * block * inter;
    auto* xh = arena.take<uint16_t>(block_x);
    float* gu = arena.take<float>(2 * block_h + block * inter);  // + the spares' block
    auto* hh = arena.take<uint16_t>(block_h);
    float* ys = arena.take<float>(block_x + block * dim);
    void** ptrs = arena.take<void*>(9 * static_cast<int64_t>(n));
    moe_sort(idx, pairs, experts, nullptr, offsets, perm, nullptr, s(), rank, touched, n);
    moe_pad_gather(x, dim, idx, perm, offsets, rank, pairs, k, block, t.type, xh, split ? xh + cap * dim : nullptr,
                   slot, s());
    moe_batch_pointers(n, touched, t, block, dim, inter, xh, gu, hh, ys, ptrs, s());
    const cudaDataType_t ht = cuda_type(t.type);
    const float one = 1.f, zero = 0.f;
    const int M = static_cast<int>(block), D = static_cast<int>(dim), I = static_cast<int>(inter);
    // y^T [n x block] = W [n x K] . x^T [K x block], column-major views as linear()'s GEMM.
    TROUPE_CUBLAS(cublasGemmBatchedEx(blas.get(), CUBLAS_OP_T, CUBLAS_OP_N, I, M, D, &one, ptrs + 6 * n, ht, D, ptrs, ht,
                                      D, &zero, ptrs + 2 * n, CUDA_R_32F, I, 2 * n, CUBLAS_COMPUTE_32F,
                                      CUBLAS_GEMM_DEFAULT));
    const int64_t lo_rows = split ? cap : 0;
    moe_pad_swiglu(gu, n, block, inter, slot, pairs, lo_rows, limit, t.type, hh, split ? hh + cap * inter : nullptr,
                   s());
    TROUPE_CUBLAS(cublasGemmBatchedEx(blas.get(), CUBLAS_OP_T, CUBLAS_OP_N, D, M, I, &one, ptrs + 8 * n, ht, I,
                                      ptrs + 4 * n, ht, I, &zero, ptrs + 5 * n, CUDA_R_32F, D, n, CUBLAS_COMPUTE_32F,
                                      CUBLAS_GEMM_DEFAULT));
    moe_combine(ys, slot, weight, rows, k, dim, out, s(), lo_rows);
  }

  // Attention in fp32 as two batched SGEMMs per chunk of queries: the keys
  // gathered (zero-padded to max_keys), S = scale * Q K^T, softmax with sinks in
  // place, O = P K. At most ~256 MB of keys and scores at a time.
  void attention_f32(const float* q, int64_t n_queries, int heads, int64_t dim, RaggedRows keys, int64_t max_keys,
                     const float* sinks, float scale, float* out) {
    const int64_t per_query = max_keys * (dim + heads);
    const int64_t chunk = std::clamp<int64_t>((int64_t{64} << 20) / per_query, 1, std::min<int64_t>(n_queries, 65535));
    float* kbuf = arena.take<float>(chunk * max_keys * dim);
    float* sbuf = arena.take<float>(chunk * heads * max_keys);
    const float zero = 0.f, one = 1.f;
    const int M = static_cast<int>(max_keys), H = heads, D = static_cast<int>(dim);
    for (int64_t t0 = 0; t0 < n_queries; t0 += chunk) {
      const int nq = static_cast<int>(std::min(chunk, n_queries - t0));
      gather_key_rows(keys.rows, keys.offsets + t0, nq, max_keys, dim, kbuf, s());
      // Column-major views: S^T[max_keys x heads] = K[t] (dim x max_keys, transposed) . Q[t]^T (dim x heads).
      TROUPE_CUBLAS(cublasSgemmStridedBatched(blas.get(), CUBLAS_OP_T, CUBLAS_OP_N, M, H, D, &scale, kbuf, D,
                                              max_keys * dim, q + t0 * heads * dim, D, heads * dim, &zero, sbuf, M,
                                              heads * max_keys, nq));
      attention_softmax(sbuf, nq, heads, max_keys, keys.offsets + t0, sinks, s());
      // O^T[dim x heads] = K[t]^T (dim x max_keys) . P[t]^T (max_keys x heads).
      TROUPE_CUBLAS(cublasSgemmStridedBatched(blas.get(), CUBLAS_OP_N, CUBLAS_OP_N, D, H, M, &one, kbuf, D,
                                              max_keys * dim, sbuf, M, heads * max_keys, &zero,
                                              out + t0 * heads * dim, D, heads * dim, nq));
    }
  }

  void reserve_topk(size_t bytes) {
    if (topk_ws.reserve(bytes)) topk_workspace_init(topk_ws.get(), topk_ws.size(), s());
  }

  // Host copy of a ragged offsets array (n + 1 entries); synchronises.
  std::vector<int64_t> host_offsets(const int64_t* offsets, int64_t n) {
    std::vector<int64_t> h(static_cast<size_t>(n + 1));
    TROUPE_CUDA(cudaMemcpyAsync(h.data(), offsets, h.size() * 8, cudaMemcpyDeviceToHost, s()));
    TROUPE_CUDA(cudaStreamSynchronize(s()));
    return h;
  }

  // Device tables of the experts' weight pointers, uploaded once per expert set.
  // Quantized experts: their scale grids' pointers follow, 3 * experts more.
  ExpertTables tables(const Weight* gate, const Weight* up, const Weight* down, int experts) {
    const bool quantized = is_quantized(gate[0].type);
    std::vector<const void*> host(static_cast<size_t>((quantized ? 6 : 3) * experts));
    for (int e = 0; e < experts; ++e) {
      host[e] = gate[e].data;
      host[experts + e] = up[e].data;
      host[2 * experts + e] = down[e].data;
      if (quantized) {
        host[3 * experts + e] = gate[e].scale;
        host[4 * experts + e] = up[e].scale;
        host[5 * experts + e] = down[e].scale;
      }
    }
    auto it = expert_tables.find(host);
    if (it == expert_tables.end()) {
      TROUPE_REQUIRE(!capturing, "moe: expert tables must be uploaded before a graph is recorded");
      auto buf = std::make_unique<DeviceBuffer>(&keep);
      buf->reserve(host.size() * sizeof(void*));
      TROUPE_CUDA(cudaMemcpyAsync(buf->get(), host.data(), host.size() * sizeof(void*), cudaMemcpyHostToDevice, s()));
      TROUPE_CUDA(cudaStreamSynchronize(s()));
      it = expert_tables.emplace(std::move(host), std::move(buf)).first;
    }
    auto* base = static_cast<const void* const*>(it->second->get());
    ExpertTables t = expert_shape(gate, up, down, experts);
    t.gate = base;
    t.up = base + experts;
    t.down = base + 2 * experts;
    if (quantized) t.scales = reinterpret_cast<const float* const*>(base + 3 * experts);
    return t;
  }

  // The experts' type, width and (quantized) scale layouts, without the device tables.
  static ExpertTables expert_shape(const Weight* gate, const Weight* up, const Weight* down, int experts) {
    ExpertTables t;
    t.type = gate[0].type;
    t.inter = gate[0].rows;
    t.experts = experts;
    if (is_quantized(t.type)) {
      t.gate_q = quant_layout(gate[0]);
      t.up_q = quant_layout(up[0]);
      t.down_q = quant_layout(down[0]);
    }
    return t;
  }
};

CudaBackend::CudaBackend(int device) {
  TROUPE_CUDA(cudaSetDevice(device));
  impl_ = std::make_unique<Impl>(device);
}
CudaBackend::~CudaBackend() {
  if (impl_) cudaStreamSynchronize(impl_->s());
}

namespace {
class CudaGraph final : public Backend::Graph {
 public:
  CudaGraph(cudaGraphExec_t exec, cudaStream_t s) : exec_(exec), s_(s) {}
  ~CudaGraph() override { cudaGraphExecDestroy(exec_); }
  void launch() override { TROUPE_CUDA(cudaGraphLaunch(exec_, s_)); }

 private:
  cudaGraphExec_t exec_;
  cudaStream_t s_;
};
}  // namespace

bool CudaBackend::capture_begin() {
  TROUPE_REQUIRE(!impl_->capturing, "capture_begin: already recording");
  impl_->arena.begin();  // consolidate now: nothing may be freed while recording
  impl_->arena.frozen = true;
  impl_->keep.graphs = true;  // from here on, memory an op took is never freed early
  TROUPE_CUDA(cudaStreamBeginCapture(impl_->s(), cudaStreamCaptureModeRelaxed));
  impl_->capturing = true;
  return true;
}

std::unique_ptr<Backend::Graph> CudaBackend::capture_end() {
  TROUPE_REQUIRE(impl_->capturing, "capture_end: not recording");
  impl_->capturing = false;
  impl_->arena.frozen = false;
  cudaGraph_t graph = nullptr;
  TROUPE_CUDA(cudaStreamEndCapture(impl_->s(), &graph));
  cudaGraphExec_t exec = nullptr;
  const cudaError_t st = cudaGraphInstantiate(&exec, graph, 0);
  cudaGraphDestroy(graph);
  TROUPE_CUDA(st);
  return std::make_unique<CudaGraph>(exec, impl_->s());
}

void CudaBackend::copy_queue(void* dst, const void* src, size_t bytes, bool to_host_dir) {
  if (bytes == 0) return;
  TROUPE_CUDA(cudaSetDevice(impl_->device));  // the calling thread may be a copy thread
  {
    std::lock_guard lock(copy_mu_);
    if (impl_->copy_stream == nullptr) {
      TROUPE_CUDA(cudaStreamCreateWithFlags(&impl_->copy_stream, cudaStreamNonBlocking));
    }
  }
  TROUPE_CUDA(cudaMemcpyAsync(dst, src, bytes, to_host_dir ? cudaMemcpyDeviceToHost : cudaMemcpyHostToDevice,
                              impl_->copy_stream));
}

void CudaBackend::copy_queue_wait() {
  cudaStream_t cs;
  {
    std::lock_guard lock(copy_mu_);
    cs = impl_->copy_stream;
  }
  if (cs != nullptr) TROUPE_CUDA(cudaStreamSynchronize(cs));
}
cudaStream_t CudaBackend::stream() const { return impl_->s(); }
int CudaBackend::device() const { return impl_->device; }

void* CudaBackend::alloc(size_t bytes) {
  void* p = nullptr;
  if (cudaMalloc(&p, std::max<size_t>(bytes, 256)) != cudaSuccess) {
    (void)cudaGetLastError();
    throw std::bad_alloc();
  }
  return p;
}
std::optional<Backend::MemoryInfo> CudaBackend::memory_info() const {
  TROUPE_CUDA(cudaSetDevice(impl_->device));
  size_t free = 0, total = 0;
  if (cudaMemGetInfo(&free, &total) != cudaSuccess) {
    (void)cudaGetLastError();
    return std::nullopt;
  }
  return MemoryInfo{free, total};
}
void CudaBackend::free(void* p) {
  if (p != nullptr) TROUPE_CUDA(cudaFree(p));
}
bool CudaBackend::host_mapped() const {
  static const bool off = [] {
    const char* e = std::getenv("TROUPE_HOST_MAPPED");
    return e != nullptr && e[0] == '0';
  }();
  if (off) return false;
  int unified = 0, host_ptr = 0;
  return cudaDeviceGetAttribute(&unified, cudaDevAttrUnifiedAddressing, impl_->device) == cudaSuccess &&
         cudaDeviceGetAttribute(&host_ptr, cudaDevAttrCanUseHostPointerForRegisteredMem, impl_->device) ==
             cudaSuccess &&
         unified != 0 && host_ptr != 0;
}
void* CudaBackend::alloc_host_mapped(size_t bytes) {
  if (!host_mapped()) return nullptr;
  TROUPE_CUDA(cudaSetDevice(impl_->device));  // the calling thread may be a copy thread
  void* p = nullptr;
  if (cudaHostAlloc(&p, std::max<size_t>(bytes, 256), cudaHostAllocMapped | cudaHostAllocPortable) != cudaSuccess) {
    (void)cudaGetLastError();
    return nullptr;
  }
  // Kernels take pool rows by address: the device's address of the memory must be the host's.
  void* d = nullptr;
  if (cudaHostGetDevicePointer(&d, p, 0) != cudaSuccess || d != p) {
    (void)cudaGetLastError();
    cudaFreeHost(p);
    return nullptr;
  }
  return p;
}
void CudaBackend::free_host_mapped(void* p) {
  if (p != nullptr) TROUPE_CUDA(cudaFreeHost(p));  // (waits for the device, as cudaFree)
}
void CudaBackend::to_device(void* dst, const void* src, size_t bytes) {
  if (bytes == 0) return;
  // Pageable sources are staged before the call returns; page-locked ones are read
  // asynchronously, so wait for those (the caller may free the source at once).
  cudaPointerAttributes attr{};
  const bool pinned = cudaPointerGetAttributes(&attr, src) == cudaSuccess && attr.type == cudaMemoryTypeHost;
  (void)cudaGetLastError();
  TROUPE_CUDA(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, impl_->s()));
  if (pinned) TROUPE_CUDA(cudaStreamSynchronize(impl_->s()));
}
void CudaBackend::to_host(void* dst, const void* src, size_t bytes) {
  if (bytes == 0) return;
  TROUPE_CUDA(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, impl_->s()));
  TROUPE_CUDA(cudaStreamSynchronize(impl_->s()));
}
void CudaBackend::copy(void* dst, const void* src, size_t bytes) {
  if (bytes == 0) return;
  TROUPE_CUDA(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, impl_->s()));
}
void CudaBackend::synchronize() { TROUPE_CUDA(cudaStreamSynchronize(impl_->s())); }

namespace {
// TROUPE_CUDA_QUANTIZED: 0 (unset), 1 / all, experts.
std::string quantized_setting() {
  const char* e = std::getenv("TROUPE_CUDA_QUANTIZED");
  const std::string v = e != nullptr ? e : "0";
  TROUPE_REQUIRE(v == "0" || v == "1" || v == "all" || v == "experts",
                 "TROUPE_CUDA_QUANTIZED must be 0, 1, all or experts, not '" + v + "'");
  return v;
}
}  // namespace

bool CudaBackend::takes_quantized() const { return quantized_setting() != "0"; }
bool CudaBackend::keeps_quantized(bool routed_expert) const {
  const std::string v = quantized_setting();
  return v == "1" || v == "all" || (v == "experts" && routed_expert);
}

void CudaBackend::linear(const float* x, int64_t m, const Weight& w, float* y, float beta) {
  impl_->arena.begin();
  impl_->linear(x, m, w, y, beta);
}

void CudaBackend::linear_multi(const float* x, int64_t m, const Weight* w, float* const* y, int count) {
  static const bool off = [] {
    const char* e = std::getenv("TROUPE_MULTI_GEMV");
    return e != nullptr && std::strcmp(e, "0") == 0;
  }();
  if (!off && gemv_multi(x, m, w, y, count, impl_->s())) return;
  // The weights linear() would run as half-precision cuBLAS GEMMs, grouped by type and width: x converted
  // (and split) once a group, and the split products' halves added in one launch, instead of a conversion
  // and an add a weight; the others one by one. TROUPE_MULTI_GEMM=0: every weight by linear() (an A/B switch).
  static const bool one_by_one = [] {
    const char* e = std::getenv("TROUPE_MULTI_GEMM");
    return e != nullptr && std::strcmp(e, "0") == 0;
  }();
  std::vector<bool> done(static_cast<size_t>(count), false);
  for (int i = 0; i < count && !one_by_one; ++i) {
    if (done[static_cast<size_t>(i)] || !Impl::linear_takes_half_gemm(m, w[i])) continue;
    int members[kMaxSplitSums];  // w[i] and the later weights it can share x with
    int n = 0;
    for (int j = i; j < count && n < kMaxSplitSums; ++j) {
      if (!done[static_cast<size_t>(j)] && Impl::linear_takes_half_gemm(m, w[j]) && w[j].type == w[i].type &&
          w[j].cols == w[i].cols) {
        members[n++] = j;
      }
    }
    if (n == 1) continue;  // alone: linear() below
    float* gy[kMaxSplitSums];
    int64_t outs[kMaxSplitSums];
    for (int g = 0; g < n; ++g) {
      done[static_cast<size_t>(members[g])] = true;
      gy[g] = y[members[g]];
      outs[g] = w[members[g]].rows;
    }
    impl_->arena.begin();
    impl_->half_products(x, m, w[i].cols, w[i].type, n, outs, gy, 0.f,
                         [&](int g, const void* xp, int64_t rows, const float* b, float* out) {
                           impl_->half_gemm(w[members[g]], xp, rows, b, out);
                         });
  }
  for (int i = 0; i < count; ++i) {
    if (!done[static_cast<size_t>(i)]) linear(x, m, w[i], y[i], 0.f);
  }
}

void CudaBackend::linear_grouped(const float* x, int64_t m, const Weight& wq, int groups, float* y) {
  if (m == 0) return;
  const int64_t out = wq.rows / groups;
  if (m <= kGemvBatchRows && gemv_takes(wq, m, groups * wq.cols, x)) {
    gemv(x, groups * wq.cols, m, wq, y, wq.rows, 0.f, out, impl_->s());
    return;
  }
  if (is_quantized(wq.type) && Impl::codes_in_passes(wq, m, groups * wq.cols, x)) {
    impl_->gemv_in_passes(x, groups * wq.cols, m, wq, y, wq.rows, 0.f, out);
    return;
  }
  impl_->arena.begin();
  const Weight w = is_quantized(wq.type) ? impl_->dequantized(wq) : wq;
  if (m <= kGemvBatchRows) {
    gemv(x, groups * w.cols, m, w, y, w.rows, 0.f, out, impl_->s());
    return;
  }
  const float one = 1.f, zero = 0.f;
  const int N = static_cast<int>(out), K = static_cast<int>(w.cols), M = static_cast<int>(m);
  if (w.type == WeightType::f32) {
    TROUPE_CUBLAS(cublasSgemmStridedBatched(impl_->blas.get(), CUBLAS_OP_T, CUBLAS_OP_N, N, M, K, &one,
                                            static_cast<const float*>(w.data), K, out * K, x, groups * K, K, &zero, y,
                                            groups * N, N, groups));
    return;
  }
  const int64_t outs = groups * out;
  impl_->half_products(x, m, groups * w.cols, w.type, 1, &outs, &y, 0.f,
                       [&](int, const void* xp, int64_t rows, const float* b, float* o) {
                         TROUPE_CUBLAS(cublasGemmStridedBatchedEx(
                             impl_->blas.get(), CUBLAS_OP_T, CUBLAS_OP_N, N, static_cast<int>(rows), K, &one, w.data,
                             cuda_type(w.type), K, out * K, xp, cuda_type(w.type), groups * K, K, b, o, CUDA_R_32F,
                             groups * N, N, groups, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
                       });
}

void CudaBackend::rmsnorm(const float* x, const float* weight, float* y, int64_t rows, int64_t dim, float eps) {
  cuda::rmsnorm(x, weight, y, rows, dim, eps, impl_->s());
}
void CudaBackend::rope(float* x, int64_t rows, int heads, int64_t head_dim, const RopeTable& r,
                       const int64_t* positions, bool inverse) {
  cuda::rope(x, rows, heads, head_dim, r, positions, inverse, impl_->s());
}
void CudaBackend::rmsnorm_rope(const float* x, const float* weight, float* y, int64_t rows, int heads,
                               int64_t head_dim, float eps, const RopeTable& r, const int64_t* positions) {
  cuda::rmsnorm_rope(x, weight, y, rows, heads, head_dim, eps, r, positions, impl_->s());
}
void CudaBackend::add_position_bias(float* x, int64_t rows, int64_t dim, const int64_t* positions, const float* bias,
                                    int64_t period) {
  cuda::add_position_bias(x, rows, dim, positions, bias, period, impl_->s());
}
void CudaBackend::copy_rows(float* const* dst, const float* const* src, int64_t count, int64_t n) {
  cuda::copy_rows(dst, src, count, n, impl_->s());
}
void CudaBackend::embed(const Weight& table, const int32_t* ids, int64_t rows, int copies, float* out) {
  cuda::embed(table, ids, rows, copies, out, impl_->s());
}
void CudaBackend::gather_rows(const float* x, int64_t dim, const int64_t* index, int64_t count, float* out) {
  cuda::gather_rows(x, dim, index, count, out, impl_->s());
}

void CudaBackend::mhc_pre(const float* X, int64_t rows, const Weight& fn, const float* base, const float* scale,
                          const MhcParams& p, float* y, float* post, float* comb) {
  if (rows == 0) return;
  impl_->arena.begin();
  if (const int64_t ws = mhc_fused_workspace(rows, fn, p); ws > 0 && !mhc_unfused()) {
    if (mhc_fused(X, rows, fn, base, scale, p, false, false, nullptr, 0.f, y, post, comb, impl_->arena.take<float>(ws),
                  impl_->s())) {
      return;
    }
  }
  float* mix = impl_->arena.take<float>(rows * fn.rows);
  gemv(X, p.hc * p.dim, rows, fn, mix, fn.rows, 0.f, 0, impl_->s());  // exact fp32 activations
  mhc_pre_finish(X, mix, rows, base, scale, p, y, post, comb, impl_->s());
}
void CudaBackend::mhc_pre_norm(const float* X, int64_t rows, const Weight& fn, const float* base, const float* scale,
                               const MhcParams& p, const float* norm_weight, float norm_eps, float* y, float* post,
                               float* comb) {
  if (rows == 0) return;
  impl_->arena.begin();
  if (const int64_t ws = mhc_fused_workspace(rows, fn, p); ws > 0 && !mhc_unfused()) {
    if (mhc_fused(X, rows, fn, base, scale, p, false, true, norm_weight, norm_eps, y, post, comb,
                  impl_->arena.take<float>(ws), impl_->s())) {
      return;
    }
  }
  mhc_pre(X, rows, fn, base, scale, p, y, post, comb);
  rmsnorm(y, norm_weight, y, rows, p.dim, norm_eps);
}

void CudaBackend::mhc_post(float* X, int64_t rows, const float* f, const float* post, const float* comb,
                           const MhcParams& p) {
  cuda::mhc_post(X, rows, f, post, comb, p, impl_->s());
}
void CudaBackend::mhc_head(const float* X, int64_t rows, const Weight& fn, const float* base, const float* scale,
                           const MhcParams& p, float* y) {
  if (rows == 0) return;
  impl_->arena.begin();
  if (const int64_t ws = mhc_fused_workspace(rows, fn, p); ws > 0 && !mhc_unfused()) {
    if (mhc_fused(X, rows, fn, base, scale, p, true, false, nullptr, 0.f, y, nullptr, nullptr,
                  impl_->arena.take<float>(ws), impl_->s())) {
      return;
    }
  }
  float* mix = impl_->arena.take<float>(rows * fn.rows);
  gemv(X, p.hc * p.dim, rows, fn, mix, fn.rows, 0.f, 0, impl_->s());
  mhc_head_finish(X, mix, rows, base, scale, p, y, impl_->s());
}
void CudaBackend::mhc_head_norm(const float* X, int64_t rows, const Weight& fn, const float* base, const float* scale,
                                const MhcParams& p, const float* norm_weight, float norm_eps, float* y) {
  if (rows == 0) return;
  impl_->arena.begin();
  if (const int64_t ws = mhc_fused_workspace(rows, fn, p); ws > 0 && !mhc_unfused()) {
    if (mhc_fused(X, rows, fn, base, scale, p, true, true, norm_weight, norm_eps, y, nullptr, nullptr,
                  impl_->arena.take<float>(ws), impl_->s())) {
      return;
    }
  }
  mhc_head(X, rows, fn, base, scale, p, y);
  rmsnorm(y, norm_weight, y, rows, p.dim, norm_eps);
}

void CudaBackend::compress(int64_t count, int slots, int64_t dim, const float* const* kv_src,
                           const float* const* score_src, const float* norm_weight, float eps,
                           const int64_t* positions, const RopeTable& rope, float* const* out) {
  compress_slots(count, slots, dim, kv_src, score_src, norm_weight, eps, positions, rope, out, impl_->s());
}

void CudaBackend::indexer_topk(const float* q, const float* w, int64_t n_queries, int heads, int64_t dim, float scale,
                               float weight_scale, RaggedRows keys, int k, int32_t* out_idx, int32_t* out_count) {
  if (n_queries == 0) return;
  impl_->arena.begin();
  auto* lengths = impl_->arena.take<int32_t>(n_queries);
  int64_t max_len = 0;
  const bool bounded = keys.max_rows > 0;
  if (bounded) {  // lengths on the device, no round trip: written by the scoring launch below
    max_len = keys.max_rows;
  } else {
    const std::vector<int64_t> off = impl_->host_offsets(keys.offsets, n_queries);
    std::vector<int32_t> len(static_cast<size_t>(n_queries));
    for (int64_t t = 0; t < n_queries; ++t) {
      len[t] = static_cast<int32_t>(off[t + 1] - off[t]);
      max_len = std::max<int64_t>(max_len, len[t]);
    }
    TROUPE_CUDA(cudaMemcpyAsync(lengths, len.data(), len.size() * 4, cudaMemcpyHostToDevice, impl_->s()));
    TROUPE_CUDA(cudaStreamSynchronize(impl_->s()));  // `len` dies here
  }
  const int64_t stride = std::max<int64_t>((max_len + 3) / 4 * 4, 4);
  // Queries in chunks: <= 65535 rows per top-k launch and <= 256 M scores at a time.
  const int64_t chunk = std::max<int64_t>(1, std::min<int64_t>(65535, (int64_t{1} << 28) / stride));
  float* scores = impl_->arena.take<float>(std::min(chunk, n_queries) * stride);
  impl_->reserve_topk(topk_workspace_bytes(static_cast<int>(std::min(chunk, n_queries)), std::max<int64_t>(max_len, 1), k));
  for (int64_t t0 = 0; t0 < n_queries; t0 += chunk) {
    const int64_t nq = std::min(chunk, n_queries - t0);
    RaggedRows sub{keys.rows, keys.offsets + t0};
    indexer_scores_ragged(q + t0 * heads * dim, w + t0 * heads, nq, heads, dim, scale, weight_scale, sub, scores,
                          stride, max_len, impl_->s(), RaggedForm::automatic, bounded ? lengths + t0 : nullptr);
    TopkArgs ta;
    ta.scores = scores;
    ta.row_stride = stride;
    ta.lengths = lengths + t0;
    ta.rows = static_cast<int>(nq);
    ta.max_len = std::max<int64_t>(max_len, 1);
    ta.k = k;
    ta.out_idx = out_idx + t0 * k;
    ta.out_stride = k;
    ta.out_count = out_count + t0;
    topk(ta, impl_->topk_ws.get(), impl_->s());
    sort_rows_ascending(out_idx + t0 * k, k, out_count + t0, static_cast<int>(nq), k, ta.max_len, impl_->s());
  }
}

void CudaBackend::attention(const float* q, int64_t n_queries, int heads, int64_t dim, RaggedRows keys,
                            const float* sinks, float scale, float* out) {
  attend(q, n_queries, heads, dim, keys, sinks, scale, nullptr, nullptr, out);
}

void CudaBackend::attention_derotated(const float* q, int64_t n_queries, int heads, int64_t dim, RaggedRows keys,
                                      const float* sinks, float scale, const RopeTable& rope,
                                      const int64_t* positions, float* out) {
  attend(q, n_queries, heads, dim, keys, sinks, scale, &rope, positions, out);
}

void CudaBackend::attend(const float* q, int64_t n_queries, int heads, int64_t dim, RaggedRows keys,
                         const float* sinks, float scale, const RopeTable* rope, const int64_t* positions,
                         float* out) {
  if (n_queries == 0) return;
  impl_->arena.begin();
  int64_t max_keys = keys.max_rows;
  if (max_keys <= 0) {
    const std::vector<int64_t> off = impl_->host_offsets(keys.offsets, n_queries);
    for (int64_t t = 0; t < n_queries; ++t) max_keys = std::max(max_keys, off[t + 1] - off[t]);
  }
  // fp32 throughout for calls of decode size whose key lists are bounded by 2,048 (the
  // bf16 tensor-core kernel's rounding of queries, keys and probabilities is what moves
  // a batch-1 decode off the fp32 oracle; see docs/kernels-notes.md), for head widths
  // the tensor-core kernel does not take, and for every call under
  // TROUPE_ATTENTION_FP32=1 (=0: never by size).
  static const int forced = [] {
    const char* e = std::getenv("TROUPE_ATTENTION_FP32");
    return e == nullptr ? -1 : std::strcmp(e, "1") == 0 ? 1 : 0;
  }();
  const bool tc_dim = dim == 64 || dim == 128 || dim == 256 || dim == 512;
  const bool decode_size = n_queries <= kAttentionF32Queries && max_keys <= kAttentionF32MaxKeys;
  if (forced == 1 || !tc_dim || (forced == -1 && decode_size)) {
    // Decode-sized calls by cuda::attention_rows (split and combine kernels, no gathered keys) instead of the
    // gather, two SGEMMs and the softmax (TROUPE_ATTENTION_ROWS=0: those): measured on the H100 (run 50),
    // batch 1 1.4907 -> 1.4739 ms a step, batch 16 unchanged (2.7491 / 2.7504), top-1 against transformers
    // fp32 99.91 % as before.
    static const bool rows_form = !env_off("TROUPE_ATTENTION_ROWS");
    const int64_t bound = std::max<int64_t>(max_keys, 1);
    if (rows_form && decode_size && attention_rows_takes(n_queries, dim, max_keys)) {
      void* ws =
          impl_->arena.take<char>(static_cast<int64_t>(attention_rows_workspace_bytes(n_queries, heads, dim, bound)));
      // (the inverse rope in the combine: run 50, a rope launch less a layer)
      attention_rows(q, n_queries, heads, dim, keys.rows, keys.offsets, bound, sinks, scale, ws, out, impl_->s(), rope,
                     positions);
      return;
    }
    impl_->attention_f32(q, n_queries, heads, dim, keys, bound, sinks, scale, out);
  } else {
    for (int64_t t0 = 0; t0 < n_queries; t0 += 65535) {
      AttentionArgs a;
      a.q = q + t0 * heads * dim;
      a.n_queries = std::min<int64_t>(65535, n_queries - t0);
      a.heads = heads;
      a.dim = dim;
      a.key_type = KeyType::f32;
      a.rows = reinterpret_cast<const void* const*>(keys.rows);
      a.offsets = keys.offsets + t0;
      a.max_keys = max_keys;
      a.sinks = sinks;
      a.scale = scale;
      a.out = out + t0 * heads * dim;
      const size_t ws = attention_workspace_bytes(a);
      void* workspace = ws > 0 ? impl_->arena.take<char>(static_cast<int64_t>(ws)) : nullptr;
      cuda::attention(a, workspace, impl_->s());
    }
  }
  if (positions != nullptr) this->rope(out, n_queries, heads, dim, *rope, positions, true);
}

void CudaBackend::route(const float* logits, int64_t rows, int experts, ScoreFn fn, const float* bias, int k,
                        const int64_t* hash_table, const int32_t* ids, float route_scale, int32_t* out_idx,
                        float* out_weight) {
  cuda::route(logits, rows, experts, fn, bias, k, hash_table, ids, route_scale, out_idx, out_weight, impl_->s());
}

void CudaBackend::moe(const float* x, int64_t rows, int64_t dim, const int32_t* idx, const float* weight, int k,
                      int experts, const Weight* gate, const Weight* up, const Weight* down, float limit, float* out) {
  const int64_t pairs = rows * k;
  if (pairs == 0) return;
  impl_->arena.begin();
  const int64_t inter = gate[0].rows;
  // Quantized experts share one scale layout a kind (checkpoints give every expert the same shapes),
  // their codes 16-byte aligned.
  const auto same_grid = [](const Weight& a, const Weight& b) {
    return a.scale_stride == b.scale_stride && a.block_rows == b.block_rows && a.block_cols == b.block_cols &&
           a.scale_row == b.scale_row && reinterpret_cast<uintptr_t>(a.data) % 16 == 0;
  };
  bool uniform = true;
  for (int e = 0; e < experts; ++e) {
    uniform &= gate[e].type == gate[0].type && up[e].type == gate[0].type && down[e].type == gate[0].type &&
               gate[e].rows == inter && up[e].rows == inter && down[e].cols == inter && gate[e].cols == dim &&
               down[e].rows == dim;
    if (is_quantized(gate[0].type)) {
      uniform &= same_grid(gate[e], gate[0]) && same_grid(up[e], up[0]) && same_grid(down[e], down[0]);
    }
  }
  if (uniform && rows <= kRowsWithoutSync && Impl::moe_batched_takes(gate[0].type, rows)) {
    impl_->moe_batched(x, rows, dim, idx, weight, k, experts, impl_->tables(gate, up, down, experts), limit, out);
    return;
  }
  const bool fits = moe_widths_fit(Impl::expert_shape(gate, up, down, experts), dim);
  if (uniform && rows == 1 && pairs <= kPairsWithoutSync && fits) {
    const ExpertTables t = impl_->tables(gate, up, down, experts);
    float* h = impl_->arena.take<float>(pairs * inter);
    float* ys = impl_->arena.take<float>(pairs * dim);
    moe_pairs(x, rows, dim, idx, weight, k, t, limit, h, ys, out, impl_->s());
    return;
  }
  if (uniform && rows <= kRowsWithoutSync && fits) {
    // Each expert's rows through its weights once, sorted on the device.
    const ExpertTables t = impl_->tables(gate, up, down, experts);
    auto* counts = impl_->arena.take<int32_t>(experts);
    auto* offsets = impl_->arena.take<int32_t>(experts + 1);
    auto* perm = impl_->arena.take<int32_t>(pairs);
    auto* inv = impl_->arena.take<int32_t>(pairs);
    float* xs = impl_->arena.take<float>(pairs * dim);
    float* h = impl_->arena.take<float>(pairs * inter);
    float* ys = impl_->arena.take<float>(pairs * dim);
    moe_grouped(x, rows, dim, idx, weight, k, experts, t, limit, counts, offsets, perm, inv, xs, h, ys, out,
                impl_->s());
    return;
  }
  // Sorted by expert: one GEMM chain per expert over its rows.
  auto* counts = impl_->arena.take<int32_t>(experts);
  auto* offsets = impl_->arena.take<int32_t>(experts + 1);
  auto* perm = impl_->arena.take<int32_t>(pairs);
  auto* inv = impl_->arena.take<int32_t>(pairs);
  moe_sort(idx, pairs, experts, counts, offsets, perm, inv, impl_->s());
  std::vector<int32_t> off(static_cast<size_t>(experts + 1));
  TROUPE_CUDA(cudaMemcpyAsync(off.data(), offsets, off.size() * 4, cudaMemcpyDeviceToHost, impl_->s()));
  TROUPE_CUDA(cudaStreamSynchronize(impl_->s()));
  float* xs = impl_->arena.take<float>(pairs * dim);
  moe_gather(x, dim, perm, pairs, k, xs, impl_->s());
  float* g = impl_->arena.take<float>(pairs * inter);
  float* u = impl_->arena.take<float>(pairs * inter);
  float* ys = impl_->arena.take<float>(pairs * dim);
  for (int e = 0; e < experts; ++e) {
    const int64_t m = off[e + 1] - off[e];
    if (m == 0) continue;
    TROUPE_REQUIRE(gate[e].rows == inter && up[e].rows == inter && down[e].cols == inter,
                   "moe: experts of different widths");
    impl_->linear(xs + off[e] * dim, m, gate[e], g + off[e] * inter, 0.f);
    impl_->linear(xs + off[e] * dim, m, up[e], u + off[e] * inter, 0.f);
  }
  cuda::swiglu(g, u, g, pairs * inter, limit, impl_->s());
  for (int e = 0; e < experts; ++e) {
    const int64_t m = off[e + 1] - off[e];
    if (m == 0) continue;
    impl_->linear(g + off[e] * inter, m, down[e], ys + off[e] * dim, 0.f);
  }
  moe_combine(ys, inv, weight, rows, k, dim, out, impl_->s());
}

void CudaBackend::decode_rows(int64_t batch, const int64_t* positions, const int32_t* table_of,
                              const float* const* window, int64_t window_stride, int64_t window_slots,
                              int64_t window_len, const float* const* entries, int64_t entry_stride, int64_t rate,
                              const int32_t* picked, const int32_t* picked_count, int k, const float** out_rows,
                              int64_t* out_offsets, const float* store, int64_t store_dim) {
  cuda::decode_rows(batch, positions, table_of, window, window_stride, window_slots, window_len, entries, entry_stride,
                    rate, picked, picked_count, k, out_rows, out_offsets, store, store_dim, impl_->s());
}
void CudaBackend::decode_compress_rows(int64_t batch, const int64_t* positions, const int32_t* table_of, int64_t rate,
                                       bool overlap, int64_t dim, const float* kv, float* score, const float* bias,
                                       float* const* ring, int64_t ring_stride, float* const* entries,
                                       int64_t entry_stride, const float** kv_src, const float** score_src,
                                       float** out, int64_t* entry_pos, float** ring_dst, const float** ring_src) {
  cuda::decode_compress_rows(batch, positions, table_of, rate, overlap, dim, kv, score, bias, ring, ring_stride, entries,
                             entry_stride, kv_src, score_src, out, entry_pos, ring_dst, ring_src, impl_->s());
}
void CudaBackend::decode_compress(int64_t batch, const int64_t* positions, const int32_t* table_of, int64_t rate,
                                  bool overlap, int64_t dim, const float* kv, float* score, const float* bias,
                                  float* const* ring, int64_t ring_stride, float* const* entries, int64_t entry_stride,
                                  const float* norm_weight, float eps, const RopeTable& rope,
                                  const DecodeCompressScratch& scratch) {
  static const bool fused = !env_off("TROUPE_COMPRESS_FUSED");
  if (!fused) {
    Backend::decode_compress(batch, positions, table_of, rate, overlap, dim, kv, score, bias, ring, ring_stride,
                             entries, entry_stride, norm_weight, eps, rope, scratch);
    return;
  }
  if (batch == 0) return;
  CompressorShape s;
  s.rate = static_cast<int>(rate);
  s.overlap = overlap;
  s.dim = dim;
  s.ape = bias;
  s.norm_weight = norm_weight;
  s.eps = eps;
  s.rope = rope;
  compress_decode_paged(s, batch, positions, table_of, kv, score, ring, ring_stride, entries, entry_stride, impl_->s());
}
void CudaBackend::scatter_pointers(void** table, const int64_t* index, void* const* values, int64_t count) {
  cuda::scatter_pointers(table, index, values, count, impl_->s());
}
void CudaBackend::argmax(const float* x, int64_t rows, int64_t n, int32_t* out) {
  if (const int64_t ws = argmax_split_workspace(rows, n); ws > 0) {
    impl_->arena.begin();
    float* v = impl_->arena.take<float>(ws);
    auto* i = impl_->arena.take<int32_t>(ws);
    argmax_rows_split(x, rows, n, out, v, i, impl_->s());
    return;
  }
  cuda::argmax_rows(x, rows, n, out, impl_->s());
}

void CudaBackend::swiglu(const float* g, const float* u, float* y, int64_t n, float limit) {
  cuda::swiglu(g, u, y, n, limit, impl_->s());
}
void CudaBackend::add(float* y, const float* x, int64_t n) { cuda::add(y, x, n, impl_->s()); }

}  // namespace troupe::kernels::cuda

namespace troupe::kernels {

std::unique_ptr<Backend> make_cuda_backend(int device) {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || device < 0 || device >= count) {
    (void)cudaGetLastError();
    return nullptr;
  }
  return std::make_unique<cuda::CudaBackend>(device);
}

bool cuda_backend_compiled() { return true; }

}  // namespace troupe::kernels
