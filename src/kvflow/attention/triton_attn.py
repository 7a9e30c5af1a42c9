"""Paged attention as one varlen Triton kernel: same signature and semantics as `torch_ref`.

The step's k/v are stored at their slots first (`write_kv`, one kernel for both, reading them
where the fused projection left them), then one kernel launch attends every scheduled token,
prefill chunks and decodes alike.

Grid `(num_tiles, Hkv)`: a program takes one *query tile* of one request (up to BLOCK_Q
consecutive query tokens of that request) and one KV head, and with it the G = Hq / Hkv query
heads that share that KV head, so each K/V tile is loaded once per group. Its BLOCK_M rows are

    row r  ->  query token  tile_start + r // GP  of the request,  query head  kv_head * G + r % GP

(GP = G rounded up to a power of two; rows of missing tokens or heads are masked out).

Varlen mapping: request b has ceil(q_len[b] / BLOCK_Q) tiles. Once per step, torch ops turn the
cumulative tile counts into `tile_req` / `tile_start` (program id -> request, first query token),
kept in `meta.memo` for all layers. The grid size must be known without reading q_len back
from the device, so it is the bound B + T // BLOCK_Q (sum of ceil(q/BQ) <= sum of q//BQ + 1);
spare programs find `tile_req == -1` and return at once.

Decode-only steps (max_query_len == 1: every request has exactly one query token, so
query_start_loc is 0, 1, .., B) take the DECODE path: grid (B, Hkv), program i is request i with
tile_start 0, and no tile map is built or read. This is the CUDA graphs' step, where the map's
dozen small torch ops would be replayed every step (~25 us on an H200).

A decode step stores its own k/v inside the attention kernel (no `write_kv`): the program
with the request's last keys stores the token's k and v at its slot and attends them from
registers, so no program reads back what this kernel wrote. With `rotary=(cos, sin)` (as
`PagedAttention` passes it to a backend with `fuses_rotary`) q and k arrive unrotated and the
kernel rotates them as it loads them, so the rotary kernel is gone from the step too. Other steps
rotate q in place (`rotary_`) and k as `write_kv` stores it. Either way the rotation rounds as
`rotary_` (and transformers) rounds, compiled without fused multiply-adds.

Under PDL (`kernels.triton.pdl.pdl_args`) a decode program reads its request's seq_len, block table
and first key tile before `gdc_wait`, while the projection before it still runs: all of it was
written before the forward began (the host's inputs; keys of earlier steps), and the forward's
first kernel, the embedding, is launched without PDL, so those writers are done. Everything
else (q, the token's k/v, the split counters) is read after the wait. Other steps wait first:
`write_kv` has just stored their keys.

Split decode (`SPLITS`, `_decode_splits`): a decode step with fewer (request, KV head) pairs
than the card has SMs would leave most SMs idle while a few programs walk long contexts (81 us
a layer at 8192 tokens and batch 1 on an H200). Then each pair gets SPLITS programs (grid
(B, Hkv, SPLITS)); the pair's keys are cut into `active` chunks of whole key tiles (a context
of one tile or less: one chunk, one program, as without splitting; programs past `active`
return once they have waited). Each program stores its partial result (running max, sum,
unnormalised output) and counts itself on the pair's counter (a barrier, then one acq_rel
atomic: the release covers every thread's stores); the program that counts last merges the
partials in split order, so the result does not depend on which came last, writes the output
and sets the counter back to 0 for the next layer. Counters live outside the graphs' memory pool.

Key loop: a program walks its request's context by token position, BLOCK_N keys at a time, from
the first key any of its queries can see (0, or the sliding window's start) to its last query's
position. Key position p is read through the block table at block p // block_size, offset
p % block_size, so any block size works. Keys at or beyond seq_len are never loaded (masked
loads), so stale slots and the null block cannot leak in, even as NaN. Scores use an online
softmax in float32 (base 2); the output is cast to q's dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from kvflow.attention.metadata import AttentionMetadata
from kvflow.kernels.triton.device import sm_count
from kvflow.kernels.triton.ops import contiguous_rows, rotary_, rotate, swapped_halves
from kvflow.kernels.triton.pdl import pdl_args, pdl_start

_LOG2E = 1.4426950408889634


@triton.jit
def _kv_tile(
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
def _paged_attention_kernel(
    q_ptr, out_ptr, k_cache_ptr, v_cache_ptr,
    block_tables_ptr, query_start_loc_ptr, seq_lens_ptr, tile_req_ptr, tile_start_ptr,
    k_ptr, v_ptr, slot_ptr, cos_ptr, sin_ptr, counter_ptr, part_ml_ptr, part_acc_ptr,
    qk_scale, window,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_cache_block, stride_cache_offset, stride_cache_head, stride_table,
    stride_kt, stride_kh, stride_vt, stride_vh, stride_ct, stride_st,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, HAS_WINDOW: tl.constexpr, DECODE: tl.constexpr,
    ROTARY: tl.constexpr = False, SPLITS: tl.constexpr = 1, PDL: tl.constexpr = False,
):  # fmt: skip
    """DECODE: k_ptr/v_ptr/slot_ptr are the step's k, v and slots (this kernel stores them);
    ROTARY (DECODE only): k is unrotated, cos_ptr/sin_ptr are the step's cos/sin rows. SPLITS >
    1 (DECODE only): counter_ptr/part_ml_ptr/part_acc_ptr are the split counters and partial
    results. See the module docstring; otherwise never read."""
    if PDL:
        gdc_launch_dependents()
        if not DECODE:  # write_kv just stored the step's keys: wait before any read
            gdc_wait()
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    if DECODE:  # one query token per request: program i is request i, its token i
        req = tile
        tile_start = 0
        q_start = req
        q_len = 1
    else:
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
    active = 1  # programs that share this (request, KV head)'s keys
    split = 0
    if SPLITS > 1:  # this program takes one chunk of the keys, whole tiles of them
        span = key_end - key_start
        chunk = tl.cdiv(tl.cdiv(span, SPLITS), BLOCK_N) * BLOCK_N
        active = tl.cdiv(span, chunk)
        split = tl.program_id(2)
        key_start += split * chunk  # past key_end for an idle program: it loads nothing
        key_end = tl.minimum(key_end, key_start + chunk)
    cached_end = key_end  # keys read from the cache; a decode's own token comes from k_ptr
    if DECODE:
        cached_end = tl.minimum(key_end, seq_len - 1)
    table_row = block_tables_ptr + req.to(tl.int64) * stride_table
    k, v = _kv_tile(
        k_cache_ptr, v_cache_ptr, table_row, key_start, cached_end, kv_head, dims, dim_ok,
        stride_cache_block, stride_cache_offset, stride_cache_head, BLOCK_N, BLOCK_SIZE,
    )  # fmt: skip
    if PDL and DECODE:  # the first tile was read before the wait (module docstring)
        gdc_wait()
    if split >= active:
        return

    q_rows = (q_start + token)[:, None] * stride_qt + head[:, None] * stride_qh
    io_mask = row_ok[:, None] & dim_ok[None, :]
    q = tl.load(q_ptr + q_rows + dims[None, :], mask=io_mask, other=0.0)
    if DECODE:  # the program with the last keys stores the token's k, v and attends them as is
        own = dim_ok & (key_end == seq_len)
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

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)  # running max (base-2 scores)
    l_i = tl.zeros([BLOCK_M], tl.float32)  # running sum of exp2
    acc = tl.zeros([BLOCK_M, HEAD_PAD], tl.float32)

    for n_start in range(key_start, key_end, BLOCK_N):  # k, v: this tile's keys, read before
        k_pos = n_start + tl.arange(0, BLOCK_N)
        if DECODE:  # the token's own key and value
            is_new = (k_pos == seq_len - 1)[:, None]
            k = tl.where(is_new, k_new[None, :], k)
            v = tl.where(is_new, v_new[None, :], v)
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
        m_i = m_new
        k, v = _kv_tile(
            k_cache_ptr, v_cache_ptr, table_row, n_start + BLOCK_N, cached_end, kv_head, dims,
            dim_ok, stride_cache_block, stride_cache_offset, stride_cache_head, BLOCK_N,
            BLOCK_SIZE,
        )  # fmt: skip

    if SPLITS > 1 and active > 1:  # the partial result out; the last program to finish
        # merges them (SPLITS is known at compile time, `active` is not)
        first = (req * tl.num_programs(1) + kv_head) * SPLITS  # this pair's first partial
        ml = part_ml_ptr + (first + split) * 2 * BLOCK_M + rows
        tl.store(ml, m_i)
        tl.store(ml + BLOCK_M, l_i)
        tile_offsets = rows[:, None] * HEAD_PAD + dims[None, :]
        tl.store(part_acc_ptr + (first + split) * BLOCK_M * HEAD_PAD + tile_offsets, acc)
        tl.debug_barrier()  # every thread's stores, then one release (the atomic's)
        counter = counter_ptr + req * tl.num_programs(1) + kv_head
        if tl.atomic_add(counter, 1, sem="acq_rel") < active - 1:
            return
        tl.atomic_xchg(counter, 0, sem="relaxed")  # ready for the next step or layer
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_PAD], tl.float32)
        for part in range(first, first + active):  # in split order: results do not depend on
            ml = part_ml_ptr + part * 2 * BLOCK_M + rows  # which program came last
            m_s = tl.load(ml, cache_modifier=".cg")
            l_s = tl.load(ml + BLOCK_M, cache_modifier=".cg")
            acc_s = tl.load(
                part_acc_ptr + part * BLOCK_M * HEAD_PAD + tile_offsets, cache_modifier=".cg"
            )
            m_new = tl.maximum(m_i, m_s)
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m_i - m_safe)
            beta = tl.exp2(m_s - m_safe)
            l_i = l_i * alpha + l_s * beta
            acc = acc * alpha[:, None] + acc_s * beta[:, None]
            m_i = m_new

    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    o_offsets = (q_start + token)[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :]
    tl.store(out_ptr + o_offsets, out.to(out_ptr.dtype.element_ty), mask=io_mask)


@triton.jit
def _write_kv_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, cos_ptr, sin_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh, stride_cache_slot, stride_cache_head,
    stride_ct, stride_st,
    HEADS: tl.constexpr, HEADS_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr,
    ROTARY: tl.constexpr = False, PDL: tl.constexpr = False,
):  # fmt: skip
    pdl_start(PDL)
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    heads = tl.arange(0, HEADS_PAD)[:, None]
    dims = tl.arange(0, HEAD_PAD)[None, :]
    mask = (heads < HEADS) & (dims < HEAD_DIM)
    dst = slot * stride_cache_slot + heads * stride_cache_head + dims
    k_rows = k_ptr + token * stride_kt + heads * stride_kh
    k = tl.load(k_rows + dims, mask=mask)
    if ROTARY:  # k is stored rotated (k itself is left as it was)
        dim_ok = dims < HEAD_DIM
        cos = tl.load(cos_ptr + token * stride_ct + dims, mask=dim_ok, other=0.0)
        sin = tl.load(sin_ptr + token * stride_st + dims, mask=dim_ok, other=0.0)
        swapped = tl.load(k_rows + swapped_halves(dims, HEAD_DIM), mask=mask)
        k = rotate(k, swapped, cos.to(tl.float32), sin.to(tl.float32), dims, HEAD_DIM)
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    v = tl.load(v_ptr + token * stride_vt + heads * stride_vh + dims, mask=mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def write_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    slots: torch.Tensor,
    rotary: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """`torch_ref.write_kv_cache` in one kernel: k/v [T, Hkv, D] (rows may be strided, as the
    fused projection leaves them) into `kv_cache` [2, blocks, block_size, Hkv, D] at `slots`;
    with `rotary` (cos, sin [T, 1, D]) k is stored rotated."""
    tokens, heads, head_dim = k.shape
    if not tokens:
        return
    if k.stride(2) != 1 or v.stride(2) != 1:
        k, v = k.contiguous(), v.contiguous()
    if kv_cache.stride(4) != 1 or kv_cache.stride(3) != head_dim:
        raise ValueError("kv_cache must be packed over heads and head_dim")
    cos, sin = (k, k) if rotary is None else (contiguous_rows(t, tokens, head_dim) for t in rotary)
    _write_kv_kernel[(tokens,)](
        k, v, kv_cache[0], kv_cache[1], slots, cos, sin,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        cos.stride(0), sin.stride(0),
        HEADS=heads, HEADS_PAD=triton.next_power_of_2(heads),
        HEAD_DIM=head_dim, HEAD_PAD=triton.next_power_of_2(head_dim),
        ROTARY=rotary is not None, enable_fp_fusion=rotary is None, **pdl_args(),
    )  # fmt: skip


def _query_tiles(meta: AttentionMetadata, num_tokens: int, block_q: int) -> tuple:
    """(tile_req, tile_start) int32 [B + T // block_q]: each program's request (-1: spare) and
    first query token within it. Built with device ops (no sync), once per step and tile size."""
    key = ("triton_query_tiles", block_q)
    if key not in meta.memo:
        starts = meta.query_start_loc.long()
        tiles = (starts[1:] - starts[:-1] + block_q - 1) // block_q
        ends = torch.cumsum(tiles, 0)
        ids = torch.arange(meta.num_reqs + num_tokens // block_q, device=starts.device)
        req = torch.searchsorted(ends, ids, right=True)
        clamped = req.clamp(max=meta.num_reqs - 1)
        tile_start = (ids - (ends - tiles)[clamped]) * block_q
        tile_req = torch.where(req < meta.num_reqs, req, -1)
        meta.memo[key] = (tile_req.to(torch.int32), tile_start.to(torch.int32))
    return meta.memo[key]


def triton_paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
    *,
    rotary: tuple[torch.Tensor, torch.Tensor] | None = None,
    tile: tuple[int, int] | None = None,
    splits: int | None = None,
) -> torch.Tensor:
    """Drop-in for `torch_ref.paged_attention`: q [T, Hq, D], k/v [T, Hkv, D] -> [T, Hq, D].
    `rotary` (cos, sin [T, 1, D]): q and k are not rotated yet (see the module docstring; q
    may be rotated in place). `tile` (BLOCK_N keys, warps) and `splits` (programs per
    request and KV head of a decode step) override `_key_tile`'s and `_decode_splits`'
    choices (tests and benchmarks)."""
    decode = meta.max_query_len == 1  # the attention kernel stores k/v (and rotates them)
    if not decode:
        if rotary is not None:
            rotary_(q, *rotary)
        write_kv(k, v, kv_cache, meta.slot_mapping, rotary)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if meta.num_reqs == 0 or q.shape[0] == 0:
        return out
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = kv_cache.shape[3]
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads are not a multiple of {num_kv_heads} KV heads")
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1, got {sliding_window}")
    if q.stride(-1) != 1:
        q = q.contiguous()
    if kv_cache.stride(-1) != 1:
        raise ValueError("kv_cache must be contiguous in the head dimension")
    if decode and kv_cache.stride(1) != kv_cache.shape[2] * kv_cache.stride(2):
        raise ValueError("kv_cache's blocks must be packed (a decode stores k/v at slot rows)")
    group = num_heads // num_kv_heads
    group_pad = triton.next_power_of_2(group)
    head_pad = max(16, triton.next_power_of_2(head_dim))
    # tl.dot wants >= 16 rows; aim for ~64 rows (query tokens x group heads) per program.
    q_tokens = min(triton.next_power_of_2(meta.max_query_len), max(1, 64 // group_pad))
    block_m = max(16, group_pad * q_tokens)
    block_q = block_m // group_pad
    if decode:  # no tile map: program i is request i (the pointers are never read)
        tile_req = tile_start = meta.seq_lens
        grid = (meta.num_reqs, num_kv_heads)
    else:
        tile_req, tile_start = _query_tiles(meta, num_tokens, block_q)
        grid = (tile_req.shape[0], num_kv_heads)
    block_n, warps = tile or _key_tile(q.device, decode, grid[0] * grid[1], head_pad)
    if not decode:
        splits = 1
    elif splits is None:
        splits = _decode_splits(q.device, grid[0] * grid[1])
    counters = part_ml = part_acc = q  # never read without splits
    if splits > 1:
        counters = _split_counters(q.device, grid[0] * grid[1])
        if counters is None:  # not allocated yet, inside a graph capture
            splits, counters = 1, q
        else:  # one pair of buffers per step, shared by the layers (one kernel at a time)
            parts = grid[0] * grid[1] * splits
            key = ("triton_split_parts", parts, block_m, head_pad)
            if key not in meta.memo:
                on = {"dtype": torch.float32, "device": q.device}
                meta.memo[key] = (
                    torch.empty(parts, 2, block_m, **on),
                    torch.empty(parts, block_m, head_pad, **on),
                )
            part_ml, part_acc = meta.memo[key]
    grid = (*grid, splits)
    fused = decode and rotary is not None
    if decode:
        if k.stride(-1) != 1 or v.stride(-1) != 1:
            k, v = k.contiguous(), v.contiguous()
    else:  # never read
        k = v = q
    cos, sin = (contiguous_rows(t, num_tokens, head_dim) for t in rotary) if fused else (q, q)
    block_table = meta.block_tables
    _paged_attention_kernel[grid](
        q, out, kv_cache[0], kv_cache[1],
        block_table, meta.query_start_loc, meta.seq_lens, tile_req, tile_start,
        k, v, meta.slot_mapping, cos, sin, counters, part_ml, part_acc,
        scale * _LOG2E, sliding_window or 0,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3), block_table.stride(0),
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos.stride(0), sin.stride(0),
        GROUP=group, GROUP_PAD=group_pad, BLOCK_Q=block_q, BLOCK_M=block_m,
        BLOCK_N=block_n, HEAD_DIM=head_dim, HEAD_PAD=head_pad,
        BLOCK_SIZE=meta.block_size, HAS_WINDOW=sliding_window is not None, DECODE=decode,
        ROTARY=fused, SPLITS=splits, num_warps=warps, enable_fp_fusion=not fused, **pdl_args(),
    )  # fmt: skip
    return out


triton_paged_attention.fuses_rotary = True  # type: ignore[attr-defined]  # see `rotary`


def _key_tile(device: torch.device, decode: bool, programs: int, head_pad: int) -> tuple:
    """(BLOCK_N, warps): keys per iteration of a program's walk over its context. A decode step
    with fewer programs than the card has SMs (batch 1: one per KV head) is a chain of
    dependent loads per program, so its programs take longer key tiles: 256 keys for head dims
    up to 64 (on an H200, batch 1 and 8, contexts 150 to 8192: 0.8x the time of 128 keys and
    0.45-0.8x that of 64; benchmarks/RESULTS.md 2026-12-01), twice the usual tile above."""
    block_n = 32 if head_pad > 128 else 64
    if decode and device.type == "cuda" and programs < sm_count(device):
        block_n *= 4 if head_pad <= 64 else 2
    return block_n, 4


_MAX_SPLITS = 16


def _decode_splits(device: torch.device, programs: int) -> int:
    """Programs per (request, KV head) of a decode step: with fewer (request, KV head) pairs
    than the card has SMs, each pair's keys are cut into up to SMs / pairs chunks (at most 16,
    whole key tiles each), attended in parallel and merged (see the module docstring). A
    context of one key tile or less stays one program, so short contexts pay nothing."""
    if device.type != "cuda" or programs >= sm_count(device):
        return 1
    return max(1, min(_MAX_SPLITS, sm_count(device) // programs))


_COUNTERS: dict[torch.device, list[torch.Tensor]] = {}


def _split_counters(device: torch.device, pairs: int) -> torch.Tensor | None:
    """int32 zeros, one per (request, KV head) pair, that the split programs count on and the
    merging one sets back to 0; allocated per device outside any CUDA graph capture (a graph
    must not own them) and never freed (a captured graph keeps their address). None: too few,
    and a capture is running (no splitting then)."""
    held = _COUNTERS.setdefault(device, [])
    if not held or held[-1].numel() < pairs:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        held.append(torch.zeros(max(pairs, 4096), dtype=torch.int32, device=device))
    return held[-1]
