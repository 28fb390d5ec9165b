#include "cache/pool/slab_arena.hpp"

#include "base/check.hpp"

namespace troupe::cache {

SlabArena::SlabArena(Memory& memory, size_t slab_bytes, uint64_t budget_bytes)
    : memory_(memory), slab_bytes_(slab_bytes),
      slabs_total_(slab_bytes == 0 ? 0 : static_cast<int64_t>(budget_bytes / slab_bytes)) {
  TROUPE_CHECK(slab_bytes > 0, "slabs need a size");
}

SlabArena::~SlabArena() {
  TROUPE_CHECK(taken_ == 0, "slab arena destroyed while pools hold slabs");
  for (void* p : allocated_) memory_.free(p);
}

void* SlabArena::take() {
  if (taken_ >= slabs_total_) return nullptr;
  void* p = nullptr;
  if (!spare_.empty()) {
    p = spare_.back();
    spare_.pop_back();
  } else {
    p = memory_.alloc(slab_bytes_);
    if (p == nullptr) return nullptr;
    allocated_.push_back(p);
  }
  ++taken_;
  return p;
}

void SlabArena::give(void* slab) {
  TROUPE_CHECK(slab != nullptr && taken_ > 0, "slab given back twice");
  spare_.push_back(slab);
  --taken_;
}

}  // namespace troupe::cache
