#!/usr/bin/env python3
"""The peer of bench/gpu/e2e.sh: transformers' DeepseekV4ForCausalLM on the model
troupe loads, on the same card.

Writes the teacher-forced logits of random ids (bf16 eager, as served; the bf16
model cast to fp32; and the checkpoint loaded in fp32, the oracle), and times `generate`
(greedy, fixed lengths) at the given shapes. One JSON object on stdout."""
import argparse
import json
import os
import sys
import time

# This folder holds a profile.py, which would shadow the standard library's
# (torch imports cProfile, which imports profile).
sys.path = [p for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(os.path.abspath(__file__))]

import numpy as np
import torch
from transformers import DeepseekV4ForCausalLM

ap = argparse.ArgumentParser()
ap.add_argument("--model", required=True)
ap.add_argument("--positions", type=int, default=320)
ap.add_argument("--seed", type=int, default=7)
ap.add_argument("--ids-out", required=True)
ap.add_argument("--bf16-out", required=True)
ap.add_argument("--fp32-out", required=True)
ap.add_argument("--generate", default="1x512x32,8x512x32", help="BxPROMPTxNEW,...")
a = ap.parse_args()

out = {"kind": "transformers"}
t0 = time.perf_counter()
model = DeepseekV4ForCausalLM.from_pretrained(a.model, dtype=torch.bfloat16, attn_implementation="eager").eval().cuda()
# transformers 5.17 keeps these RMSNorms in fp32 (_keep_in_fp32_modules_strict); their
# fp32 outputs then meet bf16 projections ("expected mat1 and mat2 to have the same
# dtype"). In bf16 their outputs are bf16; mHC, sinks and biases stay fp32.
for name, mod in model.named_modules():
    if name.split(".")[-1] in {"q_a_norm", "kv_norm", "input_layernorm", "post_attention_layernorm", "norm"}:
        mod.to(torch.bfloat16)
torch.cuda.synchronize()
out["load_s"] = time.perf_counter() - t0
V = model.config.vocab_size
g = torch.Generator().manual_seed(a.seed)
ids = torch.randint(2, min(V, 100000), (a.positions,), generator=g)
np.save(a.ids_out, ids.numpy().astype(np.int64))
x = ids.view(1, -1).cuda()
with torch.no_grad():
    np.save(a.bf16_out, model(x, use_cache=False).logits[0].float().cpu().numpy())

gens = []
for spec in a.generate.split(","):
    B, N, M = (int(v) for v in spec.split("x"))
    prompts = torch.randint(2, min(V, 100000), (B, N), generator=g).cuda()
    mask = torch.ones_like(prompts)
    kw = dict(attention_mask=mask, do_sample=False, pad_token_id=0, eos_token_id=None)
    with torch.no_grad():
        model.generate(prompts, max_new_tokens=4, min_new_tokens=4, **kw)  # warm
        times = []
        for _ in range(2):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            res = model.generate(prompts, max_new_tokens=M, min_new_tokens=M, **kw)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        # Prefill alone (one forward over the prompts), to split generate's time.
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        model(prompts, use_cache=False)
        torch.cuda.synchronize()
        pre = time.perf_counter() - t0
    best = min(times)
    gens.append({"batch": B, "prompt": N, "new": M, "generate_s": best, "generate_tok_s": B * M / best,
                 "prefill_s": pre, "new_tokens": int(res.shape[1] - N)})
out["generate"] = gens

# The bf16 model cast to fp32: its matrices are the checkpoint's bf16 values, but the
# fp32 vectors of the checkpoint (norm weights, mHC base/scale, sinks, biases) went
# through bf16 at load or in the cast above, so they differ from the file's.
model = model.float()
with torch.no_grad():
    np.save(a.fp32_out.replace(".npy", "cast.npy"), model(x, use_cache=False).logits[0].float().cpu().numpy())
# The oracle: the checkpoint loaded in fp32 (every value exactly the file's), computed in fp32.
del model
torch.cuda.empty_cache()
model = DeepseekV4ForCausalLM.from_pretrained(a.model, dtype=torch.float32, attn_implementation="eager").eval().cuda()
with torch.no_grad():
    np.save(a.fp32_out, model(x, use_cache=False).logits[0].float().cpu().numpy())
out["torch"] = torch.__version__
import transformers  # noqa: E402

out["transformers"] = transformers.__version__
out["device"] = torch.cuda.get_device_name(0)
print(json.dumps(out), flush=True)
