# KV state between processes: the handoff protocol (prefill -> decode, and any
# move of a request's state: park, resume, migration) and the KV events that
# feed the router's prefix index.
#
# Handoff, one lease per request, all frames with the request's id:
#   owner  --KvOffer-->   taker     pages are leased; owner keeps them alive
#   owner  <--KvPull---   taker     taker starts moving bytes (RMA get, or asks for puts)
#   owner  <--KvConfirm-- taker     bytes arrived; owner may free its pages
#   either --KvRelease--> other     lease over (after confirm, or aborted/expired/failed)
# The owner frees its pages only after KvConfirm or KvRelease, or when the
# lease expires, or when the transport reports the taker lost; a taker that
# fails falls back to recompute.
@0xa5a8eb8d74aaa6b6;

using Cxx = import "/capnp/c++.capnp";
$Cxx.namespace("troupe::msg");

using Common = import "common.capnp";

# The five kinds of per-sequence, per-layer state of DeepSeek-V4
# (docs/architecture.md, model/state.hpp).
enum StateKind {
  swaWindow @0;          # raw kv rows of the last `sliding_window` tokens, by position
  compressedEntries @1;  # CSA (rate 4) or HCA (rate 128) compressed entries, by entry index
  indexerKeys @2;        # CSA lightning-indexer keys, by entry index
  csaInflight @3;        # CSA compressor ring: kv+score of the open and previous window
  hcaInflight @4;        # HCA compressor ring: kv+score of the open window
}

# One kind of state of one layer, as pages inside one registered region.
# Page p of `pages` starts at byte `regionOffset + pages[p] * pageStride` of
# `region`, holds `pageShape` elements of `dtype` (row-major), and
# `pageBytes` = product(pageShape) * size(dtype) <= pageStride.
struct KvDescriptor {
  kind @0 :StateKind;
  layer @1 :UInt32;             # decoder layer index
  compressRate @2 :UInt32;      # 4 (CSA) or 128 (HCA) for compressed kinds; 0 otherwise
  pages @3 :List(UInt32);       # page indices in the region, in logical order
  pageShape @4 :List(UInt32);   # e.g. [rows per page, row width]
  dtype @5 :Common.Dtype;
  pageBytes @6 :UInt64;         # bytes of one page
  pageStride @7 :UInt64;        # bytes between consecutive page indices in the region
  regionOffset @8 :UInt64;      # byte offset of page index 0 inside the region
  firstIndex @9 :UInt64;        # logical index (position or entry) of row 0 of pages[0]
  count @10 :UInt64;            # valid rows across the pages, starting at firstIndex
  ringSlots @11 :UInt32;        # ring kinds: slots in the ring (row = index % ringSlots); else 0
  location @12 :Common.Location;# where the region's bytes live
  device @13 :Int32 = -1;       # GPU ordinal when location = device
  region @14 :Common.RemoteRegion; # transport keys: owner, address, length, packed rkey
}

# Owner -> taker: the state of a request is ready to move.
struct KvOffer {
  leaseId @0 :UInt64;             # owner's lease; names the handoff in the frames below
  model @1 :Text;                 # model id, so the taker can check shapes
  tokenCount @2 :UInt64;          # tokens (prompt + generated) the state covers
  nextTokenId @3 :UInt32;         # token sampled after the last covered one (decode starts here)
  hasNextToken @4 :Bool;          # false when the taker must sample it
  descriptors @5 :List(KvDescriptor);
  expiresUnixNanos @6 :UInt64;    # owner frees the pages after this wall time; 0 = no expiry
  totalBytes @7 :UInt64;          # sum of pageBytes over all pages, for admission
}

enum PullMode {
  get @0;  # taker reads the owner's pages with one-sided gets
  put @1;  # taker asks the owner to write into `destinations` with one-sided puts
}

# Taker -> owner: accept (part of) an offer and start moving bytes.
struct KvPull {
  leaseId @0 :UInt64;
  mode @1 :PullMode;
  descriptorIndices @2 :List(UInt32);    # which offered descriptors; empty = all
  destinations @3 :List(KvDescriptor);   # put mode: where to write, one per descriptor pulled
}

# Taker -> owner: the bytes arrived (put mode: the owner's puts completed
# remotely). The owner may now free the offered pages.
struct KvConfirm {
  leaseId @0 :UInt64;
  bytes @1 :UInt64;        # bytes moved
  checksum @2 :UInt64;     # optional FNV-1a 64 of the moved bytes in descriptor order; 0 = not computed
}

enum ReleaseReason {
  confirmed @0;  # normal end after KvConfirm
  aborted @1;    # the request was aborted
  expired @2;    # the lease ran out before a confirm
  failed @3;     # the move failed (see message); taker recomputes
}

# Either side: the lease is over; neither side may touch the pages after it.
struct KvRelease {
  leaseId @0 :UInt64;
  reason @1 :ReleaseReason;
  message @2 :Text;
}

enum KvEventType {
  stored @0;    # blocks became reusable prefix cache
  evicted @1;   # blocks left the tier
  cleared @2;   # the whole tier was dropped (restart, reset); blockHashes empty
}

# One change of a worker's prefix cache. Blocks are chained: a block's hash
# covers its tokens and its parent's hash.
struct KvEvent {
  type @0 :KvEventType;
  blockHashes @1 :List(UInt64);  # in prefix order
  parentHash @2 :UInt64;         # hash of the block before blockHashes[0]; 0 = root
  tokensPerBlock @3 :UInt32;
  tier @4 :Common.Location;      # device pools or the host tier
}

# Worker -> router: prefix cache changes, in order. A gap in `seq` means
# events were lost; the router then asks for (or waits for) a `cleared`.
struct KvEvents {
  worker @0 :Text;              # transport name of the worker
  seq @1 :UInt64;               # sequence number of the first event in this frame
  events @2 :List(KvEvent);
}
