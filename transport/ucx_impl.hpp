// Private to transport/ucx*.cpp: the state behind UcxTransport. Everything
// below `--- progress thread only ---` is touched by the progress thread
// alone; callers reach it by posting commands (post / call).
#pragma once

#include <ucp/api/ucp.h>

#include <atomic>
#include <deque>
#include <future>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <thread>
#include <unordered_map>

#include "transport/ucx.hpp"

namespace troupe::transport {

// Active message ids.
enum : unsigned {
  // Handshake data: name, then (direct endpoints) a 0 byte, the sender's
  // u64 token for this connection and its worker address.
  kAmHello = 21,     // client -> server after connect, on the connection-manager endpoint
  kAmHelloAck = 22,  // server -> client
  // Frame: header = frame header (24 bytes) + u64 sequence [+ u64 token of
  // the receiver's connection, on a direct endpoint]; data = body.
  kAmFrame = 23,
  // Inbox probe over a direct endpoint: header = u64 token of the receiver's
  // connection + u64 nonce, no data; answered with kAmProbeReply, same header shape.
  kAmProbe = 24,
  kAmProbeReply = 25,
  // Frames by put (UcxOptions::put_frames_arena_bytes), all over direct
  // endpoints. Offer, receiver -> sender: header = u64 token of the sender's
  // connection, u64 arena address, u64 arena bytes; data = the packed rkey.
  kAmArenaOffer = 26,
  // Notice of one chunk of a frame, sender -> receiver: header = a direct
  // frame header (frame header, sequence, token) + u64 offset of the chunk in
  // the receiver's arena, u64 offset of the chunk in the body, u64 chunk bytes;
  // no data. A frame's chunks may come in any order.
  kAmFramePut = 27,
  // Release, receiver -> sender: header = u64 token, u64 offset; no data.
  kAmArenaRelease = 28,
};
inline constexpr size_t kAmFrameHeaderBytes = messages::kHeaderBytes + 8;
inline constexpr size_t kAmDirectHeaderBytes = kAmFrameHeaderBytes + 8;
inline constexpr size_t kAmPutHeaderBytes = kAmDirectHeaderBytes + 24;
inline constexpr size_t kMaxNameBytes = 255;

struct SendOp;

// Memory mapped with UCX here (a registered region, or a connection's frame arena).
struct LocalUcxRegion {
  ucp_mem_h memh = nullptr;
  std::byte* base = nullptr;
  size_t length = 0;
  bool allocated = false;
  RegionKey key;
};

// Parameters of a send-like nbx call (put, get, flush, active message, endpoint close) that
// completes through `cb(request, status, user)`.
inline ucp_request_param_t send_param(ucp_send_nbx_callback_t cb, void* user) {
  ucp_request_param_t p{};
  p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
  p.cb.send = cb;
  p.user_data = user;
  return p;
}

// One received frame slot, delivered in the sender's sequence order.
struct Arrival {
  bool ready = false;
  std::optional<Frame> frame;
  std::optional<FrameFault> fault;
  // A frame by put, while its chunks arrive: the header of its first notice,
  // the body being filled and the bytes copied so far.
  bool by_put = false;
  messages::FrameHeader header{};
  kj::Array<capnp::word> body;
  size_t body_got = 0;
};

// A peer. `ep` is the endpoint of the sockaddr connection (listener /
// connect); it carries the handshake. Both sides then open a direct endpoint
// to the other's worker address (`data_ep`) and send frames and RMA over it:
// UCX selects its lanes from the full worker addresses the way ucx_perftest's
// endpoints get them (shared memory on one host), where the sockaddr
// endpoint's lanes moved large messages over tcp (4 MiB frames at ~half the
// speed). Frames on the direct endpoint name the receiver's connection by a
// token (its Conn id) since they arrive without a reply endpoint.
struct Conn {
  enum class State { handshaking, up, closing };
  uint64_t id = 0;
  ucp_ep_h ep = nullptr;
  ucp_ep_h data_ep = nullptr;  // direct endpoint (null: everything over `ep`)
  uint64_t peer_token = 0;     // the peer's id for this connection
  bool shm = false;            // data_ep has shared-memory lanes (the peer is on this host)
  ucp_ep_h tx() const { return data_ep ? data_ep : ep; }
  std::string name;  // empty until the handshake
  State state = State::handshaking;
  uint64_t send_seq = 0;
  uint64_t recv_next = 0;
  std::map<uint64_t, Arrival> arrivals;
  // The peer's region id -> its unpacked key. At most UcxOptions::
  // max_remote_keys per peer: the least recently used idle one goes (an
  // unpacked key of a shared-memory region keeps that memory mapped here,
  // even after its owner freed it). `busy`: RMA batches using it.
  struct RemoteKey {
    ucp_rkey_h rkey = nullptr;
    uint64_t last_use = 0;
    unsigned busy = 0;
    bool forgotten = false;  // forget_remote came while busy: destroy when idle
  };
  std::map<uint64_t, RemoteKey> rkeys;
  // Frames by put (UcxOptions::put_frames_arena_bytes). in_arena: the memory
  // this side offered the peer for its frames. out_arena: the peer's arena
  // (its unpacked key), with the spans our frames hold in allocation order
  // until the peer releases them (a ring: `head` is where the next goes).
  struct OutArena {
    struct Span {
      uint64_t offset = 0, length = 0;
      bool released = false;
    };
    ucp_rkey_h rkey = nullptr;
    uint64_t address = 0;
    size_t length = 0;
    size_t head = 0;
    std::deque<Span> live;
    // Where `bytes` fit (offset), or nullopt while the live spans leave no room.
    std::optional<uint64_t> take(size_t bytes);
  };
  std::optional<LocalUcxRegion> in_arena;
  bool in_arena_tried = false;  // offered (or failed to): never again on this connection
  std::optional<OutArena> out_arena;
  std::deque<std::unique_ptr<SendOp>> put_waiting;  // by-put frames waiting for arena room, in order
  std::shared_ptr<std::promise<Expected<std::string>>> connect_promise;
  uint32_t faults = 0;
  std::optional<Error> down_reason;
  bool down_reported = false;  // on_peer_down already ran (replaced by a reconnect)
  // Rendezvous receives in flight. UCX 1.13 leaves one of them attached to
  // an endpoint that is flush-closed under it (and ucp_worker_destroy aborts
  // on it), so our own close waits for them: close_deferred until
  // `receiving` is 0 (a failed peer's endpoints are force-closed at once).
  unsigned receiving = 0;
  bool close_deferred = false;
  std::chrono::steady_clock::time_point down_since;
};

// An active message in flight; owns the header bytes (UCX 1.13 needs them
// until completion) and keeps the body alive.
struct SendOp {
  struct UcxTransport::Impl* impl = nullptr;
  size_t queued_bytes = 0;  // counted in Impl::send_queue_bytes until completion
  std::array<std::byte, kAmPutHeaderBytes> header{};
  size_t header_bytes = kAmFrameHeaderBytes;
  Frame frame;
  std::vector<std::byte> raw_header, raw_body;  // test hook and handshake
  // A frame by put: its connection and the body bytes put so far; a chunk of
  // one: the put and flush still outstanding.
  uint64_t conn_id = 0;
  size_t put_next = 0;
  unsigned put_outstanding = 0;
  bool put_failed = false;
};

// A rendezvous body being received into aligned memory.
struct RndvRecv {
  struct UcxTransport::Impl* impl = nullptr;
  uint64_t conn_id = 0;
  uint64_t seq = 0;
  messages::FrameHeader header;
  void* desc = nullptr;
  kj::Array<capnp::word> words;
};

// One put/get call: completes when every op (and the flush) did.
struct Batch {
  struct UcxTransport::Impl* impl = nullptr;
  Completion done;
  uint64_t conn_id = 0, region_id = 0;  // the remote key it holds busy (conn_id 0: none)
  Status status = Ok{};
  size_t outstanding = 0;
  bool issued = false;  // all ops posted; completion may run when outstanding hits 0
  void op_done(ucs_status_t st);
  void maybe_finish();
};

struct UcxTransport::Impl {
  UcxOptions opt;
  TransportEvents events;
  std::string address;
  std::vector<std::byte> worker_address;  // sent in the handshake (direct endpoints)
  ucp_context_h ctx = nullptr;
  ucp_worker_h worker = nullptr;
  ucp_listener_h listener = nullptr;
  int efd = -1;
  std::thread thread;
  std::atomic<std::thread::id> thread_id{};
  bool started = false;

  // Commands from other threads.
  std::mutex cmd_mu;
  std::deque<std::function<void()>> cmds;
  // Held while the worker is destroyed or made (reset_worker), so that other
  // threads' ucp_worker_signal never meets a dying worker.
  std::mutex worker_mu;
  void signal();
  bool stopping = false;  // guarded by cmd_mu

  // Names of connected peers, readable from any thread.
  mutable std::mutex names_mu;
  std::set<std::string> up_names;

  std::atomic<uint64_t> frames_sent{0}, frames_received{0}, bad_frames{0}, resets{0}, frames_by_put{0};
  std::atomic<size_t> rma_in_flight{0}, n_regions{0}, n_remote_keys{0}, send_queue_bytes{0};

  // --- progress thread only ---
  uint64_t next_conn = 1;
  std::map<uint64_t, std::unique_ptr<Conn>> conns;
  std::unordered_map<ucp_ep_h, uint64_t> by_ep;
  std::map<std::string, uint64_t> by_name;
  std::vector<ucp_conn_request_h> accepted;
  std::vector<std::pair<ucp_ep_h, ucs_status_t>> failed;
  std::vector<uint64_t> closed;          // conns with an endpoint close completed (one entry per endpoint)
  std::vector<uint64_t> close_ready;     // conns whose deferred close can start (last receive done)
  std::set<ucp_ep_h> closed_eps;         // those endpoints, until their conn is finished
  std::set<uint64_t> dirty;              // conns with arrivals to deliver
  std::set<void*> requests;              // frame sends and rendezvous receives UCX still holds
  std::deque<std::function<void()>> user_calls;  // events to run outside UCX callbacks
  std::map<uint64_t, LocalUcxRegion> regions;
  uint64_t next_region = 1;
  // Inbox probe (UcxOptions::inbox_probe_ms): set when a shared-memory peer
  // failed; cleared by any probe answer from a shared-memory peer. `probing`:
  // connections asked and not yet answered, by `probe_deadline`.
  bool inbox_suspect = false;
  std::set<uint64_t> probing;
  std::chrono::steady_clock::time_point probe_deadline;
  uint64_t probe_nonce = 0;
  std::chrono::steady_clock::time_point next_rebuild;  // while worker is null (a failed rebuild)

  Status init();
  Status init_worker();       // worker, wakeup fd, address, handlers, listener
  void destroy_worker();      // listener and worker (connections already gone)
  void stop_listening();      // rejects what was accepted and not yet taken, destroys the listener
  void run();
  void shutdown_in_thread();
  void teardown();

  // Runs `fn` on the progress thread; false once stopping.
  bool post(std::function<void()> fn);
  // Runs `fn` on the progress thread and waits for its result.
  template <class T>
  T call(std::function<T()> fn, T if_stopped);
  bool on_thread() const { return std::this_thread::get_id() == thread_id; }

  Conn* conn_by_ep(ucp_ep_h ep);
  Conn* conn_by_name(const std::string& name);
  Conn* conn_by_id(uint64_t id);
  Conn* add_conn(ucp_ep_h ep);
  ucp_ep_h create_server_ep(ucp_conn_request_h request);
  void start_connect(const std::string& host, uint16_t port, std::shared_ptr<std::promise<Expected<std::string>>> p);
  // Over `ep` (default: the connection-manager endpoint, with a reply endpoint).
  void send_am(Conn& c, unsigned id, std::unique_ptr<SendOp> op, std::span<const std::byte> body,
               ucp_ep_h ep = nullptr);
  // queued_bytes: what send() counted in send_queue_bytes (0 for internal frames).
  void send_frame(Conn& c, Frame frame, size_t queued_bytes = 0);
  void send_name(Conn& c, unsigned id);
  // Frames by put (ucx.cpp): the receiver's offer, the sender's puts of a
  // frame's chunks into the arena (false: no room for the rest yet), each
  // chunk's notice once its put is remotely visible, the receiver's copy out
  // and release, the cleanup.
  void offer_arena(Conn& c);
  void on_arena_offer(Conn& c, uint64_t address, uint64_t length, const std::vector<std::byte>& packed);
  bool put_chunks(Conn& c, SendOp& frame_op);
  void put_done(SendOp* chunk);
  void on_frame_put(uint64_t conn_id, uint64_t seq, uint64_t arena_offset, uint64_t body_offset, uint64_t bytes);
  void on_arena_release(Conn& c, uint64_t offset);
  void drop_arenas(Conn& c);
  void on_hello(Conn& c, std::string peer, bool is_ack, uint64_t token, std::vector<std::byte> address);
  void open_direct(Conn& c, uint64_t token, const std::vector<std::byte>& address);
  void mark_up(Conn& c, const std::string& peer);
  void deliver(Conn& c);
  void handle_fault(Conn& c, const FrameFault& fault);
  void close_conn(Conn& c, Error reason, bool force);
  void close_endpoints(Conn& c, bool force);
  void finish_close(uint64_t conn_id);
  void report_down(Conn& c);
  bool run_deferred();
  bool close_failed();
  void probe(Conn& c);
  void send_probe(Conn& c, unsigned id, uint64_t nonce);
  void on_probe(uint64_t conn_id, uint64_t nonce, bool is_reply);
  bool check_inbox();   // rebuilds the worker when the probes' time ran out
  void reset_worker(const std::string& why);
  // Ends every connection within about a second (force: cancel what is in
  // flight), each reported down (unless its name was cleared); the shutdown and
  // the worker rebuild.
  void end_all_connections(const Error& why, bool force);

  // RMA (ucx_rma.cpp)
  // Maps (allocate: allocates) memory with UCX and packs its key; no region id.
  Expected<LocalUcxRegion> map_memory(void* base, size_t length, bool allocate);
  Expected<LocalRegion> map_region(void* base, size_t length, bool allocate);
  Status unmap_region(uint64_t region_id);
  void start_rma(bool is_put, const std::string& peer, const RegionKey& remote, std::vector<RmaOp> ops, Completion done);
  // The peer's unpacked key for `remote` (unpacked and cached on first use).
  Expected<Conn::RemoteKey*> rkey_for(Conn& c, const RegionKey& remote);
  void release_rkey(uint64_t conn_id, uint64_t region_id);  // a batch is done with it
  uint64_t rkey_clock = 0;
  void drop_rkeys(Conn& c);
};

template <class T>
T UcxTransport::Impl::call(std::function<T()> fn, T if_stopped) {
  if (on_thread()) return fn();  // from a callback: run inline
  auto p = std::make_shared<std::promise<T>>();
  auto f = p->get_future();
  if (!post([p, fn = std::move(fn)] { p->set_value(fn()); })) return if_stopped;
  try {
    return f.get();
  } catch (const std::future_error&) {  // dropped by a shutdown
    return if_stopped;
  }
}

}  // namespace troupe::transport
