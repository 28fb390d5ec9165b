#!/usr/bin/env bash
# On the GPU machine: the steady decode step of `troupe_gpu_e2e bench` under several environment
# settings, alternating ROUNDS times, for A/B checks of kernel variants inside the whole step.
#   bench/gpu/step-ab.sh BUNDLE MODEL BATCHES [SETTING ...]
# BUNDLE: a device-bundle holding troupe_gpu_e2e. MODEL: a model folder (troupe init-model --preset
# flash-shaped --dtype bf16 --seed 0 --out MODEL). BATCHES: comma-separated batch sizes. SETTING: "" (as
# built) or NAME=VALUE[,NAME=VALUE...]; E2E_BIN=FILE in a setting runs that binary of the bundle instead of
# troupe_gpu_e2e (a variant built from a patched tree). Prints each run's steady step, experts touched a layer (runs
# compare only where these agree) and fraction of the roofline; with SMI=1 also the mean SM clock and
# power drawn over the run (nvidia-smi every 100 ms); STEP_LOG=FILE appends every run's JSON lines there (the
# bench's "profile" line splits a step into groups of ops), each with its setting. ROUNDS (2), PROMPT (512), NEW (32).
set -uo pipefail
bundle=$1 model=$2 batches=$3
shift 3
[ $# -gt 0 ] || set -- ""
export NCCL_NVLS_ENABLE=0
here=$(cd "$(dirname "$0")/../.." && pwd)
export TROUPE_TOKENIZER_DIR=${TROUPE_TOKENIZER_DIR:-$here/model/tokenizer/data/deepseek-v4}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
field() { grep -o "\"$1\":[0-9.e+-]*" "$2" | head -1 | cut -d: -f2; }
for b in ${batches//,/ }; do
  for ((r = 0; r < ${ROUNDS:-2}; ++r)); do
    for setting in "$@"; do
      smi_pid=
      if [ "${SMI:-0}" = 1 ]; then
        nvidia-smi --query-gpu=clocks.sm,power.draw --format=csv,noheader,nounits -lms 100 > "$tmp/smi.csv" &
        smi_pid=$!
      fi
      bin=troupe_gpu_e2e
      for kv in ${setting//,/ }; do [[ $kv == E2E_BIN=* ]] && bin=${kv#E2E_BIN=}; done
      env ${setting//,/ } timeout 120 "$bundle/run.sh" "$bin" bench --model "$model" --batch "$b" \
        --prompt "${PROMPT:-512}" --new "${NEW:-32}" > "$tmp/run.json" 2> "$tmp/err.txt"
      rc=$?
      extra=
      if [ -n "$smi_pid" ]; then
        kill "$smi_pid" 2> /dev/null
        wait "$smi_pid" 2> /dev/null
        extra=$(awk -F', ' '{c += $1; p += $2; n++} END {if (n) printf " sm %.0f MHz, %.0f W (%d samples)", c / n, p / n, n}' \
          "$tmp/smi.csv")
      fi
      [ -n "${STEP_LOG:-}" ] && sed "s/^{/{\"setting\":\"${setting}\",\"batch_run\":$b,/" "$tmp/run.json" >> "$STEP_LOG"
      if [ "$rc" != 0 ]; then
        echo "batch $b ${setting:-as built}: exit $rc: $(tail -n 2 "$tmp/err.txt" | tr '\n' ' ')"
        continue
      fi
      echo "batch $b ${setting:-as built}: step $(field steady_step_ms "$tmp/run.json") ms, experts" \
        "$(field experts_touched_per_layer "$tmp/run.json"), roofline $(field fraction_of_roofline "$tmp/run.json")$extra"
    done
  done
done
