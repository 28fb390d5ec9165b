// The shapes of the cache: which pools a model needs, what one page of each
// holds, and how a sequence's virtual token index maps onto pages.
//
// A sequence's tokens are cut into token pages of `page_tokens` (P) tokens.
// Token page k (tokens [kP, (k+1)P)) has one page in each entry pool, and a
// window page while its raw kv is needed:
//
//   pool        per layer that has it, rows of one page             shadow of token pos / entry i
//   window      SWA: P rows of head_dim (every layer)               page pos/P, row pos%P
//               CSA inflight rings, nested: 2r rows (kv+score,      page pos/P, slot pos%(2r)
//               compressor and indexer)
//   csa_entry   P/r_csa entries of head_dim (CSA layers)            page i/(P/r), row i%(P/r)
//   csa_index   P/r_csa indexer keys of index_head_dim (CSA)        same
//   hca_entry   P/r_hca entries of head_dim (HCA layers)            same with r_hca
//   hca_ring    r_hca rows of kv+score (HCA layers); one page per   slot pos%r_hca
//               running sequence, not per token page
//
// No table per token: page tables hold one entry per token page, and rows are
// found by arithmetic. P is a multiple of both compress rates, so a page
// boundary closes every compression window (the HCA ring is empty there) and
// the CSA ring of the last 2r tokens of a page lives in that page's window:
// a page boundary is resumable exactly from (window pages, entry pages).
// A page holds the rows of every layer, so moving a page is one copy.
#pragma once

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "model/config.hpp"
#include "model/state.hpp"

namespace troupe::cache {

enum class PoolKind : uint8_t { window = 0, csa_entry = 1, csa_index = 2, hca_entry = 3, hca_ring = 4 };
inline constexpr int kPoolKinds = 5;
inline constexpr std::array<PoolKind, kPoolKinds> kAllPools = {PoolKind::window, PoolKind::csa_entry,
                                                                PoolKind::csa_index, PoolKind::hca_entry,
                                                                PoolKind::hca_ring};
// The entry pools: one page per token page, kept for the whole prefix.
inline constexpr std::array<PoolKind, 3> kEntryPools = {PoolKind::csa_entry, PoolKind::csa_index, PoolKind::hca_entry};
const char* to_string(PoolKind k);
inline int index(PoolKind k) { return static_cast<int>(k); }

// Pages (or anything else) per pool.
using PoolCounts = std::array<int64_t, kPoolKinds>;

// Where one layer's rows sit inside a page.
struct Section {
  int64_t offset = -1;  // bytes from the page start; -1: the layer has none here
  int64_t width = 0;    // floats per row
  int64_t rows = 0;
  bool present() const { return offset >= 0; }
};

struct PoolLayout {
  PoolKind kind = PoolKind::window;
  size_t page_bytes = 0;               // 0: the model has no state of this kind
  std::vector<Section> rows;           // per layer
  std::vector<Section> ring[2];        // window pool: the nested CSA rings (compressor, indexer) per layer
  bool present() const { return page_bytes > 0; }
};

struct CacheGeometry {
  int64_t page_tokens = 0;  // P
  int64_t window = 0;       // raw tokens whose window pages a sequence keeps: max(sliding_window, 2 r_csa)
  int64_t csa_rate = 0;     // 0 without CSA layers
  int64_t hca_rate = 0;     // 0 without HCA layers
  int64_t layers = 0;
  std::vector<model::LayerShape> shapes;
  std::array<PoolLayout, kPoolKinds> pools;

  // page_tokens 0 picks the default: sliding_window rounded up to a multiple
  // of both rates. Throws troupe::Error(invalid_argument) for a page size the
  // cache cannot use (not a multiple of the rates, shorter than a CSA ring).
  static CacheGeometry of(const model::ModelConfig& config, int64_t page_tokens = 0);

  const PoolLayout& pool(PoolKind k) const { return pools[static_cast<size_t>(index(k))]; }
  bool has(PoolKind k) const { return pool(k).present(); }
  // The page of the largest pool (a slab holds at least one of every pool's).
  size_t largest_page_bytes() const {
    size_t largest = 0;
    for (const auto& p : pools) largest = std::max(largest, p.page_bytes);
    return largest;
  }
  // Entries (of the pool's rate) per token page.
  int64_t entries_per_page(PoolKind k) const;
  // Token pages that cover tokens [0, n).
  int64_t pages_for(int64_t tokens) const { return (tokens + page_tokens - 1) / page_tokens; }
  // Bytes of state one token adds in the entry pools (amortised), and the
  // bytes a running sequence holds regardless of length (window pages, rings).
  double entry_bytes_per_token() const;
  std::string describe() const;
};

}  // namespace troupe::cache
