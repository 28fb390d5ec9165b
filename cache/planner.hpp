// The memory planner: sizes every pool of the device tier from the bytes
// available and what the deployment expects.
//
// Parameters (docs/cache-plan.md):
//   bytes        device bytes for the pools (what is left after weights and activations)
//   mix          expected context lengths: (tokens, weight) pairs, e.g. 70% at 4K,
//                25% at 32K, 5% at 128K. A sequence of T tokens holds ceil(T/P) pages
//                of every entry pool, the window pages of one window plus a
//                checkpoint, and one HCA ring.
//   cache_share  share of the bytes kept for cached prefixes beyond the live
//                sequences (entry pages plus a window page per checkpoint).
//   ratios       instead of a mix: the share of bytes per pool, explicitly.
// The plan is where pools start: at run time empty slabs move between pools as
// demand shifts (cache/pool/pool_set.hpp), so a wrong guess costs fragmentation,
// not failures.
#pragma once

#include <array>
#include <optional>
#include <string>
#include <vector>

#include "cache/layout.hpp"

namespace troupe::cache {

// The mix a plan assumes when a deployment names none: 70% of sequences at
// 4K tokens, 25% at 32K, 5% at 128K.
inline constexpr const char* kDefaultMix = "4K:0.7,32K:0.25,128K:0.05";

struct ContextShare {
  int64_t tokens = 0;
  double weight = 1.0;
};

struct PlanInput {
  uint64_t bytes = 0;
  std::vector<ContextShare> mix;
  double cache_share = 0.0;
  std::optional<std::array<double, kPoolKinds>> ratios;
  size_t slab_bytes = 0;  // 0: PoolSet's default for the geometry
};

struct PoolPlan {
  size_t page_bytes = 0;
  int64_t pages = 0;
  int64_t slabs = 0;
  uint64_t bytes = 0;
  double per_sequence = 0;  // pages one sequence of the mix holds, on average
};

struct Plan {
  int64_t page_tokens = 0;
  size_t slab_bytes = 0;
  int64_t slabs = 0;
  std::array<PoolPlan, kPoolKinds> pools;
  double mean_context = 0;          // tokens, over the mix
  double bytes_per_sequence = 0;    // at the mix
  double sequences = 0;             // live sequences of the mix the pools hold at once
  int64_t max_context = 0;          // tokens one sequence can reach alone (pools rebalanced)
  double entry_bytes_per_token = 0;
  PoolCounts initial_pages() const;
};

// Throws troupe::Error(invalid_argument) for an empty budget, an empty mix
// without ratios, or ratios that do not sum to a positive number.
Plan plan_pools(const CacheGeometry& geometry, const PlanInput& input);

// Pages one sequence of `tokens` tokens holds in each pool.
PoolCounts pages_per_sequence(const CacheGeometry& geometry, int64_t tokens);

// "80GiB", "512MiB", "1.5TB", "4096": bytes. Throws Error(invalid_argument).
uint64_t parse_bytes(const std::string& text);
// "4096:0.7,32768:0.25,131072" (weight 1 when left out; 32K, 1M allowed).
// Errors name `option`.
std::vector<ContextShare> parse_mix(const std::string& text, const std::string& option = "--mix");
// "window=0.1,csa_entry=0.6,..." (pools left out get 0; shares in [0, 1], not all 0).
std::array<double, kPoolKinds> parse_ratios(const std::string& text, const std::string& option = "--ratios");
std::string format_bytes(double bytes);

}  // namespace troupe::cache
