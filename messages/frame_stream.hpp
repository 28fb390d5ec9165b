// Reassembles frames from a byte stream (TCP), for any split of the bytes
// into reads. Reads go straight into the header buffer or into the body's
// aligned storage, so a body is never copied twice.
#pragma once

#include <optional>
#include <span>
#include <variant>
#include <vector>

#include "messages/frame.hpp"

namespace troupe::messages {

// One result of feeding bytes: a validated frame, or a fault. After a fault
// with resync = false the assembler is closed and ignores further input.
using StreamEvent = std::variant<Frame, FrameFault>;

class FrameAssembler {
 public:
  explicit FrameAssembler(FrameLimits limits = {}) : limits_(limits) {}

  // Where the next bytes should be read to (never empty unless closed()).
  std::span<std::byte> next_buffer();
  // The first `n` bytes of next_buffer() were filled. Returns an event when
  // a frame completed or a fault was found.
  std::optional<StreamEvent> commit(size_t n);

  // Convenience for tests and the fuzzer: feed arbitrary bytes.
  std::vector<StreamEvent> feed(std::span<const std::byte> bytes);

  bool closed() const { return state_ == State::closed; }
  // True between frames: a connection closing now loses no partial frame.
  bool idle() const { return state_ == State::header && header_fill_ == 0; }

 private:
  enum class State { header, body, skip, closed };
  std::optional<StreamEvent> on_header();
  std::optional<StreamEvent> on_body();

  FrameLimits limits_;
  State state_ = State::header;
  HeaderBytes header_bytes_{};
  size_t header_fill_ = 0;
  FrameHeader header_;
  kj::Array<capnp::word> body_;
  size_t body_fill_ = 0;
  size_t skip_left_ = 0;
  std::array<std::byte, 4096> skip_buffer_{};
};

}  // namespace troupe::messages
