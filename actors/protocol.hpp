// What the actors say to each other inside a process. Messages that cross a
// process are the same structs, carried by the node actor as Cap'n Proto
// frames (actors/node). Every request is named by a RequestId the gateway
// assigns; tokens are numbered by their index in the request's output, so a
// request resumed elsewhere can never deliver a token twice.
#pragma once

#include <caf/all.hpp>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "base/error.hpp"
#include "engine/engine.hpp"
#include "engine/request.hpp"

namespace troupe::actors {

using RequestId = uint64_t;

enum class WorkerRole : uint8_t { colocated, prefill, decode };
const char* to_string(WorkerRole r);

// Run (or continue) one request. The worker streams TokenBatch messages and
// ends with Done or Failed, all to `reply_to`.
struct Job {
  RequestId id = 0;
  std::vector<int32_t> prompt;         // what to feed: the original prompt plus tokens already streamed
  int64_t prompt_tokens = 0;           // the original prompt's length (usage)
  int64_t generated_before = 0;        // tokens already streamed to the client (index of the next one)
  engine::SamplingParams sampling;     // max/min tokens already reduced by generated_before
  int32_t priority = 0;
  caf::actor reply_to;                 // the gateway that owns the request
  // Disaggregation: a prefill worker parks the request after its first token and
  // hands the state to `decode_to`.
  caf::actor decode_to;
  // Migration / handoff: continue from this state instead of computing the prompt.
  std::shared_ptr<const engine::SequenceImage> image;
  int32_t attempt = 0;                 // resubmissions after a worker was lost
  int32_t logprobs = -1;               // alternatives per token to report with its logprob (0..20); -1: none
  // The prompt's logprobs (completions' echo): each prompt token's after the
  // first, with this many alternatives (0..20); -1: none. Reported in TokenBatch
  // messages without tokens, before the first token.
  int32_t prompt_logprobs = -1;
};

// A sampled token's log-probability (log-softmax of the raw logits) and the
// most likely alternatives, best first.
struct TokenLogprob {
  float logprob = 0;
  std::vector<int32_t> top_ids;
  std::vector<float> top_logprobs;
};

// Tokens of one request, in output order starting at `index`.
struct TokenBatch {
  RequestId id = 0;
  int64_t index = 0;
  std::vector<int32_t> tokens;
  caf::actor worker;
  std::vector<TokenLogprob> logprobs;  // one per token when the job asked for them
  // Job::prompt_logprobs: the logprobs of prompt tokens prompt_index, prompt_index + 1, ...
  // (a batch carries these or tokens, not both).
  int64_t prompt_index = 0;
  std::vector<TokenLogprob> prompt_logprobs;
};

inline TokenBatch token_batch(RequestId id, int64_t index, std::vector<int32_t> tokens, caf::actor worker) {
  TokenBatch b;
  b.id = id;
  b.index = index;
  b.tokens = std::move(tokens);
  b.worker = std::move(worker);
  return b;
}

struct Done {
  RequestId id = 0;
  engine::FinishReason reason = engine::FinishReason::stop;
  engine::Usage usage;
  caf::actor worker;
  // The output index after the worker's last token: the client has the whole
  // answer once every TokenBatch up to it arrived. TokenBatches from two
  // workers (PD: the prefill worker's first token, the decode worker's rest)
  // come from two processes and may arrive in either order; so may this.
  int64_t end_index = 0;
};

struct Failed {
  RequestId id = 0;
  ErrorCode code = ErrorCode::internal;
  std::string message;
  caf::actor worker;
};

// A worker's load, reported to the router (and the supervisor) after steps.
struct WorkerLoad {
  std::string name;
  WorkerRole role = WorkerRole::colocated;
  int64_t running = 0;
  int64_t waiting = 0;
  int64_t parked = 0;
  uint64_t device_free_bytes = 0;
  uint64_t device_budget_bytes = 0;
  int64_t leaked_pages = 0;
  bool draining = false;
  double kv_use = 0;              // fraction of the device pool budget that requests hold (the prefix
                                  // cache's own pages are reclaimable and do not count)
  RequestId largest = 0;          // the running request with the largest projected state (0: none)
  int64_t largest_tokens = 0;     // its projected length (prompt + max tokens)
  double largest_share = 0;       // the device pool budget its pages take now
  std::vector<RequestId> parked_ids;  // requests parked by the long-tail policy
  // The worker each of its requests moves to (a PD prefill's decode target, a drain's migration target),
  // one entry a request, until the move is confirmed: a draining worker stays up while any load names it.
  std::vector<caf::actor> handoff_targets;
  caf::actor actor;
};

// The router's answer to a Job: which worker runs it (the gateway watches it).
struct Assigned {
  RequestId id = 0;
  caf::actor worker;
  std::string worker_name;
  int64_t from_index = 0;  // the output index the worker streams from (Job::generated_before)
};

// A prefill worker's finished state for a decode worker (PD handoff).
struct Handoff {
  Job job;                                        // the request as the decode worker continues it
  std::shared_ptr<const engine::SequenceImage> image;
  caf::actor from;                                // the prefill worker, to confirm or release
  uint64_t handoff_id = 0;
};

using job_atom = caf::atom_constant<caf::atom("job")>;
using abort_atom = caf::atom_constant<caf::atom("abort")>;
using register_atom = caf::atom_constant<caf::atom("register")>;
using load_atom = caf::atom_constant<caf::atom("load")>;
using event_atom = caf::atom_constant<caf::atom("event")>;
using tick_atom = caf::atom_constant<caf::atom("tick")>;
using drain_atom = caf::atom_constant<caf::atom("drain")>;
using confirm_atom = caf::atom_constant<caf::atom("confirm")>;
using release_atom = caf::atom_constant<caf::atom("release")>;
using exported_atom = caf::atom_constant<caf::atom("exported")>;
using park_atom = caf::atom_constant<caf::atom("park")>;
using resume_atom = caf::atom_constant<caf::atom("resume")>;
using gone_atom = caf::atom_constant<caf::atom("gone")>;
using workers_atom = caf::atom_constant<caf::atom("workers")>;
using stop_atom = caf::atom_constant<caf::atom("stop")>;
using crash_atom = caf::atom_constant<caf::atom("crash")>;
using migrate_atom = caf::atom_constant<caf::atom("migrate")>;
using fence_atom = caf::atom_constant<caf::atom("fence")>;
using scale_atom = caf::atom_constant<caf::atom("scale")>;
using hold_atom = caf::atom_constant<caf::atom("hold")>;
// A client's Park / Resume of its request (frames): unlike the long-tail
// policy's park_atom, no policy resumes it; only the client's Resume does.
using client_park_atom = caf::atom_constant<caf::atom("cpark")>;
using client_resume_atom = caf::atom_constant<caf::atom("cresume")>;

}  // namespace troupe::actors

CAF_ALLOW_UNSAFE_MESSAGE_TYPE(troupe::actors::Job)
CAF_ALLOW_UNSAFE_MESSAGE_TYPE(troupe::actors::TokenBatch)
CAF_ALLOW_UNSAFE_MESSAGE_TYPE(troupe::actors::Done)
CAF_ALLOW_UNSAFE_MESSAGE_TYPE(troupe::actors::Failed)
CAF_ALLOW_UNSAFE_MESSAGE_TYPE(troupe::actors::WorkerLoad)
CAF_ALLOW_UNSAFE_MESSAGE_TYPE(std::vector<troupe::actors::WorkerLoad>)
CAF_ALLOW_UNSAFE_MESSAGE_TYPE(troupe::actors::Assigned)
CAF_ALLOW_UNSAFE_MESSAGE_TYPE(troupe::actors::Handoff)
CAF_ALLOW_UNSAFE_MESSAGE_TYPE(troupe::engine::Event)
CAF_ALLOW_UNSAFE_MESSAGE_TYPE(std::shared_ptr<const troupe::engine::SequenceImage>)
