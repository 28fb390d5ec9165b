#!/usr/bin/env python3
"""Digest of teacher-forced logits files, small enough to keep and compare across cards and runs.

    logit_digest.py OUT.npz FILE.npy ...

For each file (rows = positions, columns = the vocabulary): the top-1 and top-2 ids, the top-1 and top-2
values, and a float64 checksum of each row. Two runs of one build on two cards can then be told apart
position by position (which side moved, and where) without carrying 1 GB of logits.
"""
import os
import sys

import numpy as np

out, files = sys.argv[1], sys.argv[2:]
digest = {}
for f in files:
    x = np.load(f, mmap_mode="r")
    x = x.reshape(-1, x.shape[-1])
    name = os.path.splitext(os.path.basename(f))[0]
    top1, top2, v1, v2, sums = [], [], [], [], []
    for i in range(0, x.shape[0], 256):
        b = np.asarray(x[i:i + 256], dtype=np.float32)
        part = np.argpartition(-b, 1, axis=1)[:, :2]
        vals = np.take_along_axis(b, part, axis=1)
        order = np.argsort(-vals, axis=1, kind="stable")
        part, vals = np.take_along_axis(part, order, 1), np.take_along_axis(vals, order, 1)
        top1.append(part[:, 0]); top2.append(part[:, 1]); v1.append(vals[:, 0]); v2.append(vals[:, 1])
        sums.append(b.astype(np.float64).sum(axis=1))
    for key, parts in (("top1", top1), ("top2", top2), ("v1", v1), ("v2", v2), ("sum", sums)):
        digest[f"{name}.{key}"] = np.concatenate(parts)
    print(f"{name}: {x.shape[0]} rows, checksum {np.concatenate(sums).sum():.9e}")
np.savez_compressed(out, **digest)
