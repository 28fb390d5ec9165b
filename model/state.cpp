#include "model/state.hpp"

#include "base/check.hpp"

namespace troupe::model {

LayerShape LayerShape::of(const ModelConfig& c, int layer) {
  LayerShape s;
  s.type = c.layer_types[static_cast<size_t>(layer)];
  s.rate = c.compress_rate(layer);
  s.head_dim = c.head_dim;
  if (s.type == LayerType::csa) {
    s.index_head_dim = c.index_head_dim;
    s.ring_slots = 2 * s.rate;
    s.ring_width = 2 * (2 * c.head_dim);          // kv (a|b) + score (a|b)
    s.index_ring_width = 2 * (2 * c.index_head_dim);
  } else if (s.type == LayerType::hca) {
    s.ring_slots = s.rate;
    s.ring_width = 2 * c.head_dim;                // kv + score
  }
  return s;
}

DenseState::DenseState(const ModelConfig& config) : window_(config.sliding_window) {
  for (int l = 0; l < config.num_hidden_layers; ++l) {
    Layer layer;
    layer.shape = LayerShape::of(config, l);
    layer.swa.resize(static_cast<size_t>(window_ * config.head_dim));
    layer.ring[0].resize(static_cast<size_t>(layer.shape.ring_slots * layer.shape.ring_width));
    layer.ring[1].resize(static_cast<size_t>(layer.shape.ring_slots * layer.shape.index_ring_width));
    layers_.push_back(std::move(layer));
  }
}

void DenseState::reserve(int64_t new_length) {
  for (auto& l : layers_) {
    if (l.shape.rate == 0) continue;
    const auto n = static_cast<size_t>(new_length / l.shape.rate);
    if (l.entries.size() < n * l.shape.head_dim) l.entries.resize(n * l.shape.head_dim);
    if (l.index_keys.size() < n * l.shape.index_head_dim) l.index_keys.resize(n * l.shape.index_head_dim);
  }
}

float* DenseState::swa_row(int layer, int64_t pos) {
  auto& l = layers_[static_cast<size_t>(layer)];
  return l.swa.data() + (pos % window_) * l.shape.head_dim;
}

float* DenseState::entry_row(int layer, int64_t i) {
  auto& l = layers_[static_cast<size_t>(layer)];
  TROUPE_CHECK(static_cast<size_t>((i + 1) * l.shape.head_dim) <= l.entries.size(), "entry row beyond reserve");
  return l.entries.data() + i * l.shape.head_dim;
}

float* DenseState::index_key_row(int layer, int64_t i) {
  auto& l = layers_[static_cast<size_t>(layer)];
  TROUPE_CHECK(static_cast<size_t>((i + 1) * l.shape.index_head_dim) <= l.index_keys.size(), "index key row beyond reserve");
  return l.index_keys.data() + i * l.shape.index_head_dim;
}

float* DenseState::ring_row(int layer, Ring ring, int64_t pos) {
  auto& l = layers_[static_cast<size_t>(layer)];
  const int64_t width = ring == Ring::compressor ? l.shape.ring_width : l.shape.index_ring_width;
  return l.ring[static_cast<int>(ring)].data() + (pos % l.shape.ring_slots) * width;
}

}  // namespace troupe::model
