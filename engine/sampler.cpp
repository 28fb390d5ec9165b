#include "engine/sampler.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <vector>

namespace troupe::engine {

namespace {
uint64_t splitmix(uint64_t z) {
  z += 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}
}  // namespace

double uniform(uint64_t seed, int64_t position) {
  const uint64_t x = splitmix(seed ^ splitmix(static_cast<uint64_t>(position)));
  return static_cast<double>(x >> 11) * (1.0 / 9007199254740992.0);
}

std::string check(const SamplingParams& p) {
  if (!(p.temperature >= 0.0f) || !std::isfinite(p.temperature)) return fmt::format("temperature {} must be >= 0", p.temperature);
  if (!(p.top_p > 0.0f && p.top_p <= 1.0f)) return fmt::format("top_p {} must be in (0, 1]", p.top_p);
  if (p.top_k < 0) return fmt::format("top_k {} must be >= 0", p.top_k);
  for (const auto& q : p.answer_prefixes) {
    if (q.empty()) return "an answer prefix is empty";
    for (int32_t t : q) {
      if (t < 0) return fmt::format("an answer prefix has token {}", t);
    }
  }
  if (!p.answer_prefixes.empty() && !p.json_schema.empty()) {
    return "answer prefixes and a json schema cannot be combined (answer_schemas hold what follows a prefix)";
  }
  if (!p.answer_trigger.empty() && p.answer_prefixes.empty()) return "an answer trigger without answer prefixes";
  if (!p.answer_schemas.empty() && p.answer_schemas.size() != p.answer_prefixes.size()) {
    return fmt::format("{} answer schemas for {} answer prefixes", p.answer_schemas.size(), p.answer_prefixes.size());
  }
  if (!(p.min_p >= 0.0f && p.min_p <= 1.0f)) return fmt::format("min_p {} must be in [0, 1]", p.min_p);
  if (p.max_tokens < 0) return fmt::format("max_tokens {} must be >= 0", p.max_tokens);
  if (p.min_tokens < 0 || p.min_tokens > p.max_tokens) {
    return fmt::format("min_tokens {} must be in [0, max_tokens {}]", p.min_tokens, p.max_tokens);
  }
  if (!(p.repetition_penalty > 0.0f) || !std::isfinite(p.repetition_penalty)) {
    return fmt::format("repetition_penalty {} must be > 0", p.repetition_penalty);
  }
  if (!(std::fabs(p.frequency_penalty) <= kMaxAbsPenalty)) {
    return fmt::format("frequency_penalty {} must be in [-{}, {}]", p.frequency_penalty, kMaxAbsPenalty, kMaxAbsPenalty);
  }
  if (!(std::fabs(p.presence_penalty) <= kMaxAbsPenalty)) {
    return fmt::format("presence_penalty {} must be in [-{}, {}]", p.presence_penalty, kMaxAbsPenalty, kMaxAbsPenalty);
  }
  if (p.logit_bias.size() > kMaxLogitBiasEntries) {
    return fmt::format("logit_bias has {} entries, at most {}", p.logit_bias.size(), kMaxLogitBiasEntries);
  }
  for (auto [t, bias] : p.logit_bias) {
    if (t < 0) return fmt::format("logit_bias names token {}", t);
    if (!(std::fabs(bias) <= kMaxAbsLogitBias)) {
      return fmt::format("logit_bias {} for token {} must be in [-{}, {}]", bias, t, kMaxAbsLogitBias, kMaxAbsLogitBias);
    }
  }
  return {};
}

void TokenCounts::update(std::span<const int32_t> tokens, int64_t start) {
  if (start != answer_start || counted > static_cast<int64_t>(tokens.size())) *this = TokenCounts{0, start, {}, {}};
  for (auto i = static_cast<size_t>(counted); i < tokens.size(); ++i) {
    seen.insert(tokens[i]);
    if (static_cast<int64_t>(i) >= start) ++answer[tokens[i]];
  }
  counted = static_cast<int64_t>(tokens.size());
}

TokenCounts TokenCounts::of(std::span<const int32_t> tokens, int64_t answer_start) {
  TokenCounts c;
  c.update(tokens, answer_start);
  return c;
}

void adjust_logits(std::span<float> l, const SamplingParams& p, const TokenCounts& counts) {
  if (!p.adjusts_logits()) return;
  const auto V = static_cast<int64_t>(l.size());
  for (auto [t, bias] : p.logit_bias) {
    if (t >= 0 && t < V) l[static_cast<size_t>(t)] += bias;
  }
  if (p.repetition_penalty != 1.0f) {
    for (int32_t t : counts.seen) {
      if (t < 0 || t >= V) continue;
      float& x = l[static_cast<size_t>(t)];
      x = x > 0.0f ? x / p.repetition_penalty : x * p.repetition_penalty;
    }
  }
  if (p.frequency_penalty != 0.0f || p.presence_penalty != 0.0f) {
    for (auto [t, count] : counts.answer) {
      if (t < 0 || t >= V) continue;
      l[static_cast<size_t>(t)] -= p.frequency_penalty * static_cast<float>(count) + p.presence_penalty;
    }
  }
}

std::vector<int32_t> prefix_choices(const SamplingParams& p, std::span<const int32_t> whole_answer) {
  const size_t from = p.held_from(whole_answer);
  if (from == SamplingParams::kUntriggered) return {};  // the trigger has not come
  const auto answer = whole_answer.subspan(from);
  std::vector<int32_t> next;
  for (const auto& q : p.answer_prefixes) {
    const size_t n = std::min(q.size(), answer.size());
    if (!std::equal(q.begin(), q.begin() + static_cast<std::ptrdiff_t>(n), answer.begin())) continue;
    if (q.size() <= answer.size()) return {};  // a whole prefix: free from here
    next.push_back(q[answer.size()]);
  }
  std::sort(next.begin(), next.end());
  next.erase(std::unique(next.begin(), next.end()), next.end());
  return next;
}

int32_t sample(std::span<const float> logits, const SamplingParams& p, uint64_t seed, int64_t position,
               int32_t generated, std::span<const int64_t> eos, const TokenCounts& counts,
               std::span<const int32_t> answer, std::span<const uint64_t> allowed) {
  const auto V = static_cast<int32_t>(logits.size());
  std::vector<float> l(logits.begin(), logits.end());
  adjust_logits(l, p, counts);
  constexpr float kOff = -std::numeric_limits<float>::infinity();
  if (generated < p.min_tokens) {
    for (int32_t s : p.stop_ids) {
      if (s >= 0 && s < V) l[static_cast<size_t>(s)] = kOff;
    }
    if (!p.ignore_eos) {
      for (int64_t e : eos) {
        if (e >= 0 && e < V) l[static_cast<size_t>(e)] = kOff;
      }
    }
  }
  if (!p.answer_prefixes.empty()) {  // only the tokens that continue a prefix (kept finite: one is drawn)
    const auto next = prefix_choices(p, answer);
    std::vector<float> only(l.size(), kOff);
    bool any = false;
    for (int32_t t : next) {
      if (t < 0 || t >= V) continue;  // (an id past this model's vocabulary cannot be drawn)
      only[static_cast<size_t>(t)] = std::max(l[static_cast<size_t>(t)], std::numeric_limits<float>::lowest());
      any = true;
    }
    if (any) l.swap(only);
  }
  if (!allowed.empty()) {
    auto is_allowed = [&](size_t i) { return i < allowed.size() * 64 && (allowed[i >> 6] >> (i & 63) & 1); };
    bool any = false;
    for (size_t i = 0; i < l.size(); ++i) {
      if (!is_allowed(i)) l[i] = kOff;
      any = any || l[i] != kOff;
    }
    if (!any) {  // every allowed id masked above (min_tokens): kept finite, since one is drawn
      for (size_t i = 0; i < l.size(); ++i) {
        if (is_allowed(i)) l[i] = std::numeric_limits<float>::lowest();
      }
    }
  }
  if (p.temperature <= 0.0f || p.top_k == 1) {
    return static_cast<int32_t>(std::max_element(l.begin(), l.end()) - l.begin());  // first of the maxima
  }
  // Candidates by falling logit (ties: lower id first), cut to top_k.
  std::vector<int32_t> ids(static_cast<size_t>(V));
  std::iota(ids.begin(), ids.end(), 0);
  const int32_t k = p.top_k > 0 ? std::min(p.top_k, V) : V;
  auto by_logit = [&](int32_t a, int32_t b) {
    return l[static_cast<size_t>(a)] > l[static_cast<size_t>(b)] || (l[static_cast<size_t>(a)] == l[static_cast<size_t>(b)] && a < b);
  };
  std::partial_sort(ids.begin(), ids.begin() + k, ids.end(), by_logit);
  ids.resize(static_cast<size_t>(k));
  // Softmax of logits / temperature over the candidates (masked ones get 0).
  const double top = l[static_cast<size_t>(ids[0])];
  std::vector<double> prob(ids.size());
  double sum = 0;
  for (size_t i = 0; i < ids.size(); ++i) {
    const float x = l[static_cast<size_t>(ids[i])];
    prob[i] = x == kOff ? 0.0 : std::exp((x - top) / p.temperature);
    sum += prob[i];
  }
  // min_p (vLLM's order: before top_p): the head whose probability is at least min_p
  // times the first's (prob[] is relative to it).
  if (p.min_p > 0.0f) {
    size_t head = 1;
    while (head < ids.size() && prob[head] >= p.min_p) ++head;
    for (size_t i = head; i < ids.size(); ++i) sum -= prob[i];
    ids.resize(head);
    prob.resize(head);
  }
  // Nucleus: the shortest head whose mass reaches top_p (at least one token).
  size_t keep = ids.size();
  if (p.top_p < 1.0f) {
    double mass = 0;
    for (size_t i = 0; i < ids.size(); ++i) {
      mass += prob[i] / sum;
      if (mass >= p.top_p) {
        keep = i + 1;
        break;
      }
    }
  }
  double kept = 0;
  for (size_t i = 0; i < keep; ++i) kept += prob[i];
  const double u = uniform(seed, position) * kept;
  double acc = 0;
  for (size_t i = 0; i < keep; ++i) {
    acc += prob[i];
    if (u < acc) return ids[i];
  }
  for (size_t i = keep; i-- > 0;) {
    if (prob[i] > 0) return ids[i];
  }
  return ids[0];
}

}  // namespace troupe::engine
