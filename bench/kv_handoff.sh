#!/usr/bin/env bash
# KV handoff benchmark: the node's PD handoff (lend -> KvOffer -> RMA gets ->
# KvConfirm) between two processes over UCX on loopback, next to
# ucx_perftest ucp_get at the same size and UCX settings, in one run.
# Rewrites the "KV handoff" section of docs/benchmarks.md (other sections stay).
#   bench/kv_handoff.sh [BUILD_DIR] [extra kv_handoff_bench args]
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${1:-build}
shift || true
BIN=$BUILD/bin/kv_handoff_bench
[ -x "$BIN" ] || cmake --build "$BUILD" --target kv_handoff_bench
export UCX_NET_DEVICES=lo UCX_MM_ERROR_HANDLING=y

load_before=$(cut -d' ' -f1-3 /proc/loadavg)
table=$("$BIN" --trials "${TRIALS:-3}" "$@")
load_after=$(cut -d' ' -f1-3 /proc/loadavg)
echo "$table"

DOC=docs/benchmarks.md
section=$(cat <<MD
<!-- kv-handoff:begin (written by bench/kv_handoff.sh) -->
## KV handoff over UCX vs ucx_perftest

$(date -u +%Y-%m-%d), commit $(git rev-parse --short HEAD), $(nproc) cores ($(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs)),
UCX $(ucx_info -v | sed -n 's/^# Version \(.*\)/\1/p'), loopback, both sides
\`UCX_NET_DEVICES=lo UCX_MM_ERROR_HANDLING=y\`, error mode PEER on both (ucx_perftest \`-e\`).${GLIBC_TUNABLES:+
\`GLIBC_TUNABLES=$GLIBC_TUNABLES\` for both (troupe and ucx_perftest).}
Load average before/after: ${load_before} / ${load_after} (the machine is shared; best of ${TRIALS:-3} trials,
each the mean of 8 handoffs, interleaved with ucx_perftest). Target (PERF-TARGETS.md): pull >= 90% of ucx_perftest.

$table

- *pull*: the taker's part of \`actors/node/kv_handoff\`: one \`Transport::get\` per page straight into the
  image's page buffers (first get issued .. last completed), from a region the owner lent with
  \`allocate_region\` (shared memory the taker maps), as the decode side of a handoff does it.
- *handoff*: the whole exchange as one process sees it: ask, the owner's copy of the pages into the lent
  region, the \`KvOffer\` frame, the taker's page allocation (fresh zeroed buffers each time) and gets,
  \`KvConfirm\`, the owner's \`KvRelease\` back.
- *ucp_get*: \`ucx_perftest -t ucp_get -s <image bytes> -e\`: one get of the whole image per iteration into
  memory UCX registered, the peak for the same bytes.
<!-- kv-handoff:end -->
MD
)
python3 - "$DOC" "$section" <<'PY'
import re, sys
path, section = sys.argv[1], sys.argv[2]
text = open(path).read()
pat = re.compile(r"<!-- kv-handoff:begin.*?<!-- kv-handoff:end -->", re.S)
text = pat.sub(lambda m: section, text) if pat.search(text) else text.rstrip("\n") + "\n\n" + section + "\n"
open(path, "w").write(text)
PY
echo "wrote the KV handoff section of $DOC"
