// Picks tokens from logits by a request's SamplingParams. Random draws come
// from (seed, position) alone, so a request samples the same tokens however it
// is batched, parked, preempted or recomputed.
#pragma once

#include <cstdint>
#include <span>

#include "engine/request.hpp"

namespace troupe::engine {

// The token at `position` (its index in the sequence), the `generated`-th of
// the request. `eos` are the model's EOS ids.
int32_t sample(std::span<const float> logits, const SamplingParams& p, uint64_t seed, int64_t position,
               int32_t generated, std::span<const int64_t> eos);

// A uniform draw in [0, 1) from (seed, position).
double uniform(uint64_t seed, int64_t position);

// Why params are unusable, or empty.
std::string check(const SamplingParams& p);

}  // namespace troupe::engine
