#!/usr/bin/env bash
# The benchmark libraries of kernel variants for bench/gpu/kernel-ab.sh, which builds
# its own through this script; run here first (kernel-ab.sh AB_PREBUILT=1 with the
# libraries carried) so that device time is not spent compiling.
#   bench/gpu/ab-libs.sh OUT NAME[:SOURCE=FILE[,SOURCE=FILE...]] ...
# Each NAME gets OUT/lib-NAME/lib.so: bench/gpu/bench_lib.cu and the tree's kernels, with
# each SOURCE (kernels/cuda/topk.cu) replaced by FILE. The tree's objects are built once
# (OUT/obj) and shared by every variant that does not replace them.
# Example:
#   bench/gpu/ab-libs.sh bundle/main/ablib tree new:kernels/cuda/indexer.cu=/tmp/indexer_new.cu
set -euo pipefail
cd "$(dirname "$0")/../.."
out=$1
shift
nvcc=${NVCC:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}
flags=(-std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a --expt-relaxed-constexpr -Xcompiler -fPIC -I.)
sources=(bench/gpu/bench_lib.cu kernels/cuda/{topk,compressor,indexer,attention,dense}.cu)
jobs=${AB_JOBS:-2}
mkdir -p "$out/obj"
pids=()
compile() {  # SRC OBJ, in the background (at most $jobs at once); finish() waits for them
  while [ "$(jobs -rp | wc -l)" -ge "$jobs" ]; do wait -n; done
  rm -f "$2"  # a failed compile must not leave an older object to be linked
  "$nvcc" "${flags[@]}" ${AB_EXTRA_FLAGS:-} -c "$1" -o "$2" &
  pids+=($!)
}
finish() {  # every compile started, each one's status (a bare `wait` returns 0 whatever failed)
  for pid in "${pids[@]}"; do wait "$pid"; done
  pids=()
}
# The tree's objects (rebuilt when the source or any header of kernels/cuda is newer).
header=$(ls -t kernels/cuda/*.cuh kernels/cuda/*.hpp | head -1)
for src in "${sources[@]}"; do
  obj=$out/obj/$(basename "$src" .cu).o
  if [ ! -f "$obj" ] || [ "$src" -nt "$obj" ] || [ "$header" -nt "$obj" ]; then
    compile "$src" "$obj"
  fi
done
finish
for spec in "$@"; do
  name=${spec%%:*} repl=
  [ "$spec" != "$name" ] && repl=${spec#*:}
  dir=$out/lib-$name
  mkdir -p "$dir"
  objs=()
  IFS=, read -ra pairs <<< "$repl"
  for src in "${sources[@]}"; do
    obj=$out/obj/$(basename "$src" .cu).o
    for pair in "${pairs[@]}"; do
      if [ "${pair%%=*}" = "$src" ]; then
        obj=$dir/$(basename "$src" .cu).o
        compile "${pair#*=}" "$obj"
      fi
    done
    objs+=("$obj")
  done
  finish
  "$nvcc" -shared -gencode=arch=compute_90a,code=sm_90a -o "$dir/lib.so" "${objs[@]}"
  echo "built $dir/lib.so"
done
