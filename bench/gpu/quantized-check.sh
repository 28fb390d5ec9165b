#!/usr/bin/env bash
# On the GPU machine, one call: the CUDA backend's path over FP8 / FP4 codes (TROUPE_CUDA_QUANTIZED=1)
# checked and timed against the default, which dequantizes a quantized checkpoint into bf16 as it loads.
#   bench/gpu/quantized-check.sh BUNDLE OUT
# BUNDLE: a device-bundle of troupe, troupe_gpu_e2e and kernels_cuda_backend_test.
# Stages (each with a time limit; a failed stage does not stop the others):
#   1. kernels_cuda_backend_test's quantized cases (every op over codes against the CPU backend's quantized
#      ops), and compute-sanitizer memcheck over them
#   2. the committed fixtures through troupe_gpu_e2e fixtures with codes kept (the fp8_fp4 fixture holds a
#      DeepSeek-layout checkpoint: FP8 linears, FP4 experts), against transformers' logits and the CPU's
#   3. a Flash-shaped 4-layer model quantized as DeepSeek ships V4 (init-model --quantize fp4: FP8 linears,
#      FP4 experts): teacher-forced logits with codes kept against the dequantized load (top-1 agreement,
#      relative L2), then the steady decode step of both at BATCHES (step-ab.sh)
# STEP_SETTINGS: the step A/B's settings, space-separated ("as-built TROUPE_CUDA_QUANTIZED=1"; as-built: none;
# E2E_BIN=NAME in one runs that binary of the bundle, as step-ab.sh).
# NCU=1: before the step A/B, a batch-1 step with codes kept and without split into kernels (ncu over two eager
# steps, bench/gpu/ncu_steps.py). The step A/B's runs' JSON lines go to OUT/step-runs.jsonl; their "profile"
# lines (a step split into groups of ops) are printed last.
# LOGITS_Q ("0 1"): the settings stage 3's logits run, each compared with the first. SKIP_SAN=1: no memcheck.
# STEP_ONLY=1 skips stages 1 and 2, SKIP_TESTS=1 stage 1; FIX_Q ("0 1"): the settings stage 2 runs. Budgets: TEST_S (120), FIX_S (150), STEP_S (300). BATCHES (1,8,64).
source "$(dirname "$0")/check-env.sh" "$@"  # here, bundle, out, count; NCCL_NVLS_ENABLE=0, the tokenizer, OUT/smi.txt
if [ "${STEP_ONLY:-0}" != 1 ] && [ "${SKIP_TESTS:-0}" != 1 ]; then
  TROUPE_CUDA_QUANTIZED=1 timeout "${TEST_S:-120}" "$bundle/run.sh" kernels_cuda_backend_test \
    --gtest_filter='*quantized*' > "$out/test.log" 2>&1
  echo "quantized backend test: $(count $? "$out/test.log")"
  grep -E "Failure|Expected|max|error" "$out/test.log" | head -12
  if [ "${SKIP_SAN:-0}" != 1 ]; then
    LD_LIBRARY_PATH="$bundle/lib:${LD_LIBRARY_PATH:-}" timeout "${TEST_S:-120}" compute-sanitizer --tool memcheck \
      --error-exitcode 9 "$bundle/kernels_cuda_backend_test" --gtest_filter='*quantized*' > "$out/sanitizer.log" 2>&1
    echo "memcheck (quantized cases): exit $? ($(grep -m1 'ERROR SUMMARY' "$out/sanitizer.log"))"
  fi
fi
if [ "${STEP_ONLY:-0}" != 1 ]; then
  for q in ${FIX_Q:-0 1}; do
    TROUPE_CUDA_QUANTIZED=$q timeout "${FIX_S:-150}" "$bundle/run.sh" troupe_gpu_e2e fixtures \
      --dir "$here/tests/fixtures/model" > "$out/fixtures_q$q.jsonl" 2> "$out/fixtures_q$q.err"
    echo "fixtures, TROUPE_CUDA_QUANTIZED=$q: exit $?"
    python3 - "$out/fixtures_q$q.jsonl" << 'EOF'
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    if r.get("kind") == "fixture" and r.get("backend") == "cuda" and r["fixture"] in ("fp8_fp4", "basic") and r["weights"] != "f32":
        print(f"  {r['fixture']:9s} {r['weights']:4s} {r['mode'][:28]:28s} top1 {r['top1']:.4f} rel_l2 {r['rel_l2']:.2e} "
              f"vs cpu top1 {r['vs_cpu_top1']:.4f} rel_l2 {r['vs_cpu_rel_l2']:.2e} finite {r['finite']}")
EOF
  done
fi
model=/dev/shm/flash-fp4
if [ ! -e "$model/config.json" ]; then
  timeout 200 "$bundle/run.sh" troupe init-model --preset flash-shaped --quantize fp4 --seed 0 --out "$model" \
    > "$out/init.log" 2>&1 || { echo "init-model failed"; tail -5 "$out/init.log"; }
fi
du -sh "$model" | tee -a "$out/smi.txt"
python3 -c "
import numpy as np; np.random.seed(5)
np.save('$out/ids.npy', np.random.randint(0, 120000, size=(${POSITIONS:-1024},)).astype(np.int64))"
for q in ${LOGITS_Q:-0 1}; do
  TROUPE_CUDA_QUANTIZED=$q timeout 150 "$bundle/run.sh" troupe_gpu_e2e logits --model "$model" --ids "$out/ids.npy" \
    --prefill "${PREFILL:-256}" --weights auto --out "$out/logits_q$q.npy" > "$out/logits_q$q.json" 2> "$out/logits_q$q.err"
  echo "logits, TROUPE_CUDA_QUANTIZED=$q: exit $? $(cut -c1-300 "$out/logits_q$q.json")"
done
python3 - "$out" ${LOGITS_Q:-0 1} << 'EOF'
import numpy as np, sys
o, settings = sys.argv[1], sys.argv[2:]
try:
    base = np.load(f"{o}/logits_q{settings[0]}.npy")
except Exception as e:
    print("logits compare: missing", e); sys.exit(0)
base = base.reshape(-1, base.shape[-1])
for q in settings[1:]:
    try:
        b = np.load(f"{o}/logits_q{q}.npy")
    except Exception as e:
        print("logits compare: missing", e); continue
    b = b.reshape(-1, b.shape[-1])
    top = (base.argmax(-1) == b.argmax(-1)).mean()
    rel = np.linalg.norm(base - b) / np.linalg.norm(base)
    print(f"TROUPE_CUDA_QUANTIZED={q} against ={settings[0]}: top-1 agreement {top:.4f} over {b.shape[0]} positions, "
          f"rel L2 {rel:.2e}, max abs {np.abs(base - b).max():.3e}, finite {np.isfinite(b).all()}")
EOF
if [ "${NCU:-0}" = 1 ]; then  # a batch-1 step by kernel, codes kept and not
  for q in 1 0; do
    TROUPE_CUDA_QUANTIZED=$q timeout 150 ncu --profile-from-start off --clock-control none --cache-control none --metrics gpu__time_duration.sum \
      --csv "$bundle/run.sh" troupe_gpu_e2e profile-steps --model "$model" --prompt 512 --steps 2 > "$out/ncu_q$q.csv" 2>&1
    python3 "$here/bench/gpu/ncu_steps.py" "$out/ncu_q$q.csv" 2 > "$out/ncu_q$q.md"; head -30 "$out/ncu_q$q.md"
  done
fi
settings=()
for st in ${STEP_SETTINGS:-as-built TROUPE_CUDA_QUANTIZED=1}; do settings+=("${st#as-built}"); done
STEP_LOG=$out/step-runs.jsonl ROUNDS=${ROUNDS:-2} SMI=1 timeout "${STEP_S:-300}" "$here/bench/gpu/step-ab.sh" "$bundle" "$model" "${BATCHES:-1,8,64}" \
  "${settings[@]}" 2>&1 | tee "$out/step-ab.txt"
python3 - "$out/step-runs.jsonl" << 'EOF'
import json, sys
try:
    lines = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("{")]
except OSError:
    sys.exit(0)
for r in lines:
    if r.get("kind") == "profile":
        top = sorted(r["us_per_step"].items(), key=lambda kv: -kv[1])[:8]
        print(f"profile {r['setting'] or 'as built'} batch {r['batch_run']}: eager {r['total_us']:.0f} us:",
              ", ".join(f"{k} {v:.0f}" for k, v in top))
EOF
