// The kernel set: one interface, two backends (kernels/cpu, kernels/cuda).
//
// Every pointer an op takes is memory of that backend (host memory for the CPU
// backend, device memory for CUDA), except where an argument says "host".
// Ops are asynchronous on backends that have a stream; `synchronize()` waits.
// Shapes are row-major; "rows" are tokens unless stated. All activations are
// fp32; weights may be fp32, bf16 or fp16 (`Weight::dtype`), accumulation fp32.
//
// This header includes nothing of troupe's but itself, so both nvcc and g++
// compile it (Cap'n Proto and CAF headers never reach a .cu file).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

namespace troupe::kernels {

enum class WeightType : uint8_t { f32, bf16, f16 };

// A matrix [rows, cols] in backend memory, row-major (torch Linear layout:
// rows = output features, cols = input features).
struct Weight {
  const void* data = nullptr;
  WeightType type = WeightType::f32;
  int64_t rows = 0;
  int64_t cols = 0;
};

enum class ScoreFn : uint8_t { sqrtsoftplus, sigmoid, softmax };

// Parameters of the mHC mixing (one hyper-connection site).
struct MhcParams {
  int hc = 4;              // hc_mult: residual streams
  int64_t dim = 0;         // hidden size D
  int sinkhorn_iters = 20; // 0 for the head (no comb)
  float hc_eps = 1e-6f;    // added after sigmoid/softmax and in Sinkhorn
  float norm_eps = 1e-6f;  // rms_norm_eps of the unweighted input norm
};

// Per-query lists of key rows, ragged: query t reads rows[offsets[t] .. offsets[t+1]).
// A RoPE table: `rope_dim` trailing channels turn, pair i by angle position * inv_freq[i];
// cos and sin are multiplied by `scale` (YaRN's attention factor; 1 otherwise).
struct RopeTable {
  const float* inv_freq = nullptr;  // backend memory, rope_dim / 2 entries
  int64_t rope_dim = 0;
  float scale = 1.0f;
};

struct RaggedRows {
  const float* const* rows = nullptr;  // backend memory: an array of row pointers
  const int64_t* offsets = nullptr;    // backend memory: n_queries + 1 entries
};

class Backend {
 public:
  virtual ~Backend() = default;
  virtual std::string name() const = 0;

  // ---- memory ---------------------------------------------------------------
  virtual void* alloc(size_t bytes) = 0;     // 256-byte aligned; throws std::bad_alloc
  virtual void free(void* p) = 0;
  virtual void to_device(void* dst, const void* host_src, size_t bytes) = 0;
  virtual void to_host(void* host_dst, const void* src, size_t bytes) = 0;
  virtual void copy(void* dst, const void* src, size_t bytes) = 0;
  virtual void synchronize() = 0;

  // ---- dense math -----------------------------------------------------------
  // y[m, w.rows] = x[m, w.cols] @ w^T   (beta = 1 accumulates into y)
  virtual void linear(const float* x, int64_t m, const Weight& w, float* y, float beta = 0.f) = 0;
  // Block-diagonal: x [m, groups*w_cols], w [groups*out, w.cols], y [m, groups*out];
  // group g maps x[:, g*w.cols : (g+1)*w.cols] through rows [g*out, (g+1)*out) of w.
  virtual void linear_grouped(const float* x, int64_t m, const Weight& w, int groups, float* y) = 0;
  // y = x * rsqrt(mean(x^2) + eps) * weight   per row of `dim`; weight may be null (unweighted).
  // x == y is allowed.
  virtual void rmsnorm(const float* x, const float* weight, float* y, int64_t rows, int64_t dim,
                       float eps) = 0;
  // Interleaved RoPE on the trailing `rope.rope_dim` channels of each head of each row:
  // x is [rows, heads, head_dim]; pair (2i, 2i+1) of the rope slice becomes
  // (a cos - b sin, b cos + a sin) at angle positions[row] * inv_freq[i], with sin
  // negated when `inverse`. In place.
  virtual void rope(float* x, int64_t rows, int heads, int64_t head_dim, const RopeTable& rope,
                    const int64_t* positions, bool inverse) = 0;
  // x[r, :] += bias[positions[r] % period, :]
  virtual void add_position_bias(float* x, int64_t rows, int64_t dim, const int64_t* positions,
                                 const float* bias, int64_t period) = 0;
  // dst_rows[i][0:n) = src_rows[i][0:n) for i < count (row pointer arrays in backend memory).
  virtual void copy_rows(float* const* dst_rows, const float* const* src_rows, int64_t count,
                         int64_t n) = 0;
  // out[r, :] = table[ids[r], :] repeated `copies` times: out is [rows, copies, table.cols].
  virtual void embed(const Weight& table, const int32_t* ids, int64_t rows, int copies, float* out) = 0;
  // Gathers rows: out[i, :] = x[index[i], :]
  virtual void gather_rows(const float* x, int64_t dim, const int64_t* index, int64_t count, float* out) = 0;

  // ---- mHC --------------------------------------------------------------------
  // X [rows, hc, dim]. mix = rmsnorm_unweighted(X.flat) @ fn^T, fn [(2+hc)*hc, hc*dim];
  // pre = sigmoid(mix[0:hc]*scale[0] + base) + eps -> y = sum_j pre_j X_j    [rows, dim]
  // post = 2 sigmoid(mix[hc:2hc]*scale[1] + base[hc:])                         [rows, hc]
  // comb = Sinkhorn(softmax_row(mix[2hc:]*scale[2] + base[2hc:]))             [rows, hc, hc]
  virtual void mhc_pre(const float* X, int64_t rows, const Weight& fn, const float* base,
                       const float* scale, const MhcParams& p, float* y, float* post, float* comb) = 0;
  // X'_k = post_k * f + sum_j comb[j, k] X_j   (in place on X)
  virtual void mhc_post(float* X, int64_t rows, const float* f, const float* post, const float* comb,
                        const MhcParams& p) = 0;
  // Final collapse: pre = sigmoid(mix * scale[0] + base) + eps, y = sum_j pre_j X_j; fn [hc, hc*dim].
  virtual void mhc_head(const float* X, int64_t rows, const Weight& fn, const float* base,
                        const float* scale, const MhcParams& p, float* y) = 0;

  // ---- V4 attention ------------------------------------------------------------
  // Compressor window pooling for `count` new entries. Entry e pools `slots` slots;
  // slot s reads kv_src[e*slots+s] and score_src[e*slots+s] (`dim` floats each,
  // score already carries the position bias); a null slot is empty (kv 0, score -inf).
  // out[e] = rope(rmsnorm(sum_s softmax_s(score)[ch] * kv[ch], norm_weight), positions[e]).
  virtual void compress(int64_t count, int slots, int64_t dim, const float* const* kv_src,
                        const float* const* score_src, const float* norm_weight, float eps,
                        const int64_t* positions, const RopeTable& rope, float* const* out) = 0;
  // Lightning indexer: for query t (of n_queries), score key rows keys[t] (ragged) by
  // sum_h (w[t,h] * weight_scale) * (relu(q[t,h,:] . key) * scale), then write the
  // indices (into that query's key list, ascending) of the top min(k, n_keys) scores
  // to out_idx[t*k ...] and the count to out_count[t]. q [n, heads, dim], w [n, heads].
  virtual void indexer_topk(const float* q, const float* w, int64_t n_queries, int heads, int64_t dim,
                            float scale, float weight_scale, RaggedRows keys, int k, int32_t* out_idx,
                            int32_t* out_count) = 0;
  // One softmax per (query, head) over the query's key rows plus a sink logit that only
  // joins the denominator: out[t,h] = sum_j p_j k_j, p = softmax([q.k_j * scale ..., sink_h]).
  // q, out [n, heads, dim]; K = V (shared head).
  virtual void attention(const float* q, int64_t n_queries, int heads, int64_t dim, RaggedRows keys,
                         const float* sinks, float scale, float* out) = 0;

  // ---- MoE ----------------------------------------------------------------------
  // Router: logits [rows, experts] -> scores by `fn`; picks the top `k` experts by
  // score + bias (bias may be null) unless `hash_ids` (host or backend: backend) is
  // given, in which case experts are hash_table[ids[r]] (int64 [vocab, k]).
  // weights = picked scores / (sum + 1e-20) * route_scale.
  virtual void route(const float* logits, int64_t rows, int experts, ScoreFn fn, const float* bias,
                     int k, const int64_t* hash_table, const int32_t* ids, float route_scale,
                     int32_t* out_idx, float* out_weight) = 0;
  // out[r] += sum_j weight[r,j] * expert_{idx[r,j]}(x[r]); each expert is
  // down @ (silu(min(gate@x, limit)) * clamp(up@x, -limit, limit)).
  // gate/up/down are arrays (host memory) of `experts` weights.
  virtual void moe(const float* x, int64_t rows, int64_t dim, const int32_t* idx, const float* weight,
                   int k, int experts, const Weight* gate, const Weight* up, const Weight* down,
                   float limit, float* out) = 0;
  // y = silu(min(g, limit)) * clamp(u, -limit, limit), elementwise over n
  virtual void swiglu(const float* g, const float* u, float* y, int64_t n, float limit) = 0;
  // y += x over n
  virtual void add(float* y, const float* x, int64_t n) = 0;
};

std::unique_ptr<Backend> make_cpu_backend();
// Null when the build has no CUDA backend or no device is present.
std::unique_ptr<Backend> make_cuda_backend(int device = 0);
bool cuda_backend_compiled();

}  // namespace troupe::kernels
