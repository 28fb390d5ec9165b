// The gateway's HTTP/1.1 server (Boost.Beast): keep-alive connections, bounded
// request bodies, read deadlines against slowloris clients, and responses that
// are either complete or streamed (chunked, for Server-Sent Events).
//
// Threading: the server runs its own io_context threads. The handler is called
// on one of them and must not block; it answers through the Responder, whose
// methods may be called from any thread (actors, engine threads).
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

namespace troupe::gateway {

struct HttpRequest {
  std::string method;  // "GET", "POST", ...
  std::string target;  // path and query, e.g. "/v1/completions"
  std::map<std::string, std::string> headers;  // lower-case names
  std::string body;
  std::string peer;    // "ip:port" of the client
};

// One response. Exactly one of respond() or start_stream()...end() per request.
class Responder {
 public:
  virtual ~Responder() = default;
  virtual void respond(int status, const std::string& content_type, std::string body,
                       std::map<std::string, std::string> extra_headers = {}) = 0;
  virtual void start_stream(int status, const std::string& content_type) = 0;
  virtual void send(std::string chunk) = 0;  // one chunk of a streamed body
  virtual void end() = 0;                     // last chunk; the connection may be reused
  // True once the client has gone (disconnect, write error) before the response ended.
  virtual bool closed() const = 0;
  // Called once, on an io thread, if the client goes away before end()/respond().
  virtual void on_close(std::function<void()> callback) = 0;
};

using HttpHandler = std::function<void(HttpRequest, std::shared_ptr<Responder>)>;

struct HttpOptions {
  std::string address = "127.0.0.1";
  uint16_t port = 0;                                  // 0: any free port
  size_t max_body_bytes = 8u << 20;                   // larger bodies get 413
  std::chrono::seconds read_timeout{30};              // whole request (headers + body) must arrive in time
  std::chrono::seconds idle_timeout{120};             // keep-alive connection with no request
  int threads = 2;
  // Bytes of a streamed response waiting behind its oldest unsent chunk for
  // a client that does not read; past it the connection is closed (the
  // handler's on_close fires). One chunk of any size is always written.
  size_t max_queued_bytes = 16u << 20;
  // Cross-origin requests from browsers (CORS): the origins whose pages may
  // call this server ("https://ui.example.com"; "*": any). A request with an
  // allowed Origin gets Access-Control-Allow-Origin on its response, and a
  // preflight (OPTIONS with Access-Control-Request-Method) is answered 204 here
  // without reaching the handler. Empty: no CORS headers, OPTIONS goes to the handler.
  std::vector<std::string> allowed_origins;
};

// "*" or the origin itself when `origin` (a request's Origin header) is one of
// `allowed`; "" when it is not (or there is none).
std::string cors_allow_origin(const std::vector<std::string>& allowed, const std::string& origin);
// "*", "none" (no CORS) or origins separated by commas ("https://a.example,http://localhost:3000": scheme,
// host, optional port; no path). Throws Error(invalid_argument) naming the entry.
std::vector<std::string> parse_origins(const std::string& text);

class HttpServer {
 public:
  // Binds and starts serving. Throws troupe::Error(unavailable) if the address is taken.
  HttpServer(HttpOptions options, HttpHandler handler);
  ~HttpServer();  // stops accepting, closes connections, joins threads
  HttpServer(const HttpServer&) = delete;
  HttpServer& operator=(const HttpServer&) = delete;

  uint16_t port() const;
  void stop();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace troupe::gateway
