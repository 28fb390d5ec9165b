#!/usr/bin/env bash
# On the GPU machine, one call: the KV tiers on the CUDA backend.
#   bench/gpu/tier-check.sh BUNDLE OUT
# BUNDLE: a device-bundle of troupe and engine_test. Stages (each with a time limit, TIER_S seconds, default 200):
#   1. engine_test's Offload tests (OffloadGpu: one sequence past a capped device tier with cold CSA entries in
#      mapped pinned host memory, against the same request uncapped) on a tiny model made here
#   2. bench/gpu/pool_budget_check.py: --kv-memory-fraction on CUDA (budget against the card's free memory)
#   3. bench/gpu/offload_bench.py on a Flash-shaped model (troupe init-model --preset flash-shaped --dtype bf16,
#      made in /dev/shm): a prompt FACTOR (3) times what the capped pools reach, decode rate against uncapped
# SKIP_OFFLOAD_BENCH=1 skips stage 3.
source "$(dirname "$0")/check-env.sh" "$@"  # here, bundle, out, count; NCCL_NVLS_ENABLE=0, OUT/smi.txt
cd "$here"
lim=${TIER_S:-200}
"$bundle/run.sh" troupe init-model --preset tiny --vocab 512 --out /tmp/tier-tiny512 > /dev/null
TROUPE_TEST_MODEL=/tmp/tier-tiny512 timeout "$lim" "$bundle/run.sh" engine_test --gtest_filter='Offload*' \
  > "$out/offload_test.log" 2>&1
echo "engine_test Offload*: $(count $? "$out/offload_test.log")"
grep -E "offload  \]|SKIPPED|Failure" -A2 "$out/offload_test.log" | head -12
timeout "$lim" python3 bench/gpu/pool_budget_check.py --troupe "$bundle/run.sh troupe" \
  --model tests/fixtures/model/basic_bf16 --out "$out/pool" > "$out/pool.log" 2>&1
echo "pool budget check: exit $?"
cat "$out/pool/pool-budget.md" 2> /dev/null
if [ "${SKIP_OFFLOAD_BENCH:-0}" != 1 ]; then
  flash=/dev/shm/tier-flash
  [ -f $flash/config.json ] || "$bundle/run.sh" troupe init-model --preset flash-shaped --dtype bf16 --seed 0 \
    --out $flash > /dev/null
  timeout "$lim" python3 bench/gpu/offload_bench.py --troupe "$bundle/run.sh troupe" --model $flash \
    --out "$out/offload" --factor "${FACTOR:-3}" > "$out/offload_bench.log" 2>&1
  echo "offload bench: exit $?"
  cat "$out/offload/offload.md" 2> /dev/null || tail -5 "$out/offload_bench.log"
fi
