"""Multi-process test harness: troupe processes, HTTP requests, network namespaces.

Every process a test starts is killed and reaped when the test ends, also when
it fails or is killed itself (PR_SET_PDEATHSIG), and every network namespace it
creates is deleted (stale ones of dead test processes too).
"""
import atexit
import ctypes
import http.client
import json
import os
import random
import signal
import subprocess
import sys
import threading
import tempfile
import time
import unittest
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "support"))
from ports import free_port_block  # noqa: E402,F401  (the tests call h.free_port_block)
_libc = ctypes.CDLL("libc.so.6", use_errno=True)
PR_SET_PDEATHSIG = 1


def _die_with_parent():
    _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def paths():
    """(troupe binary, model directory) from the environment ctest sets."""
    build = Path(os.environ.get("TROUPE_BINARY_DIR", ROOT / "build"))
    troupe = Path(os.environ.get("TROUPE_BIN", build / "bin" / "troupe"))
    model = Path(os.environ.get("TROUPE_TEST_MODEL", build / "tests" / "integration" / "tiny-512"))
    return troupe, model


def ensure_model(troupe, model):
    """The small model the tests serve (init-model is deterministic; concurrent
    creators race harmlessly through a rename)."""
    if (model / "config.json").exists() and (model / "model.safetensors").exists():
        return model
    tmp = model.with_name(model.name + f".tmp-{os.getpid()}")
    subprocess.run([str(troupe), "init-model", "--preset", "tiny", "--vocab", "512", "--layers", "2",
                    "--out", str(tmp)], check=True, stdout=subprocess.DEVNULL)
    try:
        os.rename(tmp, model)
    except OSError:
        subprocess.run(["rm", "-rf", str(tmp)], check=False)
    return model


class Proc:
    def __init__(self, name, argv, log, env, netns=None):
        self.name, self.argv, self.log_path, self.netns = name, argv, log, netns
        cmd = (["ip", "netns", "exec", netns] if netns else []) + argv
        self.log = open(log, "ab")
        self.popen = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env,
                                      preexec_fn=_die_with_parent)

    def alive(self):
        return self.popen.poll() is None

    def signal(self, sig):
        if self.alive():
            self.popen.send_signal(sig)

    def wait(self, timeout):
        try:
            return self.popen.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None

    def kill(self):
        if self.alive():
            self.popen.kill()
        self.popen.wait()
        self.log.close()

    def reap(self, timeout):
        """Waits for a process that is exiting (killed, drained) and closes its log."""
        code = self.wait(timeout)
        if code is not None:
            self.log.close()
        return code

    def tail(self, n=40):
        try:
            lines = Path(self.log_path).read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(lines[-n:])


class Cluster:
    """The troupe processes of one test."""

    def __init__(self, workdir, troupe, env_extra=None):
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.troupe = str(troupe)
        self.procs = {}   # node -> its latest process
        self.every = []   # every process started, restarted ones too
        self.env = dict(os.environ)
        self.env.update({"UCX_TCP_PORT_RANGE": "0", "OPENBLAS_NUM_THREADS": "1"})
        self.env.update(env_extra or {})
        atexit.register(self.close)

    def start(self, node, manifest, netns=None, env=None, args=()):
        e = dict(self.env)
        e.update(env or {})
        n = sum(1 for k in self.procs if k.startswith(node))
        log = self.workdir / f"{node}.{n}.log"
        p = Proc(node, [self.troupe, "run", "--manifest", str(manifest), "--node", node, *args], log, e, netns)
        self.procs[node] = p
        self.every.append(p)
        return p

    def close(self):
        for p in self.every + [p for p in self.procs.values() if p not in self.every]:
            p.kill()

    def logs(self):
        procs = self.every + [p for p in self.procs.values() if p not in self.every]
        return "\n".join(f"---- {p.name} ({p.log_path})\n{p.tail()}" for p in procs)


# ------------------------------------------------------------------ HTTP

def _conn(host, port, timeout):
    return http.client.HTTPConnection(host, port, timeout=timeout)


def get(host, port, path, timeout=5):
    c = _conn(host, port, timeout)
    try:
        c.request("GET", path)
        r = c.getresponse()
        return r.status, r.read().decode()
    finally:
        c.close()


def wait_ready(host, port, deadline_s=60, procs=()):
    end = time.time() + deadline_s
    last = ""
    while time.time() < end:
        for p in procs:
            if not p.alive():
                raise AssertionError(f"{p.name} exited with {p.popen.returncode}:\n{p.tail()}")
        try:
            status, body = get(host, port, "/health", timeout=2)
            if status == 200:
                return
            last = body
        except OSError as e:
            last = str(e)
        time.sleep(0.1)
    raise AssertionError(f"{host}:{port} not ready after {deadline_s} s: {last}")


def wait_all_ready(cluster, host, ports, deadline_s=90):
    """Every port's /health answers 200; on failure the error carries every
    process's log tail."""
    try:
        for port in ports:
            wait_ready(host, port, deadline_s, procs=cluster.procs.values())
    except AssertionError as e:
        raise AssertionError(f"{e}\n{cluster.logs()}") from None


def metrics(host, port):
    status, body = get(host, port, "/metrics")
    assert status == 200, body
    out = {}
    for line in body.splitlines():
        if not line or line.startswith("#"):
            continue
        name, _, value = line.rpartition(" ")
        out[name] = float(value)
    return out


def metric_sum(values, name):
    return sum(v for k, v in values.items() if k == name or k.startswith(name + "{"))


def leased_pages(values):
    """Pool pages leased by requests (troupe_pool_pages{...,state="leased"})."""
    return sum(v for k, v in values.items() if k.startswith("troupe_pool_pages{") and 'state="leased"' in k)


def wait_settled(host, port, deadline_s=20):
    """The metrics of a process once nothing runs there, no KV lease or
    handoff is open and no page is leased (or the last ones at the deadline)."""
    end = time.time() + deadline_s
    while True:
        m = metrics(host, port)
        if (metric_sum(m, "troupe_kv_leases") == 0 and metric_sum(m, "troupe_handoffs_pending") == 0
                and metric_sum(m, "troupe_kv_pulls") == 0 and leased_pages(m) == 0
                and metric_sum(m, "troupe_running") == 0) or time.time() > end:
            return m
        time.sleep(0.2)


def model_id(host, port):
    status, body = get(host, port, "/v1/models")
    assert status == 200, body
    return json.loads(body)["data"][0]["id"]


def references(host, port, model, prompts, max_tokens):
    """The oracle of a test: each prompt's greedy ids, one request at a time."""
    out = []
    for p in prompts:
        r = complete(host, port, model, p, max_tokens)
        if r["error"] is not None:
            raise AssertionError(f"a reference request failed: {r}")
        out.append(r["token_ids"])
    return out


def complete(host, port, model, prompt, max_tokens, stream=False, timeout=120, on_token=None, extra=None):
    """Greedy completion of token ids (`extra`: more request fields); returns {"token_ids",
    "finish_reason", "error", "status"}."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True, "stream": stream, **(extra or {})}
    c = http.client.HTTPConnection(host, port, timeout=timeout)
    out = {"token_ids": [], "finish_reason": None, "error": None, "status": None}
    try:
        c.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        r = c.getresponse()
        out["status"] = r.status
        if not stream:
            data = json.loads(r.read().decode())
            if r.status != 200:
                out["error"] = data
                return out
            ch = data["choices"][0]
            out["token_ids"] = ch["token_ids"]
            out["finish_reason"] = ch["finish_reason"]
            out["logprobs"] = ch.get("logprobs")
            return out
        if r.status != 200:
            out["error"] = r.read().decode()
            return out
        while True:
            line = r.readline()
            if not line:
                break
            line = line.decode().strip()
            if not line.startswith("data:"):
                continue
            payload = line[5:].strip()
            if payload == "[DONE]":
                break
            ev = json.loads(payload)
            if "error" in ev:
                out["error"] = ev["error"]
                continue
            ch = ev["choices"][0]
            ids = ch.get("token_ids") or []
            out["token_ids"].extend(ids)
            if ids and on_token:
                on_token(len(out["token_ids"]))
            if ch.get("finish_reason"):
                out["finish_reason"] = ch["finish_reason"]
        return out
    except (OSError, http.client.HTTPException, ValueError) as e:
        out["error"] = f"{type(e).__name__}: {e}"
        return out
    finally:
        c.close()


class Streams:
    """Requests running on threads, with their progress visible."""

    def __init__(self, host, port, model, prompts, max_tokens, stream=True, netns=None):
        self.results = [None] * len(prompts)
        self.progress = [0] * len(prompts)
        self.threads = []
        for i, p in enumerate(prompts):
            def run(i=i, p=p):
                def tick(n):
                    self.progress[i] = n
                if netns:
                    enter_netns(netns)
                self.results[i] = complete(host, port, model, p, max_tokens, stream=stream, on_token=tick)
            t = threading.Thread(target=run, daemon=True)
            t.start()
            self.threads.append(t)

    def join(self, timeout=300):
        end = time.time() + timeout
        for t in self.threads:
            t.join(max(0.1, end - time.time()))
        return self.results


def model_vocab():
    """The served model's vocabulary size (its config.json; the generated tiny model's 512 before it exists)."""
    config = paths()[1] / "config.json"
    return json.loads(config.read_text())["vocab_size"] if config.exists() else 512


def prompts(n, length=24, seed=1, vocab=None):
    """n random token-id prompts of about `length` ids below `vocab` (the served model's by default)."""
    vocab = vocab if vocab is not None else model_vocab()
    r = random.Random(seed)
    return [[r.randrange(1, vocab) for _ in range(length + (i % 5))] for i in range(n)]


# ------------------------------------------------------------------ network namespaces

NETNS_PREFIX = "trp"


def _ip(*args, check=True):
    return subprocess.run(["ip", *args], check=check, capture_output=True, text=True)


def netns_supported():
    if os.geteuid() != 0:
        return False
    probe = f"{NETNS_PREFIX}probe{os.getpid()}"
    ok = _ip("netns", "add", probe, check=False).returncode == 0
    if ok:
        _ip("netns", "del", probe, check=False)
    return ok


def delete_stale_namespaces():
    """Namespaces left by test processes that died without cleaning up."""
    out = _ip("netns", "list", check=False).stdout
    for line in out.splitlines():
        name = line.split()[0] if line.split() else ""
        if not name.startswith(NETNS_PREFIX):
            continue
        pid = name[len(NETNS_PREFIX):].split("-")[0]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            _ip("netns", "del", name, check=False)


class Hosts:
    """Hosts as network namespaces joined by veth pairs to a bridge that lives
    in a namespace of its own (nothing touches the test machine's network)."""

    def __init__(self, addresses, prefix_len=24):
        delete_stale_namespaces()
        self.tag = f"{NETNS_PREFIX}{os.getpid()}"
        self.switch = f"{self.tag}-sw"
        self.names = []
        atexit.register(self.close)
        _ip("netns", "add", self.switch)
        self.names.append(self.switch)
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")
        self.ns = {}
        for i, addr in enumerate(addresses):
            ns = f"{self.tag}-h{i}"
            _ip("netns", "add", ns)
            self.names.append(ns)
            # Every host's link is eth0, as on real hosts: UCX_NET_DEVICES=eth0
            # keeps UCX off lo (two namespaces of one machine look like one
            # host to UCX, which would pair their loopback interfaces).
            host_if, sw_if = "eth0", f"p{i}"
            _ip("link", "add", host_if, "netns", ns, "type", "veth", "peer", "name", sw_if, "netns", self.switch)
            _ip("-n", self.switch, "link", "set", sw_if, "master", "br0")
            _ip("-n", self.switch, "link", "set", sw_if, "up")
            _ip("-n", ns, "addr", "add", f"{addr}/{prefix_len}", "dev", host_if)
            _ip("-n", ns, "link", "set", host_if, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            self.ns[addr] = ns

    def close(self):
        for ns in reversed(self.names):
            subprocess.run(["ip", "netns", "pids", ns], capture_output=True)
            _ip("netns", "del", ns, check=False)
        self.names = []


CLONE_NEWNET = 0x40000000


def enter_netns(ns):
    """Moves the calling thread (only it: a network namespace is per thread)
    into namespace `ns`; sockets it opens from then on live there."""
    fd = os.open(f"/var/run/netns/{ns}", os.O_RDONLY)
    try:
        if _libc.setns(fd, CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns {ns}")
    finally:
        os.close(fd)


def run_in(ns, fn, *args, **kw):
    """fn(*args) on a thread inside namespace `ns` (None: here)."""
    if ns is None:
        return fn(*args, **kw)
    box = {}

    def body():
        try:
            enter_netns(ns)
            box["value"] = fn(*args, **kw)
        except BaseException as e:  # noqa: BLE001 - re-raised below
            box["error"] = e
    t = threading.Thread(target=body, daemon=True)
    t.start()
    t.join()
    if "error" in box:
        raise box["error"]
    return box["value"]


# ------------------------------------------------------------------ manifests

def write_manifest(path, name, model, nodes, handoff_timeout_s=10, drain_timeout_s=30, memory_budget="256MiB",
                   extra="", scale=()):
    """nodes: [{"name", "actors": [...], "address": "IP", "ports": (http, transport, range_first, range_last)}];
    a node may list "transports" (one transport port per slot) and "replicas" instead.
    scale: rules for policies.scale, each a dict of its fields ({"node": "decode", "max_workers": 2, ...})."""
    lines = [f"version: 1", f"name: {name}", "model:", f"  path: {model}", "discovery: static",
             "pools:", f"  memory_budget: {memory_budget}", "nodes:"]
    prefill, decode = [], []
    for n in nodes:
        lines.append(f"  - name: {n['name']}")
        lines.append(f"    actors: [{', '.join(n['actors'])}]")
        http_port, transport, first, last = n["ports"]
        if "transports" in n:
            slots = ", ".join(f"{n['address']}:{t}" for t in n["transports"])
            lines.append(f"    address: [{slots}]")
            lines.append(f"    replicas: {n.get('replicas', 1)}")
        else:
            lines.append(f"    address: {n['address']}:{transport}")
        lines += ["    ports:", f"      http: {http_port}", f"      transport: {transport}",
                  f"      transport_range: {first}-{last}"]
        if "prefill" in n["actors"]:
            prefill.append(n["name"])
        if "decode" in n["actors"]:
            decode.append(n["name"])
    lines += ["policies:", "  restart:", "    max_restarts: 5", "    window_s: 60", "  disaggregation:",
              f"    prefill: [{', '.join(prefill)}]", f"    decode: [{', '.join(decode)}]",
              f"    handoff_timeout_s: {handoff_timeout_s}"]
    if scale:
        lines.append("  scale:")
        for rule in scale:
            items = list(rule.items())
            lines.append(f"    - {items[0][0]}: {items[0][1]}")
            lines += [f"      {k}: {v}" for k, v in items[1:]]
    lines += ["drain:", f"  timeout_s: {drain_timeout_s}"]
    Path(path).write_text("\n".join(lines) + "\n" + extra)
    return Path(path)


class Topo:
    """front (gateway + router), prefill, and N decode processes on 127.0.0.1,
    each with ports of its own. (UCX accepts connections only on an address an
    interface has, so every process shares 127.0.0.1 and differs by port.)"""

    def __init__(self, decode_processes=1, layout=None):
        """layout: [(name, actors)] instead of front, prefill and the decode processes."""
        if layout is None:
            names = ["front", "prefill"] + (["decode"] if decode_processes == 1 else
                                            [f"decode{chr(ord('a') + i)}" for i in range(decode_processes)])
            layout = [(n, ["gateway", "router"] if n == "front" else
                       ["prefill" if n == "prefill" else "decode", "cache_shard"]) for n in names]
        base = free_port_block(10 * len(layout))
        self.nodes = []
        self.http = {}
        for i, (n, actors) in enumerate(layout):
            b = base + 10 * i
            self.nodes.append({"name": n, "actors": actors, "address": "127.0.0.1", "ports": (b, b + 1, b + 2, b + 9)})
            self.http[n] = b
        self.host = "127.0.0.1"
        self.decodes = [n for n, actors in layout if "decode" in actors]

    def port(self, node):
        return self.http[node]


class TwoDecodeProcesses(unittest.TestCase):
    """front (gateway + router), prefill and two decode processes (decodea,
    decodeb) on 127.0.0.1 from one manifest, up and ready before each test.
    Subclasses set NAME and MANIFEST (write_manifest's keyword arguments)."""
    NAME = "two-decode"
    MANIFEST = {}

    def setUp(self):
        troupe, model = paths()
        ensure_model(troupe, model)
        self.dir = Path(tempfile.mkdtemp(prefix=f"troupe-{self.NAME}-"))
        self.cluster = Cluster(self.dir, troupe, {"UCX_NET_DEVICES": "lo"})
        self.addCleanup(self.cluster.close)  # also when setUp fails below
        self.topo = Topo(decode_processes=2)
        manifest = write_manifest(self.dir / f"{self.NAME}.yaml", self.NAME, model, self.topo.nodes, **self.MANIFEST)
        self.procs = {n: self.cluster.start(n, manifest) for n in ("front", "prefill", "decodea", "decodeb")}
        wait_all_ready(self.cluster, "127.0.0.1", [self.topo.port(n) for n in self.procs])
        self.front = self.topo.port("front")
        self.model = model_id("127.0.0.1", self.front)

    def tearDown(self):
        if self._outcome.result.failures or self._outcome.result.errors:
            print(self.cluster.logs())
