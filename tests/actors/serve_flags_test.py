#!/usr/bin/env python3
"""`troupe serve`'s flags as an operator meets them: the pool flags --kv-memory-fraction (a share of the memory
free after the weights, split among the workers), --pool-ratios and --pool-mix (where the pools start: the pages
`troupe plan` prints for the same budget); --allowed-origins (CORS for browser clients: by default any origin, as
vLLM and SGLang do); the API key from TROUPE_API_KEY; and for every bad value or combination of the pool, worker,
policy and origin flags a CLI error naming the flag, before anything is served.
"""
import os
import subprocess
import sys
import time
from pathlib import Path

import harness

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "support"))
import pools  # noqa: E402
from pools import mem_available  # noqa: E402

A = harness.args() if __name__ == "__main__" else None
POOLS = ["window", "csa_entry", "csa_index", "hca_entry", "hca_ring"]


def model_dir():
    return os.path.join(A.home, "models", "deepseek-v4-tiny")


def plan_pages(budget, *args):
    return pools.plan_pages(A.troupe, model_dir(), budget, *args)


def reported(s, workers):
    """Each worker's (device budget, host budget, free pages per pool) once all have reported."""
    deadline = time.monotonic() + 30
    while True:
        m = s.metrics()
        out = {}
        for w in workers:
            device = harness.metric(m, "troupe_kv_budget_bytes", worker=w, tier="device")
            free = {p: int(harness.metric(m, "troupe_pool_pages", worker=w, pool=p, state="free")) for p in POOLS}
            out[w] = (device, harness.metric(m, "troupe_kv_budget_bytes", worker=w, tier="host"),
                      {p: n for p, n in free.items() if n > 0})
        if all(v[0] > 0 for v in out.values()):
            return out
        assert time.monotonic() < deadline, f"the workers never reported their pools: {out}"
        time.sleep(0.1)


def completes(s):
    st, b = s.post("/v1/completions", {"model": "deepseek-v4-tiny", "prompt": "pools and ratios", "max_tokens": 8,
                                       "temperature": 0, "ignore_eos": True})
    assert st == 200, (st, b)
    assert b["usage"]["completion_tokens"] == 8, b


def test_a_fraction_split_among_the_workers_with_fixed_ratios():
    ratios = "window=0.2,csa_entry=0.3,csa_index=0.3,hca_entry=0.1,hca_ring=0.1"
    before = mem_available()
    with harness.Server(A.troupe, A.home, ["--kv-memory-fraction", "0.004", "--workers", "2", "--pool-ratios", ratios],
                        name="pools-fraction") as s:
        after = mem_available()
        got = reported(s, ["worker-0", "worker-1"])
        for w, (device, host, pages) in got.items():
            # 0.004 of the free memory once the weights were in, over 2 workers (whole slabs of it).
            assert 0.002 * min(before, after) * 0.8 < device < 0.002 * max(before, after) * 1.2, (w, device, before)
            assert host == 0, (w, host)  # serve gives a host tier only when asked (or disaggregated)
            assert pages == plan_pages(device, "--ratios", ratios), (w, pages)
        completes(s)


def test_a_context_mix():
    with harness.Server(A.troupe, A.home, ["--kv-memory-mib", "24", "--pool-mix", "2K:0.6,16K:0.4",
                                           "--cache-share", "0.25"], name="pools-mix") as s:
        (device, _, pages), = reported(s, ["worker-0"]).values()
        assert device == 24 << 20, device
        assert pages == plan_pages(device, "--mix", "2K:0.6,16K:0.4", "--cache-share", "0.25"), pages
        completes(s)


def test_without_pool_flags_the_pools_start_empty():
    with harness.Server(A.troupe, A.home, ["--kv-memory-mib", "16"], name="pools-none") as s:
        (device, _, pages), = reported(s, ["worker-0"]).values()
        assert device == 16 << 20 and pages == {}, (device, pages)
        completes(s)


def refused(cases):
    for flags, phrase in cases:
        r = subprocess.run([A.troupe, "serve", "--port", "0", *flags], capture_output=True, text=True, timeout=30,
                           env=dict(os.environ, TROUPE_HOME=A.home))
        assert r.returncode != 0, (flags, r.stdout[-500:])
        assert phrase in r.stderr, (flags, r.stderr)
        assert "serving" not in r.stdout + r.stderr, flags


def test_bad_pool_flags_are_refused_by_name():
    refused([(["--kv-memory-fraction", "0"], "--kv-memory-fraction: must be a number in (0, 1]"),
                          (["--kv-memory-fraction", "nan"], "--kv-memory-fraction: must be a number in (0, 1]"),
                          (["--kv-memory-fraction", "0.5", "--kv-memory-mib", "8"], "excludes"),
                          (["--pool-mix", "4K:zero"], "--pool-mix: '4K:zero' is not TOKENS[:WEIGHT]"),
                          (["--pool-ratios", "window=2"], "--pool-ratios: 'window=2' needs a share in [0, 1]"),
                          (["--pool-ratios", "swa=1"], "--pool-ratios: 'swa=1' is not POOL=SHARE"),
                          (["--pool-mix", "4K", "--pool-ratios", "window=1"], "excludes"),
                          (["--cache-share", "0.1"], "--cache-share requires --pool-mix"),
                          (["--pool-mix", "4K", "--cache-share", "1"], "--cache-share: must be a number in [0, 1)")])


def test_bad_worker_and_policy_flags_are_refused_by_name():
    lt = ["--long-tail", "--host-memory-mib", "64"]
    refused([(["--long-tail"], "--long-tail parks requests in the host tier: give --host-memory-mib"),
             (["--long-tail-pressure", "0.5"], "--long-tail-pressure requires --long-tail"),
             (lt + ["--long-tail-pressure", "7"], "--long-tail-pressure: must be a number in (0, 1]"),
             (lt + ["--long-tail-resume", "0"], "--long-tail-resume: must be a number in (0, 1]"),
             (lt + ["--long-tail-min-share", "nan"], "--long-tail-min-share: must be a number in [0, 1)"),
             (lt + ["--long-tail-max-deferrals", "0"], "--long-tail-max-deferrals"),
             (["--scale-max", "2", "--scale-min", "5"], "--scale-min 5 is above --scale-max 2"),
             (["--scale-max", "2", "--scale-kv-low", "0.9", "--scale-kv-high", "0.5"],
              "--scale-kv-low 0.9 must be below --scale-kv-high 0.5"),
             (["--scale-min", "2"], "--scale-min requires --scale-max"),
             (["--scale-max", "-1"], "--scale-max"),
             (["--scale-max", "2", "--scale-cooldown", "-1"], "--scale-cooldown"),
             (["--restart-max", "-3"], "--restart-max"),
             (["--restart-window", "0"], "--restart-window"),
             (["--read-timeout", "0"], "--read-timeout"),
             (["--drain-timeout", "-1"], "--drain-timeout: must be a number in [0, 86400]"),
             (["--drain-timeout", "inf"], "--drain-timeout: must be a number in [0, 86400]"),
             (["--max-model-len", "-5"], "--max-model-len"),
             (["--workers", "2", "--prefill-workers", "1", "--decode-workers", "1"], "excludes"),
             (["--prefill-workers", "1"], "--prefill-workers requires --decode-workers"),
             (["--decode-workers", "1"], "--decode-workers requires --prefill-workers"),
             (["--prefill-workers", "0", "--decode-workers", "1"], "--prefill-workers"),
             (["--allowed-origins", "ui.example.com"], "allowed origins: 'ui.example.com' is not an origin"),
             (["--allowed-origins", "https://ui.example.com/app"], "'https://ui.example.com/app' is not an origin"),
             (["--allowed-origins", "*,"], "allowed origins: '' is not an origin")])


def lower(headers):
    return {k.lower(): v for k, v in headers.items()}


def preflight(s, origin, path="/v1/chat/completions"):
    st, h, _ = s.request("OPTIONS", path, headers={"Origin": origin, "Access-Control-Request-Method": "POST",
                                                   "Access-Control-Request-Headers": "authorization, content-type"})
    return st, lower(h)


def test_cors_any_origin_by_default():
    with harness.Server(A.troupe, A.home, [], name="cors-any") as s:
        st, h, b = s.request("GET", "/v1/models", headers={"Origin": "http://localhost:3000"})
        assert st == 200 and lower(h).get("access-control-allow-origin") == "*", (st, h)
        # Without an Origin (not a browser) nothing is added.
        st, h, b = s.request("GET", "/v1/models")
        assert st == 200 and "access-control-allow-origin" not in lower(h), h
        st, h = preflight(s, "http://localhost:3000")
        assert st == 204, (st, h)
        assert h["access-control-allow-origin"] == "*", h
        assert "POST" in h["access-control-allow-methods"], h
        assert h["access-control-allow-headers"] == "authorization, content-type", h
        # A streamed answer carries it too.
        st, h, b = s.request("POST", "/v1/completions", {"model": "deepseek-v4-tiny", "prompt": "cors", "max_tokens": 3,
                                                         "stream": True}, headers={"Origin": "http://localhost:3000"})
        assert st == 200 and lower(h).get("access-control-allow-origin") == "*" and "[DONE]" in b, (st, h, b)


def test_cors_listed_origins_only_and_none():
    with harness.Server(A.troupe, A.home, ["--allowed-origins", "https://ui.example.com, http://localhost:3000",
                                           "--api-key", "k1"], name="cors-list") as s:
        # A refused request (401) still tells an allowed page why.
        st, h, b = s.request("GET", "/v1/models", headers={"Origin": "https://ui.example.com"})
        h = lower(h)
        assert st == 401 and h.get("access-control-allow-origin") == "https://ui.example.com", (st, h)
        assert h.get("vary") == "Origin", h
        st, h, b = s.request("GET", "/v1/models", headers={"Origin": "https://evil.example",
                                                           "Authorization": "Bearer k1"})
        assert st == 200 and "access-control-allow-origin" not in lower(h), (st, h)
        # The preflight carries no key; an origin not listed gets no grant.
        st, h = preflight(s, "http://localhost:3000")
        assert st == 204 and h["access-control-allow-origin"] == "http://localhost:3000", (st, h)
        st, h = preflight(s, "https://evil.example")
        assert st == 204 and "access-control-allow-origin" not in h and "access-control-allow-methods" not in h, h
    with harness.Server(A.troupe, A.home, ["--allowed-origins", "none"], name="cors-none") as s:
        st, h, b = s.request("GET", "/v1/models", headers={"Origin": "http://localhost:3000"})
        assert st == 200 and "access-control-allow-origin" not in lower(h), (st, h)
        st, h = preflight(s, "http://localhost:3000")
        assert st >= 400 and "access-control-allow-origin" not in h, (st, h)
        assert s.get("/health")[0] == 200


def test_the_api_key_from_the_environment():
    with harness.Server(A.troupe, A.home, [], name="env-key", env={"TROUPE_API_KEY": "from-env"}) as s:
        assert s.get("/v1/models")[0] == 401
        assert s.get("/admin/workers")[0] == 401
        assert s.get("/v1/models", headers={"Authorization": "Bearer from-env"})[0] == 200


if __name__ == "__main__":
    raise SystemExit(harness.run(globals(), A.only))
