"""Paged attention for decode-only steps (one query token per request): grid (B, Hkv, SPLITS),
program i is request i, so no tile map is built or read (the CUDA graphs' step).

The kernel also stores the step's K/V: the program with the request's last keys stores the
token's k and v at its slot and attends them from registers, so no program reads back what
this kernel wrote. With ROTARY, q and k arrive unrotated and the kernel rotates them as it
loads them (rounded as `ops.rotary_` rounds; compiled without fused multiply-adds).

Under PDL a program reads its request's seq_len, block table and first key tile before
`gdc_wait`, while the projection before it still runs: all of it was written before the forward
began (the host's inputs; keys of earlier steps), and the forward's first kernel, the
embedding, is launched without PDL, so those writers are done. Everything else (q, the token's
k/v, the split counters) is read after the wait.

SPLITS > 1: a pair's keys are cut into `active` chunks of whole key tiles (a context of one
tile or less: one chunk, one program; programs past `active` return once they have waited),
attended in parallel and merged (`attention_merge`). Without ROTARY the cos/sin pointers, and
without SPLITS the counter and partial pointers, are never read.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from kvflow.kernels.triton.attention_common import (
    LOG2E,
    TileShape,
    attend_tile,
    kv_tile,
    store_rows,
)
from kvflow.kernels.triton.attention_merge import merge_partials, publish_partial
from kvflow.kernels.triton.ops import contiguous_rows, rotate, swapped_halves
from kvflow.kernels.triton.pdl import pdl_args


@triton.jit
def _rows(kv_head, seq_len, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_M: tl.constexpr):
    """(rows, their query heads, which rows are real: the one token's heads, their position)."""
    rows = tl.arange(0, BLOCK_M)
    head = kv_head * GROUP + rows % GROUP_PAD
    row_ok = (rows // GROUP_PAD < 1) & (rows % GROUP_PAD < GROUP)
    return rows, head, row_ok, seq_len - 1 + rows // GROUP_PAD


@triton.jit
def _key_span(seq_len, window, BLOCK_N: tl.constexpr, SPLITS: tl.constexpr, HAS_WINDOW):
    """(first key, one past the last, programs sharing the keys, this program's chunk)."""
    key_start = 0
    if HAS_WINDOW:
        key_start = tl.maximum(seq_len - window, 0)
    key_end = seq_len
    active = 1
    split = 0
    if SPLITS > 1:  # this program takes one chunk of the keys, whole tiles of them
        span = key_end - key_start
        chunk = tl.cdiv(tl.cdiv(span, SPLITS), BLOCK_N) * BLOCK_N
        active = tl.cdiv(span, chunk)
        split = tl.program_id(2)
        key_start += split * chunk  # past key_end for an idle program: it loads nothing
        key_end = tl.minimum(key_end, key_start + chunk)
    return key_start, key_end, active, split


@triton.jit
def _own_token(
    q_ptr, q_rows, io_mask, k_ptr, v_ptr, cos_ptr, sin_ptr, k_cache_ptr, v_cache_ptr,
    slot_ptr, req, kv_head, dims, dim_ok, own, stride_kt, stride_kh, stride_vt, stride_vh,
    stride_ct, stride_st, stride_cache_offset, stride_cache_head,
    HEAD_DIM: tl.constexpr, ROTARY: tl.constexpr,
):  # fmt: skip
    """(q, the token's k, v) rotated with ROTARY; k and v stored at the token's slot where
    `own` (the program with the request's last keys)."""
    q = tl.load(q_ptr + q_rows + dims[None, :], mask=io_mask, other=0.0)
    k_row = k_ptr + req * stride_kt + kv_head * stride_kh
    k_new = tl.load(k_row + dims, mask=own, other=0.0)
    v_new = tl.load(v_ptr + req * stride_vt + kv_head * stride_vh + dims, mask=own, other=0.0)
    if ROTARY:  # rotate q and the token's k
        swap = swapped_halves(dims, HEAD_DIM)
        cos = tl.load(cos_ptr + req * stride_ct + dims, mask=dim_ok, other=0.0).to(tl.float32)
        sin = tl.load(sin_ptr + req * stride_st + dims, mask=dim_ok, other=0.0).to(tl.float32)
        q_swapped = tl.load(q_ptr + q_rows + swap[None, :], mask=io_mask, other=0.0)
        q = rotate(q, q_swapped, cos[None, :], sin[None, :], dims[None, :], HEAD_DIM)
        k_new = rotate(k_new, tl.load(k_row + swap, mask=own), cos, sin, dims, HEAD_DIM)
    k_new = k_new.to(k_cache_ptr.dtype.element_ty)
    v_new = v_new.to(v_cache_ptr.dtype.element_ty)
    dst = tl.load(slot_ptr + req).to(tl.int64) * stride_cache_offset
    dst += kv_head * stride_cache_head + dims
    tl.store(k_cache_ptr + dst, k_new, mask=own)
    tl.store(v_cache_ptr + dst, v_new, mask=own)
    return q, k_new, v_new


@triton.jit
def _walk_keys(
    q, k, v, k_new, v_new, seq_len, q_pos, key_start, key_end, cached_end, window, qk_scale,
    k_cache_ptr, v_cache_ptr, table_row, kv_head, dims, dim_ok,
    stride_cache_block, stride_cache_offset, stride_cache_head,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, HAS_WINDOW: tl.constexpr,
):  # fmt: skip
    """(max, sum, unnormalised output) over keys key_start .. key_end - 1, BLOCK_N at a time
    (k, v: the first tile, read already), the token's own key and value (k_new, v_new) at its
    position instead of the cache's."""
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)  # running max (base-2 scores)
    l_i = tl.zeros([BLOCK_M], tl.float32)  # running sum of exp2
    acc = tl.zeros([BLOCK_M, HEAD_PAD], tl.float32)
    for n_start in range(key_start, key_end, BLOCK_N):  # k, v: this tile's keys, read before
        k_pos = n_start + tl.arange(0, BLOCK_N)
        is_new = (k_pos == seq_len - 1)[:, None]  # the token's own key and value
        k = tl.where(is_new, k_new[None, :], k)
        v = tl.where(is_new, v_new[None, :], v)
        m_i, l_i, acc = attend_tile(
            q, k, v, k_pos, q_pos, key_end, window, qk_scale, m_i, l_i, acc, HAS_WINDOW
        )
        k, v = kv_tile(
            k_cache_ptr, v_cache_ptr, table_row, n_start + BLOCK_N, cached_end, kv_head, dims,
            dim_ok, stride_cache_block, stride_cache_offset, stride_cache_head, BLOCK_N,
            BLOCK_SIZE,
        )  # fmt: skip
    return m_i, l_i, acc


@triton.jit
def _decode_attention_kernel(
    q_ptr, out_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr,
    k_ptr, v_ptr, slot_ptr, cos_ptr, sin_ptr, counter_ptr, part_ml_ptr, part_acc_ptr,
    qk_scale, window,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_cache_block, stride_cache_offset, stride_cache_head, stride_table,
    stride_kt, stride_kh, stride_vt, stride_vh, stride_ct, stride_st,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, HAS_WINDOW: tl.constexpr,
    ROTARY: tl.constexpr = False, SPLITS: tl.constexpr = 1, PDL: tl.constexpr = False,
):  # fmt: skip
    if PDL:
        gdc_launch_dependents()
    req = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + req)
    rows, head, row_ok, q_pos = _rows(kv_head, seq_len, GROUP, GROUP_PAD, BLOCK_M)
    dims = tl.arange(0, HEAD_PAD)
    dim_ok = dims < HEAD_DIM
    key_start, key_end, active, split = _key_span(seq_len, window, BLOCK_N, SPLITS, HAS_WINDOW)
    cached_end = tl.minimum(key_end, seq_len - 1)  # the token's own key comes from k_ptr
    table_row = block_tables_ptr + req.to(tl.int64) * stride_table
    k, v = kv_tile(
        k_cache_ptr, v_cache_ptr, table_row, key_start, cached_end, kv_head, dims, dim_ok,
        stride_cache_block, stride_cache_offset, stride_cache_head, BLOCK_N, BLOCK_SIZE,
    )  # fmt: skip
    if PDL:  # the first tile was read before the wait (module docstring)
        gdc_wait()
    if split >= active:
        return
    q_rows = (req + rows // GROUP_PAD)[:, None] * stride_qt + head[:, None] * stride_qh
    io_mask = row_ok[:, None] & dim_ok[None, :]
    q, k_new, v_new = _own_token(
        q_ptr, q_rows, io_mask, k_ptr, v_ptr, cos_ptr, sin_ptr, k_cache_ptr, v_cache_ptr,
        slot_ptr, req, kv_head, dims, dim_ok, dim_ok & (key_end == seq_len), stride_kt,
        stride_kh, stride_vt, stride_vh, stride_ct, stride_st, stride_cache_offset,
        stride_cache_head, HEAD_DIM, ROTARY,
    )  # fmt: skip
    m_i, l_i, acc = _walk_keys(
        q, k, v, k_new, v_new, seq_len, q_pos, key_start, key_end, cached_end, window,
        qk_scale, k_cache_ptr, v_cache_ptr, table_row, kv_head, dims, dim_ok,
        stride_cache_block, stride_cache_offset, stride_cache_head,
        BLOCK_M, BLOCK_N, HEAD_PAD, BLOCK_SIZE, HAS_WINDOW,
    )  # fmt: skip
    tile_offsets = rows[:, None] * HEAD_PAD + dims[None, :]
    if SPLITS > 1 and active > 1:  # the partial out; the last program to count merges
        pair = req * tl.num_programs(1) + kv_head  # its partials: pair * SPLITS ..
        last = publish_partial(
            part_ml_ptr, part_acc_ptr, counter_ptr + pair, pair * SPLITS + split, m_i, l_i,
            acc, rows, tile_offsets, active, BLOCK_M, HEAD_PAD,
        )  # fmt: skip
        if not last:
            return
        m_i, l_i, acc = merge_partials(
            part_ml_ptr, part_acc_ptr, counter_ptr + pair, pair * SPLITS, active, rows,
            tile_offsets, BLOCK_M, HEAD_PAD,
        )  # fmt: skip
    o_offsets = (req + rows // GROUP_PAD)[:, None] * stride_ot + head[:, None] * stride_oh
    store_rows(out_ptr, acc, l_i, o_offsets + dims[None, :], io_mask)


def decode_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    slot_mapping: torch.Tensor,
    scale: float,
    sliding_window: int | None,
    rotary: tuple[torch.Tensor, torch.Tensor] | None,
    shape: TileShape,
    key_tile: tuple[int, int],
    split: tuple[int, torch.Tensor, torch.Tensor, torch.Tensor] | None,
) -> None:
    """out [B, Hq, D] = each request's token q [B, Hq, D] over its context, its k/v [B, Hkv, D]
    stored at `slot_mapping` first (rotated with `rotary`: cos, sin [B, 1, D]). `key_tile`:
    (BLOCK_N keys, warps); `split`: (programs per request and KV head, int32 counters, one per
    pair, all 0; partial max/sum [parts, 2, BLOCK_M] and outputs [parts, BLOCK_M, HEAD_PAD],
    float32, parts = pairs x programs) or None."""
    batch, _, head_dim = q.shape
    if k.stride(-1) != 1 or v.stride(-1) != 1:
        k, v = k.contiguous(), v.contiguous()
    cos, sin = (q, q) if rotary is None else (contiguous_rows(t, batch, head_dim) for t in rotary)
    splits, counters, part_ml, part_acc = split or (1, q, q, q)
    block_n, warps = key_tile
    _decode_attention_kernel[(batch, kv_cache.shape[3], splits)](
        q, out, kv_cache[0], kv_cache[1], block_tables, seq_lens,
        k, v, slot_mapping, cos, sin, counters, part_ml, part_acc,
        scale * LOG2E, sliding_window or 0,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3), block_tables.stride(0),
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos.stride(0), sin.stride(0),
        GROUP=shape.group, GROUP_PAD=shape.group_pad, BLOCK_M=shape.block_m, BLOCK_N=block_n,
        HEAD_DIM=head_dim, HEAD_PAD=shape.head_pad, BLOCK_SIZE=kv_cache.shape[2],
        HAS_WINDOW=sliding_window is not None, ROTARY=rotary is not None, SPLITS=splits,
        num_warps=warps, enable_fp_fusion=rotary is None, **pdl_args(),
    )  # fmt: skip
