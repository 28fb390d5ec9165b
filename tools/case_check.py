#!/usr/bin/env python3
"""One kept oracle case (oracle_fuzz --keep: config.json, weights, ids.npy, logits.npy,
meta.json) through `troupe forward` under several environment settings: the max
|logit - expected| overall and where along the sequence the error starts, so that a
backend's mismatch can be narrowed to a kernel path (its A/B switches).

  tools/case_check.py CASE_DIR --troupe "CMD" [--backend cuda] [--prefill N] [SETTING ...]
  SETTING: "" (as found) or "NAME=VALUE[,NAME=VALUE...]"
"""
import argparse
import os
import shlex
import subprocess
import sys
import tempfile

import numpy as np


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("case")
    ap.add_argument("settings", nargs="*", default=[""])
    ap.add_argument("--troupe", default="build/bin/troupe")
    ap.add_argument("--backend", default="cuda")
    ap.add_argument("--weights", default="f32")
    ap.add_argument("--prefill", type=int, default=None)
    ap.add_argument("--threshold", type=float, default=1e-4, help="a row's error counts as a mismatch above this")
    args = ap.parse_intermixed_args()
    ids = np.load(os.path.join(args.case, "ids.npy")).tolist()
    want = np.load(os.path.join(args.case, "logits.npy"))
    out = os.path.join(tempfile.mkdtemp(prefix="case_check_"), "out.npy")
    worst = 0.0
    for setting in args.settings or [""]:
        env = dict(os.environ)
        for kv in filter(None, setting.split(",")):
            k, v = kv.split("=", 1)
            env[k] = v
        cmd = shlex.split(args.troupe) + ["forward", "--model", args.case, "--ids", ",".join(map(str, ids)), "--out", out,
                                          "--backend", args.backend, "--weights", args.weights]
        if args.prefill is not None:
            cmd += ["--prefill", str(args.prefill)]
        p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
        if p.returncode != 0:
            print(f"[{setting or 'as found'}] troupe failed: {(p.stderr or p.stdout).strip()[-400:]}", flush=True)
            continue
        got = np.load(out)
        rows = np.abs(got - want).max(axis=1)
        bad = np.nonzero(rows > args.threshold)[0]
        worst = max(worst, float(rows.max()))
        first = int(bad[0]) if len(bad) else -1
        print(f"[{setting or 'as found'}] max {rows.max():.3e} at position {int(rows.argmax())}; "
              f"{len(bad)} of {len(rows)} rows above {args.threshold:g}, the first at {first}; "
              f"rows there on: {' '.join(f'{e:.1e}' for e in rows[max(first, 0):max(first, 0) + 8])}", flush=True)
    return 0 if worst <= 1e-3 else 1


if __name__ == "__main__":
    sys.exit(main())
