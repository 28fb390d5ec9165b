#!/usr/bin/env bash
# On the GPU machine, one call: the batched MoE (CudaBackend::moe's cuBLAS batched GEMMs over the touched
# experts' rows; TROUPE_MOE_BATCHED unset or 1: bf16 / f16 calls of 2-64 rows; 0: off, the grouped GEMVs and
# the pair path; 2: also at one row) checked and timed.
#   bench/gpu/moe-check.sh BUNDLE OUT
# BUNDLE: a device-bundle of troupe, troupe_gpu_e2e, kernels_cuda_backend_test (and model_tests for the GPU
# decoder's tests). Stages (each with a time limit; a failed stage does not stop the others):
#   1. kernels_cuda_backend_test (all of it, as built), its MoE cases with TROUPE_MOE_BATCHED=0 and =2, and
#      compute-sanitizer memcheck over the MoE cases with =2; model_tests DecoderGpu; the committed fixtures
#      through the CUDA backend (troupe_gpu_e2e fixtures) as built and with =0
#   2. Backend::moe alone (troupe_gpu_e2e moe) at MOE_SHAPES (experts:k:dim:inter), rows MOE_ROWS, with each
#      setting of OP_SETTINGS ("0 2": TROUPE_MOE_BATCHED values, or NAME=VALUE[,NAME=VALUE...]) against
#      TROUPE_MOE_BATCHED=0 (the grouped GEMVs on fp32 x; keep 0 in the list):
#      microseconds a call, touched experts' weight bytes a second, and the two outputs' relative L2 distance
#   3. a Flash-shaped 4-layer bf16 model (init-model --preset flash-shaped --dtype bf16): the steady decode step at
#      BATCHES of each setting in SETTINGS (step-ab.sh), then a table: step, routed experts' share of it (the
#      bench's profile line) and how many of the last run's generated tokens (first and last a sequence) each
#      setting shares with the first setting of the list
# BATCHES (8,16,64), SETTINGS ("TROUPE_MOE_BATCHED=0 -"), ROUNDS (1), MOE_SHAPES, MOE_ROWS, OP_SETTINGS,
# FIXTURE_SETTINGS ("1 0"; empty: none), SKIP_TESTS=1, SKIP_SAN=1, SKIP_OP=1, SKIP_STEP=1; budgets TEST_S (150),
# OP_S (150), STEP_S (300). A device call returns at most 8 files: point OUT at a local folder and archive it.
source "$(dirname "$0")/check-env.sh" "$@"  # here, bundle, out, count; NCCL_NVLS_ENABLE=0, the tokenizer, OUT/smi.txt
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  timeout "${TEST_S:-150}" "$bundle/run.sh" kernels_cuda_backend_test > "$out/backend_test.log" 2>&1
  echo "kernels_cuda_backend_test (as built): $(count $? "$out/backend_test.log")"
  grep -E "Failure|Expected|rows " "$out/backend_test.log" | head -6
  for on in 0 2; do
    TROUPE_MOE_BATCHED=$on timeout "${TEST_S:-150}" "$bundle/run.sh" kernels_cuda_backend_test --gtest_filter='*moe*' \
      > "$out/test_batched$on.log" 2>&1
    echo "MoE backend tests, TROUPE_MOE_BATCHED=$on: $(count $? "$out/test_batched$on.log")"
    grep -E "Failure|Expected|rows " "$out/test_batched$on.log" | head -6
  done
  if [ "${SKIP_SAN:-0}" != 1 ]; then
    TROUPE_MOE_BATCHED=2 LD_LIBRARY_PATH="$bundle/lib:${LD_LIBRARY_PATH:-}" timeout "${TEST_S:-150}" compute-sanitizer \
      --tool memcheck --error-exitcode 9 "$bundle/kernels_cuda_backend_test" --gtest_filter='*moe_matches*' \
      > "$out/sanitizer.log" 2>&1
    echo "memcheck (MoE cases, TROUPE_MOE_BATCHED=2): exit $? ($(grep -m1 'ERROR SUMMARY' "$out/sanitizer.log"))"
  fi
  if [ -x "$bundle/model_tests" ]; then
    src=${BUILD_SOURCE_DIR:-/work/main}  # where the test binary looks for the fixtures
    [ -e "$src/tests/fixtures/model" ] || { mkdir -p "$src/tests/fixtures" && ln -s "$here/tests/fixtures/model" "$src/tests/fixtures/model"; }
    timeout "${TEST_S:-150}" "$bundle/run.sh" model_tests --gtest_filter='DecoderGpu*' > "$out/decoder_gpu.log" 2>&1
    echo "model_tests DecoderGpu: $(count $? "$out/decoder_gpu.log")"
    grep -E "Failure|Expected" "$out/decoder_gpu.log" | head -6
  fi
  for on in ${FIXTURE_SETTINGS-1 0}; do
    TROUPE_MOE_BATCHED=$on timeout 120 "$bundle/run.sh" troupe_gpu_e2e fixtures --dir "$here/tests/fixtures/model" \
      > "$out/fixtures$on.jsonl" 2> "$out/fixtures$on.err"
    echo "fixtures, TROUPE_MOE_BATCHED=$on: exit $?"
  done
  python3 - "$out/fixtures1.jsonl" "$out/fixtures0.jsonl" << 'EOF'
import json, sys
def rows(p):
    try:
        return {(r["fixture"], r["weights"], r["mode"]): r for r in map(json.loads, open(p)) if r.get("backend") == "cuda"}
    except (OSError, ValueError):
        return {}
on, off = rows(sys.argv[1]), rows(sys.argv[2])
print("| fixture | weights | mode | rel L2 vs transformers (batched on) | (off) | top-1 (on / off) |")
print("|---|---|---|---|---|---|")
for key in sorted(on):
    a, b = on[key], off.get(key, {})
    print(f"| {key[0]} | {key[1]} | {key[2]} | {a['rel_l2']:.2e} | {b.get('rel_l2', float('nan')):.2e} | {a['top1']:.3f} / {b.get('top1', float('nan')):.3f} |")
EOF
fi
if [ "${SKIP_OP:-0}" != 1 ]; then
  for shape in ${MOE_SHAPES:-256:6:4096:2048 16:6:4096:2048}; do
    IFS=: read -r e k d i <<< "$shape"
    for on in ${OP_SETTINGS:-0 2}; do
      # a TROUPE_MOE_BATCHED value, or NAME=VALUE[,NAME=VALUE...]
      if [[ $on == *=* ]]; then envs=(${on//,/ }); else envs=(TROUPE_MOE_BATCHED=$on); fi
      tag=$(printf '%s' "$on" | tr -c 'A-Za-z0-9_' '_')
      env "${envs[@]}" TROUPE_VARIANT="$on" timeout "${OP_S:-150}" "$bundle/run.sh" troupe_gpu_e2e moe --experts "$e" \
        --k "$k" --dim "$d" --inter "$i" --rows "${MOE_ROWS:-1,2,4,8,16,32,64}" --dump "$out/moe-$tag-$e" \
        >> "$out/moe-op.jsonl" 2>> "$out/moe-op.err"
      echo "moe op $shape ${envs[*]}: exit $?"
    done
  done
  python3 - "$out" << 'EOF'
import json, sys, os, re
import numpy as np
out = sys.argv[1]
tag = lambda s: re.sub(r"[^A-Za-z0-9_]", "_", s)
runs = {}
for line in open(os.path.join(out, "moe-op.jsonl")):
    if line.startswith("{"):
        r = json.loads(line)
        if r.get("kind") == "moe":
            runs[(r["experts"], r["k"], r["dim"], r["inter"], r["rows"], r["setting"])] = r
print("| experts:k:dim:inter | rows | touched | grouped GEMVs (=0) us | GB/s | setting | us | GB/s | ratio | rel L2 between |")
print("|---|---|---|---|---|---|---|---|---|---|")
for key in sorted({k[:5] for k in runs}):
    a = runs.get(key + ("0",))
    for setting in sorted({k[5] for k in runs if k[:5] == key} - {"0"}):
        b = runs[key + (setting,)]
        if not a:
            continue
        d = ""
        try:
            x = np.load(os.path.join(out, f"moe-0-{key[0]}", f"moe_rows{key[4]}.npy"))
            y = np.load(os.path.join(out, f"moe-{tag(setting)}-{key[0]}", f"moe_rows{key[4]}.npy"))
            d = f"{np.linalg.norm(x - y) / max(np.linalg.norm(x), 1e-30):.2e}"
        except OSError:
            pass
        print(f"| {key[0]}:{key[1]}:{key[2]}:{key[3]} | {key[4]} | {a['touched']} | {a['us']:.1f} | {a['touched_weight_gbs']:.0f} | "
              f"={setting} | {b['us']:.1f} | {b['touched_weight_gbs']:.0f} | {a['us'] / b['us']:.2f} | {d} |")
EOF
  find "$out" -maxdepth 1 -type d -name 'moe-*' -exec rm -rf {} +
fi
[ "${SKIP_STEP:-0}" = 1 ] && exit 0
model=/dev/shm/flash-bf16
if [ ! -e "$model/config.json" ]; then
  timeout 200 "$bundle/run.sh" troupe init-model --preset flash-shaped --dtype bf16 --seed 0 --out "$model" \
    > "$out/init.log" 2>&1 || { echo "init-model failed"; tail -5 "$out/init.log"; }
fi
# SETTINGS: comma-separated NAME=VALUE pairs a setting, settings separated by spaces ("-" for as built)
read -r -a settings <<< "${SETTINGS:-TROUPE_MOE_BATCHED=0 -}"
for i in "${!settings[@]}"; do [ "${settings[$i]}" = - ] && settings[$i]=""; done
STEP_LOG=$out/step-runs.jsonl ROUNDS=${ROUNDS:-1} timeout "${STEP_S:-300}" "$here/bench/gpu/step-ab.sh" "$bundle" "$model" \
  "${BATCHES:-8,16,64}" "${settings[@]}" 2>&1 | tee "$out/step-ab.txt"
python3 - "$out/step-runs.jsonl" << 'EOF' | tee "$out/moe-table.md"
import json, sys
try:
    lines = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("{")]
except OSError:
    sys.exit(0)
bench, prof, first = {}, {}, {}
for r in lines:
    key = (r["batch_run"], r["setting"] or "as built")
    first.setdefault(r["batch_run"], key[1])
    if r.get("kind") == "bench":
        bench[key] = r
    elif r.get("kind") == "profile":
        prof[key] = r
print("| batch | setting | steady step (ms) | routed experts (us a step, eager profile) | tokens shared with the first setting |")
print("|---|---|---|---|---|")
for (b, s) in sorted(bench):
    r = bench[(b, s)]
    routed = prof.get((b, s), {}).get("us_per_step", {}).get("routed experts")
    base = bench.get((b, first[b]), {}).get("tokens_last_run")
    mine = r.get("tokens_last_run")
    shared = ""
    if base and mine:
        pairs = [(x, y) for bs, ms in zip(base, mine) for x, y in zip(bs, ms)]
        shared = f"{sum(x == y for x, y in pairs)}/{len(pairs)}"
    routed_s = f"{routed:.0f}" if routed is not None else ""
    print(f"| {b} | {s} | {r['steady_step_ms']:.3f} | {routed_s} | {shared} |")
EOF
