// The supervisor: the control plane of a group of workers. It spawns them,
// and applies the policies the manifest names:
//   restart    one-for-one, at most max_restarts in window_s; requests on a lost
//              worker are resubmitted by their gateway (none is dropped)
//   long_tail  when the requests on a worker hold more than pressure_threshold
//              of its device pool and more than one runs, park the request with
//              the largest projected state (if it holds min_share of the pool);
//              resume it when it fits back under resume_threshold or nothing
//              else runs; after max_deferrals parks it is left to finish
//   scale      add a worker when queue depth or KV use is high, remove (drain)
//              one when both stayed low for a cooldown (scale_rule.hpp)
// A removed worker drains: the router fences it, its running requests move to
// other workers with their state (park, export, import), then it stops.
#pragma once

#include <caf/all.hpp>

#include <chrono>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "actors/protocol.hpp"
#include "actors/supervisor/scale_rule.hpp"
#include "actors/worker/worker.hpp"
#include "base/metrics.hpp"

namespace troupe::actors {

struct RestartPolicy {
  int max_restarts = 5;
  std::chrono::seconds window{60};
};

struct LongTailPolicy {
  double pressure_threshold = 0.9;  // fraction of the device pool budget in use
  double resume_threshold = 0.6;
  int max_deferrals = 8;            // parks of one request; after that it runs to the end
  double min_share = 0.25;          // park only a request holding at least this much of the pool: a long tail
  std::chrono::milliseconds cooldown{2000};  // between two parks on one worker (loads are audited every 32 steps)
};

struct SupervisorConfig {
  std::vector<WorkerConfig> workers;   // the initial group
  WorkerConfig worker_template;        // for workers the scale policy adds
  RestartPolicy restart;
  std::optional<LongTailPolicy> long_tail;
  std::optional<ScaleRule> scale;
  std::chrono::milliseconds tick{100};
};

caf::actor spawn_supervisor(caf::actor_system& sys, std::shared_ptr<model::Model> model, SupervisorConfig config,
                            caf::actor router, std::shared_ptr<MetricsRegistry> metrics);

// Messages the supervisor answers:
//   (workers_atom)                  -> std::vector<std::string>   names of live workers
//   (crash_atom, name)              crash a worker (tests: the restart policy)
//   (drain_atom, name)      -> bool  remove a worker: fence, migrate, stop (admin / scale down);
//                                   false when there is no such live worker
//   (stop_atom)             -> bool  stop every worker (shutdown; none is restarted)
//   (scale_atom, node, n)   -> std::string  admin: grow (start workers) or shrink (drain) to n
//                                   workers ("" when done, else why not; `node` is unused: one group)
//   (scale_atom)            -> std::string  JSON: the workers and their state
// The ScalePolicy applies itself on ticks. Under `troupe run` each process
// supervises its own worker; the scale policy across processes and admin
// drains of remote workers are the fleet's (actors/supervisor/fleet.hpp).

}  // namespace troupe::actors
