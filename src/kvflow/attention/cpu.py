"""The CPU backend: the reference backend, with decode-only steps in a native kernel.

A decode-only step (every request schedules one token) attends with
`cpu_kernels.decode_attention`, which reads each request's K/V where they lie in the paged cache;
the reference gathers them into a padded copy first (a third of a batch-32 step, see
benchmarks/RESULTS.md). Steps with prefill chunks, float32 caches, or no native library take the
reference path unchanged, so both paths are checked against each other in the tests.
"""

from __future__ import annotations

import torch

from kvflow.attention.metadata import AttentionMetadata
from kvflow.attention.torch_ref import paged_attention
from kvflow.model import cpu_kernels


def cpu_paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Same contract as `torch_ref.paged_attention`."""
    native = (
        meta.max_query_len == 1
        and q.dtype == kv_cache.dtype == torch.bfloat16
        and cpu_kernels.native_available()
    )
    if not native:
        return paged_attention(q, k, v, kv_cache, meta, scale, sliding_window)
    return cpu_kernels.decode_attention(
        q,
        k,
        v,
        kv_cache,
        meta.slot_mapping,
        meta.block_tables,
        meta.seq_lens,
        meta.max_seq_len,
        scale,
        sliding_window,
    )
