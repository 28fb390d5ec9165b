#include "model/init.hpp"

#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <algorithm>
#include <numeric>
#include <vector>

#include "base/error.hpp"
#include "base/parallel.hpp"
#include "model/safetensors.hpp"
#include "model/tokenizer/default_tokenizer.hpp"

namespace troupe::model {
namespace {

using json = nlohmann::json;

// splitmix64 + Box-Muller: the same numbers on every machine.
class Rng {
 public:
  explicit Rng(uint64_t seed) : s_(seed * 0x9e3779b97f4a7c15ull + 0x1234567ull) {}
  static Rng at_state(uint64_t s) {
    Rng r(0);
    r.s_ = s;
    return r;
  }
  uint64_t state() const { return s_; }
  // The stream `draws` numbers later (splitmix64 steps by a constant).
  void skip(uint64_t draws) { s_ += draws * 0x9e3779b97f4a7c15ull; }
  uint64_t next() {
    uint64_t z = (s_ += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  double uniform() { return static_cast<double>(next() >> 11) * (1.0 / 9007199254740992.0); }
  float normal() {
    double u1 = uniform(), u2 = uniform();
    if (u1 < 1e-300) u1 = 1e-300;
    return static_cast<float>(std::sqrt(-2.0 * std::log(u1)) * std::cos(2 * M_PI * u2));
  }

 private:
  uint64_t s_;
};

// store(i, normal_i) for i < n: the next n normals of `rng` (two draws each), made
// on several threads from skipped-ahead copies of the stream, so the numbers are
// the same as one thread drawing them in order; `rng` ends after them.
template <class Store>
void fill_normals(Rng& rng, int64_t n, Store store) {
  const uint64_t s0 = rng.state();
  parallel_ranges(n, std::clamp<int64_t>(n / (int64_t{1} << 20), 1, hardware_threads()), [&](int64_t begin, int64_t end) {
    Rng r = Rng::at_state(s0);
    r.skip(2 * static_cast<uint64_t>(begin));
    for (int64_t i = begin; i < end; ++i) store(i, r.normal());
  });
  rng.skip(2 * static_cast<uint64_t>(n));
}

// Nearest e4m3fn code of v (|v| <= 448), ties to the even code.
uint8_t to_e4m3(float v) {
  static const std::vector<float> kValues = [] {
    std::vector<float> t;
    for (int c = 0; c < 0x7f; ++c) t.push_back(e4m3_to_f32(static_cast<uint8_t>(c)));
    return t;
  }();
  const float a = std::min(std::fabs(v), 448.0f);
  const auto hi = std::lower_bound(kValues.begin(), kValues.end(), a);
  int c = static_cast<int>(hi - kValues.begin());
  if (c == static_cast<int>(kValues.size())) c = static_cast<int>(kValues.size()) - 1;
  if (c > 0) {
    const float below = kValues[static_cast<size_t>(c - 1)], above = kValues[static_cast<size_t>(c)];
    if (a - below < above - a || (a - below == above - a && (c - 1) % 2 == 0)) --c;
  }
  return static_cast<uint8_t>(c | (std::signbit(v) ? 0x80 : 0));
}

// Nearest e2m1 code of v (|v| <= 6), ties to the even code.
uint8_t to_e2m1(float v) {
  static constexpr float kMagnitude[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
  const float a = std::min(std::fabs(v), 6.0f);
  int best = 0;
  for (int c = 1; c < 8; ++c) {
    const float d = std::fabs(a - kMagnitude[c]), db = std::fabs(a - kMagnitude[best]);
    if (d < db || (d == db && c % 2 == 0)) best = c;
  }
  return static_cast<uint8_t>(best | (std::signbit(v) ? 0x8 : 0));
}

// The ue8m0 scale of a block whose largest magnitude is amax, for codes up to `top`: the power of two
// at or above amax / top (1 for an all-zero block); its exponent byte in *e8m0.
float pow2_scale(float amax, float top, uint8_t* e8m0) {
  int e = amax > 0.0f ? static_cast<int>(std::ceil(std::log2(static_cast<double>(amax) / top))) : 0;
  e = std::clamp(e, -127, 127);
  *e8m0 = static_cast<uint8_t>(e + 127);
  return std::ldexp(1.0f, e);
}

json preset_config(const InitOptions& o) {
  json c;
  if (o.preset == "tiny") {
    c = {{"vocab_size", 129280}, {"hidden_size", 256}, {"num_hidden_layers", 4}, {"num_attention_heads", 8},
         {"head_dim", 64}, {"q_lora_rank", 128}, {"o_groups", 2}, {"o_lora_rank", 64}, {"sliding_window", 32},
         {"layer_types", {"sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
                          "compressed_sparse_attention"}},
         {"mlp_layer_types", {"hash_moe", "moe", "moe", "moe"}},
         {"compress_rates", {{"compressed_sparse_attention", 4}, {"heavily_compressed_attention", 16}}},
         {"index_n_heads", 4}, {"index_head_dim", 32}, {"index_topk", 16}, {"n_routed_experts", 8},
         {"num_experts_per_tok", 2}, {"moe_intermediate_size", 128}, {"partial_rotary_factor", 0.25},
         {"rope_parameters", {{"main", {{"rope_type", "default"}, {"rope_theta", 10000.0}, {"partial_rotary_factor", 0.25}}},
                              {"compress", {{"rope_type", "yarn"}, {"rope_theta", 160000.0}, {"partial_rotary_factor", 0.25},
                                            {"factor", 16.0}, {"original_max_position_embeddings", 4096},
                                            {"beta_fast", 32}, {"beta_slow", 1}, {"attention_factor", 1.0}}}}},
         {"max_position_embeddings", 65536}};
  } else if (o.preset == "flash-shaped") {
    c = {{"vocab_size", 129280}, {"hidden_size", 4096}, {"num_hidden_layers", 4}, {"num_attention_heads", 64},
         {"head_dim", 512}, {"q_lora_rank", 1024}, {"o_groups", 8}, {"o_lora_rank", 1024}, {"sliding_window", 128},
         {"layer_types", {"heavily_compressed_attention", "compressed_sparse_attention", "heavily_compressed_attention",
                          "compressed_sparse_attention"}},
         {"mlp_layer_types", {"moe", "moe", "moe", "moe"}},
         {"compress_rates", {{"compressed_sparse_attention", 4}, {"heavily_compressed_attention", 128}}},
         {"index_n_heads", 64}, {"index_head_dim", 128}, {"index_topk", 512}, {"n_routed_experts", 16},
         {"num_experts_per_tok", 6}, {"moe_intermediate_size", 2048}, {"partial_rotary_factor", 0.125},
         {"rope_parameters", {{"main", {{"rope_type", "default"}, {"rope_theta", 10000.0}, {"partial_rotary_factor", 0.125}}},
                              {"compress", {{"rope_type", "yarn"}, {"rope_theta", 160000.0}, {"partial_rotary_factor", 0.125},
                                            {"factor", 16.0}, {"original_max_position_embeddings", 65536},
                                            {"beta_fast", 32}, {"beta_slow", 1}, {"attention_factor", 1.0}}}}},
         {"max_position_embeddings", 1048576}};
  } else {
    raise(ErrorCode::invalid_argument, "unknown preset '{}' (tiny, flash-shaped)", o.preset);
  }
  c["model_type"] = "deepseek_v4";
  c["architectures"] = {"DeepseekV4ForCausalLM"};
  c["num_key_value_heads"] = 1;
  c["hc_mult"] = 4;
  c["hc_sinkhorn_iters"] = 20;
  c["hc_eps"] = 1e-6;
  c["rms_norm_eps"] = 1e-6;
  c["scoring_func"] = "sqrtsoftplus";
  c["routed_scaling_factor"] = 1.5;
  c["swiglu_limit"] = 10.0;
  c["n_shared_experts"] = 1;
  c["rope_theta"] = 10000.0;
  c["compress_rope_theta"] = 160000.0;
  c["tie_word_embeddings"] = false;
  c["bos_token_id"] = 0;
  c["eos_token_id"] = 1;
  if (o.layers > 0) {
    json lt = json::array(), mt = json::array();
    for (int64_t i = 0; i < o.layers; ++i) {
      lt.push_back(c["layer_types"][static_cast<size_t>(i) % c["layer_types"].size()]);
      mt.push_back(c["mlp_layer_types"][static_cast<size_t>(i) % c["mlp_layer_types"].size()]);
    }
    c["num_hidden_layers"] = o.layers;
    c["layer_types"] = lt;
    c["mlp_layer_types"] = mt;
  }
  if (!o.layer_types.empty()) {
    json lt = json::array(), mt = json::array();
    for (size_t i = 0; i < o.layer_types.size(); ++i) {
      const std::string& t = o.layer_types[i];
      if (t == "sliding") lt.push_back("sliding_attention");
      else if (t == "csa") lt.push_back("compressed_sparse_attention");
      else if (t == "hca") lt.push_back("heavily_compressed_attention");
      else raise(ErrorCode::invalid_argument, "init-model: layer type '{}' is not sliding, csa or hca", t);
      mt.push_back(c["mlp_layer_types"][i % c["mlp_layer_types"].size()]);
    }
    c["num_hidden_layers"] = o.layer_types.size();
    c["layer_types"] = lt;
    c["mlp_layer_types"] = mt;
  }
  if (o.experts > 0) c["n_routed_experts"] = o.experts;
  if (o.vocab > 0) c["vocab_size"] = o.vocab;
  return c;
}

}  // namespace

void init_model(const std::string& dir, const InitOptions& o) {
  namespace fs = std::filesystem;
  if (o.dtype != DType::f32 && o.dtype != DType::bf16) raise(ErrorCode::invalid_argument, "init-model: dtype must be f32 or bf16");
  if (!o.quantize.empty() && o.quantize != "fp8" && o.quantize != "fp4") {
    raise(ErrorCode::invalid_argument, "init-model: quantize must be fp8 or fp4, not '{}'", o.quantize);
  }
  const json c = preset_config(o);
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) raise(ErrorCode::invalid_argument, "cannot create {}: {}", dir, ec.message());

  Rng rng(o.seed);
  struct Owned {
    std::string name;
    DType dtype;
    std::vector<int64_t> shape;
    std::vector<float> f;
    std::vector<uint16_t> h;
    std::vector<int64_t> i;
    std::vector<uint8_t> b;
  };
  std::vector<Owned> tensors;
  const bool quantized_layers = !o.quantize.empty();  // linear layers in FP8 (experts FP8 or FP4)
  auto matrix = [&](const std::string& name, std::vector<int64_t> shape, float std) {
    Owned t{name, o.dtype, shape, {}, {}, {}, {}};
    const int64_t n = std::accumulate(shape.begin(), shape.end(), int64_t{1}, std::multiplies<>());
    if (o.dtype == DType::f32) {
      t.f.resize(static_cast<size_t>(n));
      fill_normals(rng, n, [&](int64_t i, float v) { t.f[static_cast<size_t>(i)] = v * std; });
    } else {
      t.h.resize(static_cast<size_t>(n));
      fill_normals(rng, n, [&](int64_t i, float v) { t.h[static_cast<size_t>(i)] = f32_to_bf16(v * std); });
    }
    tensors.push_back(std::move(t));
  };
  auto vec = [&](const std::string& name, std::vector<int64_t> shape, float mean, float std) {
    Owned t{name, DType::f32, shape, {}, {}, {}, {}};
    const int64_t n = std::accumulate(shape.begin(), shape.end(), int64_t{1}, std::multiplies<>());
    t.f.resize(static_cast<size_t>(n));
    fill_normals(rng, n, [&](int64_t i, float v) { t.f[static_cast<size_t>(i)] = mean + v * std; });
    tensors.push_back(std::move(t));
  };
  // Codes and scales of one matrix v [rows, cols]: FP8 e4m3 with a power-of-two float32 scale per
  // 128 x 128 block, or FP4 e2m1 pairs with an e8m0 scale per 32 inputs; the scale tensor is `scale_name`.
  auto quantized = [&](const std::string& name, const std::string& scale_name, const float* v, int64_t rows,
                       int64_t cols, bool fp4) {
    const int64_t bm = fp4 ? 1 : 128, bn = fp4 ? 32 : 128;
    const int64_t sr = (rows + bm - 1) / bm, sc = (cols + bn - 1) / bn;
    Owned codes{name, fp4 ? DType::i8 : DType::f8_e4m3, {rows, fp4 ? cols / 2 : cols}, {}, {}, {}, {}};
    Owned scales{scale_name, fp4 ? DType::f8_e8m0 : DType::f32, {sr, sc}, {}, {}, {}, {}};
    codes.b.assign(static_cast<size_t>(fp4 ? rows * cols / 2 : rows * cols), 0);
    if (fp4) scales.b.resize(static_cast<size_t>(sr * sc)); else scales.f.resize(static_cast<size_t>(sr * sc));
    for (int64_t br = 0; br < sr; ++br) {
      for (int64_t bc = 0; bc < sc; ++bc) {
        const int64_t r1 = std::min(rows, (br + 1) * bm), c1 = std::min(cols, (bc + 1) * bn);
        float amax = 0.0f;
        for (int64_t r = br * bm; r < r1; ++r)
          for (int64_t cc = bc * bn; cc < c1; ++cc) amax = std::max(amax, std::fabs(v[r * cols + cc]));
        uint8_t ex = 0;
        const float scale = pow2_scale(amax, fp4 ? 6.0f : 448.0f, &ex);
        if (fp4) scales.b[static_cast<size_t>(br * sc + bc)] = ex; else scales.f[static_cast<size_t>(br * sc + bc)] = scale;
        for (int64_t r = br * bm; r < r1; ++r) {
          for (int64_t cc = bc * bn; cc < c1; ++cc) {
            const float x = v[r * cols + cc] / scale;
            if (!fp4) {
              codes.b[static_cast<size_t>(r * cols + cc)] = to_e4m3(x);
            } else {
              const uint8_t q = to_e2m1(x);
              codes.b[static_cast<size_t>(r * (cols / 2) + cc / 2)] |= static_cast<uint8_t>((cc & 1) ? q << 4 : q);
            }
          }
        }
      }
    }
    tensors.push_back(std::move(codes));
    tensors.push_back(std::move(scales));
  };
  // A linear layer's matrix `X.weight` [rows, cols]: quantized (scale `X.weight_scale_inv`,
  // transformers' name) when asked, else `matrix`. The same normals either way.
  auto linear = [&](const std::string& name, std::vector<int64_t> shape, float std) {
    if (!quantized_layers) return matrix(name, shape, std);
    std::vector<float> v(static_cast<size_t>(shape[0] * shape[1]));
    fill_normals(rng, static_cast<int64_t>(v.size()), [&](int64_t i, float x) { v[static_cast<size_t>(i)] = x * std; });
    quantized(name, name + "_scale_inv", v.data(), shape[0], shape[1], false);
  };
  // The routed experts of layer l: stacked `experts.gate_up_proj` [E, 2I, D] and `experts.down_proj`
  // [E, D, I] (transformers' layout), or, quantized, DeepSeek's per-expert `ffn.experts.N.w1/w3/w2`
  // with `.scale` tensors, the layout its FP8 / FP4 checkpoints have (from the same normals).
  auto experts = [&](int64_t l, int64_t E, int64_t I, int64_t D, float std_in, float std_out, bool fp4) {
    const std::string m = "model.layers." + std::to_string(l) + ".mlp.";
    if (!quantized_layers) {
      matrix(m + "experts.gate_up_proj", {E, 2 * I, D}, std_in);
      matrix(m + "experts.down_proj", {E, D, I}, std_out);
      return;
    }
    std::vector<float> gate_up(static_cast<size_t>(E * 2 * I * D)), down(static_cast<size_t>(E * D * I));
    fill_normals(rng, static_cast<int64_t>(gate_up.size()), [&](int64_t i, float x) { gate_up[static_cast<size_t>(i)] = x * std_in; });
    fill_normals(rng, static_cast<int64_t>(down.size()), [&](int64_t i, float x) { down[static_cast<size_t>(i)] = x * std_out; });
    for (int64_t e = 0; e < E; ++e) {
      const std::string x = "model.layers." + std::to_string(l) + ".ffn.experts." + std::to_string(e) + ".";
      quantized(x + "w1.weight", x + "w1.scale", gate_up.data() + e * 2 * I * D, I, D, fp4);
      quantized(x + "w3.weight", x + "w3.scale", gate_up.data() + e * 2 * I * D + I * D, I, D, fp4);
      quantized(x + "w2.weight", x + "w2.scale", down.data() + e * D * I, D, I, fp4);
    }
  };
  const bool fp4_experts = o.quantize == "fp4";
  const int64_t V = c["vocab_size"], D = c["hidden_size"], L = c["num_hidden_layers"], H = c["num_attention_heads"];
  const int64_t hd = c["head_dim"], qr = c["q_lora_rank"], G = c["o_groups"], olr = c["o_lora_rank"];
  const int64_t E = c["n_routed_experts"], K = c["num_experts_per_tok"], I = c["moe_intermediate_size"];
  const int64_t nih = c["index_n_heads"], ihd = c["index_head_dim"], hc = c["hc_mult"];
  const int64_t n_mix = (2 + hc) * hc;
  auto inv = [](int64_t fan_in) { return 1.0f / std::sqrt(static_cast<float>(fan_in)); };

  matrix("model.embed_tokens.weight", {V, D}, 1.0f);
  matrix("lm_head.weight", {V, D}, inv(D));
  vec("model.norm.weight", {D}, 1.0f, 0.1f);
  matrix("model.hc_head.hc_fn", {hc, hc * D}, inv(hc * D));
  vec("model.hc_head.hc_base", {hc}, 0.0f, 0.5f);
  vec("model.hc_head.hc_scale", {1}, 1.0f, 0.2f);
  for (int64_t l = 0; l < L; ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".";
    for (const char* site : {"attn_hc.", "ffn_hc."}) {
      matrix(p + site + "fn", {n_mix, hc * D}, inv(hc * D));
      vec(p + site + "base", {n_mix}, 0.0f, 0.5f);
      vec(p + site + "scale", {3}, 1.0f, 0.2f);
    }
    vec(p + "input_layernorm.weight", {D}, 1.0f, 0.1f);
    vec(p + "post_attention_layernorm.weight", {D}, 1.0f, 0.1f);
    const std::string a = p + "self_attn.";
    linear(a + "q_a_proj.weight", {qr, D}, inv(D));
    vec(a + "q_a_norm.weight", {qr}, 1.0f, 0.1f);
    linear(a + "q_b_proj.weight", {H * hd, qr}, inv(qr));
    linear(a + "kv_proj.weight", {hd, D}, inv(D));
    vec(a + "kv_norm.weight", {hd}, 1.0f, 0.1f);
    linear(a + "o_a_proj.weight", {G * olr, H * hd / G}, inv(H * hd / G));
    linear(a + "o_b_proj.weight", {D, G * olr}, inv(G * olr));
    vec(a + "sinks", {H}, 0.0f, 1.0f);
    const std::string type = c["layer_types"][static_cast<size_t>(l)];
    const int64_t rate = type == "compressed_sparse_attention" ? c["compress_rates"]["compressed_sparse_attention"].get<int64_t>()
                                                                : c["compress_rates"]["heavily_compressed_attention"].get<int64_t>();
    if (type != "sliding_attention") {
      const int64_t w = type == "compressed_sparse_attention" ? 2 * hd : hd;
      linear(a + "compressor.kv_proj.weight", {w, D}, inv(D));
      linear(a + "compressor.gate_proj.weight", {w, D}, inv(D));
      vec(a + "compressor.position_bias", {rate, w}, 0.0f, 0.5f);
      vec(a + "compressor.kv_norm.weight", {hd}, 1.0f, 0.1f);
    }
    if (type == "compressed_sparse_attention") {
      const std::string ip = a + "compressor.indexer.";
      linear(ip + "kv_proj.weight", {2 * ihd, D}, inv(D));
      linear(ip + "gate_proj.weight", {2 * ihd, D}, inv(D));
      vec(ip + "position_bias", {rate, 2 * ihd}, 0.0f, 0.5f);
      vec(ip + "kv_norm.weight", {ihd}, 1.0f, 0.1f);
      linear(ip + "q_b_proj.weight", {nih * ihd, qr}, inv(qr));
      linear(ip + "scorer.weights_proj.weight", {nih, D}, inv(D));
    }
    const std::string m = p + "mlp.";
    matrix(m + "gate.weight", {E, D}, inv(D));
    if (c["mlp_layer_types"][static_cast<size_t>(l)] == "hash_moe") {
      Owned t{m + "gate.tid2eid", DType::i64, {V, K}, {}, {}, {}, {}};
      t.i.resize(static_cast<size_t>(V * K));
      for (int64_t v = 0; v < V; ++v) {  // K distinct experts per token
        for (int64_t j = 0; j < K; ++j) {
          int64_t e;
          bool dup;
          do {
            e = static_cast<int64_t>(rng.next() % static_cast<uint64_t>(E));
            dup = false;
            for (int64_t q = 0; q < j; ++q) dup |= t.i[static_cast<size_t>(v * K + q)] == e;
          } while (dup);
          t.i[static_cast<size_t>(v * K + j)] = e;
        }
      }
      tensors.push_back(std::move(t));
    } else {
      vec(m + "gate.e_score_correction_bias", {E}, 0.0f, 0.1f);
    }
    experts(l, E, I, D, inv(D), inv(I), fp4_experts);
    linear(m + "shared_experts.gate_proj.weight", {I, D}, inv(D));
    linear(m + "shared_experts.up_proj.weight", {I, D}, inv(D));
    linear(m + "shared_experts.down_proj.weight", {D, I}, inv(I));
  }
  std::vector<TensorToWrite> out;
  for (const auto& t : tensors) {
    const void* data = t.dtype == DType::i64 ? static_cast<const void*>(t.i.data())
                       : t.dtype == DType::bf16 ? static_cast<const void*>(t.h.data())
                       : !t.b.empty()           ? static_cast<const void*>(t.b.data())
                                                : static_cast<const void*>(t.f.data());
    out.push_back({t.name, t.dtype, t.shape, data});
  }
  write_safetensors((fs::path(dir) / "model.safetensors").string(), out);
  json cfg = c;
  cfg["dtype"] = o.dtype == DType::f32 ? "float32" : "bfloat16";
  if (quantized_layers) {
    cfg["quantization_config"] = {{"quant_method", "fp8"}, {"fmt", "e4m3"}, {"activation_scheme", "dynamic"},
                                  {"weight_block_size", {128, 128}}, {"scale_fmt", "ue8m0"}};
    cfg["expert_dtype"] = fp4_experts ? "fp4" : "fp8";
  }
  std::ofstream(fs::path(dir) / "config.json") << cfg.dump(2) << "\n";
  if (o.with_tokenizer) {
    const fs::path from = tokenizer::default_tokenizer_dir();
    for (const char* f : {"tokenizer.json", "tokenizer_config.json"}) {
      fs::copy_file(from / f, fs::path(dir) / f, fs::copy_options::overwrite_existing, ec);
      if (ec) raise(ErrorCode::invalid_argument, "cannot copy {} into {}: {}", (from / f).string(), dir, ec.message());
    }
  }
}

}  // namespace troupe::model
