// The node: one per process, the bridge between CAF and the transport
// (docs/architecture.md, "The node and the fabric").
//
//  - It owns the Transport (UCX between processes; in-process in tests) and
//    knows its peers from the manifest: it dials the ones it should, with
//    retries, so processes come up in any order, and accepts the others.
//  - A remote actor is a local proxy actor. A proxy encodes what it receives
//    as an ActorMessage frame (messages/fabric.capnp); the node decodes
//    incoming frames and sends them to the local actor they name. Actor
//    handles inside messages travel as ActorRefs: a local actor is exported by
//    its id, a ref to a remote actor becomes its proxy, so handle equality,
//    monitors and replies work as in one process.
//  - Proxies of a peer's actors end with `remote_link_unreachable` when the
//    transport loses the peer (kill -9: milliseconds on loopback) or when it
//    falls silent for `peer_silence` (heartbeats every `heartbeat_every`), and
//    with the actor's own reason when that actor ends: local monitors get a
//    real down_msg, so supervision, the router's worker removal and the
//    gateway's resubmission need no fabric-specific code.
//  - Well-known actors (the router) are addressed by name through stable
//    proxies, which outlive a peer's restart; worker registrations sent
//    through them are replayed whenever the peer connects again.
//  - A Handoff to a remote worker lends the image's pages by RMA (kv_handoff.hpp)
//    and the taker's node pulls them before the worker sees the Handoff.
//
// Thread-safe. Transport callbacks run on the transport thread and never block.
#pragma once

#include <caf/all.hpp>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <variant>
#include <vector>

#include "actors/node/codec.hpp"
#include "actors/node/kv_handoff.hpp"
#include "transport/transport.hpp"

namespace troupe::actors::node {

struct PeerSpec {
  std::string name;       // the peer's transport name (its instance name)
  std::string host;       // IPv4 address or DNS name (resolved at every dial)
  uint16_t port = 0;
  std::string address;    // a full transport address ("inproc://b"); when set, host and port are unused
  bool dial = false;      // this process connects to it; else the peer connects here
  bool required = false;  // readiness waits for it (connected, weights loaded)
};

struct NodeOptions {
  std::string name;                                  // this process's transport name
  std::vector<PeerSpec> peers;
  bool has_weights = false;                          // readiness waits for set_weights_ready(true)
  std::chrono::milliseconds heartbeat_every{500};
  std::chrono::milliseconds peer_silence{5000};      // no frame for this long: the peer is dropped
  std::chrono::milliseconds dial_timeout{2000};
  std::chrono::milliseconds dial_backoff_max{2000};  // between failed dials of one peer
  // A lent image's pages are freed after this, and a handoff its taker has not
  // confirmed by then stops counting as pending (the prefill worker's own timer,
  // the topology's same handoff_timeout_s, has given the request back).
  std::chrono::milliseconds handoff_ttl{30000};
  // A message for an actor of a peer that is listed but not connected (yet,
  // or again after a restart) waits this long for the connection.
  std::chrono::milliseconds pending_wait{5000};
  KvHandoffOptions kv;
};

struct PeerStatus {
  std::string name;
  bool up = false;
  bool weights_ready = false;
  bool required = false;
  bool dial = false;
  uint32_t handoffs_outstanding = 0;  // from its last heartbeat: KV handoffs it lent that are not confirmed
};

struct NodeStats {
  size_t peers_up = 0;
  size_t proxies = 0;              // dynamic proxies of remote actors
  size_t exported = 0;             // local actors remote processes hold refs to
  size_t handoffs_pending = 0;     // handoffs lent from here whose worker has not confirmed
  uint64_t frames_sent = 0;
  uint64_t frames_received = 0;
  uint64_t undeliverable = 0;      // frames naming a local actor that is gone
  KvHandoffStats kv;
};

// Where a proxy's messages go.
struct ProxyRef {
  std::string peer;
  uint64_t id = 0;      // 0: a stable proxy of the well-known actor `name`
  std::string name;
  // > 0: the peer was not connected when the proxy was made; its messages
  // wait this long for the connection, then the proxy ends (unreachable).
  std::chrono::milliseconds wait{0};
};

// A frame a proxy sends, with what the node must undo if it cannot go.
struct Outgoing {
  transport::Frame frame;
  uint64_t lease = 0;   // a Handoff's KV lease
  caf::actor from;      // its prefill worker
  uint64_t handoff = 0;
};

class Node final : public RefMap, public std::enable_shared_from_this<Node> {
 public:
  // Starts `transport` (listening where it was configured), the node actor
  // (heartbeats, lease expiry, calls) and the dialer. Throws troupe::Error
  // when the transport cannot start.
  static std::shared_ptr<Node> start(caf::actor_system& system, NodeOptions options,
                                     std::unique_ptr<transport::Transport> transport);
  ~Node() override;
  Node(const Node&) = delete;
  Node& operator=(const Node&) = delete;

  // Closes every connection (peers see this process go), ends every proxy and
  // joins the dialer. Idempotent; the destructor calls it.
  void stop();

  const std::string& name() const { return options_.name; }
  std::string address() const;
  // A local actor remote processes address by `name` ("router", "gateway").
  void publish(const std::string& name, caf::actor actor);
  // The well-known actor `name` of process `peer`, as a stable proxy: it
  // survives the peer's restarts (messages sent while the peer is away are
  // dropped; registrations are replayed when it is back).
  caf::actor remote(const std::string& peer, const std::string& name);
  // This process's own weights are loaded (peers learn it from heartbeats).
  void set_weights_ready(bool ready);
  // Why this process is not ready, or "" when it is: every required peer
  // connected with its weights loaded, and its own weights loaded.
  std::string not_ready() const;
  std::vector<PeerStatus> peers() const;
  bool connected(const std::string& peer) const;
  NodeStats stats() const;

  // ---- for proxies and the node actor ---------------------------------------
  // The frame for `message` to `ref` (a Handoff lends its pages here).
  Expected<Outgoing> build(const ProxyRef& ref, const caf::message& message);
  // A call (request/response) through a proxy; `corr` names its reply.
  Expected<transport::Frame> build_call(const ProxyRef& ref, const caf::message& message, const caf::actor& proxy,
                                        uint64_t& corr);
  // Sends; `unavailable` when the peer is not connected (now), `resource_exhausted`
  // under backpressure (retry later).
  transport::Status send(const std::string& peer, const Outgoing& out);
  // `out` will never be sent: undoes what it started (its lease; the prefill
  // worker gets its request back).
  void drop(const std::string& peer, const Outgoing& out);
  // A proxy that gave up waiting for its peer: no longer handed out.
  void forget(const caf::actor_addr& proxy);
  void on_tick();
  // A Call's answer: its result (one of the Reply union's values) or an error.
  using ReplyValue = std::variant<std::vector<WorkerLoad>, bool, std::string, Error>;
  void send_reply(const std::string& peer, uint64_t corr, const ReplyValue& value);

  // ---- RefMap ---------------------------------------------------------------
  void to_wire(const caf::actor& actor, msg::ActorRef::Builder out) override;
  caf::actor from_wire(msg::ActorRef::Reader ref) override;

 private:
  struct Peer {
    PeerSpec spec;
    bool up = false;
    bool weights_ready = false;
    uint32_t handoffs_outstanding = 0;
    uint64_t incarnation = 0;
    std::chrono::steady_clock::time_point last_heard{};
    std::chrono::steady_clock::time_point next_dial{};
    std::chrono::milliseconds backoff{0};
    std::string last_dial_error;  // logged when it changes
  };
  struct Registration {
    std::string peer;
    std::string target;  // the stable proxy's name
    caf::actor worker;
    std::string name;
    uint8_t role = 0;
  };
  struct PendingHandoff {
    std::string peer;
    caf::actor from;
    uint64_t handoff = 0;
    std::chrono::steady_clock::time_point deadline{};  // lent + handoff_ttl
  };

  Node(caf::actor_system& system, NodeOptions options, std::unique_ptr<transport::Transport> transport);
  void on_frame(const std::string& peer, transport::Frame frame);
  void on_peer_up(const std::string& peer);
  void on_peer_down(const std::string& peer, const Error& why);
  void on_actor_message(const std::string& peer, const transport::Frame& frame);
  void on_handoff(const std::string& peer, msg::ActorMessage::Reader message);
  void on_local_exit(uint64_t id, const caf::error& reason);
  caf::actor local(msg::ActorRef::Reader ref);
  caf::actor proxy_for(const std::string& peer, uint64_t id, const std::string& label);
  caf::actor dead_proxy(const std::string& label);
  void send_heartbeat(const std::string& peer);
  void replay_registrations(const std::string& peer, const std::vector<Registration>& regs);
  void dial_loop();

  // Entry points called from outside the transport thread hold a Use: stop()
  // waits for them before it closes the transport.
  struct Use {
    explicit Use(const Node& n) : n_(n) {
      ++n_.users_;
      ok_ = !n_.stopping_;
    }
    ~Use() { --n_.users_; }
    explicit operator bool() const { return ok_; }
    const Node& n_;
    bool ok_ = false;
  };

  caf::actor_system& system_;
  NodeOptions options_;
  std::unique_ptr<transport::Transport> owned_transport_;
  // Stays valid while the transport's destructor runs (callbacks in flight may
  // still use it); nothing uses it once stop() returned.
  transport::Transport* transport_ = nullptr;
  std::unique_ptr<KvHandoff> kv_;
  caf::actor node_actor_;
  uint64_t incarnation_ = 0;
  std::atomic<bool> weights_ready_{false};
  std::atomic<bool> stopping_{false};
  mutable std::atomic<int> users_{0};
  std::once_flag stopped_;

  mutable std::mutex mu_;
  std::map<std::string, Peer> peers_;
  std::map<std::string, caf::actor> published_;
  std::map<uint64_t, caf::actor> exported_;
  std::map<std::pair<std::string, uint64_t>, caf::actor> proxies_;          // (peer, id)
  std::map<std::pair<std::string, std::string>, caf::actor> stable_;        // (peer, name)
  std::map<caf::actor_addr, ProxyRef> proxy_refs_;
  std::map<std::string, Registration> registrations_;                       // by worker name
  std::map<uint64_t, caf::actor> calls_;                                    // corr -> proxy
  std::map<uint64_t, PendingHandoff> handoffs_;                             // by lease
  uint64_t next_corr_ = 1;
  uint64_t heartbeat_seq_ = 0;
  uint64_t undeliverable_ = 0;

  std::mutex dial_mu_;
  std::condition_variable dial_cv_;
  std::thread dialer_;
};

// Spawns the proxy of a remote actor (used by the Node).
caf::actor spawn_proxy(caf::actor_system& system, std::weak_ptr<Node> node, ProxyRef ref);

}  // namespace troupe::actors::node
