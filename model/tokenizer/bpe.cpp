#include "model/tokenizer/bpe.hpp"

#include <climits>
#include <mutex>
#include <queue>

#include "base/check.hpp"

namespace troupe::tokenizer {
namespace {

constexpr uint64_t kEmpty = ~0ull;
// The cache holds recent pieces up to this many; past it, pieces are merged
// again rather than letting adversarial text grow memory without bound.
constexpr size_t kCacheEntries = 1 << 16;
constexpr size_t kCacheablePiece = 64;

uint64_t pair_key(int32_t left, int32_t right) {
  return (static_cast<uint64_t>(static_cast<uint32_t>(left)) << 32) | static_cast<uint32_t>(right);
}

uint64_t mix(uint64_t k) {
  k ^= k >> 33;
  k *= 0xff51afd7ed558ccdull;
  k ^= k >> 33;
  return k;
}

}  // namespace

void Bpe::PairTable::build(const std::vector<Merge>& merges) {
  size_t cap = 16;
  while (cap < merges.size() * 2) cap <<= 1;
  keys.assign(cap, kEmpty);
  rules.assign(cap, Rule{INT_MAX, -1});
  mask = cap - 1;
  for (size_t rank = 0; rank < merges.size(); ++rank) {
    const auto& m = merges[rank];
    const uint64_t key = pair_key(m.left, m.right);
    uint64_t slot = mix(key) & mask;
    while (keys[slot] != kEmpty && keys[slot] != key) slot = (slot + 1) & mask;
    if (keys[slot] == key) continue;  // a repeated merge keeps its first (lowest) rank
    keys[slot] = key;
    rules[slot] = Rule{static_cast<int32_t>(rank), m.merged};
  }
}

const Bpe::Rule* Bpe::PairTable::find(int32_t left, int32_t right) const {
  const uint64_t key = pair_key(left, right);
  uint64_t slot = mix(key) & mask;
  while (true) {
    const uint64_t k = keys[slot];
    if (k == key) return &rules[slot];
    if (k == kEmpty) return nullptr;
    slot = (slot + 1) & mask;
  }
}

Bpe::Bpe(const std::array<int32_t, 256>& byte_ids, const std::vector<Merge>& merges) : byte_ids_(byte_ids) {
  pairs_.build(merges);
}

Bpe::~Bpe() = default;

void Bpe::merge_short(std::vector<int32_t>& s) const {
  // ranks[i]: the rule for (s[i], s[i+1]).
  int32_t ranks[kShortPiece];
  int32_t merged[kShortPiece];
  size_t n = s.size();
  auto rate = [&](size_t i) {
    const Rule* r = pairs_.find(s[i], s[i + 1]);
    ranks[i] = r ? r->rank : INT_MAX;
    merged[i] = r ? r->merged : -1;
  };
  for (size_t i = 0; i + 1 < n; ++i) rate(i);
  while (n > 1) {
    size_t best = 0;
    for (size_t i = 1; i + 1 < n; ++i) {
      if (ranks[i] < ranks[best]) best = i;
    }
    if (ranks[best] == INT_MAX) break;
    s[best] = merged[best];
    for (size_t i = best + 1; i + 1 < n; ++i) {
      s[i] = s[i + 1];
      ranks[i] = ranks[i + 1];
      merged[i] = merged[i + 1];
    }
    --n;
    s.resize(n);
    if (best > 0) rate(best - 1);
    if (best + 1 < n) rate(best);
  }
}

void Bpe::merge_long(std::vector<int32_t>& s) const {
  // Hugging Face's loop: a heap of candidate merges ordered by (rank, position)
  // over a linked list of symbols; stale candidates are skipped when popped.
  const size_t n = s.size();
  std::vector<int32_t> prev(n), next(n);
  for (size_t i = 0; i < n; ++i) {
    prev[i] = static_cast<int32_t>(i) - 1;
    next[i] = i + 1 < n ? static_cast<int32_t>(i + 1) : -1;
  }
  struct Candidate {
    int32_t rank, pos, left, right;
    bool operator>(const Candidate& o) const { return rank != o.rank ? rank > o.rank : pos > o.pos; }
  };
  std::priority_queue<Candidate, std::vector<Candidate>, std::greater<>> heap;
  auto offer = [&](int32_t pos) {
    const int32_t nx = next[pos];
    if (nx < 0) return;
    if (const Rule* r = pairs_.find(s[pos], s[nx])) heap.push({r->rank, pos, s[pos], s[nx]});
  };
  for (size_t i = 0; i + 1 < n; ++i) offer(static_cast<int32_t>(i));
  std::vector<bool> gone(n, false);
  while (!heap.empty()) {
    const Candidate c = heap.top();
    heap.pop();
    const int32_t nx = next[c.pos];
    if (gone[c.pos] || nx < 0 || s[c.pos] != c.left || s[nx] != c.right) continue;
    s[c.pos] = pairs_.find(c.left, c.right)->merged;
    gone[nx] = true;
    next[c.pos] = next[nx];
    if (next[nx] >= 0) prev[next[nx]] = c.pos;
    if (prev[c.pos] >= 0) offer(prev[c.pos]);
    offer(c.pos);
  }
  size_t w = 0;
  for (int32_t i = 0; i >= 0; i = next[i]) s[w++] = s[i];
  s.resize(w);
}

std::vector<int32_t> Bpe::merge_uncached(std::string_view bytes, Loop loop) const {
  std::vector<int32_t> symbols;
  symbols.reserve(bytes.size());
  for (unsigned char b : bytes) {
    if (byte_ids_[b] >= 0) symbols.push_back(byte_ids_[b]);
  }
  // Short pieces scan for the best pair, which beats a heap when a piece has a
  // handful of symbols; long ones (a run of letters, base64) use the heap.
  if (loop == Loop::scan || (loop == Loop::automatic && symbols.size() <= kShortPiece)) {
    TROUPE_CHECK(symbols.size() <= kShortPiece, "the scanning merge loop takes at most kShortPiece symbols");
    merge_short(symbols);
  } else {
    merge_long(symbols);
  }
  return symbols;
}

void Bpe::encode_piece(std::string_view bytes, std::vector<int32_t>& out) const {
  if (bytes.size() == 1) {
    if (byte_ids_[static_cast<unsigned char>(bytes[0])] >= 0)
      out.push_back(byte_ids_[static_cast<unsigned char>(bytes[0])]);
    return;
  }
  const bool cacheable = bytes.size() <= kCacheablePiece;
  if (cacheable) {
    std::shared_lock lock(cache_mutex_);
    auto it = cache_.find(bytes);
    if (it != cache_.end()) {
      out.insert(out.end(), it->second.begin(), it->second.end());
      return;
    }
  }
  auto ids = merge_uncached(bytes);
  out.insert(out.end(), ids.begin(), ids.end());
  if (cacheable) {
    std::unique_lock lock(cache_mutex_);
    if (cache_.size() >= kCacheEntries) cache_.clear();
    cache_.emplace(std::string(bytes), std::move(ids));
  }
}

}  // namespace troupe::tokenizer
