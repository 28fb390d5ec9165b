#!/usr/bin/env bash
# On the GPU machine, one call: the top-k kernels' tests, compute-sanitizer over a filter of them, and
# (with prebuilt benchmark libraries) an A/B of their times under one setting.
#   bench/gpu/topk-check.sh BUNDLE OUT
# BUNDLE: a device-bundle of kernels_cuda_kernels_test. Stages (each with a time limit):
#   1. kernels_cuda_kernels_test --gtest_filter="$FILTER" (default '*topk*')
#   2. each compute-sanitizer tool of SAN_TOOLS (default "memcheck racecheck") over SAN_FILTER (default
#      '*topk_cluster*'); SKIP_SAN=1 skips
#   3. when AB_LIB_DIR holds lib-NAME/lib.so for each of AB_NAMES (default "before after"): kernel-ab.sh
#      over them with AB_ENV (default TROUPE_TOPK_CLUSTER=16) for every variant whose AB_ENV_NAME is unset,
#      --only topk --topk-cases CASES (default 1048576x1,1048576x8,4194304x1,262144x64); the table is
#      OUT/ab/ab.md
#   4. STAMPS (NxROWS,...; none by default): the fused sampled filter's %globaltimer stamps
#      (bench/gpu/topk_ncu.py stamps) with lib-STAMP_LIB (default the last of AB_NAMES) under
#      TROUPE_TOPK_SAMPLED=1 and the environment as given, into OUT/stamps.txt
# Example (session 51's, run in session 52: the fused path against 97be96d's kernels as "head"):
#   FILTER='*topk_sampled*:*share_a_workspace*' SAN_FILTER='*topk_sampled*' AB_NAMES="head tree treef" \
#   AB_ENV_head= AB_ENV_tree=TROUPE_TOPK_FUSED=1 AB_ENV_treef="TROUPE_TOPK_FUSED=1 TROUPE_TOPK_FUSED_FINISH=1" \
#   CASES=65536x1,65536x8,65536x64,262144x1,262144x8,262144x64,1048576x1,1048576x8,1048576x64 \
#   STAMPS=65536x8,262144x8,1048576x1,1048576x8,1048576x64 STAMP_LIB=tree TROUPE_TOPK_FUSED=1 \
#   bench/gpu/topk-check.sh BUNDLE OUT
# Budgets TEST_S (200), SAN_S (150 each), AB_S (240). A device call returns at most 8 files: point OUT at a
# local folder and archive it.
source "$(dirname "$0")/check-env.sh" "$@"  # here, bundle, out, count; NCCL_NVLS_ENABLE=0, OUT/smi.txt
filter=${FILTER:-*topk*}
timeout "${TEST_S:-200}" "$bundle/run.sh" kernels_cuda_kernels_test --gtest_filter="$filter" > "$out/tests.log" 2>&1
echo "kernels_cuda_kernels_test $filter: $(count $? "$out/tests.log")"
grep -E "^\[  FAILED|Failure|Expected|not the stable" "$out/tests.log" | head -8
if [ "${SKIP_SAN:-0}" != 1 ]; then
  for tool in ${SAN_TOOLS:-memcheck racecheck}; do
    LD_LIBRARY_PATH="$bundle/lib:${LD_LIBRARY_PATH:-}" timeout "${SAN_S:-150}" compute-sanitizer --tool $tool \
      --error-exitcode 9 "$bundle/kernels_cuda_kernels_test" --gtest_filter="${SAN_FILTER:-*topk_cluster*}" \
      > "$out/$tool.log" 2>&1
    echo "$tool ${SAN_FILTER:-*topk_cluster*}: exit $? ($(grep -m1 -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$out/$tool.log"))"
  done
fi
names=(${AB_NAMES:-before after})
have=1
for n in "${names[@]}"; do [ -f "${AB_LIB_DIR:-/nonexistent}/lib-$n/lib.so" ] || have=0; done
if [ $have = 1 ]; then
  specs=()
  for n in "${names[@]}"; do
    specs+=("$n=tree")
    v=AB_ENV_$n
    [ -n "${!v+x}" ] || export "$v=${AB_ENV-TROUPE_TOPK_CLUSTER=16}"
  done
  AB_PREBUILT=1 timeout "${AB_S:-240}" "$here/bench/gpu/kernel-ab.sh" "$out/ab" kernels/cuda/topk.cu "${specs[@]}" -- \
    --only topk --topk-cases "${CASES:-1048576x1,1048576x8,4194304x1,262144x64}" > "$out/ab.log" 2>&1
  echo "kernel-ab: exit $?"
  cat "$out/ab/ab.md" 2>/dev/null || tail -20 "$out/ab.log"
fi
if [ -n "${STAMPS:-}" ]; then
  lib=${AB_LIB_DIR:-/nonexistent}/lib-${STAMP_LIB:-${names[-1]}}/lib.so
  IFS=, read -ra stamp_cases <<< "$STAMPS"
  for c in "${stamp_cases[@]}"; do
    TROUPE_TOPK_SAMPLED=1 timeout 30 python3 "$here/bench/gpu/topk_ncu.py" stamps "$lib" "${c%x*}" "${c#*x}"
  done > "$out/stamps.txt" 2>&1
  cat "$out/stamps.txt"
fi
