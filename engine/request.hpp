// What callers give the engine (Request) and what it gives back (Event).
#pragma once

#include <algorithm>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "base/error.hpp"

namespace troupe::engine {

using RequestId = uint64_t;

// Bounds of the logit changes (OpenAI's): frequency and presence penalties in
// [-kMaxAbsPenalty, kMaxAbsPenalty], each logit bias in [-kMaxAbsLogitBias,
// kMaxAbsLogitBias], at most kMaxLogitBiasEntries of them.
inline constexpr float kMaxAbsPenalty = 2.0f;
inline constexpr float kMaxAbsLogitBias = 100.0f;
inline constexpr size_t kMaxLogitBiasEntries = 1024;
// JSON levels of a json schema document (its compiler and serializer recurse).
inline constexpr size_t kMaxSchemaNesting = 128;

// Per-request sampling, named as OpenAI / vLLM name them.
struct SamplingParams {
  float temperature = 0.0f;      // 0: greedy (argmax, lowest id on ties)
  float top_p = 1.0f;            // nucleus: the smallest set of tokens with this much probability, (0, 1]
  int32_t top_k = 0;             // the k most likely tokens; 0: all
  float min_p = 0.0f;            // only tokens at least this times the likeliest one's probability, [0, 1]; 0: all
  std::optional<uint64_t> seed;  // same seed, same tokens; none: the engine picks one
  int32_t min_tokens = 0;        // stop ids and EOS cannot be sampled before this many tokens
  int32_t max_tokens = 16;       // finish with `length` after this many tokens (0: after the prompt, sampling none)
  std::vector<int32_t> stop_ids; // finish with `stop` after sampling one of these (it is returned)
  bool ignore_eos = false;       // EOS ids are ordinary tokens
  // Changes to the logits before anything else, in vLLM's order and meaning: the
  // logit bias (OpenAI's: added to a token's logit, [-100, 100]), then the
  // penalties: repetition divides a positive logit (multiplies a negative one) of
  // every token already in the sequence, prompt included; frequency subtracts its
  // count in the answer times this, presence this once for a token the answer has.
  // None, 1, 0, 0: off.
  std::vector<std::pair<int32_t, float>> logit_bias;  // (token, bias)
  float repetition_penalty = 1.0f;  // > 0
  float frequency_penalty = 0.0f;   // [-2, 2]
  float presence_penalty = 0.0f;    // [-2, 2]
  // Where the answer starts in the sequence: tokens before it count as prompt for the
  // penalties. -1: at the end of the request's prompt. A request resubmitted with its
  // answer so far appended to the prompt keeps the original prompt's length here.
  int64_t answer_start = -1;
  // The answer begins with one of these token sequences (none: free): while the answer so
  // far is a proper prefix of some of them, only their next tokens can be sampled, and
  // once it holds one whole, sampling is free again. (A tool call's name when the request
  // must call one of several tools.)
  std::vector<std::vector<int32_t>> answer_prefixes;
  // The answer is one JSON value valid under this JSON Schema (engine/json_schema.hpp
  // says which keywords are held; "{}": any value; empty: free text), or raw text: one of a
  // choice_grammar()'s texts, or a text a regex_grammar()'s pattern matches. Only tokens that
  // keep it valid are sampled, and the request finishes with `stop` once the value is
  // whole (min_tokens gives way). Where it could end or go on (a number at the top),
  // an EOS id may end it (unless ignore_eos, or before min_tokens).
  std::string json_schema;
  // With answer_prefixes: once the answer holds prefix i whole, the rest of it is held to
  // answer_schemas[i] as json_schema holds a whole answer (empty: free). Empty, or one a
  // prefix. (The arguments of a call to one of several tools, after its name.)
  std::vector<std::string> answer_schemas;
  // Where answer_prefixes (and their schemas) apply. Empty: at the answer's start, once.
  // Else after the last occurrence of these tokens in the answer: free before it, a
  // prefix and its schema's value after it, free again once that value is whole, until
  // the trigger comes again. (A tool call the model starts itself: the call marker.)
  std::vector<int32_t> answer_trigger;

  // Where the part answer_prefixes hold starts in `answer` (kUntriggered: the trigger has not come).
  static constexpr size_t kUntriggered = static_cast<size_t>(-1);
  size_t held_from(std::span<const int32_t> answer) const {
    if (answer_trigger.empty()) return 0;
    const auto t = answer_trigger.size();
    for (size_t end = answer.size(); end >= t; --end) {
      if (std::equal(answer_trigger.begin(), answer_trigger.end(), answer.begin() + static_cast<std::ptrdiff_t>(end - t))) {
        return end;
      }
    }
    return kUntriggered;
  }

  // The schema that holds the answer from which of its tokens on: json_schema from the
  // first, or the answer_schemas entry of the prefix the answer (after its trigger) holds whole.
  struct HeldBy {
    const std::string* schema = nullptr;
    size_t from = 0;
  };
  std::optional<HeldBy> held_by(std::span<const int32_t> answer) const {
    if (!json_schema.empty()) return HeldBy{&json_schema, 0};
    const size_t from = held_from(answer);
    if (from == kUntriggered) return std::nullopt;
    const auto tail = answer.subspan(from);
    for (size_t i = 0; i < answer_schemas.size() && i < answer_prefixes.size(); ++i) {
      const auto& q = answer_prefixes[i];
      if (answer_schemas[i].empty() || q.size() > tail.size()) continue;
      if (std::equal(q.begin(), q.end(), tail.begin())) return HeldBy{&answer_schemas[i], from + q.size()};
    }
    return std::nullopt;
  }
  bool holds_json() const {
    return !json_schema.empty() || std::any_of(answer_schemas.begin(), answer_schemas.end(), [](const auto& x) { return !x.empty(); });
  }

  // Where the answer starts for a sequence whose request prompt has `prompt_len` tokens.
  int64_t answer_begin(int64_t prompt_len) const { return answer_start >= 0 ? answer_start : prompt_len; }
  // Whether answer_prefixes or a json schema may still mask the token after `generated` answer tokens.
  bool prefix_bound(int64_t generated) const {
    if (holds_json() || !answer_trigger.empty()) return true;
    for (const auto& q : answer_prefixes) {
      if (static_cast<int64_t>(q.size()) > generated) return true;
    }
    return false;
  }
  bool adjusts_logits() const {
    return !logit_bias.empty() || repetition_penalty != 1.0f || frequency_penalty != 0.0f || presence_penalty != 0.0f;
  }
};

enum class LogitsMode : uint8_t {
  none,
  sampled,  // each token event carries the logits row it was sampled from
  prompt,   // sampled, plus `logits` events with the rows of the prompt's chunks (prompt logprobs)
  all,      // `logits` events with every computed row, prompt and decode (token events carry none)
};
// Whether a chunk starting at `start` of a sequence whose prompt has `prompt_len` tokens returns every row.
inline bool wants_all_rows(LogitsMode m, int64_t start, int64_t prompt_len) {
  return m == LogitsMode::all || (m == LogitsMode::prompt && start < prompt_len);
}

struct Request {
  std::vector<int32_t> prompt;
  SamplingParams sampling;
  LogitsMode logits = LogitsMode::none;
  bool prefix_cache = true;      // match from and insert into the radix tree
  int64_t max_chunk_tokens = 0;  // cap on prefill tokens per step for this request; 0: the step budget
  bool park_after_prefill = false;  // PD prefill: park once the first token is sampled (then export_parked)
  int32_t priority = 0;  // larger is admitted first and preempted last; ties by arrival
};

enum class FinishReason : uint8_t { stop, length, abort, error };
const char* to_string(FinishReason r);

// Token accounting of one request, in its `finished` event.
struct Usage {
  int64_t prompt_tokens = 0;
  int64_t cached_tokens = 0;      // tokens served by the radix tree (not computed)
  int64_t computed_tokens = 0;    // tokens run through the model, recomputation included
  int64_t recomputed_tokens = 0;  // of those: matched in the tree but not resumable, or preempted and run again
  int64_t generated_tokens = 0;
  int32_t parks = 0;
  int32_t preemptions = 0;
};

enum class EventKind : uint8_t {
  token,     // a sampled token
  logits,    // LogitsMode::all / prompt: computed rows, `position` the first one's
  finished,  // last event of a request
  parked,    // park(id) done (ok) or refused (!ok, message says why)
  resumed,   // resume(id) done
};
const char* to_string(EventKind k);

struct Event {
  RequestId id = 0;
  EventKind kind = EventKind::token;
  int32_t token = -1;          // token
  int64_t position = -1;       // token: its position; logits: the first row's position
  std::vector<float> logits;   // rows x vocab
  FinishReason reason = FinishReason::stop;  // finished
  bool ok = true;              // parked / finished(error): false with a message
  ErrorCode code = ErrorCode::internal;      // finished(error)
  std::string message;
  Usage usage;                 // finished
};

inline Event make_event(RequestId id, EventKind kind, bool ok = true, std::string message = {}) {
  Event e;
  e.id = id;
  e.kind = kind;
  e.ok = ok;
  e.message = std::move(message);
  return e;
}

}  // namespace troupe::engine
