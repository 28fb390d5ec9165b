// UcxTransport: context, worker, listener, the progress loop, connections,
// frames. RMA lives in ucx_rma.cpp.
#include <arpa/inet.h>
#include <fmt/format.h>
#include <netinet/in.h>
#include <poll.h>
#include <kj/exception.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <initializer_list>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "transport/ucx_impl.hpp"

namespace troupe::transport {
namespace {

Error ucs_error(ErrorCode code, const std::string& what, ucs_status_t st) {
  return Error(code, fmt::format("{}: {}", what, ucs_status_string(st)));
}

uint64_t load_u64(const std::byte* p) {
  uint64_t v;
  std::memcpy(&v, p, 8);
  return v;
}

size_t round_up_64(size_t n) { return (n + 63) & ~size_t{63}; }

// Appends u64 fields (host order, as every peer is a troupe process on the same
// kind of machine) to an active message's raw header.
void append_u64(std::vector<std::byte>& out, std::initializer_list<uint64_t> words) {
  for (uint64_t w : words) {
    const auto* b = reinterpret_cast<const std::byte*>(&w);
    out.insert(out.end(), b, b + 8);
  }
}

bool valid_name(const std::string& s) {
  if (s.empty() || s.size() > kMaxNameBytes) return false;
  for (unsigned char c : s) {
    if (c < 0x21 || c > 0x7e) return false;
  }
  return true;
}

void finish_send(SendOp* op) {
  if (op->impl) op->impl->send_queue_bytes -= op->queued_bytes;
  delete op;
}

void send_cb(void* request, ucs_status_t, void* user) {
  auto* op = static_cast<SendOp*>(user);
  op->impl->requests.erase(request);
  finish_send(op);
  ucp_request_free(request);
}

void ep_err_cb(void* arg, ucp_ep_h ep, ucs_status_t st) {
  static_cast<UcxTransport::Impl*>(arg)->failed.emplace_back(ep, st);
}

void conn_request_cb(ucp_conn_request_h request, void* arg) {
  static_cast<UcxTransport::Impl*>(arg)->accepted.push_back(request);
}

struct CloseCtx {
  UcxTransport::Impl* impl;
  uint64_t conn;
  ucp_ep_h ep;
};

void close_cb(void* request, ucs_status_t, void* user) {
  auto* ctx = static_cast<CloseCtx*>(user);
  ctx->impl->closed.push_back(ctx->conn);
  ctx->impl->closed_eps.insert(ctx->ep);
  delete ctx;
  ucp_request_free(request);
}

void rndv_done(RndvRecv* r, ucs_status_t st) {
  auto* impl = r->impl;
  Conn* c = impl->conn_by_id(r->conn_id);
  if (c) {
    if (--c->receiving == 0 && c->close_deferred) impl->close_ready.push_back(c->id);
    Arrival& a = c->arrivals[r->seq];
    a.ready = true;
    if (st == UCS_OK) {
      auto body = std::make_shared<messages::FrameBody>();
      body->words = std::move(r->words);
      a.frame = Frame(r->header, std::move(body));
    } else {
      a.fault = FrameFault{ucs_error(ErrorCode::unavailable, "rendezvous receive failed", st), r->header.request_id,
                           r->header.kind, true};
    }
    impl->dirty.insert(c->id);
  }
  delete r;
}

void rndv_cb(void* request, ucs_status_t st, size_t, void* user) {
  auto* r = static_cast<RndvRecv*>(user);
  r->impl->requests.erase(request);
  rndv_done(r, st);
  ucp_request_free(request);
}

ucs_status_t am_handshake_cb(void* arg, const void* header, size_t, void* data, size_t length,
                             const ucp_am_recv_param_t* param, bool is_ack) {
  auto* impl = static_cast<UcxTransport::Impl*>(arg);
  if (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) {
    ucp_am_data_release(impl->worker, data);
    return UCS_OK;
  }
  Conn* c = (param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP) ? impl->conn_by_ep(param->reply_ep) : nullptr;
  if (!c) {
    spdlog::warn("ucx {}: handshake from an unknown endpoint, ignored", impl->opt.name);
    return UCS_OK;
  }
  // name [0 token address] (see kAmHello)
  auto* bytes = static_cast<const char*>(data);
  size_t name_len = 0;
  while (name_len < length && name_len <= kMaxNameBytes && bytes[name_len] != 0) ++name_len;
  std::string name(bytes, name_len);
  uint64_t token = 0;
  std::vector<std::byte> address;
  if (name_len < length && bytes[name_len] == 0 && length >= name_len + 1 + 8) {
    token = load_u64(reinterpret_cast<const std::byte*>(bytes + name_len + 1));
    auto* a = reinterpret_cast<const std::byte*>(bytes + name_len + 9);
    address.assign(a, a + (length - name_len - 9));
  }
  uint64_t id = c->id;
  impl->user_calls.push_back([impl, id, name, is_ack, token, address = std::move(address)]() mutable {
    if (Conn* c = impl->conn_by_id(id)) impl->on_hello(*c, name, is_ack, token, std::move(address));
  });
  return UCS_OK;
}

ucs_status_t am_hello_cb(void* arg, const void* h, size_t hl, void* d, size_t l, const ucp_am_recv_param_t* p) {
  return am_handshake_cb(arg, h, hl, d, l, p, false);
}
ucs_status_t am_ack_cb(void* arg, const void* h, size_t hl, void* d, size_t l, const ucp_am_recv_param_t* p) {
  return am_handshake_cb(arg, h, hl, d, l, p, true);
}

// Frames by put: the size check both sides make (the sender's use, the
// receiver's offer).
bool put_size_ok(const UcxOptions& o, size_t body) {
  return o.put_frames_arena_bytes > 0 && body >= std::max<size_t>(o.put_frames_from_bytes, 1);
}

// The checks every frame message gets (kAmFrame and, with extra = 24 header
// bytes, kAmFramePut's first notice of a frame): the connection it names, a sequence number not seen
// before, a valid frame header. `c` null: dropped (no connection). Else `a` is
// the arrival slot, already ready with a fault when a check failed.
struct FrameIn {
  Conn* c = nullptr;
  Arrival* a = nullptr;
  uint64_t seq = 0;
  messages::FrameHeader h{};
};

FrameIn open_frame(UcxTransport::Impl* impl, const std::byte* hb, size_t header_length, const ucp_am_recv_param_t* param,
                   size_t extra) {
  FrameIn in;
  // A direct endpoint's frame names our connection by its token; one over the
  // connection-manager endpoint comes with a reply endpoint.
  bool direct = !(param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP);
  const size_t expected = (direct ? kAmDirectHeaderBytes : kAmFrameHeaderBytes) + extra;
  Conn* c = nullptr;
  if (!direct) {
    c = impl->conn_by_ep(param->reply_ep);
  } else if (header_length == expected) {
    // The peer may send here before this side has seen its handshake reply:
    // arrivals wait in the connection until it is up.
    c = impl->conn_by_id(load_u64(hb + kAmFrameHeaderBytes));
  }
  if (!c || c->state == Conn::State::closing) {
    if (direct) spdlog::warn("ucx {}: a frame for no known connection, dropped", impl->opt.name);
    return in;
  }
  in.c = c;
  impl->dirty.insert(c->id);
  auto fault_without_slot = [&](std::string what) {
    // Without a sequence number there is no slot for it: a lost stream.
    in.a = &c->arrivals[UINT64_MAX];
    in.a->ready = true;
    in.a->fault = FrameFault{Error(ErrorCode::invalid_argument, std::move(what)), 0, msg::Kind::NONE, false};
    return in;
  };
  if (header_length != expected) {
    return fault_without_slot(
        fmt::format("frame message with a {}-byte header (expected {})", header_length, expected));
  }
  in.seq = load_u64(hb + messages::kHeaderBytes);
  if (in.seq < c->recv_next || c->arrivals.count(in.seq)) {
    return fault_without_slot(fmt::format("frame sequence number {} repeats or goes back", in.seq));
  }
  in.a = &c->arrivals[in.seq];
  auto h = messages::decode_header(std::span(hb, messages::kHeaderBytes), impl->opt.limits);
  if (!h) {
    in.a->ready = true;
    in.a->fault = h.fault();
    return in;
  }
  in.h = *h;
  return in;
}

ucs_status_t am_frame_cb(void* arg, const void* header, size_t header_length, void* data, size_t length,
                         const ucp_am_recv_param_t* param) {
  auto* impl = static_cast<UcxTransport::Impl*>(arg);
  bool rndv = param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV;
  auto drop = [&]() {
    if (rndv) ucp_am_data_release(impl->worker, data);
    return UCS_OK;
  };
  FrameIn in = open_frame(impl, static_cast<const std::byte*>(header), header_length, param, 0);
  if (!in.c || in.a->ready) return drop();
  Conn* c = in.c;
  Arrival& a = *in.a;
  if (in.h.body_bytes != length) {
    a.ready = true;
    a.fault = FrameFault{Error(ErrorCode::invalid_argument,
                               fmt::format("frame header says {} body bytes, the message carries {}", in.h.body_bytes,
                                           length)),
                         in.h.request_id, in.h.kind, true};
    return drop();
  }
  // A large frame from a peer on this host (eager or rendezvous, as UCX's
  // thresholds put it): offer the peer an arena, so that the next ones come by
  // put (UcxOptions::put_frames_arena_bytes).
  if (!c->in_arena_tried && c->shm && c->data_ep && put_size_ok(impl->opt, length)) {
    c->in_arena_tried = true;
    impl->user_calls.push_back([impl, id = c->id] {
      if (Conn* c = impl->conn_by_id(id); c && c->state == Conn::State::up) impl->offer_arena(*c);
    });
  }
  if (rndv) {
    // Start the data fetch here, inside the callback (UCX allows it), so the
    // next frame's transfer overlaps the delivery of this one.
    auto* r = new RndvRecv{impl, c->id, in.seq, in.h, data, messages::alloc_body_words(length)};
    ++c->receiving;  // until rndv_done
    ucp_request_param_t p{};
    p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
    p.cb.recv_am = rndv_cb;
    p.user_data = r;
    auto* req = ucp_am_recv_data_nbx(impl->worker, data, r->words.begin(), length, &p);
    if (req == nullptr) {
      rndv_done(r, UCS_OK);
    } else if (UCS_PTR_IS_ERR(req)) {
      rndv_done(r, UCS_PTR_STATUS(req));
    } else {
      impl->requests.insert(req);
    }
    return UCS_INPROGRESS;
  }
  // Eager data is not 8-byte aligned (STACK.md): copy into aligned storage.
  a.ready = true;
  a.frame = messages::copy_frame(in.h, std::span(static_cast<const std::byte*>(data), length));
  return UCS_OK;
}

// A chunk notice: part of a frame's body is in our arena (kAmFramePut). The
// frame's slot is taken with its first notice; the copy out runs after the
// callback (on_frame_put).
ucs_status_t am_frame_put_cb(void* arg, const void* header, size_t header_length, void* data, size_t length,
                             const ucp_am_recv_param_t* param) {
  auto* impl = static_cast<UcxTransport::Impl*>(arg);
  if (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) ucp_am_data_release(impl->worker, data);
  auto* hb = static_cast<const std::byte*>(header);
  const size_t extra = kAmPutHeaderBytes - kAmDirectHeaderBytes;
  Conn* c = nullptr;
  Arrival* a = nullptr;
  uint64_t seq = 0;
  if (!(param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP) && header_length == kAmPutHeaderBytes) {
    seq = load_u64(hb + messages::kHeaderBytes);
    c = impl->conn_by_id(load_u64(hb + kAmFrameHeaderBytes));
    if (c && c->state != Conn::State::closing) {
      if (auto it = c->arrivals.find(seq); it != c->arrivals.end() && it->second.by_put && !it->second.ready) {
        a = &it->second;  // a later chunk of a frame under way
      }
    }
  }
  if (a == nullptr) {  // the frame's first notice (or a bad one: open_frame says why)
    FrameIn in = open_frame(impl, hb, header_length, param, extra);
    if (!in.c || in.a->ready) return UCS_OK;
    c = in.c;
    a = in.a;
    seq = in.seq;
    a->by_put = true;
    a->header = in.h;
  }
  impl->dirty.insert(c->id);
  if (length != 0) {
    a->ready = true;
    a->fault = FrameFault{Error(ErrorCode::invalid_argument, "a frame notice carries data"), a->header.request_id,
                          a->header.kind, true};
    return UCS_OK;
  }
  const uint64_t arena_offset = load_u64(hb + kAmDirectHeaderBytes), body_offset = load_u64(hb + kAmDirectHeaderBytes + 8),
                 bytes = load_u64(hb + kAmDirectHeaderBytes + 16);
  impl->user_calls.push_back([impl, id = c->id, seq, arena_offset, body_offset, bytes] {
    impl->on_frame_put(id, seq, arena_offset, body_offset, bytes);
  });
  return UCS_OK;
}

// An arena offer (kAmArenaOffer) or a release (kAmArenaRelease), over a direct endpoint.
ucs_status_t am_arena_cb(void* arg, const void* header, size_t header_length, void* data, size_t length,
                         const ucp_am_recv_param_t* param, bool is_offer) {
  auto* impl = static_cast<UcxTransport::Impl*>(arg);
  const bool rndv = param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV;
  auto* hb = static_cast<const std::byte*>(header);
  if (rndv || header_length != (is_offer ? 24u : 16u)) {
    if (rndv) ucp_am_data_release(impl->worker, data);
    spdlog::warn("ucx {}: a malformed arena {} ({} header bytes), ignored", impl->opt.name,
                 is_offer ? "offer" : "release", header_length);
    return UCS_OK;
  }
  const uint64_t token = load_u64(hb), a = load_u64(hb + 8);
  if (is_offer) {
    const uint64_t bytes = load_u64(hb + 16);
    auto* d = static_cast<const std::byte*>(data);
    impl->user_calls.push_back([impl, token, a, bytes, key = std::vector<std::byte>(d, d + length)] {
      if (Conn* c = impl->conn_by_id(token)) impl->on_arena_offer(*c, a, bytes, key);
    });
  } else {
    impl->user_calls.push_back([impl, token, a] {
      if (Conn* c = impl->conn_by_id(token)) impl->on_arena_release(*c, a);
    });
  }
  return UCS_OK;
}

ucs_status_t am_arena_offer_cb(void* arg, const void* h, size_t hl, void* d, size_t l, const ucp_am_recv_param_t* p) {
  return am_arena_cb(arg, h, hl, d, l, p, true);
}
ucs_status_t am_arena_release_cb(void* arg, const void* h, size_t hl, void* d, size_t l, const ucp_am_recv_param_t* p) {
  return am_arena_cb(arg, h, hl, d, l, p, false);
}

// A by-put frame's put or flush completed (put_frame).
void put_cb(void* request, ucs_status_t st, void* user) {
  auto* op = static_cast<SendOp*>(user);
  op->impl->requests.erase(request);
  ucp_request_free(request);
  if (st != UCS_OK) op->put_failed = true;
  if (--op->put_outstanding == 0) op->impl->put_done(op);
}

ucs_status_t am_probe_common(void* arg, const void* header, size_t header_length, void* data,
                             const ucp_am_recv_param_t* param, bool is_reply) {
  auto* impl = static_cast<UcxTransport::Impl*>(arg);
  if (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) {
    ucp_am_data_release(impl->worker, data);
    return UCS_OK;
  }
  if (header_length != 16) return UCS_OK;
  auto* hb = static_cast<const std::byte*>(header);
  const uint64_t token = load_u64(hb), nonce = load_u64(hb + 8);
  impl->user_calls.push_back([impl, token, nonce, is_reply] { impl->on_probe(token, nonce, is_reply); });
  return UCS_OK;
}

ucs_status_t am_probe_cb(void* arg, const void* h, size_t hl, void* d, size_t, const ucp_am_recv_param_t* p) {
  return am_probe_common(arg, h, hl, d, p, false);
}
ucs_status_t am_probe_reply_cb(void* arg, const void* h, size_t hl, void* d, size_t, const ucp_am_recv_param_t* p) {
  return am_probe_common(arg, h, hl, d, p, true);
}

// Whether UCX gave the endpoint shared-memory lanes (the peer is on this host),
// from its printed configuration (UCX 1.13 has no query for the transports).
bool has_shared_memory_lanes(ucp_ep_h ep) {
  char* buf = nullptr;
  size_t len = 0;
  FILE* f = open_memstream(&buf, &len);
  if (f == nullptr) return false;
  ucp_ep_print_info(ep, f);
  std::fclose(f);
  std::string info(buf != nullptr ? buf : "", len);
  std::free(buf);
  for (const char* tl : {"posix/", "sysv/", "xpmem/"}) {
    if (info.find(tl) != std::string::npos) return true;
  }
  return false;
}

}  // namespace

// ---------------------------------------------------------------- lifecycle

UcxTransport::UcxTransport(UcxOptions options) : impl_(std::make_unique<Impl>()) { impl_->opt = std::move(options); }

UcxTransport::~UcxTransport() {
  if (impl_->started) {
    {
      std::lock_guard lock(impl_->cmd_mu);
      impl_->stopping = true;
    }
    impl_->signal();
    impl_->thread.join();
  }
  impl_->teardown();
}

const std::string& UcxTransport::name() const { return impl_->opt.name; }
std::string UcxTransport::address() const { return impl_->address; }

Status UcxTransport::start(TransportEvents events) {
  if (impl_->started) return Error(ErrorCode::invalid_argument, "transport already started");
  if (!valid_name(impl_->opt.name)) {
    return Error(ErrorCode::invalid_argument, fmt::format("'{}' is not a valid endpoint name", impl_->opt.name));
  }
  impl_->events = std::move(events);
  if (auto s = impl_->init(); !s) {
    impl_->teardown();
    return s;
  }
  impl_->started = true;
  impl_->thread = std::thread([impl = impl_.get()] { impl->run(); });
  return Ok{};
}

Status UcxTransport::Impl::init() {
  ucp_config_t* config = nullptr;
  if (auto st = ucp_config_read(nullptr, nullptr, &config); st != UCS_OK) {
    return ucs_error(ErrorCode::unavailable, "ucp_config_read", st);
  }
  // Error mode PEER silently drops shared memory unless mm error handling
  // is on (openucx/ucx#8477); keep an explicit environment setting.
  if (!std::getenv("UCX_MM_ERROR_HANDLING")) {
    ucp_config_modify(config, "MM_ERROR_HANDLING", "y");
  }
  // A rebuilt worker (reset_worker) listens again on the same port while the
  // old listener's accepted sockets may linger.
  if (!std::getenv("UCX_TCP_CM_REUSEADDR") && !std::getenv("UCX_CM_REUSEADDR")) {
    ucp_config_modify(config, "CM_REUSEADDR", "y");  // the key the tcp and rdma cm tables inherit
  }
  ucp_params_t p{};
  p.field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_NAME;
  p.features = UCP_FEATURE_AM | UCP_FEATURE_RMA | UCP_FEATURE_WAKEUP;
  p.name = opt.name.c_str();
  auto st = ucp_init(&p, config, &ctx);
  ucp_config_release(config);
  if (st != UCS_OK) return ucs_error(ErrorCode::unavailable, "ucp_init", st);

  if (const char* d = std::getenv("TROUPE_UCX_DIRECT"); d && *d) opt.direct_endpoints = std::string_view(d) != "0";
  if (const char* d = std::getenv("TROUPE_UCX_SPIN_IN_FLIGHT"); d && *d) opt.spin_while_in_flight = std::string_view(d) != "0";
  if (const char* d = std::getenv("TROUPE_UCX_INBOX_PROBE_MS"); d && *d) opt.inbox_probe_ms = std::atoi(d);
  if (const char* d = std::getenv("TROUPE_UCX_FRAME_ARENA_MB"); d && *d) {
    opt.put_frames_arena_bytes = static_cast<size_t>(std::max(0, std::atoi(d))) << 20;
  }
  return init_worker();
}

Status UcxTransport::Impl::init_worker() {
  ucs_status_t st;
  ucp_worker_params_t wp{};
  wp.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
  wp.thread_mode = UCS_THREAD_MODE_SINGLE;
  if ((st = ucp_worker_create(ctx, &wp, &worker)) != UCS_OK) {
    return ucs_error(ErrorCode::unavailable, "ucp_worker_create", st);
  }
  if ((st = ucp_worker_get_efd(worker, &efd)) != UCS_OK) return ucs_error(ErrorCode::unavailable, "ucp_worker_get_efd", st);
  if (opt.direct_endpoints) {
    ucp_address_t* a = nullptr;
    size_t len = 0;
    if ((st = ucp_worker_get_address(worker, &a, &len)) != UCS_OK) {
      return ucs_error(ErrorCode::unavailable, "ucp_worker_get_address", st);
    }
    auto* b = reinterpret_cast<const std::byte*>(a);
    worker_address.assign(b, b + len);
    ucp_worker_release_address(worker, a);
  }

  struct Handler {
    unsigned id;
    ucp_am_recv_callback_t cb;
  };
  for (auto h : {Handler{kAmHello, am_hello_cb}, Handler{kAmHelloAck, am_ack_cb}, Handler{kAmFrame, am_frame_cb},
                 Handler{kAmProbe, am_probe_cb}, Handler{kAmProbeReply, am_probe_reply_cb},
                 Handler{kAmArenaOffer, am_arena_offer_cb}, Handler{kAmFramePut, am_frame_put_cb},
                 Handler{kAmArenaRelease, am_arena_release_cb}}) {
    ucp_am_handler_param_t hp{};
    hp.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_CB | UCP_AM_HANDLER_PARAM_FIELD_ARG;
    hp.id = h.id;
    hp.cb = h.cb;
    hp.arg = this;
    if ((st = ucp_worker_set_am_recv_handler(worker, &hp)) != UCS_OK) {
      return ucs_error(ErrorCode::unavailable, "ucp_worker_set_am_recv_handler", st);
    }
  }

  if (!opt.listen_host.empty()) {
    sockaddr_in sa{};
    sa.sin_family = AF_INET;
    sa.sin_port = htons(opt.listen_port);
    if (inet_pton(AF_INET, opt.listen_host.c_str(), &sa.sin_addr) != 1) {
      return Error(ErrorCode::invalid_argument, fmt::format("{} is not an IPv4 address", opt.listen_host));
    }
    ucp_listener_params_t lp{};
    lp.field_mask = UCP_LISTENER_PARAM_FIELD_SOCK_ADDR | UCP_LISTENER_PARAM_FIELD_CONN_HANDLER;
    lp.sockaddr.addr = reinterpret_cast<const sockaddr*>(&sa);
    lp.sockaddr.addrlen = sizeof(sa);
    lp.conn_handler.cb = conn_request_cb;
    lp.conn_handler.arg = this;
    if ((st = ucp_listener_create(worker, &lp, &listener)) != UCS_OK) {
      return ucs_error(ErrorCode::unavailable, fmt::format("listen on {}:{}", opt.listen_host, opt.listen_port), st);
    }
    ucp_listener_attr_t la{};
    la.field_mask = UCP_LISTENER_ATTR_FIELD_SOCKADDR;
    if ((st = ucp_listener_query(listener, &la)) != UCS_OK) return ucs_error(ErrorCode::internal, "ucp_listener_query", st);
    auto* bound = reinterpret_cast<const sockaddr_in*>(&la.sockaddr);
    opt.listen_port = ntohs(bound->sin_port);  // a rebuilt worker listens at the same address
  }
  // Read by other threads: written once (a rebuilt worker has the same address).
  if (std::string a = opt.listen_host.empty() ? fmt::format("ucx://-/{}", opt.name)
                                              : fmt::format("ucx://{}:{}", opt.listen_host, opt.listen_port);
      a != address) {
    address = std::move(a);
  }
  return Ok{};
}

void UcxTransport::Impl::teardown() {
  for (auto& [id, r] : regions) {
    if (r.memh) ucp_mem_unmap(ctx, r.memh);
  }
  regions.clear();
  destroy_worker();
  if (ctx) ucp_cleanup(ctx);
  ctx = nullptr;
}

// Before this side closes its connections: a peer that sees one close dials
// again at once, and UCX 1.13's TCP connection manager does not survive a
// listener destroyed while such a dial is half open (the async thread hands
// the late connection request to the freed listener: SIGSEGV in
// ucp_cm_server_conn_request_cb, openucx/ucx#8243). Closed first, the port
// refuses those dials instead.
void UcxTransport::Impl::stop_listening() {
  if (!listener) return;
  for (auto request : std::exchange(accepted, {})) ucp_listener_reject(listener, request);
  std::lock_guard lock(worker_mu);
  ucp_listener_destroy(listener);
  listener = nullptr;
}

void UcxTransport::Impl::destroy_worker() {
  if (listener) ucp_listener_destroy(listener);
  listener = nullptr;
  if (worker) ucp_worker_destroy(worker);
  worker = nullptr;
  efd = -1;
  worker_address.clear();
}

bool UcxTransport::Impl::post(std::function<void()> fn) {
  bool was_empty;
  {
    std::lock_guard lock(cmd_mu);
    if (stopping || !started) return false;
    was_empty = cmds.empty();
    cmds.push_back(std::move(fn));
  }
  if (was_empty) signal();
  return true;
}

void UcxTransport::Impl::signal() {
  std::lock_guard lock(worker_mu);
  if (worker) ucp_worker_signal(worker);  // none mid-rebuild: the loop takes the command when it is back
}

// The progress loop: commands, progress until idle, deferred work, then
// sleep in the wakeup fd (ucp_worker_arm + poll) until UCX or a command
// (ucp_worker_signal) wakes it.
void UcxTransport::Impl::run() {
  thread_id = std::this_thread::get_id();
  auto last_work = std::chrono::steady_clock::now();
  const auto spin = std::chrono::microseconds(opt.spin_after_work_us);
  for (;;) {
    std::deque<std::function<void()>> batch;
    bool stop;
    {
      std::lock_guard lock(cmd_mu);
      batch.swap(cmds);
      stop = stopping;
    }
    if (stop) break;
    for (auto& fn : batch) fn();
    if (worker == nullptr) {  // a rebuild failed: try again every second
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
      if (std::chrono::steady_clock::now() >= next_rebuild) {
        next_rebuild = std::chrono::steady_clock::now() + std::chrono::seconds(1);
        std::lock_guard lock(worker_mu);
        if (auto s = init_worker(); !s) {
          destroy_worker();
        } else {
          spdlog::info("ucx {}: the UCX worker is back at {}", opt.name, address);
        }
      }
      continue;
    }
    unsigned progressed = 0;
    while (unsigned n = ucp_worker_progress(worker)) progressed += n;
    bool did = run_deferred() || !batch.empty() || progressed > 0;
    did |= check_inbox();
    auto now = std::chrono::steady_clock::now();
    if (did) {
      last_work = now;
      continue;
    }
    // Right after work, poll a little longer before sleeping: a transfer in
    // flight (rendezvous fragments through a shared-memory FIFO) needs this
    // side to progress again within microseconds. Idle, the thread sleeps.
    if (now - last_work < spin) continue;
    if (opt.spin_while_in_flight && (!requests.empty() || rma_in_flight > 0)) {
      std::this_thread::yield();
      continue;
    }
    ucs_status_t st = ucp_worker_arm(worker);
    if (st == UCS_ERR_BUSY) continue;
    pollfd pfd{efd, POLLIN, 0};
    poll(&pfd, 1, opt.idle_wakeup_ms);
  }
  shutdown_in_thread();
}

// Lets frame sends and rendezvous receives in flight finish (for at most a
// second), then closes every endpoint (flushing what is queued, for at most a
// second more), then stops. Runs on the progress thread. UCX 1.13 aborts in
// ucp_worker_destroy when an endpoint still holds a request (a rendezvous
// receive survives a flush close): what is still in flight after the first
// second is cancelled by closing its endpoints with force.
void UcxTransport::Impl::shutdown_in_thread() {
  opt.inbox_probe_ms = 0;  // no probes (nor a rebuild) while closing
  if (worker == nullptr) return;  // a failed rebuild left nothing to close
  stop_listening();  // nobody new while the transfers in flight end
  auto drain_until = std::chrono::steady_clock::now() + std::chrono::seconds(1);
  while (!requests.empty() && std::chrono::steady_clock::now() < drain_until) {
    ucp_worker_progress(worker);
    close_failed();
  }
  bool force = !requests.empty();
  if (force) spdlog::warn("ucx {}: {} transfers still in flight at shutdown, cancelled", opt.name, requests.size());
  for (auto& [id, c] : conns) c->name.clear();  // no on_peer_down for our own shutdown
  end_all_connections(Error(ErrorCode::unavailable, "transport closing"), force);
}

// Force-closes the connections whose endpoint UCX reported failed (the peer
// is gone); whether there were any.
bool UcxTransport::Impl::close_failed() {
  bool any = false, shm_peer_failed = false;
  for (auto [ep, st] : std::exchange(failed, {})) {
    any = true;
    if (Conn* c = conn_by_ep(ep)) {
      shm_peer_failed |= c->shm && c->state != Conn::State::closing;
      close_conn(*c, ucs_error(ErrorCode::unavailable, fmt::format("peer {} lost", c->name.empty() ? "?" : c->name), st),
                 true);
    }
  }
  if (shm_peer_failed && opt.inbox_probe_ms > 0) {
    // It may have died writing into our shared-memory inbox: ask the others.
    inbox_suspect = true;
    probing.clear();
    probe_deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(opt.inbox_probe_ms);
    for (auto& [id, c] : conns) {
      if (c->state == Conn::State::up && c->shm) probe(*c);
    }
    spdlog::info("ucx {}: a shared-memory peer failed; probing {} other shared-memory peers", opt.name,
                 probing.size());
  }
  return any;
}

void UcxTransport::Impl::probe(Conn& c) {
  if (!c.data_ep) return;
  probing.insert(c.id);
  send_probe(c, kAmProbe, ++probe_nonce);
}

// A probe or its answer over the direct endpoint: the receiver's token, the nonce.
void UcxTransport::Impl::send_probe(Conn& c, unsigned id, uint64_t nonce) {
  auto op = std::make_unique<SendOp>();
  append_u64(op->raw_header, {c.peer_token, nonce});
  send_am(c, id, std::move(op), {}, c.data_ep);
}

void UcxTransport::Impl::on_probe(uint64_t conn_id, uint64_t nonce, bool is_reply) {
  Conn* c = conn_by_id(conn_id);
  if (!c || c->state != Conn::State::up || !c->data_ep) return;
  if (!is_reply) {
    if (opt.answer_probes) send_probe(*c, kAmProbeReply, nonce);
    return;
  }
  // An answer from a peer on this host came through the shared-memory inbox: it works.
  if (c->shm && inbox_suspect) {
    spdlog::info("ucx {}: {} answered the probe; the shared-memory inbox works", opt.name, c->name);
    inbox_suspect = false;
    probing.clear();
  }
}

bool UcxTransport::Impl::check_inbox() {
  if (!inbox_suspect || probing.empty()) return false;
  for (auto it = probing.begin(); it != probing.end();) {
    Conn* c = conn_by_id(*it);
    it = (!c || c->state != Conn::State::up) ? probing.erase(it) : std::next(it);
  }
  // Everyone asked is gone: the next shared-memory peer to come up is asked (mark_up).
  if (probing.empty() || std::chrono::steady_clock::now() < probe_deadline) return false;
  reset_worker(fmt::format("{} shared-memory peer(s) did not answer within {} ms after a shared-memory peer failed",
                           probing.size(), opt.inbox_probe_ms));
  return true;
}

// The shared-memory inbox is taken to be wedged: every connection ends (the
// peers are reported down; whoever dials them dials again), the worker and
// its listener are destroyed and made again at the same address. Regions
// stay (they belong to the UCX context).
void UcxTransport::Impl::reset_worker(const std::string& why) {
  spdlog::error("ucx {}: {}: rebuilding the UCX worker; every connection is dropped and made again", opt.name, why);
  ++resets;
  inbox_suspect = false;
  probing.clear();
  stop_listening();
  end_all_connections(Error(ErrorCode::unavailable, "transport reset: " + why), true);
  if (!requests.empty()) spdlog::warn("ucx {}: {} transfers still held by UCX at the rebuild", opt.name, requests.size());
  requests.clear();
  std::lock_guard lock(worker_mu);
  destroy_worker();
  Status s = Error(ErrorCode::unavailable, "not tried");
  for (int attempt = 0; attempt < 30; ++attempt) {  // the old listener's port may take a moment to free
    if ((s = init_worker())) break;
    destroy_worker();
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  if (!s) {
    spdlog::error("ucx {}: the UCX worker could not be rebuilt: {}; trying again every second", opt.name,
                  s.error().what());
    next_rebuild = std::chrono::steady_clock::now() + std::chrono::seconds(1);
  }
}

void UcxTransport::Impl::end_all_connections(const Error& why, bool force) {
  std::vector<uint64_t> ids;
  for (auto& [id, c] : conns) ids.push_back(id);
  for (uint64_t id : ids) {
    if (Conn* c = conn_by_id(id)) {
      close_conn(*c, why, force);
      // A close that waited for receives: flush if they ended, else force.
      if (c->close_deferred) close_endpoints(*c, c->receiving > 0);
    }
  }
  auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(1);
  while (!conns.empty() && std::chrono::steady_clock::now() < deadline) {
    ucp_worker_progress(worker);
    for (uint64_t id : std::exchange(closed, {})) finish_close(id);
    failed.clear();
    user_calls.clear();
  }
  // A close that did not complete within the second (a peer that never answers
  // the flush) is left to ucp_worker_destroy: its endpoint handle is spent, a
  // second close of it would be a use after free.
  if (!conns.empty()) spdlog::warn("ucx {}: {} connections still closing, left to the worker", opt.name, conns.size());
  for (auto& [id, c] : conns) {
    drop_rkeys(*c);
    drop_arenas(*c);
    if (c->connect_promise) c->connect_promise->set_value(why);
    report_down(*c);
  }
  conns.clear();
  by_ep.clear();
  by_name.clear();
  closed_eps.clear();
  closed.clear();
  close_ready.clear();
  dirty.clear();
  failed.clear();
  std::lock_guard lock(names_mu);
  up_names.clear();
}

bool UcxTransport::Impl::run_deferred() {
  bool did = false;
  for (auto request : std::exchange(accepted, {})) {
    did = true;
    if (ucp_ep_h ep = create_server_ep(request)) add_conn(ep);
  }
  for (uint64_t id : std::exchange(close_ready, {})) {
    did = true;
    if (Conn* c = conn_by_id(id); c && c->close_deferred) close_endpoints(*c, false);
  }
  did |= close_failed();
  while (!user_calls.empty()) {
    did = true;
    auto fn = std::move(user_calls.front());
    user_calls.pop_front();
    fn();
  }
  for (uint64_t id : std::exchange(dirty, {})) {
    did = true;
    if (Conn* c = conn_by_id(id)) deliver(*c);
  }
  for (uint64_t id : std::exchange(closed, {})) {
    did = true;
    finish_close(id);
  }
  return did;
}

// ---------------------------------------------------------------- connections

Conn* UcxTransport::Impl::conn_by_ep(ucp_ep_h ep) {
  auto it = by_ep.find(ep);
  return it == by_ep.end() ? nullptr : conn_by_id(it->second);
}
Conn* UcxTransport::Impl::conn_by_name(const std::string& name) {
  auto it = by_name.find(name);
  return it == by_name.end() ? nullptr : conn_by_id(it->second);
}
Conn* UcxTransport::Impl::conn_by_id(uint64_t id) {
  auto it = conns.find(id);
  return it == conns.end() ? nullptr : it->second.get();
}

Conn* UcxTransport::Impl::add_conn(ucp_ep_h ep) {
  auto c = std::make_unique<Conn>();
  c->id = next_conn++;
  c->ep = ep;
  by_ep[ep] = c->id;
  Conn* raw = c.get();
  conns[c->id] = std::move(c);
  return raw;
}

ucp_ep_h UcxTransport::Impl::create_server_ep(ucp_conn_request_h request) {
  ucp_ep_params_t ep{};
  ep.field_mask = UCP_EP_PARAM_FIELD_CONN_REQUEST | UCP_EP_PARAM_FIELD_ERR_HANDLER | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE;
  ep.conn_request = request;
  ep.err_mode = UCP_ERR_HANDLING_MODE_PEER;
  ep.err_handler.cb = ep_err_cb;
  ep.err_handler.arg = this;
  ucp_ep_h h = nullptr;
  if (auto st = ucp_ep_create(worker, &ep, &h); st != UCS_OK) {
    spdlog::warn("ucx {}: cannot accept a connection: {}", opt.name, ucs_status_string(st));
    return nullptr;
  }
  return h;
}

void UcxTransport::Impl::start_connect(const std::string& host, uint16_t port,
                                       std::shared_ptr<std::promise<Expected<std::string>>> promise) {
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_port = htons(port);
  if (inet_pton(AF_INET, host.c_str(), &sa.sin_addr) != 1) {
    promise->set_value(Error(ErrorCode::invalid_argument, fmt::format("{} is not an IPv4 address", host)));
    return;
  }
  ucp_ep_params_t ep{};
  ep.field_mask = UCP_EP_PARAM_FIELD_FLAGS | UCP_EP_PARAM_FIELD_SOCK_ADDR | UCP_EP_PARAM_FIELD_ERR_HANDLER |
                  UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE;
  ep.flags = UCP_EP_PARAMS_FLAGS_CLIENT_SERVER;
  ep.sockaddr.addr = reinterpret_cast<const sockaddr*>(&sa);
  ep.sockaddr.addrlen = sizeof(sa);
  ep.err_mode = UCP_ERR_HANDLING_MODE_PEER;
  ep.err_handler.cb = ep_err_cb;
  ep.err_handler.arg = this;
  ucp_ep_h h = nullptr;
  if (worker == nullptr) {
    promise->set_value(Error(ErrorCode::unavailable, "the UCX worker could not be rebuilt"));
    return;
  }
  if (auto st = ucp_ep_create(worker, &ep, &h); st != UCS_OK) {
    promise->set_value(ucs_error(ErrorCode::unavailable, fmt::format("connect to {}:{}", host, port), st));
    return;
  }
  Conn* c = add_conn(h);
  c->connect_promise = std::move(promise);
  send_name(*c, kAmHello);
}

void UcxTransport::Impl::send_am(Conn& c, unsigned id, std::unique_ptr<SendOp> op, std::span<const std::byte> body,
                                 ucp_ep_h ep) {
  op->impl = this;
  ucp_request_param_t p = send_param(send_cb, op.get());
  p.op_attr_mask |= UCP_OP_ATTR_FIELD_FLAGS;
  p.flags = ep ? 0 : UCP_AM_SEND_FLAG_REPLY;  // a direct endpoint's frames carry the token instead
  const void* hdr = op->raw_header.empty() ? static_cast<const void*>(op->header.data()) : op->raw_header.data();
  size_t hlen = op->raw_header.empty() ? op->header_bytes : op->raw_header.size();
  auto* req = ucp_am_send_nbx(ep ? ep : c.ep, id, hdr, hlen, body.data(), body.size(), &p);
  if (req == nullptr || UCS_PTR_IS_ERR(req)) {
    if (req) spdlog::debug("ucx {}: send to {} failed: {}", opt.name, c.name, ucs_status_string(UCS_PTR_STATUS(req)));
    finish_send(op.release());  // done (or failed: the endpoint's error callback reports the peer)
    return;
  }
  requests.insert(req);
  op.release();  // send_cb frees it
}

void UcxTransport::Impl::send_frame(Conn& c, Frame frame, size_t queued_bytes) {
  auto op = std::make_unique<SendOp>();
  op->impl = this;
  op->queued_bytes = queued_bytes;
  auto h = messages::encode_header(frame.header());
  std::memcpy(op->header.data(), h.data(), h.size());
  uint64_t seq = c.send_seq++;
  std::memcpy(op->header.data() + messages::kHeaderBytes, &seq, 8);
  if (c.data_ep) {
    std::memcpy(op->header.data() + kAmFrameHeaderBytes, &c.peer_token, 8);
    op->header_bytes = kAmDirectHeaderBytes;
  }
  op->frame = std::move(frame);
  auto body = op->frame.body_bytes();
  ++frames_sent;
  if (c.out_arena && put_size_ok(opt, body.size())) {
    op->conn_id = c.id;
    // In order behind those already waiting for room (the receiver orders by sequence anyway).
    if (c.put_waiting.empty() && put_chunks(c, *op)) {
      finish_send(op.release());
      return;
    }
    c.put_waiting.push_back(std::move(op));
    return;
  }
  send_am(c, kAmFrame, std::move(op), body, c.data_ep);
}

// ---------------------------------------------------------------- frames by put

std::optional<uint64_t> Conn::OutArena::take(size_t bytes) {
  if (live.empty()) head = 0;
  uint64_t at;
  if (live.empty()) {
    if (bytes > length) return std::nullopt;
    at = 0;
  } else if (const uint64_t tail = live.front().offset; head > tail) {
    // Free: [head, length) and [0, tail). The strict `>` keeps a wrapped head
    // below the tail, so head == tail never means full.
    if (length - head >= bytes) {
      at = head;
    } else if (tail > bytes) {
      at = 0;
    } else {
      return std::nullopt;
    }
  } else if (tail - head > bytes) {  // wrapped: free is [head, tail)
    at = head;
  } else {
    return std::nullopt;
  }
  live.push_back({at, bytes, false});
  head = at + bytes;
  return at;
}

// Puts the frame's next chunks into the peer's arena while it has room; each
// chunk's notice follows once its put is remotely visible (put_done). True
// when every chunk is out (the last one carries the frame's queued bytes).
bool UcxTransport::Impl::put_chunks(Conn& c, SendOp& frame_op) {
  auto& arena = *c.out_arena;
  auto body = frame_op.frame.body_bytes();
  const size_t chunk_bytes = std::max<size_t>(64, std::min(opt.put_frames_chunk_bytes, arena.length / 2) & ~size_t{63});
  while (frame_op.put_next < body.size()) {
    const uint64_t body_offset = frame_op.put_next, bytes = std::min(chunk_bytes, body.size() - body_offset);
    auto at = arena.take(round_up_64(bytes));
    if (!at) return false;
    if (body_offset == 0) ++frames_by_put;
    frame_op.put_next += bytes;
    auto chunk = std::make_unique<SendOp>();
    chunk->impl = this;
    chunk->conn_id = c.id;
    chunk->frame = frame_op.frame;  // keeps the body alive until the notice is sent
    chunk->header_bytes = kAmPutHeaderBytes;
    std::memcpy(chunk->header.data(), frame_op.header.data(), kAmDirectHeaderBytes);
    std::memcpy(chunk->header.data() + kAmDirectHeaderBytes, &*at, 8);
    std::memcpy(chunk->header.data() + kAmDirectHeaderBytes + 8, &body_offset, 8);
    std::memcpy(chunk->header.data() + kAmDirectHeaderBytes + 16, &bytes, 8);
    if (frame_op.put_next == body.size()) chunk->queued_bytes = std::exchange(frame_op.queued_bytes, 0);
    SendOp* raw = chunk.release();
    raw->put_outstanding = 1;  // ours, until both are issued
    const ucp_request_param_t p = send_param(put_cb, raw);
    auto track = [&](ucs_status_ptr_t req) {
      if (req == nullptr) return;
      if (UCS_PTR_IS_ERR(req)) {
        raw->put_failed = true;  // the endpoint's error callback reports the peer
        return;
      }
      ++raw->put_outstanding;
      requests.insert(req);
    };
    track(ucp_put_nbx(c.data_ep, body.data() + body_offset, bytes, arena.address + *at, arena.rkey, &p));
    track(ucp_ep_flush_nbx(c.data_ep, &p));
    if (--raw->put_outstanding == 0) put_done(raw);
  }
  return true;
}

// A chunk is in the peer's arena: send its notice. A failed put loses the frame,
// and the peer would wait for it for good: the connection goes down instead (after
// the callback this may run in).
void UcxTransport::Impl::put_done(SendOp* chunk) {
  Conn* c = conn_by_id(chunk->conn_id);
  if (chunk->put_failed && c != nullptr && c->state == Conn::State::up) {
    user_calls.push_back([this, id = c->id] {
      if (Conn* c = conn_by_id(id); c && c->state == Conn::State::up) {
        spdlog::warn("ucx {}: a put into {}'s frame arena failed; dropping the connection", opt.name, c->name);
        close_conn(*c, Error(ErrorCode::unavailable, "a put into the peer's frame arena failed"), true);
      }
    });
  }
  if (chunk->put_failed || !c || c->state != Conn::State::up || !c->data_ep) {
    finish_send(chunk);
    return;
  }
  send_am(*c, kAmFramePut, std::unique_ptr<SendOp>(chunk), {}, c->data_ep);
}

// Receiver: memory the peer may put its large frames into, and its key.
void UcxTransport::Impl::offer_arena(Conn& c) {
  auto m = map_memory(nullptr, opt.put_frames_arena_bytes, true);
  if (!m) {
    spdlog::info("ucx {}: no arena for frames from {} ({}); they stay on rendezvous", opt.name, c.name,
                 m.error().what());
    return;
  }
  c.in_arena = std::move(*m);
  const RegionKey& key = c.in_arena->key;
  auto op = std::make_unique<SendOp>();
  append_u64(op->raw_header, {c.peer_token, key.address, key.length});
  auto* k = reinterpret_cast<const std::byte*>(key.packed_key.data());
  op->raw_body.assign(k, k + key.packed_key.size());
  auto body = std::span<const std::byte>(op->raw_body);
  send_am(c, kAmArenaOffer, std::move(op), body, c.data_ep);
  spdlog::debug("ucx {}: offered {} a {}-byte arena for large frames", opt.name, c.name, key.length);
}

// Sender: the peer's offer. Taken once a connection; ignored when this side
// does not put frames or the arena is too small to hold one.
void UcxTransport::Impl::on_arena_offer(Conn& c, uint64_t address, uint64_t length,
                                        const std::vector<std::byte>& packed) {
  if (c.state != Conn::State::up || !c.data_ep || c.out_arena || opt.put_frames_arena_bytes == 0) return;
  if (length / 2 < std::max<size_t>(opt.put_frames_from_bytes, 4096) || packed.size() < 8) {
    spdlog::warn("ucx {}: an unusable arena offer from {} ({} bytes, {}-byte key), ignored", opt.name, c.name, length,
                 packed.size());
    return;
  }
  ucp_rkey_h rkey = nullptr;
  if (auto st = ucp_ep_rkey_unpack(c.data_ep, packed.data(), &rkey); st != UCS_OK) {
    spdlog::warn("ucx {}: cannot unpack {}'s arena key: {}", opt.name, c.name, ucs_status_string(st));
    return;
  }
  c.out_arena.emplace();
  c.out_arena->rkey = rkey;
  c.out_arena->address = address;
  c.out_arena->length = length;
}

// Receiver: a chunk of a frame's body is in our arena. Copied out before the
// frame is checked (the peer can still write there); then the span goes back.
void UcxTransport::Impl::on_frame_put(uint64_t conn_id, uint64_t seq, uint64_t arena_offset, uint64_t body_offset,
                                      uint64_t bytes) {
  Conn* c = conn_by_id(conn_id);
  if (!c) return;
  auto it = c->arrivals.find(seq);
  if (it == c->arrivals.end() || it->second.ready) return;  // faulted meanwhile
  Arrival& a = it->second;
  const messages::FrameHeader& h = a.header;
  dirty.insert(c->id);
  auto fail = [&](std::string what) {
    a.ready = true;
    a.fault = FrameFault{Error(ErrorCode::invalid_argument, std::move(what)), h.request_id, h.kind, true};
    a.body = nullptr;
  };
  if (!c->in_arena) return fail("a frame notice, but this side offered no arena");
  const size_t length = c->in_arena->length;
  if (bytes == 0 || arena_offset % 8 != 0 || arena_offset > length || bytes > length - arena_offset ||
      body_offset > h.body_bytes || bytes > h.body_bytes - body_offset || bytes > h.body_bytes - a.body_got) {
    return fail(fmt::format("a frame notice for {} bytes at arena offset {} (of {}) and body offset {} (of {})", bytes,
                            arena_offset, length, body_offset, h.body_bytes));
  }
  if (a.body.size() == 0) a.body = messages::alloc_body_words(h.body_bytes);
  std::memcpy(reinterpret_cast<std::byte*>(a.body.begin()) + body_offset, c->in_arena->base + arena_offset, bytes);
  a.body_got += bytes;
  if (a.body_got == h.body_bytes) {
    auto body = std::make_shared<messages::FrameBody>();
    body->words = std::move(a.body);
    a.frame = Frame(h, std::move(body));
    a.ready = true;
  }
  if (c->state != Conn::State::up || !c->data_ep) return;
  auto op = std::make_unique<SendOp>();
  append_u64(op->raw_header, {c->peer_token, arena_offset});
  send_am(*c, kAmArenaRelease, std::move(op), {}, c->data_ep);
}

// Sender: the peer copied a chunk out of its arena; waiting frames may fit now.
void UcxTransport::Impl::on_arena_release(Conn& c, uint64_t offset) {
  if (!c.out_arena) return;
  auto& live = c.out_arena->live;
  auto it = std::find_if(live.begin(), live.end(), [&](const auto& s) { return s.offset == offset && !s.released; });
  if (it == live.end()) {
    spdlog::warn("ucx {}: {} released arena offset {}, which holds no frame of ours; ignored", opt.name, c.name, offset);
    return;
  }
  it->released = true;
  while (!live.empty() && live.front().released) live.pop_front();
  while (!c.put_waiting.empty() && c.state == Conn::State::up && put_chunks(c, *c.put_waiting.front())) {
    finish_send(c.put_waiting.front().release());
    c.put_waiting.pop_front();
  }
}

void UcxTransport::Impl::drop_arenas(Conn& c) {
  if (c.out_arena) ucp_rkey_destroy(c.out_arena->rkey);
  c.out_arena.reset();
  // Ours: the peer may still hold it mapped; the memory goes when it lets go too.
  if (c.in_arena) ucp_mem_unmap(ctx, c.in_arena->memh);
  c.in_arena.reset();
  for (auto& op : std::exchange(c.put_waiting, {})) finish_send(op.release());
}

void UcxTransport::Impl::send_name(Conn& c, unsigned id) {
  auto op = std::make_unique<SendOp>();
  op->header_bytes = 0;
  op->raw_body.resize(opt.name.size());
  std::memcpy(op->raw_body.data(), opt.name.data(), opt.name.size());
  if (!worker_address.empty()) {  // 0, our token for this connection, our worker address
    op->raw_body.push_back(std::byte{0});
    const auto* t = reinterpret_cast<const std::byte*>(&c.id);
    op->raw_body.insert(op->raw_body.end(), t, t + 8);
    op->raw_body.insert(op->raw_body.end(), worker_address.begin(), worker_address.end());
  }
  auto body = std::span<const std::byte>(op->raw_body);
  send_am(c, id, std::move(op), body);
}

void UcxTransport::Impl::on_hello(Conn& c, std::string peer, bool is_ack, uint64_t token,
                                  std::vector<std::byte> address) {
  if (c.state != Conn::State::handshaking) return;
  if (!valid_name(peer) || peer == opt.name) {
    spdlog::warn("ucx {}: peer announced an invalid name, dropping it", opt.name);
    close_conn(c, Error(ErrorCode::invalid_argument, "invalid peer name"), true);
    return;
  }
  if (is_ack != (c.connect_promise != nullptr)) {
    close_conn(c, Error(ErrorCode::invalid_argument, "handshake out of order"), true);
    return;
  }
  if (Conn* old = conn_by_name(peer)) {
    // A restarted peer reconnects before its old connection was seen to fail.
    spdlog::warn("ucx {}: {} connected again; dropping its previous connection", opt.name, peer);
    close_conn(*old, Error(ErrorCode::unavailable, fmt::format("peer {} reconnected", peer)), true);
    report_down(*old);  // now, so that the user sees down (old) before up (new)
  }
  if (!worker_address.empty() && !address.empty()) open_direct(c, token, address);
  if (!is_ack) send_name(c, kAmHelloAck);
  mark_up(c, peer);
  if (c.connect_promise) {
    c.connect_promise->set_value(peer);
    c.connect_promise.reset();
  }
}

// Opens the direct endpoint to the peer's worker address. A failure leaves
// the connection on its sockaddr endpoint (slower, still correct).
void UcxTransport::Impl::open_direct(Conn& c, uint64_t token, const std::vector<std::byte>& address) {
  ucp_ep_params_t ep{};
  ep.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLER |
                  UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE;
  ep.address = reinterpret_cast<const ucp_address_t*>(address.data());
  ep.err_mode = UCP_ERR_HANDLING_MODE_PEER;
  ep.err_handler.cb = ep_err_cb;
  ep.err_handler.arg = this;
  ucp_ep_h h = nullptr;
  if (auto st = ucp_ep_create(worker, &ep, &h); st != UCS_OK) {
    spdlog::warn("ucx {}: no direct endpoint to a peer ({}); frames stay on the connection endpoint", opt.name,
                 ucs_status_string(st));
    return;
  }
  c.data_ep = h;
  c.peer_token = token;
  c.shm = has_shared_memory_lanes(h);
  by_ep[h] = c.id;
}

void UcxTransport::Impl::mark_up(Conn& c, const std::string& peer) {
  c.name = peer;
  c.state = Conn::State::up;
  by_name[peer] = c.id;
  {
    std::lock_guard lock(names_mu);
    up_names.insert(peer);
  }
  spdlog::debug("ucx {}: peer {} up{}", opt.name, peer, c.shm ? " (shared memory)" : "");
  if (inbox_suspect && c.shm && opt.inbox_probe_ms > 0) {  // no one was left to ask when the peer failed
    if (probing.empty()) {
      probe_deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(opt.inbox_probe_ms);
    }
    probe(c);
  }
  if (events.on_peer_up) events.on_peer_up(peer);
  deliver(c);  // frames that overtook the handshake
}

// Hands ready arrivals to the user in sequence order.
void UcxTransport::Impl::deliver(Conn& c) {
  uint64_t id = c.id;
  // A fault without a sequence slot ends the stream.
  if (auto it = c.arrivals.find(UINT64_MAX); it != c.arrivals.end() && it->second.ready) {
    FrameFault f = *it->second.fault;
    c.arrivals.erase(it);
    handle_fault(c, f);
    return;
  }
  while (c.state == Conn::State::up) {
    auto it = c.arrivals.find(c.recv_next);
    if (it == c.arrivals.end() || !it->second.ready) return;
    Arrival a = std::move(it->second);
    c.arrivals.erase(it);
    ++c.recv_next;
    if (a.frame) {
      auto ok = messages::validate_body(*a.frame, opt.limits);
      if (ok) {
        ++frames_received;
        const auto kind = a.frame->kind();
        const auto rid = a.frame->request_id();
        try {
          events.on_frame(c.name, std::move(*a.frame));
        } catch (const kj::Exception& e) {  // a field of the wrong type, met while reading it
          a.fault = messages::unreadable_fault(kind, rid, e.getDescription().cStr());
        }
      } else {
        a.fault = ok.fault();
      }
    }
    if (a.fault) handle_fault(c, *a.fault);
    if (!conn_by_id(id)) return;
  }
}

void UcxTransport::Impl::handle_fault(Conn& c, const FrameFault& f) {
  ++bad_frames;
  ++c.faults;
  spdlog::warn("ucx {}: bad frame from {}: {}", opt.name, c.name.empty() ? "?" : c.name, f.error.what());
  if (events.on_bad_frame) events.on_bad_frame(c.name, f);
  if (c.state == Conn::State::up) send_frame(c, messages::make_error_frame(f));
  if (!f.resync || c.faults > opt.max_faults) {
    spdlog::warn("ucx {}: dropping {} ({} bad frames)", opt.name, c.name.empty() ? "?" : c.name, c.faults);
    close_conn(c, Error(ErrorCode::invalid_argument, fmt::format("dropped after a bad frame: {}", f.error.what())),
               false);
  }
}

// Starts closing a connection: removes its name at once (sends fail from
// now on), closes the endpoint (force: cancel what is in flight; else flush
// first), and reports the peer down when UCX says the endpoint is closed.
void UcxTransport::Impl::close_conn(Conn& c, Error reason, bool force) {
  if (c.state == Conn::State::closing) {
    if (force && c.close_deferred) close_endpoints(c, true);  // the peer is gone: its receives never end
    return;
  }
  bool was_named = c.state == Conn::State::up;
  if (!was_named) c.name.clear();  // never announced: nothing to report
  c.state = Conn::State::closing;
  c.down_reason = std::move(reason);
  c.down_since = std::chrono::steady_clock::now();
  if (auto it = by_name.find(c.name); was_named && it != by_name.end() && it->second == c.id) {
    by_name.erase(it);
    std::lock_guard lock(names_mu);
    up_names.erase(c.name);
  }
  // Closing an endpoint under a live peer's rendezvous leaves the receive on
  // it: rndv_done starts the close when the last one ends. A failed peer's
  // endpoints are closed with force at once (that purges their receives).
  if (c.receiving > 0 && !force) {
    c.close_deferred = true;
    return;
  }
  close_endpoints(c, force);
}

// Each endpoint's close lands in `closed` / `closed_eps`; the last one finishes the connection.
void UcxTransport::Impl::close_endpoints(Conn& c, bool force) {
  c.close_deferred = false;
  for (ucp_ep_h ep : {c.data_ep, c.ep}) {
    if (!ep) continue;
    auto* ctx = new CloseCtx{this, c.id, ep};
    ucp_request_param_t p = send_param(close_cb, ctx);
    p.op_attr_mask |= UCP_OP_ATTR_FIELD_FLAGS;
    p.flags = force ? UCP_EP_CLOSE_FLAG_FORCE : 0;
    auto* req = ucp_ep_close_nbx(ep, &p);
    if (!UCS_PTR_IS_PTR(req)) {
      delete ctx;
      closed.push_back(c.id);
      closed_eps.insert(ep);
    }
  }
}

void UcxTransport::Impl::finish_close(uint64_t id) {
  Conn* c = conn_by_id(id);
  if (!c) return;
  if (!closed_eps.count(c->ep) || (c->data_ep && !closed_eps.count(c->data_ep))) return;  // one still closing
  drop_rkeys(*c);
  drop_arenas(*c);
  by_ep.erase(c->ep);
  closed_eps.erase(c->ep);
  if (c->data_ep) {
    by_ep.erase(c->data_ep);
    closed_eps.erase(c->data_ep);
  }
  Error why = c->down_reason.value_or(Error(ErrorCode::unavailable, "closed"));
  if (c->connect_promise) c->connect_promise->set_value(why);
  report_down(*c);
  conns.erase(id);
}

// Tells the user once that a named peer is gone.
void UcxTransport::Impl::report_down(Conn& c) {
  if (c.name.empty() || c.down_reported) return;
  c.down_reported = true;
  Error why = c.down_reason.value_or(Error(ErrorCode::unavailable, "closed"));
  spdlog::info("ucx {}: peer {} down: {}", opt.name, c.name, why.what());
  if (events.on_peer_down) events.on_peer_down(c.name, why);
}

// ---------------------------------------------------------------- public API

Expected<std::string> UcxTransport::connect(const std::string& address, std::chrono::milliseconds timeout) {
  constexpr std::string_view scheme = "ucx://";
  if (address.rfind(scheme, 0) != 0) return Error(ErrorCode::invalid_argument, fmt::format("{} is not a ucx:// address", address));
  auto hostport = address.substr(scheme.size());
  auto colon = hostport.rfind(':');
  if (colon == std::string::npos) return Error(ErrorCode::invalid_argument, fmt::format("{} has no port", address));
  std::string host = hostport.substr(0, colon);
  int port = std::atoi(hostport.c_str() + colon + 1);
  if (port <= 0 || port > 65535) return Error(ErrorCode::invalid_argument, fmt::format("{} has a bad port", address));
  auto promise = std::make_shared<std::promise<Expected<std::string>>>();
  auto future = promise->get_future();
  auto* impl = impl_.get();
  if (!impl->post([impl, host, port, promise] { impl->start_connect(host, static_cast<uint16_t>(port), promise); })) {
    return Error(ErrorCode::unavailable, "transport is not running");
  }
  if (future.wait_for(timeout) != std::future_status::ready) {
    impl->post([impl, promise] {
      for (auto& [id, c] : impl->conns) {
        if (c->connect_promise == promise) {
          c->connect_promise.reset();
          impl->close_conn(*c, Error(ErrorCode::deadline_exceeded, "connect timed out"), true);
          break;
        }
      }
    });
    return Error(ErrorCode::deadline_exceeded, fmt::format("no handshake from {} within {} ms", address, timeout.count()));
  }
  try {
    return future.get();
  } catch (const std::future_error&) {
    return Error(ErrorCode::unavailable, "transport closed while connecting");
  }
}

Status UcxTransport::send(const std::string& peer, Frame frame) {
  {
    std::lock_guard lock(impl_->names_mu);
    if (!impl_->up_names.count(peer)) {
      return Error(ErrorCode::unavailable, fmt::format("{} is not connected to {}", impl_->opt.name, peer));
    }
  }
  auto* impl = impl_.get();
  size_t bytes = messages::kHeaderBytes + frame.body_bytes().size();
  size_t before = impl->send_queue_bytes.fetch_add(bytes);
  if (before > 0 && before + bytes > impl->opt.max_send_queue_bytes) {  // one frame always fits
    impl->send_queue_bytes -= bytes;
    return Error(ErrorCode::resource_exhausted,
                 fmt::format("send queue full ({} bytes queued); retry later", impl->send_queue_bytes.load()));
  }
  if (!impl->post([impl, peer, bytes, frame = std::move(frame)]() mutable {
        Conn* c = impl->conn_by_name(peer);
        if (c && c->state == Conn::State::up) return impl->send_frame(*c, std::move(frame), bytes);
        impl->send_queue_bytes -= bytes;
      })) {
    impl->send_queue_bytes -= bytes;
    return Error(ErrorCode::unavailable, "transport is not running");
  }
  return Ok{};
}

Status UcxTransport::send_raw_for_test(const std::string& peer, std::vector<std::byte> header, std::vector<std::byte> body) {
  auto* impl = impl_.get();
  impl->post([impl, peer, header = std::move(header), body = std::move(body)]() mutable {
    Conn* c = impl->conn_by_name(peer);
    if (!c) return;
    auto op = std::make_unique<SendOp>();
    op->raw_header = std::move(header);
    if (op->raw_header.empty()) op->header_bytes = 0;
    op->raw_body = std::move(body);
    auto b = std::span<const std::byte>(op->raw_body);
    impl->send_am(*c, kAmFrame, std::move(op), b);
  });
  return Ok{};
}

Status UcxTransport::send_put_notice_for_test(const std::string& peer, std::vector<std::byte> frame_header,
                                              uint64_t arena_offset, uint64_t body_offset, uint64_t bytes) {
  auto* impl = impl_.get();
  impl->post([impl, peer, frame_header = std::move(frame_header), arena_offset, body_offset, bytes] {
    Conn* c = impl->conn_by_name(peer);
    if (!c || !c->data_ep) return;
    auto op = std::make_unique<SendOp>();
    op->raw_header = frame_header;
    append_u64(op->raw_header, {c->send_seq++, c->peer_token, arena_offset, body_offset, bytes});
    impl->send_am(*c, kAmFramePut, std::move(op), {}, c->data_ep);
  });
  return Ok{};
}

void UcxTransport::disconnect(const std::string& peer) {
  auto* impl = impl_.get();
  impl->post([impl, peer] {
    if (Conn* c = impl->conn_by_name(peer)) {
      impl->close_conn(*c, Error(ErrorCode::unavailable, fmt::format("disconnected from {}", peer)), false);
    }
  });
}

std::vector<std::string> UcxTransport::peers() const {
  std::lock_guard lock(impl_->names_mu);
  return {impl_->up_names.begin(), impl_->up_names.end()};
}

TransportStats UcxTransport::stats() const {
  TransportStats s;
  s.peers = peers().size();
  s.regions = impl_->n_regions;
  s.remote_keys = impl_->n_remote_keys;
  s.rma_in_flight = impl_->rma_in_flight;
  s.send_queue_bytes = impl_->send_queue_bytes;
  s.frames_sent = impl_->frames_sent;
  s.frames_received = impl_->frames_received;
  s.bad_frames = impl_->bad_frames;
  s.resets = impl_->resets;
  s.frames_by_put = impl_->frames_by_put;
  return s;
}

}  // namespace troupe::transport
