"""The scale policy under `troupe run`: the router's process (front) decides
from what remote workers report, and acts on remote processes.

front (gateway + router) and a worker node (prefill + decode in one
process) with two slots on 127.0.0.1: decode-0 serves from the start,
decode-1 is a standby (a process that is up, registered and held out of
service). The manifest's scale rule for the node: 1..2 workers, up when more
than 2 requests wait per worker, down when none waits and KV use is (about)
zero.

1. Load (more streams than decode-0 runs at once) makes the front admit
   decode-1; new requests then run there.
2. Idle again: after the cooldown the front drains one decode worker back to
   standby (both processes stay up).
3. Admin: POST /admin/scale {"node": "decode", "workers": 2} admits it again;
   under 16 streams spread over both, {"workers": 1} drains one: it is fenced,
   its running requests move with their KV to the other (no resubmission) and
   every stream's greedy ids equal an undisturbed run's.
4. Admin: POST /admin/drain {"worker": "decode-1"} reaches the remote process:
   it drains itself and exits 0 while the streams it ran finish unchanged;
   started again by the operator, it is back in service.
A gateway-only process (edge, as a Kubernetes gateway Deployment would be)
answers the admin routes too: it asks the fleet in the router's process over
the fabric (GET /admin/scale, POST /admin/scale, POST /admin/drain).

Run by ctest (tests/integration/CMakeLists.txt).
"""
import http.client
import json
import sys
import tempfile
import time
import unittest
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness as h  # noqa: E402

HOST = "127.0.0.1"
COOLDOWN_S = 3
MAX_RUNNING = 8
# Prefill workers that run one prompt at a time in chunks of 256 tokens: a
# wave of long prompts queues there for a while.
PREFILL_ARGS = ["--max-running", "1", "--step-tokens", "256"]


def post(port, path, body, timeout=10):
    c = http.client.HTTPConnection(HOST, port, timeout=timeout)
    try:
        c.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        r = c.getresponse()
        return r.status, json.loads(r.read().decode() or "{}")
    finally:
        c.close()


class ScaleCase(unittest.TestCase):
    """A cluster on 127.0.0.1 with one scaled node, NODE (its slots' role: ROLE, checked when set)."""
    NODE = ""
    ROLE = None

    def start_cluster(self, prefix, ports):
        """Makes the cluster (cleaned up after the test); returns (model directory, the first of `ports` ports)."""
        troupe, model = h.paths()
        h.ensure_model(troupe, model)
        self.dir = Path(tempfile.mkdtemp(prefix=prefix))
        self.cluster = h.Cluster(self.dir, troupe, {"UCX_NET_DEVICES": "lo"})
        self.addCleanup(self.cluster.close)
        return model, h.free_port_block(ports)

    def tearDown(self):
        if self._outcome.result.failures or self._outcome.result.errors:
            print(self.cluster.logs())

    def slots(self, port=None):
        status, body = h.get(HOST, port or self.front, "/admin/scale")
        self.assertEqual(status, 200, body)
        node = [n for n in json.loads(body)["nodes"] if n["node"] == self.NODE][0]
        if self.ROLE:
            self.assertEqual(node["role"], self.ROLE)
        return {s["name"]: s["state"] for s in node["slots"]}

    def wait_slots(self, want, what, timeout=60):
        end = time.time() + timeout
        got = None
        while time.time() < end:
            got = self.slots()
            if want(got):
                return got
            time.sleep(0.1)
        raise AssertionError(f"{what}: the {self.NODE} slots are {got}\n{self.loads()}\n{self.cluster.logs()}")

    def loads(self):
        """What each worker of the node reports now (for a failure's message)."""
        out = []
        for name, port in sorted(getattr(self, "http", {}).items()):
            try:
                m = h.metrics(HOST, port)
                out.append(f"{name}: " + ", ".join(f"{k} {h.metric_sum(m, k):g}" for k in (
                    "troupe_queue_depth", "troupe_running", "troupe_cached_tokens", "troupe_handoffs_total")))
            except OSError as e:
                out.append(f"{name}: no metrics ({e})")
        return "\n".join(out)

    def check(self, results, reference, what):
        for i, r in enumerate(results):
            self.assertIsNotNone(r, f"{what}: request {i} never returned")
            self.assertIsNone(r["error"], f"{what}: request {i}: {r}")
            self.assertEqual(r["token_ids"], reference[i], f"{what}: request {i} changed")


class ScalePolicy(ScaleCase):
    NODE = "decode"

    def setUp(self):
        model, base = self.start_cluster("troupe-scale-policy-", 30)
        # front: base..base+9; the worker node: http base+10 (slot 0) and base+11 (slot 1), transports
        # base+12 and base+13; edge (gateway only): base+20..base+29.
        nodes = [
            {"name": "front", "actors": ["gateway", "router"], "address": HOST,
             "ports": (base, base + 1, base + 2, base + 9)},
            {"name": "decode", "actors": ["prefill", "decode", "cache_shard"], "address": HOST, "replicas": 1,
             "transports": [base + 12, base + 13], "ports": (base + 10, base + 12, base + 14, base + 19)},
            {"name": "edge", "actors": ["gateway"], "address": HOST,
             "ports": (base + 20, base + 21, base + 22, base + 29)},
        ]
        # KV use is about zero only when nothing runs: the low mark holds when idle, never under load.
        rule = {"node": "decode", "min_workers": 1, "max_workers": 2, "queue_depth_high": 2, "queue_depth_low": 0,
                "kv_use_high": 0.99, "kv_use_low": 0.0001, "outstanding_handoffs_high": 64,
                "cooldown_s": COOLDOWN_S}
        manifest = h.write_manifest(self.dir / "scale.yaml", "scale", model, nodes, drain_timeout_s=60, scale=[rule])
        self.manifest = manifest
        self.front, self.edge, self.http = base, base + 20, {"decode-0": base + 10, "decode-1": base + 11}
        run = ["--max-running", str(MAX_RUNNING)]
        self.procs = {
            "front": self.cluster.start("front", manifest),
            "decode-0": self.cluster.start("decode-0", manifest, args=run),
            "decode-1": self.cluster.start("decode-1", manifest, args=run),  # http: ports.http + 1 (same host)
            "edge": self.cluster.start("edge", manifest),
        }
        h.wait_all_ready(self.cluster, HOST, [base, base + 10, base + 11, base + 20])
        self.model = h.model_id(HOST, base)

    def metric(self, node, name):
        return h.metric_sum(h.metrics(HOST, self.http[node]), name)

    def test_scale_up_down_and_admin_drain_across_processes(self):
        self.assertEqual(self.slots(), {"decode-0": "active", "decode-1": "standby"})
        self.assertEqual(self.slots(self.edge), {"decode-0": "active", "decode-1": "standby"})
        prompts = h.prompts(40, length=16, seed=11)
        max_tokens = 300
        # The oracle, one request at a time (nothing waits: no scale up yet).
        reference = h.references(HOST, self.front, self.model, prompts, max_tokens)
        self.assertEqual(self.slots()["decode-1"], "standby", "scaled up without load")
        self.assertEqual(self.metric("decode-1", "troupe_cached_tokens"), 0, "a standby got requests")

        # 1. Load: 40 streams against 8 running places on decode-0.
        t0 = time.time()
        wave = h.Streams(HOST, self.front, self.model, prompts, max_tokens)
        self.wait_slots(lambda s: s["decode-1"] == "active", "the front did not scale up under load")
        print(f"scaled up {time.time() - t0:.2f} s after the load started")
        self.check(wave.join(timeout=240), reference, "first wave")
        m = h.metrics(HOST, self.front)
        self.assertGreaterEqual(sum(v for k, v in m.items() if k.startswith("troupe_scale_events_total{")
                                    and 'dir="up"' in k), 1, m)
        # New requests run on the added worker too.
        wave = h.Streams(HOST, self.front, self.model, prompts[:8], max_tokens)
        ran = 0
        while any(t.is_alive() for t in wave.threads):
            ran = max(ran, self.metric("decode-1", "troupe_running"))
            time.sleep(0.02)
        self.check(wave.join(timeout=240), reference[:8], "second wave")
        self.assertGreater(ran, 0, "the added worker ran no request")

        # 2. Idle: the front drains one back to standby after the cooldown; both processes stay up.
        slots = self.wait_slots(lambda s: sorted(s.values()) == ["active", "standby"],
                                "the front did not scale down when idle", timeout=COOLDOWN_S + 60)
        print(f"scaled down when idle: {slots}")
        self.assertTrue(all(p.alive() for p in self.procs.values()))

        # 3. Admin scale to 2, then to 1 under 16 streams spread over both workers.
        long_tokens = 1000  # long enough that no stream ends before both workers run some, also under load
        long_prompts = prompts[:16]
        long_ref = []
        for part in (long_prompts[:8], long_prompts[8:]):  # 8 at once: none waits, so no scale up
            for r in h.Streams(HOST, self.front, self.model, part, long_tokens, stream=False).join(timeout=240):
                self.assertIsNotNone(r)
                self.assertIsNone(r["error"], r)
                long_ref.append(r["token_ids"])
        self.assertEqual(post(self.front, "/admin/scale", {"node": "decode", "workers": 3})[0], 400)
        status, body = post(self.edge, "/admin/scale", {"node": "nope", "workers": 1})
        self.assertEqual(status, 400, body)
        self.assertIn("no worker node 'nope'", body["error"]["message"])
        self.assertEqual(post(self.front, "/admin/scale", {"workers": "x"})[0], 400)
        # The scale down must find streams running on both workers. Under CPU load the streams can all end
        # before both ran some, or the fleet's own idle rule can take decode-1 back before a stream reaches it
        # (the test's precondition, not the behaviour under test): then the outputs are checked, decode-1 is
        # admitted again and the load started again, three times at most. The wait for both to run ends as
        # soon as it cannot succeed (a stream done, decode-1 out of service).
        for attempt in range(3):
            status, body = post(self.edge, "/admin/scale", {"node": "decode", "workers": 2})  # through the fabric
            self.assertEqual(status, 200, body)
            self.wait_slots(lambda s: list(s.values()) == ["active", "active"], "admin scale up")
            handoffs_before = {n: self.metric(n, "troupe_handoffs_total") for n in ("decode-0", "decode-1")}
            streams = h.Streams(HOST, self.front, self.model, long_prompts, long_tokens)
            end = time.time() + 120
            while (time.time() < end and max(streams.progress) < long_tokens
                   and self.slots()["decode-1"] == "active"
                   and not (self.metric("decode-0", "troupe_running") > 0
                            and self.metric("decode-1", "troupe_running") > 0)):
                time.sleep(0.05)
            if max(streams.progress) < long_tokens and self.slots()["decode-1"] == "active":
                break
            print(f"attempt {attempt + 1}: a stream finished, or decode-1 went back to {self.slots()['decode-1']}, "
                  "before both workers ran; again")
            self.check(streams.join(timeout=240), long_ref, "streams before the scale down")
        self.assertLess(max(streams.progress), long_tokens, "a stream finished before the scale down, three times")
        status, body = post(self.front, "/admin/scale", {"node": "decode", "workers": 1})
        self.assertEqual(status, 200, body)
        slots = self.wait_slots(lambda s: sorted(s.values()) == ["active", "standby"], "admin scale down")
        self.check(streams.join(timeout=240), long_ref, "admin scale down")
        drained = [n for n, st in slots.items() if st == "standby"][0]
        moved = self.metric(drained, "troupe_handoffs_total") - handoffs_before[drained]
        print(f"admin scale down drained {drained}: {moved:.0f} requests moved with their KV")
        self.assertGreater(moved, 0, "the drained worker moved no running request")
        self.assertEqual(h.metric_sum(h.metrics(HOST, self.front), "troupe_resubmits_total"), 0,
                         "a request was restarted instead of moved with its KV")

        # 4. Admin drain of a remote worker: its process drains and exits 0.
        self.assertEqual(post(self.front, "/admin/drain", {"worker": "nope-3"})[0], 404)
        self.assertEqual(post(self.edge, "/admin/drain", {"worker": "nope-3"})[0], 404)
        # On a slow machine the fleet's own idle rule may take decode-1 back before the streams reach it
        # (nothing runs for a cooldown after the scale up): then it is scaled up again and new streams sent.
        for attempt in range(3):
            status, body = post(self.front, "/admin/scale", {"node": "decode", "workers": 2})
            self.assertEqual(status, 200, body)
            self.wait_slots(lambda s: list(s.values()) == ["active", "active"], "admin scale up again")
            streams = h.Streams(HOST, self.front, self.model, long_prompts, long_tokens)
            end = time.time() + 120
            while (time.time() < end and self.metric("decode-1", "troupe_running") == 0
                   and self.slots()["decode-1"] == "active"):
                time.sleep(0.05)
            if self.metric("decode-1", "troupe_running") > 0:
                break
            print(f"decode-1 went back to {self.slots()['decode-1']} before a stream reached it; again")
            self.check(streams.join(timeout=240), long_ref, "streams while decode-1 went idle")
        else:
            self.fail("decode-1 ran no stream in three scale ups")
        status, body = post(self.edge, "/admin/drain", {"worker": "decode-1"})  # through the fabric
        self.assertEqual(status, 200, body)
        code = self.procs["decode-1"].reap(timeout=90)
        self.assertEqual(code, 0, f"decode-1 exited with {code}:\n{self.procs['decode-1'].tail()}")
        self.check(streams.join(timeout=240), long_ref, "admin drain")
        self.assertEqual(self.slots()["decode-1"], "removed")
        self.assertTrue(self.procs["decode-0"].alive() and self.procs["front"].alive())
        # Growing needs a standby process that is up: none is.
        status, body = post(self.front, "/admin/scale", {"node": "decode", "workers": 2})
        self.assertEqual(status, 400, body)
        self.assertIn("standby", body["error"]["message"])
        # The operator starts it again: it serves again.
        self.procs["decode-1"] = self.cluster.start("decode-1", self.manifest, args=["--max-running", str(MAX_RUNNING)])
        self.wait_slots(lambda s: s["decode-1"] == "active", "a removed worker started again")


class ScalePrefill(ScaleCase):
    """Disaggregated: front, a prefill node with two slots (prefill-1 a standby)
    and a decode process. Prefill workers queue what they cannot run, so the
    rule on prefill scales it from queue depth; the handoffs to the decode
    process go on from either prefill worker with the same greedy tokens."""

    NODE = ROLE = "prefill"

    def setUp(self):
        model, base = self.start_cluster("troupe-scale-prefill-", 30)
        nodes = [
            {"name": "front", "actors": ["gateway", "router"], "address": HOST,
             "ports": (base, base + 1, base + 2, base + 9)},
            {"name": "prefill", "actors": ["prefill", "cache_shard"], "address": HOST, "replicas": 1,
             "transports": [base + 12, base + 13], "ports": (base + 10, base + 12, base + 14, base + 19)},
            {"name": "decode", "actors": ["decode", "cache_shard"], "address": HOST,
             "ports": (base + 20, base + 21, base + 22, base + 29)},
        ]
        rule = {"node": "prefill", "min_workers": 1, "max_workers": 2, "queue_depth_high": 2, "queue_depth_low": 0,
                "kv_use_high": 0.99, "kv_use_low": 0.0001, "outstanding_handoffs_high": 1000,
                "cooldown_s": COOLDOWN_S}
        manifest = h.write_manifest(self.dir / "prefill.yaml", "prefill", model, nodes, drain_timeout_s=60,
                                    scale=[rule])
        self.front = base
        self.procs = {
            "front": self.cluster.start("front", manifest),
            "prefill-0": self.cluster.start("prefill-0", manifest, args=PREFILL_ARGS),
            "prefill-1": self.cluster.start("prefill-1", manifest, args=PREFILL_ARGS),
            "decode": self.cluster.start("decode", manifest),
        }
        h.wait_all_ready(self.cluster, HOST, [base, base + 10, base + 11, base + 20])
        self.model = h.model_id(HOST, base)
        self.http = {"prefill-0": base + 10, "prefill-1": base + 11}

    def colocated_references(self, prompts, max_tokens):
        """Each prompt's greedy ids from a `troupe serve` of the same model, one request at a time."""
        troupe, model = h.paths()
        port = h.free_port_block(1)
        serve = h.Proc("serve", [str(troupe), "serve", "--model", str(model), "--host", HOST, "--port", str(port)],
                       self.dir / "serve.log", self.cluster.env)
        self.cluster.every.append(serve)  # killed with the cluster if this fails
        try:
            h.wait_ready(HOST, port, procs=[serve])
            self.assertEqual(h.model_id(HOST, port), self.model)
            return h.references(HOST, port, self.model, prompts, max_tokens)
        finally:
            serve.kill()

    def test_prefill_scales_from_its_queue_and_back(self):
        self.assertEqual(self.slots(), {"prefill-0": "active", "prefill-1": "standby"})
        prompts = h.prompts(24, length=1500, seed=17)  # long prompts: prefill is the bottleneck
        max_tokens = 16
        # The oracle: the same prompts one at a time in a colocated `troupe serve` (colocated and
        # disaggregated give the same greedy ids: pd_equivalence_test). Not on this cluster: that would
        # leave the wave's prompts in prefill-0's prefix cache, and a wave found there never queues.
        reference = self.colocated_references(prompts, max_tokens)
        # Requests one at a time (other prompts) do not scale prefill up.
        h.references(HOST, self.front, self.model, h.prompts(3, length=1500, seed=18), max_tokens)
        self.assertEqual(self.slots()["prefill-1"], "standby", "scaled up without load")
        t0 = time.time()
        wave = h.Streams(HOST, self.front, self.model, prompts, max_tokens)
        self.wait_slots(lambda s: s["prefill-1"] == "active", "the front did not add a prefill worker")
        print(f"prefill scaled up {time.time() - t0:.2f} s after the load started")
        self.check(wave.join(timeout=240), reference, "first wave")
        # A second wave runs on both prefill workers, with the same tokens.
        wave = h.Streams(HOST, self.front, self.model, prompts[:8], max_tokens)
        ran = 0
        while any(t.is_alive() for t in wave.threads):
            ran = max(ran, h.metric_sum(h.metrics(HOST, self.http["prefill-1"]), "troupe_running"))
            time.sleep(0.02)
        for i, r in enumerate(wave.join(timeout=240)):
            self.assertIsNone(r["error"], f"request {i}: {r}")
            self.assertEqual(r["token_ids"], reference[i], f"second wave request {i} changed")
        self.assertGreater(ran, 0, "the added prefill worker ran no request")
        # Idle: back to one prefill worker; every process stays up.
        self.wait_slots(lambda s: sorted(s.values()) == ["active", "standby"],
                        "the front did not remove a prefill worker when idle", timeout=COOLDOWN_S + 60)
        self.assertTrue(all(p.alive() for p in self.procs.values()))
        self.assertEqual(h.metric_sum(h.metrics(HOST, self.front), "troupe_resubmits_total"), 0)


if __name__ == "__main__":
    unittest.main(verbosity=2)
