// The KV handoff between processes: a request's pages (an
// engine::SequenceImage) move from the process that computed them (the owner)
// to the one that continues the request (the taker) by one-sided RMA; frames
// carry only the description (kv.capnp):
//
//   owner  lend():  copies the pages into a region the transport allocated
//                   (shared memory a local peer maps; RMA over the network
//                   otherwise) and fills a KvOffer: one layout-typed
//                   KvDescriptor per run of pages of one kind of state
//   taker  pull():  KvPull{get}, one get per page straight into the image's
//                   page buffers, then KvConfirm (or KvRelease{failed}: the
//                   taker recomputes instead)
//   owner  on_confirm / on_release / expire / on_peer_down: the lease ends,
//                   the region goes back to a small pool for the next lend
//
// Both roles live in one object per process (the node's). Thread-safe; the
// completion of a pull runs on the transport thread.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "engine/engine.hpp"
#include "messages/kinds.hpp"
#include "transport/transport.hpp"

namespace troupe::actors::node {

// A descriptor's `layer` when a page holds the rows of every layer (the
// engine's pages do: cache/layout.hpp).
inline constexpr uint32_t kAllLayers = 0xffffffffu;

struct KvHandoffOptions {
  std::string model;                  // KvOffer.model: takers refuse offers of another model
  int64_t csa_rate = 4;               // compress rates of the local model: how compressed-entry
  int64_t hca_rate = 128;             //   descriptors map back onto the engine's pools
  size_t pooled_regions = 4;          // lent regions kept for reuse after their lease ends
  uint64_t max_image_bytes = uint64_t{64} << 30;  // a taker refuses larger offers
};

struct KvHandoffStats {
  size_t leases = 0;            // owner: offered and not yet confirmed or released
  size_t pulls = 0;             // taker: gets in flight
  uint64_t bytes_lent = 0;      // owner: total bytes confirmed by takers
  uint64_t bytes_pulled = 0;    // taker: total bytes received
  uint64_t failed_pulls = 0;
  uint64_t expired_leases = 0;
  double rma_seconds = 0;       // taker: time between issuing a pull's gets and their completion, summed
};

class KvHandoff {
 public:
  // `transport` must outlive this object.
  KvHandoff(transport::Transport& transport, KvHandoffOptions options);
  ~KvHandoff();  // deregisters every region (leases in flight end) unless abandoned

  // ---- owner ---------------------------------------------------------------
  // Lends `image`'s pages to `taker` until it confirms or releases, or until
  // `ttl` passes. Fills `offer` (lease id, descriptors, expiry). The image is
  // copied; the caller may drop it.
  Expected<uint64_t> lend(const std::string& taker, const engine::SequenceImage& image, std::chrono::milliseconds ttl,
                          msg::KvOffer::Builder offer);
  // The taker has the bytes: the lease ends (answered with KvRelease{confirmed}).
  void on_confirm(const std::string& peer, uint64_t lease);
  // The taker gave up (or confirmed and released): the lease ends.
  void on_release(const std::string& peer, uint64_t lease);
  // Ends every lease whose expiry passed; returns how many.
  size_t expire(std::chrono::steady_clock::time_point now);
  // The taker is gone: its leases end. Returns their ids.
  std::vector<uint64_t> on_peer_down(const std::string& peer);

  // ---- taker ---------------------------------------------------------------
  using Pulled = std::function<void(Expected<engine::SequenceImage>)>;
  // Pulls an offer's pages from `owner` into `image` (whose non-page fields the
  // caller filled) and calls `done` on the transport thread: with the image
  // after KvConfirm went out, or with the error after KvRelease{failed} did.
  void pull(const std::string& owner, msg::KvOffer::Reader offer, engine::SequenceImage image, Pulled done);

  KvHandoffStats stats() const;
  // The transport is about to close: forget every region without
  // deregistering it (closing the transport frees what it allocated).
  void abandon();

 private:
  struct Lease;
  struct Region;
  Expected<transport::LocalRegion> take_region(size_t bytes);
  void end_lease(uint64_t lease, bool confirmed);

  transport::Transport& transport_;
  KvHandoffOptions options_;
  mutable std::mutex mu_;
  std::map<uint64_t, std::unique_ptr<Lease>> leases_;
  std::vector<transport::LocalRegion> free_regions_;
  uint64_t next_lease_ = 1;
  bool abandoned_ = false;
  KvHandoffStats stats_;
};

// The descriptors' kinds of state for the engine's pools, and back.
msg::StateKind state_kind(cache::PoolKind kind);

}  // namespace troupe::actors::node
