"""Two gateway processes (a replicated gateway, as deploy/examples/elastic.yaml runs) in front of one router,
one prefill and one decode process on 127.0.0.1: requests through both gateways at once all complete with the
greedy tokens each gives alone. Each gateway numbers its requests; the workers key their runs by that number,
so two gateways counting from 1 collided (a request dropped as a duplicate of the other gateway's, its client
waiting forever; an abort from one ending the other's).

Run by ctest (tests/integration/CMakeLists.txt).
"""
import sys
import tempfile
import unittest
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness as h  # noqa: E402

HOST = "127.0.0.1"


class TwoGateways(unittest.TestCase):
    def setUp(self):
        troupe, model = h.paths()
        h.ensure_model(troupe, model)
        self.dir = Path(tempfile.mkdtemp(prefix="troupe-two-gateways-"))
        self.cluster = h.Cluster(self.dir, troupe, {"UCX_NET_DEVICES": "lo"})
        self.addCleanup(self.cluster.close)
        topo = h.Topo(layout=[("front", ["gateway", "router"]), ("front2", ["gateway"]),
                              ("prefill", ["prefill", "cache_shard"]), ("decode", ["decode", "cache_shard"])])
        self.port = topo.http
        manifest = h.write_manifest(self.dir / "two-gateways.yaml", "two-gateways", model, topo.nodes)
        self.procs = {n: self.cluster.start(n, manifest) for n in self.port}
        h.wait_all_ready(self.cluster, HOST, list(self.port.values()))
        self.model = h.model_id(HOST, self.port["front"])

    def tearDown(self):
        if self._outcome.result.failures or self._outcome.result.errors:
            print(self.cluster.logs())

    def test_requests_through_two_gateways_at_once_all_complete(self):
        prompts = h.prompts(12, length=20, seed=11)
        max_tokens = 48
        # One at a time through each gateway: the same tokens, and both gateways' counters at the same count.
        reference = h.references(HOST, self.port["front"], self.model, prompts, max_tokens)
        self.assertEqual(h.references(HOST, self.port["front2"], self.model, prompts, max_tokens), reference)
        # Each gateway's requests in flight together with the other's: with ids from 1 in both, request k of
        # one met request k of the other on the workers.
        a = h.Streams(HOST, self.port["front"], self.model, prompts, max_tokens)
        b = h.Streams(HOST, self.port["front2"], self.model, prompts, max_tokens)
        for name, streams in (("front", a), ("front2", b)):
            results = streams.join(timeout=120)
            for i, r in enumerate(results):
                self.assertIsNotNone(r, f"{name}: request {i} never returned")
                self.assertIsNone(r["error"], f"{name}: request {i}: {r}")
                self.assertEqual(r["token_ids"], reference[i], f"{name}: request {i}")
        for name in ("prefill", "decode"):
            leaked = h.metric_sum(h.metrics(HOST, self.port[name]), "troupe_leaked_pages")
            self.assertEqual(leaked, 0, name)


if __name__ == "__main__":
    unittest.main(verbosity=2)
