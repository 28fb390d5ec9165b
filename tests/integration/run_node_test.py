"""One `troupe run` process with every actor, and what it takes from its manifest and flags. Pools: the
manifest's pools.memory_budget as a fraction of the memory free after the weights (on the CPU backend: available
RAM), pools.ratios as fixed shares per pool, pools.context_mix through the planner, and the planner's default mix
when neither is given: each process's pools start with the pages `troupe plan` prints for the same budget (the
pages free before any request), and it serves a request. The gateway's API key (--api-key or TROUPE_API_KEY) and
CORS origins (--allowed-origins).

Run by ctest (tests/integration/CMakeLists.txt).
"""
import json
import sys
import time
import tempfile
import unittest
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness as h  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "support"))
from pools import mem_available, plan_pages  # noqa: E402

HOST = "127.0.0.1"
POOLS = ["window", "csa_entry", "csa_index", "hca_entry", "hca_ring"]


class Pools(unittest.TestCase):
    def setUp(self):
        self.troupe, self.model = h.paths()
        h.ensure_model(self.troupe, self.model)
        self.dir = Path(tempfile.mkdtemp(prefix="troupe-pools-"))
        self.cluster = h.Cluster(self.dir, self.troupe, {"UCX_NET_DEVICES": "lo"})
        self.addCleanup(self.cluster.close)

    def tearDown(self):
        if self._outcome.result.failures or self._outcome.result.errors:
            print(self.cluster.logs())

    def serve(self, name, pools_yaml, env=None, args=()):
        """One process with every actor; returns its metrics before any request."""
        base = h.free_port_block(10)
        manifest = self.dir / f"{name}.yaml"
        manifest.write_text("\n".join([
            "version: 1", f"name: {name}", "model:", f"  path: {self.model}", "discovery: static",
            "pools:", *[f"  {line}" for line in pools_yaml], "nodes:", "  - name: serve",
            "    actors: [gateway, router, prefill, decode, cache_shard]", f"    address: {HOST}:{base + 1}",
            "    ports:", f"      http: {base}", f"      transport: {base + 1}",
            f"      transport_range: {base + 2}-{base + 9}"]) + "\n")
        self.cluster.start("serve", manifest, env=env, args=args)
        h.wait_all_ready(self.cluster, HOST, [base])
        self.port = base
        # The worker's first load report sets its gauges.
        deadline = time.monotonic() + 30
        while True:
            m = h.metrics(HOST, base)
            if any(k.startswith("troupe_kv_budget_bytes{") for k in m):
                return m
            if env and "TROUPE_API_KEY" in env:
                return {}
            self.assertLess(time.monotonic(), deadline, "the worker never reported its pools")
            time.sleep(0.1)

    def pages(self, m):
        """Free pages per pool (pools the model has none of, or the plan gave none, left out)."""
        free = {p: int(sum(v for k, v in m.items() if k.startswith("troupe_pool_pages{") and f'pool="{p}"' in k
                               and 'state="free"' in k)) for p in POOLS}
        return {p: n for p, n in free.items() if n > 0}

    def budget(self, m, tier):
        return sum(v for k, v in m.items() if k.startswith("troupe_kv_budget_bytes{") and f'tier="{tier}"' in k)

    def serves_a_request(self):
        model = h.model_id(HOST, self.port)
        r = h.complete(HOST, self.port, model, h.prompts(1, length=40, seed=3)[0], 12)
        self.assertIsNone(r["error"], r)
        self.assertEqual(len(r["token_ids"]), 12)
        h.wait_settled(HOST, self.port)
        self.assertEqual(h.metric_sum(h.metrics(HOST, self.port), "troupe_leaked_pages"), 0)

    def test_a_fraction_with_fixed_ratios(self):
        before = mem_available()
        m = self.serve("fraction", ["memory_budget: 0.004", "ratios:", "  swa: 0.1", "  csa_entries: 0.4",
                                    "  index_keys: 0.2", "  hca_entries: 0.2", "  inflight: 0.1"])
        after = mem_available()
        device = self.budget(m, "device")
        # 0.004 of what was available once the weights were in (the whole slabs of it); RAM moves meanwhile.
        self.assertGreater(device, 0.004 * min(before, after) * 0.8, (device, before, after))
        self.assertLess(device, 0.004 * max(before, after) * 1.2, (device, before, after))
        # The host tier defaults to the device budget (the CPU backend: at most what the budget leaves free).
        self.assertAlmostEqual(self.budget(m, "host") / device, 1.0, delta=0.05)
        want = plan_pages(self.troupe, self.model, device,
                          "--ratios", "window=0.1,csa_entry=0.4,csa_index=0.2,hca_entry=0.2,hca_ring=0.1")
        self.assertEqual(self.pages(m), want)
        self.serves_a_request()

    def test_a_size_with_a_context_mix(self):
        m = self.serve("mix", ["memory_budget: 48MiB", "context_mix:",
                               "  - {prompt_tokens: 1000, output_tokens: 24, share: 0.5}",
                               "  - {prompt_tokens: 8000, output_tokens: 192, share: 0.5}"])
        self.assertEqual(self.budget(m, "device"), 48 << 20)
        self.assertEqual(self.pages(m), plan_pages(self.troupe, self.model, 48 << 20, "--mix", "1024:0.5,8192:0.5"))
        self.serves_a_request()

    def test_the_default_mix_when_the_manifest_names_none(self):
        m = self.serve("default", ["memory_budget: 32MiB"])
        self.assertEqual(self.budget(m, "device"), 32 << 20)
        self.assertEqual(self.pages(m), plan_pages(self.troupe, self.model, 32 << 20))
        self.serves_a_request()


    def test_the_gateway_flags(self):
        """An API key from the environment, CORS origins and --max-model-len, as troupe serve takes them."""
        self.serve("auth", ["memory_budget: 32MiB"], env={"TROUPE_API_KEY": "k-run"},
                   args=["--allowed-origins", "https://ui.example.com", "--max-model-len", "64"])
        import http.client

        def call(path, headers):
            c = http.client.HTTPConnection(HOST, self.port, timeout=10)
            try:
                c.request("GET", path, headers=headers)
                r = c.getresponse()
                r.read()
                return r.status, {k.lower(): v for k, v in r.getheaders()}
            finally:
                c.close()
        st, h = call("/v1/models", {"Origin": "https://ui.example.com"})
        self.assertEqual(st, 401)
        self.assertEqual(h.get("access-control-allow-origin"), "https://ui.example.com")
        self.assertEqual(call("/admin/workers", {})[0], 401)
        st, h = call("/v1/models", {"Authorization": "Bearer k-run", "Origin": "https://other.example"})
        self.assertEqual(st, 200)
        self.assertNotIn("access-control-allow-origin", h)
        self.assertEqual(call("/health", {})[0], 200)  # probes need no key
        c = http.client.HTTPConnection(HOST, self.port, timeout=30)
        try:
            # 60 prompt tokens + 10 past --max-model-len 64: a 400 naming the limit.
            body = json.dumps({"model": self.model.name, "prompt": [5] * 60, "max_tokens": 10})
            c.request("POST", "/v1/completions", body=body,
                      headers={"Authorization": "Bearer k-run", "Content-Type": "application/json"})
            r = c.getresponse()
            text = r.read().decode()
        finally:
            c.close()
        self.assertEqual(r.status, 400, text)
        self.assertIn("64", text)


if __name__ == "__main__":
    unittest.main(verbosity=2)
