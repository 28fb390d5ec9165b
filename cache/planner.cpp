#include "cache/planner.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <optional>
#include <sstream>

#include "base/error.hpp"
#include "cache/pool/pool_set.hpp"

namespace troupe::cache {

PoolCounts pages_per_sequence(const CacheGeometry& g, int64_t tokens) {
  PoolCounts n{};
  const int64_t pages = g.pages_for(tokens);
  for (PoolKind k : kEntryPools) {
    if (g.has(k)) n[static_cast<size_t>(index(k))] = pages;
  }
  // The window, the window of the last page boundary, the page being filled.
  n[static_cast<size_t>(index(PoolKind::window))] = std::min<int64_t>(pages, (g.window + g.page_tokens - 1) / g.page_tokens + 1);
  if (g.has(PoolKind::hca_ring)) n[static_cast<size_t>(index(PoolKind::hca_ring))] = 1;
  return n;
}

PoolCounts Plan::initial_pages() const {
  PoolCounts n{};
  for (size_t i = 0; i < pools.size(); ++i) n[i] = pools[i].pages;
  return n;
}

Plan plan_pools(const CacheGeometry& g, const PlanInput& in) {
  if (in.bytes == 0) raise(ErrorCode::invalid_argument, "the plan needs a memory budget");
  if (in.mix.empty() && !in.ratios) raise(ErrorCode::invalid_argument, "the plan needs a context mix or pool ratios");
  if (!(in.cache_share >= 0 && in.cache_share < 1)) raise(ErrorCode::invalid_argument, "cache share must be in [0, 1)");
  Plan plan;
  plan.page_tokens = g.page_tokens;
  plan.slab_bytes = in.slab_bytes > 0 ? in.slab_bytes : PoolSet::default_slab_bytes(g);
  plan.slabs = static_cast<int64_t>(in.bytes / plan.slab_bytes);
  plan.entry_bytes_per_token = g.entry_bytes_per_token();
  for (PoolKind k : kAllPools) plan.pools[static_cast<size_t>(index(k))].page_bytes = g.pool(k).page_bytes;

  // Average pages per sequence over the mix.
  double weight = 0;
  for (const auto& s : in.mix) {
    if (s.tokens <= 0 || !(s.weight > 0)) raise(ErrorCode::invalid_argument, "context mix entries need tokens > 0 and weight > 0");
    weight += s.weight;
  }
  std::array<double, kPoolKinds> per_seq{};
  for (const auto& s : in.mix) {
    const auto n = pages_per_sequence(g, s.tokens);
    for (size_t i = 0; i < per_seq.size(); ++i) per_seq[i] += s.weight / weight * static_cast<double>(n[i]);
    plan.mean_context += s.weight / weight * static_cast<double>(s.tokens);
  }
  for (size_t i = 0; i < per_seq.size(); ++i) {
    plan.pools[i].per_sequence = per_seq[i];
    plan.bytes_per_sequence += per_seq[i] * static_cast<double>(plan.pools[i].page_bytes);
  }

  // Bytes per pool: live sequences of the mix, plus the prefix cache share
  // (entry pages, and a checkpoint window per page_tokens * 16 cached tokens).
  std::array<double, kPoolKinds> share{};
  if (in.ratios) {
    // Shares of the pools this model has (a model without HCA layers has no HCA pools):
    // the ratios given to the others are not handed round to these by the leftovers below.
    double sum = 0;
    for (size_t i = 0; i < share.size(); ++i) {
      if (plan.pools[i].page_bytes > 0) sum += std::max(0.0, (*in.ratios)[i]);
    }
    if (!(sum > 0)) raise(ErrorCode::invalid_argument, "pool ratios must give more than 0 to a pool this model uses");
    for (size_t i = 0; i < share.size(); ++i) {
      share[i] = plan.pools[i].page_bytes > 0 ? std::max(0.0, (*in.ratios)[i]) / sum : 0.0;
    }
  } else {
    std::array<double, kPoolKinds> cache_bytes{};
    double cache_total = 0;
    for (PoolKind k : kEntryPools) cache_total += static_cast<double>(g.pool(k).page_bytes);
    cache_total += static_cast<double>(g.pool(PoolKind::window).page_bytes) / 16.0;
    for (PoolKind k : kEntryPools) cache_bytes[static_cast<size_t>(index(k))] = static_cast<double>(g.pool(k).page_bytes) / cache_total;
    cache_bytes[0] = static_cast<double>(g.pool(PoolKind::window).page_bytes) / 16.0 / cache_total;
    for (size_t i = 0; i < share.size(); ++i) {
      const double live = per_seq[i] * static_cast<double>(plan.pools[i].page_bytes) / plan.bytes_per_sequence;
      share[i] = (1 - in.cache_share) * live + in.cache_share * cache_bytes[i];
    }
  }
  // Whole slabs per pool: floor, then the leftovers by largest remainder.
  std::array<double, kPoolKinds> want{};
  int64_t used = 0;
  for (size_t i = 0; i < share.size(); ++i) {
    if (plan.pools[i].page_bytes == 0) continue;
    want[i] = share[i] * static_cast<double>(plan.slabs);
    plan.pools[i].slabs = static_cast<int64_t>(std::floor(want[i]));
    if (share[i] > 0 && plan.pools[i].slabs == 0) plan.pools[i].slabs = 1;  // every pool in use needs a slab
    used += plan.pools[i].slabs;
  }
  while (used < plan.slabs) {
    size_t best = 0;
    double gap = -1e300;
    for (size_t i = 0; i < share.size(); ++i) {
      if (plan.pools[i].page_bytes == 0 || share[i] <= 0) continue;
      if (want[i] - static_cast<double>(plan.pools[i].slabs) > gap) gap = want[i] - static_cast<double>(plan.pools[i].slabs), best = i;
    }
    ++plan.pools[best].slabs;
    ++used;
  }
  for (auto& p : plan.pools) {
    if (p.page_bytes == 0) continue;
    p.pages = p.slabs * static_cast<int64_t>(plan.slab_bytes / p.page_bytes);
    p.bytes = static_cast<uint64_t>(p.pages) * p.page_bytes;
  }
  // Sequences of the mix that fit: the scarcest pool decides.
  if (!in.mix.empty()) {
    double fit = 1e300;
    for (size_t i = 0; i < share.size(); ++i) {
      if (per_seq[i] > 0) fit = std::min(fit, static_cast<double>(plan.pools[i].pages) / per_seq[i]);
    }
    plan.sequences = fit == 1e300 ? 0 : fit;
  }
  // One sequence alone, pools rebalanced: the most token pages whose pages (pages_per_sequence) take no
  // more than the budget's slabs, each pool in whole slabs (as the arena hands them out: a pool's last slab is partly
  // empty, which a small budget of few slabs feels. Session 43: counted in bytes, 2 MiB of the tiny model
  // gave 9,472 tokens and the Flash-shaped model's 24 MiB 16,512, where the engine stopped at 6,144 and 4,736,
  // the figures this gives).
  auto slabs_for = [&](int64_t token_pages) {
    const auto pages = pages_per_sequence(g, token_pages * g.page_tokens);
    int64_t n = 0;
    for (PoolKind k : kAllPools) {
      const auto i = static_cast<size_t>(index(k));
      if (plan.pools[i].page_bytes == 0 || pages[i] == 0) continue;
      const auto per_slab = static_cast<int64_t>(plan.slab_bytes / plan.pools[i].page_bytes);
      n += per_slab > 0 ? (pages[i] + per_slab - 1) / per_slab : std::numeric_limits<int64_t>::max() / 4;
    }
    return n;
  };
  int64_t lo = 0, hi = 1;  // the most token pages whose slabs fit: lo fits (or is 0), hi does not
  while (slabs_for(hi) <= plan.slabs && hi < (int64_t{1} << 40)) lo = hi, hi *= 2;
  while (hi - lo > 1) {
    const int64_t mid = lo + (hi - lo) / 2;
    (slabs_for(mid) <= plan.slabs ? lo : hi) = mid;
  }
  plan.max_context = lo * g.page_tokens;
  return plan;
}

uint64_t parse_bytes(const std::string& text) {
  size_t used = 0;
  double v = 0;
  try {
    v = std::stod(text, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (used == 0 || !(v >= 0)) raise(ErrorCode::invalid_argument, "'{}' is not a size (e.g. 80GiB, 512MiB)", text);
  std::string unit = text.substr(used);
  for (auto& c : unit) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  double mult = 1;
  if (unit.empty() || unit == "b") mult = 1;
  else if (unit == "kib" || unit == "k") mult = 1024.0;
  else if (unit == "mib" || unit == "m") mult = 1024.0 * 1024;
  else if (unit == "gib" || unit == "g") mult = 1024.0 * 1024 * 1024;
  else if (unit == "tib" || unit == "t") mult = 1024.0 * 1024 * 1024 * 1024;
  else if (unit == "kb") mult = 1e3;
  else if (unit == "mb") mult = 1e6;
  else if (unit == "gb") mult = 1e9;
  else if (unit == "tb") mult = 1e12;
  else raise(ErrorCode::invalid_argument, "'{}': unknown unit '{}' (B, KiB, MiB, GiB, TiB, KB, MB, GB, TB)", text, unit);
  return static_cast<uint64_t>(v * mult);
}

std::vector<ContextShare> parse_mix(const std::string& text, const std::string& option) {
  std::vector<ContextShare> mix;
  std::stringstream ss(text);
  std::string item;
  while (std::getline(ss, item, ',')) {
    ContextShare s;
    const auto colon = item.find(':');
    std::string tokens = item.substr(0, colon);
    int64_t mult = 1;
    if (!tokens.empty() && (tokens.back() == 'K' || tokens.back() == 'k')) mult = 1024, tokens.pop_back();
    else if (!tokens.empty() && (tokens.back() == 'M' || tokens.back() == 'm')) mult = 1024 * 1024, tokens.pop_back();
    try {
      size_t used = 0;
      const int64_t n = std::stoll(tokens, &used);
      if (used != tokens.size()) throw std::invalid_argument(tokens);
      if (n > (int64_t{1} << 40) / mult) raise(ErrorCode::invalid_argument, "{}: '{}' is longer than 2^40 tokens", option, item);
      s.tokens = n * mult;
      if (colon != std::string::npos) {
        const std::string w = item.substr(colon + 1);
        s.weight = std::stod(w, &used);
        if (used != w.size()) throw std::invalid_argument(w);
      }
    } catch (const Error&) {
      throw;
    } catch (const std::exception&) {
      raise(ErrorCode::invalid_argument, "{}: '{}' is not TOKENS[:WEIGHT] (e.g. 4096:0.7 or 32K:0.3)", option, item);
    }
    if (s.tokens <= 0 || !(s.weight > 0) || !std::isfinite(s.weight)) {
      raise(ErrorCode::invalid_argument, "{}: '{}' needs tokens > 0 and a finite weight > 0", option, item);
    }
    mix.push_back(s);
  }
  if (mix.empty()) raise(ErrorCode::invalid_argument, "{}: no context lengths given", option);
  return mix;
}

std::array<double, kPoolKinds> parse_ratios(const std::string& text, const std::string& option) {
  std::array<double, kPoolKinds> r{};
  std::array<bool, kPoolKinds> seen{};
  std::stringstream ss(text);
  std::string item;
  while (std::getline(ss, item, ',')) {
    const auto eq = item.find('=');
    std::optional<PoolKind> kind;
    for (auto k : kAllPools) {
      if (eq != std::string::npos && item.substr(0, eq) == to_string(k)) kind = k;
    }
    if (!kind) {
      raise(ErrorCode::invalid_argument,
            "{}: '{}' is not POOL=SHARE (pools: window, csa_entry, csa_index, hca_entry, hca_ring)", option, item);
    }
    const auto i = static_cast<size_t>(index(*kind));
    if (seen[i]) raise(ErrorCode::invalid_argument, "{}: {} is given twice", option, to_string(*kind));
    seen[i] = true;
    const std::string v = item.substr(eq + 1);
    char* end = nullptr;
    r[i] = std::strtod(v.c_str(), &end);
    if (v.empty() || *end != '\0' || !(r[i] >= 0 && r[i] <= 1)) {
      raise(ErrorCode::invalid_argument, "{}: '{}' needs a share in [0, 1] after '='", option, item);
    }
  }
  double sum = 0;
  for (double x : r) sum += x;
  if (!(sum > 0)) raise(ErrorCode::invalid_argument, "{}: the shares sum to 0", option);
  return r;
}

std::string format_bytes(double b) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int u = 0;
  while (b >= 1024 && u < 4) b /= 1024, ++u;
  return u == 0 ? fmt::format("{:.0f} B", b) : fmt::format("{:.1f} {}", b, units[u]);
}

}  // namespace troupe::cache
