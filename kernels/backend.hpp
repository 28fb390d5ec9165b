// The kernel set: one interface, two backends (kernels/cpu, kernels/cuda).
//
// Every pointer an op takes is memory of that backend (host memory for the CPU
// backend, device memory for CUDA), except where an argument says "host".
// Ops are asynchronous on backends that have a stream; `synchronize()` waits.
// Shapes are row-major; "rows" are tokens unless stated. All activations are
// fp32; weights may be fp32, bf16 or fp16 (`Weight::type`), on backends that say
// so also FP8 / FP4 codes with block scales; accumulation fp32.
//
// This header includes nothing of troupe's but itself, so both nvcc and g++
// compile it (Cap'n Proto and CAF headers never reach a .cu file).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>

namespace troupe::kernels {

// e4m3: one FP8 (e4m3fn) code a byte. e2m1: FP4 codes, two a byte (the even column
// in the low nibble), rows of cols / 2 bytes. Both carry block scales (Weight::scale).
enum class WeightType : uint8_t { f32, bf16, f16, e4m3, e2m1 };

inline bool is_quantized(WeightType t) { return t == WeightType::e4m3 || t == WeightType::e2m1; }

// A matrix [rows, cols] in backend memory, row-major (torch Linear layout:
// rows = output features, cols = input features).
//
// Quantized types (e4m3, e2m1) are the checkpoint's codes with fp32 block scales:
// element (r, c) is code(r, c) * scale[((r + scale_row) / block_rows) * scale_stride
// + c / block_cols], the scale grid row-major with scale_stride columns. A view of
// rows [r0, r1) of a quantized matrix starts its data at row r0, its scale at grid row
// r0 / block_rows, with scale_row = r0 % block_rows. Only backends whose
// takes_quantized() is true accept them (in every op that takes a Weight).
struct Weight {
  const void* data = nullptr;
  WeightType type = WeightType::f32;
  int64_t rows = 0;
  int64_t cols = 0;
  const float* scale = nullptr;  // backend memory; quantized types only
  int64_t scale_stride = 0;
  int32_t block_rows = 0;
  int32_t block_cols = 0;
  int32_t scale_row = 0;
};

// Rows [r0, r0 + n) of w, any type.
inline Weight weight_rows(const Weight& w, int64_t r0, int64_t n) {
  Weight v = w;
  v.rows = n;
  if (!is_quantized(w.type)) {
    const int64_t size = w.type == WeightType::f32 ? 4 : 2;
    v.data = static_cast<const char*>(w.data) + r0 * w.cols * size;
    return v;
  }
  const int64_t row_bytes = w.type == WeightType::e4m3 ? w.cols : w.cols / 2;
  const int64_t first = r0 + w.scale_row;
  v.data = static_cast<const uint8_t*>(w.data) + r0 * row_bytes;
  v.scale = w.scale + (first / w.block_rows) * w.scale_stride;
  v.scale_row = static_cast<int32_t>(first % w.block_rows);
  return v;
}

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
  // Optional upper bound of every query's list length (host). With it a backend
  // sizes its launches from the bound and never reads the offsets back, so the
  // call needs no host round trip (and can be recorded into a graph); 0: unknown.
  int64_t max_rows = 0;
};

class Backend {
 public:
  virtual ~Backend() = default;
  virtual std::string name() const = 0;
  // Whether the ops that take a Weight take e4m3 / e2m1 ones (else a caller
  // dequantizes them into f32 / bf16 / f16 first).
  virtual bool takes_quantized() const { return false; }
  // Which matrices of a quantized checkpoint a model loader keeps as codes on this
  // backend (the others it dequantizes): routed experts' (routed_expert) or the rest.
  virtual bool keeps_quantized(bool routed_expert) const {
    (void)routed_expert;
    return takes_quantized();
  }

  // ---- memory ---------------------------------------------------------------
  virtual void* alloc(size_t bytes) = 0;     // 256-byte aligned; throws std::bad_alloc
  virtual void free(void* p) = 0;
  virtual void to_device(void* dst, const void* host_src, size_t bytes) = 0;
  virtual void to_host(void* host_dst, const void* src, size_t bytes) = 0;
  virtual void copy(void* dst, const void* src, size_t bytes) = 0;
  virtual void synchronize() = 0;
  // Bytes free and in all of the memory alloc() draws from (the device's; on
  // the CPU backend host memory: available and total); nullopt when unknown.
  // What a pool budget given as a fraction is a fraction of.
  struct MemoryInfo {
    uint64_t free = 0, total = 0;
  };
  virtual std::optional<MemoryInfo> memory_info() const { return std::nullopt; }
  // Whether alloc() draws from host memory, so that the kernels read host memory
  // as they read their own (the CPU backend): a host tier is then readable in
  // place, and it competes with the device budget for the same memory.
  virtual bool memory_is_host() const { return false; }
  // Page-locked host memory that this backend's kernels read in place, at the
  // same address on the host and in kernels, and that its copy queue moves
  // asynchronously (CUDA: mapped pinned memory, cudaHostAlloc): what a host
  // tier needs for cold pages where memory_is_host() is false. host_mapped():
  // whether the backend offers it; alloc_host_mapped() returns nullptr where it
  // does not or the memory cannot be had (never throws).
  virtual bool host_mapped() const { return false; }
  virtual void* alloc_host_mapped(size_t bytes) {
    (void)bytes;
    return nullptr;
  }
  virtual void free_host_mapped(void* p) { (void)p; }

  // A copy queue beside the compute stream, for the host tier: copies between
  // host memory and backend memory issued here run in order among themselves,
  // may overlap compute ops, and are finished when copy_queue_wait() returns.
  // Both may be called from a thread other than the one issuing compute ops;
  // the caller orders them against compute (a copy out of backend memory is
  // issued after the compute that wrote it has been synchronized). Default:
  // synchronous to_host / to_device.
  virtual void copy_queue(void* dst, const void* src, size_t bytes, bool to_host_dir) {
    if (to_host_dir) {
      to_host(dst, src, bytes);
    } else {
      to_device(dst, src, bytes);
    }
  }
  virtual void copy_queue_wait() {}

  // ---- graphs ---------------------------------------------------------------
  // Records the ops issued between capture_begin() and capture_end() for replay:
  // Graph::launch() runs them again, in order after the ops issued before it,
  // on the same memory (buffers an op took for itself stay reserved while a
  // graph lives). Only ops with no host round trip may be recorded (RaggedRows
  // with max_rows; moe with at most 64 rows). Backends without graphs return
  // false from capture_begin(), and the caller runs its ops directly.
  class Graph {
   public:
    virtual ~Graph() = default;
    virtual void launch() = 0;
  };
  virtual bool graphs_supported() const { return false; }
  virtual bool capture_begin() { return false; }
  virtual std::unique_ptr<Graph> capture_end() { return nullptr; }

  // ---- dense math -----------------------------------------------------------
  // y[m, w.rows] = x[m, w.cols] @ w^T   (beta = 1 accumulates into y)
  virtual void linear(const float* x, int64_t m, const Weight& w, float* y, float beta = 0.f) = 0;
  // y_i[m, w_i.rows] = x[m, k] @ w_i^T for `count` weights over the same x (every
  // w_i.cols == k): one launch where a backend can. Same results as linear() each.
  virtual void linear_multi(const float* x, int64_t m, const Weight* w, float* const* y, int count) {
    for (int i = 0; i < count; ++i) linear(x, m, w[i], y[i], 0.f);
  }
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
  // rmsnorm over each head row of x [rows, heads, head_dim] (weight [head_dim] or null), then rope
  // (not inverse) on y: the two calls as one, which a backend may fuse. x == y is allowed.
  virtual void rmsnorm_rope(const float* x, const float* weight, float* y, int64_t rows, int heads, int64_t head_dim,
                            float eps, const RopeTable& rope, const int64_t* positions) {
    rmsnorm(x, weight, y, rows * heads, head_dim, eps);
    this->rope(y, rows, heads, head_dim, rope, positions, false);
  }
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

  // mhc_pre (mhc_head), then y = rmsnorm(y) * norm_weight (unweighted when null) over
  // dim with norm_eps: the two calls as one, which a backend may fuse.
  virtual void mhc_pre_norm(const float* X, int64_t rows, const Weight& fn, const float* base, const float* scale,
                            const MhcParams& p, const float* norm_weight, float norm_eps, float* y, float* post,
                            float* comb) {
    mhc_pre(X, rows, fn, base, scale, p, y, post, comb);
    rmsnorm(y, norm_weight, y, rows, p.dim, norm_eps);
  }
  virtual void mhc_head_norm(const float* X, int64_t rows, const Weight& fn, const float* base, const float* scale,
                             const MhcParams& p, const float* norm_weight, float norm_eps, float* y) {
    mhc_head(X, rows, fn, base, scale, p, y);
    rmsnorm(y, norm_weight, y, rows, p.dim, norm_eps);
  }

  // ---- V4 attention ------------------------------------------------------------
  // Compressor window pooling for `count` new entries. Entry e pools `slots` slots;
  // slot s reads kv_src[e*slots+s] and score_src[e*slots+s] (`dim` floats each,
  // score already carries the position bias); a null slot is empty (kv 0, score -inf).
  // out[e] = rope(rmsnorm(sum_s softmax_s(score)[ch] * kv[ch], norm_weight), positions[e]);
  // an entry whose out[e] is null is skipped.
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
  // attention, then the inverse rope on each head of out (V carried RoPE: K = V), positions[t] the
  // query's: the two calls as one, which a backend may fuse.
  virtual void attention_derotated(const float* q, int64_t n_queries, int heads, int64_t dim, RaggedRows keys,
                                   const float* sinks, float scale, const RopeTable& rope, const int64_t* positions,
                                   float* out) {
    attention(q, n_queries, heads, dim, keys, sinks, scale, out);
    this->rope(out, n_queries, heads, dim, rope, positions, true);
  }

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

  // ---- decoding without host round trips ------------------------------------------
  // One query per sequence; sequence b's tables are row `table_of[b]` (b when
  // table_of is null) of per-sequence pointer tables in backend memory.
  //
  // Key rows of query b at position p = positions[b], in this order:
  //   window rows  window[t * window_stride + j % window_slots]  for j = max(0, p - window_len + 1) .. p
  //   then         entries[t * entry_stride + i]                 for i < (p + 1) / rate   (picked null)
  //   or           entries[t * entry_stride + picked[b * k + s]] for s < picked_count[b] (picked given)
  // (t = table row; window_len 0 or entries null: none of that part). Written to out_rows
  // from out_offsets[b]; out_offsets has batch + 1 entries, out_offsets[0] = 0.
  // With `store` (window given, window_len >= 1): row b of store (store_dim floats) is also
  // written into query b's own window row, window[t * window_stride + p % window_slots]
  // (the new token's key, listed last among the window rows).
  virtual void decode_rows(int64_t batch, const int64_t* positions, const int32_t* table_of,
                           const float* const* window, int64_t window_stride, int64_t window_slots, int64_t window_len,
                           const float* const* entries, int64_t entry_stride, int64_t rate, const int32_t* picked,
                           const int32_t* picked_count, int k, const float** out_rows, int64_t* out_offsets,
                           const float* store = nullptr, int64_t store_dim = 0) = 0;
  // The compressor of one decode token per sequence (rate r; overlap: CSA's two
  // windows over rows of width 2*dim, else rows of width dim). Token p = positions[b]
  // closes entry i = p / r when (p + 1) % r == 0: then out[b] = entries[t * entry_stride + i],
  // entry_pos[b] = i * r and the slot lists (r slots, or 2r with overlap: half a of window
  // i-1 (null slots for i = 0), then half b (+ dim) of window i) name token j's kv row
  // kv + b * width for j == p, else ring[t * ring_stride + j % ring_slots] (its score at
  // + width); otherwise out[b] = null, which compress() skips. Also lists the ring store
  // of token p: ring_dst[2b] = ring[t * ring_stride + p % ring_slots], ring_dst[2b + 1] =
  // that + width, ring_src = kv + b * width and score + b * width (ring_slots = 2r or r).
  // First adds the position bias to the new rows in place: score[b, :] += bias[p % r, :]
  // (bias [r, width]; null: none), as add_position_bias does.
  virtual void decode_compress_rows(int64_t batch, const int64_t* positions, const int32_t* table_of, int64_t rate,
                                    bool overlap, int64_t dim, const float* kv, float* score, const float* bias,
                                    float* const* ring, int64_t ring_stride, float* const* entries,
                                    int64_t entry_stride, const float** kv_src, const float** score_src, float** out,
                                    int64_t* entry_pos, float** ring_dst, const float** ring_src) = 0;
  // Scratch of decode_compress's composed form: batch * slots kv_src and score_src
  // entries, batch out and entry_pos, 2 * batch ring_dst and ring_src.
  struct DecodeCompressScratch {
    const float** kv_src = nullptr;
    const float** score_src = nullptr;
    float** out = nullptr;
    int64_t* entry_pos = nullptr;
    float** ring_dst = nullptr;
    const float** ring_src = nullptr;
  };
  // The whole compressor step of one decode token per sequence: decode_compress_rows
  // (position bias into score, the closing windows' slot lists, the ring store's rows),
  // then compress() into the closed entries (norm_weight, eps, rope as compress takes
  // them), then the ring store (copy_rows of 2 * batch rows of width floats, after the
  // entries have read the ring). A backend may fuse the three; this form composes them.
  virtual void decode_compress(int64_t batch, const int64_t* positions, const int32_t* table_of, int64_t rate,
                               bool overlap, int64_t dim, const float* kv, float* score, const float* bias,
                               float* const* ring, int64_t ring_stride, float* const* entries, int64_t entry_stride,
                               const float* norm_weight, float eps, const RopeTable& rope,
                               const DecodeCompressScratch& scratch) {
    decode_compress_rows(batch, positions, table_of, rate, overlap, dim, kv, score, bias, ring, ring_stride, entries,
                         entry_stride, scratch.kv_src, scratch.score_src, scratch.out, scratch.entry_pos,
                         scratch.ring_dst, scratch.ring_src);
    const int slots = static_cast<int>(overlap ? 2 * rate : rate);
    compress(batch, slots, dim, scratch.kv_src, scratch.score_src, norm_weight, eps, scratch.entry_pos, rope,
             scratch.out);
    copy_rows(scratch.ring_dst, scratch.ring_src, 2 * batch, overlap ? 2 * dim : dim);
  }
  // table[index[i]] = values[i] for i < count where index[i] >= 0.
  virtual void scatter_pointers(void** table, const int64_t* index, void* const* values, int64_t count) = 0;
  // out[r] = the index of the largest of x[r, 0..n) (the lowest index among equals;
  // NaN never wins unless the row is all NaN).
  virtual void argmax(const float* x, int64_t rows, int64_t n, int32_t* out) = 0;
};

std::unique_ptr<Backend> make_cpu_backend();
// Rows [r0, r1) of a quantized matrix in host memory as fp32, (r1 - r0) * w.cols floats at out:
// each element code * scale, the values the CPU backend's products use (a dequantizing load
// gives the same bits).
void dequantize_rows_host(const Weight& w, int64_t r0, int64_t r1, float* out);
// Null when the build has no CUDA backend or no device is present.
std::unique_ptr<Backend> make_cuda_backend(int device = 0);
bool cuda_backend_compiled();

}  // namespace troupe::kernels
