// The fleet on Kubernetes: a node whose slots are a StatefulSet's pods. Load
// makes it ask for one pod more and serve it once it registers; idle for a
// whole cooldown, it drains the highest pod (the one a StatefulSet removes)
// and only then shrinks the StatefulSet; a resize the API server refuses puts
// the slot back to standby. A scripted router reports the loads; the
// StatefulSet is a function that records what it is asked (the HTTPS call
// itself is kube_scale_test's).
#include <gtest/gtest.h>

#include <mutex>
#include <nlohmann/json.hpp>

#include "actors/supervisor/fleet.hpp"
#include "tests/support/wait.hpp"

namespace troupe::actors {
namespace {

using namespace std::chrono_literals;

struct World {
  std::mutex mu;
  std::map<std::string, WorkerLoad> loads;  // what the router reports (workers that registered)
  std::vector<std::string> to_worker;       // messages the workers got, "decode-1 migrate" ...
  std::vector<int32_t> resized;             // replicas asked of the StatefulSet
  bool refuse = false;                      // the API server refuses resizes
  int attempts = 0;                         // resizes asked, refused or not
};

caf::behavior router(caf::event_based_actor*, std::shared_ptr<World> w) {
  return {
      [](hold_atom, const std::string&, bool) {},
      [=](workers_atom) {
        std::lock_guard lock(w->mu);
        std::vector<WorkerLoad> out;
        for (auto& [n, l] : w->loads) out.push_back(l);
        return out;
      },
  };
}

caf::behavior worker(caf::event_based_actor* self, std::shared_ptr<World> w, std::string name) {
  auto note = [=](const std::string& what) {
    std::lock_guard lock(w->mu);
    w->to_worker.push_back(name + " " + what);
  };
  return {
      [=](migrate_atom, const caf::actor&) { note("migrate"); },
      [=](drain_atom) { note("drain"); },
      [=](fence_atom, const std::string&, bool fenced) { note(fenced ? "fence" : "unfence"); },
  };
}

using troupe::testing::wait_until;

class FleetK8s : public ::testing::Test {
 protected:
  void SetUp() override {
    cfg_.set("scheduler.max-threads", 2);
    cfg_.set("logger.verbosity", caf::atom("quiet"));
    system_ = std::make_unique<caf::actor_system>(cfg_);
    router_ = system_->spawn(router, w_);
    for (const char* n : {"decode-0", "decode-1"}) workers_[n] = system_->spawn(worker, w_, std::string(n));
    set_load("decode-0", 0, 0.0);

    FleetNode node;
    node.name = "decode";
    node.role = WorkerRole::decode;
    node.slots = {"decode-0", "decode-1"};
    node.active = 1;
    ScaleRule r;
    r.min_workers = 1;
    r.max_workers = 2;
    r.queue_depth_high = 2;
    r.queue_depth_low = 0;
    r.kv_use_high = 0.99;
    r.kv_use_low = 0.0001;
    r.cooldown = 300ms;
    node.rule = r;
    node.statefulset = "demo-decode";
    FleetConfig fc;
    fc.nodes = {node};
    fc.tick = 20ms;
    fc.migrate_every = 50ms;
    auto w = w_;
    fc.set_replicas = [w](const std::string& ss, int32_t n) -> Expected<int32_t> {
      std::lock_guard lock(w->mu);
      ++w->attempts;
      if (ss != "demo-decode") return Error(ErrorCode::not_found, "no StatefulSet " + ss);
      if (w->refuse) return Error(ErrorCode::invalid_argument, "HTTP 403: forbidden");
      w->resized.push_back(n);
      return n;
    };
    fleet_ = spawn_fleet(*system_, fc, router_, std::make_shared<MetricsRegistry>());
  }
  void TearDown() override {
    for (auto& a : {fleet_, router_, workers_["decode-0"], workers_["decode-1"]}) caf::anon_send_exit(a, caf::exit_reason::user_shutdown);
    fleet_ = router_ = nullptr;
    workers_.clear();
    system_->await_all_actors_done();
    system_.reset();
  }
  void set_load(const std::string& name, int64_t waiting, double kv, int64_t running = 0) {
    std::lock_guard lock(w_->mu);
    WorkerLoad& l = w_->loads[name];
    l.name = name;
    l.role = WorkerRole::decode;
    l.waiting = waiting;
    l.running = running;
    l.kv_use = kv;
    l.actor = workers_[name];
  }
  std::map<std::string, std::string> slots() {
    caf::scoped_actor self{*system_};
    std::string out;
    self->request(fleet_, 2s, scale_atom::value).receive([&](const std::string& s) { out = s; }, [](caf::error& e) { ADD_FAILURE() << caf::to_string(e); });
    std::map<std::string, std::string> m;
    const auto j = nlohmann::json::parse(out);
    for (const auto& s : j["nodes"][0]["slots"]) m[s["name"].get<std::string>()] = s["state"].get<std::string>();
    return m;
  }
  std::vector<int32_t> resized() {
    std::lock_guard lock(w_->mu);
    return w_->resized;
  }
  bool worker_got(const std::string& what) {
    std::lock_guard lock(w_->mu);
    return std::find(w_->to_worker.begin(), w_->to_worker.end(), what) != w_->to_worker.end();
  }

  caf::actor_system_config cfg_;
  std::unique_ptr<caf::actor_system> system_;
  std::shared_ptr<World> w_ = std::make_shared<World>();
  caf::actor router_, fleet_;
  std::map<std::string, caf::actor> workers_;
};

TEST_F(FleetK8s, load_adds_a_pod_and_idle_removes_the_highest_after_draining_it) {
  EXPECT_EQ(slots(), (std::map<std::string, std::string>{{"decode-0", "active"}, {"decode-1", "standby"}}));
  set_load("decode-0", 10, 0.2);  // 10 waiting on one worker: above 2
  ASSERT_TRUE(wait_until([&] { return resized() == std::vector<int32_t>{2}; })) << "no pod was asked for";
  EXPECT_EQ(slots()["decode-1"], "active");  // serves once its pod registers

  // The pod came up; the load is gone. Not removed before the low marks held a whole cooldown.
  set_load("decode-1", 0, 0.0);
  set_load("decode-0", 0, 0.0);
  const auto idle_from = std::chrono::steady_clock::now();
  ASSERT_TRUE(wait_until([&] { return worker_got("decode-1 migrate"); })) << "the highest pod was not drained";
  EXPECT_GE(std::chrono::steady_clock::now() - idle_from, 250ms);
  EXPECT_FALSE(worker_got("decode-0 migrate"));
  EXPECT_EQ(resized(), std::vector<int32_t>{2});  // the pod stays until it is empty
  ASSERT_TRUE(wait_until([&] { return resized() == std::vector<int32_t>({2, 1}); })) << "the StatefulSet was not shrunk";
  EXPECT_EQ(slots()["decode-1"], "standby");
}

TEST_F(FleetK8s, a_refused_resize_puts_the_slot_back_to_standby) {
  {
    std::lock_guard lock(w_->mu);
    w_->refuse = true;
  }
  set_load("decode-0", 10, 0.2);
  ASSERT_TRUE(wait_until([&] {
    std::lock_guard lock(w_->mu);
    return w_->attempts >= 1;
  })) << "no pod was asked for";
  // (asked again after each cooldown while the load lasts; between the asks it is a standby)
  ASSERT_TRUE(wait_until([&] { return slots()["decode-1"] == "standby"; })) << "a slot kept waiting for a pod";
  EXPECT_TRUE(resized().empty());
}

}  // namespace
}  // namespace troupe::actors
