// Pages of one kind of state (cache/layout.hpp), for every layer that has it,
// cut from slabs of an arena.
//
// Ownership: a page is leased with one reference; every holder (a sequence,
// the radix tree, a copy in flight) holds one reference and releases it; the
// page is free again when the last one lets go. Only the holders of a page may
// write it, and a page that more than one holder references is immutable
// (full token pages are never written again). Not thread-safe: the engine
// thread owns pools.
#pragma once

#include <cstddef>
#include <cstdint>
#include <set>
#include <vector>

#include "cache/layout.hpp"
#include "cache/pool/slab_arena.hpp"

namespace troupe::cache {

using PageId = int32_t;
inline constexpr PageId kNoPage = -1;

struct PoolStats {
  int64_t capacity = 0;  // pages in the slabs the pool holds
  int64_t in_use = 0;    // pages with at least one reference
  int64_t slabs = 0;
  int64_t leases = 0;    // lease() calls that returned a page, ever
};

class PagePool {
 public:
  PagePool(const PoolLayout& layout, SlabArena& arena);
  ~PagePool();  // gives every slab back (pages still referenced are leaks the owner's audit reports)
  PagePool(const PagePool&) = delete;
  PagePool& operator=(const PagePool&) = delete;

  // A free page with one reference, or kNoPage when no slab the pool holds
  // has a free page (grow() first).
  PageId lease();
  void retain(PageId page);
  void release(PageId page);
  int32_t refs(PageId page) const;
  // Calls visit(page, refs) for every page in use.
  template <class Visit>
  void for_each_in_use(Visit visit) const {
    for (size_t i = 0; i < refs_.size(); ++i) {
      if (refs_[i] > 0) visit(static_cast<PageId>(i), refs_[i]);
    }
  }

  // Takes one slab from the arena; false when the arena has none.
  bool grow();
  // Gives fully free slabs back to the arena, keeping `keep` of them. Returns
  // how many went back.
  int64_t shrink(int64_t keep = 0);

  std::byte* page(PageId page) const;
  float* row(PageId page, const Section& s, int64_t row) const {
    return reinterpret_cast<float*>(this->page(page) + s.offset) + row * s.width;
  }

  const PoolLayout& layout() const { return layout_; }
  int64_t pages_per_slab() const { return per_slab_; }
  int64_t free_pages() const { return stats_.capacity - stats_.in_use; }
  // Free pages in slabs that are not entirely free (what leasing uses before empty slabs).
  int64_t free_in_partial_slabs() const { return free_pages() - empty_slabs_ * per_slab_; }
  int64_t empty_slabs() const { return empty_slabs_; }
  const PoolStats& stats() const { return stats_; }

 private:
  struct Slab {
    std::byte* base = nullptr;  // null: a hole left by shrink()
    int32_t used = 0;
    std::vector<int32_t> free;  // page indices within the slab, lowest last
  };
  const PoolLayout& layout_;
  SlabArena& arena_;
  int64_t per_slab_;
  std::vector<Slab> slabs_;
  std::vector<int32_t> refs_;  // per page id
  // Slabs with a free page: partly used ones are leased from first (lowest
  // first), so empty slabs stay empty for other pools (can_lease counts on it).
  std::set<int32_t> partial_;
  std::set<int32_t> empty_;
  int64_t empty_slabs_ = 0;
  PoolStats stats_;
};

}  // namespace troupe::cache
