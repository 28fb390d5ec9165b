"""Colocated (`troupe serve`, one process) and disaggregated (gateway+router,
prefill and decode as three `troupe run` processes, the KV moving between them
by UCX RMA) give the same greedy tokens, streamed and not, also for requests
with repetition / frequency / presence penalties (which the prefill and decode
processes must both apply: they travel in the job and in the handoff), and the
prompt's logprobs of echo requests (computed in the prefill process).

Run by ctest (tests/integration/CMakeLists.txt).
"""
import sys
import tempfile
import unittest
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness as h  # noqa: E402

TROUPE, MODEL = h.paths()


class ColocatedVsDisaggregated(unittest.TestCase):
    def setUp(self):
        h.ensure_model(TROUPE, MODEL)
        self.dir = Path(tempfile.mkdtemp(prefix="troupe-pd-"))
        self.cluster = h.Cluster(self.dir, TROUPE, {"UCX_NET_DEVICES": "lo"})
        self.addCleanup(self.cluster.close)  # also when setUp fails below

    def tearDown(self):
        self.cluster.close()
        if self._outcome.result.failures or self._outcome.result.errors:
            print(self.cluster.logs())

    PENALTIES = {"repetition_penalty": 1.3, "frequency_penalty": 0.8, "presence_penalty": 0.4,
                 "logit_bias": {"500": 6.0, "501": -100.0}}

    def run_all(self, host, port, model, prompts, max_tokens, penalized=()):
        out = []
        for i, p in enumerate(prompts):
            extra = self.PENALTIES if i in penalized else None
            r = h.complete(host, port, model, p, max_tokens, stream=bool(i % 2), extra=extra)
            self.assertIsNone(r["error"], r)
            self.assertEqual(len(r["token_ids"]), max_tokens, r)
            out.append(r["token_ids"])
        return out

    def echo_scores(self, host, port, model, prompts):
        """The prompt's logprobs (echo) with an answer and without: the prefill process
        computes them and they reach the gateway's process over the fabric."""
        out = []
        for p, max_tokens in ((prompts[0], 4), (prompts[1], 0)):
            r = h.complete(host, port, model, p, max_tokens, extra={"echo": True, "logprobs": 2})
            self.assertIsNone(r["error"], r)
            lp = r["logprobs"]
            self.assertEqual(len(lp["token_logprobs"]), len(p) + max_tokens, lp)
            self.assertIsNone(lp["token_logprobs"][0])
            self.assertTrue(all(x is not None for x in lp["token_logprobs"][1:]), lp)
            out.append((r["token_ids"], lp))
        return out

    def test_colocated_and_disaggregated_give_identical_greedy_tokens(self):
        prompts = h.prompts(6, length=40, seed=3)
        max_tokens = 24

        # Colocated: every actor in one process.
        host, serve_port = "127.0.0.1", h.free_port_block(1)
        serve = h.Proc("serve", [str(TROUPE), "serve", "--model", str(MODEL), "--host", host, "--port",
                                 str(serve_port)], self.dir / "serve.log", self.cluster.env)
        self.cluster.procs["serve"] = serve
        h.wait_ready(host, serve_port, procs=[serve])
        model = h.model_id(host, serve_port)
        penalized = (0, 3, 5)
        colocated = self.run_all(host, serve_port, model, prompts, max_tokens, penalized)
        plain = self.run_all(host, serve_port, model, [prompts[i] for i in penalized], max_tokens)
        echo_colocated = self.echo_scores(host, serve_port, model, prompts)
        self.assertNotEqual(plain, [colocated[i] for i in penalized], "the penalties changed no answer")
        serve.kill()

        # Disaggregated: three processes, started decode first (any order works).
        topo = h.Topo()
        manifest = h.write_manifest(self.dir / "pd.yaml", "pd", MODEL, topo.nodes)
        procs = [self.cluster.start(n, manifest) for n in ("decode", "prefill", "front")]
        for n in ("front", "prefill", "decode"):
            h.wait_ready(host, topo.port(n), procs=procs)
        front = topo.port("front")
        self.assertEqual(h.model_id(host, front), model)
        disaggregated = self.run_all(host, front, model, prompts, max_tokens, penalized)

        self.assertEqual(disaggregated, colocated)
        self.assertEqual(self.echo_scores(host, front, model, prompts), echo_colocated)
        # The state really moved between the processes, and nothing leaked.
        lent = h.metrics(host, topo.port("prefill"))
        pulled = h.metrics(host, topo.port("decode"))
        self.assertGreater(h.metric_sum(lent, "troupe_kv_bytes_lent"), 0)
        self.assertGreater(h.metric_sum(pulled, "troupe_kv_bytes_pulled"), 0)
        self.assertEqual(h.metric_sum(pulled, "troupe_kv_failed_pulls"), 0)
        for m in (lent, pulled):
            self.assertEqual(h.metric_sum(m, "troupe_leaked_pages"), 0)


if __name__ == "__main__":
    unittest.main(verbosity=2)
