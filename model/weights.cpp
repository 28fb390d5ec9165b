#include "model/weights.hpp"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <regex>
#include <set>

#include "base/error.hpp"
#include "base/parallel.hpp"

namespace troupe::model {
namespace {

struct Rename {
  std::regex from;
  std::string to;
};

// transformers' conversion_mapping for deepseek_v4, applied in order.
const std::vector<Rename>& renames() {
  static const std::vector<Rename> r = [] {
    std::vector<std::pair<const char*, const char*>> rules = {
        {R"(\.attn\.)", ".self_attn."},
        {R"(\.ffn\.)", ".mlp."},
        {R"(\.indexer\.compressor\.)", ".compressor.indexer."},
        {R"(^embed\.weight$)", "embed_tokens.weight"},
        {R"(^head\.weight$)", "lm_head.weight"},
        {R"(^hc_head_fn$)", "hc_head.hc_fn"},
        {R"(^hc_head_base$)", "hc_head.hc_base"},
        {R"(^hc_head_scale$)", "hc_head.hc_scale"},
        {R"(\.attn_norm\.)", ".input_layernorm."},
        {R"(\.ffn_norm\.)", ".post_attention_layernorm."},
        {R"(\.hc_attn_fn$)", ".attn_hc.fn"},
        {R"(\.hc_attn_base$)", ".attn_hc.base"},
        {R"(\.hc_attn_scale$)", ".attn_hc.scale"},
        {R"(\.hc_ffn_fn$)", ".ffn_hc.fn"},
        {R"(\.hc_ffn_base$)", ".ffn_hc.base"},
        {R"(\.hc_ffn_scale$)", ".ffn_hc.scale"},
        {R"(\.attn_sink$)", ".sinks"},
        {R"(\.indexer\.weights_proj\.)", ".compressor.indexer.scorer.weights_proj."},
        {R"(\.indexer\.wq_b\.)", ".compressor.indexer.q_b_proj."},
        {R"(\.norm\.)", ".kv_norm."},
        {R"(\.ape$)", ".position_bias"},
        {R"(\.wq_a\.)", ".q_a_proj."},
        {R"(\.self_attn\.wq_b\.)", ".self_attn.q_b_proj."},
        {R"(\.wkv\.)", ".kv_proj."},
        {R"(\.wgate\.)", ".gate_proj."},
        {R"(\.wo_a\.)", ".o_a_proj."},
        {R"(\.wo_b\.)", ".o_b_proj."},
        {R"(\.q_norm\.)", ".q_a_norm."},
        {R"(\.gate\.bias$)", ".gate.e_score_correction_bias"},
        {R"(\.shared_experts\.w1\.)", ".shared_experts.gate_proj."},
        {R"(\.shared_experts\.w2\.)", ".shared_experts.down_proj."},
        {R"(\.shared_experts\.w3\.)", ".shared_experts.up_proj."},
    };
    std::vector<Rename> out;
    for (auto& [f, t] : rules) out.push_back({std::regex(f), t});
    return out;
  }();
  return r;
}

}  // namespace

std::string canonical_tensor_name(const std::string& name) {
  std::string n = name;
  if (n.rfind("model.", 0) == 0) n = n.substr(6);
  for (const auto& r : renames()) n = std::regex_replace(n, r.from, r.to);
  return n;
}

// Looks tensors up by canonical name, checks shapes and moves them to the backend.
class WeightLoader {
 public:
  WeightLoader(const ModelConfig& c, const Checkpoint& ck, kernels::Backend& b, kernels::WeightType mt,
               bool keep_quantized, Weights& w)
      : c_(c), ck_(ck), backend_(b), matrix_type_(mt), keep_quantized_(keep_quantized && b.keeps_quantized(false)),
        keep_quantized_experts_(keep_quantized && b.keeps_quantized(true)), w_(w) {
    for (const auto& [name, view] : ck.tensors()) {
      std::string canon = canonical_tensor_name(name);
      if (by_name_.count(canon)) {
        raise(ErrorCode::invalid_file, "{}: tensors '{}' and '{}' are the same weight", ck.dir(), by_name_[canon]->name, name);
      }
      by_name_[canon] = &view;
    }
  }

  const TensorView& find(const std::string& canon, const std::vector<int64_t>& shape) {
    auto it = by_name_.find(canon);
    if (it == by_name_.end()) raise(ErrorCode::invalid_file, "{}: tensor '{}' is missing", ck_.dir(), canon);
    const TensorView& v = *it->second;
    used_.insert(canon);
    if (v.shape != shape) {
      TensorView want;
      want.shape = shape;
      raise(ErrorCode::invalid_file, "{}: tensor '{}' has shape {}, expected {} from config.json", ck_.dir(), v.name,
            v.shape_string(), want.shape_string());
    }
    return v;
  }
  bool has(const std::string& canon) const { return by_name_.count(canon) > 0; }

  // A float tensor converted to fp32 (host), any float dtype.
  std::vector<float> host_f32(const TensorView& v) {
    if (v.dtype != DType::f32 && v.dtype != DType::bf16 && v.dtype != DType::f16) {
      raise(ErrorCode::invalid_file, "{}: tensor '{}' has dtype {}, expected a float type", ck_.dir(), v.name,
            dtype_name(v.dtype));
    }
    std::vector<float> out(static_cast<size_t>(v.numel()));
    convert_to_f32(v.dtype, v.data, out.data(), out.size());
    return out;
  }

  void* upload(const void* host, size_t bytes) {
    void* p = backend_.alloc(bytes);
    w_.allocations_.push_back(p);
    backend_.to_device(p, host, bytes);
    w_.bytes += bytes;
    return p;
  }

  const float* vector(const std::string& canon, std::vector<int64_t> shape) {
    auto f = host_f32(find(canon, shape));
    return static_cast<const float*>(upload(f.data(), f.size() * 4));
  }

  Weight matrix_from_host(const float* data, int64_t rows, int64_t cols) {
    Weight w;
    w.rows = rows;
    w.cols = cols;
    w.type = matrix_type_;
    const size_t n = static_cast<size_t>(rows * cols);
    if (matrix_type_ == kernels::WeightType::f32) {
      w.data = upload(data, n * 4);
    } else {
      std::vector<uint16_t> h(n);
      for (size_t i = 0; i < n; ++i) h[i] = matrix_type_ == kernels::WeightType::bf16 ? f32_to_bf16(data[i]) : f32_to_f16(data[i]);
      w.data = upload(h.data(), n * 2);
    }
    return w;
  }

  Weight matrix(const std::string& canon, int64_t rows, int64_t cols, bool routed_expert = false) {
    if (routed_expert ? keep_quantized_experts_ : keep_quantized_) {
      if (auto q = quantized(canon, rows, cols, 0)) return upload_quantized(*q, rows, cols, 1)[0];
    }
    auto f = matrix_f32(canon, rows, cols, 0);
    return matrix_from_host(f.data(), rows, cols);
  }

  // A quantized checkpoint tensor (FP8 e4m3 or packed FP4 e2m1) with its scales as fp32,
  // checked against the shape config.json gives: [rows, cols] or [stacked, rows, cols].
  struct Quantized {
    const TensorView* codes = nullptr;
    bool fp4 = false;
    std::vector<float> scales;  // [count, sr, sc]
    int64_t sr = 0, sc = 0, bm = 0, bn = 0;
  };

  // Null when the tensor is not stored quantized (a float tensor, or missing).
  std::optional<Quantized> quantized(const std::string& canon, int64_t rows, int64_t cols, int64_t stacked) {
    auto it = by_name_.find(canon);
    if (it == by_name_.end() || !is_quantized(it->second->dtype)) return std::nullopt;
    const int64_t count = stacked > 0 ? stacked : 1;
    const TensorView& w = *it->second;
    used_.insert(canon);
    Quantized q;
    q.codes = &w;
    q.fp4 = w.dtype != DType::f8_e4m3;  // i8 / u8: two e2m1 codes a byte
    std::vector<int64_t> stored = {rows, cols};
    if (stacked > 0) stored.insert(stored.begin(), stacked);
    if (q.fp4) {
      if (cols % 2 != 0) raise(ErrorCode::invalid_file, "{}: tensor '{}' is packed FP4 but {} inputs are odd", ck_.dir(), w.name, cols);
      stored.back() = cols / 2;
    }
    if (w.shape != stored) {
      TensorView want;
      want.shape = stored;
      raise(ErrorCode::invalid_file, "{}: tensor '{}' ({}) has shape {}, expected {} from config.json", ck_.dir(), w.name,
            dtype_name(w.dtype), w.shape_string(), want.shape_string());
    }
    const TensorView& s = scale_of(canon, w);
    const int64_t lead = stacked > 0 ? 1 : 0;
    if (s.shape.size() != static_cast<size_t>(2 + lead) || (lead && s.shape[0] != count)) {
      raise(ErrorCode::invalid_file, "{}: scale tensor '{}' has shape {}, expected {}[scale rows, scale columns]", ck_.dir(),
            s.name, s.shape_string(), lead ? std::to_string(count) + " x " : "");
    }
    q.sr = s.shape[static_cast<size_t>(lead)];
    q.sc = s.shape[static_cast<size_t>(lead + 1)];
    const Quantization& cq = c_.quantization;
    if (!q.fp4 && cq.block_rows > 0) {  // DeepSeek's blocks: the last ones may be partial
      q.bm = cq.block_rows;
      q.bn = cq.block_cols;
      if (q.sr != (rows + q.bm - 1) / q.bm || q.sc != (cols + q.bn - 1) / q.bn) {
        raise(ErrorCode::invalid_file, "{}: scale tensor '{}' has a {} x {} grid; blocks of {} x {} over [{}, {}] need {} x {}",
              ck_.dir(), s.name, q.sr, q.sc, q.bm, q.bn, rows, cols, (rows + q.bm - 1) / q.bm, (cols + q.bn - 1) / q.bn);
      }
    } else {
      if (q.sr <= 0 || q.sc <= 0 || rows % q.sr != 0 || cols % q.sc != 0) {
        raise(ErrorCode::invalid_file, "{}: scale tensor '{}' has a {} x {} grid, which does not divide [{}, {}]", ck_.dir(),
              s.name, q.sr, q.sc, rows, cols);
      }
      q.bm = rows / q.sr;
      q.bn = cols / q.sc;
    }
    q.scales.resize(static_cast<size_t>(s.numel()));
    if (s.dtype == DType::u8) {  // e8m0 exponents stored as bytes
      convert_to_f32(DType::f8_e8m0, s.data, q.scales.data(), q.scales.size());
    } else if (s.dtype == DType::f32 || s.dtype == DType::bf16 || s.dtype == DType::f16 || s.dtype == DType::f8_e8m0) {
      convert_to_f32(s.dtype, s.data, q.scales.data(), q.scales.size());
    } else {
      raise(ErrorCode::invalid_file, "{}: scale tensor '{}' has dtype {}, expected F32, BF16, F16, F8_E8M0 or U8", ck_.dir(),
            s.name, dtype_name(s.dtype));
    }
    return q;
  }

  // A matrix [rows, cols] (stacked = 0) or a stack of them [stacked, rows, cols] as fp32: a float
  // tensor converted, or an FP8 / packed FP4 one dequantized with its scale tensor.
  std::vector<float> matrix_f32(const std::string& canon, int64_t rows, int64_t cols, int64_t stacked) {
    auto q = quantized(canon, rows, cols, stacked);
    if (!q) {
      std::vector<int64_t> shape = {rows, cols};
      if (stacked > 0) shape.insert(shape.begin(), stacked);
      return host_f32(find(canon, shape));
    }
    const int64_t count = stacked > 0 ? stacked : 1;
    std::vector<float> out(static_cast<size_t>(count * rows * cols));
    const auto* codes = static_cast<const uint8_t*>(q->codes->data);
    // Rows [first, last) of the whole stack, a matrix's rows at a time; a real checkpoint's matrices
    // (gigabytes) on every core.
    auto dequantize = [&](int64_t first, int64_t last) {
      for (int64_t row = first; row < last;) {
        const int64_t e = row / rows, end = std::min(last, (e + 1) * rows);
        kernels::dequantize_rows_host(quantized_weight(*q, rows, cols, e, codes, q->scales.data()), row - e * rows,
                                      end - e * rows, out.data() + row * cols);
        row = end;
      }
    };
    const int64_t all_rows = count * rows;
    parallel_ranges(all_rows, std::clamp<int64_t>(all_rows * cols / (int64_t{1} << 22), 1, hardware_threads()),
                    dequantize);
    return out;
  }

  // Matrix e of a quantized stack (0 for an unstacked tensor) over `codes` and `scales`, the whole
  // stack's in host or backend memory.
  static Weight quantized_weight(const Quantized& q, int64_t rows, int64_t cols, int64_t e, const uint8_t* codes,
                                 const float* scales) {
    Weight w;
    w.type = q.fp4 ? kernels::WeightType::e2m1 : kernels::WeightType::e4m3;
    w.rows = rows;
    w.cols = cols;
    w.data = codes + e * rows * (q.fp4 ? cols / 2 : cols);
    w.scale = scales + e * q.sr * q.sc;
    w.scale_stride = q.sc;
    w.block_rows = static_cast<int32_t>(q.bm);
    w.block_cols = static_cast<int32_t>(q.bn);
    return w;
  }

  // The codes and scales of a quantized tensor in backend memory, as the matrices of its
  // stack (one for an unstacked tensor): what backends that take quantized weights use.
  std::vector<Weight> upload_quantized(const Quantized& q, int64_t rows, int64_t cols, int64_t count) {
    const int64_t row_bytes = q.fp4 ? cols / 2 : cols;
    const auto* codes = static_cast<const uint8_t*>(upload(q.codes->data, static_cast<size_t>(count * rows * row_bytes)));
    const auto* scales = static_cast<const float*>(upload(q.scales.data(), q.scales.size() * 4));
    std::vector<Weight> out;
    for (int64_t e = 0; e < count; ++e) out.push_back(quantized_weight(q, rows, cols, e, codes, scales));
    return out;
  }

  static bool is_quantized(DType t) { return t == DType::f8_e4m3 || t == DType::i8 || t == DType::u8; }

  // The scale tensor beside a quantized weight: `X.weight` -> `X.scale` (DeepSeek's name) or
  // `X.weight_scale_inv` (transformers'); a stacked `experts.gate_up_proj` -> `..._scale_inv`.
  const TensorView& scale_of(const std::string& canon, const TensorView& w) {
    if (!c_.quantization.fp8) {
      raise(ErrorCode::invalid_file, "{}: tensor '{}' is {} but config.json has no quantization_config", ck_.dir(), w.name,
            dtype_name(w.dtype));
    }
    std::vector<std::string> names;
    const std::string suffix = ".weight";
    if (canon.size() > suffix.size() && canon.compare(canon.size() - suffix.size(), suffix.size(), suffix) == 0) {
      const std::string base = canon.substr(0, canon.size() - suffix.size());
      names = {base + ".scale", base + ".weight_scale_inv"};
    } else {
      names = {canon + "_scale_inv", canon + ".scale"};
    }
    for (const auto& n : names) {
      auto it = by_name_.find(n);
      if (it != by_name_.end()) {
        used_.insert(n);
        return *it->second;
      }
    }
    raise(ErrorCode::invalid_file, "{}: tensor '{}' is {} but has no scale tensor ('{}')", ck_.dir(), w.name, dtype_name(w.dtype),
          names[0]);
  }

  HcWeights hc(const std::string& prefix, int64_t n_mix, int n_scale, bool head) {
    const int64_t width = c_.hc_mult * c_.hidden_size;
    HcWeights h;
    h.fn = matrix(prefix + (head ? "hc_fn" : "fn"), n_mix, width);
    h.base = vector(prefix + (head ? "hc_base" : "base"), {n_mix});
    h.scale = vector(prefix + (head ? "hc_scale" : "scale"), {n_scale});
    return h;
  }

  CompressorWeights compressor(const std::string& prefix, int64_t dim, bool overlap, int64_t rate) {
    CompressorWeights cw;
    cw.width = overlap ? 2 * dim : dim;
    cw.kv_proj = matrix(prefix + "kv_proj.weight", cw.width, c_.hidden_size);
    cw.gate_proj = matrix(prefix + "gate_proj.weight", cw.width, c_.hidden_size);
    cw.position_bias = vector(prefix + "position_bias", {rate, cw.width});
    cw.kv_norm = vector(prefix + "kv_norm.weight", {dim});
    return cw;
  }

  void load_experts(const std::string& p, MoeWeights& m) {
    const int64_t E = c_.n_routed_experts, I = c_.moe_intermediate_size, D = c_.hidden_size;
    if (has(p + "experts.gate_up_proj") && keep_quantized_experts_) {
      auto gu = quantized(p + "experts.gate_up_proj", 2 * I, D, E);
      auto dn = quantized(p + "experts.down_proj", D, I, E);
      if (gu && dn) {
        const auto gate_up = upload_quantized(*gu, 2 * I, D, E);
        m.down = upload_quantized(*dn, D, I, E);
        for (const Weight& w : gate_up) {
          m.gate.push_back(kernels::weight_rows(w, 0, I));
          m.up.push_back(kernels::weight_rows(w, I, I));
        }
        return;
      }
    }
    if (has(p + "experts.gate_up_proj")) {
      auto gu = matrix_f32(p + "experts.gate_up_proj", 2 * I, D, E);
      auto dn = matrix_f32(p + "experts.down_proj", D, I, E);
      for (int64_t e = 0; e < E; ++e) {
        m.gate.push_back(matrix_from_host(gu.data() + e * 2 * I * D, I, D));
        m.up.push_back(matrix_from_host(gu.data() + e * 2 * I * D + I * D, I, D));
        m.down.push_back(matrix_from_host(dn.data() + e * D * I, D, I));
      }
      return;
    }
    for (int64_t e = 0; e < E; ++e) {
      const std::string q = p + "experts." + std::to_string(e) + ".";
      m.gate.push_back(matrix(q + "w1.weight", I, D, true));
      m.up.push_back(matrix(q + "w3.weight", I, D, true));
      m.down.push_back(matrix(q + "w2.weight", D, I, true));
    }
  }

  void load_all() {
    const int64_t D = c_.hidden_size, V = c_.vocab_size, H = c_.num_attention_heads, hd = c_.head_dim;
    const int hcm = c_.hc_mult;
    w_.embed = matrix("embed_tokens.weight", V, D);
    if (has("lm_head.weight") || !c_.tie_word_embeddings) {
      w_.lm_head = matrix("lm_head.weight", V, D);
    } else {
      w_.lm_head = w_.embed;
    }
    w_.final_norm = vector("norm.weight", {D});
    w_.hc_head = hc("hc_head.", hcm, 1, true);
    for (int l = 0; l < c_.num_hidden_layers; ++l) {
      const std::string p = "layers." + std::to_string(l) + ".";
      LayerWeights lw;
      const int64_t n_mix = (2 + hcm) * hcm;
      lw.attn_hc = hc(p + "attn_hc.", n_mix, 3, false);
      lw.ffn_hc = hc(p + "ffn_hc.", n_mix, 3, false);
      lw.input_norm = vector(p + "input_layernorm.weight", {D});
      lw.post_attention_norm = vector(p + "post_attention_layernorm.weight", {D});
      const std::string a = p + "self_attn.";
      auto& at = lw.attn;
      at.q_a_proj = matrix(a + "q_a_proj.weight", c_.q_lora_rank, D);
      at.q_a_norm = vector(a + "q_a_norm.weight", {c_.q_lora_rank});
      at.q_b_proj = matrix(a + "q_b_proj.weight", H * hd, c_.q_lora_rank);
      at.kv_proj = matrix(a + "kv_proj.weight", hd, D);
      at.kv_norm = vector(a + "kv_norm.weight", {hd});
      at.o_a_proj = matrix(a + "o_a_proj.weight", c_.o_groups * c_.o_lora_rank, H * hd / c_.o_groups);
      at.o_b_proj = matrix(a + "o_b_proj.weight", D, c_.o_groups * c_.o_lora_rank);
      at.sinks = vector(a + "sinks", {H});
      const LayerType lt = c_.layer_types[static_cast<size_t>(l)];
      if (lt != LayerType::sliding) {
        const int64_t rate = c_.compress_rate(l);
        at.compressor = compressor(a + "compressor.", hd, lt == LayerType::csa, rate);
        if (lt == LayerType::csa) {
          IndexerWeights iw;
          const std::string ip = a + "compressor.indexer.";
          iw.compressor = compressor(ip, c_.index_head_dim, true, rate);
          iw.q_b_proj = matrix(ip + "q_b_proj.weight", c_.index_n_heads * c_.index_head_dim, c_.q_lora_rank);
          iw.weights_proj = matrix(ip + "scorer.weights_proj.weight", c_.index_n_heads, D);
          at.indexer = std::move(iw);
        }
      }
      const std::string m = p + "mlp.";
      auto& mo = lw.moe;
      mo.router = matrix(m + "gate.weight", c_.n_routed_experts, D);
      if (c_.mlp_layer_types[static_cast<size_t>(l)] == MlpType::hash_moe) {
        const TensorView& t = find(m + "gate.tid2eid", {V, c_.num_experts_per_tok});
        std::vector<int64_t> table(static_cast<size_t>(t.numel()));
        if (t.dtype == DType::i64) {
          std::memcpy(table.data(), t.data, table.size() * 8);
        } else if (t.dtype == DType::i32) {
          for (size_t i = 0; i < table.size(); ++i) table[i] = static_cast<const int32_t*>(t.data)[i];
        } else {
          raise(ErrorCode::invalid_file, "{}: tensor '{}' must be an integer tensor", ck_.dir(), t.name);
        }
        for (int64_t e : table) {
          if (e < 0 || e >= c_.n_routed_experts) {
            raise(ErrorCode::invalid_file, "{}: tensor '{}' names expert {} of {}", ck_.dir(), t.name, e, c_.n_routed_experts);
          }
        }
        mo.tid2eid = static_cast<const int64_t*>(upload(table.data(), table.size() * 8));
      } else {
        mo.score_bias = vector(m + "gate.e_score_correction_bias", {c_.n_routed_experts});
      }
      load_experts(m, mo);
      const int64_t I = c_.moe_intermediate_size;
      mo.shared_gate = matrix(m + "shared_experts.gate_proj.weight", I, D);
      mo.shared_up = matrix(m + "shared_experts.up_proj.weight", I, D);
      mo.shared_down = matrix(m + "shared_experts.down_proj.weight", D, I);
      w_.layers.push_back(std::move(lw));
    }
    for (const auto& [canon, view] : by_name_) {
      if (used_.count(canon)) continue;
      if (canon.rfind("mtp.", 0) == 0) continue;  // multi-token-prediction layers: not used for serving
      spdlog::warn("{}: tensor '{}' is not used by the model", ck_.dir(), view->name);
    }
  }

 private:
  const ModelConfig& c_;
  const Checkpoint& ck_;
  kernels::Backend& backend_;
  kernels::WeightType matrix_type_;
  bool keep_quantized_;          // matrices other than the routed experts'
  bool keep_quantized_experts_;
  Weights& w_;
  std::map<std::string, const TensorView*> by_name_;
  std::set<std::string> used_;
};

std::unique_ptr<Weights> Weights::load(const ModelConfig& config, const Checkpoint& ckpt, kernels::Backend& backend,
                                       kernels::WeightType matrix_type, bool keep_quantized) {
  std::unique_ptr<Weights> w(new Weights(backend));
  WeightLoader loader(config, ckpt, backend, matrix_type, keep_quantized, *w);
  loader.load_all();
  return w;
}

Weights::~Weights() {
  for (void* p : allocations_) backend_.free(p);
}

}  // namespace troupe::model
