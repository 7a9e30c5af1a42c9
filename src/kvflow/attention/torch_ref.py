"""Reference paged attention in plain torch: the exact oracle that faster backends are checked against.

Layout of one layer's cache: `kv_cache[0]` holds K and `kv_cache[1]` holds V, each
`[num_blocks, block_size, num_kv_heads, head_dim]`; flattening the first two dims gives one row
per slot, so slot s = block * block_size + offset is row s.

Per step, for B requests packed into T tokens (Q = max_query_len, L = padded context length):

    q [T, Hq, D] --scatter--> [B, Q, Hq, D]     K/V via block_tables --gather--> [B, Hkv, L, D]
    query i of request b sits at position  seq_lens[b] - q_len[b] + i  and sees keys j <= that
    (and j > position - sliding_window when a window is set); padding keys j >= seq_lens[b]
    (null block or stale slots) are masked. Decode-only batches (Q == 1) skip the padding.
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
    return attend(q, keys, values, meta, scale, sliding_window)


def attend(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """q [T, Hq, D] over each request's keys/values [B, Hkv, L, D] (index = context position;
    positions >= seq_len are masked) -> [T, Hq, D]."""
    group = q.shape[1] // keys.shape[1]
    mask, req, local = step_mask(q, meta, keys.shape[2], sliding_window, group)
    if meta.max_query_len == 1:  # decode only: T == B, one query row per request
        return _grouped_sdpa(q[:, None], keys, values, mask, scale)[:, 0]
    return _grouped_sdpa(pad_by_request(q, meta, req, local), keys, values, mask, scale)[req, local]


def step_mask(
    q: torch.Tensor, meta: AttentionMetadata, length: int, sliding_window: int | None, group: int
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """`_step_mask`, built on the first layer of a step and kept in `meta.memo` for the rest."""
    key = ("mask", sliding_window, group)
    if key not in meta.memo:
        meta.memo[key] = _step_mask(q, meta, length, sliding_window, group)
    return meta.memo[key]


def pad_by_request(
    x: torch.Tensor, meta: AttentionMetadata, req: torch.Tensor, local: torch.Tensor
) -> torch.Tensor:
    """Packed rows x [T, ...] -> [B, max_query_len, ...], zero-padded (req/local from the mask)."""
    padded = x.new_zeros(meta.num_reqs, meta.max_query_len, *x.shape[1:])
    padded[req, local] = x
    return padded


def _step_mask(
    q: torch.Tensor, meta: AttentionMetadata, length: int, sliding_window: int | None, group: int
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """(mask [B, 1, Q*group, L] for the folded GQA rows, token -> request, token -> row).

    The same for every layer of a step, so it is built once and kept in `meta.memo`.
    """
    seq_lens = meta.seq_lens.long()
    if meta.max_query_len == 1:
        mask = _visible((seq_lens - 1)[:, None], seq_lens, length, sliding_window)
        req = local = None
    else:
        req, local, query_pos = _query_rows(q, meta)
        mask = _visible(query_pos, seq_lens, length, sliding_window)
    return mask.repeat_interleave(group, dim=1)[:, None], req, local


def _gather_context(
    kv_cache: torch.Tensor, meta: AttentionMetadata
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of every request's context, [B, Hkv, L, D] with L = blocks_used * block_size."""
    blocks_used = -(-meta.max_seq_len // meta.block_size)
    table = meta.block_tables[:, :blocks_used].reshape(-1)
    num_reqs = meta.num_reqs
    two, num_blocks, block_size, num_kv_heads, head_dim = kv_cache.shape
    # index_select on flattened blocks: an order of magnitude faster than kv_cache[:, table] on CPU
    gathered = kv_cache.view(two, num_blocks, -1).index_select(1, table)
    length = blocks_used * block_size
    gathered = gathered.view(two, num_reqs, length, num_kv_heads, head_dim)
    # Slots past a request's context (a block's stale tail, the null block) may hold anything,
    # NaN included, and a masked NaN still poisons the softmax (0 * NaN): zero them.
    if "stale" not in meta.memo:
        keys = torch.arange(length, device=kv_cache.device)
        meta.memo["stale"] = (keys[None, :] >= meta.seq_lens[:, None])[None, :, :, None, None]
    gathered.masked_fill_(meta.memo["stale"], 0)
    gathered = gathered.transpose(2, 3)
    return gathered[0], gathered[1]


def _query_rows(
    q: torch.Tensor, meta: AttentionMetadata
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(per token its request and row in the padded [B, Q] queries, query positions [B, Q]).

    Padding rows copy the last real query's position so that no row is fully masked (no NaN).
    """
    num_tokens = q.shape[0]
    num_reqs, max_q = meta.num_reqs, meta.max_query_len
    starts = meta.query_start_loc.long()
    q_lens = starts[1:] - starts[:-1]
    req = torch.repeat_interleave(
        torch.arange(num_reqs, device=q.device), q_lens, output_size=num_tokens
    )
    local = torch.arange(num_tokens, device=q.device) - starts[req]
    seq_lens = meta.seq_lens.long()
    rows = torch.arange(max_q, device=q.device)[None, :]
    query_pos = torch.minimum((seq_lens - q_lens)[:, None] + rows, (seq_lens - 1)[:, None])
    return req, local, query_pos


def _visible(
    query_pos: torch.Tensor, seq_lens: torch.Tensor, length: int, sliding_window: int | None
) -> torch.Tensor:
    """Bool [B, Q, L]: key j is visible to a query at position p iff j <= p and j < seq_len
    (and j > p - sliding_window with a window)."""
    keys = torch.arange(length, device=query_pos.device)[None, None, :]
    mask = (keys <= query_pos[:, :, None]) & (keys < seq_lens[:, None, None])
    if sliding_window is not None:
        mask &= keys > query_pos[:, :, None] - sliding_window
    return mask


def _grouped_sdpa(
    queries: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """queries [B, Q, Hq, D] over keys/values [B, Hkv, L, D] -> [B, Q, Hq, D]; mask is the
    folded [B, 1, Q*g, L] one from `_step_mask`.

    GQA: query head h uses KV head h // g (g = Hq / Hkv), as transformers' repeat_kv. Instead
    of copying each KV head g times, the g query heads of a group become g extra query rows
    of that KV head (row = query * g + r), each with its query's mask row: same math, no copy.
    """
    batch, max_q, num_heads, head_dim = queries.shape
    num_kv_heads = keys.shape[1]
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads are not a multiple of {num_kv_heads} KV heads")
    group = num_heads // num_kv_heads
    folded = queries.reshape(batch, max_q, num_kv_heads, group, head_dim).permute(0, 2, 1, 3, 4)
    folded = folded.reshape(batch, num_kv_heads, max_q * group, head_dim)
    out = F.scaled_dot_product_attention(
        folded, keys.to(queries.dtype), values.to(queries.dtype), attn_mask=mask, scale=scale
    )
    out = out.reshape(batch, num_kv_heads, max_q, group, head_dim).permute(0, 2, 1, 3, 4)
    return out.reshape(batch, max_q, num_heads, head_dim)
