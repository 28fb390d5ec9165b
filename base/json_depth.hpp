// How deeply a parsed JSON value nests, found without recursion: code that walks a
// value recursively (a schema compiler, nlohmann's dump()) checks it first, so that a
// client's deeply nested body is a 400, not a stack overflow.
#pragma once

#include <cstddef>
#include <utility>
#include <vector>

namespace troupe {

// Whether `value` (an nlohmann::json) nests more than `limit` arrays / objects deep.
template <class Json>
bool nests_deeper_than(const Json& value, size_t limit) {
  std::vector<std::pair<const Json*, size_t>> todo{{&value, 1}};
  while (!todo.empty()) {
    const auto [v, depth] = todo.back();
    todo.pop_back();
    if (!v->is_structured()) continue;
    if (depth > limit) return true;
    for (const auto& child : *v) todo.emplace_back(&child, depth + 1);
  }
  return false;
}

}  // namespace troupe
