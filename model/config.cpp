#include "model/config.hpp"

#include <cmath>
#include <nlohmann/json.hpp>
#include <set>

#include "base/error.hpp"
#include "base/mapped_file.hpp"

namespace troupe::model {
namespace {

using json = nlohmann::json;

// Fields transformers writes that do not change the forward math.
const std::set<std::string> kIgnoredFields = {
    "architectures", "model_type", "transformers_version", "dtype", "torch_dtype", "_name_or_path",
    "_attn_implementation", "_attn_implementation_autoset", "use_cache", "initializer_range",
    "attention_dropout", "output_router_logits", "router_aux_loss_coef", "router_jitter_noise",
    "num_nextn_predict_layers", "pad_token_id", "sep_token_id", "decoder_start_token_id", "return_dict",
    "output_hidden_states", "output_attentions", "torchscript", "use_bfloat16", "tf_legacy_loss",
    "pruned_heads", "chunk_size_feed_forward", "is_encoder_decoder", "is_decoder",
    "cross_attention_hidden_size", "add_cross_attention", "tie_encoder_decoder", "finetuning_task",
    "id2label", "label2id", "num_labels", "task_specific_params", "problem_type", "tokenizer_class",
    "prefix", "max_length", "min_length", "do_sample", "early_stopping", "num_beams", "num_beam_groups",
    "diversity_penalty", "temperature", "top_k", "top_p", "typical_p", "repetition_penalty",
    "length_penalty", "no_repeat_ngram_size", "encoder_no_repeat_ngram_size", "bad_words_ids",
    "num_return_sequences", "output_scores", "return_dict_in_generate", "forced_bos_token_id",
    "forced_eos_token_id", "remove_invalid_values", "exponential_decay_length_penalty",
    "suppress_tokens", "begin_suppress_tokens", "auto_map", "generation_config",
    // Ignored by transformers' DeepSeek-V4 forward as well:
    "norm_topk_prob",   // the top-k router always renormalises
    "n_shared_experts", // the shared expert's width is moe_intermediate_size
};

[[noreturn]] void field_error(const std::string& source, const std::string& field, const std::string& what) {
  raise(ErrorCode::invalid_file, "{}: field '{}' {}", source, field, what);
}

class Reader {
 public:
  Reader(const json& j, std::string source) : j_(j), source_(std::move(source)) {}

  bool has(const std::string& k) const { return j_.contains(k) && !j_.at(k).is_null(); }

  int64_t integer(const std::string& k) const {
    if (!has(k)) field_error(source_, k, "is missing");
    const auto& v = j_.at(k);
    if (!v.is_number_integer()) field_error(source_, k, "must be an integer");
    return v.get<int64_t>();
  }
  int64_t integer(const std::string& k, int64_t fallback) const { return has(k) ? integer(k) : fallback; }
  int64_t positive(const std::string& k) const {
    int64_t v = integer(k);
    if (v <= 0) field_error(source_, k, "must be positive, got " + std::to_string(v));
    return v;
  }
  double number(const std::string& k) const {
    if (!has(k)) field_error(source_, k, "is missing");
    const auto& v = j_.at(k);
    if (!v.is_number()) field_error(source_, k, "must be a number");
    return v.get<double>();
  }
  double number(const std::string& k, double fallback) const { return has(k) ? number(k) : fallback; }
  std::string string(const std::string& k, const std::string& fallback) const {
    if (!has(k)) return fallback;
    if (!j_.at(k).is_string()) field_error(source_, k, "must be a string");
    return j_.at(k).get<std::string>();
  }
  bool boolean(const std::string& k, bool fallback) const {
    if (!has(k)) return fallback;
    if (!j_.at(k).is_boolean()) field_error(source_, k, "must be true or false");
    return j_.at(k).get<bool>();
  }
  const json& at(const std::string& k) const { return j_.at(k); }
  const std::string& source() const { return source_; }

 private:
  const json& j_;
  std::string source_;
};

RopeConfig parse_rope(const json& r, const std::string& source, const std::string& where) {
  if (!r.is_object()) field_error(source, where, "must be an object");
  static const std::set<std::string> known = {"rope_type", "type", "rope_theta", "partial_rotary_factor",
                                              "factor", "original_max_position_embeddings", "beta_fast",
                                              "beta_slow", "attention_factor", "mscale", "mscale_all_dim",
                                              "truncate"};
  for (auto it = r.begin(); it != r.end(); ++it) {
    if (!known.count(it.key())) field_error(source, where + "." + it.key(), "is unknown to troupe");
  }
  Reader rd(r, source);
  RopeConfig rc;
  rc.type = rd.string("rope_type", rd.string("type", "default"));
  if (!rd.has("rope_theta")) field_error(source, where + ".rope_theta", "is missing");
  rc.theta = rd.number("rope_theta");
  // transformers reads partial_rotary_factor per rope family with a default of 1.0.
  rc.partial_rotary_factor = rd.number("partial_rotary_factor", 1.0);
  if (rc.type == "default") {
    return rc;
  }
  if (rc.type == "linear") {
    rc.factor = rd.number("factor");
    return rc;
  }
  if (rc.type != "yarn") {
    field_error(source, where + ".rope_type", "is '" + rc.type + "'; troupe supports default, linear and yarn");
  }
  if (!rd.has("original_max_position_embeddings")) {
    field_error(source, where + ".original_max_position_embeddings", "is missing (required for yarn)");
  }
  rc.original_max_position_embeddings = rd.integer("original_max_position_embeddings");
  rc.factor = rd.has("factor") ? rd.number("factor") : -1.0;  // -1: derive from max_position_embeddings
  // transformers: `beta_fast or 32`, `beta_slow or 1` (a zero means the default).
  rc.beta_fast = rd.number("beta_fast", 0.0);
  if (rc.beta_fast == 0.0) rc.beta_fast = 32.0;
  rc.beta_slow = rd.number("beta_slow", 0.0);
  if (rc.beta_slow == 0.0) rc.beta_slow = 1.0;
  rc.mscale = rd.number("mscale", 0.0);
  rc.mscale_all_dim = rd.number("mscale_all_dim", 0.0);
  rc.attention_factor = rd.has("attention_factor") ? rd.number("attention_factor") : NAN;
  return rc;
}

std::vector<float> default_inv_freq(double theta, int64_t dim) {
  std::vector<float> inv(static_cast<size_t>(dim / 2));
  for (int64_t i = 0; i < dim / 2; ++i) {
    // torch: 1.0 / (base ** (arange(0, dim, 2, float32) / dim)) in fp32
    const float exponent = static_cast<float>(2 * i) / static_cast<float>(dim);
    inv[static_cast<size_t>(i)] = 1.0f / std::pow(static_cast<float>(theta), exponent);
  }
  return inv;
}

}  // namespace

const char* to_string(LayerType t) {
  switch (t) {
    case LayerType::sliding: return "sliding_attention";
    case LayerType::csa: return "compressed_sparse_attention";
    case LayerType::hca: return "heavily_compressed_attention";
  }
  return "?";
}

int64_t ModelConfig::compress_rate(int layer) const {
  switch (layer_types[static_cast<size_t>(layer)]) {
    case LayerType::sliding: return 0;
    case LayerType::csa: return csa_rate;
    case LayerType::hca: return hca_rate;
  }
  return 0;
}

const RopeConfig& ModelConfig::rope_for(int layer) const {
  return layer_types[static_cast<size_t>(layer)] == LayerType::sliding ? rope_main : rope_compress;
}

void ModelConfig::finish() {
  auto need = [&](bool ok, const char* field, const std::string& what) {
    if (!ok) field_error(source, field, what);
  };
  need(num_attention_heads % o_groups == 0, "o_groups", "must divide num_attention_heads");
  need(static_cast<int64_t>(layer_types.size()) == num_hidden_layers, "layer_types",
       "must have num_hidden_layers entries");
  need(static_cast<int64_t>(mlp_layer_types.size()) == num_hidden_layers, "mlp_layer_types",
       "must have num_hidden_layers entries");
  need(num_experts_per_tok <= n_routed_experts, "num_experts_per_tok", "must not exceed n_routed_experts");
  need(hc_mult >= 1, "hc_mult", "must be at least 1");
  need(hc_sinkhorn_iters >= 1, "hc_sinkhorn_iters", "must be at least 1");
  need(csa_rate >= 1 && hca_rate >= 1, "compress_rates", "must be positive");
  for (RopeConfig* rc : {&rope_main, &rope_compress}) {
    const char* field = rc == &rope_main ? "rope_parameters.main" : "rope_parameters.compress";
    rc->rope_dim = static_cast<int64_t>(static_cast<double>(head_dim) * rc->partial_rotary_factor);
    need(rc->rope_dim > 0 && rc->rope_dim % 2 == 0 && rc->rope_dim <= head_dim, field,
         "gives a rope dimension that is not an even number in (0, head_dim]");
    const int64_t dim = rc->rope_dim;
    if (rc->type == "default") {
      rc->inv_freq = default_inv_freq(rc->theta, dim);
      rc->attention_factor = 1.0;
    } else if (rc->type == "linear") {
      rc->inv_freq = default_inv_freq(rc->theta, dim);
      for (float& f : rc->inv_freq) f = static_cast<float>(f / rc->factor);
      rc->attention_factor = 1.0;
    } else {  // yarn, as transformers' _compute_yarn_parameters
      double factor = rc->factor;
      if (factor < 0) factor = static_cast<double>(max_position_embeddings) /
                               static_cast<double>(rc->original_max_position_embeddings);
      rc->factor = factor;
      auto get_mscale = [](double scale, double m) { return scale <= 1 ? 1.0 : 0.1 * m * std::log(scale) + 1.0; };
      if (std::isnan(rc->attention_factor)) {
        rc->attention_factor = rc->mscale != 0.0 && rc->mscale_all_dim != 0.0
                                   ? get_mscale(factor, rc->mscale) / get_mscale(factor, rc->mscale_all_dim)
                                   : get_mscale(factor, 1.0);
      }
      const double base = rc->theta;
      const auto orig = static_cast<double>(rc->original_max_position_embeddings);
      auto correction_dim = [&](double rotations) {
        return (static_cast<double>(dim) * std::log(orig / (rotations * 2 * M_PI))) / (2 * std::log(base));
      };
      // transformers 5.17 reads `truncate` from the top-level rope_parameters of a
      // DeepSeek-V4 config, where it never is: the correction range is always truncated.
      double low = std::floor(correction_dim(rc->beta_fast));
      double high = std::ceil(correction_dim(rc->beta_slow));
      low = std::max(low, 0.0);
      high = std::min(high, static_cast<double>(dim - 1));
      if (low == high) high += 0.001;
      rc->inv_freq.resize(static_cast<size_t>(dim / 2));
      for (int64_t i = 0; i < dim / 2; ++i) {
        const float pos_freq = std::pow(static_cast<float>(base), static_cast<float>(2 * i) / static_cast<float>(dim));
        const float extrapolation = 1.0f / pos_freq;
        const float interpolation = 1.0f / (static_cast<float>(factor) * pos_freq);
        float ramp = (static_cast<float>(i) - static_cast<float>(low)) / static_cast<float>(high - low);
        ramp = std::min(std::max(ramp, 0.0f), 1.0f);
        const float extrapolation_factor = 1.0f - ramp;
        rc->inv_freq[static_cast<size_t>(i)] =
            interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor;
      }
    }
  }
  need(index_head_dim == 0 || rope_compress.rope_dim <= index_head_dim, "index_head_dim",
       "is smaller than the compress rope dimension");
}

namespace {

// quantization_config: quant_method "fp8" (e4m3 weights with block scales, dynamic activation
// scheme). Its other keys (modules_to_not_convert, scale_fmt, ...) need nothing: a matrix is
// dequantized when the checkpoint gives it in FP8 or FP4 with a scale tensor beside it.
Quantization parse_quantization(const json& q, const std::string& source) {
  const std::string field = "quantization_config";
  if (!q.is_object()) field_error(source, field, "must be an object");
  Quantization out;
  const std::string method = q.contains("quant_method") && q.at("quant_method").is_string()
                                 ? q.at("quant_method").get<std::string>()
                                 : std::string();
  if (method != "fp8") {
    field_error(source, field + ".quant_method",
                "is '" + method + "'; troupe loads quant_method 'fp8' (e4m3 block-scaled weights, FP4 experts)");
  }
  out.fp8 = true;
  if (q.contains("fmt") && !q.at("fmt").is_null() && q.at("fmt") != "e4m3") {
    field_error(source, field + ".fmt", "is " + q.at("fmt").dump() + ", expected \"e4m3\"");
  }
  if (q.contains("activation_scheme") && !q.at("activation_scheme").is_null() &&
      q.at("activation_scheme") != "dynamic") {
    field_error(source, field + ".activation_scheme",
                "is " + q.at("activation_scheme").dump() + "; troupe loads the dynamic scheme (no activation scales)");
  }
  if (q.contains("weight_block_size") && !q.at("weight_block_size").is_null()) {
    const json& b = q.at("weight_block_size");
    if (!b.is_array() || b.size() != 2 || !b[0].is_number_integer() || !b[1].is_number_integer() ||
        b[0].get<int64_t>() <= 0 || b[1].get<int64_t>() <= 0) {
      field_error(source, field + ".weight_block_size", "must be two positive integers, got " + b.dump());
    }
    out.block_rows = b[0].get<int64_t>();
    out.block_cols = b[1].get<int64_t>();
  }
  return out;
}

}  // namespace

ModelConfig parse_config(const std::string& text, const std::string& source) {
  json j;
  try {
    j = json::parse(text);
  } catch (const json::parse_error& e) {
    raise(ErrorCode::invalid_file, "{}: not valid JSON: {}", source, e.what());
  }
  if (!j.is_object()) raise(ErrorCode::invalid_file, "{}: expected a JSON object", source);

  static const std::set<std::string> math_fields = {
      "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
      "head_dim", "q_lora_rank", "o_groups", "o_lora_rank", "sliding_window", "max_position_embeddings",
      "rms_norm_eps", "layer_types", "mlp_layer_types", "compress_rates", "index_n_heads", "index_head_dim",
      "index_topk", "hc_mult", "hc_sinkhorn_iters", "hc_eps", "n_routed_experts", "num_experts_per_tok",
      "moe_intermediate_size", "scoring_func", "routed_scaling_factor", "swiglu_limit", "tie_word_embeddings",
      "bos_token_id", "eos_token_id", "rope_theta", "compress_rope_theta", "partial_rotary_factor",
      "rope_parameters", "rope_scaling", "hidden_act", "attention_bias", "mlp_bias",
      // legacy spellings transformers folds in
      "compress_ratios", "compress_rate_csa", "compress_rate_hca", "num_hash_layers", "qk_rope_head_dim",
      "quantization_config", "expert_dtype"};
  for (auto it = j.begin(); it != j.end(); ++it) {
    if (!math_fields.count(it.key()) && !kIgnoredFields.count(it.key())) {
      field_error(source, it.key(), "is unknown to troupe (it may change the model's math)");
    }
  }

  Reader rd(j, source);
  ModelConfig c;
  c.source = source;
  if (rd.string("model_type", "deepseek_v4") != "deepseek_v4") {
    field_error(source, "model_type", "is '" + rd.string("model_type", "") + "', expected 'deepseek_v4'");
  }
  if (rd.has("quantization_config")) c.quantization = parse_quantization(rd.at("quantization_config"), source);
  {
    const std::string ed = rd.string("expert_dtype", "fp8");
    if (ed != "fp8" && ed != "fp4") field_error(source, "expert_dtype", "is '" + ed + "', expected fp8 or fp4");
    if (ed == "fp4" && !c.quantization.fp8) field_error(source, "expert_dtype", "is fp4 without a quantization_config");
    c.quantization.expert_dtype = ed;
  }
  c.vocab_size = rd.positive("vocab_size");
  c.hidden_size = rd.positive("hidden_size");
  c.num_hidden_layers = rd.positive("num_hidden_layers");
  c.num_attention_heads = rd.positive("num_attention_heads");
  if (rd.integer("num_key_value_heads", 1) != 1) field_error(source, "num_key_value_heads", "must be 1 (one shared K=V head)");
  c.head_dim = rd.positive("head_dim");
  c.q_lora_rank = rd.positive("q_lora_rank");
  c.o_groups = rd.positive("o_groups");
  c.o_lora_rank = rd.positive("o_lora_rank");
  c.sliding_window = rd.positive("sliding_window");
  c.max_position_embeddings = rd.integer("max_position_embeddings", 1048576);
  c.rms_norm_eps = static_cast<float>(rd.number("rms_norm_eps", 1e-6));
  if (rd.string("hidden_act", "silu") != "silu") field_error(source, "hidden_act", "must be 'silu'");
  if (rd.boolean("attention_bias", false)) field_error(source, "attention_bias", "must be false");
  if (rd.boolean("mlp_bias", false)) field_error(source, "mlp_bias", "must be false");

  // compress_rates: dict, with legacy scalar overrides.
  if (rd.has("compress_rates")) {
    const auto& cr = rd.at("compress_rates");
    if (!cr.is_object()) field_error(source, "compress_rates", "must be an object");
    for (auto it = cr.begin(); it != cr.end(); ++it) {
      if (!it.value().is_number_integer() || it.value().get<int64_t>() <= 0) {
        field_error(source, "compress_rates." + it.key(), "must be a positive integer");
      }
      if (it.key() == "compressed_sparse_attention") c.csa_rate = it.value().get<int64_t>();
      else if (it.key() == "heavily_compressed_attention") c.hca_rate = it.value().get<int64_t>();
      else field_error(source, "compress_rates." + it.key(), "is not a compressed layer type");
    }
  }
  if (rd.has("compress_rate_csa")) c.csa_rate = rd.positive("compress_rate_csa");
  if (rd.has("compress_rate_hca")) c.hca_rate = rd.positive("compress_rate_hca");

  const int64_t n = c.num_hidden_layers;
  if (rd.has("layer_types")) {
    const auto& lt = rd.at("layer_types");
    if (!lt.is_array()) field_error(source, "layer_types", "must be a list");
    for (size_t i = 0; i < lt.size() && static_cast<int64_t>(i) < n; ++i) {
      std::string t = lt[i].is_string() ? lt[i].get<std::string>() : "";
      if (t == "sliding_attention") c.layer_types.push_back(LayerType::sliding);
      else if (t == "compressed_sparse_attention") c.layer_types.push_back(LayerType::csa);
      else if (t == "heavily_compressed_attention") c.layer_types.push_back(LayerType::hca);
      else field_error(source, "layer_types[" + std::to_string(i) + "]", "is '" + t + "', not a DeepSeek-V4 layer type");
    }
    if (static_cast<int64_t>(lt.size()) < n) {
      field_error(source, "layer_types", "has fewer entries than num_hidden_layers");
    }
  } else if (rd.has("compress_ratios")) {
    const auto& cr = rd.at("compress_ratios");
    for (size_t i = 0; i < cr.size() && static_cast<int64_t>(i) < n; ++i) {
      int64_t r = cr[i].get<int64_t>();
      if (r == 0) c.layer_types.push_back(LayerType::sliding);
      else if (r == 4) c.layer_types.push_back(LayerType::csa);
      else if (r == 128) c.layer_types.push_back(LayerType::hca);
      else field_error(source, "compress_ratios[" + std::to_string(i) + "]", "must be 0, 4 or 128");
    }
  } else {
    // transformers' default: 2x HCA bootstrap, then CSA/HCA interleave.
    for (int64_t i = 0; i < n; ++i) {
      if (i < 2) c.layer_types.push_back(LayerType::hca);
      else c.layer_types.push_back((i - 2) % 2 ? LayerType::csa : LayerType::hca);
    }
  }

  if (rd.has("mlp_layer_types")) {
    const auto& mt = rd.at("mlp_layer_types");
    if (!mt.is_array()) field_error(source, "mlp_layer_types", "must be a list");
    for (size_t i = 0; i < mt.size() && static_cast<int64_t>(i) < n; ++i) {
      std::string t = mt[i].is_string() ? mt[i].get<std::string>() : "";
      if (t == "hash_moe") c.mlp_layer_types.push_back(MlpType::hash_moe);
      else if (t == "moe") c.mlp_layer_types.push_back(MlpType::moe);
      else field_error(source, "mlp_layer_types[" + std::to_string(i) + "]", "is '" + t + "', expected hash_moe or moe");
    }
    if (static_cast<int64_t>(mt.size()) < n) field_error(source, "mlp_layer_types", "has fewer entries than num_hidden_layers");
  } else {
    const int64_t n_hash = rd.integer("num_hash_layers", 3);
    for (int64_t i = 0; i < n; ++i) c.mlp_layer_types.push_back(i < n_hash ? MlpType::hash_moe : MlpType::moe);
  }

  bool any_csa = false;
  for (auto t : c.layer_types) any_csa |= t == LayerType::csa;
  if (any_csa) {
    c.index_n_heads = rd.positive("index_n_heads");
    c.index_head_dim = rd.positive("index_head_dim");
    c.index_topk = rd.positive("index_topk");
  }

  c.hc_mult = static_cast<int>(rd.integer("hc_mult", 4));
  c.hc_sinkhorn_iters = static_cast<int>(rd.integer("hc_sinkhorn_iters", 20));
  c.hc_eps = static_cast<float>(rd.number("hc_eps", 1e-6));

  c.n_routed_experts = rd.positive("n_routed_experts");
  c.num_experts_per_tok = rd.positive("num_experts_per_tok");
  c.moe_intermediate_size = rd.positive("moe_intermediate_size");
  const std::string sf = rd.string("scoring_func", "sqrtsoftplus");
  if (sf == "sqrtsoftplus") c.scoring_func = kernels::ScoreFn::sqrtsoftplus;
  else if (sf == "sigmoid") c.scoring_func = kernels::ScoreFn::sigmoid;
  else if (sf == "softmax") c.scoring_func = kernels::ScoreFn::softmax;
  else field_error(source, "scoring_func", "is '" + sf + "'; expected sqrtsoftplus, sigmoid or softmax");
  c.routed_scaling_factor = static_cast<float>(rd.number("routed_scaling_factor", 1.5));
  c.swiglu_limit = static_cast<float>(rd.number("swiglu_limit", 10.0));
  c.tie_word_embeddings = rd.boolean("tie_word_embeddings", false);
  c.bos_token_id = rd.integer("bos_token_id", -1);
  if (rd.has("eos_token_id")) {
    const auto& e = rd.at("eos_token_id");
    if (e.is_array()) {
      for (const auto& v : e) c.eos_token_ids.push_back(v.get<int64_t>());
    } else if (e.is_number_integer()) {
      c.eos_token_ids.push_back(e.get<int64_t>());
    } else {
      field_error(source, "eos_token_id", "must be an integer or a list of integers");
    }
  }

  // RoPE: transformers' DeepseekV4Config.__post_init__.
  double partial = 64.0 / 512.0;
  if (rd.has("partial_rotary_factor")) partial = rd.number("partial_rotary_factor");
  else if (rd.has("qk_rope_head_dim")) partial = static_cast<double>(rd.integer("qk_rope_head_dim")) / static_cast<double>(c.head_dim);
  const double rope_theta = rd.number("rope_theta", 10000.0);
  const double compress_theta = rd.number("compress_rope_theta", 160000.0);
  json rp = rd.has("rope_parameters") ? rd.at("rope_parameters") : rd.has("rope_scaling") ? rd.at("rope_scaling") : json::object();
  if (!rp.is_object()) field_error(source, "rope_parameters", "must be an object");
  if (rp.contains("main") && rp["main"].is_object() && rp.contains("compress") && rp["compress"].is_object()) {
    c.rope_main = parse_rope(rp["main"], source, "rope_parameters.main");
    c.rope_compress = parse_rope(rp["compress"], source, "rope_parameters.compress");
  } else {
    json flat = json::object();
    for (auto it = rp.begin(); it != rp.end(); ++it) {
      if (it.key() != "main" && it.key() != "compress") flat[it.key()] = it.value();
    }
    json main = {{"rope_type", "default"}, {"rope_theta", rope_theta}, {"partial_rotary_factor", partial}};
    json compress = flat;
    compress["rope_theta"] = compress_theta;
    compress["partial_rotary_factor"] = partial;
    if (!compress.contains("rope_type")) compress["rope_type"] = compress.value("type", std::string("default"));
    compress.erase("type");
    if (compress["rope_type"] == "yarn" && !compress.contains("attention_factor")) compress["attention_factor"] = 1.0;
    c.rope_main = parse_rope(main, source, "rope_parameters.main");
    c.rope_compress = parse_rope(compress, source, "rope_parameters");
  }
  c.finish();
  return c;
}

ModelConfig load_config(const std::string& path) { return parse_config(read_text_file(path), path); }

}  // namespace troupe::model
