#!/usr/bin/env python3
"""Worker loss and scale-down inside one process, seen from clients.

- A worker crashes mid-stream (the supervisor's crash_atom through the
  --test-hooks admin route) with 2 workers: every stream completes with the
  greedy tokens of an undisturbed run, no client sees an error, the restart
  is counted and no pages leak.
- Scale down under load: a worker is drained (fence, migrate with its KV,
  stop) while 50 streams run: none fails, their tokens are those of an
  undisturbed run, the worker stops.
- The admin's /admin/scale on `troupe serve`: GET lists the workers, POST
  grows the group and shrinks it again under load (the least loaded drained,
  every stream intact); a count out of range or of the wrong type is a 400
  and changes nothing.
"""
import time

import harness

A = harness.args()
MODEL = "deepseek-v4-tiny"


def bodies(n, max_tokens, words=12):
    return [{"model": MODEL, "prompt": p, "max_tokens": max_tokens, "temperature": 0}
            for p in harness.distinct_prompts(n, words)]


def workers(s):
    st, b = s.get("/admin/workers")
    assert st == 200, b
    return {w["name"]: w for w in b["workers"]}


def undisturbed(s, bs):
    ref = harness.Streams(s.base_url, bs).join()
    assert not ref.errors, ref.errors
    assert all(f == "length" for f in ref.finish), ref.finish
    return ref.tokens


def test_worker_crash_mid_stream_is_invisible_to_clients():
    with harness.Server(A.troupe, A.home, ["--workers", "2", "--test-hooks"], name="crash") as s:
        bs = bodies(8, 40)
        ref = undisturbed(s, bs)
        m0 = s.metrics()
        run = harness.Streams(s.base_url, bs)
        s.wait_for("every stream to have 5 tokens", lambda: run.min_tokens() >= 5, timeout=60, every=0.02)
        st, b = s.post("/admin/crash", {"worker": "worker-0"})
        assert st == 200, b
        run.join()
        assert not run.errors, run.errors
        assert run.finish == ["length"] * 8, run.finish
        diff = [i for i in range(8) if run.tokens[i] != ref[i]]
        assert not diff, f"streams {diff} differ from the undisturbed run"
        m = s.idle_pages()
        assert harness.metric(m, "troupe_restarts_total", worker="worker-0") == 1
        resubmits = harness.metric(m, "troupe_resubmits_total") - harness.metric(m0, "troupe_resubmits_total")
        assert resubmits >= 1, "no request was running on the crashed worker"
        assert harness.metric(m, "troupe_leaked_pages") == 0
        s.wait_for("worker-0 back", lambda: set(workers(s)) == {"worker-0", "worker-1"}, timeout=30)
        print(f"crash: {resubmits:.0f} requests resubmitted, all 8 streams identical to the undisturbed run")


def test_drain_under_load_keeps_every_stream():
    with harness.Server(A.troupe, A.home, ["--workers", "2", "--host-memory-mib", "512"], name="drain") as s:
        bs = bodies(50, 24)
        ref = undisturbed(s, bs)
        run = harness.Streams(s.base_url, bs)
        s.wait_for("25 streams with 3 tokens", lambda: run.count_with(3) >= 25, timeout=120, every=0.02)
        before = workers(s)["worker-0"]
        st, b = s.post("/admin/drain", {"worker": "worker-0"})
        assert st == 200 and b == {"draining": "worker-0"}, b
        st, b = s.post("/admin/drain", {"worker": "worker-0"})  # already draining
        assert st == 404, b
        run.join()
        assert not run.errors, run.errors
        assert run.finish == ["length"] * 50, run.finish
        diff = [i for i in range(50) if run.tokens[i] != ref[i]]
        assert not diff, f"streams {diff} differ from the undisturbed run"
        s.wait_for("worker-0 to stop", lambda: set(workers(s)) == {"worker-1"}, timeout=30)
        m = s.idle_pages()
        moved = harness.metric(m, "troupe_handoffs_total", worker="worker-0")
        assert harness.metric(m, "troupe_drains_total") == 1
        assert harness.metric(m, "troupe_leaked_pages", worker="worker-1") == 0
        assert harness.metric(m, "troupe_restarts_total") == 0
        print(f"drain: worker-0 had {before['running']} running; {moved:.0f} moved with their KV; "
              f"50 streams identical to the undisturbed run")
        # The remaining worker serves on.
        st, b = s.post("/v1/completions", {"model": MODEL, "prompt": "after", "max_tokens": 3})
        assert st == 200 and b["usage"]["completion_tokens"] == 3


def test_sigterm_drains_requests_in_flight():
    s = harness.Server(A.troupe, A.home, ["--drain-timeout", "60"], name="sigterm")
    try:
        run = harness.Streams(s.base_url, bodies(4, 30))
        s.wait_for("4 streams with a token", lambda: run.min_tokens() >= 1, timeout=60, every=0.02)
        import signal
        s.proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        st, b = s.post("/v1/completions", {"model": MODEL, "prompt": "too late", "max_tokens": 3})
        assert st == 503, (st, b)
        assert s.get("/health")[0] == 503
        run.join()
        assert not run.errors and run.finish == ["length"] * 4, (run.errors, run.finish)
        assert [len(t) for t in run.tokens] == [30] * 4
        s.proc.wait(30)
        assert s.proc.returncode == 0, s.proc.returncode
    finally:
        s.stop()


def scale_active(s):
    st, b = s.get("/admin/scale")
    assert st == 200, b
    [node] = b["nodes"]
    return node["active"]


def test_admin_scale_grows_and_shrinks_the_group():
    with harness.Server(A.troupe, A.home, ["--workers", "1", "--host-memory-mib", "512"], name="scale") as s:
        assert scale_active(s) == 1
        for bad, why in [({"workers": 0}, "between 1 and"), ({"workers": 5000}, "between 0 and 1024"),
                         ({"workers": "2"}, "workers"), ({}, "workers"), ({"workers": 2, "node": 3}, "workers")]:
            st, b = s.post("/admin/scale", bad)
            assert st == 400 and why in b["error"]["message"], (bad, st, b)
        assert scale_active(s) == 1 and set(workers(s)) == {"worker-0"}

        st, b = s.post("/admin/scale", {"workers": 3})
        assert st == 200 and b == {"node": "", "workers": 3}, b
        s.wait_for("3 workers", lambda: len(workers(s)) == 3, timeout=30)
        assert scale_active(s) == 3
        bs = bodies(12, 24)
        ref = undisturbed(s, bs)

        # Back to one while 12 streams run: two workers drain, their requests move with their KV.
        run = harness.Streams(s.base_url, bs)
        s.wait_for("6 streams with 3 tokens", lambda: run.count_with(3) >= 6, timeout=120, every=0.02)
        st, b = s.post("/admin/scale", {"workers": 1})
        assert st == 200 and b == {"node": "", "workers": 1}, b
        assert scale_active(s) == 1
        run.join()
        assert not run.errors, run.errors
        assert run.finish == ["length"] * 12, run.finish
        diff = [i for i in range(12) if run.tokens[i] != ref[i]]
        assert not diff, f"streams {diff} differ from the undisturbed run"
        s.wait_for("one worker left", lambda: len(workers(s)) == 1, timeout=30)
        m = s.idle_pages()
        assert harness.metric(m, "troupe_drains_total") == 2
        assert harness.metric(m, "troupe_leaked_pages") == 0
        assert harness.metric(m, "troupe_restarts_total") == 0
        st, b = s.post("/v1/completions", {"model": MODEL, "prompt": "after", "max_tokens": 3})
        assert st == 200 and b["usage"]["completion_tokens"] == 3
        print(f"admin scale: 1 -> 3 -> 1 workers, 12 streams through the shrink identical to the undisturbed run")


if __name__ == "__main__":
    raise SystemExit(harness.run(globals(), A.only))
