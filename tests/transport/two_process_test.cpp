// Two processes on 127.0.0.1 over UCX: every message kind crosses and comes
// back unchanged, and KV pages of 4 KiB to 64 MiB move both ways (get after
// KvOffer, put after KvPull) with the bytes verified on both sides.
#include <gtest/gtest.h>

#include "tests/messages/samples.hpp"
#include "tests/transport/child.hpp"
#include "tests/transport/harness.hpp"
#include "tests/transport/test_service.hpp"
#include "transport/ucx.hpp"

namespace troupe::test {
namespace {

using namespace troupe::transport;
using messages::FrameBuilder;

class TwoProcess : public ::testing::Test {
 protected:
  void SetUp() override {
    child_ = std::make_unique<Child>(std::vector<std::string>{server_binary(), "--ucx", "--name", "server"},
                                     log_path("two_process_server"));
    auto line = child_->read_line();
    UcxOptions o;
    o.name = "driver";
    o.listen_host.clear();
    t_ = std::make_unique<UcxTransport>(o);
    ASSERT_TRUE(t_->start(inbox_.events()).ok());
    auto peer = t_->connect(Child::field(line, "ucx"), 10s);
    ASSERT_TRUE(peer.ok()) << peer.error().what();
    ASSERT_EQ(*peer, "server");
  }
  void TearDown() override {
    t_.reset();
    child_->terminate();
    EXPECT_EQ(child_->wait(), 0) << child_->log();
  }

  // Sends `f` and waits for the next frame with the same request id.
  Frame round_trip(const Frame& f, std::chrono::milliseconds timeout = 30s) {
    size_t seen = inbox_.frame_count();
    EXPECT_TRUE(t_->send("server", f).ok());
    Frame got;
    inbox_.wait(
        [&] {
          for (size_t i = seen; i < inbox_.frames.size(); ++i) {
            if (inbox_.frames[i].frame.request_id() == f.request_id()) {
              got = inbox_.frames[i].frame;
              return true;
            }
          }
          return false;
        },
        timeout);
    return got;
  }

  std::unique_ptr<Child> child_;
  Inbox inbox_;
  std::unique_ptr<UcxTransport> t_;
};

TEST_F(TwoProcess, every_message_kind_crosses_and_returns_unchanged) {
  auto frames = sample_frames();
  for (auto& f : frames) {
    Frame back = round_trip(f.with_request_id(f.request_id() | kEchoBit));
    ASSERT_EQ(back.kind(), f.kind()) << messages::kind_name(f.kind());
    EXPECT_EQ(canonical_body(back), canonical_body(f)) << messages::kind_name(f.kind());
  }
  EXPECT_EQ(t_->stats().bad_frames, 0u);
}

void describe(msg::KvDescriptor::Builder d, const RegionKey& key, uint64_t page_bytes, std::vector<uint32_t> pages) {
  d.setKind(msg::StateKind::COMPRESSED_ENTRIES);
  d.setLayer(3);
  d.setCompressRate(4);
  auto p = d.initPages(pages.size());
  for (size_t i = 0; i < pages.size(); ++i) p.set(i, pages[i]);
  auto shape = d.initPageShape(1);
  shape.set(0, static_cast<uint32_t>(page_bytes));
  d.setDtype(msg::Dtype::U8);
  d.setPageBytes(page_bytes);
  d.setPageStride(page_bytes);
  d.setLocation(msg::Location::HOST);
  to_wire(key, d.initRegion());
}

TEST_F(TwoProcess, pages_from_4KiB_to_64MiB_move_both_ways_verified) {
  struct Case {
    uint64_t page_bytes;
    std::vector<uint32_t> pages;
    uint64_t region_pages;
    bool caller_memory;
  };
  std::vector<Case> cases;
  for (uint64_t size : {4ull << 10, 64ull << 10, 1ull << 20, 4ull << 20, 16ull << 20, 64ull << 20}) {
    cases.push_back({size, {0}, 1, false});
  }
  cases.push_back({4096, {1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31}, 32, false});  // scattered pages
  cases.push_back({1 << 20, {2, 0, 1}, 3, true});                                                     // caller memory, out of order
  uint64_t lease = 100;
  for (auto& c : cases) {
    SCOPED_TRACE(::testing::Message() << c.page_bytes << " B x " << c.pages.size());
    uint64_t bytes = c.page_bytes * c.pages.size();
    uint64_t region_bytes = c.page_bytes * c.region_pages;
    std::vector<std::byte> caller(c.caller_memory ? region_bytes : 0);

    // Get: we offer pages, the server pulls them and confirms their checksum.
    ++lease;
    auto region = c.caller_memory ? t_->register_region(caller.data(), region_bytes) : t_->allocate_region(region_bytes);
    ASSERT_TRUE(region.ok()) << region.error().what();
    fill_pattern(region->base, region_bytes, lease);
    uint64_t want = 0xcbf29ce484222325ull;
    for (uint32_t p : c.pages) want = fnv1a(region->base + p * c.page_bytes, c.page_bytes, want);
    FrameBuilder<msg::KvOffer> offer;
    offer.root().setLeaseId(lease);
    describe(offer.root().initDescriptors(1)[0], region->key, c.page_bytes, c.pages);
    auto confirm = round_trip(offer.finish(lease));
    ASSERT_EQ(confirm.kind(), msg::Kind::KV_CONFIRM) << (confirm.kind() == msg::Kind::ERROR ? "error" : "");
    auto cv = messages::open<msg::KvConfirm>(confirm);
    ASSERT_TRUE(cv.ok());
    EXPECT_EQ(cv->root().getBytes(), bytes);
    EXPECT_EQ(cv->root().getChecksum(), want);
    FrameBuilder<msg::KvRelease> rel;
    rel.root().setLeaseId(lease);
    rel.root().setReason(msg::ReleaseReason::CONFIRMED);
    EXPECT_EQ(round_trip(rel.finish(lease + 50000)).kind(), msg::Kind::ACK);
    ASSERT_TRUE(t_->deregister_region(region->key.region_id).ok());

    // Put: we ask the server to write into our pages (pattern seed = lease).
    ++lease;
    std::fill(caller.begin(), caller.end(), std::byte{0});
    region = c.caller_memory ? t_->register_region(caller.data(), region_bytes) : t_->allocate_region(region_bytes);
    ASSERT_TRUE(region.ok());
    FrameBuilder<msg::KvPull> pull;
    pull.root().setLeaseId(lease);
    pull.root().setMode(msg::PullMode::PUT);
    describe(pull.root().initDestinations(1)[0], region->key, c.page_bytes, c.pages);
    confirm = round_trip(pull.finish(lease));
    ASSERT_EQ(confirm.kind(), msg::Kind::KV_CONFIRM);
    std::vector<std::byte> expect(bytes);
    fill_pattern(expect.data(), bytes, lease);
    for (size_t i = 0; i < c.pages.size(); ++i) {
      ASSERT_EQ(std::memcmp(region->base + c.pages[i] * c.page_bytes, expect.data() + i * c.page_bytes, c.page_bytes), 0)
          << "page " << c.pages[i];
    }
    cv = messages::open<msg::KvConfirm>(confirm);
    EXPECT_EQ(cv->root().getChecksum(), fnv1a(expect.data(), bytes));
    ASSERT_TRUE(t_->deregister_region(region->key.region_id).ok());
  }
  EXPECT_EQ(t_->stats().regions, 0u);
}

}  // namespace
}  // namespace troupe::test
