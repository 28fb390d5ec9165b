"""Three hosts (deploy/examples/three-host.yaml: gateway+router / prefill /
decode at 10.77.0.1-3) as three network namespaces joined by veth pairs to a
bridge, each host one `troupe run`: requests through the gateway succeed;
killing the decode host's process and starting it again, the requests in
flight resume (same greedy tokens) and new ones succeed.

Needs root (ip netns); skipped without it. Run by ctest.
"""
import signal
import sys
import tempfile
import time
import unittest
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness as h  # noqa: E402

TROUPE, MODEL = h.paths()
EXAMPLE = h.ROOT / "deploy" / "examples" / "three-host.yaml"
FRONT, PREFILL, DECODE = "10.77.0.1", "10.77.0.2", "10.77.0.3"


@unittest.skipUnless(h.netns_supported(), "needs root and ip netns")
class ThreeHosts(unittest.TestCase):
    def setUp(self):
        h.ensure_model(TROUPE, MODEL)
        self.dir = Path(tempfile.mkdtemp(prefix="troupe-3host-"))
        # The example as written, serving the tests' small model instead of the embedded one.
        text = EXAMPLE.read_text().replace("path: embedded", f"path: {MODEL}")
        self.manifest = self.dir / "three-host.yaml"
        self.manifest.write_text(text)
        self.hosts = h.Hosts([FRONT, PREFILL, DECODE])
        self.addCleanup(self.hosts.close)  # cleanups run last-first: processes, then namespaces
        self.cluster = h.Cluster(self.dir, TROUPE, {"UCX_NET_DEVICES": "eth0"})
        self.addCleanup(self.cluster.close)
        self.ns = self.hosts.ns
        # Started back to front: a process is live at once but ready (/health
        # 200) only when the peers it needs are connected with their weights.
        self.procs = {"decode": self.cluster.start("decode", self.manifest, netns=self.ns[DECODE])}
        self.assert_not_ready(DECODE, "front")
        self.procs["prefill"] = self.cluster.start("prefill", self.manifest, netns=self.ns[PREFILL])
        self.assert_not_ready(PREFILL, "front")
        self.assert_not_ready(DECODE, "front")
        self.procs["front"] = self.cluster.start("front", self.manifest, netns=self.ns[FRONT])
        try:
            for ip in (FRONT, PREFILL, DECODE):
                h.run_in(self.ns[ip], h.wait_ready, ip, 8000, 60, list(self.procs.values()))
        except AssertionError as e:
            raise AssertionError(f"{e}\n{self.cluster.logs()}") from None
        self.model = h.run_in(self.ns[FRONT], h.model_id, FRONT, 8000)

    def tearDown(self):
        self.cluster.close()
        self.hosts.close()
        if self._outcome.result.failures or self._outcome.result.errors:
            print(self.cluster.logs())

    def assert_not_ready(self, ip, missing):
        """`ip`'s process is live (/health/live 200) but not ready, for want of `missing`."""
        def probe():
            end = time.time() + 30
            while True:
                try:
                    live, health = h.get(ip, 8000, "/health/live", timeout=2), h.get(ip, 8000, "/health", timeout=2)
                    if '"starting"' not in health[1] or time.time() > end:  # its fabric is up
                        return live, health
                except OSError:
                    if time.time() > end:
                        raise
                time.sleep(0.1)
        live, health = h.run_in(self.ns[ip], probe)
        self.assertEqual(live[0], 200, live)
        self.assertEqual(health[0], 503, f"{ip} ready without {missing}: {health}")
        self.assertIn(missing, health[1], health)

    def complete(self, prompt, max_tokens):
        # The client runs on the front host (inside its namespace).
        return h.run_in(self.ns[FRONT], h.complete, FRONT, 8000, self.model, prompt, max_tokens)

    def test_requests_survive_a_restart_of_the_decode_host(self):
        prompts = h.prompts(6, length=30, seed=21)
        max_tokens = 160
        reference = []
        for p in prompts:
            r = self.complete(p, max_tokens)
            self.assertIsNone(r["error"], r)
            self.assertEqual(len(r["token_ids"]), max_tokens)
            reference.append(r["token_ids"])

        streams = h.Streams(FRONT, 8000, self.model, prompts, max_tokens, netns=self.ns[FRONT])
        end = time.time() + 60
        while min(streams.progress) < 4 and time.time() < end:
            time.sleep(0.002)
        self.assertLess(max(streams.progress), max_tokens, "a stream finished before the kill: make them longer")
        self.procs["decode"].signal(signal.SIGKILL)
        self.assertIsNotNone(self.procs["decode"].reap(10), "kill -9 did not end the decode process")
        killed = time.time()
        time.sleep(1.0)  # the front notices, the requests wait for a decode worker
        self.procs["decode"] = self.cluster.start("decode", self.manifest, netns=self.ns[DECODE])
        h.run_in(self.ns[DECODE], h.wait_ready, DECODE, 8000, 60, [self.procs["decode"]])
        results = streams.join(timeout=180)
        for i, r in enumerate(results):
            self.assertIsNotNone(r, f"request {i} never returned")
            self.assertIsNone(r["error"], f"request {i}: {r}")
            self.assertEqual(r["token_ids"], reference[i], f"request {i} differs after the restart")
        print(f"in-flight requests resumed; last one done {time.time() - killed:.2f} s after the kill")

        # New requests succeed on the restarted host.
        for i, p in enumerate(prompts[:3]):
            r = self.complete(p, 32)
            self.assertIsNone(r["error"], r)
            self.assertEqual(r["token_ids"], reference[i][:32])
        pulled = h.run_in(self.ns[DECODE], h.metrics, DECODE, 8000)
        self.assertGreater(h.metric_sum(pulled, "troupe_kv_bytes_pulled"), 0)
        # Nothing leaked on either worker host once everything settled.
        for ip in (PREFILL, DECODE):
            m = h.run_in(self.ns[ip], h.wait_settled, ip, 8000)
            self.assertEqual(h.metric_sum(m, "troupe_leaked_pages"), 0, ip)
            self.assertEqual(h.leased_pages(m), 0, f"{ip}: pages still leased after every request finished")
            self.assertEqual(h.metric_sum(m, "troupe_kv_leases"), 0, ip)
            self.assertEqual(h.metric_sum(m, "troupe_handoffs_pending"), 0, ip)


if __name__ == "__main__":
    unittest.main(verbosity=2)
