#!/usr/bin/env python3
"""Writes docs/cache-plan.md: the pool sizes `troupe plan` picks for V4-Flash
shapes (bench/configs/v4-flash/config.json, 43 layers, no weights needed) at
several device budgets and context mixes.

Usage: scripts/plan_table.py [--troupe build/bin/troupe]
"""
import argparse
import os
import re
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = "bench/configs/v4-flash"
BUDGETS = ["24GiB", "80GiB", "120GiB"]
MIXES = [
    ("chat", "2K:0.6,8K:0.3,32K:0.1"),
    ("mixed", "4K:0.7,32K:0.25,128K:0.05"),
    ("long", "32K:0.5,128K:0.4,1M:0.1"),
    ("1M only", "1M"),
]
POOLS = ["window", "csa_entry", "csa_index", "hca_entry", "hca_ring"]


def plan(troupe, memory, mix, extra=()):
    out = subprocess.run([troupe, "plan", "--model", CONFIG, "--memory", memory, "--mix", mix, *extra],
                         cwd=ROOT, check=True, capture_output=True, text=True).stdout
    pools = {}
    for line in out.splitlines():
        f = line.split()
        if f and f[0] in POOLS:
            pools[f[0]] = dict(page=int(f[1]), pages=int(f[2]), bytes=f[3] + " " + f[4], share=f[5])
    seqs = re.search(r"-> (\d+) sequences at once", out).group(1)
    per_seq = re.search(r"tokens, ([\d.]+ \w+) per sequence", out).group(1)
    alone = re.search(r"reaches (\d+) tokens", out).group(1)
    header = out.splitlines()[:2]
    return pools, seqs, per_seq, alone, header


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--troupe", default=os.path.join(ROOT, "build/bin/troupe"))
    args = ap.parse_args()
    lines = []
    w = lines.append
    pools, _, _, alone, header = plan(args.troupe, "80GiB", MIXES[1][1])
    w("# KV cache pool plans for V4-Flash shapes")
    w("")
    w("Made by `scripts/plan_table.py` from `troupe plan --model bench/configs/v4-flash --memory M --mix MIX`")
    w("(cache/planner.hpp). The config has V4-Flash's shapes: 43 layers (2 sliding-only, 21 CSA at rate 4,")
    w("20 HCA at rate 128), head_dim 512, indexer 64 x 128, window 128. State rows are fp32, as the")
    w("forward pass writes them today (bf16/fp8 rows would halve/quarter every figure).")
    w("")
    w("## Parameters")
    w("")
    w("- `--memory`: device bytes for the pools (what remains after weights and activations).")
    w("- `--mix TOKENS[:WEIGHT],...`: the expected context lengths of live sequences and their shares.")
    w("  A sequence of T tokens holds ceil(T/128) pages of each entry pool, two window pages and one HCA ring.")
    w("- `--cache-share S`: share of the bytes kept for cached prefixes beyond the live sequences (default 0).")
    w("- `--ratios window=..,csa_entry=..`: explicit shares per pool instead of a mix.")
    w("- `--page-tokens N`, `--slab-bytes B`: page and slab sizes (defaults: the window, four of the largest pages).")
    w("")
    w("The plan is where the pools start. At run time empty slabs move between pools as demand shifts")
    w("(cache/pool/pool_set.hpp), and when memory runs out new requests wait (admission control).")
    w("")
    w("Page sizes (bytes): " + ", ".join(f"{p} {pools[p]['page']:,}" for p in POOLS) + ".")
    w(f"Entry state: 13,760 bytes per token. One sequence alone in 80 GiB reaches {int(alone):,} tokens.")
    w("")
    w("## Live sequences that fit, and the bytes per pool")
    w("")
    w("| budget | mix | per sequence | sequences | " + " | ".join(POOLS) + " |")
    w("|---|---|---|---|" + "---|" * len(POOLS))
    for budget in BUDGETS:
        for name, mix in MIXES:
            pools, seqs, per_seq, _, _ = plan(args.troupe, budget, mix)
            cells = [f"{pools[p]['bytes']} ({pools[p]['share']})" for p in POOLS]
            w(f"| {budget} | {name} `{mix}` | {per_seq} | {seqs} | " + " | ".join(cells) + " |")
    w("")
    w("## With a prefix cache share")
    w("")
    w("| budget | mix | cache share | sequences | " + " | ".join(POOLS) + " |")
    w("|---|---|---|---|" + "---|" * len(POOLS))
    for share in ["0.2", "0.5"]:
        pools, seqs, _, _, _ = plan(args.troupe, "80GiB", MIXES[1][1], ["--cache-share", share])
        cells = [f"{pools[p]['pages']:,} pages" for p in POOLS]
        w(f"| 80GiB | mixed | {share} | {seqs} | " + " | ".join(cells) + " |")
    w("")
    with open(os.path.join(ROOT, "docs/cache-plan.md"), "w") as f:
        f.write("\n".join(lines))


if __name__ == "__main__":
    main()
