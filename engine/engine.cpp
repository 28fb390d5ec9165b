// Engine: construction, the thread-safe API, commands, events, finishing requests.
#include "engine/engine.hpp"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <random>
#include <set>

#include "engine/sampler.hpp"
#include "engine/sequence.hpp"

namespace troupe::engine {

using cache::PoolKind;
using cache::Tier;

const char* to_string(FinishReason r) {
  switch (r) {
    case FinishReason::stop: return "stop";
    case FinishReason::length: return "length";
    case FinishReason::abort: return "abort";
    case FinishReason::error: return "error";
  }
  return "?";
}

const char* to_string(EventKind k) {
  switch (k) {
    case EventKind::token: return "token";
    case EventKind::logits: return "logits";
    case EventKind::finished: return "finished";
    case EventKind::parked: return "parked";
    case EventKind::resumed: return "resumed";
  }
  return "?";
}

uint64_t pool_budget(const kernels::Backend& backend, double fraction, int sharers) {
  if (!(fraction > 0 && fraction <= 1)) raise(ErrorCode::invalid_argument, "a memory fraction must be in (0, 1], got {}", fraction);
  if (sharers < 1) raise(ErrorCode::invalid_argument, "a memory budget needs at least one worker to share it");
  const auto info = backend.memory_info();
  if (!info) {
    raise(ErrorCode::invalid_argument, "the {} backend cannot tell its free memory: give the pool budget as a size",
          backend.name());
  }
  return static_cast<uint64_t>(fraction * static_cast<double>(info->free) / sharers);
}

Engine::Engine(model::Model& model, EngineOptions options, std::function<void(const Event&)> on_event)
    : model_(model), options_(std::move(options)), on_event_(std::move(on_event)),
      geometry_(cache::CacheGeometry::of(model.config(), options_.page_tokens)) {
  if (options_.step_tokens < 1) raise(ErrorCode::invalid_argument, "step_tokens must be at least 1");
  cache::PoolCounts initial = options_.initial_pages;
  if (!options_.pool_mix.empty() || options_.pool_ratios) {
    cache::PlanInput in;
    in.bytes = options_.device_bytes;
    in.mix = options_.pool_mix;
    in.ratios = options_.pool_ratios;
    in.cache_share = options_.cache_share;
    in.slab_bytes = options_.slab_bytes;
    const auto plan = cache::plan_pools(geometry_, in);
    std::string pools;
    for (cache::PoolKind k : cache::kAllPools) {
      auto& n = initial[static_cast<size_t>(cache::index(k))];
      n = std::max(n, plan.pools[static_cast<size_t>(cache::index(k))].pages);
      if (geometry_.has(k)) pools += fmt::format(" {} {}", cache::to_string(k), n);
    }
    spdlog::info("engine: pools of {} start from {} (pages:{})", cache::format_bytes(static_cast<double>(in.bytes)),
                 options_.pool_ratios ? "fixed ratios" : "a context mix", pools);
  }
  device_ = std::make_unique<cache::PoolSet>(geometry_, cache::backend_memory(model.backend()), options_.device_bytes,
                                             options_.slab_bytes, initial);
  if (options_.host_bytes > 0) {
    host_ = std::make_unique<cache::PoolSet>(geometry_, cache::host_tier_memory(model.backend()), options_.host_bytes,
                                             options_.slab_bytes);
  }
  tiers_ = std::make_unique<cache::Tiers>(*device_, host_.get());
  copies_ = std::make_unique<cache::CopyEngine>(model.backend());
  copies_->set_wake([this] {
    std::lock_guard lock(mu_);
    wake_.notify_all();
  });
  mover_ = std::make_unique<cache::PageMover>(*tiers_, *copies_);
  tree_ = std::make_unique<cache::ShadowRadix>(*tiers_);
  int batch = options_.decode_batch;
  if (batch < 0) batch = model.backend().graphs_supported() ? 64 : 0;  // graphs are what make the decoder pay
  if (batch > 0) {
    const auto& c = model.config();
    model::Decoder::Options o;
    o.max_batch = std::min(batch, 64);
    o.max_context = options_.decode_context > 0 ? options_.decode_context
                                                : std::min<int64_t>(c.max_position_embeddings, int64_t{1} << 17);
    decoder_ = std::make_unique<model::Decoder>(model, o);
  }
  publish_stats();
}

Engine::~Engine() {
  stop();
  mover_->wait_all();
  seqs_.clear();
  decoder_.reset();
}

// ---- any thread ---------------------------------------------------------------------

void Engine::send(Command c) {
  {
    std::lock_guard lock(mu_);
    inbox_.push_back(std::move(c));
  }
  wake_.notify_all();
}

RequestId Engine::submit(Request request) {
  Command c;
  c.kind = Command::submit;
  c.id = next_id_++;
  c.request = std::move(request);
  const RequestId id = c.id;
  send(std::move(c));
  return id;
}

void Engine::abort(RequestId id) {
  Command c;
  c.kind = Command::abort;
  c.id = id;
  send(std::move(c));
}

void Engine::park(RequestId id) {
  Command c;
  c.kind = Command::park;
  c.id = id;
  send(std::move(c));
}

void Engine::resume(RequestId id) {
  Command c;
  c.kind = Command::resume;
  c.id = id;
  send(std::move(c));
}

EngineStats Engine::stats() const {
  std::lock_guard lock(mu_);
  return published_;
}

std::vector<Event> Engine::take_events() {
  std::lock_guard lock(mu_);
  return std::exchange(outbox_, {});
}

void Engine::start() {
  if (thread_.joinable()) return;
  stop_ = false;
  thread_ = std::thread([this] {
    while (!stop_) {
      bool worked = false;
      try {
        worked = step();
      } catch (const std::exception& e) {
        // A failed step ends the requests it touched, not the engine.
        spdlog::error("engine step failed: {}", e.what());
        std::vector<RequestId> ids;
        for (auto& [id, s] : seqs_) {
          if (s->phase == Phase::running) ids.push_back(id);
        }
        for (RequestId id : ids) finish(*find(id), FinishReason::error, ErrorCode::internal, e.what());
        publish_stats();
      }
      if (!worked) {
        std::unique_lock lock(mu_);
        wake_.wait_for(lock, std::chrono::milliseconds(20), [&] { return stop_ || !inbox_.empty(); });
      }
    }
  });
}

void Engine::stop() {
  if (!thread_.joinable()) return;
  {
    std::lock_guard lock(mu_);
    stop_ = true;
  }
  wake_.notify_all();
  thread_.join();
}

// ---- engine thread --------------------------------------------------------------------

Engine::Seq* Engine::find(RequestId id) {
  auto it = seqs_.find(id);
  return it == seqs_.end() ? nullptr : it->second.get();
}

void Engine::emit(Event e) {
  if (on_event_) {
    on_event_(e);
    return;
  }
  std::lock_guard lock(mu_);
  outbox_.push_back(std::move(e));
}

void Engine::admit_request(RequestId id, Request r) {
  const auto& c = model_.config();
  std::string why;
  if (r.prompt.empty()) why = "the prompt is empty";
  for (int32_t t : r.prompt) {
    if (why.empty() && (t < 0 || t >= c.vocab_size)) {
      why = fmt::format("token id {} is out of range for a vocabulary of {}", t, c.vocab_size);
    }
  }
  if (why.empty() && static_cast<int64_t>(r.prompt.size()) >= c.max_position_embeddings) {
    why = fmt::format("a prompt of {} tokens leaves no room under max_position_embeddings {}", r.prompt.size(),
                      c.max_position_embeddings);
  }
  if (why.empty()) why = check(r.sampling);
  if (why.empty() && r.sampling.holds_json()) {
    if (!options_.vocabulary) {
      why = "structured output (a json schema) needs the tokenizer's vocabulary, which this engine was not given";
    } else {
      try {
        if (!r.sampling.json_schema.empty()) grammars_.get(r.sampling.json_schema);
        for (const auto& x : r.sampling.answer_schemas) {
          if (!x.empty()) grammars_.get(x);
        }
      } catch (const Error& e) {
        why = e.what();
      }
    }
  }
  if (why.empty() && r.max_chunk_tokens < 0) why = "max_chunk_tokens must be >= 0";
  ++counters_.submitted;
  if (!why.empty()) {
    ++counters_.errors;
    ++counters_.finished;
    Event e;
    e.id = id;
    e.kind = EventKind::finished;
    e.reason = FinishReason::error;
    e.ok = false;
    e.code = ErrorCode::invalid_argument;
    e.message = why;
    e.usage.prompt_tokens = static_cast<int64_t>(r.prompt.size());
    emit(std::move(e));
    return;
  }
  auto s = std::make_unique<Seq>();
  s->id = id;
  s->tokens = r.prompt;
  s->prompt_len = static_cast<int64_t>(r.prompt.size());
  s->usage.prompt_tokens = s->prompt_len;
  s->seed = r.sampling.seed ? *r.sampling.seed : std::random_device{}() ^ (uint64_t{std::random_device{}()} << 32);
  if (!options_.prefix_cache) r.prefix_cache = false;
  s->req = std::move(r);
  Seq& queued = *s;
  seqs_.emplace(id, std::move(s));
  enqueue(queued, false);
}

void Engine::drain_inbox() {
  std::vector<Command> commands;
  {
    std::lock_guard lock(mu_);
    commands.swap(inbox_);
  }
  for (auto& c : commands) {
    if (c.kind == Command::submit) {
      admit_request(c.id, std::move(c.request));
      continue;
    }
    if (c.kind == Command::export_state) {
      c.exported->set_value(export_image(c.id));
      continue;
    }
    if (c.kind == Command::import_state) {
      import_image(c.id, std::move(*c.image));
      continue;
    }
    Seq* s = find(c.id);
    if (s == nullptr) continue;
    if (c.kind == Command::abort) {
      finish(*s, FinishReason::abort);
    } else if (c.kind == Command::park) {
      if (s->phase == Phase::waiting) {  // nothing to move: just keep it out of the queue
        std::erase(waiting_, s->id);
        s->phase = Phase::parked;
        ++counters_.parks;
        ++s->usage.parks;
        emit(make_event(s->id, EventKind::parked));
      } else if (s->phase == Phase::running) {
        s->resume_wanted = false;
        start_park(*s);
      } else {
        emit(make_event(s->id, EventKind::parked, false, "the request is moving between tiers; park it again later"));
      }
    } else if (c.kind == Command::resume) {
      if (s->phase == Phase::parked || s->phase == Phase::parking) s->resume_wanted = true;
    }
  }
}

void Engine::unlock(Seq& s) {
  if (s.lock != nullptr) tree_->unlock(s.lock);
  s.lock = nullptr;
}

void Engine::finish(Seq& s, FinishReason reason, ErrorCode code, std::string message) {
  if (s.state && s.phase == Phase::running && reason != FinishReason::error) insert_prefix(s);
  unlock(s);
  Event e;
  e.id = s.id;
  e.kind = EventKind::finished;
  e.reason = reason;
  e.ok = reason != FinishReason::error;
  e.code = code;
  e.message = std::move(message);
  s.usage.generated_tokens = s.generated;
  e.usage = s.usage;
  ++counters_.finished;
  if (reason == FinishReason::abort) ++counters_.aborted;
  if (reason == FinishReason::error) ++counters_.errors;
  std::erase(waiting_, s.id);
  const RequestId id = s.id;
  seqs_.erase(id);  // releases every page the sequence holds
  emit(std::move(e));
}

bool Engine::idle() const {
  if (mover_->in_flight() > 0 || !waiting_.empty()) return false;
  for (const auto& [id, s] : seqs_) {
    if (s->phase != Phase::parked || s->resume_wanted) return false;
  }
  std::lock_guard lock(mu_);
  return inbox_.empty();
}

void Engine::run_until_idle() {
  while (!idle()) {
    if (!step() && !idle()) {
      // Nothing can move (e.g. a resume that never fits): report, do not spin.
      publish_stats();
      return;
    }
  }
  publish_stats();
}

int64_t Engine::tombstone_windows(int64_t max_pages) {
  const int64_t n = tree_->tombstone(max_pages, false);
  counters_.tombstoned_pages += n;
  publish_stats();
  return n;
}

void Engine::clear_cache() {
  tree_->clear();
  publish_stats();
}

}  // namespace troupe::engine
