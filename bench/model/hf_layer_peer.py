#!/usr/bin/env python3
"""The peer for cpu_layer_bench: transformers' DeepSeek-V4 (same shapes, one layer,
fp32, CPU) doing one decode step at a given context, its cache filled with random
state. Prints one JSON line like cpu_layer_bench."""
import argparse
import json
import os
import time

import torch
from transformers import DeepseekV4Config, DeepseekV4ForCausalLM
from transformers.cache_utils import DynamicCache

ap = argparse.ArgumentParser()
ap.add_argument("--layer-type", required=True, choices=["compressed_sparse_attention", "heavily_compressed_attention"])
ap.add_argument("--context", type=int, required=True)
ap.add_argument("--steps", type=int, default=5)
a = ap.parse_args()
torch.set_num_threads(os.cpu_count())
cfg = DeepseekV4Config(
    vocab_size=1024, hidden_size=4096, num_hidden_layers=1, num_attention_heads=64, head_dim=512, q_lora_rank=1024,
    o_groups=8, o_lora_rank=1024, sliding_window=128, layer_types=[a.layer_type], mlp_layer_types=["moe"],
    index_n_heads=64, index_head_dim=128, index_topk=512, n_routed_experts=16, num_experts_per_tok=6,
    moe_intermediate_size=2048)
cfg._attn_implementation = "eager"
with torch.device("cpu"):
    model = DeepseekV4ForCausalLM(cfg).float().eval()
C = a.context
cache = DynamicCache(config=cfg)
layer = cache.layers[0]
layer.keys = torch.randn(1, 1, cfg.sliding_window - 1, cfg.head_dim)
layer.values = layer.keys
layer.is_initialized = True
layer.dtype, layer.device = torch.float32, torch.device("cpu")
layer.cumulative_length = C
rate = cfg.compress_rates[a.layer_type]
names = ["compressor", "indexer"] if a.layer_type == "compressed_sparse_attention" else ["compressor"]
for name in names:
    dim = cfg.head_dim if name == "compressor" else cfg.index_head_dim
    width = 2 * dim if a.layer_type == "compressed_sparse_attention" else dim
    layer.compressed_kv[name] = torch.randn(1, C // rate, dim)
    layer.entry_count[name] = C // rate
    layer.buffer_kv[name] = torch.zeros(1, 0, width)
    layer.buffer_gate[name] = torch.zeros(1, 0, width)
    if a.layer_type == "compressed_sparse_attention":
        layer.overlap_kv[name] = torch.randn(1, rate, dim)
        layer.overlap_gate[name] = torch.randn(1, rate, dim)
ids = torch.tensor([[7]])
times = []
with torch.no_grad():
    for s in range(a.steps + 1):
        t0 = time.perf_counter()
        model(ids, past_key_values=cache, use_cache=True)
        if s:
            times.append((time.perf_counter() - t0) * 1000)
times.sort()
print(json.dumps({"layer_type": a.layer_type, "context": C, "ms_per_step": times[len(times) // 2]}))
