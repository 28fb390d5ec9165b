// Transport between endpoints of one process (`troupe serve`, tests): frames
// are handed over by reference and validated like any received frame;
// puts/gets are memcpy into registered memory, with the same bounds and key
// checks as UCX. Each endpoint has its own transport thread, so callbacks
// run exactly as they would over UCX.
#pragma once

#include <memory>
#include <string>

#include "transport/transport.hpp"

namespace troupe::transport {

// The set of endpoints that can reach each other ("inproc://<name>").
// Shared by its endpoints; may be destroyed in any order with them.
class InProcessFabric {
 public:
  InProcessFabric();
  ~InProcessFabric();
  // Test hook: the endpoint `name` crashes. Its peers get on_peer_down, its
  // regions vanish and it delivers nothing more (it stays an object).
  void crash(const std::string& name);

  struct State;
  std::shared_ptr<State> state() const { return state_; }

 private:
  std::shared_ptr<State> state_;
};

class InProcessTransport final : public Transport {
 public:
  InProcessTransport(std::shared_ptr<InProcessFabric> fabric, std::string name);
  ~InProcessTransport() override;

  const std::string& name() const override;
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

  struct Node;

 private:
  void move(bool is_put, const std::string& peer, const RegionKey& remote, std::vector<RmaOp> ops, Completion done);

  std::shared_ptr<InProcessFabric> fabric_;
  std::shared_ptr<Node> node_;
};

}  // namespace troupe::transport
