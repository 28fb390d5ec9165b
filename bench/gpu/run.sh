#!/usr/bin/env bash
# On the GPU machine: builds the kernel library for the benchmark (unless
# TROUPE_BENCH_LIB names a built one), then checks and times every fast kernel
# next to the PyTorch composition of the same math and torch.topk, with the
# card's copy bandwidth measured in the same run. Writes bench.md / bench.json.
#   bench/gpu/run.sh [OUTDIR] [bench.py options: --quick, --only topk,indexer]
set -euo pipefail
cd "$(dirname "$0")/../.."
out=${1:-${OUT:-bench-out}}
shift || true
mkdir -p "$out"
lib=${TROUPE_BENCH_LIB:-build-bench/libtroupe_bench.so}
if [ ! -f "$lib" ]; then
  dir=$(dirname "$lib")
  mkdir -p "$dir"
  nvcc=${NVCC:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}
  pids=() objs=()
  for src in bench/gpu/bench_lib.cu kernels/cuda/{topk,compressor,indexer,attention,dense}.cu; do
    obj=$dir/$(basename "$src" .cu).o
    objs+=("$obj")
    "$nvcc" -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a --expt-relaxed-constexpr -Xcompiler -fPIC -I. \
      -c "$src" -o "$obj" &
    pids+=($!)
  done
  for p in "${pids[@]}"; do wait "$p"; done
  "$nvcc" -shared -gencode=arch=compute_90a,code=sm_90a -o "$lib" "${objs[@]}"
fi
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv || true
PYTHONUNBUFFERED=1 python3 bench/gpu/bench.py "$lib" --out "$out" "$@"
