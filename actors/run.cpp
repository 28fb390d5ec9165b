#include "actors/run.hpp"

#include <signal.h>
#include <map>
#include <spdlog/spdlog.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <filesystem>
#include <future>
#include <mutex>
#include <optional>
#include <nlohmann/json.hpp>
#include <thread>

#include "actors/gateway/gateway.hpp"
#include "actors/node/node.hpp"
#include "actors/router/router.hpp"
#include "actors/serve.hpp"
#include "actors/supervisor/fleet.hpp"
#include "actors/supervisor/kube_scale.hpp"
#include "actors/supervisor/supervisor.hpp"
#include "base/error.hpp"
#include "cache/layout.hpp"
#include "cache/planner.hpp"
#include "engine/engine.hpp"
#include "deploy/manifest.hpp"
#include "kernels/backend.hpp"
#include "model/config.hpp"
#include "model/tokenizer/default_tokenizer.hpp"
#include "transport/ucx.hpp"

namespace troupe::actors {
namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;
using json = nlohmann::json;

namespace {

// Which of two instances connects to the other: each pair has one connection.
// Gateway-only Deployment pods (rank 0) dial everyone and are never dialled;
// workers (1) dial the router's process (2); equal ranks: the larger name dials.
int rank(const deploy::Instance& i) {
  if (i.node->workload == deploy::Workload::deployment) return 0;
  if (i.node->runs(deploy::ActorKind::router)) return 2;
  return 1;
}

bool dials(const deploy::Instance& a, const deploy::Instance& b) {
  if (b.node->workload == deploy::Workload::deployment) return false;
  return rank(a) < rank(b) || (rank(a) == rank(b) && a.name > b.name);
}

void setenv_default(const char* name, const std::string& value) {
  if (std::getenv(name) == nullptr) ::setenv(name, value.c_str(), 0);
}

std::string hostname() {
  char buf[256] = {};
  if (::gethostname(buf, sizeof buf - 1) != 0) return "host";
  return buf;
}

}  // namespace

struct NodeProcess::Impl {
  RunOptions options;
  deploy::Topology topology;
  deploy::Instance instance;
  std::string transport_name;
  std::string router_instance;  // empty: the router runs here
  bool runs_router = false, runs_gateway = false, runs_worker = false;
  WorkerRole role = WorkerRole::colocated;

  std::unique_ptr<caf::actor_system_config> cfg;
  std::unique_ptr<caf::actor_system> system;
  std::shared_ptr<MetricsRegistry> metrics = std::make_shared<MetricsRegistry>();
  std::shared_ptr<node::Node> node;
  std::unique_ptr<gateway::HttpServer> health;  // nodes without a gateway
  uint16_t port = 0;
  caf::actor router, gateway, supervisor;
  caf::actor fleet;    // the router's process: scale and admin drains across processes
  caf::actor control;  // worker processes: a remote drain request (the fleet's admin drain)
  std::unique_ptr<kernels::Backend> backend;
  std::shared_ptr<model::Model> model;
  std::atomic<bool> draining{false};
  std::atomic<bool> stop_housekeeping{false};
  std::thread housekeeper;

  bool shut_down = false;

  void start(RunOptions opts);  // NodeProcess's constructor
  void shutdown();              // stops what start() started (also after it failed part way); once
  std::string not_ready() const {
    if (draining) return "draining";
    if (!node) return "starting";
    return node->not_ready();
  }
  void update_metrics();
  void serve_health(const gateway::HttpRequest& req, gateway::Responder& r);
};

void NodeProcess::Impl::update_metrics() {
  if (!node) return;
  auto s = node->stats();
  auto& m = *metrics;
  m.gauge("troupe_peers_up", "Peers connected to this process").set(static_cast<double>(s.peers_up));
  m.gauge("troupe_ready", "1 when /health is 200").set(not_ready().empty() ? 1 : 0);
  m.gauge("troupe_fabric_proxies", "Proxies of remote actors").set(static_cast<double>(s.proxies));
  m.gauge("troupe_fabric_exported", "Local actors remote processes refer to").set(static_cast<double>(s.exported));
  m.gauge("troupe_kv_leases", "KV handoff leases lent from here and not yet confirmed").set(static_cast<double>(s.kv.leases));
  m.gauge("troupe_kv_pulls", "KV handoff pulls in flight here").set(static_cast<double>(s.kv.pulls));
  m.gauge("troupe_kv_bytes_lent", "KV bytes takers confirmed (total)").set(static_cast<double>(s.kv.bytes_lent));
  m.gauge("troupe_kv_bytes_pulled", "KV bytes pulled here (total)").set(static_cast<double>(s.kv.bytes_pulled));
  m.gauge("troupe_kv_failed_pulls", "KV pulls that failed (the request was recomputed)").set(static_cast<double>(s.kv.failed_pulls));
  m.gauge("troupe_kv_expired_leases", "KV leases that expired before a confirm").set(static_cast<double>(s.kv.expired_leases));
  m.gauge("troupe_handoffs_pending", "Handoffs lent from here whose taker has not confirmed").set(static_cast<double>(s.handoffs_pending));
}

void NodeProcess::Impl::serve_health(const gateway::HttpRequest& req, gateway::Responder& r) {
  const std::string path = req.target.substr(0, req.target.find('?'));
  if (path == "/health/live") {
    r.respond(200, "application/json", R"({"status": "live"})");
  } else if (path == "/health") {
    const std::string why = not_ready();
    r.respond(why.empty() ? 200 : 503, "application/json",
              json{{"status", why.empty() ? "ok" : "unavailable"}, {"reason", why}, {"node", instance.name}}.dump());
  } else if (path == "/metrics") {
    update_metrics();
    r.respond(200, "text/plain; version=0.0.4", metrics->render());
  } else {
    r.respond(404, "application/json", R"({"error": {"message": "no such route on a worker node"}})");
  }
}

// A start that fails part way (the backend, a port in use) stops what it started: an exception out of the
// constructor skips ~NodeProcess, and ~actor_system would wait forever for the actors already spawned.
NodeProcess::NodeProcess(RunOptions options) : impl_(std::make_unique<Impl>()) {
  try {
    impl_->start(std::move(options));
  } catch (...) {
    impl_->shutdown();
    throw;
  }
}

void NodeProcess::Impl::start(RunOptions opts) {
  auto& im = *this;
  im.options = std::move(opts);
  im.topology = deploy::load_manifest_or_throw(im.options.manifest);
  const auto& topo = im.topology;
  auto inst = topo.find_instance(im.options.node);
  if (!inst) {
    std::string names;
    for (const auto& i : topo.instances()) names += (names.empty() ? "" : ", ") + i.name;
    raise(ErrorCode::not_found, "the manifest {} has no node '{}'; its instances: {}", im.options.manifest,
          im.options.node, names);
  }
  im.instance = *inst;
  const deploy::Node& me = *im.instance.node;
  const auto discovery = deploy::effective_discovery(topo);
  const char* ns_env = std::getenv("POD_NAMESPACE");
  const std::string pod_ns = ns_env && *ns_env ? ns_env : "default";
  im.runs_router = me.runs(deploy::ActorKind::router);
  im.runs_gateway = me.runs(deploy::ActorKind::gateway);
  const bool prefill = me.runs(deploy::ActorKind::prefill), decode = me.runs(deploy::ActorKind::decode);
  im.runs_worker = prefill || decode;
  im.role = prefill && decode ? WorkerRole::colocated : prefill ? WorkerRole::prefill : WorkerRole::decode;
  im.transport_name = me.workload == deploy::Workload::deployment ? me.name + "@" + hostname() : im.instance.name;
  for (const auto& n : topo.nodes) {
    if (n.runs(deploy::ActorKind::router) && &n != &me) im.router_instance = n.name + "-0";
  }

  // UCX: quick restarts on the fixed listening port, TCP lanes inside the
  // manifest's range, and TCP only when the manifest asks for it.
  setenv_default("UCX_TCP_CM_REUSEADDR", "y");
  setenv_default("UCX_TCP_PORT_RANGE",
                 fmt::format("{}-{}", me.ports.transport_range.first, me.ports.transport_range.last));
  if (topo.policies.disaggregation.handoff_transport == deploy::HandoffTransport::tcp) setenv_default("UCX_TLS", "tcp");

  im.cfg = std::make_unique<caf::actor_system_config>();
  im.cfg->set("scheduler.max-threads", std::max(2u, std::thread::hardware_concurrency()));
  im.cfg->set("logger.verbosity", caf::atom("quiet"));
  im.system = std::make_unique<caf::actor_system>(*im.cfg);

  const auto own = topo.transport_endpoint(im.instance, discovery, pod_ns);
  const std::string bind_host = discovery == deploy::Discovery::static_addresses && !own.host.empty() ? own.host : "0.0.0.0";

  // /health/live answers as soon as the process runs; a gateway serves it itself.
  if (!im.runs_gateway) {
    gateway::HttpOptions ho;
    ho.address = bind_host;
    ho.port = im.options.http_port >= 0 ? static_cast<uint16_t>(im.options.http_port) : (discovery == deploy::Discovery::static_addresses ? topo.http_port(im.instance) : me.ports.http);
    ho.threads = 1;
    Impl* raw = this;
    im.health = std::make_unique<gateway::HttpServer>(
        ho, [raw](gateway::HttpRequest req, std::shared_ptr<gateway::Responder> r) { raw->serve_health(req, *r); });
    im.port = im.health->port();
  }

  // The node: peers from the manifest.
  node::NodeOptions no;
  no.name = im.transport_name;
  no.has_weights = im.runs_worker;
  no.handoff_ttl = std::chrono::milliseconds(static_cast<int64_t>(topo.policies.disaggregation.handoff_timeout_s * 1000));
  auto required = topo.required_peers(im.instance);
  // A prefill worker hands every request to a decode worker: it is ready only
  // once it reaches the first instances of the decode nodes too.
  if (im.role == WorkerRole::prefill) {
    for (const auto& n : topo.nodes) {
      if (!n.runs(deploy::ActorKind::decode) || n.runs(deploy::ActorKind::prefill)) continue;
      const deploy::ScalePolicy* rule = topo.scale_rule(n.name);
      for (int32_t i = 0; i < (rule ? rule->min_workers : n.replicas); ++i) required.push_back(fmt::format("{}-{}", n.name, i));
    }
  }
  for (const auto& other : topo.instances()) {
    if (other.name == im.instance.name || other.node->workload == deploy::Workload::deployment) continue;
    node::PeerSpec p;
    p.name = other.name;
    auto ep = topo.transport_endpoint(other, discovery, pod_ns);
    p.host = ep.host;
    p.port = ep.port;
    p.dial = dials(im.instance, other);
    p.required = std::find(required.begin(), required.end(), other.name) != required.end();
    no.peers.push_back(p);
  }
  std::string model_dir;
  if (im.runs_worker || im.runs_gateway) model_dir = topo.model.embedded() ? ensure_default_model() : topo.model.path;
  std::optional<model::ModelConfig> config;
  if (!model_dir.empty()) {
    config = model::load_config((fs::path(model_dir) / "config.json").string());
    const auto g = cache::CacheGeometry::of(*config);
    no.kv.csa_rate = g.csa_rate;
    no.kv.hca_rate = g.hca_rate;
    no.kv.model = fs::path(model_dir).filename().string();
  }
  transport::UcxOptions uo;
  uo.name = im.transport_name;
  uo.listen_host = me.workload == deploy::Workload::deployment ? "" : bind_host;
  uo.listen_port = own.port != 0 ? own.port : me.ports.transport;
  im.node = node::Node::start(*im.system, no, std::make_unique<transport::UcxTransport>(uo));

  // The router: here, or a stable proxy of the router's process.
  if (im.runs_router) {
    RouterOptions ro;
    ro.hold_when_empty = std::chrono::milliseconds(static_cast<int64_t>(topo.drain.timeout_s * 1000));
    im.router = spawn_router(*im.system, im.metrics, ro);
    // The fleet before anyone can register: standby slots are held out of service first.
    FleetConfig fc;
    for (const auto& n : topo.nodes) {
      if (!n.is_worker() || n.workload == deploy::Workload::deployment) continue;
      FleetNode fn;
      fn.name = n.name;
      const bool p = n.runs(deploy::ActorKind::prefill), d = n.runs(deploy::ActorKind::decode);
      fn.role = p && d ? WorkerRole::colocated : p ? WorkerRole::prefill : WorkerRole::decode;
      for (const auto& i : topo.instances()) {
        if (i.node == &n) fn.slots.push_back(i.name);
      }
      fn.active = std::min<int>(n.replicas, static_cast<int>(fn.slots.size()));
      if (const deploy::ScalePolicy* r = topo.scale_rule(n.name)) {
        ScaleRule fr;
        fr.min_workers = r->min_workers;
        fr.max_workers = r->max_workers;
        fr.queue_depth_high = r->queue_depth_high;
        fr.queue_depth_low = r->queue_depth_low;
        fr.kv_use_high = r->kv_use_high;
        fr.kv_use_low = r->kv_use_low;
        fr.outstanding_handoffs_high = r->outstanding_handoffs_high;
        fr.cooldown = std::chrono::milliseconds(static_cast<int64_t>(r->cooldown_s * 1000));
        fn.rule = fr;
        if (discovery == deploy::Discovery::kubernetes && n.workload == deploy::Workload::stateful_set) {
          fn.statefulset = topo.object_name(n);
        }
      }
      fc.nodes.push_back(std::move(fn));
    }
    // On Kubernetes the fleet resizes the scaled nodes' StatefulSets as the
    // pod's service account (the renderer's Role allows exactly that).
    if (discovery == deploy::Discovery::kubernetes && !topo.policies.scale.empty()) {
      if (auto api = KubeApiOptions::in_cluster(topo.kubernetes.namespace_name)) {
        auto scaler = std::make_shared<KubeScaler>(*api);
        fc.set_replicas = [scaler](const std::string& ss, int32_t n) { return scaler->set_replicas(ss, n); };
        spdlog::info("run: the fleet resizes StatefulSets through https://{}:{} (namespace {})", api->host, api->port,
                     api->namespace_name);
      } else {
        spdlog::warn("run: not in a Kubernetes pod (no KUBERNETES_SERVICE_HOST): the scale policy admits only pods "
                     "that are already up");
      }
    }
    std::weak_ptr<node::Node> weak = im.node;
    fc.control = [weak](const std::string& instance) -> caf::actor {
      auto n = weak.lock();
      return n ? n->remote(instance, "control") : nullptr;
    };
    fc.handoffs = [weak] {
      std::map<std::string, int64_t> out;
      if (auto n = weak.lock()) {
        for (const auto& p : n->peers()) out[p.name] = p.handoffs_outstanding;
      }
      return out;
    };
    im.fleet = spawn_fleet(*im.system, std::move(fc), im.router, im.metrics);
    im.node->publish("router", im.router);
    im.node->publish("fleet", im.fleet);
  } else if (!im.router_instance.empty()) {
    im.router = im.node->remote(im.router_instance, "router");
  }

  std::shared_ptr<const tokenizer::Tokenizer> tok;
  if (im.runs_gateway || im.runs_worker) {
    tok = std::shared_ptr<const tokenizer::Tokenizer>(tokenizer::Tokenizer::load(tokenizer::tokenizer_dir_for(model_dir)));
  }
  if (im.runs_gateway) {
    GatewayConfig gc;
    gc.model_name = fs::path(model_dir).filename().string();
    gc.max_model_len = im.options.max_model_len > 0 ? im.options.max_model_len
                                                    : std::min<int64_t>(config->max_position_embeddings, 32768);
    gc.http.max_body_bytes = im.options.max_body_bytes;
    gc.http.read_timeout = std::chrono::seconds(im.options.read_timeout_s);
    gc.http.address = bind_host;
    gc.http.port = im.options.http_port >= 0 ? static_cast<uint16_t>(im.options.http_port) : (discovery == deploy::Discovery::static_addresses ? topo.http_port(im.instance) : me.ports.http);
    gc.min_workers_ready = 1;
    gc.api_key = im.options.api_key;
    gc.http.allowed_origins = im.options.allowed_origins;
    Impl* raw = this;
    gc.not_ready = [raw] { return raw->not_ready(); };
    im.gateway = spawn_gateway(*im.system, gc, tok, im.router, im.metrics, &im.port);
    im.node->publish("gateway", im.gateway);
    // Admin routes (drain, scale) reach every process's workers through the
    // fleet: here, or in the router's process (a gateway-only process, e.g. a
    // Kubernetes Deployment behind the Service, asks it over the fabric).
    if (im.fleet) attach_supervisor(im.gateway, im.fleet);
    else if (!im.router_instance.empty()) attach_supervisor(im.gateway, im.node->remote(im.router_instance, "fleet"));
  }

  if (im.runs_worker) {
    im.backend = im.options.backend == "cuda" ? kernels::make_cuda_backend() : kernels::make_cpu_backend();
    if (!im.backend) raise(ErrorCode::unavailable, "the CUDA backend is not available (no GPU or not compiled)");
    im.model = std::shared_ptr<model::Model>(model::Model::load(model_dir, *im.backend));
    WorkerConfig wc;
    wc.name = im.instance.name;
    wc.role = im.role;
    const auto& pools = topo.pools;
    wc.engine.device_bytes = pools.memory_budget.bytes > 0
                                 ? pools.memory_budget.bytes
                                 : engine::pool_budget(*im.backend, pools.memory_budget.fraction);
    if (pools.memory_budget.bytes == 0) {
      spdlog::info("run: KV pools get {:g} of the free {} memory: {}", pools.memory_budget.fraction,
                   im.backend->name(), cache::format_bytes(static_cast<double>(wc.engine.device_bytes)));
    }
    // Where the pools start: fixed ratios, the manifest's mix or the planner's default mix.
    if (pools.ratios) {
      const auto& q = *pools.ratios;
      std::array<double, cache::kPoolKinds> r{};
      r[cache::index(cache::PoolKind::window)] = q.swa;
      r[cache::index(cache::PoolKind::csa_entry)] = q.csa_entries;
      r[cache::index(cache::PoolKind::csa_index)] = q.index_keys;
      r[cache::index(cache::PoolKind::hca_entry)] = q.hca_entries;
      r[cache::index(cache::PoolKind::hca_ring)] = q.inflight;
      wc.engine.pool_ratios = r;
    } else if (!pools.context_mix.empty()) {
      for (const auto& c : pools.context_mix) wc.engine.pool_mix.push_back({c.prompt_tokens + c.output_tokens, c.share});
    } else {
      wc.engine.pool_mix = cache::parse_mix(cache::kDefaultMix);
    }
    wc.engine.host_bytes = pools.host_tier;
    // A request's state leaves a worker through its host tier (the PD handoff
    // exports a request parked there, and so does a drain's migration): a
    // worker always gets one, as large as its device budget unless the
    // manifest sizes it; where both tiers are the same memory (the CPU
    // backend: Backend::memory_is_host), at most what the device budget leaves of the free memory.
    if (wc.engine.host_bytes == 0) {
      wc.engine.host_bytes = wc.engine.device_bytes;
      const auto info = im.backend->memory_info();
      if (im.backend->memory_is_host() && info && info->free > wc.engine.device_bytes) {
        wc.engine.host_bytes = std::min(wc.engine.host_bytes, info->free - wc.engine.device_bytes);
      }
    }
    wc.engine.step_tokens = im.options.step_tokens;
    wc.engine.max_running = im.options.max_running;
    wc.engine.vocabulary = std::make_shared<const engine::TokenVocabulary>(tok->vocabulary_bytes());
    wc.handoff_timeout = std::chrono::milliseconds(static_cast<int64_t>(topo.policies.disaggregation.handoff_timeout_s * 1000));
    SupervisorConfig sc;
    sc.workers.push_back(wc);
    sc.worker_template = wc;
    sc.restart.max_restarts = topo.policies.restart.max_restarts;
    sc.restart.window = std::chrono::seconds(static_cast<int64_t>(topo.policies.restart.window_s));
    if (topo.policies.long_tail) {
      LongTailPolicy lt;
      lt.pressure_threshold = topo.policies.long_tail->pressure_threshold;
      lt.resume_threshold = topo.policies.long_tail->resume_threshold;
      lt.max_deferrals = topo.policies.long_tail->max_deferrals;
      sc.long_tail = lt;
    }
    im.supervisor = spawn_supervisor(*im.system, im.model, std::move(sc), im.router, im.metrics);
    if (im.fleet) caf::anon_send(im.fleet, local_atom::value, im.supervisor, im.instance.name);
    // The fleet's admin drain of this worker: the process drains itself and exits (as on SIGTERM).
    auto on_drain = im.options.on_drain_request;
    const std::string me_name = im.instance.name;
    im.control = im.system->spawn([on_drain, me_name](caf::event_based_actor*) -> caf::behavior {
      auto asked = std::make_shared<bool>(false);  // once: a second SIGTERM would end the drain at once
      return {
          [=](drain_atom) {
            if (*asked) return;
            *asked = true;
            if (on_drain) {
              spdlog::info("run: {}: the router's process asks this process to drain and stop", me_name);
              on_drain();
            } else {
              spdlog::warn("run: {}: asked to drain and stop, but this process cannot stop itself", me_name);
            }
          },
      };
    });
    im.node->publish("control", im.control);
    im.node->set_weights_ready(true);
  }

  im.housekeeper = std::thread([raw = this] {
    while (!raw->stop_housekeeping) {
      raw->update_metrics();
      std::this_thread::sleep_for(std::chrono::milliseconds(500));
    }
  });
  spdlog::info("run: node {} ({}) up: http :{}, transport {}, router {}", im.instance.name,
               [&] {
                 std::string a;
                 for (auto k : me.actors) a += (a.empty() ? "" : "+") + std::string(deploy::to_string(k));
                 return a;
               }(),
               im.port, im.node->address(), im.runs_router ? "here" : im.router_instance);
}

NodeProcess::~NodeProcess() { impl_->shutdown(); }

void NodeProcess::Impl::shutdown() {
  auto& im = *this;
  if (im.shut_down || !im.system) return;
  im.shut_down = true;
  im.stop_housekeeping = true;
  if (im.housekeeper.joinable()) im.housekeeper.join();
  if (im.supervisor) {  // its workers are monitored, not linked: stopped explicitly (none restarted)
    caf::scoped_actor self{*im.system};
    self->request(im.supervisor, std::chrono::seconds(5), stop_atom::value).receive([](bool) {}, [](caf::error&) {});
  }
  for (const auto& a : {im.gateway, im.supervisor, im.router, im.fleet, im.control}) {
    if (a) caf::anon_send_exit(a, caf::exit_reason::user_shutdown);
  }
  im.health.reset();
  // Peers see this process go; every proxy ends.
  if (im.node) im.node->stop();
  im.router = im.gateway = im.supervisor = im.fleet = im.control = nullptr;
  im.system->await_all_actors_done();
  im.node.reset();
  im.system.reset();
}

uint16_t NodeProcess::http_port() const { return impl_->port; }
std::chrono::milliseconds NodeProcess::drain_timeout() const {
  return std::chrono::milliseconds(static_cast<int64_t>(impl_->topology.drain.timeout_s * 1000));
}
std::string NodeProcess::not_ready() const { return impl_->not_ready(); }

bool NodeProcess::drain(std::chrono::milliseconds timeout) {
  auto& im = *impl_;
  im.draining = true;
  const auto deadline = Clock::now() + timeout;
  caf::scoped_actor self{*im.system};
  spdlog::info("run: draining node {} (at most {} ms)", im.instance.name, timeout.count());

  // The gateway: no new requests; wait for those in flight.
  bool gateway_idle = !im.gateway;
  // A worker: fenced at the router, its requests moved to another worker of its role; it stops when no
  // other worker's load names it as a handoff target (a job the router dispatched before the fence, a PD
  // prefill naming this worker as its decode target, reaches it only when its prefill ends, as a handoff
  // this loop then moves on) and it has been idle for kDrainQuiet (loads are reported every 50 ms: a job
  // the router sent to a prefill just before the fence shows in that prefill's next report). Session 50's
  // make test caught a drain that stopped in the 1 ms before such a handoff arrived (the gateway resubmitted
  // the request: nothing lost, but not the drain's promise).
  constexpr auto kDrainQuiet = std::chrono::milliseconds(1000);
  bool worker_idle = !im.runs_worker;
  bool fenced = false;
  auto last_migrate = Clock::now() - std::chrono::hours(1);
  std::optional<Clock::time_point> idle_since;
  while (Clock::now() < deadline) {
    if (!gateway_idle) {
      int64_t inflight = -1;
      self->request(im.gateway, std::chrono::seconds(2), drain_atom::value)
          .receive([&](int64_t n) { inflight = n; }, [&](caf::error&) {});
      gateway_idle = inflight == 0;
    }
    if (!worker_idle && im.router) {
      if (!fenced) {
        self->send(im.router, fence_atom::value, im.instance.name, true);
        fenced = true;
      }
      // Asked by the actor that sent the fence: the router has applied it when it answers.
      std::vector<WorkerLoad> loads;
      self->request(im.router, std::chrono::seconds(2), workers_atom::value)
          .receive([&](const std::vector<WorkerLoad>& l) { loads = l; },
                   [&](caf::error& e) { spdlog::warn("run: the router did not answer: {}", caf::to_string(e)); });
      const WorkerLoad* mine = nullptr;
      const WorkerLoad* target = nullptr;
      for (const auto& l : loads) {
        if (l.name == im.instance.name) {
          mine = &l;
        } else if (l.role == im.role && !l.draining && l.actor &&
                   (!target || l.running + l.waiting < target->running + target->waiting)) {
          target = &l;
        }
      }
      const auto s = im.node->stats();
      if (mine && Clock::now() - last_migrate > std::chrono::seconds(1)) {
        // Again every second: requests that arrived after the fence (handoffs in flight) move too.
        if (target) self->send(mine->actor, migrate_atom::value, target->actor);
        else self->send(mine->actor, drain_atom::value);
        last_migrate = Clock::now();
      }
      // Requests other workers still mean to move here (a PD prefill that names this worker as its decode
      // target, dispatched before the fence): they arrive as handoffs, which the migrations above move on.
      int64_t inbound = 0;
      if (mine != nullptr) {
        for (const auto& l : loads) {
          if (&l != mine) inbound += std::count(l.handoff_targets.begin(), l.handoff_targets.end(), mine->actor);
        }
      }
      bool idle = (mine == nullptr || (mine->running == 0 && mine->waiting == 0 && mine->parked == 0)) &&
                  inbound == 0 && s.handoffs_pending == 0 && s.kv.leases == 0 && s.kv.pulls == 0;
      if (mine == nullptr && loads.empty()) idle = false;  // the router did not answer: keep waiting
      if (!idle) idle_since.reset();
      else if (!idle_since) idle_since = Clock::now();
      worker_idle = idle && Clock::now() - *idle_since >= kDrainQuiet;
    } else if (!worker_idle) {
      worker_idle = true;  // no router to fence with: nothing more to do than stop
    }
    if (gateway_idle && worker_idle) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  const bool ok = gateway_idle && worker_idle;
  if (ok) spdlog::info("run: node {} drained", im.instance.name);
  else spdlog::warn("run: node {}: drain timed out with work left", im.instance.name);
  return ok;
}

int run_until_signal(RunOptions options) {
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGINT);
  sigaddset(&set, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &set, nullptr);  // every thread started below inherits the mask
  // A drain the router's process asks for (admin): the SIGTERM path below.
  options.on_drain_request = [] { ::kill(::getpid(), SIGTERM); };
  auto process = std::make_unique<NodeProcess>(std::move(options));
  int sig = 0;
  sigwait(&set, &sig);
  int code = 0;
  if (sig == SIGTERM) {
    // A second signal during the drain ends the process at once.
    std::thread([set]() mutable {
      int again = 0;
      sigwait(&set, &again);
      spdlog::warn("second signal during the drain: exiting now");
      std::_Exit(1);
    }).detach();
    code = process->drain(process->drain_timeout()) ? 0 : 1;
  } else {
    spdlog::info("SIGINT: stopping");
  }
  // Orderly teardown (peers see the connections close), bounded: a stuck
  // actor must not keep a drained process from exiting. On this thread: CAF
  // 0.17's actor system must be destroyed by the thread that created it (its
  // logger lives in that thread's thread-local until then).
  std::promise<void> torn_down;
  std::thread([done = torn_down.get_future(), code]() mutable {
    if (done.wait_for(std::chrono::seconds(10)) == std::future_status::ready) return;
    spdlog::warn("run: teardown did not finish within 10 s; exiting anyway");
    spdlog::default_logger()->flush();
    std::_Exit(code);
  }).detach();
  process.reset();
  torn_down.set_value();
  return code;
}

}  // namespace troupe::actors
