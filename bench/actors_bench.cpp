// Tokens/s through the actors against the engine's own loop, on the same batch.
//
// One round: `batch` requests (random prompts of `prompt` tokens, greedy,
// `tokens` tokens each, ignore_eos), from submission until every one has
// finished. The peer drives an engine::Engine with step() on this thread; the
// actor path sends Jobs to the router, a worker actor runs its own engine
// (same options) on an engine thread and streams TokenBatch/Done messages to
// a sink. Rounds alternate so that load from other processes hits both
// alike; each round uses fresh prompts (no prefix cache hits).
// Prints one JSON object per batch size; bench/actors.sh writes docs/benchmarks.md.
//
// Usage: troupe_actors_bench [--model DIR] [--batch 1,8,64] [--tokens 32] [--prompt 64] [--rounds 3]
#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include <chrono>
#include <cstring>
#include <iostream>
#include <random>
#include <sstream>

#include "actors/router/router.hpp"
#include "actors/serve.hpp"
#include "actors/supervisor/supervisor.hpp"
#include "engine/engine.hpp"
#include "kernels/backend.hpp"
#include "model/forward.hpp"

using namespace troupe;
using Clock = std::chrono::steady_clock;

namespace {

double since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

std::vector<std::vector<int32_t>> prompts(std::mt19937_64& rng, int batch, int64_t n) {
  std::vector<std::vector<int32_t>> out;
  for (int i = 0; i < batch; ++i) {
    std::vector<int32_t> p(static_cast<size_t>(n));
    for (auto& x : p) x = static_cast<int32_t>(2 + rng() % 100000);
    out.push_back(std::move(p));
  }
  return out;
}

engine::SamplingParams greedy(int tokens) {
  engine::SamplingParams s;
  s.max_tokens = tokens;
  s.ignore_eos = true;
  return s;
}

// The engine's own loop: submit, then step on this thread until idle. Returns tokens generated.
int64_t engine_round(model::Model& m, const engine::EngineOptions& o, const std::vector<std::vector<int32_t>>& ps,
                     int tokens) {
  engine::Engine e(m, o);
  for (const auto& p : ps) {
    engine::Request r;
    r.prompt = p;
    r.sampling = greedy(tokens);
    e.submit(std::move(r));
  }
  e.run_until_idle();
  int64_t n = 0;
  for (const auto& ev : e.take_events()) n += ev.kind == engine::EventKind::token ? 1 : 0;
  return n;
}

struct ActorPath {
  caf::actor_system_config cfg;
  std::unique_ptr<caf::actor_system> sys;
  caf::actor router, supervisor;
  actors::RequestId next = 1;

  ActorPath(std::shared_ptr<model::Model> m, const engine::EngineOptions& o) {
    cfg.set("scheduler.max-threads", 2);
    sys = std::make_unique<caf::actor_system>(cfg);
    auto metrics = std::make_shared<MetricsRegistry>();
    router = actors::spawn_router(*sys, metrics);
    actors::SupervisorConfig sc;
    actors::WorkerConfig w;
    w.engine = o;
    sc.workers.push_back(w);
    sc.worker_template = w;
    supervisor = actors::spawn_supervisor(*sys, std::move(m), sc, router, metrics);
    caf::scoped_actor self{*sys};
    for (int i = 0; i < 1000; ++i) {  // until the worker has registered
      size_t n = 0;
      self->request(router, std::chrono::seconds(5), actors::workers_atom::value)
          .receive([&](const std::vector<actors::WorkerLoad>& ws) { n = ws.size(); }, [](caf::error&) {});
      if (n == 1) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
  }
  ~ActorPath() {
    caf::scoped_actor self{*sys};
    self->request(supervisor, std::chrono::seconds(5), actors::stop_atom::value).receive([](bool) {}, [](caf::error&) {});
    for (auto& a : {supervisor, router}) caf::anon_send_exit(a, caf::exit_reason::user_shutdown);
  }

  // Jobs through the router; the sink counts streamed tokens until every Done.
  int64_t round(const std::vector<std::vector<int32_t>>& ps, int tokens) {
    caf::scoped_actor sink{*sys};
    for (const auto& p : ps) {
      actors::Job j;
      j.id = next++;
      j.prompt = p;
      j.prompt_tokens = static_cast<int64_t>(p.size());
      j.sampling = greedy(tokens);
      j.reply_to = caf::actor_cast<caf::actor>(sink);
      sink->send(router, std::move(j));
    }
    int64_t n = 0;
    size_t done = 0;
    bool failed = false;
    sink->receive_while([&] { return done < ps.size() && !failed; })(
        [&](const actors::TokenBatch& b) { n += static_cast<int64_t>(b.tokens.size()); },
        [&](const actors::Done&) { ++done; }, [&](const actors::Assigned&) {},
        [&](const actors::Failed& f) {
          spdlog::error("request {} failed: {}", f.id, f.message);
          failed = true;
        });
    return failed ? -1 : n;
  }
};

std::vector<int> parse_list(const std::string& s) {
  std::vector<int> out;
  std::stringstream ss(s);
  std::string x;
  while (std::getline(ss, x, ',')) out.push_back(std::stoi(x));
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  std::string dir, batches = "1,8,64";
  int tokens = 32, rounds = 3;
  int64_t prompt = 64;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string k = argv[i];
    if (k == "--model") dir = argv[i + 1];
    else if (k == "--batch") batches = argv[i + 1];
    else if (k == "--tokens") tokens = std::stoi(argv[i + 1]);
    else if (k == "--prompt") prompt = std::stoll(argv[i + 1]);
    else if (k == "--rounds") rounds = std::stoi(argv[i + 1]);
  }
  spdlog::set_level(spdlog::level::warn);
  if (dir.empty()) dir = actors::ensure_default_model();
  auto backend = kernels::make_cpu_backend();
  auto m = std::shared_ptr<model::Model>(model::Model::load(dir, *backend));
  std::mt19937_64 rng(7);
  for (int batch : parse_list(batches)) {
    engine::EngineOptions o;
    o.step_tokens = std::max<int64_t>(512, prompt * batch);
    ActorPath actors_path(m, o);
    double t_engine = 0, t_actors = 0;
    int64_t n_engine = 0, n_actors = 0;
    engine_round(*m, o, prompts(rng, batch, prompt), 2);  // warm-up
    actors_path.round(prompts(rng, batch, prompt), 2);
    for (int r = 0; r < rounds; ++r) {
      auto t = Clock::now();
      n_engine += engine_round(*m, o, prompts(rng, batch, prompt), tokens);
      t_engine += since(t);
      t = Clock::now();
      const int64_t n = actors_path.round(prompts(rng, batch, prompt), tokens);
      t_actors += since(t);
      if (n < 0) return 1;
      n_actors += n;
    }
    if (n_engine != n_actors || n_engine != int64_t{batch} * tokens * rounds) {
      std::cerr << fmt::format("token counts differ: engine {} actors {}\n", n_engine, n_actors);
      return 1;
    }
    std::cout << fmt::format(R"({{"bench":"actors","batch":{},"prompt":{},"tokens":{},"rounds":{},)"
                             R"("engine_s":{:.3f},"engine_tokens_per_s":{:.1f},"actors_s":{:.3f},)"
                             R"("actors_tokens_per_s":{:.1f},"ratio":{:.4f}}})",
                             batch, prompt, tokens, rounds, t_engine, n_engine / t_engine, t_actors,
                             n_actors / t_actors, t_engine / t_actors)
              << std::endl;
  }
  return 0;
}
