#!/usr/bin/env bash
# One decode step of a V4-Flash-shaped layer on the CPU backend, next to
# transformers on PyTorch (CPU, fp32, same shapes) in the same run, and writes
# the table into docs/benchmarks.md. The peer needs torch + transformers: run
# scripts/setup-bench once (a large download), or set BENCH_PYTHON.
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${BUILD:-build}
PY=${BENCH_PYTHON:-.venv-bench/bin/python}
cmake --build "$BUILD" --target troupe cpu_layer_bench >/dev/null
models="$BUILD/bench-models"
mkdir -p "$models"
rows=""
# The bench re-executes itself with OPENBLAS_CORETYPE set where OpenBLAS would
# pick its generic kernels: the kernel set it runs with is the last one named.
core=$(OPENBLAS_VERBOSE=2 "$BUILD/bin/cpu_layer_bench" --help 2>&1 | grep Core | tail -1 | cut -d: -f2 | xargs || true)
isa=$(grep -q avx512f /proc/cpuinfo && echo AVX-512 || (grep -q avx2 /proc/cpuinfo && echo AVX2 || echo scalar))
for t in csa hca; do
  dir="$models/flash-layer-$t"
  [ -f "$dir/model.safetensors" ] || "$BUILD/bin/troupe" init-model --preset flash-shaped --layer-types $t --vocab 1024 --out "$dir"
  long=$([ $t = csa ] && echo compressed_sparse_attention || echo heavily_compressed_attention)
  for ctx in 4096 65536; do
    # TRIALS alternating runs of each side; the best median of each is kept
    # (the machine is shared: single runs vary by 2x).
    ours=1e9 peer=1e9
    have_peer=$("$PY" -c "import torch, transformers" 2>/dev/null && echo 1 || echo 0)
    for trial in $(seq "${TRIALS:-3}"); do
      o=$("$BUILD/bin/cpu_layer_bench" --model "$dir" --context $ctx --steps 5 | sed 's/.*"ms_per_step": \([0-9.]*\).*/\1/')
      ours=$(python3 -c "print(min($ours, $o))")
      if [ "$have_peer" = 1 ]; then
        q=$("$PY" bench/model/hf_layer_peer.py --layer-type $long --context $ctx --steps 5 | sed 's/.*"ms_per_step": \([0-9.]*\).*/\1/')
        peer=$(python3 -c "print(min($peer, $q))")
      fi
    done
    if [ "$have_peer" = 1 ]; then
      peer=$(python3 -c "print(f'{$peer:.1f}')")
      ours=$(python3 -c "print(f'{$ours:.1f}')")
      ratio=$(python3 -c "print(f'{$peer/$ours:.2f}x')")
    else
      peer="n/a"; ratio="n/a (no torch: scripts/setup-bench)"
    fi
    rows+="| $long | $ctx | $ours | $peer | $ratio |"$'\n'
    echo "$long context $ctx: troupe $ours ms, transformers $peer ms"
  done
done
section="## CPU: one decode step of a V4-Flash-shaped layer

\`bench/cpu_layer.sh\`, $(date -u +%Y-%m-%d), $(nproc) cores ($(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs)),
fp32; products by troupe's batch-invariant kernel (kernels/cpu/cpu_gemm.cpp, $isa), attention
scores by OpenBLAS ($core kernels).
One layer (hidden 4096, 64 heads x 512, q_lora 1024, o 8 x 1024, index 64 x 128
top-512, window 128, 16 experts top-6 x 2048), state filled to the context, median
of 5 steps, the best of ${TRIALS:-3} alternating runs of each side. Peer: transformers 5.17 \`DeepseekV4ForCausalLM\` with the same single
layer on PyTorch (CPU, fp32, eager), measured in the same run.

| layer | context | troupe ms/step | transformers ms/step | speed-up |
|---|---|---|---|---|
$rows"
python3 bench/update_benchmarks.py "CPU: one decode step of a V4-Flash-shaped layer" "$section"
