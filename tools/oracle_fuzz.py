#!/usr/bin/env python3
"""The CPU forward pass against transformers on random model configs.

Draws configs from the space `DeepseekV4Config` accepts (widths, head counts, rope
fractions, o_groups, indexer shapes, compress rates, layer and MLP schedules, hc_mult,
Sinkhorn iterations, router functions, swiglu limits, rope and YaRN settings, tied
embeddings, the legacy config.json spellings), makes each model with every parameter
random (make_golden.randomize), saves it, and compares `troupe forward` (stateless, and
a prefill followed by one token a call) with transformers' stateless logits. Some of the
cases are saved as FP8 / FP4 checkpoints (--quantized; expected logits from transformers'
dequantizing load). A draw whose indexer or router top-k comes within a hair of a tie is
redrawn, as make_golden does; when every redraw is near one (the indexer's relu gives exact
zeros with few heads) the case still runs but a mismatch is not counted, unless
--stable-ties makes the oracle settle exact ties by lower index, as troupe does (torch's
order among equal scores is unspecified).

Needs torch and transformers 5.17 (not in scripts/requirements.txt: CPU wheels from
PyPI, about 5 GB):
    python3 -m venv /tmp/oracle && /tmp/oracle/bin/pip install torch transformers==5.17.0 safetensors numpy accelerate
    /tmp/oracle/bin/python tools/oracle_fuzz.py --troupe build/bin/troupe --cases 40 --seed 1 --stable-ties
Failing cases are kept under --keep (config, weights, ids, expected logits) so that they
can be rerun, or turned into fixtures (tests/fixtures/model/<name>/, same layout).
"""
import argparse
import json
import os
import random
import shlex
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np
import torch
from transformers import DeepseekV4Config, DeepseekV4ForCausalLM, FineGrainedFP8Config

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import make_golden  # noqa: E402  (randomize, TieWatch, TIE_GAP)

TOLERANCE = 1e-3  # the golden tests' bound on max |logit - transformers|

CSA, HCA, SWA = "compressed_sparse_attention", "heavily_compressed_attention", "sliding_attention"


def draw_config(rng, tokens_max=700):
    """One random config (constructor kwargs) and the run's token count and prefill."""
    heads = rng.choice([1, 2, 3, 4, 6, 8])
    o_groups = rng.choice([g for g in range(1, heads + 1) if heads % g == 0])
    head_dim = rng.choice([16, 24, 32, 48, 64])
    rope_choices = [f for f in (0.125, 0.25, 0.5, 1.0) if int(head_dim * f) >= 2 and int(head_dim * f) % 2 == 0
                    and head_dim * f == int(head_dim * f)]
    partial = rng.choice(rope_choices)
    rope_dim = int(head_dim * partial)
    index_head_dim = rng.choice([d for d in (8, 16, 32, 64) if d >= rope_dim] or [max(rope_dim, 8)])
    n_layers = rng.randint(1, 5)
    layer_types = [rng.choice([SWA, CSA, HCA]) for _ in range(n_layers)]
    mlp_layer_types = [rng.choice(["hash_moe", "moe"]) for _ in range(n_layers)]
    experts = rng.choice([2, 3, 4, 6, 8, 12, 16])
    fields = dict(
        vocab_size=rng.choice([97, 128, 256, 300, 513]),
        hidden_size=rng.choice([32, 40, 48, 64, 72, 96, 128]),
        num_attention_heads=heads, head_dim=head_dim, o_groups=o_groups,
        q_lora_rank=rng.choice([8, 16, 32, 48]), o_lora_rank=rng.choice([8, 16, 24, 32]),
        index_n_heads=rng.choice([1, 2, 4, 8, 16, 32]), index_head_dim=index_head_dim,
        index_topk=rng.choice([1, 2, 3, 5, 8, 16, 32]),
        n_routed_experts=experts, num_experts_per_tok=rng.randint(1, min(experts, 6)),
        moe_intermediate_size=rng.choice([8, 16, 32, 48]),
        sliding_window=rng.choice([1, 2, 5, 8, 16, 33, 64, 128]),
        partial_rotary_factor=partial,
        layer_types=layer_types, mlp_layer_types=mlp_layer_types, num_hidden_layers=n_layers,
        compress_rates={CSA: rng.choice([2, 3, 4, 8]), HCA: rng.choice([2, 3, 5, 8, 16, 32, 128])},
        hc_mult=rng.choice([1, 2, 3, 4]), hc_sinkhorn_iters=rng.choice([1, 2, 3, 7, 20]),
        hc_eps=rng.choice([1e-6, 1e-4, 1e-2]),
        scoring_func=rng.choice(["sqrtsoftplus", "sigmoid"]),
        routed_scaling_factor=rng.choice([1.0, 1.5, 2.5, 0.7]),
        swiglu_limit=rng.choice([10.0, 1.0, 0.3, 100.0]),
        rms_norm_eps=rng.choice([1e-6, 1e-5, 1e-3]),
        rope_theta=rng.choice([10000.0, 500.0, 1e6]),
        compress_rope_theta=rng.choice([160000.0, 10000.0, 1000.0]),
        tie_word_embeddings=rng.random() < 0.25,
        max_position_embeddings=4096, bos_token_id=0, eos_token_id=1,
    )
    r = rng.random()
    if r < 0.4:
        orig = rng.choice([64, 128, 256, 512])
        yarn = {"rope_type": "yarn", "factor": rng.choice([2.0, 4.0, 16.0, 40.0]),
                "original_max_position_embeddings": orig,
                "beta_fast": rng.choice([32, 16, 8]), "beta_slow": rng.choice([1, 2])}
        if rng.random() < 0.4:
            yarn["mscale"] = rng.choice([0.707, 1.0])
            yarn["mscale_all_dim"] = rng.choice([0.0, 0.5, 1.0])
        fields["rope_parameters"] = yarn
    tokens = rng.randint(20, 320) if rng.random() < 0.8 else rng.randint(320, max(320, tokens_max))
    prefill = rng.randint(1, tokens)
    return fields, tokens, prefill


def troupe_forward(troupe, model_dir, ids, prefill, out, extra):
    cmd = shlex.split(troupe) + ["forward", "--model", model_dir, "--ids", ",".join(map(str, ids)), "--out", out] + extra
    if prefill is not None:
        cmd += ["--prefill", str(prefill)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if p.returncode != 0:
        return None, (p.stderr or p.stdout).strip()[-800:]
    return np.load(out), None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--troupe", default="build/bin/troupe", help="the troupe command (may hold a wrapper and its arguments)")
    ap.add_argument("--backend", default="cpu", choices=["cpu", "cuda"],
                    help="troupe's backend (fp32 weights either way: the oracle's weights are fp32)")
    ap.add_argument("--cases", type=int, default=20)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--keep", default="/tmp/oracle_fuzz_failures")
    ap.add_argument("--tokens-max", type=int, default=700, help="the longest of the long fifth of the cases")
    ap.add_argument("--engine", action="store_true",
                    help="also run `troupe generate` (the serving engine) and check its rows and its prefix-cached rerun")
    ap.add_argument("--quantized", type=float, default=0.3, help="share of cases saved as FP8/FP4 checkpoints")
    ap.add_argument("--stable-ties", action="store_true",
                    help="the oracle's top-k settles exact ties by lower index, as troupe does (torch's order is unspecified)")
    ap.add_argument("--attempts", type=int, default=8, help="redraws of a config's weights near a tie")
    ap.add_argument("--keep-cases", type=lambda v: {int(c) for c in v.split(",") if c}, default=set(),
                    help="case numbers kept in --keep even when they pass (to rerun one on another backend)")
    args = ap.parse_args()
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    if args.quantized > 0:
        try:
            import accelerate  # noqa: F401  (transformers' FP8 loader needs it)
        except ImportError:
            print("accelerate is not installed: no quantized cases", flush=True)
            args.quantized = 0.0
    torch.set_float32_matmul_precision("highest")
    watch = make_golden.TieWatch()
    watch.install()
    if args.stable_ties:
        def stable_topk(self, k, dim=-1, largest=True, sorted=True):
            order = torch.sort(self, dim=dim, descending=largest, stable=True).indices.narrow(dim, 0, k)
            return torch.return_types.topk((self.gather(dim, order), order))
        torch.Tensor.topk = stable_topk
    rng = random.Random(args.seed)
    failures, skipped, passed, ties, engine_unsupported = [], 0, 0, 0, 0
    for case in range(args.cases):
        fields, tokens, prefill = draw_config(rng, args.tokens_max)
        label = f"case {case} (seed {args.seed})"
        try:
            cfg = DeepseekV4Config(**fields)
        except Exception as e:  # a draw transformers itself rejects
            print(f"{label}: config rejected by transformers: {e}", flush=True)
            skipped += 1
            continue
        cfg._attn_implementation = "eager"
        kept, gaps, tie = None, [], False
        for attempt in range(args.attempts):
            gen = torch.Generator().manual_seed(args.seed * 100003 + case * 101 + attempt)
            model = DeepseekV4ForCausalLM(cfg).float().eval()
            make_golden.randomize(model, cfg, gen)
            ids = torch.randint(0, cfg.vocab_size, (tokens,), generator=gen)
            watch.min_index_gap = watch.min_router_gap = float("inf")
            with torch.no_grad():
                logits = model(ids.view(1, -1), use_cache=False).logits[0].float()
            kept = (model, ids, logits)
            if min(watch.min_index_gap, watch.min_router_gap) >= make_golden.TIE_GAP:
                break
            gaps.append(f"indexer {watch.min_index_gap:.0e} router {watch.min_router_gap:.0e}")
        else:
            # Every draw has a top-k choice within a hair of a tie (the indexer's relu makes
            # exact zeros common with few heads). Still run, but a mismatch is not counted.
            tie = True
        model, ids, logits = kept
        work = tempfile.mkdtemp(prefix="oracle_fuzz_")
        try:
            d = os.path.join(work, "model")
            original = rng.random() < 0.7
            kwargs = {"save_original_format": original}
            if rng.random() < 0.2:
                kwargs["max_shard_size"] = "100KB"
            model.save_pretrained(d, **kwargs)
            legacy = []
            if rng.random() < 0.4:  # some of the older config.json spellings, where they can say the same
                parts = [p for p, chance in zip(make_golden.LEGACY_SPELLINGS, (0.7, 0.7, 0.5, 0.5)) if rng.random() < chance]
                legacy = make_golden.legacy_spelling(os.path.join(d, "config.json"), parts)
            quant = ""
            if original and "max_shard_size" not in kwargs and rng.random() < args.quantized:
                # FP8 linears (blocks of 8 x 8: every drawn width is a multiple of 8 or below it), FP4
                # experts where their inputs are multiples of 32; expected logits from transformers'
                # dequantizing load of the same files
                fp4 = fields["hidden_size"] % 32 == 0 and fields["moe_intermediate_size"] % 32 == 0
                make_golden.quantize_checkpoint(d, [8, 8], experts_fp4=fp4)
                qcfg = FineGrainedFP8Config(weight_block_size=(8, 8), dequantize=True)
                loaded = DeepseekV4ForCausalLM.from_pretrained(d, dtype=torch.float32, quantization_config=qcfg)
                loaded.config._attn_implementation = "eager"
                watch.min_index_gap = watch.min_router_gap = float("inf")
                with torch.no_grad():
                    logits = loaded.eval()(ids.view(1, -1), use_cache=False).logits[0].float()
                if min(watch.min_index_gap, watch.min_router_gap) < make_golden.TIE_GAP:
                    tie = True
                quant = "fp8+fp4 " if fp4 else "fp8 "
            desc = (f"layers {fields['layer_types']} mlp {fields['mlp_layer_types']} rates {fields['compress_rates']} "
                    f"hc {fields['hc_mult']} heads {fields['num_attention_heads']}/{fields['o_groups']} "
                    f"hd {fields['head_dim']} rope {fields['partial_rotary_factor']} win {fields['sliding_window']} "
                    f"topk {fields['index_topk']} tokens {tokens} prefill {prefill} "
                    f"{'yarn ' if 'rope_parameters' in fields else ''}{'hf-names ' if not original else ''}"
                    f"{quant}{' '.join(legacy)}")
            expect = logits.numpy()
            t0 = time.time()
            errs = {}
            problem = None
            for what, pf in (("stateless", None), (f"prefill {prefill} then decode", prefill)):
                got, err = troupe_forward(args.troupe, d, ids.tolist(), pf, os.path.join(work, "out.npy"),
                                          ["--backend", args.backend, "--weights", "f32"])
                if got is None:
                    problem = f"{what}: troupe failed: {err}"
                    break
                if got.shape != expect.shape:
                    problem = f"{what}: shape {got.shape} vs {expect.shape}"
                    break
                errs[what] = float(np.abs(got - expect).max())
                if not np.isfinite(errs[what]) or errs[what] > TOLERANCE:
                    problem = f"{what}: max |logit - transformers| = {errs[what]:.3e}"
                    break
            if problem is None and args.engine:
                # The serving engine (paged pools, chunked prefill, the decode path, the prefix cache):
                # greedy tokens from the first `prefill` ids, every row against transformers over the
                # same sequence, and a rerun from the prefix cache sampling the same ids.
                n_new = min(tokens - prefill, 48) if tokens > prefill else 8
                extra = ["--backend", args.backend, "--weights", "f32", "--ignore-eos", "--repeat", "2",
                         "--step-tokens", str(rng.choice([16, 64, 512])), "--max-chunk", str(rng.choice([0, 1, 7, 33])),
                         "--decode-batch", str(rng.choice([-1, 8]))]  # 8: decode steps through model::Decoder
                cmd = shlex.split(args.troupe) + ["generate", "--model", d, "--ids", ",".join(map(str, ids[:prefill].tolist())),
                                                  "--max-tokens", str(n_new), "--out", os.path.join(work, "gen.npy")] + extra
                p = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
                if p.returncode != 0 and "shorter than a CSA ring" in p.stderr:
                    engine_unsupported += 1
                    errs["engine"] = float("nan")
                elif p.returncode != 0:
                    problem = f"engine: troupe generate failed: {(p.stderr or p.stdout).strip()[-600:]}"
                else:
                    runs = [list(map(int, line.split(","))) for line in p.stdout.split()]
                    seq = torch.tensor(ids[:prefill].tolist() + runs[0][:-1])
                    watch.min_index_gap = watch.min_router_gap = float("inf")
                    with torch.no_grad():
                        oracle_model = loaded if quant else model
                        want = oracle_model(seq.view(1, -1), use_cache=False).logits[0].float().numpy()
                    got = np.load(os.path.join(work, "gen.npy"))
                    near = min(watch.min_index_gap, watch.min_router_gap) < make_golden.TIE_GAP
                    if len(runs) != 2 or runs[0] != runs[1]:
                        problem = f"engine: the prefix-cached rerun sampled {runs[1:]} after {runs[0]}"
                    elif got.shape != want.shape:
                        problem = f"engine: rows {got.shape} vs {want.shape}"
                    else:
                        errs["engine"] = float(np.abs(got - want).max())
                        if not np.isfinite(errs["engine"]) or errs["engine"] > TOLERANCE:
                            problem = f"engine ({' '.join(extra[6:])}): max |logit - transformers| = {errs['engine']:.3e}"
                            tie = tie or near
            took = time.time() - t0
            def keep_case():  # the model, its ids and the oracle's logits (tools/case_check.py reruns them)
                keep = os.path.join(args.keep, f"seed{args.seed}_case{case}")
                shutil.rmtree(keep, ignore_errors=True)
                shutil.copytree(d, keep)
                np.save(os.path.join(keep, "ids.npy"), ids.numpy().astype(np.int64))
                np.save(os.path.join(keep, "logits.npy"), expect.astype(np.float32))
                with open(os.path.join(keep, "meta.json"), "w") as f:
                    json.dump(dict(case=f"seed{args.seed}_case{case}", tokens=tokens, prefill=prefill,
                                   fields=fields, legacy=legacy, problem=problem), f, indent=2, default=str)
                return keep

            if case in args.keep_cases and not problem:
                print(f"{label}: kept in {keep_case()} (--keep-cases)", flush=True)
            if problem and tie:
                ties += 1
                print(f"{label}: near-tie draw differs ({problem}; {'; '.join(gaps[:2])}); not counted\n    {desc}",
                      flush=True)
            elif problem:
                keep = keep_case()
                failures.append((label, problem, desc))
                print(f"{label}: FAIL {problem}\n    {desc}\n    kept in {keep}", flush=True)
            else:
                passed += 1
                print(f"{label}: ok{' (near-tie draw)' if tie else ''} ({', '.join(f'{k} {v:.1e}' for k, v in errs.items())}; {took:.1f} s)\n    {desc}",
                      flush=True)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    print(f"\n{passed} passed, {len(failures)} failed, {ties} near-tie draws differed (not counted), "
          f"{skipped} skipped of {args.cases}" + (f"; the engine refused {engine_unsupported} (window < CSA ring)"
                                                   if engine_unsupported else ""))
    for label, problem, desc in failures:
        print(f"  {label}: {problem}\n    {desc}")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
