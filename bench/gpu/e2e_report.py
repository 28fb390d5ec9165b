#!/usr/bin/env python3
"""Reads what bench/gpu/e2e.sh collected (results.jsonl, the logits .npy files)
and writes e2e.md: the tables of docs/benchmarks.md's end-to-end section.
Prints the short table last.

  e2e_report.py OUTDIR SHM_DIR PREFILL"""
import glob
import json
import os
import sys

import numpy as np

out_dir, shm, prefill = sys.argv[1], sys.argv[2], int(sys.argv[3])
rows = []
with open(f"{out_dir}/results.jsonl") as f:
    for line in f:
        line = line.strip()
        if line.startswith("{"):
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                pass
by = {}
for r in rows:
    by.setdefault(r.get("kind"), []).append(r)
md = []


def fmt(x, nd=3):
    if isinstance(x, float):
        return f"{x:.{nd}g}" if abs(x) < 1e4 else f"{x:,.0f}"
    return str(x)


# ---- fixtures ----------------------------------------------------------------------
fx = by.get("fixture", [])
if fx:
    md.append("### Committed fixtures on the CUDA backend\n")
    md.append("| fixture | backend | weights | mode | max abs | rel L2 | top-1 | vs CPU rel L2 | graph replays |")
    md.append("|---|---|---|---|---|---|---|---|---|")
    for r in fx:
        md.append(f"| {r['fixture']} | {r['backend']} | {r['weights']} | {r['mode']} | {r['max_abs']:.2e} | "
                  f"{r['rel_l2']:.2e} | {100 * r['top1']:.1f}% | {fmt(r.get('vs_cpu_rel_l2', '-'))} | "
                  f"{r.get('replays', '-')} |")
    md.append("")

# ---- agreement with transformers ------------------------------------------------------
# troupe's runs (each a .npy of teacher-forced logits, if present) against both oracles.
RUNS = (("troupe_logits", "troupe, bf16 matrices (as served)"),
        ("troupe_logits_f32", "troupe, fp32 matrices, bf16 tensor-core attention"),
        ("troupe_logits_f32_exact", "troupe, fp32 matrices, fp32 attention"),
        ("troupe_logits_attn32", "troupe, bf16 matrices, fp32 attention"),
        ("troupe_logits_split", "troupe, bf16 matrices, split-activation GEMMs"),
        ("troupe_logits_split_attn32", "troupe, bf16 matrices, split-activation GEMMs, fp32 attention"))
REFS = (("bf16", "transformers bf16 eager"),
        ("fp32cast", "transformers bf16 model cast to fp32 (norm weights etc. bf16-rounded)"),
        ("fp32", "transformers fp32: the checkpoint's exact values"))
summary = []
agree = []  # (run label, ref label, stats)
hf_self = None
n_pos = 0


def stats(o, f):
    top = o.argmax(1) == f.argmax(1)
    two = np.partition(f, -2, axis=1)[:, -2:]
    gap = two[:, 1] - two[:, 0]
    d = (o - f).astype(np.float64)
    rel = np.sqrt((d * d).sum()) / np.sqrt((f.astype(np.float64) ** 2).sum())
    return {"n": len(f), "top1": top.mean(), "top1_prefill": top[:prefill].mean(), "top1_decode": top[prefill:].mean(),
            "rel": rel, "max_abs": float(np.abs(o - f).max()), "flips": int((~top).sum()),
            "flip_gaps": ", ".join(f"{g:.4f}" for g in sorted(gap[~top].tolist())[:6]), "median_gap": float(np.median(gap))}


try:
    refs = {}
    for name, _ in REFS:
        try:
            refs[name] = np.load(f"{shm}/hf_{name}.npy").astype(np.float32)
        except FileNotFoundError:
            pass
    REFS = tuple(r for r in REFS if r[0] in refs)
    alts = sorted(os.path.basename(f)[:-4] for f in glob.glob(f"{shm}/troupe_logits_alt_*.npy"))
    for stem, label in RUNS + tuple((a, f"troupe, bf16 matrices, build {a[len('troupe_logits_alt_'):]}") for a in alts):
        try:
            ours = np.load(f"{shm}/{stem}.npy").astype(np.float32)
        except FileNotFoundError:
            continue
        for name, rlabel in REFS:
            n = min(len(refs[name]), len(ours))
            agree.append((label, rlabel, stats(ours[:n], refs[name][:n])))
            n_pos = n
    hb, hf = refs["bf16"], refs["fp32"]
    d = (hb - hf).astype(np.float64)
    hf_self = {"top1": (hb.argmax(1) == hf.argmax(1)).mean(),
               "rel": np.sqrt((d * d).sum()) / np.sqrt((hf.astype(np.float64) ** 2).sum())}
except Exception as e:  # noqa: BLE001
    md.append(f"(agreement with transformers not computed: {e})\n")
if agree:
    md.append(f"### Flash-shaped model: troupe (CUDA) against transformers, teacher-forced\n")
    md.append(f"{n_pos} random positions; troupe runs the first {prefill} as one Model::forward call "
              f"and the rest as Decoder steps replayed from a CUDA graph.\n")
    md.append("| troupe run | reference | top-1 agreement | prefill part | decode part | flips | rel L2 of logits | "
              "max abs | oracle top-2 gap at flips, smallest (median gap) |")
    md.append("|---|---|---|---|---|---|---|---|---|")
    for label, rlabel, a in agree:
        md.append(f"| {label} | {rlabel} | **{100 * a['top1']:.2f}%** | {100 * a['top1_prefill']:.2f}% | "
                  f"{100 * a['top1_decode']:.2f}% | {a['flips']} | {a['rel']:.2e} | {a['max_abs']:.3f} | "
                  f"{a['flip_gaps'] or '-'} ({a['median_gap']:.3f}) |")
        summary.append((f"top-1 {label[8:30]} vs {rlabel[13:30]}", f"{100 * a['top1']:.2f}%", ">= 99%"))
    if hf_self:
        md.append(f"| (transformers bf16) | transformers fp32 | {100 * hf_self['top1']:.2f}% | | | | "
                  f"{hf_self['rel']:.2e} | | |")
    md.append("")

# ---- throughput ------------------------------------------------------------------------
hf = (by.get("transformers") or [{}])[0]
hfgen = {g["batch"]: g for g in hf.get("generate", [])}
bench = by.get("bench", [])
if bench:
    md.append("### Throughput (flash-shaped, 4 layers, bf16 weights, greedy)\n")
    b0 = bench[0]
    md.append(f"Copy bandwidth measured in the same run: **{b0['copy_tb_s']:.2f} TB/s** (device-to-device, bytes read + "
              f"written). Roofline = (weight bytes a step reads + state bytes) / copy bandwidth; a step reads every dense "
              f"matrix, the lm_head and the routed experts it touches (6 per layer at batch 1; the expected distinct "
              f"experts of uniform routing at batch 8).\n")
    md.append("| batch | prompt + new | troupe generate tok/s (incl. prefill) | troupe prefill tok/s | troupe decode tok/s | "
              "steady step (ms) | transformers generate tok/s | decode / transformers | bytes/step (GB) | "
              "roofline step (ms) | % of roofline |")
    md.append("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in bench:
        if r.get("variant", "default") != "default":
            r = dict(r)
            r["prompt"] = f"{r['prompt']} ({r['variant']})"
        h = hfgen.get(r["batch"], {})
        ht = h.get("generate_tok_s")
        ratio = r["steady_tok_s"] / ht if ht else None
        gb = (r["weight_bytes_per_step"] + r["state_bytes_per_step"]) / 1e9
        hf_cells = f"{ht:.1f} | {ratio:.1f}x" if ht else "- | -"
        md.append(f"| {r['batch']} | {r['prompt']} + {r['new']} | {r['generate_tok_s']:.0f} | {r['prefill_tok_s']:.0f} | "
                  f"{r['steady_tok_s']:.0f} | {r['steady_step_ms']:.3f} | {hf_cells} | {gb:.2f} | "
                  f"{r['roofline_step_ms']:.3f} | {100 * r['fraction_of_roofline']:.1f}% |")
        summary.append((f"batch {r['batch']} decode tok/s" + (f" {r['variant']}" if r.get("variant", "default") != "default" else ""), f"{r['steady_tok_s']:.0f}",
                        f"{100 * r['fraction_of_roofline']:.1f}% of roofline" + (f", {ratio:.1f}x transformers" if ratio else "")))
    md.append("")
ctx = by.get("context", [])
if ctx:
    md.append("### Decode at long context (batch 1; state rows filled with random values, not a real prefill)\n")
    md.append("| context | step (ms) | tok/s | state bytes/step (MB) | vs first |")
    md.append("|---|---|---|---|---|")
    base = ctx[0]["tok_s"]
    for r in ctx:
        md.append(f"| {r['context']:,} | {r['step_ms']:.3f} | {r['tok_s']:.0f} | {r['state_bytes_per_step'] / 1e6:.1f} | "
                  f"{100 * r['tok_s'] / base:.1f}% |")
    summary.append((f"decode {ctx[-1]['context']} vs {ctx[0]['context']}", f"{100 * ctx[-1]['tok_s'] / base:.1f}%", ">= 90%"))
    md.append("")
eng = by.get("engine", [])
if eng:
    e = eng[0]
    md.append("### engine::Engine on the CUDA backend\n")
    md.append(f"Batch {e['batch']}, prompt {e['prompt']}, {e['new']} new tokens: **{e['generate_tok_s']:.0f} tok/s** "
              f"(incl. prefill), {e['decoder_steps']} decoder steps of {e['steps']}, {e['graph_replays']} graph replays. "
              f"A request parked halfway (pages to the host tier over the copy stream, {e['park_copied_bytes'] / 1e6:.1f} MB "
              f"copied) and resumed: parked {e['park_parked']}, tokens equal to the unparked run: **{e['park_tokens_equal']}**.")
    bt = [r for r in bench if r["batch"] == e["batch"]]
    if bt and "tokens_last_run" in bt[0]:
        same = sum(t[0] == b[0] for t, b in zip(e["tokens"], bt[0]["tokens_last_run"]))
        md.append(f" First tokens equal to the direct Decoder run's: {same}/{len(e['tokens'])}.")
    summary.append(("engine park/resume tokens equal", str(e["park_tokens_equal"]), "True"))
    md.append("")
if hf:
    md.append(f"transformers {hf.get('transformers')} / torch {hf.get('torch')} on {hf.get('device')}; "
              f"generate timings best of 2 after a warm-up; model load {hf.get('load_s', 0):.1f} s.\n")
err = by.get("error", [])
for r in err:
    md.append(f"ERROR: {r.get('what')}\n")
    summary.append(("error", r.get("what", "")[:60], ""))

with open(f"{out_dir}/e2e.md", "w") as f:
    f.write("\n".join(md) + "\n")
print("\n".join(md))
print("\n== summary ==")
for a, b, c in summary:
    print(f"{a:45s} {b:>12s}   {c}")
