// Engine: making room on the device tier and moving state between tiers
// (park/resume, prefix spill/reload, cold pages of long sequences).
#include <algorithm>
#include <array>
#include <span>

#include "engine/engine.hpp"
#include "engine/sequence.hpp"

namespace troupe::engine {

using cache::PageMover;
using cache::PageRef;
using cache::PoolCounts;
using cache::PoolKind;
using cache::Tier;

namespace {

int64_t total(const PoolCounts& c) {
  int64_t n = 0;
  for (int64_t x : c) n += x;
  return n;
}

// The pools whose pages may go cold. Where the host tier is the kernels' own
// memory (the CPU backend) every entry pool. Where the kernels read it over a
// bus (mapped host memory on CUDA) only the CSA entries: a decode step reads
// the few the indexer selects (index_topk rows), where the indexer keys and the
// HCA entries are read whole at every step. They are most of a long sequence's
// state (a CSA layer keeps a head_dim-wide entry per compress_rate tokens,
// its indexer key is index_head_dim wide; an HCA layer's rate is much larger).
std::span<const PoolKind> cold_pools(const kernels::Backend& backend) {
  static constexpr std::array<PoolKind, 1> kSparse = {PoolKind::csa_entry};
  if (backend.memory_is_host()) return cache::kEntryPools;
  return kSparse;
}

}  // namespace

bool Engine::make_room(const PoolCounts& need) {
  while (!device_->can_lease(need)) {
    // Cheapest first: checkpoint windows inside unused prefixes (their
    // entries stay, and so does the window of each prefix's end) ...
    const int64_t want_windows = std::max<int64_t>(1, need[0]);
    if (const int64_t n = tree_->tombstone(want_windows, false); n > 0) {
      counters_.tombstoned_pages += n;
      continue;
    }
    // ... then whole unused prefixes, least recently used first ...
    if (evict_one()) {
      mover_->wait_all();
      continue;
    }
    // ... then the end windows of prefixes that only serve longer ones.
    if (const int64_t n = tree_->tombstone(want_windows, true); n > 0) {
      counters_.tombstoned_pages += n;
      continue;
    }
    if (move_cold_pages(std::max<int64_t>(4, total(need)), true)) continue;
    if (mover_->in_flight() > 0) {
      mover_->wait_all();
      continue;
    }
    return false;
  }
  return true;
}

// Spills (with a host tier) or erases the least recently used unlocked prefix.
bool Engine::evict_one() {
  for (auto* node : tree_->eviction_order(Tier::device)) {
    std::vector<std::pair<PoolKind, PageRef>> sources;
    std::vector<int64_t> index;
    bool busy = false;
    for (size_t i = 0; i < node->pages.size(); ++i) {
      for (PoolKind k : cache::kAllPools) {
        const PageRef r = node->pages[i].at(k);
        if (!r.on(Tier::device)) continue;
        busy |= mover_->moving(k, r);
        sources.emplace_back(k, r);
        index.push_back(node->start_page + static_cast<int64_t>(i));
      }
    }
    if (busy) continue;
    if (host_) {
      auto path = tree_->path_tokens(node);
      const bool started = mover_->start(sources, Tier::host, [this, path, index](std::span<const PageMover::Move> moves) {
        for (size_t i = 0; i < moves.size(); ++i) {
          const auto& m = moves[i];
          if (tree_->swap(path, index[i], m.kind, m.from, m.to)) ++counters_.spilled_pages;
        }
      });
      if (started) return true;
      // The host tier is full: make room there by erasing its oldest spilled prefix.
      for (auto* old : tree_->eviction_order(Tier::host)) {
        if (old->children.empty()) {
          tree_->erase(old);
          ++counters_.erased_nodes;
          return true;
        }
      }
    }
    if (node->children.empty()) {
      tree_->erase(node);
      ++counters_.erased_nodes;
      return true;
    }
  }
  return false;
}

// Moves entry pages of the oldest full token pages of long running sequences
// to the host tier, where the kernels read them in place.
bool Engine::move_cold_pages(int64_t want, bool wait) {
  if (!host_ || !options_.cold_pages || !host_->memory().backend_readable() || want <= 0) return false;
  std::vector<Seq*> order;
  for (auto& [id, s] : seqs_) {
    if (s->phase == Phase::running && s->state) order.push_back(s.get());
  }
  std::sort(order.begin(), order.end(), [](const Seq* a, const Seq* b) { return a->length() > b->length(); });
  bool started = false;
  for (Seq* s : order) {
    const int64_t until = s->state->full_pages() - options_.hot_pages;
    std::vector<std::pair<PoolKind, PageRef>> sources;
    std::vector<int64_t> index;
    int64_t k = s->cold_scan;
    for (; k < until && static_cast<int64_t>(sources.size()) < want; ++k) {
      for (PoolKind kind : cold_pools(model_.backend())) {
        const PageRef r = s->state->pages()[static_cast<size_t>(k)].at(kind);
        // Only pages this sequence (and the tree) hold: moving others frees nothing.
        if (!r.on(Tier::device) || device_->pool(kind).refs(r.id) > 2 || mover_->moving(kind, r)) continue;
        sources.emplace_back(kind, r);
        index.push_back(k);
      }
    }
    if (sources.empty()) {
      s->cold_scan = k;
      continue;
    }
    const RequestId id = s->id;
    const bool ok = mover_->start(sources, Tier::host, [this, id, index](std::span<const PageMover::Move> moves) {
      Seq* s = find(id);
      for (size_t i = 0; i < moves.size(); ++i) {
        const auto& m = moves[i];
        if (s != nullptr && s->state && s->state->pages()[static_cast<size_t>(index[i])].at(m.kind) == m.from) {
          tiers_->retain(m.kind, m.to);
          ++moves_;  // row pointers changed: decoder tables are refreshed
          s->state->replace(index[i], m.kind, m.to);
          ++counters_.cold_pages;
        }
        if (s != nullptr) tree_->swap(s->tokens, index[i], m.kind, m.from, m.to);
      }
    });
    if (!ok) break;
    s->cold_scan = k;
    started = true;
    want -= static_cast<int64_t>(sources.size());
    if (want <= 0) break;
  }
  if (started && wait) mover_->wait_all();
  return started;
}

// After a step: if the next step might not fit, start freeing device pages
// now, so the copies overlap the next forward call.
void Engine::keep_headroom() {
  if (!host_ || mover_->in_flight() > 0) return;
  PoolCounts need{};
  for (auto& [id, s] : seqs_) {
    if (s->phase != Phase::running) continue;
    const int64_t n = std::min(s->pending(), options_.step_tokens);
    const auto more = s->state->pages_needed(s->length() + n);
    for (size_t i = 0; i < need.size(); ++i) need[i] += more[i];
  }
  if (device_->can_lease(need)) return;
  if (!move_cold_pages(std::max<int64_t>(4, total(need)), false)) evict_one();
}

void Engine::start_park(Seq& s) {
  s.decode.reset();  // its slot goes to running sequences
  std::vector<std::pair<PoolKind, PageRef>> sources;
  std::vector<std::pair<int64_t, PoolKind>> where;
  const auto pages = s.state->pages();
  for (size_t k = 0; k < pages.size(); ++k) {
    for (PoolKind kind : cache::kAllPools) {
      if (pages[k].at(kind).on(Tier::device)) {
        sources.emplace_back(kind, pages[k].at(kind));
        where.emplace_back(static_cast<int64_t>(k), kind);
      }
    }
  }
  if (s.state->hca_ring().on(Tier::device)) {
    sources.emplace_back(PoolKind::hca_ring, s.state->hca_ring());
    where.emplace_back(-1, PoolKind::hca_ring);
  }
  const RequestId id = s.id;
  const bool ok = host_ && mover_->start(sources, Tier::host, [this, id, where](std::span<const PageMover::Move> moves) {
    Seq* s = find(id);
    if (s == nullptr || s->phase != Phase::parking) return;
    for (size_t i = 0; i < moves.size(); ++i) {
      tiers_->retain(moves[i].kind, moves[i].to);
      ++moves_;  // row pointers changed: decoder tables are refreshed
      s->state->replace(where[i].first, moves[i].kind, moves[i].to);
    }
    s->parked_pages = where;
    s->phase = Phase::parked;
    unlock(*s);
    ++counters_.parks;
    ++s->usage.parks;
    emit(make_event(s->id, EventKind::parked));
  });
  if (!ok) {
    emit(make_event(s.id, EventKind::parked, false,
                    host_ ? "the host tier has no room for the request's state" : "the engine has no host tier"));
    return;
  }
  s.phase = Phase::parking;
}

bool Engine::start_resume(Seq& s) {
  if (!s.state) {  // parked before it was admitted
    s.phase = Phase::waiting;
    s.resume_wanted = false;
    enqueue(s, true);
    ++counters_.resumes;
    emit(make_event(s.id, EventKind::resumed));
    return true;
  }
  std::vector<std::pair<PoolKind, PageRef>> sources;
  PoolCounts need{};
  for (auto [k, kind] : s.parked_pages) {
    const PageRef r = k < 0 ? s.state->hca_ring() : s.state->pages()[static_cast<size_t>(k)].at(kind);
    sources.emplace_back(kind, r);
    ++need[static_cast<size_t>(cache::index(kind))];
  }
  // Room for its pages and a page of growth for every running sequence, so a
  // resumed sequence does not stall the others (and get preempted again).
  for (auto& [id, o] : seqs_) {
    if (o->phase != Phase::running) continue;
    for (PoolKind k : cache::kAllPools) {
      if (k != PoolKind::hca_ring && geometry_.has(k)) ++need[static_cast<size_t>(cache::index(k))];
    }
  }
  if (!device_->can_lease(need) && !make_room(need)) {
    counters_.waiting_reason = fmt::format("parked request {} waits for device pages to resume", s.id);
    return false;
  }
  const RequestId id = s.id;
  const auto where = s.parked_pages;
  if (!mover_->start(sources, Tier::device, [this, id, where](std::span<const PageMover::Move> moves) {
        Seq* s = find(id);
        if (s == nullptr || s->phase != Phase::resuming) return;
        for (size_t i = 0; i < moves.size(); ++i) {
          tiers_->retain(moves[i].kind, moves[i].to);
          ++moves_;  // row pointers changed: decoder tables are refreshed
          s->state->replace(where[i].first, moves[i].kind, moves[i].to);
        }
        s->parked_pages.clear();
        s->phase = Phase::running;
        ++counters_.resumes;
        emit(make_event(s->id, EventKind::resumed));
      })) {
    return false;
  }
  s.resume_wanted = false;
  s.phase = Phase::resuming;
  return true;
}

// The adopted prefix has pages in the host tier: copy them back (the tree gets
// the device copies too). Without room, a readable host tier is read in place;
// an unreadable one makes the request wait (false).
bool Engine::start_reload(Seq& s) {
  std::vector<std::pair<PoolKind, PageRef>> sources;
  std::vector<std::pair<int64_t, PoolKind>> where;
  const auto pages = s.state->pages();
  for (size_t k = 0; k < pages.size(); ++k) {
    for (PoolKind kind : cache::kAllPools) {
      if (pages[k].at(kind).on(Tier::host)) {
        sources.emplace_back(kind, pages[k].at(kind));
        where.emplace_back(static_cast<int64_t>(k), kind);
      }
    }
  }
  const RequestId id = s.id;
  const bool ok = mover_->start(sources, Tier::device, [this, id, where](std::span<const PageMover::Move> moves) {
    Seq* s = find(id);
    for (size_t i = 0; i < moves.size(); ++i) {
      const auto& m = moves[i];
      if (s == nullptr) break;
      tree_->swap(s->tokens, where[i].first, m.kind, m.from, m.to);
      if (s->state && s->state->pages()[static_cast<size_t>(where[i].first)].at(m.kind) == m.from) {
        tiers_->retain(m.kind, m.to);
        ++moves_;  // row pointers changed: decoder tables are refreshed
        s->state->replace(where[i].first, m.kind, m.to);
        ++counters_.reloaded_pages;
      }
    }
    if (s != nullptr && s->phase == Phase::loading) s->phase = Phase::running;
  });
  if (ok) {
    s.phase = Phase::loading;
    return true;
  }
  if (!host_->memory().backend_readable()) return false;
  s.phase = Phase::running;
  return true;
}

}  // namespace troupe::engine
