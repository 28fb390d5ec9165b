// Bad bytes against a server process (frame_test_server): truncated frames,
// garbage, oversized lengths, wrong version, bad pointers, deep nesting,
// unknown kinds, a frame naming an unknown request, a stalled partial frame.
// Each gets an Error frame or a dropped connection and a log line; the
// process stays up and a well-behaved connection is unaffected throughout.
#include <capnp/any.h>
#include <gtest/gtest.h>

#include <random>

#include "messages/kinds.hpp"
#include "tests/messages/samples.hpp"
#include "tests/transport/child.hpp"
#include "tests/transport/harness.hpp"
#include "tests/transport/pattern.hpp"
#include "tests/transport/test_service.hpp"
#include "transport/tcp.hpp"
#include "transport/ucx.hpp"

namespace troupe::test {
namespace {

using namespace troupe::transport;
using messages::FrameBuilder;
using messages::FrameHeader;

std::vector<std::byte> header_bytes(FrameHeader h) {
  auto b = messages::encode_header(h);
  return {b.begin(), b.end()};
}

std::vector<std::byte> body_of(const Frame& f) { return {f.body_bytes().begin(), f.body_bytes().end()}; }

std::vector<std::byte> concat(std::vector<std::byte> a, const std::vector<std::byte>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

// A GenerateRequest body whose root pointer points far outside the message.
std::vector<std::byte> bad_pointer_body() {
  auto body = body_of(sample_frames()[1]);
  uint64_t w;
  std::memcpy(&w, body.data() + 8, 8);
  w = (w & ~0xffffffffull) | (uint64_t{0x00ffff00} << 2);
  std::memcpy(body.data() + 8, &w, 8);
  return body;
}

std::vector<std::byte> deep_body() {
  capnp::MallocMessageBuilder mb;
  auto s = mb.getRoot<capnp::AnyPointer>().initAsAnyStruct(0, 1);
  for (int i = 0; i < 64; ++i) s = s.getPointerSection()[0].initAsAnyStruct(0, 1);
  return body_of(messages::make_frame(msg::Kind::HEARTBEAT, 1, mb));
}

class BadBytes : public ::testing::Test {
 protected:
  void SetUp() override {
    server_ = std::make_unique<Child>(
        std::vector<std::string>{server_binary(), "--ucx", "--name", "server", "--partial-timeout-ms", "500",
                                 "--max-queued-bytes", std::to_string(2 << 20)},
        log_path("bad_bytes_server"));
    auto line = server_->read_line();
    port_ = static_cast<uint16_t>(std::stoi(Child::field(line, "tcp")));
    ucx_addr_ = Child::field(line, "ucx");
    auto g = TcpFrameSocket::connect("127.0.0.1", port_, 5s);
    ASSERT_TRUE(g.ok());
    good_ = std::move(*g);
    expect_good_connection_works();
  }
  void TearDown() override {
    EXPECT_TRUE(server_->alive()) << server_->log();
    expect_good_connection_works();
    server_->terminate();
    EXPECT_EQ(server_->wait(), 0);
  }

  void expect_good_connection_works() {
    FrameBuilder<msg::ListModels> b;
    ASSERT_TRUE(good_->send(b.finish(++good_id_)).ok());
    auto f = good_->receive(5s);
    ASSERT_TRUE(f.ok()) << f.error().what();
    EXPECT_EQ(f->kind(), msg::Kind::MODEL_LIST);
    EXPECT_EQ(f->request_id(), good_id_);
  }

  std::unique_ptr<TcpFrameSocket> fresh() {
    auto s = TcpFrameSocket::connect("127.0.0.1", port_, 5s);
    EXPECT_TRUE(s.ok());
    return std::move(*s);
  }

  // Sends bytes on a fresh connection; returns the Error frame's code (or
  // nullopt when none came) and whether the server then closed.
  struct Outcome {
    std::optional<msg::ErrorCode> code;
    uint64_t request_id = 0;
    std::string message;
    bool closed = false;
  };
  Outcome probe(const std::vector<std::byte>& bytes, bool half_close = false, TcpFrameSocket* on = nullptr) {
    std::unique_ptr<TcpFrameSocket> own;
    if (!on) {
      own = fresh();
      on = own.get();
    }
    EXPECT_TRUE(on->send_bytes(bytes).ok());
    if (half_close) on->shutdown_send();
    Outcome o;
    auto f = on->receive(5s);
    if (f.ok()) {
      EXPECT_EQ(f->kind(), msg::Kind::ERROR);
      auto v = messages::open<msg::Error>(*f);
      o.code = v->root().getCode();
      o.message = v->root().getMessage().cStr();
      o.request_id = f->request_id();
      f = on->receive(own ? 2s : 200ms);
    }
    o.closed = !f.ok() && f.error().code() == ErrorCode::unavailable;
    expect_good_connection_works();
    return o;
  }

  // Lines of the server's log that contain `text`.
  size_t log_lines(const std::string& text) {
    auto log = server_->log();
    size_t n = 0;
    for (size_t pos = log.find(text); pos != std::string::npos; pos = log.find(text, pos + 1)) ++n;
    return n;
  }

  std::unique_ptr<Child> server_;
  uint16_t port_ = 0;
  std::string ucx_addr_;
  std::unique_ptr<TcpFrameSocket> good_;
  uint64_t good_id_ = 0;
};

TEST_F(BadBytes, truncated_frames_drop_the_connection_with_a_log_line) {
  auto whole = concat(header_bytes({1, msg::Kind::HEARTBEAT, 3, 64}), std::vector<std::byte>(64));
  auto o = probe(std::vector<std::byte>(whole.begin(), whole.begin() + 10), true);
  EXPECT_TRUE(o.closed);
  EXPECT_FALSE(o.code);
  o = probe(std::vector<std::byte>(whole.begin(), whole.begin() + 40), true);
  EXPECT_TRUE(o.closed);
  EXPECT_GE(log_lines("middle of a frame"), 2u);
}

TEST_F(BadBytes, garbage_gets_an_error_frame_and_a_drop) {
  std::mt19937 rng(7);
  std::vector<std::byte> junk(256);
  for (auto& b : junk) b = static_cast<std::byte>(rng());
  auto o = probe(junk);
  EXPECT_EQ(o.code, msg::ErrorCode::INVALID_ARGUMENT);
  EXPECT_NE(o.message.find("not a troupe frame"), std::string::npos);
  EXPECT_TRUE(o.closed);
  std::string http = "GET / HTTP/1.1\r\nHost: x\r\n\r\n";
  o = probe(std::vector<std::byte>(reinterpret_cast<const std::byte*>(http.data()),
                                   reinterpret_cast<const std::byte*>(http.data()) + http.size()));
  EXPECT_TRUE(o.closed);
  EXPECT_GE(log_lines("bad frame from tcp"), 2u);
}

TEST_F(BadBytes, oversized_length_is_refused_before_allocation) {
  auto o = probe(header_bytes({1, msg::Kind::STAGE_ACTIVATION, 9, 0xfffffff8u}));
  EXPECT_EQ(o.code, msg::ErrorCode::RESOURCE_EXHAUSTED);
  EXPECT_EQ(o.request_id, 9u);
  EXPECT_TRUE(o.closed);
}

TEST_F(BadBytes, wrong_version_is_unsupported_and_dropped) {
  auto f = sample_frames()[2];
  auto o = probe(concat(header_bytes({2, f.kind(), 4, f.header().body_bytes}), body_of(f)));
  EXPECT_EQ(o.code, msg::ErrorCode::UNSUPPORTED);
  EXPECT_NE(o.message.find("version 2"), std::string::npos);
  EXPECT_TRUE(o.closed);
  o = probe(header_bytes({1, msg::Kind::HEARTBEAT, 4, 13}));  // not a whole number of words
  EXPECT_TRUE(o.closed);
}

TEST_F(BadBytes, bad_pointers_and_deep_nesting_get_errors_and_the_connection_survives) {
  auto conn = fresh();
  auto body = bad_pointer_body();
  auto o = probe(concat(header_bytes({1, msg::Kind::GENERATE_REQUEST, 11, uint32_t(body.size())}), body), false, conn.get());
  EXPECT_EQ(o.code, msg::ErrorCode::INVALID_ARGUMENT);
  EXPECT_EQ(o.request_id, 11u);
  EXPECT_NE(o.message.find("out-of-bounds"), std::string::npos) << o.message;
  EXPECT_FALSE(o.closed);

  auto deep = deep_body();
  o = probe(concat(header_bytes({1, msg::Kind::HEARTBEAT, 12, uint32_t(deep.size())}), deep), false, conn.get());
  EXPECT_EQ(o.code, msg::ErrorCode::INVALID_ARGUMENT);
  EXPECT_NE(o.message.find("nested"), std::string::npos) << o.message;
  EXPECT_FALSE(o.closed);

  auto hb = body_of(sample_frames()[15]);
  auto unknown_kind = header_bytes({1, msg::Kind::HEARTBEAT, 13, uint32_t(hb.size())});
  unknown_kind[6] = std::byte{250};
  o = probe(concat(unknown_kind, hb), false, conn.get());
  EXPECT_EQ(o.code, msg::ErrorCode::UNSUPPORTED);
  EXPECT_FALSE(o.closed);

  // The same connection still gets real answers.
  FrameBuilder<msg::ListModels> lm;
  ASSERT_TRUE(conn->send(lm.finish(14)).ok());
  auto f = conn->receive(5s);
  ASSERT_TRUE(f.ok());
  EXPECT_EQ(f->kind(), msg::Kind::MODEL_LIST);
}

TEST_F(BadBytes, a_frame_naming_an_unknown_request_gets_not_found) {
  auto conn = fresh();
  for (auto kind : {msg::Kind::ABORT, msg::Kind::PARK, msg::Kind::RESUME}) {
    Frame f;
    if (kind == msg::Kind::ABORT) f = FrameBuilder<msg::Abort>().finish(999);
    if (kind == msg::Kind::PARK) f = FrameBuilder<msg::Park>().finish(999);
    if (kind == msg::Kind::RESUME) f = FrameBuilder<msg::Resume>().finish(999);
    ASSERT_TRUE(conn->send(f).ok());
    auto e = conn->receive(5s);
    ASSERT_TRUE(e.ok());
    ASSERT_EQ(e->kind(), msg::Kind::ERROR);
    EXPECT_EQ(e->request_id(), 999u);
    EXPECT_EQ(messages::open<msg::Error>(*e)->root().getCode(), msg::ErrorCode::NOT_FOUND);
  }
  FrameBuilder<msg::GenerateRequest> g;
  g.root().setModel("no-such-model");
  g.root().getPrompt().setText("x");
  ASSERT_TRUE(conn->send(g.finish(5)).ok());
  auto e = conn->receive(5s);
  ASSERT_TRUE(e.ok());
  EXPECT_EQ(messages::open<msg::Error>(*e)->root().getCode(), msg::ErrorCode::NOT_FOUND);
  EXPECT_GE(log_lines("not running on this connection"), 3u);
}

TEST_F(BadBytes, a_connection_that_keeps_sending_bad_frames_is_dropped) {
  auto conn = fresh();
  auto body = bad_pointer_body();
  auto frame = concat(header_bytes({1, msg::Kind::GENERATE_REQUEST, 1, uint32_t(body.size())}), body);
  int errors = 0;
  bool closed = false;
  for (int i = 0; i < 20 && !closed; ++i) {
    if (!conn->send_bytes(frame).ok()) break;
    auto f = conn->receive(2s);
    if (f.ok()) {
      ++errors;
    } else {
      closed = true;
    }
  }
  EXPECT_TRUE(closed);
  EXPECT_EQ(errors, 9);  // max_faults = 8: the 9th error frame, then the drop
  EXPECT_GE(log_lines("dropping tcp"), 1u);
}

TEST_F(BadBytes, a_stalled_partial_frame_is_dropped) {
  auto conn = fresh();
  auto h = header_bytes({1, msg::Kind::HEARTBEAT, 3, 64});
  ASSERT_TRUE(conn->send_bytes(std::vector<std::byte>(h.begin(), h.begin() + 12)).ok());
  auto f = conn->receive(5s);  // the slowloris guard is 500 ms in this server
  ASSERT_TRUE(f.ok());
  EXPECT_EQ(messages::open<msg::Error>(*f)->root().getCode(), msg::ErrorCode::DEADLINE_EXCEEDED);
  EXPECT_FALSE(conn->receive(2s).ok());
  EXPECT_GE(log_lines("stalled"), 1u);
}

// A client that sends and never reads: once 2 MiB of answers wait for it (this
// server's limit, past the sockets' buffers) it is dropped. What it did get is
// answers in order from the first: no frame is skipped to go on (a stream with
// a hole would be wrong output), and nothing arrives after, not even the answer
// to a frame sent once it reads again. (How many it gets depends on what the
// sockets held when the connection closed.)
TEST_F(BadBytes, a_client_that_stops_reading_is_dropped_without_a_hole) {
  auto conn = fresh();
  constexpr uint64_t kFrames = 64;  // 64 MiB of echoes
  auto echo_frame = [](uint64_t i) {
    FrameBuilder<msg::StageActivation> b;
    b.root().getPayload().initInline(1 << 20);
    return b.finish(test::kEchoBit | i);
  };
  uint64_t sent = 0;
  for (uint64_t i = 1; i <= kFrames; ++i) {
    if (!conn->send(echo_frame(i)).ok()) break;  // dropped already
    sent = i;
  }
  std::this_thread::sleep_for(500ms);  // the server reads and answers everything sent
  uint64_t next = 1;
  std::optional<Error> last;
  for (bool resent = false;;) {
    auto f = conn->receive(5s);
    if (!f.ok()) {
      last = f.error();
      break;
    }
    ASSERT_EQ(f->request_id(), test::kEchoBit | next) << "answer " << next << " is missing";
    ++next;
    if (!resent && next > 2) {  // reading again: one more frame, which must not be answered
      (void)conn->send(echo_frame(kFrames + 1));
      resent = true;
    }
  }
  ASSERT_TRUE(last.has_value());
  EXPECT_EQ(last->code(), ErrorCode::unavailable) << "the connection was not closed: " << last->what();
  EXPECT_LT(next - 1, sent) << "every answer arrived: the client was never dropped";
  EXPECT_GE(log_lines("stopped reading"), 1u);
}

// The same over UCX: raw active messages from a misbehaving peer.
TEST_F(BadBytes, ucx_peer_sending_bad_frames_gets_errors_or_is_dropped) {
  Inbox bystander_in;
  UcxOptions bo;
  bo.name = "bystander";
  bo.listen_host.clear();
  UcxTransport bystander(bo);
  ASSERT_TRUE(bystander.start(bystander_in.events()).ok());
  ASSERT_TRUE(bystander.connect(ucx_addr_, 10s).ok());

  auto attacker = [&](const std::string& name, Inbox& in) {
    UcxOptions o;
    o.name = name;
    o.listen_host.clear();
    auto t = std::make_unique<UcxTransport>(o);
    EXPECT_TRUE(t->start(in.events()).ok());
    EXPECT_TRUE(t->connect(ucx_addr_, 10s).ok());
    return t;
  };
  auto seq = [](uint64_t s) {
    std::vector<std::byte> v(8);
    std::memcpy(v.data(), &s, 8);
    return v;
  };

  // Body faults keep the connection: Error frames come back, in order.
  Inbox a_in;
  auto a = attacker("attacker-1", a_in);
  auto bp = bad_pointer_body();
  auto deep = deep_body();
  ASSERT_TRUE(a->send_raw_for_test("server", concat(header_bytes({1, msg::Kind::GENERATE_REQUEST, 21, uint32_t(bp.size())}), seq(0)), bp).ok());
  ASSERT_TRUE(a->send_raw_for_test("server", concat(header_bytes({1, msg::Kind::HEARTBEAT, 22, uint32_t(deep.size())}), seq(1)), deep).ok());
  ASSERT_TRUE(a->send_raw_for_test("server", concat(header_bytes({1, msg::Kind::HEARTBEAT, 23, 800}), seq(2)), std::vector<std::byte>(64)).ok());
  ASSERT_TRUE(a_in.wait_frames(3));
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(a_in.frame_at(i).frame.kind(), msg::Kind::ERROR);
    EXPECT_EQ(a_in.frame_at(i).frame.request_id(), 21u + i);
  }
  EXPECT_TRUE(a->peers() == std::vector<std::string>{"server"});

  // A wrong version or a garbage header loses the stream: dropped.
  ASSERT_TRUE(a->send_raw_for_test("server", concat(header_bytes({9, msg::Kind::HEARTBEAT, 24, 8}), seq(3)), std::vector<std::byte>(8)).ok());
  EXPECT_TRUE(a_in.wait_down("server"));
  Inbox b_in;
  auto b = attacker("attacker-2", b_in);
  ASSERT_TRUE(b->send_raw_for_test("server", std::vector<std::byte>(5, std::byte{0xee}), std::vector<std::byte>(100)).ok());
  EXPECT_TRUE(b_in.wait_down("server"));

  // The bystander never noticed.
  ASSERT_TRUE(bystander.send("server", FrameBuilder<msg::ListModels>().finish(77)).ok());
  ASSERT_TRUE(bystander_in.wait_frames(1));
  EXPECT_EQ(bystander_in.frame_at(0).frame.kind(), msg::Kind::MODEL_LIST);
  EXPECT_EQ(bystander_in.down_count(), 0u);
  EXPECT_GE(log_lines("ucx server: bad frame from attacker"), 5u);
}

// Frames by put over UCX (UcxOptions::put_frames_arena_bytes): forged chunk
// notices, one before the server offered an arena, one outside it, one
// misaligned, one past its frame's body, each get an Error frame; the
// connection and the server stay up, and large frames still cross.
TEST_F(BadBytes, ucx_forged_frame_notices_get_errors_and_the_connection_survives) {
  UcxOptions o;
  o.name = "attacker-put";
  o.listen_host.clear();
  Inbox in;
  UcxTransport t(o);
  ASSERT_TRUE(t.start(in.events()).ok());
  ASSERT_TRUE(t.connect(ucx_addr_, 10s).ok());
  auto notice = [&](uint64_t rid, uint64_t arena_offset, uint64_t body_offset, uint64_t bytes) {
    ASSERT_TRUE(t.send_put_notice_for_test("server", header_bytes({1, msg::Kind::HEARTBEAT, rid, 4096}), arena_offset,
                                           body_offset, bytes)
                    .ok());
  };
  auto expect_error = [&](size_t index, uint64_t rid) {
    ASSERT_TRUE(in.wait_frames(index + 1));
    EXPECT_EQ(in.frame_at(index).frame.kind(), msg::Kind::ERROR);
    EXPECT_EQ(in.frame_at(index).frame.request_id(), rid);
  };
  ASSERT_NO_FATAL_FAILURE(notice(31, 0, 0, 4096));  // no arena offered yet
  ASSERT_NO_FATAL_FAILURE(expect_error(0, 31));

  // Large frames: the first (rendezvous) makes the server offer an arena, the
  // next go by put; the server echoes each, bytes intact.
  auto big = [](uint64_t rid) {
    FrameBuilder<msg::StageActivation> b;
    auto data = b.root().getPayload().initInline(1 << 20);
    fill_pattern(reinterpret_cast<std::byte*>(data.begin()), data.size(), static_cast<int>(rid));
    return b.finish(rid);
  };
  auto expect_echo = [&](size_t index, uint64_t rid) {
    ASSERT_TRUE(in.wait_frames(index + 1, 10s));
    ASSERT_EQ(in.frame_at(index).frame.request_id(), rid);
    auto v = messages::open<msg::StageActivation>(in.frame_at(index).frame);
    ASSERT_TRUE(v.ok());
    auto got = v->root().getPayload().getInline();
    EXPECT_TRUE(check_pattern(reinterpret_cast<const std::byte*>(got.begin()), got.size(), static_cast<int>(rid)));
  };
  ASSERT_TRUE(t.send("server", big(32)).ok());
  ASSERT_NO_FATAL_FAILURE(expect_echo(1, 32));
  for (uint64_t rid : {33, 34, 35}) ASSERT_TRUE(t.send("server", big(rid)).ok());
  for (size_t i = 0; i < 3; ++i) ASSERT_NO_FATAL_FAILURE(expect_echo(2 + i, 33 + i));
  EXPECT_EQ(t.stats().frames_by_put, 3u);

  ASSERT_NO_FATAL_FAILURE(notice(41, uint64_t{1} << 40, 0, 4096));  // outside the arena
  ASSERT_NO_FATAL_FAILURE(notice(42, 4, 0, 4096));                   // misaligned
  ASSERT_NO_FATAL_FAILURE(notice(43, 0, 4000, 4096));                // past the frame's body
  for (size_t i = 0; i < 3; ++i) ASSERT_NO_FATAL_FAILURE(expect_error(5 + i, 41 + i));
  EXPECT_EQ(t.peers(), std::vector<std::string>{"server"});
  ASSERT_TRUE(t.send("server", big(44)).ok());
  ASSERT_NO_FATAL_FAILURE(expect_echo(8, 44));
  EXPECT_GE(log_lines("bad frame from attacker-put"), 4u);
}

}  // namespace
}  // namespace troupe::test
