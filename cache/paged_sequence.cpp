#include "cache/paged_sequence.hpp"

#include <algorithm>

#include "base/error.hpp"

namespace troupe::cache {

PagedSequence::PagedSequence(const Tiers& tiers, bool checkpoints, int64_t checkpoint_every)
    : tiers_(tiers), g_(tiers.geometry()), P_(g_.page_tokens), checkpoints_(checkpoints),
      checkpoint_every_(checkpoint_every) {}

PagedSequence::~PagedSequence() { clear(); }

void PagedSequence::clear() {
  for (auto& tp : pages_) {
    for (PoolKind k : kAllPools) {
      if (tp.at(k).valid()) tiers_.release(k, tp.at(k));
    }
  }
  pages_.clear();
  complete_.clear();
  trim_from_ = 0;
  stored_from_ = 0;
  ring_stored_from_ = 0;
  if (hca_ring_.valid()) tiers_.release(PoolKind::hca_ring, hca_ring_);
  hca_ring_ = {};
  length_ = 0;
}

void PagedSequence::adopt(std::span<const TokenPage> pages, int64_t length) {
  TROUPE_CHECK(length_ == 0 && pages_.empty(), "adopt() starts a fresh sequence");
  TROUPE_CHECK(length % P_ == 0 && static_cast<int64_t>(pages.size()) == length / P_, "adopt() takes whole pages");
  // Only the window being resumed from is needed; older checkpoint windows stay with the tree.
  trim_from_ = std::max<int64_t>(0, length - g_.window) / P_;
  pages_.assign(pages.begin(), pages.end());
  for (int64_t k = 0; k < static_cast<int64_t>(pages_.size()); ++k) {
    auto& tp = pages_[static_cast<size_t>(k)];
    if (k < trim_from_) tp.window() = {};
    TROUPE_CHECK(k < trim_from_ || tp.window().valid(), "adopted prefix lacks its window pages");
    for (PoolKind kind : kAllPools) {
      if (tp.at(kind).valid()) tiers_.retain(kind, tp.at(kind));
    }
  }
  length_ = length;
  stored_from_ = std::max<int64_t>(0, length - g_.window);
  ring_stored_from_ = std::max<int64_t>(0, length - g_.csa_rate);
  complete_.assign(static_cast<size_t>(length / P_), 0);
  if (length > 0) complete_.back() = 1;
}

void PagedSequence::restore(std::vector<TokenPage> pages, PageRef hca_ring, int64_t length) {
  TROUPE_CHECK(length_ == 0 && pages_.empty() && !hca_ring_.valid(), "restore() starts a fresh sequence");
  TROUPE_CHECK(static_cast<int64_t>(pages.size()) >= length / P_, "restore() needs every full page");
  pages_ = std::move(pages);
  hca_ring_ = hca_ring;
  length_ = length;
  stored_from_ = std::max<int64_t>(0, length - g_.window);
  ring_stored_from_ = std::max<int64_t>(0, length - g_.csa_rate);
  trim_from_ = stored_from_ / P_;
  complete_.assign(static_cast<size_t>(length / P_), 0);
  // The window of the last page boundary came along if the exporter kept it.
  const int64_t last = length / P_;
  bool held = last > 0;
  for (int64_t k = std::max<int64_t>(0, last * P_ - g_.window) / P_; k < last; ++k) {
    held &= pages_[static_cast<size_t>(k)].window().valid();
  }
  if (held) complete_.back() = 1;
  for (int64_t k = std::max<int64_t>(0, length - g_.window) / P_; k < g_.pages_for(length); ++k) {
    TROUPE_CHECK(pages_[static_cast<size_t>(k)].window().valid(), "restored state lacks its window pages");
  }
}

std::vector<int64_t> PagedSequence::checkpoints(int64_t start, int64_t end) const {
  std::vector<int64_t> out;
  if (!checkpoints_) return out;
  const int64_t last = (end - 1) / P_;
  for (int64_t k = start / P_ + 1; k <= last; ++k) {
    if (k == last || (checkpoint_every_ > 0 && k % checkpoint_every_ == 0)) out.push_back(k * P_);
  }
  return out;
}

template <class Visit>
void PagedSequence::plan(int64_t new_length, Visit visit) const {
  const int64_t have = static_cast<int64_t>(pages_.size());
  const int64_t want = g_.pages_for(new_length);
  for (int64_t k = have; k < want; ++k) {
    for (PoolKind kind : kEntryPools) {
      if (g_.has(kind)) visit(k, kind);
    }
  }
  // Window pages for what the forward stores: each checkpoint's window and the
  // chunk's last window (the window being read, before length_, is held).
  int64_t next = 0;  // pages below `next` are visited or held
  auto cover = [&](int64_t lo, int64_t hi) {
    lo = std::max<int64_t>(lo, 0);
    if (hi <= lo) return;
    for (int64_t k = std::max(next, lo / P_); k <= (hi - 1) / P_; ++k) {
      if (k >= have || !pages_[static_cast<size_t>(k)].window().valid()) visit(k, PoolKind::window);
    }
    next = std::max(next, (hi - 1) / P_ + 1);
  };
  if (new_length > length_) {
    for (int64_t b : checkpoints(length_, new_length)) cover(std::max(length_, b - g_.window), b);
    cover(std::max(length_, new_length - g_.window), new_length);
  }
  if (g_.has(PoolKind::hca_ring) && !hca_ring_.valid()) visit(-1, PoolKind::hca_ring);
}

PoolCounts PagedSequence::pages_needed(int64_t new_length) const {
  PoolCounts n{};
  plan(new_length, [&](int64_t, PoolKind kind) { ++n[static_cast<size_t>(index(kind))]; });
  return n;
}

void PagedSequence::reserve(int64_t new_length) {
  if (new_length <= length_) return;
  const auto want = static_cast<size_t>(g_.pages_for(new_length));
  std::vector<std::pair<int64_t, PoolKind>> todo;
  plan(new_length, [&](int64_t k, PoolKind kind) { todo.emplace_back(k, kind); });
  if (pages_.size() < want) pages_.resize(want);
  for (auto [k, kind] : todo) {
    const PageId id = tiers_.device().lease(kind);
    if (id == kNoPage) {
      raise(ErrorCode::resource_exhausted, "the {} pool of the device tier is full", to_string(kind));
    }
    PageRef& r = k < 0 ? hca_ring_ : pages_[static_cast<size_t>(k)].at(kind);
    TROUPE_CHECK(!r.valid(), "reserve over a held page");
    r = PageRef{id, Tier::device};
  }
}

void PagedSequence::commit(int64_t new_length) {
  const int64_t start = length_, W = g_.window;
  if (new_length <= start) return;
  // The forward stored the window rows of the chunk's last window (all of a
  // chunk no longer than a window) and the CSA ring rows of its last 2r
  // tokens, plus both for each checkpoint. A boundary B is resumable when the
  // window rows [B - window, B) and the ring rows [B - r, B) are stored.
  const int64_t R = 2 * g_.csa_rate;  // ring rows stored per chunk (0 without CSA layers)
  const int64_t stored = new_length - W <= start ? stored_from_ : new_length - W;
  const int64_t ring_stored = new_length - R <= start ? ring_stored_from_ : new_length - R;
  const auto cps = checkpoints(start, new_length);
  if (complete_.size() < static_cast<size_t>(new_length / P_)) complete_.resize(static_cast<size_t>(new_length / P_), 0);
  for (int64_t k = start / P_ + 1; k <= new_length / P_; ++k) {
    const int64_t b = k * P_;
    const bool checkpoint = std::find(cps.begin(), cps.end(), b) != cps.end();
    const bool rows = std::max<int64_t>(0, b - W) >= stored && std::max<int64_t>(0, b - g_.csa_rate) >= ring_stored;
    if (checkpoint || rows) complete_[static_cast<size_t>(k - 1)] = 1;
  }
  stored_from_ = stored;
  ring_stored_from_ = ring_stored;
  length_ = new_length;
}

void PagedSequence::trim() {
  const int64_t keep_from = std::max<int64_t>(0, std::min(length_ - g_.window, length_ / P_ * P_ - g_.window));
  const int64_t until = std::min<int64_t>(keep_from / P_, static_cast<int64_t>(pages_.size()));
  for (int64_t k = trim_from_; k < until; ++k) {
    PageRef& r = pages_[static_cast<size_t>(k)].window();
    if (r.valid()) {
      tiers_.release(PoolKind::window, r);
      r = {};
    }
  }
  trim_from_ = std::max(trim_from_, until);
}

const PageRef& PagedSequence::window_page(int64_t pos) const {
  const auto k = static_cast<size_t>(pos / P_);
  TROUPE_CHECK(pos >= 0 && k < pages_.size() && pages_[k].window().valid(), "window row of a position without a window page");
  return pages_[k].window();
}

float* PagedSequence::swa_row(int layer, int64_t pos) {
  const auto& s = g_.pool(PoolKind::window).rows[static_cast<size_t>(layer)];
  return tiers_.row(PoolKind::window, window_page(pos), s, pos % P_);
}

float* PagedSequence::entry_row(int layer, int64_t i) {
  const auto type = g_.shapes[static_cast<size_t>(layer)].type;
  TROUPE_CHECK(type != model::LayerType::sliding, "entry row of a sliding layer");
  const PoolKind kind = type == model::LayerType::csa ? PoolKind::csa_entry : PoolKind::hca_entry;
  const int64_t per = g_.entries_per_page(kind);
  const auto k = static_cast<size_t>(i / per);
  TROUPE_CHECK(k < pages_.size() && pages_[k].at(kind).valid(), "entry row beyond reserve");
  return tiers_.row(kind, pages_[k].at(kind), g_.pool(kind).rows[static_cast<size_t>(layer)], i % per);
}

float* PagedSequence::index_key_row(int layer, int64_t i) {
  const int64_t per = g_.entries_per_page(PoolKind::csa_index);
  const auto k = static_cast<size_t>(i / per);
  TROUPE_CHECK(per > 0 && k < pages_.size() && pages_[k].at(PoolKind::csa_index).valid(), "index key row beyond reserve");
  return tiers_.row(PoolKind::csa_index, pages_[k].at(PoolKind::csa_index),
                    g_.pool(PoolKind::csa_index).rows[static_cast<size_t>(layer)], i % per);
}

float* PagedSequence::ring_row(int layer, model::Ring ring, int64_t pos) {
  const auto& shape = g_.shapes[static_cast<size_t>(layer)];
  if (shape.type == model::LayerType::csa) {
    const auto& s = g_.pool(PoolKind::window).ring[static_cast<int>(ring)][static_cast<size_t>(layer)];
    return tiers_.row(PoolKind::window, window_page(pos), s, pos % shape.ring_slots);
  }
  TROUPE_CHECK(shape.type == model::LayerType::hca && ring == model::Ring::compressor && hca_ring_.valid(),
               "ring row without a ring");
  return tiers_.row(PoolKind::hca_ring, hca_ring_, g_.pool(PoolKind::hca_ring).rows[static_cast<size_t>(layer)],
                    pos % shape.ring_slots);
}

void PagedSequence::replace(int64_t k, PoolKind kind, PageRef to) {
  PageRef& r = kind == PoolKind::hca_ring ? hca_ring_ : pages_[static_cast<size_t>(k)].at(kind);
  TROUPE_CHECK(r.valid(), "replace of an absent page");
  tiers_.release(kind, r);
  r = to;
}

std::vector<TokenPage> PagedSequence::prefix_for_tree(int64_t every) const {
  const int64_t full = full_pages();
  std::vector<TokenPage> out(pages_.begin(), pages_.begin() + full);
  std::vector<uint8_t> keep(static_cast<size_t>(full), 0);
  const int64_t span = (g_.window + P_ - 1) / P_;  // pages of one window
  for (int64_t b = 1; b <= full; ++b) {
    if (!window_complete(b - 1) || (b != full && (every <= 0 || b % every != 0))) continue;
    bool held = true;
    for (int64_t k = std::max<int64_t>(0, b - span); k < b; ++k) held &= out[static_cast<size_t>(k)].window().valid();
    if (!held) continue;
    for (int64_t k = std::max<int64_t>(0, b - span); k < b; ++k) keep[static_cast<size_t>(k)] = 1;
  }
  for (int64_t k = 0; k < full; ++k) {
    if (keep[static_cast<size_t>(k)] == 0) out[static_cast<size_t>(k)].window() = {};
    out[static_cast<size_t>(k)].checkpoint = false;
  }
  for (int64_t b = 1; b <= full; ++b) {
    if (!window_complete(b - 1)) continue;
    bool held = true;
    for (int64_t k = std::max<int64_t>(0, b - span); k < b; ++k) held &= out[static_cast<size_t>(k)].window().valid();
    out[static_cast<size_t>(b - 1)].checkpoint = held;
  }
  return out;
}

std::vector<std::pair<PoolKind, PageRef>> PagedSequence::held() const {
  std::vector<std::pair<PoolKind, PageRef>> out;
  for (const auto& tp : pages_) {
    for (PoolKind k : kAllPools) {
      if (tp.at(k).valid()) out.emplace_back(k, tp.at(k));
    }
  }
  if (hca_ring_.valid()) out.emplace_back(PoolKind::hca_ring, hca_ring_);
  return out;
}

}  // namespace troupe::cache
