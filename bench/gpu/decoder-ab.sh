#!/usr/bin/env bash
# On the GPU machine: the Decoder's GPU test (CUDA decode steps against the CPU
# forward) under several environment settings, for A/B checks of kernel variants.
#   bench/gpu/decoder-ab.sh BUNDLE [SETTING ...]
# BUNDLE: a device-bundle holding model_tests. SETTING: "" (as built) or
# NAME=VALUE[,NAME=VALUE...]. Prints each setting's per-sequence errors and verdict.
set -uo pipefail
bundle=$1
shift
[ $# -gt 0 ] || set -- ""
here=$(cd "$(dirname "$0")/../.." && pwd)
export TROUPE_TOKENIZER_DIR=${TROUPE_TOKENIZER_DIR:-$here/model/tokenizer/data/deepseek-v4}
for setting in "$@"; do
  t0=$SECONDS
  log=$(env ${setting//,/ } timeout 120 "$bundle/run.sh" model_tests --gtest_filter='DecoderGpu.*' 2>&1)
  rc=$?
  echo "== ${setting:-as built}: exit $rc, $((SECONDS - t0)) s"
  grep -E "decoder  \]|Failure|Expected|Which is|actual|^\[  (FAILED|PASSED|  OK)" <<< "$log" | head -24
  [ "$rc" = 0 ] || tail -n 8 <<< "$log"
done
