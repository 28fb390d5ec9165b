# Supervision and observability between processes: liveness, lifecycle of
# workers, metrics, and pipeline-stage activations.
@0x9b4158aa45b7991e;

using Cxx = import "/capnp/c++.capnp";
$Cxx.namespace("troupe::msg");

using Common = import "common.capnp";

# Load a worker reports with each heartbeat; the scale policy reads it.
struct Load {
  queued @0 :UInt32;          # requests waiting for admission
  running @1 :UInt32;         # requests in the running batch
  parked @2 :UInt32;          # requests parked on the host tier
  kvPagesUsed @3 :UInt64;     # device KV pages leased, all pools together
  kvPagesFree @4 :UInt64;
  handoffsOutstanding @5 :UInt32; # KV leases offered but not yet confirmed
}

# Node -> node, periodically. Peer failure is detected by the transport
# (within a second); heartbeats carry load and detect a restarted peer.
struct Heartbeat {
  sender @0 :Text;            # transport name of the sending node
  seq @1 :UInt64;             # increments by one per heartbeat
  sentUnixNanos @2 :UInt64;
  incarnation @3 :UInt64;     # random per process start: a change means the peer restarted
  load @4 :Load;
}

enum Role {
  gateway @0;
  router @1;
  prefill @2;
  decode @3;
  cacheShard @4;
  offload @5;
  stage @6;
  supervisor @7;
  node @8;
}

# Supervisor -> node: start a worker. Answered by Ack (or Error).
struct Spawn {
  role @0 :Role;
  name @1 :Text;       # unique worker name, e.g. "decode-3"
  node @2 :Text;       # node (process) to run it on
  model @3 :Text;      # model directory or id
  config @4 :Text;     # role-specific settings as JSON (from the manifest)
}

# Supervisor -> node: stop a worker. Answered by Ack.
struct Stop {
  name @0 :Text;
  reason @1 :Text;
  graceful @2 :Bool = true;  # finish in-flight work (see Drain) before stopping
}

# Supervisor -> worker: fence admissions, move live requests away with their
# KV, then report Ack. Requests that cannot move by the deadline are aborted.
struct Drain {
  name @0 :Text;
  deadlineUnixNanos @1 :UInt64;   # 0 = no deadline
  migrate @2 :Bool = true;        # move live requests with their KV (else finish them in place)
}

# Admin or policy -> supervisor: change the number of workers of a role.
struct Scale {
  role @0 :Role;
  delta @1 :Int32;        # add (>0) or remove (<0) this many; used when target = 0
  target @2 :UInt32;      # absolute worker count; 0 = use delta
  reason @3 :Text;        # "queue_depth", "admin", ...
}

struct Label {
  key @0 :Text;
  value @1 :Text;
}

# A counter or gauge value.
struct Sample {
  name @0 :Text;          # Prometheus name, e.g. troupe_long_tail_parked_total
  labels @1 :List(Label);
  value @2 :Float64;
}

struct Histogram {
  name @0 :Text;
  labels @1 :List(Label);
  upperBounds @2 :List(Float64);  # bucket upper bounds, ascending (+Inf implied)
  counts @3 :List(UInt64);        # per bucket, not cumulative; len = len(upperBounds) + 1
  sum @4 :Float64;
  count @5 :UInt64;
}

# Worker -> gateway (which serves /metrics): the worker's metrics now.
struct MetricsSnapshot {
  source @0 :Text;               # transport name of the worker
  timeUnixNanos @1 :UInt64;
  counters @2 :List(Sample);
  gauges @3 :List(Sample);
  histograms @4 :List(Histogram);
}

# A byte range inside a registered region.
struct RemoteSlice {
  region @0 :Common.RemoteRegion;
  offset @1 :UInt64;
  length @2 :UInt64;
}

# Stage -> next stage (pipeline parallelism): hidden states of a micro-batch.
# The tensor travels out of band (RMA into a region the receiver registered,
# or a region the sender offers); only small tensors ride inline.
struct StageActivation {
  stage @0 :UInt32;               # index of the producing stage
  microBatch @1 :UInt64;          # micro-batch sequence number
  requestIds @2 :List(UInt64);    # one per row group, in row order
  positions @3 :List(UInt32);     # position of each token row
  shape @4 :List(UInt32);         # e.g. [tokens, hc_mult, hidden]
  dtype @5 :Common.Dtype;
  payload :union {
    inline @6 :Data;              # the tensor bytes (small tensors only)
    remote @7 :RemoteSlice;       # where to get them, or where they were put
  }
}
