#!/usr/bin/env python3
"""Runs each fast kernel a few times eagerly (no graphs), for Nsight Compute:
   ncu --clock-control none --section SpeedOfLight --section WarpStateStats \
       -k regex:'topk_kernel|indexer_mma|indexer_wgmma|attention_kernel|compress_kernel' python3 bench/gpu/profile.py LIB
"""
import math
import sys

import torch

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from bench import Bench, fl, ptr, stream  # noqa: E402


def main():
    b = Bench(sys.argv[1], quick=True)
    L = b.lib
    # top-k: one row of 262,144
    n, k = 262144, 512
    x = torch.randn(1, n, device="cuda")
    out = torch.empty(1, k, dtype=torch.int32, device="cuda")
    cnt = torch.empty(1, dtype=torch.int32, device="cuda")
    ws = torch.zeros(16, dtype=torch.uint8, device="cuda")
    for _ in range(2):
        L.tb_topk(ptr(x), n, None, 1, n, k, ptr(out), ptr(cnt), ptr(ws), 0, stream())
    # indexer + top-k: 1M context, batch 1, bf16 keys
    H, D = 64, 128
    keys = torch.randn(n, D, device="cuda").to(torch.bfloat16)
    q = torch.randn(1, H, D, device="cuda")
    w = torch.randn(1, H, device="cuda")
    start = torch.zeros(1, dtype=torch.int64, device="cuda")
    nk = torch.full((1,), n, dtype=torch.int32, device="cuda")
    scores = torch.empty(1, n, device="cuda")
    wsi = torch.zeros(max(L.tb_indexer_topk_ws(1, n, k), 16), dtype=torch.uint8, device="cuda")
    for _ in range(2):
        L.tb_indexer_topk(ptr(q), ptr(w), 1, H, fl(1 / math.sqrt(D)), fl(1 / 8), 0, ptr(keys), ptr(None), ptr(start),
                          ptr(nk), n, ptr(scores), k, ptr(out), ptr(cnt), ptr(wsi), stream())
    # the same with e4m3 keys (one scale a key)
    keys8 = (torch.randn(n, D, device="cuda") * 8).to(torch.float8_e4m3fn)
    kscale = torch.rand(n, device="cuda") + 0.5
    for _ in range(2):
        L.tb_indexer_topk(ptr(q), ptr(w), 1, H, fl(1 / math.sqrt(D)), fl(1 / 8), 1, ptr(keys8), ptr(kscale), ptr(start),
                          ptr(nk), n, ptr(scores), k, ptr(out), ptr(cnt), ptr(wsi), stream())
    # attention: CSA decode, batch 1, 640 keys
    Dh = 512
    pool = torch.randn(4096, Dh, device="cuda").to(torch.bfloat16)
    qa = torch.randn(1, H, Dh, device="cuda")
    idx = torch.randint(0, 4096, (640,), device="cuda")
    rows = pool.data_ptr() + idx * Dh * 2
    offsets = torch.tensor([0, 640], dtype=torch.int64, device="cuda")
    sinks = torch.randn(H, device="cuda")
    o = torch.empty(1, H, Dh, device="cuda")
    wsb = L.tb_attention_ws(1, H, Dh, 640, 0)
    wsa = torch.empty(max(wsb, 16), dtype=torch.uint8, device="cuda")
    for _ in range(2):
        L.tb_attention(ptr(qa), 1, H, Dh, 1, ptr(rows), ptr(offsets), 640, ptr(sinks), fl(1 / math.sqrt(Dh)), ptr(o), 0,
                       ptr(wsa), stream())
    # compressor prefill: CSA and HCA over 65,536 tokens
    dim, rope_dim = 512, 64
    inv = Bench.rope_table(rope_dim)
    norm = torch.randn(dim, device="cuda")
    for T, rate, overlap in [(65536, 4, True), (65536, 128, False)]:
        width = 2 * dim if overlap else dim
        kv = torch.randn(T, width, device="cuda")
        sc = torch.randn(T, width, device="cuda")
        ape = torch.randn(rate, width, device="cuda")
        E = T // rate
        ent = torch.empty(E, dim, device="cuda")
        erows = ent.data_ptr() + torch.arange(E, dtype=torch.int64, device="cuda") * dim * 4
        ring = torch.zeros((2 * rate if overlap else rate), 2 * width, device="cuda")
        for _ in range(2):
            L.tb_compress_prefill(rate, int(overlap), dim, ptr(ape), ptr(norm), fl(1e-6), ptr(inv), rope_dim, fl(1.0),
                                  ptr(kv), ptr(sc), T, 0, ptr(ring), ptr(erows), 0, stream())
    torch.cuda.synchronize()
    print("profile driver done")


if __name__ == "__main__":
    main()
