#!/usr/bin/env bash
# On the GPU machine: the whole V4 forward pass on the CUDA backend against the
# CPU backend, on random bf16-valued models (identical weights on both sides):
# one long prefill call (so CSA's indexer really selects top-k entries) then
# single-token decode calls. Prints relative L2 error and top-1 agreement.
#   bench/gpu/forward-check.sh BUNDLE_DIR OUT     (BUNDLE_DIR holds a device-bundle of `troupe`)
# Needs the sequence state in device memory: model::DenseState keeps it in host
# vectors today, so `troupe forward --backend cuda` hands host row pointers to the
# kernels and faults (seen 2026-11-30, reported at the next cuBLAS call) until the
# pools in device memory land.
set -euo pipefail
bundle=$(cd "$1" && pwd) out=$2
mkdir -p "$out"
check() {  # name, prompt length, decode steps, init-model options...
  local name=$1 n=$2 steps=$3
  shift 3
  local dir=/tmp/fc-$name
  "$bundle/run.sh" troupe init-model "$@" --dtype bf16 --out "$dir" > /dev/null
  local ids
  ids=$(python3 -c "import random; random.seed(7); print(','.join(str(random.randrange(2, 1000)) for _ in range($n + $steps)))")
  for b in cpu cuda; do
    local t0=$SECONDS
    "$bundle/run.sh" troupe forward --model "$dir" --ids "$ids" --prefill "$n" --backend "$b" --out "$dir/$b.npy"
    echo "$name $b: $((SECONDS - t0)) s"
  done
  python3 - "$dir" "$name" <<'PY' | tee -a "$out/forward-check.txt"
import sys, numpy as np
d, name = sys.argv[1], sys.argv[2]
c, g = np.load(f"{d}/cpu.npy").astype(np.float64), np.load(f"{d}/cuda.npy").astype(np.float64)
rel = np.linalg.norm(g - c, axis=1) / np.linalg.norm(c, axis=1)
top1 = (g.argmax(1) == c.argmax(1)).mean()
print(f"{name}: rows {c.shape[0]} vocab {c.shape[1]}  rel err median {np.median(rel):.2e} max {rel.max():.2e}"
      f"  top-1 agreement {100 * top1:.1f}%  finite {np.isfinite(g).all()}")
PY
}
check tiny 600 8 --preset tiny --vocab 2000
check flash-shaped-2layer 2100 6 --preset flash-shaped --layers 2 --experts 8 --vocab 4000
