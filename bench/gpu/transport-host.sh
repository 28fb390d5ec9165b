#!/usr/bin/env bash
# On the GPU machine's host (16 cores): UcxTransport frames next to ucx_perftest,
# once per progress-thread setting, in one call. BUNDLE: a device-bundle of
# transport_bench and /usr/bin/ucx_perftest (or a .tar.xz of one).
#   bench/gpu/transport-host.sh BUNDLE OUT [transport_bench args]
# VARIANTS: transport_bench flags per run, ";"-separated (default: the default
# loop, then --spin-us 50). Writes OUT/transport-<n>.md, one table per variant.
set -uo pipefail
bundle=$1 out=$2
shift 2
if [[ $bundle == *.tar.xz ]]; then
  mkdir -p /tmp/transport-bundle && tar xJf "$bundle" -C /tmp/transport-bundle &&
    bundle=$(ls -d /tmp/transport-bundle/*/ | head -1)
fi
bundle=$(cd "$bundle" && pwd)
mkdir -p "$out"
export UCX_NET_DEVICES=lo UCX_MM_ERROR_HANDLING=y TROUPE_UCX_DIRECT=${TROUPE_UCX_DIRECT:-1}
IFS=';' read -r -a variants <<< "${VARIANTS:---spin-us 0;--spin-us 50}"
i=0
for v in "${variants[@]}"; do
  i=$((i + 1))
  echo "== variant $i: ${v:-default}" | tee "$out/transport-$i.md"
  # shellcheck disable=SC2086
  timeout "${VARIANT_S:-120}" "$bundle/run.sh" transport_bench --perftest "$bundle/ucx_perftest" "$@" $v \
    >> "$out/transport-$i.md" 2> "$out/transport-$i.log"
  echo "exit $?" >> "$out/transport-$i.md"
  grep -E "^\| [0-9]" "$out/transport-$i.md"
done
