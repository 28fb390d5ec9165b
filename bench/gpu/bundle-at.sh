#!/usr/bin/env bash
# Builds troupe_gpu_e2e at another commit (a worktree under WT, default /tmp/troupe-at) and bundles it for the
# GPU machine, so that one device call can compare builds on the same card and oracle (e2e.sh ALT_BUNDLES).
#   bench/gpu/bundle-at.sh COMMIT OUT [TARGET ...]
# OUT: the device-bundle folder to make (bundle/at-<short> by convention; bundle/ is ignored by git). TARGETs:
# the binaries to build and bundle (default troupe_gpu_e2e). Built RelWithDebInfo like the main tree, then
# stripped of debug info. ~9 minutes a commit on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/../.."
commit=$1 out=$2
shift 2
targets=("${@:-troupe_gpu_e2e}")
wt=${WT:-/tmp/troupe-at}/$(git rev-parse --short "$commit")
[ -d "$wt" ] || git worktree add -f --detach "$wt" "$commit" > /dev/null
cmake -S "$wt" -B "$wt/build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo > "$wt/cmake.log"
ninja -C "$wt/build" "${targets[@]}" > "$wt/build.log"
bins=()
for t in "${targets[@]}"; do bins+=("$wt/build/bin/$t"); done
rm -rf "$out"
../shared/tools/device-bundle "$out" "${bins[@]}" > "$wt/bundle.log"
for t in "${targets[@]}"; do strip --strip-debug "$out/$t"; done
echo "bundled $(git rev-parse --short "$commit") in $out"
