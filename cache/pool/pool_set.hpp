// The pools of one tier (device or host): one PagePool per kind of state on
// one SlabArena, so the byte budget is shared and pages move between pools.
// Not thread-safe: the engine thread owns it.
#pragma once

#include <array>
#include <memory>

#include "cache/layout.hpp"
#include "cache/memory.hpp"
#include "cache/pool/page_pool.hpp"
#include "cache/pool/slab_arena.hpp"

namespace troupe::cache {

class PoolSet {
 public:
  // `budget_bytes` of `memory` (owned) for all pools. slab_bytes 0: a default
  // that holds a few of the largest pages. `initial` pages per pool are taken
  // up front (a plan, cache/planner.hpp); the rest is taken on demand.
  PoolSet(const CacheGeometry& geometry, std::unique_ptr<Memory> memory, uint64_t budget_bytes,
          size_t slab_bytes = 0, const PoolCounts& initial = {});
  ~PoolSet();
  PoolSet(const PoolSet&) = delete;
  PoolSet& operator=(const PoolSet&) = delete;

  Tier tier() const { return memory_->tier(); }
  Memory& memory() const { return *memory_; }
  const CacheGeometry& geometry() const { return geometry_; }
  SlabArena& arena() { return *arena_; }
  const SlabArena& arena() const { return *arena_; }
  PagePool& pool(PoolKind k) { return *pools_[static_cast<size_t>(index(k))]; }
  const PagePool& pool(PoolKind k) const { return *pools_[static_cast<size_t>(index(k))]; }

  // A page with one reference, growing the pool from the arena or from empty
  // slabs of the other pools; kNoPage when the tier is full.
  PageId lease(PoolKind k);
  void retain(PoolKind k, PageId p) { pool(k).retain(p); }
  void release(PoolKind k, PageId p) { pool(k).release(p); }
  float* row(PoolKind k, PageId p, const Section& s, int64_t r) const { return pool(k).row(p, s, r); }

  // Whether `need[k]` more pages of every kind k could be leased now, all together.
  bool can_lease(const PoolCounts& need) const;
  // Pages of kind k leasable now if no other pool took any.
  int64_t available(PoolKind k) const;
  int64_t in_use(PoolKind k) const { return pool(k).stats().in_use; }
  int64_t total_in_use() const;
  uint64_t bytes_in_use() const;

  static size_t default_slab_bytes(const CacheGeometry& geometry);

 private:
  const CacheGeometry& geometry_;
  std::unique_ptr<Memory> memory_;
  std::unique_ptr<SlabArena> arena_;
  std::array<std::unique_ptr<PagePool>, kPoolKinds> pools_;
};

}  // namespace troupe::cache
