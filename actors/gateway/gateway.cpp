#include "actors/gateway/gateway.hpp"

#include <spdlog/spdlog.h>

#include <chrono>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>

#include "actors/gateway/openai.hpp"
#include "model/tokenizer/openai_messages.hpp"
#include "model/tokenizer/stop_strings.hpp"
#include "model/tokenizer/stream_decoder.hpp"

CAF_ALLOW_UNSAFE_MESSAGE_TYPE(std::shared_ptr<troupe::gateway::HttpServer>)

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

struct InFlight {
  ApiRequest api;
  ApiResult result;
  std::shared_ptr<gateway::Responder> responder;
  std::unique_ptr<tokenizer::StreamDecoder> decoder;
  std::unique_ptr<tokenizer::StopStrings> stops;
  Job job;                      // as first submitted
  caf::actor worker;            // the worker streaming it now
  int attempts = 0;
  Clock::time_point start;
  Clock::time_point last_token;
  bool first = true;
};

struct GatewayState {
  static inline const char* name = "gateway";
  GatewayConfig config;
  std::shared_ptr<const tokenizer::Tokenizer> tok;
  std::shared_ptr<gateway::HttpServer> server;
  caf::actor router;
  std::shared_ptr<MetricsRegistry> metrics;
  std::map<RequestId, InFlight> inflight;
  RequestId next_id = 1;
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
  f.result.text += tail;
  f.result.finish_reason = finish_reason == "abort" ? "abort" : finish_reason;
  if (f.api.stream) {
    if (!tail.empty()) f.responder->send(gateway::stream_delta(f.api, f.result, tail, {}, f.first));
    f.responder->send(gateway::stream_finish(f.api, f.result));
    f.responder->end();
  } else {
    f.responder->respond(200, "application/json", gateway::response_body(f.api, f.result));
  }
  st.metrics->histogram("troupe_e2e_seconds", "Request latency, admission to last token",
                        MetricsRegistry::latency_buckets())
      .observe(std::chrono::duration<double>(Clock::now() - f.start).count());
  st.metrics->counter("troupe_requests_finished_total", "Requests finished by reason", {{"reason", finish_reason}}).inc();
  st.inflight.erase(it);
}

void fail(Self self, RequestId id, const ApiError& e) {
  auto& st = self->state;
  auto it = st.inflight.find(id);
  if (it == st.inflight.end()) return;
  InFlight& f = it->second;
  if (f.api.stream) {
    f.responder->send(gateway::stream_error(e));
    f.responder->end();
  } else {
    respond_error(*f.responder, e);
  }
  st.metrics->counter("troupe_requests_finished_total", "Requests finished by reason", {{"reason", "error"}}).inc();
  st.inflight.erase(it);
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
  if (++f.attempts > st.config.max_attempts) {
    fail(self, id, ApiError{503, "request failed after " + std::to_string(f.attempts) + " attempts: " + why,
                            "service_unavailable", "", ""});
    return;
  }
  spdlog::info("gateway: request {} resubmitted ({}; {} tokens already streamed)", id, why, f.result.token_ids.size());
  st.metrics->counter("troupe_resubmits_total", "Requests resubmitted after a worker loss").inc();
  f.worker = nullptr;
  submit(self, f);
}

void watch(Self self, const caf::actor& worker) {
  if (!worker) return;
  if (self->state.watched.insert(worker.address()).second) self->monitor(worker);
}

void on_tokens(Self self, const TokenBatch& b) {
  auto& st = self->state;
  auto it = st.inflight.find(b.id);
  if (it == st.inflight.end()) return;
  InFlight& f = it->second;
  if (b.worker && f.worker != b.worker) {  // PD handoff: the decode worker streams now
    f.worker = b.worker;
    watch(self, b.worker);
  }
  std::string delta;
  std::vector<int32_t> ids;
  bool stopped = false;
  for (size_t i = 0; i < b.tokens.size() && !stopped; ++i) {
    const int64_t index = b.index + static_cast<int64_t>(i);
    if (index != static_cast<int64_t>(f.result.token_ids.size())) continue;  // already streamed (a resubmission)
    const int32_t tok = b.tokens[i];
    f.result.token_ids.push_back(tok);
    ids.push_back(tok);
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
  if (ids.empty()) return;
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
  if (f.api.stream && (!delta.empty() || f.api.return_token_ids)) {
    f.responder->send(gateway::stream_delta(f.api, f.result, delta, ids, f.first));
    f.first = false;
  }
  if (stopped) {
    if (f.worker) self->send(f.worker, abort_atom::value, b.id);
    finish(self, b.id, "stop");
  }
}

void handle_generate(Self self, HttpCall call, ApiKind kind) {
  auto& st = self->state;
  const std::string route = kind == ApiKind::chat ? "/v1/chat/completions" : "/v1/completions";
  if (st.draining) {
    requests_counter(st, route, 503).inc();
    respond_error(*call.responder, ApiError{503, "the server is shutting down; retry on another replica",
                                            "service_unavailable", "", ""});
    return;
  }
  auto parsed = gateway::parse_request(call.request.body, kind);
  if (auto* e = std::get_if<ApiError>(&parsed)) {
    requests_counter(st, route, e->status).inc();
    respond_error(*call.responder, *e);
    return;
  }
  ApiRequest api = std::move(std::get<ApiRequest>(parsed));
  if (api.model != st.config.model_name) {
    ApiError e{404, "The model '" + api.model + "' does not exist; this server serves '" + st.config.model_name + "'.",
               "invalid_request_error", "model", "model_not_found"};
    requests_counter(st, route, 404).inc();
    respond_error(*call.responder, e);
    return;
  }
  std::vector<int32_t> prompt;
  try {
    if (kind == ApiKind::chat) {
      auto messages = tokenizer::messages_from_json(api.messages);
      tokenizer::ChatOptions opts;
      opts.add_generation_prompt = api.add_generation_prompt;
      prompt = st.tok->encode_chat(messages, opts);
    } else if (api.prompt_ids) {
      prompt = *api.prompt_ids;
    } else {
      tokenizer::EncodeOptions opts;
      opts.add_bos = st.tok->config().add_bos_token;
      prompt = st.tok->encode(*api.prompt_text, opts);
    }
  } catch (const Error& e) {
    auto ae = gateway::to_api_error(e);
    if (ae.status >= 500) ae.status = 400;
    requests_counter(st, route, ae.status).inc();
    respond_error(*call.responder, ae);
    return;
  }
  const int64_t vocab = st.tok->vocab_size();
  for (int32_t id : prompt) {
    if (id >= vocab) {
      ApiError e{400, "token id " + std::to_string(id) + " is out of range for a vocabulary of " + std::to_string(vocab),
                 "invalid_request_error", "prompt", ""};
      requests_counter(st, route, 400).inc();
      respond_error(*call.responder, e);
      return;
    }
  }
  const auto plen = static_cast<int64_t>(prompt.size());
  if (plen == 0) {
    requests_counter(st, route, 400).inc();
    respond_error(*call.responder, ApiError{400, "the prompt is empty", "invalid_request_error", "prompt", ""});
    return;
  }
  int64_t max_tokens = api.sampling.max_tokens.value_or(kind == ApiKind::chat ? st.config.max_model_len - plen : 16);
  if (plen + std::max<int64_t>(max_tokens, 1) > st.config.max_model_len || max_tokens < 1) {
    ApiError e{400,
               "This model's maximum context length is " + std::to_string(st.config.max_model_len) +
                   " tokens. However, you requested " + std::to_string(plen + std::max<int64_t>(max_tokens, 1)) +
                   " tokens (" + std::to_string(plen) + " in the prompt, " + std::to_string(max_tokens) +
                   " for the completion). Please reduce the prompt or max_tokens.",
               "invalid_request_error", "max_tokens", "context_length_exceeded"};
    requests_counter(st, route, 400).inc();
    respond_error(*call.responder, e);
    return;
  }

  const RequestId id = st.next_id++;
  InFlight f;
  f.api = api;
  f.responder = call.responder;
  f.decoder = std::make_unique<tokenizer::StreamDecoder>(*st.tok);
  f.stops = std::make_unique<tokenizer::StopStrings>(api.sampling.stop);
  f.result.id = (kind == ApiKind::chat ? "chatcmpl-" : "cmpl-") + std::to_string(id);
  f.result.created = now_unix();
  f.result.model = st.config.model_name;
  f.result.prompt_ids = prompt;
  if (api.echo && api.prompt_text) f.result.text = *api.prompt_text;
  f.start = f.last_token = Clock::now();
  Job& job = f.job;
  job.id = id;
  job.prompt = std::move(prompt);
  job.prompt_tokens = plen;
  job.reply_to = caf::actor_cast<caf::actor>(self);
  auto& s = job.sampling;
  s.temperature = api.sampling.temperature;
  s.top_p = api.sampling.top_p;
  s.top_k = std::max(0, api.sampling.top_k);
  s.seed = api.sampling.seed;
  s.max_tokens = static_cast<int32_t>(max_tokens);
  s.min_tokens = static_cast<int32_t>(std::min<int64_t>(api.sampling.min_tokens, max_tokens));
  s.stop_ids = api.sampling.stop_token_ids;
  s.ignore_eos = api.sampling.ignore_eos;
  requests_counter(st, route, 200).inc();
  if (api.stream) call.responder->start_stream(200, "text/event-stream");
  const auto me = caf::actor_cast<caf::actor>(self);
  call.responder->on_close([me, id] { caf::anon_send(me, gone_atom::value, id); });
  auto [it, _] = st.inflight.emplace(id, std::move(f));
  submit(self, it->second);
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
              responder->respond(200, "application/json", json{{"workers", list}}.dump());
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
      responder->respond(200, "application/json", json{{"crashed", *name}}.dump());
      return;
    }
    self->request(st.supervisor, std::chrono::seconds(5), drain_atom::value, *name)
        .then(
            [=](bool started) {
              if (started) {
                responder->respond(200, "application/json", json{{"draining", *name}}.dump());
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
  respond_error(*responder, ApiError{404, "no route " + method + " " + path, "invalid_request_error", "", ""});
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
              responder->respond(ready >= need ? 200 : 503, "application/json", j.dump());
            },
            [=](caf::error&) { responder->respond(503, "application/json", R"({"status": "router not answering"})"); });
    return;
  }
  if (path == "/metrics") {
    call.responder->respond(200, "text/plain; version=0.0.4", st.metrics->render());
    return;
  }
  if ((path.rfind("/v1/", 0) == 0 || path.rfind("/admin/", 0) == 0) && !st.config.api_key.empty()) {
    auto h = req.headers.find("authorization");
    if (h == req.headers.end() || h->second != "Bearer " + st.config.api_key) {
      requests_counter(st, path, 401).inc();
      respond_error(*call.responder, ApiError{401, "Incorrect or missing API key: send 'Authorization: Bearer <key>'.",
                                              "invalid_request_error", "", "invalid_api_key"});
      return;
    }
  }
  if (path.rfind("/admin/", 0) == 0) {
    handle_admin(self, std::move(call), path);
    return;
  }
  if (path == "/v1/models" && req.method == "GET") {
    json j = {{"object", "list"},
              {"data", json::array({{{"id", st.config.model_name},
                                     {"object", "model"},
                                     {"created", now_unix()},
                                     {"owned_by", "troupe"},
                                     {"max_model_len", st.config.max_model_len}}})}};
    call.responder->respond(200, "application/json", j.dump());
    return;
  }
  if (path == "/v1/completions" || path == "/v1/chat/completions") {
    if (req.method != "POST") {
      respond_error(*call.responder, ApiError{405, "use POST for " + path, "invalid_request_error", "", ""},
                    {{"allow", "POST"}});
      return;
    }
    handle_generate(self, std::move(call), path == "/v1/chat/completions" ? ApiKind::chat : ApiKind::completion);
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
      [=](HttpCall call) { handle(self, std::move(call)); },
      [=](const Assigned& a) {
        auto& s = self->state;
        auto it = s.inflight.find(a.id);
        if (it == s.inflight.end()) {  // finished or gone meanwhile
          self->send(a.worker, abort_atom::value, a.id);
          return;
        }
        it->second.worker = a.worker;
        watch(self, a.worker);
      },
      [=](const TokenBatch& b) { on_tokens(self, b); },
      [=](const Done& d) {
        auto& s = self->state;
        auto it = s.inflight.find(d.id);
        if (it == s.inflight.end()) return;
        it->second.result.cached_tokens = std::max(it->second.result.cached_tokens, d.usage.cached_tokens);
        finish(self, d.id, d.reason == engine::FinishReason::length ? "length"
                           : d.reason == engine::FinishReason::abort ? "abort"
                                                                      : "stop");
      },
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
        auto it = s.inflight.find(id);
        if (it == s.inflight.end()) return;
        if (it->second.worker) self->send(it->second.worker, abort_atom::value, id);
        s.metrics->counter("troupe_client_aborts_total", "Requests aborted because the client went away").inc();
        s.inflight.erase(it);
      },
  };
}

}  // namespace

caf::actor spawn_gateway(caf::actor_system& sys, GatewayConfig config,
                         std::shared_ptr<const tokenizer::Tokenizer> tokenizer, caf::actor router,
                         std::shared_ptr<MetricsRegistry> metrics, uint16_t* port_out) {
  auto http = config.http;
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
  return gw;
}

void attach_supervisor(const caf::actor& gateway, const caf::actor& supervisor) {
  caf::anon_send(gateway, admin_atom::value, supervisor);
}

}  // namespace troupe::actors
