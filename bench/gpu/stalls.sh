#!/usr/bin/env bash
# On the GPU machine: where one launch of a kernel stalls, by Nsight Compute's source counters.
#   bench/gpu/stalls.sh LIB PART KERNEL_REGEX SKIP OUT
# LIB: a benchmark library (best built with -lineinfo); PART: what bench/gpu/profile.py runs
# (topk, indexer, attention, compressor, decode); the launch after SKIP launches matching
# KERNEL_REGEX is profiled (clocks left alone). Writes OUT/NAME_sass.csv (the SASS with
# per-instruction samples), OUT/NAME_details.csv and OUT/NAME_stalls.md (bench/gpu/stalls.py),
# NAME = PART-SKIP. NCU_INTERVAL=N: --warp-sampling-interval N (0: every 32 cycles, the most
# samples; default ncu's own).
# Example (session 17: the attention decode at batch 64 is profile.py's third case, second call):
#   bench/gpu/stalls.sh lib-lineinfo/lib.so attention attention_kernel 3 out/stalls
set -euo pipefail
cd "$(dirname "$0")/../.."
lib=$1 part=$2 regex=$3 skip=$4 out=$5
mkdir -p "$out"
name=$part-$skip
ncu --clock-control none ${NCU_INTERVAL:+--warp-sampling-interval $NCU_INTERVAL} --section SourceCounters --section WarpStateStats --section SpeedOfLight \
  --import-source yes -k "regex:$regex" --launch-skip "$skip" --launch-count 1 -o "$out/$name" \
  python3 bench/gpu/profile.py "$lib" "$part" > "$out/$name.ncu.log" 2>&1
ncu -i "$out/$name.ncu-rep" --page source --csv --print-source sass > "$out/${name}_sass.csv"
ncu -i "$out/$name.ncu-rep" --page details --csv > "$out/${name}_details.csv"
rm -f "$out/$name.ncu-rep"
python3 bench/gpu/stalls.py "$out/${name}_sass.csv" > "$out/${name}_stalls.md"
head -n 3 "$out/${name}_stalls.md"
