// Frames: the unit every troupe transport moves. A frame is a fixed 24-byte
// header followed by a body that is one Cap'n Proto message in flat
// (unpacked, segment-table-first) form. docs/messages.md describes the bytes.
//
// Everything here treats its input as untrusted: decoding never throws and
// never reads out of bounds; a bad frame becomes a FrameFault that says what
// was wrong (code + sentence for the Error frame sent back) and whether the
// byte stream can go on after it.
#pragma once

#include <capnp/message.h>
#include <capnp/serialize.h>

#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <variant>

#include "base/error.hpp"
#include "messages/common.capnp.h"

namespace troupe::messages {

// The value of operations that return nothing but can fail.
struct Ok {};
using Status = Expected<Ok>;

inline constexpr uint32_t kFrameMagic = 0x46505254;  // bytes "TRPF"
inline constexpr uint16_t kFrameVersion = 1;
inline constexpr size_t kHeaderBytes = 24;

// Limits applied to every frame an endpoint receives. The defaults suit the
// internal fabric (UCX between troupe processes); the public TCP endpoint
// uses a smaller body limit (transport/tcp.hpp).
struct FrameLimits {
  uint32_t max_body_bytes = 128u << 20;  // larger frames are refused before any allocation
  uint32_t nesting_limit = 16;           // Cap'n Proto pointer depth; our schemas need < 8
  // A reader of a frame may traverse at most this many words per body word
  // (bounds amplification through shared pointers). Validation itself allows 2.
  uint32_t traversal_factor = 8;
};

struct FrameHeader {
  uint16_t version = kFrameVersion;
  msg::Kind kind = msg::Kind::NONE;
  uint64_t request_id = 0;  // chosen by the requester; 0 = not about a request
  uint32_t body_bytes = 0;  // a multiple of 8
};

using HeaderBytes = std::array<std::byte, kHeaderBytes>;

HeaderBytes encode_header(const FrameHeader& header);

// What was wrong with a received frame and what the receiver does next.
struct FrameFault {
  Error error;                          // sent back in an Error frame
  uint64_t request_id = 0;              // the frame's request id when the header was readable
  msg::Kind kind = msg::Kind::NONE;     // the frame's kind when readable
  bool resync = false;                  // true: framing is intact, skip the body and go on;
                                        // false: the byte stream is lost, close the connection
  uint32_t skip_bytes = 0;              // resync: body bytes still to skip in the stream
};

// A frame that passed validate_body can still hold fields of another type than
// its schema says (Cap'n Proto checks types lazily, when a field is read, and
// throws kj::Exception). Receivers of untrusted frames catch that around their
// handler and answer with this fault (invalid_argument; the stream goes on).
FrameFault unreadable_fault(msg::Kind kind, uint64_t request_id, const char* why);

// A value or a FrameFault (Expected<T> with the extra facts a receiver needs).
template <class T>
class Decoded {
 public:
  Decoded(T value) : v_(std::move(value)) {}
  Decoded(FrameFault fault) : v_(std::move(fault)) {}
  bool ok() const { return v_.index() == 0; }
  explicit operator bool() const { return ok(); }
  T& value() & { return std::get<0>(v_); }
  T&& value() && { return std::get<0>(std::move(v_)); }
  const T& value() const& { return std::get<0>(v_); }
  const FrameFault& fault() const { return std::get<1>(v_); }
  T& operator*() { return value(); }
  T* operator->() { return &value(); }

 private:
  std::variant<T, FrameFault> v_;
};

// Checks magic, version, kind, body size (<= limits, multiple of 8) and the
// reserved bytes. `bytes` must hold at least kHeaderBytes.
Decoded<FrameHeader> decode_header(std::span<const std::byte> bytes, const FrameLimits& limits);

// The body of a frame: a flat Cap'n Proto message in 8-byte-aligned memory.
// Immutable once built; shared by every copy of the Frame.
struct FrameBody {
  kj::Array<capnp::word> words;
  std::span<const std::byte> bytes() const {
    return {reinterpret_cast<const std::byte*>(words.begin()), words.size() * sizeof(capnp::word)};
  }
};

// Aligned storage for `bytes` bytes (a multiple of 8), for receivers that
// fill a body in place (TCP reads, UCX rendezvous).
kj::Array<capnp::word> alloc_body_words(size_t bytes);

// The pool behind alloc_body_words for bodies of 256 KiB and more.
struct BodyPoolStats {
  size_t cached_bytes = 0;    // buffers waiting for reuse (at most 512 MiB)
  size_t cached_buffers = 0;
  uint64_t reused = 0;        // takes served from the pool
  uint64_t allocated = 0;     // takes that allocated fresh memory
};
BodyPoolStats body_pool_stats();

// A header plus a shared, immutable body. Cheap to copy; safe to read from
// several threads at once.
class Frame {
 public:
  Frame() = default;
  Frame(FrameHeader header, std::shared_ptr<const FrameBody> body) : header_(header), body_(std::move(body)) {}

  const FrameHeader& header() const { return header_; }
  msg::Kind kind() const { return header_.kind; }
  uint64_t request_id() const { return header_.request_id; }
  std::span<const std::byte> body_bytes() const;
  kj::ArrayPtr<const capnp::word> body_words() const;
  // The same body under another request id (e.g. echoing, forwarding).
  Frame with_request_id(uint64_t request_id) const;

 private:
  FrameHeader header_;
  std::shared_ptr<const FrameBody> body_;
};

// Builds a frame from a finished message (one copy into flat form).
Frame make_frame(msg::Kind kind, uint64_t request_id, capnp::MessageBuilder& message);

// Copies unaligned bytes (e.g. an eager UCX active message) into aligned storage.
Frame copy_frame(const FrameHeader& header, std::span<const std::byte> body);

// Checks that a frame's body is a well-formed Cap'n Proto message with a
// struct root, every pointer in bounds (a full traversal), within the nesting
// and traversal limits, and no trailing bytes. A frame that passes can be
// read with `open` without exceptions (within the traversal budget).
Decoded<Ok> validate_body(const Frame& frame, const FrameLimits& limits);

// The Error frame a receiver sends back for a fault.
Frame make_error_frame(const FrameFault& fault);
Frame make_error_frame(uint64_t request_id, ErrorCode code, const std::string& message,
                       msg::Kind about = msg::Kind::NONE);

// Maps between troupe::ErrorCode and the wire enum.
// A Cap'n Proto text field as a string, every byte of it (cStr() stops at a NUL, and
// texts here carry user content and grammar tags that hold one).
inline std::string text(capnp::Text::Reader t) { return std::string(t.begin(), t.size()); }
// A string as a Cap'n Proto text, every byte of it (a std::string given to a setter goes
// through kj::StringPtr's c_str() and stops at a NUL).
inline capnp::Text::Reader wire_text(const std::string& s) { return capnp::Text::Reader(s.data(), s.size()); }

msg::ErrorCode to_wire(ErrorCode code);
ErrorCode from_wire(msg::ErrorCode code);

const char* kind_name(msg::Kind kind);
bool is_known_kind(uint16_t kind);

}  // namespace troupe::messages
