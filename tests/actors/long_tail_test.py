#!/usr/bin/env python3
"""The long_tail policy in one process: a small device pool (2 MiB per
worker, host tier on), one very long request and 20 short ones.

The long request holds more than half of the device pool; when the short
ones arrive (more than one request runs and requests hold more than the
threshold) the supervisor parks the request with the largest projected state
(the long one) in the host tier.
The short ones run and finish while it is parked; it resumes when the
pressure is gone and its tokens equal those of an uncapped run.
"""
import random
import threading
import time

import harness

A = harness.args() if __name__ == "__main__" else None
MODEL = "deepseek-v4-tiny"
LONG_PROMPT = 5000
LONG_TOKENS = 200
# Park when requests hold more than half of the pool and more than one runs;
# resume when the parked one fits back under 60% (or nothing else runs).
# Cold pages off: every page of a running sequence stays on the device (as on
# a GPU without mapped host memory), so the long request really holds the
# pool; with cold pages the engine keeps its old pages in the host tier and
# the policy has little to free.
POOLS = ["--kv-memory-mib", "2", "--host-memory-mib", "256", "--no-cold-pages"]
CAPPED = POOLS + ["--long-tail", "--long-tail-pressure", "0.5", "--long-tail-resume", "0.6"]


def long_body():
    rng = random.Random(5)
    return {"model": MODEL, "prompt": [rng.randint(1000, 100000) for _ in range(LONG_PROMPT)],
            "max_tokens": LONG_TOKENS, "temperature": 0, "ignore_eos": True}


def short_bodies():
    return [{"model": MODEL, "prompt": p, "max_tokens": 16, "temperature": 0, "ignore_eos": True}
            for p in harness.distinct_prompts(20, words=10)]


def run_capped(flags, name):
    """The long request, then the 20 short ones once it decodes: (long Streams,
    short Streams, seconds until the last short one finished, long tokens by
    then, seconds until the long one finished, metrics, KV use before)."""
    with harness.Server(A.troupe, A.home, flags, name=name) as s:
        t0 = time.monotonic()
        long_run = harness.Streams(s.base_url, [long_body()])
        long_done = []
        threading.Thread(target=lambda: (long_run.join(600), long_done.append(time.monotonic())), daemon=True).start()
        # Past the engine's first full audit (every 32 steps), so the worker's load shows what it holds.
        s.wait_for("the long request to decode", lambda: long_run.min_tokens() >= 30, timeout=300, every=0.05)
        use = max(w["kv_use"] for w in s.get("/admin/workers")[1]["workers"])
        t_short = time.monotonic()
        shorts = harness.Streams(s.base_url, short_bodies())
        short_done = []
        for t in shorts._threads:
            t.join(300)
            short_done.append(time.monotonic())
        shorts.join(1)
        long_by_then = len(long_run.tokens[0])
        s.wait_for("the long request to finish", lambda: long_done, timeout=600, every=0.1)
        m = s.idle_pages()
        return (long_run, shorts, max(short_done) - t_short, long_by_then, long_done[0] - t_short, m, use,
                max(short_done) < long_done[0])


def test_long_request_is_parked_for_short_ones_and_resumes_exactly():
    with harness.Server(A.troupe, A.home, name="uncapped") as ref_server:
        ref = harness.Streams(ref_server.base_url, [long_body()]).join(600)
        assert not ref.errors and len(ref.tokens[0]) == LONG_TOKENS, ref.errors
        shorts_ref = harness.Streams(ref_server.base_url, short_bodies()).join()
    long_run, shorts, all_short, long_by_then, long_total, m, use, shorts_first = run_capped(CAPPED, "long-tail")
    parks = harness.metric(m, "troupe_long_tail_parked_total")
    resumes = harness.metric(m, "troupe_long_tail_resumed_total")
    # The same load without the policy, for the record: how long the short ones take when the long one keeps its pages.
    _, off_shorts, off_all_short, off_long_by_then, off_long_total, _, _, _ = run_capped(POOLS, "no-long-tail")
    print(f"long request: {LONG_PROMPT}-token prompt, {LONG_TOKENS} tokens, holding {use:.2f} of a 2 MiB pool.\n"
          f"  long_tail on:  20 short requests done {all_short:.1f} s after they were sent (the long one had "
          f"{long_by_then}/{LONG_TOKENS} tokens then, finished after {long_total:.1f} s); parks {parks:.0f}, "
          f"resumes {resumes:.0f}\n"
          f"  long_tail off: 20 short requests done {off_all_short:.1f} s after they were sent (the long one had "
          f"{off_long_by_then}/{LONG_TOKENS} tokens then, finished after {off_long_total:.1f} s); "
          f"{len(off_shorts.errors)} of them failed: {off_shorts.errors[:1]}")
    assert not shorts.errors and not long_run.errors, (shorts.errors, long_run.errors)
    diff = [i for i in range(20) if shorts.tokens[i] != shorts_ref.tokens[i]]
    assert not diff, f"short requests {diff} differ from the uncapped run"
    assert long_run.tokens[0] == ref.tokens[0], "the parked and resumed request's tokens differ from an uncapped run"
    assert parks >= 1 and resumes >= 1, (parks, resumes)
    # The short ones did not wait for the long one.
    assert shorts_first, "a short request finished after the long one"
    assert long_by_then < LONG_TOKENS
    assert harness.metric(m, "troupe_leaked_pages") == 0


def test_a_drain_with_nowhere_to_move_resumes_what_the_policy_parked():
    """The only worker drained while the policy has the long request parked: no worker to move it to, and
    the policy stops for a draining worker, so the drain resumes it there; it finishes with its tokens (it
    used to stay parked, and the drain with it)."""
    with harness.Server(A.troupe, A.home, name="uncapped-drain") as ref_server:
        ref = harness.Streams(ref_server.base_url, [long_body()]).join(600)
    with harness.Server(A.troupe, A.home, CAPPED, name="long-tail-drain") as s:
        long_run = harness.Streams(s.base_url, [long_body()])
        s.wait_for("the long request to decode", lambda: long_run.min_tokens() >= 30, timeout=300, every=0.05)
        shorts = harness.Streams(s.base_url, short_bodies())
        s.wait_for("the policy to park it",
                   lambda: harness.metric(s.metrics(), "troupe_long_tail_parked_total") >= 1, timeout=120,
                   every=0.02)
        # Every request reached the gateway (its 200 is counted as it goes to the router): one sent after
        # the drain has no worker to go to and is refused, as it should be, which is not what this tests.
        s.wait_for("the gateway to take all 21 requests",
                   lambda: harness.metric(s.metrics(), "troupe_http_requests_total", route="/v1/completions",
                                          status="200") >= 21, timeout=120, every=0.02)
        st, b = s.post("/admin/drain", {"worker": "worker-0"})
        assert st == 200, (st, b)
        shorts.join(120)
        long_run.join(120)
        assert len(long_run.tokens[0]) == LONG_TOKENS, f"the long request stopped at {len(long_run.tokens[0])} tokens"
        assert not long_run.errors and not shorts.errors, (long_run.errors, shorts.errors)
        assert long_run.tokens[0] == ref.tokens[0], "the resumed request's tokens differ from an uncapped run"


if __name__ == "__main__":
    raise SystemExit(harness.run(globals(), A.only))
