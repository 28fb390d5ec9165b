#!/usr/bin/env bash
# Transport benchmark: UcxTransport frames and page puts next to ucx_perftest
# (ucp_am_bw / ucp_put_bw) at the same sizes and UCX settings, in one run.
# Rewrites the "Transport" section of docs/benchmarks.md (other sections stay).
#   bench/transport.sh [BUILD_DIR] [extra transport_bench args]
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${1:-build}
shift || true
BIN=$BUILD/bin/transport_bench
[ -x "$BIN" ] || cmake --build "$BUILD" --target transport_bench
export UCX_NET_DEVICES=lo UCX_MM_ERROR_HANDLING=y
# Direct endpoints (UcxOptions::direct_endpoints, the default) unless TROUPE_UCX_DIRECT=0 says otherwise.
export TROUPE_UCX_DIRECT=${TROUPE_UCX_DIRECT:-1}

load_before=$(cut -d' ' -f1-3 /proc/loadavg)
table=$("$BIN" --trials "${TRIALS:-3}" "$@")
load_after=$(cut -d' ' -f1-3 /proc/loadavg)
echo "$table"

DOC=docs/benchmarks.md
[ -f "$DOC" ] || printf '# troupe: benchmarks\n\nEach section is written by the script it names; ratios are against a peer measured in the same run.\n' > "$DOC"
section=$(cat <<MD
<!-- transport:begin (written by bench/transport.sh) -->
## Transport: frames and page puts vs ucx_perftest

$(date -u +%Y-%m-%d), $(nproc) cores ($(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs)),
UCX $(ucx_info -v | sed -n 's/^# Version \(.*\)/\1/p'), loopback, both sides
\`UCX_NET_DEVICES=lo UCX_MM_ERROR_HANDLING=y\`, error mode PEER on both (ucx_perftest \`-e\`).
Load average before/after: ${load_before} / ${load_after} (the machine is shared; best of ${TRIALS:-3} interleaved trials).

$table

- *frame bytes*: 24-byte header + Cap'n Proto body (StageActivation with an inline payload; the 64 B row is the
  smallest frame, an empty TokenChunk). *troupe GB/s* counts frame bytes. ucx_perftest moves the body bytes
  (\`ucp_am_bw -s <body bytes> -H 32\`: our active-message header is the frame header + a sequence number).
- *troupe / poll* and *put / ucp_put_bw*: the median over trials of (troupe / ucx_perftest) measured back to
  back, body bytes against body bytes; the GB/s columns are the best trial of each. *poll* is ucx_perftest's
  default busy-polling; *sleep* is \`-I -E sleep\`, the wakeup model troupe's progress thread uses.
- troupe frames go through the whole path: \`Transport::send\` from another thread, the progress thread, an
  aligned receive buffer, full validation of the body, delivery in order to \`on_frame\`. Frames with bodies of
  32 KiB and more move by puts into the receiver's arena in 1 MiB chunks (UcxOptions::put_frames_arena_bytes,
  4 MiB a connection; the first such frame takes the active-message path and brings the offer); the rest by
  active messages (eager, or rendezvous through UCX's shared-memory FIFO).
- *put*: batches of 16 puts (one completion each, up to 4 in flight) into a region the peer made with
  \`allocate_region\`, next to \`ucp_put_bw -s <size>\` (which also targets UCX-allocated memory).
  *put into caller memory*: the same into memory the peer registered with \`register_region\`: shared-memory
  transports cannot map it, so UCX moves it over its active-message fallback.
<!-- transport:end -->
MD
)
python3 - "$DOC" "$section" <<'PY'
import re, sys
path, section = sys.argv[1], sys.argv[2]
text = open(path).read()
pat = re.compile(r"<!-- transport:begin.*?<!-- transport:end -->", re.S)
text = pat.sub(lambda m: section, text) if pat.search(text) else text.rstrip("\n") + "\n\n" + section + "\n"
open(path, "w").write(text)
PY
echo "wrote the transport section of $DOC"
