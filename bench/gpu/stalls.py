#!/usr/bin/env python3
"""Summarizes one kernel launch's warp-stall samples from Nsight Compute's source page
(`ncu -i REP --page source --csv --print-source sass`, a report taken with --section SourceCounters):
the totals by stall reason, then per BUCKET bytes of code (default 4096) the samples, the
instruction-fetch stalls (no_inst) and the instructions executed, with the instructions that
hold at least 1/200 of the samples. Code never executed shows as buckets with nothing; a
kernel whose CTAs run long stretches once shows its instruction-cache misses as no_inst.

  stalls.py SASS.csv [BUCKET]"""
import csv
import sys


def main():
    path = sys.argv[1]
    bucket = int(sys.argv[2]) if len(sys.argv) > 2 else 4096
    lines = open(path, errors="replace").read().splitlines()
    head = [i for i, line in enumerate(lines) if line.startswith('"Address"')]
    if not head:
        sys.exit(f"{path}: no source-page table (was the report taken with --section SourceCounters?)")
    rows = list(csv.DictReader(lines[head[0]:]))
    reasons = [c for c in rows[0] if c.startswith("stall_") and "Not Issued" not in c]
    total = sum(int(r["Warp Stall Sampling (All Samples)"] or 0) for r in rows)
    by_reason = sorted(((c[6:], sum(int(r[c] or 0) for r in rows)) for c in reasons), key=lambda x: -x[1])
    print(f"{path}: {len(rows)} instructions, {total} samples; " +
          ", ".join(f"{n} {v}" for n, v in by_reason[:8]))
    base = int(rows[0]["Address"], 16)
    buckets = {}
    for r in rows:
        b = buckets.setdefault((int(r["Address"], 16) - base) // bucket, {"samples": 0, "no_inst": 0, "exec": 0, "hot": []})
        s = int(r["Warp Stall Sampling (All Samples)"] or 0)
        b["samples"] += s
        b["no_inst"] += int(r["stall_no_inst"] or 0)
        b["exec"] += int(r["Instructions Executed"] or 0)
        if s >= max(3, total // 200):
            top = sorted(((c[6:], int(r[c] or 0)) for c in reasons), key=lambda x: -x[1])[:2]
            b["hot"].append(f"{r['Address'][-5:]} {s:5d} {r['Source'].strip()[:60]:60s} " +
                            " ".join(f"{n}={v}" for n, v in top if v))
    print("| code | samples | no_inst | executed |")
    print("|---|---|---|---|")
    for k in sorted(buckets):
        b = buckets[k]
        print(f"| {k * bucket // 1024} KB | {b['samples']} | {b['no_inst']} | {b['exec']} |")
    for k in sorted(buckets):
        for h in buckets[k]["hot"]:
            print(f"  {k * bucket // 1024:4d} KB  {h}")


if __name__ == "__main__":
    main()
