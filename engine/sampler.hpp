// Picks tokens from logits by a request's SamplingParams. Random draws come
// from (seed, position) alone, so a request samples the same tokens however it
// is batched, parked, preempted or recomputed.
#pragma once

#include <cstdint>
#include <span>

#include "engine/request.hpp"

namespace troupe::engine {

// The token at `position` (its index in the sequence), the `generated`-th of
// the request. `eos` are the model's EOS ids. `tokens`: the sequence so far (the
// penalties' history; may be empty when the params have none), whose answer starts
// at `answer_start` (the params' own answer_start, when set, wins).
int32_t sample(std::span<const float> logits, const SamplingParams& p, uint64_t seed, int64_t position,
               int32_t generated, std::span<const int64_t> eos, std::span<const int32_t> tokens = {},
               int64_t answer_start = 0);

// The params' logit bias and penalties applied to `logits` in place, for a sequence
// `tokens` whose answer starts at `answer_start` (see SamplingParams).
void adjust_logits(std::span<float> logits, const SamplingParams& p, std::span<const int32_t> tokens,
                     int64_t answer_start);

// A uniform draw in [0, 1) from (seed, position).
double uniform(uint64_t seed, int64_t position);

// Why params are unusable, or empty.
std::string check(const SamplingParams& p);

}  // namespace troupe::engine
