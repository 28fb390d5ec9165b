#!/usr/bin/env bash
# On the GPU machine, one call: the split activations of the cuBLAS GEMMs (backend.cu's gemm_split)
# checked and timed against the rounded forms in the same run.
#   bench/gpu/split-check.sh BUNDLE OUT
# BUNDLE: a device-bundle of troupe, troupe_gpu_e2e, kernels_cuda_backend_test and model_tests (or a
# .tar.xz of one). Steps, each under its own time limit (SPLIT_DEADLINE seconds in all, default 560):
#   1. the GEMM and MoE backend tests as built (split at every shape) and with TROUPE_GEMM_SPLIT=0
#      (rounded) and =2 (split from 128 rows, session 41's rule); DecoderGpu
#   2. decode throughput of the Flash-shaped model (troupe init-model --preset flash-shaped) at
#      batches BATCHES (default "16 64"), prompt 512, 32 new tokens: as built against =2 against =0,
#      alternating, each twice
#   3. the teacher-forced top-1 agreement with transformers fp32 (bench/gpu/e2e.sh's agreement stages)
#      as built and with =2 (the served form's logits from the same binary under each setting)
# SKIP_TESTS=1 skips step 1, SKIP_AGREEMENT=1 step 3.
# Writes OUT/log.txt, OUT/results.jsonl (the bench lines) and OUT/split.md (a table).
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
bundle=$1 out=$2
mkdir -p "$out"
out=$(cd "$out" && pwd)
if [[ $bundle == *.tar.xz ]]; then
  mkdir -p /tmp/split-bundle && tar xJf "$bundle" -C /tmp/split-bundle && bundle=$(ls -d /tmp/split-bundle/*/ | head -1)
fi
bundle=$(cd "$bundle" && pwd)
export NCCL_NVLS_ENABLE=0
if [ -z "${TROUPE_TOKENIZER_DIR:-}" ] && [ -d "$here/../../model/tokenizer/data/deepseek-v4" ]; then
  export TROUPE_TOKENIZER_DIR=$(cd "$here/../../model/tokenizer/data/deepseek-v4" && pwd)
fi
L=$out/log.txt R=$out/results.jsonl
: > "$R"
deadline=${SPLIT_DEADLINE:-560}
left() { echo $((deadline - SECONDS)); }
nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv,noheader | tee -a "$L"

# 1. tests
filter='*linear*:*moe_matches*:*quantized*'
[ "${SKIP_TESTS:-0}" = 1 ] || for mode in default 0 2; do
  env_set=()
  [ "$mode" = default ] || env_set=(TROUPE_GEMM_SPLIT=$mode)
  timeout 150 env "${env_set[@]}" "$bundle/run.sh" kernels_cuda_backend_test --gtest_filter="$filter" > "$out/tests-$mode.txt" 2>&1
  echo "kernels_cuda_backend_test ($filter, TROUPE_GEMM_SPLIT=$mode): exit $?, $(grep -c '^\[       OK' "$out/tests-$mode.txt") ok, $(grep -c '^\[  FAILED' "$out/tests-$mode.txt") failed lines" | tee -a "$L"
  grep -E "Failure|max rel|Expected" "$out/tests-$mode.txt" | head -8 | tee -a "$L"
done
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  timeout 90 "$bundle/run.sh" model_tests --gtest_filter='DecoderGpu*' > "$out/tests-decoder.txt" 2>&1
  echo "model_tests DecoderGpu*: exit $?, $(grep -c '^\[       OK' "$out/tests-decoder.txt") ok" | tee -a "$L"
fi

# 2. decode throughput, alternating settings
shm=/dev/shm/troupe-e2e
model=$shm/flash
mkdir -p "$shm"
if [ ! -f "$model/config.json" ]; then
  timeout 150 "$bundle/run.sh" troupe init-model --preset flash-shaped --dtype bf16 --seed 0 --out "$model" >> "$L" 2>&1
fi
for b in ${BATCHES:-16 64}; do
  for round in 1 2; do
    for mode in default 2 0; do
      [ "$(left)" -lt "${AGREEMENT_S:-200}" ] && { echo "bench batch $b: skipped (deadline)" | tee -a "$L"; break 3; }
      env_set=(TROUPE_VARIANT=split-$mode)
      [ "$mode" = default ] || env_set+=(TROUPE_GEMM_SPLIT=$mode)
      timeout 90 env "${env_set[@]}" "$bundle/run.sh" troupe_gpu_e2e bench --model "$model" --batch "$b" --prompt 512 \
        --new 32 2>> "$L" | grep '"kind"' >> "$R"
    done
  done
done

# 3. agreement (e2e.sh's stages; the rounded rule's logits through a wrapper that sets the variable)
mkdir -p /tmp/split-rule41
printf '#!/bin/sh\nexport TROUPE_GEMM_SPLIT=2\nexec %s/run.sh "$@"\n' "$bundle" > /tmp/split-rule41/run.sh
chmod +x /tmp/split-rule41/run.sh
if [ "${SKIP_AGREEMENT:-0}" != 1 ] && [ "$(left)" -gt 60 ]; then
  E2E_DEADLINE=$(($(left) - 10)) SKIP_TESTS=1 SKIP_FIXTURES=1 SKIP_EXTRA=1 SKIP_B1=1 SKIP_B8=1 F32_AGREEMENT=0 \
    ALT_BUNDLES="rule41=/tmp/split-rule41" "$here/e2e.sh" "$bundle" "$out/e2e" >> "$L" 2>&1
fi
python3 - "$R" > "$out/split.md" <<'EOF'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
for r in rows:
    if r.get("kind") == "error":
        print("error:", r.get("what"))
rows = [r for r in rows if r.get("kind") == "bench"]
print("| batch | setting | steady step ms (each run) | prefill tok/s (each run) | fraction of roofline |")
print("|---|---|---|---|---|")
seen = {}
for r in rows:
    seen.setdefault((r["batch"], r["variant"]), []).append(r)
for (b, v), rs in sorted(seen.items()):
    steps = " / ".join("%.3f" % r["steady_step_ms"] for r in rs)
    prefill = " / ".join("%.0f" % r["prefill_tok_s"] for r in rs)
    print("| %d | %s | %s | %s | %.3f |" % (b, v, steps, prefill, rs[-1]["fraction_of_roofline"]))
EOF
cat "$out/split.md"
grep -A12 "^| troupe" "$out/e2e/report.txt" 2>/dev/null | head -16
