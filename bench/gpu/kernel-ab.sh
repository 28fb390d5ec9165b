#!/usr/bin/env bash
# On the GPU machine: the kernel benchmark (bench/gpu/bench.py) over variants of one
# kernel source, each built into its own benchmark library, in one call, then one
# table of every variant's times side by side (ab.md in OUT).
#   bench/gpu/kernel-ab.sh OUT SOURCE NAME=FILE [NAME=FILE ...] [-- bench.py options]
# SOURCE: the tree's file the variants replace (kernels/cuda/topk.cu); FILE: a copy of
# it to build instead ("tree" builds SOURCE itself). AB_PREBUILT=1 with AB_LIB_DIR
# holding lib-NAME/lib.so: those libraries as they are (built here, carried along).
# AB_ENV_NAME="VAR=value ...": environment for that variant's run only (one library
# timed under several settings: copy lib-NAME to a second name and give each its own).
# Example:
#   bench/gpu/kernel-ab.sh out/ab kernels/cuda/topk.cu before=ab/topk_a.cu after=tree -- --only topk,indexer
set -euo pipefail
cd "$(dirname "$0")/../.."
out=$1 source=$2
shift 2
variants=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do variants+=("$1"); shift; done
[ "${1:-}" = "--" ] && shift
mkdir -p "$out"
for v in "${variants[@]}"; do  # built by ab-libs.sh (outside OUT: the objects need not come back)
  name=${v%%=*} file=${v#*=}
  dir=${AB_LIB_DIR:-/tmp/kernel-ab}/lib-$name
  [ "${AB_PREBUILT:-0}" = 1 ] && [ -f "$dir/lib.so" ] && continue  # built elsewhere (AB_LIB_DIR carried along)
  spec=$name
  [ "$file" != tree ] && spec=$name:$source=$file
  AB_JOBS=${AB_JOBS:-6} bench/gpu/ab-libs.sh "${AB_LIB_DIR:-/tmp/kernel-ab}" "$spec"
done
for v in "${variants[@]}"; do
  name=${v%%=*}
  echo "== $name"
  mkdir -p "$out/$name"
  envs=AB_ENV_$name
  # shellcheck disable=SC2086  # the variant's settings are words VAR=value
  env ${!envs:-} PYTHONUNBUFFERED=1 python3 bench/gpu/bench.py "${AB_LIB_DIR:-/tmp/kernel-ab}/lib-$name/lib.so" --out "$out/$name" \
    "$@" | grep -E "phases|failures"
done
python3 - "$out" "${variants[@]%%=*}" <<'PY'
import json, sys
out, names = sys.argv[1], sys.argv[2:]
runs = {n: json.load(open(f"{out}/{n}/bench.json")) for n in names}
cols = ["ours_us", "finish1_us", "grid_us", "stream_us", "sampled_us"]
keys = []
for n in names:
    for r in runs[n]["rows"]:
        k = (r["kernel"], r["shape"])
        if k not in keys:
            keys.append(k)
head = "| kernel | shape | " + " | ".join(f"{n} {c}" for c in cols for n in names) + " | exact |"
lines = [head, "|" + "---|" * (3 + len(cols) * len(names))]
for k in keys:
    cells, exact = [], []
    for c in cols:
        for n in names:
            r = next((r for r in runs[n]["rows"] if (r["kernel"], r["shape"]) == k), {})
            cells.append(f"{r[c]:.2f}" if isinstance(r.get(c), (int, float)) else "")
            if c == cols[0] and "exact" in r:
                exact.append(str(r["exact"]))
    lines.append(f"| {k[0]} | {k[1]} | " + " | ".join(cells) + f" | {'/'.join(exact)} |")
lines.append("")
lines.append("failures: " + "; ".join(f"{n}: {runs[n]['failures'] or 'none'}" for n in names))
open(f"{out}/ab.md", "w").write("\n".join(lines) + "\n")
print("\n".join(lines))
PY
