// A sequence's state as one host buffer: what moves when a request changes
// worker (PD handoff, migration on drain, resume after a park on another
// worker). Layout-typed: the buffer is a list of segments, each one kind of
// state of one layer, so a receiver checks the layout before it trusts bytes.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "kernels/backend.hpp"
#include "model/config.hpp"
#include "model/state.hpp"

namespace troupe::model {

enum class StateKind : uint8_t {
  swa_window = 0,     // raw kv rows of the last sliding_window positions
  entries = 1,        // compressed entries (CSA or HCA)
  index_keys = 2,     // CSA indexer keys
  compressor_ring = 3,  // inflight ring of the compressor (all slots)
  indexer_ring = 4,   // inflight ring of the CSA indexer (all slots)
};
const char* to_string(StateKind k);

struct SnapshotSegment {
  StateKind kind;
  int32_t layer = 0;
  int64_t first_row = 0;  // position (window), entry index, or ring slot
  int64_t rows = 0;
  int64_t row_floats = 0;
  uint64_t offset = 0;    // byte offset in the data
};

struct StateSnapshot {
  int64_t length = 0;                    // tokens folded into the state
  std::vector<SnapshotSegment> segments;
  std::vector<float> data;               // fp32 rows, segment after segment

  uint64_t bytes() const { return data.size() * sizeof(float); }
};

// The segments a sequence of `length` tokens has under `config` (offsets filled).
std::vector<SnapshotSegment> snapshot_layout(const ModelConfig& config, int64_t length);

// Reads every row of `state` (backend memory) into a host snapshot.
StateSnapshot take_snapshot(const ModelConfig& config, SequenceState& state, kernels::Backend& backend);

// Writes `snap` into an empty `state` (length 0) and commits its length.
// Throws troupe::Error(invalid_argument) when the layout does not match the config.
void restore_snapshot(const ModelConfig& config, const StateSnapshot& snap, SequenceState& state,
                      kernels::Backend& backend);

}  // namespace troupe::model
