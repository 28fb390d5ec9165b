// The CPU reference backend: plain fp32 loops plus OpenBLAS for GEMMs. It is
// the oracle every CUDA kernel is checked against, and it serves the embedded
// default model.
#pragma once

#include "kernels/backend.hpp"

namespace troupe::kernels::cpu {

class CpuBackend : public Backend {
 public:
  std::string name() const override { return "cpu"; }
  bool memory_is_host() const override { return true; }
  bool takes_quantized() const override { return true; }

  void* alloc(size_t bytes) override;
  void free(void* p) override;
  void to_device(void* dst, const void* host_src, size_t bytes) override;
  void to_host(void* host_dst, const void* src, size_t bytes) override;
  void copy(void* dst, const void* src, size_t bytes) override;
  void synchronize() override {}
  std::optional<MemoryInfo> memory_info() const override;  // /proc/meminfo: MemAvailable, MemTotal

  void linear(const float* x, int64_t m, const Weight& w, float* y, float beta) override;
  void linear_grouped(const float* x, int64_t m, const Weight& w, int groups, float* y) override;
  void rmsnorm(const float* x, const float* weight, float* y, int64_t rows, int64_t dim, float eps) override;
  void rope(float* x, int64_t rows, int heads, int64_t head_dim, const RopeTable& rope, const int64_t* positions,
            bool inverse) override;
  void add_position_bias(float* x, int64_t rows, int64_t dim, const int64_t* positions, const float* bias,
                         int64_t period) override;
  void copy_rows(float* const* dst_rows, const float* const* src_rows, int64_t count, int64_t n) override;
  void embed(const Weight& table, const int32_t* ids, int64_t rows, int copies, float* out) override;
  void gather_rows(const float* x, int64_t dim, const int64_t* index, int64_t count, float* out) override;

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
  void scatter_pointers(void** table, const int64_t* index, void* const* values, int64_t count) override;
  void argmax(const float* x, int64_t rows, int64_t n, int32_t* out) override;
};

// OpenBLAS 0.3.21 (Debian 12) does not recognise recent Xeons and falls back to
// its generic "Prescott" kernels, 4x slower here. OpenBLAS reads its kernel choice
// once, when it loads, from OPENBLAS_CORETYPE; so when the variable is unset and
// the CPU has AVX2/AVX-512, this sets it and re-executes the program (argv[0] via
// /proc/self/exe). Call first thing in main(). Returns normally otherwise.
void ensure_blas_kernels(char** argv);

// Helpers shared by the CPU kernels (also used by tests as the plain reference).
// Turns one rope slice (rope.rope_dim floats) to `position`.
void rope_row(float* x, const RopeTable& rope, int64_t position, bool inverse);

}  // namespace troupe::kernels::cpu
