// The proxy of a remote actor: whatever it receives goes to the node, which
// encodes it as a frame for the actor's process. Requests (CAF request/then)
// become Calls whose Replies the node hands back here. A proxy ends when its
// actor does or when its process is lost; monitors see the reason.
#include <spdlog/spdlog.h>

#include <deque>

#include "actors/node/node.hpp"
#include "actors/node/proxy.hpp"

namespace troupe::actors::node {
namespace {

struct ProxyState {
  static inline const char* name = "proxy";
  std::weak_ptr<Node> node;
  ProxyRef ref;
  std::deque<Outgoing> backlog;  // frames not sent yet (backpressure, or the peer not connected yet), in order
  std::map<uint64_t, caf::response_promise> calls;
  std::chrono::steady_clock::time_point wait_until{};  // a pending proxy waits for its peer until then
  bool retry_scheduled = false;
};

using Self = caf::stateful_actor<ProxyState>*;

void retry_later(Self self, std::chrono::milliseconds after) {
  if (self->state.retry_scheduled) return;
  self->state.retry_scheduled = true;
  self->delayed_send(self, after, proxy_retry_atom::value);
}

// Sends what is queued, in order; keeps the rest when the transport pushes
// back or, for a pending proxy, while its peer may still connect.
void flush(Self self) {
  auto node = self->state.node.lock();
  auto& st = self->state;
  auto& q = st.backlog;
  while (node && !q.empty()) {
    auto s = node->send(st.ref.peer, q.front());
    if (s) {
      st.wait_until = {};  // connected: from now on a failure means the peer is gone
      q.pop_front();
      continue;
    }
    if (s.error().code() == ErrorCode::resource_exhausted) {
      retry_later(self, std::chrono::milliseconds(2));
      return;
    }
    if (std::chrono::steady_clock::now() < st.wait_until) {
      retry_later(self, std::chrono::milliseconds(20));
      return;
    }
    spdlog::debug("proxy {}@{}: dropped a frame: {}", st.ref.name, st.ref.peer, s.error().what());
    node->drop(st.ref.peer, q.front());
    q.pop_front();
    if (st.wait_until != std::chrono::steady_clock::time_point{}) {
      // Its process never connected: the actor is as good as gone.
      for (auto& out : q) node->drop(st.ref.peer, out);
      q.clear();
      node->forget(caf::actor_cast<caf::actor_addr>(self));
      self->quit(caf::exit_reason::remote_link_unreachable);
      return;
    }
  }
  if (!node) q.clear();
}

caf::behavior proxy_actor(Self self, std::weak_ptr<Node> node, ProxyRef ref) {
  self->state.node = std::move(node);
  self->state.ref = std::move(ref);
  if (self->state.ref.wait.count() > 0) self->state.wait_until = std::chrono::steady_clock::now() + self->state.ref.wait;
  self->set_default_handler([](caf::scheduled_actor* s, caf::message_view& x) -> caf::result<caf::message> {
    auto* self = static_cast<caf::stateful_actor<ProxyState>*>(s);
    auto node = self->state.node.lock();
    if (!node) return caf::message{};
    caf::message m = x.copy_content_to_message();
    auto* element = self->current_mailbox_element();
    if (element != nullptr && element->mid.is_request()) {
      uint64_t corr = 0;
      auto frame = node->build_call(self->state.ref, m, caf::actor_cast<caf::actor>(self), corr);
      if (!frame) return caf::make_error(caf::sec::unexpected_message, frame.error().what());
      Outgoing out;
      out.frame = std::move(*frame);
      auto sent = node->send(self->state.ref.peer, out);
      if (!sent) return caf::make_error(caf::sec::request_receiver_down, std::string(sent.error().what()));
      auto rp = self->make_response_promise();
      self->state.calls[corr] = rp;
      return rp;
    }
    auto out = node->build(self->state.ref, m);
    if (!out) {
      spdlog::warn("proxy {}@{}: {}", self->state.ref.name, self->state.ref.peer, out.error().what());
      return caf::message{};
    }
    self->state.backlog.push_back(std::move(*out));
    if (self->state.backlog.size() == 1) flush(self);
    return caf::message{};
  });
  return {
      [=](proxy_retry_atom) {
        self->state.retry_scheduled = false;
        flush(self);
      },
      [=](proxy_reply_atom, uint64_t corr, const caf::message& result) {
        auto it = self->state.calls.find(corr);
        if (it == self->state.calls.end()) return;
        it->second.deliver(result);
        self->state.calls.erase(it);
      },
      [=](proxy_reply_atom, uint64_t corr, const std::string& error) {
        auto it = self->state.calls.find(corr);
        if (it == self->state.calls.end()) return;
        it->second.deliver(caf::make_error(caf::sec::runtime_error, error));
        self->state.calls.erase(it);
      },
      [=](proxy_quit_atom, const caf::error& reason) {
        for (auto& [corr, rp] : self->state.calls) rp.deliver(caf::make_error(caf::sec::request_receiver_down));
        self->state.calls.clear();
        self->quit(reason);
      },
  };
}

}  // namespace

caf::actor spawn_proxy(caf::actor_system& system, std::weak_ptr<Node> node, ProxyRef ref) {
  return system.spawn(proxy_actor, std::move(node), std::move(ref));
}

}  // namespace troupe::actors::node
