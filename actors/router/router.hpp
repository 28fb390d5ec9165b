// The router: which worker runs a request. Colocated workers: the least loaded
// one (running + waiting + assigned since its last report). With prefill and
// decode workers: the least loaded of each, the prefill worker handing the
// state to the decode worker. Fenced (draining) and lost workers get nothing.
#pragma once

#include <caf/all.hpp>

#include <chrono>
#include <memory>

#include "actors/protocol.hpp"
#include "base/metrics.hpp"

namespace troupe::actors {

struct RouterOptions {
  // A job no worker can take (none registered, all fenced) waits this long for
  // one to register (a worker process restarting) before it fails; 0: fails at once.
  std::chrono::milliseconds hold_when_empty{0};
};

caf::actor spawn_router(caf::actor_system& sys, std::shared_ptr<MetricsRegistry> metrics, RouterOptions options = {});

// (workers_atom) -> std::vector<WorkerLoad>: the router's view, for tests and policies
//   (a worker fenced or out of service shows as draining).
// (fence_atom, name, bool): a worker gets no new requests (until it registers again).
// (hold_atom, name, bool): a worker gets no new requests while held, across
//   re-registrations (the fleet's standby slots and scale-downs).

}  // namespace troupe::actors
