#include "actors/supervisor/kube_scale.hpp"

#include <fmt/format.h>

#include <boost/asio/connect.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/ssl.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <boost/beast/ssl.hpp>
#include <cstdlib>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

namespace troupe::actors {
namespace {

namespace beast = boost::beast;
namespace http = beast::http;
namespace net = boost::asio;
namespace ssl = net::ssl;
using json = nlohmann::json;

std::optional<std::string> read_file(const std::string& path) {
  std::ifstream in(path);
  if (!in) return std::nullopt;
  std::stringstream ss;
  ss << in.rdbuf();
  std::string s = ss.str();
  while (!s.empty() && (s.back() == '\n' || s.back() == '\r' || s.back() == ' ')) s.pop_back();
  return s;
}

// One HTTPS request to the API server; the parsed JSON answer of a 2xx.
Expected<json> call(const KubeApiOptions& o, http::verb verb, const std::string& target, const std::string& body) {
  auto token = read_file(o.token_file);
  if (!token) return Error(ErrorCode::unavailable, "cannot read the service account token " + o.token_file);
  try {
    net::io_context ioc;
    ssl::context ctx(ssl::context::tls_client);
    ctx.load_verify_file(o.ca_file);
    ctx.set_verify_mode(ssl::verify_peer);
    beast::ssl_stream<beast::tcp_stream> stream(ioc, ctx);
    if (!SSL_set_tlsext_host_name(stream.native_handle(), o.host.c_str())) {
      return Error(ErrorCode::unavailable, "cannot set the TLS server name " + o.host);
    }
    stream.set_verify_callback(ssl::host_name_verification(o.host));
    net::ip::tcp::resolver resolver(ioc);
    beast::get_lowest_layer(stream).expires_after(o.timeout);
    beast::get_lowest_layer(stream).connect(resolver.resolve(o.host, std::to_string(o.port)));
    stream.handshake(ssl::stream_base::client);
    http::request<http::string_body> req{verb, target, 11};
    req.set(http::field::host, o.host);
    req.set(http::field::authorization, "Bearer " + *token);
    req.set(http::field::accept, "application/json");
    req.set(http::field::user_agent, "troupe-fleet");
    if (!body.empty()) {
      req.set(http::field::content_type, "application/merge-patch+json");
      req.body() = body;
    }
    req.prepare_payload();
    http::write(stream, req);
    beast::flat_buffer buffer;
    http::response<http::string_body> res;
    http::read(stream, buffer, res);
    beast::error_code ignored;
    stream.shutdown(ignored);  // the server may just close: not an error here
    auto j = json::parse(res.body(), nullptr, false);
    const unsigned status = res.result_int();
    if (status < 200 || status >= 300) {
      // Kubernetes answers errors as a Status object with a message.
      std::string why = !j.is_discarded() && j.contains("message") && j["message"].is_string() ? j["message"].get<std::string>()
                                                                                               : res.body().substr(0, 200);
      const ErrorCode code = status == 404 ? ErrorCode::not_found
                             : status == 401 || status == 403 ? ErrorCode::invalid_argument
                                                              : ErrorCode::unavailable;
      return Error(code, fmt::format("{} {}: HTTP {}: {}", std::string(http::to_string(verb)), target, status, why));
    }
    if (j.is_discarded()) return Error(ErrorCode::unavailable, fmt::format("{}: the API server's answer is not JSON", target));
    return j;
  } catch (const std::exception& e) {
    return Error(ErrorCode::unavailable, fmt::format("{} https://{}:{}{}: {}", std::string(http::to_string(verb)), o.host, o.port, target,
                                                     e.what()));
  }
}

Expected<int32_t> replicas_of(Expected<json> j) {
  if (!j) return j.error();
  const json& v = *j;
  if (!v.contains("spec") || !v["spec"].contains("replicas") || !v["spec"]["replicas"].is_number_integer()) {
    return Error(ErrorCode::unavailable, "the scale object has no spec.replicas");
  }
  return v["spec"]["replicas"].template get<int32_t>();
}

std::string scale_path(const KubeApiOptions& o, const std::string& statefulset) {
  return fmt::format("/apis/apps/v1/namespaces/{}/statefulsets/{}/scale", o.namespace_name, statefulset);
}

}  // namespace

std::optional<KubeApiOptions> KubeApiOptions::in_cluster(const std::string& fallback_namespace) {
  const char* host = std::getenv("KUBERNETES_SERVICE_HOST");
  if (host == nullptr || *host == '\0') return std::nullopt;
  KubeApiOptions o;
  o.host = host;
  if (const char* port = std::getenv("KUBERNETES_SERVICE_PORT"); port && *port) o.port = static_cast<uint16_t>(std::atoi(port));
  auto ns = read_file("/var/run/secrets/kubernetes.io/serviceaccount/namespace");
  o.namespace_name = ns && !ns->empty() ? *ns : fallback_namespace.empty() ? "default" : fallback_namespace;
  return o;
}

Expected<int32_t> KubeScaler::replicas(const std::string& statefulset) const {
  return replicas_of(call(o_, http::verb::get, scale_path(o_, statefulset), ""));
}

Expected<int32_t> KubeScaler::set_replicas(const std::string& statefulset, int32_t replicas) const {
  const std::string body = json{{"spec", {{"replicas", replicas}}}}.dump();
  return replicas_of(call(o_, http::verb::patch, scale_path(o_, statefulset), body));
}

}  // namespace troupe::actors
