"""The paged KV cache's tensors: their shape from the model's config, and their allocation."""

from __future__ import annotations

from typing import Any

import torch


def kv_cache_shape(hf_config: Any) -> tuple[int, int, int]:
    """(num_layers, num_kv_heads, head_dim) of the paged KV cache."""
    heads = hf_config.num_attention_heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
    return hf_config.num_hidden_layers, kv_heads, head_dim


def allocate_kv_caches(
    hf_config: Any,
    num_blocks: int,
    block_size: int,
    dtype: torch.dtype,
    device: str | torch.device,
) -> list[torch.Tensor]:
    """One zeroed tensor per layer, [2, num_blocks, block_size, num_kv_heads, head_dim] (K, V)."""
    num_layers, kv_heads, head_dim = kv_cache_shape(hf_config)
    shape = (2, num_blocks, block_size, kv_heads, head_dim)
    return [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
