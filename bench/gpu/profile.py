#!/usr/bin/env python3
"""Runs each fast kernel a few times eagerly (no graphs), for Nsight Compute:
   ncu --clock-control none --section SpeedOfLight --section WarpStateStats \
       -k regex:'topk_kernel|indexer_mma|indexer_wgmma|attention_kernel|compress_kernel' python3 bench/gpu/profile.py LIB
   profile.py LIB [PARTS]: PARTS a comma list of topk, indexer, attention, compressor, decode, ragged
   (default: all but decode, the compressor's decode form at batch 64, and ragged, the backend op's
   split-bf16 scoring of fp32 key rows by pointers: 262,144 keys x 1, two calls);
   attention runs CSA decode at batch 1 and 64 (640 keys) and HCA decode at batch 1 (8,320 keys), two
   calls each, in that order.
"""
import math
import os
import sys

import torch

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from bench import Bench, attention_case, decode_case, fl, prefill_case, ptr, stream  # noqa: E402


def main():
    b = Bench(sys.argv[1], quick=True)
    parts = sys.argv[2].split(",") if len(sys.argv) > 2 else ["topk", "indexer", "attention", "compressor"]
    L = b.lib
    n, k = 262144, 512
    out = torch.empty(1, k, dtype=torch.int32, device="cuda")
    cnt = torch.empty(1, dtype=torch.int32, device="cuda")
    H = 64
    if "topk" in parts:  # one row of 262,144 (PROFILE_TOPK_N: another length)
        nt = int(os.environ.get("PROFILE_TOPK_N", n))
        x = torch.randn(1, nt, device="cuda")
        ws = torch.zeros(max(L.tb_topk_ws(1, nt, k, 0), 16), dtype=torch.uint8, device="cuda")
        for _ in range(2):
            L.tb_topk(ptr(x), nt, None, 1, nt, k, ptr(out), ptr(cnt), ptr(ws), 0, stream())
    if "indexer" in parts:  # indexer + top-k: 1M context, batch 1, bf16 keys, then e4m3 keys
        os.environ["TROUPE_INDEXER_FUSED"] = "1"  # the fused kernel (by default this length takes two kernels)
        D = 128
        keys = torch.randn(n, D, device="cuda").to(torch.bfloat16)
        q = torch.randn(1, H, D, device="cuda")
        w = torch.randn(1, H, device="cuda")
        start = torch.zeros(1, dtype=torch.int64, device="cuda")
        nk = torch.full((1,), n, dtype=torch.int32, device="cuda")
        scores = torch.empty(1, n, device="cuda")
        wsi = torch.zeros(max(L.tb_indexer_topk_ws(1, n, k), 16), dtype=torch.uint8, device="cuda")
        for _ in range(2):
            L.tb_indexer_topk(ptr(q), ptr(w), 1, H, fl(1 / math.sqrt(D)), fl(1 / 8), 0, ptr(keys), ptr(None),
                              ptr(start), ptr(nk), n, ptr(scores), k, ptr(out), ptr(cnt), ptr(wsi), stream())
        keys8 = (torch.randn(n, D, device="cuda") * 8).to(torch.float8_e4m3fn)
        kscale = torch.rand(n, device="cuda") + 0.5
        for _ in range(2):
            L.tb_indexer_topk(ptr(q), ptr(w), 1, H, fl(1 / math.sqrt(D)), fl(1 / 8), 1, ptr(keys8), ptr(kscale),
                              ptr(start), ptr(nk), n, ptr(scores), k, ptr(out), ptr(cnt), ptr(wsi), stream())
    if "attention" in parts:  # bf16 keys gathered from a pool, 64 heads x 512
        Dh = 512
        pool_rows = 200000
        pool = torch.randn(pool_rows, Dh, device="cuda").to(torch.bfloat16)
        sinks = torch.randn(H, device="cuda")
        for B, nkeys in [(1, 640), (64, 640), (1, 128 + 8192)]:
            qa, _, rows, offsets, o, wsa = attention_case(L, pool, B, nkeys, H)
            for _ in range(2):
                L.tb_attention(ptr(qa), B, H, Dh, 1, ptr(rows), ptr(offsets), nkeys, ptr(sinks), fl(1 / math.sqrt(Dh)),
                               ptr(o), 0, ptr(wsa), stream())
    if "compressor" in parts:  # CSA and HCA prefill over 65,536 tokens
        dim, rope_dim = 512, 64
        inv = Bench.rope_table(rope_dim)
        norm = torch.randn(dim, device="cuda")
        for T, rate, overlap in [(65536, 4, True), (65536, 128, False)]:
            kv, sc, ape, ent, erows, ring = prefill_case(T, rate, overlap, dim)
            for _ in range(2):
                L.tb_compress_prefill(rate, int(overlap), dim, ptr(ape), ptr(norm), fl(1e-6), ptr(inv), rope_dim,
                                      fl(1.0), ptr(kv), ptr(sc), T, 0, ptr(ring), ptr(erows), 0, stream())
    if "decode" in parts:  # compressor decode: 64 sequences, CSA (rate 4, overlap), every window closing
        dim, rope_dim, rate, B = 512, 64, 4, 64
        inv = Bench.rope_table(rope_dim)
        norm = torch.randn(dim, device="cuda")
        ape, kv, sc, pos, ring_rows, out_rows, keep = decode_case(B, rate, True, dim, True)
        for _ in range(2):
            L.tb_compress_decode(rate, 1, dim, ptr(ape), ptr(norm), fl(1e-6), ptr(inv), rope_dim, fl(1.0), ptr(kv),
                                 ptr(sc), B, ptr(pos), ptr(ring_rows), ptr(out_rows), 0, stream())
    if "ragged" in parts:  # the backend op's scoring: fp32 rows by pointers, split bf16 on the tensor cores
        D = 128
        pool = torch.randn(n, D, device="cuda")
        rows = pool.data_ptr() + torch.randperm(n, device="cuda") * D * 4
        offsets = torch.tensor([0, n], dtype=torch.int64, device="cuda")
        q = torch.randn(1, H, D, device="cuda")
        w = torch.randn(1, H, device="cuda")
        scores = torch.empty(1, n, device="cuda")
        for _ in range(2):
            L.tb_indexer_ragged(ptr(q), ptr(w), 1, H, D, fl(1 / math.sqrt(D)), fl(1 / 8), ptr(rows), ptr(offsets), n,
                                ptr(scores), n, 2, stream())
    if "gemv" in parts:  # lm_head (129,280 x 4,096 bf16) at 4 rows of x
        n_out, dim, m = 129280, 4096, 4
        wg = torch.randn(n_out, dim, device="cuda").to(torch.bfloat16)
        xg = torch.randn(m, dim, device="cuda")
        yg = torch.empty(m, n_out, device="cuda")
        for _ in range(2):
            L.tb_gemv(ptr(xg), m, ptr(wg), n_out, dim, 1, ptr(yg), stream())
    torch.cuda.synchronize()
    print("profile driver done")


if __name__ == "__main__":
    main()
