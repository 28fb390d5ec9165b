// DeepSeek-V4 model configuration, read from an HF `config.json` the way
// transformers 5.17's DeepseekV4Config reads it (legacy keys included).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "kernels/backend.hpp"

namespace troupe::model {

enum class LayerType : uint8_t { sliding, csa, hca };  // sliding_attention, compressed_sparse_attention, heavily_compressed_attention
enum class MlpType : uint8_t { hash_moe, moe };

const char* to_string(LayerType t);

// One RoPE family ("main" for sliding-only layers, "compress" for CSA/HCA layers
// and their compressors and indexers).
struct RopeConfig {
  std::string type = "default";   // default | linear | yarn
  double theta = 10000.0;
  double partial_rotary_factor = 1.0;
  // yarn / linear
  double factor = 1.0;
  int64_t original_max_position_embeddings = 0;
  double beta_fast = 32.0;
  double beta_slow = 1.0;
  double attention_factor = 1.0;  // scales cos and sin (yarn); NaN until derived
  double mscale = 0.0;            // yarn: derive attention_factor from these when both are set
  double mscale_all_dim = 0.0;

  // Derived tables (filled by ModelConfig::finish).
  int64_t rope_dim = 0;           // head_dim * partial_rotary_factor
  std::vector<float> inv_freq;    // rope_dim / 2 entries
};

// A quantized checkpoint (config.json's quantization_config, quant_method "fp8", as DeepSeek ships
// V4): matrices in FP8 e4m3 with a scale per block (`<name>.scale` or `<name>.weight_scale_inv`:
// float32, bf16 or e8m0 values), routed experts optionally in FP4 e2m1 (two a byte, element 2j in the
// low nibble) with a scale per 1 x 32 inputs. The products are those of transformers' dequantizing
// load (backends that take quantized weights keep the codes, others dequantize them as they load);
// activations are not quantized.
struct Quantization {
  bool fp8 = false;
  int64_t block_rows = 0;  // weight_block_size; 0: derived from each scale grid (which must divide the matrix)
  int64_t block_cols = 0;
  std::string expert_dtype = "fp8";  // config.json's expert_dtype: fp8 or fp4
};

struct ModelConfig {
  std::string source;  // the config.json path, for error messages
  Quantization quantization;

  int64_t vocab_size = 0;
  int64_t hidden_size = 0;
  int64_t num_hidden_layers = 0;
  int64_t num_attention_heads = 0;
  int64_t head_dim = 0;
  int64_t q_lora_rank = 0;
  int64_t o_groups = 0;
  int64_t o_lora_rank = 0;
  int64_t sliding_window = 0;
  int64_t max_position_embeddings = 0;
  float rms_norm_eps = 1e-6f;

  std::vector<LayerType> layer_types;
  std::vector<MlpType> mlp_layer_types;
  int64_t csa_rate = 4;
  int64_t hca_rate = 128;

  int64_t index_n_heads = 0;
  int64_t index_head_dim = 0;
  int64_t index_topk = 0;

  int hc_mult = 4;
  int hc_sinkhorn_iters = 20;
  float hc_eps = 1e-6f;

  int64_t n_routed_experts = 0;
  int64_t num_experts_per_tok = 0;
  int64_t moe_intermediate_size = 0;
  kernels::ScoreFn scoring_func = kernels::ScoreFn::sqrtsoftplus;
  float routed_scaling_factor = 1.0f;
  float swiglu_limit = 10.0f;

  bool tie_word_embeddings = false;
  int64_t bos_token_id = -1;
  std::vector<int64_t> eos_token_ids;

  RopeConfig rope_main;
  RopeConfig rope_compress;

  // Derived helpers.
  int64_t compress_rate(int layer) const;  // 0 for sliding layers
  const RopeConfig& rope_for(int layer) const;
  bool has_indexer(int layer) const { return layer_types[static_cast<size_t>(layer)] == LayerType::csa; }

  // Checks invariants and computes RoPE tables. Throws troupe::Error naming the field.
  void finish();
};

// Parses `path` (a config.json file). Unknown fields, missing required fields and
// unsupported values are errors that name the field and the file.
ModelConfig load_config(const std::string& path);
ModelConfig parse_config(const std::string& json_text, const std::string& source);

}  // namespace troupe::model
