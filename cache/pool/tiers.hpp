// References to pages in either tier, and the pair of tiers they live in.
#pragma once

#include <array>

#include "base/check.hpp"
#include "cache/pool/pool_set.hpp"

namespace troupe::cache {

struct PageRef {
  PageId id = kNoPage;
  Tier tier = Tier::device;
  bool valid() const { return id != kNoPage; }
  bool on(Tier t) const { return valid() && tier == t; }
  friend bool operator==(const PageRef&, const PageRef&) = default;
};

// The pages behind one token page: a window page (absent once outside every
// window and not a checkpoint) and one page per entry pool. The hca_ring slot
// is unused: that ring belongs to a running sequence, not to a token page.
struct TokenPage {
  std::array<PageRef, kPoolKinds> ref;
  // In the radix tree: the boundary after this page is a checkpoint (its
  // window and ring rows were all stored), resumable while the window pages
  // of the window before it are held.
  bool checkpoint = false;
  PageRef& at(PoolKind k) { return ref[static_cast<size_t>(index(k))]; }
  const PageRef& at(PoolKind k) const { return ref[static_cast<size_t>(index(k))]; }
  PageRef& window() { return at(PoolKind::window); }
  const PageRef& window() const { return at(PoolKind::window); }
};

// The device tier and, optionally, the host tier. Neither is owned.
class Tiers {
 public:
  Tiers(PoolSet& device, PoolSet* host) : device_(device), host_(host) {}
  PoolSet& device() const { return device_; }
  PoolSet* host() const { return host_; }
  PoolSet& at(Tier t) const {
    TROUPE_CHECK(t == Tier::device || host_ != nullptr, "no host tier");
    return t == Tier::device ? device_ : *host_;
  }
  const CacheGeometry& geometry() const { return device_.geometry(); }
  void retain(PoolKind k, PageRef r) const { at(r.tier).retain(k, r.id); }
  void release(PoolKind k, PageRef r) const { at(r.tier).release(k, r.id); }
  float* row(PoolKind k, PageRef r, const Section& s, int64_t i) const { return at(r.tier).row(k, r.id, s, i); }
  std::byte* page(PoolKind k, PageRef r) const { return at(r.tier).pool(k).page(r.id); }

 private:
  PoolSet& device_;
  PoolSet* host_;
};

}  // namespace troupe::cache
