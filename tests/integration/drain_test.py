"""SIGTERM drain of a decode process under load: it stops taking requests,
moves its running ones with their KV to the other decode process, exits 0,
and no request is lost or changed.

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


class Drain(h.TwoDecodeProcesses):
    NAME = "drain"
    MANIFEST = {"drain_timeout_s": 60}

    def test_sigterm_drains_a_decode_process_under_load_and_loses_nothing(self):
        prompts = h.prompts(10, length=28, seed=5)
        max_tokens = 600  # long enough that no stream ends before the slowest one starts, also under load
        reference = h.references(HOST, self.front, self.model, prompts, max_tokens)
        pulled_before = h.metric_sum(h.metrics(HOST, self.topo.port("decodeb")), "troupe_kv_bytes_pulled")

        streams = h.Streams(HOST, self.front, self.model, prompts, max_tokens)
        end = time.time() + 60
        while min(streams.progress) < 4 and time.time() < end:
            time.sleep(0.002)
        self.assertLess(max(streams.progress), max_tokens, "a stream finished before the drain: make them longer")
        draining = self.procs["decodea"]
        draining.signal(signal.SIGTERM)
        # While it drains, new requests keep succeeding (on the other decode process).
        extra = h.complete(HOST, self.front, self.model, prompts[0], 8)
        self.assertIsNone(extra["error"], extra)
        self.assertEqual(extra["token_ids"], reference[0][:8])

        code = draining.wait(timeout=90)
        self.assertEqual(code, 0, f"the drained process exited with {code}:\n{draining.tail()}")
        results = streams.join(timeout=120)
        for i, r in enumerate(results):
            self.assertIsNotNone(r, f"request {i} never returned")
            self.assertIsNone(r["error"], f"request {i}: {r}")
            self.assertEqual(r["token_ids"], reference[i], f"request {i} changed by the drain")

        # Requests moved with their state, none was given back to the gateway.
        survivor = h.metrics(HOST, self.topo.port("decodeb"))
        moved = h.metric_sum(survivor, "troupe_kv_bytes_pulled") - pulled_before
        resubmits = h.metric_sum(h.metrics(HOST, self.front), "troupe_resubmits_total")
        print(f"KV pulled by decodeb-0 during the drain: {moved:.0f} bytes; resubmits: {resubmits:.0f}")
        self.assertEqual(resubmits, 0)
        self.assertEqual(h.metric_sum(survivor, "troupe_leaked_pages"), 0)


if __name__ == "__main__":
    unittest.main(verbosity=2)
