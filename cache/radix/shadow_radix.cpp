#include "cache/radix/shadow_radix.hpp"

#include <algorithm>

#include "base/check.hpp"

namespace troupe::cache {

namespace {

std::vector<int32_t> page_key(std::span<const int32_t> tokens, int64_t page, int64_t P) {
  const auto* p = tokens.data() + page * P;
  return std::vector<int32_t>(p, p + P);
}

bool same_page(std::span<const int32_t> a, int64_t pa, const std::vector<int32_t>& b, int64_t pb, int64_t P) {
  return std::equal(a.begin() + pa * P, a.begin() + (pa + 1) * P, b.begin() + pb * P);
}

template <class F>
void visit_nodes(const ShadowRadix::Node& n, F&& f) {
  for (const auto& [key, child] : n.children) {
    f(*child);
    visit_nodes(*child, f);
  }
}

}  // namespace

ShadowRadix::ShadowRadix(const Tiers& tiers) : tiers_(tiers), g_(tiers.geometry()), P_(g_.page_tokens) {}

ShadowRadix::~ShadowRadix() {
  // The owner is going away: release everything, locked or not.
  visit_nodes(root_, [&](const Node& n) {
    for (const auto& tp : n.pages) {
      for (PoolKind k : kAllPools) {
        if (tp.at(k).valid()) tiers_.release(k, tp.at(k));
      }
    }
  });
}

bool ShadowRadix::resumable_at(const std::vector<const TokenPage*>& path, int64_t k) const {
  if (k == 0) return true;
  if (!path[static_cast<size_t>(k - 1)]->checkpoint) return false;
  for (int64_t i = std::max<int64_t>(0, k * P_ - g_.window) / P_; i < k; ++i) {
    if (!path[static_cast<size_t>(i)]->window().valid()) return false;
  }
  return true;
}

ShadowRadix::Match ShadowRadix::match(std::span<const int32_t> tokens, int64_t limit) {
  Match m;
  m.node = &root_;
  const int64_t max_pages = std::min<int64_t>(limit, static_cast<int64_t>(tokens.size())) / P_;
  std::vector<const TokenPage*> path;
  std::vector<Node*> owner;
  Node* node = &root_;
  ++tick_;
  int64_t k = 0;
  while (k < max_pages) {
    auto it = node->children.find(page_key(tokens, k, P_));
    if (it == node->children.end()) break;
    Node* c = it->second.get();
    c->last_use = tick_;
    const auto n = static_cast<int64_t>(c->pages.size());
    int64_t j = 0;
    while (j < n && k + j < max_pages && same_page(tokens, k + j, c->tokens, j, P_)) {
      path.push_back(&c->pages[static_cast<size_t>(j)]);
      owner.push_back(c);
      ++j;
    }
    k += j;
    if (j < n) break;
    node = c;
  }
  m.matched = k * P_;
  int64_t r = k;
  while (r > 0 && !resumable_at(path, r)) --r;
  m.resumable = r * P_;
  m.pages.reserve(static_cast<size_t>(r));
  for (int64_t i = 0; i < r; ++i) {
    m.pages.push_back(*path[static_cast<size_t>(i)]);
    for (PoolKind kind : kAllPools) m.on_host |= m.pages.back().at(kind).on(Tier::host);
  }
  if (r > 0) m.node = owner[static_cast<size_t>(r - 1)];
  return m;
}

ShadowRadix::Node* ShadowRadix::split(Node* node, int64_t pages) {
  TROUPE_CHECK(pages > 0 && pages < static_cast<int64_t>(node->pages.size()), "split inside a node");
  Node* parent = node->parent;
  auto key = page_key(node->tokens, 0, P_);
  auto self = std::move(parent->children.at(key));
  auto upper = std::make_unique<Node>();
  upper->parent = parent;
  upper->tokens.assign(node->tokens.begin(), node->tokens.begin() + pages * P_);
  upper->pages.assign(node->pages.begin(), node->pages.begin() + pages);
  upper->start_page = node->start_page;
  upper->locks = node->locks;
  upper->last_use = node->last_use;
  node->tokens.erase(node->tokens.begin(), node->tokens.begin() + pages * P_);
  node->pages.erase(node->pages.begin(), node->pages.begin() + pages);
  node->start_page += pages;
  node->parent = upper.get();
  Node* up = upper.get();
  up->children.emplace(page_key(node->tokens, 0, P_), std::move(self));
  parent->children[key] = std::move(upper);
  ++nodes_;
  return up;
}

ShadowRadix::Node* ShadowRadix::insert(std::span<const int32_t> tokens, std::span<const TokenPage> pages) {
  const auto n = static_cast<int64_t>(pages.size());
  TROUPE_CHECK(static_cast<int64_t>(tokens.size()) >= n * P_, "insert needs the tokens of every page");
  auto take_window = [&](TokenPage& mine, const TokenPage& given, int64_t) {
    if (!mine.window().valid() && given.window().valid()) {
      mine.window() = given.window();
      tiers_.retain(PoolKind::window, mine.window());
    }
    mine.checkpoint |= given.checkpoint;
  };
  Node* node = &root_;
  ++tick_;
  int64_t k = 0;
  while (k < n) {
    auto it = node->children.find(page_key(tokens, k, P_));
    if (it == node->children.end()) {
      auto c = std::make_unique<Node>();
      c->parent = node;
      c->start_page = k;
      c->last_use = tick_;
      c->tokens.assign(tokens.begin() + k * P_, tokens.begin() + n * P_);
      for (int64_t i = k; i < n; ++i) {
        TokenPage tp;
        const TokenPage& given = pages[static_cast<size_t>(i)];
        for (PoolKind kind : kEntryPools) {
          if (!g_.has(kind)) continue;
          TROUPE_CHECK(given.at(kind).valid(), "inserted page lacks an entry page");
          tp.at(kind) = given.at(kind);
          tiers_.retain(kind, tp.at(kind));
        }
        take_window(tp, given, i);
        c->pages.push_back(tp);
      }
      Node* raw = c.get();
      node->children.emplace(page_key(tokens, k, P_), std::move(c));
      ++nodes_;
      return raw;
    }
    Node* c = it->second.get();
    c->last_use = tick_;
    const auto len = static_cast<int64_t>(c->pages.size());
    int64_t j = 1;
    while (j < len && k + j < n && same_page(tokens, k + j, c->tokens, j, P_)) ++j;
    if (j < len) c = split(c, j);
    for (int64_t i = 0; i < j; ++i) take_window(c->pages[static_cast<size_t>(i)], pages[static_cast<size_t>(k + i)], k + i);
    k += j;
    node = c;
  }
  return node;
}

void ShadowRadix::lock(Node* node) {
  for (Node* n = node; n != nullptr; n = n->parent) ++n->locks;
}

void ShadowRadix::unlock(Node* node) {
  for (Node* n = node; n != nullptr; n = n->parent) {
    TROUPE_CHECK(n->locks > 0, "unlock of an unlocked node");
    --n->locks;
  }
}

void ShadowRadix::drop_window(TokenPage& tp) {
  tiers_.release(PoolKind::window, tp.window());
  tp.window() = {};
}

int64_t ShadowRadix::tombstone(int64_t want, bool tails) {
  const int64_t span = (g_.window + P_ - 1) / P_;  // the tail window's pages
  auto droppable = [&](const Node& n, size_t i) {
    const PageRef w = n.pages[i].window();
    if (!w.on(Tier::device)) return false;
    // On a locked path only windows nobody else holds: the running sequence
    // does not read them, they only serve later matches.
    if (n.locks > 0 && tiers_.device().pool(PoolKind::window).refs(w.id) > 1) return false;
    const bool tail = static_cast<int64_t>(i) >= static_cast<int64_t>(n.pages.size()) - span;
    return !tail || (tails && (!n.children.empty() || n.locks > 0));
  };
  std::vector<Node*> order;
  visit_nodes(root_, [&](const Node& n) {
    for (size_t i = 0; i < n.pages.size(); ++i) {
      if (droppable(n, i)) {
        order.push_back(const_cast<Node*>(&n));
        return;
      }
    }
  });
  std::sort(order.begin(), order.end(), [](const Node* a, const Node* b) { return a->last_use < b->last_use; });
  int64_t freed = 0;
  for (Node* n : order) {
    for (size_t i = 0; i < n->pages.size(); ++i) {
      auto& tp = n->pages[i];
      if (freed >= want) return freed;
      if (!droppable(*n, i)) continue;
      if (tiers_.device().pool(PoolKind::window).refs(tp.window().id) == 1) ++freed;
      drop_window(tp);
    }
  }
  return freed;
}

std::vector<ShadowRadix::Node*> ShadowRadix::eviction_order(Tier tier) const {
  auto holds = [&](const Node& n) {
    for (const auto& tp : n.pages) {
      for (PoolKind k : kAllPools) {
        if (tp.at(k).on(tier)) return true;
      }
    }
    return false;
  };
  std::vector<Node*> out;
  visit_nodes(root_, [&](const Node& n) {
    if (n.locks > 0 || !holds(n)) return;
    for (const auto& [key, c] : n.children) {
      if (holds(*c)) return;
    }
    out.push_back(const_cast<Node*>(&n));
  });
  std::sort(out.begin(), out.end(), [](const Node* a, const Node* b) { return a->last_use < b->last_use; });
  return out;
}

void ShadowRadix::erase(Node* leaf) {
  TROUPE_CHECK(leaf != &root_ && leaf->children.empty() && leaf->locks == 0, "erase of a locked or inner node");
  for (auto& tp : leaf->pages) {
    for (PoolKind k : kAllPools) {
      if (tp.at(k).valid()) tiers_.release(k, tp.at(k));
    }
  }
  Node* parent = leaf->parent;
  parent->children.erase(page_key(leaf->tokens, 0, P_));
  --nodes_;
}

void ShadowRadix::clear() {
  // Post-order: children first, so every erase is of a leaf.
  std::function<void(Node*)> drop = [&](Node* n) {
    std::vector<Node*> kids;
    for (auto& [key, c] : n->children) kids.push_back(c.get());
    for (Node* c : kids) drop(c);
    if (n != &root_ && n->children.empty() && n->locks == 0) erase(n);
  };
  drop(&root_);
}

bool ShadowRadix::swap(std::span<const int32_t> tokens, int64_t page_index, PoolKind kind, PageRef from, PageRef to) {
  if (static_cast<int64_t>(tokens.size()) < (page_index + 1) * P_) return false;
  Node* node = &root_;
  int64_t k = 0;
  while (true) {
    auto it = node->children.find(page_key(tokens, k, P_));
    if (it == node->children.end()) return false;
    Node* c = it->second.get();
    const int64_t end = c->end_page();
    for (int64_t i = k; i < std::min(end, page_index + 1); ++i) {
      if (!same_page(tokens, i, c->tokens, i - k, P_)) return false;
    }
    if (page_index < end) {
      PageRef& r = c->pages[static_cast<size_t>(page_index - k)].at(kind);
      if (r != from) return false;
      tiers_.retain(kind, to);
      tiers_.release(kind, from);
      r = to;
      return true;
    }
    node = c;
    k = end;
  }
}

std::vector<int32_t> ShadowRadix::path_tokens(const Node* node) const {
  std::vector<const Node*> chain;
  for (const Node* n = node; n != nullptr && n != &root_; n = n->parent) chain.push_back(n);
  std::vector<int32_t> out;
  for (auto it = chain.rbegin(); it != chain.rend(); ++it) out.insert(out.end(), (*it)->tokens.begin(), (*it)->tokens.end());
  return out;
}

void ShadowRadix::for_each_page(const std::function<void(PoolKind, PageRef)>& visit) const {
  visit_nodes(root_, [&](const Node& n) {
    for (const auto& tp : n.pages) {
      for (PoolKind k : kAllPools) {
        if (tp.at(k).valid()) visit(k, tp.at(k));
      }
    }
  });
}

int64_t ShadowRadix::cached_pages() const {
  int64_t n = 0;
  visit_nodes(root_, [&](const Node& x) { n += static_cast<int64_t>(x.pages.size()); });
  return n;
}

}  // namespace troupe::cache
