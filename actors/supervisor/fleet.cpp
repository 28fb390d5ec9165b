#include "actors/supervisor/fleet.hpp"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <thread>
#include <nlohmann/json.hpp>

namespace troupe::actors {
namespace {

using Clock = std::chrono::steady_clock;

enum class SlotState { active, standby, draining, removed };

const char* to_string(SlotState s) {
  switch (s) {
    case SlotState::active: return "active";
    case SlotState::standby: return "standby";
    case SlotState::draining: return "draining";
    case SlotState::removed: return "removed";
  }
  return "?";
}

struct Slot {
  std::string name;
  size_t node = 0;  // index into config.nodes
  int ordinal = 0;
  SlotState state = SlotState::standby;
  Clock::time_point first_migrate{}, last_migrate{};  // of the drain under way
  Clock::time_point drain_started{};
  bool gone = false;  // removed, and its worker has left the router since
};

struct FleetState {
  static inline const char* name = "fleet";
  FleetConfig config;
  caf::actor router;
  std::shared_ptr<MetricsRegistry> metrics;
  std::vector<Slot> slots;
  std::vector<ScaleGate> gates;               // per node
  std::vector<std::optional<int>> target;     // per node: an admin's worker count, applied over ticks
  std::map<std::string, Clock::time_point> warned;  // rate-limited warnings by key
  std::vector<WorkerLoad> loads;                    // the router's last view
  bool asking = false;                              // a workers request to the router is out
  std::vector<int32_t> asked_replicas;              // per node: the StatefulSet size last asked for (-1: none)
};

using replicas_atom = caf::atom_constant<caf::atom("replicas")>;

using Self = caf::stateful_actor<FleetState>*;

bool local(const FleetState& st, const std::string& name) {
  return std::find(st.config.local_workers.begin(), st.config.local_workers.end(), name) != st.config.local_workers.end();
}

const WorkerLoad* load_of(const FleetState& st, const std::string& name) {
  for (const auto& l : st.loads) {
    if (l.name == name) return &l;
  }
  return nullptr;
}

void warn_once(FleetState& st, const std::string& key, const std::string& message) {
  auto now = Clock::now();
  auto it = st.warned.find(key);
  if (it != st.warned.end() && now - it->second < std::chrono::seconds(30)) return;
  st.warned[key] = now;
  spdlog::warn("fleet: {}", message);
}

int count(const FleetState& st, size_t node, SlotState state) {
  int n = 0;
  for (const auto& s : st.slots) n += s.node == node && s.state == state ? 1 : 0;
  return n;
}

void update_gauges(FleetState& st) {
  for (size_t i = 0; i < st.config.nodes.size(); ++i) {
    const auto& n = st.config.nodes[i];
    for (auto state : {SlotState::active, SlotState::standby, SlotState::draining}) {
      st.metrics->gauge("troupe_fleet_workers", "Worker slots of a node by state (the fleet's view)",
                        {{"node", n.name}, {"state", to_string(state)}})
          .set(count(st, i, state));
    }
  }
}

// The least loaded worker in service of `role`, other than `except`.
const WorkerLoad* target_for(const FleetState& st, WorkerRole role, const std::string& except) {
  const WorkerLoad* best = nullptr;
  for (const auto& l : st.loads) {
    if (l.name == except || l.role != role || l.draining || !l.actor) continue;
    auto s = std::find_if(st.slots.begin(), st.slots.end(), [&](const Slot& x) { return x.name == l.name; });
    if (s != st.slots.end() && s->state != SlotState::active) continue;
    if (best == nullptr || l.running + l.waiting < best->running + best->waiting) best = &l;
  }
  return best;
}

// Takes a worker out of service and moves its requests away (scale down).
void begin_drain(Self self, Slot& slot, const std::string& why) {
  auto& st = self->state;
  spdlog::info("fleet: draining {} ({})", slot.name, why);
  slot.state = SlotState::draining;
  slot.drain_started = Clock::now();
  slot.first_migrate = slot.last_migrate = Clock::time_point{};
  self->send(st.router, hold_atom::value, slot.name, true);
  st.metrics->counter("troupe_drains_total", "Workers drained (scale down or admin)").inc();
}

void activate(Self self, Slot& slot, const std::string& why) {
  auto& st = self->state;
  spdlog::info("fleet: {} in service ({})", slot.name, why);
  slot.state = SlotState::active;
  self->send(st.router, hold_atom::value, slot.name, false);
  // A worker drained before refuses jobs until told it serves again.
  if (const WorkerLoad* l = load_of(st, slot.name); l && l->actor) {
    self->send(l->actor, fence_atom::value, slot.name, false);
  }
}

void resize(Self self, size_t i);

// A draining worker: migrate again until it holds nothing, then it is a standby.
void step_drain(Self self, Slot& slot, const std::map<std::string, int64_t>& handoffs) {
  auto& st = self->state;
  const WorkerLoad* mine = load_of(st, slot.name);
  const auto h = handoffs.find(slot.name);
  const int64_t pending = h == handoffs.end() ? 0 : h->second;
  if (mine == nullptr) {  // gone (its process stopped): nothing left to move
    spdlog::info("fleet: {} left while draining", slot.name);
    slot.state = SlotState::standby;
    resize(self, slot.node);
    return;
  }
  // Loads arrive every 50 ms; the first migrate has had time to show up once a
  // report newer than it says the worker is empty.
  // (The first migrate counts: later ones only repeat it, every migrate_every.)
  const bool migrated = slot.first_migrate != Clock::time_point{} &&
                        Clock::now() - slot.first_migrate > std::chrono::milliseconds(300);
  if (migrated && mine->running == 0 && mine->waiting == 0 && mine->parked == 0 && pending == 0) {
    spdlog::info("fleet: {} drained in {} ms; standby now", slot.name,
                 std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - slot.drain_started).count());
    slot.state = SlotState::standby;
    resize(self, slot.node);  // Kubernetes: its pod goes
    return;
  }
  if (Clock::now() - slot.last_migrate < st.config.migrate_every || !mine->actor) return;
  slot.last_migrate = Clock::now();
  if (slot.first_migrate == Clock::time_point{}) slot.first_migrate = slot.last_migrate;
  const auto& node = st.config.nodes[slot.node];
  if (const WorkerLoad* to = target_for(st, node.role, slot.name)) {
    self->send(mine->actor, migrate_atom::value, to->actor);
  } else {
    warn_once(st, "no-target-" + slot.name,
              slot.name + " is draining but no other worker of its role is in service: its requests finish there");
    self->send(mine->actor, drain_atom::value);
  }
}

// Kubernetes: the StatefulSet of node `i` gets one pod per slot up to the
// highest one in service (or draining), as the slots now say.
void resize(Self self, size_t i) {
  auto& st = self->state;
  const auto& node = st.config.nodes[i];
  if (node.statefulset.empty() || !st.config.set_replicas) return;
  int32_t pods = 0;
  for (const auto& s : st.slots) {
    if (s.node == i && (s.state == SlotState::active || s.state == SlotState::draining)) pods = std::max(pods, s.ordinal + 1);
  }
  if (st.asked_replicas[i] == pods) return;
  st.asked_replicas[i] = pods;
  spdlog::info("fleet: StatefulSet {} to {} replicas", node.statefulset, pods);
  auto set = st.config.set_replicas;
  const auto me = caf::actor_cast<caf::actor>(self);
  std::thread([set, me, i, name = node.statefulset, pods] {
    auto r = set(name, pods);
    caf::anon_send(me, replicas_atom::value, static_cast<uint64_t>(i), pods, r ? std::string() : std::string(r.error().what()));
  }).detach();
}

void scale_node(Self self, size_t i, const std::map<std::string, int64_t>& handoffs) {
  auto& st = self->state;
  const auto& node = st.config.nodes[i];
  const int active = count(st, i, SlotState::active);
  int want = active;
  std::string why;
  if (node.rule) {
    // Outstanding handoffs: for decode workers, the states prefill processes
    // lent and no decode worker has taken yet; otherwise the node's own.
    ScaleReading in;
    for (const auto& s : st.slots) {
      const bool counts = node.role == WorkerRole::decode ? st.config.nodes[s.node].role == WorkerRole::prefill
                                                          : s.node == i;
      if (!counts) continue;
      if (auto h = handoffs.find(s.name); h != handoffs.end()) in.outstanding_handoffs += h->second;
    }
    for (const auto& s : st.slots) {
      if (s.node != i || s.state != SlotState::active) continue;
      const WorkerLoad* l = load_of(st, s.name);
      if (l == nullptr) continue;
      ++in.active;
      in.waiting += l->waiting;
      in.kv_use = std::max(in.kv_use, l->kv_use);
    }
    // Read on every tick, also while an admin's count applies: the low marks' window runs on.
    const ScaleDecision d = st.gates[i].decide(*node.rule, in);
    if (d.step != ScaleStep::hold) {
      want = active + (d.step == ScaleStep::up ? 1 : -1);
      why = d.why;
    }
  }
  if (st.target[i]) {
    want = *st.target[i];
    why = "admin";
    if (want == active) st.target[i].reset();
  }
  if (want > active) {
    // The lowest standby slot whose process is up and registered; on
    // Kubernetes, else the lowest standby slot, whose pod the resize makes.
    auto add = [&](bool up) {
      for (auto& s : st.slots) {
        if (s.node != i || s.state != SlotState::standby || (load_of(st, s.name) != nullptr) != up) continue;
        activate(self, s, (up ? "scale up: " : "scale up, new pod: ") + why);
        st.gates[i].changed();
        st.metrics->counter("troupe_scale_events_total", "Workers added or removed by the scale policy",
                            {{"node", node.name}, {"dir", "up"}}).inc();
        resize(self, i);
        return true;
      }
      return false;
    };
    if (add(true) || (!node.statefulset.empty() && st.config.set_replicas && add(false))) return;
    warn_once(st, "no-standby-" + node.name,
              fmt::format("node {} should grow to {} workers ({}) but no standby process of it is up", node.name,
                          want, why));
  } else if (want < active) {
    // The least loaded active slot, the highest one on a tie; on Kubernetes
    // the highest one (a StatefulSet removes its last pod).
    const bool highest = !node.statefulset.empty();
    Slot* pick = nullptr;
    int64_t pick_load = 0;
    for (auto& s : st.slots) {
      if (s.node != i || s.state != SlotState::active || local(st, s.name)) continue;
      const WorkerLoad* l = load_of(st, s.name);
      const int64_t load = l ? l->running + l->waiting : 0;
      if (pick == nullptr || highest || load <= pick_load) {
        pick = &s;
        pick_load = load;
      }
    }
    if (pick == nullptr) return;
    begin_drain(self, *pick, "scale down: " + why);
    st.gates[i].changed();
    st.metrics->counter("troupe_scale_events_total", "Workers added or removed by the scale policy",
                        {{"node", node.name}, {"dir", "down"}}).inc();
  }
}

void on_loads(Self self, std::vector<WorkerLoad> loads) {
  auto& st = self->state;
  st.loads = std::move(loads);
  const auto handoffs = st.config.handoffs ? st.config.handoffs() : std::map<std::string, int64_t>{};
  for (auto& s : st.slots) {
    if (s.state == SlotState::draining) step_drain(self, s, handoffs);
    if (s.state != SlotState::removed) continue;
    // An admin removed it and its process stopped; started again, it serves again.
    if (load_of(st, s.name) == nullptr) {
      s.gone = true;
    } else if (s.gone) {
      spdlog::info("fleet: {} is back after its removal; in service", s.name);
      s.gone = false;
      s.state = SlotState::active;
    }
  }
  for (size_t i = 0; i < st.config.nodes.size(); ++i) {
    if (count(st, i, SlotState::draining) == 0) scale_node(self, i, handoffs);  // one change at a time per node
  }
  update_gauges(st);
}

std::string describe(const FleetState& st) {
  using json = nlohmann::json;
  json nodes = json::array();
  for (size_t i = 0; i < st.config.nodes.size(); ++i) {
    const auto& n = st.config.nodes[i];
    json slots = json::array();
    for (const auto& s : st.slots) {
      if (s.node != i) continue;
      const WorkerLoad* l = load_of(st, s.name);
      slots.push_back({{"name", s.name}, {"state", to_string(s.state)}, {"up", l != nullptr}});
    }
    json j = {{"node", n.name}, {"role", to_string(n.role)}, {"active", count(st, i, SlotState::active)},
              {"slots", slots}};
    if (n.rule) {
      j["min_workers"] = n.rule->min_workers;
      j["max_workers"] = n.rule->max_workers;
    }
    nodes.push_back(std::move(j));
  }
  return json{{"nodes", nodes}}.dump();
}

caf::behavior fleet_actor(Self self, FleetConfig config, caf::actor router, std::shared_ptr<MetricsRegistry> metrics) {
  auto& st = self->state;
  st.config = std::move(config);
  st.router = std::move(router);
  st.metrics = std::move(metrics);
  st.gates.assign(st.config.nodes.size(), ScaleGate{});
  st.asked_replicas.assign(st.config.nodes.size(), -1);
  st.target.assign(st.config.nodes.size(), std::nullopt);
  for (size_t i = 0; i < st.config.nodes.size(); ++i) {
    const auto& n = st.config.nodes[i];
    for (size_t k = 0; k < n.slots.size(); ++k) {
      Slot s;
      s.name = n.slots[k];
      s.node = i;
      s.ordinal = static_cast<int>(k);
      s.state = static_cast<int>(k) < n.active ? SlotState::active : SlotState::standby;
      // Before any worker registers (this message reaches the router first).
      if (s.state == SlotState::standby) self->send(st.router, hold_atom::value, s.name, true);
      st.slots.push_back(std::move(s));
    }
  }
  update_gauges(st);
  self->send(self, tick_atom::value);
  return {
      [=](tick_atom) {
        auto& s = self->state;
        self->delayed_send(self, s.config.tick, tick_atom::value);
        if (s.asking) return;
        s.asking = true;
        self->request(s.router, std::chrono::seconds(2), workers_atom::value)
            .then(
                [=](std::vector<WorkerLoad>& loads) {
                  self->state.asking = false;
                  on_loads(self, std::move(loads));
                },
                [=](caf::error& e) {
                  self->state.asking = false;
                  warn_once(self->state, "router", "the router did not answer: " + caf::to_string(e));
                });
      },
      [=](workers_atom) {
        std::vector<std::string> names;
        for (const auto& s : self->state.slots) {
          if (s.state == SlotState::active && load_of(self->state, s.name)) names.push_back(s.name);
        }
        return names;
      },
      [=](drain_atom, const std::string& name) -> bool {
        auto& s = self->state;
        const WorkerLoad* l = load_of(s, name);
        auto slot = std::find_if(s.slots.begin(), s.slots.end(), [&](const Slot& x) { return x.name == name; });
        if (slot != s.slots.end() && slot->state != SlotState::active) return false;
        if (l == nullptr && slot == s.slots.end()) return false;
        if (local(s, name)) {
          if (!s.config.local_supervisor) return false;
          self->send(s.config.local_supervisor, drain_atom::value, name);
        } else {
          caf::actor control = s.config.control ? s.config.control(name) : nullptr;
          if (!control || l == nullptr) return false;  // its process is not connected
          spdlog::info("fleet: asking {}'s process to drain and stop (admin)", name);
          self->send(control, drain_atom::value);
        }
        if (slot != s.slots.end()) slot->state = SlotState::removed;
        s.metrics->counter("troupe_drains_total", "Workers drained (scale down or admin)").inc();
        update_gauges(s);
        return true;
      },
      [=](scale_atom, const std::string& node, int32_t workers) -> std::string {
        auto& s = self->state;
        for (size_t i = 0; i < s.config.nodes.size(); ++i) {
          const auto& n = s.config.nodes[i];
          if (n.name != node) continue;
          const int lo = n.rule ? n.rule->min_workers : 1;
          const int hi = n.rule ? n.rule->max_workers : static_cast<int>(n.slots.size());
          if (workers < lo || workers > hi) {
            return fmt::format("node {} runs between {} and {} workers; asked for {}", node, lo, hi, workers);
          }
          const int active = count(s, i, SlotState::active);
          int standby_up = 0;
          for (const auto& x : s.slots) {
            standby_up += x.node == i && x.state == SlotState::standby && load_of(s, x.name) ? 1 : 0;
          }
          if (workers > active + standby_up) {
            return fmt::format("node {} has {} workers in service and {} standby process{} up; {} cannot be "
                               "reached (start the processes of its other slots first)",
                               node, active, standby_up, standby_up == 1 ? "" : "es", workers);
          }
          spdlog::info("fleet: admin asks node {} for {} workers (now {})", node, workers, active);
          s.target[i] = workers;
          return "";
        }
        std::string names;
        for (const auto& n : s.config.nodes) names += (names.empty() ? "" : ", ") + n.name;
        return fmt::format("no worker node '{}'; the worker nodes: {}", node, names);
      },
      [=](scale_atom) -> std::string { return describe(self->state); },
      [=](replicas_atom, uint64_t node, int32_t pods, const std::string& error) {
        auto& s = self->state;
        if (node >= s.config.nodes.size()) return;
        const auto& n = s.config.nodes[node];
        if (error.empty()) {
          spdlog::info("fleet: StatefulSet {} has {} replicas", n.statefulset, pods);
          return;
        }
        spdlog::warn("fleet: resizing StatefulSet {} to {} failed: {}", n.statefulset, pods, error);
        if (s.asked_replicas[node] == pods) s.asked_replicas[node] = -1;  // asked again on the next change
        // Slots waiting for a pod that will not come go back to standby.
        for (auto& slot : s.slots) {
          if (slot.node == node && slot.state == SlotState::active && slot.ordinal >= pods - 1 &&
              load_of(s, slot.name) == nullptr) {
            slot.state = SlotState::standby;
            self->send(s.router, hold_atom::value, slot.name, true);
          }
        }
        update_gauges(s);
      },
      [=](local_atom, caf::actor supervisor, const std::string& worker) {
        self->state.config.local_supervisor = std::move(supervisor);
        self->state.config.local_workers.push_back(worker);
      },
      [=](crash_atom, const std::string& name) {
        if (self->state.config.local_supervisor) self->send(self->state.config.local_supervisor, crash_atom::value, name);
      },
  };
}

}  // namespace

caf::actor spawn_fleet(caf::actor_system& sys, FleetConfig config, caf::actor router,
                       std::shared_ptr<MetricsRegistry> metrics) {
  return sys.spawn(fleet_actor, std::move(config), std::move(router), std::move(metrics));
}

}  // namespace troupe::actors
