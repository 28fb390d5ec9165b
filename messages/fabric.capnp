# The actor fabric: what actors in different troupe processes say to each
# other. The node actor of each process (actors/node) carries the in-process
# messages of actors/protocol.hpp as one frame kind, `actorMessage`, whose body
# is an ActorMessage: a target actor and a typed union of the messages. Actor
# handles inside messages travel as ActorRefs and become local proxy actors on
# arrival, so monitors, replies and supervision work across processes.
#
# The KV pages of a PD handoff never ride in a frame: a Handoff names them with
# a kv.capnp KvOffer (layout-typed descriptors into a region registered with the
# transport); the taker pulls them by RMA, then answers with KvConfirm or
# KvRelease frames (kv.capnp) carrying the offer's lease id.
#
# Evolution: Cap'n Proto's rules (common.capnp). New messages are new union
# members at the end; a receiver that does not know one answers nothing and
# logs it.
@0xd3180000ccd1da2b;

using Cxx = import "/capnp/c++.capnp";
$Cxx.namespace("troupe::msg");

using Common = import "common.capnp";
using Kv = import "kv.capnp";
using Generate = import "generate.capnp";

# An actor somewhere on the fabric.
struct ActorRef {
  node @0 :Text;    # transport name of the process the actor runs in; empty: no actor (a null handle)
  id @1 :UInt64;    # the actor's id in that process; 0: the well-known actor called `name`
  name @2 :Text;    # well-known name ("router", "gateway", a worker's name); for id != 0 a label for logs
}

enum WorkerRole {
  colocated @0;
  prefill @1;
  decode @2;
}

# engine::SamplingParams.
struct Sampling {
  temperature @0 :Float32 = 0.0;  # 0: greedy
  topP @1 :Float32 = 1.0;
  topK @2 :Int32;
  seed :union {
    none @3 :Void;
    value @4 :UInt64;
  }
  minTokens @5 :Int32;
  maxTokens @6 :Int32 = 16;
  stopIds @7 :List(Int32);
  ignoreEos @8 :Bool;
  repetitionPenalty @9 :Float32 = 1.0;  # engine::SamplingParams' penalties (1, 0, 0: none)
  frequencyPenalty @10 :Float32;
  presencePenalty @11 :Float32;
  answerStart @12 :Int64 = -1;          # where the answer starts in the sequence; -1: the prompt's end
  logitBias @13 :List(TokenBias);       # added to these tokens' logits first
  minP @14 :Float32;                    # 0: off
  answerPrefixes @15 :List(List(Int32)); # the answer begins with one of these (engine::SamplingParams)
  jsonSchema @16 :Text;                 # the answer is JSON under this schema; empty: free text
  answerSchemas @17 :List(Text);        # what follows answer prefix i is JSON under schema i (empty: free)
  answerTrigger @18 :List(Int32);       # the prefixes apply after each occurrence of these tokens (empty: at the start)
}

struct TokenBias {
  token @0 :Int32;
  bias @1 :Float32;
}

# engine::Usage.
struct Usage {
  promptTokens @0 :Int64;
  cachedTokens @1 :Int64;
  computedTokens @2 :Int64;
  recomputedTokens @3 :Int64;
  generatedTokens @4 :Int64;
  parks @5 :Int32;
  preemptions @6 :Int32;
}

# Run (or continue) one request (actors::Job). A Job never carries a state
# image across processes: states move as a Handoff.
struct Job {
  id @0 :UInt64;
  prompt @1 :List(Int32);
  promptTokens @2 :Int64;
  generatedBefore @3 :Int64;
  sampling @4 :Sampling;
  priority @5 :Int32;
  replyTo @6 :ActorRef;
  decodeTo @7 :ActorRef;
  attempt @8 :Int32;
  logprobs @9 :Int32 = -1;     # alternatives per token to report with its logprob (0..20); -1: none
  promptLogprobs @10 :Int32 = -1;  # the prompt tokens' logprobs with this many alternatives; -1: none
}

# A sampled token's log-probability under the model (log-softmax of its raw
# logits) and the most likely alternatives, best first.
struct TokenLogprob {
  logprob @0 :Float32;
  topIds @1 :List(Int32);
  topLogprobs @2 :List(Float32);
}

struct TokenBatch {
  id @0 :UInt64;
  index @1 :Int64;
  tokens @2 :List(Int32);
  worker @3 :ActorRef;
  logprobs @4 :List(TokenLogprob);  # one per token when the job asked for them
  promptIndex @5 :Int64;            # Job.promptLogprobs: the prompt token the first of promptLogprobs is for
  promptLogprobs @6 :List(TokenLogprob);
}

struct Done {
  id @0 :UInt64;
  reason @1 :Generate.FinishReason;  # engine::FinishReason (abort -> aborted)
  usage @2 :Usage;
  worker @3 :ActorRef;
  endIndex @4 :Int64;  # the output index after the last token (TokenBatch.index + tokens)
}

struct Failed {
  id @0 :UInt64;
  code @1 :Common.ErrorCode;
  message @2 :Text;
  worker @3 :ActorRef;
}

struct WorkerLoad {
  name @0 :Text;
  role @1 :WorkerRole;
  running @2 :Int64;
  waiting @3 :Int64;
  parked @4 :Int64;
  deviceFreeBytes @5 :UInt64;
  deviceBudgetBytes @6 :UInt64;
  leakedPages @7 :Int64;
  draining @8 :Bool;
  kvUse @9 :Float64;
  largest @10 :UInt64;
  largestTokens @11 :Int64;
  parkedIds @12 :List(UInt64);
  actor @13 :ActorRef;
  handoffTargets @14 :List(ActorRef);  # the worker each of its requests moves to, until confirmed
}

struct Assigned {
  id @0 :UInt64;
  worker @1 :ActorRef;
  workerName @2 :Text;
  fromIndex @3 :Int64;  # the output index the worker streams from
}

# A worker announces itself to the router (register_atom).
struct Registration {
  worker @0 :ActorRef;
  name @1 :Text;
  role @2 :WorkerRole;
}

# The router stops (or resumes) giving a worker new requests (fence_atom).
struct Fence {
  name @0 :Text;
  fenced @1 :Bool;
}

# The part of an engine::SequenceImage that is not pages.
struct SequenceMeta {
  prompt @0 :List(Int32);
  sampling @1 :Sampling;
  logitsMode @2 :UInt8;        # engine::LogitsMode
  prefixCache @3 :Bool;
  maxChunkTokens @4 :Int64;
  tokens @5 :List(Int32);      # prompt and sampled tokens; the last one is not in the state yet
  length @6 :Int64;            # tokens in the state
  generated @7 :Int32;
  seed @8 :UInt64;
  usage @9 :Usage;
  pageTokens @10 :Int64;
  priority @11 :Int32;         # engine::Request::priority
}

# Prefill (or a draining worker) -> the worker that continues the request
# (actors::Handoff). `offer` names the pages; the taker's node pulls them,
# answers KvConfirm (or KvRelease on failure, then the taker recomputes), and
# hands the state to the target worker, which confirms to `from`.
struct Handoff {
  job @0 :Job;
  from @1 :ActorRef;
  handoffId @2 :UInt64;
  image @3 :SequenceMeta;
  offer @4 :Kv.KvOffer;
}

# What a Call asks.
enum CallKind {
  routerWorkers @0;            # (workers_atom) to a router -> Reply.workers
  fleetDrain @1;               # (drain_atom, name) to the fleet: an admin's drain -> Reply.flag (started)
  fleetScale @2;               # (scale_atom) to the fleet: its slots as JSON -> Reply.text
  fleetScaleTo @3;             # (scale_atom, node, count) to the fleet -> Reply.text ("" or why not)
}

# A request that expects one reply (CAF request/response through a proxy).
struct Call {
  corr @0 :UInt64;             # the caller's correlation id, echoed in the Reply
  kind @1 :CallKind;
  name @2 :Text;               # fleetDrain: the worker; fleetScaleTo: the node
  count @3 :Int32;             # fleetScaleTo: the workers wanted
}

struct Reply {
  corr @0 :UInt64;
  union {
    workers @1 :List(WorkerLoad);
    error @2 :Common.Error;
    flag @3 :Bool;
    text @4 :Text;
  }
}

# An actor that other processes may hold references to has ended: their
# proxies of it end with the same reason (their monitors get a DOWN).
struct Exited {
  id @0 :UInt64;
  normal @1 :Bool;             # ended normally (else: an error or a kill)
  reason @2 :Text;
}

# Frame kind `actorMessage`. The frame's request id is the request the
# message is about (0 when none).
struct ActorMessage {
  target @0 :ActorRef;         # an actor of the receiving process (empty for node-level bodies: reply, exited)
  body :union {
    job @1 :Job;
    tokenBatch @2 :TokenBatch;
    done @3 :Done;
    failed @4 :Failed;
    assigned @5 :Assigned;
    workerLoad @6 :WorkerLoad;
    registration @7 :Registration;
    abort @8 :UInt64;          # (abort_atom, request id)
    park @9 :UInt64;           # (park_atom, request id)
    resume @10 :UInt64;        # (resume_atom, request id)
    handoff @11 :Handoff;
    confirm @12 :UInt64;       # (confirm_atom, handoff id): the taker holds the state
    release @13 :UInt64;       # (release_atom, handoff id)
    fence @14 :Fence;
    drain @15 :Void;           # (drain_atom)
    migrate @16 :ActorRef;     # (migrate_atom, target worker)
    call @17 :Call;
    reply @18 :Reply;
    exited @19 :Exited;
    clientPark @20 :UInt64;    # (client_park_atom, request id): a client's Park; the stream pauses until its Resume
    clientResume @21 :UInt64;  # (client_resume_atom, request id)
  }
}
