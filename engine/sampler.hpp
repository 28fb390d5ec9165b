// Picks tokens from logits by a request's SamplingParams. Random draws come
// from (seed, position) alone, so a request samples the same tokens however it
// is batched, parked, preempted or recomputed.
#pragma once

#include <cstdint>
#include <span>
#include <unordered_map>
#include <unordered_set>

#include "engine/request.hpp"

namespace troupe::engine {

// What the penalties need to know of a sequence, brought up to date as it grows
// (tokens are only ever appended): each token costs once, not once per sample.
struct TokenCounts {
  int64_t counted = 0;                           // tokens[0, counted) are counted
  int64_t answer_start = -1;                     // where the counted answer starts
  std::unordered_set<int32_t> seen;              // every token of the sequence (repetition)
  std::unordered_map<int32_t, int32_t> answer;   // count in the answer (frequency, presence)
  // Counts tokens[counted, size) (all of them again if answer_start moved).
  void update(std::span<const int32_t> tokens, int64_t answer_start);
  // The counts of `tokens` whose answer starts at `answer_start`.
  static TokenCounts of(std::span<const int32_t> tokens, int64_t answer_start);
};

// The token at `position` (its index in the sequence), the `generated`-th of
// the request. `eos` are the model's EOS ids. `counts`: the sequence so far, for
// the penalties (none: no history).
// `answer`: the answer's tokens so far (for p.answer_prefixes). `allowed`: when given,
// only the ids whose bit it sets can be drawn (p.json_schema's; bit i % 64 of word
// i / 64, ids past it excluded); it must set at least one.
int32_t sample(std::span<const float> logits, const SamplingParams& p, uint64_t seed, int64_t position,
               int32_t generated, std::span<const int64_t> eos, const TokenCounts& counts = TokenCounts{},
               std::span<const int32_t> answer = {}, std::span<const uint64_t> allowed = {});

// The tokens p.answer_prefixes allow after `answer` (sorted, distinct), or none when they
// no longer bind it (a whole prefix is there, or none is left that it begins).
std::vector<int32_t> prefix_choices(const SamplingParams& p, std::span<const int32_t> answer);

// The params' logit bias and penalties applied to `logits` in place (see SamplingParams).
void adjust_logits(std::span<float> logits, const SamplingParams& p, const TokenCounts& counts);

// A uniform draw in [0, 1) from (seed, position).
double uniform(uint64_t seed, int64_t position);

// Why params are unusable, or empty.
std::string check(const SamplingParams& p);

}  // namespace troupe::engine
