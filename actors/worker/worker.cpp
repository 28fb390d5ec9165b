#include "actors/worker/worker.hpp"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <map>
#include <span>
#include <thread>

namespace troupe::actors {
namespace {

struct Running {
  Job job;
  int64_t next_index = 0;         // output index of the next token
  std::vector<int32_t> sampled;   // tokens this worker sampled for the job
  bool handing_off = false;       // parked for a handoff (PD or migration), exporting
  bool migrating = false;         // a drain moves it to handoff_to (its next park is the handoff's)
  caf::actor handoff_to;          // the worker that continues it
  bool long_tail_parked = false;  // parked by the supervisor's long-tail policy
  bool client_parked = false;     // parked by its client (frame Park): only the client's Resume continues it
  bool park_retry = false;        // the client's Park is retried shortly (it met the request between tiers)
  bool superseded = false;        // a later attempt of the request runs here instead: silent until it ends
  int64_t prompt_next = 1;        // Job::prompt_logprobs: the next prompt token whose logprob to report
};

// Prompt rows per forward chunk of a request whose prompt logprobs are wanted:
// each row is a vocabulary of floats in the engine's event.
constexpr int64_t kPromptRowsChunk = 128;

// Four floats at once (GCC / Clang vector extensions: SSE without -march flags).
using Float4 = float __attribute__((vector_size(16)));
using Int4 = int32_t __attribute__((vector_size(16)));

// exp(x) for x <= 0 (e^-87 below -87), within ~2e-7 relative where it matters: 2^i
// times a polynomial of the remainder in [-1/2, 1/2] (Taylor to degree 6), four at a
// time. libm's exp, one at a time, was a quarter of a prompt-logprob request's time
// (the reduction runs on the worker's actor thread).
inline Float4 exp_nonpositive(Float4 x) {
  const Float4 t = (x < -87.0f ? Float4{} - 87.0f : x) * 1.44269504f;  // x / ln 2
  const Int4 i = __builtin_convertvector(t - 0.5f, Int4);                // t rounded (t <= 0: toward zero from t - 1/2)
  const Float4 f = (t - __builtin_convertvector(i, Float4)) * 0.693147181f;
  const Float4 p = 1.0f + f * (1.0f + f * (0.5f + f * (1.0f / 6 + f * (1.0f / 24 + f * (1.0f / 120 + f * (1.0f / 720))))));
  return p * reinterpret_cast<Float4>((i + 127) << 23);
}

// The log-probability of `token` under `logits` (log-softmax, the raw
// logits as the model gave them) and the `top` most likely ids, best first
// (lowest id on ties).
TokenLogprob logprob_of(std::span<const float> logits, int32_t token, int32_t top) {
  TokenLogprob out;
  if (logits.empty()) return out;
  const size_t n = logits.size(), whole = n / 4 * 4;
  auto load = [&](size_t i) {
    Float4 v;
    std::memcpy(&v, logits.data() + i, sizeof v);
    return v;
  };
  constexpr float kLowest = -std::numeric_limits<float>::infinity();
  Float4 lane_max = Float4{} + kLowest;
  for (size_t i = 0; i < whole; i += 4) {
    const Float4 v = load(i);
    lane_max = v > lane_max ? v : lane_max;
  }
  float mx = std::max(std::max(lane_max[0], lane_max[1]), std::max(lane_max[2], lane_max[3]));
  for (size_t i = whole; i < n; ++i) mx = std::max(mx, logits[i]);
  // Sums of exp(x - max): four lanes a block of 64, each block's into double.
  double sum = 0;
  for (size_t b = 0; b < whole; b += 64) {
    Float4 acc{};
    for (size_t i = b; i < std::min(b + 64, whole); i += 4) acc += exp_nonpositive(load(i) - mx);
    sum += static_cast<double>(acc[0]) + acc[1] + acc[2] + acc[3];
  }
  for (size_t i = whole; i < n; ++i) sum += exp_nonpositive(Float4{} + (logits[i] - mx))[0];
  const double lse = mx + std::log(sum);
  auto lp = [&](int32_t id) { return static_cast<float>(logits[static_cast<size_t>(id)] - lse); };
  if (token >= 0 && static_cast<size_t>(token) < logits.size()) out.logprob = lp(token);
  const size_t k = std::min<size_t>(static_cast<size_t>(std::max(top, 0)), logits.size());
  // The k best so far, best first: a later id enters only above an equal logit's place.
  // `bar`: what an id must beat once k are held (blocks of four below it are skipped).
  std::vector<int32_t> best;
  best.reserve(k + 1);
  float bar = kLowest;
  auto offer = [&](size_t i) {
    const float x = logits[i];
    if (best.size() == k && !(x > bar)) return;
    size_t at = best.size();
    while (at > 0 && x > logits[static_cast<size_t>(best[at - 1])]) --at;
    best.insert(best.begin() + static_cast<std::ptrdiff_t>(at), static_cast<int32_t>(i));
    if (best.size() > k) best.pop_back();
    if (best.size() == k) bar = logits[static_cast<size_t>(best.back())];
  };
  for (size_t i = 0; i < whole && k > 0; i += 4) {
    const Int4 above = load(i) > bar;
    if (best.size() < k || (above[0] | above[1] | above[2] | above[3])) {
      for (size_t j = i; j < i + 4; ++j) offer(j);
    }
  }
  for (size_t i = whole; i < n && k > 0; ++i) offer(i);
  for (int32_t id : best) {
    out.top_ids.push_back(id);
    out.top_logprobs.push_back(lp(id));
  }
  return out;
}

// The job that continues `run` from scratch elsewhere: prompt plus what was sampled.
Job continuation(const Running& run) {
  Job j = run.job;
  j.image = nullptr;
  j.decode_to = nullptr;
  j.prompt.insert(j.prompt.end(), run.sampled.begin(), run.sampled.end());
  const auto n = static_cast<int32_t>(run.sampled.size());
  j.generated_before = run.next_index;
  j.sampling.max_tokens = std::max(0, j.sampling.max_tokens - n);
  j.sampling.min_tokens = std::max(0, j.sampling.min_tokens - n);
  if (run.prompt_next >= j.prompt_tokens) j.prompt_logprobs = -1;  // all reported
  return j;
}

struct WorkerState {
  static inline const char* name = "worker";
  WorkerConfig config;
  std::shared_ptr<model::Model> model;
  std::unique_ptr<engine::Engine> engine;
  caf::actor router;
  caf::actor supervisor;
  std::shared_ptr<MetricsRegistry> metrics;
  std::map<engine::RequestId, Running> by_engine;
  std::map<RequestId, engine::RequestId> by_request;
  struct Pending {  // prefill side: a handoff waiting for the decode worker's confirm
    engine::RequestId engine_id;
    RequestId request;
  };
  std::map<uint64_t, Pending> handoffs;
  uint64_t next_handoff = 1;
  bool draining = false;
};

using Self = caf::stateful_actor<WorkerState>*;

void fail_job(Self self, const Job& job, ErrorCode code, const std::string& message) {
  self->send(job.reply_to, Failed{job.id, code, message, caf::actor_cast<caf::actor>(self)});
}

void start_job(Self self, Job job) {
  auto& st = self->state;
  if (auto it = st.by_request.find(job.id); it != st.by_request.end()) {
    // A duplicate (the router retried): the first one runs. A later attempt
    // (the gateway resubmitted after a release or a lost worker) replaces a
    // run that is still being torn down here.
    auto run = st.by_engine.find(it->second);
    // (One dropped here on its client's park is replaced by the same attempt on Resume.)
    if (run == st.by_engine.end() || (run->second.job.attempt >= job.attempt && !run->second.superseded)) return;
    // The gateway gave up on the earlier attempt (it lost sight of this
    // worker for a while): that run ends without a word, this one streams.
    // One that is handing its state over ends when the handoff does.
    if (!run->second.handing_off) {
      run->second.superseded = true;
      st.engine->abort(run->first);
    }
  }
  engine::RequestId eid;
  if (job.image) {
    eid = st.engine->import(*job.image);
  } else {
    engine::Request r;
    r.prompt = job.prompt;
    r.sampling = job.sampling;
    r.park_after_prefill = static_cast<bool>(job.decode_to);
    r.priority = job.priority;
    if (job.logprobs >= 0) r.logits = engine::LogitsMode::sampled;  // each token comes with its logits row
    if (job.prompt_logprobs >= 0) {
      // Every prompt row, so none from the prefix cache, in chunks whose rows stay small.
      r.logits = engine::LogitsMode::prompt;
      r.prefix_cache = false;
      r.max_chunk_tokens = kPromptRowsChunk;
    }
    eid = st.engine->submit(std::move(r));
  }
  Running run;
  run.next_index = job.generated_before;
  run.handoff_to = job.decode_to;
  // The gateway watches the worker that runs a request. The router says so for
  // the jobs it places; a request that moved here (handoff, migration,
  // recompute fallback) is announced by its new worker.
  if (job.image || job.generated_before > 0 || job.attempt > 0) {
    self->send(job.reply_to, Assigned{job.id, caf::actor_cast<caf::actor>(self), st.config.name, job.generated_before});
  }
  run.job = std::move(job);
  st.by_request[run.job.id] = eid;
  st.by_engine.emplace(eid, std::move(run));
}

void report_load(Self self) {
  auto& st = self->state;
  const auto s = st.engine->stats();
  WorkerLoad load;
  load.name = st.config.name;
  load.role = st.config.role;
  // Requests this worker still answers for (a handoff not yet confirmed
  // counts): a draining worker stops only when this reaches zero.
  load.running = std::max<int64_t>(s.running, static_cast<int64_t>(st.by_engine.size()) - s.waiting - s.parked);
  load.waiting = s.waiting;
  load.parked = s.parked;
  load.device_free_bytes = s.device_free_bytes;
  load.device_budget_bytes = s.device_budget_bytes;
  for (const auto& a : s.device) load.leaked_pages += a.leaked;
  for (const auto& a : s.host) load.leaked_pages += a.leaked;
  load.draining = st.draining;
  load.actor = caf::actor_cast<caf::actor>(self);
  for (const auto& [eid, run] : st.by_engine) {
    if (run.handoff_to) load.handoff_targets.push_back(run.handoff_to);
  }
  // Pressure is what requests hold: pages only the prefix cache keeps are
  // given back on demand, so counting them would park requests (and keep them
  // parked) while the pool could still serve everyone. From the audit (every
  // 32 steps and when idle); shared pages count for each request.
  const double budget = static_cast<double>(std::max<uint64_t>(1, s.device_budget_bytes));
  int64_t held = 0;
  for (const auto& r : s.requests) {
    held += r.device_bytes;
    auto it = st.by_engine.find(r.id);
    if (it == st.by_engine.end()) continue;
    if (it->second.long_tail_parked) {
      load.parked_ids.push_back(it->second.job.id);
    } else if (r.phase == "running" && !it->second.handing_off && r.max_tokens > load.largest_tokens) {
      load.largest = it->second.job.id;
      load.largest_tokens = r.max_tokens;
      load.largest_share = static_cast<double>(r.device_bytes) / budget;
    }
  }
  load.kv_use = std::min(1.0, static_cast<double>(held) / budget);
  if (st.router) self->send(st.router, load);
  if (st.supervisor) self->send(st.supervisor, load);
  if (st.metrics) {
    const Labels labels{{"worker", st.config.name}};
    auto& m = *st.metrics;
    m.gauge("troupe_running", "Requests running in the engine", labels).set(static_cast<double>(s.running));
    m.gauge("troupe_queue_depth", "Requests waiting for admission", labels).set(static_cast<double>(s.waiting));
    m.gauge("troupe_kv_budget_bytes", "KV pool budget per tier (whole slabs)", {{"worker", st.config.name}, {"tier", "device"}})
        .set(static_cast<double>(s.device_budget_bytes));
    m.gauge("troupe_kv_budget_bytes", "KV pool budget per tier (whole slabs)", {{"worker", st.config.name}, {"tier", "host"}})
        .set(static_cast<double>(s.host_budget_bytes));
    m.gauge("troupe_parked", "Requests parked in the host tier", labels).set(static_cast<double>(s.parked));
    m.gauge("troupe_leaked_pages", "Pages in use that no holder references", labels)
        .set(static_cast<double>(load.leaked_pages));
    m.gauge("troupe_parks", "Parks so far (engine)", labels).set(static_cast<double>(s.parks));
    m.gauge("troupe_resumes", "Resumes so far (engine)", labels).set(static_cast<double>(s.resumes));
    m.gauge("troupe_preemptions", "Preemptions so far (engine)", labels).set(static_cast<double>(s.preemptions));
    m.gauge("troupe_aborted", "Requests aborted so far (engine)", labels).set(static_cast<double>(s.aborted));
    m.gauge("troupe_cached_tokens", "Prompt tokens served by the prefix cache", labels)
        .set(static_cast<double>(s.cached_tokens));
    for (size_t k = 0; k < s.device.size(); ++k) {
      const std::string pool = cache::to_string(static_cast<cache::PoolKind>(k));
      const auto& a = s.device[k];
      for (auto [state, v] : {std::pair{"in_use", a.in_use}, {"free", a.free}, {"leased", a.leased},
                              {"parked", a.parked}, {"cached", a.cached}}) {
        m.gauge("troupe_pool_pages", "Device pages per pool and state", {{"worker", st.config.name}, {"pool", pool},
                                                                         {"state", state}})
            .set(static_cast<double>(v));
      }
    }
  }
}

void on_event(Self self, const engine::Event& e) {
  auto& st = self->state;
  auto it = st.by_engine.find(e.id);
  if (it == st.by_engine.end()) return;  // a released handoff finishing, or a request already forgotten
  Running& run = it->second;
  const auto me = caf::actor_cast<caf::actor>(self);
  switch (e.kind) {
    case engine::EventKind::token: {
      // Handing off: the target owns the stream from the continuation's generated_before on; a token the
      // engine sampled in the step that failed to park (and is aborted now) is not the one it continues from.
      if (run.superseded || run.handing_off) break;
      run.sampled.push_back(e.token);
      TokenBatch b = token_batch(run.job.id, run.next_index++, {e.token}, me);
      if (run.job.logprobs >= 0) b.logprobs.push_back(logprob_of(e.logits, e.token, run.job.logprobs));
      self->send(run.job.reply_to, std::move(b));
      break;
    }
    case engine::EventKind::logits: {  // prompt rows (Job::prompt_logprobs)
      if (run.superseded || run.handing_off || run.job.prompt_logprobs < 0) break;
      const auto V = static_cast<size_t>(st.model->config().vocab_size);
      TokenBatch b = token_batch(run.job.id, run.next_index, {}, me);
      b.prompt_index = run.prompt_next;
      // Row r is position e.position + r's: it predicts prompt token e.position + r + 1.
      // (A preempted request computes its rows again: the ones reported are skipped.)
      for (size_t r = 0; (r + 1) * V <= e.logits.size(); ++r) {
        const int64_t target = e.position + static_cast<int64_t>(r) + 1;
        if (target != run.prompt_next || target >= run.job.prompt_tokens) continue;
        b.prompt_logprobs.push_back(logprob_of(std::span(e.logits).subspan(r * V, V),
                                               run.job.prompt[static_cast<size_t>(target)], run.job.prompt_logprobs));
        ++run.prompt_next;
      }
      if (!b.prompt_logprobs.empty()) self->send(run.job.reply_to, std::move(b));
      break;
    }
    case engine::EventKind::parked: {
      if (!e.ok && run.client_parked && !run.handoff_to) {
        if (st.config.engine.host_bytes > 0 && e.message.find("no room") == std::string::npos) {
          // It was between tiers (loading, resuming): the client's park is tried again shortly.
          run.client_parked = false;
          run.park_retry = true;  // a client Resume before the retry cancels it
          self->delayed_send(self, std::chrono::milliseconds(20), client_park_atom::value, run.job.id);
          break;
        }
        // No host tier, or no room in it: the state cannot be kept. It is
        // dropped here (its device pages free) and the gateway, which holds
        // the stream, recomputes it from its tokens on Resume.
        spdlog::info("worker {}: request {} parked by its client cannot keep its state ({}); it is recomputed on "
                     "resume", st.config.name, run.job.id, e.message);
        run.superseded = true;
        st.engine->abort(e.id);
        self->send(run.job.reply_to, Failed{run.job.id, ErrorCode::unavailable,
                                            "parked without room in a host tier: " + e.message, me});
        break;
      }
      if (!run.handoff_to || run.handing_off) break;  // a long-tail or client park: the stream just pauses
      // A PD prefill's own park comes once its first token is sampled (park_after_prefill); before that a
      // park is the engine's preemption into the host tier, which it resumes itself: not the handoff.
      if (!run.migrating && run.sampled.empty()) break;
      run.handing_off = true;
      if (!e.ok) {
        // No state to hand over (no host tier, no room there, or the request was
        // between tiers): the target recomputes it from its tokens instead.
        spdlog::warn("worker {}: request {} cannot be handed over with its state ({}); the target recomputes it",
                     st.config.name, run.job.id, e.message);
        self->send(run.handoff_to, continuation(run));
        if (st.metrics) {
          st.metrics->counter("troupe_handoff_fallbacks_total", "Handoffs that fell back to recomputation",
                              {{"worker", st.config.name}}).inc();
        }
        st.engine->abort(e.id);
        break;
      }
      // Export on a helper thread: the future completes on the engine thread's next step.
      auto fut = std::make_shared<std::future<std::optional<engine::SequenceImage>>>(st.engine->export_parked(e.id));
      const engine::RequestId eid = e.id;
      std::thread([fut, me, eid] {
        std::shared_ptr<const engine::SequenceImage> shared;
        try {
          // Throws (std::future_error) when the engine stops before its next step fulfils the export;
          // uncaught on this thread it would end the process.
          auto image = fut->get();
          if (image) shared = std::make_shared<const engine::SequenceImage>(std::move(*image));
        } catch (const std::exception& ex) {
          spdlog::warn("worker: export of request {} did not complete: {}", eid, ex.what());
        }
        caf::anon_send(me, exported_atom::value, eid, shared);
      }).detach();
      break;
    }
    case engine::EventKind::finished: {
      const Job job = run.job;
      const int64_t end_index = run.next_index;
      const bool handed_off = run.handing_off || run.superseded;
      if (auto br = st.by_request.find(job.id); br != st.by_request.end() && br->second == e.id) st.by_request.erase(br);
      st.by_engine.erase(it);
      if (handed_off) break;  // the decode worker owns the stream now
      if (e.reason == engine::FinishReason::error) {
        // A state that could not be imported is recomputed elsewhere.
        self->send(job.reply_to, Failed{job.id, job.image ? ErrorCode::unavailable : e.code, e.message, me});
      } else {
        engine::Usage u = e.usage;
        u.prompt_tokens = job.prompt_tokens;
        self->send(job.reply_to, Done{job.id, e.reason, u, me, end_index});
      }
      break;
    }
    default:
      break;
  }
}

// Resumes a request parked by `who` (the client or the long-tail policy), if it still is.
void resume_parked(Self self, RequestId id, bool Running::*who, const char* counter, const char* help) {
  auto& s = self->state;
  auto it = s.by_request.find(id);
  if (it == s.by_request.end()) return;
  auto& run = s.by_engine.at(it->second);
  if (!(run.*who)) return;
  run.*who = false;
  s.engine->resume(it->second);
  if (s.metrics) s.metrics->counter(counter, help, {{"worker", s.config.name}}).inc();
}

caf::behavior worker_actor(Self self, std::shared_ptr<model::Model> model, WorkerConfig config, caf::actor router,
                           std::shared_ptr<MetricsRegistry> metrics, caf::actor supervisor) {
  auto& st = self->state;
  st.supervisor = supervisor;
  st.config = std::move(config);
  st.model = std::move(model);
  st.router = router;
  st.metrics = std::move(metrics);
  const auto me = caf::actor_cast<caf::actor>(self);
  st.engine = std::make_unique<engine::Engine>(*st.model, st.config.engine, [me](const engine::Event& e) {
    caf::anon_send(me, event_atom::value, e);
  });
  st.engine->start();
  // No attach_functor here: CAF 0.17 destroys the state (on_exit) before it
  // runs attached functors, and the state's destructor already stops the
  // engine thread and releases every page (the engine is declared after the
  // model it uses, so it goes first).
  if (router) self->send(router, register_atom::value, me, st.config.name, static_cast<uint8_t>(st.config.role));
  self->delayed_send(self, st.config.load_every, tick_atom::value);
  spdlog::info("worker {} ({}) up", st.config.name, to_string(st.config.role));

  return {
      [=](const Job& job) {
        if (self->state.draining) {
          fail_job(self, job, ErrorCode::unavailable, "worker " + self->state.config.name + " is draining");
          return;
        }
        start_job(self, job);
      },
      [=](const Handoff& h) {  // decode side of PD
        Job job = h.job;
        job.image = h.image;
        start_job(self, std::move(job));
        self->send(h.from, confirm_atom::value, h.handoff_id);
      },
      [=](abort_atom, RequestId id) {
        auto& s = self->state;
        if (auto it = s.by_request.find(id); it != s.by_request.end()) s.engine->abort(it->second);
      },
      [=](event_atom, const engine::Event& e) { on_event(self, e); },
      [=](exported_atom, engine::RequestId eid, std::shared_ptr<const engine::SequenceImage> image) {
        auto& s = self->state;
        auto it = s.by_engine.find(eid);
        if (it == s.by_engine.end()) return;
        Job job = it->second.job;
        it->second.handing_off = true;
        const caf::actor target = it->second.handoff_to;
        if (!image) {  // could not export: the target recomputes the prompt
          spdlog::warn("worker {}: export of request {} failed; the target recomputes it", s.config.name, job.id);
          self->send(target, continuation(it->second));
          s.engine->abort(eid);
          return;
        }
        const uint64_t hid = s.next_handoff++;
        s.handoffs[hid] = {eid, job.id};
        Handoff h;
        h.job = continuation(it->second);
        h.image = std::move(image);
        h.from = caf::actor_cast<caf::actor>(self);
        h.handoff_id = hid;
        self->send(target, std::move(h));
        if (s.metrics) s.metrics->counter("troupe_handoffs_total", "PD handoffs offered", {{"worker", s.config.name}}).inc();
        self->delayed_send(self, s.config.handoff_timeout, release_atom::value, hid);
      },
      [=](confirm_atom, uint64_t hid) {  // the decode worker has the state: free ours
        auto& s = self->state;
        auto it = s.handoffs.find(hid);
        if (it == s.handoffs.end()) return;
        s.engine->abort(it->second.engine_id);
        s.handoffs.erase(it);
      },
      [=](release_atom, uint64_t hid) {  // no confirm in time: free ours; the gateway resubmits
        auto& s = self->state;
        auto it = s.handoffs.find(hid);
        if (it == s.handoffs.end()) return;
        spdlog::warn("worker {}: handoff {} of request {} timed out; releasing it", s.config.name, hid,
                     it->second.request);
        if (auto r = s.by_engine.find(it->second.engine_id); r != s.by_engine.end()) {
          self->send(r->second.job.reply_to, Failed{it->second.request, ErrorCode::unavailable,
                                                    "KV handoff to the decode worker timed out",
                                                    caf::actor_cast<caf::actor>(self)});
        }
        s.engine->abort(it->second.engine_id);
        s.handoffs.erase(it);
      },
      [=](park_atom, RequestId id) {  // long-tail policy
        auto& s = self->state;
        auto it = s.by_request.find(id);
        if (it == s.by_request.end()) return;
        auto& run = s.by_engine.at(it->second);
        if (run.handing_off || run.long_tail_parked || run.client_parked) return;
        run.long_tail_parked = true;
        s.engine->park(it->second);
        if (s.metrics) {
          s.metrics->counter("troupe_long_tail_parked_total", "Requests parked by the long-tail policy",
                             {{"worker", s.config.name}}).inc();
        }
      },
      [=](client_park_atom, RequestId id) {  // frame Park: the gateway holds the stream
        auto& s = self->state;
        auto it = s.by_request.find(id);
        if (it == s.by_request.end()) return;
        auto& run = s.by_engine.at(it->second);
        // This worker's own retry of a Park that met the request between tiers: dropped if the client's
        // Resume came in the meantime (else that Resume would be lost and the request stay parked).
        const bool retry = caf::actor_cast<caf::actor_addr>(self->current_sender()) == self->address();
        if (retry && !run.park_retry) return;
        run.park_retry = false;
        if (run.handing_off || run.client_parked) return;
        const bool was_parked = run.long_tail_parked;
        run.client_parked = true;
        run.long_tail_parked = false;  // the client's Resume decides now, not the long-tail policy
        if (!was_parked) s.engine->park(it->second);
        if (s.metrics) {
          s.metrics->counter("troupe_client_parked_total", "Requests parked by their client (frame Park)",
                             {{"worker", s.config.name}}).inc();
        }
      },
      [=](client_resume_atom, RequestId id) {
        auto& s = self->state;
        if (auto it = s.by_request.find(id); it != s.by_request.end()) {
          auto& run = s.by_engine.at(it->second);
          if (run.park_retry) {  // its Park is still waiting for a retry: not parked, so cancel the retry
            run.park_retry = false;
            return;
          }
        }
        resume_parked(self, id, &Running::client_parked, "troupe_client_resumed_total",
                      "Requests resumed by their client (frame Resume)");
      },
      [=](resume_atom, RequestId id) {
        resume_parked(self, id, &Running::long_tail_parked, "troupe_long_tail_resumed_total",
                      "Requests resumed by the long-tail policy");
      },
      [=](migrate_atom, caf::actor target) {  // drain: every running request moves to `target`
        auto& s = self->state;
        s.draining = true;
        for (auto& [eid, run] : s.by_engine) {
          if (run.handing_off || run.handoff_to) continue;
          run.handoff_to = target;
          run.migrating = true;
          if (run.long_tail_parked || run.client_parked) {  // already parked: export right away
            // (a client-parked request is parked again on the target by its gateway)
            run.long_tail_parked = run.client_parked = false;
            on_event(self, engine::make_event(eid, engine::EventKind::parked));
          } else {
            s.engine->park(eid);
          }
        }
      },
      [=](drain_atom) {  // no worker to move to: finish here
        auto& s = self->state;
        s.draining = true;
        // The supervisor's long-tail policy stops for a draining worker: what it parked resumes now, or
        // it would wait forever (and the drain with it).
        std::vector<RequestId> parked;
        for (const auto& [eid, run] : s.by_engine) {
          if (run.long_tail_parked) parked.push_back(run.job.id);
        }
        for (const RequestId id : parked) {
          resume_parked(self, id, &Running::long_tail_parked, "troupe_long_tail_resumed_total",
                        "Requests resumed by the long-tail policy");
        }
      },
      [=](fence_atom, const std::string&, bool fenced) {  // back in service after a drain (the fleet's scale up)
        if (!fenced && self->state.draining) {
          spdlog::info("worker {}: back in service", self->state.config.name);
          self->state.draining = false;
        }
      },
      [=](tick_atom) {
        report_load(self);
        self->delayed_send(self, self->state.config.load_every, tick_atom::value);
      },
      [=](crash_atom) { self->quit(caf::sec::runtime_error); },
  };
}

}  // namespace

const char* to_string(WorkerRole r) {
  switch (r) {
    case WorkerRole::colocated: return "colocated";
    case WorkerRole::prefill: return "prefill";
    case WorkerRole::decode: return "decode";
  }
  return "?";
}

caf::actor spawn_worker(caf::actor_system& sys, std::shared_ptr<model::Model> model, WorkerConfig config,
                        caf::actor router, std::shared_ptr<MetricsRegistry> metrics, caf::actor supervisor) {
  return sys.spawn(worker_actor, std::move(model), std::move(config), std::move(router), std::move(metrics),
                   std::move(supervisor));
}

}  // namespace troupe::actors
