#include "actors/serve.hpp"

#include <signal.h>
#include <spdlog/spdlog.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <optional>
#include <thread>

#include "actors/gateway/gateway.hpp"
#include "actors/router/router.hpp"
#include "base/error.hpp"
#include "engine/engine.hpp"
#include "kernels/backend.hpp"
#include "model/forward.hpp"
#include "model/init.hpp"
#include "model/tokenizer/default_tokenizer.hpp"
#include "model/tokenizer/tokenizer.hpp"

namespace troupe::actors {
namespace fs = std::filesystem;

std::string default_model_dir() {
  fs::path home;
  if (const char* t = std::getenv("TROUPE_HOME"); t && *t) {
    home = t;
  } else if (const char* x = std::getenv("XDG_CACHE_HOME"); x && *x) {
    home = fs::path(x) / "troupe";
  } else if (const char* h = std::getenv("HOME"); h && *h) {
    home = fs::path(h) / ".cache" / "troupe";
  } else {
    home = fs::temp_directory_path() / "troupe";
  }
  return (home / "models" / "deepseek-v4-tiny").string();
}

std::string ensure_default_model() {
  const fs::path dir = default_model_dir();
  if (fs::exists(dir / "config.json") && fs::exists(dir / "model.safetensors")) return dir.string();
  // Build it next to its final place, then rename: concurrent first starts never see half a model.
  const fs::path tmp = dir.string() + ".tmp-" + std::to_string(::getpid());
  spdlog::info("creating the embedded default model (random weights) in {}", dir.string());
  model::InitOptions o;
  o.preset = "tiny";
  o.seed = 0;
  o.dtype = DType::bf16;
  model::init_model(tmp.string(), o);
  std::error_code ec;
  fs::rename(tmp, dir, ec);
  if (ec) fs::remove_all(tmp, ec);  // another process won the race; its copy is the same
  return dir.string();
}

struct Graph::Owned {
  std::unique_ptr<kernels::Backend> backend;
  std::shared_ptr<model::Model> model;
  std::shared_ptr<const tokenizer::Tokenizer> tokenizer;
};

Graph::Graph(ServeOptions options) : options_(std::move(options)), owned_(std::make_unique<Owned>()) {
  const std::string dir = options_.model_dir.empty() ? ensure_default_model() : options_.model_dir;
  owned_->backend = options_.backend == "cuda" ? kernels::make_cuda_backend() : kernels::make_cpu_backend();
  if (!owned_->backend) raise(ErrorCode::unavailable, "the CUDA backend is not available (no GPU or not compiled)");
  if (options_.weights == "bf16" && options_.backend != "cuda") {
    raise(ErrorCode::invalid_argument, "--weights bf16 needs --backend cuda (the CPU backend computes in fp32)");
  }
  std::optional<kernels::WeightType> type;
  if (options_.weights == "f32") type = kernels::WeightType::f32;
  if (options_.weights == "bf16") type = kernels::WeightType::bf16;
  owned_->model = std::shared_ptr<model::Model>(model::Model::load(dir, *owned_->backend, type));
  owned_->tokenizer = std::shared_ptr<const tokenizer::Tokenizer>(tokenizer::Tokenizer::load(tokenizer::tokenizer_dir_for(dir)));
  const auto& mc = owned_->model->config();
  if (owned_->tokenizer->vocab_size() > mc.vocab_size) {
    spdlog::warn("the tokenizer has {} ids but the model only {}; prompts with larger ids are refused",
                 owned_->tokenizer->vocab_size(), mc.vocab_size);
  }
  model_name_ = options_.served_model_name.empty() ? fs::path(dir).filename().string() : options_.served_model_name;

  cfg_ = std::make_unique<caf::actor_system_config>();
  cfg_->set("scheduler.max-threads", std::max(2u, std::thread::hardware_concurrency()));
  cfg_->set("logger.verbosity", caf::atom("quiet"));
  system_ = std::make_unique<caf::actor_system>(*cfg_);
  metrics_ = std::make_shared<MetricsRegistry>();
  try {
    spawn_actors(mc);
  } catch (...) {
    // Without this the actor system's destructor waits forever for the actors
    // already spawned (e.g. when the port is taken).
    shutdown();
    throw;
  }
  spdlog::info("serving '{}' on http://{}:{} ({} backend)", model_name_, options_.host, port_, owned_->backend->name());
  if (options_.frame_port) spdlog::info("serving '{}' frames on tcp://{}:{}", model_name_, options_.host, frame_port_);
}

void Graph::spawn_actors(const model::ModelConfig& mc) {
  router_ = spawn_router(*system_, metrics_);

  if (options_.kv_fraction > 0) {
    // Every worker this process may run shares the memory (a scaled-up one too).
    int sharers = options_.prefill_workers > 0 && options_.decode_workers > 0
                      ? options_.prefill_workers + options_.decode_workers
                      : std::max(1, options_.workers);
    if (options_.scale) sharers = std::max(sharers, options_.scale->max_workers);
    options_.kv_bytes = engine::pool_budget(*owned_->backend, options_.kv_fraction, sharers);
    spdlog::info("KV pools: {:g} of the free {} memory over {} worker(s): {} each", options_.kv_fraction,
                 owned_->backend->name(), sharers, cache::format_bytes(static_cast<double>(options_.kv_bytes)));
  }
  WorkerConfig base;
  base.engine.device_bytes = options_.kv_bytes;
  base.engine.pool_mix = options_.pool_mix;
  base.engine.pool_ratios = options_.pool_ratios;
  base.engine.cache_share = options_.cache_share;
  base.engine.host_bytes = options_.host_bytes;
  base.engine.cold_pages = options_.cold_pages;
  base.engine.step_tokens = options_.step_tokens;
  base.engine.max_running = options_.max_running;
  base.engine.vocabulary = std::make_shared<const engine::TokenVocabulary>(owned_->tokenizer->vocabulary_bytes());
  SupervisorConfig sc;
  auto add = [&](WorkerRole role, int n, const std::string& prefix) {
    for (int i = 0; i < n; ++i) {
      WorkerConfig w = base;
      w.role = role;
      w.name = prefix + "-" + std::to_string(i);
      sc.workers.push_back(w);
    }
  };
  if (options_.prefill_workers > 0 && options_.decode_workers > 0) {
    // A prefill worker parks each request in its host tier until the decode
    // worker has pulled the state: without one there is no handoff at all.
    WorkerConfig plain = base;
    if (base.engine.host_bytes == 0) base.engine.host_bytes = options_.kv_bytes;
    add(WorkerRole::prefill, options_.prefill_workers, "prefill");
    base = plain;
    add(WorkerRole::decode, options_.decode_workers, "decode");
    sc.worker_template = base;
    sc.worker_template.role = WorkerRole::decode;
    sc.worker_template.name = "decode-scaled";
  } else {
    add(WorkerRole::colocated, std::max(1, options_.workers), "worker");
    sc.worker_template = base;
    sc.worker_template.name = "worker-scaled";
  }
  sc.restart = options_.restart;
  sc.long_tail = options_.long_tail;
  sc.scale = options_.scale;
  supervisor_ = spawn_supervisor(*system_, owned_->model, std::move(sc), router_, metrics_);

  GatewayConfig gc;
  gc.model_name = model_name_;
  gc.max_model_len = options_.max_model_len > 0 ? options_.max_model_len
                                                : std::min<int64_t>(mc.max_position_embeddings, 32768);
  gc.api_key = options_.api_key;
  gc.http.address = options_.host;
  gc.http.port = options_.port;
  gc.http.max_body_bytes = options_.max_body_bytes;
  gc.http.read_timeout = std::chrono::seconds(options_.read_timeout_s);
  gc.http.allowed_origins = options_.allowed_origins;
  gc.min_workers_ready = 1;
  gc.test_hooks = options_.test_hooks;
  gc.frame_port = options_.frame_port;
  gc.frame_host = options_.host;
  gateway_ = spawn_gateway(*system_, gc, owned_->tokenizer, router_, metrics_, &port_, &frame_port_);
  attach_supervisor(gateway_, supervisor_);
}

Graph::~Graph() { shutdown(); }

void Graph::shutdown() {
  if (!system_) return;
  // The supervisor first: its workers are monitored, not linked, so they are stopped explicitly.
  if (supervisor_) {
    caf::scoped_actor self{*system_};
    self->request(supervisor_, std::chrono::seconds(5), stop_atom::value)
        .receive([](bool) {}, [](caf::error&) {});
  }
  for (const auto& a : {gateway_, supervisor_, router_}) {
    if (a) caf::anon_send_exit(a, caf::exit_reason::user_shutdown);
  }
  system_->await_all_actors_done();
  system_.reset();
}

int64_t Graph::drain(std::chrono::milliseconds grace) {
  caf::scoped_actor self{*system_};
  const auto deadline = std::chrono::steady_clock::now() + grace;
  int64_t left = -1;
  while (true) {
    self->request(gateway_, std::chrono::seconds(5), drain_atom::value)
        .receive([&](int64_t n) { left = n; }, [&](caf::error&) { left = -1; });
    if (left == 0 || std::chrono::steady_clock::now() >= deadline) return left;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
}

int serve_until_signal(ServeOptions options) {
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGINT);
  sigaddset(&set, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &set, nullptr);  // every thread started below inherits the mask
  const auto grace = std::chrono::milliseconds(static_cast<int64_t>(options.drain_timeout_s * 1000));
  Graph graph(std::move(options));
  int sig = 0;
  sigwait(&set, &sig);
  if (sig == SIGTERM && grace.count() > 0) {
    // Drain: refuse new requests (503, /health says draining), let the ones in flight finish.
    spdlog::info("SIGTERM: draining (up to {} s for the requests in flight)", grace.count() / 1000.0);
    const int64_t left = graph.drain(grace);
    if (left > 0) spdlog::warn("drain timed out; {} requests in flight are cut off", left);
  }
  spdlog::info("{}: shutting down", sig == SIGTERM ? "SIGTERM" : "SIGINT");
  return 0;
}

}  // namespace troupe::actors
