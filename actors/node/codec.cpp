#include "actors/node/codec.hpp"

#include <algorithm>

namespace troupe::actors::node {
namespace {

template <class List>
std::vector<int32_t> ints(List in) {
  std::vector<int32_t> out;
  out.reserve(in.size());
  for (auto v : in) out.push_back(v);
  return out;
}

msg::WorkerRole role_to_wire(WorkerRole r) {
  switch (r) {
    case WorkerRole::colocated: return msg::WorkerRole::COLOCATED;
    case WorkerRole::prefill: return msg::WorkerRole::PREFILL;
    case WorkerRole::decode: return msg::WorkerRole::DECODE;
  }
  return msg::WorkerRole::COLOCATED;
}

WorkerRole role_from_wire(msg::WorkerRole r) {
  switch (r) {
    case msg::WorkerRole::PREFILL: return WorkerRole::prefill;
    case msg::WorkerRole::DECODE: return WorkerRole::decode;
    default: return WorkerRole::colocated;
  }
}

msg::FinishReason reason_to_wire(engine::FinishReason r) {
  switch (r) {
    case engine::FinishReason::stop: return msg::FinishReason::STOP;
    case engine::FinishReason::length: return msg::FinishReason::LENGTH;
    case engine::FinishReason::abort: return msg::FinishReason::ABORTED;
    case engine::FinishReason::error: return msg::FinishReason::ERROR;
  }
  return msg::FinishReason::ERROR;
}

engine::FinishReason reason_from_wire(msg::FinishReason r) {
  switch (r) {
    case msg::FinishReason::STOP: return engine::FinishReason::stop;
    case msg::FinishReason::LENGTH: return engine::FinishReason::length;
    case msg::FinishReason::ABORTED: return engine::FinishReason::abort;
    default: return engine::FinishReason::error;
  }
}

void sampling_to_wire(const engine::SamplingParams& s, msg::Sampling::Builder out) {
  out.setTemperature(s.temperature);
  out.setTopP(s.top_p);
  out.setTopK(s.top_k);
  out.setMinP(s.min_p);
  if (s.seed) out.getSeed().setValue(*s.seed);
  else out.getSeed().setNone();
  out.setMinTokens(s.min_tokens);
  out.setMaxTokens(s.max_tokens);
  auto stops = out.initStopIds(static_cast<unsigned>(s.stop_ids.size()));
  for (size_t i = 0; i < s.stop_ids.size(); ++i) stops.set(static_cast<unsigned>(i), s.stop_ids[i]);
  out.setIgnoreEos(s.ignore_eos);
  out.setRepetitionPenalty(s.repetition_penalty);
  out.setFrequencyPenalty(s.frequency_penalty);
  out.setPresencePenalty(s.presence_penalty);
  out.setAnswerStart(s.answer_start);
  out.setJsonSchema(messages::wire_text(s.json_schema));
  auto schemas = out.initAnswerSchemas(static_cast<unsigned>(s.answer_schemas.size()));
  for (size_t i = 0; i < s.answer_schemas.size(); ++i) schemas.set(static_cast<unsigned>(i), messages::wire_text(s.answer_schemas[i]));
  auto trigger = out.initAnswerTrigger(static_cast<unsigned>(s.answer_trigger.size()));
  for (size_t i = 0; i < s.answer_trigger.size(); ++i) trigger.set(static_cast<unsigned>(i), s.answer_trigger[i]);
  auto prefixes = out.initAnswerPrefixes(static_cast<unsigned>(s.answer_prefixes.size()));
  for (size_t i = 0; i < s.answer_prefixes.size(); ++i) {
    const auto& q = s.answer_prefixes[i];
    auto l = prefixes.init(static_cast<unsigned>(i), static_cast<unsigned>(q.size()));
    for (size_t j = 0; j < q.size(); ++j) l.set(static_cast<unsigned>(j), q[j]);
  }
  auto bias = out.initLogitBias(static_cast<unsigned>(s.logit_bias.size()));
  for (size_t i = 0; i < s.logit_bias.size(); ++i) {
    bias[static_cast<unsigned>(i)].setToken(s.logit_bias[i].first);
    bias[static_cast<unsigned>(i)].setBias(s.logit_bias[i].second);
  }
}

engine::SamplingParams sampling_from_wire(msg::Sampling::Reader in) {
  engine::SamplingParams s;
  s.temperature = in.getTemperature();
  s.top_p = in.getTopP();
  s.top_k = in.getTopK();
  s.min_p = in.getMinP();
  if (in.getSeed().isValue()) s.seed = in.getSeed().getValue();
  s.min_tokens = in.getMinTokens();
  s.max_tokens = in.getMaxTokens();
  s.stop_ids = ints(in.getStopIds());
  s.ignore_eos = in.getIgnoreEos();
  s.repetition_penalty = in.getRepetitionPenalty();
  s.frequency_penalty = in.getFrequencyPenalty();
  s.presence_penalty = in.getPresencePenalty();
  s.answer_start = in.getAnswerStart();
  for (auto b : in.getLogitBias()) s.logit_bias.emplace_back(b.getToken(), b.getBias());
  for (auto q : in.getAnswerPrefixes()) s.answer_prefixes.push_back(ints(q));
  s.json_schema = messages::text(in.getJsonSchema());
  for (auto x : in.getAnswerSchemas()) s.answer_schemas.push_back(messages::text(x));
  s.answer_trigger = ints(in.getAnswerTrigger());
  return s;
}

void usage_to_wire(const engine::Usage& u, msg::Usage::Builder out) {
  out.setPromptTokens(u.prompt_tokens);
  out.setCachedTokens(u.cached_tokens);
  out.setComputedTokens(u.computed_tokens);
  out.setRecomputedTokens(u.recomputed_tokens);
  out.setGeneratedTokens(u.generated_tokens);
  out.setParks(u.parks);
  out.setPreemptions(u.preemptions);
}

engine::Usage usage_from_wire(msg::Usage::Reader in) {
  engine::Usage u;
  u.prompt_tokens = in.getPromptTokens();
  u.cached_tokens = in.getCachedTokens();
  u.computed_tokens = in.getComputedTokens();
  u.recomputed_tokens = in.getRecomputedTokens();
  u.generated_tokens = in.getGeneratedTokens();
  u.parks = in.getParks();
  u.preemptions = in.getPreemptions();
  return u;
}

template <class B>
void set_list(B list, const std::vector<int32_t>& v) {
  for (size_t i = 0; i < v.size(); ++i) list.set(static_cast<unsigned>(i), v[i]);
}

void logprobs_to_wire(const std::vector<TokenLogprob>& in, capnp::List<msg::TokenLogprob>::Builder out) {
  for (size_t i = 0; i < in.size(); ++i) {
    const auto& l = in[i];
    auto o = out[static_cast<unsigned>(i)];
    o.setLogprob(l.logprob);
    set_list(o.initTopIds(static_cast<unsigned>(l.top_ids.size())), l.top_ids);
    auto tl = o.initTopLogprobs(static_cast<unsigned>(l.top_logprobs.size()));
    for (size_t k = 0; k < l.top_logprobs.size(); ++k) tl.set(static_cast<unsigned>(k), l.top_logprobs[k]);
  }
}

std::vector<TokenLogprob> logprobs_from_wire(capnp::List<msg::TokenLogprob>::Reader in) {
  std::vector<TokenLogprob> out;
  out.reserve(in.size());
  for (auto l : in) {
    TokenLogprob t;
    t.logprob = l.getLogprob();
    t.top_ids = ints(l.getTopIds());
    for (float v : l.getTopLogprobs()) t.top_logprobs.push_back(v);
    out.push_back(std::move(t));
  }
  return out;
}

}  // namespace

void to_wire(const Job& job, RefMap& refs, msg::Job::Builder out) {
  out.setId(job.id);
  set_list(out.initPrompt(static_cast<unsigned>(job.prompt.size())), job.prompt);
  out.setPromptTokens(job.prompt_tokens);
  out.setGeneratedBefore(job.generated_before);
  sampling_to_wire(job.sampling, out.initSampling());
  out.setPriority(job.priority);
  refs.to_wire(job.reply_to, out.initReplyTo());
  refs.to_wire(job.decode_to, out.initDecodeTo());
  out.setAttempt(job.attempt);
  out.setLogprobs(job.logprobs);
  out.setPromptLogprobs(job.prompt_logprobs);
}

Job from_wire(msg::Job::Reader in, RefMap& refs) {
  Job job;
  job.id = in.getId();
  job.prompt = ints(in.getPrompt());
  job.prompt_tokens = in.getPromptTokens();
  job.generated_before = in.getGeneratedBefore();
  job.sampling = sampling_from_wire(in.getSampling());
  job.priority = in.getPriority();
  job.reply_to = refs.from_wire(in.getReplyTo());
  job.decode_to = refs.from_wire(in.getDecodeTo());
  job.attempt = in.getAttempt();
  job.logprobs = std::clamp(in.getLogprobs(), -1, 20);
  job.prompt_logprobs = std::clamp(in.getPromptLogprobs(), -1, 20);
  return job;
}

void to_wire(const WorkerLoad& l, RefMap& refs, msg::WorkerLoad::Builder out) {
  out.setName(l.name);
  out.setRole(role_to_wire(l.role));
  out.setRunning(l.running);
  out.setWaiting(l.waiting);
  out.setParked(l.parked);
  out.setDeviceFreeBytes(l.device_free_bytes);
  out.setDeviceBudgetBytes(l.device_budget_bytes);
  out.setLeakedPages(l.leaked_pages);
  out.setDraining(l.draining);
  out.setKvUse(l.kv_use);
  out.setLargest(l.largest);
  out.setLargestTokens(l.largest_tokens);
  auto ids = out.initParkedIds(static_cast<unsigned>(l.parked_ids.size()));
  for (size_t i = 0; i < l.parked_ids.size(); ++i) ids.set(static_cast<unsigned>(i), l.parked_ids[i]);
  refs.to_wire(l.actor, out.initActor());
  auto targets = out.initHandoffTargets(static_cast<unsigned>(l.handoff_targets.size()));
  for (size_t i = 0; i < l.handoff_targets.size(); ++i) {
    refs.to_wire(l.handoff_targets[i], targets[static_cast<unsigned>(i)]);
  }
}

WorkerLoad from_wire(msg::WorkerLoad::Reader in, RefMap& refs) {
  WorkerLoad l;
  l.name = in.getName();
  l.role = role_from_wire(in.getRole());
  l.running = in.getRunning();
  l.waiting = in.getWaiting();
  l.parked = in.getParked();
  l.device_free_bytes = in.getDeviceFreeBytes();
  l.device_budget_bytes = in.getDeviceBudgetBytes();
  l.leaked_pages = in.getLeakedPages();
  l.draining = in.getDraining();
  l.kv_use = in.getKvUse();
  l.largest = in.getLargest();
  l.largest_tokens = in.getLargestTokens();
  for (auto id : in.getParkedIds()) l.parked_ids.push_back(id);
  l.actor = refs.from_wire(in.getActor());
  for (auto t : in.getHandoffTargets()) l.handoff_targets.push_back(refs.from_wire(t));
  return l;
}

void to_wire(const engine::SequenceImage& im, msg::SequenceMeta::Builder out) {
  set_list(out.initPrompt(static_cast<unsigned>(im.request.prompt.size())), im.request.prompt);
  sampling_to_wire(im.request.sampling, out.initSampling());
  out.setLogitsMode(static_cast<uint8_t>(im.request.logits));
  out.setPrefixCache(im.request.prefix_cache);
  out.setMaxChunkTokens(im.request.max_chunk_tokens);
  out.setPriority(im.request.priority);
  set_list(out.initTokens(static_cast<unsigned>(im.tokens.size())), im.tokens);
  out.setLength(im.length);
  out.setGenerated(im.generated);
  out.setSeed(im.seed);
  usage_to_wire(im.usage, out.initUsage());
  out.setPageTokens(im.page_tokens);
}

engine::SequenceImage image_from_wire(msg::SequenceMeta::Reader in) {
  engine::SequenceImage im;
  im.request.prompt = ints(in.getPrompt());
  im.request.sampling = sampling_from_wire(in.getSampling());
  im.request.logits = static_cast<engine::LogitsMode>(std::min<uint8_t>(in.getLogitsMode(), 2));
  im.request.prefix_cache = in.getPrefixCache();
  im.request.max_chunk_tokens = in.getMaxChunkTokens();
  im.request.priority = in.getPriority();
  im.tokens = ints(in.getTokens());
  im.length = in.getLength();
  im.generated = in.getGenerated();
  im.seed = in.getSeed();
  im.usage = usage_from_wire(in.getUsage());
  im.page_tokens = in.getPageTokens();
  return im;
}

bool encode_body(const caf::message& m, RefMap& refs, msg::ActorMessage::Body::Builder body, uint64_t& request_id,
                 std::string& why) {
  request_id = 0;
  if (m.match_elements<Job>()) {
    const auto& job = m.get_as<Job>(0);
    if (job.image) {
      why = "a Job with a state image (states cross processes as a Handoff)";
      return false;
    }
    request_id = job.id;
    to_wire(job, refs, body.initJob());
    return true;
  }
  if (m.match_elements<TokenBatch>()) {
    const auto& b = m.get_as<TokenBatch>(0);
    request_id = b.id;
    auto out = body.initTokenBatch();
    out.setId(b.id);
    out.setIndex(b.index);
    set_list(out.initTokens(static_cast<unsigned>(b.tokens.size())), b.tokens);
    refs.to_wire(b.worker, out.initWorker());
    if (!b.logprobs.empty()) logprobs_to_wire(b.logprobs, out.initLogprobs(static_cast<unsigned>(b.logprobs.size())));
    if (!b.prompt_logprobs.empty()) {
      out.setPromptIndex(b.prompt_index);
      logprobs_to_wire(b.prompt_logprobs, out.initPromptLogprobs(static_cast<unsigned>(b.prompt_logprobs.size())));
    }
    return true;
  }
  if (m.match_elements<Done>()) {
    const auto& d = m.get_as<Done>(0);
    request_id = d.id;
    auto out = body.initDone();
    out.setId(d.id);
    out.setReason(reason_to_wire(d.reason));
    usage_to_wire(d.usage, out.initUsage());
    refs.to_wire(d.worker, out.initWorker());
    out.setEndIndex(d.end_index);
    return true;
  }
  if (m.match_elements<Failed>()) {
    const auto& f = m.get_as<Failed>(0);
    request_id = f.id;
    auto out = body.initFailed();
    out.setId(f.id);
    out.setCode(messages::to_wire(f.code));
    out.setMessage(f.message);
    refs.to_wire(f.worker, out.initWorker());
    return true;
  }
  if (m.match_elements<Assigned>()) {
    const auto& a = m.get_as<Assigned>(0);
    request_id = a.id;
    auto out = body.initAssigned();
    out.setId(a.id);
    refs.to_wire(a.worker, out.initWorker());
    out.setWorkerName(a.worker_name);
    out.setFromIndex(a.from_index);
    return true;
  }
  if (m.match_elements<WorkerLoad>()) {
    to_wire(m.get_as<WorkerLoad>(0), refs, body.initWorkerLoad());
    return true;
  }
  if (m.match_elements<register_atom, caf::actor, std::string, uint8_t>()) {
    auto out = body.initRegistration();
    refs.to_wire(m.get_as<caf::actor>(1), out.initWorker());
    out.setName(m.get_as<std::string>(2));
    out.setRole(role_to_wire(static_cast<WorkerRole>(m.get_as<uint8_t>(3))));
    return true;
  }
  if (m.match_elements<abort_atom, RequestId>()) {
    request_id = m.get_as<RequestId>(1);
    body.setAbort(request_id);
    return true;
  }
  if (m.match_elements<park_atom, RequestId>()) {
    request_id = m.get_as<RequestId>(1);
    body.setPark(request_id);
    return true;
  }
  if (m.match_elements<resume_atom, RequestId>()) {
    request_id = m.get_as<RequestId>(1);
    body.setResume(request_id);
    return true;
  }
  if (m.match_elements<client_park_atom, RequestId>()) {
    request_id = m.get_as<RequestId>(1);
    body.setClientPark(request_id);
    return true;
  }
  if (m.match_elements<client_resume_atom, RequestId>()) {
    request_id = m.get_as<RequestId>(1);
    body.setClientResume(request_id);
    return true;
  }
  if (m.match_elements<confirm_atom, uint64_t>()) {
    body.setConfirm(m.get_as<uint64_t>(1));
    return true;
  }
  if (m.match_elements<release_atom, uint64_t>()) {
    body.setRelease(m.get_as<uint64_t>(1));
    return true;
  }
  if (m.match_elements<fence_atom, std::string, bool>()) {
    auto out = body.initFence();
    out.setName(m.get_as<std::string>(1));
    out.setFenced(m.get_as<bool>(2));
    return true;
  }
  if (m.match_elements<drain_atom>()) {
    body.setDrain();
    return true;
  }
  if (m.match_elements<migrate_atom, caf::actor>()) {
    refs.to_wire(m.get_as<caf::actor>(1), body.initMigrate());
    return true;
  }
  why = "a message the fabric does not carry: " + caf::to_string(m);
  return false;
}

bool deliver_body(msg::ActorMessage::Body::Reader body, RefMap& refs, const caf::actor& target) {
  using B = msg::ActorMessage::Body;
  switch (body.which()) {
    case B::JOB:
      caf::anon_send(target, from_wire(body.getJob(), refs));
      return true;
    case B::TOKEN_BATCH: {
      auto in = body.getTokenBatch();
      TokenBatch b = token_batch(in.getId(), in.getIndex(), ints(in.getTokens()), refs.from_wire(in.getWorker()));
      b.logprobs = logprobs_from_wire(in.getLogprobs());
      b.prompt_index = in.getPromptIndex();
      b.prompt_logprobs = logprobs_from_wire(in.getPromptLogprobs());
      caf::anon_send(target, std::move(b));
      return true;
    }
    case B::DONE: {
      auto in = body.getDone();
      caf::anon_send(target, Done{in.getId(), reason_from_wire(in.getReason()), usage_from_wire(in.getUsage()),
                                  refs.from_wire(in.getWorker()), in.getEndIndex()});
      return true;
    }
    case B::FAILED: {
      auto in = body.getFailed();
      caf::anon_send(target, Failed{in.getId(), messages::from_wire(in.getCode()), in.getMessage().cStr(),
                                    refs.from_wire(in.getWorker())});
      return true;
    }
    case B::ASSIGNED: {
      auto in = body.getAssigned();
      caf::anon_send(target, Assigned{in.getId(), refs.from_wire(in.getWorker()), in.getWorkerName().cStr(),
                                      in.getFromIndex()});
      return true;
    }
    case B::WORKER_LOAD:
      caf::anon_send(target, from_wire(body.getWorkerLoad(), refs));
      return true;
    case B::REGISTRATION: {
      auto in = body.getRegistration();
      caf::anon_send(target, register_atom::value, refs.from_wire(in.getWorker()), std::string(in.getName().cStr()),
                     static_cast<uint8_t>(role_from_wire(in.getRole())));
      return true;
    }
    case B::ABORT:
      caf::anon_send(target, abort_atom::value, RequestId{body.getAbort()});
      return true;
    case B::PARK:
      caf::anon_send(target, park_atom::value, RequestId{body.getPark()});
      return true;
    case B::RESUME:
      caf::anon_send(target, resume_atom::value, RequestId{body.getResume()});
      return true;
    case B::CLIENT_PARK:
      caf::anon_send(target, client_park_atom::value, RequestId{body.getClientPark()});
      return true;
    case B::CLIENT_RESUME:
      caf::anon_send(target, client_resume_atom::value, RequestId{body.getClientResume()});
      return true;
    case B::CONFIRM:
      caf::anon_send(target, confirm_atom::value, uint64_t{body.getConfirm()});
      return true;
    case B::RELEASE:
      caf::anon_send(target, release_atom::value, uint64_t{body.getRelease()});
      return true;
    case B::FENCE: {
      auto in = body.getFence();
      caf::anon_send(target, fence_atom::value, std::string(in.getName().cStr()), in.getFenced());
      return true;
    }
    case B::DRAIN:
      caf::anon_send(target, drain_atom::value);
      return true;
    case B::MIGRATE:
      caf::anon_send(target, migrate_atom::value, refs.from_wire(body.getMigrate()));
      return true;
    default:
      return false;
  }
}

}  // namespace troupe::actors::node
