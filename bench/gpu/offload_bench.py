#!/usr/bin/env python3
"""One sequence longer than the device pools hold, served through `troupe serve`: the host tier's cold pages
(on CUDA: mapped pinned host memory, the CSA entries the indexer selects read in place over the bus) against
the same request on uncapped pools, in one run.

  bench/gpu/offload_bench.py --troupe "BUNDLE/run.sh troupe" --model DIR --out OUT [--backend cuda]

The device budget is chosen with `troupe plan` so that one sequence alone reaches about --reach tokens. Three
servers in turn, each on 127.0.0.1:
  capped      --kv-memory-mib B, no host tier, a prompt of --factor times the plan's reach: the request must
              fail (the device tier is full); the token count where it stopped is the reach the others use;
  capped+host --kv-memory-mib B --host-memory-mib H, a prompt of --factor times that reach: must finish;
  uncapped    --kv-memory-mib U: the peer.
The last two stream a greedy completion of --decode tokens; decode rate = the tokens after the first chunk's
over the time from the first chunk to the last. Checks: the same tokens from both, the capped run failing. Writes
OUT/offload.md (a table) and OUT/offload-CASE.log; exit 1 when a check fails.
"""
import argparse
import json
import os
import random
import re
import shlex
import subprocess
import sys
import time
import urllib.error

from served import NotServing, Served, metrics, open_request, summed


def reach_tokens(troupe, model, kv_bytes):
    out = subprocess.run(shlex.split(troupe) + ["plan", "--model", model, "--memory", str(kv_bytes)],
                         check=True, capture_output=True, text=True).stdout
    m = re.search(r"one sequence alone reaches (\d+) tokens", out)
    assert m, out
    return int(m.group(1))


def budget_for(troupe, model, reach):
    """The smallest budget (to 1 MiB) whose plan lets one sequence reach `reach` tokens."""
    lo, hi = 1 << 20, 1 << 20
    while reach_tokens(troupe, model, hi) < reach:
        lo, hi = hi, hi * 2
    while hi - lo > (1 << 20):
        mid = (lo + hi) // 2
        if reach_tokens(troupe, model, mid) >= reach:
            hi = mid
        else:
            lo = mid
    return hi


def serve_case(args, name, flags, port, prompt):
    cmd = shlex.split(args.troupe) + ["serve", "--backend", args.backend, "--model", args.model, "--host", "127.0.0.1",
                                      "--port", str(port), "--max-model-len", str(len(prompt) + args.decode + 16),
                                      "--max-body-mib", "64", "--read-timeout", "600"] + flags
    row = dict(case=name, flags=" ".join(flags), ok=False, note="")
    try:
        with Served(cmd, os.path.join(args.out, f"offload-{name}.log"), port, args.start_s) as server:
            body = {"model": server.model_id(), "prompt": prompt, "max_tokens": args.decode, "temperature": 0,
                    "ignore_eos": True, "stream": True, "return_token_ids": True}
            t0 = time.time()
            stamps, tokens, error = [], [], None
            try:
                with open_request(port, "/v1/completions", body, timeout=args.request_s) as r:
                    for raw in r:
                        line = raw.decode().strip()
                        if not line.startswith("data: ") or line == "data: [DONE]":
                            continue
                        chunk = json.loads(line[6:])
                        if "error" in chunk:
                            error = chunk["error"].get("message", str(chunk["error"]))
                            break
                        for c in chunk.get("choices", []):
                            ids = c.get("token_ids") or []
                            if ids:
                                stamps.append((time.time(), len(ids)))  # (a chunk may carry several tokens)
                                tokens.extend(ids)
                            if c.get("finish_reason") not in (None, "length"):
                                error = f"finish_reason {c['finish_reason']}"
            except urllib.error.HTTPError as e:
                error = f"HTTP {e.code}: {e.read().decode()[:200]}"
            leaked = summed(metrics(port), "troupe_leaked_pages")
    except NotServing as e:
        row["note"] = str(e)
        return row
    row.update(error=error, tokens=len(tokens), ids=tokens, leaked=leaked)
    if stamps:
        row["first_token_s"] = stamps[0][0] - t0
        if len(stamps) > 1 and stamps[-1][0] > stamps[0][0]:  # the tokens after the first chunk's, over their time
            row["decode_tok_s"] = (len(tokens) - stamps[0][1]) / (stamps[-1][0] - stamps[0][0])
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--troupe", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--backend", default="cuda")
    ap.add_argument("--reach", type=int, default=16384, help="tokens one sequence reaches on the capped pools")
    ap.add_argument("--factor", type=float, default=3.0, help="the prompt, as a multiple of --reach")
    ap.add_argument("--decode", type=int, default=64)
    ap.add_argument("--host-mib", type=int, default=16384)
    ap.add_argument("--uncapped-mib", type=int, default=32768)
    ap.add_argument("--port", type=int, default=18531)
    ap.add_argument("--start-s", type=float, default=180)
    ap.add_argument("--request-s", type=float, default=600)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    budget = budget_for(args.troupe, args.model, args.reach)
    kv_mib = (budget + (1 << 20) - 1) >> 20
    reach = reach_tokens(args.troupe, args.model, kv_mib << 20)
    n = int(args.factor * reach)
    vocab = json.load(open(os.path.join(args.model, "config.json")))["vocab_size"]
    rng = random.Random(7)
    # (ids the tokenizer has too: a server refuses ids past the smaller of the two vocabularies)
    prompt = [rng.randrange(100, min(vocab, 128000) - 100) for _ in range(n)]
    capped = serve_case(args, "capped", ["--kv-memory-mib", str(kv_mib)], args.port, prompt)
    # Where the capped pools stopped the sequence ("... at N tokens"; `troupe plan` says the same since it counts
    # whole slabs per pool, run 43: 4,736 for the Flash-shaped model on 24 MiB, which it had put at 16,512 before).
    # The other two runs take --factor times that.
    stopped = re.search(r"at (\d+) tokens", capped.get("error") or "")
    if stopped:
        reach = int(stopped.group(1))
        n = min(n, int(args.factor * reach))
        prompt = prompt[:n]
    host = serve_case(args, "capped+host", ["--kv-memory-mib", str(kv_mib), "--host-memory-mib", str(args.host_mib)],
                      args.port + 1, prompt)
    free = serve_case(args, "uncapped", ["--kv-memory-mib", str(args.uncapped_mib)], args.port + 2, prompt)
    rows = [capped, host, free]
    capped["ok"] = "device tier" in (capped.get("error") or "")
    if not capped["ok"]:
        capped["note"] = (f"not refused for want of device pages ({capped.get('error')}): the case does not test "
                          "the host tier")
    for r in (host, free):
        r["ok"] = r.get("error") is None and r.get("tokens") == args.decode and not r.get("leaked")
        if not r["ok"] and not r["note"]:
            r["note"] = r.get("error") or f"{r.get('tokens')} tokens, {r.get('leaked')} leaked pages"
    if host["ok"] and free["ok"] and host["ids"] != free["ids"]:
        host["ok"] = False
        host["note"] = "its tokens differ from the uncapped run's"
    if host.get("decode_tok_s") and free.get("decode_tok_s"):
        host["vs_uncapped"] = host["decode_tok_s"] / free["decode_tok_s"]
    cols = ["case", "flags", "tokens", "first_token_s", "decode_tok_s", "vs_uncapped", "leaked", "ok", "note"]
    lines = [f"prompt {n} tokens (one sequence stopped at {reach} on {kv_mib} MiB of device pools), {args.decode} "
             f"decoded; backend {args.backend}", "",
             "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        if r.get("error") and r["case"] == "capped":
            r["note"] = r["note"] or f"refused as expected: {r['error'][:120]}"
        lines.append("| " + " | ".join(f"{r[c]:.4g}" if isinstance(r.get(c), float) else str(r.get(c, ""))
                                       for c in cols) + " |")
    table = "\n".join(lines) + "\n"
    open(os.path.join(args.out, "offload.md"), "w").write(table)
    print(table)
    sys.exit(0 if all(r["ok"] for r in rows) else 1)


if __name__ == "__main__":
    main()
