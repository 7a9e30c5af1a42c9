"""The native paged attention kernel: K/V read where they lie in the paged cache."""

from __future__ import annotations

import torch

from kvflow.kernels.cpu.build import library


def _rows(t: torch.Tensor) -> torch.Tensor:
    """t [rows, heads, D] with heads and D packed (any row stride), else a packed copy."""
    return t if t.stride(2) == 1 and t.stride(1) == t.shape[2] else t.contiguous()


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None,
) -> torch.Tensor:
    """One step's attention, any mix of new prompts, later chunks and decode tokens: writes k/v
    [T, Hkv, D] at `slot_mapping` (int64 [T]) into the paged bf16 `kv_cache` [2, num_blocks,
    block_size, Hkv, D], then each token of q [T, Hq, D] attends over its request's context up
    to its own position (the last `sliding_window` positions with a window) -> [T, Hq, D].
    Request b's queries are rows query_start_loc[b] .. query_start_loc[b + 1] (int32 [B + 1]),
    its context seq_lens[b] tokens (int32 [B]) through block_tables[b] (int32 [B, max blocks]).
    Every argument of the kernel call is fixed by the tensors' addresses and shapes (nothing
    per step's values), so a recorded call replays (`worker.cpu_replay`).
    All bf16, head dim a multiple of 16 up to 256; needs `native_available()`."""
    lib = library()
    assert lib is not None, "call native_available() first"
    q, k, v = _rows(q), _rows(k), _rows(v)
    if k.stride(0) != v.stride(0):
        k, v = k.contiguous(), v.contiguous()
    tokens, num_heads, head_dim = q.shape
    _, _, block_size, num_kv_heads, _ = kv_cache.shape
    out = torch.empty(tokens, num_heads, head_dim, dtype=q.dtype)
    lib.kvflow_paged_attention(
        q.data_ptr(),
        q.stride(0),
        k.data_ptr(),
        v.data_ptr(),
        k.stride(0),
        slot_mapping.data_ptr(),
        kv_cache[0].data_ptr(),
        kv_cache[1].data_ptr(),
        block_tables.data_ptr(),
        block_tables.shape[1],
        query_start_loc.data_ptr(),
        seq_lens.data_ptr(),
        seq_lens.shape[0],
        num_heads,
        num_kv_heads,
        head_dim,
        block_size,
        sliding_window or 0,
        scale,
        out.data_ptr(),
    )
    return out
