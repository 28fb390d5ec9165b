#include "actors/gateway/http_server.hpp"

#include <spdlog/spdlog.h>

#include <atomic>
#include <boost/asio.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <deque>
#include <iterator>
#include <mutex>
#include <optional>

#include "base/error.hpp"

namespace troupe::gateway {
namespace {

namespace beast = boost::beast;
namespace http = beast::http;
namespace net = boost::asio;
using tcp = net::ip::tcp;

std::string error_json(const std::string& message, const std::string& type) {
  std::string escaped;
  for (char c : message) {
    if (c == '"' || c == '\\') escaped.push_back('\\');
    escaped.push_back(c);
  }
  return "{\"error\": {\"message\": \"" + escaped + "\", \"type\": \"" + type + "\", \"param\": null, \"code\": null}}";
}

class Session;

// The CORS headers of one response: none without an allowed origin.
void set_cors(http::fields& f, const std::string& allow_origin) {
  if (allow_origin.empty()) return;
  f.set(http::field::access_control_allow_origin, allow_origin);
  if (allow_origin != "*") f.set(http::field::vary, "Origin");
}

// The handler's view of one request; forwards to the session on its strand.
class SessionResponder final : public Responder {
 public:
  // allow_origin: the request's Access-Control-Allow-Origin ("" none).
  explicit SessionResponder(std::shared_ptr<Session> s, std::string allow_origin = "");
  void respond(int status, const std::string& content_type, std::string body,
               std::map<std::string, std::string> extra_headers) override;
  void start_stream(int status, const std::string& content_type) override;
  void send(std::string chunk) override;
  void end() override;
  bool closed() const override { return closed_.load(); }
  void on_close(std::function<void()> callback) override;

  void mark_closed();  // strand only
  std::atomic<bool> closed_{false};
  std::atomic<bool> finished_{false};
  std::mutex mu_;
  std::function<void()> on_close_;

 private:
  std::weak_ptr<Session> session_;
  std::string allow_origin_;
};

class Session : public std::enable_shared_from_this<Session> {
 public:
  Session(tcp::socket socket, const HttpOptions& opts, const HttpHandler& handler)
      : stream_(std::move(socket)), opts_(opts), handler_(handler) {
    beast::error_code ec;
    auto ep = stream_.socket().remote_endpoint(ec);
    if (!ec) peer_ = ep.address().to_string() + ":" + std::to_string(ep.port());
  }

  void start() {
    net::dispatch(stream_.get_executor(), [self = shared_from_this()] { self->read_request(); });
  }

  void close() {
    net::post(stream_.get_executor(), [self = shared_from_this()] { self->shutdown(); });
  }

  // ---- called on the strand by SessionResponder --------------------------------
  struct Out {
    enum Kind { full, header, chunk, last } kind;
    std::shared_ptr<void> msg;  // http::response<...> for full/header
    std::string data;           // chunk payload
  };

  void enqueue(Out out) {
    if (closed_) return;
    // What waits behind the oldest chunk (which may be one large chunk, an
    // echoed prompt, going out to a client that reads): past the limit the
    // client has stopped reading. Cut off (its request is aborted through
    // on_close) rather than holding its output without bound.
    size_t oldest = 0;
    for (const auto& q : queue_) {
      if (!q.data.empty()) {
        oldest = q.data.size();
        break;
      }
    }
    if (queued_bytes_ - oldest > opts_.max_queued_bytes) {
      spdlog::warn("http: {} stopped reading ({} bytes of its response waiting); closing the connection", peer_,
                   queued_bytes_);
      shutdown();
      return;
    }
    queued_bytes_ += out.data.size();
    queue_.push_back(std::move(out));
    if (!writing_) write_next();
  }

 private:
  void read_request() {
    if (closed_) return;
    parser_.emplace();
    parser_->body_limit(opts_.max_body_bytes);
    parser_->header_limit(64 * 1024);
    stream_.expires_after(first_request_ ? opts_.read_timeout : opts_.idle_timeout);
    http::async_read_header(stream_, buffer_, *parser_,
                            beast::bind_front_handler(&Session::on_header, shared_from_this()));
  }

  void on_header(beast::error_code ec, size_t) {
    if (ec) return fail_read(ec);
    first_request_ = false;
    stream_.expires_after(opts_.read_timeout);
    // A client that sent "Expect: 100-continue" (curl does for bodies past 1 MiB) waits for this before its
    // body. Nothing else is being written here: the previous response ended before this header was read.
    if (!parser_->is_done() && beast::iequals(parser_->get()[http::field::expect], "100-continue")) {
      static const std::string kContinue = "HTTP/1.1 100 Continue\r\n\r\n";
      net::async_write(stream_, net::buffer(kContinue), [self = shared_from_this()](beast::error_code wec, size_t) {
        if (wec) return self->fail_read(wec);
        self->read_body();
      });
      return;
    }
    read_body();
  }

  void read_body() {
    http::async_read(stream_, buffer_, *parser_, beast::bind_front_handler(&Session::on_body, shared_from_this()));
  }

  void fail_read(beast::error_code ec) {
    if (ec == http::error::body_limit) {
      keep_alive_ = false;
      // The headers were read: a browser's page learns why (CORS) too.
      const std::string origin(parser_->get()[http::field::origin]);
      auto r = std::make_shared<SessionResponder>(shared_from_this(), cors_allow_origin(opts_.allowed_origins, origin));
      responder_ = r;
      r->respond(413, "application/json",
                 error_json("request body exceeds " + std::to_string(opts_.max_body_bytes) + " bytes",
                            "invalid_request_error"),
                 {});
      return;
    }
    if (ec == beast::error::timeout) {
      spdlog::info("http: closing {} (request not received within the deadline)", peer_);
    } else if (ec != http::error::end_of_stream && ec != net::error::eof && ec != net::error::operation_aborted &&
               ec != net::error::connection_reset) {
      // Malformed request: answer 400 when the socket still works.
      if (ec.category() == http::make_error_code(http::error::bad_target).category()) {
        keep_alive_ = false;
        auto r = std::make_shared<SessionResponder>(shared_from_this());
        responder_ = r;
        r->respond(400, "application/json", error_json("malformed HTTP request: " + ec.message(), "invalid_request_error"),
                   {});
        return;
      }
    }
    shutdown();
  }

  void on_body(beast::error_code ec, size_t) {
    if (ec) return fail_read(ec);
    auto msg = parser_->release();
    keep_alive_ = msg.keep_alive();
    HttpRequest req;
    req.method = std::string(msg.method_string());
    req.target = std::string(msg.target());
    for (const auto& f : msg) {
      std::string name(f.name_string());
      for (auto& c : name) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
      req.headers[name] = std::string(f.value());
    }
    req.body = std::move(msg.body());
    req.peer = peer_;
    const auto origin = req.headers.find("origin");
    const std::string allow_origin =
        origin == req.headers.end() ? "" : cors_allow_origin(opts_.allowed_origins, origin->second);
    auto r = std::make_shared<SessionResponder>(shared_from_this(), allow_origin);
    responder_ = r;
    response_done_ = false;
    stream_.expires_never();
    watch_for_close();
    // The watch read keeps this session alive while the handler answers (the responder holds it weakly);
    // without one (a pipelined request already buffered) the session holds itself until the answer ends.
    if (!watching_ && !closed_) hold_ = shared_from_this();
    // A browser's preflight: answered here. An origin that is not allowed gets no
    // Access-Control-Allow-Origin, which is how a browser learns it is refused.
    if (!opts_.allowed_origins.empty() && req.method == "OPTIONS" &&
        req.headers.count("access-control-request-method") > 0) {
      std::map<std::string, std::string> h;
      if (!allow_origin.empty()) {
        h["Access-Control-Allow-Methods"] = "GET, POST, OPTIONS";
        const auto asked = req.headers.find("access-control-request-headers");
        h["Access-Control-Allow-Headers"] =
            asked != req.headers.end() && !asked->second.empty() ? asked->second : "Authorization, Content-Type";
        h["Access-Control-Max-Age"] = "600";
      }
      r->respond(204, "text/plain", "", std::move(h));
      return;
    }
    try {
      handler_(std::move(req), r);
    } catch (const std::exception& e) {
      spdlog::error("http: handler failed: {}", e.what());
      if (!r->finished_) r->respond(500, "application/json", error_json("internal error", "internal_error"), {});
    }
  }

  // A read while the response is pending: EOF means the client went away. Not when the buffer already
  // holds bytes past this request (pipelined requests sent in one write): the next request is there, no
  // more bytes may come, and on_write's final write parses it.
  void watch_for_close() {
    if (watching_ || closed_ || buffer_.size() > 0) return;
    watching_ = true;
    stream_.socket().async_read_some(buffer_.prepare(4096), [self = shared_from_this()](beast::error_code ec, size_t n) {
      self->watching_ = false;
      if (ec) {
        if (!self->response_done_) {
          if (auto r = self->responder_.lock()) r->mark_closed();
        }
        self->shutdown();
        return;
      }
      self->buffer_.commit(n);
      // Bytes, not EOF: the client is there. If they came before this
      // response ended (the next request on a keep-alive connection, sent as
      // soon as the client had the last byte), on_write's final write parses
      // them. Watching again here would wait for bytes that never come while
      // the request already sits in the buffer.
      if (self->response_done_) self->read_request();
    });
  }

  void write_next() {
    if (queue_.empty() || closed_) {
      writing_ = false;
      return;
    }
    writing_ = true;
    Out& out = queue_.front();
    auto done = [self = shared_from_this()](beast::error_code ec, size_t n) { self->on_write(ec, n); };
    switch (out.kind) {
      case Out::full: {
        auto m = std::static_pointer_cast<http::response<http::string_body>>(out.msg);
        http::async_write(stream_, *m, done);
        break;
      }
      case Out::header: {
        auto sr = std::static_pointer_cast<http::response_serializer<http::empty_body>>(out.msg);
        http::async_write_header(stream_, *sr, done);
        break;
      }
      case Out::chunk:
        net::async_write(stream_, http::make_chunk(net::buffer(out.data)), done);
        break;
      case Out::last:
        net::async_write(stream_, http::make_chunk_last(), done);
        break;
    }
  }

  void on_write(beast::error_code ec, size_t) {
    // The element just written is still at the front: shutdown() keeps it
    // (the write was reading its buffer) and drops only what was waiting.
    const bool final_write = queue_.front().kind == Out::full || queue_.front().kind == Out::last;
    queued_bytes_ -= queue_.front().data.size();
    queue_.pop_front();
    if (closed_) {
      queue_.clear();
      writing_ = false;
      return;
    }
    if (ec) {
      if (auto r = responder_.lock()) r->mark_closed();
      shutdown();
      return;
    }
    if (final_write) {
      response_done_ = true;
      hold_.reset();  // the write's completion handler still holds this session
      if (!keep_alive_) {
        shutdown();
        return;
      }
      if (!watching_) read_request();  // else the watch read's completion starts the next request
    }
    write_next();
  }

  void shutdown() {
    if (closed_) return;
    closed_ = true;
    const auto keep = std::move(hold_);  // released when this returns (every caller holds the session too)
    if (auto r = responder_.lock(); r && !response_done_) r->mark_closed();
    beast::error_code ec;
    stream_.socket().shutdown(tcp::socket::shutdown_both, ec);
    stream_.socket().close(ec);
    // A write in flight still reads the front element's buffer; on_write pops it.
    if (writing_ && !queue_.empty()) {
      queue_.erase(std::next(queue_.begin()), queue_.end());
      queued_bytes_ = queue_.front().data.size();
    } else {
      queue_.clear();
      queued_bytes_ = 0;
    }
  }

  beast::tcp_stream stream_;
  beast::flat_buffer buffer_;
  std::optional<http::request_parser<http::string_body>> parser_;
  const HttpOptions& opts_;
  const HttpHandler& handler_;
  std::string peer_;
  std::deque<Out> queue_;
  size_t queued_bytes_ = 0;  // chunk bytes in queue_
  std::weak_ptr<SessionResponder> responder_;
  bool writing_ = false;
  std::shared_ptr<Session> hold_;  // set while a response is pending and no watch read holds the session
  bool watching_ = false;
  bool keep_alive_ = true;
  bool response_done_ = true;
  bool first_request_ = true;
  bool closed_ = false;

  friend class SessionResponder;
};

SessionResponder::SessionResponder(std::shared_ptr<Session> s, std::string allow_origin)
    : session_(s), allow_origin_(std::move(allow_origin)) {}

void SessionResponder::respond(int status, const std::string& content_type, std::string body,
                               std::map<std::string, std::string> extra_headers) {
  if (finished_.exchange(true)) return;
  auto s = session_.lock();
  if (!s) return;
  auto m = std::make_shared<http::response<http::string_body>>(static_cast<http::status>(status), 11);
  m->set(http::field::server, "troupe");
  m->set(http::field::content_type, content_type);
  set_cors(*m, allow_origin_);
  for (auto& [k, v] : extra_headers) m->set(k, v);
  m->body() = std::move(body);
  net::post(s->stream_.get_executor(), [s, m] {
    m->keep_alive(s->keep_alive_);
    m->prepare_payload();
    s->enqueue({Session::Out::full, m, {}});
  });
}

void SessionResponder::start_stream(int status, const std::string& content_type) {
  auto s = session_.lock();
  if (!s) return;
  auto m = std::make_shared<http::response<http::empty_body>>(static_cast<http::status>(status), 11);
  m->set(http::field::server, "troupe");
  m->set(http::field::content_type, content_type);
  m->set(http::field::cache_control, "no-cache");
  set_cors(*m, allow_origin_);
  m->chunked(true);
  net::post(s->stream_.get_executor(), [s, m] {
    m->keep_alive(s->keep_alive_);
    m->chunked(true);
    auto sr = std::shared_ptr<http::response_serializer<http::empty_body>>(
        new http::response_serializer<http::empty_body>(*m), [m](auto* p) { delete p; });
    s->enqueue({Session::Out::header, sr, {}});
  });
}

void SessionResponder::send(std::string chunk) {
  if (finished_ || chunk.empty()) return;
  auto s = session_.lock();
  if (!s) return;
  net::post(s->stream_.get_executor(),
            [s, c = std::move(chunk)]() mutable { s->enqueue({Session::Out::chunk, nullptr, std::move(c)}); });
}

void SessionResponder::end() {
  if (finished_.exchange(true)) return;
  auto s = session_.lock();
  if (!s) return;
  net::post(s->stream_.get_executor(), [s] { s->enqueue({Session::Out::last, nullptr, {}}); });
}

void SessionResponder::on_close(std::function<void()> callback) {
  bool fire_now = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (closed_) {
      fire_now = true;
    } else {
      on_close_ = std::move(callback);
    }
  }
  if (fire_now && callback) callback();
}

void SessionResponder::mark_closed() {
  if (finished_ || closed_.exchange(true)) return;
  std::function<void()> cb;
  {
    std::lock_guard<std::mutex> lock(mu_);
    cb = std::move(on_close_);
  }
  if (cb) cb();
}

}  // namespace

std::string cors_allow_origin(const std::vector<std::string>& allowed, const std::string& origin) {
  if (origin.empty()) return "";
  for (const auto& a : allowed) {
    if (a == "*") return "*";
    if (a == origin) return origin;
  }
  return "";
}

std::vector<std::string> parse_origins(const std::string& text) {
  std::vector<std::string> out;
  if (text == "none") return out;
  size_t start = 0;
  while (start <= text.size()) {
    const size_t comma = std::min(text.find(',', start), text.size());
    std::string o = text.substr(start, comma - start);
    while (!o.empty() && o.front() == ' ') o.erase(o.begin());
    while (!o.empty() && o.back() == ' ') o.pop_back();
    const auto scheme = o.find("://");
    const bool ok = o == "*" || (scheme != std::string::npos && scheme > 0 && scheme + 3 < o.size() &&
                                 o.find_first_of("/?#", scheme + 3) == std::string::npos &&
                                 o.find_first_of(" \t\r\n") == std::string::npos);
    if (!ok) {
      raise(ErrorCode::invalid_argument,
            "allowed origins: '{}' is not an origin (SCHEME://HOST[:PORT], e.g. https://ui.example.com), * or none", o);
    }
    out.push_back(o);
    start = comma + 1;
  }
  return out;
}

struct HttpServer::Impl {
  HttpOptions opts;
  HttpHandler handler;
  net::io_context ioc;
  tcp::acceptor acceptor{ioc};
  std::vector<std::thread> threads;
  std::mutex mu;
  std::vector<std::weak_ptr<Session>> sessions;
  std::atomic<bool> stopped{false};

  void accept() {
    acceptor.async_accept(net::make_strand(ioc), [this](beast::error_code ec, tcp::socket socket) {
      if (ec) {
        if (!stopped) accept();
        return;
      }
      auto s = std::make_shared<Session>(std::move(socket), opts, handler);
      {
        std::lock_guard<std::mutex> lock(mu);
        std::erase_if(sessions, [](const auto& w) { return w.expired(); });
        sessions.push_back(s);
      }
      s->start();
      accept();
    });
  }
};

HttpServer::HttpServer(HttpOptions options, HttpHandler handler) : impl_(std::make_unique<Impl>()) {
  impl_->opts = std::move(options);
  impl_->handler = std::move(handler);
  beast::error_code ec;
  tcp::endpoint ep(net::ip::make_address(impl_->opts.address, ec), impl_->opts.port);
  if (ec) raise(ErrorCode::invalid_argument, "bad listen address '{}'", impl_->opts.address);
  impl_->acceptor.open(ep.protocol(), ec);
  if (!ec) impl_->acceptor.set_option(net::socket_base::reuse_address(true), ec);
  if (!ec) impl_->acceptor.bind(ep, ec);
  if (!ec) impl_->acceptor.listen(net::socket_base::max_listen_connections, ec);
  if (ec) {
    raise(ErrorCode::unavailable, "cannot listen on {}:{}: {}", impl_->opts.address, impl_->opts.port, ec.message());
  }
  impl_->accept();
  for (int i = 0; i < std::max(1, impl_->opts.threads); ++i) {
    impl_->threads.emplace_back([this] { impl_->ioc.run(); });
  }
}

HttpServer::~HttpServer() { stop(); }

uint16_t HttpServer::port() const { return impl_->acceptor.local_endpoint().port(); }

void HttpServer::stop() {
  if (impl_->stopped.exchange(true)) return;
  net::post(impl_->ioc, [this] {
    beast::error_code ec;
    impl_->acceptor.close(ec);
    std::lock_guard<std::mutex> lock(impl_->mu);
    for (auto& w : impl_->sessions) {
      if (auto s = w.lock()) s->close();
    }
  });
  // Let the closes run, then stop the loop.
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  impl_->ioc.stop();
  for (auto& t : impl_->threads) {
    if (t.joinable()) t.join();
  }
}

}  // namespace troupe::gateway
