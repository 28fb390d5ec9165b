#!/usr/bin/env python3
"""`troupe serve --frame-port`: talking to a real server in troupe frames.

The Python client (clients/python/troupe_client.py) and `troupe client`
against one server (embedded model) that also serves HTTP: greedy generation
over frames gives the same ids and text as /v1/completions; Abort, Park and
Resume (same greedy ids), ListModels, a closed connection aborts its requests; bad requests get Error frames and
the server keeps serving.
"""
import json
import re
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path

import harness

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "clients" / "python"))
from troupe_client import HEADER, MAGIC, VERSION, Client, TroupeError  # noqa: E402

A = harness.args()
MODEL = "deepseek-v4-tiny"
MAX_LEN = 512
server = None
frame_port = None


def srv():
    global server, frame_port
    if server is None or not server.alive():
        server = harness.Server(A.troupe, A.home, ["--frame-port", "0", "--max-model-len", str(MAX_LEN),
                                                   "--host-memory-mib", "64"], name="frames")
        m = re.search(r"frames on tcp://[^:]+:(\d+)", server.tail(100000))
        assert m, server.tail()
        frame_port = int(m.group(1))
    return server


def client():
    srv()
    return Client("127.0.0.1", frame_port, timeout=120)


def http_completion(prompt, max_tokens, **kw):
    s, b = srv().post("/v1/completions", dict(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                              return_token_ids=True, **kw))
    assert s == 200, (s, b)
    return b["choices"][0]


def still_serving(c=None):
    own = c is None
    c = c or client()
    try:
        out = c.generate(text="still there?", max_tokens=2, temperature=0.0, ignore_eos=True, return_token_ids=True)
        assert out["finish_reason"] == "length" and len(out["token_ids"]) == 2, out
    finally:
        if own:
            c.close()
    assert srv().alive()


def expect_error(fn, code, *words):
    try:
        fn()
    except TroupeError as e:
        assert e.code == code, (e.code, e.message)
        for w in words:
            assert w in e.message, (w, e.message)
        return e
    raise AssertionError(f"expected an Error frame {code}")


def test_greedy_ids_match_http():
    ref_text = http_completion("The quick brown fox", 4)
    prompt_ids = ref_text["prompt_token_ids"]
    assert prompt_ids, ref_text
    ref = http_completion(prompt_ids, 16, ignore_eos=True)
    with client() as c:
        out = c.generate(token_ids=prompt_ids, max_tokens=16, temperature=0.0, ignore_eos=True, return_token_ids=True)
        assert out["token_ids"] == ref["token_ids"], (out["token_ids"], ref["token_ids"])
        assert out["text"] == ref["text"], (out["text"], ref["text"])
        assert out["finish_reason"] == "length", out
        assert out["usage"]["prompt_tokens"] == len(prompt_ids) and out["usage"]["completion_tokens"] == 16, out
        # Text prompts are tokenized by the server the same way as over HTTP.
        t = c.generate(text="The quick brown fox", max_tokens=4, temperature=0.0, return_token_ids=True)
        assert t["token_ids"] == ref_text["token_ids"] and t["text"] == ref_text["text"], (t, ref_text)
        # Streaming: one chunk per batch, indices contiguous.
        rid = c.submit(token_ids=prompt_ids, max_tokens=8, temperature=0.0, ignore_eos=True, return_token_ids=True)
        index = 0
        for kind, msg in c.events(rid):
            if kind == "chunk":
                assert msg.index == index, (msg.index, index)
                index += len(msg.tokenIds)
        assert index == 8
        # Penalties (repetitionPenalty, frequencyPenalty, presencePenalty) as over HTTP.
        pen = dict(repetition_penalty=0.8, frequency_penalty=0.3, presence_penalty=-2.0)
        ref_pen = http_completion(prompt_ids, 24, ignore_eos=True, **pen)
        assert ref_pen["token_ids"] != http_completion(prompt_ids, 24, ignore_eos=True)["token_ids"], ref_pen
        out = c.generate(token_ids=prompt_ids, max_tokens=24, temperature=0.0, ignore_eos=True, return_token_ids=True,
                         **pen)
        assert out["token_ids"] == ref_pen["token_ids"], (out["token_ids"], ref_pen["token_ids"])
        out = c.generate(token_ids=prompt_ids, max_tokens=4, temperature=0.0, return_token_ids=True,
                         logit_bias={1234: 100.0})
        assert out["token_ids"] == [1234] * 4, out


def test_chat_matches_http():
    s, b = srv().post("/v1/chat/completions", dict(model=MODEL, messages=[{"role": "user", "content": "hello"}],
                                                   max_tokens=6, temperature=0))
    assert s == 200, (s, b)
    with client() as c:
        out = c.generate(chat=[("user", "hello")], max_tokens=6, temperature=0.0)
    assert out["text"] == b["choices"][0]["message"]["content"], (out, b)
    assert out["usage"]["prompt_tokens"] == b["usage"]["prompt_tokens"], (out, b)


def test_json_schema_matches_http():
    """GenerateRequest.sampling.jsonSchema: the same answer as HTTP's response_format, valid under the schema."""
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer"},
                                               "tag": {"enum": ["a", "b"]}}, "required": ["ok", "n", "tag"]}
    s, b = srv().post("/v1/completions", dict(model=MODEL, prompt="state:", max_tokens=300, temperature=0,
                                              response_format={"type": "json_schema",
                                                               "json_schema": {"name": "s", "schema": schema}}))
    assert s == 200 and b["choices"][0]["finish_reason"] == "stop", (s, b)
    with client() as c:
        out = c.generate(text="state:", max_tokens=300, temperature=0.0, json_schema=schema)
        assert out["text"] == b["choices"][0]["text"], (out, b)
        v = json.loads(out["text"])
        assert set(v) == {"ok", "n", "tag"} and isinstance(v["ok"], bool) and v["tag"] in ("a", "b"), v
        expect_error(lambda: c.generate(text="x", json_schema={"type": "string", "format": "email", "pattern": "\\1"},
                                        max_tokens=2), "invalidArgument", "backreferences")
        # sampling.regex: the same answer as HTTP's guided_regex, matched whole; a bad pattern is named.
        pattern = r"(on|off) [0-9]{2,3} ?[a-z]{0,4}"
        s, b = srv().post("/v1/completions", dict(model=MODEL, prompt="state:", max_tokens=30, temperature=0,
                                                  guided_regex=pattern))
        assert s == 200 and b["choices"][0]["finish_reason"] == "stop", (s, b)
        out = c.generate(text="state:", max_tokens=30, temperature=0.0, regex=pattern)
        assert out["text"] == b["choices"][0]["text"] and re.fullmatch(pattern, out["text"]), (out, b)
        expect_error(lambda: c.generate(text="x", regex="a{3,1}", max_tokens=2), "invalidArgument", "m below n")
        expect_error(lambda: c.generate(text="x", regex="a", json_schema={}, max_tokens=2), "invalidArgument", "regex")
        # sampling.ebnf: a text the grammar derives; a bad grammar is named.
        grammar = 'root ::= word (" " word){0,2}\nword ::= [a-z]{1,5}'
        out = c.generate(text="state:", max_tokens=30, temperature=0.0, ebnf=grammar)
        assert out["finish_reason"] == "stop" and re.fullmatch(r"[a-z]{1,5}( [a-z]{1,5}){0,2}", out["text"]), out
        expect_error(lambda: c.generate(text="x", ebnf="root ::= (", max_tokens=2), "invalidArgument", "unclosed")


def test_deadlines_far_and_past():
    """deadlineUnixNanos is unsigned: one past 2^63 ns (read as a negative int64 before) is no deadline, one
    in the past is refused as passed."""
    with client() as c:
        out = c.generate(text="far", max_tokens=3, temperature=0.0, ignore_eos=True, return_token_ids=True,
                         deadline_unix_nanos=(1 << 64) - 1)
        assert len(out["token_ids"]) == 3, out
        expect_error(lambda: c.generate(text="late", max_tokens=3, deadline_unix_nanos=1), "deadlineExceeded")
        still_serving(c)


def test_list_models():
    with client() as c:
        models = c.list_models()
    assert len(models) == 1 and models[0]["id"] == MODEL, models
    assert models[0]["maxContext"] == MAX_LEN and models[0]["vocabSize"] > 0 and models[0]["ownedBy"] == "troupe", models


def test_abort():
    with client() as c:
        rid = c.submit(text="a long one", max_tokens=400, temperature=0.0, ignore_eos=True, return_token_ids=True)
        chunks, finish = 0, None
        for kind, msg in c.events(rid):
            if kind == "chunk":
                chunks += 1
                if chunks == 2:
                    c.abort(rid, "test")
            elif kind == "finish":
                finish = msg
        assert str(finish.reason) == "aborted" and finish.completionTokens < 400, finish
        # The request is gone: aborting it again names it unknown.
        c.abort(rid)
        expect_error(lambda: list(c.events(rid)), "notFound", str(rid))
        still_serving(c)
    srv().idle_pages()


def test_disconnect_aborts():
    before = srv().metric_sum("troupe_client_aborts_total")
    c = client()
    rid = c.submit(text="going away", max_tokens=400, temperature=0.0, ignore_eos=True)
    kind, _ = next(c.events(rid))
    assert kind == "chunk"
    c.close()
    srv().wait_for("the server to abort the request of the closed connection",
                   lambda: srv().metric_sum("troupe_client_aborts_total") >= before + 1, timeout=30)
    srv().idle_pages()
    still_serving()


def test_bad_requests():
    with client() as c:
        expect_error(lambda: c.generate(token_ids=[1, 10_000_000], max_tokens=2), "invalidArgument", "out of range")
        expect_error(lambda: c.generate(text="x", model="nope", max_tokens=2), "notFound", "nope")
        expect_error(lambda: c.generate(text="x", max_tokens=0), "invalidArgument", "maxTokens")
        expect_error(lambda: c.generate(token_ids=[], max_tokens=2), "invalidArgument", "empty")
        expect_error(lambda: c.generate(text="x", temperature=5.0, max_tokens=2), "invalidArgument", "temperature")
        expect_error(lambda: c.generate(text="x", frequency_penalty=2.5, max_tokens=2), "invalidArgument",
                     "frequencyPenalty")
        expect_error(lambda: c.generate(text="x", presence_penalty=-2.5, max_tokens=2), "invalidArgument",
                     "presencePenalty")
        expect_error(lambda: c.generate(text="x", repetition_penalty=0.0, max_tokens=2), "invalidArgument",
                     "repetitionPenalty")
        expect_error(lambda: c.generate(text="x", min_p=1.5, max_tokens=2), "invalidArgument", "minP")
        expect_error(lambda: c.generate(text="x", logit_bias={5: 150.0}, max_tokens=2), "invalidArgument", "logitBias")
        expect_error(lambda: c.generate(text="x", logit_bias={10_000_000: 1.0}, max_tokens=2), "invalidArgument",
                     "out of range")
        expect_error(lambda: c.generate(token_ids=[1] * 100, max_tokens=MAX_LEN), "invalidArgument", "context length")
        # Park / Resume of a request that is not running; Resume of one not parked.
        c.park(999)
        expect_error(lambda: list(c.events(999)), "notFound", "999")
        c.resume(998)
        expect_error(lambda: list(c.events(998)), "notFound", "998")
        rid = c.submit(text="not parked", max_tokens=400, temperature=0.0, ignore_eos=True)
        c.resume(rid)
        while True:
            kind, msg = c._wait(rid)
            if kind == c.kind.error:
                assert str(msg.code) == "invalidArgument" and "not parked" in msg.message, msg
                break
            assert kind == c.kind.tokenChunk, (kind, msg)
        c.abort(rid)  # the request itself is still running: abort it
        while True:
            kind, msg = c._wait(rid)
            if kind in (c.kind.finish, c.kind.error):
                break
        # A second request under a running one's id: one Error, and it ends the running one too (aborted,
        # its pages freed): nothing more arrives for that id.
        rid = c.submit(text="first of two", max_tokens=400, temperature=0.0, ignore_eos=True)
        assert c._wait(rid)[0] == c.kind.tokenChunk
        g = c.schemas["generate"].GenerateRequest.new_message()
        g.prompt.text = "second under the same id"
        g.maxTokens = 4
        c.send(c.kind.generateRequest, rid, g)
        while True:
            kind, msg = c._wait(rid)
            if kind == c.kind.error:
                assert str(msg.code) == "invalidArgument" and "already running" in msg.message, msg
                break
            assert kind == c.kind.tokenChunk, (kind, msg)  # sent before the duplicate arrived
        srv().idle_pages()
        still_serving(c)
        assert not c._pending.get(rid), c._pending.get(rid)
        # Request id 0 is reserved.
        g = c.schemas["generate"].GenerateRequest.new_message()
        g.prompt.text = "x"
        c.send(c.kind.generateRequest, 0, g)
        expect_error(lambda: list(c.events(0)), "invalidArgument", "reserved")
        still_serving(c)
    # Garbage on a connection: an Error frame, the connection closes, the server stays up.
    s = socket.create_connection(("127.0.0.1", frame_port), timeout=30)
    s.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n"[:HEADER.size])  # one header's worth: nothing left unread
    data = b""
    while True:
        try:
            chunk = s.recv(65536)
        except ConnectionResetError:
            break
        if not chunk:
            break
        data += chunk
    s.close()
    assert len(data) >= HEADER.size, data
    magic, version, kind, _, size, _ = HEADER.unpack(data[:HEADER.size])
    assert magic == MAGIC and version == VERSION and kind == 1, data[:32]
    # A frame with an unreadable body: an Error frame, the connection stays usable.
    with client() as c:
        c.send_bytes(HEADER.pack(MAGIC, VERSION, c.kind.generateRequest, 7, 8, 0) + b"\xff" * 8)
        kind, rid, body = c.recv_frame()
        assert kind == c.kind.error and rid == 7, (kind, rid)
        still_serving(c)
    still_serving()


def test_park_resume():
    """Park a running request: Ack, then silence while its KV sits in the host
    tier (the worker's parked gauge says so); Resume: Ack, and the stream goes
    on with exactly the greedy ids of an unparked run; Finish.parks counts."""
    prompt = "Park me for a while, then carry on"
    ref = http_completion(prompt, 120, ignore_eos=True)["token_ids"]
    parks_before = srv().metric_sum("troupe_frame_parks_total")
    with client() as c:
        rid = c.submit(text=prompt, max_tokens=120, temperature=0.0, ignore_eos=True, return_token_ids=True)
        ids, acks, finish = [], [], None
        parked_at = None
        for kind, msg in c.events(rid):
            if kind == "chunk":
                assert not acks or acks[-1] != "park", "a token arrived while parked"
                ids += list(msg.tokenIds)
                if len(ids) >= 5 and parked_at is None:
                    c.park(rid, "test")
                    parked_at = len(ids)
            elif kind == "ack":
                of = str(msg.ofKind)
                acks.append(of)
                if of == "park":
                    if len(acks) == 1:
                        c.park(rid)  # again: acknowledged, nothing changes
                        continue
                    assert msg.detail == "already parked", msg
                    # Parked: its state sits in the host tier and nothing streams.
                    srv().wait_for("the request to be parked in the engine",
                                   lambda: srv().metric_sum("troupe_parked") >= 1, timeout=30)
                    c.sock.settimeout(0.8)
                    try:
                        c.recv_frame()
                        raise AssertionError("a frame arrived while the request was parked")
                    except socket.timeout:
                        pass
                    finally:
                        c.sock.settimeout(120)
                    c.resume(rid)
            elif kind == "finish":
                finish = msg
        assert acks == ["park", "park", "resume"], acks
        assert ids == ref, (parked_at, ids, ref)
        assert str(finish.reason) == "length" and finish.parks == 1 and finish.completionTokens == 120, finish
        # Parked before its first token (Park right after submit): the same ids.
        rid = c.submit(text=prompt, max_tokens=120, temperature=0.0, ignore_eos=True, return_token_ids=True)
        c.park(rid)
        kind, msg = next(c.events(rid))
        assert kind == "ack" and str(msg.ofKind) == "park", (kind, msg)
        time.sleep(0.3)
        c.resume(rid)
        ids = []
        for kind, msg in c.events(rid):
            if kind == "chunk":
                ids += list(msg.tokenIds)
        assert ids == ref, (ids, ref)
        # Park, then Abort while parked: Finish{aborted}, and its host pages go.
        rid = c.submit(text=prompt, max_tokens=400, temperature=0.0, ignore_eos=True)
        kind, _ = next(c.events(rid))
        assert kind == "chunk"
        c.park(rid)
        while True:
            kind, msg = c._wait(rid)
            if kind == c.kind.ack:
                break
        c.abort(rid)
        while True:
            kind, msg = c._wait(rid)
            if kind == c.kind.finish:
                assert str(msg.reason) == "aborted", msg
                break
            assert kind == c.kind.tokenChunk, (kind, msg)  # held tokens are dropped; none should come
    assert srv().metric_sum("troupe_frame_parks_total") - parks_before == 3
    srv().idle_pages()
    # Without a host tier the state cannot be kept: the worker drops it and the
    # request is recomputed from its tokens on Resume; the ids are the same.
    with harness.Server(A.troupe, A.home, ["--frame-port", "0", "--max-model-len", str(MAX_LEN)], name="fnohost") as s:
        port = int(re.search(r"frames on tcp://[^:]+:(\d+)", s.tail(100000)).group(1))
        with Client("127.0.0.1", port, timeout=120) as c:
            rid = c.submit(text=prompt, max_tokens=120, temperature=0.0, ignore_eos=True, return_token_ids=True)
            ids, finish = [], None
            for kind, msg in c.events(rid):
                if kind == "chunk":
                    ids += list(msg.tokenIds)
                    if len(ids) >= 5 and finish is None and not s.metric_sum("troupe_frame_parks_total"):
                        c.park(rid)
                elif kind == "ack" and str(msg.ofKind) == "park":
                    s.wait_for("the worker to drop the parked request's state",
                               lambda: s.metric_sum("troupe_running") == 0, timeout=30)
                    c.resume(rid)
                elif kind == "finish":
                    finish = msg
        assert ids == ref and finish.parks == 1, (ids, ref, finish)
        s.idle_pages()
    # troupe client --park-after: parks after 3 chunks, resumes 300 ms later, same ids.
    ids_ref = http_completion(prompt, 20, ignore_eos=True)
    p = subprocess.run([A.troupe, "client", "--connect", f"127.0.0.1:{frame_port}", "generate", "--prompt", prompt,
                        "--max-tokens", "20", "--temperature", "0", "--ignore-eos", "--return-token-ids",
                        "--park-after", "3", "--resume-after-ms", "300"], capture_output=True, text=True, timeout=120,
                       preexec_fn=harness._die_with_parent)
    assert p.returncode == 0, (p.returncode, p.stdout, p.stderr)
    ids = [int(x) for x in re.search(r"^ids: (.*)$", p.stdout, re.M).group(1).split(",")]
    assert ids == ids_ref["token_ids"], (ids, ids_ref["token_ids"])
    assert "[Park acknowledged" in p.stderr and "[Resume acknowledged" in p.stderr and "parks 1]" in p.stderr, p.stderr
    still_serving()


def test_stop_strings_match_http():
    ref = http_completion("Once upon a time", 24, ignore_eos=True)
    text = ref["text"]
    if len(text) < 8:
        print(f"skipped: the greedy text is too short to cut ({text!r})")
        return
    stop = text[len(text) // 2:len(text) // 2 + 3]
    want = http_completion("Once upon a time", 24, ignore_eos=True, stop=[stop])
    assert want["finish_reason"] == "stop", want
    with client() as c:
        out = c.generate(text="Once upon a time", max_tokens=24, temperature=0.0, ignore_eos=True, stop=[stop])
    assert out["finish_reason"] == "stop" and out["text"] == want["text"], (stop, out, want)
    assert stop not in out["text"], (stop, out)


def test_worker_crash_is_invisible_over_frames():
    """A worker crashes mid-stream (2 workers): every frame stream completes with
    the ids of an undisturbed run; the gateway resubmitted at least one."""
    with harness.Server(A.troupe, A.home, ["--workers", "2", "--test-hooks", "--frame-port", "0"], name="fcrash") as s:
        port = int(re.search(r"frames on tcp://[^:]+:(\d+)", s.tail(100000)).group(1))
        prompts = harness.distinct_prompts(6, 12)
        with Client("127.0.0.1", port, timeout=120) as c:
            ref = [c.generate(text=p, max_tokens=40, temperature=0.0, ignore_eos=True, return_token_ids=True)["token_ids"]
                   for p in prompts]
            before = s.metric_sum("troupe_resubmits_total")
            rids = {c.submit(text=p, max_tokens=40, temperature=0.0, ignore_eos=True, return_token_ids=True): i
                    for i, p in enumerate(prompts)}
            got = {rid: [] for rid in rids}
            done, crashed = set(), False
            while len(done) < len(rids):
                kind, rid, body = c.recv_frame()
                msg = c.decode(kind, body)
                assert kind != c.kind.error, (rid, msg)
                if kind == c.kind.tokenChunk:
                    got[rid] += list(msg.tokenIds)
                elif kind == c.kind.finish:
                    assert str(msg.reason) == "length", msg
                    done.add(rid)
                if not crashed and all(len(v) >= 3 for v in got.values()):
                    st, b = s.post("/admin/crash", {"worker": "worker-0"})
                    assert st == 200, b
                    crashed = True
            assert crashed
            for rid, i in rids.items():
                assert got[rid] == ref[i], (i, got[rid], ref[i])
        m = s.idle_pages()
        assert harness.metric(m, "troupe_resubmits_total") - before >= 1, "no request ran on the crashed worker"


def test_cli_generate():
    ref_text = http_completion("The quick brown fox", 4)
    prompt_ids = ref_text["prompt_token_ids"]
    ref = http_completion(prompt_ids, 8, ignore_eos=True)
    srv()
    p = subprocess.run([A.troupe, "client", "--connect", f"127.0.0.1:{frame_port}", "generate", "--ids",
                        ",".join(map(str, prompt_ids)), "--max-tokens", "8", "--temperature", "0", "--ignore-eos",
                        "--return-token-ids"], capture_output=True, text=True, timeout=120,
                       preexec_fn=harness._die_with_parent)
    assert p.returncode == 0, (p.returncode, p.stdout, p.stderr)
    ids = [int(x) for x in re.search(r"^ids: (.*)$", p.stdout, re.M).group(1).split(",")]
    assert ids == ref["token_ids"], (ids, ref["token_ids"])
    assert "[finish: length" in p.stderr, p.stderr
    p = subprocess.run([A.troupe, "client", "--connect", f"127.0.0.1:{frame_port}", "list-models"], capture_output=True,
                       text=True, timeout=60, preexec_fn=harness._die_with_parent)
    assert p.returncode == 0 and p.stdout.startswith(MODEL), (p.returncode, p.stdout, p.stderr)
    p = subprocess.run([A.troupe, "client", "--connect", f"127.0.0.1:{frame_port}", "generate", "--prompt", "x",
                        "--model", "nope"], capture_output=True, text=True, timeout=60,
                       preexec_fn=harness._die_with_parent)
    assert p.returncode != 0 and "nope" in p.stderr, (p.returncode, p.stdout, p.stderr)
    # --json-schema: the answer is JSON under it; a schema troupe cannot hold is named.
    schema = '{"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}'
    p = subprocess.run([A.troupe, "client", "--connect", f"127.0.0.1:{frame_port}", "generate", "--prompt", "state:",
                        "--max-tokens", "200", "--temperature", "0", "--json-schema", schema], capture_output=True,
                       text=True, timeout=120, preexec_fn=harness._die_with_parent)
    assert p.returncode == 0 and "[finish: stop" in p.stderr, (p.returncode, p.stdout, p.stderr)
    assert json.loads(p.stdout.strip())["ok"] in (True, False), p.stdout
    p = subprocess.run([A.troupe, "client", "--connect", f"127.0.0.1:{frame_port}", "generate", "--prompt", "x",
                        "--json-schema", '{"type": "string", "multipleOf": 2}'], capture_output=True, text=True,
                       timeout=60, preexec_fn=harness._die_with_parent)
    assert p.returncode != 0 and "'multipleOf'" in p.stderr, (p.returncode, p.stdout, p.stderr)
    # --regex: a text the pattern matches whole.
    p = subprocess.run([A.troupe, "client", "--connect", f"127.0.0.1:{frame_port}", "generate", "--prompt", "state:",
                        "--max-tokens", "30", "--temperature", "0", "--regex", "[a-f]{2,6}!"], capture_output=True,
                       text=True, timeout=120, preexec_fn=harness._die_with_parent)
    assert p.returncode == 0 and re.fullmatch("[a-f]{2,6}!", p.stdout.strip()), (p.returncode, p.stdout, p.stderr)
    still_serving()


if __name__ == "__main__":
    raise SystemExit(harness.run(globals(), A.only))
