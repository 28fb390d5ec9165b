// Random-weight DeepSeek-V4 models for tests, benchmarks and the embedded
// default: a config.json plus model.safetensors in transformers' layout,
// generated deterministically from a seed.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "base/dtype.hpp"

namespace troupe::model {

struct InitOptions {
  std::string preset = "tiny";  // tiny | flash-shaped
  uint64_t seed = 0;
  DType dtype = DType::f32;     // f32 or bf16 for matrices
  // "fp8": the linear layers' matrices (attention, compressor, indexer, experts) in FP8 e4m3 with a
  // power-of-two scale per 128 x 128 block, as DeepSeek ships V4 (quantization_config, ue8m0);
  // "fp4": the same with the routed experts in FP4 e2m1, a power-of-two scale per 32 inputs
  // (expert_dtype fp4); "": none. Embeddings, lm_head, mHC and router matrices stay `dtype`.
  std::string quantize;
  int64_t layers = -1;          // override num_hidden_layers (layer types cycle the preset's)
  std::vector<std::string> layer_types;  // override: sliding|csa|hca per layer (sets the layer count)
  int64_t experts = -1;         // override n_routed_experts
  int64_t vocab = -1;           // override vocab_size
  bool with_tokenizer = true;   // copy the shipped DeepSeek tokenizer files into the directory
};

// Writes config.json and model.safetensors (and the tokenizer files) into `dir`
// (created if missing).
// Throws troupe::Error on an unknown preset or an unwritable directory.
void init_model(const std::string& dir, const InitOptions& options);

}  // namespace troupe::model
