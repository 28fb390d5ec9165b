#include "model/forward.hpp"

#include <algorithm>
#include <cmath>
#include <filesystem>

#include "base/check.hpp"
#include "base/error.hpp"

namespace troupe::model {
namespace {

}  // namespace

// Backend buffers that live for one forward call, taken from and returned to the
// model's spare buffers (no allocation per call once sizes repeat).
class ForwardScratch {
 public:
  explicit ForwardScratch(Model& m) : m_(m), b_(m.backend_) {}
  ~ForwardScratch() {
    try {
      b_.synchronize();  // a forward that threw may have left work in flight
    } catch (...) {
    }
    std::lock_guard lock(m_.spare_mutex_);
    for (auto [bytes, p] : owned_) {
      m_.spare_.emplace(bytes, p);
      m_.spare_bytes_ += bytes;
    }
    // Keep at most 4 GiB spare: beyond, give back the largest.
    while (m_.spare_bytes_ > (size_t{4} << 30) && !m_.spare_.empty()) {
      auto it = std::prev(m_.spare_.end());
      m_.spare_bytes_ -= it->first;
      b_.free(it->second);
      m_.spare_.erase(it);
    }
  }
  ForwardScratch(const ForwardScratch&) = delete;
  ForwardScratch& operator=(const ForwardScratch&) = delete;

  template <class T>
  T* alloc(int64_t n) {
    const size_t want = static_cast<size_t>(std::max<int64_t>(n, 1)) * sizeof(T);
    size_t bytes = 256;
    while (bytes < want) bytes *= 2;  // size classes, so buffers get reused
    void* p = nullptr;
    {
      std::lock_guard lock(m_.spare_mutex_);
      auto it = m_.spare_.find(bytes);
      if (it != m_.spare_.end()) {
        p = it->second;
        m_.spare_bytes_ -= bytes;
        m_.spare_.erase(it);
      }
    }
    if (p == nullptr) p = b_.alloc(bytes);
    owned_.emplace_back(bytes, p);
    return static_cast<T*>(p);
  }
  float* floats(int64_t n) { return alloc<float>(n); }
  // Copies a host vector into a new backend buffer.
  template <class T>
  T* upload(const std::vector<T>& host) {
    T* p = alloc<T>(static_cast<int64_t>(host.size()));
    if (!host.empty()) b_.to_device(p, host.data(), host.size() * sizeof(T));
    return p;
  }

 private:
  Model& m_;
  kernels::Backend& b_;
  std::vector<std::pair<size_t, void*>> owned_;
};

namespace {

struct ChunkInfo {
  SequenceState* state;
  int64_t start;   // position of the first token
  int64_t length;  // tokens in the chunk
  int64_t row;     // first row in the batch
  std::vector<int64_t> checkpoints;  // SequenceState::checkpoints(start, start + length)
};

// Positions of a chunk whose window (or ring) rows the forward stores: the last
// `tail` positions, and [open(B), B) for each checkpoint B; each position once,
// ascending.
template <class Open>
std::vector<int64_t> stored_positions(const ChunkInfo& ci, int64_t tail, Open open) {
  const int64_t end = ci.start + ci.length;
  std::vector<int64_t> out;
  int64_t next = ci.start;  // positions below `next` are already out
  for (int64_t b : ci.checkpoints) {
    for (int64_t j = std::max(next, open(b)); j < b; ++j) out.push_back(j);
    next = std::max(next, b);
  }
  for (int64_t j = std::max(next, end - tail); j < end; ++j) out.push_back(j);
  return out;
}

kernels::RopeTable table(const RopeConfig& rc, const float* inv_freq) {
  return kernels::RopeTable{inv_freq, rc.rope_dim, static_cast<float>(rc.attention_factor)};
}

}  // namespace

struct Model::Batch {
  explicit Batch(Model& m) : scratch(m) {}
  ForwardScratch scratch;
  std::vector<ChunkInfo> chunks;
  int64_t rows = 0;
  std::vector<int64_t> positions_host;
  std::vector<int32_t> ids_host;
  int64_t* positions = nullptr;  // backend
  int32_t* ids = nullptr;        // backend
  float* X = nullptr;            // [rows, hc, D] residual streams
  float* qr = nullptr;           // [rows, q_lora_rank] normalised low-rank query (shared with the indexer)
};

Model::Model(ModelConfig config, std::unique_ptr<Weights> weights, kernels::Backend& backend)
    : config_(std::move(config)), weights_(std::move(weights)), backend_(backend) {
  auto upload = [&](const std::vector<float>& v) {
    auto* p = static_cast<float*>(backend_.alloc(v.size() * 4));
    backend_.to_device(p, v.data(), v.size() * 4);
    return p;
  };
  rope_main_ = upload(config_.rope_main.inv_freq);
  rope_compress_ = upload(config_.rope_compress.inv_freq);
}

Model::~Model() {
  backend_.synchronize();
  for (auto& [bytes, p] : spare_) backend_.free(p);
  backend_.free(rope_main_);
  backend_.free(rope_compress_);
}

std::unique_ptr<Model> Model::load(const std::string& dir, kernels::Backend& backend,
                                   std::optional<kernels::WeightType> matrix_type) {
  namespace fs = std::filesystem;
  if (!fs::exists(dir)) raise(ErrorCode::not_found, "model directory {} does not exist", dir);
  const std::string config_path = (fs::path(dir) / "config.json").string();
  if (!fs::exists(config_path)) raise(ErrorCode::not_found, "{} has no config.json", dir);
  ModelConfig config = load_config(config_path);
  Checkpoint ckpt = Checkpoint::open(dir);
  const auto type = matrix_type ? *matrix_type
                    : backend.name() == "cpu" ? kernels::WeightType::f32
                                              : kernels::WeightType::bf16;
  auto weights = Weights::load(config, ckpt, backend, type, !matrix_type.has_value());
  return std::make_unique<Model>(std::move(config), std::move(weights), backend);
}

std::unique_ptr<SequenceState> Model::new_dense_state() const {
  return std::make_unique<DenseState>(config_, &backend_);
}

std::vector<float> Model::forward(std::span<const Chunk> chunks) {
  const auto& c = config_;
  Batch b(*this);
  int64_t logits_rows = 0;
  for (const auto& ch : chunks) {
    if (ch.state == nullptr || ch.ids.empty()) raise(ErrorCode::invalid_argument, "forward: empty chunk");
    for (int32_t id : ch.ids) {
      if (id < 0 || id >= c.vocab_size) {
        raise(ErrorCode::invalid_argument, "token id {} is out of range for a vocabulary of {}", id, c.vocab_size);
      }
    }
    const int64_t start = ch.state->length();
    if (start + static_cast<int64_t>(ch.ids.size()) > c.max_position_embeddings) {
      raise(ErrorCode::invalid_argument, "sequence of {} tokens exceeds max_position_embeddings {}",
            start + static_cast<int64_t>(ch.ids.size()), c.max_position_embeddings);
    }
    const auto n = static_cast<int64_t>(ch.ids.size());
    auto checkpoints = ch.state->checkpoints(start, start + n);
    for (size_t i = 0; i < checkpoints.size(); ++i) {
      TROUPE_CHECK(checkpoints[i] > start && checkpoints[i] < start + n && (i == 0 || checkpoints[i] > checkpoints[i - 1]),
                   "checkpoints must lie inside the chunk, ascending");
    }
    b.chunks.push_back({ch.state, start, n, b.rows, std::move(checkpoints)});
    for (size_t i = 0; i < ch.ids.size(); ++i) {
      b.positions_host.push_back(start + static_cast<int64_t>(i));
      b.ids_host.push_back(ch.ids[i]);
    }
    b.rows += static_cast<int64_t>(ch.ids.size());
    logits_rows += ch.logits == LogitsWanted::all ? static_cast<int64_t>(ch.ids.size())
                   : ch.logits == LogitsWanted::last ? 1 : 0;
  }
  for (const auto& ci : b.chunks) ci.state->reserve(ci.start + ci.length);

  const int64_t T = b.rows, D = c.hidden_size;
  b.positions = b.scratch.upload(b.positions_host);
  b.ids = b.scratch.upload(b.ids_host);
  b.X = b.scratch.floats(T * c.hc_mult * D);
  b.qr = b.scratch.floats(T * c.q_lora_rank);
  backend_.embed(weights_->embed, b.ids, T, c.hc_mult, b.X);

  for (int l = 0; l < c.num_hidden_layers; ++l) run_layer(l, b);

  // Head: collapse the streams, final norm, lm_head on the wanted rows.
  kernels::MhcParams hp{c.hc_mult, D, 0, c.hc_eps, c.rms_norm_eps};
  float* z = b.scratch.floats(T * D);
  backend_.mhc_head(b.X, T, weights_->hc_head.fn, weights_->hc_head.base, weights_->hc_head.scale, hp, z);
  std::vector<int64_t> wanted;
  for (size_t i = 0; i < chunks.size(); ++i) {
    const auto& ci = b.chunks[i];
    if (chunks[i].logits == LogitsWanted::all) {
      for (int64_t t = 0; t < ci.length; ++t) wanted.push_back(ci.row + t);
    } else if (chunks[i].logits == LogitsWanted::last) {
      wanted.push_back(ci.row + ci.length - 1);
    }
  }
  std::vector<float> logits(static_cast<size_t>(logits_rows * c.vocab_size));
  if (!wanted.empty()) {
    float* zw = b.scratch.floats(logits_rows * D);
    backend_.gather_rows(z, D, b.scratch.upload(wanted), logits_rows, zw);
    backend_.rmsnorm(zw, weights_->final_norm, zw, logits_rows, D, c.rms_norm_eps);
    float* out = b.scratch.floats(logits_rows * c.vocab_size);
    backend_.linear(zw, logits_rows, weights_->lm_head, out);
    backend_.to_host(logits.data(), out, logits.size() * 4);
  }
  backend_.synchronize();
  for (const auto& ci : b.chunks) ci.state->commit(ci.start + ci.length);
  return logits;
}

void Model::run_layer(int layer, Batch& b) {
  const auto& c = config_;
  const auto& lw = weights_->layers[static_cast<size_t>(layer)];
  const int64_t T = b.rows, D = c.hidden_size;
  kernels::MhcParams hp{c.hc_mult, D, c.hc_sinkhorn_iters, c.hc_eps, c.rms_norm_eps};

  float* y = b.scratch.floats(T * D);
  float* post = b.scratch.floats(T * c.hc_mult);
  float* comb = b.scratch.floats(T * c.hc_mult * c.hc_mult);
  float* f = b.scratch.floats(T * D);

  backend_.mhc_pre_norm(b.X, T, lw.attn_hc.fn, lw.attn_hc.base, lw.attn_hc.scale, hp, lw.input_norm, c.rms_norm_eps, y,
                        post, comb);
  attention_block(layer, b, y, f);
  backend_.mhc_post(b.X, T, f, post, comb, hp);

  backend_.mhc_pre_norm(b.X, T, lw.ffn_hc.fn, lw.ffn_hc.base, lw.ffn_hc.scale, hp, lw.post_attention_norm,
                        c.rms_norm_eps, y, post, comb);
  moe_block(layer, b, y, f);
  backend_.mhc_post(b.X, T, f, post, comb, hp);
}

// Compresses every window that closes inside the batch's chunks and keeps the
// trailing tokens' kv and score in the sequence's inflight ring.
void Model::compress_block(int layer, Batch& b, const CompressorWeights& cw, Ring ring, const float* h,
                           bool to_index_keys) {
  const auto& c = config_;
  const int64_t T = b.rows;
  const int64_t rate = c.compress_rate(layer);
  const bool overlap = c.layer_types[static_cast<size_t>(layer)] == LayerType::csa;  // CSA pools two windows
  const int64_t dim = to_index_keys ? c.index_head_dim : c.head_dim;
  const int slots = static_cast<int>(overlap ? 2 * rate : rate);
  const int64_t ring_slots = overlap ? 2 * rate : rate;

  float* kv = b.scratch.floats(T * cw.width);
  float* score = b.scratch.floats(T * cw.width);
  backend_.linear(h, T, cw.kv_proj, kv);
  backend_.linear(h, T, cw.gate_proj, score);
  backend_.add_position_bias(score, T, cw.width, b.positions, cw.position_bias, rate);

  std::vector<const float*> kv_src, score_src;
  std::vector<float*> out;
  std::vector<int64_t> entry_pos;
  std::vector<float*> ring_dst;
  std::vector<const float*> ring_src;
  for (const auto& ci : b.chunks) {
    // Row of token j: the chunk's buffers for j >= start, the ring before.
    auto kv_of = [&](int64_t j) -> const float* {
      return j >= ci.start ? kv + (ci.row + j - ci.start) * cw.width : ci.state->ring_row(layer, ring, j);
    };
    auto score_of = [&](int64_t j) -> const float* {
      return j >= ci.start ? score + (ci.row + j - ci.start) * cw.width
                           : ci.state->ring_row(layer, ring, j) + cw.width;
    };
    const int64_t first = ci.start / rate, last = (ci.start + ci.length) / rate;
    for (int64_t i = first; i < last; ++i) {
      if (overlap) {  // slots [0, rate): previous window through half a; [rate, 2 rate): this window, half b
        for (int64_t s = 0; s < rate; ++s) {
          const int64_t j = (i - 1) * rate + s;
          kv_src.push_back(i > 0 ? kv_of(j) : nullptr);
          score_src.push_back(i > 0 ? score_of(j) : nullptr);
        }
        for (int64_t s = 0; s < rate; ++s) {
          const int64_t j = i * rate + s;
          kv_src.push_back(kv_of(j) + dim);
          score_src.push_back(score_of(j) + dim);
        }
      } else {
        for (int64_t s = 0; s < rate; ++s) {
          kv_src.push_back(kv_of(i * rate + s));
          score_src.push_back(score_of(i * rate + s));
        }
      }
      out.push_back(to_index_keys ? ci.state->index_key_row(layer, i) : ci.state->entry_row(layer, i));
      entry_pos.push_back(i * rate);
    }
    // Tokens whose windows are still open at checkpoint B: the previous window too with overlap.
    auto open = [&](int64_t b) { return std::max<int64_t>(0, (b / rate - (overlap ? 1 : 0)) * rate); };
    for (int64_t j : stored_positions(ci, ring_slots, open)) {
      float* dst = ci.state->ring_row(layer, ring, j);
      ring_dst.push_back(dst);
      ring_src.push_back(kv + (ci.row + j - ci.start) * cw.width);
      ring_dst.push_back(dst + cw.width);
      ring_src.push_back(score + (ci.row + j - ci.start) * cw.width);
    }
  }
  const auto count = static_cast<int64_t>(out.size());
  if (count > 0) {
    backend_.compress(count, slots, dim, b.scratch.upload(kv_src), b.scratch.upload(score_src), cw.kv_norm,
                      c.rms_norm_eps, b.scratch.upload(entry_pos), table(c.rope_compress, rope_compress_),
                      b.scratch.upload(out));
  }
  // The ring is written after the entries have read it.
  if (!ring_dst.empty()) {
    backend_.copy_rows(b.scratch.upload(ring_dst), b.scratch.upload(ring_src), static_cast<int64_t>(ring_dst.size()),
                       cw.width);
  }
}

void Model::attention_block(int layer, Batch& b, const float* h, float* out) {
  const auto& c = config_;
  const auto& aw = weights_->layers[static_cast<size_t>(layer)].attn;
  const int64_t T = b.rows, H = c.num_attention_heads, hd = c.head_dim, W = c.sliding_window;
  const LayerType type = c.layer_types[static_cast<size_t>(layer)];
  const bool main_rope = type == LayerType::sliding;
  const auto rope = main_rope ? table(c.rope_main, rope_main_) : table(c.rope_compress, rope_compress_);

  // Query: low rank, per-head unweighted norm, RoPE.
  backend_.linear(h, T, aw.q_a_proj, b.qr);
  backend_.rmsnorm(b.qr, aw.q_a_norm, b.qr, T, c.q_lora_rank, c.rms_norm_eps);
  float* q = b.scratch.floats(T * H * hd);
  backend_.linear(b.qr, T, aw.q_b_proj, q);
  backend_.rmsnorm_rope(q, nullptr, q, T, static_cast<int>(H), hd, c.rms_norm_eps, rope, b.positions);
  // The shared K=V head.
  float* kv = b.scratch.floats(T * hd);
  backend_.linear(h, T, aw.kv_proj, kv);
  backend_.rmsnorm_rope(kv, aw.kv_norm, kv, T, 1, hd, c.rms_norm_eps, rope, b.positions);

  const int64_t rate = c.compress_rate(layer);
  if (aw.compressor) compress_block(layer, b, *aw.compressor, Ring::compressor, h, false);

  // CSA: the lightning indexer picks top-k entries per query.
  std::vector<int32_t> picked, picked_count;
  const int64_t topk = c.index_topk;
  if (aw.indexer) {
    const auto& iw = *aw.indexer;
    compress_block(layer, b, iw.compressor, Ring::indexer, h, true);
    const int64_t nih = c.index_n_heads, ihd = c.index_head_dim;
    float* iq = b.scratch.floats(T * nih * ihd);
    backend_.linear(b.qr, T, iw.q_b_proj, iq);
    backend_.rope(iq, T, static_cast<int>(nih), ihd, table(c.rope_compress, rope_compress_), b.positions, false);
    float* w = b.scratch.floats(T * nih);
    backend_.linear(h, T, iw.weights_proj, w);
    std::vector<const float*> rows;
    std::vector<int64_t> offsets{0};
    for (const auto& ci : b.chunks) {
      for (int64_t t = 0; t < ci.length; ++t) {
        const int64_t visible = (ci.start + t + 1) / rate;
        for (int64_t i = 0; i < visible; ++i) rows.push_back(ci.state->index_key_row(layer, i));
        offsets.push_back(static_cast<int64_t>(rows.size()));
      }
    }
    auto* idx = b.scratch.alloc<int32_t>(T * topk);
    auto* cnt = b.scratch.alloc<int32_t>(T);
    backend_.indexer_topk(iq, w, T, static_cast<int>(nih), ihd, 1.0f / std::sqrt(static_cast<float>(ihd)),
                          1.0f / std::sqrt(static_cast<float>(nih)),
                          {b.scratch.upload(rows), b.scratch.upload(offsets)}, static_cast<int>(topk), idx, cnt);
    picked.resize(static_cast<size_t>(T * topk));
    picked_count.resize(static_cast<size_t>(T));
    backend_.to_host(picked.data(), idx, picked.size() * 4);
    backend_.to_host(picked_count.data(), cnt, picked_count.size() * 4);
  }

  // Keys of each query: its window of raw kv, then its compressed entries.
  std::vector<const float*> keys;
  std::vector<int64_t> offsets{0};
  for (const auto& ci : b.chunks) {
    for (int64_t t = 0; t < ci.length; ++t) {
      const int64_t p = ci.start + t;
      for (int64_t j = std::max<int64_t>(0, p - W + 1); j <= p; ++j) {
        keys.push_back(j >= ci.start ? kv + (ci.row + j - ci.start) * hd : ci.state->swa_row(layer, j));
      }
      const int64_t row = ci.row + t;
      if (type == LayerType::hca) {
        for (int64_t i = 0; i < (p + 1) / rate; ++i) keys.push_back(ci.state->entry_row(layer, i));
      } else if (type == LayerType::csa) {
        for (int32_t s = 0; s < picked_count[static_cast<size_t>(row)]; ++s) {
          keys.push_back(ci.state->entry_row(layer, picked[static_cast<size_t>(row * topk + s)]));
        }
      }
      offsets.push_back(static_cast<int64_t>(keys.size()));
    }
  }
  // V carried RoPE (K = V): the output turned back by the inverse rope (fused where the backend can).
  float* o = b.scratch.floats(T * H * hd);
  backend_.attention_derotated(q, T, static_cast<int>(H), hd, {b.scratch.upload(keys), b.scratch.upload(offsets)},
                               aw.sinks, 1.0f / std::sqrt(static_cast<float>(hd)), rope, b.positions, o);

  // The window keeps the chunk's last tokens (after attention has read the old ones).
  std::vector<float*> dst;
  std::vector<const float*> src;
  for (const auto& ci : b.chunks) {
    for (int64_t j : stored_positions(ci, W, [&](int64_t cp) { return cp - W; })) {
      dst.push_back(ci.state->swa_row(layer, j));
      src.push_back(kv + (ci.row + j - ci.start) * hd);
    }
  }
  backend_.copy_rows(b.scratch.upload(dst), b.scratch.upload(src), static_cast<int64_t>(dst.size()), hd);

  // The grouped output projection.
  float* g = b.scratch.floats(T * c.o_groups * c.o_lora_rank);
  backend_.linear_grouped(o, T, aw.o_a_proj, static_cast<int>(c.o_groups), g);
  backend_.linear(g, T, aw.o_b_proj, out);
}

void Model::moe_block(int layer, Batch& b, const float* h, float* out) {
  const auto& c = config_;
  const auto& mw = weights_->layers[static_cast<size_t>(layer)].moe;
  const int64_t T = b.rows, D = c.hidden_size, I = c.moe_intermediate_size, E = c.n_routed_experts;
  const int k = static_cast<int>(c.num_experts_per_tok);

  // Shared expert first; routed experts accumulate onto it.
  float* g = b.scratch.floats(T * I);
  float* u = b.scratch.floats(T * I);
  backend_.linear(h, T, mw.shared_gate, g);
  backend_.linear(h, T, mw.shared_up, u);
  backend_.swiglu(g, u, g, T * I, c.swiglu_limit);
  backend_.linear(g, T, mw.shared_down, out);

  float* logits = b.scratch.floats(T * E);
  backend_.linear(h, T, mw.router, logits);
  auto* idx = b.scratch.alloc<int32_t>(T * k);
  float* wt = b.scratch.floats(T * k);
  backend_.route(logits, T, static_cast<int>(E), c.scoring_func, mw.score_bias, k, mw.tid2eid, b.ids,
                 c.routed_scaling_factor, idx, wt);
  backend_.moe(h, T, D, idx, wt, k, static_cast<int>(E), mw.gate.data(), mw.up.data(), mw.down.data(), c.swiglu_limit,
               out);
}

}  // namespace troupe::model
