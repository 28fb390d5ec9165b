// The CUDA backend: every op of kernels::Backend on one CUDA stream of one device.
//
// Memory is cudaMalloc/cudaFree (free waits for the device, so buffers in use by
// queued work are never released early). Weights may be f32, bf16 or f16;
// activations are fp32 and accumulation is fp32 everywhere. GEMMs with few rows
// (<= 4) or few outputs (<= 64) run as exact fp32 GEMVs that stream the weights
// once; larger ones go through cuBLAS (fp32 weights: SGEMM; 16-bit weights: the
// activations are rounded to the weight type and multiplied with fp32
// accumulation, the same precision as a bf16 model in PyTorch).
//
// Ops that need a host-side size (indexer_topk, attention: the longest key list,
// unless RaggedRows::max_rows bounds it; moe with more than 64 rows: the rows per
// expert) read it back and so synchronise the stream; everything else is
// asynchronous and can be recorded into a CUDA graph (capture_begin/capture_end).
#pragma once

#include <cuda_runtime.h>

#include <memory>
#include <mutex>

#include "kernels/backend.hpp"

namespace troupe::kernels::cuda {

class CudaBackend final : public Backend {
 public:
  explicit CudaBackend(int device);
  ~CudaBackend() override;
  CudaBackend(const CudaBackend&) = delete;
  CudaBackend& operator=(const CudaBackend&) = delete;

  std::string name() const override { return "cuda"; }
  // FP8 / FP4 weights kept as codes only where TROUPE_CUDA_QUANTIZED asks (GEMVs and MoE convert them in
  // registers, products of more rows run as 8-row passes over them or dequantize into bf16 first); by
  // default the loader dequantizes them into bf16. Off until measured faster: slower than the dequantized
  // load at batch 1 and 64 in sessions 37 and 38 (docs/kernel-runs/run38-quantized.md).
  bool takes_quantized() const override;
  // TROUPE_CUDA_QUANTIZED=1 (or all): every quantized matrix kept as codes; =experts: the routed experts' only
  // (the rest bf16, for cuBLAS past 8 rows of x); 0 or unset: none. Other values throw.
  bool keeps_quantized(bool routed_expert) const override;
  cudaStream_t stream() const;
  int device() const;

  void* alloc(size_t bytes) override;
  void free(void* p) override;
  void to_device(void* dst, const void* host_src, size_t bytes) override;
  void to_host(void* host_dst, const void* src, size_t bytes) override;
  void copy(void* dst, const void* src, size_t bytes) override;
  void synchronize() override;
  std::optional<MemoryInfo> memory_info() const override;  // cudaMemGetInfo
  // cudaHostAlloc(mapped, portable) where the device addresses host memory at its host address (unified
  // addressing and host pointers usable for registered memory); TROUPE_HOST_MAPPED=0 turns it off.
  bool host_mapped() const override;
  void* alloc_host_mapped(size_t bytes) override;
  void free_host_mapped(void* p) override;
  // The copy queue is a second stream of the device (host tier copies).
  void copy_queue(void* dst, const void* src, size_t bytes, bool to_host_dir) override;
  void copy_queue_wait() override;
  // CUDA graphs of the compute stream.
  bool graphs_supported() const override { return true; }
  bool capture_begin() override;
  std::unique_ptr<Graph> capture_end() override;

  void linear(const float* x, int64_t m, const Weight& w, float* y, float beta) override;
  void linear_multi(const float* x, int64_t m, const Weight* w, float* const* y, int count) override;
  void linear_grouped(const float* x, int64_t m, const Weight& w, int groups, float* y) override;
  void rmsnorm(const float* x, const float* weight, float* y, int64_t rows, int64_t dim, float eps) override;
  void rope(float* x, int64_t rows, int heads, int64_t head_dim, const RopeTable& rope, const int64_t* positions,
            bool inverse) override;
  void rmsnorm_rope(const float* x, const float* weight, float* y, int64_t rows, int heads, int64_t head_dim, float eps,
                    const RopeTable& rope, const int64_t* positions) override;
  void add_position_bias(float* x, int64_t rows, int64_t dim, const int64_t* positions, const float* bias,
                         int64_t period) override;
  void copy_rows(float* const* dst_rows, const float* const* src_rows, int64_t count, int64_t n) override;
  void embed(const Weight& table, const int32_t* ids, int64_t rows, int copies, float* out) override;
  void gather_rows(const float* x, int64_t dim, const int64_t* index, int64_t count, float* out) override;

  void mhc_pre_norm(const float* X, int64_t rows, const Weight& fn, const float* base, const float* scale,
                    const MhcParams& p, const float* norm_weight, float norm_eps, float* y, float* post,
                    float* comb) override;
  void mhc_head_norm(const float* X, int64_t rows, const Weight& fn, const float* base, const float* scale,
                     const MhcParams& p, const float* norm_weight, float norm_eps, float* y) override;
  void mhc_pre(const float* X, int64_t rows, const Weight& fn, const float* base, const float* scale,
               const MhcParams& p, float* y, float* post, float* comb) override;
  void mhc_post(float* X, int64_t rows, const float* f, const float* post, const float* comb,
                const MhcParams& p) override;
  void mhc_head(const float* X, int64_t rows, const Weight& fn, const float* base, const float* scale,
                const MhcParams& p, float* y) override;

  void compress(int64_t count, int slots, int64_t dim, const float* const* kv_src, const float* const* score_src,
                const float* norm_weight, float eps, const int64_t* positions, const RopeTable& rope,
                float* const* out) override;
  void indexer_topk(const float* q, const float* w, int64_t n_queries, int heads, int64_t dim, float scale,
                    float weight_scale, RaggedRows keys, int k, int32_t* out_idx, int32_t* out_count) override;
  void attention(const float* q, int64_t n_queries, int heads, int64_t dim, RaggedRows keys, const float* sinks,
                 float scale, float* out) override;
  void attention_derotated(const float* q, int64_t n_queries, int heads, int64_t dim, RaggedRows keys,
                           const float* sinks, float scale, const RopeTable& rope, const int64_t* positions,
                           float* out) override;

  void route(const float* logits, int64_t rows, int experts, ScoreFn fn, const float* bias, int k,
             const int64_t* hash_table, const int32_t* ids, float route_scale, int32_t* out_idx,
             float* out_weight) override;
  void moe(const float* x, int64_t rows, int64_t dim, const int32_t* idx, const float* weight, int k, int experts,
           const Weight* gate, const Weight* up, const Weight* down, float limit, float* out) override;
  void swiglu(const float* g, const float* u, float* y, int64_t n, float limit) override;
  void add(float* y, const float* x, int64_t n) override;

  void decode_rows(int64_t batch, const int64_t* positions, const int32_t* table_of, const float* const* window,
                   int64_t window_stride, int64_t window_slots, int64_t window_len, const float* const* entries,
                   int64_t entry_stride, int64_t rate, const int32_t* picked, const int32_t* picked_count, int k,
                   const float** out_rows, int64_t* out_offsets,
                   const float* store, int64_t store_dim) override;
  void decode_compress_rows(int64_t batch, const int64_t* positions, const int32_t* table_of, int64_t rate,
                            bool overlap, int64_t dim, const float* kv, float* score, const float* bias,
                            float* const* ring,
                            int64_t ring_stride, float* const* entries, int64_t entry_stride, const float** kv_src,
                            const float** score_src, float** out, int64_t* entry_pos, float** ring_dst,
                            const float** ring_src) override;
  // One fused kernel (compressor.hpp); TROUPE_COMPRESS_FUSED=0 runs the composed form.
  void decode_compress(int64_t batch, const int64_t* positions, const int32_t* table_of, int64_t rate, bool overlap,
                       int64_t dim, const float* kv, float* score, const float* bias, float* const* ring,
                       int64_t ring_stride, float* const* entries, int64_t entry_stride, const float* norm_weight,
                       float eps, const RopeTable& rope, const DecodeCompressScratch& scratch) override;
  void scatter_pointers(void** table, const int64_t* index, void* const* values, int64_t count) override;
  void argmax(const float* x, int64_t rows, int64_t n, int32_t* out) override;

 private:
  // attention and attention_derotated: the inverse rope (rope and positions, else null) fused into the
  // rows form's combine where that form runs, else a rope() call after.
  void attend(const float* q, int64_t n_queries, int heads, int64_t dim, RaggedRows keys, const float* sinks,
              float scale, const RopeTable* rope, const int64_t* positions, float* out);
  struct Impl;
  std::unique_ptr<Impl> impl_;
  std::mutex copy_mu_;
};

}  // namespace troupe::kernels::cuda
