#!/usr/bin/env python3
"""Where a top-k call's time goes, kernel by kernel: run under ncu, or summarise its CSV.

  ncu --profile-from-start off --clock-control none --cache-control none --csv \\
      --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed \\
      python3 bench/gpu/topk_ncu.py run LIB N ROWS [CALLS] > case.csv
  python3 bench/gpu/topk_ncu.py table case1.csv case2.csv ...

`run` calls the library's top-k CALLS times (default 5) on random rows (k = 2,048 from 1 M scores up,
else 512) after two unprofiled calls, each eagerly (so ncu sees each kernel alone, no PDL overlap),
rotating over input sets so that the calls do not find their scores in L2. Environment switches
(TROUPE_TOPK_SAMPLED, ...) apply as in the library. `table` prints, per case, each kernel's mean
duration and DRAM read rate, and the call's sum.

  python3 bench/gpu/topk_ncu.py stamps LIB N ROWS

prints the sampled path's %globaltimer stamps: the fused filter's (CTA 0 and the last CTA; topk.cu,
fused_filter_topk_kernel) of a third call, in microseconds from CTA 0's entry (its first sample's steps
too, and sums over the CTA: time at row changes, in stage waits, in the last flush), or the sample kernel's
(row 0; TROUPE_TOPK_FUSED unset), the finish kernel's (row 0), then the time of a
call unstamped (20 eager calls back to back, inputs in rotation)."""
import csv
import io
import re
import sys


def run(lib, n, rows, calls):
    import ctypes as C
    import torch
    vp, lg, it = C.c_void_p, C.c_long, C.c_int
    L = C.CDLL(lib)
    L.tb_topk_ws.argtypes = [it, lg, it, it]
    L.tb_topk_ws.restype = lg
    L.tb_topk.argtypes = [vp, lg, vp, it, lg, it, vp, vp, vp, it, vp]
    k = 2048 if n >= 1048576 else 512
    nbuf = max(2, min(8, (512 << 20) // (rows * n * 4)))
    xs = [torch.randn(rows, n, device="cuda") for _ in range(nbuf)]
    out = torch.empty(rows, k, dtype=torch.int32, device="cuda")
    cnt = torch.empty(rows, dtype=torch.int32, device="cuda")
    ws = torch.zeros(max(L.tb_topk_ws(rows, n, k, 0), 16), dtype=torch.uint8, device="cuda")
    s = vp(torch.cuda.current_stream().cuda_stream)

    def call(i):
        assert L.tb_topk(vp(xs[i % nbuf].data_ptr()), n, None, rows, n, k, vp(out.data_ptr()),
                         vp(cnt.data_ptr()), vp(ws.data_ptr()), 0, s) == 0

    for i in range(2):
        call(i)
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    for i in range(calls):
        call(i + 2)
        torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()
    vals = torch.topk(xs[(calls + 1) % nbuf], k, dim=1).values.sort(dim=1).values
    got = xs[(calls + 1) % nbuf].gather(1, out.long()).sort(dim=1).values
    print(f"# case {rows}x{n} k={k} calls={calls} exact={bool(torch.equal(vals, got))}", flush=True)


def stamps(lib, n, rows):
    import ctypes as C
    import torch
    vp, lg, it = C.c_void_p, C.c_long, C.c_int
    L = C.CDLL(lib)
    L.tb_topk_ws.argtypes = [it, lg, it, it]
    L.tb_topk_ws.restype = lg
    L.tb_topk_profiled.argtypes = [vp, lg, vp, it, lg, it, vp, vp, vp, it, vp, vp]
    k = 2048 if n >= 1048576 else 512
    # Inputs in rotation (~150 MB in all, at least two): the calls read DRAM, not L2, as the bench's do.
    xs = [torch.randn(rows, n, device="cuda") for _ in range(max(2, min(64, -(-150 * 2**20 // (rows * n * 4)))))]
    out = torch.empty(rows, k, dtype=torch.int32, device="cuda")
    cnt = torch.empty(rows, dtype=torch.int32, device="cuda")
    ws = torch.zeros(max(L.tb_topk_ws(rows, n, k, 0), 16), dtype=torch.uint8, device="cuda")
    turn = [0]
    prof = torch.zeros(48, dtype=torch.int64, device="cuda")
    s = vp(torch.cuda.current_stream().cuda_stream)

    def call(profile):
        x = xs[turn[0] % len(xs)]
        turn[0] += 1
        assert L.tb_topk_profiled(vp(x.data_ptr()), n, None, rows, n, k, vp(out.data_ptr()), vp(cnt.data_ptr()),
                                  vp(ws.data_ptr()), 0, profile, s) == 0

    for _ in range(3):
        prof.zero_()
        call(vp(prof.data_ptr()))
        torch.cuda.synchronize()
    st = prof.tolist()
    # The same call unstamped, back to back (eager launches; the bench's figures are graph replays).
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    reps = 20
    begin.record()
    for _ in range(reps):
        call(None)
    end.record()
    torch.cuda.synchronize()
    per_call = begin.elapsed_time(end) * 1000.0 / reps
    names = ["entry", "ring_issued", "sampled", "first_thr", "first_stage", "last_span", "end"]
    inner = ["s_loaded", "s_thr", "s_radix"]  # the CTA's first sample (absolute stamps)
    sums = ["row_change_us", "wait_us", "last_flush_us"]  # durations summed over the CTA
    t0 = st[0] or st[40]  # the fused kernel's CTA 0, else the sample kernel's row 0
    for base, who in ((0, "cta0"), (16, "last")):
        if not st[base]:
            continue
        cells = " ".join(f"{nm}={(st[base + i] - t0) / 1000.0:.2f}" for i, nm in enumerate(names) if st[base + i])
        cells += "".join(f" {nm}={(st[base + 8 + i] - t0) / 1000.0:.2f}" for i, nm in enumerate(inner)
                         if st[base + 8 + i])
        cells += "".join(f" {nm}={st[base + 11 + i] / 1000.0:.2f}" for i, nm in enumerate(sums))
        print(f"stamps {rows}x{n} {who}: {cells} spans={st[base + 7]} row_changes={st[base + 14]} "
              f"staged={st[base + 15]}", flush=True)
    if st[40]:  # the three-kernel path: the sample kernel's row 0
        cells = " ".join(f"{nm}={(st[40 + i] - t0) / 1000.0:.2f}" for i, nm in
                         enumerate(["entry", "s_loaded", "s_thr", "s_radix"]) if st[40 + i])
        print(f"stamps {rows}x{n} sample row 0: {cells}", flush=True)
    cells = " ".join(f"{nm}={(st[32 + i] - t0) / 1000.0:.2f}" for i, nm in
                     enumerate(["entry", "count", "candidates", "end", "kth_bin", "pass", "ranked"]) if st[32 + i])
    if st[39]:
        cells += f" bin_count={st[39]}"
    print(f"stamps {rows}x{n} finish row 0: {cells}", flush=True)
    print(f"stamps {rows}x{n} eager call: {per_call:.2f} us", flush=True)


def short(name):
    name = name.replace("(anonymous namespace)::", "").replace("troupe::kernels::cuda::", "")
    name = re.sub(r"^void ", "", name)
    depth = 0
    for i, ch in enumerate(name):
        depth += ch == "<"
        depth -= ch == ">"
        if ch == "(" and depth == 0:
            return name[:i]
    return name


def table(paths):
    scale = {"nsecond": 1e-3, "usecond": 1.0, "msecond": 1e3, "second": 1e6}
    print("| case | kernel | launches a call | us a launch | DRAM read GB/s | DRAM % of peak |")
    print("|---|---|---|---|---|---|")
    for path in paths:
        text = open(path, errors="replace").read()
        m = re.search(r"# case (.+?) k=(\d+) calls=(\d+) exact=(\w+)", text)
        case, calls = (f"{m.group(1)} k={m.group(2)}{'' if m.group(4) == 'True' else ' INEXACT'}",
                       int(m.group(3))) if m else (path, 1)
        lines = [l for l in text.splitlines() if l.startswith('"')]
        per = {}
        for r in csv.DictReader(io.StringIO("\n".join(lines))):
            key = (r.get("ID"), short(r.get("Kernel Name", "?")))
            v = float(r["Metric Value"].replace(",", ""))
            unit = r.get("Metric Unit", "")
            d = per.setdefault(key, {})
            if r["Metric Name"] == "gpu__time_duration.sum":
                d["us"] = v * scale.get(unit, 1e-3)
            elif r["Metric Name"] == "dram__bytes_read.sum":
                d["bytes"] = v * {"byte": 1, "Kbyte": 1e3, "Mbyte": 1e6, "Gbyte": 1e9}.get(unit, 1)
            else:
                d["pct"] = v
        agg = {}
        for (_, name), d in per.items():
            a = agg.setdefault(name, [0, 0.0, 0.0, 0.0])
            a[0] += 1
            a[1] += d.get("us", 0)
            a[2] += d.get("bytes", 0)
            a[3] += d.get("pct", 0)
        total = 0.0
        for name, (cnt, us, by, pct) in agg.items():
            total += us / calls
            print(f"| {case} | {name} | {cnt / calls:g} | {us / cnt:.2f} | {by / (us * 1e-6) / 1e9 if us else 0:.0f} "
                  f"| {pct / cnt:.0f} |")
        print(f"| {case} | **sum** | | {total:.2f} | | |")


if __name__ == "__main__":
    if sys.argv[1] == "stamps":
        stamps(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
    elif sys.argv[1] == "run":
        run(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]) if len(sys.argv) > 5 else 5)
    else:
        table(sys.argv[2:])
