#!/usr/bin/env python3
"""Bad input gets a clear OpenAI-format 4xx and the server keeps serving.

One server with a small context limit (512), a 64 KiB body limit, a 2 s read
deadline and an API key. Every case ends by checking that a valid request is
still answered.
"""
import json
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import openai

import harness

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "support"))
from ports import free_port_block  # noqa: E402

A = harness.args()
MODEL = "deepseek-v4-tiny"
KEY = "sekret"
AUTH = {"authorization": f"Bearer {KEY}"}
server = None


def srv():
    global server
    if server is None or not server.alive():
        server = harness.Server(A.troupe, A.home, ["--max-model-len", "512", "--max-body-mib", "0.0625",
                                                   "--read-timeout", "2", "--api-key", KEY], name="bad")
    return server


def post(body, path="/v1/completions", headers=AUTH):
    status, _, b = srv().request("POST", path, body, headers=headers)
    return status, b


def still_serving():
    s, b = post({"model": MODEL, "prompt": "still there?", "max_tokens": 2, "temperature": 0})
    assert s == 200 and len(b["choices"][0]["text"]) >= 0 and b["usage"]["completion_tokens"] == 2, (s, b)
    assert srv().alive()


def expect_error(status, body, want_status, param=None, code=None, words=()):
    assert status == want_status, (status, body)
    assert isinstance(body, dict) and set(body) == {"error"}, body
    e = body["error"]
    assert set(e) >= {"message", "type", "param", "code"} and e["message"], e
    assert e["type"] == ("invalid_request_error" if want_status < 500 else e["type"]), e
    if param is not None:
        assert e["param"] == param, e
    if code is not None:
        assert e["code"] == code, e
    for w in words:
        assert w in e["message"], (w, e["message"])


def test_malformed_json():
    for raw in ['{"model": "deepseek-v4-tiny", "prompt": "x",', "not json", "[1, 2]", ""]:
        s, b = post(raw)
        expect_error(s, b, 400)
    still_serving()


def test_deeply_nested_schemas():
    """Schemas (and tool definitions) nested 5,000 deep: a 400 naming the parameter, not a stack overflow in
    the code that walks them (raw bodies: Python's json recurses too)."""
    deep = '{"items":' * 5000 + '{}' + '}' * 5000
    head = '{"model": "deepseek-v4-tiny", "max_tokens": 2, '
    for path, raw, param in [
            ("/v1/completions", head + '"prompt": "x", "guided_json": ' + deep + '}', "guided_json"),
            ("/v1/completions", head + '"prompt": "x", "guided_json": ' + json.dumps(deep) + '}', "guided_json"),
            ("/v1/completions", head + '"prompt": "x", "response_format": {"type": "json_schema", "json_schema": '
                                       '{"schema": ' + deep + '}}}', "response_format"),
            ("/v1/chat/completions", head + '"messages": [{"role": "user", "content": "x"}], "tools": [{"type": '
                                            '"function", "function": {"name": "f", "parameters": ' + deep + '}}]}',
             "tools")]:
        s, b = post(raw, path=path)
        expect_error(s, b, 400, param=param, words=("deeper than",))
    still_serving()


def test_bytes_that_are_not_utf8():
    # The parser's message quotes the bytes it stopped at; quoting them back must not end the
    # gateway (it did: an exception serialising the error body took every request with it).
    ok = b'{"model": "deepseek-v4-tiny", "prompt": "hi", "max_tokens": 2}'
    for raw in [ok + b"\xff\xfe", b'{"model": "\xff\xfe", "prompt": "x"}', b'{"model": "deepseek-v4-tiny", "prompt": "\xc3"}',
                b'{"model": "deepseek-v4-tiny", "messages": [{"role": "\xe4\xb8", "content": "x"}]}']:
        for path in ["/v1/completions", "/v1/chat/completions"]:
            s, b = post(raw, path=path)
            expect_error(s, b, 400)
            assert "\ufffd" in b["error"]["message"] or "UTF-8" in b["error"]["message"], b
    still_serving()


def test_wrong_types_name_the_parameter():
    cases = [({"max_tokens": "ten"}, "max_tokens"), ({"temperature": "hot"}, "temperature"),
             ({"stream": "yes"}, "stream"), ({"prompt": 5}, "prompt"), ({"top_p": 0}, "top_p"),
             ({"seed": 1.5}, "seed"), ({"stop": [1, 2]}, "stop"), ({"n": 0}, "n"), ({"n": 129}, "n"), ({"model": 7}, "model"),
             ({"prompt": [1, -4]}, "prompt"), ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
             ({"temperature": 3.5}, "temperature"), ({"logprobs": 21}, "logprobs"),
             ({"logprobs": True}, "logprobs"), ({"logprobs": "2"}, "logprobs"),
             ({"frequency_penalty": 3}, "frequency_penalty"), ({"presence_penalty": "x"}, "presence_penalty"),
             ({"repetition_penalty": -1}, "repetition_penalty"), ({"repetition_penalty": 0}, "repetition_penalty"),
             ({"min_p": 1.5}, "min_p"), ({"min_p": -0.1}, "min_p"), ({"min_p": "x"}, "min_p"),
             ({"suffix": "tail"}, "suffix"), ({"best_of": 3}, "best_of"),
             ({"response_format": {"type": "xml"}}, "response_format"),
             ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "string", "pattern": "(?!x)"}}}},
              "response_format"),
             ({"guided_json": 5}, "guided_json"),
             ({"guided_choice": []}, "guided_choice"), ({"guided_choice": ["a", ""]}, "guided_choice"),
             ({"guided_choice": "a"}, "guided_choice"), ({"guided_choice": ["a"], "guided_json": {}}, "guided_choice"),
             ({"guided_regex": "(a"}, "guided_regex"), ({"guided_regex": 5}, "guided_regex"), ({"regex": "[b-a]"}, "regex"),
             ({"guided_grammar": "root ::= ("}, "guided_grammar"), ({"ebnf": ["x"]}, "ebnf"),
             ({"ebnf": "root ::= \"a\"", "regex": "a"}, "ebnf"),

             ({"response_format": "json"}, "response_format")]
    for patch, param in cases:
        body = {"model": MODEL, "prompt": "hello", "max_tokens": 4}
        body.update(patch)
        s, b = post(body)
        expect_error(s, b, 400, param=param)
    s, b = post({"model": MODEL, "messages": "hi"}, path="/v1/chat/completions")
    expect_error(s, b, 400, param="messages")
    s, b = post({"model": MODEL, "messages": [{"role": "wizard", "content": "hi"}]}, path="/v1/chat/completions")
    expect_error(s, b, 400, param="messages", words=("wizard",))
    image = [{"type": "image_url", "image_url": {"url": "http://example.com/a.png"}}]
    for path in ("/v1/chat/completions", "/tokenize"):
        s, b = post({"model": MODEL, "messages": [{"role": "user", "content": image}]}, path=path)
        expect_error(s, b, 400, param="messages", words=("image_url",))
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    # Bad values, and features this server does not have, are refused by name, not dropped.
    tool = {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {}}}}
    for patch, param in [({"logprobs": 2}, "logprobs"), ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
                         ({"top_logprobs": 2}, "top_logprobs"), ({"tools": [{**tool, "type": "code"}]}, "tools"),
                         ({"tools": tool}, "tools"), ({"tools": [tool], "parallel_tool_calls": "no"}, "parallel_tool_calls"),
                         ({"tool_choice": "required"}, "tool_choice"), ({"functions": [tool["function"]]}, "functions"),
                         ({"tools": [tool], "tool_choice": {"type": 5}}, "tool_choice"),
                         ({"tools": [tool], "tool_choice": "required", "add_generation_prompt": False}, "tool_choice"),
                         ({"response_format": {"type": "json_schema", "json_schema": "x"}}, "response_format")]:
        s, b = post({**chat, **patch}, path="/v1/chat/completions")
        expect_error(s, b, 400, param=param)
    # Their "off" values are fine.
    s, b = post({**chat, "tools": [], "tool_choice": "none", "response_format": {"type": "text"}},
                path="/v1/chat/completions")
    assert s == 200, (s, b)
    s, b = post({"model": MODEL, "prompt": "hello", "max_tokens": 2, "suffix": "", "best_of": 1})
    assert s == 200, (s, b)
    still_serving()


def test_negative_or_zero_max_tokens():
    for v in (-1, 0, -100000):
        s, b = post({"model": MODEL, "prompt": "hello", "max_tokens": v})
        expect_error(s, b, 400, param="max_tokens")
    with openai.OpenAI(api_key=KEY, base_url=srv().base_url, max_retries=0) as c:
        try:
            c.completions.create(model=MODEL, prompt="hello", max_tokens=-1)
            raise AssertionError("the SDK accepted max_tokens=-1")
        except openai.BadRequestError as e:
            assert e.status_code == 400 and e.body["param"] == "max_tokens", e.body
    still_serving()


def test_prompt_longer_than_the_model_limit():
    s, b = post({"model": MODEL, "prompt": list(range(100, 700)), "max_tokens": 4})
    expect_error(s, b, 400, param="max_tokens", code="context_length_exceeded", words=("512", "600"))
    # Fits alone, but not with the completion.
    s, b = post({"model": MODEL, "prompt": list(range(100, 500)), "max_tokens": 200})
    expect_error(s, b, 400, code="context_length_exceeded")
    s, b = post({"model": MODEL, "messages": [{"role": "user", "content": "word " * 700}]},
                path="/v1/chat/completions")
    expect_error(s, b, 400, code="context_length_exceeded")
    s, b = post({"model": MODEL, "prompt": [129280 + 5], "max_tokens": 4})
    expect_error(s, b, 400, param="prompt", words=("out of range",))
    s, b = post({"model": MODEL, "prompt": [], "max_tokens": 4})
    expect_error(s, b, 400, param="prompt")
    # several choices: one error for the request, as for one choice
    for stream in (False, True):
        s, b = post({"model": MODEL, "prompt": list(range(100, 700)), "max_tokens": 4, "n": 3, "stream": stream})
        expect_error(s, b, 400, code="context_length_exceeded")
        s, b = post({"model": MODEL, "prompt": ["fits", "x " * 600], "max_tokens": 4, "stream": stream})
        expect_error(s, b, 400, code="context_length_exceeded")
    s, b = post({"model": MODEL, "prompt": [[1, 2], "mixed"], "max_tokens": 4})
    expect_error(s, b, 400, param="prompt", words=("all strings or all lists",))
    still_serving()


def test_unimplemented_extensions_are_refused_not_ignored():
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    for field, value in (("include_stop_str_in_output", True), ("allowed_token_ids", [1, 2]), ("bad_words", ["x"]),
                         ("prompt_logprobs", 1), ("continue_final_message", True),
                         ("chat_template_kwargs", {"thinking": True}), ("echo", True)):
        s, b = post({**chat, field: value}, path="/v1/chat/completions")
        expect_error(s, b, 400, param=field)
    # Their defaults are accepted (clients send them).
    s, b = post({**chat, "include_stop_str_in_output": False, "allowed_token_ids": None, "bad_words": [],
                 "chat_template_kwargs": {}, "echo": False}, path="/v1/chat/completions")
    assert s == 200, (s, b)
    still_serving()


def test_integer_fields_take_whole_floats_and_refuse_what_would_wrap():
    s, b = post({"model": MODEL, "prompt": "whole", "max_tokens": 3.0, "seed": 7.0, "temperature": 0})
    assert s == 200 and b["usage"]["completion_tokens"] == 3, (s, b)
    for field, value in (("seed", 18446744073709551615), ("seed", 1e30), ("max_tokens", 2.5)):
        s, b = post({"model": MODEL, "prompt": "x", field: value})
        expect_error(s, b, 400, param=field)
    still_serving()


def test_tool_names_the_call_format_cannot_carry_are_refused():
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    for name in ("get\nweather", "get weather", "x" * 65, "a`b"):
        s, b = post({**chat, "tools": [{"type": "function", "function": {"name": name}}]}, path="/v1/chat/completions")
        expect_error(s, b, 400, param="tools", words=("function.name",))
    s, b = post({**chat, "tools": [{"type": "function", "function": {"name": "get_weather-v2.1"}}]},
                path="/v1/chat/completions")
    assert s == 200, (s, b)
    still_serving()


def test_a_missing_model_means_the_served_one():
    for extra in ({}, {"model": None}, {"model": ""}):
        s, b = post({"prompt": "which model?", "max_tokens": 2, "temperature": 0, **extra})
        assert s == 200 and b["model"] == MODEL, (extra, s, b)
    s, b = post({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}, path="/v1/chat/completions")
    assert s == 200 and b["model"] == MODEL, (s, b)
    still_serving()


def test_unknown_model_is_404():
    s, b = post({"model": "gpt-7", "prompt": "hello"})
    expect_error(s, b, 404, param="model", code="model_not_found", words=("gpt-7", MODEL))
    with openai.OpenAI(api_key=KEY, base_url=srv().base_url, max_retries=0) as c:
        try:
            c.chat.completions.create(model="gpt-7", messages=[{"role": "user", "content": "hi"}])
            raise AssertionError("unknown model accepted")
        except openai.NotFoundError as e:
            assert e.status_code == 404
    still_serving()


def test_oversized_body_is_413():
    body = json.dumps({"model": MODEL, "prompt": "x" * (100 * 1024)}).encode()
    s = socket.create_connection(("127.0.0.1", srv().port), timeout=10)
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Authorization: Bearer " + KEY.encode() + b"\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n")
    try:
        s.sendall(body)
    except OSError:
        pass  # the server may stop reading once it has answered
    data = b""
    try:
        while True:
            d = s.recv(65536)
            if not d:
                break
            data += d
    except OSError:
        pass
    s.close()
    head, _, rest = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 413"), data[:200]
    assert json.loads(rest)["error"]["message"].startswith("request body exceeds"), rest
    still_serving()


def test_methods_and_routes():
    s, _, b = srv().request("GET", "/v1/completions", headers=AUTH)
    expect_error(s, b, 405)
    s, _, b = srv().request("GET", "/v1/nothing", headers=AUTH)
    expect_error(s, b, 404)
    s, h, b = srv().request("POST", "/v1/models", {}, headers=AUTH)
    expect_error(s, b, 405)
    assert h.get("allow", h.get("Allow")) == "GET", h
    still_serving()


def test_api_key_is_required():
    s, b = post({"model": MODEL, "prompt": "hi"}, headers={})
    expect_error(s, b, 401, code="invalid_api_key")
    s, b = post({"model": MODEL, "prompt": "hi"}, headers={"authorization": "Bearer wrong"})
    expect_error(s, b, 401, code="invalid_api_key")
    s, _, b = srv().request("GET", "/v1/models")
    expect_error(s, b, 401)
    with openai.OpenAI(api_key="wrong", base_url=srv().base_url, max_retries=0) as c:
        try:
            c.models.list()
            raise AssertionError("wrong key accepted")
        except openai.AuthenticationError as e:
            assert e.status_code == 401
    with openai.OpenAI(api_key=KEY, base_url=srv().base_url, max_retries=0) as c:
        assert [m.id for m in c.models.list().data] == [MODEL]
    assert srv().get("/health")[0] == 200  # probes need no key
    still_serving()


def read_responses(s, count, deadline_s=20):
    """Reads `count` HTTP responses (Content-Length or chunked bodies) from socket s: [(status line, body)]."""
    s.settimeout(deadline_s)
    data, out = b"", []
    while len(out) < count:
        head_end = data.find(b"\r\n\r\n")
        if head_end >= 0:
            head = data[:head_end].decode("latin-1")
            lines = head.split("\r\n")
            fields = {k.strip().lower(): v.strip() for k, _, v in (l.partition(":") for l in lines[1:])}
            rest = data[head_end + 4:]
            if lines[0].split(" ")[1] == "100":  # an interim response: no body
                out.append((lines[0], b""))
                data = rest
                continue
            if "content-length" in fields and len(rest) >= int(fields["content-length"]):
                n = int(fields["content-length"])
                out.append((lines[0], rest[:n]))
                data = rest[n:]
                continue
        d = s.recv(65536)
        if not d:
            raise AssertionError(f"connection closed after {len(out)} of {count} responses: {data[:300]!r}")
        data += d
    return out


def test_pipelined_requests_are_all_answered():
    """Requests a client writes back to back in one send (HTTP/1.1 pipelining) are answered in order; the second
    used to wait forever (the server watched the socket for bytes while they already sat in its buffer)."""
    s = socket.create_connection(("127.0.0.1", srv().port), timeout=20)
    body = json.dumps({"model": MODEL, "prompt": "pipelined", "max_tokens": 2, "temperature": 0}).encode()
    post_req = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Authorization: Bearer " + KEY.encode() + b"\r\nContent-Length: " + str(len(body)).encode() +
                b"\r\n\r\n" + body)
    get_req = b"GET /health/live HTTP/1.1\r\nHost: x\r\n\r\n"
    s.sendall(get_req + get_req + post_req + get_req)
    got = read_responses(s, 4)
    s.close()
    assert [g[0].split(" ")[1] for g in got] == ["200"] * 4, got
    assert json.loads(got[2][1])["usage"]["completion_tokens"] == 2, got[2]
    still_serving()


def test_expect_100_continue_is_answered():
    """A client that sends "Expect: 100-continue" (curl does past 1 MiB) gets the interim 100 before it sends
    its body, then the response."""
    s = socket.create_connection(("127.0.0.1", srv().port), timeout=20)
    body = json.dumps({"model": MODEL, "prompt": "continue", "max_tokens": 2, "temperature": 0}).encode()
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Authorization: Bearer " + KEY.encode() + b"\r\nExpect: 100-continue\r\nContent-Length: " +
              str(len(body)).encode() + b"\r\n\r\n")
    interim = read_responses(s, 1, deadline_s=1.5)  # before the body: the server's read deadline is 2 s
    assert interim[0][0].startswith("HTTP/1.1 100"), interim
    s.sendall(body)
    final = read_responses(s, 1)
    s.close()
    assert final[0][0].startswith("HTTP/1.1 200"), final
    assert json.loads(final[0][1])["usage"]["completion_tokens"] == 2, final
    still_serving()


def test_refused_paths_do_not_grow_the_metrics():
    """401s on client-chosen paths are counted under one label, not a label per path."""
    for i in range(50):
        s, _, b = srv().request("GET", f"/v1/no-such-route-{i}-" + "x" * 2000)
        expect_error(s, b, 401)
    status, _, text = srv().request("GET", "/metrics")
    text = text if isinstance(text, str) else json.dumps(text)
    assert status == 200 and "no-such-route" not in text, text[:500]
    assert 'route="other",status="401"' in text, [l for l in text.splitlines() if "401" in l]
    still_serving()


def test_slowloris_is_cut_off_and_others_are_served():
    """20 clients trickle header bytes; each is closed after the 2 s read
    deadline, and a normal client is answered while they trickle."""
    closed_after = []
    lock = threading.Lock()

    def trickle():
        s = socket.create_connection(("127.0.0.1", srv().port), timeout=30)
        t0 = time.monotonic()
        try:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
            for i in range(60):  # 30 s of trickling at most
                s.sendall(b"X-Slow-%d: 1\r\n" % i)
                time.sleep(0.5)
        except OSError:
            pass
        # The server closed it: the next read sees EOF or a reset.
        try:
            s.settimeout(5)
            s.recv(10)
        except OSError:
            pass
        s.close()
        with lock:
            closed_after.append(time.monotonic() - t0)

    threads = [threading.Thread(target=trickle) for _ in range(20)]
    for t in threads:
        t.start()
    time.sleep(0.5)
    t0 = time.monotonic()
    still_serving()  # answered while the slow clients hold their connections
    served_in = time.monotonic() - t0
    for t in threads:
        t.join(60)
    assert len(closed_after) == 20, closed_after
    assert all(1.5 <= t <= 8 for t in closed_after), closed_after
    assert served_in < 15, served_in
    still_serving()


def random_body(rng):
    """A request body from a seeded generator: known fields with values of any type (None, bools,
    integers past int64, NaN, strings with added-token text, nested lists and objects), sometimes
    cut short or followed by bytes that are not UTF-8. The generation length stays small."""
    names = ["model", "messages", "prompt", "temperature", "top_p", "top_k", "n", "stream", "stream_options",
             "stop", "seed", "logprobs", "top_logprobs", "echo", "logit_bias", "presence_penalty",
             "frequency_penalty", "repetition_penalty", "min_p", "ignore_eos", "user", "response_format", "guided_json",
             "guided_choice", "tools",
             "tool_choice", "suffix", "best_of", "add_generation_prompt", "priority", "return_token_ids"]

    def value(depth=0):
        r = rng.random() * (0.65 if depth > 1 else 1.0)
        if r < 0.1:
            return None
        if r < 0.2:
            return rng.choice([True, False])
        if r < 0.33:
            return rng.choice([0, 1, -1, 7, 2 ** 31, -2 ** 63, 2 ** 64, 10 ** 20])
        if r < 0.43:
            return rng.choice([0.0, 0.5, -0.1, 1e308, float("nan"), 1e-9])
        if r < 0.65:
            return rng.choice(["", "x", "\u00e9\u4e2d", "a" * 500, "<\uff5cend\u2581of\u2581sentence\uff5c>", MODEL])
        if r < 0.82:
            return [value(depth + 1) for _ in range(rng.randint(0, 3))]
        return {rng.choice(names + ["role", "content", "type", "text", "include_usage"]): value(depth + 1)
                for _ in range(rng.randint(0, 3))}

    b = {"model": MODEL if rng.random() < 0.7 else value()}
    if rng.random() < 0.5:
        b["messages"] = [{"role": rng.choice(["user", "system", "assistant", "tool", "bogus", 3]),
                          "content": value()} for _ in range(rng.randint(0, 3))]
    else:
        b["prompt"] = rng.choice(["hello", [1, 2, 3], [[1, 2], [3]], [], [10 ** 12], [-1], value()])
    for _ in range(rng.randint(0, 6)):
        b[rng.choice(names)] = value()
    b["max_tokens"] = rng.choice([1, 2, 3, 0, -1, "2", None])
    raw = json.dumps(b).encode()
    if rng.random() < 0.05:
        raw = raw[:rng.randint(0, len(raw))]
    if rng.random() < 0.05:
        raw += b"\xff\xfe"
    return raw


def random_response_body(rng):
    """A /v1/responses body from a seeded generator: input as text or items of every type (some
    malformed), and the Responses API's own fields with values of any type."""
    names = ["instructions", "max_output_tokens", "text", "tools", "tool_choice", "temperature", "top_p", "stream",
             "previous_response_id", "store", "metadata", "reasoning", "top_logprobs", "background", "include",
             "truncation", "parallel_tool_calls", "seed", "n", "messages"]
    values = [None, True, 0, -1, 2 ** 64, 0.5, float("nan"), "", "x", "a" * 300, [], {}, [1, "x"], {"type": "x"},
              {"type": 5}, [{"type": 5}], [{"type": "function", "name": 7}], {"type": "function", "name": []},
              {"format": {"type": "json_schema", "name": 5, "schema": {}}},
              {"format": {"type": rng.choice(["json_schema", "json_object", "text", "xml"]), "schema": {"type": "string"}}}]
    item_types = ["message", "function_call", "function_call_output", "reasoning", "item_reference", "bogus", 3, None]

    def item():
        it = {"type": rng.choice(item_types)}
        for k in rng.sample(["role", "content", "call_id", "name", "arguments", "output", "id"], rng.randint(0, 5)):
            it[k] = rng.choice(values + ["user", "assistant", "tool", [{"type": "input_text", "text": "hi"}],
                                         [{"type": "input_image"}]])
        if rng.random() < 0.3:
            del it["type"]
        return it

    b = {"model": MODEL if rng.random() < 0.8 else rng.choice(values)}
    r = rng.random()
    b["input"] = "hello" if r < 0.3 else [item() for _ in range(rng.randint(0, 4))] if r < 0.9 else rng.choice(values)
    for _ in range(rng.randint(0, 5)):
        b[rng.choice(names)] = rng.choice(values)
    b["max_output_tokens"] = rng.choice([1, 2, 3, 0, -1, "2", None])
    if rng.random() < 0.5:
        b.pop("stream", None)
    return json.dumps(b).encode()


def test_random_response_bodies():
    """200 seeded random /v1/responses bodies: each answered (2xx, or 4xx in the error format), none ends the server."""
    import random
    rng = random.Random(20261205)
    seen = {}
    for _ in range(200):
        raw = random_response_body(rng)
        body = json.loads(raw)
        s, b = post(raw, path="/v1/responses")
        seen[s] = seen.get(s, 0) + 1
        assert s in (200, 400, 404), (s, b, body)
        if s != 200:
            expect_error(s, b, s)
    assert seen.get(400, 0) > 100 and seen.get(200, 0) > 0, seen
    still_serving()


def test_random_bodies():
    """400 seeded random bodies: each answered (2xx, or 4xx in the error format), none ends the server."""
    import random
    rng = random.Random(20261204)
    seen = {}
    for _ in range(400):
        path = rng.choice(["/v1/completions", "/v1/chat/completions"])
        s, b = post(random_body(rng), path=path)
        seen[s] = seen.get(s, 0) + 1
        assert s in (200, 400, 404, 413), (s, b)
        if s != 200:
            expect_error(s, b, s)
    assert seen.get(400, 0) > 300 and seen.get(200, 0) > 0, seen
    still_serving()


def test_port_in_use_fails_fast():
    """A second server on a taken port exits with a clear error (it used to hang)."""
    p = subprocess.run([A.troupe, "serve", "--port", str(srv().port)], env={"TROUPE_HOME": A.home, "PATH": "/usr/bin"},
                       capture_output=True, text=True, timeout=120, preexec_fn=harness._die_with_parent)
    assert p.returncode != 0 and "cannot listen" in (p.stdout + p.stderr), (p.returncode, p.stdout, p.stderr)
    still_serving()


def test_run_with_its_http_port_in_use_fails_fast():
    """`troupe run` whose node's HTTP port is taken exits with the error (it used to hang: the actors it had
    started were never stopped, and the actor system waited for them)."""
    import pathlib
    import re
    import tempfile
    example = pathlib.Path(__file__).resolve().parents[2] / "deploy" / "examples" / "colocated.yaml"
    base = srv().port  # taken: the test server's HTTP port
    text = example.read_text().replace("http: 8000", f"http: {base}")
    # Two free ports for the node's transport and its range, below the ephemeral range: a port bind(0) gave
    # (and the one after it) could be taken by another test's client socket before the node bound it, and
    # the node then failed at its transport ("ucp_worker_create: Device is busy"), not at its HTTP port.
    transport = free_port_block(2)
    text = re.sub(r"7400", str(transport), text).replace("7401-7463", f"{transport + 1}-{transport + 1}")
    with tempfile.TemporaryDirectory() as d:
        manifest = pathlib.Path(d) / "m.yaml"
        manifest.write_text(text)
        t0 = time.monotonic()
        p = subprocess.run([A.troupe, "run", "--manifest", str(manifest), "--node", "serve"],
                           env={"TROUPE_HOME": A.home, "PATH": "/usr/bin", "UCX_NET_DEVICES": "lo"},
                           capture_output=True, text=True, timeout=120, preexec_fn=harness._die_with_parent)
    assert p.returncode != 0 and "cannot listen" in (p.stdout + p.stderr), (p.returncode, p.stdout, p.stderr)
    assert time.monotonic() - t0 < 60
    still_serving()


if __name__ == "__main__":
    raise SystemExit(harness.run(globals(), A.only))
