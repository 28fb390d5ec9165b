#include "actors/gateway/gateway.hpp"

#include <spdlog/spdlog.h>

#include <fmt/format.h>

#include <chrono>
#include <cmath>
#include <limits>
#include <map>
#include <random>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>

#include "actors/gateway/fanout.hpp"
#include "actors/gateway/openai.hpp"
#include "actors/gateway/responses.hpp"
#include "engine/json_schema.hpp"
#include "messages/kinds.hpp"
#include "model/tokenizer/openai_messages.hpp"
#include "model/tokenizer/stop_strings.hpp"
#include "model/tokenizer/stream_decoder.hpp"
#include "transport/frame_server.hpp"

namespace troupe::actors::frames {

// What the frame endpoint's handler (on the FrameServer's I/O thread) sends
// the gateway: a validated frame from a connection, or the connection's end.
struct FrameCall {
  transport::ConnectionPtr conn;
  messages::Frame frame;
};
struct FrameClosed {
  uint64_t conn = 0;
};

// The FrameServer and its handler; the gateway's state owns it (the server
// stops, and its I/O thread ends, when the gateway's state is destroyed).
class Endpoint : public transport::FrameHandler {
 public:
  explicit Endpoint(caf::actor gateway) : gateway_(std::move(gateway)) {}
  void on_frame(const transport::ConnectionPtr& conn, messages::Frame frame) override {
    caf::anon_send(gateway_, FrameCall{conn, std::move(frame)});
  }
  void on_close(const transport::ConnectionPtr& conn, const Error& why) override {
    spdlog::debug("frames: {} closed ({})", conn->peer(), why.what());
    caf::anon_send(gateway_, FrameClosed{conn->id()});
  }

 private:
  caf::actor gateway_;
};

struct Front {
  std::unique_ptr<Endpoint> handler;
  std::unique_ptr<transport::FrameServer> server;
  ~Front() {
    if (server) server->stop();
    server.reset();
  }
};

}  // namespace troupe::actors::frames

CAF_ALLOW_UNSAFE_MESSAGE_TYPE(std::shared_ptr<troupe::gateway::HttpServer>)
CAF_ALLOW_UNSAFE_MESSAGE_TYPE(std::shared_ptr<troupe::actors::frames::Front>)
CAF_ALLOW_UNSAFE_MESSAGE_TYPE(troupe::actors::frames::FrameCall)
CAF_ALLOW_UNSAFE_MESSAGE_TYPE(troupe::actors::frames::FrameClosed)

namespace troupe::actors {
namespace {

using gateway::ApiError;
using gateway::ApiKind;
using gateway::ApiRequest;
using gateway::ApiResult;
using Clock = std::chrono::steady_clock;
using json = nlohmann::json;

using server_atom = caf::atom_constant<caf::atom("server")>;
using admin_atom = caf::atom_constant<caf::atom("admin")>;
using fserver_atom = caf::atom_constant<caf::atom("fserver")>;
using deadline_atom = caf::atom_constant<caf::atom("deadline")>;
using gap_atom = caf::atom_constant<caf::atom("gap")>;

// Where a request admitted from the frame endpoint answers.
struct FrameSink {
  transport::ConnectionPtr conn;
  uint64_t rid = 0;  // the client's request id on that connection
  bool return_ids = false;
};
using FrameKey = std::pair<uint64_t, uint64_t>;  // connection id, client request id

struct InFlight {
  ApiRequest api;
  ApiResult result;
  std::shared_ptr<gateway::Responder> responder;  // HTTP; null for a frame request
  std::optional<FrameSink> frames;                // a frame request
  std::unique_ptr<tokenizer::StreamDecoder> decoder;
  std::unique_ptr<tokenizer::StopStrings> stops;
  Job job;                      // as first submitted
  caf::actor worker;            // the worker streaming it now
  int64_t worker_from = 0;      // the output index it streams from
  int attempts = 0;
  Clock::time_point start;
  Clock::time_point last_token;
  bool first = true;
  // A client's Park (frames): the stream is silent until its Resume. What
  // arrives meanwhile (tokens sampled before the park took hold, or after a
  // migration) is held here and sent on Resume.
  bool client_parked = false;
  uint32_t parks = 0;
  std::vector<TokenBatch> held;
  std::optional<Done> held_done;
  bool resubmit_on_resume = false;  // its worker was lost while parked
  // Two workers in two processes can stream one request (PD: the prefill
  // worker's first token, the decode worker's rest; a migration): their
  // messages may arrive in either order. A batch past a gap waits here for
  // the one before it, by index; a Done waits for its last token.
  std::map<int64_t, TokenBatch> early;
  std::optional<Done> early_done;
  // Completions' echo with logprobs: the prompt's entries are still coming
  // (result.logprobs holds the ones here). Tokens and a Done wait in `early`
  // until they are all here, then the echo goes out first.
  bool prompt_pending = false;
  std::string echo;  // the echoed prompt (echo: true), streamed as the first event
  std::unique_ptr<gateway::ToolCallParser> tools;  // chat with tools: splits the answer into content and calls
  std::unique_ptr<gateway::ResponseStream> responses;  // a streamed /v1/responses request: its events' state
};

struct GatewayState {
  static inline const char* name = "gateway";
  GatewayConfig config;
  std::shared_ptr<const tokenizer::Tokenizer> tok;
  engine::GrammarCache grammars;  // json schemas compiled at admission (a bad one is a 400 here, not an engine error)
  std::shared_ptr<gateway::HttpServer> server;
  std::shared_ptr<frames::Front> frame_front;
  std::map<FrameKey, RequestId> frame_ids;  // running frame requests
  caf::actor router;
  std::shared_ptr<MetricsRegistry> metrics;
  std::map<RequestId, InFlight> inflight;
  // Request ids start at a random multiple of 2^32: a worker keys its runs by id alone, and several
  // gateways (replicas) place requests on the same workers, so each gateway's ids must not meet another's.
  RequestId next_id = (static_cast<RequestId>(std::random_device{}()) << 32) | 1;
  std::set<caf::actor_addr> watched;
  caf::actor supervisor;  // for the admin routes
  bool draining = false;  // shutting down: no new requests
};

using Self = caf::stateful_actor<GatewayState>*;

int64_t now_unix() {
  return std::chrono::duration_cast<std::chrono::seconds>(std::chrono::system_clock::now().time_since_epoch()).count();
}

void respond_error(gateway::Responder& r, const ApiError& e, const std::map<std::string, std::string>& headers = {}) {
  r.respond(e.status, "application/json", gateway::error_body(e), headers);
}

Counter& requests_counter(GatewayState& st, const std::string& route, int status) {
  return st.metrics->counter("troupe_http_requests_total", "HTTP requests by route and status",
                             {{"route", route}, {"status", std::to_string(status)}});
}

// A route label for a path a request was refused on before routing: one of the served routes, or "other"
// (a label per client-chosen path would grow the registry without bound).
std::string known_route(const std::string& path) {
  for (const ApiKind kind : {ApiKind::completion, ApiKind::chat, ApiKind::responses}) {
    if (path == gateway::route_of(kind)) return path;
  }
  for (const char* r : {"/v1/models", "/tokenize", "/detokenize"}) {
    if (path == r) return path;
  }
  return path.rfind("/admin/", 0) == 0 ? "/admin" : "other";
}

void forget(GatewayState& st, std::map<RequestId, InFlight>::iterator it) {
  if (it->second.frames) st.frame_ids.erase(FrameKey{it->second.frames->conn->id(), it->second.frames->rid});
  st.inflight.erase(it);
}

Counter& aborted_counter(GatewayState& st) {
  return st.metrics->counter("troupe_requests_finished_total", "Requests finished by reason", {{"reason", "abort"}});
}
Counter& client_gone_counter(GatewayState& st) {
  return st.metrics->counter("troupe_client_aborts_total", "Requests aborted because the client went away");
}

// A request that ends here without an answer from its worker: the worker aborts
// it (its pages are freed), `counter` counts it, the gateway forgets it.
void abort_and_forget(Self self, std::map<RequestId, InFlight>::iterator it, Counter& counter) {
  if (it->second.worker) self->send(it->second.worker, abort_atom::value, it->first);
  counter.inc();
  forget(self->state, it);
}

ErrorCode code_of(const ApiError& e) {
  switch (e.status) {
    case 404: return ErrorCode::not_found;
    case 413:
    case 429: return ErrorCode::resource_exhausted;
    case 499: return ErrorCode::cancelled;
    case 503: return ErrorCode::unavailable;
    case 504: return ErrorCode::deadline_exceeded;
    default: return e.status >= 500 ? ErrorCode::internal : ErrorCode::invalid_argument;
  }
}

void send_frame_error(const transport::ConnectionPtr& conn, uint64_t rid, ErrorCode code, const std::string& message,
                      msg::Kind about) {
  (void)conn->send(messages::make_error_frame(rid, code, message, about));
}

void send_chunk(const FrameSink& s, uint32_t index, const std::vector<int32_t>& ids, const std::string& text) {
  messages::FrameBuilder<msg::TokenChunk> b;
  b.root().setIndex(index);
  if (s.return_ids) {
    auto l = b.root().initTokenIds(static_cast<unsigned>(ids.size()));
    for (size_t i = 0; i < ids.size(); ++i) l.set(static_cast<unsigned>(i), static_cast<uint32_t>(ids[i]));
  }
  b.root().setText(messages::wire_text(text));
  (void)s.conn->send(b.finish(s.rid));
}

void send_finish(const FrameSink& s, const InFlight& f, msg::FinishReason reason) {
  messages::FrameBuilder<msg::Finish> b;
  b.root().setReason(reason);
  b.root().setPromptTokens(static_cast<uint32_t>(f.job.prompt_tokens));
  b.root().setCompletionTokens(static_cast<uint32_t>(f.result.token_ids.size()));
  b.root().setCachedTokens(static_cast<uint32_t>(f.result.cached_tokens));
  b.root().setParks(f.parks);
  (void)s.conn->send(b.finish(s.rid));
}

// The calls of a parser step go to the result and its call pieces to `deltas` (what a
// stream sends next); its content is returned.
std::string take_tool_calls(InFlight& f, gateway::ToolCallParser::Step step,
                            std::vector<gateway::ToolCallDelta>& deltas) {
  for (auto& c : step.calls) f.result.tool_calls.push_back(std::move(c));
  for (auto& d : step.deltas) deltas.push_back(std::move(d));
  return std::move(step.content);
}

void finish(Self self, RequestId id, const std::string& reason) {
  auto& st = self->state;
  auto it = st.inflight.find(id);
  if (it == st.inflight.end()) return;
  InFlight& f = it->second;
  std::string tail = f.decoder->finish();
  auto step = f.stops->push(tail);
  tail = step.text;
  std::string finish_reason = reason;
  if (!step.stopped) tail += f.stops->finish();
  else finish_reason = "stop";
  std::vector<gateway::ToolCallDelta> deltas;
  if (f.tools) {
    tail = take_tool_calls(f, f.tools->push(tail), deltas);
    tail += take_tool_calls(f, f.tools->finish(), deltas);
    if (!f.result.tool_calls.empty() && finish_reason == "stop") finish_reason = "tool_calls";
  }
  f.result.text += tail;
  f.result.finish_reason = finish_reason == "abort" ? "abort" : finish_reason;
  if (f.frames) {
    if (!tail.empty()) send_chunk(*f.frames, static_cast<uint32_t>(f.result.token_ids.size()), {}, tail);
    send_finish(*f.frames, f, finish_reason == "length"  ? msg::FinishReason::LENGTH
                              : finish_reason == "abort" ? msg::FinishReason::ABORTED
                                                         : msg::FinishReason::STOP);
  } else if (f.responses) {
    std::string events = f.responses->text(f.result, tail);  // (in this order: each event is numbered)
    events += f.responses->tool_calls(f.result, deltas);
    events += f.responses->finish(f.api, f.result);
    f.responder->send(events);
    f.responder->end();
  } else if (f.api.stream) {
    if (!tail.empty()) {
      f.responder->send(gateway::stream_delta(f.api, f.result, tail, {}, f.first));
      f.first = false;
    }
    if (!deltas.empty()) f.responder->send(gateway::stream_tool_calls(f.result, deltas, f.first));
    f.responder->send(gateway::stream_finish(f.api, f.result));
    f.responder->end();
  } else if (f.api.kind == ApiKind::responses) {
    f.responder->respond(200, "application/json", gateway::response_body_of(f.api, f.result));
  } else {
    f.responder->respond(200, "application/json", gateway::response_body(f.api, f.result));
  }
  st.metrics->histogram("troupe_e2e_seconds", "Request latency, admission to last token",
                        MetricsRegistry::latency_buckets())
      .observe(std::chrono::duration<double>(Clock::now() - f.start).count());
  st.metrics->counter("troupe_requests_finished_total", "Requests finished by reason", {{"reason", finish_reason}}).inc();
  forget(st, it);
}

void fail(Self self, RequestId id, const ApiError& e) {
  auto& st = self->state;
  auto it = st.inflight.find(id);
  if (it == st.inflight.end()) return;
  InFlight& f = it->second;
  if (f.frames) {
    send_frame_error(f.frames->conn, f.frames->rid, code_of(e), e.message, msg::Kind::GENERATE_REQUEST);
  } else if (f.api.stream) {
    f.responder->send(f.responses ? f.responses->error(e) : gateway::stream_error(e));
    f.responder->end();
  } else {
    respond_error(*f.responder, e);
  }
  st.metrics->counter("troupe_requests_finished_total", "Requests finished by reason", {{"reason", "error"}}).inc();
  forget(st, it);
}

void submit(Self self, InFlight& f) {
  Job job = f.job;
  const auto done = static_cast<int32_t>(f.result.token_ids.size());
  if (done > 0) {  // continue from what the client already has
    job.prompt.insert(job.prompt.end(), f.result.token_ids.begin(), f.result.token_ids.end());
    job.generated_before = done;
    job.sampling.max_tokens = std::max(1, job.sampling.max_tokens - done);
    job.sampling.min_tokens = std::max(0, job.sampling.min_tokens - done);
  }
  job.attempt = f.attempts;
  self->send(self->state.router, std::move(job));
}

// A worker is gone or refused: run the request again elsewhere, or give up.
void retry(Self self, RequestId id, const std::string& why) {
  auto& st = self->state;
  auto it = st.inflight.find(id);
  if (it == st.inflight.end()) return;
  InFlight& f = it->second;
  if (f.client_parked) {  // its client parked it: run it again on Resume
    spdlog::info("gateway: request {} lost its worker while parked ({}); resubmitted on resume", id, why);
    f.worker = nullptr;
    f.resubmit_on_resume = true;
    return;
  }
  if (++f.attempts > st.config.max_attempts) {
    fail(self, id, ApiError{503, "request failed after " + std::to_string(f.attempts) + " attempts: " + why,
                            "service_unavailable", "", ""});
    return;
  }
  spdlog::info("gateway: request {} resubmitted ({}; {} tokens already streamed)", id, why, f.result.token_ids.size());
  if (!f.prompt_pending) f.job.prompt_logprobs = -1;  // (none of them will be asked again)
  st.metrics->counter("troupe_resubmits_total", "Requests resubmitted after a worker loss").inc();
  f.worker = nullptr;
  f.early.clear();  // the next attempt streams from what the client has
  f.early_done.reset();
  submit(self, f);
}

void watch(Self self, const caf::actor& worker) {
  if (!worker) return;
  if (self->state.watched.insert(worker.address()).second) self->monitor(worker);
}

// `worker` streams request `id` from output index `from` on: it is the one to
// watch, abort and park, unless one that took over later announced itself
// first (an earlier worker's message arriving late changes nothing).
void take_over(Self self, InFlight& f, RequestId id, const caf::actor& worker, int64_t from) {
  if (!worker || worker == f.worker) return;
  if (f.worker && from < f.worker_from) return;
  f.worker = worker;
  f.worker_from = from;
  watch(self, worker);
  if (f.client_parked) self->send(worker, client_park_atom::value, id);
}

void on_done(Self self, const Done& d);

// A token's logprob as the API reports it: its bytes and its alternatives' (ids
// outside the tokenizer, which random weights can produce, have none).
gateway::LogprobEntry logprob_entry(const tokenizer::Tokenizer& tok, int32_t id, const TokenLogprob& l) {
  auto bytes = [&](int32_t t) { return t >= 0 && t < tok.vocab_size() ? std::string(tok.token_bytes(t)) : std::string(); };
  gateway::LogprobEntry e;
  e.bytes = bytes(id);
  e.logprob = l.logprob;
  for (size_t k = 0; k < l.top_ids.size() && k < l.top_logprobs.size(); ++k) {
    e.top.emplace_back(bytes(l.top_ids[k]), l.top_logprobs[k]);
  }
  return e;
}

// Streams the new tokens of `b` (b.index <= what the client has); false when
// that ended the request (a stop string): `f` is gone then.
bool stream_batch(Self self, InFlight& f, const TokenBatch& b) {
  auto& st = self->state;
  std::string delta;
  std::vector<int32_t> ids;
  bool stopped = false;
  for (size_t i = 0; i < b.tokens.size() && !stopped; ++i) {
    const int64_t index = b.index + static_cast<int64_t>(i);
    if (index != static_cast<int64_t>(f.result.token_ids.size())) continue;  // already streamed (a resubmission)
    const int32_t tok = b.tokens[i];
    f.result.token_ids.push_back(tok);
    ids.push_back(tok);
    if (f.api.logprobs >= 0) {  // (a worker that did not compute them leaves the entry at 0)
      f.result.logprobs.push_back(logprob_entry(*st.tok, tok, i < b.logprobs.size() ? b.logprobs[i] : TokenLogprob{}));
    }
    std::string text;
    try {
      text = f.decoder->push(tok);
    } catch (const Error&) {
      text.clear();  // an id outside the tokenizer (random weights can produce any id < vocab)
    }
    auto step = f.stops->push(text);
    delta += step.text;
    stopped = step.stopped;
  }
  if (ids.empty()) return true;
  std::vector<gateway::ToolCallDelta> deltas;
  if (f.tools) delta = take_tool_calls(f, f.tools->push(delta), deltas);
  const auto now = Clock::now();
  if (f.first) {
    st.metrics->histogram("troupe_ttft_seconds", "Time to first token", MetricsRegistry::latency_buckets())
        .observe(std::chrono::duration<double>(now - f.start).count());
  } else {
    st.metrics->histogram("troupe_itl_seconds", "Inter-token latency", MetricsRegistry::latency_buckets())
        .observe(std::chrono::duration<double>(now - f.last_token).count() / static_cast<double>(ids.size()));
  }
  f.last_token = now;
  f.result.text += delta;
  auto batch_logprobs = [&] {  // the batch's entries (when asked), for a streamed delta
    std::vector<gateway::LogprobEntry> lps;
    if (f.api.logprobs >= 0) lps.assign(f.result.logprobs.end() - static_cast<std::ptrdiff_t>(ids.size()), f.result.logprobs.end());
    return lps;
  };
  if (f.frames) {
    send_chunk(*f.frames, static_cast<uint32_t>(f.result.token_ids.size() - ids.size()), ids, delta);
  } else if (f.responses) {
    std::string events = f.responses->text(f.result, delta, batch_logprobs());  // (in this order: each event is numbered)
    events += f.responses->tool_calls(f.result, deltas);
    if (!events.empty()) f.responder->send(events);
  } else if (f.api.stream && (!delta.empty() || f.api.return_token_ids || f.api.logprobs >= 0)) {
    f.responder->send(gateway::stream_delta(f.api, f.result, delta, ids, f.first, batch_logprobs()));
    f.first = false;
  }
  if (f.api.stream && f.responder && !f.responses && !deltas.empty()) {
    f.responder->send(gateway::stream_tool_calls(f.result, deltas, f.first));
    f.first = false;
  }
  if (stopped) {
    if (f.worker) self->send(f.worker, abort_atom::value, b.id);
    finish(self, b.id, "stop");
    return false;
  }
  return true;
}

// The echoed prompt as the stream's first event (with the prompt's logprobs when asked).
void send_echo(InFlight& f) {
  if (!f.api.stream || !f.api.echo) return;
  f.responder->send(gateway::stream_delta(f.api, f.result, f.echo, {}, f.first, f.result.logprobs));
  f.first = false;
}

// Streams what waited for the batches before it (and for the prompt's logprobs);
// `f` may be gone afterwards (the request ended).
void stream_early(Self self, InFlight& f) {
  auto have = [&f] { return static_cast<int64_t>(f.result.token_ids.size()); };
  while (!f.early.empty() && f.early.begin()->first <= have()) {
    const TokenBatch next = std::move(f.early.begin()->second);
    f.early.erase(f.early.begin());
    if (!stream_batch(self, f, next)) return;
  }
  if (f.early_done && f.early_done->end_index <= have()) {
    const Done d = *f.early_done;
    f.early_done.reset();
    on_done(self, d);
  }
}

// Prompt logprobs (echo): entries for prompt tokens b.prompt_index, ...; the ones
// already here (a recomputation) are skipped.
void take_prompt_logprobs(Self self, InFlight& f, const TokenBatch& b) {
  auto& st = self->state;
  const auto& prompt = f.result.prompt_ids;
  for (size_t i = 0; i < b.prompt_logprobs.size(); ++i) {
    const int64_t index = b.prompt_index + static_cast<int64_t>(i);
    if (!f.prompt_pending || index != static_cast<int64_t>(f.result.logprobs.size())) continue;
    f.result.logprobs.push_back(logprob_entry(*st.tok, prompt[static_cast<size_t>(index)], b.prompt_logprobs[i]));
    if (f.result.logprobs.size() == prompt.size()) {
      f.prompt_pending = false;
      send_echo(f);
    }
  }
}

void on_tokens(Self self, const TokenBatch& b) {
  auto& st = self->state;
  auto it = st.inflight.find(b.id);
  if (it == st.inflight.end()) return;
  InFlight& f = it->second;
  take_over(self, f, b.id, b.worker, b.index);
  if (!b.prompt_logprobs.empty()) {
    const bool was_pending = f.prompt_pending;
    take_prompt_logprobs(self, f, b);
    if (was_pending && !f.prompt_pending) stream_early(self, f);
    return;
  }
  if (f.client_parked) {
    f.held.push_back(b);
    return;
  }
  auto have = [&f] { return static_cast<int64_t>(f.result.token_ids.size()); };
  if (b.index > have() || f.prompt_pending) {  // the batch before it (or the prompt's logprobs) still on its way
    f.early.emplace(b.index, b);
    if (b.index > have()) {
      st.metrics->counter("troupe_early_batches_total",
                          "Token batches that overtook an earlier one of their request (two workers, two processes) "
                          "and waited for it").inc();
    }
    return;
  }
  if (!stream_batch(self, f, b)) return;
  stream_early(self, f);
}

void on_done(Self self, const Done& d) {
  auto& s = self->state;
  auto it = s.inflight.find(d.id);
  if (it == s.inflight.end()) return;
  if (d.reason == engine::FinishReason::abort) {
    // The gateway forgets a request before it aborts it, so this worker
    // dropped it on its own (a stale attempt, a worker stopping): the
    // client has not got all its tokens; run it again.
    retry(self, d.id, "the worker aborted it");
    return;
  }
  if (it->second.client_parked) {  // finished as the park arrived: the client hears it on Resume
    it->second.held_done = d;
    return;
  }
  if (d.end_index > static_cast<int64_t>(it->second.result.token_ids.size()) || it->second.prompt_pending) {
    // Its last tokens are on their way (another process sent some of them).
    if (!it->second.early_done) {
      self->delayed_send(self, s.config.token_gap_timeout, gap_atom::value, d.id, it->second.attempts);
    }
    it->second.early_done = d;
    return;
  }
  it->second.result.cached_tokens = std::max(it->second.result.cached_tokens, d.usage.cached_tokens);
  finish(self, d.id, d.reason == engine::FinishReason::length ? "length" : "stop");
}

// Where an admitted request answers: an HTTP responder or a frame connection.
struct Origin {
  std::shared_ptr<gateway::Responder> responder;
  std::optional<FrameSink> frames;
  std::optional<Clock::time_point> deadline;  // frames: GenerateRequest.deadlineUnixNanos
};

// Tokenizes and checks a parsed request and hands it to the router; or
// returns why not (nothing is answered then: the caller reports the error).
ApiError model_not_found(const GatewayState& st, const std::string& name) {
  return ApiError{404, "The model '" + name + "' does not exist; this server serves '" + st.config.model_name + "'.",
                  "invalid_request_error", "model", "model_not_found"};
}

// The served model as /v1/models lists it.
json model_object(const GatewayState& st) {
  return {{"id", st.config.model_name}, {"object", "model"}, {"created", now_unix()}, {"owned_by", "troupe"},
          {"max_model_len", st.config.max_model_len}};
}

// The ids a chat (through the template) or a text prompt becomes, as a request feeds
// them to the model (/tokenize answers the same). Throws troupe::Error for bad messages.
std::vector<int32_t> encode_messages(const GatewayState& st, const json& messages, bool add_generation_prompt,
                                     const ApiRequest* tools = nullptr) {
  tokenizer::ChatOptions opts;
  opts.add_generation_prompt = add_generation_prompt;
  if (tools && tools->uses_tools()) {  // (tool_choice none: the model is not told of them)
    opts.system_suffix = gateway::tools_prompt(tools->tools);
    opts.answer_prefix = gateway::forced_call_start(tools->tool_choice);
  }
  return st.tok->encode_chat(tokenizer::messages_from_json(messages), opts);
}
std::vector<int32_t> encode_text(const GatewayState& st, const std::string& text, bool special_tokens = true) {
  tokenizer::EncodeOptions opts;
  opts.add_bos = special_tokens && st.tok->config().add_bos_token;
  return st.tok->encode(text, opts);
}

// The schema a call to `tool` holds its arguments to: its parameters where the
// structured-output grammar holds them, else any JSON object (a tool's schema is the
// client's own: a keyword the grammar lacks costs the constraint, not the request).
std::string arguments_schema(GatewayState& st, const gateway::ToolSpec& tool) {
  if (tool.function.contains("parameters")) {
    try {
      std::string params = tool.function["parameters"].dump();
      st.grammars.get(params);
      return params;
    } catch (const Error& e) {
      spdlog::debug("tool '{}': arguments held to any object: {}", tool.name, e.what());
    }
  }
  return R"({"type": "object"})";
}

std::optional<ApiError> admit(Self self, ApiRequest api, ApiKind kind, const std::string& route, Origin origin) {
  auto& st = self->state;
  if (st.draining) {
    requests_counter(st, route, 503).inc();
    return ApiError{503, "the server is shutting down; retry on another replica", "service_unavailable", "", ""};
  }
  if (api.model.empty()) api.model = st.config.model_name;  // left out by the client: the served model
  if (api.model != st.config.model_name) {
    requests_counter(st, route, 404).inc();
    return model_not_found(st, api.model);
  }
  std::vector<int32_t> prompt;
  try {
    if (gateway::chat_like(kind)) {
      if (!api.add_generation_prompt && api.tool_choice.forces_call()) {
        requests_counter(st, route, 400).inc();
        return ApiError{400, "'tool_choice' that forces a call needs 'add_generation_prompt'", "invalid_request_error",
                        "tool_choice", ""};
      }
      prompt = encode_messages(st, api.messages, api.add_generation_prompt, &api);
    } else if (api.prompt_ids) {
      prompt = *api.prompt_ids;
    } else {
      prompt = encode_text(st, *api.prompt_text);
    }
  } catch (const Error& e) {
    const auto ae = gateway::to_request_error(e, kind == ApiKind::chat ? "messages" : kind == ApiKind::responses ? "input" : "prompt");
    requests_counter(st, route, ae.status).inc();
    return ae;
  }
  const int64_t vocab = st.tok->vocab_size();
  for (int32_t id : prompt) {
    if (id >= vocab || id < 0) {
      ApiError e{400, "token id " + std::to_string(id) + " is out of range for a vocabulary of " + std::to_string(vocab),
                 "invalid_request_error", "prompt", ""};
      requests_counter(st, route, 400).inc();
      return e;
    }
  }
  for (auto [id, bias] : api.sampling.logit_bias) {
    if (id >= vocab || id < 0) {
      requests_counter(st, route, 400).inc();
      return ApiError{400, "logit_bias names token " + std::to_string(id) + ", out of range for a vocabulary of " +
                               std::to_string(vocab), "invalid_request_error", "logit_bias", ""};
    }
  }
  std::string json_schema = api.sampling.json_schema;
  if (!json_schema.empty()) {
    try {
      st.grammars.get(json_schema);
    } catch (const Error& e) {
      requests_counter(st, route, 400).inc();
      return ApiError{400, e.what(), "invalid_request_error", api.sampling.grammar_param, ""};
    }
  } else if (api.uses_tools() && api.tool_choice.mode == gateway::ToolChoice::named) {
    // The answer is the named call's arguments.
    for (const auto& t : api.tools) {
      if (t.name == api.tool_choice.name) json_schema = arguments_schema(st, t);
    }
  }
  const auto plen = static_cast<int64_t>(prompt.size());
  if (plen == 0) {
    requests_counter(st, route, 400).inc();
    return ApiError{400, "the prompt is empty", "invalid_request_error", "prompt", ""};
  }
  int64_t max_tokens = api.sampling.max_tokens.value_or(gateway::chat_like(kind) ? st.config.max_model_len - plen : 16);
  if (plen + std::max<int64_t>(max_tokens, 1) > st.config.max_model_len || max_tokens < (api.echo ? 0 : 1)) {
    ApiError e{400,
               "This model's maximum context length is " + std::to_string(st.config.max_model_len) +
                   " tokens. However, you requested " + std::to_string(plen + std::max<int64_t>(max_tokens, 1)) +
                   " tokens (" + std::to_string(plen) + " in the prompt, " + std::to_string(max_tokens) +
                   " for the completion). Please reduce the prompt or max_tokens.",
               "invalid_request_error", "max_tokens", "context_length_exceeded"};
    requests_counter(st, route, 400).inc();
    return e;
  }
  if (origin.deadline && *origin.deadline <= Clock::now()) {
    requests_counter(st, route, 504).inc();
    return ApiError{504, "the request's deadline passed before it was admitted", "timeout", "", ""};
  }

  const RequestId id = st.next_id++;
  InFlight f;
  f.api = api;
  f.responder = origin.responder;
  f.frames = origin.frames;
  f.decoder =
      std::make_unique<tokenizer::StreamDecoder>(*st.tok, tokenizer::DecodeOptions{.skip_special = api.sampling.skip_special_tokens});
  f.stops = std::make_unique<tokenizer::StopStrings>(api.sampling.stop);
  if (api.uses_tools()) {
    std::string forced;
    for (const auto& part : gateway::forced_call_start(api.tool_choice)) forced += part.text;
    f.tools = std::make_unique<gateway::ToolCallParser>(std::move(forced), api.parallel_tool_calls);
  }
  f.result.id = (kind == ApiKind::chat ? "chatcmpl-" : kind == ApiKind::responses ? "resp_" : "cmpl-") + std::to_string(id);
  if (kind == ApiKind::responses && api.stream) f.responses = std::make_unique<gateway::ResponseStream>();
  f.result.created = now_unix();
  f.result.model = st.config.model_name;
  f.result.prompt_ids = prompt;
  if (api.echo) {
    f.echo = api.prompt_text ? *api.prompt_text : st.tok->decode(prompt);
    f.result.text = f.echo;
    if (api.logprobs >= 0) {  // the first prompt token has no logprob (null); the others come from the worker
      gateway::LogprobEntry first = logprob_entry(*st.tok, prompt[0], TokenLogprob{});
      first.none = true;
      f.result.logprobs.push_back(std::move(first));
      f.prompt_pending = plen > 1;
    }
  }
  f.start = f.last_token = Clock::now();
  Job& job = f.job;
  job.id = id;
  job.prompt = std::move(prompt);
  job.prompt_tokens = plen;
  job.reply_to = caf::actor_cast<caf::actor>(self);
  job.logprobs = api.logprobs;
  if (api.echo && api.logprobs >= 0) job.prompt_logprobs = api.logprobs;
  job.priority = api.priority;
  auto& s = job.sampling;
  s.temperature = api.sampling.temperature;
  s.top_p = api.sampling.top_p;
  s.top_k = std::max(0, api.sampling.top_k);
  s.min_p = api.sampling.min_p;
  s.seed = api.sampling.seed;
  s.max_tokens = static_cast<int32_t>(max_tokens);
  s.min_tokens = static_cast<int32_t>(std::min<int64_t>(api.sampling.min_tokens, max_tokens));
  s.stop_ids = api.sampling.stop_token_ids;
  s.ignore_eos = api.sampling.ignore_eos;
  s.repetition_penalty = api.sampling.repetition_penalty;
  s.frequency_penalty = api.sampling.frequency_penalty;
  s.presence_penalty = api.sampling.presence_penalty;
  s.answer_start = plen;  // a resubmission appends the answer so far to the prompt; the penalties still see it
  s.logit_bias = api.sampling.logit_bias;
  s.json_schema = std::move(json_schema);
  if (api.uses_tools() && api.tool_choice.mode == gateway::ToolChoice::required) {
    // The answer starts inside a call after "function<sep>": it goes on with one of the
    // offered names and the json fence, so the call names a tool the request has.
    for (const auto& t : api.tools) {
      s.answer_prefixes.push_back(encode_text(st, t.name + "\n```json\n", false));
      s.answer_schemas.push_back(arguments_schema(st, t));  // then its arguments
    }
  } else if (api.uses_tools() && api.tool_choice.mode == gateway::ToolChoice::auto_ && json_schema.empty()) {
    // A call the model starts itself: after each call marker, one of the offered names in
    // either form the parser reads (V3's "function<sep>NAME" and its fence, or "NAME<sep>"),
    // then that function's arguments; free again once they are whole.
    const auto begin = st.tok->token_id(tokenizer::marker::tool_call_begin);
    const auto sep = st.tok->token_id(tokenizer::marker::tool_sep);
    if (begin && sep) {
      s.answer_trigger = {*begin};
      for (const auto& t : api.tools) {
        const std::string args = arguments_schema(st, t);
        std::vector<int32_t> v3 = encode_text(st, "function", false);
        v3.push_back(*sep);
        const auto name = encode_text(st, t.name + "\n```json\n", false);
        v3.insert(v3.end(), name.begin(), name.end());
        s.answer_prefixes.push_back(std::move(v3));
        s.answer_schemas.push_back(args);
        std::vector<int32_t> later = encode_text(st, t.name, false);
        later.push_back(*sep);
        s.answer_prefixes.push_back(std::move(later));
        s.answer_schemas.push_back(args);
      }
    }
  }
  requests_counter(st, route, 200).inc();
  if (origin.responder) {
    if (api.stream) origin.responder->start_stream(200, "text/event-stream");
    if (f.responses) origin.responder->send(f.responses->start(f.api, f.result));
    if (!f.prompt_pending) send_echo(f);
    const auto me = caf::actor_cast<caf::actor>(self);
    origin.responder->on_close([me, id] { caf::anon_send(me, gone_atom::value, id); });
  }
  if (origin.frames) st.frame_ids[FrameKey{origin.frames->conn->id(), origin.frames->rid}] = id;
  if (origin.deadline) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(*origin.deadline - Clock::now());
    self->delayed_send(self, std::max(left, std::chrono::milliseconds(1)), deadline_atom::value, id);
  }
  auto [it, _] = st.inflight.emplace(id, std::move(f));
  submit(self, it->second);
  return std::nullopt;
}

void handle_generate(Self self, HttpCall call, ApiKind kind) {
  auto& st = self->state;
  const std::string route = gateway::route_of(kind);
  if (st.draining) {
    requests_counter(st, route, 503).inc();
    respond_error(*call.responder, ApiError{503, "the server is shutting down; retry on another replica",
                                            "service_unavailable", "", ""});
    return;
  }
  auto parsed = kind == ApiKind::responses ? gateway::parse_response_request(call.request.body)
                                           : gateway::parse_request(call.request.body, kind);
  if (auto* e = std::get_if<ApiError>(&parsed)) {
    requests_counter(st, route, e->status).inc();
    respond_error(*call.responder, *e);
    return;
  }
  auto& api = std::get<ApiRequest>(parsed);
  if (api.n > 1 || !api.more_prompts.empty()) {  // one request per choice, answered as one
    auto children = gateway::fan_out(api);
    auto group = gateway::FanOut::make(call.responder, static_cast<int32_t>(children.size()), api.n,
                                       api.stream && api.include_usage);
    for (size_t i = 0; i < children.size() && !group->finished(); ++i) {
      Origin origin;
      origin.responder = group->child(static_cast<int32_t>(i));
      auto responder = origin.responder;
      if (auto e = admit(self, std::move(children[i]), kind, route, std::move(origin))) respond_error(*responder, *e);
    }
    group->admitted();
    return;
  }
  Origin origin;
  origin.responder = call.responder;
  if (auto e = admit(self, std::move(api), kind, route, std::move(origin))) {
    respond_error(*call.responder, *e);
  }
}

// ---- the frame endpoint ----------------------------------------------------

constexpr const char* kFrameRoute = "frames:generate";

// A GenerateRequest as the API request it means (the same checks as HTTP's).
std::variant<ApiRequest, ApiError> from_frame(const messages::Frame& frame, const std::string& default_model) {
  auto bad = [](const std::string& param, const std::string& message) {
    return ApiError{400, message, "invalid_request_error", param, ""};
  };
  auto v = messages::open<msg::GenerateRequest>(frame);
  if (!v) return bad("", std::string("unreadable GenerateRequest: ") + v.fault().error.what());
  auto r = v->root();
  ApiRequest api;
  api.model = r.hasModel() && r.getModel().size() > 0 ? std::string(r.getModel().cStr()) : default_model;
  auto prompt = r.getPrompt();
  switch (prompt.which()) {
    case msg::GenerateRequest::Prompt::TOKEN_IDS: {
      api.kind = ApiKind::completion;
      std::vector<int32_t> ids;
      for (uint32_t id : prompt.getTokenIds()) {
        if (id > static_cast<uint32_t>(std::numeric_limits<int32_t>::max())) {
          return bad("prompt", "token id " + std::to_string(id) + " is out of range");
        }
        ids.push_back(static_cast<int32_t>(id));
      }
      api.prompt_ids = std::move(ids);
      break;
    }
    case msg::GenerateRequest::Prompt::TEXT:
      api.kind = ApiKind::completion;
      api.prompt_text = messages::text(prompt.getText());
      break;
    case msg::GenerateRequest::Prompt::CHAT: {
      api.kind = ApiKind::chat;
      api.messages = json::array();
      for (auto m : prompt.getChat()) {
        json turn = {{"role", messages::text(m.getRole())}, {"content", messages::text(m.getContent())}};
        if (m.getName().size() > 0) turn["name"] = messages::text(m.getName());
        api.messages.push_back(std::move(turn));
      }
      if (api.messages.empty()) return bad("prompt", "the chat has no messages");
      break;
    }
    default: return bad("prompt", "the prompt is neither token ids, text nor chat");
  }
  api.priority = r.getPriority();
  auto sp = r.getSampling();
  auto& s = api.sampling;
  const float t = sp.getTemperature(), p = sp.getTopP();
  if (!(t >= 0.0f && t <= 2.0f)) return bad("temperature", fmt::format("temperature must be between 0 and 2, got {}", t));
  if (!(p > 0.0f && p <= 1.0f)) return bad("top_p", fmt::format("topP must be in (0, 1], got {}", p));
  if (sp.getTopK() > (1u << 20)) return bad("top_k", fmt::format("topK must be at most {}, got {}", 1u << 20, sp.getTopK()));
  const float mp = sp.getMinP();
  if (!(mp >= 0.0f && mp <= 1.0f)) return bad("min_p", fmt::format("minP must be in [0, 1], got {}", mp));
  const float rp = sp.getRepetitionPenalty(), fp = sp.getFrequencyPenalty(), pp = sp.getPresencePenalty();
  if (!(rp > 0.0f) || !std::isfinite(rp)) {
    return bad("repetition_penalty", fmt::format("repetitionPenalty must be greater than 0, got {}", rp));
  }
  constexpr float kPen = engine::kMaxAbsPenalty, kBias = engine::kMaxAbsLogitBias;
  if (!(std::fabs(fp) <= kPen)) {
    return bad("frequency_penalty", fmt::format("frequencyPenalty must be between -{} and {}, got {}", kPen, kPen, fp));
  }
  if (!(std::fabs(pp) <= kPen)) {
    return bad("presence_penalty", fmt::format("presencePenalty must be between -{} and {}, got {}", kPen, kPen, pp));
  }
  s.temperature = t;
  s.top_p = p;
  s.top_k = static_cast<int32_t>(sp.getTopK());
  s.min_p = mp;
  s.json_schema = messages::text(sp.getJsonSchema());
  if (sp.getRegex().size() > 0) {
    if (!s.json_schema.empty()) return bad("regex", "give one of sampling.jsonSchema, sampling.regex and sampling.ebnf");
    s.json_schema = engine::regex_grammar(messages::text(sp.getRegex()));
    s.grammar_param = "regex";
  }
  if (sp.getEbnf().size() > 0) {
    if (!s.json_schema.empty()) return bad("ebnf", "give one of sampling.jsonSchema, sampling.regex and sampling.ebnf");
    s.json_schema = engine::ebnf_grammar(messages::text(sp.getEbnf()));
    s.grammar_param = "ebnf";
  }
  s.repetition_penalty = rp;
  s.frequency_penalty = fp;
  s.presence_penalty = pp;
  if (sp.getLogitBias().size() > engine::kMaxLogitBiasEntries) {
    return bad("logit_bias", fmt::format("logitBias has {} entries, at most {}", sp.getLogitBias().size(),
                                         engine::kMaxLogitBiasEntries));
  }
  for (auto b : sp.getLogitBias()) {
    const float v = b.getBias();
    if (!(std::fabs(v) <= kBias)) {
      return bad("logit_bias", fmt::format("logitBias for token {} must be between -{} and {}, got {}", b.getToken(),
                                           kBias, kBias, v));
    }
    if (b.getToken() > static_cast<uint32_t>(std::numeric_limits<int32_t>::max())) {
      return bad("logit_bias", fmt::format("logitBias names token {}, out of range", b.getToken()));
    }
    s.logit_bias.emplace_back(static_cast<int32_t>(b.getToken()), v);
  }
  if (sp.getSeed().isValue()) s.seed = sp.getSeed().getValue();
  if (r.getMaxTokens() < 1) return bad("max_tokens", "maxTokens must be at least 1");
  if (r.getMinTokens() > r.getMaxTokens()) return bad("min_tokens", "minTokens must not exceed maxTokens");
  s.max_tokens = r.getMaxTokens();
  s.min_tokens = r.getMinTokens();
  for (auto stop : r.getStopStrings()) s.stop.emplace_back(stop.cStr(), stop.size());
  for (uint32_t id : r.getStopTokenIds()) {
    if (id > static_cast<uint32_t>(std::numeric_limits<int32_t>::max())) {
      return bad("stop_token_ids", "stop token id " + std::to_string(id) + " is out of range");
    }
    s.stop_token_ids.push_back(static_cast<int32_t>(id));
  }
  s.ignore_eos = r.getIgnoreEos();
  api.return_token_ids = r.getReturnTokenIds();
  return api;
}

void frame_generate(Self self, const transport::ConnectionPtr& conn, const messages::Frame& frame) {
  auto& st = self->state;
  const uint64_t rid = frame.request_id();
  auto refuse = [&](ErrorCode code, const std::string& message) {
    spdlog::info("frames: {} request {} refused: {}", conn->peer(), rid, message);
    send_frame_error(conn, rid, code, message, msg::Kind::GENERATE_REQUEST);
  };
  if (rid == 0) return refuse(ErrorCode::invalid_argument, "request id 0 is reserved; number requests from 1");
  if (auto k = st.frame_ids.find(FrameKey{conn->id(), rid}); k != st.frame_ids.end()) {
    // Two requests under one id: the client cannot tell their frames apart,
    // and the Error (about that id) reads as the end of it. So the running one
    // ends too (aborted, its pages freed) and the Error is that id's last frame.
    if (auto it = st.inflight.find(k->second); it != st.inflight.end()) abort_and_forget(self, it, aborted_counter(st));
    return refuse(ErrorCode::invalid_argument,
                  fmt::format("request {} is already running on this connection: both are ended (number each "
                              "request anew)", rid));
  }
  auto parsed = from_frame(frame, st.config.model_name);
  if (auto* e = std::get_if<ApiError>(&parsed)) {
    requests_counter(st, kFrameRoute, e->status).inc();
    return refuse(code_of(*e), e->message);
  }
  ApiRequest api = std::move(std::get<ApiRequest>(parsed));
  const ApiKind kind = api.kind;
  Origin origin;
  origin.frames = FrameSink{conn, rid, api.return_token_ids};
  {
    auto v = messages::open<msg::GenerateRequest>(frame);
    if (const uint64_t ns = v->root().getDeadlineUnixNanos(); ns != 0) {
      const auto now_ns = static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(
                              std::chrono::system_clock::now().time_since_epoch()).count());
      // Compared unsigned: a deadline at or past 2^63 ns (year 2262) read as int64 was negative, refused as
      // passed. Past a year from now it is no deadline at all; before now, one that has passed.
      constexpr uint64_t kYearNs = uint64_t{365} * 24 * 3600 * 1000000000;
      if (ns <= now_ns) {
        origin.deadline = Clock::now();
      } else if (ns - now_ns < kYearNs) {
        origin.deadline = Clock::now() + std::chrono::nanoseconds(static_cast<int64_t>(ns - now_ns));
      }
    }
  }
  if (auto e = admit(self, std::move(api), kind, kFrameRoute, std::move(origin))) refuse(code_of(*e), e->message);
}

// The request a client's Abort / Park / Resume frame names on its connection,
// or inflight.end() after answering not_found.
auto frame_request(GatewayState& st, const transport::ConnectionPtr& conn, const messages::Frame& frame) {
  const uint64_t rid = frame.request_id();
  auto k = st.frame_ids.find(FrameKey{conn->id(), rid});
  auto it = k == st.frame_ids.end() ? st.inflight.end() : st.inflight.find(k->second);
  if (it == st.inflight.end()) {
    send_frame_error(conn, rid, ErrorCode::not_found,
                     fmt::format("{}: request {} is not running on this connection",
                                 messages::kind_name(frame.kind()), rid),
                     frame.kind());
  }
  return it;
}

void frame_abort(Self self, const transport::ConnectionPtr& conn, const messages::Frame& frame) {
  auto& st = self->state;
  auto it = frame_request(st, conn, frame);
  if (it == st.inflight.end()) return;
  send_finish(*it->second.frames, it->second, msg::FinishReason::ABORTED);
  abort_and_forget(self, it, aborted_counter(st));
}

void send_ack(const transport::ConnectionPtr& conn, uint64_t rid, msg::Kind of, const std::string& detail) {
  messages::FrameBuilder<msg::Ack> b;
  b.root().setOfKind(of);
  b.root().setDetail(detail);
  (void)conn->send(b.finish(rid));
}

// Park: the request's state goes to its worker's host tier and its stream
// pauses (Ack first; nothing more until Resume). Non-blocking: the worker
// parks it on its engine thread; tokens sampled before that are held here.
void frame_park(Self self, const transport::ConnectionPtr& conn, const messages::Frame& frame) {
  auto& st = self->state;
  const uint64_t rid = frame.request_id();
  auto it = frame_request(st, conn, frame);
  if (it == st.inflight.end()) return;
  InFlight& f = it->second;
  if (f.client_parked) {
    send_ack(conn, rid, msg::Kind::PARK, "already parked");
    return;
  }
  f.client_parked = true;
  ++f.parks;
  // Without a worker yet (the router is placing it), Assigned parks it there.
  if (f.worker) self->send(f.worker, client_park_atom::value, f.job.id);
  st.metrics->counter("troupe_frame_parks_total", "Requests parked by their frame client").inc();
  send_ack(conn, rid, msg::Kind::PARK, "");
}

// Resume: what was held goes out, then the request continues where it
// stopped (on its worker; the placement hint is not used).
void frame_resume(Self self, const transport::ConnectionPtr& conn, const messages::Frame& frame) {
  auto& st = self->state;
  const uint64_t rid = frame.request_id();
  auto it = frame_request(st, conn, frame);
  if (it == st.inflight.end()) return;
  InFlight& f = it->second;
  if (!f.client_parked) {
    send_frame_error(conn, rid, ErrorCode::invalid_argument,
                     fmt::format("Resume: request {} is not parked", rid), msg::Kind::RESUME);
    return;
  }
  const RequestId id = f.job.id;
  f.client_parked = false;
  st.metrics->counter("troupe_frame_resumes_total", "Requests resumed by their frame client").inc();
  send_ack(conn, rid, msg::Kind::RESUME, "");
  std::vector<TokenBatch> held = std::move(f.held);
  std::optional<Done> done = std::move(f.held_done);
  const bool resubmit = f.resubmit_on_resume;
  f.held.clear();
  f.held_done.reset();
  f.resubmit_on_resume = false;
  for (const auto& b : held) {
    on_tokens(self, b);
    if (!st.inflight.count(id)) return;  // a stop string ended it
  }
  if (done) return on_done(self, *done);
  InFlight& g = st.inflight.at(id);
  if (resubmit) {
    submit(self, g);
  } else if (g.worker) {
    self->send(g.worker, client_resume_atom::value, id);
  }
}

void frame_list_models(Self self, const transport::ConnectionPtr& conn, const messages::Frame& frame) {
  auto& st = self->state;
  messages::FrameBuilder<msg::ModelList> b;
  auto m = b.root().initModels(1);
  m[0].setId(st.config.model_name);
  m[0].setOwnedBy("troupe");
  m[0].setCreated(static_cast<uint64_t>(now_unix()));
  m[0].setMaxContext(static_cast<uint32_t>(st.config.max_model_len));
  m[0].setVocabSize(static_cast<uint32_t>(st.tok->vocab_size()));
  (void)conn->send(b.finish(frame.request_id()));
}

void dispatch_frame(Self self, const transport::ConnectionPtr& conn, const messages::Frame& frame) {
  switch (frame.kind()) {
    case msg::Kind::GENERATE_REQUEST: return frame_generate(self, conn, frame);
    case msg::Kind::ABORT: return frame_abort(self, conn, frame);
    case msg::Kind::LIST_MODELS: return frame_list_models(self, conn, frame);
    case msg::Kind::PARK: return frame_park(self, conn, frame);
    case msg::Kind::RESUME: return frame_resume(self, conn, frame);
    default:
      send_frame_error(conn, frame.request_id(), ErrorCode::unsupported,
                       fmt::format("a client does not send {} frames to the gateway", messages::kind_name(frame.kind())),
                       frame.kind());
  }
}

// A validated frame can still hold a field of the wrong type (Cap'n Proto
// checks lazily, on access): that is the client's error, never the gateway's end.
void handle_frame(Self self, const frames::FrameCall& call) {
  try {
    dispatch_frame(self, call.conn, call.frame);
  } catch (const kj::Exception& e) {
    spdlog::warn("frames: {} request {}: unreadable {}: {}", call.conn->peer(), call.frame.request_id(),
                 messages::kind_name(call.frame.kind()), e.getDescription().cStr());
    send_frame_error(call.conn, call.frame.request_id(), ErrorCode::invalid_argument,
                     fmt::format("unreadable {}: {}", messages::kind_name(call.frame.kind()), e.getDescription().cStr()),
                     call.frame.kind());
  } catch (const std::exception& e) {  // never the gateway's end either
    spdlog::error("frames: {} request {}: handling {} failed: {}", call.conn->peer(), call.frame.request_id(),
                  messages::kind_name(call.frame.kind()), e.what());
    send_frame_error(call.conn, call.frame.request_id(), ErrorCode::internal,
                     fmt::format("internal error while handling {}", messages::kind_name(call.frame.kind())),
                     call.frame.kind());
  }
}

// A connection ended: abort every request it still had running.
void frame_closed(Self self, uint64_t conn) {
  auto& st = self->state;
  std::vector<RequestId> ids;
  for (auto k = st.frame_ids.lower_bound(FrameKey{conn, 0}); k != st.frame_ids.end() && k->first.first == conn; ++k) {
    ids.push_back(k->second);
  }
  for (RequestId id : ids) {
    if (auto it = st.inflight.find(id); it != st.inflight.end()) abort_and_forget(self, it, client_gone_counter(st));
  }
  if (!ids.empty()) spdlog::info("frames: connection {} closed; aborted {} request(s)", conn, ids.size());
}

// The worker named in an admin request's body, or an error already answered.
std::optional<std::string> worker_param(const HttpCall& call) {
  json j = json::parse(call.request.body, nullptr, false);
  if (j.is_object() && j.contains("worker") && j["worker"].is_string()) return j["worker"].get<std::string>();
  respond_error(*call.responder, ApiError{400, R"(send {"worker": NAME}; GET /admin/workers lists them)",
                                          "invalid_request_error", "worker", ""});
  return std::nullopt;
}

void handle_admin(Self self, HttpCall call, const std::string& path) {
  auto& st = self->state;
  const auto& method = call.request.method;
  auto responder = call.responder;
  if (!st.supervisor) {
    respond_error(*responder, ApiError{503, "no supervisor is attached to this gateway", "service_unavailable", "", ""});
    return;
  }
  if (path == "/admin/workers" && method == "GET") {
    self->request(st.router, std::chrono::seconds(5), workers_atom::value)
        .then(
            [=](const std::vector<WorkerLoad>& ws) {
              json list = json::array();
              for (const auto& w : ws) {
                list.push_back({{"name", w.name}, {"role", to_string(w.role)}, {"running", w.running},
                                {"waiting", w.waiting}, {"parked", w.parked}, {"kv_use", w.kv_use},
                                {"leaked_pages", w.leaked_pages}, {"draining", w.draining},
                                {"largest", w.largest}, {"largest_tokens", w.largest_tokens},
                                {"largest_share", w.largest_share}, {"long_tail_parked", w.parked_ids}});
              }
              responder->respond(200, "application/json", gateway::dump_json(json{{"workers", list}}));
            },
            [=](caf::error& e) {
              respond_error(*responder, ApiError{503, "the router did not answer: " + caf::to_string(e),
                                                 "service_unavailable", "", ""});
            });
    return;
  }
  const bool drain = path == "/admin/drain", crash = path == "/admin/crash" && st.config.test_hooks;
  if ((drain || crash) && method == "POST") {
    auto name = worker_param(call);
    if (!name) return;
    if (crash) {
      spdlog::warn("admin: crashing worker {} (test hook)", *name);
      self->send(st.supervisor, crash_atom::value, *name);
      responder->respond(200, "application/json", gateway::dump_json(json{{"crashed", *name}}));
      return;
    }
    self->request(st.supervisor, std::chrono::seconds(5), drain_atom::value, *name)
        .then(
            [=](bool started) {
              if (started) {
                responder->respond(200, "application/json", gateway::dump_json(json{{"draining", *name}}));
              } else {
                respond_error(*responder, ApiError{404, "no live worker named '" + *name + "'",
                                                   "invalid_request_error", "worker", ""});
              }
            },
            [=](caf::error& e) {
              respond_error(*responder, ApiError{503, "the supervisor did not answer: " + caf::to_string(e),
                                                 "service_unavailable", "", ""});
            });
    return;
  }
  if (path == "/admin/scale" && method == "GET") {
    self->request(st.supervisor, std::chrono::seconds(5), scale_atom::value)
        .then([=](const std::string& body) { responder->respond(200, "application/json", body); },
              [=](caf::error& e) {
                respond_error(*responder, ApiError{503, "the supervisor did not answer: " + caf::to_string(e),
                                                   "service_unavailable", "", ""});
              });
    return;
  }
  if (path == "/admin/scale" && method == "POST") {
    json j = json::parse(call.request.body, nullptr, false);
    if (!j.is_object() || !j.contains("workers") || !j["workers"].is_number_integer() ||
        (j.contains("node") && !j["node"].is_string())) {
      respond_error(*responder, ApiError{400, R"(send {"node": NAME, "workers": N}; GET /admin/scale lists the nodes)",
                                         "invalid_request_error", "workers", ""});
      return;
    }
    const std::string node = j.value("node", std::string());
    const int64_t workers = j["workers"].get<int64_t>();
    if (workers < 0 || workers > 1024) {
      respond_error(*responder, ApiError{400, "workers must be between 0 and 1024", "invalid_request_error", "workers", ""});
      return;
    }
    self->request(st.supervisor, std::chrono::seconds(5), scale_atom::value, node, static_cast<int32_t>(workers))
        .then(
            [=](const std::string& why) {
              if (why.empty()) {
                responder->respond(200, "application/json", gateway::dump_json(json{{"node", node}, {"workers", workers}}));
              } else {
                respond_error(*responder, ApiError{400, why, "invalid_request_error", "workers", ""});
              }
            },
            [=](caf::error& e) {
              respond_error(*responder, ApiError{503, "the supervisor did not answer: " + caf::to_string(e),
                                                 "service_unavailable", "", ""});
            });
    return;
  }
  respond_error(*responder, ApiError{404, "no route " + method + " " + path, "invalid_request_error", "", ""});
}

// vLLM's /tokenize and /detokenize: the ids a prompt (text, or chat messages through the
// template) becomes exactly as a completion request would feed it, and the text of ids.
void handle_tokenize(Self self, const HttpCall& call, bool detokenize) {
  auto& st = self->state;
  auto bad = [&](const std::string& param, const std::string& message) {
    respond_error(*call.responder, ApiError{400, message, "invalid_request_error", param, ""});
  };
  json j = json::parse(call.request.body, nullptr, false);
  if (j.is_discarded() || !j.is_object()) return bad("", "request body must be a JSON object");
  if (j.contains("model") && !j["model"].is_null()) {
    if (!j["model"].is_string()) return bad("model", "'model' must be a string");
    if (j["model"] != st.config.model_name) {
      respond_error(*call.responder, model_not_found(st, j["model"].get<std::string>()));
      return;
    }
  }
  try {
    if (detokenize) {
      if (!j.contains("tokens") || !j["tokens"].is_array()) return bad("tokens", "'tokens' must be a list of token ids");
      std::vector<int32_t> ids;
      for (const auto& t : j["tokens"]) {
        if (!t.is_number_integer() || t.get<int64_t>() < 0 || t.get<int64_t>() >= st.tok->vocab_size()) {
          return bad("tokens", "'tokens' must hold ids in [0, " + std::to_string(st.tok->vocab_size()) + ")");
        }
        ids.push_back(t.get<int32_t>());
      }
      call.responder->respond(200, "application/json", gateway::dump_json(json{{"prompt", st.tok->decode(ids)}}));
      return;
    }
    std::vector<int32_t> ids;
    if (j.contains("messages")) {
      if (!j["messages"].is_array() || j["messages"].empty()) return bad("messages", "'messages' must be a non-empty list");
      const bool generation_prompt = !j.contains("add_generation_prompt") || !j["add_generation_prompt"].is_boolean() ||
                                     j["add_generation_prompt"].get<bool>();  // as a chat completion renders it
      ApiRequest tools;  // tool definitions render into the prompt as a chat completion's do
      if (auto e = gateway::parse_tools(j, tools)) {
        respond_error(*call.responder, *e);
        return;
      }
      ids = encode_messages(st, j["messages"], generation_prompt, &tools);
    } else if (j.contains("prompt") && j["prompt"].is_string()) {
      const bool special = !j.contains("add_special_tokens") || !j["add_special_tokens"].is_boolean() ||
                           j["add_special_tokens"].get<bool>();
      ids = encode_text(st, j["prompt"].get<std::string>(), special);
    } else {
      return bad("prompt", "give 'prompt' (a string) or 'messages'");
    }
    json out = {{"tokens", ids}, {"count", ids.size()}, {"max_model_len", st.config.max_model_len}};
    call.responder->respond(200, "application/json", gateway::dump_json(out));
  } catch (const Error& e) {
    respond_error(*call.responder, gateway::to_request_error(e, j.contains("messages") ? "messages" : "prompt"));
  }
}

void handle(Self self, HttpCall call) {
  auto& st = self->state;
  const auto& req = call.request;
  const std::string path = req.target.substr(0, req.target.find('?'));
  if (path == "/health/live") {
    call.responder->respond(200, "application/json", R"({"status": "live"})");
    return;
  }
  if (path == "/health") {
    auto responder = call.responder;
    if (st.config.not_ready) {
      if (std::string why = st.config.not_ready(); !why.empty()) {
        responder->respond(503, "application/json", gateway::dump_json(json({{"status", "unavailable"}, {"reason", why}})));
        return;
      }
    }
    const int64_t need = st.config.min_workers_ready;
    if (st.draining) {
      responder->respond(503, "application/json", R"({"status": "draining"})");
      return;
    }
    self->request(st.router, std::chrono::seconds(2), workers_atom::value)
        .then(
            [=](const std::vector<WorkerLoad>& ws) {
              int64_t ready = 0;
              for (const auto& w : ws) ready += w.draining ? 0 : 1;
              json j = {{"status", ready >= need ? "ok" : "starting"}, {"workers", ready}};
              responder->respond(ready >= need ? 200 : 503, "application/json", gateway::dump_json(j));
            },
            [=](caf::error&) { responder->respond(503, "application/json", R"({"status": "router not answering"})"); });
    return;
  }
  if (path == "/metrics") {
    call.responder->respond(200, "text/plain; version=0.0.4", st.metrics->render());
    return;
  }
  const bool tokenizing = path == "/tokenize" || path == "/detokenize";
  if ((path.rfind("/v1/", 0) == 0 || path.rfind("/admin/", 0) == 0 || tokenizing) && !st.config.api_key.empty()) {
    auto h = req.headers.find("authorization");
    if (h == req.headers.end() || h->second != "Bearer " + st.config.api_key) {
      requests_counter(st, known_route(path), 401).inc();
      respond_error(*call.responder, ApiError{401, "Incorrect or missing API key: send 'Authorization: Bearer <key>'.",
                                              "invalid_request_error", "", "invalid_api_key"});
      return;
    }
  }
  if (path.rfind("/admin/", 0) == 0) {
    handle_admin(self, std::move(call), path);
    return;
  }
  if (tokenizing) {
    if (req.method != "POST") {
      respond_error(*call.responder, ApiError{405, "use POST for " + path, "invalid_request_error", "", ""},
                    {{"allow", "POST"}});
      return;
    }
    handle_tokenize(self, call, path == "/detokenize");
    return;
  }
  if (path.rfind("/v1/models/", 0) == 0 && req.method == "GET") {  // the OpenAI SDK's models.retrieve
    const std::string id = path.substr(std::string("/v1/models/").size());
    if (id != st.config.model_name) {
      respond_error(*call.responder, model_not_found(st, id));
      return;
    }
    call.responder->respond(200, "application/json", gateway::dump_json(model_object(st)));
    return;
  }
  if ((path == "/v1/models" || path.rfind("/v1/models/", 0) == 0) && req.method != "GET") {
    respond_error(*call.responder, ApiError{405, "use GET for " + path, "invalid_request_error", "", ""},
                  {{"allow", "GET"}});
    return;
  }
  if (path == "/v1/models" && req.method == "GET") {
    json j = {{"object", "list"}, {"data", json::array({model_object(st)})}};
    call.responder->respond(200, "application/json", gateway::dump_json(j));
    return;
  }
  for (const ApiKind kind : {ApiKind::completion, ApiKind::chat, ApiKind::responses}) {
    if (path != gateway::route_of(kind)) continue;
    if (req.method != "POST") {
      respond_error(*call.responder, ApiError{405, "use POST for " + path, "invalid_request_error", "", ""},
                    {{"allow", "POST"}});
      return;
    }
    handle_generate(self, std::move(call), kind);
    return;
  }
  respond_error(*call.responder, ApiError{404, "no route " + req.method + " " + path, "invalid_request_error", "", ""});
}

caf::behavior gateway_actor(Self self, GatewayConfig config, std::shared_ptr<const tokenizer::Tokenizer> tok,
                            caf::actor router, std::shared_ptr<MetricsRegistry> metrics) {
  auto& st = self->state;
  st.config = std::move(config);
  st.tok = std::move(tok);
  st.router = router;
  st.metrics = std::move(metrics);
  // The HTTP server stops when the state is destroyed (CAF 0.17: in on_exit,
  // before attached functors run, so none may touch the state).
  self->set_down_handler([=](caf::down_msg& dm) {
    auto& s = self->state;
    s.watched.erase(dm.source);
    std::vector<RequestId> lost;
    for (auto& [id, f] : s.inflight) {
      if (f.worker && f.worker.address() == dm.source) lost.push_back(id);
    }
    for (RequestId id : lost) retry(self, id, "worker lost");
  });
  return {
      [=](server_atom, std::shared_ptr<gateway::HttpServer> server) { self->state.server = std::move(server); },
      [=](admin_atom, caf::actor supervisor) { self->state.supervisor = std::move(supervisor); },
      [=](drain_atom) -> int64_t {
        if (!self->state.draining) spdlog::info("gateway: draining ({} requests in flight)", self->state.inflight.size());
        self->state.draining = true;
        return static_cast<int64_t>(self->state.inflight.size());
      },
      [=](HttpCall call) {
        // An exception here would end the gateway actor and with it every request: answer 500 instead.
        auto responder = call.responder;
        try {
          handle(self, std::move(call));
        } catch (const std::exception& e) {
          spdlog::error("gateway: handling a request failed: {}", e.what());
          respond_error(*responder, ApiError{500, "internal error while handling the request", "internal_error", "", ""});
        }
      },
      [=](const Assigned& a) {
        auto& s = self->state;
        auto it = s.inflight.find(a.id);
        if (it == s.inflight.end()) {  // finished or gone meanwhile
          self->send(a.worker, abort_atom::value, a.id);
          return;
        }
        // Parked by its client before it was placed, or moved (drain, handoff)
        // while parked: take_over parks it on the worker that has it now.
        take_over(self, it->second, a.id, a.worker, a.from_index);
      },
      [=](const TokenBatch& b) { on_tokens(self, b); },
      [=](const Done& d) { on_done(self, d); },
      [=](const Failed& f) {
        if (f.code == ErrorCode::unavailable) {
          retry(self, f.id, f.message);
          return;
        }
        ApiError e = gateway::to_api_error(Error(f.code, f.message));
        fail(self, f.id, e);
      },
      [=](gone_atom, RequestId id) {  // the client went away: free everything the request holds
        auto& s = self->state;
        if (auto it = s.inflight.find(id); it != s.inflight.end()) abort_and_forget(self, it, client_gone_counter(s));
      },
      [=](const frames::FrameCall& call) { handle_frame(self, call); },
      [=](const frames::FrameClosed& c) { frame_closed(self, c.conn); },
      [=](fserver_atom, std::shared_ptr<frames::Front> front) { self->state.frame_front = std::move(front); },
      [=](gap_atom, RequestId id, int attempt) {  // a Done still waits for tokens that never came
        auto& s = self->state;
        auto it = s.inflight.find(id);
        if (it == s.inflight.end() || !it->second.early_done || it->second.attempts != attempt) return;
        spdlog::warn("gateway: request {} finished at token {} but only {} arrived in {} ms; running it again from there",
                     id, it->second.early_done->end_index, it->second.result.token_ids.size(),
                     s.config.token_gap_timeout.count());
        retry(self, id, "tokens lost between processes");
      },
      [=](deadline_atom, RequestId id) {
        auto& s = self->state;
        auto it = s.inflight.find(id);
        if (it == s.inflight.end()) return;
        if (it->second.worker) self->send(it->second.worker, abort_atom::value, id);
        fail(self, id, ApiError{504, "the request's deadline passed", "timeout", "", ""});
      },
  };
}

}  // namespace

caf::actor spawn_gateway(caf::actor_system& sys, GatewayConfig config,
                         std::shared_ptr<const tokenizer::Tokenizer> tokenizer, caf::actor router,
                         std::shared_ptr<MetricsRegistry> metrics, uint16_t* port_out, uint16_t* frame_port_out) {
  auto http = config.http;
  const auto frame_port = config.frame_port;
  const auto frame_host = config.frame_host;
  auto gw = sys.spawn(gateway_actor, std::move(config), std::move(tokenizer), std::move(router), std::move(metrics));
  std::shared_ptr<gateway::HttpServer> server;
  try {
    server = std::make_shared<gateway::HttpServer>(
        http, [gw](gateway::HttpRequest req, std::shared_ptr<gateway::Responder> r) {
          caf::anon_send(gw, HttpCall{std::move(req), std::move(r)});
        });
  } catch (...) {
    caf::anon_send_exit(gw, caf::exit_reason::user_shutdown);
    throw;
  }
  if (port_out != nullptr) *port_out = server->port();
  caf::anon_send(gw, server_atom::value, std::move(server));
  if (frame_port) {
    auto front = std::make_shared<frames::Front>();
    front->handler = std::make_unique<frames::Endpoint>(gw);
    transport::FrameServerOptions fo;
    fo.host = frame_host;
    fo.port = *frame_port;
    front->server = std::make_unique<transport::FrameServer>(fo, *front->handler);
    if (auto st = front->server->start(); !st) {
      caf::anon_send_exit(gw, caf::exit_reason::user_shutdown);
      throw Error(st.error().code(), fmt::format("frame endpoint on {}:{}: {}", frame_host, *frame_port, st.error().what()));
    }
    if (frame_port_out != nullptr) *frame_port_out = front->server->port();
    caf::anon_send(gw, fserver_atom::value, std::move(front));
  }
  return gw;
}

void attach_supervisor(const caf::actor& gateway, const caf::actor& supervisor) {
  caf::anon_send(gateway, admin_atom::value, supervisor);
}

}  // namespace troupe::actors
