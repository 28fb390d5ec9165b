#include "model/weights.hpp"

#include <spdlog/spdlog.h>

#include <cstring>
#include <map>
#include <regex>
#include <set>

#include "base/error.hpp"

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
  WeightLoader(const ModelConfig& c, const Checkpoint& ck, kernels::Backend& b, kernels::WeightType mt, Weights& w)
      : c_(c), ck_(ck), backend_(b), matrix_type_(mt), w_(w) {
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

  Weight matrix(const std::string& canon, int64_t rows, int64_t cols) {
    auto f = host_f32(find(canon, {rows, cols}));
    return matrix_from_host(f.data(), rows, cols);
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
    if (has(p + "experts.gate_up_proj")) {
      auto gu = host_f32(find(p + "experts.gate_up_proj", {E, 2 * I, D}));
      auto dn = host_f32(find(p + "experts.down_proj", {E, D, I}));
      for (int64_t e = 0; e < E; ++e) {
        m.gate.push_back(matrix_from_host(gu.data() + e * 2 * I * D, I, D));
        m.up.push_back(matrix_from_host(gu.data() + e * 2 * I * D + I * D, I, D));
        m.down.push_back(matrix_from_host(dn.data() + e * D * I, D, I));
      }
      return;
    }
    for (int64_t e = 0; e < E; ++e) {
      const std::string q = p + "experts." + std::to_string(e) + ".";
      m.gate.push_back(matrix(q + "w1.weight", I, D));
      m.up.push_back(matrix(q + "w3.weight", I, D));
      m.down.push_back(matrix(q + "w2.weight", D, I));
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
  Weights& w_;
  std::map<std::string, const TensorView*> by_name_;
  std::set<std::string> used_;
};

std::unique_ptr<Weights> Weights::load(const ModelConfig& config, const Checkpoint& ckpt, kernels::Backend& backend,
                                       kernels::WeightType matrix_type) {
  std::unique_ptr<Weights> w(new Weights(backend));
  WeightLoader loader(config, ckpt, backend, matrix_type, *w);
  loader.load_all();
  return w;
}

Weights::~Weights() {
  for (void* p : allocations_) backend_.free(p);
}

}  // namespace troupe::model
