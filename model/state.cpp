#include "model/state.hpp"

#include <algorithm>
#include <cstdlib>
#include <new>

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

namespace {
constexpr int64_t kFirstBlock = 256;  // rows of the first entry block; each later block doubles the total
}

int64_t DenseState::Blocks::rows() const {
  return blocks.empty() ? 0 : kFirstBlock << (blocks.size() - 1);
}

float* DenseState::Blocks::row(int64_t i) const {
  if (i < kFirstBlock) return blocks[0] + i * width;
  const int k = 63 - __builtin_clzll(static_cast<unsigned long long>(i / kFirstBlock));  // block k + 1
  return blocks[static_cast<size_t>(k + 1)] + (i - (kFirstBlock << k)) * width;
}

DenseState::DenseState(const ModelConfig& config, kernels::Backend* backend)
    : backend_(backend), window_(config.sliding_window) {
  for (int l = 0; l < config.num_hidden_layers; ++l) {
    Layer layer;
    layer.shape = LayerShape::of(config, l);
    layer.swa = take(window_ * config.head_dim);
    if (layer.shape.ring_slots > 0) {
      layer.ring[0] = take(layer.shape.ring_slots * layer.shape.ring_width);
      if (layer.shape.index_ring_width > 0) layer.ring[1] = take(layer.shape.ring_slots * layer.shape.index_ring_width);
    }
    layer.entries.width = layer.shape.head_dim;
    layer.index_keys.width = layer.shape.index_head_dim;
    layers_.push_back(std::move(layer));
  }
}

DenseState::~DenseState() {
  for (float* p : owned_) {
    if (backend_ != nullptr) {
      backend_->free(p);
    } else {
      std::free(p);
    }
  }
}

float* DenseState::take(int64_t floats) {
  const size_t bytes = static_cast<size_t>(std::max<int64_t>(floats, 1)) * sizeof(float);
  float* p = nullptr;
  if (backend_ != nullptr) {
    p = static_cast<float*>(backend_->alloc(bytes));
    static const std::vector<float> zeros(size_t{1} << 18);  // 1 MiB
    for (size_t at = 0; at < bytes; at += zeros.size() * sizeof(float)) {
      backend_->to_device(reinterpret_cast<char*>(p) + at, zeros.data(), std::min(bytes - at, zeros.size() * sizeof(float)));
    }
  } else {
    p = static_cast<float*>(std::calloc(bytes / sizeof(float), sizeof(float)));
    if (p == nullptr) throw std::bad_alloc();
  }
  owned_.push_back(p);
  bytes_ += bytes;
  return p;
}

void DenseState::grow(Blocks& b, int64_t rows) {
  if (b.width == 0) return;
  while (b.rows() < rows) {
    const int64_t n = b.blocks.empty() ? kFirstBlock : b.rows();
    b.blocks.push_back(take(n * b.width));
  }
}

void DenseState::reserve(int64_t new_length) {
  for (auto& l : layers_) {
    if (l.shape.rate == 0) continue;
    const int64_t n = new_length / l.shape.rate;
    grow(l.entries, n);
    grow(l.index_keys, n);
  }
}

float* DenseState::swa_row(int layer, int64_t pos) {
  auto& l = layers_[static_cast<size_t>(layer)];
  return l.swa + (pos % window_) * l.shape.head_dim;
}

float* DenseState::entry_row(int layer, int64_t i) {
  auto& l = layers_[static_cast<size_t>(layer)];
  TROUPE_CHECK(i >= 0 && i < l.entries.rows(), "entry row beyond reserve");
  return l.entries.row(i);
}

float* DenseState::index_key_row(int layer, int64_t i) {
  auto& l = layers_[static_cast<size_t>(layer)];
  TROUPE_CHECK(i >= 0 && i < l.index_keys.rows() && l.index_keys.width > 0, "index key row beyond reserve");
  return l.index_keys.row(i);
}

float* DenseState::ring_row(int layer, Ring ring, int64_t pos) {
  auto& l = layers_[static_cast<size_t>(layer)];
  const int64_t width = ring == Ring::compressor ? l.shape.ring_width : l.shape.index_ring_width;
  TROUPE_CHECK(l.ring[static_cast<int>(ring)] != nullptr, "ring row of a layer without that ring");
  return l.ring[static_cast<int>(ring)] + (pos % l.shape.ring_slots) * width;
}

}  // namespace troupe::model
