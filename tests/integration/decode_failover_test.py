"""kill -9 of a decode process mid-stream, with two decode processes: every
in-flight request completes on the other one with the same greedy tokens, no
client sees an error, and no process that is left holds a leaked page.

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


class DecodeFailover(h.TwoDecodeProcesses):
    NAME = "failover"
    MANIFEST = {"handoff_timeout_s": 5}

    def test_killed_decode_process_mid_stream_loses_nothing(self):
        prompts = h.prompts(8, length=32, seed=11)
        max_tokens = 160
        # The oracle: the same requests with nothing killed.
        reference = h.references(HOST, self.front, self.model, prompts, max_tokens)

        streams = h.Streams(HOST, self.front, self.model, prompts, max_tokens)
        # Mid-stream: every request has tokens out, none is finished.
        end = time.time() + 60
        while min(streams.progress) < 4 and time.time() < end:
            time.sleep(0.002)
        self.assertGreaterEqual(min(streams.progress), 4, "the streams did not start")
        self.assertLess(max(streams.progress), max_tokens, "a stream finished before the kill: make them longer")
        peers_before = h.metric_sum(h.metrics(HOST, self.topo.port("prefill")), "troupe_peers_up")
        killed_at = time.time()
        self.procs["decodea"].signal(signal.SIGKILL)
        # How long until the prefill process (a peer of the killed one) knows.
        detected = None
        while time.time() - killed_at < 5:
            if h.metric_sum(h.metrics(HOST, self.topo.port("prefill")), "troupe_peers_up") < peers_before:
                detected = time.time() - killed_at
                break
        self.assertIsNotNone(detected, "the prefill process never noticed the kill")
        print(f"kill -9 of decodea-0 detected by its peer after {detected * 1000:.1f} ms")
        results = streams.join(timeout=180)

        for i, r in enumerate(results):
            self.assertIsNotNone(r, f"request {i} never returned")
            self.assertIsNone(r["error"], f"request {i}: {r}")
            self.assertEqual(r["finish_reason"], "length", r)
            self.assertEqual(r["token_ids"], reference[i], f"request {i} differs after the failover")

        gw = h.metrics(HOST, self.front)
        resubmitted = h.metric_sum(gw, "troupe_resubmits_total")
        self.assertGreater(resubmitted, 0, "no request was on the killed process: the test proved nothing")
        print(f"resubmitted {resubmitted:.0f} of {len(prompts)} requests; all done "
              f"{time.time() - killed_at:.2f} s after the kill")

        # Nothing leaked in the processes that are left, once everything settled.
        for node in ("prefill", "decodeb"):
            deadline = time.time() + 20
            while True:
                m = h.metrics(HOST, self.topo.port(node))
                leased = sum(v for k, v in m.items() if k.startswith("troupe_pool_pages{") and 'state="leased"' in k)
                settled = (h.metric_sum(m, "troupe_kv_leases") == 0 and h.metric_sum(m, "troupe_handoffs_pending") == 0
                           and leased == 0 and h.metric_sum(m, "troupe_running") == 0)
                if settled or time.time() > deadline:
                    break
                time.sleep(0.2)
            self.assertEqual(h.metric_sum(m, "troupe_leaked_pages"), 0, node)
            self.assertEqual(h.metric_sum(m, "troupe_kv_leases"), 0, node)
            self.assertEqual(h.metric_sum(m, "troupe_handoffs_pending"), 0, node)
            in_use = sum(v for k, v in m.items() if k.startswith("troupe_pool_pages{") and 'state="leased"' in k)
            self.assertEqual(in_use, 0, f"{node}: pages still leased by requests after all finished")


if __name__ == "__main__":
    unittest.main(verbosity=2)
