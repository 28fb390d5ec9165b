"""The Python client (pycapnp, same .capnp files) against a troupe process
(frame_test_server) over TCP: the schema is usable from another language.

Run by ctest: python_client_test.py SERVER_BINARY
"""
import os
import subprocess
import sys
import unittest
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "clients" / "python"))
from troupe_client import ECHO_BIT, HEADER, MAGIC, Client, TroupeError  # noqa: E402

SERVER = sys.argv.pop(1) if len(sys.argv) > 1 else str(ROOT / "build" / "bin" / "frame_test_server")
VOCAB = 129280


def test_token(base, seed, i):
    # tests/transport/test_service.hpp
    return (base + seed * 31 + i * 7919) % VOCAB


class PythonClient(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.proc = subprocess.Popen([SERVER, "--token-interval-ms", "1"], stdout=subprocess.PIPE,
                                    stderr=subprocess.DEVNULL, text=True)
        line = cls.proc.stdout.readline()
        assert line.startswith("READY"), line
        cls.port = int(line.split("tcp=")[1].split()[0])

    @classmethod
    def tearDownClass(cls):
        cls.proc.terminate()
        cls.proc.wait(timeout=10)

    def setUp(self):
        self.c = Client("127.0.0.1", self.port)

    def tearDown(self):
        self.c.close()

    def test_list_models(self):
        models = self.c.list_models()
        self.assertEqual(models[0]["id"], "troupe-test")
        self.assertEqual(models[0]["vocabSize"], VOCAB)

    def test_generate_streams_deterministic_tokens(self):
        out = self.c.generate(token_ids=[1, 2, 3], max_tokens=12, seed=9, return_token_ids=True)
        self.assertEqual(out["token_ids"], [test_token(6, 9, i) for i in range(12)])
        self.assertEqual(out["finish_reason"], "length")
        self.assertEqual(out["usage"]["completion_tokens"], 12)
        self.assertTrue(out["text"].startswith("t"))

    def test_chat_and_stop_ids(self):
        base = sum(map(ord, "hello"))
        out = self.c.generate(chat=[("user", "hello")], max_tokens=30, stop_token_ids=[test_token(base, 0, 2)],
                              return_token_ids=True)
        self.assertEqual(out["finish_reason"], "stop")
        self.assertEqual(len(out["token_ids"]), 3)

    def test_abort_park_resume(self):
        rid = self.c.submit(text="long", max_tokens=100000)
        events = self.c.events(rid)
        self.assertEqual(next(events)[0], "chunk")
        self.c.park(rid)
        kind, msg = next(events)
        while kind == "chunk":
            kind, msg = next(events)
        self.assertEqual((kind, str(msg.ofKind)), ("ack", "park"))
        self.c.resume(rid)
        self.assertEqual(next(events)[0], "ack")
        self.assertEqual(next(events)[0], "chunk")
        self.c.abort(rid, "test")
        kinds = [k for k, _ in events]
        self.assertEqual(kinds[-1], "finish")

    def test_errors_are_raised(self):
        with self.assertRaises(TroupeError) as e:
            self.c.generate(text="x", model="gpt-17")
        self.assertEqual(e.exception.code, "notFound")
        with self.assertRaises(TroupeError) as e:
            self.c.generate(text="x", max_tokens=0)
        self.assertEqual(e.exception.code, "invalidArgument")
        # An Abort naming an unknown request.
        self.c.abort(4242)
        kind, msg = self.c._wait(4242)
        self.assertEqual((kind, str(msg.code)), (self.c.kind.error, "notFound"))

    def test_every_kind_round_trips_through_the_server(self):
        # Each kind built in Python, echoed by the C++ server, read back in Python.
        n = 0
        for kind_name, number in self.c.kind.schema.enumerants.items():
            if kind_name == "none":
                continue
            msg = self.c.struct_for(number).new_message()
            if kind_name == "tokenChunk":
                msg.text, msg.tokenIds = "héllo", [1, 2, 3]
            if kind_name == "kvOffer":
                d = msg.init("descriptors", 1)[0]
                d.kind, d.layer, d.pages = "indexerKeys", 7, [3, 1]
                d.region.packedKey = b"\x01\x02"
            self.c.send(number, ECHO_BIT | number, msg)
            kind, rid, body = self.c.recv_frame()
            self.assertEqual((kind, rid), (number, ECHO_BIT | number))
            back = self.c.decode(kind, body)
            self.assertEqual(back.to_dict(), msg.to_dict(), kind_name)
            n += 1
        self.assertEqual(n, 22)

    def test_bad_bytes_get_an_error_frame(self):
        self.c.send_bytes(HEADER.pack(MAGIC, 7, 2, 5, 8, 0) + b"\0" * 8)
        kind, rid, body = self.c.recv_frame()
        err = self.c.decode(kind, body)
        self.assertEqual((kind, rid, str(err.code)), (self.c.kind.error, 5, "unsupported"))


if __name__ == "__main__":
    unittest.main(verbosity=2)
