// The node actor's protocol between two "processes" (two actor systems with
// a Node each over the in-process transport): messages cross as the same
// structs, handles inside them become proxies (one per remote actor), requests
// get their replies, a lost peer or an ended actor is a real down_msg for
// local monitors, registrations are replayed when a peer comes back, and a
// handoff's pages move by RMA with the lease ending on confirm.
#include <gtest/gtest.h>

#include <condition_variable>
#include <deque>

#include <capnp/message.h>

#include "actors/node/kv_handoff.hpp"
#include "actors/node/node.hpp"
#include "engine/json_schema.hpp"
#include "transport/in_process.hpp"
#include "tests/support/wait.hpp"

namespace troupe::actors::node {
namespace {

using namespace std::chrono_literals;

struct Inbox {
  std::mutex mu;
  std::condition_variable cv;
  std::deque<caf::message> q;
  void push(caf::message m) {
    std::lock_guard lock(mu);
    q.push_back(std::move(m));
    cv.notify_all();
  }
  // The next message, or an empty one after `timeout`.
  caf::message pop(std::chrono::milliseconds timeout = 5000ms) {
    std::unique_lock lock(mu);
    if (!cv.wait_for(lock, timeout, [&] { return !q.empty(); })) return {};
    auto m = std::move(q.front());
    q.pop_front();
    return m;
  }
};

// Records every message; answers (workers_atom) like a router with one worker.
caf::behavior recorder(caf::event_based_actor* self, std::shared_ptr<Inbox> inbox) {
  self->set_default_handler([inbox](caf::scheduled_actor*, caf::message_view& x) -> caf::result<caf::message> {
    inbox->push(x.copy_content_to_message());
    return caf::message{};
  });
  return {
      [self](workers_atom) {
        WorkerLoad l;
        l.name = "decode-7";
        l.role = WorkerRole::decode;
        l.running = 3;
        l.actor = caf::actor_cast<caf::actor>(self);
        l.handoff_targets = {l.actor, l.actor};  // (a drain counts the loads that name it)
        return std::vector<WorkerLoad>{l};
      },
  };
}

struct Process {
  explicit Process(std::shared_ptr<transport::InProcessFabric> fabric, const std::string& name,
                   std::vector<PeerSpec> peers, std::chrono::milliseconds handoff_ttl = 30000ms) {
    cfg.set("scheduler.max-threads", 2);
    cfg.set("logger.verbosity", caf::atom("quiet"));
    system = std::make_unique<caf::actor_system>(cfg);
    NodeOptions o;
    o.name = name;
    o.peers = std::move(peers);
    o.heartbeat_every = 50ms;
    o.peer_silence = 2000ms;
    o.handoff_ttl = handoff_ttl;
    o.kv.csa_rate = 4;
    o.kv.hca_rate = 16;
    o.kv.model = "tiny";
    node = Node::start(*system, o, std::make_unique<transport::InProcessTransport>(fabric, name));
  }
  ~Process() {
    node->stop();
    system->await_actors_before_shutdown(false);  // the recorders never quit on their own
    system.reset();
  }
  caf::actor spawn_recorder(std::shared_ptr<Inbox> inbox) { return system->spawn(recorder, std::move(inbox)); }

  caf::actor_system_config cfg;
  std::unique_ptr<caf::actor_system> system;
  std::shared_ptr<Node> node;
};

using troupe::testing::wait_until;

class NodeFabric : public ::testing::Test {
 protected:
  void SetUp() override {
    fabric_ = std::make_shared<transport::InProcessFabric>();
    a_ = std::make_unique<Process>(fabric_, "a", std::vector<PeerSpec>{{"b", "", 0, "", false, true}}, handoff_ttl());
    // b dials a (workers dial the router's process).
    b_ = std::make_unique<Process>(fabric_, "b", std::vector<PeerSpec>{{"a", "", 0, "inproc://a", true, true}});
    router_ = a_->spawn_recorder(router_in_);
    a_->node->publish("router", router_);
    worker_ = b_->spawn_recorder(worker_in_);
    ASSERT_TRUE(wait_until([&] { return a_->node->connected("b") && b_->node->connected("a"); }));
  }
  void TearDown() override {
    for (auto* a : {&router_, &worker_}) {
      if (*a) caf::anon_send_exit(*a, caf::exit_reason::user_shutdown);
      *a = nullptr;  // no handle may outlive its actor system
    }
    b_.reset();
    a_.reset();
  }

  virtual std::chrono::milliseconds handoff_ttl() const { return 30000ms; }  // a's

  // b's worker registers with a's router; returns the router's handle of it.
  caf::actor register_worker() {
    caf::anon_send(b_->node->remote("a", "router"), register_atom::value, worker_, std::string("decode-7"),
                   static_cast<uint8_t>(WorkerRole::decode));
    auto m = router_in_->pop();
    EXPECT_TRUE((m.match_elements<register_atom, caf::actor, std::string, uint8_t>())) << caf::to_string(m);
    if (!m.match_elements<register_atom, caf::actor, std::string, uint8_t>()) return nullptr;
    return m.get_as<caf::actor>(1);
  }

  std::shared_ptr<transport::InProcessFabric> fabric_;
  std::unique_ptr<Process> a_, b_;
  std::shared_ptr<Inbox> router_in_ = std::make_shared<Inbox>(), worker_in_ = std::make_shared<Inbox>();
  caf::actor router_, worker_;
};

TEST_F(NodeFabric, messages_cross_as_the_same_structs_and_handles_become_one_proxy_each) {
  caf::actor w = register_worker();
  ASSERT_TRUE(w);
  EXPECT_NE(w, worker_);  // a proxy on a's side

  Job job;
  job.id = 42;
  job.prompt = {5, 6, 7};
  job.prompt_tokens = 3;
  job.sampling.max_tokens = 9;
  job.sampling.seed = 77;
  job.sampling.min_p = 0.25f;
  job.sampling.answer_prefixes = {{4, 5}, {6}};
  job.sampling.json_schema = engine::regex_grammar("[a-c]+");  // (its tag holds a NUL byte)
  job.sampling.answer_schemas = {"{}", "", engine::choice_grammar({"x", "y"})};
  job.sampling.answer_trigger = {9, 8};
  job.reply_to = router_;
  job.logprobs = 3;
  job.prompt_logprobs = 2;
  caf::anon_send(w, job);
  auto m = worker_in_->pop();
  ASSERT_TRUE(m.match_elements<Job>()) << caf::to_string(m);
  const Job got = m.get_as<Job>(0);
  EXPECT_EQ(got.id, 42u);
  EXPECT_EQ(got.prompt, job.prompt);
  EXPECT_EQ(got.sampling.max_tokens, 9);
  EXPECT_EQ(got.sampling.min_p, 0.25f);
  EXPECT_EQ(got.sampling.answer_prefixes, (std::vector<std::vector<int32_t>>{{4, 5}, {6}}));
  EXPECT_EQ(got.sampling.json_schema, job.sampling.json_schema);
  EXPECT_EQ(got.sampling.answer_schemas, job.sampling.answer_schemas);
  EXPECT_EQ(got.sampling.answer_trigger, job.sampling.answer_trigger);
  ASSERT_TRUE(got.sampling.seed.has_value());
  EXPECT_EQ(*got.sampling.seed, 77u);
  EXPECT_EQ(got.logprobs, 3);
  EXPECT_EQ(got.prompt_logprobs, 2);
  ASSERT_TRUE(got.reply_to);
  EXPECT_NE(got.reply_to, router_);

  // The worker answers through the reply_to proxy, naming itself: a's side
  // sees the same proxy it already holds for the worker.
  TokenBatch batch = token_batch(42, 0, {11, 12}, worker_);
  batch.logprobs = {TokenLogprob{-0.5f, {11, 3}, {-0.5f, -1.25f}}, TokenLogprob{-2.0f, {}, {}}};
  batch.prompt_index = 5;
  batch.prompt_logprobs = {TokenLogprob{-3.5f, {7}, {-0.25f}}};
  caf::anon_send(got.reply_to, batch);
  m = router_in_->pop();
  ASSERT_TRUE(m.match_elements<TokenBatch>()) << caf::to_string(m);
  EXPECT_EQ(m.get_as<TokenBatch>(0).tokens, (std::vector<int32_t>{11, 12}));
  EXPECT_EQ(m.get_as<TokenBatch>(0).worker, w);
  const auto& lps = m.get_as<TokenBatch>(0).logprobs;
  ASSERT_EQ(lps.size(), 2u);
  EXPECT_EQ(lps[0].logprob, -0.5f);
  EXPECT_EQ(lps[0].top_ids, (std::vector<int32_t>{11, 3}));
  EXPECT_EQ(lps[0].top_logprobs, (std::vector<float>{-0.5f, -1.25f}));
  EXPECT_EQ(lps[1].logprob, -2.0f);
  EXPECT_EQ(m.get_as<TokenBatch>(0).prompt_index, 5);
  const auto& plps = m.get_as<TokenBatch>(0).prompt_logprobs;
  ASSERT_EQ(plps.size(), 1u);
  EXPECT_EQ(plps[0].logprob, -3.5f);
  EXPECT_EQ(plps[0].top_ids, (std::vector<int32_t>{7}));

  caf::anon_send(got.reply_to, Done{42, engine::FinishReason::length, {}, worker_, 2});
  m = router_in_->pop();
  ASSERT_TRUE(m.match_elements<Done>()) << caf::to_string(m);
  EXPECT_EQ(m.get_as<Done>(0).reason, engine::FinishReason::length);
  EXPECT_EQ(m.get_as<Done>(0).end_index, 2);

  caf::anon_send(w, abort_atom::value, RequestId{42});
  m = worker_in_->pop();
  ASSERT_TRUE((m.match_elements<abort_atom, RequestId>())) << caf::to_string(m);
  EXPECT_EQ(m.get_as<RequestId>(1), 42u);

  // A frame client's Park / Resume stay distinct from the long-tail policy's.
  caf::anon_send(w, client_park_atom::value, RequestId{43});
  m = worker_in_->pop();
  ASSERT_TRUE((m.match_elements<client_park_atom, RequestId>())) << caf::to_string(m);
  EXPECT_EQ(m.get_as<RequestId>(1), 43u);
  caf::anon_send(w, client_resume_atom::value, RequestId{43});
  m = worker_in_->pop();
  ASSERT_TRUE((m.match_elements<client_resume_atom, RequestId>())) << caf::to_string(m);
  caf::anon_send(w, park_atom::value, RequestId{44});
  m = worker_in_->pop();
  ASSERT_TRUE((m.match_elements<park_atom, RequestId>())) << caf::to_string(m);
}

TEST_F(NodeFabric, a_request_through_a_proxy_gets_the_remote_reply) {
  caf::scoped_actor self{*b_->system};
  std::vector<WorkerLoad> loads;
  self->request(b_->node->remote("a", "router"), 5s, workers_atom::value)
      .receive([&](const std::vector<WorkerLoad>& l) { loads = l; },
               [&](caf::error& e) { ADD_FAILURE() << caf::to_string(e); });
  ASSERT_EQ(loads.size(), 1u);
  EXPECT_EQ(loads[0].name, "decode-7");
  EXPECT_EQ(loads[0].running, 3);
  // Actor refs come back as one handle each: the handoff targets equal the load's own actor.
  ASSERT_TRUE(loads[0].actor);
  ASSERT_EQ(loads[0].handoff_targets.size(), 2u);
  EXPECT_EQ(loads[0].handoff_targets[0], loads[0].actor);
  EXPECT_EQ(loads[0].handoff_targets[1], loads[0].actor);
}

TEST_F(NodeFabric, a_lost_peer_is_a_down_msg_for_local_monitors) {
  caf::actor w = register_worker();
  ASSERT_TRUE(w);
  caf::scoped_actor self{*a_->system};
  self->monitor(w);
  const auto t0 = std::chrono::steady_clock::now();
  fabric_->crash("b");
  bool down = false;
  self->receive([&](caf::down_msg& dm) {
    down = true;
    EXPECT_EQ(dm.source, w.address());
    EXPECT_EQ(dm.reason, caf::make_error(caf::exit_reason::remote_link_unreachable));
  }, caf::after(5s) >> [] {});
  EXPECT_TRUE(down);
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 1s);
  EXPECT_FALSE(a_->node->connected("b"));
  EXPECT_NE(a_->node->not_ready(), "");  // b is required
}

TEST_F(NodeFabric, an_ended_remote_actor_ends_its_proxy) {
  caf::actor w = register_worker();
  ASSERT_TRUE(w);
  caf::scoped_actor self{*a_->system};
  self->monitor(w);
  caf::anon_send_exit(worker_, caf::exit_reason::kill);
  bool down = false;
  self->receive([&](caf::down_msg& dm) { down = dm.source == w.address(); }, caf::after(5s) >> [] {});
  EXPECT_TRUE(down);
  EXPECT_TRUE(a_->node->connected("b"));  // only the actor is gone
}

TEST_F(NodeFabric, registrations_are_replayed_when_the_peer_comes_back) {
  ASSERT_TRUE(register_worker());
  // a restarts: a fresh process under the same name.
  a_.reset();
  a_ = std::make_unique<Process>(fabric_, "a", std::vector<PeerSpec>{{"b", "", 0, "", false, true}});
  auto again = std::make_shared<Inbox>();
  a_->node->publish("router", a_->spawn_recorder(again));
  auto m = again->pop(10s);
  ASSERT_TRUE((m.match_elements<register_atom, caf::actor, std::string, uint8_t>())) << caf::to_string(m);
  EXPECT_EQ(m.get_as<std::string>(2), "decode-7");
}

engine::SequenceImage sample_image() {
  engine::SequenceImage im;
  im.request.prompt = {1, 2, 3, 4, 5};
  im.request.sampling.max_tokens = 20;
  im.tokens = {1, 2, 3, 4, 5, 6};
  im.length = 5;
  im.generated = 1;
  im.seed = 99;
  im.page_tokens = 64;
  auto page = [&](int64_t index, cache::PoolKind kind, size_t bytes, uint8_t fill) {
    engine::SequenceImage::Page p;
    p.index = index;
    p.kind = kind;
    p.bytes.resize(bytes);
    for (size_t i = 0; i < bytes; ++i) p.bytes[i] = std::byte(static_cast<uint8_t>(fill + i * 7));
    im.pages.push_back(std::move(p));
  };
  page(0, cache::PoolKind::window, 8192, 1);
  page(1, cache::PoolKind::window, 8192, 2);
  page(0, cache::PoolKind::csa_entry, 2048, 3);
  page(0, cache::PoolKind::csa_index, 1024, 4);
  page(0, cache::PoolKind::hca_entry, 512, 5);
  page(-1, cache::PoolKind::hca_ring, 4096, 6);
  return im;
}

TEST_F(NodeFabric, a_handoff_moves_the_pages_by_rma_and_ends_the_lease_on_confirm) {
  caf::actor w = register_worker();
  ASSERT_TRUE(w);
  const auto image = std::make_shared<const engine::SequenceImage>(sample_image());
  Handoff h;
  h.job.id = 5;
  h.job.prompt = {1, 2, 3, 4, 5, 6};
  h.job.reply_to = router_;
  h.image = image;
  h.from = router_;  // stands for the prefill worker
  h.handoff_id = 31;
  caf::anon_send(w, h);

  auto m = worker_in_->pop();
  ASSERT_TRUE(m.match_elements<Handoff>()) << caf::to_string(m);
  const Handoff got = m.get_as<Handoff>(0);
  EXPECT_EQ(got.handoff_id, 31u);
  EXPECT_EQ(got.job.id, 5u);
  ASSERT_TRUE(got.image);
  EXPECT_EQ(got.image->tokens, image->tokens);
  EXPECT_EQ(got.image->length, 5);
  EXPECT_EQ(got.image->seed, 99u);
  ASSERT_EQ(got.image->pages.size(), image->pages.size());
  for (size_t i = 0; i < image->pages.size(); ++i) {
    EXPECT_EQ(got.image->pages[i].index, image->pages[i].index) << i;
    EXPECT_EQ(got.image->pages[i].kind, image->pages[i].kind) << i;
    EXPECT_TRUE(got.image->pages[i].bytes == image->pages[i].bytes) << i;
  }
  // The taker confirmed at the node level: the owner's lease is over.
  ASSERT_TRUE(wait_until([&] { return a_->node->stats().kv.leases == 0; }));
  EXPECT_EQ(a_->node->stats().kv.bytes_lent, image->bytes());
  EXPECT_EQ(b_->node->stats().kv.bytes_pulled, image->bytes());
  EXPECT_EQ(a_->node->stats().handoffs_pending, 1u);

  // The decode worker confirms to `from`: the prefill side frees its pages.
  caf::anon_send(got.from, confirm_atom::value, uint64_t{31});
  m = router_in_->pop();
  ASSERT_TRUE((m.match_elements<confirm_atom, uint64_t>())) << caf::to_string(m);
  EXPECT_EQ(a_->node->stats().handoffs_pending, 0u);
}

// A handoff of request `job` whose prefill worker the router's recorder stands for.
Handoff router_handoff(const caf::actor& router, RequestId job, uint64_t handoff_id) {
  Handoff h;
  h.job.id = job;
  h.job.prompt = {1, 2, 3};
  h.job.reply_to = router;
  h.image = std::make_shared<const engine::SequenceImage>(sample_image());
  h.from = router;
  h.handoff_id = handoff_id;
  return h;
}

// A handoff addressed to an actor the taker's process does not have (a peer
// that restarted under the same name since the proxy was made): the taker
// frees the owner's pages and tells the prefill worker to give the request
// back, and the owner stops counting the handoff as pending.
TEST_F(NodeFabric, a_handoff_to_a_target_the_peer_lacks_is_released_and_not_left_pending) {
  const Handoff h = router_handoff(router_, 6, 41);
  caf::anon_send(a_->node->remote("b", "nobody-here"), h);
  auto m = router_in_->pop();
  ASSERT_TRUE((m.match_elements<release_atom, uint64_t>())) << caf::to_string(m);
  EXPECT_EQ(m.get_as<uint64_t>(1), 41u);
  ASSERT_TRUE(wait_until([&] { return a_->node->stats().kv.leases == 0; }));
  ASSERT_TRUE(wait_until([&] { return a_->node->stats().handoffs_pending == 0; }));
  EXPECT_TRUE(a_->node->connected("b"));
}

// A handoff the taker never confirms (its worker took the state and died, say)
// stops counting as pending once the handoff ttl has passed; its pages were
// freed when the taker pulled them.
class NodeFabricShortTtl : public NodeFabric {
 protected:
  std::chrono::milliseconds handoff_ttl() const override { return 600ms; }
};

TEST_F(NodeFabricShortTtl, an_unconfirmed_handoff_stops_counting_after_its_ttl) {
  caf::actor w = register_worker();
  ASSERT_TRUE(w);
  const Handoff h = router_handoff(router_, 7, 51);
  const auto sent = std::chrono::steady_clock::now();
  caf::anon_send(w, h);
  auto m = worker_in_->pop();
  ASSERT_TRUE(m.match_elements<Handoff>()) << caf::to_string(m);  // delivered; the recorder never confirms
  ASSERT_TRUE(wait_until([&] { return a_->node->stats().kv.leases == 0; }));
  if (std::chrono::steady_clock::now() - sent < 500ms) {
    EXPECT_EQ(a_->node->stats().handoffs_pending, 1u);
  }
  ASSERT_TRUE(wait_until([&] { return a_->node->stats().handoffs_pending == 0; }));
  EXPECT_GE(std::chrono::steady_clock::now() - sent, 600ms);
  EXPECT_TRUE(router_in_->pop(0ms).empty());  // nothing is sent to the prefill worker: its own timer acts
}

// The owner's pool of lent regions keeps the newest: once two other sizes
// fill it, leases of a third size reuse their region instead of allocating,
// registering (and having the taker map) a fresh one every time.
TEST(KvHandoffPool, a_full_pool_gives_up_its_oldest_region_not_the_newest) {
  auto fabric = std::make_shared<transport::InProcessFabric>();
  transport::InProcessTransport t(fabric, "owner");
  ASSERT_TRUE(t.start({}).ok());
  KvHandoffOptions o;
  o.pooled_regions = 2;
  KvHandoff kv(t, o);
  auto lend_and_confirm = [&](size_t bytes) -> uint64_t {
    engine::SequenceImage im = sample_image();
    im.pages.resize(1);
    im.pages[0].bytes.assign(bytes, std::byte{1});
    capnp::MallocMessageBuilder mb;
    auto offer = mb.initRoot<msg::KvOffer>();
    auto lease = kv.lend("taker", im, std::chrono::seconds(10), offer);
    EXPECT_TRUE(lease.ok());
    if (!lease.ok()) return 0;
    uint64_t region = offer.getDescriptors()[0].getRegion().getRegionId();
    kv.on_confirm("taker", *lease);
    return region;
  };
  lend_and_confirm(1u << 20);
  lend_and_confirm(16u << 20);
  const uint64_t first = lend_and_confirm(64u << 20);
  EXPECT_EQ(lend_and_confirm(64u << 20), first) << "the 64 MiB region was not kept for the next 64 MiB lease";
  EXPECT_EQ(t.stats().regions, 2u) << "the pool holds at most pooled_regions regions";
  EXPECT_EQ(kv.stats().leases, 0u);
}

}  // namespace
}  // namespace troupe::actors::node
