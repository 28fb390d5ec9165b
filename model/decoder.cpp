#include "model/decoder.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>

#include "base/check.hpp"
#include "base/error.hpp"

namespace troupe::model {
namespace {

#define DECODER_REQUIRE(cond, ...)                                 \
  do {                                                             \
    if (!(cond)) raise(ErrorCode::invalid_argument, __VA_ARGS__); \
  } while (0)

kernels::RopeTable rope_table(const RopeConfig& rc, const float* inv_freq) {
  return kernels::RopeTable{inv_freq, rc.rope_dim, static_cast<float>(rc.attention_factor)};
}

}  // namespace

// Backend memory of the decoder, allocated once for max_batch rows.
struct Decoder::Buffers {
  explicit Buffers(kernels::Backend& backend) : b(backend) {}
  ~Buffers() {
    b.synchronize();
    for (void* p : owned) b.free(p);
  }
  Buffers(const Buffers&) = delete;
  Buffers& operator=(const Buffers&) = delete;
  template <class T>
  T* alloc(int64_t n) {
    void* p = b.alloc(static_cast<size_t>(std::max<int64_t>(n, 1)) * sizeof(T));
    owned.push_back(p);
    return static_cast<T*>(p);
  }

  kernels::Backend& b;
  std::vector<void*> owned;

  // Step input (one upload per step): positions, scatter index and values, table slots.
  char* in = nullptr;
  size_t in_bytes = 0;
  int64_t* positions = nullptr;
  int64_t* scatter_index = nullptr;
  void** scatter_values = nullptr;
  int32_t* table_of = nullptr;
  std::vector<char> host_in;
  size_t off_index = 0, off_values = 0, off_table = 0;

  int32_t* ids = nullptr;
  int32_t* sampled = nullptr;
  void** tables = nullptr;

  float *X = nullptr, *y = nullptr, *post = nullptr, *comb = nullptr, *f = nullptr;
  float *qr = nullptr, *q = nullptr, *kv = nullptr, *o = nullptr, *g = nullptr;
  float *ckv = nullptr, *csc = nullptr, *ickv = nullptr, *icsc = nullptr, *iq = nullptr, *iw = nullptr;
  float *sg = nullptr, *su = nullptr, *rlogits = nullptr, *rweight = nullptr;
  float *z = nullptr, *logits = nullptr;
  int32_t *picked = nullptr, *picked_count = nullptr, *ridx = nullptr;
  const float** irows = nullptr;
  int64_t* ioffs = nullptr;
  const float** krows = nullptr;
  int64_t* koffs = nullptr;
  kernels::Backend::DecodeCompressScratch compress;  // decode_compress's slot lists and ring store
};

Decoder::Decoder(Model& model, Options options) : model_(model), options_(options) {
  const auto& c = model_.config_;
  auto& be = model_.backend_;
  DECODER_REQUIRE(options_.max_batch >= 1 && options_.max_batch <= 64, "Decoder: max_batch must be 1..64");
  DECODER_REQUIRE(options_.max_context >= 1, "Decoder: max_context must be positive");
  const int64_t B = options_.max_batch, W = c.sliding_window, D = c.hidden_size, hd = c.head_dim;
  const int64_t H = c.num_attention_heads;

  // Table layout of one slot.
  int64_t at = 0, max_cap = 0, max_slots = 1, max_width = 1;
  per_seq_scatter_ = 0;
  for (int l = 0; l < c.num_hidden_layers; ++l) {
    const auto shape = LayerShape::of(c, l);
    LayerTables t;
    t.swa = at;
    at += W;
    ++per_seq_scatter_;
    if (shape.rate > 0) {
      t.cap = options_.max_context / shape.rate + 1;
      max_cap = std::max(max_cap, t.cap);
      max_slots = std::max(max_slots, shape.ring_slots);
      t.ring[0] = at;
      at += shape.ring_slots;
      t.entries = at;
      at += t.cap;
      per_seq_scatter_ += 2;
      max_width = std::max(max_width, shape.ring_width / 2);
      if (shape.type == LayerType::csa) {
        t.ring[1] = at;
        at += shape.ring_slots;
        t.index_keys = at;
        at += t.cap;
        per_seq_scatter_ += 2;
        max_width = std::max(max_width, shape.index_ring_width / 2);
      }
    }
    layout_.push_back(t);
  }
  slot_stride_ = std::max<int64_t>(at, 1);
  slots_.resize(static_cast<size_t>(B));

  buf_ = std::make_unique<Buffers>(be);
  auto& b = *buf_;
  const int64_t S = B * per_seq_scatter_;
  b.off_index = static_cast<size_t>(B) * 8;
  b.off_values = b.off_index + static_cast<size_t>(S) * 8;
  b.off_table = b.off_values + static_cast<size_t>(S) * 8;
  b.in_bytes = b.off_table + static_cast<size_t>(B) * 4;
  b.in = b.alloc<char>(static_cast<int64_t>(b.in_bytes));
  b.host_in.assign(b.in_bytes, 0);
  b.positions = reinterpret_cast<int64_t*>(b.in);
  b.scatter_index = reinterpret_cast<int64_t*>(b.in + b.off_index);
  b.scatter_values = reinterpret_cast<void**>(b.in + b.off_values);
  b.table_of = reinterpret_cast<int32_t*>(b.in + b.off_table);
  b.ids = b.alloc<int32_t>(B);
  b.sampled = b.alloc<int32_t>(B);
  b.tables = b.alloc<void*>(B * slot_stride_);
  {
    std::vector<void*> null_tables(static_cast<size_t>(B * slot_stride_), nullptr);
    be.to_device(b.tables, null_tables.data(), null_tables.size() * sizeof(void*));
    std::vector<int32_t> zero(static_cast<size_t>(B), 0);
    be.to_device(b.ids, zero.data(), zero.size() * 4);
    be.synchronize();
  }

  const int64_t hc = c.hc_mult, topk = c.index_topk;
  b.X = b.alloc<float>(B * hc * D);
  b.y = b.alloc<float>(B * D);
  b.post = b.alloc<float>(B * hc);
  b.comb = b.alloc<float>(B * hc * hc);
  b.f = b.alloc<float>(B * D);
  b.qr = b.alloc<float>(B * c.q_lora_rank);
  b.q = b.alloc<float>(B * H * hd);
  b.kv = b.alloc<float>(B * hd);
  b.o = b.alloc<float>(B * H * hd);
  b.g = b.alloc<float>(B * c.o_groups * c.o_lora_rank);
  b.ckv = b.alloc<float>(B * 2 * max_width);
  b.csc = b.alloc<float>(B * 2 * max_width);
  b.ickv = b.alloc<float>(B * 2 * max_width);
  b.icsc = b.alloc<float>(B * 2 * max_width);
  b.iq = b.alloc<float>(B * std::max<int64_t>(1, c.index_n_heads * c.index_head_dim));
  b.iw = b.alloc<float>(B * std::max<int64_t>(1, c.index_n_heads));
  b.sg = b.alloc<float>(B * c.moe_intermediate_size);
  b.su = b.alloc<float>(B * c.moe_intermediate_size);
  b.rlogits = b.alloc<float>(B * c.n_routed_experts);
  b.rweight = b.alloc<float>(B * c.num_experts_per_tok);
  b.ridx = b.alloc<int32_t>(B * c.num_experts_per_tok);
  b.z = b.alloc<float>(B * D);
  b.logits = b.alloc<float>(B * c.vocab_size);
  b.picked = b.alloc<int32_t>(B * std::max<int64_t>(topk, 1));
  b.picked_count = b.alloc<int32_t>(B);
  b.irows = b.alloc<const float*>(B * std::max<int64_t>(max_cap, 1));
  b.ioffs = b.alloc<int64_t>(B + 1);
  b.krows = b.alloc<const float*>(B * (W + std::max(topk, max_cap)));
  b.koffs = b.alloc<int64_t>(B + 1);
  b.compress.kv_src = b.alloc<const float*>(B * max_slots);
  b.compress.score_src = b.alloc<const float*>(B * max_slots);
  b.compress.out = b.alloc<float*>(B);
  b.compress.entry_pos = b.alloc<int64_t>(B);
  b.compress.ring_dst = b.alloc<float*>(2 * B);
  b.compress.ring_src = b.alloc<const float*>(2 * B);
  graphs_ = options_.graphs && be.graphs_supported();
}

Decoder::~Decoder() {
  graphs_by_n_.clear();
  buf_.reset();
}

float* const* Decoder::table(int64_t offset) const {
  return reinterpret_cast<float* const*>(buf_->tables + offset);
}

SequenceState* Decoder::bound(int slot) const { return slots_.at(static_cast<size_t>(slot)).state; }

bool Decoder::fits(int slot) const {
  const SequenceState* st = bound(slot);
  return st != nullptr && st->length() + 1 <= options_.max_context;
}

int Decoder::bind(SequenceState& state) {
  if (state.length() < 1) raise(ErrorCode::invalid_argument, "Decoder::bind: the sequence has no tokens yet");
  if (state.length() + 1 > options_.max_context) {
    raise(ErrorCode::invalid_argument, "Decoder::bind: {} tokens exceed the decoder's max_context {}", state.length(),
          options_.max_context);
  }
  for (size_t i = 0; i < slots_.size(); ++i) {
    if (slots_[i].state == nullptr) {
      slots_[i].state = &state;
      upload_tables(static_cast<int>(i));
      return static_cast<int>(i);
    }
  }
  return -1;
}

void Decoder::refresh(int slot) {
  TROUPE_CHECK(bound(slot) != nullptr, "refresh of an unbound slot");
  upload_tables(slot);
}

void Decoder::unbind(int slot) { slots_.at(static_cast<size_t>(slot)).state = nullptr; }

void Decoder::upload_tables(int slot) {
  const auto& c = model_.config_;
  SequenceState& st = *slots_[static_cast<size_t>(slot)].state;
  const int64_t L = st.length(), W = c.sliding_window;
  std::vector<const float*> tab(static_cast<size_t>(slot_stride_), nullptr);
  for (int l = 0; l < c.num_hidden_layers; ++l) {
    const auto shape = LayerShape::of(c, l);
    const auto& t = layout_[static_cast<size_t>(l)];
    for (int64_t pos = std::max<int64_t>(0, L - W); pos < L; ++pos) tab[static_cast<size_t>(t.swa + pos % W)] = st.swa_row(l, pos);
    if (shape.rate == 0) continue;
    const int64_t n = L / shape.rate;
    TROUPE_CHECK(n < t.cap, "Decoder: entries beyond the tables");
    for (int64_t pos = std::max<int64_t>(0, L - shape.ring_slots); pos < L; ++pos) {
      tab[static_cast<size_t>(t.ring[0] + pos % shape.ring_slots)] = st.ring_row(l, Ring::compressor, pos);
      if (t.ring[1] >= 0) tab[static_cast<size_t>(t.ring[1] + pos % shape.ring_slots)] = st.ring_row(l, Ring::indexer, pos);
    }
    for (int64_t i = 0; i < n; ++i) {
      tab[static_cast<size_t>(t.entries + i)] = st.entry_row(l, i);
      if (t.index_keys >= 0) tab[static_cast<size_t>(t.index_keys + i)] = st.index_key_row(l, i);
    }
  }
  auto& be = model_.backend_;
  be.to_device(buf_->tables + static_cast<int64_t>(slot) * slot_stride_, tab.data(), tab.size() * sizeof(void*));
  be.synchronize();  // `tab` dies here
}

void Decoder::step(std::span<const int> slots, std::span<const int32_t> ids) {
  const auto& c = model_.config_;
  auto& be = model_.backend_;
  auto& b = *buf_;
  const auto n = static_cast<int64_t>(slots.size());
  DECODER_REQUIRE(n >= 1 && n <= options_.max_batch, "Decoder::step: 1..max_batch sequences");
  if (ids.empty()) {
    DECODER_REQUIRE(last_n_ == n, "Decoder::step: chained ids need the previous step's batch");
  } else {
    DECODER_REQUIRE(static_cast<int64_t>(ids.size()) == n, "Decoder::step: one id per sequence");
    for (int32_t id : ids) {
      if (id < 0 || id >= c.vocab_size) {
        raise(ErrorCode::invalid_argument, "token id {} is out of range for a vocabulary of {}", id, c.vocab_size);
      }
    }
  }
  for (int64_t i = 0; i < n; ++i) {
    DECODER_REQUIRE(slots[i] >= 0 && slots[i] < options_.max_batch && bound(slots[i]) != nullptr,
                   "Decoder::step: unbound slot");
    for (int64_t j = 0; j < i; ++j) DECODER_REQUIRE(slots[i] != slots[j], "Decoder::step: a slot twice");
    if (!fits(slots[i])) raise(ErrorCode::invalid_argument, "Decoder::step: the sequence reached max_context");
  }

  // Host image of the step input: positions, the new rows' pointers, table slots.
  auto* positions = reinterpret_cast<int64_t*>(b.host_in.data());
  auto* index = reinterpret_cast<int64_t*>(b.host_in.data() + b.off_index);
  auto* values = reinterpret_cast<void**>(b.host_in.data() + b.off_values);
  auto* table_of = reinterpret_cast<int32_t*>(b.host_in.data() + b.off_table);
  const int64_t W = c.sliding_window;
  int64_t k = 0;
  auto push = [&](int64_t at, const void* v) {
    index[k] = at;
    values[k] = const_cast<void*>(v);
    ++k;
  };
  for (int64_t i = 0; i < n; ++i) {
    const int s = slots[i];
    SequenceState& st = *slots_[static_cast<size_t>(s)].state;
    const int64_t p = st.length();
    st.reserve(p + 1);
    positions[i] = p;
    table_of[i] = s;
    const int64_t base = static_cast<int64_t>(s) * slot_stride_;
    for (int l = 0; l < c.num_hidden_layers; ++l) {
      const auto& t = layout_[static_cast<size_t>(l)];
      push(base + t.swa + p % W, st.swa_row(l, p));
      const int64_t rate = c.compress_rate(l);
      if (rate == 0) continue;
      const int64_t slots_n = t.ring[1] >= 0 ? 2 * rate : rate;
      const bool closing = (p + 1) % rate == 0;
      push(base + t.ring[0] + p % slots_n, st.ring_row(l, Ring::compressor, p));
      push(closing ? base + t.entries + p / rate : -1, closing ? st.entry_row(l, p / rate) : nullptr);
      if (t.ring[1] >= 0) {
        push(base + t.ring[1] + p % slots_n, st.ring_row(l, Ring::indexer, p));
        push(closing ? base + t.index_keys + p / rate : -1, closing ? st.index_key_row(l, p / rate) : nullptr);
      }
    }
  }
  TROUPE_CHECK(k == n * per_seq_scatter_, "Decoder: scatter count");
  be.to_device(b.in, b.host_in.data(), b.in_bytes);
  if (ids.empty()) {
    be.copy(b.ids, b.sampled, static_cast<size_t>(n) * 4);
  } else {
    be.to_device(b.ids, ids.data(), static_cast<size_t>(n) * 4);
  }

  auto it = graphs_by_n_.find(n);
  if (it != graphs_by_n_.end()) {
    it->second->launch();
    ++replays_;
  } else if (graphs_ && !options_.profile && runs_by_n_[n] >= 1 && be.capture_begin()) {
    // Recorded the second time this size runs (the first sized every buffer).
    std::unique_ptr<kernels::Backend::Graph> graph;
    try {
      run_ops(n);
    } catch (...) {
      be.capture_end();
      throw;
    }
    graph = be.capture_end();
    if (graph) {
      graph->launch();
      ++replays_;
      graphs_by_n_[n] = std::move(graph);
    } else {
      run_ops(n);
    }
  } else {
    run_ops(n);
  }
  ++runs_by_n_[n];
  for (int64_t i = 0; i < n; ++i) slots_[static_cast<size_t>(slots[i])].state->commit(positions[i] + 1);
  last_n_ = n;
  ++steps_;
}

std::vector<int32_t> Decoder::tokens() {
  std::vector<int32_t> out(static_cast<size_t>(last_n_));
  if (last_n_ > 0) model_.backend_.to_host(out.data(), buf_->sampled, out.size() * 4);
  model_.backend_.synchronize();
  return out;
}

std::vector<float> Decoder::logits() {
  std::vector<float> out(static_cast<size_t>(last_n_ * model_.config_.vocab_size));
  if (last_n_ > 0) model_.backend_.to_host(out.data(), buf_->logits, out.size() * 4);
  model_.backend_.synchronize();
  return out;
}

// ---- the ops of one step (recorded into a graph where the backend can) ------------

void Decoder::run_ops(int64_t n) {
  const auto& c = model_.config_;
  const auto& w = *model_.weights_;
  auto& be = model_.backend_;
  auto& b = *buf_;
  const int64_t D = c.hidden_size;
  mark(nullptr);
  be.scatter_pointers(b.tables, b.scatter_index, b.scatter_values, n * per_seq_scatter_);
  be.embed(w.embed, b.ids, n, c.hc_mult, b.X);
  mark("tables and embedding");
  for (int l = 0; l < c.num_hidden_layers; ++l) layer_ops(l, n);
  kernels::MhcParams hp{c.hc_mult, D, 0, c.hc_eps, c.rms_norm_eps};
  be.mhc_head_norm(b.X, n, w.hc_head.fn, w.hc_head.base, w.hc_head.scale, hp, w.final_norm, c.rms_norm_eps, b.z);
  mark("head mHC and norm");
  be.linear(b.z, n, w.lm_head, b.logits);
  mark("lm_head");
  be.argmax(b.logits, n, c.vocab_size, b.sampled);
  mark("argmax");
}

void Decoder::mark(const char* what) {
  if (!options_.profile) return;
  model_.backend_.synchronize();
  const auto now = std::chrono::steady_clock::now();
  if (what != nullptr) profile_[what] += std::chrono::duration<double>(now - mark_).count();
  mark_ = now;
}

void Decoder::layer_ops(int layer, int64_t n) {
  const auto& c = model_.config_;
  const auto& lw = model_.weights_->layers[static_cast<size_t>(layer)];
  auto& be = model_.backend_;
  auto& b = *buf_;
  const int64_t D = c.hidden_size;
  kernels::MhcParams hp{c.hc_mult, D, c.hc_sinkhorn_iters, c.hc_eps, c.rms_norm_eps};
  be.mhc_pre_norm(b.X, n, lw.attn_hc.fn, lw.attn_hc.base, lw.attn_hc.scale, hp, lw.input_norm, c.rms_norm_eps, b.y,
                  b.post, b.comb);
  mark("mHC pre and norm");
  attention_ops(layer, n, b.y, b.f);
  be.mhc_post(b.X, n, b.f, b.post, b.comb, hp);
  be.mhc_pre_norm(b.X, n, lw.ffn_hc.fn, lw.ffn_hc.base, lw.ffn_hc.scale, hp, lw.post_attention_norm, c.rms_norm_eps,
                  b.y, b.post, b.comb);
  mark("mHC pre and norm");
  moe_ops(layer, n, b.y, b.f);
  be.mhc_post(b.X, n, b.f, b.post, b.comb, hp);
  mark("mHC post");
}

void Decoder::compress_ops(int layer, int64_t n, const CompressorWeights& cw, Ring ring, float* kv, float* score,
                           bool index_keys) {
  const auto& c = model_.config_;
  auto& be = model_.backend_;
  auto& b = *buf_;
  const auto& t = layout_[static_cast<size_t>(layer)];
  const int64_t rate = c.compress_rate(layer);
  const bool overlap = c.layer_types[static_cast<size_t>(layer)] == LayerType::csa;
  const int64_t dim = index_keys ? c.index_head_dim : c.head_dim;
  // The position bias, the closing windows' entries and the ring store (one kernel on CUDA).
  be.decode_compress(n, b.positions, b.table_of, rate, overlap, dim, kv, score, cw.position_bias,
                     table(t.ring[static_cast<int>(ring)]), slot_stride_, table(index_keys ? t.index_keys : t.entries),
                     slot_stride_, cw.kv_norm, c.rms_norm_eps, rope_table(c.rope_compress, model_.rope_compress_),
                     b.compress);
}

void Decoder::attention_ops(int layer, int64_t n, const float* h, float* out) {
  const auto& c = model_.config_;
  const auto& aw = model_.weights_->layers[static_cast<size_t>(layer)].attn;
  auto& be = model_.backend_;
  auto& b = *buf_;
  const auto& t = layout_[static_cast<size_t>(layer)];
  const int64_t H = c.num_attention_heads, hd = c.head_dim, W = c.sliding_window;
  const LayerType type = c.layer_types[static_cast<size_t>(layer)];
  const auto rope = type == LayerType::sliding ? rope_table(c.rope_main, model_.rope_main_)
                                               : rope_table(c.rope_compress, model_.rope_compress_);

  // Every projection of h in one launch where the backend can: the low-rank query,
  // the shared K=V head, the compressors' kv and gate, the indexer's head weights.
  {
    std::vector<kernels::Weight> ws{aw.q_a_proj, aw.kv_proj};
    std::vector<float*> ys{b.qr, b.kv};
    if (aw.compressor) {
      ws.insert(ws.end(), {aw.compressor->kv_proj, aw.compressor->gate_proj});
      ys.insert(ys.end(), {b.ckv, b.csc});
    }
    if (aw.indexer) {
      ws.insert(ws.end(), {aw.indexer->compressor.kv_proj, aw.indexer->compressor.gate_proj, aw.indexer->weights_proj});
      ys.insert(ys.end(), {b.ickv, b.icsc, b.iw});
    }
    be.linear_multi(h, n, ws.data(), ys.data(), static_cast<int>(ws.size()));
  }
  mark("projections of h (q_a, kv, compressors, indexer weights)");
  be.rmsnorm(b.qr, aw.q_a_norm, b.qr, n, c.q_lora_rank, c.rms_norm_eps);
  {
    std::vector<kernels::Weight> ws{aw.q_b_proj};
    std::vector<float*> ys{b.q};
    if (aw.indexer) {
      ws.push_back(aw.indexer->q_b_proj);
      ys.push_back(b.iq);
    }
    be.linear_multi(b.qr, n, ws.data(), ys.data(), static_cast<int>(ws.size()));
  }
  mark("q_b projections");
  be.rmsnorm_rope(b.q, nullptr, b.q, n, static_cast<int>(H), hd, c.rms_norm_eps, rope, b.positions);
  be.rmsnorm_rope(b.kv, aw.kv_norm, b.kv, n, 1, hd, c.rms_norm_eps, rope, b.positions);
  mark("q/kv norms and rope");

  const int64_t rate = c.compress_rate(layer);
  if (aw.compressor) compress_ops(layer, n, *aw.compressor, Ring::compressor, b.ckv, b.csc, false);

  const int64_t topk = c.index_topk;
  if (aw.indexer) {
    const auto& iw = *aw.indexer;
    compress_ops(layer, n, iw.compressor, Ring::indexer, b.ickv, b.icsc, true);
    mark("compressors");
    const int64_t nih = c.index_n_heads, ihd = c.index_head_dim;
    be.rope(b.iq, n, static_cast<int>(nih), ihd, rope_table(c.rope_compress, model_.rope_compress_), b.positions,
            false);
    be.decode_rows(n, b.positions, b.table_of, nullptr, slot_stride_, 1, 0, table(t.index_keys), slot_stride_, rate,
                   nullptr, nullptr, 0, b.irows, b.ioffs);
    be.indexer_topk(b.iq, b.iw, n, static_cast<int>(nih), ihd, 1.0f / std::sqrt(static_cast<float>(ihd)),
                    1.0f / std::sqrt(static_cast<float>(nih)), {b.irows, b.ioffs, t.cap}, static_cast<int>(topk),
                    b.picked, b.picked_count);
    mark("indexer (keys, scores, top-k)");
  } else {
    mark("compressors");
  }

  // Keys of each query: its window, then its compressed entries (all, or the indexer's picks). The same
  // call stores the new token's kv in its window row (its old occupant, p - W, is out of every window
  // read now).
  int64_t bound = W;
  if (type == LayerType::hca) {
    be.decode_rows(n, b.positions, b.table_of, table(t.swa), slot_stride_, W, W, table(t.entries), slot_stride_, rate,
                   nullptr, nullptr, 0, b.krows, b.koffs, b.kv, hd);
    bound += t.cap;
  } else if (type == LayerType::csa) {
    be.decode_rows(n, b.positions, b.table_of, table(t.swa), slot_stride_, W, W, table(t.entries), slot_stride_, rate,
                   b.picked, b.picked_count, static_cast<int>(topk), b.krows, b.koffs, b.kv, hd);
    bound += topk;
  } else {
    be.decode_rows(n, b.positions, b.table_of, table(t.swa), slot_stride_, W, W, nullptr, slot_stride_, 1, nullptr,
                   nullptr, 0, b.krows, b.koffs, b.kv, hd);
  }
  mark("window store and key lists");
  // V carried RoPE (K = V): the output turned back by the inverse rope (fused where the backend can), then
  // the grouped projection.
  be.attention_derotated(b.q, n, static_cast<int>(H), hd, {b.krows, b.koffs, bound}, aw.sinks,
                         1.0f / std::sqrt(static_cast<float>(hd)), rope, b.positions, b.o);
  mark("attention and its output rope");
  be.linear_grouped(b.o, n, aw.o_a_proj, static_cast<int>(c.o_groups), b.g);
  be.linear(b.g, n, aw.o_b_proj, out);
  mark("output projections (o_a, o_b)");
}

void Decoder::moe_ops(int layer, int64_t n, const float* h, float* out) {
  const auto& c = model_.config_;
  const auto& mw = model_.weights_->layers[static_cast<size_t>(layer)].moe;
  auto& be = model_.backend_;
  auto& b = *buf_;
  const int64_t D = c.hidden_size, I = c.moe_intermediate_size, E = c.n_routed_experts;
  const int k = static_cast<int>(c.num_experts_per_tok);
  {
    const kernels::Weight ws[3] = {mw.shared_gate, mw.shared_up, mw.router};
    float* const ys[3] = {b.sg, b.su, b.rlogits};
    be.linear_multi(h, n, ws, ys, 3);
  }
  be.swiglu(b.sg, b.su, b.sg, n * I, c.swiglu_limit);
  be.linear(b.sg, n, mw.shared_down, out);
  mark("shared expert and router");
  be.route(b.rlogits, n, static_cast<int>(E), c.scoring_func, mw.score_bias, k, mw.tid2eid, b.ids,
           c.routed_scaling_factor, b.ridx, b.rweight);
  be.moe(h, n, D, b.ridx, b.rweight, k, static_cast<int>(E), mw.gate.data(), mw.up.data(), mw.down.data(),
         c.swiglu_limit, out);
  mark("routed experts");
}

}  // namespace troupe::model
