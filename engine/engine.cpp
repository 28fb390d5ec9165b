// Engine: construction, the thread-safe API, events and accounting.
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

Engine::Engine(model::Model& model, EngineOptions options, std::function<void(const Event&)> on_event)
    : model_(model), options_(std::move(options)), on_event_(std::move(on_event)),
      geometry_(cache::CacheGeometry::of(model.config(), options_.page_tokens)) {
  if (options_.step_tokens < 1) raise(ErrorCode::invalid_argument, "step_tokens must be at least 1");
  device_ = std::make_unique<cache::PoolSet>(geometry_, cache::backend_memory(model.backend()), options_.device_bytes,
                                             options_.slab_bytes, options_.initial_pages);
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
  publish_stats();
}

Engine::~Engine() {
  stop();
  mover_->wait_all();
  seqs_.clear();
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

std::future<std::optional<SequenceImage>> Engine::export_parked(RequestId id) {
  auto promise = std::make_shared<std::promise<std::optional<SequenceImage>>>();
  auto future = promise->get_future();
  Command c;
  c.kind = Command::export_state;
  c.id = id;
  c.exported = std::move(promise);
  send(std::move(c));
  return future;
}

RequestId Engine::import(SequenceImage image) {
  Command c;
  c.kind = Command::import_state;
  c.id = next_id_++;
  c.image = std::make_shared<SequenceImage>(std::move(image));
  const RequestId id = c.id;
  send(std::move(c));
  return id;
}

uint64_t SequenceImage::bytes() const {
  uint64_t n = 0;
  for (const auto& p : pages) n += p.bytes.size();
  return n;
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
  waiting_.push_back(id);
  seqs_.emplace(id, std::move(s));
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

std::optional<SequenceImage> Engine::export_image(RequestId id) {
  Seq* s = find(id);
  if (s == nullptr || s->phase != Phase::parked) return std::nullopt;
  SequenceImage im;
  im.request = s->req;
  im.tokens = s->tokens;
  im.length = s->length();
  im.generated = s->generated;
  im.seed = s->seed;
  im.usage = s->usage;
  im.page_tokens = geometry_.page_tokens;
  auto copy_out = [&](int64_t index, PoolKind kind, cache::PageRef r) {
    SequenceImage::Page p;
    p.index = index;
    p.kind = kind;
    p.bytes.resize(geometry_.pool(kind).page_bytes);
    model_.backend().to_host(p.bytes.data(), tiers_->page(kind, r), p.bytes.size());
    im.pages.push_back(std::move(p));
  };
  if (s->state) {
    const auto pages = s->state->pages();
    for (size_t k = 0; k < pages.size(); ++k) {
      for (PoolKind kind : cache::kAllPools) {
        if (pages[k].at(kind).valid()) copy_out(static_cast<int64_t>(k), kind, pages[k].at(kind));
      }
    }
    if (s->state->hca_ring().valid()) copy_out(-1, PoolKind::hca_ring, s->state->hca_ring());
  }
  return im;
}

void Engine::import_image(RequestId id, SequenceImage im) {
  ++counters_.submitted;
  auto fail = [&](ErrorCode code, std::string why) {
    ++counters_.errors;
    ++counters_.finished;
    Event e = make_event(id, EventKind::finished, false, std::move(why));
    e.reason = FinishReason::error;
    e.code = code;
    emit(std::move(e));
  };
  const int64_t P = geometry_.page_tokens;
  if (im.page_tokens != P) {
    return fail(ErrorCode::invalid_argument, fmt::format("the image has pages of {} tokens, this engine {}", im.page_tokens, P));
  }
  if (im.tokens.empty() || im.length < 0 || im.length >= static_cast<int64_t>(im.tokens.size()) ||
      static_cast<int64_t>(im.request.prompt.size()) > static_cast<int64_t>(im.tokens.size())) {
    return fail(ErrorCode::invalid_argument, "the image's tokens and length disagree");
  }
  for (int32_t t : im.tokens) {
    if (t < 0 || t >= model_.config().vocab_size) return fail(ErrorCode::invalid_argument, "the image has a token out of range");
  }
  // Pages go to the host tier and come back by resume(); without one, straight to the device.
  cache::PoolSet& target = host_ ? *host_ : *device_;
  cache::PoolCounts need{};
  for (const auto& p : im.pages) {
    if (p.index < -1 || p.index >= geometry_.pages_for(im.length) || p.bytes.size() != geometry_.pool(p.kind).page_bytes ||
        (p.index == -1) != (p.kind == PoolKind::hca_ring)) {
      return fail(ErrorCode::invalid_argument, "the image's pages do not fit this engine's page layout");
    }
    ++need[static_cast<size_t>(cache::index(p.kind))];
  }
  if (!target.can_lease(need)) {
    return fail(ErrorCode::resource_exhausted, fmt::format("the {} tier has no room for the image", cache::to_string(target.tier())));
  }
  std::vector<cache::TokenPage> pages(static_cast<size_t>(geometry_.pages_for(im.length)));
  cache::PageRef ring;
  std::vector<std::pair<int64_t, PoolKind>> where;
  for (const auto& p : im.pages) {
    const cache::PageRef r{target.lease(p.kind), target.tier()};
    model_.backend().to_device(tiers_->page(p.kind, r), p.bytes.data(), p.bytes.size());
    (p.index < 0 ? ring : pages[static_cast<size_t>(p.index)].at(p.kind)) = r;
    where.emplace_back(p.index, p.kind);
  }
  auto s = std::make_unique<Seq>();
  s->id = id;
  s->req = std::move(im.request);
  if (!options_.prefix_cache) s->req.prefix_cache = false;
  s->req.park_after_prefill = false;
  s->tokens = std::move(im.tokens);
  s->prompt_len = static_cast<int64_t>(s->req.prompt.size());
  s->generated = im.generated;
  s->seed = im.seed;
  s->usage = im.usage;
  s->admitted_once = true;
  s->state = std::make_unique<cache::PagedSequence>(*tiers_, s->req.prefix_cache, options_.checkpoint_every_pages);
  try {
    s->state->restore(std::move(pages), ring, im.length);
  } catch (const InvariantError& e) {
    s->state.reset();  // releases what was leased
    return fail(ErrorCode::invalid_argument, std::string("the image is not a resumable state: ") + e.what());
  }
  s->order = ++admit_counter_;
  if (host_) {
    s->phase = Phase::parked;
    s->parked_pages = std::move(where);
    s->resume_wanted = true;
  } else {
    s->phase = Phase::running;
  }
  seqs_.emplace(id, std::move(s));
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

std::array<PoolAudit, cache::kPoolKinds> Engine::audit(Tier tier) const {
  std::array<PoolAudit, cache::kPoolKinds> out{};
  const cache::PoolSet* set = tier == Tier::device ? device_.get() : host_.get();
  if (set == nullptr) return out;
  // References per page, and which holders reference it.
  std::array<std::map<cache::PageId, int64_t>, cache::kPoolKinds> refs;
  std::array<std::set<cache::PageId>, cache::kPoolKinds> leased, parked, cached, flight;
  auto note = [&](auto& who, PoolKind k, cache::PageRef r) {
    if (!r.on(tier)) return;
    ++refs[static_cast<size_t>(cache::index(k))][r.id];
    who[static_cast<size_t>(cache::index(k))].insert(r.id);
  };
  for (const auto& [id, s] : seqs_) {
    if (!s->state) continue;
    const bool is_parked = s->phase == Phase::parked || s->phase == Phase::parking || s->phase == Phase::resuming;
    for (auto [k, r] : s->state->held()) note(is_parked ? parked : leased, k, r);
  }
  tree_->for_each_page([&](PoolKind k, cache::PageRef r) { note(cached, k, r); });
  mover_->for_each_page([&](PoolKind k, cache::PageRef r) { note(flight, k, r); });
  for (PoolKind k : cache::kAllPools) {
    const auto i = static_cast<size_t>(cache::index(k));
    const auto& pool = set->pool(k);
    auto& a = out[i];
    a.capacity = pool.stats().capacity;
    a.in_use = pool.stats().in_use;
    a.free = a.capacity - a.in_use;
    a.leased = static_cast<int64_t>(leased[i].size());
    a.parked = static_cast<int64_t>(parked[i].size());
    a.cached = static_cast<int64_t>(cached[i].size());
    a.in_flight = static_cast<int64_t>(flight[i].size());
    pool.for_each_in_use([&](cache::PageId id, int32_t n) {
      auto it = refs[i].find(id);
      const int64_t held = it == refs[i].end() ? 0 : it->second;
      TROUPE_CHECK(held <= n, "a page is referenced more often than it was retained");
      if (held < n) ++a.leaked;
    });
  }
  return out;
}

void Engine::publish_stats() {
  counters_.waiting = static_cast<int64_t>(waiting_.size());
  counters_.running = 0;
  counters_.parked = 0;
  for (const auto& [id, s] : seqs_) {
    if (s->phase == Phase::running || s->phase == Phase::loading) ++counters_.running;
    if (s->phase == Phase::parked || s->phase == Phase::parking || s->phase == Phase::resuming) ++counters_.parked;
  }
  const bool full = counters_.steps % 32 == 0 || idle();
  if (full) counters_.requests.clear();
  static const char* phases[] = {"waiting", "loading", "running", "parking", "parked", "resuming"};
  for (const auto& [id, s] : seqs_) {
    if (!full) break;
    RequestStatus r;
    r.id = id;
    r.phase = phases[static_cast<int>(s->phase)];
    r.length = s->length();
    r.tokens = static_cast<int64_t>(s->tokens.size());
    r.max_tokens = s->prompt_len + s->req.sampling.max_tokens;
    if (s->state) {
      for (auto [k, ref] : s->state->held()) {
        (ref.tier == Tier::device ? r.device_bytes : r.host_bytes) += static_cast<int64_t>(geometry_.pool(k).page_bytes);
      }
    }
    counters_.requests.push_back(std::move(r));
  }
  auto free_bytes = [](const cache::PoolSet& set) {
    uint64_t b = static_cast<uint64_t>(set.arena().slabs_free()) * set.arena().slab_bytes();
    for (PoolKind k : cache::kAllPools) b += static_cast<uint64_t>(set.pool(k).free_pages()) * set.pool(k).layout().page_bytes;
    return b;
  };
  counters_.device_budget_bytes = static_cast<uint64_t>(device_->arena().slabs_total()) * device_->arena().slab_bytes();
  counters_.device_free_bytes = free_bytes(*device_);
  if (host_) {
    counters_.host_budget_bytes = static_cast<uint64_t>(host_->arena().slabs_total()) * host_->arena().slab_bytes();
    counters_.host_free_bytes = free_bytes(*host_);
  }
  counters_.tree_nodes = tree_->node_count();
  counters_.tree_pages = tree_->cached_pages();
  counters_.copied_bytes = copies_->bytes_copied();
  // The full audit walks every page table: every 32 steps and when idle;
  // pool occupancy every step.
  if (full) {
    counters_.device = audit(Tier::device);
    counters_.host = audit(Tier::host);
  } else {
    for (Tier tier : {Tier::device, Tier::host}) {
      const cache::PoolSet* set = tier == Tier::device ? device_.get() : host_.get();
      if (set == nullptr) continue;
      auto& out = tier == Tier::device ? counters_.device : counters_.host;
      for (PoolKind k : cache::kAllPools) {
        auto& a = out[static_cast<size_t>(cache::index(k))];
        a.capacity = set->pool(k).stats().capacity;
        a.in_use = set->pool(k).stats().in_use;
        a.free = a.capacity - a.in_use;
      }
    }
  }
  std::lock_guard lock(mu_);
  published_ = counters_;
}

}  // namespace troupe::engine
