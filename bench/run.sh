#!/usr/bin/env bash
# Runs every benchmark script in bench/ (each writes its section of docs/benchmarks.md).
set -euo pipefail
cd "$(dirname "$0")/.."
for s in bench/*.sh; do
  [ "$s" = bench/run.sh ] && continue
  echo "== $s"
  "$s"
done
