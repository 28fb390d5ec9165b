#!/usr/bin/env python3
"""Golden fixtures for the DeepSeek-V4 forward pass, made by the reference.

Runs transformers' `DeepseekV4ForCausalLM` (5.17 on the GPU machine) on small
random models whose EVERY parameter and buffer is random (transformers
initialises sinks, position_bias, hc base, e_score_correction_bias and tid2eid
to zero, which would hide bugs), and writes for each case:

    <out>/<case>/config.json, model*.safetensors   (save_pretrained)
    <out>/<case>/ids.npy                           int64 [T]
    <out>/<case>/logits.npy                        float32 [T, vocab], stateless forward
    <out>/<case>/meta.json                         prefill split, checks, versions

A case is kept only when transformers agrees with itself (stateless forward vs
its own prefill-then-decode run) and no top-k choice (lightning indexer, MoE
router) is within a hair of a tie, where any two correct implementations may
pick differently. Otherwise the next seed is tried.

Usage (the GPU machine, or a CPU-only venv with torch, transformers 5.17 and accelerate, as in
tools/oracle_fuzz.py):  python3 tools/make_golden.py --out tests/fixtures/model [--cases fp8_fp4]
Never run in CI: CI uses the committed fixtures.
"""
import argparse
import json
import os
import shutil
import sys

import numpy as np
import torch
import transformers
from transformers import DeepseekV4Config, DeepseekV4ForCausalLM
from transformers.cache_utils import DynamicCache
from transformers.models.deepseek_v4 import modeling_deepseek_v4 as mdv4

# A top-k choice whose k-th and (k+1)-th scores are closer than this (relative)
# could go either way between two correct fp32 implementations.
TIE_GAP = 1e-5

# ---- cases -----------------------------------------------------------------
BASE = dict(
    vocab_size=256, hidden_size=64, num_attention_heads=4, head_dim=32, q_lora_rank=32,
    o_groups=2, o_lora_rank=16, index_n_heads=8, index_head_dim=16, index_topk=8,
    n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, sliding_window=16,
    partial_rotary_factor=0.25, max_position_embeddings=4096, bos_token_id=0, eos_token_id=1,
)

CASES = {
    # all three layer types, both routers, default rope, hc_mult 4
    "basic": dict(
        layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
                     "compressed_sparse_attention"],
        mlp_layer_types=["hash_moe", "moe", "moe", "moe"],
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 16},
        tokens=300, prefill=37, seed=1),
    # YaRN on the compress rope, hc_mult 3, other rates, sigmoid router, hidden 128
    "yarn_hc3": dict(
        hc_mult=3, head_dim=48, num_attention_heads=6, o_groups=3,
        layer_types=["heavily_compressed_attention", "compressed_sparse_attention", "sliding_attention",
                     "compressed_sparse_attention", "heavily_compressed_attention"],
        mlp_layer_types=["hash_moe", "hash_moe", "moe", "moe", "moe"],
        compress_rates={"compressed_sparse_attention": 2, "heavily_compressed_attention": 8},
        rope_parameters={"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 256,
                         "beta_fast": 32, "beta_slow": 1},
        scoring_func="sigmoid", sliding_window=12, tokens=400, prefill=101, seed=2),
    # hc_mult 2, rates 8 / 32, few experts. (transformers 5.17 has no "softmax"
    # scoring function, so that router is checked against a reference in tests/.)
    "hc2_rates8": dict(
        hc_mult=2, layer_types=["heavily_compressed_attention", "compressed_sparse_attention", "sliding_attention"],
        mlp_layer_types=["moe", "moe", "hash_moe"],
        compress_rates={"compressed_sparse_attention": 8, "heavily_compressed_attention": 32},
        sliding_window=24, n_routed_experts=4, num_experts_per_tok=3,
        tokens=450, prefill=1, seed=3),
    # indexer everywhere, small top-k, 2 indexer heads
    "csa_heavy": dict(
        layer_types=["compressed_sparse_attention"] * 3, mlp_layer_types=["moe", "moe", "moe"],
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 128},
        index_topk=6, tokens=350, prefill=250, seed=4),
    # the real rates (4 / 128) with a long window, yarn with mscale and partial rope 1/2
    "real_rates": dict(
        hidden_size=96, layer_types=["heavily_compressed_attention", "compressed_sparse_attention",
                                      "heavily_compressed_attention", "compressed_sparse_attention"],
        mlp_layer_types=["hash_moe", "moe", "moe", "moe"],
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 128},
        rope_parameters={"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 512,
                         "mscale": 1.0, "mscale_all_dim": 0.5},
        partial_rotary_factor=0.5, sliding_window=64, index_topk=16, tokens=600, prefill=333, seed=5),
    # transformers' own module names (save_original_format=False), sharded, tied embeddings
    "hf_names_sharded": dict(
        layer_types=["compressed_sparse_attention", "sliding_attention", "heavily_compressed_attention"],
        mlp_layer_types=["hash_moe", "moe", "moe"],
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
        tie_word_embeddings=True, tokens=200, prefill=63, seed=6, save_original_format=False, shard="150KB"),
    # corners of the config space: hc_mult 1, a window of two tokens, rope over the whole head, one
    # indexer pick, one Sinkhorn iteration, a head per output group, every expert routed, a tight
    # SwiGLU clamp, a large rms eps; config.json in the legacy spellings (compress_ratios,
    # num_hash_layers, qk_rope_head_dim), which transformers folds in
    "corners": dict(
        hc_mult=1, sliding_window=2, partial_rotary_factor=1.0, index_head_dim=32, index_topk=1, hc_sinkhorn_iters=1, o_groups=4,
        num_experts_per_tok=8, swiglu_limit=0.3, rms_norm_eps=1e-3, scoring_func="sigmoid",
        layer_types=["compressed_sparse_attention", "heavily_compressed_attention", "sliding_attention",
                     "compressed_sparse_attention"],
        mlp_layer_types=["hash_moe", "hash_moe", "moe", "moe"],
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 128},
        tokens=330, prefill=131, seed=8, legacy_config=True),
    # a quantized checkpoint as DeepSeek ships V4: linears FP8 e4m3 with block scales (power-of-two values in
    # float32 `.scale` tensors, blocks of 32 x 64 here), routed experts FP4 e2m1 packed two a byte with one
    # float8_e8m0 scale per 32 inputs (`expert_dtype: fp4`); expected logits from transformers' own
    # dequantizing load of those files
    "fp8_fp4": dict(
        hidden_size=128, q_lora_rank=64, head_dim=64, o_lora_rank=64, index_head_dim=32, moe_intermediate_size=64,
        layer_types=["compressed_sparse_attention", "sliding_attention", "heavily_compressed_attention"],
        mlp_layer_types=["hash_moe", "moe", "moe"],
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
        tokens=160, prefill=45, seed=7, quantize=dict(block=[32, 64])),
}


def randomize(model, cfg, gen):
    """Every parameter and buffer random, at scales that keep activations O(1)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            elif name.endswith("sinks"):
                p.copy_(torch.randn(p.shape, generator=gen))
            elif name.endswith("position_bias"):
                p.copy_(0.5 * torch.randn(p.shape, generator=gen))
            elif name.endswith(".base") or name.endswith("hc_base"):
                p.copy_(0.5 * torch.randn(p.shape, generator=gen))
            elif name.endswith(".scale") or name.endswith("hc_scale"):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
            elif name.endswith("embed_tokens.weight"):
                p.copy_(torch.randn(p.shape, generator=gen))
            else:  # matrices: 1/sqrt(fan_in)
                fan_in = p.shape[-1]
                p.copy_(torch.randn(p.shape, generator=gen) / fan_in ** 0.5)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn(b.shape, generator=gen))
            elif name.endswith("tid2eid"):
                vocab, k = b.shape
                rows = [torch.randperm(cfg.n_routed_experts, generator=gen)[:k] for _ in range(vocab)]
                b.copy_(torch.stack(rows))


class TieWatch:
    """Records how close each top-k choice came to a tie (indexer and router)."""

    def __init__(self):
        self.min_index_gap = float("inf")
        self.min_router_gap = float("inf")
        self.pos = None
        self.rate = None
        self.k = None

    @staticmethod
    def gap(sorted_desc, k):
        a, b = sorted_desc[..., k - 1], sorted_desc[..., k]
        rel = (a - b) / (a.abs() + b.abs() + 1e-6)
        return float(rel.min()) if rel.numel() else float("inf")

    def install(self):
        watch = self
        orig_indexer = mdv4.DeepseekV4Indexer.forward
        orig_scorer = mdv4.DeepseekV4IndexerScorer.forward
        orig_router = mdv4.DeepseekV4TopKRouter.forward

        def indexer(self, hidden_states, q_residual, position_ids, past_key_values, layer_idx):
            watch.pos, watch.rate, watch.k = position_ids, self.compress_rate, self.index_topk
            return orig_indexer(self, hidden_states, q_residual, position_ids, past_key_values, layer_idx)

        def scorer(self, q, compressed_kv, hidden_states):
            s = orig_scorer(self, q, compressed_kv, hidden_states)  # [B, S, T]
            n = s.shape[-1]
            visible = (watch.pos + 1) // watch.rate  # [B, S]
            masked = s.masked_fill(torch.arange(n, device=s.device).view(1, 1, -1) >= visible.unsqueeze(-1),
                                   float("-inf"))
            srt = masked.sort(dim=-1, descending=True).values
            sel = visible > watch.k  # only rows where top-k really chooses
            if sel.any() and n > watch.k:
                watch.min_index_gap = min(watch.min_index_gap, TieWatch.gap(srt[sel], watch.k))
            return s

        def router(self, hidden_states):
            flat = hidden_states.reshape(-1, self.hidden_dim)
            scores = self.score_fn(torch.nn.functional.linear(flat, self.weight))
            keyed = (scores + self.e_score_correction_bias).sort(dim=-1, descending=True).values
            if keyed.shape[-1] > self.top_k:
                watch.min_router_gap = min(watch.min_router_gap, TieWatch.gap(keyed, self.top_k))
            return orig_router(self, hidden_states)

        mdv4.DeepseekV4Indexer.forward = indexer
        mdv4.DeepseekV4IndexerScorer.forward = scorer
        mdv4.DeepseekV4TopKRouter.forward = router


FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def pow2_scale(amax, top):
    """The power-of-two scale (ue8m0) that brings amax within the format's largest value."""
    return torch.exp2(torch.ceil(torch.log2(torch.clamp(amax, min=1e-30) / top)))


def quantize_fp8(w, block):
    """w [R, C] -> (e4m3 [R, C], float32 scales [ceil(R/bm), ceil(C/bn)], powers of two)."""
    bm, bn = block
    R, C = w.shape
    sr, sc = -(-R // bm), -(-C // bn)
    scale = torch.empty(sr, sc)
    q = torch.empty(R, C, dtype=torch.float8_e4m3fn)
    for i in range(sr):
        for j in range(sc):
            blk = w[i * bm:(i + 1) * bm, j * bn:(j + 1) * bn]
            s = pow2_scale(blk.abs().max(), 448.0)
            scale[i, j] = s
            q[i * bm:(i + 1) * bm, j * bn:(j + 1) * bn] = (blk / s).to(torch.float8_e4m3fn)
    return q, scale


def quantize_fp4(w):
    """w [R, C] -> (int8 [R, C/2], two e2m1 codes a byte, element 2j in the low nibble; e8m0 scales [R, C/32])."""
    R, C = w.shape
    blocks = w.reshape(R, C // 32, 32)
    scale = pow2_scale(blocks.abs().amax(dim=-1), 6.0)  # [R, C/32]
    x = blocks / scale.unsqueeze(-1)
    values = torch.tensor(FP4_VALUES)
    mag = (x.abs().unsqueeze(-1) - values).abs().argmin(dim=-1)  # nearest magnitude code 0..7
    code = (mag | ((x < 0) & (mag > 0)).long() << 3).reshape(R, C).to(torch.uint8)
    packed = (code[:, 0::2] | (code[:, 1::2] << 4)).view(torch.int8)
    return packed, scale.to(torch.float8_e8m0fnu)


def quantize_checkpoint(d, block, experts_fp4=True):
    """Rewrites a saved (DeepSeek-named) fp32 checkpoint the way V4's are shipped: every attention,
    compressor, indexer and shared-expert linear in FP8 with `.scale`, routed experts in FP4 (or
    FP8 when experts_fp4 is false)."""
    from safetensors.torch import load_file, save_file
    files = sorted(f for f in os.listdir(d) if f.endswith(".safetensors"))
    for f in files:
        path = os.path.join(d, f)
        out = {}
        for k, v in load_file(path).items():
            linear = (v.dim() == 2 and k.endswith(".weight") and (".attn." in k or ".shared_experts." in k)
                      and not k.endswith("norm.weight"))
            expert = ".experts." in k and ".shared_experts." not in k and k.endswith(".weight")
            if expert and experts_fp4:
                q, scale = quantize_fp4(v.float())
            elif expert:
                q, scale = quantize_fp8(v.float(), block)
            elif linear:
                q, scale = quantize_fp8(v.float(), block)
            else:
                out[k] = v
                continue
            out[k] = q
            out[k[:-len(".weight")] + ".scale"] = scale
        save_file(out, path, metadata={"format": "pt"})
    index = os.path.join(d, "model.safetensors.index.json")
    if os.path.exists(index):
        raise SystemExit("quantize_checkpoint: sharded checkpoints are not handled here")
    cfg_path = os.path.join(d, "config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                  "weight_block_size": list(block), "scale_fmt": "ue8m0"}
    cfg["expert_dtype"] = "fp4" if experts_fp4 else "fp8"
    with open(cfg_path, "w") as f:
        json.dump(cfg, f, indent=2)


LEGACY_SPELLINGS = ("compress_ratios", "num_hash_layers", "qk_rope_head_dim", "rope_scaling")


def legacy_spelling(path, parts=LEGACY_SPELLINGS):
    """Rewrites a saved config.json in the spellings older checkpoints and converters ship, each of
    `parts` only where it can say the same thing: compress_ratios per layer instead of layer_types +
    compress_rates (the real rates only), num_hash_layers instead of mlp_layer_types (hash layers
    first), qk_rope_head_dim instead of partial_rotary_factor, and rope_parameters as older configs
    have it (absent for default rope, else a flat rope_scaling of YaRN's keys, which transformers
    applies to the compress rope with compress_rope_theta). Returns the parts applied."""
    with open(path) as f:
        cfg = json.load(f)
    applied = []
    real_rates = {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128}
    if "compress_ratios" in parts and cfg.get("compress_rates") == real_rates and "layer_types" in cfg:
        cfg.pop("compress_rates")
        ratio = {"sliding_attention": 0, "compressed_sparse_attention": 4, "heavily_compressed_attention": 128}
        cfg["compress_ratios"] = [ratio[t] for t in cfg.pop("layer_types")]
        applied.append("compress_ratios")
    mlp = cfg.get("mlp_layer_types")
    if "num_hash_layers" in parts and mlp is not None:
        n_hash = mlp.count("hash_moe")
        if mlp == ["hash_moe"] * n_hash + ["moe"] * (len(mlp) - n_hash):
            cfg.pop("mlp_layer_types")
            cfg["num_hash_layers"] = n_hash
            applied.append("num_hash_layers")
    if "qk_rope_head_dim" in parts and "partial_rotary_factor" in cfg:
        cfg["qk_rope_head_dim"] = int(round(cfg["head_dim"] * cfg.pop("partial_rotary_factor")))
        applied.append("qk_rope_head_dim")
    rp = cfg.get("rope_parameters")
    if ("rope_scaling" in parts and isinstance(rp, dict) and isinstance(rp.get("main"), dict)
            and isinstance(rp.get("compress"), dict) and rp["main"].get("rope_type") == "default"):
        cfg.pop("rope_parameters")
        if rp["compress"].get("rope_type", "default") != "default":
            cfg["rope_scaling"] = {k: v for k, v in rp["compress"].items()
                                   if k not in ("rope_theta", "partial_rotary_factor", "attention_factor")}
        applied.append("rope_scaling")
    with open(path, "w") as f:
        json.dump(cfg, f, indent=2)
    return applied


def run_case(name, spec, out_dir, device, watch, attempts=20):
    spec = dict(spec)
    tokens, prefill, seed = spec.pop("tokens"), spec.pop("prefill"), spec.pop("seed")
    original = spec.pop("save_original_format", True)
    shard = spec.pop("shard", None)
    quantize = spec.pop("quantize", None)
    legacy_config = spec.pop("legacy_config", False)
    fields = dict(BASE)
    fields.update(spec)
    fields["num_hidden_layers"] = len(fields["layer_types"])
    for attempt in range(attempts):
        s = seed * 1000 + attempt
        gen = torch.Generator().manual_seed(s)
        cfg = DeepseekV4Config(**fields)
        cfg._attn_implementation = "eager"
        model = DeepseekV4ForCausalLM(cfg).float().eval()
        randomize(model, cfg, gen)
        model.to(device)
        ids = torch.randint(0, cfg.vocab_size, (tokens,), generator=gen)
        x = ids.view(1, -1).to(device)
        watch.min_index_gap = watch.min_router_gap = float("inf")
        with torch.no_grad():
            stateless = model(x, use_cache=False).logits[0].float().cpu()
            cache = DynamicCache(config=cfg)
            rows = [model(x[:, :prefill], past_key_values=cache, use_cache=True).logits[0].float().cpu()]
            for t in range(prefill, tokens):
                rows.append(model(x[:, t:t + 1], past_key_values=cache, use_cache=True).logits[0].float().cpu())
        cached = torch.cat(rows)
        diff = float((stateless - cached).abs().max())
        scale = float(stateless.abs().max())
        why = None
        if diff > 1e-4:
            why = f"stateless and cached runs disagree by {diff:.2e}"
        elif watch.min_index_gap < TIE_GAP:
            why = f"indexer top-k near a tie (relative gap {watch.min_index_gap:.1e})"
        elif watch.min_router_gap < TIE_GAP:
            why = f"router top-k near a tie (relative gap {watch.min_router_gap:.1e})"
        if why:
            print(f"{name}: seed {s} discarded: {why}", flush=True)
            continue
        index_gap, router_gap = watch.min_index_gap, watch.min_router_gap
        d = os.path.join(out_dir, name)
        shutil.rmtree(d, ignore_errors=True)
        model.cpu()
        kwargs = {"save_original_format": original}
        if shard:
            kwargs["max_shard_size"] = shard
        model.save_pretrained(d, **kwargs)
        if quantize:
            # The expected logits are those of transformers' load of the quantized files (it
            # dequantizes FP8 and FP4 on a machine without an FP8 GPU, or when asked to).
            quantize_checkpoint(d, quantize["block"])
            from transformers import FineGrainedFP8Config
            qcfg = FineGrainedFP8Config(weight_block_size=tuple(quantize["block"]), dequantize=True)
            loaded = DeepseekV4ForCausalLM.from_pretrained(d, dtype=torch.float32, quantization_config=qcfg)
            loaded.config._attn_implementation = "eager"
            loaded = loaded.eval().to(device)
            watch.min_index_gap = watch.min_router_gap = float("inf")
            with torch.no_grad():
                qlogits = loaded(x, use_cache=False).logits[0].float().cpu()
            if min(watch.min_index_gap, watch.min_router_gap) < TIE_GAP:
                print(f"{name}: seed {s} discarded: the quantized model's top-k near a tie", flush=True)
                continue
            meta_extra = dict(quantized_vs_fp32=float((qlogits - stateless).abs().max()))
            stateless = qlogits
            model = loaded.cpu()
        else:
            meta_extra = {}
        if legacy_config:
            applied = legacy_spelling(os.path.join(d, "config.json"))
            if applied != list(LEGACY_SPELLINGS):
                raise SystemExit(f"{name}: config.json cannot take every legacy spelling (only {applied})")
            again = DeepseekV4ForCausalLM.from_pretrained(d, dtype=torch.float32)
            again.config._attn_implementation = "eager"
            with torch.no_grad():
                moved = float((again.eval().to(device)(x, use_cache=False).logits[0].float().cpu() - stateless).abs().max())
            if moved > 1e-5:
                raise SystemExit(f"{name}: the legacy config.json changes transformers' logits by {moved:.2e}")
        np.save(os.path.join(d, "ids.npy"), ids.numpy().astype(np.int64))
        np.save(os.path.join(d, "logits.npy"), stateless.numpy().astype(np.float32))
        finite = lambda v: v if np.isfinite(v) else None  # no top-k choice made: JSON null, not Infinity
        meta = dict(case=name, seed=s, tokens=tokens, prefill=prefill, stateless_vs_cached=diff,
                    logit_scale=scale, min_index_gap=finite(index_gap), min_router_gap=finite(router_gap),
                    transformers=transformers.__version__, torch=torch.__version__, device=str(device), **meta_extra)
        if name == "basic":
            # The bf16 twin: the same model saved in bf16; its expected logits are the
            # fp32 forward of the bf16-rounded weights.
            twin = os.path.join(out_dir, "basic_bf16")
            shutil.rmtree(twin, ignore_errors=True)
            model.to(torch.bfloat16).save_pretrained(twin)
            rounded = DeepseekV4ForCausalLM.from_pretrained(twin, dtype=torch.float32).eval().to(device)
            with torch.no_grad():
                twin_logits = rounded(x, use_cache=False).logits[0].float().cpu()
            np.save(os.path.join(twin, "ids.npy"), ids.numpy().astype(np.int64))
            np.save(os.path.join(twin, "logits.npy"), twin_logits.numpy().astype(np.float32))
            np.save(os.path.join(twin, "fp32_logits.npy"), stateless.numpy().astype(np.float32))
            tmeta = dict(meta, case="basic_bf16", twin_of="basic",
                         bf16_vs_fp32=float((twin_logits - stateless).abs().max()))
            with open(os.path.join(twin, "meta.json"), "w") as f:
                json.dump(tmeta, f, indent=2)
        with open(os.path.join(d, "meta.json"), "w") as f:
            json.dump(meta, f, indent=2)
        print(f"{name}: seed {s} kept: {tokens} tokens, prefill {prefill}, self-agreement {diff:.1e}, "
              f"logit scale {scale:.2f}, index gap {index_gap:.1e}, router gap {router_gap:.1e}",
              flush=True)
        return True
    print(f"{name}: no usable seed in {attempts} attempts", flush=True)
    return False


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    os.makedirs(args.out, exist_ok=True)
    watch = TieWatch()
    watch.install()
    ok = all(run_case(n, CASES[n], args.out, torch.device(args.device), watch) for n in args.cases.split(","))
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
