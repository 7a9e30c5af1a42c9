"""The CPU backend: the native kernel for every bf16 step, else the reference with one shortcut.

- bf16 with a head dim the kernel takes (a multiple of 16, at most 256):
  `kernels.cpu.attention.paged_attention` writes the step's K/V and attends each token over its request's
  context where it lies in the paged cache, whatever the step mixes (new prompts, later chunks,
  prefix hits, decode tokens). The reference gathers every context into a padded copy and pads
  every request's queries to the longest, about twice the time for a mixed step
  (benchmarks/RESULTS.md).
- Otherwise, steps of new prompts only (every request starts at position 0): a request's context
  is exactly its own scheduled tokens, so the reference's SDPA runs on the step's q/k/v without
  gathering them back from the cache (and, for prompts of one length, without padding or mask).
Everything else takes the reference path unchanged; the tests check every path against a naive
loop.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvflow.attention.metadata import AttentionMetadata
from kvflow.attention.torch_ref import (
    attend,
    pad_by_request,
    paged_attention,
    step_mask,
    write_kv_cache,
)
from kvflow.kernels.cpu import attention as native_attention
from kvflow.kernels.cpu import build


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
        q.dtype == kv_cache.dtype == torch.bfloat16
        and q.shape[-1] % 16 == 0
        and q.shape[-1] <= 256
        and build.native_available()
    )
    if native:
        return native_attention.paged_attention(
            q, k, v, kv_cache, meta.slot_mapping, meta.block_tables, meta.query_start_loc,
            meta.seq_lens, scale, sliding_window,
        )  # fmt: skip
    if meta.max_query_len > 1 and _new_prompts_only(meta):
        write_kv_cache(k, v, kv_cache, meta.slot_mapping)
        return _new_prompts_attention(q, k, v, meta, scale, sliding_window)
    return paged_attention(q, k, v, kv_cache, meta, scale, sliding_window)


def _new_prompts_only(meta: AttentionMetadata) -> bool:
    """Whether every request's context is just its scheduled tokens (nothing cached before)."""
    if "new_prompts" not in meta.memo:
        starts = meta.query_start_loc
        meta.memo["new_prompts"] = bool(torch.equal(starts[1:] - starts[:-1], meta.seq_lens))
    return meta.memo["new_prompts"]


def _new_prompts_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None,
) -> torch.Tensor:
    """Causal attention of new prompts over themselves: the reference's `attend` over the step's
    own k/v [T, Hkv, D], padded by request, instead of K/V gathered back from the cache. Prompts
    of one length (a lone prompt, a uniform batch) need no padding and no mask: the packed rows
    reshape to [B, L, H, D] for SDPA's causal kernel."""
    length = meta.max_query_len
    if q.shape[0] == meta.num_reqs * length and (
        sliding_window is None or sliding_window >= length
    ):
        batch = meta.num_reqs
        out = F.scaled_dot_product_attention(
            q.view(batch, length, *q.shape[1:]).transpose(1, 2),
            k.view(batch, length, *k.shape[1:]).transpose(1, 2),
            v.view(batch, length, *v.shape[1:]).transpose(1, 2),
            is_causal=True,
            scale=scale,
            enable_gqa=True,
        )
        return out.transpose(1, 2).reshape(q.shape)
    group = q.shape[1] // k.shape[1]
    _, req, local = step_mask(q, meta, meta.max_query_len, sliding_window, group)
    keys = pad_by_request(k, meta, req, local).transpose(1, 2)
    values = pad_by_request(v, meta, req, local).transpose(1, 2)
    return attend(q, keys, values, meta, scale, sliding_window)
