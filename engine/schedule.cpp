// Engine::step: picking one forward call's chunks, running it, sampling.
#include <fmt/format.h>

#include <algorithm>

#include "engine/engine.hpp"
#include "engine/sampler.hpp"
#include "engine/sequence.hpp"

namespace troupe::engine {

using cache::PoolCounts;
using cache::PoolKind;

namespace {

PoolCounts plus(PoolCounts a, const PoolCounts& b) {
  for (size_t i = 0; i < a.size(); ++i) a[i] += b[i];
  return a;
}

std::string describe(const PoolCounts& need) {
  std::string s;
  for (PoolKind k : cache::kAllPools) {
    const int64_t n = need[static_cast<size_t>(cache::index(k))];
    if (n > 0) s += fmt::format("{}{} {}", s.empty() ? "" : ", ", n, cache::to_string(k));
  }
  return s.empty() ? "nothing" : s;
}

}  // namespace

bool Engine::step() {
  drain_inbox();
  mover_->poll();
  for (auto& [id, s] : seqs_) {
    if (s->phase == Phase::parked && s->resume_wanted) start_resume(*s);
  }

  Batch batch;
  int64_t budget = options_.step_tokens;
  // Running sequences: decode tokens first, then prefill chunks, oldest first.
  std::vector<Seq*> running;
  for (auto& [id, s] : seqs_) {
    if (s->phase == Phase::running) running.push_back(s.get());
  }
  std::sort(running.begin(), running.end(), [](const Seq* a, const Seq* b) {
    const bool da = a->pending() == 1, db = b->pending() == 1;
    return da != db ? da : a->order < b->order;
  });
  auto add = [&](Seq& s, int64_t n) {
    batch.chunks.push_back({s.state.get(),
                            std::span<const int32_t>(s.tokens).subspan(static_cast<size_t>(s.length()), static_cast<size_t>(n)),
                            s.rows_wanted(n)});
    batch.seqs.push_back(&s);
    batch.tokens += n;
  };
  for (Seq* s : running) {
    if (budget == 0) break;
    int64_t n = std::min(s->pending(), budget);
    if (s->req.max_chunk_tokens > 0) n = std::min(n, s->req.max_chunk_tokens);
    n = fit_chunk(*s, n);
    if (n == 0) continue;
    add(*s, n);
    budget -= n;
  }
  // Admissions in queue order (priority, then arrival): the head waits if it does not fit.
  counters_.waiting_reason.clear();
  while (!waiting_.empty() && budget > 0 && static_cast<int64_t>(batch.seqs.size()) < options_.max_running) {
    int64_t admitted = 0;
    for (auto& [id, s] : seqs_) admitted += s->phase == Phase::running || s->phase == Phase::loading;
    if (admitted >= options_.max_running) break;
    Seq& s = *find(waiting_.front());
    if (!try_admit(s, budget, batch)) {
      ++counters_.admission_waits;
      break;
    }
    waiting_.erase(waiting_.begin());
    if (!batch.seqs.empty() && batch.seqs.back() == &s) budget -= batch.chunks.back().ids.size();
  }

  if (batch.chunks.empty()) {
    if (mover_->in_flight() > 0) {
      mover_->wait_one();
      mover_->poll();
      return true;
    }
    const bool changed = handle_stall();
    publish_stats();
    return changed;
  }
  run_batch(batch);
  keep_headroom();
  ++counters_.steps;
  publish_stats();
  return true;
}

int64_t Engine::fit_chunk(Seq& s, int64_t n) {
  const int64_t len = s.length();
  auto fits = [&](int64_t m) { return device_->can_lease(s.state->pages_needed(len + m)); };
  if (!fits(n) && !make_room(s.state->pages_needed(len + n))) {
    // A shorter chunk may fit.
    while (n > 1 && !fits(n)) n /= 2;
    if (!fits(n)) return 0;
  }
  s.state->reserve(len + n);
  return n;
}

bool Engine::try_admit(Seq& s, int64_t budget, Batch& batch) {
  s.state = std::make_unique<cache::PagedSequence>(*tiers_, s.req.prefix_cache, options_.checkpoint_every_pages);
  int64_t resumable = 0;
  cache::ShadowRadix::Match m;
  if (s.req.prefix_cache) {
    m = tree_->match(s.tokens, static_cast<int64_t>(s.tokens.size()) - 1);
    if (m.resumable > 0) {
      s.state->adopt(m.pages, m.resumable);
      tree_->lock(m.node);
      s.lock = m.node;
      resumable = m.resumable;
    }
  }
  // Room for the first chunk, plus a page of growth for every running sequence.
  int64_t n = std::min(s.pending(), budget);
  if (s.req.max_chunk_tokens > 0) n = std::min(n, s.req.max_chunk_tokens);
  PoolCounts headroom{};
  for (auto& [id, o] : seqs_) {
    if (o->phase == Phase::running) {
      for (PoolKind k : cache::kAllPools) {
        if (k != PoolKind::hca_ring && geometry_.has(k)) ++headroom[static_cast<size_t>(cache::index(k))];
      }
    }
  }
  const PoolCounts need = plus(s.state->pages_needed(s.length() + n), headroom);
  if (!device_->can_lease(need) && !make_room(need)) {
    counters_.waiting_reason = fmt::format("request {} waits for device pages: needs {}; the device tier has {} of {} slabs free",
                                           s.id, describe(need), device_->arena().slabs_free(), device_->arena().slabs_total());
    unlock(s);
    s.state.reset();
    return false;
  }
  if (m.on_host && resumable > 0 && !start_reload(s)) {
    counters_.waiting_reason = fmt::format("request {} waits for device pages to reload its cached prefix", s.id);
    unlock(s);
    s.state.reset();
    return false;
  }
  // Admitted.
  s.order = ++admit_counter_;
  if (!s.admitted_once) {
    s.usage.cached_tokens = resumable;
    s.usage.recomputed_tokens += m.matched - resumable;
    counters_.recomputed_tokens += m.matched - resumable;
  } else {
    s.usage.recomputed_tokens += std::max<int64_t>(0, s.computed_before - resumable);
    counters_.recomputed_tokens += std::max<int64_t>(0, s.computed_before - resumable);
  }
  counters_.cached_tokens += resumable;
  s.admitted_once = true;
  s.inserted_pages = resumable / geometry_.page_tokens;
  if (s.phase == Phase::loading) return true;  // runs once its prefix is back on the device
  s.phase = Phase::running;
  n = fit_chunk(s, n);
  TROUPE_CHECK(n > 0, "admission checked the room for the first chunk");
  batch.chunks.push_back({s.state.get(),
                          std::span<const int32_t>(s.tokens).subspan(static_cast<size_t>(s.length()), static_cast<size_t>(n)),
                          s.rows_wanted(n)});
  batch.seqs.push_back(&s);
  batch.tokens += n;
  return true;
}

namespace {

// Whether the host sampler would pick the argmax of the raw logits for `s`'s next token.
bool greedy_on_device(const SamplingParams& p, LogitsMode logits, int32_t generated, bool model_has_eos) {
  if (logits != LogitsMode::none || p.prefix_bound(generated)) return false;
  if (!(p.temperature <= 0.0f || p.top_k == 1) || p.adjusts_logits()) return false;
  const bool masks = generated < p.min_tokens && (!p.stop_ids.empty() || (!p.ignore_eos && model_has_eos));
  return !masks;
}

}  // namespace

bool Engine::run_decode(Batch& batch) {
  if (!decoder_ || batch.chunks.empty() || static_cast<int>(batch.chunks.size()) > decoder_->options().max_batch) {
    return false;
  }
  for (size_t i = 0; i < batch.chunks.size(); ++i) {
    const auto& c = batch.chunks[i];
    if (c.ids.size() != 1 || c.state->length() < 1 || c.state->length() + 1 > decoder_->options().max_context) {
      return false;
    }
  }
  // Table slots: bound on a sequence's first decode step, refreshed when its rows
  // were written or moved outside the decoder.
  std::vector<int> slots;
  std::vector<int32_t> ids;
  bool host_logits = false;
  const bool has_eos = !model_.config().eos_token_ids.empty();
  for (size_t i = 0; i < batch.chunks.size(); ++i) {
    Seq& s = *batch.seqs[i];
    DecodeSlot& d = s.decode;
    if (d.slot >= 0 && d.state != s.state.get()) d.reset();
    if (d.slot < 0) {
      const int slot = decoder_->bind(*s.state);
      if (slot < 0) return false;  // every slot taken (sequences beyond the batch)
      d.decoder = decoder_.get();
      d.slot = slot;
    } else if (d.length != s.state->length() || d.moves != moves_) {
      decoder_->refresh(d.slot);
    }
    d.state = s.state.get();
    slots.push_back(d.slot);
    ids.push_back(batch.chunks[i].ids[0]);
    host_logits |= !greedy_on_device(s.req.sampling, s.req.logits, s.generated, has_eos);
  }
  try {
    decoder_->step(slots, ids);
  } catch (const Error& e) {
    std::vector<RequestId> gone;
    for (Seq* s : batch.seqs) gone.push_back(s->id);
    for (RequestId id : gone) {
      if (Seq* s = find(id)) finish(*s, FinishReason::error, e.code(), e.what());
    }
    return true;
  }
  ++counters_.decoder_steps;
  counters_.graph_replays = decoder_->replays();
  std::vector<float> logits;
  std::vector<int32_t> tokens;
  if (host_logits) {
    logits = decoder_->logits();
  } else {
    tokens = decoder_->tokens();
  }
  for (Seq* s : batch.seqs) {
    s->decode.length = s->state->length();
    s->decode.moves = moves_;
  }
  counters_.forward_tokens += batch.tokens;
  const int64_t V = model_.config().vocab_size;
  std::vector<RequestId> order;
  for (Seq* s : batch.seqs) order.push_back(s->id);
  for (size_t i = 0; i < order.size(); ++i) {
    Seq* s = find(order[i]);
    if (s == nullptr) continue;
    if (host_logits) {
      after_chunk(*s, 1, logits.data() + i * static_cast<size_t>(V), 1);
    } else {
      after_chunk(*s, 1, nullptr, 1, &tokens[i]);
    }
  }
  return true;
}

void Engine::run_batch(Batch& batch) {
  if (run_decode(batch)) return;
  const int64_t V = model_.config().vocab_size;
  std::vector<float> logits;
  try {
    logits = model_.forward(batch.chunks);
  } catch (const Error& e) {
    // The batch's requests end; their pages go back.
    std::vector<RequestId> ids;
    for (Seq* s : batch.seqs) ids.push_back(s->id);
    for (RequestId id : ids) {
      if (Seq* s = find(id)) finish(*s, FinishReason::error, e.code(), e.what());
    }
    return;
  }
  // Chunks of finished sequences are gone after finish(): walk by id.
  std::vector<std::tuple<RequestId, int64_t, size_t, int64_t>> todo;  // id, tokens, first row, rows
  size_t row = 0;
  for (size_t i = 0; i < batch.chunks.size(); ++i) {
    const auto& c = batch.chunks[i];
    const auto n = static_cast<int64_t>(c.ids.size());
    const int64_t rows = c.logits == model::LogitsWanted::all ? n : c.logits == model::LogitsWanted::last ? 1 : 0;
    todo.emplace_back(batch.seqs[i]->id, n, row, rows);
    row += static_cast<size_t>(rows);
  }
  counters_.forward_tokens += batch.tokens;
  for (auto [id, n, first, rows] : todo) {
    if (Seq* s = find(id)) after_chunk(*s, n, logits.data() + first * static_cast<size_t>(V), rows);
  }
}

void Engine::after_chunk(Seq& s, int64_t n, const float* rows, int64_t row_count, const int32_t* sampled) {
  const auto& c = model_.config();
  const int64_t V = c.vocab_size;
  const int64_t start = s.length() - n;
  s.usage.computed_tokens += n;
  if (n == 1 && start >= s.prompt_len) {
    ++counters_.decode_tokens;
  } else {
    counters_.prefill_tokens += n;
  }
  if (wants_all_rows(s.req.logits, start, s.prompt_len) && row_count > 0) {
    Event e = make_event(s.id, EventKind::logits);
    e.position = start;
    e.logits.assign(rows, rows + row_count * V);
    emit(std::move(e));
  }
  // Insert the prefix at the end of prefill chunks, and every few pages of decode.
  if (s.req.prefix_cache) {
    const int64_t full = s.state->full_pages();
    const bool prefill = n > 1 || start < s.prompt_len;
    const int64_t every = options_.decode_insert_every_pages;
    if (full > s.inserted_pages && (prefill || (every > 0 && full - s.inserted_pages >= every))) insert_prefix(s);
  }
  s.state->trim();  // after the insert: the tree keeps the checkpoint windows it wants
  if (s.length() < static_cast<int64_t>(s.tokens.size())) return;  // more prompt to feed

  const auto& sp = s.req.sampling;
  if (sp.max_tokens == 0) {  // the prompt only (its rows were the point)
    finish(s, FinishReason::length);
    return;
  }
  const float* last = rows != nullptr ? rows + (row_count - 1) * V : nullptr;
  if (sampled == nullptr && sp.adjusts_logits()) {
    s.counts.update(s.tokens, sp.answer_begin(s.prompt_len));
  }
  TokenMask allowed;
  if (sp.holds_json()) {
    if (auto why = schema_mask(s, allowed)) {
      if (why->empty()) {
        finish(s, FinishReason::stop);  // the value is whole (an imported answer), or nothing may follow
      } else {
        finish(s, FinishReason::error, ErrorCode::internal, *why);
      }
      return;
    }
  }
  const int32_t token = sampled != nullptr ? *sampled  // argmax on the device (greedy_on_device)
                                           : sample(std::span(last, static_cast<size_t>(V)), sp, s.seed, s.length(),
                                                    s.generated, c.eos_token_ids, s.counts, s.answer(), allowed);
  s.tokens.push_back(token);
  ++s.generated;
  Event e = make_event(s.id, EventKind::token);
  e.token = token;
  e.position = s.length();
  if ((s.req.logits == LogitsMode::sampled || s.req.logits == LogitsMode::prompt) && last != nullptr) {
    e.logits.assign(last, last + V);
  }
  emit(std::move(e));

  const auto& p = s.req.sampling;
  const bool is_eos = std::find(c.eos_token_ids.begin(), c.eos_token_ids.end(), token) != c.eos_token_ids.end();
  const bool is_stop = std::find(p.stop_ids.begin(), p.stop_ids.end(), token) != p.stop_ids.end();
  if (s.generated >= p.min_tokens && (is_stop || (is_eos && !p.ignore_eos))) {
    finish(s, FinishReason::stop);
  } else if (p.holds_json() && p.answer_trigger.empty() && schema_whole(s)) {
    finish(s, FinishReason::stop);  // the value is whole: nothing but its end may follow
  } else if (s.generated >= p.max_tokens || static_cast<int64_t>(s.tokens.size()) >= c.max_position_embeddings) {
    finish(s, FinishReason::length);
  } else if (s.req.park_after_prefill && s.generated == 1) {
    start_park(s);  // PD prefill: the state waits in the host tier for export_parked()
  }
}

void Engine::insert_prefix(Seq& s) {
  if (!s.req.prefix_cache || !s.state) return;
  const int64_t full = s.state->full_pages();
  if (full <= s.inserted_pages) return;
  auto* node = tree_->insert(s.tokens, s.state->prefix_for_tree(options_.checkpoint_every_pages));
  tree_->lock(node);
  unlock(s);
  s.lock = node;
  s.inserted_pages = full;
}

bool Engine::handle_stall() {
  std::vector<Seq*> running;
  for (auto& [id, s] : seqs_) {
    if (s->phase == Phase::running) running.push_back(s.get());
  }
  if (running.size() > 1) {
    // Nobody could grow: the lowest priority gives way, the newest of it.
    preempt(**std::max_element(running.begin(), running.end(), [](const Seq* a, const Seq* b) {
      return a->req.priority != b->req.priority ? a->req.priority > b->req.priority : a->order < b->order;
    }));
    return true;
  }
  const auto total = device_->arena().slabs_total() * static_cast<int64_t>(device_->arena().slab_bytes());
  if (running.size() == 1) {
    Seq& s = *running.front();
    finish(s, FinishReason::error, ErrorCode::resource_exhausted,
           fmt::format("the sequence needs more KV memory than the device tier holds ({} bytes) at {} tokens{}", total,
                       s.length(), host_ ? "" : "; a host tier (host_bytes) would let it grow further"));
    return true;
  }
  if (!waiting_.empty()) {
    // Nothing runs and the head still does not fit: it never will.
    Seq& s = *find(waiting_.front());
    finish(s, FinishReason::error, ErrorCode::resource_exhausted,
           fmt::format("the request's first chunk does not fit in the device tier ({} bytes)", total));
    return true;
  }
  for (auto& [id, s] : seqs_) {
    if (s->phase == Phase::parked && s->resume_wanted) {
      finish(*s, FinishReason::error, ErrorCode::resource_exhausted,
             "the parked request cannot be resumed: its state does not fit in the device tier");
      return true;
    }
  }
  return false;
}

void Engine::preempt(Seq& s) {
  ++counters_.preemptions;
  ++s.usage.preemptions;
  if (host_ && s.phase == Phase::running) {
    s.resume_wanted = true;
    start_park(s);
    if (s.phase == Phase::parking) return;
  }
  // Recompute: drop the state; the request runs again from its tokens (and
  // whatever prefix the tree still holds).
  s.computed_before = s.length();
  unlock(s);
  s.decode.reset();
  s.state.reset();
  s.phase = Phase::waiting;
  enqueue(s, true);
}

void Engine::enqueue(Seq& s, bool again) {
  const int32_t p = s.req.priority;
  auto it = std::find_if(waiting_.begin(), waiting_.end(), [&](RequestId id) {
    const int32_t q = find(id)->req.priority;
    return again ? q <= p : q < p;
  });
  waiting_.insert(it, s.id);
}

std::optional<bool> Engine::sync_matcher(Seq& s) {
  const auto& p = s.req.sampling;
  const auto answer = s.answer();
  const auto held = p.held_by(answer);
  if (!held) return std::nullopt;
  if (!s.matcher || s.matcher_from != held->from) {
    s.matcher = std::make_unique<JsonMatcher>(grammars_.get(*held->schema));
    s.matcher_from = held->from;
    s.matched = 0;
  }
  const TokenVocabulary& vocab = *options_.vocabulary;
  for (; held->from + static_cast<size_t>(s.matched) < answer.size(); ++s.matched) {
    const int32_t id = answer[held->from + static_cast<size_t>(s.matched)];
    if (id < 0 || id >= vocab.size() || vocab.bytes(id).empty() || !s.matcher->feed(vocab.bytes(id))) return false;
  }
  return true;
}

bool Engine::schema_whole(Seq& s) {
  try {
    const auto synced = sync_matcher(s);
    return synced.value_or(false) && s.matcher->complete();
  } catch (const Error&) {
    return false;  // schema_mask reports it at the next sample
  }
}

std::optional<std::string> Engine::schema_mask(Seq& s, TokenMask& allowed) {
  const auto& p = s.req.sampling;
  try {  // (a bad schema; an EBNF grammar too ambiguous to follow on)
    const auto synced = sync_matcher(s);
    if (!synced) return std::nullopt;  // no schema holds the answer yet (its prefix is still coming)
    if (!*synced) return fmt::format("the answer's {} tokens break its json schema", s.answer().size());
    if (s.matcher->complete()) {
      if (!p.answer_trigger.empty()) return std::nullopt;  // free again until the trigger comes back
      return std::string();
    }
    allowed = s.matcher->allowed(*options_.vocabulary);
  } catch (const Error& e) {
    return std::string(e.what());
  }
  const auto& eos = model_.config().eos_token_ids;
  allowed.resize(std::max(allowed.size(), static_cast<size_t>(model_.config().vocab_size + 63) / 64), 0);
  if (s.matcher->may_end() && !p.ignore_eos && s.generated >= p.min_tokens) {
    for (int64_t e : eos) {
      if (e >= 0 && static_cast<size_t>(e) < allowed.size() * 64) allowed[static_cast<size_t>(e) >> 6] |= uint64_t{1} << (e & 63);
    }
  }
  if (std::all_of(allowed.begin(), allowed.end(), [](uint64_t w) { return w == 0; })) return std::string();
  return std::nullopt;
}

}  // namespace troupe::engine
