#include "actors/supervisor/supervisor.hpp"

#include <spdlog/spdlog.h>

#include <deque>
#include <map>
#include <nlohmann/json.hpp>

namespace troupe::actors {
namespace {

using Clock = std::chrono::steady_clock;

struct Member {
  WorkerConfig config;
  caf::actor actor;
  WorkerLoad load;
  bool draining = false;  // being removed: no restart when it stops
};

struct SupervisorState {
  static inline const char* name = "supervisor";
  SupervisorConfig config;
  std::shared_ptr<model::Model> model;
  caf::actor router;
  std::shared_ptr<MetricsRegistry> metrics;
  std::map<std::string, Member> members;
  std::deque<Clock::time_point> restarts;     // within the restart window
  std::map<RequestId, int> deferrals;         // long-tail parks per request
  std::map<RequestId, double> parked_share;   // the pool share a parked request took when parked
  std::map<std::string, Clock::time_point> last_park;  // per worker
  ScaleGate scale_gate;
  int next_index = 0;
};

using Self = caf::stateful_actor<SupervisorState>*;

void start_member(Self self, WorkerConfig config) {
  auto& st = self->state;
  auto w = spawn_worker(self->system(), st.model, config, st.router, st.metrics, caf::actor_cast<caf::actor>(self));
  self->monitor(w);
  Member m;
  m.config = std::move(config);
  m.actor = w;
  m.load.name = m.config.name;
  st.members[m.config.name] = std::move(m);
}

void drain_member(Self self, const std::string& name) {
  auto& st = self->state;
  auto it = st.members.find(name);
  if (it == st.members.end() || it->second.draining) return;
  // A target: the least loaded other worker of the same role.
  Member* target = nullptr;
  for (auto& [n, m] : st.members) {
    if (n == name || m.draining || m.config.role != it->second.config.role) continue;
    if (target == nullptr || m.load.running + m.load.waiting < target->load.running + target->load.waiting) target = &m;
  }
  it->second.draining = true;
  self->send(st.router, fence_atom::value, name, true);
  if (target != nullptr) {
    spdlog::info("supervisor: draining {} into {}", name, target->config.name);
    self->send(it->second.actor, migrate_atom::value, target->actor);
  } else {
    spdlog::info("supervisor: draining {} (no other worker: its requests finish there)", name);
    self->send(it->second.actor, drain_atom::value);
  }
  st.metrics->counter("troupe_drains_total", "Workers drained (scale down or admin)").inc();
}

void long_tail(Self self, Member& m) {
  auto& st = self->state;
  const auto& p = *st.config.long_tail;
  const auto& l = m.load;
  const auto now = Clock::now();
  auto last = st.last_park.find(m.config.name);
  const bool cooling = last != st.last_park.end() && now - last->second < p.cooldown;
  if (l.kv_use > p.pressure_threshold && l.largest != 0 && l.running > 1 && l.largest_share >= p.min_share) {
    if (cooling) return;
    st.last_park[m.config.name] = now;
    int& n = st.deferrals[l.largest];
    if (n >= p.max_deferrals) return;  // resumes and runs now; it will not be parked again
    ++n;
    spdlog::info("supervisor: long_tail parks request {} on {} (KV use {:.2f}, {:.2f} of it its own, projected {} "
                 "tokens, deferral {})", l.largest, m.config.name, l.kv_use, l.largest_share, l.largest_tokens, n);
    st.parked_share[l.largest] = l.largest_share;
    self->send(m.actor, park_atom::value, l.largest);
    return;
  }
  // Resume a parked request when it fits back under the resume threshold with
  // what runs now (resuming it into the pressure that parked it would only
  // park it again), or when nothing else is left to run.
  const bool alone = l.running == 0 && l.waiting == 0;
  for (RequestId id : l.parked_ids) {
    auto share = st.parked_share.find(id);
    const double need = share == st.parked_share.end() ? 0 : share->second;
    if (alone || l.kv_use + need < p.resume_threshold) {
      spdlog::info("supervisor: long_tail resumes request {} on {} (KV use {:.2f} + {:.2f})", id, m.config.name,
                   l.kv_use, need);
      self->send(m.actor, resume_atom::value, id);
      if (share != st.parked_share.end()) st.parked_share.erase(share);
      break;  // one at a time: the next report shows the pressure it adds
    }
  }
}

// One more worker from the template (scale up, admin); returns its name.
std::string add_member(Self self) {
  auto& st = self->state;
  WorkerConfig c = st.config.worker_template;
  c.name = c.name + "-" + std::to_string(st.next_index++);
  std::string name = c.name;
  start_member(self, std::move(c));
  return name;
}

// Drains the least loaded worker not draining yet (scale down, admin); returns its name.
std::string remove_least_loaded(Self self) {
  const Member* pick = nullptr;
  for (auto& [n, m] : self->state.members) {
    if (!m.draining && (pick == nullptr || m.load.running < pick->load.running)) pick = &m;
  }
  std::string name = pick->config.name;
  drain_member(self, name);
  return name;
}

void scale(Self self) {
  auto& st = self->state;
  ScaleReading in;
  for (auto& [n, m] : st.members) {
    if (m.draining) continue;
    ++in.active;
    in.waiting += m.load.waiting;
    in.kv_use = std::max(in.kv_use, m.load.kv_use);
  }
  const ScaleDecision d = st.scale_gate.decide(*st.config.scale, in);
  if (d.step == ScaleStep::up) {
    const std::string name = add_member(self);
    spdlog::info("supervisor: scale up to {} workers ({}: {})", in.active + 1, name, d.why);
    st.scale_gate.changed();
    st.metrics->counter("troupe_scale_events_total", "Workers added or removed by the scale policy", {{"dir", "up"}}).inc();
  } else if (d.step == ScaleStep::down) {
    const std::string name = remove_least_loaded(self);
    spdlog::info("supervisor: scale down: draining {} ({})", name, d.why);
    st.scale_gate.changed();
    st.metrics->counter("troupe_scale_events_total", "Workers added or removed by the scale policy", {{"dir", "down"}})
        .inc();
  }
}

caf::behavior supervisor_actor(Self self, std::shared_ptr<model::Model> model, SupervisorConfig config,
                               caf::actor router, std::shared_ptr<MetricsRegistry> metrics) {
  auto& st = self->state;
  st.config = std::move(config);
  st.model = std::move(model);
  st.router = router;
  st.metrics = std::move(metrics);
  for (const auto& w : st.config.workers) start_member(self, w);
  self->delayed_send(self, st.config.tick, tick_atom::value);

  self->set_down_handler([=](caf::down_msg& dm) {
    auto& s = self->state;
    for (auto it = s.members.begin(); it != s.members.end(); ++it) {
      if (it->second.actor.address() != dm.source) continue;
      Member m = std::move(it->second);
      s.members.erase(it);
      if (m.draining) {
        spdlog::info("supervisor: {} drained and stopped", m.config.name);
        return;
      }
      const auto now = Clock::now();
      while (!s.restarts.empty() && now - s.restarts.front() > s.config.restart.window) s.restarts.pop_front();
      if (static_cast<int>(s.restarts.size()) >= s.config.restart.max_restarts) {
        spdlog::error("supervisor: {} failed ({}); restart budget of {} in {} s spent, not restarting",
                      m.config.name, caf::to_string(dm.reason), s.config.restart.max_restarts,
                      s.config.restart.window.count());
        return;
      }
      s.restarts.push_back(now);
      spdlog::warn("supervisor: {} failed ({}); restarting it", m.config.name, caf::to_string(dm.reason));
      s.metrics->counter("troupe_restarts_total", "Workers restarted by the restart policy", {{"worker", m.config.name}})
          .inc();
      start_member(self, m.config);
      return;
    }
  });

  return {
      [=](const WorkerLoad& load) {
        auto& s = self->state;
        auto it = s.members.find(load.name);
        if (it == s.members.end()) return;
        it->second.load = load;
        if (it->second.draining && load.running == 0 && load.waiting == 0 && load.parked == 0) {
          self->send_exit(it->second.actor, caf::exit_reason::user_shutdown);
        }
      },
      [=](tick_atom) {
        auto& s = self->state;
        if (s.config.long_tail) {
          for (auto& [n, m] : s.members) {
            if (!m.draining) long_tail(self, m);
          }
        }
        if (s.config.scale) scale(self);
        self->delayed_send(self, s.config.tick, tick_atom::value);
      },
      [=](workers_atom) {
        std::vector<std::string> names;
        for (const auto& [n, m] : self->state.members) {
          if (!m.draining) names.push_back(n);
        }
        return names;
      },
      [=](crash_atom, const std::string& name) {
        auto& s = self->state;
        if (auto it = s.members.find(name); it != s.members.end()) self->send(it->second.actor, crash_atom::value);
      },
      [=](drain_atom, const std::string& name) -> bool {
        auto& s = self->state;
        auto it = s.members.find(name);
        if (it == s.members.end() || it->second.draining) return false;
        drain_member(self, name);
        return true;
      },
      [=](scale_atom, const std::string&, int32_t workers) -> std::string {  // admin: one group here, `node` unused
        auto& s = self->state;
        const int lo = s.config.scale ? s.config.scale->min_workers : 1;
        const int hi = s.config.scale ? s.config.scale->max_workers : 64;
        if (workers < lo || workers > hi) {
          return fmt::format("this server runs between {} and {} workers; asked for {}", lo, hi, workers);
        }
        int live = 0;
        for (const auto& [n, m] : s.members) live += m.draining ? 0 : 1;
        spdlog::info("supervisor: admin asks for {} workers (now {})", workers, live);
        for (; live < workers; ++live) add_member(self);
        for (; live > workers; --live) remove_least_loaded(self);
        s.scale_gate.changed();
        return "";
      },
      [=](scale_atom) -> std::string {
        nlohmann::json slots = nlohmann::json::array();
        int active = 0;
        for (const auto& [n, m] : self->state.members) {
          slots.push_back({{"name", n}, {"state", m.draining ? "draining" : "active"}, {"up", true}});
          active += m.draining ? 0 : 1;
        }
        return nlohmann::json{{"nodes", nlohmann::json::array({{{"node", ""}, {"active", active}, {"slots", slots}}})}}
            .dump();
      },
      [=](stop_atom) -> bool {  // shutdown: stop every worker, restart none
        for (auto& [n, m] : self->state.members) {
          m.draining = true;
          self->send_exit(m.actor, caf::exit_reason::user_shutdown);
        }
        return true;
      },
  };
}

}  // namespace

caf::actor spawn_supervisor(caf::actor_system& sys, std::shared_ptr<model::Model> model, SupervisorConfig config,
                            caf::actor router, std::shared_ptr<MetricsRegistry> metrics) {
  return sys.spawn(supervisor_actor, std::move(model), std::move(config), std::move(router), std::move(metrics));
}

}  // namespace troupe::actors
