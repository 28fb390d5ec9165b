// Frames: every kind round-trips through header, body and stream reassembly;
// every kind of bad input becomes a FrameFault with the right code and the
// right verdict on the stream (resync or close), never an exception.
#include <capnp/any.h>
#include <gtest/gtest.h>

#include <cstring>
#include <random>

#include "messages/frame_stream.hpp"
#include "messages/kinds.hpp"
#include "tests/messages/samples.hpp"

namespace troupe::messages {
namespace {

std::vector<std::byte> wire(const Frame& f) {
  auto h = encode_header(f.header());
  std::vector<std::byte> out(h.begin(), h.end());
  auto b = f.body_bytes();
  out.insert(out.end(), b.begin(), b.end());
  return out;
}

Frame frame_of(msg::Kind kind, std::vector<uint64_t> words) {
  FrameHeader h;
  h.kind = kind;
  h.request_id = 9;
  h.body_bytes = static_cast<uint32_t>(words.size() * 8);
  return copy_frame(h, std::as_bytes(std::span(words)));
}

TEST(Frame, every_kind_round_trips_through_a_byte_stream) {
  auto frames = test::sample_frames();
  ASSERT_EQ(frames.size(), 23u);  // Kind::ERROR .. Kind::ACTOR_MESSAGE
  std::vector<std::byte> stream;
  for (auto& f : frames) {
    auto w = wire(f);
    stream.insert(stream.end(), w.begin(), w.end());
  }
  // Feed in odd-sized pieces so headers and bodies split everywhere.
  FrameAssembler asm_{FrameLimits{}};
  std::vector<StreamEvent> events;
  for (size_t off = 0; off < stream.size(); off += 7) {
    auto n = std::min<size_t>(7, stream.size() - off);
    for (auto& e : asm_.feed(std::span(stream).subspan(off, n))) events.push_back(std::move(e));
  }
  ASSERT_EQ(events.size(), frames.size());
  for (size_t i = 0; i < frames.size(); ++i) {
    ASSERT_TRUE(std::holds_alternative<Frame>(events[i])) << std::get<FrameFault>(events[i]).error.what();
    const Frame& got = std::get<Frame>(events[i]);
    EXPECT_EQ(got.kind(), frames[i].kind());
    EXPECT_EQ(got.request_id(), 1000 + static_cast<uint64_t>(frames[i].kind()));
    EXPECT_EQ(test::canonical_body(got), test::canonical_body(frames[i])) << kind_name(got.kind());
  }
  EXPECT_TRUE(asm_.idle());
}

TEST(Frame, typed_open_reads_fields_and_checks_the_kind) {
  auto frames = test::sample_frames();
  const Frame& gen = frames[1];
  auto view = open<msg::GenerateRequest>(gen);
  ASSERT_TRUE(view.ok());
  auto r = view->root();
  EXPECT_EQ(std::string(r.getModel().cStr()), "tiny");
  ASSERT_TRUE(r.getPrompt().isChat());
  EXPECT_EQ(r.getPrompt().getChat().size(), 2u);
  EXPECT_FLOAT_EQ(r.getSampling().getTemperature(), 0.7f);
  EXPECT_EQ(r.getSampling().getSeed().getValue(), 1234u);
  EXPECT_EQ(r.getStopStrings()[1].cStr(), std::string("END"));
  EXPECT_TRUE(r.getIgnoreEos());

  auto wrong = open<msg::TokenChunk>(gen);
  ASSERT_FALSE(wrong.ok());
  EXPECT_EQ(wrong.fault().error.code(), ErrorCode::invalid_argument);

  // Defaults of an empty request are OpenAI's.
  FrameBuilder<msg::GenerateRequest> b;
  auto empty = open<msg::GenerateRequest>(b.finish(1));
  ASSERT_TRUE(empty.ok());
  EXPECT_EQ(empty->root().getMaxTokens(), 16u);
  EXPECT_FLOAT_EQ(empty->root().getSampling().getTopP(), 1.0f);
  EXPECT_TRUE(empty->root().getSampling().getSeed().isNone());
  // No penalties unless asked (a client built before they existed asks for none).
  EXPECT_FLOAT_EQ(empty->root().getSampling().getRepetitionPenalty(), 1.0f);
  EXPECT_FLOAT_EQ(empty->root().getSampling().getFrequencyPenalty(), 0.0f);
  EXPECT_FLOAT_EQ(empty->root().getSampling().getPresencePenalty(), 0.0f);
}

TEST(Frame, copy_from_forwards_a_message_unchanged) {
  for (auto& f : test::sample_frames()) {
    if (f.kind() != msg::Kind::KV_OFFER) continue;
    auto in = open<msg::KvOffer>(f);
    ASSERT_TRUE(in.ok());
    FrameBuilder<msg::KvOffer> out;
    out.copy_from(in->root());
    EXPECT_EQ(test::canonical_body(out.finish(5)), test::canonical_body(f));
    EXPECT_EQ(in->root().getDescriptors()[4].getKind(), msg::StateKind::HCA_INFLIGHT);
    EXPECT_EQ(in->root().getDescriptors()[3].getRingSlots(), 8u);
  }
}

TEST(Frame, bad_headers_are_faults_with_the_right_verdict) {
  FrameLimits limits;
  limits.max_body_bytes = 1 << 20;
  auto good = encode_header({kFrameVersion, msg::Kind::HEARTBEAT, 5, 64});
  ASSERT_TRUE(decode_header(good, limits).ok());

  auto truncated = decode_header(std::span(good).first(10), limits);
  ASSERT_FALSE(truncated.ok());
  EXPECT_FALSE(truncated.fault().resync);

  auto garbage = good;
  garbage[0] = std::byte{0xff};
  auto g = decode_header(garbage, limits);
  ASSERT_FALSE(g.ok());
  EXPECT_EQ(g.fault().error.code(), ErrorCode::invalid_argument);
  EXPECT_FALSE(g.fault().resync);

  auto v = decode_header(encode_header({7, msg::Kind::HEARTBEAT, 5, 64}), limits);
  ASSERT_FALSE(v.ok());
  EXPECT_EQ(v.fault().error.code(), ErrorCode::unsupported);
  EXPECT_EQ(v.fault().request_id, 5u);
  EXPECT_FALSE(v.fault().resync);

  auto big = decode_header(encode_header({kFrameVersion, msg::Kind::HEARTBEAT, 5, (1u << 20) + 8}), limits);
  ASSERT_FALSE(big.ok());
  EXPECT_EQ(big.fault().error.code(), ErrorCode::resource_exhausted);
  EXPECT_FALSE(big.fault().resync);

  auto odd = decode_header(encode_header({kFrameVersion, msg::Kind::HEARTBEAT, 5, 13}), limits);
  ASSERT_FALSE(odd.ok());
  EXPECT_FALSE(odd.fault().resync);

  auto unknown = encode_header({kFrameVersion, msg::Kind::HEARTBEAT, 5, 64});
  unknown[6] = std::byte{200};
  auto u = decode_header(unknown, limits);
  ASSERT_FALSE(u.ok());
  EXPECT_EQ(u.fault().error.code(), ErrorCode::unsupported);
  EXPECT_TRUE(u.fault().resync);
  EXPECT_EQ(u.fault().skip_bytes, 64u);

  auto reserved = good;
  reserved[22] = std::byte{1};
  EXPECT_FALSE(decode_header(reserved, limits).ok());

  auto empty = decode_header(encode_header({kFrameVersion, msg::Kind::HEARTBEAT, 5, 0}), limits);
  ASSERT_FALSE(empty.ok());
  EXPECT_TRUE(empty.fault().resync);
}

TEST(Frame, unknown_kind_is_skipped_and_the_stream_goes_on) {
  auto frames = test::sample_frames();
  auto bad = wire(frames[5]);
  bad[6] = std::byte{99};
  auto good = wire(frames[6]);
  bad.insert(bad.end(), good.begin(), good.end());
  FrameAssembler a;
  auto ev = a.feed(bad);
  ASSERT_EQ(ev.size(), 2u);
  ASSERT_TRUE(std::holds_alternative<FrameFault>(ev[0]));
  ASSERT_TRUE(std::holds_alternative<Frame>(ev[1]));
  EXPECT_EQ(std::get<Frame>(ev[1]).kind(), frames[6].kind());
}

TEST(Frame, fatal_fault_closes_the_assembler) {
  FrameAssembler a;
  std::vector<std::byte> junk(100, std::byte{0x41});
  auto ev = a.feed(junk);
  ASSERT_EQ(ev.size(), 1u);
  EXPECT_TRUE(a.closed());
  EXPECT_TRUE(a.feed(wire(test::sample_frames()[0])).empty());
}

TEST(Frame, garbage_and_truncated_bodies_are_rejected) {
  FrameLimits limits;
  // Segment table claims 1000 words, body has 2.
  auto t = validate_body(frame_of(msg::Kind::HEARTBEAT, {uint64_t{1000} << 32, 0}), limits);
  ASSERT_FALSE(t.ok());
  EXPECT_EQ(t.fault().error.code(), ErrorCode::invalid_argument);
  EXPECT_TRUE(t.fault().resync);
  EXPECT_EQ(t.fault().request_id, 9u);
  EXPECT_NE(std::string(t.fault().error.what()).find("prematurely"), std::string::npos);

  auto g = validate_body(frame_of(msg::Kind::HEARTBEAT, {~0ull, ~0ull, ~0ull}), limits);
  EXPECT_FALSE(g.ok());

  // Root is a list pointer, not a struct.
  auto l = validate_body(frame_of(msg::Kind::HEARTBEAT, {uint64_t{1} << 32, (uint64_t{8} << 35) | (2ull << 32) | 1}), limits);
  EXPECT_FALSE(l.ok());
}

TEST(Frame, out_of_bounds_pointers_are_rejected) {
  auto f = test::sample_frames()[1];  // GenerateRequest
  std::vector<uint64_t> words(f.body_words().size());
  std::memcpy(words.data(), f.body_words().begin(), words.size() * 8);
  // words[0] is the segment table (1 segment), words[1] the root struct pointer.
  auto bad_root = words;
  bad_root[1] = (bad_root[1] & ~0xffffffffull) | (uint64_t{0x00ffff00} << 2);
  auto r = validate_body(frame_of(msg::Kind::GENERATE_REQUEST, bad_root), {});
  ASSERT_FALSE(r.ok());
  EXPECT_NE(std::string(r.fault().error.what()).find("out-of-bounds"), std::string::npos) << r.fault().error.what();

  // A pointer deep inside (the last word pointing anywhere) is found by the traversal too.
  int rejected = 0;
  for (size_t i = 2; i < words.size(); ++i) {
    auto w = words;
    w[i] = (uint64_t{0x7fff} << 32) | (uint64_t{0x3fffff} << 2) | 1;  // far-away list pointer
    if (!validate_body(frame_of(msg::Kind::GENERATE_REQUEST, w), {}).ok()) ++rejected;
  }
  EXPECT_GT(rejected, 0);
}

TEST(Frame, deep_nesting_is_rejected) {
  capnp::MallocMessageBuilder mb;
  auto s = mb.getRoot<capnp::AnyPointer>().initAsAnyStruct(0, 1);
  for (int depth = 0; depth < 40; ++depth) s = s.getPointerSection()[0].initAsAnyStruct(0, 1);
  auto f = make_frame(msg::Kind::HEARTBEAT, 3, mb);
  auto r = validate_body(f, {});
  ASSERT_FALSE(r.ok());
  EXPECT_NE(std::string(r.fault().error.what()).find("nested"), std::string::npos) << r.fault().error.what();
}

TEST(Frame, pointer_amplification_hits_the_traversal_limit) {
  // 64 pointers to one 64 KiB blob: 0.5 MiB of message, 4 MiB to traverse.
  const uint64_t P = 64, B = 64 * 1024;
  std::vector<uint64_t> w;
  uint64_t seg_words = 1 + P + B / 8;
  w.push_back(seg_words << 32);              // segment table: 1 segment
  w.push_back(uint64_t{P} << 48);            // root: struct at +0, 0 data words, P pointers
  for (uint64_t i = 1; i <= P; ++i) {
    uint64_t offset = P - i;                 // from word i+1 to the blob at word P+1
    w.push_back(((B << 3 | 2) << 32) | (offset << 2) | 1);  // list of bytes
  }
  w.resize(1 + seg_words, 0x4141414141414141ull);
  auto r = validate_body(frame_of(msg::Kind::HEARTBEAT, w), {});
  ASSERT_FALSE(r.ok());
  EXPECT_NE(std::string(r.fault().error.what()).find("traversal limit"), std::string::npos) << r.fault().error.what();
}

TEST(Frame, trailing_bytes_are_rejected) {
  auto f = test::sample_frames()[4];
  std::vector<uint64_t> words(f.body_words().size() + 1, 0);
  std::memcpy(words.data(), f.body_words().begin(), f.body_words().size() * 8);
  EXPECT_FALSE(validate_body(frame_of(f.kind(), words), {}).ok());
}

TEST(Frame, random_mutations_never_throw) {
  std::mt19937_64 rng(42);
  auto frames = test::sample_frames();
  int faults = 0, frames_ok = 0;
  for (int iter = 0; iter < 20000; ++iter) {
    auto w = wire(frames[rng() % frames.size()]);
    int flips = 1 + static_cast<int>(rng() % 4);
    for (int k = 0; k < flips; ++k) w[rng() % w.size()] = static_cast<std::byte>(rng());
    if (rng() % 4 == 0) w.resize(rng() % w.size());
    FrameAssembler a{FrameLimits{}};
    for (auto& ev : a.feed(w)) {
      if (auto* f = std::get_if<Frame>(&ev)) {
        ++frames_ok;
        // A validated frame opens as its kind; a field of the wrong type
        // throws kj::Exception only when read (receivers catch it: see
        // unreadable_fault), never anything else, never a crash.
        if (f->kind() == msg::Kind::GENERATE_REQUEST) {
          auto v = open<msg::GenerateRequest>(*f);
          ASSERT_TRUE(v.ok());
          try {
            for (auto s : v->root().getStopStrings()) (void)s.size();
          } catch (const kj::Exception&) {
            ++faults;
          }
        }
      } else {
        ++faults;
      }
    }
  }
  EXPECT_GT(faults, 1000);
  EXPECT_GT(frames_ok, 100);
}

// Large bodies come back from a pool: the same size gets a buffer returned
// before (no page faults), and a pool full of other sizes gives up its
// oldest buffers rather than the newest.
TEST(Frame, large_bodies_are_recycled_and_the_oldest_evicted) {
  auto stats = messages::body_pool_stats;
  { auto a = messages::alloc_body_words(64u << 20); }
  auto s0 = stats();
  {
    auto b = messages::alloc_body_words(64u << 20);
    EXPECT_EQ(b.size(), (64u << 20) / sizeof(capnp::word));
    EXPECT_EQ(stats().reused, s0.reused + 1) << "a 64 MiB body of the same size reuses the one returned";
  }
  // 40 buffers of about 12 MiB returned after the 64 MiB one: past 512 MiB the oldest go first.
  {
    std::vector<kj::Array<capnp::word>> others;
    for (int i = 0; i < 40; ++i) others.push_back(messages::alloc_body_words((12u << 20) + (1u << 16) * i));
  }
  auto s1 = stats();
  EXPECT_LE(s1.cached_bytes, size_t{512} << 20);
  EXPECT_GT(s1.cached_bytes, size_t{400} << 20);
  { auto c = messages::alloc_body_words(64u << 20); }
  EXPECT_EQ(stats().allocated, s1.allocated + 1) << "the 64 MiB buffer, returned first, was evicted";
  { auto d = messages::alloc_body_words((12u << 20) + (1u << 16) * 39); }
  EXPECT_EQ(stats().reused, s1.reused + 1) << "the buffer returned last is still there";
  auto s2 = stats();
  { auto small = messages::alloc_body_words(4096); }
  EXPECT_EQ(stats().allocated + stats().reused, s2.allocated + s2.reused) << "small bodies bypass the pool";
}

TEST(Frame, error_codes_map_both_ways) {
  for (int c = 0; c <= static_cast<int>(ErrorCode::internal); ++c) {
    auto code = static_cast<ErrorCode>(c);
    EXPECT_EQ(from_wire(to_wire(code)), code);
  }
  auto e = make_error_frame(12, ErrorCode::not_found, "no such request", msg::Kind::ABORT);
  auto v = open<msg::Error>(e);
  ASSERT_TRUE(v.ok());
  EXPECT_EQ(v->root().getCode(), msg::ErrorCode::NOT_FOUND);
  EXPECT_EQ(v->root().getFrameKind(), msg::Kind::ABORT);
  EXPECT_EQ(e.request_id(), 12u);
}

}  // namespace
}  // namespace troupe::messages
