#include "transport/in_process.hpp"

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include <atomic>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <random>
#include <set>
#include <thread>

namespace troupe::transport {

namespace {
constexpr std::string_view kScheme = "inproc://";

std::vector<uint8_t> random_key() {
  static std::mutex mu;
  static std::mt19937_64 rng(std::random_device{}());
  std::lock_guard lock(mu);
  uint64_t v = rng();
  std::vector<uint8_t> k(8);
  std::memcpy(k.data(), &v, 8);
  return k;
}
}  // namespace

struct InProcessTransport::Node {
  std::string name;
  std::weak_ptr<InProcessFabric::State> fabric;

  // The transport thread and its queue.
  std::mutex mu;
  std::condition_variable cv;
  std::deque<std::function<void()>> tasks;
  bool accepting = false;  // started and not crashed/closed
  bool stopping = false;
  std::thread thread;
  TransportEvents events;

  // Regions registered here; guarded by regions_mu (held while a peer copies).
  struct Region {
    std::byte* base = nullptr;
    size_t length = 0;
    std::vector<uint8_t> key;
    bool owned = false;
  };
  std::mutex regions_mu;
  std::map<uint64_t, Region> regions;
  uint64_t next_region = 1;

  std::atomic<uint64_t> frames_sent{0}, frames_received{0}, bad_frames{0};
  std::atomic<size_t> rma_in_flight{0};

  // Runs `fn` on this node's thread; false when the node is not accepting.
  bool post(std::function<void()> fn) {
    std::lock_guard lock(mu);
    if (!accepting) return false;
    tasks.push_back(std::move(fn));
    cv.notify_one();
    return true;
  }

  void run() {
    for (;;) {
      std::function<void()> task;
      {
        std::unique_lock lock(mu);
        cv.wait(lock, [&] { return stopping || !tasks.empty(); });
        if (stopping) return;
        task = std::move(tasks.front());
        tasks.pop_front();
      }
      task();
    }
  }

  void drop_regions() {
    std::lock_guard lock(regions_mu);
    for (auto& [id, r] : regions) {
      if (r.owned) std::free(r.base);
    }
    regions.clear();
  }
};

struct InProcessFabric::State {
  std::mutex mu;
  std::map<std::string, std::shared_ptr<InProcessTransport::Node>> nodes;
  std::set<std::pair<std::string, std::string>> links;  // both orders present

  bool linked(const std::string& a, const std::string& b) {
    std::lock_guard lock(mu);
    return links.count({a, b}) > 0;
  }
  std::shared_ptr<InProcessTransport::Node> node(const std::string& n) {
    std::lock_guard lock(mu);
    auto it = nodes.find(n);
    return it == nodes.end() ? nullptr : it->second;
  }
  // Removes every link of `name`; returns the peers it had.
  std::vector<std::shared_ptr<InProcessTransport::Node>> unlink_all(const std::string& name) {
    std::lock_guard lock(mu);
    std::vector<std::shared_ptr<InProcessTransport::Node>> out;
    for (auto it = links.begin(); it != links.end();) {
      if (it->first == name) {
        if (auto n = nodes.find(it->second); n != nodes.end()) out.push_back(n->second);
        links.erase({it->second, it->first});
        it = links.erase(it);
      } else {
        ++it;
      }
    }
    return out;
  }
};

InProcessFabric::InProcessFabric() : state_(std::make_shared<State>()) {}
InProcessFabric::~InProcessFabric() = default;

namespace {
void tell_down(const std::shared_ptr<InProcessTransport::Node>& to, const std::string& who, const std::string& why) {
  to->post([to, who, why] {
    if (to->events.on_peer_down) to->events.on_peer_down(who, Error(ErrorCode::unavailable, why));
  });
}
}  // namespace

void InProcessFabric::crash(const std::string& name) {
  auto node = state_->node(name);
  if (!node) return;
  {
    std::lock_guard lock(node->mu);
    node->accepting = false;
    node->tasks.clear();
  }
  node->drop_regions();
  for (auto& peer : state_->unlink_all(name)) tell_down(peer, name, fmt::format("peer {} crashed", name));
}

InProcessTransport::InProcessTransport(std::shared_ptr<InProcessFabric> fabric, std::string name)
    : fabric_(std::move(fabric)), node_(std::make_shared<Node>()) {
  node_->name = std::move(name);
  node_->fabric = fabric_->state();
}

InProcessTransport::~InProcessTransport() {
  auto state = fabric_->state();
  {
    std::lock_guard lock(state->mu);
    auto it = state->nodes.find(node_->name);
    if (it != state->nodes.end() && it->second == node_) state->nodes.erase(it);
  }
  for (auto& peer : state->unlink_all(node_->name)) tell_down(peer, node_->name, fmt::format("peer {} closed", node_->name));
  {
    std::lock_guard lock(node_->mu);
    node_->accepting = false;
    node_->stopping = true;
    node_->cv.notify_all();
  }
  if (node_->thread.joinable()) node_->thread.join();
  {
    // Tasks hold the node (and peers hold tasks of ours): break the cycle.
    std::lock_guard lock(node_->mu);
    node_->tasks.clear();
  }
  node_->drop_regions();
}

const std::string& InProcessTransport::name() const { return node_->name; }
std::string InProcessTransport::address() const { return std::string(kScheme) + node_->name; }

Status InProcessTransport::start(TransportEvents events) {
  auto state = fabric_->state();
  {
    std::lock_guard lock(state->mu);
    if (state->nodes.count(node_->name)) {
      return Error(ErrorCode::invalid_argument, fmt::format("an endpoint named {} already exists", node_->name));
    }
    state->nodes[node_->name] = node_;
  }
  node_->events = std::move(events);
  {
    std::lock_guard lock(node_->mu);
    node_->accepting = true;
  }
  node_->thread = std::thread([n = node_] { n->run(); });
  return Ok{};
}

Expected<std::string> InProcessTransport::connect(const std::string& address, std::chrono::milliseconds) {
  if (address.rfind(kScheme, 0) != 0) {
    return Error(ErrorCode::invalid_argument, fmt::format("{} is not an inproc:// address", address));
  }
  std::string peer = address.substr(kScheme.size());
  auto state = fabric_->state();
  std::shared_ptr<Node> other;
  {
    std::lock_guard lock(state->mu);
    auto it = state->nodes.find(peer);
    if (it == state->nodes.end() || peer == node_->name) {
      return Error(ErrorCode::unavailable, fmt::format("no endpoint at {}", address));
    }
    other = it->second;
    if (state->links.count({node_->name, peer})) return peer;
    state->links.insert({node_->name, peer});
    state->links.insert({peer, node_->name});
  }
  auto me = node_->name;
  other->post([other, me] {
    if (other->events.on_peer_up) other->events.on_peer_up(me);
  });
  node_->post([n = node_, peer] {
    if (n->events.on_peer_up) n->events.on_peer_up(peer);
  });
  return peer;
}

Status InProcessTransport::send(const std::string& peer, Frame frame) {
  auto state = fabric_->state();
  if (!state->linked(node_->name, peer)) {
    return Error(ErrorCode::unavailable, fmt::format("{} is not connected to {}", node_->name, peer));
  }
  auto other = state->node(peer);
  if (!other) return Error(ErrorCode::unavailable, fmt::format("peer {} is gone", peer));
  ++node_->frames_sent;
  std::string me = node_->name;
  bool posted = other->post([other, me, frame = std::move(frame)]() mutable {
    // Same contract as a network transport: only valid frames reach on_frame.
    auto ok = messages::validate_body(frame, {});
    if (!ok) {
      ++other->bad_frames;
      if (other->events.on_bad_frame) other->events.on_bad_frame(me, ok.fault());
      return;
    }
    ++other->frames_received;
    other->events.on_frame(me, std::move(frame));
  });
  if (!posted) return Error(ErrorCode::unavailable, fmt::format("peer {} is gone", peer));
  return Ok{};
}

void InProcessTransport::disconnect(const std::string& peer) {
  auto state = fabric_->state();
  {
    std::lock_guard lock(state->mu);
    if (!state->links.erase({node_->name, peer})) return;
    state->links.erase({peer, node_->name});
  }
  if (auto other = state->node(peer)) tell_down(other, node_->name, fmt::format("peer {} disconnected", node_->name));
  tell_down(node_, peer, fmt::format("disconnected from {}", peer));
}

std::vector<std::string> InProcessTransport::peers() const {
  auto state = fabric_->state();
  std::lock_guard lock(state->mu);
  std::vector<std::string> out;
  for (auto& [a, b] : state->links) {
    if (a == node_->name) out.push_back(b);
  }
  return out;
}

Expected<LocalRegion> InProcessTransport::register_region(void* base, size_t length) {
  if (base == nullptr || length == 0) return Error(ErrorCode::invalid_argument, "cannot register an empty region");
  std::lock_guard lock(node_->regions_mu);
  uint64_t id = node_->next_region++;
  Node::Region r{static_cast<std::byte*>(base), length, random_key(), false};
  node_->regions[id] = r;
  return LocalRegion{RegionKey{node_->name, id, reinterpret_cast<uint64_t>(base), length, r.key}, r.base, length};
}

Expected<LocalRegion> InProcessTransport::allocate_region(size_t length) {
  if (length == 0) return Error(ErrorCode::invalid_argument, "cannot allocate an empty region");
  void* p = nullptr;
  if (posix_memalign(&p, 4096, length) != 0) {
    return Error(ErrorCode::resource_exhausted, fmt::format("cannot allocate a region of {} bytes", length));
  }
  std::memset(p, 0, length);
  auto r = register_region(p, length);
  if (!r) {
    std::free(p);
    return r;
  }
  std::lock_guard lock(node_->regions_mu);
  node_->regions[r->key.region_id].owned = true;
  return r;
}

Status InProcessTransport::deregister_region(uint64_t region_id) {
  std::lock_guard lock(node_->regions_mu);
  auto it = node_->regions.find(region_id);
  if (it == node_->regions.end()) return Error(ErrorCode::not_found, fmt::format("no region {}", region_id));
  if (it->second.owned) std::free(it->second.base);
  node_->regions.erase(it);
  return Ok{};
}

void InProcessTransport::move(bool is_put, const std::string& peer, const RegionKey& remote, std::vector<RmaOp> ops,
                              Completion done) {
  auto finish = [this, &done](Status s) {
    auto n = node_;
    ++n->rma_in_flight;
    bool posted = n->post([n, done = std::move(done), s = std::move(s)]() mutable {
      --n->rma_in_flight;
      done(std::move(s));
    });
    if (!posted) --n->rma_in_flight;
  };
  auto state = fabric_->state();
  if (!state->linked(node_->name, peer) || remote.owner != peer) {
    return finish(Error(ErrorCode::unavailable, fmt::format("{} is not connected to {}", node_->name, peer)));
  }
  if (auto b = check_bounds(remote, ops); !b) return finish(b);
  auto other = state->node(peer);
  if (!other) return finish(Error(ErrorCode::unavailable, fmt::format("peer {} is gone", peer)));
  std::lock_guard lock(other->regions_mu);
  auto it = other->regions.find(remote.region_id);
  if (it == other->regions.end() || it->second.key != remote.packed_key ||
      reinterpret_cast<uint64_t>(it->second.base) != remote.address || it->second.length != remote.length) {
    return finish(Error(ErrorCode::not_found, fmt::format("region {} of {} is not registered (or the key is wrong)",
                                                          remote.region_id, peer)));
  }
  for (const auto& op : ops) {
    std::byte* r = it->second.base + op.remote_offset;
    if (is_put) {
      std::memcpy(r, op.local, op.length);
    } else {
      std::memcpy(op.local, r, op.length);
    }
  }
  finish(Ok{});
}

void InProcessTransport::put(const std::string& peer, const RegionKey& remote, std::vector<RmaOp> ops, Completion done) {
  move(true, peer, remote, std::move(ops), std::move(done));
}

void InProcessTransport::get(const std::string& peer, const RegionKey& remote, std::vector<RmaOp> ops, Completion done) {
  move(false, peer, remote, std::move(ops), std::move(done));
}

void InProcessTransport::forget_remote(const std::string&, uint64_t) {}

TransportStats InProcessTransport::stats() const {
  TransportStats s;
  s.peers = peers().size();
  {
    std::lock_guard lock(node_->regions_mu);
    s.regions = node_->regions.size();
  }
  s.rma_in_flight = node_->rma_in_flight;
  s.frames_sent = node_->frames_sent;
  s.frames_received = node_->frames_received;
  s.bad_frames = node_->bad_frames;
  return s;
}

}  // namespace troupe::transport
