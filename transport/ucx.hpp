// Transport between processes over UCX 1.13 (ucp): active messages for
// frames (eager for small, rendezvous for large; large frames to a peer on
// this host by puts into a ring it shares, see put_frames_arena_bytes), RMA with packed rkeys for
// regions, endpoint error mode PEER for failure detection. One worker, owned
// by one progress thread that sleeps in the worker's wakeup fd (epoll/poll)
// whenever there is nothing to do: no busy spinning (2-core machines).
//
// Environment: shared memory with error mode PEER needs
// UCX_MM_ERROR_HANDLING=y (openucx/ucx#8477); the transport sets it in its
// UCX config unless the environment says otherwise. Tests pin
// UCX_NET_DEVICES=lo. UCX headers stay out of this file.
#pragma once

#include <memory>
#include <string>

#include "transport/transport.hpp"

namespace troupe::transport {

struct UcxOptions {
  std::string name;                       // this endpoint's name (peers address frames to it)
  std::string listen_host = "127.0.0.1";  // empty: no listener (connect-only)
  uint16_t listen_port = 0;               // 0: an ephemeral port
  messages::FrameLimits limits;           // applied to every received frame
  uint32_t max_faults = 8;                // bad frames from one peer before it is dropped
  int idle_wakeup_ms = 100;               // longest sleep of the progress thread
  // Keep polling this long after the last work before sleeping. 0 (pure
  // wakeup loop) is right on shared 2-core machines; a dedicated core may
  // gain from ~50 us.
  int spin_after_work_us = 0;
  // Never sleep while a frame send, a rendezvous receive or an RMA operation
  // of ours is in flight: keep progressing (yielding the core between
  // rounds), so shared-memory fragments keep moving without a wakeup per
  // FIFO refill. Off by default until measured on a many-core host (on the
  // 2-core machine: 4 MiB frames 59 -> 65 % of ucp_am_bw, median of 3, within
  // the noise). TROUPE_UCX_SPIN_IN_FLIGHT=1 / =0 in the environment overrides.
  bool spin_while_in_flight = false;
  // Frames to a peer on this host (shared-memory lanes, direct endpoints) of
  // at least put_frames_from_bytes body bytes move by puts into a ring the
  // receiver shares with the sender (an "arena" of put_frames_arena_bytes of
  // UCX-allocated memory a connection, offered by the receiver after the first
  // such frame arrives), in chunks of put_frames_chunk_bytes,
  // each followed by a small notice; the receiver copies each chunk out and
  // hands its span back. Bulk copies through a ring small enough to stay in
  // the last-level cache, and a wakeup a chunk, where a rendezvous moves
  // through the shared-memory FIFO in 8 KB fragments with the progress threads
  // waking for refills. Frames to peers elsewhere take the rendezvous.
  // 0 arena bytes: never. TROUPE_UCX_FRAME_ARENA_MB overrides the arena size.
  // From 32 KiB (GPU host, session 13: 64 KiB frames 54 -> 80-86 % of
  // ucp_am_bw, 128 KiB 59 -> 84-88 %, 256 KiB 58 -> 83-124 %, against a 256 KiB threshold).
  size_t put_frames_from_bytes = 32 << 10;
  size_t put_frames_arena_bytes = 4 << 20;
  size_t put_frames_chunk_bytes = 1 << 20;  // at most half the arena
  // Bytes of frames queued or in flight, all peers together; send() answers
  // resource_exhausted beyond it (backpressure instead of unbounded memory).
  size_t max_send_queue_bytes = 1ull << 30;
  // Unpacked region keys kept per peer (least recently used idle ones go).
  size_t max_remote_keys = 32;
  // After the handshake, send frames and RMA over endpoints made from the
  // peers' worker addresses (see Conn in ucx_impl.hpp): 1.8x the frame
  // bandwidth at 4 MiB on one host (UCX gives a sockaddr endpoint's large
  // active messages tcp lanes). Off: everything over the sockaddr endpoints.
  // TROUPE_UCX_DIRECT=1 / =0 in the environment overrides this.
  bool direct_endpoints = true;
  // Recovery of a wedged shared-memory inbox. UCX 1.13's shared-memory FIFO
  // waits for good on a slot a writer claimed and never finished; a local
  // peer killed in the middle of writing into this process's FIFO leaves it
  // so, and nothing from any local peer arrives again. After a peer reached
  // over shared memory fails, every other such peer is probed; if none
  // answers within this many ms, the transport rebuilds its UCX worker (same
  // listening address): every connection is reported down and made again by
  // whoever dials it. 0: never probe. TROUPE_UCX_INBOX_PROBE_MS overrides.
  // (5 s: a node's peer_silence, so a busy peer is not taken for a wedge.)
  int inbox_probe_ms = 5000;
  bool answer_probes = true;  // test hook: false plays a peer whose answers never arrive
};

class UcxTransport final : public Transport {
 public:
  explicit UcxTransport(UcxOptions options);
  ~UcxTransport() override;

  const std::string& name() const override;
  // "ucx://HOST:PORT"
  std::string address() const override;
  Status start(TransportEvents events) override;
  Expected<std::string> connect(const std::string& address, std::chrono::milliseconds timeout) override;
  Status send(const std::string& peer, Frame frame) override;
  void disconnect(const std::string& peer) override;
  std::vector<std::string> peers() const override;
  Expected<LocalRegion> register_region(void* base, size_t length) override;
  Expected<LocalRegion> allocate_region(size_t length) override;
  Status deregister_region(uint64_t region_id) override;
  void put(const std::string& peer, const RegionKey& remote, std::vector<RmaOp> ops, Completion done) override;
  void get(const std::string& peer, const RegionKey& remote, std::vector<RmaOp> ops, Completion done) override;
  void forget_remote(const std::string& peer, uint64_t region_id) override;
  TransportStats stats() const override;

  // Test hook: sends `header` and `body` as one frame active message exactly
  // as given (no encoding, no checks), to exercise a peer's bad-bytes path.
  Status send_raw_for_test(const std::string& peer, std::vector<std::byte> header, std::vector<std::byte> body);
  // Test hook: sends a chunk notice of a frame by put (see
  // put_frames_arena_bytes) with the given frame header bytes, offsets and
  // length, under the next sequence number, and no put before it.
  Status send_put_notice_for_test(const std::string& peer, std::vector<std::byte> frame_header, uint64_t arena_offset,
                                  uint64_t body_offset, uint64_t bytes);

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace troupe::transport
