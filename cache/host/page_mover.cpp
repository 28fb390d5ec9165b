#include "cache/host/page_mover.hpp"

namespace troupe::cache {

PageMover::PageMover(const Tiers& tiers, CopyEngine& copies) : tiers_(tiers), copies_(copies) {}

PageMover::~PageMover() {
  for (auto& [ticket, b] : batches_) {
    copies_.wait(ticket);
    finish(b, false);
  }
}

bool PageMover::start(std::span<const std::pair<PoolKind, PageRef>> sources, Tier to, Done done) {
  PoolSet& target = tiers_.at(to);
  PoolCounts need{};
  for (const auto& [kind, ref] : sources) {
    TROUPE_CHECK(ref.valid() && ref.tier != to, "a move goes between tiers");
    ++need[static_cast<size_t>(index(kind))];
  }
  if (!target.can_lease(need)) return false;
  Batch b;
  b.done = std::move(done);
  std::vector<CopyEngine::Copy> copies;
  for (const auto& [kind, ref] : sources) {
    const PageId id = target.lease(kind);
    TROUPE_CHECK(id != kNoPage, "can_lease promised a page");
    const PageRef dst{id, to};
    tiers_.retain(kind, ref);
    const size_t bytes = tiers_.geometry().pool(kind).page_bytes;
    copies.push_back({tiers_.page(kind, dst), tiers_.page(kind, ref), bytes, to});
    bytes_ += bytes;
    b.moves.push_back({kind, ref, dst});
    sources_.emplace(index(kind), static_cast<int>(ref.tier), ref.id);
  }
  const auto ticket = copies_.submit(std::move(copies));
  batches_.emplace(ticket, std::move(b));
  return true;
}

void PageMover::finish(Batch& b, bool run_callback) {
  for (const auto& m : b.moves) {
    sources_.erase(sources_.find({index(m.kind), static_cast<int>(m.from.tier), m.from.id}));
  }
  if (run_callback && b.done) b.done(b.moves);
  for (const auto& m : b.moves) {
    tiers_.release(m.kind, m.from);
    tiers_.release(m.kind, m.to);
  }
}

int PageMover::poll() {
  int n = 0;
  for (auto ticket : copies_.take_finished()) {
    auto it = batches_.find(ticket);
    if (it == batches_.end()) continue;
    Batch b = std::move(it->second);
    batches_.erase(it);
    finish(b, true);
    ++n;
  }
  return n;
}

void PageMover::wait_one() {
  if (!batches_.empty()) copies_.wait(batches_.begin()->first);
}

void PageMover::wait_all() {
  if (!batches_.empty()) copies_.wait(batches_.rbegin()->first);
  poll();
}

bool PageMover::moving(PoolKind kind, PageRef ref) const {
  return sources_.count({index(kind), static_cast<int>(ref.tier), ref.id}) > 0;
}

void PageMover::for_each_page(const std::function<void(PoolKind, PageRef)>& visit) const {
  for (const auto& [ticket, b] : batches_) {
    for (const auto& m : b.moves) {
      visit(m.kind, m.from);
      visit(m.kind, m.to);
    }
  }
}

}  // namespace troupe::cache
