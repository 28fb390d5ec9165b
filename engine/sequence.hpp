// The engine's private records: one per request, commands from other
// threads, one step's batch. Included by engine/*.cpp only.
#pragma once

#include <algorithm>
#include <memory>
#include <span>
#include <vector>

#include "cache/paged_sequence.hpp"
#include "engine/engine.hpp"
#include "engine/sampler.hpp"
#include "model/decoder.hpp"

namespace troupe::engine {

enum class Phase : uint8_t {
  waiting,   // queued; no state
  loading,   // admitted on a prefix whose pages are coming back from the host tier
  running,
  parking,   // its pages are moving to the host tier
  parked,
  resuming,  // its pages are moving back
};

// A sequence's table slot in the engine's model::Decoder; released with the
// sequence (or its state).
struct DecodeSlot {
  model::Decoder* decoder = nullptr;
  int slot = -1;
  const model::SequenceState* state = nullptr;  // the state the tables were read from
  int64_t length = -1;                          // its length then (another length: rows written elsewhere)
  uint64_t moves = 0;                           // the engine's page-move count then
  DecodeSlot() = default;
  DecodeSlot(const DecodeSlot&) = delete;
  DecodeSlot& operator=(const DecodeSlot&) = delete;
  ~DecodeSlot() { reset(); }
  void reset() {
    if (decoder != nullptr && slot >= 0) decoder->unbind(slot);
    slot = -1;
    state = nullptr;
    length = -1;
  }
};

struct Engine::Seq {
  RequestId id = 0;
  Request req;
  std::vector<int32_t> tokens;  // prompt, then sampled tokens; the last one is not yet in the state
  int64_t prompt_len = 0;
  int32_t generated = 0;
  Phase phase = Phase::waiting;
  std::unique_ptr<cache::PagedSequence> state;
  cache::ShadowRadix::Node* lock = nullptr;  // the deepest tree node whose pages this sequence uses
  uint64_t seed = 0;
  uint64_t order = 0;            // admission order: preemption takes the newest
  Usage usage;
  int64_t inserted_pages = 0;    // token pages already inserted into the tree
  int64_t cold_scan = 0;         // token pages below this were considered for the host tier
  int64_t computed_before = 0;   // state length when last preempted (recomputation accounting)
  bool admitted_once = false;
  bool resume_wanted = false;    // parked: resume when the device tier has room
  std::vector<std::pair<int64_t, cache::PoolKind>> parked_pages;  // what park moved (k = -1: HCA ring)
  TokenCounts counts;            // for the penalties (SamplingParams::adjusts_logits), kept up to date in after_chunk
  // The answer's place in its json schema (SamplingParams::held_by) after `matched` of the
  // tokens it holds (made at the first sample it holds, so a sequence imported or
  // resubmitted builds it from its tokens).
  std::unique_ptr<JsonMatcher> matcher;
  size_t matcher_from = 0;  // the answer token it starts at (a trigger's every occurrence starts another)
  int64_t matched = 0;
  DecodeSlot decode;             // after `state`: released before it

  int64_t length() const { return state ? state->length() : 0; }
  // The answer's tokens so far (after the prompt, or after SamplingParams::answer_start).
  std::span<const int32_t> answer() const {
    return std::span(tokens).subspan(std::min<size_t>(tokens.size(), static_cast<size_t>(req.sampling.answer_begin(prompt_len))));
  }
  // Tokens to feed before the next sample.
  int64_t pending() const { return static_cast<int64_t>(tokens.size()) - length(); }
  // The logits rows a chunk of the next `n` tokens returns.
  model::LogitsWanted rows_wanted(int64_t n) const {
    if (wants_all_rows(req.logits, length(), prompt_len)) return model::LogitsWanted::all;
    return length() + n == static_cast<int64_t>(tokens.size()) ? model::LogitsWanted::last : model::LogitsWanted::none;
  }
};

struct Engine::Command {
  enum Kind : uint8_t { submit, abort, park, resume, export_state, import_state } kind = submit;
  RequestId id = 0;
  Request request;
  std::shared_ptr<std::promise<std::optional<SequenceImage>>> exported;
  std::shared_ptr<SequenceImage> image;
};

struct Engine::Batch {
  std::vector<model::Chunk> chunks;
  std::vector<Seq*> seqs;
  int64_t tokens = 0;
};

}  // namespace troupe::engine
