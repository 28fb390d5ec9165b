#include "actors/node/node.hpp"

#include <arpa/inet.h>
#include <netdb.h>
#include <spdlog/spdlog.h>

#include <random>

#include "actors/node/proxy.hpp"

namespace troupe::actors::node {

using Clock = std::chrono::steady_clock;
using transport::Frame;
using transport::Status;

namespace {

uint64_t unix_nanos() {
  return static_cast<uint64_t>(
      std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::system_clock::now().time_since_epoch()).count());
}

// An IPv4 address for `host` (a literal, or a DNS name such as a Kubernetes
// headless service's pod record); empty when it does not resolve (yet).
std::string resolve_ipv4(const std::string& host) {
  in_addr a{};
  if (inet_pton(AF_INET, host.c_str(), &a) == 1) return host;
  addrinfo hints{};
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  if (getaddrinfo(host.c_str(), nullptr, &hints, &res) != 0 || res == nullptr) return {};
  char buf[INET_ADDRSTRLEN] = {};
  inet_ntop(AF_INET, &reinterpret_cast<sockaddr_in*>(res->ai_addr)->sin_addr, buf, sizeof buf);
  freeaddrinfo(res);
  return buf;
}

// The node actor: heartbeats and expiries on a timer, and the Calls remote
// proxies make to local actors (a CAF request needs an actor to wait in).
caf::behavior node_actor(caf::event_based_actor* self, std::weak_ptr<Node> node, std::chrono::milliseconds every) {
  self->delayed_send(self, every, tick_atom::value);
  return {
      [=](tick_atom) {
        auto n = node.lock();
        if (!n) {
          self->quit();
          return;
        }
        n->on_tick();
        self->delayed_send(self, every, tick_atom::value);
      },
      [=](node_call_atom, const std::string& peer, uint64_t corr, const caf::actor& target, const caf::message& ask) {
        auto reply = [=](Node::ReplyValue v) {
          if (auto n = node.lock()) n->send_reply(peer, corr, v);
        };
        auto failed = [=](caf::error& e) { reply(Error(ErrorCode::unavailable, caf::to_string(e))); };
        const auto timeout = std::chrono::seconds(5);
        if (ask.match_elements<workers_atom>()) {
          self->request(target, timeout, workers_atom::value)
              .then([=](const std::vector<WorkerLoad>& loads) { reply(loads); }, failed);
        } else if (ask.match_elements<drain_atom, std::string>()) {
          self->request(target, timeout, drain_atom::value, ask.get_as<std::string>(1))
              .then([=](bool started) { reply(started); }, failed);
        } else if (ask.match_elements<scale_atom>()) {
          self->request(target, timeout, scale_atom::value).then([=](const std::string& s) { reply(s); }, failed);
        } else if (ask.match_elements<scale_atom, std::string, int32_t>()) {
          self->request(target, timeout, scale_atom::value, ask.get_as<std::string>(1), ask.get_as<int32_t>(2))
              .then([=](const std::string& s) { reply(s); }, failed);
        }
      },
  };
}

}  // namespace

Node::Node(caf::actor_system& system, NodeOptions options, std::unique_ptr<transport::Transport> transport)
    : system_(system), options_(std::move(options)), owned_transport_(std::move(transport)) {
  transport_ = owned_transport_.get();
  std::random_device rd;
  incarnation_ = (uint64_t{rd()} << 32) ^ rd() ^ unix_nanos();
  kv_ = std::make_unique<KvHandoff>(*transport_, options_.kv);
  for (const auto& spec : options_.peers) {
    Peer p;
    p.spec = spec;
    peers_[spec.name] = p;
  }
}

std::shared_ptr<Node> Node::start(caf::actor_system& system, NodeOptions options,
                                  std::unique_ptr<transport::Transport> transport) {
  std::shared_ptr<Node> n(new Node(system, std::move(options), std::move(transport)));
  std::weak_ptr<Node> weak = n;
  transport::TransportEvents ev;
  ev.on_frame = [weak](const std::string& peer, Frame f) {
    if (auto s = weak.lock()) s->on_frame(peer, std::move(f));
  };
  ev.on_peer_up = [weak](const std::string& peer) {
    if (auto s = weak.lock()) s->on_peer_up(peer);
  };
  ev.on_peer_down = [weak](const std::string& peer, const Error& why) {
    if (auto s = weak.lock()) s->on_peer_down(peer, why);
  };
  ev.on_bad_frame = [name = n->options_.name](const std::string& peer, const messages::FrameFault& f) {
    spdlog::warn("node {}: bad frame from {}: {}", name, peer, f.error.what());
  };
  if (auto s = n->transport_->start(std::move(ev)); !s) throw s.error();
  n->node_actor_ = system.spawn(node_actor, weak, n->options_.heartbeat_every);
  n->dialer_ = std::thread([n = n.get()] { n->dial_loop(); });
  spdlog::info("node {}: listening at {}", n->options_.name, n->transport_->address());
  return n;
}

Node::~Node() { stop(); }

void Node::stop() {
  std::call_once(stopped_, [this] {
    stopping_ = true;
    dial_cv_.notify_all();
    if (dialer_.joinable()) dialer_.join();
    if (node_actor_) caf::anon_send_exit(node_actor_, caf::exit_reason::user_shutdown);
    while (users_.load() > 0) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    kv_->abandon();
    // Peers see this process go; no callback runs once the transport is gone,
    // and closing it frees the regions lent to takers.
    owned_transport_.reset();
  });
  std::vector<caf::actor> all;
  {
    std::lock_guard lock(mu_);
    for (auto& [k, p] : proxies_) all.push_back(p);
    for (auto& [k, p] : stable_) all.push_back(p);
    proxies_.clear();
    stable_.clear();
    proxy_refs_.clear();
    exported_.clear();
    published_.clear();
    registrations_.clear();
    calls_.clear();
    handoffs_.clear();
  }
  for (auto& p : all) caf::anon_send(p, proxy_quit_atom::value, caf::make_error(caf::exit_reason::user_shutdown));
}

std::string Node::address() const {
  Use use(*this);
  return use ? transport_->address() : std::string{};
}

void Node::publish(const std::string& name, caf::actor actor) {
  std::lock_guard lock(mu_);
  published_[name] = std::move(actor);
}

caf::actor Node::remote(const std::string& peer, const std::string& name) {
  std::lock_guard lock(mu_);
  auto key = std::make_pair(peer, name);
  if (auto it = stable_.find(key); it != stable_.end()) return it->second;
  ProxyRef ref{peer, 0, name};
  auto p = spawn_proxy(system_, weak_from_this(), ref);
  stable_[key] = p;
  proxy_refs_[p.address()] = ref;
  return p;
}

void Node::set_weights_ready(bool ready) {
  weights_ready_ = ready;
  std::vector<std::string> up;
  {
    std::lock_guard lock(mu_);
    for (auto& [n, p] : peers_) {
      if (p.up) up.push_back(n);
    }
  }
  for (auto& p : up) send_heartbeat(p);
}

std::string Node::not_ready() const {
  std::string why;
  auto add = [&](const std::string& s) { why += (why.empty() ? "" : "; ") + s; };
  if (stopping_) add("stopping");
  if (options_.has_weights && !weights_ready_) add("loading the model weights");
  std::lock_guard lock(mu_);
  for (const auto& [n, p] : peers_) {
    if (!p.spec.required) continue;
    if (!p.up) add("peer " + n + " not connected");
    else if (!p.weights_ready) add("peer " + n + " not ready");
  }
  return why;
}

std::vector<PeerStatus> Node::peers() const {
  std::vector<PeerStatus> out;
  std::lock_guard lock(mu_);
  for (const auto& [n, p] : peers_) {
    out.push_back({n, p.up, p.weights_ready, p.spec.required, p.spec.dial, p.up ? p.handoffs_outstanding : 0});
  }
  return out;
}

bool Node::connected(const std::string& peer) const {
  std::lock_guard lock(mu_);
  auto it = peers_.find(peer);
  return it != peers_.end() && it->second.up;
}

NodeStats Node::stats() const {
  NodeStats s;
  {
    std::lock_guard lock(mu_);
    for (const auto& [n, p] : peers_) s.peers_up += p.up ? 1 : 0;
    s.proxies = proxies_.size();
    s.exported = exported_.size();
    s.handoffs_pending = handoffs_.size();
    s.undeliverable = undeliverable_;
  }
  if (Use use(*this); use) {
    auto t = transport_->stats();
    s.frames_sent = t.frames_sent;
    s.frames_received = t.frames_received;
  }
  s.kv = kv_->stats();
  return s;
}

// ------------------------------------------------------------------ refs

void Node::to_wire(const caf::actor& actor, msg::ActorRef::Builder out) {
  if (!actor) return;
  {
    std::lock_guard lock(mu_);
    if (auto it = proxy_refs_.find(actor.address()); it != proxy_refs_.end()) {
      out.setNode(it->second.peer);
      out.setId(it->second.id);
      out.setName(it->second.name);
      return;
    }
  }
  const uint64_t id = actor.id();
  bool fresh;
  {
    std::lock_guard lock(mu_);
    fresh = exported_.emplace(id, actor).second;
  }
  if (fresh) {
    // Not under the lock: the functor runs at once if the actor already ended.
    std::weak_ptr<Node> weak = weak_from_this();
    caf::actor_cast<caf::abstract_actor*>(actor)->attach_functor([weak, id](const caf::error& reason) {
      if (auto n = weak.lock()) n->on_local_exit(id, reason);
    });
  }
  out.setNode(options_.name);
  out.setId(id);
}

caf::actor Node::from_wire(msg::ActorRef::Reader ref) {
  const std::string node = ref.getNode();
  if (node.empty()) return nullptr;
  if (node == options_.name) return local(ref);
  if (ref.getId() == 0) return remote(node, ref.getName());
  return proxy_for(node, ref.getId(), ref.getName());
}

caf::actor Node::local(msg::ActorRef::Reader ref) {
  std::lock_guard lock(mu_);
  if (ref.getId() != 0) {
    auto it = exported_.find(ref.getId());
    return it == exported_.end() ? nullptr : it->second;
  }
  auto it = published_.find(ref.getName());
  return it == published_.end() ? nullptr : it->second;
}

caf::actor Node::proxy_for(const std::string& peer, uint64_t id, const std::string& label) {
  {
    std::lock_guard lock(mu_);
    auto key = std::make_pair(peer, id);
    if (auto it = proxies_.find(key); it != proxies_.end()) return it->second;
    auto pit = peers_.find(peer);
    if (pit != peers_.end()) {
      // Not connected (yet, or again after a restart): its messages wait for the connection a while.
      ProxyRef ref{peer, id, label, pit->second.up ? std::chrono::milliseconds(0) : options_.pending_wait};
      auto p = spawn_proxy(system_, weak_from_this(), ref);
      proxies_[key] = p;
      proxy_refs_[p.address()] = ref;
      return p;
    }
  }
  // A process this one does not know: a handle whose monitors fire at once.
  return dead_proxy(label + "@" + peer);
}

caf::actor Node::dead_proxy(const std::string& label) {
  auto p = spawn_proxy(system_, std::weak_ptr<Node>{}, ProxyRef{"", 0, label});
  caf::anon_send(p, proxy_quit_atom::value, caf::make_error(caf::exit_reason::remote_link_unreachable));
  return p;
}

void Node::on_local_exit(uint64_t id, const caf::error& reason) {
  std::vector<std::string> up;
  {
    std::lock_guard lock(mu_);
    exported_.erase(id);
    for (auto it = registrations_.begin(); it != registrations_.end();) {
      it = it->second.worker.id() == id ? registrations_.erase(it) : std::next(it);
    }
    for (auto& [n, p] : peers_) {
      if (p.up) up.push_back(n);
    }
  }
  Use use(*this);
  if (!use) return;
  for (const auto& peer : up) {
    messages::FrameBuilder<msg::ActorMessage> b;
    auto e = b.root().getBody().initExited();
    e.setId(id);
    e.setNormal(reason == caf::exit_reason::normal || !reason);
    e.setReason(caf::to_string(reason));
    (void)transport_->send(peer, b.finish(0));
  }
}

// ------------------------------------------------------------------ outgoing

Expected<Outgoing> Node::build(const ProxyRef& ref, const caf::message& m) {
  Use use(*this);
  if (!use) return Error(ErrorCode::unavailable, "the node is stopping");
  if (ref.peer.empty()) return Error(ErrorCode::unavailable, "the actor is gone");
  messages::FrameBuilder<msg::ActorMessage> b;
  auto target = b.root().initTarget();
  target.setNode(ref.peer);
  target.setId(ref.id);
  target.setName(ref.name);
  auto body = b.root().getBody();
  Outgoing out;
  uint64_t request_id = 0;
  if (m.match_elements<Handoff>()) {
    const auto& h = m.get_as<Handoff>(0);
    if (!h.image) return Error(ErrorCode::invalid_argument, "a Handoff without a state image");
    auto hb = body.initHandoff();
    node::to_wire(h.job, *this, hb.initJob());
    to_wire(h.from, hb.initFrom());
    hb.setHandoffId(h.handoff_id);
    node::to_wire(*h.image, hb.initImage());
    auto lease = kv_->lend(ref.peer, *h.image, options_.handoff_ttl, hb.initOffer());
    if (!lease) return lease.error();
    out.lease = *lease;
    out.from = h.from;
    out.handoff = h.handoff_id;
    request_id = h.job.id;
    std::lock_guard lock(mu_);
    handoffs_[*lease] = {ref.peer, h.from, h.handoff_id, Clock::now() + options_.handoff_ttl};
  } else {
    std::string why;
    if (!encode_body(m, *this, body, request_id, why)) return Error(ErrorCode::unsupported, why);
    if (ref.id == 0 && m.match_elements<register_atom, caf::actor, std::string, uint8_t>()) {
      Registration r{ref.peer, ref.name, m.get_as<caf::actor>(1), m.get_as<std::string>(2), m.get_as<uint8_t>(3)};
      std::lock_guard lock(mu_);
      registrations_[r.name] = r;
    }
  }
  out.frame = b.finish(request_id);
  return out;
}

Expected<Frame> Node::build_call(const ProxyRef& ref, const caf::message& m, const caf::actor& proxy, uint64_t& corr) {
  if (stopping_) return Error(ErrorCode::unavailable, "the node is stopping");
  if (ref.peer.empty()) return Error(ErrorCode::unavailable, "the actor is gone");
  msg::CallKind kind;
  if (m.match_elements<workers_atom>()) {
    kind = msg::CallKind::ROUTER_WORKERS;
  } else if (m.match_elements<drain_atom, std::string>()) {
    kind = msg::CallKind::FLEET_DRAIN;
  } else if (m.match_elements<scale_atom>()) {
    kind = msg::CallKind::FLEET_SCALE;
  } else if (m.match_elements<scale_atom, std::string, int32_t>()) {
    kind = msg::CallKind::FLEET_SCALE_TO;
  } else {
    return Error(ErrorCode::unsupported, "a request the fabric does not carry: " + caf::to_string(m));
  }
  {
    std::lock_guard lock(mu_);
    corr = next_corr_++;
    calls_[corr] = proxy;
  }
  messages::FrameBuilder<msg::ActorMessage> b;
  auto target = b.root().initTarget();
  target.setNode(ref.peer);
  target.setId(ref.id);
  target.setName(ref.name);
  auto call = b.root().getBody().initCall();
  call.setCorr(corr);
  call.setKind(kind);
  if (kind == msg::CallKind::FLEET_DRAIN || kind == msg::CallKind::FLEET_SCALE_TO) call.setName(m.get_as<std::string>(1));
  if (kind == msg::CallKind::FLEET_SCALE_TO) call.setCount(m.get_as<int32_t>(2));
  return b.finish(0);
}

Status Node::send(const std::string& peer, const Outgoing& out) {
  Use use(*this);
  if (!use) return Error(ErrorCode::unavailable, "the node is stopping");
  return transport_->send(peer, out.frame);
}

void Node::drop(const std::string& peer, const Outgoing& out) {
  if (out.lease == 0) return;
  // The offer never left: end the lease and let the prefill worker give the request back.
  kv_->on_release(peer, out.lease);
  {
    std::lock_guard lock(mu_);
    handoffs_.erase(out.lease);
  }
  if (out.from) caf::anon_send(out.from, release_atom::value, out.handoff);
}

void Node::forget(const caf::actor_addr& proxy) {
  std::lock_guard lock(mu_);
  auto it = proxy_refs_.find(proxy);
  if (it == proxy_refs_.end()) return;
  proxies_.erase({it->second.peer, it->second.id});
  proxy_refs_.erase(it);
}

void Node::send_reply(const std::string& peer, uint64_t corr, const ReplyValue& value) {
  Use use(*this);
  if (!use) return;
  messages::FrameBuilder<msg::ActorMessage> b;
  auto reply = b.root().getBody().initReply();
  reply.setCorr(corr);
  if (auto* loads = std::get_if<std::vector<WorkerLoad>>(&value)) {
    auto list = reply.initWorkers(static_cast<unsigned>(loads->size()));
    for (size_t i = 0; i < loads->size(); ++i) node::to_wire((*loads)[i], *this, list[static_cast<unsigned>(i)]);
  } else if (auto* flag = std::get_if<bool>(&value)) {
    reply.setFlag(*flag);
  } else if (auto* text = std::get_if<std::string>(&value)) {
    reply.setText(messages::wire_text(*text));
  } else {
    const auto& err = std::get<Error>(value);
    auto e = reply.initError();
    e.setCode(messages::to_wire(err.code()));
    e.setMessage(err.what());
  }
  (void)transport_->send(peer, b.finish(0));
}

void Node::send_heartbeat(const std::string& peer) {
  Use use(*this);
  if (!use) return;
  messages::FrameBuilder<msg::Heartbeat> b;
  auto h = b.root();
  h.setSender(options_.name);
  {
    std::lock_guard lock(mu_);
    h.setSeq(++heartbeat_seq_);
  }
  h.setSentUnixNanos(unix_nanos());
  h.setIncarnation(incarnation_);
  h.setWeightsReady(!options_.has_weights || weights_ready_);
  size_t pending = 0;  // handoffs lent from here whose taker has not confirmed, or their KV leases
  {
    std::lock_guard lock(mu_);
    pending = handoffs_.size();
  }
  h.initLoad().setHandoffsOutstanding(static_cast<uint32_t>(std::max<size_t>(kv_->stats().leases, pending)));
  (void)transport_->send(peer, b.finish(0));
}

void Node::on_tick() {
  Use use(*this);
  if (!use) return;
  const auto now = Clock::now();
  std::vector<std::string> beat, silent;
  {
    std::lock_guard lock(mu_);
    for (auto& [n, p] : peers_) {
      if (!p.up) continue;
      if (now - p.last_heard > options_.peer_silence) silent.push_back(n);
      else beat.push_back(n);
    }
  }
  for (const auto& p : beat) send_heartbeat(p);
  for (const auto& p : silent) {
    spdlog::warn("node {}: {} has been silent for more than {} ms; dropping it", options_.name, p,
                 options_.peer_silence.count());
    transport_->disconnect(p);
  }
  kv_->expire(now);
  // A handoff its taker never answered (the frame reached a worker that died
  // before confirming, or a restarted peer that no longer knows the target):
  // the prefill worker's timer has given the request back by now.
  size_t stale = 0;
  {
    std::lock_guard lock(mu_);
    stale = std::erase_if(handoffs_, [&](const auto& kv) { return kv.second.deadline <= now; });
  }
  if (stale) spdlog::warn("node {}: {} handoff(s) unconfirmed past their ttl; no longer pending", options_.name, stale);
}

// ------------------------------------------------------------------ incoming

void Node::on_frame(const std::string& peer, Frame frame) {
  if (stopping_) return;
  {
    std::lock_guard lock(mu_);
    auto it = peers_.find(peer);
    if (it != peers_.end()) it->second.last_heard = Clock::now();
  }
  switch (frame.kind()) {
    case msg::Kind::ACTOR_MESSAGE:
      on_actor_message(peer, frame);
      return;
    case msg::Kind::HEARTBEAT: {
      auto v = messages::open<msg::Heartbeat>(frame);
      if (!v) return;
      bool restarted = false;
      {
        std::lock_guard lock(mu_);
        auto it = peers_.find(peer);
        if (it == peers_.end()) return;
        auto& p = it->second;
        const uint64_t inc = v->root().getIncarnation();
        restarted = p.incarnation != 0 && p.incarnation != inc;
        p.incarnation = inc;
        p.weights_ready = v->root().getWeightsReady();
        p.handoffs_outstanding = v->root().getLoad().getHandoffsOutstanding();
      }
      if (restarted) {
        // The transport reports a restart as down then up; this only guards
        // against a peer that came back under the same connection.
        spdlog::warn("node {}: {} restarted", options_.name, peer);
      }
      return;
    }
    case msg::Kind::KV_CONFIRM:
      if (auto v = messages::open<msg::KvConfirm>(frame)) kv_->on_confirm(peer, v->root().getLeaseId());
      return;
    case msg::Kind::KV_RELEASE:
      if (auto v = messages::open<msg::KvRelease>(frame)) {
        if (v->root().getReason() != msg::ReleaseReason::CONFIRMED) {
          spdlog::warn("node {}: {} released KV lease {}: {}", options_.name, peer, v->root().getLeaseId(),
                       v->root().getMessage().cStr());
        }
        kv_->on_release(peer, v->root().getLeaseId());
        if (v->root().getReason() != msg::ReleaseReason::CONFIRMED) {
          // The taker gave up on the pages: it recomputes (and confirms to the
          // prefill worker itself) or has told that worker to give the request back.
          std::lock_guard lock(mu_);
          if (auto it = handoffs_.find(v->root().getLeaseId()); it != handoffs_.end() && it->second.peer == peer) {
            handoffs_.erase(it);
          }
        }
      }
      return;
    case msg::Kind::KV_PULL:
      return;  // the taker started its gets; the lease's expiry stands
    case msg::Kind::ERROR:
      if (auto v = messages::open<msg::Error>(frame)) {
        spdlog::warn("node {}: {} answered an error: {}", options_.name, peer, v->root().getMessage().cStr());
      }
      return;
    default:
      spdlog::warn("node {}: {} sent a {} frame, which the fabric does not use", options_.name, peer,
                   messages::kind_name(frame.kind()));
      return;
  }
}

void Node::on_actor_message(const std::string& peer, const Frame& frame) {
  auto v = messages::open<msg::ActorMessage>(frame);
  if (!v) {
    spdlog::warn("node {}: unreadable actor message from {}: {}", options_.name, peer, v.fault().error.what());
    return;
  }
  auto m = v->root();
  auto body = m.getBody();
  using B = msg::ActorMessage::Body;
  switch (body.which()) {
    case B::REPLY: {
      auto r = body.getReply();
      caf::actor proxy;
      {
        std::lock_guard lock(mu_);
        auto it = calls_.find(r.getCorr());
        if (it == calls_.end()) return;
        proxy = it->second;
        calls_.erase(it);
      }
      switch (r.which()) {
        case msg::Reply::WORKERS: {
          std::vector<WorkerLoad> loads;
          for (auto l : r.getWorkers()) loads.push_back(node::from_wire(l, *this));
          caf::anon_send(proxy, proxy_reply_atom::value, r.getCorr(), caf::make_message(std::move(loads)));
          break;
        }
        case msg::Reply::FLAG:
          caf::anon_send(proxy, proxy_reply_atom::value, r.getCorr(), caf::make_message(r.getFlag()));
          break;
        case msg::Reply::TEXT:
          caf::anon_send(proxy, proxy_reply_atom::value, r.getCorr(), caf::make_message(std::string(r.getText().cStr())));
          break;
        default:
          caf::anon_send(proxy, proxy_reply_atom::value, r.getCorr(), std::string(r.getError().getMessage().cStr()));
          break;
      }
      return;
    }
    case B::EXITED: {
      auto e = body.getExited();
      caf::actor proxy;
      {
        std::lock_guard lock(mu_);
        auto it = proxies_.find({peer, e.getId()});
        if (it == proxies_.end()) return;
        proxy = it->second;
        proxy_refs_.erase(proxy.address());
        proxies_.erase(it);
      }
      caf::error reason = caf::make_error(e.getNormal() ? caf::exit_reason::normal : caf::exit_reason::unknown);
      caf::anon_send(proxy, proxy_quit_atom::value, reason);
      return;
    }
    case B::HANDOFF:
      on_handoff(peer, m);
      return;
    default:
      break;
  }
  if (m.getTarget().getNode() != options_.name) {
    spdlog::warn("node {}: {} sent a message for {}, not for this process", options_.name, peer,
                 m.getTarget().getNode().cStr());
    return;
  }
  caf::actor target = local(m.getTarget());
  if (!target) {
    std::lock_guard lock(mu_);
    ++undeliverable_;
    spdlog::debug("node {}: {} sent a message for actor {} ({}), which is gone", options_.name, peer,
                  m.getTarget().getId(), m.getTarget().getName().cStr());
    return;
  }
  if (body.isCall()) {
    auto call = body.getCall();
    caf::message ask;
    switch (call.getKind()) {
      case msg::CallKind::ROUTER_WORKERS: ask = caf::make_message(workers_atom::value); break;
      case msg::CallKind::FLEET_DRAIN: ask = caf::make_message(drain_atom::value, std::string(call.getName().cStr())); break;
      case msg::CallKind::FLEET_SCALE: ask = caf::make_message(scale_atom::value); break;
      case msg::CallKind::FLEET_SCALE_TO:
        ask = caf::make_message(scale_atom::value, std::string(call.getName().cStr()), call.getCount());
        break;
    }
    if (ask.empty()) {  // a kind this build does not know (a newer peer)
      send_reply(peer, call.getCorr(), Error(ErrorCode::unsupported, "a call this process does not answer"));
      return;
    }
    caf::anon_send(node_actor_, node_call_atom::value, peer, call.getCorr(), target, std::move(ask));
    return;
  }
  if (body.isConfirm()) {  // the taker's worker holds the state: the handoff is over
    std::lock_guard lock(mu_);
    for (auto it = handoffs_.begin(); it != handoffs_.end(); ++it) {
      if (it->second.peer == peer && it->second.handoff == body.getConfirm() && it->second.from == target) {
        handoffs_.erase(it);
        break;
      }
    }
  }
  if (!deliver_body(body, *this, target)) {
    spdlog::warn("node {}: {} sent a message this process does not understand", options_.name, peer);
  }
}

void Node::on_handoff(const std::string& peer, msg::ActorMessage::Reader m) {
  auto h = m.getBody().getHandoff();
  caf::actor target = m.getTarget().getNode() == options_.name ? local(m.getTarget()) : nullptr;
  Job job = node::from_wire(h.getJob(), *this);
  caf::actor from = from_wire(h.getFrom());
  const uint64_t hid = h.getHandoffId();
  if (!target) {
    // Nobody here continues it: free the owner's pages, and the prefill
    // worker gives the request back to its gateway (which resubmits).
    messages::FrameBuilder<msg::KvRelease> b;
    b.root().setLeaseId(h.getOffer().getLeaseId());
    b.root().setReason(msg::ReleaseReason::FAILED);
    b.root().setMessage("the target worker is gone");
    (void)transport_->send(peer, b.finish(job.id));
    if (from) caf::anon_send(from, release_atom::value, hid);
    return;
  }
  engine::SequenceImage image = image_from_wire(h.getImage());
  const std::string me = options_.name;
  kv_->pull(peer, h.getOffer(), std::move(image),
            [target, job, from, hid, me](Expected<engine::SequenceImage> pulled) mutable {
              if (pulled) {
                Handoff out;
                out.job = std::move(job);
                out.image = std::make_shared<const engine::SequenceImage>(std::move(*pulled));
                out.from = from;
                out.handoff_id = hid;
                caf::anon_send(target, std::move(out));
                return;
              }
              // Recompute here instead: the job carries the prompt and the
              // tokens sampled so far; the prefill side may free its pages.
              spdlog::warn("node {}: KV pull for request {} failed ({}); recomputing it", me, job.id,
                           pulled.error().what());
              caf::anon_send(target, std::move(job));
              if (from) caf::anon_send(from, confirm_atom::value, hid);
            });
}

void Node::on_peer_up(const std::string& peer) {
  if (stopping_) return;
  std::vector<Registration> regs;
  {
    std::lock_guard lock(mu_);
    auto& p = peers_[peer];
    if (p.spec.name.empty()) p.spec.name = peer;  // a peer that dialled in without being listed
    p.up = true;
    p.weights_ready = false;
    p.incarnation = 0;
    p.last_heard = Clock::now();
    p.backoff = std::chrono::milliseconds(0);
    // Taken with `up` set: a registration made after this point (connected()
    // is already true) goes out by itself and must not be sent twice.
    for (auto& [n, r] : registrations_) {
      if (r.peer == peer) regs.push_back(r);
    }
  }
  spdlog::info("node {}: peer {} up", options_.name, peer);
  send_heartbeat(peer);
  replay_registrations(peer, regs);
}

void Node::replay_registrations(const std::string& peer, const std::vector<Registration>& regs) {
  for (const auto& r : regs) {
    auto out = build(ProxyRef{r.peer, 0, r.target},
                     caf::make_message(register_atom::value, r.worker, r.name, r.role));
    if (out) (void)send(peer, *out);
  }
}

void Node::on_peer_down(const std::string& peer, const Error& why) {
  if (stopping_) return;
  std::vector<caf::actor> dying;
  std::vector<PendingHandoff> released;
  {
    std::lock_guard lock(mu_);
    if (auto it = peers_.find(peer); it != peers_.end()) {
      it->second.up = false;
      it->second.weights_ready = false;
      it->second.next_dial = Clock::now();
    }
    for (auto it = proxies_.begin(); it != proxies_.end();) {
      if (it->first.first == peer) {
        dying.push_back(it->second);
        proxy_refs_.erase(it->second.address());
        it = proxies_.erase(it);
      } else {
        ++it;
      }
    }
    for (auto it = handoffs_.begin(); it != handoffs_.end();) {
      if (it->second.peer == peer) {
        released.push_back(it->second);
        it = handoffs_.erase(it);
      } else {
        ++it;
      }
    }
  }
  spdlog::warn("node {}: peer {} down ({}): {} proxies end, {} handoffs released", options_.name, peer, why.what(),
               dying.size(), released.size());
  for (auto& p : dying) {
    caf::anon_send(p, proxy_quit_atom::value, caf::make_error(caf::exit_reason::remote_link_unreachable));
  }
  kv_->on_peer_down(peer);
  // The prefill worker gives each request back (its gateway resubmits it).
  for (auto& h : released) {
    if (h.from) caf::anon_send(h.from, release_atom::value, h.handoff);
  }
  dial_cv_.notify_all();
}

// ------------------------------------------------------------------ dialling

void Node::dial_loop() {
  while (!stopping_) {
    std::vector<PeerSpec> due;
    const auto now = Clock::now();
    {
      std::lock_guard lock(mu_);
      for (auto& [n, p] : peers_) {
        if (p.spec.dial && !p.up && now >= p.next_dial && (!p.spec.host.empty() || !p.spec.address.empty())) {
          due.push_back(p.spec);
        }
      }
    }
    for (const auto& spec : due) {
      if (stopping_) return;
      std::string address = spec.address;
      if (address.empty()) {
        const std::string ip = resolve_ipv4(spec.host);
        if (!ip.empty()) address = "ucx://" + ip + ":" + std::to_string(spec.port);
      }
      Expected<std::string> r = Error(ErrorCode::unavailable, spec.host + " does not resolve (yet)");
      if (!address.empty()) r = transport_->connect(address, options_.dial_timeout);
      std::lock_guard lock(mu_);
      auto& p = peers_[spec.name];
      if (r) {
        if (*r != spec.name) {
          spdlog::warn("node {}: dialled {} at {}:{} but {} answered", options_.name, spec.name, spec.host, spec.port,
                       *r);
        }
        continue;
      }
      p.backoff = std::min(options_.dial_backoff_max, std::max(std::chrono::milliseconds(100), p.backoff * 2));
      p.next_dial = Clock::now() + p.backoff;
      if (p.last_dial_error != r.error().what()) {
        p.last_dial_error = r.error().what();
        spdlog::info("node {}: {} not reachable at {} yet ({}); retrying every {} ms at most", options_.name, spec.name,
                     address.empty() ? spec.host : address, p.last_dial_error, options_.dial_backoff_max.count());
      }
    }
    std::unique_lock lock(dial_mu_);
    dial_cv_.wait_for(lock, std::chrono::milliseconds(50), [&] { return stopping_.load(); });
  }
}

}  // namespace troupe::actors::node
