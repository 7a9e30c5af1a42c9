"""What the paged-attention kernels share: the tile geometry, reading K/V through a block table,
one online-softmax step over a key tile, and the normalised store.

A program holds BLOCK_M query rows of one KV head: the G = Hq / Hkv query heads that share it,
for up to BLOCK_Q consecutive query tokens of one request, so each K/V tile is loaded once per
group. Row r is

    query token  tile_start + r // GP,  query head  kv_head * G + r % GP

(GP = G rounded up to a power of two; rows of missing tokens or heads are masked out). Keys at
or past a program's `end` are never loaded (masked loads read 0), so stale slots of a reused
block and the null block cannot leak in, even as NaN. Scores use an online softmax in float32
(base 2); the output is cast to q's dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import triton
import triton.language as tl

LOG2E = 1.4426950408889634


@dataclass(frozen=True)
class TileShape:
    """Rows per program and their layout, from the heads and the step's longest query."""

    group: int  # G: query heads per KV head
    group_pad: int  # GP
    block_q: int  # query tokens per program
    block_m: int  # rows per program: GP x BLOCK_Q, at least 16 (tl.dot's minimum)
    head_dim: int
    head_pad: int  # head_dim rounded up to a power of two, at least 16


def tile_shape(num_heads: int, num_kv_heads: int, head_dim: int, max_query_len: int) -> TileShape:
    """Aims at ~64 rows (query tokens x group heads) per program."""
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads are not a multiple of {num_kv_heads} KV heads")
    group = num_heads // num_kv_heads
    group_pad = triton.next_power_of_2(group)
    q_tokens = min(triton.next_power_of_2(max_query_len), max(1, 64 // group_pad))
    block_m = max(16, group_pad * q_tokens)
    head_pad = max(16, triton.next_power_of_2(head_dim))
    return TileShape(group, group_pad, block_m // group_pad, block_m, head_dim, head_pad)


@triton.jit
def kv_tile(
    k_cache_ptr, v_cache_ptr, table_row, n_start, end, kv_head, dims, dim_ok,
    stride_cache_block, stride_cache_offset, stride_cache_head,
    BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr,
):  # fmt: skip
    """Keys and values n_start .. n_start + BLOCK_N - 1 of one KV head, as the cache holds them,
    read through the request's block table row; positions at or past `end` are 0, unread."""
    k_pos = n_start + tl.arange(0, BLOCK_N)
    k_ok = k_pos < end
    block = tl.load(table_row + k_pos // BLOCK_SIZE, mask=k_ok, other=0).to(tl.int64)
    slot = (
        block * stride_cache_block
        + (k_pos % BLOCK_SIZE) * stride_cache_offset
        + kv_head * stride_cache_head
    )
    offsets = slot[:, None] + dims[None, :]  # [BLOCK_N, HEAD_PAD]
    mask = k_ok[:, None] & dim_ok[None, :]
    k = tl.load(k_cache_ptr + offsets, mask=mask, other=0.0)
    return k, tl.load(v_cache_ptr + offsets, mask=mask, other=0.0)


@triton.jit
def attend_tile(
    q, k, v, k_pos, q_pos, key_end, window, qk_scale, m_i, l_i, acc, HAS_WINDOW: tl.constexpr
):  # fmt: skip
    """One online-softmax step: the rows' running max `m_i`, sum `l_i` and unnormalised output
    `acc` after the keys k_pos (k, v) that each row sees (before `key_end`, at or before its
    position, inside the window)."""
    s = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision="ieee") * qk_scale
    visible = (k_pos < key_end)[None, :] & (k_pos[None, :] <= q_pos[:, None])
    if HAS_WINDOW:
        visible &= k_pos[None, :] > q_pos[:, None] - window
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing visible yet
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision="ieee")
    return m_new, l_i, acc


@triton.jit
def store_rows(out_ptr, acc, l_i, offsets, mask):
    """acc / l_i (0 for a row that saw no key) at `offsets`, in out's dtype."""
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(out_ptr + offsets, out.to(out_ptr.dtype.element_ty), mask=mask)
