// Where a sequence's per-layer state lives between forward calls: the five
// kinds of V4 state (docs/architecture.md, "State").
//
//   SWA window    raw kv of the last sliding_window tokens       swa_row(layer, pos)
//   entries       compressed entries (CSA or HCA layers)         entry_row(layer, i)
//   index keys    CSA indexer keys                               index_key_row(layer, i)
//   inflight      compressor kv+score of the open windows        ring_row(layer, ring, pos)
//
// The model reads and writes rows through this interface and never owns the
// memory: DenseState (below) keeps one sequence's rows in backend memory for
// `troupe forward`; cache/ keeps them in paged pools shared through the radix tree.
#pragma once

#include <cstdint>
#include <vector>

#include "kernels/backend.hpp"
#include "model/config.hpp"

namespace troupe::model {

enum class Ring : uint8_t { compressor = 0, indexer = 1 };

// Sizes of one layer's rows and rings, from the config.
struct LayerShape {
  LayerType type = LayerType::sliding;
  int64_t rate = 0;            // compress rate (0 for sliding layers)
  int64_t head_dim = 0;
  int64_t index_head_dim = 0;  // CSA only
  int64_t ring_slots = 0;      // 2*rate with overlap (CSA), rate (HCA)
  int64_t ring_width = 0;      // floats per compressor ring row: kv + score
  int64_t index_ring_width = 0;

  static LayerShape of(const ModelConfig& c, int layer);
};

class SequenceState {
 public:
  virtual ~SequenceState() = default;
  // Tokens already folded into the state: the position of the next token.
  virtual int64_t length() const = 0;
  // Makes rows available for tokens [length(), new_length). Pointers returned
  // earlier may move. May throw troupe::Error(resource_exhausted).
  virtual void reserve(int64_t new_length) = 0;
  // Declares tokens [length(), new_length) written.
  virtual void commit(int64_t new_length) = 0;

  // Positions B with start < B < end (ascending) inside a chunk [start, end)
  // at which the state wants to be resumable exactly as if a chunk had ended at
  // B (cache/ keeps such states in a prefix tree). For each B the forward also
  // stores the window rows of [B - sliding_window, B) and, per compressed layer,
  // the ring rows of the tokens whose windows are still open at B
  // ([(B/rate - 1)*rate, B) with overlap, [B/rate*rate, B) without). The state
  // must give those rows storage distinct from the rows of the chunk's last
  // sliding_window / ring_slots tokens. Default: none (DenseState's ring of
  // sliding_window rows could not hold them).
  virtual std::vector<int64_t> checkpoints(int64_t start, int64_t end) const { return {}; }

  // Row addresses (backend memory). swa_row is valid for the positions the
  // forward reads or stores: [length()-sliding_window, length()), the chunk's
  // last sliding_window positions and each checkpoint's window; entry and
  // index-key rows for i < reserved_end / rate; ring rows for the positions the
  // forward reads (still-open windows) or stores (slot pos % ring_slots).
  virtual float* swa_row(int layer, int64_t pos) = 0;
  virtual float* entry_row(int layer, int64_t i) = 0;
  virtual float* index_key_row(int layer, int64_t i) = 0;
  virtual float* ring_row(int layer, Ring ring, int64_t pos) = 0;
};

// The state of one sequence in one piece of memory per kind: the rows live in
// the backend's memory (device memory on CUDA; host memory on the CPU backend,
// or without a backend). Rows never move once handed out: entries and index
// keys grow in blocks (256 rows, then doubling), so pointers stay valid across
// reserve() and a decoder may keep them in tables.
class DenseState final : public SequenceState {
 public:
  explicit DenseState(const ModelConfig& config, kernels::Backend* backend = nullptr);
  ~DenseState() override;
  DenseState(const DenseState&) = delete;
  DenseState& operator=(const DenseState&) = delete;
  int64_t length() const override { return length_; }
  void reserve(int64_t new_length) override;
  void commit(int64_t new_length) override { length_ = new_length; }
  float* swa_row(int layer, int64_t pos) override;
  float* entry_row(int layer, int64_t i) override;
  float* index_key_row(int layer, int64_t i) override;
  float* ring_row(int layer, Ring ring, int64_t pos) override;
  // Bytes of memory held.
  size_t bytes() const { return bytes_; }

 private:
  struct Blocks {
    int64_t width = 0;  // floats per row
    std::vector<float*> blocks;
    int64_t rows() const;  // rows the blocks hold
    float* row(int64_t i) const;
  };
  struct Layer {
    LayerShape shape;
    float* swa = nullptr;       // ring of sliding_window rows
    Blocks entries;
    Blocks index_keys;
    float* ring[2] = {nullptr, nullptr};
  };
  float* take(int64_t floats);  // zeroed memory of the backend (or host)
  void grow(Blocks& b, int64_t rows);

  kernels::Backend* backend_;
  int64_t window_ = 0;
  int64_t length_ = 0;
  size_t bytes_ = 0;
  std::vector<Layer> layers_;
  std::vector<float*> owned_;
};

}  // namespace troupe::model
