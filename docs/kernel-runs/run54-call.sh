#!/bin/bash
# Session 54's prepared device call (not run: no device machine was lent). On the GPU machine, from the
# repository root, with bundle/b54.tar.xz carried. Three top-k sources: head (HEAD's topk.cu), rare (with
# docs/kernel-runs/run54-topk-rare-paths.patch), sb (rare with run54-topk-span-bounds.patch, timed under
# TROUPE_TOPK_LOCAL_BOUNDS=1; the test binary is built from sb, whose default equals rare). bench/gpu/topk-check.sh
# runs the top-k tests, memcheck, head / rare / sb at the nine PERF-TARGETS shapes and rare's sampled-path stamps;
# then the sampled tests under TROUPE_TOPK_LOCAL_BOUNDS=2 and =1, TROUPE_TOPK_EARLY_FILTER=0 and
# TROUPE_TOPK_FUSED=1; memcheck under LOCAL_BOUNDS=2; sb's stamps; ncu of 8 x 1 M's kernels; racecheck over the
# one-chunk rows. Results in $OUT/all.tgz.
# The bundle, here (~6 min on 2 cores):
#   git apply docs/kernel-runs/run54-topk-rare-paths.patch && cp kernels/cuda/topk.cu /tmp/topk_rare.cu
#   git apply docs/kernel-runs/run54-topk-span-bounds.patch
#   cmake --build build --target kernels_cuda_kernels_test
#   git show HEAD:kernels/cuda/topk.cu > /tmp/topk_head.cu
#   bench/gpu/ab-libs.sh bundle/b54/ab sb head:kernels/cuda/topk.cu=/tmp/topk_head.cu \
#       rare:kernels/cuda/topk.cu=/tmp/topk_rare.cu && rm -rf bundle/b54/ab/obj
#   ../shared/tools/device-bundle bundle/b54 build/bin/kernels_cuda_kernels_test
#   strip --strip-debug bundle/b54/kernels_cuda_kernels_test
#   (cd bundle && tar cf - b54 | xz -T2 -9 > b54.tar.xz)   # ~12 MB
# then: device run `bash docs/kernel-runs/run54-call.sh`, carry ["bundle/b54.tar.xz"], ~400-500 s of wall.
R=$OUT/r; mkdir -p $R
trap 'cd $OUT && tar czf all.tgz r' EXIT
cd /tmp && tar xJf $OLDPWD/bundle/b54.tar.xz && cd $OLDPWD
B=/tmp/b54 T=/tmp/b54/kernels_cuda_kernels_test
FILTER='*topk*' SAN_TOOLS=memcheck SAN_FILTER='*topk_sampled*:*topk_rows_of_one_chunk*' \
  AB_NAMES="head rare sb" AB_ENV_head= AB_ENV_rare= AB_ENV_sb=TROUPE_TOPK_LOCAL_BOUNDS=1 AB_LIB_DIR=$B/ab \
  CASES=65536x1,65536x8,65536x64,262144x1,262144x8,262144x64,1048576x1,1048576x8,1048576x64 \
  STAMPS=1048576x8,262144x64 STAMP_LIB=rare bench/gpu/topk-check.sh $B $R/check
for e in TROUPE_TOPK_LOCAL_BOUNDS=2 TROUPE_TOPK_LOCAL_BOUNDS=1 TROUPE_TOPK_EARLY_FILTER=0 TROUPE_TOPK_FUSED=1; do
  ( env $e timeout 30 $B/run.sh $T --gtest_filter='*topk_sampled*:*share_a_workspace*'; echo "rc=$?" ) > $R/tests-$e.log 2>&1
done
tail -2 $R/tests-*.log
export LD_LIBRARY_PATH=$B/lib:$LD_LIBRARY_PATH
( TROUPE_TOPK_LOCAL_BOUNDS=2 timeout 40 compute-sanitizer --tool memcheck $T --gtest_filter='*topk_sampled*' | tail -4 ) > $R/memcheck-lb.log 2>&1
tail -3 $R/memcheck-lb.log
for s in 1048576x8 262144x64; do
  TROUPE_TOPK_LOCAL_BOUNDS=1 TROUPE_TOPK_SAMPLED=1 timeout 15 python3 bench/gpu/topk_ncu.py stamps $B/ab/lib-sb/lib.so ${s%x*} ${s#*x}
done > $R/stamps-sb.log 2>&1
cat $R/stamps-sb.log
timeout 60 bench/gpu/topk-ncu.sh $B/ab/lib-sb/lib.so $R/ncu 1048576x8:TROUPE_TOPK_SAMPLED=1 \
  1048576x8:TROUPE_TOPK_SAMPLED=1,TROUPE_TOPK_LOCAL_BOUNDS=1 > $R/ncu.log 2>&1; cat $R/ncu.log
( timeout 40 compute-sanitizer --tool racecheck $T --gtest_filter='*topk_rows_of_one_chunk*' | tail -4 ) > $R/racecheck.log 2>&1
tail -3 $R/racecheck.log
