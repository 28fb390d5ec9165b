#include "messages/frame_stream.hpp"

#include <algorithm>
#include <cstring>

namespace troupe::messages {

std::span<std::byte> FrameAssembler::next_buffer() {
  switch (state_) {
    case State::header: return {header_bytes_.data() + header_fill_, kHeaderBytes - header_fill_};
    case State::body: {
      auto* base = reinterpret_cast<std::byte*>(body_.begin());
      return {base + body_fill_, header_.body_bytes - body_fill_};
    }
    case State::skip: return {skip_buffer_.data(), std::min(skip_left_, skip_buffer_.size())};
    case State::closed: return {};
  }
  return {};
}

std::optional<StreamEvent> FrameAssembler::commit(size_t n) {
  switch (state_) {
    case State::header:
      header_fill_ += n;
      if (header_fill_ == kHeaderBytes) return on_header();
      return std::nullopt;
    case State::body:
      body_fill_ += n;
      if (body_fill_ == header_.body_bytes) return on_body();
      return std::nullopt;
    case State::skip:
      skip_left_ -= n;
      if (skip_left_ == 0) {
        state_ = State::header;
        header_fill_ = 0;
      }
      return std::nullopt;
    case State::closed: return std::nullopt;
  }
  return std::nullopt;
}

std::optional<StreamEvent> FrameAssembler::on_header() {
  header_fill_ = 0;
  auto h = decode_header(header_bytes_, limits_);
  if (!h) {
    const FrameFault& f = h.fault();
    if (!f.resync) {
      state_ = State::closed;
    } else {
      // The length is trusted (checked against the limit): skip the body.
      skip_left_ = f.skip_bytes;
      state_ = skip_left_ ? State::skip : State::header;
    }
    return StreamEvent(f);
  }
  header_ = *h;
  body_ = alloc_body_words(header_.body_bytes);
  body_fill_ = 0;
  state_ = State::body;
  return std::nullopt;
}

std::optional<StreamEvent> FrameAssembler::on_body() {
  auto body = std::make_shared<FrameBody>();
  body->words = std::move(body_);
  Frame frame(header_, std::move(body));
  state_ = State::header;
  auto ok = validate_body(frame, limits_);
  if (!ok) return StreamEvent(ok.fault());
  return StreamEvent(std::move(frame));
}

std::vector<StreamEvent> FrameAssembler::feed(std::span<const std::byte> bytes) {
  std::vector<StreamEvent> events;
  while (!bytes.empty() && !closed()) {
    auto dst = next_buffer();
    size_t n = std::min(dst.size(), bytes.size());
    std::memcpy(dst.data(), bytes.data(), n);
    bytes = bytes.subspan(n);
    if (auto ev = commit(n)) events.push_back(std::move(*ev));
  }
  return events;
}

}  // namespace troupe::messages
