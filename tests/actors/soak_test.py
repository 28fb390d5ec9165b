#!/usr/bin/env python3
"""200 concurrent streaming clients for a fixed time (2 minutes in CTest) on
the embedded model: zero errors, memory flat, no leaked pages, and sampled
tokens unchanged by the load.

Each client is a keep-alive HTTP/1.1 connection (asyncio, no SDK: 200 SDK
streams would need more CPU than the server gets on 2 cores) that sends
streaming completions back to back with random prompts, lengths and seeds.
Oracles: every request must end with [DONE], finish_reason "length" and
exactly max_tokens token ids (ignore_eos); a sample of requests is replayed
alone after the soak and must give the same tokens (sampling is seeded by
position, so batching must not change a token); RSS after warm-up vs at the
end; the pools' audit (leaked pages, pages held by requests).

    soak_test.py --troupe bin/troupe --home DIR [--clients 200] [--seconds 120] [--warmup 30]
"""
import argparse
import asyncio
import json
import random
import sys
import time

import harness

p = argparse.ArgumentParser()
p.add_argument("--troupe", required=True)
p.add_argument("--home", required=True)
p.add_argument("--clients", type=int, default=200)
p.add_argument("--seconds", type=float, default=120)
p.add_argument("--warmup", type=float, default=30)
p.add_argument("--kv-memory-mib", default="48")
A = p.parse_args()
MODEL = "deepseek-v4-tiny"
WORDS = "actor mailbox page window radix prefix handoff decode prefill park resume drain token sample".split()


class Failure(Exception):
    pass


async def one_request(reader, writer, body):
    data = json.dumps(body).encode()
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: " + str(len(data)).encode() + b"\r\n\r\n" + data)
    await writer.drain()
    head = await reader.readuntil(b"\r\n\r\n")
    status = head.split(b" ", 2)[1]
    if status != b"200":
        raise Failure(f"HTTP {status.decode()}: {head[:200]!r}")
    if b"chunked" not in head.lower():
        raise Failure("streamed response is not chunked")
    tokens, finish, done = [], None, False
    async for payload in harness.sse_payloads(reader):
        if payload == b"[DONE]":
            done = True
            continue
        j = json.loads(payload)
        if "error" in j:
            raise Failure(f"error event: {j['error']}")
        for c in j["choices"]:
            tokens += c.get("token_ids") or []
            finish = c.get("finish_reason") or finish
    if not done:
        raise Failure("stream ended without [DONE]")
    if finish != "length" or len(tokens) != body["max_tokens"]:
        raise Failure(f"finish {finish}, {len(tokens)} tokens for max_tokens {body['max_tokens']}")
    return tokens


def make_body(rng):
    n = rng.randint(3, 60)
    body = {"model": MODEL, "prompt": " ".join(rng.choice(WORDS) for _ in range(n)),
            "max_tokens": rng.randint(4, 16), "ignore_eos": True, "return_token_ids": True, "stream": True}
    if rng.random() < 0.5:
        body.update(temperature=0)
    else:  # seeded sampling; top_k keeps the engine's per-token sort short (a full-vocabulary sort costs ~10 ms)
        body.update(temperature=0.8, top_k=40, top_p=0.95, seed=rng.randint(0, 1 << 30))
    return body


async def client(i, port, deadline, stats, samples):
    rng = random.Random(i)
    reader = writer = None
    while time.monotonic() < deadline:
        body = make_body(rng)
        try:
            if writer is None:
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
            t0 = time.monotonic()
            tokens = await asyncio.wait_for(one_request(reader, writer, body), timeout=120)
            stats["requests"] += 1
            stats["tokens"] += len(tokens)
            stats["latency"].append(time.monotonic() - t0)
            if rng.random() < 0.05:
                samples.append((body, tokens))
        except Exception as e:  # noqa: BLE001 - every failure is counted and reported
            stats["errors"].append(f"client {i}: {type(e).__name__}: {e}")
            if writer is not None:
                writer.close()
            reader = writer = None
    if writer is not None:
        writer.close()


async def soak(port, seconds, rss_at_warmup, server):
    stats = {"requests": 0, "tokens": 0, "errors": [], "latency": []}
    samples = []
    deadline = time.monotonic() + seconds

    async def warm():
        await asyncio.sleep(A.warmup)
        rss_at_warmup.append(server.rss_bytes())
        rss_at_warmup.append(stats["requests"])

    await asyncio.gather(warm(), *[client(i, port, deadline, stats, samples) for i in range(A.clients)])
    return stats, samples


def main():
    with harness.Server(A.troupe, A.home, ["--kv-memory-mib", A.kv_memory_mib], name="soak") as s:
        rss0 = s.rss_bytes()
        warm = []
        t0 = time.monotonic()
        stats, samples = asyncio.run(soak(s.port, A.seconds, warm, s))
        wall = time.monotonic() - t0
        rss_end = s.rss_bytes()
        m = s.idle_pages()
        held = harness.pages_by_state(m, "in_use") - harness.pages_by_state(m, "cached")
        leaked = harness.metric(m, "troupe_leaked_pages")
        lat = sorted(stats["latency"]) or [0]
        print(f"{A.clients} clients, {wall:.0f} s: {stats['requests']} requests, {stats['tokens']} tokens "
              f"({stats['tokens'] / wall:.0f} tokens/s), {len(stats['errors'])} errors; latency p50 "
              f"{lat[len(lat) // 2]:.2f} s p99 {lat[int(len(lat) * 0.99)]:.2f} s")
        print(f"RSS: start {rss0 / 2**20:.0f} MiB, after {A.warmup:.0f} s warm-up ({warm[1]} requests) "
              f"{warm[0] / 2**20:.0f} MiB, end {rss_end / 2**20:.0f} MiB; leaked pages {leaked:.0f}, "
              f"held pages {held:.0f}")
        # Replay a sample alone: the same seeds must give the same tokens.
        replay_bad = 0
        for body, tokens in samples[:20]:
            st, b = s.post("/v1/completions", dict(body, stream=False))
            if st != 200 or b["choices"][0]["token_ids"] != tokens:
                replay_bad += 1
        print(f"replayed {min(20, len(samples))} sampled requests alone: {replay_bad} differ")
        failures = []
        if stats["errors"]:
            failures.append(f"{len(stats['errors'])} errors, first: {stats['errors'][:5]}")
        if stats["requests"] < A.clients:
            failures.append(f"only {stats['requests']} requests finished")
        margin = 0.05 * warm[0] + 16 * 2**20
        if rss_end > warm[0] + margin:
            failures.append(f"RSS grew from {warm[0] / 2**20:.0f} MiB to {rss_end / 2**20:.0f} MiB after warm-up")
        if leaked != 0 or held != 0:
            failures.append(f"leaked pages {leaked}, pages still held {held}")
        if replay_bad or not samples:
            failures.append(f"{replay_bad} of {len(samples[:20])} replayed requests gave other tokens")
        if not s.alive():
            failures.append("the server died")
        for f in failures:
            print("FAIL", f)
        print(f"{0 if failures else 1} passed, {1 if failures else 0} failed")
        return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
