// Plain TCP speaking troupe frames, for clients without UCX. Plain sockets
// and epoll (no Boost.Asio): the server side is one epoll loop in
// FrameServer (frame_server.cpp); this is the blocking client side.
#pragma once

#include <chrono>
#include <memory>
#include <mutex>
#include <string>

#include "messages/frame_stream.hpp"
#include "transport/transport.hpp"

namespace troupe::transport {

// A connected socket that sends and receives whole frames. send() may be
// called from several threads; receive() from one thread at a time.
class TcpFrameSocket {
 public:
  // Connects to host:port (IPv4 or a name resolving to one).
  static Expected<std::unique_ptr<TcpFrameSocket>> connect(const std::string& host, uint16_t port,
                                                           std::chrono::milliseconds timeout,
                                                           messages::FrameLimits limits = {});
  ~TcpFrameSocket();

  Status send(const Frame& frame);
  // Raw bytes, for tests of the server's bad-bytes path.
  Status send_bytes(std::span<const std::byte> bytes);
  // The next frame; deadline_exceeded on timeout (nothing lost, call again),
  // unavailable when the server closed, invalid_argument when it sent bytes
  // that are not a frame.
  Expected<Frame> receive(std::chrono::milliseconds timeout);
  // Half-closes the sending side (the server sees end of stream).
  void shutdown_send();
  // Wakes a blocked receive() (it returns unavailable) and closes.
  void close();
  int fd() const { return fd_; }

 private:
  TcpFrameSocket(int fd, messages::FrameLimits limits) : fd_(fd), assembler_(limits) {}
  int fd_ = -1;
  std::mutex send_mu_;
  messages::FrameAssembler assembler_;
};

}  // namespace troupe::transport
