// One process, every actor: `troupe serve`. A Graph owns the actor system,
// the model, the router, the supervisor with its workers and the gateway; it
// is what the CLI runs and what in-process tests start.
#pragma once

#include <caf/all.hpp>

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "actors/supervisor/supervisor.hpp"
#include "base/metrics.hpp"
#include "cache/planner.hpp"
#include "model/config.hpp"

namespace troupe::actors {

struct ServeOptions {
  std::string model_dir;            // empty: the embedded default model (created on first use)
  std::string served_model_name;    // empty: the model directory's name
  std::string host = "127.0.0.1";
  uint16_t port = 8000;             // 0: any free port
  std::optional<uint16_t> frame_port;  // the frame endpoint (docs/messages.md); 0: any free port; unset: none
  std::string api_key;
  std::vector<std::string> allowed_origins{"*"};  // CORS (gateway::HttpOptions); empty: none
  int workers = 1;                  // colocated workers
  int prefill_workers = 0;          // > 0 with decode_workers > 0: disaggregated inside the process
  int decode_workers = 0;
  uint64_t kv_bytes = uint64_t{1} << 30;  // device tier per worker
  double kv_fraction = 0;                 // > 0: instead, this share of the memory free after the weights,
                                          // split among the workers the process may run
  std::vector<cache::ContextShare> pool_mix;  // where the pools start (engine::EngineOptions)
  std::optional<std::array<double, cache::kPoolKinds>> pool_ratios;
  double cache_share = 0;
  uint64_t host_bytes = 0;                // host tier per worker (park, spill)
  bool cold_pages = true;                 // long sequences' old pages may live in (and be read from) the host tier
  int64_t max_model_len = 0;        // 0: min(max_position_embeddings, 32768)
  int64_t step_tokens = 512;
  int max_running = 256;
  size_t max_body_bytes = 8u << 20;
  int read_timeout_s = 30;
  std::optional<LongTailPolicy> long_tail;
  std::optional<ScaleRule> scale;
  RestartPolicy restart;
  std::string backend = "cpu";
  std::string weights = "auto";     // matrix type: auto, f32 or bf16 (as `troupe forward --weights`)
  double drain_timeout_s = 30;      // SIGTERM: how long requests in flight may take to finish
  bool test_hooks = false;          // POST /admin/crash (fault injection for tests)
};

// Where the embedded default model lives: $TROUPE_HOME, else
// $XDG_CACHE_HOME/troupe, else ~/.cache/troupe; then models/deepseek-v4-tiny.
std::string default_model_dir();
// Creates the embedded default model there unless it exists (deterministic:
// `troupe init-model --preset tiny --dtype bf16 --seed 0`). Returns the path.
std::string ensure_default_model();

class Graph {
 public:
  // Loads the model, spawns the actors and starts listening. Throws troupe::Error.
  explicit Graph(ServeOptions options);
  ~Graph();  // stops everything
  uint16_t port() const { return port_; }
  uint16_t frame_port() const { return frame_port_; }  // 0: no frame endpoint
  caf::actor_system& system() { return *system_; }
  caf::actor gateway() const { return gateway_; }
  caf::actor router() const { return router_; }
  caf::actor supervisor() const { return supervisor_; }
  const std::string& model_name() const { return model_name_; }
  MetricsRegistry& metrics() { return *metrics_; }
  // Stops admissions (new requests get 503) and waits up to `grace` for the
  // requests in flight to finish; returns how many are left.
  int64_t drain(std::chrono::milliseconds grace);

 private:
  void spawn_actors(const model::ModelConfig& mc);
  void shutdown();

  ServeOptions options_;
  std::unique_ptr<caf::actor_system_config> cfg_;
  std::unique_ptr<caf::actor_system> system_;
  std::shared_ptr<MetricsRegistry> metrics_;
  caf::actor router_, supervisor_, gateway_;
  uint16_t port_ = 0;
  uint16_t frame_port_ = 0;
  std::string model_name_;
  struct Owned;
  std::unique_ptr<Owned> owned_;
};

// Runs a Graph until SIGINT or SIGTERM, then shuts down. Returns the exit status.
int serve_until_signal(ServeOptions options);

}  // namespace troupe::actors
