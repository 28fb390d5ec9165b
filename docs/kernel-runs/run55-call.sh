#!/bin/bash
# Session 55's device call: the indexer's sampled form (TROUPE_INDEXER_SAMPLED=1; kernels/cuda/indexer.cu,
# topk_after_scan in topk.cu). On the GPU machine, from the repository root, with bundle/b55.tar.xz carried.
# Tests (default, sampled, sampled without PDL), memcheck and racecheck of the sampled indexer test, then the
# indexer benchmark, base against sampled (one library, two settings), at three shapes and two seeds.
# The bundle, here (with docs/kernel-runs/run55-indexer-sampled.patch applied to the tree):
#   cmake --build build --target kernels_cuda_kernels_test
#   bench/gpu/ab-libs.sh bundle/b55/ab base && rm -rf bundle/b55/ab/obj && cp -r bundle/b55/ab/lib-base bundle/b55/ab/lib-samp
#   ../shared/tools/device-bundle bundle/b55 build/bin/kernels_cuda_kernels_test
#   strip --strip-debug bundle/b55/kernels_cuda_kernels_test
#   (cd bundle && tar cf - b55 | xz -T2 -9 > b55.tar.xz)
R=$OUT/r; mkdir -p $R
trap 'cd $OUT && tar czf all.tgz r' EXIT
cd /tmp && tar xJf $OLDPWD/bundle/b55.tar.xz && cd $OLDPWD
B=/tmp/b55 T=/tmp/b55/kernels_cuda_kernels_test
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv,noheader > $R/smi.txt
F='*indexer_scores_and_topk*:*topk_sampled*:*share_a_workspace*'
tests() {  # settings..., as words VAR=value
  local n=$(echo "$*" | tr ' =' '__')
  ( env "$@" timeout 90 $B/run.sh $T --gtest_filter="$F"; echo "rc=$?" ) > $R/tests_$n.log 2>&1
  echo "tests [$*]: $(grep -E '^\[  (PASSED|FAILED)' $R/tests_$n.log | tr '\n' ' ') $(tail -1 $R/tests_$n.log)"
  grep -E "Failure|Expected|Which is|sampled form" $R/tests_$n.log | head -6
}
ab() {  # seed
  AB_PREBUILT=1 AB_LIB_DIR=$B/ab AB_ENV_base= AB_ENV_samp=TROUPE_INDEXER_SAMPLED=1 timeout 150 \
    bench/gpu/kernel-ab.sh $R/ab$1 kernels/cuda/indexer.cu base=tree samp=tree -- --only indexer \
    --indexer-cases 262144x1,262144x2,163840x1 --seed $1 > $R/ab$1.log 2>&1
  echo "seed $1: exit $?"; grep -E "indexer" $R/ab$1/ab.md | cut -d'|' -f2-5,8 || tail -5 $R/ab$1.log
}
san() {  # tool seconds
  ( TROUPE_INDEXER_SAMPLED=1 timeout $2 compute-sanitizer --tool $1 $T --gtest_filter='*indexer_scores_and_topk*' | tail -4 ) > $R/$1.log 2>&1
  echo "$1: $(grep -E 'SUMMARY|PASSED|FAILED' $R/$1.log | tr '\n' ' ')"
}
tests TROUPE_INDEXER_SAMPLED=1
ab 0
tests TROUPE_INDEXER_SAMPLED=1 TROUPE_PDL=0
export LD_LIBRARY_PATH=$B/lib:$LD_LIBRARY_PATH
san memcheck 100
tests NONE=1
ab 1
san racecheck 80
