// A byte budget of one tier, cut into equal slabs. Pools take slabs when they
// run out of pages and give fully free ones back, so pages move between pools
// as demand shifts (short requests need window pages, long ones entry pages).
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "cache/memory.hpp"

namespace troupe::cache {

class SlabArena {
 public:
  // At most budget_bytes / slab_bytes slabs; memory is allocated on first use
  // and kept until the arena dies. `memory` must outlive the arena.
  SlabArena(Memory& memory, size_t slab_bytes, uint64_t budget_bytes);
  ~SlabArena();  // frees every slab: the pools that took them must be gone
  SlabArena(const SlabArena&) = delete;
  SlabArena& operator=(const SlabArena&) = delete;

  // A slab, or nullptr when the budget is spent or the memory is exhausted.
  void* take();
  // Gives back a slab from take().
  void give(void* slab);

  Memory& memory() const { return memory_; }
  size_t slab_bytes() const { return slab_bytes_; }
  int64_t slabs_total() const { return slabs_total_; }
  int64_t slabs_taken() const { return taken_; }
  int64_t slabs_free() const { return slabs_total_ - taken_; }

 private:
  Memory& memory_;
  size_t slab_bytes_;
  int64_t slabs_total_;
  int64_t taken_ = 0;
  std::vector<void*> spare_;      // allocated, not taken
  std::vector<void*> allocated_;  // everything allocated
};

}  // namespace troupe::cache
