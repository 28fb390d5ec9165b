// Engine: PD handoff and migration images (export a parked request, import it elsewhere).
#include <fmt/format.h>

#include "engine/engine.hpp"
#include "engine/sequence.hpp"

namespace troupe::engine {

using cache::PoolKind;
using cache::Tier;

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

}  // namespace troupe::engine
