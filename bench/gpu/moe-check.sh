#!/usr/bin/env bash
# On the GPU machine, one call: the batched MoE (TROUPE_MOE_BATCHED=1: MoE calls past 8 rows whose experts
# average 4 or more rows as cuBLAS batched GEMMs over every expert's rows) checked and timed against the
# default (grouped GEMVs, 8 rows a pass).
#   bench/gpu/moe-check.sh BUNDLE OUT
# BUNDLE: a device-bundle of troupe, troupe_gpu_e2e and kernels_cuda_backend_test.
# Stages (each with a time limit; a failed stage does not stop the others):
#   1. kernels_cuda_backend_test's MoE cases, default and with TROUPE_MOE_BATCHED=1 (rows 40 and 64 then take the
#      batched path, within bf16 tolerance of the CPU), and compute-sanitizer memcheck over the batched run
#   2. a Flash-shaped 4-layer bf16 model (init-model --preset flash-shaped --dtype bf16): the steady decode step of
#      both settings at BATCHES (step-ab.sh), then a table: step, routed experts' share of it (the bench's profile
#      line), and how many of the last run's generated tokens (first and last a sequence) the two settings share
# BATCHES (8,16,64), ROUNDS (1), SKIP_TESTS=1, SKIP_SAN=1; budgets TEST_S (120), STEP_S (300).
source "$(dirname "$0")/check-env.sh" "$@"  # here, bundle, out; NCCL_NVLS_ENABLE=0, the tokenizer, OUT/smi.txt
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  for on in 0 1; do
    TROUPE_MOE_BATCHED=$on timeout "${TEST_S:-120}" "$bundle/run.sh" kernels_cuda_backend_test --gtest_filter='*moe*' \
      > "$out/test_batched$on.log" 2>&1
    echo "MoE backend tests, TROUPE_MOE_BATCHED=$on: exit $? ($(grep -c '^\[       OK' "$out/test_batched$on.log") ok," \
      "$(grep -c '^\[  FAILED' "$out/test_batched$on.log") failed lines)"
    grep -E "Failure|Expected|max abs|rows " "$out/test_batched$on.log" | head -8
  done
  if [ "${SKIP_SAN:-0}" != 1 ]; then
    TROUPE_MOE_BATCHED=1 LD_LIBRARY_PATH="$bundle/lib:${LD_LIBRARY_PATH:-}" timeout "${TEST_S:-120}" compute-sanitizer \
      --tool memcheck --error-exitcode 9 "$bundle/kernels_cuda_backend_test" --gtest_filter='*moe_matches*' \
      > "$out/sanitizer.log" 2>&1
    echo "memcheck (batched MoE): exit $? ($(grep -m1 'ERROR SUMMARY' "$out/sanitizer.log"))"
  fi
fi
model=/dev/shm/flash-bf16
if [ ! -e "$model/config.json" ]; then
  timeout 200 "$bundle/run.sh" troupe init-model --preset flash-shaped --dtype bf16 --seed 0 --out "$model" \
    > "$out/init.log" 2>&1 || { echo "init-model failed"; tail -5 "$out/init.log"; }
fi
STEP_LOG=$out/step-runs.jsonl ROUNDS=${ROUNDS:-1} timeout "${STEP_S:-300}" "$here/bench/gpu/step-ab.sh" "$bundle" "$model" \
  "${BATCHES:-8,16,64}" "" TROUPE_MOE_BATCHED=1 2>&1 | tee "$out/step-ab.txt"
python3 - "$out/step-runs.jsonl" << 'EOF' | tee "$out/moe-table.md"
import json, sys
try:
    lines = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("{")]
except OSError:
    sys.exit(0)
bench, prof = {}, {}
for r in lines:
    key = (r["batch_run"], r["setting"] or "default")
    if r.get("kind") == "bench":
        bench[key] = r
    elif r.get("kind") == "profile":
        prof[key] = r
print("| batch | setting | steady step (ms) | routed experts (us a step, eager profile) | tokens shared with default |")
print("|---|---|---|---|---|")
for (b, s) in sorted(bench):
    r = bench[(b, s)]
    routed = prof.get((b, s), {}).get("us_per_step", {}).get("routed experts")
    base = bench.get((b, "default"), {}).get("tokens_last_run")
    mine = r.get("tokens_last_run")
    shared = ""
    if base and mine:
        pairs = [(x, y) for bs, ms in zip(base, mine) for x, y in zip(bs, ms)]
        shared = f"{sum(x == y for x, y in pairs)}/{len(pairs)}"
    print(f"| {b} | {s} | {r['steady_step_ms']:.3f} | {routed:.0f} | {shared} |" if routed is not None else
          f"| {b} | {s} | {r['steady_step_ms']:.3f} |  | {shared} |")
EOF
