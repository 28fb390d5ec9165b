// model::SequenceState over the paged pools: the state of one running
// sequence as page tables (one TokenPage per page_tokens tokens) plus its HCA
// ring, with rows found by arithmetic (cache/layout.hpp).
//
// Ownership: the sequence holds one reference on every page in its tables and
// releases them all when it dies (an aborted sequence leaks nothing). Pages it
// adopted from the radix tree are shared and never written: the sequence only
// writes rows at positions >= the adopted length, which lie in pages it leased.
// Engine thread only.
#pragma once

#include <span>
#include <vector>

#include "cache/pool/tiers.hpp"
#include "model/state.hpp"

namespace troupe::cache {

class PagedSequence final : public model::SequenceState {
 public:
  // Checkpoints (SequenceState::checkpoints) are asked for at the last page
  // boundary of every chunk, and at every `checkpoint_every` pages when > 0,
  // so those boundaries can be inserted into the radix tree as resumable.
  PagedSequence(const Tiers& tiers, bool checkpoints = true, int64_t checkpoint_every = 0);
  ~PagedSequence() override;
  PagedSequence(const PagedSequence&) = delete;
  PagedSequence& operator=(const PagedSequence&) = delete;

  // Starts an empty sequence at `length` tokens on a prefix's pages (from the
  // radix tree), retaining them. `length` must be a page boundary, `pages`
  // length/page_tokens long, with window pages covering [length - window, length).
  void adopt(std::span<const TokenPage> pages, int64_t length);

  // Starts an empty sequence at `length` tokens on pages whose references the
  // caller hands over (an imported state): the window pages must cover
  // [length - window, length) and the HCA ring the open window.
  void restore(std::vector<TokenPage> pages, PageRef hca_ring, int64_t length);

  // Device pages per pool that reserve(new_length) would lease.
  PoolCounts pages_needed(int64_t new_length) const;

  // ---- model::SequenceState -------------------------------------------------
  int64_t length() const override { return length_; }
  // Leases device pages; throws troupe::Error(resource_exhausted) when a pool
  // is full (callers check pages_needed() against the pools first).
  void reserve(int64_t new_length) override;
  void commit(int64_t new_length) override;
  std::vector<int64_t> checkpoints(int64_t start, int64_t end) const override;
  float* swa_row(int layer, int64_t pos) override;
  float* entry_row(int layer, int64_t i) override;
  float* index_key_row(int layer, int64_t i) override;
  float* ring_row(int layer, model::Ring ring, int64_t pos) override;

  // Releases the window pages nothing needs any more: those wholly before
  // min(length - window, last page boundary - window). The window of the last
  // page boundary stays, so the prefix up to it can be inserted as resumable.
  void trim();

  // ---- page tables (for the radix tree and the tiers) --------------------------
  const Tiers& tiers() const { return tiers_; }
  int64_t page_tokens() const { return P_; }
  std::span<const TokenPage> pages() const { return pages_; }
  // Token pages [0, length / page_tokens) are full and immutable.
  int64_t full_pages() const { return length_ / P_; }
  // Whether boundary B = (k+1) * page_tokens is resumable from the window
  // pages of [B - window, B): their window rows and the CSA ring rows of the
  // last open window before B were all stored.
  bool window_complete(int64_t k) const {
    return k >= 0 && static_cast<size_t>(k) < complete_.size() && complete_[static_cast<size_t>(k)] != 0;
  }
  PageRef hca_ring() const { return hca_ring_; }
  // Token pages [0, full_pages()) to insert into the radix tree, with the
  // window pages of the checkpoints worth keeping: the last page boundary and,
  // when every > 0, every every-th boundary whose window is complete.
  std::vector<TokenPage> prefix_for_tree(int64_t every) const;
  // Points page k's `kind` (or the HCA ring, with k ignored) at `to`, taking
  // over the caller's reference on `to` and releasing the one on the old page.
  // For moves between tiers whose contents were copied.
  void replace(int64_t k, PoolKind kind, PageRef to);
  // Every page reference held, for audits: (kind, ref).
  std::vector<std::pair<PoolKind, PageRef>> held() const;
  // Releases every page and restarts at length 0.
  void clear();

 private:
  // Calls visit(k, kind) for every page reserve(new_length) must lease
  // (k = -1 for the HCA ring).
  template <class Visit>
  void plan(int64_t new_length, Visit visit) const;
  const PageRef& window_page(int64_t pos) const;

  Tiers tiers_;
  const CacheGeometry& g_;
  int64_t P_;
  bool checkpoints_;
  int64_t checkpoint_every_;
  int64_t length_ = 0;
  int64_t trim_from_ = 0;  // no window page is held below this token page
  int64_t stored_from_ = 0;       // window rows of [stored_from_, length_) are all stored
  int64_t ring_stored_from_ = 0;  // CSA ring rows of [ring_stored_from_, length_) are all stored
  std::vector<uint8_t> complete_;  // per token page: window_complete()
  std::vector<TokenPage> pages_;
  PageRef hca_ring_;
};

}  // namespace troupe::cache
