// Decode steps without host round trips: one token for each of up to
// `max_batch` sequences per step, the same math as Model::forward over
// single-token chunks (bit for bit on the CPU backend).
//
// Each bound sequence owns a table slot: pointer tables in backend memory of
// its window rows (by position % sliding_window), ring rows (by position %
// ring slots), compressed entries and indexer keys (by entry index). A step
// uploads one small host buffer (positions, table slots, and the few row
// pointers the new token adds), scatters the new pointers into the tables, and
// builds every key list, the compressor's slot lists and the indexer's
// selection on the device. Nothing is read back inside a step, so on a backend
// with graphs the step of each batch size is recorded once (the second time
// that size runs) and replayed after that. The last op samples greedily
// (argmax) on the device; logits stay on the device unless asked for.
//
// Rows must not move while a state is bound (DenseState and PagedSequence
// rows never move on their own; after a tier move, a prefill chunk through
// Model::forward or anything else that wrote rows, call refresh()).
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <string>
#include <memory>
#include <span>
#include <vector>

#include "kernels/backend.hpp"
#include "model/forward.hpp"

namespace troupe::model {

class Decoder {
 public:
  struct Options {
    int max_batch = 8;           // sequences per step (and table slots)
    int64_t max_context = 8192;  // longest sequence a slot's tables hold
    bool graphs = true;          // record and replay steps where the backend can
    bool profile = false;        // time each group of ops (synchronizing after each; no graphs)
  };
  Decoder(Model& model, Options options);
  ~Decoder();
  Decoder(const Decoder&) = delete;
  Decoder& operator=(const Decoder&) = delete;

  const Options& options() const { return options_; }
  Model& model() const { return model_; }
  // Whether steps are replayed from recorded graphs (the backend supports them).
  bool graphs() const { return graphs_; }

  // Binds a sequence whose next token goes at state.length() (>= 1 tokens in it)
  // to a free slot and uploads its tables; -1 when every slot is taken. Throws
  // troupe::Error(invalid_argument) when the sequence is longer than max_context.
  int bind(SequenceState& state);
  // Re-reads every row pointer of the slot's state (its rows moved or grew
  // outside step()).
  void refresh(int slot);
  void unbind(int slot);
  SequenceState* bound(int slot) const;
  // Whether `slot`'s state can take one more token within max_context.
  bool fits(int slot) const;

  // One token for each of `slots` (distinct, bound): ids[b] goes to slots[b] at
  // its state's length(), which then grows by one (reserve and commit happen
  // here). An empty `ids` feeds the previous step's greedy samples (the same
  // slots in the same order). Asynchronous: the results are read with
  // tokens() / logits().
  void step(std::span<const int> slots, std::span<const int32_t> ids);
  // The last step's greedy samples (argmax of each row's logits), host; waits.
  std::vector<int32_t> tokens();
  // The last step's logits rows [n, vocab], host; waits.
  std::vector<float> logits();

  // Steps run, and of those replayed from a graph.
  int64_t steps() const { return steps_; }
  // Seconds per group of ops summed over the profiled steps (Options::profile).
  const std::map<std::string, double>& profile() const { return profile_; }
  int64_t replays() const { return replays_; }

 private:
  struct Buffers;
  struct LayerTables {
    int64_t swa = -1;          // offsets (pointers) inside a slot's table region
    int64_t ring[2] = {-1, -1};
    int64_t entries = -1;
    int64_t index_keys = -1;
    int64_t cap = 0;           // entries each table holds
  };
  struct Slot {
    SequenceState* state = nullptr;
  };

  void run_ops(int64_t n);
  void layer_ops(int layer, int64_t n);
  void attention_ops(int layer, int64_t n, const float* h, float* out);
  void compress_ops(int layer, int64_t n, const CompressorWeights& cw, Ring ring, float* kv, float* score,
                    bool index_keys);
  void mark(const char* what);  // profile: the ops since the last mark were `what`
  void moe_ops(int layer, int64_t n, const float* h, float* out);
  void upload_tables(int slot);
  float* const* table(int64_t offset) const;  // column `offset` of slot 0's region (stride: slot_stride_)

  Model& model_;
  Options options_;
  bool graphs_ = false;
  std::vector<LayerTables> layout_;
  int64_t slot_stride_ = 0;      // pointers per slot region
  int64_t per_seq_scatter_ = 0;  // scatter entries per sequence per step
  std::vector<Slot> slots_;
  std::unique_ptr<Buffers> buf_;
  std::map<int64_t, std::unique_ptr<kernels::Backend::Graph>> graphs_by_n_;
  std::map<int64_t, int> runs_by_n_;
  int64_t last_n_ = 0;
  int64_t steps_ = 0, replays_ = 0;
  std::map<std::string, double> profile_;
  std::chrono::steady_clock::time_point mark_;
};

}  // namespace troupe::model
