"""Scale down under load: 50 streams run through gateway+router, a prefill
process and two decode processes; one decode process is removed (SIGTERM: it
is fenced at the router, moves its running requests with their KV to the other
decode process and exits 0). No stream fails and every stream's greedy tokens
equal those of the same request with nothing removed.

Run by ctest (tests/integration/CMakeLists.txt).
"""
import signal
import sys
import time
import unittest
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness as h  # noqa: E402

HOST = "127.0.0.1"
STREAMS = 50


class ScaleDown(h.TwoDecodeProcesses):
    NAME = "scale"
    MANIFEST = {"drain_timeout_s": 90}

    def test_removing_a_decode_process_under_50_streams_fails_none(self):
        prompts = h.prompts(STREAMS, length=20, seed=31)
        max_tokens = 1000
        # The oracle: the same 50 requests, all at once, with nothing removed.
        reference = h.Streams(HOST, self.front, self.model, prompts, max_tokens, stream=False).join(timeout=240)
        for i, r in enumerate(reference):
            self.assertIsNotNone(r, f"reference request {i} never returned")
            self.assertIsNone(r["error"], r)
            self.assertEqual(len(r["token_ids"]), max_tokens, r)

        streams = h.Streams(HOST, self.front, self.model, prompts, max_tokens)
        end = time.time() + 120
        while sum(1 for p in streams.progress if p >= 1) < STREAMS and time.time() < end:
            time.sleep(0.005)
        self.assertEqual(sum(1 for p in streams.progress if p >= 1), STREAMS, "the streams did not start")
        self.assertLess(max(streams.progress), max_tokens, "a stream finished before the removal: make them longer")
        # The decode process running more of the streams is removed while it runs them (the
        # router may have put all of them on one: which one depends on its periodic load reports).
        running = {"decodea": 0, "decodeb": 0}
        while (max(running.values()) < STREAMS // 4 and max(streams.progress) < max_tokens - 100
               and time.time() < end):
            for name in running:
                running[name] = h.metric_sum(h.metrics(HOST, self.topo.port(name)), "troupe_running")
        gone = max(running, key=running.get)
        kept = "decodeb" if gone == "decodea" else "decodea"
        self.assertGreater(running[gone], 0, f"no decode process runs any of the streams: {running}")
        removed = self.procs[gone]
        removed.signal(signal.SIGTERM)
        removed_at = time.time()

        code = removed.wait(timeout=150)
        self.assertEqual(code, 0, f"the removed process exited with {code}:\n{removed.tail()}")
        results = streams.join(timeout=240)
        for i, r in enumerate(results):
            self.assertIsNotNone(r, f"stream {i} never returned")
            self.assertIsNone(r["error"], f"stream {i}: {r}")
            self.assertEqual(r["finish_reason"], "length", r)
            self.assertEqual(r["token_ids"], reference[i]["token_ids"], f"stream {i} changed by the removal")
        print(f"{gone} had {running[gone]:.0f} running requests when removed ({kept}: {running[kept]:.0f}); "
              f"all {STREAMS} streams done {time.time() - removed_at:.2f} s later")

        # The survivor took the state over; nothing leaked there once settled.
        survivor = self.topo.port(kept)
        m = h.wait_settled(HOST, survivor)
        self.assertGreater(h.metric_sum(m, "troupe_kv_bytes_pulled"), 0)
        self.assertEqual(h.metric_sum(m, "troupe_leaked_pages"), 0)
        self.assertEqual(h.leased_pages(m), 0, "pages still leased after every request finished")
        self.assertEqual(h.metric_sum(h.metrics(HOST, self.front), "troupe_resubmits_total"), 0,
                         "a request was restarted instead of moved with its KV")


if __name__ == "__main__":
    unittest.main(verbosity=2)
