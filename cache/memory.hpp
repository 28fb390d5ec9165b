// Where pool pages live: device memory through the kernel backend, pinned host
// memory, or plain host memory. Slab arenas (cache/pool/slab_arena.hpp) own
// what they allocate through a Memory and give it back before the Memory dies.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "kernels/backend.hpp"

namespace troupe::cache {

// The two tiers of the cache: pages the kernels compute on, and the host tier
// that mirrors them for park/resume, prefix spill and cold pages.
enum class Tier : uint8_t { device = 0, host = 1 };
const char* to_string(Tier t);

class Memory {
 public:
  virtual ~Memory() = default;
  virtual std::string name() const = 0;
  virtual Tier tier() const = 0;
  // `bytes` of memory, 256-byte aligned, or nullptr when it cannot be had.
  // Never throws. The caller frees it with free().
  virtual void* alloc(size_t bytes) = 0;
  virtual void free(void* p) = 0;
  // Whether the backend's kernels may read this memory in place: always for
  // backend memory; for host memory on the CPU backend (it is the same kind of
  // memory) and for mapped pinned memory (Backend::alloc_host_mapped). Pages of a host tier whose
  // memory is not backend-readable must be copied back before use.
  virtual bool backend_readable() const = 0;
};

// Device memory: Backend::alloc / free (host memory on the CPU backend).
std::unique_ptr<Memory> backend_memory(kernels::Backend& backend);
// Plain host memory (aligned_alloc).
std::unique_ptr<Memory> host_memory(bool backend_readable);
// Page-locked host memory: host memory that the OS may not swap (mlock), the
// precondition for asynchronous device copies. Falls back to unlocked memory
// when the lock limit (RLIMIT_MEMLOCK) is reached.
std::unique_ptr<Memory> pinned_host_memory(bool backend_readable);

// The host tier's memory for a backend: pinned, readable in place on the CPU
// backend; mapped pinned memory (readable in place) where the backend offers it.
std::unique_ptr<Memory> host_tier_memory(kernels::Backend& backend);

}  // namespace troupe::cache
