// Engine: who holds which pages (audit) and the stats other threads read.
#include <map>
#include <set>

#include <fmt/format.h>

#include "engine/engine.hpp"
#include "engine/sequence.hpp"

namespace troupe::engine {

using cache::PoolKind;
using cache::Tier;

std::array<PoolAudit, cache::kPoolKinds> Engine::audit(Tier tier) const {
  std::array<PoolAudit, cache::kPoolKinds> out{};
  const cache::PoolSet* set = tier == Tier::device ? device_.get() : host_.get();
  if (set == nullptr) return out;
  // References per page, and which holders reference it.
  std::array<std::map<cache::PageId, int64_t>, cache::kPoolKinds> refs;
  std::array<std::set<cache::PageId>, cache::kPoolKinds> leased, parked, cached, flight;
  auto note = [&](auto& who, PoolKind k, cache::PageRef r) {
    if (!r.on(tier)) return;
    ++refs[static_cast<size_t>(cache::index(k))][r.id];
    who[static_cast<size_t>(cache::index(k))].insert(r.id);
  };
  for (const auto& [id, s] : seqs_) {
    if (!s->state) continue;
    const bool is_parked = s->phase == Phase::parked || s->phase == Phase::parking || s->phase == Phase::resuming;
    for (auto [k, r] : s->state->held()) note(is_parked ? parked : leased, k, r);
  }
  tree_->for_each_page([&](PoolKind k, cache::PageRef r) { note(cached, k, r); });
  mover_->for_each_page([&](PoolKind k, cache::PageRef r) { note(flight, k, r); });
  for (PoolKind k : cache::kAllPools) {
    const auto i = static_cast<size_t>(cache::index(k));
    const auto& pool = set->pool(k);
    auto& a = out[i];
    a.capacity = pool.stats().capacity;
    a.in_use = pool.stats().in_use;
    a.free = a.capacity - a.in_use;
    a.leased = static_cast<int64_t>(leased[i].size());
    a.parked = static_cast<int64_t>(parked[i].size());
    a.cached = static_cast<int64_t>(cached[i].size());
    a.in_flight = static_cast<int64_t>(flight[i].size());
    pool.for_each_in_use([&](cache::PageId id, int32_t n) {
      auto it = refs[i].find(id);
      const int64_t held = it == refs[i].end() ? 0 : it->second;
      TROUPE_CHECK(held <= n, "a page is referenced more often than it was retained");
      if (held < n) ++a.leaked;
    });
  }
  return out;
}

void Engine::publish_stats() {
  counters_.waiting = static_cast<int64_t>(waiting_.size());
  counters_.running = 0;
  counters_.parked = 0;
  for (const auto& [id, s] : seqs_) {
    if (s->phase == Phase::running || s->phase == Phase::loading) ++counters_.running;
    // A parked request that wants to resume (an imported handoff or migration,
    // a long-tail park whose time came) waits for room like a new one: it is
    // the queue a decode worker has.
    if (s->phase == Phase::parked && s->resume_wanted) ++counters_.waiting;
    else if (s->phase == Phase::parked || s->phase == Phase::parking || s->phase == Phase::resuming) ++counters_.parked;
  }
  const bool full = counters_.steps % 32 == 0 || idle();
  if (full) counters_.requests.clear();
  static const char* phases[] = {"waiting", "loading", "running", "parking", "parked", "resuming"};
  for (const auto& [id, s] : seqs_) {
    if (!full) break;
    RequestStatus r;
    r.id = id;
    r.phase = phases[static_cast<int>(s->phase)];
    r.length = s->length();
    r.tokens = static_cast<int64_t>(s->tokens.size());
    r.max_tokens = s->prompt_len + s->req.sampling.max_tokens;
    if (s->state) {
      for (auto [k, ref] : s->state->held()) {
        (ref.tier == Tier::device ? r.device_bytes : r.host_bytes) += static_cast<int64_t>(geometry_.pool(k).page_bytes);
      }
    }
    counters_.requests.push_back(std::move(r));
  }
  auto free_bytes = [](const cache::PoolSet& set) {
    uint64_t b = static_cast<uint64_t>(set.arena().slabs_free()) * set.arena().slab_bytes();
    for (PoolKind k : cache::kAllPools) b += static_cast<uint64_t>(set.pool(k).free_pages()) * set.pool(k).layout().page_bytes;
    return b;
  };
  counters_.device_budget_bytes = static_cast<uint64_t>(device_->arena().slabs_total()) * device_->arena().slab_bytes();
  counters_.device_free_bytes = free_bytes(*device_);
  if (host_) {
    counters_.host_budget_bytes = static_cast<uint64_t>(host_->arena().slabs_total()) * host_->arena().slab_bytes();
    counters_.host_free_bytes = free_bytes(*host_);
  }
  counters_.tree_nodes = tree_->node_count();
  counters_.tree_pages = tree_->cached_pages();
  counters_.copied_bytes = copies_->bytes_copied();
  // The full audit walks every page table: every 32 steps and when idle;
  // pool occupancy every step.
  if (full) {
    counters_.device = audit(Tier::device);
    counters_.host = audit(Tier::host);
  } else {
    for (Tier tier : {Tier::device, Tier::host}) {
      const cache::PoolSet* set = tier == Tier::device ? device_.get() : host_.get();
      if (set == nullptr) continue;
      auto& out = tier == Tier::device ? counters_.device : counters_.host;
      for (PoolKind k : cache::kAllPools) {
        auto& a = out[static_cast<size_t>(cache::index(k))];
        a.capacity = set->pool(k).stats().capacity;
        a.in_use = set->pool(k).stats().in_use;
        a.free = a.capacity - a.in_use;
      }
    }
  }
  std::lock_guard lock(mu_);
  published_ = counters_;
}

}  // namespace troupe::engine
