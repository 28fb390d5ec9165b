#!/usr/bin/env python3
"""Compares two logit digests (bench/gpu/logit_digest.py), e.g. one build's run on two cards.

    digest_compare.py A.npz B.npz [--oracle hf_fp32] [--pair NAME_IN_A=NAME_IN_B ...]

For each logits file both digests hold: on how many positions the top-1 id differs between A and B, and the
largest difference of the top-1 value and of the row checksum. Then, inside each digest, every troupe run's
flips against the oracle (top-1 ids unequal), so that a card's change can be pinned to one side: if the
oracle's row moved between A and B and troupe's did not, the oracle's card arithmetic moved the agreement.
--pair compares logits that carry different names in the two digests (e.g. one setting that was the served
form in A's build and an alternative in B's), besides those of the same name.
"""
import argparse

import numpy as np

ap = argparse.ArgumentParser()
ap.add_argument("a")
ap.add_argument("b")
ap.add_argument("--oracle", default="hf_fp32")
ap.add_argument("--pair", action="append", default=[], metavar="NAME_IN_A=NAME_IN_B")
args = ap.parse_args()
A, B = np.load(args.a), np.load(args.b)


def names(d):
    return sorted({k.rsplit(".", 1)[0] for k in d.files if k.endswith(".top1") and d[k].size > 1})


print(f"{'logits':32} {'top-1 differs':>13} {'max |top-1 value diff|':>23} {'max |row sum diff|':>19}")
pairs = [(n, n) for n in sorted(set(names(A)) & set(names(B)))] + [tuple(p.split("=", 1)) for p in args.pair]
for na, nb in pairs:
    if f"{na}.top1" not in A.files or f"{nb}.top1" not in B.files:
        print(f"{na}={nb}: not in both digests")
        continue
    ta, tb = A[f"{na}.top1"], B[f"{nb}.top1"]
    dv = np.abs(A[f"{na}.v1"] - B[f"{nb}.v1"]).max()
    ds = np.abs(A[f"{na}.sum"] - B[f"{nb}.sum"]).max()
    label = na if na == nb else f"{na}={nb}"
    print(f"{label:32} {int((ta != tb).sum()):>13} {dv:>23.3e} {ds:>19.3e}")
for label, d in (("A", A), ("B", B)):
    if f"{args.oracle}.top1" not in d.files:
        continue
    o = d[f"{args.oracle}.top1"]
    for n in names(d):
        if n.startswith("troupe"):
            flips = np.nonzero(d[f"{n}.top1"] != o)[0]
            print(f"{label}: {n} against {args.oracle}: {flips.size} flips at {flips[:12].tolist()}")
