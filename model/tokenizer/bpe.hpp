// Byte-level BPE: the bytes of one pre-tokenized piece start as one symbol per
// byte and adjacent pairs merge by rank (lowest first, leftmost first among
// equal ranks) until no listed merge applies, exactly as Hugging Face's BPE
// model does. Results are cached per piece because text repeats its words.
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <shared_mutex>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

namespace troupe::tokenizer {

class Bpe {
 public:
  // `byte_ids[b]`: the id of the one-byte token for byte b (-1: none, that
  // byte is then dropped as Hugging Face drops it without an unk token).
  // `merges`: (left id, right id, merged id) in rank order.
  struct Merge {
    int32_t left, right, merged;
  };
  Bpe(const std::array<int32_t, 256>& byte_ids, const std::vector<Merge>& merges);
  ~Bpe();

  // Appends the ids of one piece. Thread-safe.
  void encode_piece(std::string_view bytes, std::vector<int32_t>& out) const;

  // The same without the cache. `loop` picks the merge loop (tests check that
  // both give the same ids); scan takes at most kShortPiece symbols.
  enum class Loop { automatic, scan, heap };
  static constexpr size_t kShortPiece = 48;
  std::vector<int32_t> merge_uncached(std::string_view bytes, Loop loop = Loop::automatic) const;

 private:
  struct Rule {
    int32_t rank, merged;
  };
  // Open addressing over (left, right) pairs: the hot lookup of the merge loop.
  struct PairTable {
    std::vector<uint64_t> keys;
    std::vector<Rule> rules;
    uint64_t mask = 0;
    void build(const std::vector<Merge>& merges);
    const Rule* find(int32_t left, int32_t right) const;
  };
  struct StringHash {
    using is_transparent = void;
    size_t operator()(std::string_view s) const { return std::hash<std::string_view>{}(s); }
  };

  void merge_short(std::vector<int32_t>& symbols) const;
  void merge_long(std::vector<int32_t>& symbols) const;

  std::array<int32_t, 256> byte_ids_;
  PairTable pairs_;
  mutable std::shared_mutex cache_mutex_;
  mutable std::unordered_map<std::string, std::vector<int32_t>, StringHash, std::equal_to<>> cache_;
};

}  // namespace troupe::tokenizer
