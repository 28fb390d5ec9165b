// One node of a topology: `troupe run --manifest FILE --node NAME`.
//
// A NodeProcess starts the actors the manifest places on its node (gateway,
// router, a prefill / decode / colocated worker under a supervisor) plus the
// node actor that connects this process to its peers over UCX. Peers are found
// from the manifest (static addresses, or Kubernetes headless-service DNS),
// come up in any order and are dialled until they answer. Who dials whom is
// fixed so that each pair has one connection: gateway-only Deployment pods
// dial everyone and are never dialled; workers dial the router's process;
// among workers the larger instance name dials.
//
// HTTP on the node's `ports.http`: the OpenAI API where a gateway runs;
// everywhere /health/live (200 as soon as the process runs), /health (200 only
// when every required peer is connected and ready, the weights are loaded and
// the process is not draining) and /metrics.
//
// SIGTERM drains: the gateway stops admitting and waits for its requests; a
// worker is fenced at the router, moves its running requests with their KV
// to another worker of its role (or finishes them in place when there is
// none), and waits until it holds nothing; then the process exits 0.
#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <string>

namespace troupe::actors {

struct RunOptions {
  std::string manifest;        // topology manifest (docs/manifest.md)
  std::string node;            // instance: "decode-1", or "front" for a node with one slot
  std::string backend = "cpu"; // cpu | cuda
  int64_t step_tokens = 512;
  int max_running = 256;
  // HTTP port instead of the node's ports.http (several slots of one node on
  // one host); -1: the manifest's.
  int http_port = -1;
  // A gateway node's HTTP API, as troupe serve's.
  std::string api_key;                            // empty: none
  std::vector<std::string> allowed_origins{"*"};  // CORS origins; empty: none
  int64_t max_model_len = 0;                      // 0: min(the model's positions, 32768)
  size_t max_body_bytes = 8u << 20;
  int read_timeout_s = 30;
  // Called when the router's process asks this one to drain and stop (an
  // admin's POST /admin/drain of its worker); run_until_signal raises SIGTERM.
  std::function<void()> on_drain_request;
};

class NodeProcess {
 public:
  // Starts HTTP (/health/live at once), the node (peers are dialled in the
  // background), the router and gateway, then loads the weights and starts the
  // worker; returns when all of that is done. Throws troupe::Error for a bad
  // manifest, an unknown node or a port in use.
  explicit NodeProcess(RunOptions options);
  ~NodeProcess();  // stops everything (no drain)
  NodeProcess(const NodeProcess&) = delete;
  NodeProcess& operator=(const NodeProcess&) = delete;

  // The SIGTERM path: stop admitting, finish or move in-flight work, within
  // `timeout`. True when nothing was left behind.
  bool drain(std::chrono::milliseconds timeout);
  // The manifest's drain.timeout_s.
  std::chrono::milliseconds drain_timeout() const;
  uint16_t http_port() const;
  std::string not_ready() const;

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

// Runs a NodeProcess until SIGTERM (drain, then exit 0) or SIGINT (exit at once).
int run_until_signal(RunOptions options);

}  // namespace troupe::actors
