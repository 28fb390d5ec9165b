// The fleet: the supervisor's view of the workers of every process of a
// topology (`troupe run`), on the router's process. Each worker process runs
// its own supervisor for its worker (the restart policy); the fleet decides
// what no single process can:
//
//   scale   per scaled node (the manifest's policies.scale rules): from what
//           the workers report (queue depth and KV use in their loads, which
//           reach the router over the fabric, and outstanding KV handoffs in
//           their processes' heartbeats), add or remove a worker as the
//           node's ScaleRule says (scale_rule.hpp: up on any high mark, down
//           when every low mark held for a whole cooldown); or to the count
//           an admin asks for.
//   drain   an admin's removal of a worker of any process.
//
// What "add" and "remove" are with static addresses on one host: every slot
// of a scaled node is a process the operator started (`troupe run --node
// decode-2`); slots beyond the node's replicas are standbys, kept out of
// service at the router (registered and loaded, given no request). Adding a
// worker admits the lowest standby slot that is up. Removing one drains it
// from here: it is held out of service at the router (fenced), its running
// requests move with their KV to the least loaded active worker of its role
// (migrate, again every second until it holds nothing), then it is a standby
// again (stopped serving; its process stays up so that it can be added back).
// An admin's drain of a remote worker asks its process to drain itself and
// exit (the SIGTERM path: fence, migrate with the KV, exit 0), through the
// process's published "control" actor.
//
// On Kubernetes (FleetNode::statefulset) adding a worker whose pod does not
// exist yet resizes the node's StatefulSet through the API server
// (kube_scale.hpp) and serves it once it registers; removing one drains the
// highest slot (the pod a StatefulSet removes first) and then shrinks the
// StatefulSet, which deletes that pod.
//
// Handlers never block: the router's view arrives as a response message, the
// Kubernetes calls' outcome too.
#pragma once

#include <caf/all.hpp>

#include <chrono>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "actors/protocol.hpp"
#include "actors/supervisor/scale_rule.hpp"
#include "base/error.hpp"
#include "base/metrics.hpp"

namespace troupe::actors {

struct FleetNode {
  std::string name;                  // the manifest's node ("decode")
  WorkerRole role = WorkerRole::colocated;
  std::vector<std::string> slots;    // instance names in slot order ("decode-0", "decode-1", ...)
  int active = 0;                    // slots [0, active) serve from the start; the rest are standbys
  std::optional<ScaleRule> rule;
  // Kubernetes: the node's StatefulSet, which the fleet resizes (adding
  // creates the next pod; removing drains the highest slot, then deletes its
  // pod). Empty: the slots are processes an operator started (standbys).
  std::string statefulset;
};

struct FleetConfig {
  std::vector<FleetNode> nodes;
  std::chrono::milliseconds tick{250};
  std::chrono::milliseconds migrate_every{1000};  // a drain re-sends its migrate this often
  // The "control" actor of an instance's process (a stable proxy); null: none.
  std::function<caf::actor(const std::string& instance)> control;
  // Outstanding KV handoffs per instance, from the processes' heartbeats.
  std::function<std::map<std::string, int64_t>()> handoffs;
  // Sets a StatefulSet's replicas; blocking (the fleet calls it on a thread
  // of its own). Empty: nothing is resized, only standbys that are up join.
  std::function<Expected<int32_t>(const std::string& statefulset, int32_t replicas)> set_replicas;
  // Workers of this process (their drains go to the local supervisor).
  std::vector<std::string> local_workers;
  caf::actor local_supervisor;
};

using local_atom = caf::atom_constant<caf::atom("local")>;

caf::actor spawn_fleet(caf::actor_system& sys, FleetConfig config, caf::actor router,
                       std::shared_ptr<MetricsRegistry> metrics);

// Messages the fleet answers (the gateway's admin routes):
//   (workers_atom)                      -> std::vector<std::string>  workers in service
//   (drain_atom, name)                  -> bool   false: no such worker in service
//   (scale_atom, node, int32_t workers) -> std::string  "" when started, else why not
//   (scale_atom)                        -> std::string  JSON: every node's slots and their state
//   (crash_atom, name)                  forwarded to the local supervisor (test hook)
//   (local_atom, supervisor, worker)    this process's own worker and its supervisor

}  // namespace troupe::actors
