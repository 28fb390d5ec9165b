#!/usr/bin/env bash
# On the GPU machine: each top-k case's kernels under ncu (durations, DRAM reads), one table.
#   bench/gpu/topk-ncu.sh LIB OUT CASE...
# CASE: NxROWS[:VAR=VALUE[,VAR=VALUE...]], e.g. 1048576x8:TROUPE_TOPK_SAMPLED=1. Writes OUT/NAME.csv
# per case and OUT/topk-ncu.md. ncu runs with --clock-control none (the card's clocks as found) and
# --cache-control none.
set -uo pipefail
cd "$(dirname "$0")/../.."
lib=$1 out=$2
shift 2
mkdir -p "$out"
csvs=()
for spec in "$@"; do
  shape=${spec%%:*} envs=
  [ "$spec" != "$shape" ] && envs=${spec#*:}
  n=${shape%x*} rows=${shape#*x}
  name=$(echo "$spec" | tr ':,=' '___')
  (
    IFS=, read -ra kv <<< "$envs"
    for e in "${kv[@]}"; do export "$e"; done
    timeout 120 ncu --profile-from-start off --clock-control none --cache-control none --csv \
      --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed \
      python3 bench/gpu/topk_ncu.py run "$lib" "$n" "$rows" 5 > "$out/$name.csv" 2> "$out/$name.err"
  )
  sed -i "s|^# case \([^ ]*\)|# case \1${envs:+ [$envs]}|" "$out/$name.csv"
  csvs+=("$out/$name.csv")
done
python3 bench/gpu/topk_ncu.py table "${csvs[@]}" | tee "$out/topk-ncu.md"
