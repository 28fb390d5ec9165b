#include "model/tokenizer/added_vocabulary.hpp"

#include <algorithm>

namespace troupe::tokenizer {

AddedVocabulary::AddedVocabulary(std::vector<AddedToken> tokens) : tokens_(std::move(tokens)) {
  for (const auto& t : tokens_) {
    if (t.content.empty()) continue;
    Pass& pass = t.normalized ? normalized_ : raw_;
    pass.by_first_byte[static_cast<unsigned char>(t.content[0])].push_back(&t);
    pass.any = true;
  }
  for (Pass* pass : {&raw_, &normalized_}) {
    for (auto& list : pass->by_first_byte) {
      std::stable_sort(list.begin(), list.end(),
                       [](const AddedToken* a, const AddedToken* b) { return a->content.size() > b->content.size(); });
    }
  }
}

void AddedVocabulary::cut(const Pass& pass, std::string_view text, size_t begin, size_t end,
                          std::vector<Segment>& out) const {
  size_t plain = begin;  // start of the plain text not yet emitted
  size_t i = begin;
  while (i < end) {
    const auto& candidates = pass.by_first_byte[static_cast<unsigned char>(text[i])];
    const AddedToken* hit = nullptr;
    for (const AddedToken* t : candidates) {
      if (t->content.size() <= end - i && text.compare(i, t->content.size(), t->content) == 0) {
        hit = t;
        break;
      }
    }
    if (!hit) {
      ++i;
      continue;
    }
    if (i > plain) out.push_back({plain, i, -1});
    out.push_back({i, i + hit->content.size(), hit->id});
    i += hit->content.size();
    plain = i;
  }
  if (end > plain) out.push_back({plain, end, -1});
}

std::vector<Segment> AddedVocabulary::split(std::string_view text) const {
  std::vector<Segment> first, out;
  if (raw_.any) {
    cut(raw_, text, 0, text.size(), first);
  } else if (!text.empty()) {
    first.push_back({0, text.size(), -1});
  }
  if (!normalized_.any) return first;
  for (const Segment& s : first) {
    if (s.token >= 0) {
      out.push_back(s);
    } else {
      cut(normalized_, text, s.begin, s.end, out);
    }
  }
  return out;
}

}  // namespace troupe::tokenizer
