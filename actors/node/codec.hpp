// The in-process actor messages (actors/protocol.hpp) as fabric.capnp
// ActorMessages, and back. Actor handles inside messages go through a RefMap:
// a local actor becomes an ActorRef naming this process, an ActorRef becomes a
// local proxy actor (or the local actor it names).
#pragma once

#include <caf/all.hpp>

#include <string>

#include "actors/protocol.hpp"
#include "messages/kinds.hpp"

namespace troupe::actors::node {

// How actor handles cross a process boundary (implemented by the Node).
class RefMap {
 public:
  virtual ~RefMap() = default;
  // A null handle writes an empty ref.
  virtual void to_wire(const caf::actor& actor, msg::ActorRef::Builder out) = 0;
  // An empty ref reads as a null handle; a ref to a lost actor as a handle
  // whose monitors fire at once.
  virtual caf::actor from_wire(msg::ActorRef::Reader ref) = 0;
};

// Writes a message an actor sent to a remote actor into `body`; false (with
// `why`) for a message that never crosses processes. Handoff and calls are
// the Node's (they need the transport). `request_id` gets the request the
// message is about, for the frame header.
bool encode_body(const caf::message& message, RefMap& refs, msg::ActorMessage::Body::Builder body,
                 uint64_t& request_id, std::string& why);

// Sends the message in `body` to `target` as the in-process message it was
// (caf::anon_send). Bodies that are not actor messages (handoff, call, reply,
// exited) are the Node's; this returns false for them.
bool deliver_body(msg::ActorMessage::Body::Reader body, RefMap& refs, const caf::actor& target);

void to_wire(const Job& job, RefMap& refs, msg::Job::Builder out);
Job from_wire(msg::Job::Reader in, RefMap& refs);
void to_wire(const WorkerLoad& load, RefMap& refs, msg::WorkerLoad::Builder out);
WorkerLoad from_wire(msg::WorkerLoad::Reader in, RefMap& refs);
// Everything of an image but its pages.
void to_wire(const engine::SequenceImage& image, msg::SequenceMeta::Builder out);
engine::SequenceImage image_from_wire(msg::SequenceMeta::Reader in);

}  // namespace troupe::actors::node
