// The one interface that moves bytes between troupe processes:
//   (a) frames to a named peer,
//   (b) one-sided put/get of registered memory regions (KV pages),
//   (c) peer-failure notification.
// Implementations: InProcessTransport (transport/in_process.hpp; `troupe
// serve`, tests) and UcxTransport (transport/ucx.hpp; between processes).
// Every implementation passes tests/transport/conformance_test.cpp.
//
// Threading, for every implementation:
// - Each transport owns one thread (its "transport thread"). Every callback
//   in TransportEvents and every Completion runs on it, one at a time.
//   Callbacks must not block; hand work to an actor (caf::anon_send) or a
//   queue. They may call send/put/get/disconnect on the same transport.
// - All methods are thread-safe. Methods marked (blocking) wait for the
//   transport thread; called from a callback they run inline, except
//   connect and put_wait/get_wait, which must never be called from it.
// - Frames to one peer arrive in the order they were sent; nothing is
//   promised across peers. A frame sent to a peer that fails may be lost.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "messages/common.capnp.h"
#include "messages/frame.hpp"

namespace troupe::transport {

using messages::Frame;
using messages::FrameFault;
using messages::Ok;
using messages::Status;

// Where a region of registered memory is, as a peer needs it to put/get.
// Travels inside messages as msg::RemoteRegion (KvDescriptor.region).
struct RegionKey {
  std::string owner;                 // transport name of the owning process
  uint64_t region_id = 0;            // never reused by one transport instance
  uint64_t address = 0;              // base address in the owner's address space
  uint64_t length = 0;               // bytes
  std::vector<uint8_t> packed_key;   // implementation-specific (UCX: packed rkey)
};
void to_wire(const RegionKey& key, msg::RemoteRegion::Builder out);
RegionKey from_wire(msg::RemoteRegion::Reader in);

// A region registered here. The memory belongs to whoever registered it
// (register_region) or to the transport (allocate_region); either way it
// stays valid until deregister_region returns.
struct LocalRegion {
  RegionKey key;          // send this to peers
  std::byte* base = nullptr;
  size_t length = 0;
};

// One contiguous move between local memory and a peer's region.
struct RmaOp {
  void* local = nullptr;       // put: source; get: destination. Valid until the Completion runs.
  uint64_t remote_offset = 0;  // byte offset inside the peer's region
  size_t length = 0;
};

// Runs once on the transport thread when a batch of moves finished: ok means
// every byte arrived (put: remotely visible; get: in local memory).
using Completion = std::function<void(Status)>;

struct TransportEvents {
  // A validated frame from `peer` (header and body checked, see
  // messages::validate_body). Required.
  std::function<void(const std::string& peer, Frame frame)> on_frame;
  // A peer finished the connection handshake (either direction). Optional.
  std::function<void(const std::string& peer)> on_peer_up;
  // A peer is gone: it closed, crashed (kill -9: within 1 s on loopback) or
  // was dropped. By the time this runs the transport has failed the peer's
  // in-flight puts/gets and dropped its keys; the owner of leases the peer
  // held releases them here. Once per connection. Optional, but every actor
  // layer wants it.
  std::function<void(const std::string& peer, const Error& why)> on_peer_down;
  // A peer sent something that is not a valid frame. The transport already
  // answered with an Error frame, and dropped the connection when the byte
  // stream was lost or the peer kept doing it. Optional (logs, metrics).
  std::function<void(const std::string& peer, const FrameFault& fault)> on_bad_frame;
};

struct TransportStats {
  size_t peers = 0;              // connected peers
  size_t regions = 0;            // regions registered here
  size_t remote_keys = 0;        // peers' region keys held (unpacked) here
  size_t rma_in_flight = 0;      // batches of puts/gets not yet completed
  size_t send_queue_bytes = 0;   // frame bytes accepted by send() and not yet sent
  uint64_t frames_sent = 0;
  uint64_t frames_received = 0;  // valid frames delivered to on_frame
  uint64_t bad_frames = 0;       // faults seen (each answered or dropped)
  uint64_t frames_by_put = 0;    // UCX: frames sent by a put into the peer's arena (UcxOptions)
  uint64_t resets = 0;           // UCX: worker rebuilt after its shared-memory inbox went silent
};

class Transport {
 public:
  // Closes every connection (peers see on_peer_down) and frees every
  // region the transport allocated. No callback runs after it returns.
  virtual ~Transport() = default;

  // The name peers know this endpoint by (unique in a deployment).
  virtual const std::string& name() const = 0;
  // Where peers connect to this endpoint (valid after start).
  virtual std::string address() const = 0;

  // Starts the transport thread and the listener. Call once, first.
  virtual Status start(TransportEvents events) = 0;

  // --- (a) frames ----------------------------------------------------------
  // (blocking) Connects to the endpoint at `address` and returns its name
  // once both sides know each other (on_peer_up then runs on both sides).
  // Connect one direction per pair of endpoints.
  virtual Expected<std::string> connect(const std::string& address, std::chrono::milliseconds timeout) = 0;
  // Queues a frame to a connected peer; never blocks. `unavailable` when the
  // peer is unknown or gone; `resource_exhausted` when too many bytes are
  // queued already (retry later: backpressure). The body is shared, not copied.
  virtual Status send(const std::string& peer, Frame frame) = 0;
  // Closes a connection after queued frames; on_peer_down runs on both sides.
  virtual void disconnect(const std::string& peer) = 0;
  virtual std::vector<std::string> peers() const = 0;

  // --- (b) regions and one-sided moves --------------------------------------
  // (blocking) Registers caller-owned memory [base, base+length) for peers'
  // puts/gets. The caller keeps it alive until deregister_region.
  virtual Expected<LocalRegion> register_region(void* base, size_t length) = 0;
  // (blocking) Allocates `length` bytes of memory the transport can expose
  // best (UCX: shared memory a local peer maps directly). Zero-filled.
  virtual Expected<LocalRegion> allocate_region(size_t length) = 0;
  // (blocking) Ends a registration (frees it if allocated here). Peers must
  // have stopped using it: deregister after the lease is released.
  virtual Status deregister_region(uint64_t region_id) = 0;

  // Writes local bytes into a peer's region; `done` runs when they are
  // remotely visible, or with an error (bounds, bad key, peer lost). Ops
  // outside [0, remote.length) fail with invalid_argument and move nothing.
  virtual void put(const std::string& peer, const RegionKey& remote, std::vector<RmaOp> ops, Completion done) = 0;
  // Reads a peer's region into local memory; same rules as put.
  virtual void get(const std::string& peer, const RegionKey& remote, std::vector<RmaOp> ops, Completion done) = 0;
  // Drops what this endpoint caches for a peer's region (UCX: the unpacked
  // rkey). Call when the lease on it ends. Optional: peer loss drops them all.
  virtual void forget_remote(const std::string& peer, uint64_t region_id) = 0;

  virtual TransportStats stats() const = 0;
};

// (blocking) put/get and wait for the completion.
Status put_wait(Transport& t, const std::string& peer, const RegionKey& remote, std::vector<RmaOp> ops);
Status get_wait(Transport& t, const std::string& peer, const RegionKey& remote, std::vector<RmaOp> ops);

// Checks ops against a region's length (used by every implementation).
Status check_bounds(const RegionKey& remote, const std::vector<RmaOp>& ops);

}  // namespace troupe::transport
