#!/usr/bin/env python3
"""Sums an ncu CSV (--metrics gpu__time_duration.sum --csv) per kernel name and
prints a markdown table of microseconds per decode step.

  ncu_steps.py NCU.csv STEPS"""
import csv
import io
import re
import sys

path, steps = sys.argv[1], int(sys.argv[2])
text = open(path, errors="replace").read()
# ncu prints its own lines (==PROF== ...) and the program's stdout around the CSV.
lines = [l for l in text.splitlines() if l.startswith('"')]
rows = list(csv.DictReader(io.StringIO("\n".join(lines))))
scale = {"nsecond": 1e-3, "usecond": 1.0, "msecond": 1e3, "second": 1e6}
per = {}
count = {}
for r in rows:
    if r.get("Metric Name") != "gpu__time_duration.sum":
        continue
    name = r.get("Kernel Name", "?")
    name = name.replace("(anonymous namespace)::", "").replace("<unnamed>::", "").replace("troupe::kernels::cuda::", "")
    name = re.sub(r"^void ", "", name)
    depth = 0
    for i, ch in enumerate(name):  # drop the argument list (the first "(" outside <...>)
        depth += ch == "<"
        depth -= ch == ">"
        if ch == "(" and depth == 0:
            name = name[:i]
            break
    us = float(r["Metric Value"].replace(",", "")) * scale.get(r.get("Metric Unit", "nsecond"), 1e-3)
    per[name] = per.get(name, 0.0) + us
    count[name] = count.get(name, 0) + 1
total = sum(per.values())
print(f"Kernels of {steps} eager batch-1 decode steps (ncu gpu__time_duration, clocks as found): "
      f"{total / steps:.1f} us of kernel time a step, {sum(count.values()) / steps:.0f} launches a step.\n")
print("| kernel | us / step | launches / step | share |")
print("|---|---|---|---|")
for name, us in sorted(per.items(), key=lambda kv: -kv[1]):
    print(f"| {name[:90]} | {us / steps:.1f} | {count[name] / steps:g} | {100 * us / total:.1f}% |")
