// The worker actor: one engine (engine::Engine on its own thread) behind a
// mailbox. Roles: colocated (prefill and decode), prefill (computes the prompt
// and the first token, then hands the state to a decode worker), decode.
//
// Handlers never block: jobs go into the engine's queue, engine events come
// back as messages, exports complete on a helper thread.
#pragma once

#include <caf/all.hpp>

#include <memory>
#include <string>

#include "actors/protocol.hpp"
#include "base/metrics.hpp"
#include "engine/engine.hpp"
#include "model/forward.hpp"

namespace troupe::actors {

struct WorkerConfig {
  std::string name = "worker-0";
  WorkerRole role = WorkerRole::colocated;
  engine::EngineOptions engine;
  std::chrono::milliseconds load_every{50};        // load reports to the router
  std::chrono::milliseconds handoff_timeout{5000};  // prefill side: release an unconfirmed handoff
};

// Spawns a worker that registers with `router` and reports its load there.
// `model` is shared by the workers of a process (its forward is reentrant).
// Loads also go to `supervisor` when given.
caf::actor spawn_worker(caf::actor_system& sys, std::shared_ptr<model::Model> model, WorkerConfig config,
                        caf::actor router, std::shared_ptr<MetricsRegistry> metrics, caf::actor supervisor = nullptr);

// Messages a worker answers besides jobs:
//   (abort_atom, id), (park_atom, id), (resume_atom, id)
//   (migrate_atom, target)   drain: move every running request to `target` with its state
//   (drain_atom)             refuse new jobs (the router is fenced separately)
//   (crash_atom)             fail on purpose (tests of the restart policy)

}  // namespace troupe::actors
