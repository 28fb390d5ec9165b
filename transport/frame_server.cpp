// FrameServer: one epoll loop thread for the listener and every TCP
// connection; sends from other threads queue and wake the loop (eventfd).
#include "transport/frame_server.hpp"

#include <arpa/inet.h>
#include <fcntl.h>
#include <fmt/format.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <kj/exception.h>
#include <spdlog/spdlog.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <set>
#include <thread>

#include "messages/frame_stream.hpp"

namespace troupe::transport {
namespace {

using Clock = std::chrono::steady_clock;

struct Out {
  messages::HeaderBytes header;
  Frame frame;
  size_t written = 0;  // of header + body
  size_t size() const { return header.size() + frame.body_bytes().size(); }
};

}  // namespace

struct TcpConn;

struct FrameServer::Impl {
  FrameServerOptions opt;
  FrameHandler& handler;
  int listen_fd = -1, epoll_fd = -1, wake_fd = -1;
  uint16_t port = 0;
  std::thread thread;
  std::atomic<bool> running{false};
  std::atomic<uint64_t> next_id{1};

  // Requests from other threads, drained by the loop.
  std::mutex wake_mu;
  std::set<uint64_t> want_flush, want_close, want_drop;
  bool want_stop = false;

  // Loop thread only.
  std::map<uint64_t, std::shared_ptr<TcpConn>> conns;
  std::atomic<size_t> n_open{0};

  // Transport peers served as connections (transport threads).
  std::mutex transport_mu;
  std::map<std::pair<Transport*, std::string>, std::shared_ptr<Connection>> transport_conns;

  Impl(FrameServerOptions o, FrameHandler& h) : opt(std::move(o)), handler(h) {}
  void wake() {
    uint64_t one = 1;
    [[maybe_unused]] auto n = ::write(wake_fd, &one, sizeof(one));
  }
  void run();
  void accept_all();
  void read_ready(const std::shared_ptr<TcpConn>& c);
  void flush(const std::shared_ptr<TcpConn>& c);
  void on_fault(const std::shared_ptr<TcpConn>& c, const messages::FrameFault& f);
  void close_after_flush(const std::shared_ptr<TcpConn>& c, Error why);
  // By value: callers may pass the conns map's own element, which this erases.
  void finish(std::shared_ptr<TcpConn> c, Error why);
  void set_events(TcpConn& c);
  void check_timers();
};

struct TcpConn final : Connection {
  FrameServer::Impl* server;
  uint64_t id_;
  std::string peer_;
  int fd;
  messages::FrameAssembler assembler;

  mutable std::mutex mu;  // guards out, queued, open_
  std::deque<Out> out;
  size_t queued = 0;
  bool open_ = true;

  // Loop thread only.
  uint32_t faults = 0;
  bool closing = false;  // reading stopped; closes when `out` drains or at close_deadline
  bool finished = false;
  bool want_write = false;
  std::optional<Error> close_reason;
  Clock::time_point partial_since{}, close_deadline{};

  TcpConn(FrameServer::Impl* s, uint64_t id, std::string peer, int fd_, messages::FrameLimits limits)
      : server(s), id_(id), peer_(std::move(peer)), fd(fd_), assembler(limits) {}

  uint64_t id() const override { return id_; }
  const std::string& peer() const override { return peer_; }
  Transport* transport() const override { return nullptr; }
  bool is_open() const override {
    std::lock_guard lock(mu);
    return open_;
  }
  Status send(Frame frame) override { return enqueue(std::move(frame), false); }
  Status enqueue(Frame frame, bool internal) {
    Out o{messages::encode_header(frame.header()), std::move(frame)};
    bool was_empty = false;
    std::optional<Error> dropped;
    {
      std::lock_guard lock(mu);
      if (!open_ && !internal) return Error(ErrorCode::unavailable, fmt::format("connection {} is closed", peer_));
      if (queued + o.size() > server->opt.max_queued_bytes && !internal) {
        // A client that stopped reading loses the connection, not a frame: a
        // stream with a hole in it (a token chunk missing, later ones arriving
        // once it reads again) would be wrong output. Nothing more is queued;
        // the loop closes it and on_close aborts its requests.
        open_ = false;
        dropped = Error(ErrorCode::resource_exhausted, fmt::format("client {} is not reading: {} bytes queued", peer_, queued));
      } else {
        queued += o.size();
        was_empty = out.empty();
        out.push_back(std::move(o));
      }
    }
    if (dropped) {
      std::lock_guard lock(server->wake_mu);
      server->want_drop.insert(id_);
      server->wake();
      return *dropped;
    }
    if (was_empty) {
      std::lock_guard lock(server->wake_mu);
      server->want_flush.insert(id_);
      server->wake();
    }
    return Ok{};
  }
  void close() override {
    std::lock_guard lock(server->wake_mu);
    server->want_close.insert(id_);
    server->wake();
  }
};

// A transport peer seen as a Connection.
struct PeerConn final : Connection {
  Transport* t;
  std::string name;
  uint64_t id_;
  std::atomic<bool> open_{true};
  PeerConn(Transport* tr, std::string n, uint64_t id) : t(tr), name(std::move(n)), id_(id) {}
  uint64_t id() const override { return id_; }
  const std::string& peer() const override { return name; }
  Transport* transport() const override { return t; }
  bool is_open() const override { return open_; }
  Status send(Frame frame) override {
    if (!open_) return Error(ErrorCode::unavailable, fmt::format("peer {} is gone", name));
    return t->send(name, std::move(frame));
  }
  void close() override { t->disconnect(name); }
};

FrameServer::FrameServer(FrameServerOptions options, FrameHandler& handler)
    : impl_(std::make_unique<Impl>(std::move(options), handler)) {}

FrameServer::~FrameServer() { stop(); }

uint16_t FrameServer::port() const { return impl_->port; }
size_t FrameServer::open_connections() const { return impl_->n_open; }

Status FrameServer::start() {
  auto& s = *impl_;
  s.listen_fd = ::socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (s.listen_fd < 0) return Error(ErrorCode::unavailable, fmt::format("socket: {}", std::strerror(errno)));
  int one = 1;
  setsockopt(s.listen_fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_port = htons(s.opt.port);
  if (inet_pton(AF_INET, s.opt.host.c_str(), &sa.sin_addr) != 1) {
    return Error(ErrorCode::invalid_argument, fmt::format("{} is not an IPv4 address", s.opt.host));
  }
  if (::bind(s.listen_fd, reinterpret_cast<sockaddr*>(&sa), sizeof(sa)) != 0 || ::listen(s.listen_fd, 512) != 0) {
    return Error(ErrorCode::unavailable, fmt::format("listen on {}:{}: {}", s.opt.host, s.opt.port, std::strerror(errno)));
  }
  socklen_t len = sizeof(sa);
  getsockname(s.listen_fd, reinterpret_cast<sockaddr*>(&sa), &len);
  s.port = ntohs(sa.sin_port);
  s.epoll_fd = epoll_create1(EPOLL_CLOEXEC);
  s.wake_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  epoll_event ev{};
  ev.events = EPOLLIN;
  ev.data.u64 = 0;  // listener
  epoll_ctl(s.epoll_fd, EPOLL_CTL_ADD, s.listen_fd, &ev);
  ev.data.u64 = UINT64_MAX;  // wake
  epoll_ctl(s.epoll_fd, EPOLL_CTL_ADD, s.wake_fd, &ev);
  s.running = true;
  s.thread = std::thread([&s] { s.run(); });
  spdlog::debug("frame server listening on {}:{}", s.opt.host, s.port);
  return Ok{};
}

void FrameServer::stop() {
  auto& s = *impl_;
  if (!s.running.exchange(false)) {
    if (s.listen_fd >= 0) ::close(s.listen_fd);  // start() failed half way
    s.listen_fd = -1;
    return;
  }
  {
    std::lock_guard lock(s.wake_mu);
    s.want_stop = true;
    s.wake();
  }
  s.thread.join();
  ::close(s.listen_fd);
  ::close(s.epoll_fd);
  ::close(s.wake_fd);
  s.listen_fd = s.epoll_fd = s.wake_fd = -1;
}

void FrameServer::Impl::run() {
  std::vector<epoll_event> evs(64);
  for (;;) {
    int n = epoll_wait(epoll_fd, evs.data(), static_cast<int>(evs.size()), 200);
    for (int i = 0; i < n; ++i) {
      uint64_t key = evs[i].data.u64;
      if (key == 0) {
        accept_all();
        continue;
      }
      if (key == UINT64_MAX) {
        uint64_t v;
        [[maybe_unused]] auto r = ::read(wake_fd, &v, sizeof(v));
        continue;
      }
      auto it = conns.find(key);
      if (it == conns.end()) continue;
      auto c = it->second;
      if (c->closing && (evs[i].events & (EPOLLHUP | EPOLLERR))) {
        finish(c, c->close_reason.value_or(Error(ErrorCode::unavailable, "client gone")));
        continue;
      }
      if (evs[i].events & (EPOLLIN | EPOLLHUP | EPOLLERR | EPOLLRDHUP)) read_ready(c);
      if (!c->finished && (evs[i].events & EPOLLOUT)) flush(c);
    }
    std::set<uint64_t> flushes, closes, drops;
    bool stop;
    {
      std::lock_guard lock(wake_mu);
      flushes.swap(want_flush);
      closes.swap(want_close);
      drops.swap(want_drop);
      stop = want_stop;
    }
    for (uint64_t id : flushes) {
      if (auto it = conns.find(id); it != conns.end()) flush(it->second);
    }
    for (uint64_t id : drops) {
      if (auto it = conns.find(id); it != conns.end()) {
        spdlog::warn("frame server: {} stopped reading ({} bytes queued); dropping it", it->second->peer_,
                     opt.max_queued_bytes);
        finish(it->second, Error(ErrorCode::resource_exhausted, "the client stopped reading"));
      }
    }
    for (uint64_t id : closes) {
      if (auto it = conns.find(id); it != conns.end()) {
        close_after_flush(it->second, Error(ErrorCode::cancelled, "closed by the server"));
      }
    }
    check_timers();
    if (stop) break;
  }
  auto all = conns;
  for (auto& [id, c] : all) finish(c, Error(ErrorCode::unavailable, "server stopping"));
}

void FrameServer::Impl::accept_all() {
  for (;;) {
    sockaddr_in sa{};
    socklen_t len = sizeof(sa);
    int fd = ::accept4(listen_fd, reinterpret_cast<sockaddr*>(&sa), &len, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd < 0) return;
    char ip[INET_ADDRSTRLEN] = "?";
    inet_ntop(AF_INET, &sa.sin_addr, ip, sizeof(ip));
    std::string peer = fmt::format("tcp:{}:{}", ip, ntohs(sa.sin_port));
    if (conns.size() >= opt.max_connections) {
      spdlog::warn("frame server: refusing {}: {} connections open", peer, conns.size());
      ::close(fd);
      continue;
    }
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    auto c = std::make_shared<TcpConn>(this, next_id++, peer, fd, opt.limits);
    conns[c->id_] = c;
    ++n_open;
    set_events(*c);
    handler.on_open(c);
  }
}

void FrameServer::Impl::set_events(TcpConn& c) {
  epoll_event ev{};
  ev.events = (c.closing ? 0u : uint32_t{EPOLLIN | EPOLLRDHUP}) | (c.want_write ? uint32_t{EPOLLOUT} : 0u);
  ev.data.u64 = c.id_;
  if (epoll_ctl(epoll_fd, EPOLL_CTL_MOD, c.fd, &ev) != 0) epoll_ctl(epoll_fd, EPOLL_CTL_ADD, c.fd, &ev);
}

void FrameServer::Impl::read_ready(const std::shared_ptr<TcpConn>& c) {
  while (!c->finished && !c->closing) {
    auto buf = c->assembler.next_buffer();
    if (buf.empty()) return;
    ssize_t r = ::recv(c->fd, buf.data(), buf.size(), 0);
    if (r < 0 && errno == EINTR) continue;
    if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) break;
    if (r <= 0) {
      if (!c->assembler.idle()) {
        spdlog::warn("frame server: {} closed in the middle of a frame (truncated frame)", c->peer_);
        return finish(c, Error(ErrorCode::invalid_argument, "connection closed mid-frame"));
      }
      return finish(c, Error(ErrorCode::unavailable, r == 0 ? "client closed the connection" : std::strerror(errno)));
    }
    auto ev = c->assembler.commit(static_cast<size_t>(r));
    if (ev) {
      if (auto* f = std::get_if<Frame>(&*ev)) {
        const auto kind = f->kind();
        const auto rid = f->request_id();
        try {
          handler.on_frame(c, std::move(*f));
        } catch (const kj::Exception& e) {  // a field of the wrong type, met while reading it
          on_fault(c, messages::unreadable_fault(kind, rid, e.getDescription().cStr()));
        }
      } else {
        on_fault(c, std::get<messages::FrameFault>(*ev));
      }
    }
  }
  if (c->finished) return;
  if (c->assembler.idle()) {
    c->partial_since = {};
  } else if (c->partial_since == Clock::time_point{}) {
    c->partial_since = Clock::now();
  }
}

void FrameServer::Impl::on_fault(const std::shared_ptr<TcpConn>& c, const messages::FrameFault& f) {
  ++c->faults;
  spdlog::warn("frame server: bad frame from {} (request {}): {}", c->peer_, f.request_id, f.error.what());
  (void)c->enqueue(messages::make_error_frame(f), true);
  if (!f.resync) {
    close_after_flush(c, Error(f.error.code(), fmt::format("dropped: {}", f.error.what())));
  } else if (c->faults > opt.max_faults) {
    spdlog::warn("frame server: dropping {} after {} bad frames", c->peer_, c->faults);
    close_after_flush(c, Error(ErrorCode::invalid_argument, fmt::format("dropped after {} bad frames", c->faults)));
  }
}

// Stops reading, writes what is queued (at most 2 s), then closes.
void FrameServer::Impl::close_after_flush(const std::shared_ptr<TcpConn>& c, Error why) {
  if (c->closing || c->finished) return;
  c->closing = true;
  c->close_reason = std::move(why);
  c->close_deadline = Clock::now() + std::chrono::seconds(2);
  {
    std::lock_guard lock(c->mu);
    c->open_ = false;
  }
  set_events(*c);
  flush(c);
}

void FrameServer::Impl::finish(std::shared_ptr<TcpConn> c, Error why) {
  if (c->finished) return;
  c->finished = true;
  {
    std::lock_guard lock(c->mu);
    c->open_ = false;
    c->out.clear();
  }
  epoll_ctl(epoll_fd, EPOLL_CTL_DEL, c->fd, nullptr);
  ::close(c->fd);
  conns.erase(c->id_);
  --n_open;
  spdlog::debug("frame server: {} closed: {}", c->peer_, why.what());
  handler.on_close(c, why);
}

void FrameServer::Impl::flush(const std::shared_ptr<TcpConn>& c) {
  if (c->finished) return;
  bool drained = false, failed = false;
  {
    std::lock_guard lock(c->mu);
    while (!c->out.empty()) {
      iovec iov[32];
      int n = 0;
      for (auto it = c->out.begin(); it != c->out.end() && n < 31; ++it) {
        size_t w = it == c->out.begin() ? it->written : 0;
        if (w < it->header.size()) {
          iov[n++] = {it->header.data() + w, it->header.size() - w};
          w = it->header.size();
        }
        auto body = it->frame.body_bytes();
        size_t bw = w - it->header.size();
        if (bw < body.size()) iov[n++] = {const_cast<std::byte*>(body.data()) + bw, body.size() - bw};
      }
      msghdr m{};
      m.msg_iov = iov;
      m.msg_iovlen = n;
      ssize_t r = ::sendmsg(c->fd, &m, MSG_NOSIGNAL | MSG_DONTWAIT);
      if (r < 0 && errno == EINTR) continue;
      if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) break;
      if (r < 0) {
        failed = true;
        break;
      }
      size_t left = static_cast<size_t>(r);
      while (left > 0 && !c->out.empty()) {
        Out& o = c->out.front();
        size_t rest = o.size() - o.written;
        if (left >= rest) {
          left -= rest;
          c->queued -= o.size();
          c->out.pop_front();
        } else {
          o.written += left;
          left = 0;
        }
      }
    }
    drained = c->out.empty();
  }
  if (failed) return finish(c, Error(ErrorCode::unavailable, fmt::format("client {} is gone", c->peer_)));
  if (drained && c->closing) return finish(c, c->close_reason.value_or(Error(ErrorCode::cancelled, "closed")));
  if (c->want_write != !drained) {
    c->want_write = !drained;
    set_events(*c);
  }
}

void FrameServer::Impl::check_timers() {
  auto now = Clock::now();
  std::vector<std::shared_ptr<TcpConn>> expired, slow;
  for (auto& [id, c] : conns) {
    if (c->closing && now > c->close_deadline) expired.push_back(c);
    if (!c->closing && c->partial_since != Clock::time_point{} && now - c->partial_since > opt.partial_frame_timeout) {
      slow.push_back(c);
    }
  }
  for (auto& c : expired) finish(c, c->close_reason.value_or(Error(ErrorCode::cancelled, "closed")));
  for (auto& c : slow) {
    spdlog::warn("frame server: {} sent part of a frame and stalled; dropping it", c->peer_);
    (void)c->enqueue(messages::make_error_frame(0, ErrorCode::deadline_exceeded, "frame not completed in time"), true);
    close_after_flush(c, Error(ErrorCode::deadline_exceeded, "partial frame timed out"));
  }
}

TransportEvents FrameServer::transport_events(Transport& t) {
  auto* s = impl_.get();
  auto conn_for = [s, tp = &t](const std::string& peer, bool create) -> std::shared_ptr<Connection> {
    std::lock_guard lock(s->transport_mu);
    auto key = std::make_pair(tp, peer);
    auto it = s->transport_conns.find(key);
    if (it != s->transport_conns.end()) return it->second;
    if (!create) return nullptr;
    auto c = std::make_shared<PeerConn>(tp, peer, s->next_id++);
    s->transport_conns[key] = c;
    return c;
  };
  TransportEvents e;
  e.on_peer_up = [s, conn_for](const std::string& peer) { s->handler.on_open(conn_for(peer, true)); };
  e.on_frame = [s, conn_for](const std::string& peer, Frame f) {
    const auto kind = f.kind();
    try {
      s->handler.on_frame(conn_for(peer, true), std::move(f));
    } catch (const kj::Exception& e) {  // a field of the wrong type, met while reading it
      spdlog::warn("frame server: {} sent an unreadable {} body: {}", peer, messages::kind_name(kind),
                   e.getDescription().cStr());
    }
  };
  e.on_peer_down = [s, tp = &t](const std::string& peer, const Error& why) {
    std::shared_ptr<Connection> c;
    {
      std::lock_guard lock(s->transport_mu);
      auto it = s->transport_conns.find({tp, peer});
      if (it == s->transport_conns.end()) return;
      c = it->second;
      s->transport_conns.erase(it);
    }
    static_cast<PeerConn&>(*c).open_ = false;
    s->handler.on_close(c, why);
  };
  return e;
}

}  // namespace troupe::transport
