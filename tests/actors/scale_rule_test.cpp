// The scale decision both supervisors use: up on any high mark after the
// cooldown; down only when every low mark held for a whole cooldown; within
// [min_workers, max_workers]; a change (the rule's or an admin's) restarts both clocks.
#include <gtest/gtest.h>

#include "actors/supervisor/scale_rule.hpp"

namespace troupe::actors {
namespace {

using namespace std::chrono_literals;
using Clock = ScaleGate::Clock;

ScaleRule rule() {
  ScaleRule r;
  r.min_workers = 1;
  r.max_workers = 3;
  r.queue_depth_high = 4;
  r.queue_depth_low = 0;
  r.kv_use_high = 0.8;
  r.kv_use_low = 0.1;
  r.outstanding_handoffs_high = 8;
  r.cooldown = 3000ms;
  return r;
}

ScaleReading reading(int active, int64_t waiting, double kv, int64_t handoffs = 0) {
  return ScaleReading{active, waiting, kv, handoffs};
}

TEST(ScaleRule, any_high_mark_adds_a_worker_once_the_cooldown_passed) {
  const auto t0 = Clock::now();
  ScaleGate g(t0);
  const auto r = rule();
  EXPECT_EQ(g.decide(r, reading(1, 9, 0.2), t0 + 1s).step, ScaleStep::hold);  // cooling down since the start
  EXPECT_EQ(g.decide(r, reading(1, 9, 0.2), t0 + 3s).step, ScaleStep::up);    // 9 waiting per worker > 4
  EXPECT_EQ(g.decide(r, reading(2, 2, 0.9), t0 + 3s).step, ScaleStep::up);    // KV use
  EXPECT_EQ(g.decide(r, reading(2, 2, 0.5, 9), t0 + 3s).step, ScaleStep::up); // outstanding handoffs
  EXPECT_EQ(g.decide(r, reading(2, 8, 0.5), t0 + 3s).step, ScaleStep::hold);  // 4 per worker: not above
  EXPECT_EQ(g.decide(r, reading(3, 99, 0.99), t0 + 3s).step, ScaleStep::hold); // at max_workers
  g.changed(t0 + 3s);
  EXPECT_EQ(g.decide(r, reading(2, 99, 0.5), t0 + 5s).step, ScaleStep::hold);  // cooling down again
  EXPECT_EQ(g.decide(r, reading(2, 99, 0.5), t0 + 6s).step, ScaleStep::up);
}

TEST(ScaleRule, a_worker_goes_only_after_the_low_marks_held_for_a_whole_cooldown) {
  const auto t0 = Clock::now();
  ScaleGate g(t0);
  const auto r = rule();
  // Idle from 10 s on: not before 13 s.
  EXPECT_EQ(g.decide(r, reading(2, 0, 0.0), t0 + 10s).step, ScaleStep::hold);
  EXPECT_EQ(g.decide(r, reading(2, 0, 0.0), t0 + 12s).step, ScaleStep::hold);
  // A moment of load breaks the window; it starts again after it.
  EXPECT_EQ(g.decide(r, reading(2, 0, 0.3), t0 + 12500ms).step, ScaleStep::hold);
  EXPECT_EQ(g.decide(r, reading(2, 0, 0.0), t0 + 13s).step, ScaleStep::hold);
  EXPECT_EQ(g.decide(r, reading(2, 0, 0.0), t0 + 15500ms).step, ScaleStep::hold);
  const auto d = g.decide(r, reading(2, 0, 0.0), t0 + 16s);
  EXPECT_EQ(d.step, ScaleStep::down);
  EXPECT_NE(d.why.find("3000 ms"), std::string::npos) << d.why;
  // Waiting requests or handoffs not yet taken are not idle either.
  ScaleGate h(t0);
  EXPECT_EQ(h.decide(r, reading(2, 1, 0.0), t0 + 10s).step, ScaleStep::hold);
  EXPECT_EQ(h.decide(r, reading(2, 0, 0.0, 1), t0 + 20s).step, ScaleStep::hold);
  EXPECT_EQ(h.decide(r, reading(2, 0, 0.0), t0 + 21s).step, ScaleStep::hold);
  EXPECT_EQ(h.decide(r, reading(2, 0, 0.0), t0 + 24s).step, ScaleStep::down);
  // Never below min_workers.
  EXPECT_EQ(h.decide(r, reading(1, 0, 0.0), t0 + 60s).step, ScaleStep::hold);
}

TEST(ScaleRule, a_worker_back_in_service_is_not_removed_before_its_load_arrives) {
  // The fleet's scale up (or an admin's) is a change: the low marks must hold a
  // whole window after it, however long the node was idle before.
  const auto t0 = Clock::now();
  ScaleGate g(t0);
  const auto r = rule();
  EXPECT_EQ(g.decide(r, reading(1, 0, 0.0), t0 + 10s).step, ScaleStep::hold);
  g.changed(t0 + 20s);  // an admin asks for 2
  EXPECT_EQ(g.decide(r, reading(2, 0, 0.0), t0 + 20s).step, ScaleStep::hold);
  EXPECT_EQ(g.decide(r, reading(2, 0, 0.0), t0 + 22s).step, ScaleStep::hold);
  EXPECT_EQ(g.decide(r, reading(2, 0, 0.2), t0 + 23s).step, ScaleStep::hold);  // the load arrived
  EXPECT_EQ(g.decide(r, reading(2, 0, 0.0), t0 + 40s).step, ScaleStep::hold);  // idle again from 40 s
  EXPECT_EQ(g.decide(r, reading(2, 0, 0.0), t0 + 43s).step, ScaleStep::down);
}

TEST(ScaleRule, no_worker_in_service_decides_nothing) {
  const auto t0 = Clock::now();
  ScaleGate g(t0);
  EXPECT_EQ(g.decide(rule(), reading(0, 50, 1.0), t0 + 60s).step, ScaleStep::hold);
}

}  // namespace
}  // namespace troupe::actors
