// FrameServer: the seam between the network and whoever answers requests
// (the gateway actor of the actor layer; tests/transport/test_service.cpp
// until then). It accepts TCP connections speaking troupe frames, and can
// also serve the peers of a Transport (UCX clients) the same way; either way
// the handler sees Connections and validated Frames.
//
// Bad bytes never reach the handler: a malformed frame is answered with an
// Error frame (its request id when readable) and logged; when the byte stream
// is lost (bad magic, wrong version, oversized length) or a connection keeps
// sending bad frames, it is closed after the Error frame is written. Other
// connections are unaffected.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>

#include "transport/transport.hpp"

namespace troupe::transport {

// One client as the handler sees it. Shared: the handler may keep it (e.g.
// per streaming request) and send from any thread, long after on_frame.
class Connection {
 public:
  virtual ~Connection() = default;
  virtual uint64_t id() const = 0;                // unique within the server
  virtual const std::string& peer() const = 0;    // "tcp:127.0.0.1:40412" or the transport peer's name
  // The transport for one-sided moves with this peer; nullptr for TCP.
  virtual Transport* transport() const = 0;
  // Queues a frame; thread-safe, never blocks. `unavailable` once closed,
  // `resource_exhausted` when the client does not read and the queue is full.
  virtual Status send(Frame frame) = 0;
  // Closes after the queued frames are written; on_close follows.
  virtual void close() = 0;
  virtual bool is_open() const = 0;
};
using ConnectionPtr = std::shared_ptr<Connection>;

// Implemented by the gateway. Calls for TCP connections run on the server's
// I/O thread; calls for transport peers on that transport's thread. Calls
// about one connection never overlap; none may block. Answer from anywhere, any time, with
// conn->send: one request may stream many TokenChunk frames and a Finish.
class FrameHandler {
 public:
  virtual ~FrameHandler() = default;
  // (optional) A connection opened.
  virtual void on_open(const ConnectionPtr& conn) {}
  // A validated frame (see messages::validate_body). Use messages::open<T>
  // to read it; an unknown request id is the handler's to answer (Error
  // not_found).
  virtual void on_frame(const ConnectionPtr& conn, Frame frame) = 0;
  // The connection is gone: closed by the client, the client died, dropped
  // for bad bytes, or the server stopped. Exactly once per connection, after
  // which conn->send fails. Abort the connection's requests here.
  virtual void on_close(const ConnectionPtr& conn, const Error& why) = 0;
};

struct FrameServerOptions {
  std::string host = "127.0.0.1";
  uint16_t port = 0;                                // 0: an ephemeral port (see port())
  messages::FrameLimits limits{.max_body_bytes = 8u << 20};  // clients send requests, not tensors
  uint32_t max_faults = 8;                          // bad frames before a connection is dropped
  size_t max_connections = 1024;                    // more are accepted and closed at once
  size_t max_queued_bytes = 64u << 20;              // unsent bytes per connection
  std::chrono::milliseconds partial_frame_timeout{30000};  // slowloris guard
};

class FrameServer {
 public:
  FrameServer(FrameServerOptions options, FrameHandler& handler);
  // Stops first (on_close for every open connection).
  ~FrameServer();

  // Binds and starts the I/O thread.
  Status start();
  uint16_t port() const;
  // Closes the listener and every connection; on_close for each.
  void stop();
  size_t open_connections() const;

  // Events to pass to Transport::start so that the transport's peers are
  // served as Connections too (on_open/on_frame/on_close on the transport's
  // thread). The server must outlive the transport.
  TransportEvents transport_events(Transport& transport);

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace troupe::transport
