#!/usr/bin/env python3
"""On the GPU machine: a KV pool budget given as a fraction, on the CUDA backend (CudaBackend::memory_info,
cudaMemGetInfo), as an operator meets it. For each case `troupe serve --backend cuda` starts on 127.0.0.1 with
--kv-memory-fraction F (and the case's other flags); once it answers /health the script reads its
troupe_kv_budget_bytes gauges and the card's free memory (nvidia-smi), sends completions, and checks:

  - the device budgets of the workers add up to F of the memory free after the weights, within 10 %
    (free after the weights = what nvidia-smi says is free now + the pages the pools already took);
  - with --pool-mix the pools took their pages up front: the card's free memory fell by about the budget;
  - every completion answers 200 with text, and no page is left leased or leaked afterwards.

  bench/gpu/pool_budget_check.py --troupe "BUNDLE/run.sh troupe" --model DIR --out OUT

Writes OUT/pool-budget.md (a table) and OUT/pool-budget-CASE.log (the server's log); exit 1 when a check fails.
"""
import argparse
import json
import os
import shlex
import subprocess
import sys
import time

from served import NotServing, Served, metrics, request, summed

MIB = 1 << 20


def smi_free_bytes(backend="cuda"):
    if backend == "cpu":  # what the CPU backend's memory_info reads (a dry run of this script off the GPU machine)
        for line in open("/proc/meminfo"):
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    out = subprocess.run(["nvidia-smi", "--query-gpu=memory.free", "--format=csv,noheader,nounits"],
                         check=True, capture_output=True, text=True).stdout
    return int(out.split()[0]) * MIB


def run_case(args, name, fraction, extra, port):
    want_workers = int(extra[extra.index("--workers") + 1]) if "--workers" in extra else 1
    cmd = shlex.split(args.troupe) + ["serve", "--backend", args.backend, "--model", args.model, "--host", "127.0.0.1",
                                      "--port", str(port), "--kv-memory-fraction", str(fraction)] + extra
    free_before = smi_free_bytes(args.backend)
    row = dict(case=name, flags=" ".join(["--kv-memory-fraction", str(fraction)] + extra), ok=False, note="")
    try:
        with Served(cmd, os.path.join(args.out, f"pool-budget-{name}.log"), port, args.start_s, 30) as server:
            # The workers publish their gauges once their engines run (a moment after /health answers).
            end = time.time() + 30
            while True:
                m = metrics(port)
                budget = summed(m, "troupe_kv_budget_bytes", 'tier="device"')
                workers = sum(1 for k in m if k.startswith("troupe_kv_budget_bytes{") and 'tier="device"' in k)
                if workers >= want_workers or time.time() > end:
                    break
                time.sleep(0.2)
            free_now = smi_free_bytes(args.backend)
            # The pools' pages taken so far (with --pool-mix: the plan's, up front).
            taken = summed(m, "troupe_pool_pages", 'state="free"') + summed(m, "troupe_pool_pages", 'state="in_use"')
            status, body = 0, ""
            texts = []
            model = server.model_id()
            for i in range(args.requests):
                status, body = request(port, "/v1/completions", {"model": model,
                                                                 "prompt": [(7 * i + j) % 200 + 1 for j in range(24)],
                                                                 "max_tokens": 16, "temperature": 0})
                if status != 200:
                    break
                texts.append(json.loads(body)["choices"][0]["text"])
            time.sleep(0.5)
            after = metrics(port)
    except NotServing as e:
        row["note"] = str(e)
        return row
    leased = summed(after, "troupe_pool_pages", 'state="leased"')
    leaked = summed(after, "troupe_leaked_pages")
    row.update(free_before_mib=free_before / MIB, free_running_mib=free_now / MIB, budget_mib=budget / MIB,
               pool_pages=taken, requests=len(texts), leased=leased, leaked=leaked)
    problems = []
    if status != 200:
        problems.append(f"completion answered {status}: {body[:200]}")
    if any(not t for t in texts):
        problems.append("an empty completion")
    if leased or leaked:
        problems.append(f"{leased:.0f} pages leased, {leaked:.0f} leaked after the requests")
    if budget <= 0:
        problems.append("no device budget reported")
    if "--pool-mix" in extra and args.backend == "cuda":  # (the CPU's pages are touched lazily)
        # The plan's pages were taken at start: the card's free memory fell by about the budget.
        drop = free_before - free_now
        row["free_drop_mib"] = drop / MIB
        if not 0.9 * budget <= drop <= 1.1 * budget + 2048 * MIB:
            problems.append(f"free memory fell by {drop / MIB:.0f} MiB, the budget is {budget / MIB:.0f} MiB")
        base = free_now + budget  # free after the weights, as the engine read it (pages bought since)
    else:
        base = free_now
    share = budget / base if base > 0 else 0.0
    row["share"] = share
    if not 0.9 * fraction <= share <= 1.1 * fraction:
        problems.append(f"budget is {share:.3f} of the free memory, asked {fraction}")
    row["ok"] = not problems
    row["note"] = "; ".join(problems)
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--troupe", required=True, help="the troupe command (a bundle's 'run.sh troupe')")
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--backend", default="cuda", help="cuda (the check), or cpu (a dry run of the script)")
    ap.add_argument("--fractions", default="0.5,0.6,0.8", help="the three cases' fractions")
    ap.add_argument("--port", type=int, default=18431)
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--start-s", type=float, default=120)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    f = [float(x) for x in args.fractions.split(",")]
    cases = [("one-worker", f[0], []),
             ("two-workers", f[1], ["--workers", "2"]),
             ("mix", f[2], ["--pool-mix", "4K:0.7,32K:0.3"])]
    rows = [run_case(args, name, f, extra, args.port + i) for i, (name, f, extra) in enumerate(cases)]
    cols = ["case", "flags", "free_before_mib", "free_running_mib", "free_drop_mib", "budget_mib", "share",
            "pool_pages", "requests", "leased", "leaked", "ok", "note"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        cells = []
        for c in cols:
            v = r.get(c, "")
            cells.append(f"{v:.4g}" if isinstance(v, float) else str(v))
        lines.append("| " + " | ".join(cells) + " |")
    table = "\n".join(lines) + "\n"
    with open(os.path.join(args.out, "pool-budget.md"), "w") as f:
        f.write(table)
    print(table)
    sys.exit(0 if all(r["ok"] for r in rows) else 1)


if __name__ == "__main__":
    main()
