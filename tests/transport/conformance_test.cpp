// One conformance suite for every Transport (llama.cpp's test-backend-ops
// idea): the in-process transport and UCX must behave the same.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <atomic>
#include <cstring>
#include <memory>
#include <thread>

#include "tests/messages/samples.hpp"
#include "tests/support/wait.hpp"
#include "tests/transport/harness.hpp"
#include "transport/in_process.hpp"
#include "transport/ucx.hpp"

namespace troupe::test {
namespace {

using namespace troupe::transport;
using messages::FrameBuilder;

struct Factory {
  std::string kind;
  std::shared_ptr<InProcessFabric> fabric = std::make_shared<InProcessFabric>();
  std::unique_ptr<Transport> make(const std::string& name) const {
    if (kind == "inproc") return std::make_unique<InProcessTransport>(fabric, name);
    UcxOptions o;
    o.name = name;
    o.direct_endpoints = kind != "ucx";
    o.spin_while_in_flight = kind == "ucx_spin";
    return std::make_unique<UcxTransport>(o);
  }
};

class Conformance : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    factory_.kind = GetParam();
    a_ = factory_.make("alpha");
    b_ = factory_.make("beta");
    ASSERT_TRUE(a_->start(ia_.events()).ok());
    ASSERT_TRUE(b_->start(ib_.events()).ok());
    auto peer = a_->connect(b_->address(), 5s);
    ASSERT_TRUE(peer.ok()) << peer.error().what();
    ASSERT_EQ(*peer, "beta");
    ASSERT_TRUE(ib_.wait_up("alpha"));
  }

  Factory factory_;
  Inbox ia_, ib_;
  std::unique_ptr<Transport> a_, b_;
};

TEST_P(Conformance, connect_names_both_sides) {
  EXPECT_TRUE(ia_.wait_up("beta"));
  EXPECT_EQ(a_->peers(), std::vector<std::string>{"beta"});
  EXPECT_EQ(b_->peers(), std::vector<std::string>{"alpha"});
  EXPECT_EQ(a_->stats().peers, 1u);
}

TEST_P(Conformance, every_kind_arrives_both_ways_unchanged) {
  auto frames = sample_frames();
  for (auto& f : frames) ASSERT_TRUE(a_->send("beta", f).ok());
  for (auto& f : frames) ASSERT_TRUE(b_->send("alpha", f).ok());
  ASSERT_TRUE(ib_.wait_frames(frames.size()));
  ASSERT_TRUE(ia_.wait_frames(frames.size()));
  for (size_t i = 0; i < frames.size(); ++i) {
    EXPECT_EQ(ib_.frame_at(i).peer, "alpha");
    EXPECT_EQ(ib_.frame_at(i).frame.kind(), frames[i].kind());
    EXPECT_EQ(ib_.frame_at(i).frame.request_id(), frames[i].request_id());
    EXPECT_EQ(canonical_body(ib_.frame_at(i).frame), canonical_body(frames[i]));
    EXPECT_EQ(canonical_body(ia_.frame_at(i).frame), canonical_body(frames[i]));
  }
  EXPECT_EQ(b_->stats().frames_received, frames.size());
}

// Small frames interleaved with large (rendezvous) ones keep the send order.
TEST_P(Conformance, frames_keep_their_order_across_sizes) {
  const int n = 3000;
  for (int i = 0; i < n; ++i) {
    FrameBuilder<msg::TokenChunk> b;
    b.root().setIndex(i);
    if (i % 500 == 7) b.root().setText(std::string(1 << 20, 'x'));
    ASSERT_TRUE(a_->send("beta", b.finish(i)).ok());
  }
  ASSERT_TRUE(ib_.wait_frames(n, 30s));
  for (int i = 0; i < n; ++i) {
    ASSERT_EQ(ib_.frame_at(i).frame.request_id(), static_cast<uint64_t>(i));
    auto v = messages::open<msg::TokenChunk>(ib_.frame_at(i).frame);
    ASSERT_TRUE(v.ok());
    EXPECT_EQ(v->root().getIndex(), static_cast<uint32_t>(i));
  }
}

TEST_P(Conformance, a_handler_can_answer_from_its_callback) {
  ib_.on_frame = [this](const std::string& peer, const Frame& f) { (void)b_->send(peer, f.with_request_id(f.request_id() + 1)); };
  auto frames = sample_frames();
  ASSERT_TRUE(a_->send("beta", frames[2]).ok());
  ASSERT_TRUE(ia_.wait_frames(1));
  EXPECT_EQ(ia_.frame_at(0).frame.request_id(), frames[2].request_id() + 1);
  EXPECT_EQ(canonical_body(ia_.frame_at(0).frame), canonical_body(frames[2]));
}

TEST_P(Conformance, large_frame_round_trips) {
  FrameBuilder<msg::StageActivation> b;
  auto data = b.root().getPayload().initInline(32 << 20);
  fill_pattern(reinterpret_cast<std::byte*>(data.begin()), data.size(), 5);
  auto f = b.finish(77);
  ASSERT_TRUE(a_->send("beta", f).ok());
  ASSERT_TRUE(ib_.wait_frames(1, 30s));
  auto v = messages::open<msg::StageActivation>(ib_.frame_at(0).frame);
  ASSERT_TRUE(v.ok());
  auto got = v->root().getPayload().getInline();
  ASSERT_EQ(got.size(), size_t{32 << 20});
  EXPECT_TRUE(check_pattern(reinterpret_cast<const std::byte*>(got.begin()), got.size(), 5));
}

TEST_P(Conformance, put_and_get_pages_with_bytes_verified) {
  for (size_t size : {size_t{4} << 10, size_t{64} << 10, size_t{1} << 20, size_t{4} << 20, size_t{16} << 20}) {
    SCOPED_TRACE(size);
    auto region = b_->allocate_region(size);
    ASSERT_TRUE(region.ok()) << region.error().what();
    std::vector<std::byte> src(size), dst(size);
    fill_pattern(src.data(), size, size);
    auto put = put_wait(*a_, "beta", region->key, {{src.data(), 0, size}});
    ASSERT_TRUE(put.ok()) << put.error().what();
    EXPECT_TRUE(check_pattern(region->base, size, size));
    fill_pattern(region->base, size, size + 1);
    auto got = get_wait(*a_, "beta", region->key, {{dst.data(), 0, size}});
    ASSERT_TRUE(got.ok()) << got.error().what();
    EXPECT_TRUE(check_pattern(dst.data(), size, size + 1));
    a_->forget_remote("beta", region->key.region_id);
    ASSERT_TRUE(b_->deregister_region(region->key.region_id).ok());
  }
  EXPECT_EQ(b_->stats().regions, 0u);
}

TEST_P(Conformance, caller_memory_and_page_batches) {
  const size_t page = 64 << 10, pages = 16;
  std::vector<std::byte> pool(page * pages * 2);
  auto region = b_->register_region(pool.data(), pool.size());
  ASSERT_TRUE(region.ok()) << region.error().what();
  std::vector<std::byte> src(page * pages);
  fill_pattern(src.data(), src.size(), 9);
  std::vector<RmaOp> ops;
  for (size_t i = 0; i < pages; ++i) ops.push_back({src.data() + i * page, (2 * i + 1) * page, page});  // odd slots
  ASSERT_TRUE(put_wait(*a_, "beta", region->key, ops).ok());
  for (size_t i = 0; i < pages; ++i) {
    EXPECT_EQ(std::memcmp(pool.data() + (2 * i + 1) * page, src.data() + i * page, page), 0) << i;
  }
  std::vector<std::byte> back(page * pages);
  for (size_t i = 0; i < pages; ++i) ops[i].local = back.data() + i * page;
  ASSERT_TRUE(get_wait(*a_, "beta", region->key, ops).ok());
  EXPECT_EQ(back, src);
  ASSERT_TRUE(b_->deregister_region(region->key.region_id).ok());
}

TEST_P(Conformance, moves_outside_a_region_are_refused) {
  auto region = b_->allocate_region(4096);
  ASSERT_TRUE(region.ok());
  std::vector<std::byte> buf(8192, std::byte{1});
  auto s = put_wait(*a_, "beta", region->key, {{buf.data(), 4000, 200}});
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.error().code(), ErrorCode::invalid_argument);
  s = get_wait(*a_, "beta", region->key, {{buf.data(), 0, 8192}});
  EXPECT_FALSE(s.ok());
  s = put_wait(*a_, "beta", region->key, {{buf.data(), ~uint64_t{0} - 10, 100}});  // offset overflow
  EXPECT_FALSE(s.ok());
  for (size_t i = 0; i < 4096; ++i) ASSERT_EQ(region->base[i], std::byte{0});

  auto forged = region->key;
  forged.packed_key.clear();
  EXPECT_FALSE(put_wait(*a_, "beta", forged, {{buf.data(), 0, 100}}).ok());
  auto wrong_owner = region->key;
  wrong_owner.owner = "gamma";
  EXPECT_FALSE(put_wait(*a_, "beta", wrong_owner, {{buf.data(), 0, 100}}).ok());
  EXPECT_EQ(b_->deregister_region(region->key.region_id + 1000).error().code(), ErrorCode::not_found);
}

TEST_P(Conformance, sending_to_an_unknown_peer_is_unavailable) {
  auto s = a_->send("nobody", sample_frames()[0]);
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.error().code(), ErrorCode::unavailable);
  std::vector<std::byte> buf(16);
  RegionKey k{"nobody", 1, 0, 16, std::vector<uint8_t>(16)};
  EXPECT_EQ(put_wait(*a_, "nobody", k, {{buf.data(), 0, 16}}).error().code(), ErrorCode::unavailable);
}

TEST_P(Conformance, a_closing_peer_is_reported_within_a_second) {
  auto region = b_->allocate_region(1 << 20);
  ASSERT_TRUE(region.ok());
  std::vector<std::byte> buf(1 << 20);
  ASSERT_TRUE(get_wait(*a_, "beta", region->key, {{buf.data(), 0, buf.size()}}).ok());
  auto t0 = std::chrono::steady_clock::now();
  b_.reset();
  ASSERT_TRUE(ia_.wait_down("beta", 5s));
  auto dt = ia_.down_time_at(0) - t0;
  EXPECT_LT(dt, 1s);
  EXPECT_TRUE(a_->peers().empty());
  EXPECT_EQ(a_->stats().remote_keys, 0u);
  EXPECT_EQ(a_->stats().rma_in_flight, 0u);
  EXPECT_EQ(a_->send("beta", sample_frames()[0]).error().code(), ErrorCode::unavailable);
}

TEST_P(Conformance, disconnect_is_seen_on_both_sides_and_a_restart_reconnects) {
  a_->disconnect("beta");
  ASSERT_TRUE(ia_.wait_down("beta"));
  ASSERT_TRUE(ib_.wait_down("alpha"));
  EXPECT_TRUE(a_->peers().empty());

  // "beta" restarts (a new endpoint of the same name) and alpha reconnects.
  b_.reset();
  Inbox ib2;
  b_ = factory_.make("beta");
  ASSERT_TRUE(b_->start(ib2.events()).ok());
  auto peer = a_->connect(b_->address(), 5s);
  ASSERT_TRUE(peer.ok()) << peer.error().what();
  ASSERT_TRUE(a_->send("beta", sample_frames()[3]).ok());
  ASSERT_TRUE(ib2.wait_frames(1));
  EXPECT_EQ(ib2.frame_at(0).peer, "alpha");
}

TEST_P(Conformance, connecting_to_nothing_fails_cleanly) {
  std::string nowhere = GetParam() == "inproc" ? "inproc://nobody" : "ucx://127.0.0.1:1";
  auto r = a_->connect(nowhere, 3s);
  EXPECT_FALSE(r.ok());
  EXPECT_FALSE(a_->connect("tcp://what", 1s).ok());
  // The existing connection is unaffected.
  ASSERT_TRUE(a_->send("beta", sample_frames()[1]).ok());
  EXPECT_TRUE(ib_.wait_frames(1));
}

// Two started UCX transports, alpha connected to beta, for the UCX-only
// tests that need their own options.
struct UcxPair {
  Inbox ia, ib;
  std::unique_ptr<UcxTransport> a, b;
  void connect(UcxOptions oa, UcxOptions ob) {
    oa.name = "alpha";
    ob.name = "beta";
    a = std::make_unique<UcxTransport>(oa);
    b = std::make_unique<UcxTransport>(ob);
    ASSERT_TRUE(a->start(ia.events()).ok());
    ASSERT_TRUE(b->start(ib.events()).ok());
    ASSERT_TRUE(a->connect(b->address(), 5s).ok());
    ASSERT_TRUE(ib.wait_up("alpha"));
  }
};

// UCX only (the in-process transport hands frames over at once): a full
// send queue pushes back instead of growing without bound.
TEST(UcxBackpressure, a_full_send_queue_answers_resource_exhausted) {
  UcxOptions oa;
  oa.max_send_queue_bytes = 1 << 20;
  UcxPair p;
  ASSERT_NO_FATAL_FAILURE(p.connect(oa, {}));
  auto& a = *p.a;
  auto& ia = p.ia;
  auto& ib = p.ib;
  FrameBuilder<msg::StageActivation> big;
  big.root().getPayload().initInline(256 << 10);
  auto f = big.finish(1);
  size_t accepted = 0, refused = 0;
  for (int i = 0; i < 64; ++i) {
    auto s = a.send("beta", f.with_request_id(i));
    if (s.ok()) {
      ++accepted;
    } else {
      EXPECT_EQ(s.error().code(), ErrorCode::resource_exhausted);
      ++refused;
    }
  }
  EXPECT_GT(refused, 0u);
  ASSERT_TRUE(ib.wait_frames(accepted, 20s));
  EXPECT_TRUE(ia.wait([&] { return a.stats().send_queue_bytes == 0; }, 5s));
  EXPECT_TRUE(a.send("beta", f).ok());
}

// UCX only: a connection closed (or a transport shut down) while rendezvous
// frames are still arriving must not leave a receive attached to a closed
// endpoint: UCX 1.13 aborts the process in ucp_worker_destroy if it does.
TEST(UcxClose, closing_while_large_frames_arrive_leaves_nothing_behind) {
  FrameBuilder<msg::StageActivation> big;
  big.root().getPayload().initInline(1 << 20);
  auto f = big.finish(1);
  for (int round = 0; round < 24; ++round) {
    UcxOptions o;
    o.direct_endpoints = round % 2 == 0;
    UcxPair p;
    ASSERT_NO_FATAL_FAILURE(p.connect(o, o));
    for (int i = 0; i < 6; ++i) (void)p.a->send("beta", f.with_request_id(i));
    std::this_thread::sleep_for(std::chrono::microseconds(250 * (round / 2 % 6)));
    if (round % 4 < 2) {
      p.b->disconnect("alpha");  // the receiver closes mid-stream
      EXPECT_TRUE(p.ib.wait_down("alpha"));
    }
    p.b.reset();  // the receiver shuts down mid-stream (or after its close)
    p.a.reset();
  }
}

// UCX only: peers that dial again the moment a transport closes their
// connection (as nodes do) must find its port refused, not a listener being
// destroyed under a half-open connection request: UCX 1.13 crashes on that
// (SIGSEGV in ucp_cm_server_conn_request_cb on the async thread).
TEST(UcxClose, peers_redialling_at_once_do_not_crash_a_closing_transport) {
  constexpr int kClients = 4;
  for (int round = 0; round < 12; ++round) {
    UcxOptions os;
    os.name = "server";
    Inbox is;
    auto server = std::make_unique<UcxTransport>(os);
    ASSERT_TRUE(server->start(is.events()).ok());
    const std::string addr = server->address();
    std::vector<std::unique_ptr<Inbox>> inboxes;
    std::vector<std::unique_ptr<UcxTransport>> clients;
    for (int i = 0; i < kClients; ++i) {
      UcxOptions oc;
      oc.name = fmt::format("client-{}", i);
      oc.listen_host.clear();
      inboxes.push_back(std::make_unique<Inbox>());
      clients.push_back(std::make_unique<UcxTransport>(oc));
      ASSERT_TRUE(clients.back()->start(inboxes.back()->events()).ok());
      ASSERT_TRUE(clients.back()->connect(addr, 5s).ok());
    }
    std::atomic<bool> stop{false};
    std::vector<std::thread> dialers;
    for (int i = 0; i < kClients; ++i) {
      dialers.emplace_back([&, i] {
        while (!stop) {  // dial again as soon as the server is seen down, until told to stop
          if (inboxes[i]->wait([&] { return !inboxes[i]->downs.empty(); }, 20ms)) {
            (void)clients[i]->connect(addr, 200ms);
          }
        }
      });
    }
    server.reset();  // closes every connection while the clients dial back
    for (auto& in : inboxes) EXPECT_TRUE(in->wait_down("server"));
    std::this_thread::sleep_for(50ms);
    stop = true;
    for (auto& t : dialers) t.join();
  }
}

// UCX only: a peer's region keys are cached up to max_remote_keys; the least
// recently used idle one goes (it keeps the owner's memory mapped here), and
// a region whose key went is unpacked again on its next use.
TEST(UcxRemoteKeys, the_key_cache_is_bounded_and_evicts_the_least_recently_used) {
  UcxOptions oa;
  oa.max_remote_keys = 8;
  UcxPair p;
  ASSERT_NO_FATAL_FAILURE(p.connect(oa, {}));
  auto& a = *p.a;
  auto& b = *p.b;
  std::vector<LocalRegion> regions;
  for (int i = 0; i < 20; ++i) {
    auto r = b.allocate_region(4096);
    ASSERT_TRUE(r.ok());
    std::memset(r->base, i + 1, 4096);
    regions.push_back(*r);
  }
  std::vector<std::byte> buf(4096);
  auto get_and_check = [&](int i) {
    auto s = get_wait(a, "beta", regions[i].key, {{buf.data(), 0, buf.size()}});
    ASSERT_TRUE(s.ok()) << i << ": " << s.error().what();
    EXPECT_EQ(buf[0], std::byte(i + 1));
    EXPECT_EQ(buf[4095], std::byte(i + 1));
  };
  for (int i = 0; i < 20; ++i) {
    get_and_check(0);  // region 0 stays the most recently used
    get_and_check(i);
    EXPECT_LE(a.stats().remote_keys, 8u) << "after region " << i;
  }
  EXPECT_EQ(a.stats().remote_keys, 8u);
  get_and_check(1);  // evicted long ago: unpacked again
  get_and_check(19);
  a.forget_remote("beta", regions[19].key.region_id);
  EXPECT_TRUE(troupe::testing::wait_until([&] { return a.stats().remote_keys == 7u; }));
}

// UCX only: frames of at least put_frames_from_bytes to a peer on this host
// move by puts into the receiver's arena, in chunks, once the first one's
// rendezvous made the receiver offer it; a small arena makes them wait for
// room and wrap around, and a frame larger than the arena goes through it in
// turns. Order and bytes hold across every size.
void send_mixed_frames(UcxPair& p, int n) {
  const size_t sizes[] = {100, 70 << 10, 300 << 10, (1 << 20) + 300 * 1024 + 8, (3 << 20) + 8};
  for (int i = 0; i < n; ++i) {
    FrameBuilder<msg::StageActivation> b;
    auto data = b.root().getPayload().initInline(sizes[i % 5]);
    fill_pattern(reinterpret_cast<std::byte*>(data.begin()), data.size(), i);
    auto f = b.finish(i);
    Status s = p.a->send("beta", f);
    for (int tries = 0; !s.ok() && s.error().code() == ErrorCode::resource_exhausted && tries < 10000; ++tries) {
      std::this_thread::sleep_for(1ms);
      s = p.a->send("beta", f);
    }
    ASSERT_TRUE(s.ok()) << s.error().what();
  }
  ASSERT_TRUE(p.ib.wait_frames(n, 60s));
  for (int i = 0; i < n; ++i) {
    ASSERT_EQ(p.ib.frame_at(i).frame.request_id(), static_cast<uint64_t>(i));
    auto v = messages::open<msg::StageActivation>(p.ib.frame_at(i).frame);
    ASSERT_TRUE(v.ok());
    auto got = v->root().getPayload().getInline();
    ASSERT_EQ(got.size(), sizes[i % 5]) << i;
    EXPECT_TRUE(check_pattern(reinterpret_cast<const std::byte*>(got.begin()), got.size(), i)) << i;
  }
  EXPECT_EQ(p.b->stats().bad_frames, 0u);
  EXPECT_TRUE(p.ia.wait([&] { return p.a->stats().send_queue_bytes == 0; }, 5s));
}

TEST(UcxFramesByPut, large_frames_move_by_put_in_order_with_bytes_verified) {
  UcxOptions o;
  o.put_frames_from_bytes = 64 << 10;
  o.put_frames_arena_bytes = 1 << 20;
  o.put_frames_chunk_bytes = 192 << 10;
  o.max_send_queue_bytes = 16 << 20;
  UcxPair p;
  ASSERT_NO_FATAL_FAILURE(p.connect(o, o));
  ASSERT_NO_FATAL_FAILURE(send_mixed_frames(p, 80));
  // The first frame over the threshold went by rendezvous (it brought the offer); most after it by put.
  EXPECT_GT(p.a->stats().frames_by_put, 40u);
}

TEST(UcxFramesByPut, an_arena_of_zero_keeps_every_frame_on_rendezvous) {
  UcxOptions o;
  o.put_frames_arena_bytes = 0;
  UcxPair p;
  ASSERT_NO_FATAL_FAILURE(p.connect(o, o));
  ASSERT_NO_FATAL_FAILURE(send_mixed_frames(p, 20));
  EXPECT_EQ(p.a->stats().frames_by_put, 0u);
}

INSTANTIATE_TEST_SUITE_P(Transports, Conformance, ::testing::Values("inproc", "ucx", "ucx_direct", "ucx_spin"),
                         [](const auto& info) { return info.param; });

}  // namespace
}  // namespace troupe::test
