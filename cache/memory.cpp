#include "cache/memory.hpp"

#include <sys/mman.h>

#include <cstdlib>
#include <mutex>
#include <new>
#include <unordered_map>

namespace troupe::cache {

const char* to_string(Tier t) { return t == Tier::device ? "device" : "host"; }

namespace {

class BackendMemory final : public Memory {
 public:
  explicit BackendMemory(kernels::Backend& b) : backend_(b) {}
  std::string name() const override { return backend_.name() + " device memory"; }
  Tier tier() const override { return Tier::device; }
  void* alloc(size_t bytes) override {
    try {
      return backend_.alloc(bytes);
    } catch (const std::bad_alloc&) {
      return nullptr;
    }
  }
  void free(void* p) override { backend_.free(p); }
  bool backend_readable() const override { return true; }

 private:
  kernels::Backend& backend_;
};

class HostMemory : public Memory {
 public:
  explicit HostMemory(bool readable) : readable_(readable) {}
  std::string name() const override { return "host memory"; }
  Tier tier() const override { return Tier::host; }
  void* alloc(size_t bytes) override { return std::aligned_alloc(256, (bytes + 255) / 256 * 256); }
  void free(void* p) override { std::free(p); }
  bool backend_readable() const override { return readable_; }

 private:
  bool readable_;
};

class PinnedHostMemory final : public HostMemory {
 public:
  using HostMemory::HostMemory;
  std::string name() const override { return "pinned host memory"; }
  void* alloc(size_t bytes) override {
    const size_t n = (bytes + 4095) / 4096 * 4096;
    void* p = std::aligned_alloc(4096, n);
    if (p == nullptr) return nullptr;
    const bool locked = mlock(p, n) == 0;  // best effort: the limit may be small in containers
    std::lock_guard lock(mu_);
    sizes_[p] = locked ? n : 0;
    return p;
  }
  void free(void* p) override {
    if (p == nullptr) return;
    size_t n = 0;
    {
      std::lock_guard lock(mu_);
      auto it = sizes_.find(p);
      if (it != sizes_.end()) n = it->second, sizes_.erase(it);
    }
    if (n > 0) munlock(p, n);
    std::free(p);
  }

 private:
  std::mutex mu_;
  std::unordered_map<void*, size_t> sizes_;  // 0: not locked
};

// Host memory the backend's kernels read in place (Backend::alloc_host_mapped:
// mapped pinned memory on CUDA).
class MappedHostMemory final : public Memory {
 public:
  explicit MappedHostMemory(kernels::Backend& b) : backend_(b) {}
  std::string name() const override { return "mapped pinned host memory"; }
  Tier tier() const override { return Tier::host; }
  void* alloc(size_t bytes) override { return backend_.alloc_host_mapped(bytes); }
  void free(void* p) override { backend_.free_host_mapped(p); }
  bool backend_readable() const override { return true; }

 private:
  kernels::Backend& backend_;
};

}  // namespace

std::unique_ptr<Memory> backend_memory(kernels::Backend& backend) { return std::make_unique<BackendMemory>(backend); }
std::unique_ptr<Memory> host_memory(bool backend_readable) { return std::make_unique<HostMemory>(backend_readable); }
std::unique_ptr<Memory> pinned_host_memory(bool backend_readable) {
  return std::make_unique<PinnedHostMemory>(backend_readable);
}
std::unique_ptr<Memory> host_tier_memory(kernels::Backend& backend) {
  // Where the backend's memory is host memory (the CPU backend) the kernels
  // read the host tier in place; a backend with mapped host memory (CUDA) reads
  // it over the bus. Elsewhere the host tier is not readable: it holds parked
  // and spilled pages, which move back before use, and no cold pages.
  if (backend.memory_is_host()) return pinned_host_memory(true);
  if (backend.host_mapped()) return std::make_unique<MappedHostMemory>(backend);
  return pinned_host_memory(false);
}

}  // namespace troupe::cache
