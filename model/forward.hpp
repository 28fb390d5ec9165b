// The DeepSeek-V4 forward pass over a batch of sequence chunks.
//
// One call runs any mix of prefill chunks and decode tokens of different
// sequences: the per-token work (projections, mHC, MoE) runs over all tokens at
// once; the per-sequence work (window, compression, indexer, attention) reads
// and writes each sequence's SequenceState. Feeding a sequence in pieces gives
// the same logits as one call over the whole sequence.
#pragma once

#include <cstdint>
#include <map>
#include <mutex>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "kernels/backend.hpp"
#include "model/config.hpp"
#include "model/state.hpp"
#include "model/weights.hpp"

namespace troupe::model {

enum class LogitsWanted : uint8_t { none, last, all };

struct Chunk {
  SequenceState* state = nullptr;   // the chunk starts at state->length()
  std::span<const int32_t> ids;     // at least one token
  LogitsWanted logits = LogitsWanted::last;
};

class Model {
 public:
  // Loads config.json and the safetensors weights of `dir` onto `backend`.
  // Throws troupe::Error with a one-line reason.
  // Matrices become fp32 on the CPU backend and bf16 elsewhere unless
  // `matrix_type` says otherwise (e.g. fp32 on CUDA, to separate kernel error
  // from weight rounding). Without `matrix_type`, FP8 / FP4 matrices of a
  // quantized checkpoint stay quantized on backends that take them (the CPU
  // backend; the same values); with it, every matrix is that type.
  static std::unique_ptr<Model> load(const std::string& dir, kernels::Backend& backend,
                                     std::optional<kernels::WeightType> matrix_type = std::nullopt);
  Model(ModelConfig config, std::unique_ptr<Weights> weights, kernels::Backend& backend);
  ~Model();

  const ModelConfig& config() const { return config_; }
  kernels::Backend& backend() const { return backend_; }
  const Weights& weights() const { return *weights_; }
  size_t weights_bytes() const { return weights_->bytes; }

  // Runs the chunks and returns the wanted logits rows (host, fp32, row-major
  // [rows, vocab]) in chunk order. Checks ids against the vocabulary and throws
  // troupe::Error(invalid_argument) before touching any state.
  std::vector<float> forward(std::span<const Chunk> chunks);

  std::unique_ptr<SequenceState> new_dense_state() const;

 private:
  friend class Decoder;  // model/decoder.hpp: the same math, one token per sequence, no host round trips
  struct Batch;
  void run_layer(int layer, Batch& b);
  void attention_block(int layer, Batch& b, const float* h, float* out);
  void compress_block(int layer, Batch& b, const CompressorWeights& cw, Ring ring, const float* h,
                      bool to_index_keys);
  void moe_block(int layer, Batch& b, const float* h, float* out);

  ModelConfig config_;
  std::unique_ptr<Weights> weights_;
  kernels::Backend& backend_;
  float* rope_main_ = nullptr;      // inv_freq tables in backend memory
  float* rope_compress_ = nullptr;
  // Backend buffers of finished forward calls, by size, for the next calls
  // (a forward ends with synchronize(), so nothing in flight uses them).
  // Several engines (workers of one process) may run forward() on one Model at
  // once: the spare list is shared under spare_mutex_, each buffer owned by one call.
  std::mutex spare_mutex_;
  std::multimap<size_t, void*> spare_;
  size_t spare_bytes_ = 0;
  friend class ForwardScratch;
};

}  // namespace troupe::model
