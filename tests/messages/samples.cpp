#include "tests/messages/samples.hpp"

#include <capnp/any.h>

namespace troupe::test {
namespace {

using namespace troupe::messages;

void fill_region(msg::RemoteRegion::Builder r, uint64_t id) {
  r.setOwner("prefill-0");
  r.setRegionId(id);
  r.setAddress(0x7f0000000000ull + id * 0x100000);
  r.setLength(1 << 20);
  auto key = r.initPackedKey(24);
  for (size_t i = 0; i < key.size(); ++i) key[i] = static_cast<uint8_t>(i * 7 + id);
}

void fill_descriptor(msg::KvDescriptor::Builder d, msg::StateKind kind, uint32_t layer) {
  d.setKind(kind);
  d.setLayer(layer);
  d.setCompressRate(kind == msg::StateKind::COMPRESSED_ENTRIES ? 4 : 0);
  auto pages = d.initPages(3);
  for (uint32_t i = 0; i < 3; ++i) pages.set(i, 10 + i * 3 + layer);
  auto shape = d.initPageShape(2);
  shape.set(0, 64);
  shape.set(1, 512);
  d.setDtype(msg::Dtype::BF16);
  d.setPageBytes(64 * 512 * 2);
  d.setPageStride(64 * 512 * 2);
  d.setRegionOffset(4096);
  d.setFirstIndex(128);
  d.setCount(150);
  d.setRingSlots(kind == msg::StateKind::CSA_INFLIGHT ? 8 : kind == msg::StateKind::HCA_INFLIGHT ? 128 : 0);
  d.setLocation(layer % 2 ? msg::Location::DEVICE : msg::Location::HOST);
  d.setDevice(layer % 2 ? 0 : -1);
  fill_region(d.initRegion(), layer);
}

template <class T, class Fill>
Frame build(Fill fill) {
  FrameBuilder<T> b;
  fill(b.root());
  return b.finish(1000 + static_cast<uint64_t>(KindOf<T>::value));
}

}  // namespace

std::vector<Frame> sample_frames() {
  std::vector<Frame> out;
  out.push_back(build<msg::Error>([](auto r) {
    r.setCode(msg::ErrorCode::NOT_FOUND);
    r.setMessage("request 7 is not known on this connection");
    r.setFrameKind(msg::Kind::ABORT);
  }));
  out.push_back(build<msg::GenerateRequest>([](auto r) {
    r.setModel("tiny");
    auto chat = r.getPrompt().initChat(2);
    chat[0].setRole("system");
    chat[0].setContent("You are terse.");
    chat[1].setRole("user");
    chat[1].setContent("Say hi.");
    chat[1].setName("ada");
    auto s = r.initSampling();
    s.setTemperature(0.7f);
    s.setTopP(0.9f);
    s.setTopK(40);
    s.getSeed().setValue(1234);
    r.setMaxTokens(64);
    r.setMinTokens(2);
    auto stops = r.initStopStrings(2);
    stops.set(0, "\n\n");
    stops.set(1, "END");
    auto ids = r.initStopTokenIds(1);
    ids.set(0, 1);
    r.setIgnoreEos(true);
    r.setReturnTokenIds(true);
    r.setPriority(-3);
    r.setDeadlineUnixNanos(1'900'000'000'000'000'000ull);
    r.setUser("tests");
  }));
  out.push_back(build<msg::TokenChunk>([](auto r) {
    r.setIndex(5);
    auto ids = r.initTokenIds(3);
    for (uint32_t i = 0; i < 3; ++i) ids.set(i, 100 + i);
    r.setText("hello");
  }));
  out.push_back(build<msg::Finish>([](auto r) {
    r.setReason(msg::FinishReason::LENGTH);
    r.setPromptTokens(12);
    r.setCompletionTokens(64);
    r.setCachedTokens(8);
    r.setMatchedStop("");
    r.setParks(1);
  }));
  out.push_back(build<msg::Abort>([](auto r) { r.setReason("client went away"); }));
  out.push_back(build<msg::Park>([](auto r) { r.setReason("long_tail"); }));
  out.push_back(build<msg::Resume>([](auto r) { r.setPreferredWorker("decode-1"); }));
  out.push_back(build<msg::Ack>([](auto r) {
    r.setOfKind(msg::Kind::PARK);
    r.setDetail("parked 40 pages");
  }));
  out.push_back(build<msg::ListModels>([](auto) {}));
  out.push_back(build<msg::ModelList>([](auto r) {
    auto m = r.initModels(2);
    m[0].setId("tiny");
    m[0].setOwnedBy("troupe");
    m[0].setCreated(1'764'000'000);
    m[0].setMaxContext(4096);
    m[0].setVocabSize(129280);
    m[1].setId("flash-shaped");
    m[1].setOwnedBy("troupe");
    m[1].setMaxContext(1 << 20);
  }));
  out.push_back(build<msg::KvOffer>([](auto r) {
    r.setLeaseId(77);
    r.setModel("tiny");
    r.setTokenCount(150);
    r.setNextTokenId(4242);
    r.setHasNextToken(true);
    auto ds = r.initDescriptors(5);
    fill_descriptor(ds[0], msg::StateKind::SWA_WINDOW, 0);
    fill_descriptor(ds[1], msg::StateKind::COMPRESSED_ENTRIES, 1);
    fill_descriptor(ds[2], msg::StateKind::INDEXER_KEYS, 1);
    fill_descriptor(ds[3], msg::StateKind::CSA_INFLIGHT, 1);
    fill_descriptor(ds[4], msg::StateKind::HCA_INFLIGHT, 2);
    r.setExpiresUnixNanos(1'900'000'000'000'000'000ull);
    r.setTotalBytes(5 * 3 * 64 * 512 * 2);
  }));
  out.push_back(build<msg::KvPull>([](auto r) {
    r.setLeaseId(77);
    r.setMode(msg::PullMode::PUT);
    auto idx = r.initDescriptorIndices(2);
    idx.set(0, 0);
    idx.set(1, 3);
    auto ds = r.initDestinations(2);
    fill_descriptor(ds[0], msg::StateKind::SWA_WINDOW, 0);
    fill_descriptor(ds[1], msg::StateKind::CSA_INFLIGHT, 1);
  }));
  out.push_back(build<msg::KvConfirm>([](auto r) {
    r.setLeaseId(77);
    r.setBytes(196608);
    r.setChecksum(0xcbf29ce484222325ull);
  }));
  out.push_back(build<msg::KvRelease>([](auto r) {
    r.setLeaseId(77);
    r.setReason(msg::ReleaseReason::CONFIRMED);
    r.setMessage("ok");
  }));
  out.push_back(build<msg::KvEvents>([](auto r) {
    r.setWorker("decode-0");
    r.setSeq(900);
    auto ev = r.initEvents(2);
    ev[0].setType(msg::KvEventType::STORED);
    auto h = ev[0].initBlockHashes(3);
    for (uint32_t i = 0; i < 3; ++i) h.set(i, 0x1000 + i);
    ev[0].setParentHash(0);
    ev[0].setTokensPerBlock(64);
    ev[0].setTier(msg::Location::DEVICE);
    ev[1].setType(msg::KvEventType::EVICTED);
    ev[1].initBlockHashes(1).set(0, 0x1002);
    ev[1].setParentHash(0x1001);
    ev[1].setTokensPerBlock(64);
    ev[1].setTier(msg::Location::HOST);
  }));
  out.push_back(build<msg::Heartbeat>([](auto r) {
    r.setSender("node-a");
    r.setSeq(31);
    r.setSentUnixNanos(1'764'000'000'000'000'000ull);
    r.setIncarnation(0xdeadbeef);
    auto l = r.initLoad();
    l.setQueued(3);
    l.setRunning(64);
    l.setParked(1);
    l.setKvPagesUsed(1000);
    l.setKvPagesFree(24);
    l.setHandoffsOutstanding(2);
  }));
  out.push_back(build<msg::Spawn>([](auto r) {
    r.setRole(msg::Role::DECODE);
    r.setName("decode-3");
    r.setNode("node-b");
    r.setModel("/models/tiny");
    r.setConfig(R"({"max_batch":64})");
  }));
  out.push_back(build<msg::Stop>([](auto r) {
    r.setName("decode-3");
    r.setReason("scale down");
    r.setGraceful(false);
  }));
  out.push_back(build<msg::Drain>([](auto r) {
    r.setName("decode-3");
    r.setDeadlineUnixNanos(1'764'000'010'000'000'000ull);
    r.setMigrate(true);
  }));
  out.push_back(build<msg::Scale>([](auto r) {
    r.setRole(msg::Role::PREFILL);
    r.setDelta(-1);
    r.setTarget(0);
    r.setReason("queue_depth");
  }));
  out.push_back(build<msg::MetricsSnapshot>([](auto r) {
    r.setSource("decode-0");
    r.setTimeUnixNanos(1'764'000'000'000'000'000ull);
    auto c = r.initCounters(1);
    c[0].setName("troupe_long_tail_parked_total");
    auto lb = c[0].initLabels(1);
    lb[0].setKey("worker");
    lb[0].setValue("decode-0");
    c[0].setValue(3);
    auto g = r.initGauges(1);
    g[0].setName("troupe_queue_depth");
    g[0].setValue(12);
    auto hs = r.initHistograms(1);
    hs[0].setName("troupe_ttft_seconds");
    auto b = hs[0].initUpperBounds(2);
    b.set(0, 0.1);
    b.set(1, 1.0);
    auto n = hs[0].initCounts(3);
    n.set(0, 5);
    n.set(1, 2);
    n.set(2, 1);
    hs[0].setSum(2.5);
    hs[0].setCount(8);
  }));
  out.push_back(build<msg::StageActivation>([](auto r) {
    r.setStage(1);
    r.setMicroBatch(17);
    auto ids = r.initRequestIds(2);
    ids.set(0, 5);
    ids.set(1, 6);
    auto pos = r.initPositions(2);
    pos.set(0, 100);
    pos.set(1, 7);
    auto shape = r.initShape(3);
    shape.set(0, 2);
    shape.set(1, 4);
    shape.set(2, 64);
    r.setDtype(msg::Dtype::BF16);
    auto remote = r.getPayload().initRemote();
    fill_region(remote.initRegion(), 9);
    remote.setOffset(8192);
    remote.setLength(2 * 4 * 64 * 2);
  }));
  return out;
}

std::string canonical_body(const Frame& frame) {
  capnp::FlatArrayMessageReader reader(frame.body_words());
  auto canon = reader.getRoot<capnp::AnyStruct>().canonicalize();
  auto bytes = canon.asBytes();
  return std::string(reinterpret_cast<const char*>(bytes.begin()), bytes.size());
}

}  // namespace troupe::test
