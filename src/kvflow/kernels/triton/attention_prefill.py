"""Paged attention for steps with prompts or chunks (any mix with decode tokens), varlen: one
launch attends every scheduled token over its request's context, read through block tables.
The step's K/V are in the cache already (`kv_write.write_kv`).

Grid `(tiles, Hkv)`: a program takes one *query tile* of one request (up to BLOCK_Q consecutive
query tokens) and one KV head (rows as `attention_common` lays them out). Request b has
ceil(q_len[b] / BLOCK_Q) tiles; `query_tiles` turns the cumulative tile counts into `tile_req`
/ `tile_start` (program -> request, first query token) with device ops. The grid size must be
known without reading q_len back from the device, so it is the bound B + T // BLOCK_Q (sum of
ceil(q / BQ) <= sum of q // BQ + 1); spare programs find `tile_req == -1` and return.

A program walks its request's context BLOCK_N keys at a time, from the first key any of its
queries can see (0, or the sliding window's start) to its last query's position; key position
p is read at block p // block_size, offset p % block_size, so any block size works.

Under PDL it waits first thing: `write_kv` has just stored the keys it reads.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvflow.kernels.triton.attention_common import (
    LOG2E,
    TileShape,
    attend_tile,
    kv_tile,
    store_rows,
)
from kvflow.kernels.triton.pdl import pdl_args, pdl_start


@triton.jit
def _varlen_attention_kernel(
    q_ptr, out_ptr, k_cache_ptr, v_cache_ptr,
    block_tables_ptr, query_start_loc_ptr, seq_lens_ptr, tile_req_ptr, tile_start_ptr,
    qk_scale, window,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_cache_block, stride_cache_offset, stride_cache_head, stride_table,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, HAS_WINDOW: tl.constexpr, PDL: tl.constexpr = False,
):  # fmt: skip
    pdl_start(PDL)
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    req = tl.load(tile_req_ptr + tile)
    if req < 0:  # spare program of the upper-bound grid
        return
    tile_start = tl.load(tile_start_ptr + tile)
    q_start = tl.load(query_start_loc_ptr + req)
    q_len = tl.load(query_start_loc_ptr + req + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + req)
    first_pos = seq_len - q_len + tile_start  # context position of the tile's first query

    rows = tl.arange(0, BLOCK_M)
    token = tile_start + rows // GROUP_PAD  # query token within the request
    head = kv_head * GROUP + rows % GROUP_PAD
    row_ok = (token < q_len) & (rows % GROUP_PAD < GROUP)
    q_pos = first_pos + rows // GROUP_PAD
    dims = tl.arange(0, HEAD_PAD)
    dim_ok = dims < HEAD_DIM
    key_end = tl.minimum(seq_len, first_pos + BLOCK_Q)  # one past the tile's last query
    key_start = 0
    if HAS_WINDOW:
        key_start = tl.maximum(first_pos - window + 1, 0)
    table_row = block_tables_ptr + req.to(tl.int64) * stride_table
    k, v = kv_tile(
        k_cache_ptr, v_cache_ptr, table_row, key_start, key_end, kv_head, dims, dim_ok,
        stride_cache_block, stride_cache_offset, stride_cache_head, BLOCK_N, BLOCK_SIZE,
    )  # fmt: skip
    q_rows = (q_start + token)[:, None] * stride_qt + head[:, None] * stride_qh
    io_mask = row_ok[:, None] & dim_ok[None, :]
    q = tl.load(q_ptr + q_rows + dims[None, :], mask=io_mask, other=0.0)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)  # running max (base-2 scores)
    l_i = tl.zeros([BLOCK_M], tl.float32)  # running sum of exp2
    acc = tl.zeros([BLOCK_M, HEAD_PAD], tl.float32)
    for n_start in range(key_start, key_end, BLOCK_N):  # k, v: this tile's keys, read before
        k_pos = n_start + tl.arange(0, BLOCK_N)
        m_i, l_i, acc = attend_tile(
            q, k, v, k_pos, q_pos, key_end, window, qk_scale, m_i, l_i, acc, HAS_WINDOW
        )
        k, v = kv_tile(
            k_cache_ptr, v_cache_ptr, table_row, n_start + BLOCK_N, key_end, kv_head, dims,
            dim_ok, stride_cache_block, stride_cache_offset, stride_cache_head, BLOCK_N,
            BLOCK_SIZE,
        )  # fmt: skip
    o_offsets = (q_start + token)[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :]
    store_rows(out_ptr, acc, l_i, o_offsets, io_mask)


def query_tiles(
    query_start_loc: torch.Tensor, num_reqs: int, num_tokens: int, block_q: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(tile_req, tile_start) int32 [B + T // block_q]: each program's request (-1: spare) and
    first query token within it, built with device ops (no sync)."""
    starts = query_start_loc.long()
    tiles = (starts[1:] - starts[:-1] + block_q - 1) // block_q
    ends = torch.cumsum(tiles, 0)
    ids = torch.arange(num_reqs + num_tokens // block_q, device=starts.device)
    req = torch.searchsorted(ends, ids, right=True)
    clamped = req.clamp(max=num_reqs - 1)
    tile_start = (ids - (ends - tiles)[clamped]) * block_q
    tile_req = torch.where(req < num_reqs, req, -1)
    return tile_req.to(torch.int32), tile_start.to(torch.int32)


def varlen_attention(
    q: torch.Tensor,
    out: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    tiles: tuple[torch.Tensor, torch.Tensor],
    scale: float,
    sliding_window: int | None,
    shape: TileShape,
    key_tile: tuple[int, int],
) -> None:
    """out [T, Hq, D] = attention of q [T, Hq, D] (head dim contiguous) over the paged cache
    [2, blocks, block_size, Hkv, D]; `tiles` from `query_tiles`, `key_tile` (BLOCK_N keys,
    warps)."""
    tile_req, tile_start = tiles
    block_n, warps = key_tile
    _varlen_attention_kernel[(tile_req.shape[0], kv_cache.shape[3])](
        q, out, kv_cache[0], kv_cache[1],
        block_tables, query_start_loc, seq_lens, tile_req, tile_start,
        scale * LOG2E, sliding_window or 0,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3), block_tables.stride(0),
        GROUP=shape.group, GROUP_PAD=shape.group_pad, BLOCK_Q=shape.block_q,
        BLOCK_M=shape.block_m, BLOCK_N=block_n, HEAD_DIM=shape.head_dim, HEAD_PAD=shape.head_pad,
        BLOCK_SIZE=kv_cache.shape[2], HAS_WINDOW=sliding_window is not None, num_warps=warps,
        **pdl_args(),
    )  # fmt: skip
