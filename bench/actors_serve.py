#!/usr/bin/env python3
"""TTFT and ITL of `troupe serve` (the embedded model) at several request
rates: open-loop Poisson arrivals for a fixed time per rate, streaming
completions (random prompts of PROMPT words, MAX_TOKENS tokens, ignore_eos).
TTFT: request sent -> first token chunk. ITL: every gap between token chunks
(the distribution, as sglang reports it; not AIPerf's per-request mean).
Prints one JSON object per rate.

    actors_serve.py --troupe build/bin/troupe [--rates 1,2,4,8] [--seconds 20]
"""
import argparse
import asyncio
import json
import os
import random
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "actors"))
import harness  # noqa: E402

p = argparse.ArgumentParser()
p.add_argument("--troupe", required=True)
p.add_argument("--home", default=os.environ.get("TROUPE_HOME", os.path.join(tempfile.gettempdir(), "troupe-bench")))
p.add_argument("--rates", default="1,2,4,8")
p.add_argument("--seconds", type=float, default=20)
p.add_argument("--prompt", type=int, default=64)
p.add_argument("--max-tokens", type=int, default=32)
A = p.parse_args()


async def one(port, body, out):
    t0 = time.monotonic()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    data = json.dumps(body).encode()
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nConnection: close\r\n"
                 b"Content-Length: " + str(len(data)).encode() + b"\r\n\r\n" + data)
    await writer.drain()
    times, ok = [], False
    head = await reader.readuntil(b"\r\n\r\n")
    if b" 200 " in head.split(b"\r\n")[0]:
        async for payload in harness.sse_payloads(reader):
            if payload == b"[DONE]":
                ok = True
                continue
            j = json.loads(payload)
            if any(c.get("token_ids") for c in j.get("choices", [])):
                times.append(time.monotonic())
    writer.close()
    out.append((t0, times, ok))


async def run_rate(port, rate, seconds, rng):
    out, tasks = [], []
    words = "actor page window prefix decode prefill park resume token sample".split()
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        body = {"model": "deepseek-v4-tiny", "prompt": " ".join(rng.choice(words) for _ in range(A.prompt)),
                "max_tokens": A.max_tokens, "ignore_eos": True, "temperature": 0, "stream": True,
                "return_token_ids": True}
        tasks.append(asyncio.create_task(one(port, body, out)))
        await asyncio.sleep(rng.expovariate(rate))
    await asyncio.gather(*tasks)
    return out


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def main():
    rng = random.Random(1)
    with harness.Server(A.troupe, A.home, name="bench") as s:
        asyncio.run(run_rate(s.port, 2, 3, rng))  # warm-up
        for rate in [float(r) for r in A.rates.split(",")]:
            t = time.monotonic()
            out = asyncio.run(run_rate(s.port, rate, A.seconds, rng))
            wall = time.monotonic() - t
            ttft = [ts[0] - t0 for t0, ts, ok in out if ts]
            itl = [b - a for _, ts, _ in out for a, b in zip(ts, ts[1:])]
            tokens = sum(len(ts) for _, ts, _ in out)
            print(json.dumps({"bench": "serve", "rate": rate, "requests": len(out),
                              "failed": sum(not ok for _, _, ok in out), "output_tokens_per_s": round(tokens / wall, 1),
                              "ttft_p50": pct(ttft, .5), "ttft_p90": pct(ttft, .9), "ttft_p99": pct(ttft, .99),
                              "itl_p50": pct(itl, .5), "itl_p90": pct(itl, .9), "itl_p99": pct(itl, .99)}), flush=True)


if __name__ == "__main__":
    main()
