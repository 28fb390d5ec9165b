// The router: which worker runs a request. Colocated workers: the least loaded
// one (running + waiting + assigned since its last report). With prefill and
// decode workers: the least loaded of each, the prefill worker handing the
// state to the decode worker. Fenced (draining) and lost workers get nothing.
#pragma once

#include <caf/all.hpp>

#include <memory>

#include "actors/protocol.hpp"
#include "base/metrics.hpp"

namespace troupe::actors {

caf::actor spawn_router(caf::actor_system& sys, std::shared_ptr<MetricsRegistry> metrics);

// (workers_atom) -> std::vector<WorkerLoad>: the router's view, for tests and policies.

}  // namespace troupe::actors
