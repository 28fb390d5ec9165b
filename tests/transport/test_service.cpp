#include "tests/transport/test_service.hpp"

#include <capnp/any.h>
#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include "messages/kinds.hpp"
#include "tests/transport/pattern.hpp"

namespace troupe::test {

using namespace troupe::messages;
using transport::ConnectionPtr;
using transport::Frame;

uint64_t fnv1a(const std::byte* p, size_t n, uint64_t h) {
  for (size_t i = 0; i < n; ++i) {
    h ^= static_cast<uint8_t>(p[i]);
    h *= 0x100000001b3ull;
  }
  return h;
}

namespace {

Frame echo(const Frame& f) {
  capnp::FlatArrayMessageReader r(f.body_words(), reader_options(f.body_words().size(), {}));
  capnp::MallocMessageBuilder mb;
  mb.getRoot<capnp::AnyPointer>().set(r.getRoot<capnp::AnyPointer>());
  return make_frame(f.kind(), f.request_id(), mb);
}

void send_error(const ConnectionPtr& c, const Frame& about, ErrorCode code, const std::string& message) {
  spdlog::info("test service: {} request {}: {}", c->peer(), about.request_id(), message);
  (void)c->send(make_error_frame(about.request_id(), code, message, about.kind()));
}

Frame ack(uint64_t request_id, msg::Kind of, const std::string& detail) {
  FrameBuilder<msg::Ack> b;
  b.root().setOfKind(of);
  b.root().setDetail(detail);
  return b.finish(request_id);
}

Frame finish_frame(uint64_t request_id, msg::FinishReason reason, uint32_t prompt, uint32_t completion, uint32_t parks) {
  FrameBuilder<msg::Finish> b;
  b.root().setReason(reason);
  b.root().setPromptTokens(prompt);
  b.root().setCompletionTokens(completion);
  b.root().setParks(parks);
  return b.finish(request_id);
}

// Page moves of one descriptor: page p at regionOffset + pages[p] * pageStride.
std::vector<transport::RmaOp> page_ops(msg::KvDescriptor::Reader d, std::byte* local) {
  std::vector<transport::RmaOp> ops;
  auto pages = d.getPages();
  for (uint32_t p = 0; p < pages.size(); ++p) {
    ops.push_back({local + p * d.getPageBytes(), d.getRegionOffset() + uint64_t{pages[p]} * d.getPageStride(),
                   static_cast<size_t>(d.getPageBytes())});
  }
  return ops;
}

constexpr uint64_t kMaxHandoffBytes = 512ull << 20;

uint64_t descriptor_bytes(msg::KvDescriptor::Reader d) { return uint64_t{d.getPages().size()} * d.getPageBytes(); }

// A handoff in flight: the local buffers, the moves still pending, the first
// error and the bytes moved.
struct Handoff {
  std::vector<std::vector<std::byte>> buffers;
  size_t pending = 0;
  Status status = Ok{};
  uint64_t bytes = 0;
};

using Moves = std::vector<std::pair<transport::RegionKey, std::vector<transport::RmaOp>>>;

// Runs `moves` (h->buffers[i] with moves[i]; get: from the peer, put: to it), then
// answers request `rid` with a KvConfirm of lease `lease` (bytes moved, FNV-1a of the
// buffers in order) or an Error frame for `kind`.
void move_and_confirm(const ConnectionPtr& conn, transport::Transport* t, const std::shared_ptr<Handoff>& h,
                      Moves moves, bool get, uint64_t lease, uint64_t rid, msg::Kind kind) {
  h->pending = moves.size();
  auto finish = [conn, h, lease, rid, kind] {
    if (!h->status) {
      return (void)conn->send(make_error_frame(rid, h->status.error().code(), h->status.error().what(), kind));
    }
    FrameBuilder<msg::KvConfirm> b;
    uint64_t sum = 0xcbf29ce484222325ull;
    for (auto& buf : h->buffers) sum = fnv1a(buf.data(), buf.size(), sum);
    b.root().setLeaseId(lease);
    b.root().setBytes(h->bytes);
    b.root().setChecksum(sum);
    (void)conn->send(b.finish(rid));
  };
  if (moves.empty()) return finish();
  for (size_t i = 0; i < moves.size(); ++i) {
    size_t n = h->buffers[i].size();
    auto done = [h, n, finish](transport::Status s) {
      if (!s && h->status) h->status = s;
      h->bytes += n;
      if (--h->pending == 0) finish();
    };
    if (get) {
      t->get(moves[i].first.owner, moves[i].first, std::move(moves[i].second), std::move(done));
    } else {
      t->put(moves[i].first.owner, moves[i].first, std::move(moves[i].second), std::move(done));
    }
  }
}

}  // namespace

TestService::TestService(std::chrono::milliseconds token_interval) : interval_(token_interval) {
  pump_ = std::thread([this] { pump(); });
}

TestService::~TestService() {
  {
    std::lock_guard lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  pump_.join();
}

void TestService::on_open(const ConnectionPtr& conn) {
  std::lock_guard lock(mu_);
  conns_[conn->id()].conn = conn;
}

void TestService::on_close(const ConnectionPtr& conn, const Error& why) {
  std::lock_guard lock(mu_);
  auto it = conns_.find(conn->id());
  if (it == conns_.end()) return;
  size_t n = it->second.streams.size();
  aborted_on_close_ += n;
  if (auto* t = conn->transport()) {
    for (auto& [lease, key] : it->second.leases) t->forget_remote(key.owner, key.region_id);
  }
  spdlog::info("test service: {} closed ({}); aborted {} request(s), released {} lease(s)", conn->peer(), why.what(), n,
               it->second.leases.size());
  conns_.erase(it);
}

void TestService::on_frame(const ConnectionPtr& conn, Frame f) {
  if (f.request_id() & kEchoBit) {
    (void)conn->send(echo(f));
    return;
  }
  switch (f.kind()) {
    case msg::Kind::LIST_MODELS: {
      FrameBuilder<msg::ModelList> b;
      auto m = b.root().initModels(1);
      m[0].setId(kTestModel);
      m[0].setOwnedBy("troupe");
      m[0].setMaxContext(4096);
      m[0].setVocabSize(kTestVocab);
      (void)conn->send(b.finish(f.request_id()));
      return;
    }
    case msg::Kind::GENERATE_REQUEST:
    case msg::Kind::ABORT:
    case msg::Kind::PARK:
    case msg::Kind::RESUME:
    case msg::Kind::KV_RELEASE: {
      std::lock_guard lock(mu_);
      auto& pc = conns_[conn->id()];
      pc.conn = conn;
      if (f.kind() == msg::Kind::GENERATE_REQUEST) {
        generate(pc, f);
      } else if (f.kind() == msg::Kind::KV_RELEASE) {
        release(pc, f);
      } else {
        control(pc, f);
      }
      cv_.notify_all();
      return;
    }
    case msg::Kind::KV_OFFER: return take_offer(conn, f);
    case msg::Kind::KV_PULL: return serve_pull(conn, f);
    default: (void)conn->send(echo(f));
  }
}

void TestService::generate(PerConn& pc, const Frame& f) {
  auto v = open<msg::GenerateRequest>(f);
  if (!v) return send_error(pc.conn, f, ErrorCode::invalid_argument, v.fault().error.what());
  auto r = v->root();
  if (f.request_id() == 0) return send_error(pc.conn, f, ErrorCode::invalid_argument, "request id 0 is reserved");
  if (pc.streams.count(f.request_id())) {
    return send_error(pc.conn, f, ErrorCode::invalid_argument, fmt::format("request {} is already running", f.request_id()));
  }
  std::string model = r.getModel().cStr();
  if (!model.empty() && model != kTestModel) {
    return send_error(pc.conn, f, ErrorCode::not_found, fmt::format("model '{}' is not served here", model));
  }
  Stream s;
  auto prompt = r.getPrompt();
  if (prompt.isTokenIds()) {
    for (auto id : prompt.getTokenIds()) s.base += id;
    s.prompt_tokens = prompt.getTokenIds().size();
  } else if (prompt.isText()) {
    for (char ch : std::string_view(prompt.getText().cStr())) s.base += static_cast<uint8_t>(ch);
    s.prompt_tokens = prompt.getText().size();
  } else {
    for (auto m : prompt.getChat()) {
      for (char ch : std::string_view(m.getContent().cStr())) s.base += static_cast<uint8_t>(ch);
      s.prompt_tokens += m.getContent().size();
    }
  }
  if (s.prompt_tokens == 0) return send_error(pc.conn, f, ErrorCode::invalid_argument, "the prompt is empty");
  if (r.getMaxTokens() == 0 || r.getMaxTokens() > 100000) {
    return send_error(pc.conn, f, ErrorCode::invalid_argument,
                      fmt::format("max_tokens must be in [1, 100000], got {}", r.getMaxTokens()));
  }
  s.seed = r.getSampling().getSeed().isValue() ? r.getSampling().getSeed().getValue() : 0;
  s.max_tokens = r.getMaxTokens();
  s.min_tokens = r.getMinTokens();
  for (auto id : r.getStopTokenIds()) s.stop_ids.push_back(id);
  s.return_ids = r.getReturnTokenIds();
  pc.streams[f.request_id()] = s;
}

void TestService::control(PerConn& pc, const Frame& f) {
  auto it = pc.streams.find(f.request_id());
  if (it == pc.streams.end()) {
    return send_error(pc.conn, f, ErrorCode::not_found,
                      fmt::format("{}: request {} is not running on this connection", kind_name(f.kind()), f.request_id()));
  }
  Stream& s = it->second;
  switch (f.kind()) {
    case msg::Kind::ABORT:
      (void)pc.conn->send(finish_frame(f.request_id(), msg::FinishReason::ABORTED, s.prompt_tokens, s.next, s.parks));
      pc.streams.erase(it);
      return;
    case msg::Kind::PARK:
      if (s.parked) return send_error(pc.conn, f, ErrorCode::invalid_argument, "request is already parked");
      s.parked = true;
      ++s.parks;
      (void)pc.conn->send(ack(f.request_id(), msg::Kind::PARK, fmt::format("parked after {} tokens", s.next)));
      return;
    case msg::Kind::RESUME:
      if (!s.parked) return send_error(pc.conn, f, ErrorCode::invalid_argument, "request is not parked");
      s.parked = false;
      (void)pc.conn->send(ack(f.request_id(), msg::Kind::RESUME, "resumed"));
      return;
    default: return;
  }
}

void TestService::release(PerConn& pc, const Frame& f) {
  auto v = open<msg::KvRelease>(f);
  if (!v) return send_error(pc.conn, f, ErrorCode::invalid_argument, v.fault().error.what());
  auto it = pc.leases.find(v->root().getLeaseId());
  if (it == pc.leases.end()) {
    return send_error(pc.conn, f, ErrorCode::not_found, fmt::format("lease {} is not known", v->root().getLeaseId()));
  }
  if (auto* t = pc.conn->transport()) t->forget_remote(it->second.owner, it->second.region_id);
  pc.leases.erase(it);
  (void)pc.conn->send(ack(f.request_id(), msg::Kind::KV_RELEASE, "released"));
}

void TestService::take_offer(const ConnectionPtr& conn, const Frame& f) {
  auto* t = conn->transport();
  if (!t) return send_error(conn, f, ErrorCode::unsupported, "a KV handoff needs a transport connection, not TCP");
  auto v = open<msg::KvOffer>(f);
  if (!v) return send_error(conn, f, ErrorCode::invalid_argument, v.fault().error.what());
  auto offer = v->root();
  uint64_t total = 0;
  for (auto d : offer.getDescriptors()) total += descriptor_bytes(d);
  if (total > kMaxHandoffBytes) return send_error(conn, f, ErrorCode::resource_exhausted, "offer too large");
  auto h = std::make_shared<Handoff>();
  uint64_t lease = offer.getLeaseId();
  Moves moves;
  for (auto d : offer.getDescriptors()) {
    h->buffers.emplace_back(descriptor_bytes(d));
    moves.emplace_back(transport::from_wire(d.getRegion()), page_ops(d, h->buffers.back().data()));
  }
  {
    std::lock_guard lock(mu_);
    auto& pc = conns_[conn->id()];
    pc.conn = conn;
    if (!moves.empty()) pc.leases[lease] = moves.front().first;
  }
  move_and_confirm(conn, t, h, std::move(moves), true, lease, f.request_id(), msg::Kind::KV_OFFER);
}

void TestService::serve_pull(const ConnectionPtr& conn, const Frame& f) {
  auto* t = conn->transport();
  if (!t) return send_error(conn, f, ErrorCode::unsupported, "a KV handoff needs a transport connection, not TCP");
  auto v = open<msg::KvPull>(f);
  if (!v) return send_error(conn, f, ErrorCode::invalid_argument, v.fault().error.what());
  auto pull = v->root();
  if (pull.getMode() != msg::PullMode::PUT) {
    return send_error(conn, f, ErrorCode::unsupported, "this test service only serves put-mode pulls");
  }
  uint64_t total = 0;
  for (auto d : pull.getDestinations()) total += descriptor_bytes(d);
  if (total > kMaxHandoffBytes) return send_error(conn, f, ErrorCode::resource_exhausted, "pull too large");
  auto h = std::make_shared<Handoff>();
  uint64_t lease = pull.getLeaseId(), rid = f.request_id();
  Moves moves;
  uint64_t k = 0;
  for (auto d : pull.getDestinations()) {
    h->buffers.emplace_back(descriptor_bytes(d));
    fill_pattern(h->buffers.back().data(), h->buffers.back().size(), lease + k++);
    moves.emplace_back(transport::from_wire(d.getRegion()), page_ops(d, h->buffers.back().data()));
  }
  move_and_confirm(conn, t, h, std::move(moves), false, lease, rid, msg::Kind::KV_PULL);
}

// Emits one token per running request every interval.
void TestService::pump() {
  std::unique_lock lock(mu_);
  while (!stop_) {
    bool any = false;
    for (auto& [cid, pc] : conns_) {
      for (auto it = pc.streams.begin(); it != pc.streams.end();) {
        Stream& s = it->second;
        if (s.parked) {
          ++it;
          continue;
        }
        any = true;
        uint32_t tok = test_token(s.base, s.seed, s.next);
        FrameBuilder<msg::TokenChunk> b;
        b.root().setIndex(s.next);
        if (s.return_ids) b.root().initTokenIds(1).set(0, tok);
        b.root().setText(fmt::format("t{} ", tok));
        (void)pc.conn->send(b.finish(it->first));
        ++s.next;
        bool stop_hit = s.next >= s.min_tokens && std::find(s.stop_ids.begin(), s.stop_ids.end(), tok) != s.stop_ids.end();
        if (stop_hit || s.next >= s.max_tokens) {
          (void)pc.conn->send(finish_frame(it->first, stop_hit ? msg::FinishReason::STOP : msg::FinishReason::LENGTH,
                                           s.prompt_tokens, s.next, s.parks));
          it = pc.streams.erase(it);
        } else {
          ++it;
        }
      }
    }
    if (any) {
      cv_.wait_for(lock, interval_);
    } else {
      cv_.wait(lock);
    }
  }
}

size_t TestService::active_streams() const {
  std::lock_guard lock(mu_);
  size_t n = 0;
  for (auto& [id, pc] : conns_) n += pc.streams.size();
  return n;
}

uint64_t TestService::aborted_on_close() const {
  std::lock_guard lock(mu_);
  return aborted_on_close_;
}

}  // namespace troupe::test
