// The gateway's HTTP server on its own (a handler of the test's): a client that
// stops reading a streamed response is cut off once its unsent output passes
// HttpOptions::max_queued_bytes (the handler's on_close fires, so the gateway
// aborts the request), while a client that reads gets the whole stream (one
// chunk larger than the limit included), and the server goes on serving.
#include "actors/gateway/http_server.hpp"

#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <string>
#include <thread>

namespace troupe::gateway {
namespace {

using namespace std::chrono_literals;

constexpr size_t kLimit = 256 << 10;

// Streams `total` bytes in 4 KiB chunks from a thread of its own (as the
// gateway's actors do), until done or the client is gone.
struct Streamer {
  std::atomic<bool> closed{false};
  std::atomic<size_t> sent{0};
  std::vector<std::thread> threads;
  ~Streamer() {
    for (auto& t : threads) t.join();
  }
  void serve(const HttpRequest& req, const std::shared_ptr<Responder>& r) {
    if (req.target == "/ok") return r->respond(200, "text/plain", "ok");
    if (req.target == "/one") {  // one chunk four times the limit (an echoed prompt), then small ones
      r->start_stream(200, "text/plain");
      r->send(std::string(kLimit * 4, 'y'));
      for (int i = 0; i < 8; ++i) r->send("token");
      return r->end();
    }
    const size_t total = req.target == "/big" ? size_t{64} << 20 : size_t{1} << 20;
    r->on_close([this] { closed = true; });
    r->start_stream(200, "text/plain");
    threads.emplace_back([this, r, total, paced = req.target != "/big"] {
      const std::string chunk(4096, 'x');
      for (size_t n = 0; n < total && !r->closed(); n += chunk.size()) {
        r->send(chunk);
        sent += chunk.size();
        if (paced) std::this_thread::sleep_for(1ms);
      }
      r->end();
    });
  }
};

int dial(uint16_t port, int rcvbuf) {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  if (rcvbuf > 0) ::setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &rcvbuf, sizeof(rcvbuf));
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(port);
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  EXPECT_EQ(::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)), 0);
  return fd;
}

void request(int fd, const std::string& path) {
  const std::string req = "GET " + path + " HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n";
  ASSERT_EQ(::send(fd, req.data(), req.size(), MSG_NOSIGNAL), static_cast<ssize_t>(req.size()));
}

// Everything the server sends until it closes (or `timeout` passes).
std::string read_all(int fd, std::chrono::milliseconds timeout) {
  timeval tv{static_cast<time_t>(timeout.count() / 1000), static_cast<suseconds_t>(timeout.count() % 1000 * 1000)};
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  std::string out;
  char buf[65536];
  for (;;) {
    const ssize_t n = ::recv(fd, buf, sizeof(buf), 0);
    if (n <= 0) break;
    out.append(buf, static_cast<size_t>(n));
    if (out.size() >= 5 && out.compare(out.size() - 5, 5, "0\r\n\r\n") == 0) break;  // the last chunk
  }
  return out;
}

TEST(HttpServer, a_client_that_stops_reading_a_stream_is_cut_off_and_others_are_served) {
  Streamer s;
  HttpOptions o;
  o.max_queued_bytes = kLimit;
  HttpServer server(o, [&](HttpRequest req, std::shared_ptr<Responder> r) { s.serve(req, r); });

  const int stalled = dial(server.port(), 4096);
  request(stalled, "/big");
  const auto until = std::chrono::steady_clock::now() + 20s;
  while (!s.closed && std::chrono::steady_clock::now() < until) std::this_thread::sleep_for(10ms);
  EXPECT_TRUE(s.closed) << "the stalled client was never cut off; " << s.sent << " bytes sent";
  EXPECT_LT(s.sent.load(), size_t{64} << 20);
  ::close(stalled);

  // A client that reads gets all of a stream several times the limit.
  const int reader = dial(server.port(), 0);
  request(reader, "/paced");
  const std::string got = read_all(reader, 20s);
  ::close(reader);
  EXPECT_NE(got.find("200 OK"), std::string::npos);
  EXPECT_GE(got.size(), size_t{1} << 20);
  EXPECT_EQ(got.compare(got.size() - 5, 5, "0\r\n\r\n"), 0) << "the stream did not end";

  // One chunk past the limit is written whole, and what follows it too.
  const int one = dial(server.port(), 0);
  request(one, "/one");
  const std::string big = read_all(one, 20s);
  ::close(one);
  EXPECT_GE(big.size(), kLimit * 4 + 40);
  EXPECT_EQ(big.compare(big.size() - 5, 5, "0\r\n\r\n"), 0) << "the stream did not end";

  const int plain = dial(server.port(), 0);
  request(plain, "/ok");
  const std::string ok = read_all(plain, 5s);
  ::close(plain);
  EXPECT_NE(ok.find("200 OK"), std::string::npos);
}

}  // namespace
}  // namespace troupe::gateway
