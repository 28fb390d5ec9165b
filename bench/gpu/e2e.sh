#!/usr/bin/env bash
# On the GPU machine, one call: the GPU backend end to end, checked and timed
# next to transformers on the same card.
#   bench/gpu/e2e.sh BUNDLE OUT [FIXTURES_DIR]
# BUNDLE: a device-bundle (../shared/tools/device-bundle) of troupe,
# troupe_gpu_e2e, kernels_cuda_backend_test and model_tests, or a .tar.xz of one.
# Stages (each with a time limit, all within E2E_DEADLINE seconds, default 540;
# a failed stage does not stop the others):
#   1. kernel tests (every backend op against the CPU backend, graphs, copy queue)
#      and the Decoder's GPU test
#   2. the committed fixtures through the CUDA backend (one call; prefill then
#      Decoder steps replayed from graphs), bf16 and fp32 weights
#   3. a Flash-shaped 4-layer model (troupe init-model --preset flash-shaped
#      --dtype bf16 --seed 0) loaded by transformers (bf16 eager, and the same
#      weights in fp32) and by troupe: teacher-forced top-1 agreement; generate
#      throughput of both at batch 1 and 8; troupe's decode at 4K and 128K
#      context; engine::Engine on CUDA with a parked-and-resumed request
# SKIP_TESTS=1 skips stage 1, SKIP_HF=1 transformers, SKIP_EXTRA=1 the long-context and engine stages.
# POSITIONS (320) / PREFILL (192): the agreement run's length and its prefill part.
# Writes OUT/results.jsonl (every JSON line), OUT/log.txt, OUT/tests.txt and
# OUT/e2e.md (the tables for docs/benchmarks.md); prints the summary last.
#
# The figures in docs/benchmarks.md (2026-11-30): a bundle of a RelWithDebInfo
# build, binaries stripped of debug info, as OUT.tar.xz (16 MB); then
#   E2E_DEADLINE=370 TEST_S=60 POSITIONS=2304 PREFILL=256 bench/gpu/e2e.sh e2e.tar.xz $OUT
# (about 150 s; the flash-shaped model is generated there, ~20 s). The device
# tool sends the checkout of the session that calls it: from another worktree,
# copy bench/, tests/fixtures/model and the bundle into a folder that
# .git/info/exclude ignores, carry it, and set TROUPE_TOKENIZER_DIR to the
# checkout's model/tokenizer/data/deepseek-v4.
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
bundle=$1 out=$2 fixtures=${3:-$here/../../tests/fixtures/model}
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
# init-model (and the tests' models) copy the shipped tokenizer; the bundle has none.
if [ -z "${TROUPE_TOKENIZER_DIR:-}" ] && [ -d "$here/../../model/tokenizer/data/deepseek-v4" ]; then
  export TROUPE_TOKENIZER_DIR=$(cd "$here/../../model/tokenizer/data/deepseek-v4" && pwd)
fi
mkdir -p "$out"
out=$(cd "$out" && pwd)
if [[ $bundle == *.tar.xz ]]; then
  mkdir -p /tmp/e2e-bundle && tar xJf "$bundle" -C /tmp/e2e-bundle && bundle=$(ls -d /tmp/e2e-bundle/*/ | head -1)
fi
bundle=$(cd "$bundle" && pwd)
shm=/dev/shm/troupe-e2e
mkdir -p "$shm"
R=$out/results.jsonl L=$out/log.txt
: > "$R"
# The test binaries look for the fixtures where they were built.
src=${BUILD_SOURCE_DIR:-/work/wt/gpu}  # TROUPE_SOURCE_DIR of the build
if [ -n "$src" ] && [ ! -e "$src/tests/fixtures/model" ]; then
  mkdir -p "$src/tests/fixtures" && ln -s "$(cd "$fixtures" && pwd)" "$src/tests/fixtures/model"
fi
deadline=${E2E_DEADLINE:-540}  # seconds for the whole script: a stage gets at most what is left
stage() {  # name, seconds, command...: JSON lines to results.jsonl, the rest to log.txt
  local name=$1 limit=$2 t0=$SECONDS
  shift 2
  local left=$((deadline - SECONDS))
  if [ "$left" -lt 10 ]; then echo "stage $name: skipped (deadline)" | tee -a "$L"; return; fi
  [ "$limit" -gt "$left" ] && limit=$left
  timeout "$limit" "$@" >> "$R" 2>> "$L"
  local rc=$?
  echo "stage $name: exit $rc, $((SECONDS - t0)) s" | tee -a "$L"
}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader | tee -a "$L"

if [ "${SKIP_TESTS:-0}" != 1 ]; then
  t0=$SECONDS
  timeout "${TEST_S:-100}" "$bundle/run.sh" kernels_cuda_backend_test > "$out/tests.txt" 2>&1
  echo "kernels_cuda_backend_test: exit $?, $(grep -c '^\[       OK' "$out/tests.txt") ok, $(grep -c '^\[  FAILED' "$out/tests.txt") failed lines, $((SECONDS - t0)) s" | tee -a "$L"
  t0=$SECONDS
  timeout 60 "$bundle/run.sh" model_tests --gtest_filter='Decoder*:DenseState*' > "$out/model_tests.txt" 2>&1
  echo "model_tests (Decoder, DenseState): exit $?, $(grep -c '^\[       OK' "$out/model_tests.txt") ok, $(grep -c '^\[  FAILED' "$out/model_tests.txt") failed lines, $((SECONDS - t0)) s" | tee -a "$L"
  grep -E "decoder  \]|FAILED|Failure" "$out/model_tests.txt" | head -20 | tee -a "$L"
  cat "$out/model_tests.txt" >> "$out/tests.txt" && rm "$out/model_tests.txt"
  grep -E "^\[  FAILED|Failure|error" "$out/tests.txt" | head -20 | tee -a "$L"
fi

stage fixtures 90 "$bundle/run.sh" troupe_gpu_e2e fixtures --dir "$fixtures"

model=$shm/flash
if [ ! -f "$model/config.json" ]; then
  stage init-model 150 "$bundle/run.sh" troupe init-model --preset flash-shaped --dtype bf16 --seed 0 --out "$model"
fi
prefill=${PREFILL:-192}
if [ "${SKIP_HF:-0}" != 1 ]; then
  stage transformers 200 python3 "$here/e2e_hf.py" --model "$model" --positions "${POSITIONS:-320}" \
    --ids-out "$shm/ids.npy" --bf16-out "$shm/hf_bf16.npy" --fp32-out "$shm/hf_fp32.npy"
fi
stage logits 60 "$bundle/run.sh" troupe_gpu_e2e logits --model "$model" --ids "$shm/ids.npy" --prefill "$prefill" \
  --out "$shm/troupe_logits.npy"
python3 "$here/e2e_report.py" "$out" "$shm" "$prefill" 2>&1 | grep -A4 "^| reference" | tee -a "$L"
stage bench-b1 60 "$bundle/run.sh" troupe_gpu_e2e bench --model "$model" --batch 1 --prompt 512 --new 32
[ "${SKIP_EXTRA:-0}" = 1 ] || stage engine 90 "$bundle/run.sh" troupe_gpu_e2e engine --model "$model" --batch 8 --prompt 512 --new 32
stage bench-b8 60 "$bundle/run.sh" troupe_gpu_e2e bench --model "$model" --batch 8 --prompt 512 --new 32
[ "${SKIP_EXTRA:-0}" = 1 ] || stage context 90 "$bundle/run.sh" troupe_gpu_e2e context --model "$model" --contexts "${CONTEXTS:-4096,131072}" --steps 50
tail -n 30 "$L" | grep -v "^stage" | tail -n 12
python3 "$here/e2e_report.py" "$out" "$shm" "$prefill" > "$out/report.txt" 2>&1
cat "$out/report.txt"
