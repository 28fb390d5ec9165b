"""What the tests in tests/actors share: a `troupe serve` process on a free
loopback port (killed and reaped however the test ends), /metrics parsing,
a raw HTTP/SSE client and the `troupe forward` greedy oracle.

Every server runs with PR_SET_PDEATHSIG, so even a test process killed by
CTest's timeout takes its servers with it.
"""
import argparse
import atexit
import ctypes
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback

import numpy as np

_libc = ctypes.CDLL("libc.so.6", use_errno=True)
_servers = []


def _die_with_parent():
    _libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.environ.get("TROUPE_TEST_CORES"):  # debugging: keep core files (in that directory)
        import resource
        resource.setrlimit(resource.RLIMIT_CORE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
        os.chdir(os.environ["TROUPE_TEST_CORES"])


def _kill_all():
    for s in list(_servers):
        s.stop()


atexit.register(_kill_all)
signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))


def args():
    p = argparse.ArgumentParser()
    p.add_argument("--troupe", required=True)
    p.add_argument("--home", required=True, help="TROUPE_HOME shared by the actor tests")
    p.add_argument("--only", default="", help="run only cases whose name contains this")
    return p.parse_args()


class Server:
    """`troupe serve` with `extra` flags; the port is read from its log."""

    def __init__(self, troupe, home, extra=(), name="serve", env=None, ready_timeout=120):
        self.troupe, self.home, self.extra = troupe, home, list(extra)
        self.log_path = os.path.join(tempfile.gettempdir(), f"troupe-{name}-{os.getpid()}-{time.monotonic_ns()}.log")
        self.log = open(self.log_path, "w+")
        e = dict(os.environ, TROUPE_HOME=home)
        e.update(env or {})
        self.proc = subprocess.Popen([troupe, "serve", "--port", "0", *self.extra], stdout=self.log,
                                     stderr=subprocess.STDOUT, env=e, preexec_fn=_die_with_parent)
        _servers.append(self)
        self.port = None
        deadline = time.monotonic() + ready_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"troupe serve exited with {self.proc.returncode}:\n{self.tail()}")
            m = re.search(r"on http://[^:]+:(\d+)", open(self.log_path).read())
            if m:
                self.port = int(m.group(1))
                break
            time.sleep(0.05)
        if self.port is None:
            self.stop()
            raise RuntimeError("troupe serve did not start listening:\n" + self.tail())
        self.url = f"http://127.0.0.1:{self.port}"
        self.base_url = self.url + "/v1"
        while time.monotonic() < deadline:
            try:
                if self.get("/health")[0] == 200:
                    return
            except OSError:
                pass
            time.sleep(0.05)
        self.stop()
        raise RuntimeError("troupe serve never became healthy:\n" + self.tail())

    def tail(self, n=4000):
        try:
            return open(self.log_path).read()[-n:]
        except OSError:
            return ""

    def alive(self):
        return self.proc.poll() is None

    def stop(self, sig=signal.SIGKILL, timeout=20):
        """Ends the server (SIGKILL unless told otherwise) and reaps it; returns its exit status."""
        if self in _servers:
            _servers.remove(self)
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        return self.proc.returncode

    def __enter__(self):
        return self

    def __exit__(self, exc_type, *exc):
        code = self.stop()
        if exc_type is not None:
            print(f"--- server log ({self.log_path}, exit {code}) ---\n{self.tail()}", flush=True)

    # ---- HTTP ------------------------------------------------------------------------
    def request(self, method, path, body=None, headers=None, timeout=120):
        """One request on a fresh connection: (status, headers, parsed JSON or text)."""
        import http.client
        c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            data = body if isinstance(body, (bytes, str)) or body is None else json.dumps(body)
            h = {"content-type": "application/json"}
            h.update(headers or {})
            c.request(method, path, body=data, headers=h)
            r = c.getresponse()
            raw = r.read().decode()
            try:
                parsed = json.loads(raw)
            except ValueError:
                parsed = raw
            return r.status, dict(r.getheaders()), parsed
        finally:
            c.close()

    def get(self, path, **kw):
        s, _, b = self.request("GET", path, **kw)
        return s, b

    def post(self, path, body, **kw):
        s, _, b = self.request("POST", path, body, **kw)
        return s, b

    def metrics(self):
        """{(name, frozenset(labels.items())): value} from /metrics."""
        s, text = self.get("/metrics")
        assert s == 200, s
        return parse_metrics(text)

    def metric_sum(self, name, **labels):
        return metric(self.metrics(), name, **labels)

    def rss_bytes(self):
        with open(f"/proc/{self.proc.pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
        return 0

    def wait_for(self, what, predicate, timeout=60, every=0.1):
        """Polls predicate() until it is truthy; fails the test with `what` after timeout."""
        deadline = time.monotonic() + timeout
        last = None
        while time.monotonic() < deadline:
            last = predicate()
            if last:
                return last
            time.sleep(every)
        raise AssertionError(f"timed out after {timeout} s waiting for {what} (last: {last})")

    def idle_pages(self):
        """Waits until no request holds pages; returns the pool page counts then."""
        def check():
            m = self.metrics()
            running = sum(v for (n, _), v in m.items() if n == "troupe_running")
            leased = sum(v for (n, ls), v in m.items() if n == "troupe_pool_pages" and dict(ls)["state"] in ("leased", "parked"))
            return m if running == 0 and leased == 0 else None
        return self.wait_for("every worker to be idle with no leased or parked pages", check, timeout=60, every=0.2)


def parse_metrics(text):
    out = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = re.match(r"([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})?\s+(\S+)$", line)
        if not m:
            continue
        labels = dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', m.group(3) or ""))
        out[(m.group(1), frozenset(labels.items()))] = float(m.group(4))
    return out


def metric(m, name, **labels):
    """The sum of `name` over the series whose labels include `labels`."""
    return sum(v for (n, ls), v in m.items() if n == name and all(dict(ls).get(k) == w for k, w in labels.items()))


def pages_by_state(m, state):
    return sum(v for (n, ls), v in m.items() if n == "troupe_pool_pages" and dict(ls)["state"] == state)


# ---- streaming without the SDK (for disconnect and load tests) ------------------------

def open_stream(port, body, path="/v1/completions", timeout=120):
    """Sends a streaming request on a raw socket; returns the socket (read with read_events)."""
    s = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    data = json.dumps(dict(body, stream=True)).encode()
    s.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    return s


def read_events(sock, want=None):
    """Reads SSE `data:` payloads from a chunked response until [DONE] (or `want` events)."""
    buf = b""
    events = []
    while True:
        chunk = sock.recv(65536)
        if not chunk:
            break
        buf += chunk
        parts = buf.split(b"\n\n")
        buf = parts.pop()
        for p in parts:
            i = p.find(b"data: ")
            if i < 0:
                continue
            payload = p[i + 6:].decode()
            if payload == "[DONE]":
                return events, True
            events.append(json.loads(payload))
            if want is not None and len(events) >= want:
                return events, False
    return events, False


async def sse_payloads(reader):
    """asyncio form for keep-alive clients: after the response head was read,
    yields each `data:` payload (bytes; b"[DONE]" included) of the chunked body
    and returns at its last chunk, leaving the connection ready for the next request."""
    buf = b""
    while True:
        size = int((await reader.readuntil(b"\r\n")).strip(), 16)
        chunk = await reader.readexactly(size + 2)
        if size == 0:
            return
        buf += chunk[:-2]
        while b"\n\n" in buf:
            ev, buf = buf.split(b"\n\n", 1)
            yield ev[len(b"data: "):]


# ---- the oracle ----------------------------------------------------------------------

def model_dir(home):
    return os.path.join(home, "models", "deepseek-v4-tiny")


def forward_logits(troupe, model, ids, prefill):
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "logits.npy")
        subprocess.run([troupe, "forward", "--model", model, "--ids", ",".join(map(str, ids)), "--prefill",
                        str(prefill), "--out", out], check=True, capture_output=True, timeout=300,
                       preexec_fn=_die_with_parent)
        return np.load(out)


def check_greedy(troupe, model, prompt_ids, tokens):
    """True when `tokens` is the greedy continuation of `prompt_ids` under `troupe forward`:
    the argmax after the prompt and after every token fed back (teacher forcing
    with the tokens themselves is the iterative argmax loop when each one matches).
    Returns the list of mismatching positions (empty: equal)."""
    ids = list(prompt_ids) + list(tokens[:-1])
    logits = forward_logits(troupe, model, ids, len(prompt_ids))
    argmax = logits[len(prompt_ids) - 1:].argmax(axis=1)
    return [i for i, (a, t) in enumerate(zip(argmax, tokens)) if int(a) != int(t)]


# ---- a tiny runner: test_* functions, a closing "N passed, N failed" line ---------------

def run(namespace, only=""):
    cases = [(n, f) for n, f in namespace.items() if n.startswith("test_") and callable(f) and only in n]
    passed = failed = 0
    for name, f in cases:
        t0 = time.monotonic()
        try:
            f()
            passed += 1
            print(f"PASS {name} ({time.monotonic() - t0:.1f} s)", flush=True)
        except Exception:
            failed += 1
            print(f"FAIL {name} ({time.monotonic() - t0:.1f} s)", flush=True)
            traceback.print_exc()
            for s in list(_servers):
                print(f"--- server log ({s.log_path}) ---\n{s.tail()}", flush=True)
            _kill_all()  # the next case starts clean
    print(f"{passed} passed, {failed} failed", flush=True)
    return 1 if failed or not passed else 0


# ---- many streams at once through the SDK ---------------------------------------------

class Streams:
    """Runs one streaming completion per body on its own thread with the
    official SDK; collects token ids, finish reasons and errors."""

    def __init__(self, base_url, bodies, api_key="unused"):
        import openai
        import threading
        self.n = len(bodies)
        self.tokens = [[] for _ in bodies]
        self.finish = [None] * self.n
        self.errors = []
        self._lock = threading.Lock()
        self._client = openai.OpenAI(api_key=api_key, base_url=base_url, max_retries=0, timeout=300)
        self._threads = [threading.Thread(target=self._run, args=(i, b), daemon=True) for i, b in enumerate(bodies)]
        for t in self._threads:
            t.start()

    def _run(self, i, body):
        try:
            body = dict(body)
            extra = {k: body.pop(k) for k in ("return_token_ids", "ignore_eos", "min_tokens") if k in body}
            extra["return_token_ids"] = True
            for ch in self._client.completions.create(stream=True, extra_body=extra, **body):
                for c in ch.choices:
                    with self._lock:
                        self.tokens[i] += (c.model_extra or {}).get("token_ids") or []
                        self.finish[i] = c.finish_reason or self.finish[i]
        except Exception as e:  # the client must never see one
            with self._lock:
                self.errors.append(f"stream {i}: {type(e).__name__}: {e}")

    def min_tokens(self):
        with self._lock:
            return min(len(t) for t in self.tokens)

    def count_with(self, k):
        with self._lock:
            return sum(len(t) >= k for t in self.tokens)

    def join(self, timeout=300):
        deadline = time.monotonic() + timeout
        for t in self._threads:
            t.join(max(0.1, deadline - time.monotonic()))
        alive = sum(t.is_alive() for t in self._threads)
        assert alive == 0, f"{alive} streams still running after {timeout} s"
        return self


def distinct_prompts(n, words=12):
    return [f"request {i}: " + " ".join(f"w{(i * 7 + j) % 97}" for j in range(words)) for i in range(n)]
