#include "cache/layout.hpp"

#include <fmt/format.h>

#include <numeric>

#include "base/check.hpp"
#include "base/error.hpp"

namespace troupe::cache {

const char* to_string(PoolKind k) {
  switch (k) {
    case PoolKind::window: return "window";
    case PoolKind::csa_entry: return "csa_entry";
    case PoolKind::csa_index: return "csa_index";
    case PoolKind::hca_entry: return "hca_entry";
    case PoolKind::hca_ring: return "hca_ring";
  }
  return "?";
}

namespace {

constexpr int64_t kAlign = 64;  // bytes; every section starts on a cache line
int64_t align(int64_t n) { return (n + kAlign - 1) / kAlign * kAlign; }

// Appends a section of `rows` x `width` floats at the end of the page.
Section add(PoolLayout& p, int64_t rows, int64_t width) {
  Section s{static_cast<int64_t>(p.page_bytes), width, rows};
  p.page_bytes = static_cast<size_t>(align(static_cast<int64_t>(p.page_bytes) + rows * width * 4));
  return s;
}

}  // namespace

CacheGeometry CacheGeometry::of(const model::ModelConfig& c, int64_t page_tokens) {
  CacheGeometry g;
  g.window = c.sliding_window;  // widened below to a CSA ring's span when the ring is longer
  g.layers = c.num_hidden_layers;
  for (int l = 0; l < c.num_hidden_layers; ++l) {
    g.shapes.push_back(model::LayerShape::of(c, l));
    const auto& s = g.shapes.back();
    int64_t& rate = s.type == model::LayerType::csa ? g.csa_rate : g.hca_rate;
    if (s.type == model::LayerType::sliding) continue;
    TROUPE_CHECK(rate == 0 || rate == s.rate, "one compress rate per layer type");
    rate = s.rate;
  }
  // The CSA ring rows of the last 2r tokens live in those tokens' window pages, so
  // a sequence keeps the window pages of its last max(sliding_window, 2r) tokens
  // (attention still reads only sliding_window of them).
  if (g.csa_rate > 0) g.window = std::max<int64_t>(g.window, 2 * g.csa_rate);
  int64_t unit = 1;
  if (g.csa_rate > 0) unit = std::lcm(unit, g.csa_rate);
  if (g.hca_rate > 0) unit = std::lcm(unit, g.hca_rate);
  if (page_tokens <= 0) page_tokens = (std::max<int64_t>(g.window, unit) + unit - 1) / unit * unit;
  if (page_tokens % unit != 0) {
    raise(ErrorCode::invalid_argument, "page size {} tokens is not a multiple of the compress rates (CSA {}, HCA {})",
          page_tokens, g.csa_rate, g.hca_rate);
  }
  if (g.csa_rate > 0 && page_tokens < 2 * g.csa_rate) {
    raise(ErrorCode::invalid_argument, "page size {} tokens is shorter than a CSA ring ({} tokens)", page_tokens,
          2 * g.csa_rate);
  }
  if (page_tokens < g.window && g.window % page_tokens != 0) {
    raise(ErrorCode::invalid_argument, "page size {} tokens must be at least sliding_window {} or divide it",
          page_tokens, g.window);
  }
  g.page_tokens = page_tokens;
  const int64_t P = page_tokens;

  for (PoolKind k : kAllPools) {
    auto& p = g.pools[static_cast<size_t>(index(k))];
    p.kind = k;
    p.rows.resize(static_cast<size_t>(g.layers));
    if (k == PoolKind::window) {
      p.ring[0].resize(static_cast<size_t>(g.layers));
      p.ring[1].resize(static_cast<size_t>(g.layers));
    }
  }
  auto& win = g.pools[0];
  for (int l = 0; l < g.layers; ++l) {
    const auto& s = g.shapes[static_cast<size_t>(l)];
    const auto L = static_cast<size_t>(l);
    win.rows[L] = add(win, P, s.head_dim);
    if (s.type == model::LayerType::csa) {
      win.ring[0][L] = add(win, s.ring_slots, s.ring_width);
      win.ring[1][L] = add(win, s.ring_slots, s.index_ring_width);
      auto& e = g.pools[static_cast<size_t>(index(PoolKind::csa_entry))];
      e.rows[L] = add(e, P / s.rate, s.head_dim);
      auto& ix = g.pools[static_cast<size_t>(index(PoolKind::csa_index))];
      ix.rows[L] = add(ix, P / s.rate, s.index_head_dim);
    } else if (s.type == model::LayerType::hca) {
      auto& e = g.pools[static_cast<size_t>(index(PoolKind::hca_entry))];
      e.rows[L] = add(e, P / s.rate, s.head_dim);
      auto& r = g.pools[static_cast<size_t>(index(PoolKind::hca_ring))];
      r.rows[L] = add(r, s.ring_slots, s.ring_width);
    }
  }
  return g;
}

int64_t CacheGeometry::entries_per_page(PoolKind k) const {
  switch (k) {
    case PoolKind::csa_entry:
    case PoolKind::csa_index: return csa_rate > 0 ? page_tokens / csa_rate : 0;
    case PoolKind::hca_entry: return hca_rate > 0 ? page_tokens / hca_rate : 0;
    default: return 0;
  }
}

double CacheGeometry::entry_bytes_per_token() const {
  double b = 0;
  for (PoolKind k : kEntryPools) b += static_cast<double>(pool(k).page_bytes) / static_cast<double>(page_tokens);
  return b;
}

std::string CacheGeometry::describe() const {
  std::string s = fmt::format("page {} tokens, window {}, CSA rate {}, HCA rate {}; page bytes:", page_tokens, window,
                              csa_rate, hca_rate);
  for (PoolKind k : kAllPools) s += fmt::format(" {} {}", to_string(k), pool(k).page_bytes);
  return s;
}

}  // namespace troupe::cache
