# Client <-> gateway: generation requests and their streams, request control,
# model listing. The frame header's request id names the request; every
# TokenChunk, Finish, Ack or Error about it carries the same id.
@0xcbe46ab8cc88a0e6;

using Cxx = import "/capnp/c++.capnp";
$Cxx.namespace("troupe::msg");

# One turn of a chat, rendered by the model's chat template at the gateway.
struct ChatMessage {
  role @0 :Text;     # "system", "user", "assistant" or "tool"
  content @1 :Text;  # the turn's text
  name @2 :Text;     # optional author name (OpenAI `name`)
}

# How tokens are chosen. Defaults are OpenAI's: temperature 1, top_p 1, no top_k.
struct SamplingParams {
  temperature @0 :Float32 = 1.0;  # 0 means greedy (argmax)
  topP @1 :Float32 = 1.0;         # nucleus mass in (0, 1]
  topK @2 :UInt32 = 0;            # keep the k most likely tokens; 0 = off
  seed :union {                   # per-request RNG seed
    none @3 :Void;                # server picks one
    value @4 :UInt64;             # deterministic sampling given the same seed
  }
  # Penalties on tokens already in the sequence, applied to the logits first
  # (vLLM's meaning): repetition divides a positive logit (multiplies a negative
  # one) of every token in the prompt or the answer so far, > 0, 1 = off;
  # frequency subtracts this times the token's count in the answer, presence
  # this once if the answer has it, both in [-2, 2], 0 = off.
  repetitionPenalty @5 :Float32 = 1.0;
  frequencyPenalty @6 :Float32 = 0.0;
  presencePenalty @7 :Float32 = 0.0;
  # Added to these tokens' logits before the penalties (OpenAI's logit_bias):
  # at most 1,024 entries, each bias in [-100, 100], tokens in the vocabulary.
  logitBias @8 :List(LogitBias);
  # vLLM's min_p: only tokens whose probability is at least this times the likeliest
  # one's, in [0, 1]; 0 = off.
  minP @9 :Float32 = 0.0;
  # Structured output: the answer is one JSON value valid under this JSON Schema
  # (the keywords troupe holds: engine/json_schema.hpp; "{}" = any JSON value,
  # {"type": "object"} = OpenAI's json_object); empty = free text. A schema
  # troupe cannot hold is refused with an Error frame naming the keyword.
  jsonSchema @10 :Text;
  # Structured output, raw text: the answer is a text this regular expression matches
  # whole (ECMAScript syntax; what troupe holds: engine/regex.hpp; vLLM's guided_regex).
  # Empty = none; not together with jsonSchema.
  regex @11 :Text;
  # Structured output, raw text: the answer is a text this EBNF grammar derives from its
  # rule `root` (GBNF syntax, engine/ebnf.cpp; vLLM's guided_grammar). Empty = none; at
  # most one of jsonSchema, regex and ebnf.
  ebnf @12 :Text;
}

struct LogitBias {
  token @0 :UInt32;
  bias @1 :Float32;
}

# Submit a generation. Answered by a stream of TokenChunk frames ended by one
# Finish (or one Error), all with this frame's request id. Request ids are
# chosen by the client and unique per connection.
struct GenerateRequest {
  model @0 :Text;                  # model id from ModelList; empty = the default model
  prompt :union {
    tokenIds @1 :List(UInt32);     # already tokenized prompt
    text @2 :Text;                 # raw text, tokenized by the gateway
    chat @3 :List(ChatMessage);    # chat turns, rendered with the chat template
  }
  sampling @4 :SamplingParams;
  maxTokens @5 :UInt32 = 16;       # stop after this many generated tokens (OpenAI default 16)
  minTokens @6 :UInt32 = 0;        # never stop (eos, stop ids/strings) before this many
  stopStrings @7 :List(Text);      # stop when the text ends with one of these (not returned)
  stopTokenIds @8 :List(UInt32);   # stop when one of these ids is generated (returned)
  ignoreEos @9 :Bool = false;      # keep generating past the end-of-sequence token
  returnTokenIds @10 :Bool = false;# TokenChunk carries token ids (text is always carried)
  priority @11 :Int32 = 0;         # larger runs first under pressure; ties by arrival
  deadlineUnixNanos @12 :UInt64 = 0; # give up (Error deadlineExceeded) after this wall time; 0 = none
  user @13 :Text;                  # opaque client tag for logs and metrics
}

# Part of a request's output, in order. Chunks of one request arrive in the
# order they were produced.
struct TokenChunk {
  index @0 :UInt32;          # position of the first token of this chunk in the output (0-based)
  tokenIds @1 :List(UInt32); # generated ids, when the request asked for them
  text @2 :Text;             # detokenized text delta (may be empty mid-codepoint)
}

enum FinishReason {
  stop @0;        # end-of-sequence token, a stop token id or a stop string
  length @1;      # maxTokens reached, or the model's context limit
  aborted @2;     # an Abort arrived, or the client went away
  error @3;       # failed; an Error frame with details precedes this frame
}

# The last frame of a request's stream.
struct Finish {
  reason @0 :FinishReason;
  promptTokens @1 :UInt32;      # prompt length in tokens
  completionTokens @2 :UInt32;  # generated tokens
  cachedTokens @3 :UInt32;      # prompt tokens served from the prefix cache
  matchedStop @4 :Text;         # the stop string that matched, if any
  parks @5 :UInt32;             # times the request was parked (long-tail policy)
}

# Stop a request now; its stream ends with Finish{reason = aborted}. Aborting
# an unknown or finished request answers Error{notFound}.
struct Abort {
  reason @0 :Text;   # optional, for logs
}

# Move a running request's KV state to the host tier and pause its stream.
# Answered by Ack; the stream is silent until Resume.
struct Park {
  reason @0 :Text;
}

# Continue a parked request, on any decode worker. Answered by Ack; then the
# stream continues where it stopped.
struct Resume {
  preferredWorker @0 :Text;  # optional placement hint; empty = the router decides
}

# Ask for the models this endpoint serves. Answered by ModelList.
struct ListModels {}

struct ModelInfo {
  id @0 :Text;              # name clients pass as GenerateRequest.model
  ownedBy @1 :Text;         # OpenAI `owned_by`
  created @2 :UInt64;       # unix seconds
  maxContext @3 :UInt32;    # longest prompt + output, in tokens
  vocabSize @4 :UInt32;
}

struct ModelList {
  models @0 :List(ModelInfo);
}
