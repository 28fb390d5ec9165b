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
  std::deque<Outgoing> backlog;  // frames the transport refused for now (backpressure), in order
  std::map<uint64_t, caf::response_promise> calls;
};

using Self = caf::stateful_actor<ProxyState>*;

// Sends what is queued, in order; keeps the rest when the transport pushes back.
void flush(Self self) {
  auto node = self->state.node.lock();
  auto& q = self->state.backlog;
  while (node && !q.empty()) {
    auto s = node->send(self->state.ref.peer, q.front());
    if (!s && s.error().code() == ErrorCode::resource_exhausted) {
      self->delayed_send(self, std::chrono::milliseconds(2), proxy_retry_atom::value);
      return;
    }
    if (!s) spdlog::debug("proxy {}@{}: dropped a frame: {}", self->state.ref.name, self->state.ref.peer, s.error().what());
    q.pop_front();
  }
  if (!node) q.clear();
}

caf::behavior proxy_actor(Self self, std::weak_ptr<Node> node, ProxyRef ref) {
  self->state.node = std::move(node);
  self->state.ref = std::move(ref);
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
      if (!sent) return caf::make_error(caf::sec::request_receiver_down, sent.error().what());
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
      [=](proxy_retry_atom) { flush(self); },
      [=](proxy_reply_atom, uint64_t corr, const std::vector<WorkerLoad>& loads) {
        auto it = self->state.calls.find(corr);
        if (it == self->state.calls.end()) return;
        it->second.deliver(loads);
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
