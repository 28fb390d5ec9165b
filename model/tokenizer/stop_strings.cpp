#include "model/tokenizer/stop_strings.hpp"

#include <algorithm>

namespace troupe::tokenizer {

StopStrings::StopStrings(std::vector<std::string> stops) {
  for (auto& s : stops) {
    if (s.empty()) continue;
    longest_ = std::max(longest_, s.size());
    stops_.push_back(std::move(s));
  }
}

StopStrings::Step StopStrings::push(std::string_view text) {
  Step step;
  if (stopped_) return step;
  held_ += text;
  // The earliest complete stop string wins.
  size_t stop_at = std::string::npos;
  for (const auto& s : stops_) stop_at = std::min(stop_at, held_.find(s));
  if (stop_at != std::string::npos) {
    step.text = held_.substr(0, stop_at);
    step.stopped = stopped_ = true;
    held_.clear();
    return step;
  }
  // Keep the longest suffix that is a proper prefix of some stop string.
  size_t keep = 0;
  for (const auto& s : stops_) {
    for (size_t k = std::min(s.size() - 1, held_.size()); k > keep; --k) {
      if (held_.compare(held_.size() - k, k, s, 0, k) == 0) {
        keep = k;
        break;
      }
    }
  }
  step.text = held_.substr(0, held_.size() - keep);
  held_.erase(0, held_.size() - keep);
  return step;
}

std::string StopStrings::finish() {
  std::string out;
  if (!stopped_) out.swap(held_);
  return out;
}

}  // namespace troupe::tokenizer
