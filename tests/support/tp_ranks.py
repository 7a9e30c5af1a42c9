"""Run a model's shards on two real ranks (processes joined by a gloo group) through the
steps of tests/model/test_tensor_parallel.py; rank 0 saves the logits of every step."""

from __future__ import annotations

import os

import torch

from kvflow.attention import AttentionMetadata, token_positions
from kvflow.attention.cpu import cpu_paged_attention
from kvflow.distributed.group import TPGroup
from kvflow.model.tensor_parallel import kv_cache_shape_for_rank, load_shard

BLOCK_SIZE = 4
NUM_BLOCKS = 16


def run_steps(model, caches, steps, block_ids) -> list[torch.Tensor]:
    """Each step: a list of (request, tokens, num_computed); returns each step's logits."""
    out = []
    for step in steps:
        q_lens = [len(tokens) for _, tokens, _ in step]
        computed = [c for _, _, c in step]
        blocks = [block_ids[r] for r, _, _ in step]
        meta = AttentionMetadata.build(q_lens, computed, blocks, BLOCK_SIZE, "cpu")
        ids = torch.tensor([t for _, tokens, _ in step for t in tokens])
        positions = torch.from_numpy(token_positions(q_lens, computed))
        with torch.inference_mode():
            out.append(model.compute_logits(model(ids, positions, caches, meta)))
    return out


def rank_main(rank: int, world: int, port: int, jobs: list, steps, block_ids, out: str) -> None:
    """jobs: (name, checkpoint path, dtype name, --quantization); rank 0 saves {name:
    ([logits per step], its (quantized bytes, bytes they replace))}."""
    torch.set_num_threads(1)
    group = TPGroup.init(rank, world, f"tcp://127.0.0.1:{port}", "cpu", timeout_s=120)
    results = {}
    for name, path, dtype_name, method in jobs:
        dtype = getattr(torch, dtype_name)
        model, cfg, quantized = load_shard(path, dtype, "cpu", group, cpu_paged_attention, method)
        layers, kv_heads, head_dim = kv_cache_shape_for_rank(cfg, group)
        shape = (2, NUM_BLOCKS, BLOCK_SIZE, kv_heads, head_dim)
        caches = [torch.zeros(shape, dtype=dtype) for _ in range(layers)]
        results[name] = (run_steps(model, caches, steps, block_ids), quantized)
    if rank == 0:
        torch.save(results, out + ".tmp")
        os.replace(out + ".tmp", out)
    group.destroy()
