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
# resume when the parked one fits back under 70% (or nothing else runs).
CAPPED = ["--kv-memory-mib", "2", "--host-memory-mib", "256", "--long-tail", "--long-tail-pressure", "0.5",
          "--long-tail-resume", "0.7"]


def long_body():
    rng = random.Random(5)
    return {"model": MODEL, "prompt": [rng.randint(1000, 100000) for _ in range(LONG_PROMPT)],
            "max_tokens": LONG_TOKENS, "temperature": 0, "ignore_eos": True}


def short_bodies():
    return [{"model": MODEL, "prompt": p, "max_tokens": 16, "temperature": 0, "ignore_eos": True}
            for p in harness.distinct_prompts(20, words=10)]


def test_long_request_is_parked_for_short_ones_and_resumes_exactly():
    with harness.Server(A.troupe, A.home, name="uncapped") as ref_server:
        ref = harness.Streams(ref_server.base_url, [long_body()]).join(600)
        assert not ref.errors and len(ref.tokens[0]) == LONG_TOKENS, ref.errors
        shorts_ref = harness.Streams(ref_server.base_url, short_bodies()).join()
    with harness.Server(A.troupe, A.home, CAPPED, name="long-tail") as s:
        t0 = time.monotonic()
        long_run = harness.Streams(s.base_url, [long_body()])
        long_done = []
        threading.Thread(target=lambda: (long_run.join(600), long_done.append(time.monotonic())), daemon=True).start()
        s.wait_for("the long request to decode", lambda: long_run.min_tokens() >= 3, timeout=300, every=0.05)
        use = max(w["kv_use"] for w in s.get("/admin/workers")[1]["workers"])
        t_short = time.monotonic()
        shorts = harness.Streams(s.base_url, short_bodies())
        short_done = []
        for t in shorts._threads:
            t.join(300)
            short_done.append(time.monotonic())
        shorts.join(1)
        all_short = max(short_done) - t_short
        long_tokens_when_shorts_done = len(long_run.tokens[0])
        s.wait_for("the long request to finish", lambda: long_done, timeout=600, every=0.1)
        m = s.idle_pages()
        parks = harness.metric(m, "troupe_long_tail_parked_total")
        resumes = harness.metric(m, "troupe_long_tail_resumed_total")
        print(f"long request: {LONG_PROMPT}-token prompt, {LONG_TOKENS} tokens, KV use {use:.2f} before the short ones; "
              f"20 short requests done {all_short:.1f} s after they were sent, when the long one had "
              f"{long_tokens_when_shorts_done} of {LONG_TOKENS} tokens; long done after {long_done[0] - t0:.1f} s; "
              f"parks {parks:.0f}, resumes {resumes:.0f}")
        assert not shorts.errors and not long_run.errors, (shorts.errors, long_run.errors)
        diff = [i for i in range(20) if shorts.tokens[i] != shorts_ref.tokens[i]]
        assert not diff, f"short requests {diff} differ from the uncapped run"
        assert long_run.tokens[0] == ref.tokens[0], "the parked and resumed request's tokens differ from an uncapped run"
        assert parks >= 1 and resumes >= 1, (parks, resumes)
        # The short ones did not wait for the long one.
        assert max(short_done) < long_done[0], "a short request finished after the long one"
        assert long_tokens_when_shorts_done < LONG_TOKENS
        assert harness.metric(m, "troupe_leaked_pages") == 0


if __name__ == "__main__":
    raise SystemExit(harness.run(globals(), A.only))
