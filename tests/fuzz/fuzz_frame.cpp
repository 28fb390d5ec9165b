// libFuzzer target over the frame decoder: arbitrary bytes as a TCP byte
// stream (split into reads at fuzzer-chosen points) and as a UCX-style
// header + body pair. Every frame that validates is then read field by field
// as its schema type (dynamic reflection), the way a handler would.
// Built with clang (tests/fuzz/CMakeLists.txt); runs in `make test`.
#include <capnp/dynamic.h>
#include <capnp/schema.h>

#include <cstdint>
#include <cstring>

#include "messages/frame_stream.hpp"
#include "messages/kinds.hpp"

using namespace troupe;
using namespace troupe::messages;

namespace {

void walk(const capnp::DynamicValue::Reader& v, int depth);

void walk_struct(capnp::DynamicStruct::Reader s, int depth) {
  if (depth > 20) return;
  for (auto field : s.getSchema().getFields()) {
    if (!s.has(field)) continue;
    walk(s.get(field), depth + 1);
  }
}

void walk(const capnp::DynamicValue::Reader& v, int depth) {
  switch (v.getType()) {
    case capnp::DynamicValue::STRUCT: walk_struct(v.as<capnp::DynamicStruct>(), depth); break;
    case capnp::DynamicValue::LIST:
      for (auto e : v.as<capnp::DynamicList>()) walk(e, depth + 1);
      break;
    case capnp::DynamicValue::TEXT: (void)v.as<capnp::Text>().size(); break;
    case capnp::DynamicValue::DATA: (void)v.as<capnp::Data>().size(); break;
    default: break;
  }
}

template <class T>
void read_as(const Frame& f) {
  auto view = open<T>(f);
  if (!view) return;
  try {
    walk_struct(capnp::DynamicStruct::Reader(view->root()), 0);
  } catch (const kj::Exception&) {
    // Only the traversal budget may stop a reader of a validated frame.
  }
}

void read_typed(const Frame& f) {
  switch (f.kind()) {
    case msg::Kind::ERROR: return read_as<msg::Error>(f);
    case msg::Kind::GENERATE_REQUEST: return read_as<msg::GenerateRequest>(f);
    case msg::Kind::TOKEN_CHUNK: return read_as<msg::TokenChunk>(f);
    case msg::Kind::FINISH: return read_as<msg::Finish>(f);
    case msg::Kind::ABORT: return read_as<msg::Abort>(f);
    case msg::Kind::PARK: return read_as<msg::Park>(f);
    case msg::Kind::RESUME: return read_as<msg::Resume>(f);
    case msg::Kind::ACK: return read_as<msg::Ack>(f);
    case msg::Kind::LIST_MODELS: return read_as<msg::ListModels>(f);
    case msg::Kind::MODEL_LIST: return read_as<msg::ModelList>(f);
    case msg::Kind::KV_OFFER: return read_as<msg::KvOffer>(f);
    case msg::Kind::KV_PULL: return read_as<msg::KvPull>(f);
    case msg::Kind::KV_CONFIRM: return read_as<msg::KvConfirm>(f);
    case msg::Kind::KV_RELEASE: return read_as<msg::KvRelease>(f);
    case msg::Kind::KV_EVENTS: return read_as<msg::KvEvents>(f);
    case msg::Kind::HEARTBEAT: return read_as<msg::Heartbeat>(f);
    case msg::Kind::SPAWN: return read_as<msg::Spawn>(f);
    case msg::Kind::STOP: return read_as<msg::Stop>(f);
    case msg::Kind::DRAIN: return read_as<msg::Drain>(f);
    case msg::Kind::SCALE: return read_as<msg::Scale>(f);
    case msg::Kind::METRICS_SNAPSHOT: return read_as<msg::MetricsSnapshot>(f);
    case msg::Kind::STAGE_ACTIVATION: return read_as<msg::StageActivation>(f);
    case msg::Kind::NONE: return;
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  auto bytes = std::span(reinterpret_cast<const std::byte*>(data), size);
  FrameLimits limits;
  limits.max_body_bytes = 1 << 20;

  // As a stream, split into reads of a size taken from the input itself.
  FrameAssembler stream(limits);
  size_t step = size ? (static_cast<size_t>(data[0]) % 61) + 1 : 1;
  for (size_t off = 0; off < size && !stream.closed(); off += step) {
    for (auto& ev : stream.feed(bytes.subspan(off, std::min(step, size - off)))) {
      if (auto* f = std::get_if<Frame>(&ev)) {
        read_typed(*f);
      } else {
        (void)make_error_frame(std::get<FrameFault>(ev));
      }
    }
  }

  // As a UCX active message: header and body arrive apart, body unaligned.
  if (size >= kHeaderBytes) {
    auto h = decode_header(bytes.first(kHeaderBytes), limits);
    if (h) {
      FrameHeader hdr = *h;
      auto body = bytes.subspan(kHeaderBytes);
      if (hdr.body_bytes == body.size()) {
        Frame f = copy_frame(hdr, body);
        if (validate_body(f, limits)) read_typed(f);
      }
    }
  }
  return 0;
}
