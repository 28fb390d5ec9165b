# Shared vocabulary of every troupe message: the frame kinds, errors, dtypes.
#
# Evolution rules (Cap'n Proto's): add fields and enumerants only at the end
# with the next ordinal; never renumber, retype or reuse an ordinal; a field
# that is no longer used stays in the schema. The frame header (docs/messages.md)
# carries a version for changes these rules cannot express.
@0x8a141669cbaa1cd7;

using Cxx = import "/capnp/c++.capnp";
$Cxx.namespace("troupe::msg");

# The kind of a frame, carried in the frame header (bytes 6..7). It names the
# root struct of the frame's body: kind `generateRequest` has a
# `GenerateRequest` root, and so on. `none` is never valid on the wire.
enum Kind {
  none @0;
  error @1;            # Error
  generateRequest @2;  # GenerateRequest
  tokenChunk @3;       # TokenChunk
  finish @4;           # Finish
  abort @5;            # Abort
  park @6;             # Park
  resume @7;           # Resume
  ack @8;              # Ack
  listModels @9;       # ListModels
  modelList @10;       # ModelList
  kvOffer @11;         # KvOffer
  kvPull @12;          # KvPull
  kvConfirm @13;       # KvConfirm
  kvRelease @14;       # KvRelease
  kvEvents @15;        # KvEvents
  heartbeat @16;       # Heartbeat
  spawn @17;           # Spawn
  stop @18;            # Stop
  drain @19;           # Drain
  scale @20;           # Scale
  metricsSnapshot @21; # MetricsSnapshot
  stageActivation @22; # StageActivation
}

# Mirrors troupe::ErrorCode (base/error.hpp); same meaning, same order.
enum ErrorCode {
  invalidArgument @0;   # the request or frame is malformed; do not retry as is
  notFound @1;          # unknown model, request id, region or peer
  invalidFile @2;       # a file the request names has the wrong contents
  unsupported @3;       # well-formed, but not something this endpoint does (e.g. frame version)
  resourceExhausted @4; # frame too large, queue full, no KV pages; retry later or smaller
  unavailable @5;       # a peer is gone or not ready; retry elsewhere
  deadlineExceeded @6;  # the request's deadline passed
  cancelled @7;         # aborted by the client or by a supervisor
  internal @8;          # a bug in troupe; the message says where
}

# A failure answer. Its frame's request id is the offending frame's request id
# (0 when the frame could not be read far enough to know it).
struct Error {
  code @0 :ErrorCode;
  message @1 :Text;    # one sentence a user can act on
  frameKind @2 :Kind;  # kind of the offending frame, `none` when unknown
}

# Element types of tensors and KV pages.
enum Dtype {
  f32 @0;
  bf16 @1;
  f16 @2;
  fp8e4m3 @3;
  fp8e5m2 @4;
  i8 @5;
  u8 @6;
  i32 @7;
  u32 @8;
  i64 @9;
}

# Where bytes live.
enum Location {
  host @0;    # process memory (pinned or pageable)
  device @1;  # GPU memory; see the `device` ordinal next to it
}

# Memory registered with a transport, named so that a peer can put/get it
# one-sidedly. Produced by Transport::register_region (transport/transport.hpp).
struct RemoteRegion {
  owner @0 :Text;       # transport name of the process that owns the memory
  regionId @1 :UInt64;  # the owner's id of the registration (unique per owner)
  address @2 :UInt64;   # base virtual address in the owner's address space
  length @3 :UInt64;    # bytes registered, starting at `address`
  packedKey @4 :Data;   # transport-specific key (UCX: packed rkey); empty in-process
}

# Generic acknowledgement of a control frame (Park, Resume, Stop, Drain,
# Scale, Spawn, KvRelease ...). Its frame's request id is the acknowledged
# frame's request id.
struct Ack {
  ofKind @0 :Kind;   # kind of the frame acknowledged
  detail @1 :Text;   # optional human-readable note
}
