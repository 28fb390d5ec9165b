# Session 18's diagnosis of the decode compressor (run 18 call 8): phase stamps of CTA 0 of a batch-64 CSA decode
# step. Build a library with run18-compressor-stamps.patch applied to kernels/cuda/compressor.cu
# (bench/gpu/ab-libs.sh OUT cst:kernels/cuda/compressor.cu=PATCHED_FILE), copy this file to bench/gpu/ and run
#   python3 bench/gpu/run18-compressor-stamps.py OUT/lib-cst/lib.so
import ctypes as C, sys, os
sys.path.insert(0, os.path.dirname(__file__))
import torch
from bench import ptr, stream, vp, lg, it, fl, decode_case, graph_time
L = C.CDLL(sys.argv[1])
comp = [it, it, lg, vp, vp, fl, vp, lg, fl, vp, vp]
L.tb_compress_decode.argtypes = comp + [lg, vp, vp, vp, it, vp]
L.tb_compress_stamps.argtypes = [vp]
dim, rope_dim = 512, 64
inv = (1.0 / (10000 ** (torch.arange(0, rope_dim, 2, device="cuda", dtype=torch.float32) / rope_dim))).contiguous()
norm = torch.randn(dim, device="cuda")
for rate, overlap, allc in [(4, True, True)]:
    B = 64
    ape, kv, sc, pos, ring_rows, out_rows, keep = decode_case(B, rate, overlap, dim, allc)
    def ours(i):
        L.tb_compress_decode(rate, int(overlap), dim, ptr(ape), ptr(norm), fl(1e-6), ptr(inv), rope_dim, fl(1.0),
                             ptr(kv), ptr(sc), B, ptr(pos), ptr(ring_rows), ptr(out_rows), 0, stream())
    st = (C.c_longlong * 16)()
    for rep in range(4):
        ours(0)
        torch.cuda.synchronize()
        L.tb_compress_stamps(st)
    v = list(st)
    names = {8: "entry", 0: "waited", 1: "table", 2: "chunk0", 3: "pooled", 4: "sum", 5: "emitted", 6: "ring_wait",
             7: "ring_stored", 9: "latest_end"}
    base = v[8] if v[8] else v[0]
    print(f"rate {rate} all_close {allc}: " + ", ".join(f"{nm} {(v[i]-base)/1e3:.2f}" for i, nm in names.items() if v[i]))
    print(f"  graph us {graph_time(ours):.2f}")
