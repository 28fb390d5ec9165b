#include "messages/frame.hpp"

#include <capnp/any.h>
#include <fmt/format.h>
#include <kj/exception.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <mutex>
#include <new>
#include <vector>

#include "messages/kinds.hpp"

namespace troupe::messages {
namespace {

// Little-endian loads/stores; the header is defined little-endian.
template <class T>
T load_le(const std::byte* p) {
  T v = 0;
  for (size_t i = 0; i < sizeof(T); ++i) v |= static_cast<T>(static_cast<uint8_t>(p[i])) << (8 * i);
  return v;
}
template <class T>
void store_le(std::byte* p, T v) {
  for (size_t i = 0; i < sizeof(T); ++i) p[i] = static_cast<std::byte>((v >> (8 * i)) & 0xff);
}

constexpr uint16_t kLastKind = static_cast<uint16_t>(msg::Kind::ACTOR_MESSAGE);

FrameFault fault(ErrorCode code, std::string message, uint64_t request_id, msg::Kind kind, bool resync,
                 uint32_t skip_bytes = 0) {
  return FrameFault{Error(code, std::move(message)), request_id, kind, resync, skip_bytes};
}

}  // namespace

HeaderBytes encode_header(const FrameHeader& h) {
  HeaderBytes out{};
  store_le<uint32_t>(out.data() + 0, kFrameMagic);
  store_le<uint16_t>(out.data() + 4, h.version);
  store_le<uint16_t>(out.data() + 6, static_cast<uint16_t>(h.kind));
  store_le<uint64_t>(out.data() + 8, h.request_id);
  store_le<uint32_t>(out.data() + 16, h.body_bytes);
  store_le<uint32_t>(out.data() + 20, 0);
  return out;
}

Decoded<FrameHeader> decode_header(std::span<const std::byte> bytes, const FrameLimits& limits) {
  if (bytes.size() < kHeaderBytes) {
    return fault(ErrorCode::invalid_argument, fmt::format("truncated frame header ({} of {} bytes)", bytes.size(), kHeaderBytes),
                 0, msg::Kind::NONE, false);
  }
  const std::byte* p = bytes.data();
  uint32_t magic = load_le<uint32_t>(p);
  if (magic != kFrameMagic) {
    return fault(ErrorCode::invalid_argument,
                 fmt::format("not a troupe frame (magic {:#010x}, expected {:#010x})", magic, kFrameMagic), 0,
                 msg::Kind::NONE, false);
  }
  FrameHeader h;
  h.version = load_le<uint16_t>(p + 4);
  uint16_t kind = load_le<uint16_t>(p + 6);
  h.request_id = load_le<uint64_t>(p + 8);
  h.body_bytes = load_le<uint32_t>(p + 16);
  uint32_t reserved = load_le<uint32_t>(p + 20);
  // Only bytes 0..5 (magic, version) are promised to stay put across versions,
  // so a frame of another version cannot be skipped: the stream is lost.
  if (h.version != kFrameVersion) {
    return fault(ErrorCode::unsupported,
                 fmt::format("frame version {} is not supported (this endpoint speaks version {})", h.version,
                             kFrameVersion),
                 h.request_id, msg::Kind::NONE, false);
  }
  if (h.body_bytes > limits.max_body_bytes) {
    return fault(ErrorCode::resource_exhausted,
                 fmt::format("frame body of {} bytes exceeds the limit of {} bytes", h.body_bytes, limits.max_body_bytes),
                 h.request_id, msg::Kind::NONE, false);
  }
  if (h.body_bytes % 8 != 0) {
    return fault(ErrorCode::invalid_argument,
                 fmt::format("frame body of {} bytes is not a whole number of 8-byte words", h.body_bytes), h.request_id,
                 msg::Kind::NONE, false);
  }
  if (reserved != 0) {
    return fault(ErrorCode::invalid_argument, "reserved frame header bytes 20..23 must be zero", h.request_id,
                 msg::Kind::NONE, false);
  }
  if (!is_known_kind(kind)) {
    return fault(ErrorCode::unsupported, fmt::format("unknown frame kind {}", kind), h.request_id, msg::Kind::NONE, true,
                 h.body_bytes);
  }
  h.kind = static_cast<msg::Kind>(kind);
  if (h.body_bytes == 0) {
    return fault(ErrorCode::invalid_argument, fmt::format("{} frame has an empty body", kind_name(h.kind)), h.request_id,
                 h.kind, true);
  }
  return h;
}

namespace {

// Recycles large bodies: receivers of big frames (activations, rendezvous
// bodies) see the same sizes again and again, and a fresh 64 MiB buffer
// costs page faults and a new UCX registration every time. At most
// kMaxCachedBytes stay cached; past that the buffers returned longest ago
// are freed first, whatever their size (a process that moved from 4 MiB to
// 64 MiB frames keeps the 64 MiB ones).
class BodyPool final : public kj::ArrayDisposer {
 public:
  static constexpr size_t kMinPooledBytes = 256u << 10;
  static constexpr size_t kMaxCachedBytes = 512u << 20;

  static BodyPool& instance() {
    static BodyPool* pool = new BodyPool;  // never destroyed: frames may outlive statics
    return *pool;
  }

  kj::Array<capnp::word> take(size_t words) {
    const size_t cap = capacity(words);
    void* p = nullptr;
    {
      std::lock_guard lock(mu_);
      for (auto it = cached_.rbegin(); it != cached_.rend(); ++it) {  // the most recently returned first: warm
        if (it->words == cap) {
          p = it->p;
          cached_bytes_ -= cap * sizeof(capnp::word);
          cached_.erase(std::next(it).base());
          break;
        }
      }
    }
    if (p) {
      ++reused_;
    } else {
      ++allocated_;
      p = std::aligned_alloc(64, cap * sizeof(capnp::word));
      if (!p) throw std::bad_alloc();
    }
    return kj::Array<capnp::word>(static_cast<capnp::word*>(p), words, *this);
  }

  BodyPoolStats stats() const {
    std::lock_guard lock(mu_);
    return {cached_bytes_, cached_.size(), reused_, allocated_};
  }

 private:
  struct Cached {
    size_t words;
    void* p;
  };

  // Rounded up to an eighth of the size's power of two (64 KiB at least), so
  // that equal-sized frames share buffers; what is rounded up but never
  // written is never touched, so it costs address space, not memory.
  static size_t capacity(size_t words) {
    constexpr size_t word = sizeof(capnp::word);
    size_t bytes = words * word;
    size_t granule = std::max<size_t>(size_t{64} << 10, std::bit_floor(bytes) / 8);
    return (bytes + granule - 1) / granule * granule / word;
  }

  void disposeImpl(void* first, size_t, size_t count, size_t, void (*)(void*)) const override {
    const size_t cap = capacity(count);
    std::vector<void*> evicted;
    {
      std::lock_guard lock(mu_);
      cached_.push_back({cap, first});
      cached_bytes_ += cap * sizeof(capnp::word);
      while (cached_bytes_ > kMaxCachedBytes) {
        cached_bytes_ -= cached_.front().words * sizeof(capnp::word);
        evicted.push_back(cached_.front().p);
        cached_.pop_front();
      }
    }
    for (void* p : evicted) std::free(p);
  }

  mutable std::mutex mu_;
  mutable std::deque<Cached> cached_;  // oldest first
  mutable size_t cached_bytes_ = 0;
  std::atomic<uint64_t> reused_{0}, allocated_{0};
};

}  // namespace

BodyPoolStats body_pool_stats() { return BodyPool::instance().stats(); }

kj::Array<capnp::word> alloc_body_words(size_t bytes) {
  size_t words = bytes / sizeof(capnp::word);
  if (bytes < BodyPool::kMinPooledBytes) return kj::heapArray<capnp::word>(words);
  return BodyPool::instance().take(words);
}

std::span<const std::byte> Frame::body_bytes() const {
  if (!body_) return {};
  return body_->bytes();
}

kj::ArrayPtr<const capnp::word> Frame::body_words() const {
  if (!body_) return {};
  return body_->words.asPtr();
}

Frame Frame::with_request_id(uint64_t request_id) const {
  FrameHeader h = header_;
  h.request_id = request_id;
  return Frame(h, body_);
}

Frame make_frame(msg::Kind kind, uint64_t request_id, capnp::MessageBuilder& message) {
  auto body = std::make_shared<FrameBody>();
  body->words = capnp::messageToFlatArray(message);
  FrameHeader h;
  h.kind = kind;
  h.request_id = request_id;
  h.body_bytes = static_cast<uint32_t>(body->words.size() * sizeof(capnp::word));
  return Frame(h, std::move(body));
}

Frame copy_frame(const FrameHeader& header, std::span<const std::byte> bytes) {
  auto body = std::make_shared<FrameBody>();
  body->words = alloc_body_words(bytes.size() & ~size_t{7});
  if (!bytes.empty()) std::memcpy(body->words.begin(), bytes.data(), bytes.size() & ~size_t{7});
  return Frame(header, std::move(body));
}

capnp::ReaderOptions reader_options(size_t body_words, const FrameLimits& limits) {
  capnp::ReaderOptions o;
  o.traversalLimitInWords = body_words * limits.traversal_factor + 1024;
  o.nestingLimit = static_cast<int>(limits.nesting_limit);
  return o;
}

Decoded<Ok> validate_body(const Frame& frame, const FrameLimits& limits) {
  auto words = frame.body_words();
  auto bad = [&](std::string why) {
    return fault(ErrorCode::invalid_argument, fmt::format("malformed {} body: {}", kind_name(frame.kind()), why),
                 frame.request_id(), frame.kind(), true);
  };
  if (words.size() * sizeof(capnp::word) != frame.header().body_bytes) return bad("body length differs from the header");
  if (reinterpret_cast<uintptr_t>(words.begin()) % alignof(capnp::word) != 0) {
    return bad("body is not 8-byte aligned (a transport bug)");
  }
  try {
    capnp::ReaderOptions o;
    o.traversalLimitInWords = words.size() * 2 + 64;
    o.nestingLimit = static_cast<int>(limits.nesting_limit);
    capnp::FlatArrayMessageReader reader(words, o);
    if (reader.getEnd() != words.end()) return bad("trailing bytes after the message");
    auto root = reader.getRoot<capnp::AnyPointer>();
    if (root.isNull()) return bad("null root");
    if (root.getPointerType() != capnp::PointerType::STRUCT) return bad("root is not a struct");
    // A full traversal: follows every pointer, checks bounds, depth and budget.
    root.targetSize();
  } catch (const kj::Exception& e) {
    return bad(e.getDescription().cStr());
  }
  return Ok{};
}

FrameFault unreadable_fault(msg::Kind kind, uint64_t request_id, const char* why) {
  return FrameFault{Error(ErrorCode::invalid_argument, fmt::format("unreadable {} body: {}", kind_name(kind), why)),
                    request_id, kind, true};
}

Frame make_error_frame(uint64_t request_id, ErrorCode code, const std::string& message, msg::Kind about) {
  FrameBuilder<msg::Error> b;
  b.root().setCode(to_wire(code));
  b.root().setMessage(message);
  b.root().setFrameKind(about);
  return b.finish(request_id);
}

Frame make_error_frame(const FrameFault& f) {
  return make_error_frame(f.request_id, f.error.code(), f.error.what(), f.kind);
}

msg::ErrorCode to_wire(ErrorCode code) {
  switch (code) {
    case ErrorCode::invalid_argument: return msg::ErrorCode::INVALID_ARGUMENT;
    case ErrorCode::not_found: return msg::ErrorCode::NOT_FOUND;
    case ErrorCode::invalid_file: return msg::ErrorCode::INVALID_FILE;
    case ErrorCode::unsupported: return msg::ErrorCode::UNSUPPORTED;
    case ErrorCode::resource_exhausted: return msg::ErrorCode::RESOURCE_EXHAUSTED;
    case ErrorCode::unavailable: return msg::ErrorCode::UNAVAILABLE;
    case ErrorCode::deadline_exceeded: return msg::ErrorCode::DEADLINE_EXCEEDED;
    case ErrorCode::cancelled: return msg::ErrorCode::CANCELLED;
    case ErrorCode::internal: return msg::ErrorCode::INTERNAL;
  }
  return msg::ErrorCode::INTERNAL;
}

ErrorCode from_wire(msg::ErrorCode code) {
  switch (code) {
    case msg::ErrorCode::INVALID_ARGUMENT: return ErrorCode::invalid_argument;
    case msg::ErrorCode::NOT_FOUND: return ErrorCode::not_found;
    case msg::ErrorCode::INVALID_FILE: return ErrorCode::invalid_file;
    case msg::ErrorCode::UNSUPPORTED: return ErrorCode::unsupported;
    case msg::ErrorCode::RESOURCE_EXHAUSTED: return ErrorCode::resource_exhausted;
    case msg::ErrorCode::UNAVAILABLE: return ErrorCode::unavailable;
    case msg::ErrorCode::DEADLINE_EXCEEDED: return ErrorCode::deadline_exceeded;
    case msg::ErrorCode::CANCELLED: return ErrorCode::cancelled;
    case msg::ErrorCode::INTERNAL: return ErrorCode::internal;
  }
  return ErrorCode::internal;  // an enumerant from a newer schema
}

bool is_known_kind(uint16_t kind) { return kind >= 1 && kind <= kLastKind; }

const char* kind_name(msg::Kind kind) {
  switch (kind) {
    case msg::Kind::NONE: return "none";
    case msg::Kind::ERROR: return "Error";
    case msg::Kind::GENERATE_REQUEST: return "GenerateRequest";
    case msg::Kind::TOKEN_CHUNK: return "TokenChunk";
    case msg::Kind::FINISH: return "Finish";
    case msg::Kind::ABORT: return "Abort";
    case msg::Kind::PARK: return "Park";
    case msg::Kind::RESUME: return "Resume";
    case msg::Kind::ACK: return "Ack";
    case msg::Kind::LIST_MODELS: return "ListModels";
    case msg::Kind::MODEL_LIST: return "ModelList";
    case msg::Kind::KV_OFFER: return "KvOffer";
    case msg::Kind::KV_PULL: return "KvPull";
    case msg::Kind::KV_CONFIRM: return "KvConfirm";
    case msg::Kind::KV_RELEASE: return "KvRelease";
    case msg::Kind::KV_EVENTS: return "KvEvents";
    case msg::Kind::HEARTBEAT: return "Heartbeat";
    case msg::Kind::SPAWN: return "Spawn";
    case msg::Kind::STOP: return "Stop";
    case msg::Kind::DRAIN: return "Drain";
    case msg::Kind::SCALE: return "Scale";
    case msg::Kind::METRICS_SNAPSHOT: return "MetricsSnapshot";
    case msg::Kind::STAGE_ACTIVATION: return "StageActivation";
    case msg::Kind::ACTOR_MESSAGE: return "ActorMessage";
  }
  return "unknown";
}

}  // namespace troupe::messages
