"""One rank's shard of a model: the architecture built without memory (on torch's meta device),
its projections, embedding and head swapped for the parallel layers, then materialised on the
rank's device and filled from the checkpoint, so a rank never holds more than its shard.

    Llama family  qkv_proj, gate_up_proj column-parallel; o_proj, down_proj row-parallel
    OPT           qkv_proj, fc1 column-parallel; out_proj, fc2 row-parallel
    both          embed_tokens vocab-parallel; an untied lm_head vocab-parallel; the norms,
                  OPT's positions and projections replicated

Each rank's KV cache holds its own KV heads (`kv_cache_shape_for_rank`). With `--quantization`
each layer then takes its part of the quantized weights (`model.quantize`), the values one
device would hold: GGUF tensors read one at a time from the repacked file, int8 / fp8 made
from the shard (a row-parallel layer's scales from the whole row).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from kvflow.attention import AttentionBackend
from kvflow.distributed.group import TPGroup
from kvflow.model.layers import RotaryEmbedding, default_dtype
from kvflow.model.llama import LlamaForCausalLM, head_dim_of
from kvflow.model.loader import load_config, load_weights
from kvflow.model.opt import OPTForCausalLM
from kvflow.model.parallel_layers import (
    ColumnParallelLinear,
    ParallelLMHead,
    RowParallelLinear,
    VocabParallelEmbedding,
    head_partition,
    qkv_parallel,
)
from kvflow.model.registry import resolve_model_class


class TensorParallelLM(nn.Module):
    """A rank's shard with the model interface: `forward` is the shard's (its layers reduce),
    `compute_logits` gathers every rank's vocabulary slice, so each rank has all the logits."""

    def __init__(self, inner: nn.Module, vocab_size: int, group: TPGroup) -> None:
        super().__init__()
        self.inner = inner
        self.config = inner.config
        self.vocab_size = vocab_size
        self.group = group

    def forward(self, *args: Any) -> torch.Tensor:
        return self.inner(*args)

    def compute_logits(self, hidden: torch.Tensor, float32: bool = True) -> torch.Tensor:
        """hidden [N, hidden] -> float32 logits [N, vocab] (`logits_linear`'s `float32`), the
        same on every rank."""
        local = self.inner.compute_logits(hidden, float32)
        return self.group.all_gather_last(local)[:, : self.vocab_size]


def check_divisible(hf_config: Any, world_size: int) -> None:
    """Raises ValueError when `world_size` ranks cannot share the model's heads."""
    heads = hf_config.num_attention_heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    for rank in range(world_size):
        head_partition(heads, kv_heads, world_size, rank)


def kv_cache_shape_for_rank(hf_config: Any, group: TPGroup) -> tuple[int, int, int]:
    """(num_layers, this rank's KV heads, head_dim) of its paged KV cache."""
    heads = hf_config.num_attention_heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
    shard = head_partition(heads, kv_heads, group.world_size, group.rank)
    return hf_config.num_hidden_layers, shard.kv_count, head_dim


def load_shard(
    path: str | Path,
    dtype: torch.dtype,
    device: str,
    group: TPGroup,
    attn_backend: AttentionBackend | None = None,
    quantization: str = "none",
) -> tuple[TensorParallelLM, Any, tuple[int, int]]:
    """(this rank's shard in eval mode with `quantization`'s weights, the transformers config,
    `quantize_model`'s bytes). Raises ValueError as `load_model` and `quantize_model` do, and
    for head counts the ranks cannot share. Every rank calls it (row-parallel int8 / fp8
    scales are an all-reduce per layer)."""
    hf_config = load_config(path)
    check_divisible(hf_config, group.world_size)
    model_class = resolve_model_class(hf_config)
    with torch.device("meta"), default_dtype(dtype):
        model = model_class(hf_config, attn_backend=attn_backend)
        if isinstance(model, LlamaForCausalLM):
            _shard_llama(model, hf_config, group)
        elif isinstance(model, OPTForCausalLM):
            _shard_opt(model, hf_config, group)
        else:
            raise ValueError(f"{model_class.__name__} has no tensor-parallel layout")
    loaders = {name: p.weight_loader for name, p in model.named_parameters()}
    model.to_empty(device=device)  # new Parameter objects: their loaders are set again
    for name, param in model.named_parameters():
        param.weight_loader = loaders[name]
    with torch.device(device), default_dtype(dtype):
        for parent in list(model.modules()):  # buffers computed at init, not in checkpoints
            for name, child in parent.named_children():
                if isinstance(child, RotaryEmbedding):
                    setattr(parent, name, RotaryEmbedding(hf_config, head_dim_of(hf_config)))
    model.eval()
    model.requires_grad_(False)
    quantized = load_weights(model, Path(path), quantization)
    return TensorParallelLM(model, hf_config.vocab_size, group), hf_config, quantized


def _shard_llama(model: LlamaForCausalLM, cfg: Any, group: TPGroup) -> None:
    inner = model.model
    for layer in inner.layers:
        attn = layer.self_attn
        shard = head_partition(attn.num_heads, attn.num_kv_heads, group.world_size, group.rank)
        attn.qkv_proj = qkv_parallel(attn.qkv_proj, shard, attn.head_dim)
        columns = (shard.q_start * attn.head_dim, shard.q_count * attn.head_dim)
        attn.o_proj = RowParallelLinear.cut(attn.o_proj, group, columns)
        attn.num_heads = attn.attn.num_heads = shard.q_count
        attn.num_kv_heads = attn.attn.num_kv_heads = shard.kv_count
        mlp = layer.mlp
        mlp.gate_up_proj = ColumnParallelLinear.cut(mlp.gate_up_proj, group)
        mlp.down_proj = RowParallelLinear.cut(mlp.down_proj, group)
    inner.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, group)
    if model.lm_head is not None:
        model.lm_head = ParallelLMHead(cfg.hidden_size, cfg.vocab_size, group)


def _shard_opt(model: OPTForCausalLM, cfg: Any, group: TPGroup) -> None:
    decoder = model.model.decoder
    for layer in decoder.layers:
        attn = layer.self_attn
        heads = attn.attn.num_heads
        shard = head_partition(heads, heads, group.world_size, group.rank)
        attn.qkv_proj = qkv_parallel(attn.qkv_proj, shard, attn.head_dim)
        columns = (shard.q_start * attn.head_dim, shard.q_count * attn.head_dim)
        attn.out_proj = RowParallelLinear.cut(attn.out_proj, group, columns)
        attn.attn.num_heads = attn.attn.num_kv_heads = shard.q_count
        layer.fc1 = ColumnParallelLinear.cut(layer.fc1, group)
        layer.fc2 = RowParallelLinear.cut(layer.fc2, group)
    decoder.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.word_embed_proj_dim, group)
    if model.lm_head is not None:
        model.lm_head = ParallelLMHead(cfg.word_embed_proj_dim, cfg.vocab_size, group)
