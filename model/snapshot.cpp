#include "model/snapshot.hpp"

#include <algorithm>

#include "base/error.hpp"

namespace troupe::model {

const char* to_string(StateKind k) {
  switch (k) {
    case StateKind::swa_window: return "swa_window";
    case StateKind::entries: return "entries";
    case StateKind::index_keys: return "index_keys";
    case StateKind::compressor_ring: return "compressor_ring";
    case StateKind::indexer_ring: return "indexer_ring";
  }
  return "?";
}

std::vector<SnapshotSegment> snapshot_layout(const ModelConfig& c, int64_t length) {
  std::vector<SnapshotSegment> segs;
  uint64_t offset = 0;
  auto add = [&](StateKind kind, int layer, int64_t first, int64_t rows, int64_t width) {
    if (rows <= 0) return;
    segs.push_back({kind, layer, first, rows, width, offset});
    offset += static_cast<uint64_t>(rows * width) * sizeof(float);
  };
  for (int l = 0; l < c.num_hidden_layers; ++l) {
    const auto shape = LayerShape::of(c, l);
    const int64_t w0 = std::max<int64_t>(0, length - c.sliding_window);
    add(StateKind::swa_window, l, w0, length - w0, c.head_dim);
    if (shape.rate == 0) continue;
    add(StateKind::entries, l, 0, length / shape.rate, c.head_dim);
    if (shape.type == LayerType::csa) add(StateKind::index_keys, l, 0, length / shape.rate, c.index_head_dim);
    add(StateKind::compressor_ring, l, 0, shape.ring_slots, shape.ring_width);
    if (shape.type == LayerType::csa) add(StateKind::indexer_ring, l, 0, shape.ring_slots, shape.index_ring_width);
  }
  return segs;
}

namespace {

// The row of segment `s` numbered `i` in `state`; ring rows are addressed by a
// position with that slot (slot i is position i).
float* row_of(SequenceState& state, const SnapshotSegment& s, int64_t i) {
  const int64_t r = s.first_row + i;
  switch (s.kind) {
    case StateKind::swa_window: return state.swa_row(s.layer, r);
    case StateKind::entries: return state.entry_row(s.layer, r);
    case StateKind::index_keys: return state.index_key_row(s.layer, r);
    case StateKind::compressor_ring: return state.ring_row(s.layer, Ring::compressor, r);
    case StateKind::indexer_ring: return state.ring_row(s.layer, Ring::indexer, r);
  }
  return nullptr;
}

}  // namespace

StateSnapshot take_snapshot(const ModelConfig& config, SequenceState& state, kernels::Backend& backend) {
  StateSnapshot snap;
  snap.length = state.length();
  snap.segments = snapshot_layout(config, snap.length);
  uint64_t total = 0;
  for (const auto& s : snap.segments) total += static_cast<uint64_t>(s.rows * s.row_floats);
  snap.data.resize(total);
  for (const auto& s : snap.segments) {
    float* dst = snap.data.data() + s.offset / sizeof(float);
    for (int64_t i = 0; i < s.rows; ++i) {
      backend.to_host(dst + i * s.row_floats, row_of(state, s, i), static_cast<size_t>(s.row_floats) * sizeof(float));
    }
  }
  backend.synchronize();
  return snap;
}

void restore_snapshot(const ModelConfig& config, const StateSnapshot& snap, SequenceState& state,
                      kernels::Backend& backend) {
  if (state.length() != 0) raise(ErrorCode::invalid_argument, "restore: the target sequence is not empty");
  const auto want = snapshot_layout(config, snap.length);
  bool same = want.size() == snap.segments.size();
  for (size_t i = 0; same && i < want.size(); ++i) {
    const auto &a = want[i], &b = snap.segments[i];
    same = a.kind == b.kind && a.layer == b.layer && a.first_row == b.first_row && a.rows == b.rows &&
           a.row_floats == b.row_floats && a.offset == b.offset;
  }
  uint64_t floats = 0;
  for (const auto& s : want) floats += static_cast<uint64_t>(s.rows * s.row_floats);
  if (!same || floats != snap.data.size()) {
    raise(ErrorCode::invalid_argument, "restore: the state layout does not match this model ({} tokens)", snap.length);
  }
  state.reserve(snap.length);
  for (const auto& s : snap.segments) {
    const float* src = snap.data.data() + s.offset / sizeof(float);
    for (int64_t i = 0; i < s.rows; ++i) {
      backend.to_device(row_of(state, s, i), src + i * s.row_floats, static_cast<size_t>(s.row_floats) * sizeof(float));
    }
  }
  backend.synchronize();
  state.commit(snap.length);
}

}  // namespace troupe::model
