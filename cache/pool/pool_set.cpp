#include "cache/pool/pool_set.hpp"

#include <algorithm>

namespace troupe::cache {

size_t PoolSet::default_slab_bytes(const CacheGeometry& g) {
  const size_t unit = 64 * 1024;
  return std::max<size_t>(unit, (g.largest_page_bytes() * 4 + unit - 1) / unit * unit);
}

PoolSet::PoolSet(const CacheGeometry& geometry, std::unique_ptr<Memory> memory, uint64_t budget_bytes,
                 size_t slab_bytes, const PoolCounts& initial)
    : geometry_(geometry), memory_(std::move(memory)) {
  if (slab_bytes == 0) slab_bytes = default_slab_bytes(geometry);
  arena_ = std::make_unique<SlabArena>(*memory_, slab_bytes, budget_bytes);
  for (PoolKind k : kAllPools) {
    pools_[static_cast<size_t>(index(k))] = std::make_unique<PagePool>(geometry_.pool(k), *arena_);
  }
  for (PoolKind k : kAllPools) {
    auto& p = pool(k);
    while (p.stats().capacity < initial[static_cast<size_t>(index(k))] && p.grow()) {
    }
  }
}

PoolSet::~PoolSet() {
  for (auto& p : pools_) p.reset();
}

PageId PoolSet::lease(PoolKind k) {
  auto& p = pool(k);
  if (!p.layout().present()) return kNoPage;
  PageId id = p.lease();
  if (id != kNoPage) return id;
  if (!p.grow()) {
    // Move an empty slab over from another pool.
    bool moved = false;
    for (PoolKind other : kAllPools) {
      if (other != k && pool(other).shrink(0) > 0) {
        moved = true;
        break;
      }
    }
    if (!moved || !p.grow()) return kNoPage;
  }
  return p.lease();
}

bool PoolSet::can_lease(const PoolCounts& need) const {
  int64_t slabs_needed = 0, slabs_spare = arena_->slabs_free();
  for (PoolKind k : kAllPools) {
    const auto& p = pool(k);
    const int64_t n = need[static_cast<size_t>(index(k))];
    slabs_spare += p.empty_slabs();
    if (n <= 0) continue;
    if (!p.layout().present()) return false;
    const int64_t beyond = n - p.free_in_partial_slabs();
    if (beyond > 0) slabs_needed += (beyond + p.pages_per_slab() - 1) / p.pages_per_slab();
  }
  return slabs_needed <= slabs_spare;
}

int64_t PoolSet::available(PoolKind k) const {
  const auto& p = pool(k);
  if (!p.layout().present()) return 0;
  int64_t slabs = arena_->slabs_free();
  for (PoolKind o : kAllPools) slabs += pool(o).empty_slabs();
  return p.free_in_partial_slabs() + slabs * p.pages_per_slab();
}

int64_t PoolSet::total_in_use() const {
  int64_t n = 0;
  for (PoolKind k : kAllPools) n += in_use(k);
  return n;
}

uint64_t PoolSet::bytes_in_use() const {
  uint64_t n = 0;
  for (PoolKind k : kAllPools) n += static_cast<uint64_t>(in_use(k)) * pool(k).layout().page_bytes;
  return n;
}

}  // namespace troupe::cache
