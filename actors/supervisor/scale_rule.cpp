#include "actors/supervisor/scale_rule.hpp"

#include <fmt/format.h>

namespace troupe::actors {

ScaleDecision ScaleGate::decide(const ScaleRule& r, const ScaleReading& in, Clock::time_point now) {
  ScaleDecision d;
  if (in.active <= 0) {
    low_since_.reset();
    return d;
  }
  const int64_t per_worker = in.waiting / in.active;
  const bool high = per_worker > r.queue_depth_high || in.kv_use > r.kv_use_high ||
                    in.outstanding_handoffs > r.outstanding_handoffs_high;
  const bool low = in.waiting <= r.queue_depth_low * in.active && in.kv_use < r.kv_use_low &&
                   in.outstanding_handoffs == 0;
  if (!low) low_since_.reset();
  else if (!low_since_) low_since_ = now;
  const bool cooled = now - last_change_ >= r.cooldown;
  if (high && in.active < r.max_workers && cooled) {
    d.step = ScaleStep::up;
    d.why = fmt::format("queue depth {} per worker, KV use {:.2f}, {} outstanding handoffs", per_worker, in.kv_use,
                        in.outstanding_handoffs);
  } else if (low && in.active > r.min_workers && cooled && now - *low_since_ >= r.cooldown) {
    d.step = ScaleStep::down;
    d.why = fmt::format("queue depth {}, KV use {:.4f}, no outstanding handoffs for {} ms", in.waiting, in.kv_use,
                        std::chrono::duration_cast<std::chrono::milliseconds>(now - *low_since_).count());
  }
  return d;
}

void ScaleGate::changed(Clock::time_point now) {
  last_change_ = now;
  low_since_.reset();
}

}  // namespace troupe::actors
