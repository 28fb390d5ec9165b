// DeepSeek-V4 weights in backend memory, loaded from a Checkpoint by name.
// Accepts both spellings `save_pretrained` can write: transformers' module
// names (`self_attn.q_a_proj.weight`, merged experts) and DeepSeek's original
// names (`attn.wq_a.weight`, `ffn.experts.N.w1.weight`), the default of
// transformers 5's save_pretrained.
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "kernels/backend.hpp"
#include "model/config.hpp"
#include "model/safetensors.hpp"

namespace troupe::model {

using kernels::Weight;

struct HcWeights {
  Weight fn;                     // [(2+hc)*hc, hc*D] (sublayer) or [hc, hc*D] (head)
  const float* base = nullptr;
  const float* scale = nullptr;  // 3 entries (sublayer) or 1 (head)
};

struct CompressorWeights {
  int64_t width = 0;             // projection width: 2*dim with overlap (CSA), dim otherwise
  Weight kv_proj;                // [width, D]
  Weight gate_proj;              // [width, D]
  const float* position_bias = nullptr;  // [rate, width]
  const float* kv_norm = nullptr;        // [dim]
};

struct IndexerWeights {
  CompressorWeights compressor;  // at index_head_dim, with overlap
  Weight q_b_proj;               // [index_n_heads*index_head_dim, q_lora_rank]
  Weight weights_proj;           // [index_n_heads, D]
};

struct AttentionWeights {
  Weight q_a_proj;
  const float* q_a_norm = nullptr;
  Weight q_b_proj;
  Weight kv_proj;
  const float* kv_norm = nullptr;
  Weight o_a_proj;               // [o_groups*o_lora_rank, H*head_dim/o_groups]
  Weight o_b_proj;
  const float* sinks = nullptr;  // [H]
  std::optional<CompressorWeights> compressor;
  std::optional<IndexerWeights> indexer;
};

struct MoeWeights {
  Weight router;                          // [E, D]
  const float* score_bias = nullptr;      // e_score_correction_bias [E] (top-k layers)
  const int64_t* tid2eid = nullptr;       // [vocab, k] (hash layers)
  std::vector<Weight> gate, up, down;     // per expert
  Weight shared_gate, shared_up, shared_down;
};

struct LayerWeights {
  HcWeights attn_hc, ffn_hc;
  const float* input_norm = nullptr;
  const float* post_attention_norm = nullptr;
  AttentionWeights attn;
  MoeWeights moe;
};

class Weights {
 public:
  // Loads and checks every tensor the config needs. Matrices become `matrix_type`
  // (fp32 for the CPU backend); vectors and tables stay fp32 / int64. With
  // keep_quantized, a matrix the checkpoint stores as FP8 / FP4 that the backend
  // keeps_quantized() (routed experts' and the rest asked apart) stays in its codes
  // with fp32 block scales (the same values
  // as dequantizing it, at a quarter / an eighth of the fp32 bytes); otherwise it is
  // dequantized into `matrix_type`. Throws troupe::Error naming the tensor and the
  // directory.
  static std::unique_ptr<Weights> load(const ModelConfig& config, const Checkpoint& ckpt, kernels::Backend& backend,
                                       kernels::WeightType matrix_type, bool keep_quantized = true);
  ~Weights();
  Weights(const Weights&) = delete;
  Weights& operator=(const Weights&) = delete;

  Weight embed;
  Weight lm_head;
  const float* final_norm = nullptr;
  HcWeights hc_head;
  std::vector<LayerWeights> layers;
  size_t bytes = 0;  // backend memory held

 private:
  explicit Weights(kernels::Backend& backend) : backend_(backend) {}
  friend class WeightLoader;
  kernels::Backend& backend_;
  std::vector<void*> allocations_;
};

// Maps a checkpoint tensor name to transformers' module name without the
// `model.` prefix (e.g. `layers.0.attn.wq_a.weight` -> `layers.0.self_attn.q_a_proj.weight`).
std::string canonical_tensor_name(const std::string& name);

}  // namespace troupe::model
