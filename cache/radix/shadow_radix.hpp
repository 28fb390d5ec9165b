// The shadow radix tree: token-id prefixes -> the pages of their state.
//
// Edges are whole token pages (page_tokens tokens). Each node holds, per token
// page, its entry pages (CSA entries, indexer keys, HCA entries: enough to
// serve any later query) and, only at checkpoints, a window page: the raw kv
// of the window before a page boundary with the CSA rings nested in it. A
// node whose window pages are gone is a tombstone: its entries keep serving
// matches that resume at a later checkpoint.
//
// Exactness: the raw kv of layer l depends on layer l-1's attention over the
// previous window, so a window cannot be rebuilt from entries. A prefix is
// resumable exactly only at a page boundary whose window ([B - window, B)) is
// held; a match retreats to the deepest such boundary and the caller
// recomputes the rest. Inserting a prefix keeps the window of its end, so a
// later request sharing the whole inserted prefix recomputes less than one page.
//
// Ownership: the tree holds one reference on every page it lists and releases
// it on tombstone, erase or destruction. Locked nodes (and their ancestors)
// are never erased or spilled, and lose only checkpoint windows no sequence
// holds. Engine thread only.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <span>
#include <vector>

#include "cache/pool/tiers.hpp"

namespace troupe::cache {

class ShadowRadix {
 public:
  struct Node {
    Node* parent = nullptr;
    std::map<std::vector<int32_t>, std::unique_ptr<Node>> children;  // keyed by their first page of tokens
    std::vector<int32_t> tokens;   // whole pages
    std::vector<TokenPage> pages;  // tokens.size() / page_tokens
    int64_t start_page = 0;        // pages from the root to this node's first page
    int32_t locks = 0;             // locks on this node or a descendant
    uint64_t last_use = 0;
    int64_t end_page() const { return start_page + static_cast<int64_t>(pages.size()); }
  };

  struct Match {
    int64_t matched = 0;           // tokens (whole pages) whose entries the tree holds
    int64_t resumable = 0;         // the deepest checkpoint <= matched
    std::vector<TokenPage> pages;  // resumable / page_tokens pages, not retained for the caller
    Node* node = nullptr;          // holds the last resumable page (the root when none): lock it
    bool on_host = false;          // some pages sit in the host tier
  };

  explicit ShadowRadix(const Tiers& tiers);
  ~ShadowRadix();  // releases every page
  ShadowRadix(const ShadowRadix&) = delete;
  ShadowRadix& operator=(const ShadowRadix&) = delete;

  // The longest prefix of tokens[0, limit) the tree serves. Marks the path used.
  Match match(std::span<const int32_t> tokens, int64_t limit);

  // Inserts tokens[0, pages.size() * page_tokens) with their pages. The tree
  // retains the entry pages of pages it lacks and every window page given
  // where it has none, and takes the `checkpoint` marks: the caller passes
  // only the windows of checkpoints (PagedSequence::prefix_for_tree), at
  // least the one of the inserted range's end. Returns the node that ends at
  // the inserted range's end (the root for none).
  Node* insert(std::span<const int32_t> tokens, std::span<const TokenPage> pages);

  // A lock pins a node and its ancestors while a sequence uses their pages.
  void lock(Node* node);
  void unlock(Node* node);

  // Drops checkpoint window pages, least recently used first, until `want`
  // device window pages were freed (or none are left); the node stays and its
  // entries keep serving matches that resume at a later checkpoint. On locked
  // nodes only windows no sequence holds are dropped. The window of a node's
  // end (its tail checkpoint) is dropped only when `tails` is set, and only
  // for nodes with children or locks (an unused leaf without it is worth
  // nothing: evict it instead). Returns how many pages were freed (pages
  // other holders still reference are dropped but not counted).
  int64_t tombstone(int64_t want, bool tails = false);

  // Unlocked nodes with pages in `tier` none of whose children has pages in
  // that tier, least recently used first: what to spill (device) or erase.
  std::vector<Node*> eviction_order(Tier tier) const;
  // Removes a node without children, releasing its pages.
  void erase(Node* leaf);
  // Removes every unlocked node, deepest first.
  void clear();

  // After a copy between tiers: page `page_index` (from the root) along the
  // path of `tokens`, if its `kind` is still `from`, becomes `to` (the tree
  // retains `to` and releases `from`). False when the tree changed meanwhile.
  bool swap(std::span<const int32_t> tokens, int64_t page_index, PoolKind kind, PageRef from, PageRef to);
  // The token prefix from the root to the end of `node`.
  std::vector<int32_t> path_tokens(const Node* node) const;

  // Every page reference the tree holds.
  void for_each_page(const std::function<void(PoolKind, PageRef)>& visit) const;
  int64_t node_count() const { return nodes_; }
  int64_t cached_pages() const;  // token pages in the tree
  const Node& root() const { return root_; }

 private:
  bool resumable_at(const std::vector<const TokenPage*>& path, int64_t k) const;
  Node* split(Node* node, int64_t pages);
  void drop_window(TokenPage& tp);

  Tiers tiers_;
  const CacheGeometry& g_;
  int64_t P_;
  Node root_;
  int64_t nodes_ = 0;
  uint64_t tick_ = 0;
};

}  // namespace troupe::cache
