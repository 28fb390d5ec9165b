// Moves pages between the device and host tiers: park/resume of sequences,
// spill/reload of radix nodes, cold pages of long sequences.
//
// start() leases a target page for every source in the other tier, takes one
// reference on each source (so it outlives the copy) and queues the copies on
// the CopyEngine. poll(), on the engine thread, runs the callback of every
// finished batch and then releases the mover's own references on sources and
// targets: a callback keeps a target by retaining it (and drops its holder's
// reference on the source); a callback whose holder vanished (an aborted
// sequence, an erased node) does nothing and the target is freed.
#pragma once

#include <functional>
#include <map>
#include <set>
#include <tuple>
#include <span>
#include <vector>

#include "cache/host/copy_engine.hpp"
#include "cache/pool/tiers.hpp"

namespace troupe::cache {

class PageMover {
 public:
  struct Move {
    PoolKind kind;
    PageRef from;
    PageRef to;
  };
  using Done = std::function<void(std::span<const Move>)>;

  PageMover(const Tiers& tiers, CopyEngine& copies);
  ~PageMover();  // waits for every copy and releases its references (callbacks do not run)
  PageMover(const PageMover&) = delete;
  PageMover& operator=(const PageMover&) = delete;

  // False, leasing nothing, when the target tier lacks pages for all sources.
  bool start(std::span<const std::pair<PoolKind, PageRef>> sources, Tier to, Done done);
  // Runs the callbacks of finished batches; returns how many finished.
  int poll();
  // Block until the oldest batch / every batch in flight is done (then poll()).
  void wait_one();
  void wait_all();
  // Whether a copy of this page is in flight (as a source).
  bool moving(PoolKind kind, PageRef ref) const;
  size_t in_flight() const { return batches_.size(); }
  uint64_t bytes_moved() const { return bytes_; }
  // References the mover holds: (kind, ref) of every source and target in flight.
  void for_each_page(const std::function<void(PoolKind, PageRef)>& visit) const;

 private:
  struct Batch {
    std::vector<Move> moves;
    Done done;
  };
  void finish(Batch& b, bool run_callback);

  Tiers tiers_;
  CopyEngine& copies_;
  std::map<CopyEngine::Ticket, Batch> batches_;
  std::multiset<std::tuple<int, int, PageId>> sources_;  // (kind, tier, id) of sources in flight
  uint64_t bytes_ = 0;
};

}  // namespace troupe::cache
