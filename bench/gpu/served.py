"""A `troupe serve` process for the GPU machine's scripts (pool_budget_check.py, offload_bench.py): started in a
session of its own on 127.0.0.1, ready once /health answers, stopped with SIGTERM (SIGKILL after a grace period);
and the HTTP calls those scripts make to it."""
import json
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request


class NotServing(Exception):
    """The server exited or did not answer /health in time (the message says which)."""


class Served:
    """with Served(cmd, log_path, port, start_s) as s: ... (raises NotServing from the with statement)."""

    def __init__(self, cmd, log_path, port, start_s=120, stop_s=60):
        self.cmd, self.log_path, self.port, self.start_s, self.stop_s = cmd, log_path, port, start_s, stop_s
        self.proc = None

    def __enter__(self):
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(self.cmd, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        end = time.time() + self.start_s
        while True:
            if self.proc.poll() is not None:
                self.__exit__(None, None, None)
                raise NotServing(f"exited with {self.proc.returncode} before it was ready")
            try:
                if request(self.port, "/health", timeout=2)[0] == 200:
                    return self
            except OSError:
                pass
            if time.time() > end:
                self.__exit__(None, None, None)
                raise NotServing(f"not ready after {self.start_s} s")
            time.sleep(0.2)

    def __exit__(self, *exc):
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=self.stop_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.log.close()
        return False

    def model_id(self):
        return json.loads(request(self.port, "/v1/models")[1])["data"][0]["id"]


def open_request(port, path, body=None, timeout=60):
    """urlopen of a GET (body None) or a JSON POST to 127.0.0.1:port (raises HTTPError on 4xx/5xx)."""
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", method="POST" if body is not None else "GET",
                                 data=json.dumps(body).encode() if body is not None else None,
                                 headers={"Content-Type": "application/json"})
    return urllib.request.urlopen(req, timeout=timeout)


def request(port, path, body=None, timeout=60):
    """(status, body text) of a GET or a JSON POST, 4xx/5xx included."""
    try:
        with open_request(port, path, body, timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def metrics(port):
    """/metrics as {series: value}."""
    status, body = request(port, "/metrics")
    assert status == 200, body
    out = {}
    for line in body.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


def summed(m, name, *must):
    """The sum of a metric's series whose labels contain every string of `must`."""
    return sum(v for k, v in m.items() if (k == name or k.startswith(name + "{")) and all(s in k for s in must))
