// KubeScaler against an HTTPS server that answers as the Kubernetes API
// server's scale subresource does: the path, verb, bearer token, merge-patch
// body, TLS verification of the server's certificate, and the API server's
// error objects. The certificate is made by `openssl` for this test.
#include <gtest/gtest.h>

#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/ssl.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <boost/beast/ssl.hpp>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <nlohmann/json.hpp>
#include <thread>

#include "actors/supervisor/kube_scale.hpp"

namespace troupe::actors {
namespace {

namespace beast = boost::beast;
namespace http = beast::http;
namespace net = boost::asio;
namespace ssl = net::ssl;
namespace fs = std::filesystem;
using json = nlohmann::json;

struct Seen {
  std::string method, target, authorization, content_type, body;
};

// A one-thread HTTPS server: one request per connection, StatefulSet "demo-decode" in namespace "ml".
class FakeApiServer {
 public:
  FakeApiServer(const fs::path& cert, const fs::path& key) : ctx_(ssl::context::tls_server), acceptor_(ioc_) {
    ctx_.use_certificate_chain_file(cert.string());
    ctx_.use_private_key_file(key.string(), ssl::context::pem);
    net::ip::tcp::endpoint ep(net::ip::make_address("127.0.0.1"), 0);
    acceptor_.open(ep.protocol());
    acceptor_.bind(ep);
    acceptor_.listen();
    port_ = acceptor_.local_endpoint().port();
    thread_ = std::thread([this] { serve(); });
  }
  ~FakeApiServer() {
    stop_ = true;
    beast::error_code ec;
    net::ip::tcp::socket poke(ioc_);
    poke.connect({net::ip::make_address("127.0.0.1"), port_}, ec);  // wakes accept()
    thread_.join();
  }
  uint16_t port() const { return port_; }
  std::vector<Seen> seen() {
    std::lock_guard lock(mu_);
    return seen_;
  }
  int32_t replicas = 2;

 private:
  void serve() {
    while (!stop_) {
      net::ip::tcp::socket sock(ioc_);
      beast::error_code ec;
      acceptor_.accept(sock, ec);
      if (ec || stop_) continue;
      beast::ssl_stream<net::ip::tcp::socket> stream(std::move(sock), ctx_);
      stream.handshake(ssl::stream_base::server, ec);
      if (ec) continue;  // the client refused our certificate
      beast::flat_buffer buf;
      http::request<http::string_body> req;
      http::read(stream, buf, req, ec);
      if (ec) continue;
      Seen s{std::string(req.method_string()), std::string(req.target()), std::string(req[http::field::authorization]),
             std::string(req[http::field::content_type]), req.body()};
      {
        std::lock_guard lock(mu_);
        seen_.push_back(s);
      }
      http::response<http::string_body> res{http::status::ok, 11};
      res.set(http::field::content_type, "application/json");
      const std::string path = "/apis/apps/v1/namespaces/ml/statefulsets/demo-decode/scale";
      if (s.authorization != "Bearer t0ken") {
        res.result(http::status::forbidden);
        res.body() = json{{"kind", "Status"}, {"message", "statefulsets.apps \"demo-decode\" is forbidden"}}.dump();
      } else if (s.target != path) {
        res.result(http::status::not_found);
        res.body() = json{{"kind", "Status"}, {"message", "statefulsets.apps not found"}}.dump();
      } else {
        if (s.method == "PATCH") replicas = json::parse(s.body)["spec"]["replicas"].get<int32_t>();
        res.body() = json{{"kind", "Scale"}, {"spec", {{"replicas", replicas}}}, {"status", {{"replicas", 2}}}}.dump();
      }
      res.prepare_payload();
      http::write(stream, res, ec);
      stream.shutdown(ec);
    }
  }

  net::io_context ioc_;
  ssl::context ctx_;
  net::ip::tcp::acceptor acceptor_;
  uint16_t port_ = 0;
  std::atomic<bool> stop_{false};
  std::mutex mu_;
  std::vector<Seen> seen_;
  std::thread thread_;
};

class KubeScale : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("troupe-kube-" + std::to_string(::getpid()));
    fs::create_directories(dir_);
    const std::string cmd = "openssl req -x509 -newkey rsa:2048 -nodes -days 1 -subj /CN=localhost "
                            "-addext subjectAltName=DNS:localhost -keyout " + (dir_ / "key.pem").string() +
                            " -out " + (dir_ / "cert.pem").string() + " >/dev/null 2>&1";
    ASSERT_EQ(std::system(cmd.c_str()), 0) << "openssl could not make a certificate (scripts/setup installs it)";
    std::ofstream(dir_ / "token") << "t0ken\n";
    server_ = std::make_unique<FakeApiServer>(dir_ / "cert.pem", dir_ / "key.pem");
    o_.host = "localhost";
    o_.port = server_->port();
    o_.token_file = (dir_ / "token").string();
    o_.ca_file = (dir_ / "cert.pem").string();
    o_.namespace_name = "ml";
    o_.timeout = std::chrono::seconds(5);
  }
  void TearDown() override {
    server_.reset();
    fs::remove_all(dir_);
  }
  fs::path dir_;
  std::unique_ptr<FakeApiServer> server_;
  KubeApiOptions o_;
};

TEST_F(KubeScale, reads_and_patches_the_statefulsets_scale_subresource) {
  KubeScaler k(o_);
  auto r = k.replicas("demo-decode");
  ASSERT_TRUE(r) << r.error().what();
  EXPECT_EQ(*r, 2);
  auto s = k.set_replicas("demo-decode", 3);
  ASSERT_TRUE(s) << s.error().what();
  EXPECT_EQ(*s, 3);
  const auto seen = server_->seen();
  ASSERT_EQ(seen.size(), 2u);
  EXPECT_EQ(seen[0].method, "GET");
  EXPECT_EQ(seen[1].method, "PATCH");
  EXPECT_EQ(seen[1].target, "/apis/apps/v1/namespaces/ml/statefulsets/demo-decode/scale");
  EXPECT_EQ(seen[1].authorization, "Bearer t0ken");
  EXPECT_EQ(seen[1].content_type, "application/merge-patch+json");
  EXPECT_EQ(json::parse(seen[1].body), (json{{"spec", {{"replicas", 3}}}}));
}

TEST_F(KubeScale, the_api_servers_refusals_come_back_as_errors_with_its_message) {
  KubeScaler k(o_);
  auto missing = k.set_replicas("nope", 3);
  ASSERT_FALSE(missing);
  EXPECT_EQ(missing.error().code(), ErrorCode::not_found);
  EXPECT_NE(std::string(missing.error().what()).find("HTTP 404"), std::string::npos) << missing.error().what();
  std::ofstream(dir_ / "token") << "wrong\n";  // read again on every call
  auto refused = k.replicas("demo-decode");
  ASSERT_FALSE(refused);
  EXPECT_NE(std::string(refused.error().what()).find("forbidden"), std::string::npos) << refused.error().what();
  EXPECT_EQ(server_->replicas, 2);  // nothing changed
}

TEST_F(KubeScale, a_server_whose_certificate_the_ca_did_not_sign_is_refused) {
  ASSERT_EQ(std::system(("openssl req -x509 -newkey rsa:2048 -nodes -days 1 -subj /CN=other -keyout " +
                         (dir_ / "k2.pem").string() + " -out " + (dir_ / "other.pem").string() + " >/dev/null 2>&1")
                            .c_str()),
            0);
  KubeApiOptions o = o_;
  o.ca_file = (dir_ / "other.pem").string();
  auto r = KubeScaler(o).set_replicas("demo-decode", 5);
  ASSERT_FALSE(r);
  EXPECT_EQ(server_->replicas, 2);
  o.ca_file = (dir_ / "missing.pem").string();
  EXPECT_FALSE(KubeScaler(o).replicas("demo-decode"));
}

}  // namespace
}  // namespace troupe::actors
