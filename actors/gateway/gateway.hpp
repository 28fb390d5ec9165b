// The gateway actor: the OpenAI-compatible HTTP API in front of the router.
// It owns every request it admits: tokenizes the prompt (chat template),
// streams text as tokens arrive (incremental detokenization, stop strings),
// aborts on client disconnect, and resubmits a request whose worker was lost
// (prompt plus the tokens already streamed; sampling is position-seeded, so
// the continuation is the same), so a worker failure is invisible to clients.
#pragma once

#include <caf/all.hpp>

#include <functional>
#include <memory>
#include <optional>
#include <string>

#include "actors/gateway/http_server.hpp"
#include "actors/protocol.hpp"
#include "base/metrics.hpp"
#include "model/tokenizer/tokenizer.hpp"

namespace troupe::actors {

struct GatewayConfig {
  std::string model_name = "troupe";  // the id clients send as "model"
  int64_t max_model_len = 4096;       // prompt + generated tokens
  std::string api_key;                // empty: no authentication
  gateway::HttpOptions http;
  int max_attempts = 4;               // resubmissions after a worker loss
  int64_t min_workers_ready = 1;      // /health is 200 once this many workers registered
  // Extra readiness condition (troupe run: peers connected, weights loaded):
  // returns why the process is not ready, "" when it is. Empty function: none.
  std::function<std::string()> not_ready;
  bool test_hooks = false;            // POST /admin/crash: fault injection (tests only)
  // A Done whose tokens did not all arrive waits this long for them (they
  // come from another process: PD's first token), then the request runs again
  // from what the client has.
  std::chrono::milliseconds token_gap_timeout{10000};
  // The frame endpoint (docs/messages.md): troupe frames over TCP on
  // frame_host:frame_port (0: any free port). Unset: no frame endpoint.
  std::optional<uint16_t> frame_port;
  std::string frame_host = "127.0.0.1";
};

struct HttpCall {
  gateway::HttpRequest request;
  std::shared_ptr<gateway::Responder> responder;
};

// Spawns the gateway and starts its HTTP server (and, with config.frame_port,
// its frame endpoint); `port_out` / `frame_port_out`, when given, get the
// bound ports once listening. Throws troupe::Error when a port is taken.
//
// The frame endpoint speaks the frames of docs/messages.md to the same
// gateway: GenerateRequest (token ids, text or chat; tokenized, templated,
// stop strings, resubmitted on worker loss like HTTP requests) is answered
// with TokenChunk frames and a Finish, or an Error; Abort ends a request
// (Finish{aborted}); ListModels; a closed connection aborts its requests.
// Park pauses a request (its KV goes to its worker's host tier; Ack, then
// silence) and Resume continues it (Ack, then the stream goes on with the
// tokens an unparked run gives); both answer Error{notFound} for an unknown
// id, Resume Error{invalidArgument} for a request that is not parked.
// Admin routes (behind the API key like /v1/*), answered with the supervisor's help:
//   GET  /admin/workers                   the router's view of every worker (load, role, draining)
//   POST /admin/drain {"worker": NAME}    remove a worker: fence, migrate its requests, stop it
//   POST /admin/crash {"worker": NAME}    make a worker fail (only with test_hooks)
//   GET  /admin/scale                     the worker groups and their slots
//   POST /admin/scale {"node": NAME, "workers": N}   grow or shrink a group to N workers (drains remove)
// Without a supervisor attached they answer 503.
//
// The gateway also answers (drain_atom) -> int64_t: from then on new requests
// get 503 and /health says "draining"; the reply is how many are in flight.
caf::actor spawn_gateway(caf::actor_system& sys, GatewayConfig config,
                         std::shared_ptr<const tokenizer::Tokenizer> tokenizer, caf::actor router,
                         std::shared_ptr<MetricsRegistry> metrics, uint16_t* port_out = nullptr,
                         uint16_t* frame_port_out = nullptr);

void attach_supervisor(const caf::actor& gateway, const caf::actor& supervisor);

}  // namespace troupe::actors

CAF_ALLOW_UNSAFE_MESSAGE_TYPE(troupe::actors::HttpCall)
