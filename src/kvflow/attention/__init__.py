"""Attention: per-step metadata and the backends that consume it.

A backend is any callable with `paged_attention`'s signature
`(q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, D], kv_cache, meta, scale, *, sliding_window=None)
-> [T, Hq, D]` that writes k/v into the cache and attends over each request's context.
`sliding_window` is only ever passed for models that use one, so a backend without window
support fails loudly (TypeError) instead of silently attending too far.

A backend with the attribute `fuses_rotary = True` (the Triton one) may also be passed
`rotary=(cos, sin)`: q and k then arrive unrotated, and the backend rotates them (rotate-half,
rounded as the model's `apply_rotary` rounds) before it stores k and attends; q may be rotated
in place. Other backends get q and k rotated by the model.
"""

from __future__ import annotations

from typing import Protocol

import torch

from kvflow.attention.metadata import AttentionMetadata, token_positions
from kvflow.attention.torch_ref import paged_attention, write_kv_cache


class AttentionBackend(Protocol):
    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        **kwargs: int,
    ) -> torch.Tensor: ...


__all__ = [
    "AttentionBackend",
    "AttentionMetadata",
    "paged_attention",
    "token_positions",
    "write_kv_cache",
]
