"""Reference paged attention in plain torch: the exact oracle that faster backends are checked against.

Layout of one layer's cache: `kv_cache[0]` holds K and `kv_cache[1]` holds V, each
`[num_blocks, block_size, num_kv_heads, head_dim]`; flattening the first two dims gives one row
per slot, so slot s = block * block_size + offset is row s.

Per step, for B requests packed into T tokens (Q = max_query_len, L = padded context length):

    q [T, Hq, D] --scatter--> [B, Q, Hq, D]     K/V via block_tables --gather--> [B, L, Hkv, D]
    query i of request b sits at position  seq_lens[b] - q_len[b] + i  and sees keys j <= that
    (and j > position - sliding_window when a window is set).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvflow.attention.metadata import AttentionMetadata


def write_kv_cache(
    k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Store k/v [T, Hkv, D] at their slots. Slots must be valid; aim padding at block 0."""
    num_blocks, block_size, num_kv_heads, head_dim = kv_cache.shape[1:]
    flat = kv_cache.view(2, num_blocks * block_size, num_kv_heads, head_dim)
    flat[0].index_copy_(0, slot_mapping, k.to(kv_cache.dtype))
    flat[1].index_copy_(0, slot_mapping, v.to(kv_cache.dtype))


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Causal attention of every scheduled token over its request's whole context.

    q [T, Hq, D], k/v [T, Hkv, D] with T == query_start_loc[-1]; returns [T, Hq, D] in q's dtype.
    Writes this step's k/v into `kv_cache` first, so the context is read back from the cache
    through the block tables (cached prefix and new tokens alike). Hq must be a multiple of Hkv.
    """
    write_kv_cache(k, v, kv_cache, meta.slot_mapping)
    if meta.num_reqs == 0:
        return q.new_empty(q.shape)
    keys, values = _gather_context(kv_cache, meta)
    num_heads = q.shape[1]
    keys = _expand_kv_heads(keys, num_heads)
    values = _expand_kv_heads(values, num_heads)
    if meta.max_query_len == 1:
        return _decode(q, keys, values, meta, scale, sliding_window)
    return _prefill(q, keys, values, meta, scale, sliding_window)


def _gather_context(
    kv_cache: torch.Tensor, meta: AttentionMetadata
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of every request's context, [B, Hkv, L, D] with L = blocks_used * block_size."""
    blocks_used = -(-meta.max_seq_len // meta.block_size)
    table = meta.block_tables[:, :blocks_used].long()
    num_reqs = table.shape[0]
    gathered = kv_cache[:, table]  # [2, B, blocks_used, block_size, Hkv, D]
    gathered = gathered.reshape(2, num_reqs, blocks_used * meta.block_size, *kv_cache.shape[3:])
    gathered = gathered.transpose(2, 3)
    return gathered[0], gathered[1]


def _expand_kv_heads(x: torch.Tensor, num_heads: int) -> torch.Tensor:
    """[B, Hkv, L, D] -> [B, Hq, L, D]; KV head h serves query heads h*g .. h*g+g-1."""
    batch, num_kv_heads, length, head_dim = x.shape
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads are not a multiple of {num_kv_heads} KV heads")
    group = num_heads // num_kv_heads
    if group == 1:
        return x
    x = x[:, :, None].expand(batch, num_kv_heads, group, length, head_dim)
    return x.reshape(batch, num_heads, length, head_dim)


def _visible(
    query_pos: torch.Tensor, seq_lens: torch.Tensor, length: int, sliding_window: int | None
) -> torch.Tensor:
    """Bool [B, 1, Q, L]: key j is visible to a query at position p iff j <= p < seq_len."""
    keys = torch.arange(length, device=query_pos.device)
    mask = keys[None, None, :] <= query_pos[:, :, None]
    mask &= keys[None, None, :] < seq_lens.long()[:, None, None]
    if sliding_window is not None:
        mask &= keys[None, None, :] > query_pos[:, :, None] - sliding_window
    return mask[:, None]


def _decode(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None,
) -> torch.Tensor:
    """One query per request (T == B): no padding, the query sits at position seq_len - 1."""
    query_pos = (meta.seq_lens.long() - 1)[:, None]
    mask = _visible(query_pos, meta.seq_lens, keys.shape[2], sliding_window)
    out = F.scaled_dot_product_attention(
        q[:, :, None, :], keys.to(q.dtype), values.to(q.dtype), attn_mask=mask, scale=scale
    )
    return out[:, :, 0, :]


def _prefill(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None,
) -> torch.Tensor:
    """General case: pad queries to [B, Hq, Q, D], mask, attend, unpad back to [T, Hq, D]."""
    num_tokens, num_heads, head_dim = q.shape
    num_reqs, max_q = meta.num_reqs, meta.max_query_len
    starts = meta.query_start_loc.long()
    q_lens = starts[1:] - starts[:-1]
    req = torch.repeat_interleave(
        torch.arange(num_reqs, device=q.device), q_lens, output_size=num_tokens
    )
    local = torch.arange(num_tokens, device=q.device) - starts[req]
    padded = q.new_zeros(num_reqs, max_q, num_heads, head_dim)
    padded[req, local] = q
    seq_lens = meta.seq_lens.long()
    # Padding rows reuse the last real query's position so no row is fully masked (no NaN).
    rows = torch.arange(max_q, device=q.device)[None, :]
    query_pos = torch.minimum(
        (seq_lens - q_lens)[:, None] + rows, (seq_lens - 1)[:, None].expand(-1, max_q)
    )
    mask = _visible(query_pos, seq_lens, keys.shape[2], sliding_window)
    out = F.scaled_dot_product_attention(
        padded.transpose(1, 2), keys.to(q.dtype), values.to(q.dtype), attn_mask=mask, scale=scale
    )
    return out.transpose(1, 2)[req, local]
