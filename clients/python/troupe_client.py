"""troupe message-level client in Python, on pycapnp, reading the same
messages/*.capnp schemas as the C++ runtime.

A frame is a 24-byte little-endian header followed by a Cap'n Proto message
in flat (unpacked) form; docs/messages.md describes it. This module speaks it
over plain TCP:

    from troupe_client import Client
    with Client("127.0.0.1", 7400) as c:
        print(c.list_models())
        rid = c.submit(token_ids=[1, 2, 3], max_tokens=8, return_token_ids=True)
        for kind, msg in c.events(rid):
            ...                      # ("chunk", TokenChunk) ... ("finish", Finish)
        print(c.generate(text="hello", max_tokens=8))

Schemas are read from $TROUPE_SCHEMA_DIR, else from ../../messages relative
to this file.
"""
from __future__ import annotations

import json
import os
import socket
import struct
import threading
from pathlib import Path

import capnp

MAGIC = 0x46505254  # "TRPF"
VERSION = 1
HEADER = struct.Struct("<IHHQII")  # magic, version, kind, request id, body bytes, reserved
ECHO_BIT = 1 << 62


def _load_schemas(schema_dir: str | os.PathLike | None = None):
    d = Path(schema_dir or os.environ.get("TROUPE_SCHEMA_DIR") or Path(__file__).resolve().parents[2] / "messages")
    # pycapnp ships capnp/c++.capnp next to its module; the schemas import it.
    imports = [os.path.dirname(os.path.dirname(capnp.__file__))]
    return {name: capnp.load(str(d / f"{name}.capnp"), imports=imports) for name in ("common", "generate", "kv", "control", "fabric")}


class TroupeError(Exception):
    """An Error frame from the server: .code (e.g. 'notFound') and .message."""

    def __init__(self, code: str, message: str, request_id: int = 0):
        super().__init__(f"{code}: {message}")
        self.code, self.message, self.request_id = code, message, request_id


class Client:
    def __init__(self, host: str, port: int, timeout: float = 10.0, schema_dir=None, max_body: int = 64 << 20):
        self.schemas = _load_schemas(schema_dir)
        self.kind = self.schemas["common"].Kind
        self._by_kind = {}  # kind number -> (schema module, struct name)
        for mod in self.schemas.values():
            for name in dir(mod):
                if name[:1].isupper() and hasattr(self.kind, name[0].lower() + name[1:]):
                    self._by_kind[getattr(self.kind, name[0].lower() + name[1:])] = getattr(mod, name)
        self.sock = socket.create_connection((host, port), timeout=timeout)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.timeout = timeout
        self.max_body = max_body
        self._next_id = 1
        self._lock = threading.Lock()
        self._pending: dict[int, list] = {}  # frames read for other request ids

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self):
        self.sock.close()

    # --- frames -------------------------------------------------------------
    def struct_for(self, kind: int):
        return self._by_kind[kind]

    def send(self, kind: int, request_id: int, message) -> None:
        body = message.to_bytes()
        self.sock.sendall(HEADER.pack(MAGIC, VERSION, kind, request_id, len(body), 0) + body)

    def send_bytes(self, data: bytes) -> None:
        self.sock.sendall(data)

    def _read_exact(self, n: int) -> bytes:
        buf = bytearray()
        while len(buf) < n:
            chunk = self.sock.recv(n - len(buf))
            if not chunk:
                raise ConnectionError("server closed the connection")
            buf += chunk
        return bytes(buf)

    def recv_frame(self):
        """Reads one frame: (kind, request id, body bytes)."""
        magic, version, kind, rid, size, reserved = HEADER.unpack(self._read_exact(HEADER.size))
        if magic != MAGIC or version != VERSION or size > self.max_body or size % 8 or reserved:
            raise ConnectionError(f"bad frame header from server (magic {magic:#x}, version {version}, {size} bytes)")
        return kind, rid, self._read_exact(size)

    def decode(self, kind: int, body: bytes):
        """The body as its schema struct (a copy that owns its bytes)."""
        with self.struct_for(kind).from_bytes(body) as m:
            return m.as_builder()  # detach from the buffer's lifetime

    def _wait(self, request_id: int):
        """Next (kind, message) for a request id, keeping others for later."""
        if self._pending.get(request_id):
            return self._pending[request_id].pop(0)
        while True:
            kind, rid, body = self.recv_frame()
            item = (kind, self.decode(kind, body))
            if rid == request_id:
                return item
            self._pending.setdefault(rid, []).append(item)

    def _new_id(self) -> int:
        with self._lock:
            rid = self._next_id
            self._next_id += 1
            return rid

    # --- requests -----------------------------------------------------------
    def list_models(self) -> list[dict]:
        rid = self._new_id()
        self.send(self.kind.listModels, rid, self.schemas["generate"].ListModels.new_message())
        kind, msg = self._wait(rid)
        if kind == self.kind.error:
            raise TroupeError(str(msg.code), msg.message, rid)
        return [m.to_dict() for m in msg.models]

    def submit(self, text=None, token_ids=None, chat=None, model="", max_tokens=16, min_tokens=0, temperature=1.0,
               top_p=1.0, top_k=0, seed=None, stop=(), stop_token_ids=(), ignore_eos=False, return_token_ids=False,
               priority=0, deadline_unix_nanos=0, user="", repetition_penalty=1.0, frequency_penalty=0.0,
               presence_penalty=0.0, logit_bias=None, min_p=0.0, json_schema=None, regex=None, ebnf=None) -> int:
        g = self.schemas["generate"].GenerateRequest.new_message()
        g.model = model
        if token_ids is not None:
            g.prompt.tokenIds = list(token_ids)
        elif chat is not None:
            turns = g.prompt.init("chat", len(chat))
            for t, (role, content) in zip(turns, chat):
                t.role, t.content = role, content
        else:
            g.prompt.text = text or ""
        g.sampling.temperature, g.sampling.topP, g.sampling.topK = temperature, top_p, top_k
        g.sampling.minP = min_p
        if json_schema is not None:  # a JSON Schema (dict) or its text: the answer is JSON under it
            g.sampling.jsonSchema = json_schema if isinstance(json_schema, str) else json.dumps(json_schema)
        if regex is not None:  # the answer is a text this regular expression matches whole
            g.sampling.regex = regex
        if ebnf is not None:  # the answer is a text this EBNF grammar derives from its rule root
            g.sampling.ebnf = ebnf
        if seed is not None:
            g.sampling.seed.value = seed
        g.sampling.repetitionPenalty = repetition_penalty
        g.sampling.frequencyPenalty, g.sampling.presencePenalty = frequency_penalty, presence_penalty
        if logit_bias:  # {token id: bias}
            entries = g.sampling.init("logitBias", len(logit_bias))
            for e, (tok, bias) in zip(entries, logit_bias.items()):
                e.token, e.bias = int(tok), float(bias)
        g.maxTokens, g.minTokens = max_tokens, min_tokens
        g.stopStrings, g.stopTokenIds = list(stop), list(stop_token_ids)
        g.ignoreEos, g.returnTokenIds = ignore_eos, return_token_ids
        g.priority, g.deadlineUnixNanos, g.user = priority, deadline_unix_nanos, user
        rid = self._new_id()
        self.send(self.kind.generateRequest, rid, g)
        return rid

    def events(self, request_id: int):
        """Yields ("chunk", TokenChunk), ("ack", Ack) ... then ("finish", Finish).
        An Error frame about the request raises TroupeError."""
        while True:
            kind, msg = self._wait(request_id)
            if kind == self.kind.tokenChunk:
                yield "chunk", msg
            elif kind == self.kind.ack:
                yield "ack", msg
            elif kind == self.kind.finish:
                yield "finish", msg
                return
            elif kind == self.kind.error:
                raise TroupeError(str(msg.code), msg.message, request_id)
            else:
                raise TroupeError("invalidArgument", f"unexpected frame kind {kind} for request {request_id}")

    def generate(self, **kwargs) -> dict:
        rid = self.submit(**kwargs)
        text, ids, finish = [], [], None
        for kind, msg in self.events(rid):
            if kind == "chunk":
                text.append(msg.text)
                ids.extend(msg.tokenIds)
            elif kind == "finish":
                finish = msg
        return {"text": "".join(text), "token_ids": ids, "finish_reason": str(finish.reason),
                "usage": {"prompt_tokens": finish.promptTokens, "completion_tokens": finish.completionTokens,
                          "cached_tokens": finish.cachedTokens}}

    def _control(self, kind: int, struct_name: str, request_id: int, **fields):
        m = getattr(self.schemas["generate"], struct_name).new_message(**fields)
        self.send(kind, request_id, m)

    def abort(self, request_id: int, reason: str = ""):
        self._control(self.kind.abort, "Abort", request_id, reason=reason)

    def park(self, request_id: int, reason: str = ""):
        self._control(self.kind.park, "Park", request_id, reason=reason)

    def resume(self, request_id: int):
        self._control(self.kind.resume, "Resume", request_id)
