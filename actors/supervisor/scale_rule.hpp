// The scale decision, one for both places that scale workers: the
// supervisor of `troupe serve` (workers of one process) and the fleet of
// `troupe run` (worker processes of a topology's node). They differ in what
// a worker is and how one is added or removed, not in when.
//
//   up    when any high mark is crossed (waiting requests per worker in
//         service, the KV use of the most used one, KV handoffs lent and not
//         yet taken), at most once per cooldown;
//   down  when every low mark has held for a whole cooldown without a break
//         (a stabilization window, as Kubernetes' HPA keeps one for scale
//         down): a lull between two requests, or the moment after a worker
//         came back in service and before the load reaches it, is not idle.
// Within [min_workers, max_workers]; an admin's change counts as a change.
#pragma once

#include <chrono>
#include <cstdint>
#include <optional>
#include <string>

namespace troupe::actors {

struct ScaleRule {
  int min_workers = 1;
  int max_workers = 1;
  int64_t queue_depth_high = 32;  // waiting requests per worker in service
  int64_t queue_depth_low = 0;    // waiting requests in all (scale down at or below)
  double kv_use_high = 0.85;      // of the most used worker in service
  double kv_use_low = 0.3;
  int64_t outstanding_handoffs_high = 16;  // KV handoffs lent and not yet taken
  std::chrono::milliseconds cooldown{60000};
};

// What the workers in service report, summed as the rule reads it.
struct ScaleReading {
  int active = 0;               // workers in service
  int64_t waiting = 0;          // their waiting requests, in all
  double kv_use = 0;            // the most used one's
  int64_t outstanding_handoffs = 0;
};

enum class ScaleStep { hold, up, down };

struct ScaleDecision {
  ScaleStep step = ScaleStep::hold;
  std::string why;  // for the log: the marks that decided it
};

class ScaleGate {
 public:
  using Clock = std::chrono::steady_clock;
  explicit ScaleGate(Clock::time_point start = Clock::now()) : last_change_(start) {}

  // The step the rule asks for now (call it on every fresh reading).
  ScaleDecision decide(const ScaleRule& rule, const ScaleReading& in, Clock::time_point now = Clock::now());
  // A worker was added or removed (by the rule or an admin): the cooldown
  // starts again and the low marks must hold a whole window anew.
  void changed(Clock::time_point now = Clock::now());

 private:
  Clock::time_point last_change_;
  std::optional<Clock::time_point> low_since_;  // every low mark has held since
};

}  // namespace troupe::actors
