"""A step's K/V stored at their cache slots in one kernel (both k and v, optionally rotating k),
read where the fused qkv projection leaves them. Decode steps store theirs inside the decode
attention kernel instead."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvflow.kernels.triton.ops import contiguous_rows, rotate, swapped_halves
from kvflow.kernels.triton.pdl import pdl_args, pdl_start


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
    """The reference's `write_kv_cache` in one kernel: k/v [T, Hkv, D] (rows may be strided, as the
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
