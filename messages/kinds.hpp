// Typed access to frames: which kind each schema struct travels as, a
// builder that ends in a Frame, and a read-only view of a received frame.
#pragma once

#include <kj/exception.h>

#include <memory>
#include <utility>

#include "messages/common.capnp.h"
#include "messages/control.capnp.h"
#include "messages/frame.hpp"
#include "messages/generate.capnp.h"
#include "messages/kv.capnp.h"

namespace troupe::messages {

// KindOf<msg::T>::value is the frame kind whose body has a T root.
template <class T>
struct KindOf;

#define TROUPE_FRAME_KIND(Type, KIND)                         \
  template <>                                                 \
  struct KindOf<msg::Type> {                                  \
    static constexpr msg::Kind value = msg::Kind::KIND;       \
  };
TROUPE_FRAME_KIND(Error, ERROR)
TROUPE_FRAME_KIND(GenerateRequest, GENERATE_REQUEST)
TROUPE_FRAME_KIND(TokenChunk, TOKEN_CHUNK)
TROUPE_FRAME_KIND(Finish, FINISH)
TROUPE_FRAME_KIND(Abort, ABORT)
TROUPE_FRAME_KIND(Park, PARK)
TROUPE_FRAME_KIND(Resume, RESUME)
TROUPE_FRAME_KIND(Ack, ACK)
TROUPE_FRAME_KIND(ListModels, LIST_MODELS)
TROUPE_FRAME_KIND(ModelList, MODEL_LIST)
TROUPE_FRAME_KIND(KvOffer, KV_OFFER)
TROUPE_FRAME_KIND(KvPull, KV_PULL)
TROUPE_FRAME_KIND(KvConfirm, KV_CONFIRM)
TROUPE_FRAME_KIND(KvRelease, KV_RELEASE)
TROUPE_FRAME_KIND(KvEvents, KV_EVENTS)
TROUPE_FRAME_KIND(Heartbeat, HEARTBEAT)
TROUPE_FRAME_KIND(Spawn, SPAWN)
TROUPE_FRAME_KIND(Stop, STOP)
TROUPE_FRAME_KIND(Drain, DRAIN)
TROUPE_FRAME_KIND(Scale, SCALE)
TROUPE_FRAME_KIND(MetricsSnapshot, METRICS_SNAPSHOT)
TROUPE_FRAME_KIND(StageActivation, STAGE_ACTIVATION)
#undef TROUPE_FRAME_KIND

// Builds one message of type T and turns it into a Frame.
//   FrameBuilder<msg::TokenChunk> b;  b.root().setIndex(3);  send(b.finish(request_id));
template <class T>
class FrameBuilder {
 public:
  FrameBuilder() : root_(message_.initRoot<T>()) {}
  typename T::Builder root() { return root_; }
  // Replaces the root with a copy of `from` (e.g. to forward a received message).
  void copy_from(typename T::Reader from) {
    message_.setRoot(from);
    root_ = message_.getRoot<T>();
  }
  Frame finish(uint64_t request_id) { return make_frame(KindOf<T>::value, request_id, message_); }

 private:
  capnp::MallocMessageBuilder message_;
  typename T::Builder root_;
};

// A read-only view of a frame's body as a T. Holds the frame (and so its
// bytes) alive; the reader it hands out must not outlive the view.
template <class T>
class View {
 public:
  typename T::Reader root() const { return root_; }
  const Frame& frame() const { return frame_; }
  uint64_t request_id() const { return frame_.request_id(); }

 private:
  template <class U>
  friend Decoded<View<U>> open(const Frame& frame, const FrameLimits& limits);
  View(Frame frame, std::unique_ptr<capnp::FlatArrayMessageReader> reader, typename T::Reader root)
      : frame_(std::move(frame)), reader_(std::move(reader)), root_(root) {}

  Frame frame_;
  std::unique_ptr<capnp::FlatArrayMessageReader> reader_;
  typename T::Reader root_;
};

capnp::ReaderOptions reader_options(size_t body_words, const FrameLimits& limits);

// Opens a frame as a T: checks the kind, builds a reader with the limits
// for untrusted input. Frames handed out by transports are already validated
// (validate_body); `open` still never throws.
template <class T>
Decoded<View<T>> open(const Frame& frame, const FrameLimits& limits = {}) {
  if (frame.kind() != KindOf<T>::value) {
    return FrameFault{Error(ErrorCode::invalid_argument,
                            std::string("expected a ") + kind_name(KindOf<T>::value) + " frame, got " +
                                kind_name(frame.kind())),
                      frame.request_id(), frame.kind(), true};
  }
  try {
    auto words = frame.body_words();
    auto reader = std::make_unique<capnp::FlatArrayMessageReader>(words, reader_options(words.size(), limits));
    auto root = reader->getRoot<T>();
    return View<T>(frame, std::move(reader), root);
  } catch (const kj::Exception& e) {
    return FrameFault{Error(ErrorCode::invalid_argument,
                            std::string("unreadable ") + kind_name(frame.kind()) + " body: " + e.getDescription().cStr()),
                      frame.request_id(), frame.kind(), true};
  }
}

}  // namespace troupe::messages
