#include "actors/router/router.hpp"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <deque>
#include <limits>
#include <set>

namespace troupe::actors {
namespace {

struct Entry {
  caf::actor actor;
  std::string name;
  WorkerRole role = WorkerRole::colocated;
  WorkerLoad load;
  int64_t assigned_since_report = 0;
  bool fenced = false;
};

struct RouterState {
  static inline const char* name = "router";
  std::vector<Entry> workers;
  std::shared_ptr<MetricsRegistry> metrics;
  RouterOptions options;
  std::deque<std::pair<std::chrono::steady_clock::time_point, Job>> held;  // waiting for a worker (hold_when_empty)
  // Workers kept out of service by name (the fleet's standby slots and
  // scale-downs): unlike a fence, this outlives a worker's re-registration.
  std::set<std::string> out_of_service;
};

using Self = caf::stateful_actor<RouterState>*;

int64_t score(const Entry& e) { return e.load.running + e.load.waiting + e.assigned_since_report; }

Entry* least_loaded(RouterState& st, std::initializer_list<WorkerRole> roles) {
  Entry* best = nullptr;
  for (auto& e : st.workers) {
    if (e.fenced || e.load.draining || st.out_of_service.count(e.name)) continue;
    if (std::find(roles.begin(), roles.end(), e.role) == roles.end()) continue;
    if (best == nullptr || score(e) < score(*best)) best = &e;
  }
  return best;
}

// Sends a job to a worker; false when none can take it now.
bool dispatch(Self self, Job& job) {
  auto& st = self->state;
  Entry* target = nullptr;
  if (!job.image) {
    Entry* prefill = least_loaded(st, {WorkerRole::prefill});
    Entry* decode = least_loaded(st, {WorkerRole::decode});
    if (prefill != nullptr && decode != nullptr) {
      job.decode_to = decode->actor;
      ++decode->assigned_since_report;
      target = prefill;
    }
  }
  if (target == nullptr) target = least_loaded(st, {WorkerRole::colocated, WorkerRole::decode});
  if (target == nullptr) return false;
  ++target->assigned_since_report;
  self->send(job.reply_to, Assigned{job.id, target->actor, target->name, job.generated_before});
  self->send(target->actor, std::move(job));
  return true;
}

// Held jobs go out as soon as a worker can take them, or fail when their time is up.
void release_held(Self self) {
  auto& st = self->state;
  const auto now = std::chrono::steady_clock::now();
  while (!st.held.empty()) {
    auto& [since, job] = st.held.front();
    if (!dispatch(self, job)) {
      if (now - since < st.options.hold_when_empty) return;
      self->send(job.reply_to, Failed{job.id, ErrorCode::unavailable, "no worker is available", nullptr});
    }
    st.held.pop_front();
  }
}

caf::behavior router_actor(Self self, std::shared_ptr<MetricsRegistry> metrics, RouterOptions options) {
  self->state.metrics = std::move(metrics);
  self->state.options = options;
  self->set_down_handler([=](caf::down_msg& dm) {
    auto& ws = self->state.workers;
    auto it = std::find_if(ws.begin(), ws.end(), [&](const Entry& e) { return e.actor.address() == dm.source; });
    if (it == ws.end()) return;
    spdlog::warn("router: worker {} is gone ({})", it->name, caf::to_string(dm.reason));
    ws.erase(it);
  });
  return {
      [=](register_atom, caf::actor worker, const std::string& name, uint8_t role) {
        auto& ws = self->state.workers;
        std::erase_if(ws, [&](const Entry& e) { return e.name == name; });  // a restarted worker replaces its old self
        Entry e;
        e.actor = worker;
        e.name = name;
        e.role = static_cast<WorkerRole>(role);
        e.load.name = name;
        e.load.role = e.role;
        ws.push_back(std::move(e));
        self->monitor(worker);
        spdlog::info("router: worker {} ({}) registered", name, to_string(static_cast<WorkerRole>(role)));
        release_held(self);
      },
      [=](const WorkerLoad& load) {
        for (auto& e : self->state.workers) {
          if (e.name == load.name) {
            e.load = load;
            e.assigned_since_report = 0;
          }
        }
      },
      [=](Job job) {
        auto& st = self->state;
        if (!st.held.empty()) release_held(self);
        if (st.held.empty() && dispatch(self, job)) return;
        if (st.options.hold_when_empty.count() > 0) {  // a worker may be on its way (restart, scale up)
          if (st.held.empty()) self->delayed_send(self, std::chrono::milliseconds(200), tick_atom::value);
          st.held.emplace_back(std::chrono::steady_clock::now(), std::move(job));
          return;
        }
        self->send(job.reply_to, Failed{job.id, ErrorCode::unavailable, "no worker is available", nullptr});
      },
      [=](tick_atom) {
        release_held(self);
        if (!self->state.held.empty()) self->delayed_send(self, std::chrono::milliseconds(200), tick_atom::value);
      },
      [=](fence_atom, const std::string& name, bool fenced) {
        for (auto& e : self->state.workers) {
          if (e.name == name) e.fenced = fenced;
        }
        if (!fenced) release_held(self);
      },
      [=](hold_atom, const std::string& name, bool out) {
        if (out) {
          self->state.out_of_service.insert(name);
          return;
        }
        self->state.out_of_service.erase(name);
        // Back in service (the fleet tells the worker too): its last report
        // still says it drains until its next one; a worker that really
        // drains (its process stops) says so again then.
        for (auto& e : self->state.workers) {
          if (e.name == name) e.load.draining = false;
        }
        release_held(self);
      },
      [=](workers_atom) {
        std::vector<WorkerLoad> out;
        for (const auto& e : self->state.workers) {
          WorkerLoad l = e.load;
          l.draining = l.draining || e.fenced || self->state.out_of_service.count(e.name) > 0;
          l.actor = e.actor;
          out.push_back(l);
        }
        return out;
      },
  };
}

}  // namespace

caf::actor spawn_router(caf::actor_system& sys, std::shared_ptr<MetricsRegistry> metrics, RouterOptions options) {
  return sys.spawn(router_actor, std::move(metrics), options);
}

}  // namespace troupe::actors
