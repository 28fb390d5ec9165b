#include "cache/pool/page_pool.hpp"

#include "base/check.hpp"

namespace troupe::cache {

PagePool::PagePool(const PoolLayout& layout, SlabArena& arena)
    : layout_(layout), arena_(arena),
      per_slab_(layout.page_bytes == 0 ? 0 : static_cast<int64_t>(arena.slab_bytes() / layout.page_bytes)) {
  TROUPE_CHECK(layout.page_bytes == 0 || per_slab_ > 0, "a slab must hold at least one page");
}

PagePool::~PagePool() {
  for (auto& s : slabs_) {
    if (s.base != nullptr) arena_.give(s.base);
  }
}

bool PagePool::grow() {
  if (per_slab_ == 0) return false;
  void* base = arena_.take();
  if (base == nullptr) return false;
  size_t at = slabs_.size();
  for (size_t i = 0; i < slabs_.size(); ++i) {
    if (slabs_[i].base == nullptr) {
      at = i;
      break;
    }
  }
  if (at == slabs_.size()) {
    slabs_.emplace_back();
    refs_.resize(slabs_.size() * static_cast<size_t>(per_slab_), 0);
  }
  Slab& s = slabs_[at];
  s.base = static_cast<std::byte*>(base);
  s.used = 0;
  s.free.clear();
  for (int64_t i = per_slab_ - 1; i >= 0; --i) s.free.push_back(static_cast<int32_t>(i));
  empty_.insert(static_cast<int32_t>(at));
  ++empty_slabs_;
  ++stats_.slabs;
  stats_.capacity += per_slab_;
  return true;
}

int64_t PagePool::shrink(int64_t keep) {
  int64_t given = 0;
  // Highest slabs first: leasing prefers low ones.
  for (size_t i = slabs_.size(); i-- > 0 && empty_slabs_ > keep;) {
    Slab& s = slabs_[i];
    if (s.base == nullptr || s.used != 0) continue;
    arena_.give(s.base);
    s.base = nullptr;
    s.free.clear();
    empty_.erase(static_cast<int32_t>(i));
    --empty_slabs_;
    --stats_.slabs;
    stats_.capacity -= per_slab_;
    ++given;
  }
  return given;
}

PageId PagePool::lease() {
  std::set<int32_t>& from = partial_.empty() ? empty_ : partial_;
  if (from.empty()) return kNoPage;
  const int32_t si = *from.begin();
  from.erase(from.begin());
  Slab& s = slabs_[static_cast<size_t>(si)];
  const int32_t i = s.free.back();
  s.free.pop_back();
  if (s.used++ == 0) --empty_slabs_;
  if (!s.free.empty()) partial_.insert(si);
  const auto id = static_cast<PageId>(si * per_slab_ + i);
  refs_[static_cast<size_t>(id)] = 1;
  ++stats_.in_use;
  ++stats_.leases;
  return id;
}

void PagePool::retain(PageId page) {
  TROUPE_CHECK(page >= 0 && static_cast<size_t>(page) < refs_.size() && refs_[static_cast<size_t>(page)] > 0,
               "retain of a page that is not leased");
  ++refs_[static_cast<size_t>(page)];
}

void PagePool::release(PageId page) {
  TROUPE_CHECK(page >= 0 && static_cast<size_t>(page) < refs_.size() && refs_[static_cast<size_t>(page)] > 0,
               "release of a page that is not leased");
  if (--refs_[static_cast<size_t>(page)] > 0) return;
  const auto si = static_cast<size_t>(page / per_slab_);
  Slab& s = slabs_[si];
  s.free.push_back(static_cast<int32_t>(page % per_slab_));
  if (--s.used == 0) {
    ++empty_slabs_;
    partial_.erase(static_cast<int32_t>(si));
    empty_.insert(static_cast<int32_t>(si));
  } else if (s.free.size() == 1) {
    partial_.insert(static_cast<int32_t>(si));
  }
  --stats_.in_use;
}

int32_t PagePool::refs(PageId page) const {
  if (page < 0 || static_cast<size_t>(page) >= refs_.size()) return 0;
  return refs_[static_cast<size_t>(page)];
}

std::byte* PagePool::page(PageId page) const {
  const auto& s = slabs_[static_cast<size_t>(page / per_slab_)];
  return s.base + static_cast<size_t>(page % per_slab_) * layout_.page_bytes;
}

}  // namespace troupe::cache
