// config.json parsing: the defaults and legacy spellings transformers accepts.
#include <gtest/gtest.h>

#include "base/error.hpp"
#include "model/config.hpp"

namespace troupe::model {
namespace {

const char* kMinimal = R"({
  "model_type": "deepseek_v4", "vocab_size": 100, "hidden_size": 64, "num_hidden_layers": 5,
  "num_attention_heads": 4, "head_dim": 32, "q_lora_rank": 32, "o_groups": 2, "o_lora_rank": 16,
  "sliding_window": 8, "index_n_heads": 2, "index_head_dim": 16, "index_topk": 4,
  "n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32 %s })";

ModelConfig parse(const std::string& extra) {
  char buf[2048];
  std::snprintf(buf, sizeof buf, kMinimal, extra.c_str());
  return parse_config(buf, "config.json");
}

TEST(Config, defaults_follow_transformers) {
  auto c = parse("");
  // 2x HCA bootstrap, then CSA/HCA interleave; first three MoE layers hashed.
  std::vector<LayerType> want{LayerType::hca, LayerType::hca, LayerType::hca, LayerType::csa, LayerType::hca};
  EXPECT_EQ(c.layer_types, want);
  EXPECT_EQ(c.mlp_layer_types[2], MlpType::hash_moe);
  EXPECT_EQ(c.mlp_layer_types[3], MlpType::moe);
  EXPECT_EQ(c.csa_rate, 4);
  EXPECT_EQ(c.hca_rate, 128);
  EXPECT_EQ(c.rope_main.rope_dim, 4);  // 64/512 of head_dim 32
  EXPECT_EQ(c.rope_compress.theta, 160000.0);
}

TEST(Config, legacy_keys_fold_in) {
  auto c = parse(R"(, "compress_ratios": [0, 4, 128, 4, 0], "num_hash_layers": 1, "qk_rope_head_dim": 8,
                    "compress_rate_csa": 2)");
  std::vector<LayerType> want{LayerType::sliding, LayerType::csa, LayerType::hca, LayerType::csa, LayerType::sliding};
  EXPECT_EQ(c.layer_types, want);
  EXPECT_EQ(c.mlp_layer_types[0], MlpType::hash_moe);
  EXPECT_EQ(c.mlp_layer_types[1], MlpType::moe);
  EXPECT_EQ(c.rope_main.rope_dim, 8);
  EXPECT_EQ(c.csa_rate, 2);
}

TEST(Config, flat_yarn_parameters_apply_to_the_compress_rope_only) {
  auto c = parse(R"(, "rope_parameters": {"rope_type": "yarn", "factor": 16, "original_max_position_embeddings": 64})");
  EXPECT_EQ(c.rope_main.type, "default");
  EXPECT_EQ(c.rope_compress.type, "yarn");
  EXPECT_EQ(c.rope_compress.attention_factor, 1.0);  // transformers forces 1.0 in this form
  // Low frequencies are interpolated by the factor, high ones kept.
  EXPECT_FLOAT_EQ(c.rope_compress.inv_freq[0], 1.0f);
  EXPECT_NEAR(c.rope_compress.inv_freq[1], 1.0f / std::pow(160000.0f, 0.5f) / 16.0f, 1e-9);
}

TEST(Config, fp8_quantization_as_deepseek_ships_it) {
  auto c = parse(R"(, "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                    "weight_block_size": [128, 128], "scale_fmt": "ue8m0"}, "expert_dtype": "fp4")");
  EXPECT_TRUE(c.quantization.fp8);
  EXPECT_EQ(c.quantization.block_rows, 128);
  EXPECT_EQ(c.quantization.block_cols, 128);
  EXPECT_EQ(c.quantization.expert_dtype, "fp4");
  EXPECT_FALSE(parse("").quantization.fp8);
}

TEST(Config, bad_values_name_the_field_and_file) {
  auto expect_error = [](const std::string& extra, const std::string& phrase) {
    try {
      parse(extra);
      FAIL() << "no error for " << extra;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(phrase), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("config.json"), std::string::npos) << e.what();
    }
  };
  expect_error(R"(, "scoring_func": "relu")", "field 'scoring_func' is 'relu'");
  expect_error(R"(, "layer_types": ["sliding_attention"])", "layer_types' has fewer entries");
  expect_error(R"(, "rope_parameters": {"rope_type": "dynamic", "factor": 2})", "rope_type' is 'dynamic'");
  expect_error(R"(, "num_key_value_heads": 2)", "num_key_value_heads' must be 1");
  expect_error(R"(, "quantization_config": {"quant_method": "bitsandbytes"})", "quant_method' is 'bitsandbytes'");
  expect_error(R"(, "quantization_config": {"quant_method": "fp8", "weight_block_size": [128]})", "weight_block_size");
  expect_error(R"(, "quantization_config": {"quant_method": "fp8", "fmt": "e5m2"})", "fmt' is \"e5m2\"");
  expect_error(R"(, "expert_dtype": "fp4")", "expert_dtype' is fp4 without a quantization_config");
  expect_error(R"(, "hidden_size": "big")", "'hidden_size' must be an integer");
}

}  // namespace
}  // namespace troupe::model
