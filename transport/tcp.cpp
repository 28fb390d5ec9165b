#include "transport/tcp.hpp"

#include <fcntl.h>
#include <fmt/format.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

namespace troupe::transport {

namespace {
Error sys_error(ErrorCode code, const std::string& what) {
  return Error(code, fmt::format("{}: {}", what, std::strerror(errno)));
}
}  // namespace

Expected<std::unique_ptr<TcpFrameSocket>> TcpFrameSocket::connect(const std::string& host, uint16_t port,
                                                                  std::chrono::milliseconds timeout,
                                                                  messages::FrameLimits limits) {
  addrinfo hints{};
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  if (int rc = getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &res); rc != 0 || !res) {
    return Error(ErrorCode::invalid_argument, fmt::format("cannot resolve {}: {}", host, gai_strerror(rc)));
  }
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (fd < 0) {
    freeaddrinfo(res);
    return sys_error(ErrorCode::unavailable, "socket");
  }
  int rc = ::connect(fd, res->ai_addr, res->ai_addrlen);
  freeaddrinfo(res);
  if (rc != 0 && errno != EINPROGRESS) {
    auto e = sys_error(ErrorCode::unavailable, fmt::format("connect to {}:{}", host, port));
    ::close(fd);
    return e;
  }
  if (rc != 0) {
    pollfd p{fd, POLLOUT, 0};
    int n = ::poll(&p, 1, static_cast<int>(timeout.count()));
    int err = 0;
    socklen_t len = sizeof(err);
    getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len);
    if (n <= 0 || err != 0) {
      ::close(fd);
      if (n == 0) return Error(ErrorCode::deadline_exceeded, fmt::format("connect to {}:{} timed out", host, port));
      return Error(ErrorCode::unavailable, fmt::format("connect to {}:{}: {}", host, port, std::strerror(err ? err : errno)));
    }
  }
  // Blocking from here on: send() writes whole frames.
  fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) & ~O_NONBLOCK);
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  return std::unique_ptr<TcpFrameSocket>(new TcpFrameSocket(fd, limits));
}

TcpFrameSocket::~TcpFrameSocket() {
  if (fd_ >= 0) ::close(fd_);
}

static Status write_all(int fd, iovec* iov, int n) {
  while (n > 0) {
    msghdr m{};
    m.msg_iov = iov;
    m.msg_iovlen = n;
    ssize_t w = ::sendmsg(fd, &m, MSG_NOSIGNAL);
    if (w < 0) {
      if (errno == EINTR) continue;
      return sys_error(ErrorCode::unavailable, "send");
    }
    size_t left = static_cast<size_t>(w);
    while (n > 0 && left >= iov->iov_len) {
      left -= iov->iov_len;
      ++iov;
      --n;
    }
    if (n > 0) {
      iov->iov_base = static_cast<char*>(iov->iov_base) + left;
      iov->iov_len -= left;
    }
  }
  return Ok{};
}

Status TcpFrameSocket::send(const Frame& frame) {
  auto h = messages::encode_header(frame.header());
  auto body = frame.body_bytes();
  iovec iov[2] = {{h.data(), h.size()}, {const_cast<std::byte*>(body.data()), body.size()}};
  std::lock_guard lock(send_mu_);
  return write_all(fd_, iov, body.empty() ? 1 : 2);
}

Status TcpFrameSocket::send_bytes(std::span<const std::byte> bytes) {
  iovec iov{const_cast<std::byte*>(bytes.data()), bytes.size()};
  std::lock_guard lock(send_mu_);
  return write_all(fd_, &iov, 1);
}

Expected<Frame> TcpFrameSocket::receive(std::chrono::milliseconds timeout) {
  auto deadline = std::chrono::steady_clock::now() + timeout;
  for (;;) {
    if (assembler_.closed()) return Error(ErrorCode::unavailable, "connection lost its framing");
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
    pollfd p{fd_, POLLIN, 0};
    int n = ::poll(&p, 1, std::max<int>(0, static_cast<int>(left.count())));
    if (n < 0 && errno == EINTR) continue;
    if (n == 0) return Error(ErrorCode::deadline_exceeded, "no frame in time");
    if (n < 0) return sys_error(ErrorCode::unavailable, "poll");
    auto buf = assembler_.next_buffer();
    ssize_t r = ::recv(fd_, buf.data(), buf.size(), 0);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) return Error(ErrorCode::unavailable, r == 0 ? "server closed the connection" : std::strerror(errno));
    if (auto ev = assembler_.commit(static_cast<size_t>(r))) {
      if (auto* f = std::get_if<Frame>(&*ev)) return std::move(*f);
      const auto& fault = std::get<messages::FrameFault>(*ev);
      return Error(ErrorCode::invalid_argument, fmt::format("bad frame from server: {}", fault.error.what()));
    }
  }
}

void TcpFrameSocket::shutdown_send() { ::shutdown(fd_, SHUT_WR); }

void TcpFrameSocket::close() { ::shutdown(fd_, SHUT_RDWR); }

}  // namespace troupe::transport
