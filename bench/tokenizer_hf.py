#!/usr/bin/env python3
"""Hugging Face `tokenizers` on the same text and in the same modes as
bench/tokenizer_bench.cpp; prints the same line format.

  tokenizer_hf.py TOKENIZER_JSON CORPUS_FILE [PASSES] [--threads N]
"lines" uses encode_batch (no Python call per line) and "text" one encode().
With --threads 1 (the default) Rayon runs on one thread, like troupe's
tokenizer, which encodes a request on the calling thread.
"""
import argparse
import os
import time


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("tokenizer")
    ap.add_argument("corpus")
    ap.add_argument("passes", nargs="?", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args()
    os.environ["RAYON_NUM_THREADS"] = str(a.threads)
    if a.threads == 1:
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
    from tokenizers import Tokenizer  # after the environment is set

    with open(a.corpus, encoding="utf-8", newline="") as f:
        text = f.read()
    lines = text.split("\n")
    if text.endswith("\n"):
        lines.pop()
    line_bytes = sum(len(l.encode()) for l in lines)

    def measure(nbytes, run):
        first = best = 0.0
        ids = 0
        for p in range(a.passes):
            t0 = time.perf_counter()
            ids = run()
            mb_s = nbytes / 1e6 / (time.perf_counter() - t0)
            first = mb_s if p == 0 else first
            best = max(best, mb_s)
        return first, best, ids

    # A fresh tokenizer per mode, so each first pass starts with a cold cache.
    tok = Tokenizer.from_file(a.tokenizer)
    f, b, n = measure(line_bytes, lambda: sum(len(e.ids) for e in tok.encode_batch(lines, add_special_tokens=False)))
    print(f"lines first_pass_mb_s={f:.2f} best_mb_s={b:.2f} ids={n} bytes={line_bytes} calls={len(lines)}")
    tok = Tokenizer.from_file(a.tokenizer)
    f, b, n = measure(len(text.encode()), lambda: len(tok.encode(text, add_special_tokens=False).ids))
    print(f"text first_pass_mb_s={f:.2f} best_mb_s={b:.2f} ids={n} bytes={len(text.encode())} calls=1")


if __name__ == "__main__":
    main()
