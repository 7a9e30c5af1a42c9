"""Fused small ops for CUDA, in Triton: what `kernels.cpu.ops` does natively on the CPU.

A decode step of a small model on a GPU is a few hundred kernels, most of them tiny: at batch 1
each costs its launch latency more than its bytes. Per Llama layer torch's ops take 2 kernels
for add + RMSNorm (twice), 5 for the rotary embedding and 2 for silu(gate) * up; these take 1
each.

Each rounds where transformers' eager code rounds (to the activations' dtype after each op),
so a bfloat16 model gives the tokens it gave through torch's ops:

    rms_norm   s = x + residual (rounded); s * rsqrt(mean(s^2) + eps) in float32, rounded, times
               the weight, rounded; s is stored back into `residual`
    rotary_    x * cos and rotate_half(x) * sin each rounded, their sum rounded, in place
    silu_mul   silu(gate) rounded, times up, rounded

Imported only for CUDA tensors (triton is absent from CPU installs); tests run them under
Triton's interpreter on the CPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvflow.kernels.triton.pdl import pdl_args, pdl_start


@triton.jit
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, eps, dim, stride_x, stride_res, stride_out,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False,
):  # fmt: skip
    pdl_start(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < dim
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0)
    if HAS_RESIDUAL:
        x = x.to(tl.float32) + tl.load(res_ptr + row * stride_res + cols, mask=ok, other=0.0)
        x = x.to(out_ptr.dtype.element_ty)
        tl.store(res_ptr + row * stride_res + cols, x, mask=ok)
    s = x.to(tl.float32)
    inv = tl.math.rsqrt(tl.sum(s * s, axis=0) / dim + eps)
    normed = (s * inv).to(out_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, (normed * w).to(out_ptr.dtype.element_ty), mask=ok)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor:
    """RMSNorm over the last dim of x [..., D]; with `residual` (x's shape, rows contiguous),
    normalises x + residual and stores that sum into `residual`."""
    dim = x.shape[-1]
    x2 = x.reshape(-1, dim)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    res = x2 if residual is None else residual.view(-1, dim)
    if x2.shape[0]:
        _rms_norm_kernel[(x2.shape[0],)](
            x2, res, weight, out, eps, dim, x2.stride(0), res.stride(0), out.stride(0),
            HAS_RESIDUAL=residual is not None, BLOCK=triton.next_power_of_2(dim), **pdl_args(),
        )  # fmt: skip
    return out.view(x.shape)


@triton.jit
def swapped_halves(dims, HEAD_DIM: tl.constexpr):
    """The dim each dim's rotate_half partner sits at: d + D/2 below D/2, d - D/2 above."""
    return tl.where(dims < HEAD_DIM // 2, dims + HEAD_DIM // 2, dims - HEAD_DIM // 2)


@triton.jit
def rotate(x, x_swapped, cos, sin, dims, HEAD_DIM: tl.constexpr):
    """x * cos + rotate_half(x) * sin, each product and the sum rounded to x's dtype, as
    transformers' eager ops round (x_swapped: x at `swapped_halves`; cos, sin float32). The
    kernel must be compiled without fused multiply-adds (`enable_fp_fusion=False`)."""
    dtype = x.dtype
    partner = x_swapped.to(tl.float32)
    partner = tl.where(dims < HEAD_DIM // 2, -partner, partner)
    a = (x.to(tl.float32) * cos).to(dtype).to(tl.float32)
    return (a + (partner * sin).to(dtype).to(tl.float32)).to(dtype)


@triton.jit
def _rotary_kernel(
    x_ptr, cos_ptr, sin_ptr, heads, stride_xt, stride_xh, stride_ct, stride_st,
    HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr, BLOCK_H: tl.constexpr,
    PDL: tl.constexpr = False,
):  # fmt: skip
    pdl_start(PDL)
    token = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    d = tl.arange(0, HEAD_PAD)
    d_ok = d < HEAD_DIM
    ok = (h < heads)[:, None] & d_ok[None, :]
    rows = x_ptr + token * stride_xt + h[:, None] * stride_xh
    x = tl.load(rows + d[None, :], mask=ok, other=0.0)
    x_swapped = tl.load(rows + swapped_halves(d, HEAD_DIM)[None, :], mask=ok, other=0.0)
    cos = tl.load(cos_ptr + token * stride_ct + d, mask=d_ok, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + token * stride_st + d, mask=d_ok, other=0.0).to(tl.float32)
    out = rotate(x, x_swapped, cos[None, :], sin[None, :], d[None, :], HEAD_DIM)
    tl.store(rows + d[None, :], out, mask=ok)


def rotary_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [T, H, D] in place (rows may be strided, heads packed); cos/sin [T, 1, D], rows
    may be strided too (`RotaryEmbedding` gives views of one [T, 2, D] block: no copy)."""
    assert x.stride(2) == 1 and x.stride(1) == x.shape[2], "heads must be packed"
    tokens, heads, dim = x.shape
    cos, sin = contiguous_rows(cos, tokens, dim), contiguous_rows(sin, tokens, dim)
    if tokens:
        block_h = min(triton.next_power_of_2(heads), 16)
        # No fused multiply-add: it would skip the rounding of each product (sm_90 turns
        # them into bf16 FMAs), and 23 % of outputs would differ from torch's.
        _rotary_kernel[(tokens, triton.cdiv(heads, block_h))](
            x, cos, sin, heads, x.stride(0), x.stride(1), cos.stride(0), sin.stride(0),
            HEAD_DIM=dim, HEAD_PAD=triton.next_power_of_2(dim), BLOCK_H=block_h,
            enable_fp_fusion=False, **pdl_args(),
        )  # fmt: skip
    return x


def contiguous_rows(t: torch.Tensor, tokens: int, dim: int) -> torch.Tensor:
    """t as [tokens, dim] with contiguous rows (a view where it can be)."""
    t = t.reshape(tokens, dim)
    return t if t.stride(1) == 1 else t.contiguous()


@triton.jit
def _silu_mul_kernel(
    gate_up_ptr, out_ptr, inner, stride_in, stride_out, BLOCK: tl.constexpr,
    PDL: tl.constexpr = False,
):  # fmt: skip
    pdl_start(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < inner
    gate = tl.load(gate_up_ptr + row * stride_in + cols, mask=ok, other=0.0)
    up = tl.load(gate_up_ptr + row * stride_in + inner + cols, mask=ok, other=0.0)
    dtype = gate.dtype
    # torch's float32 steps, each rounded as IEEE float32 rounds: exp, 1 + e, the division.
    # On NVIDIA a float32 tl.exp is ex2.approx of a rounded argument and `/` is div.full (up
    # to ~14 ulps off), so exp and the division go through float64 and are rounded back; exp
    # still overflows to inf where float32's does (silu(-100) = -0, as torch gives).
    g = gate.to(tl.float32)
    e = tl.exp(-g.to(tl.float64)).to(tl.float32)
    act = (g.to(tl.float64) / (1.0 + e).to(tl.float64)).to(tl.float32)
    act = act.to(dtype).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, (act * up.to(tl.float32)).to(dtype), mask=ok)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up [T, 2I] (gate | up) -> [T, I]."""
    if gate_up.stride(-1) != 1:
        gate_up = gate_up.contiguous()
    tokens, width = gate_up.shape
    inner = width // 2
    out = torch.empty(tokens, inner, dtype=gate_up.dtype, device=gate_up.device)
    if tokens:
        block = min(triton.next_power_of_2(inner), 1024)
        grid = (tokens, triton.cdiv(inner, block))
        _silu_mul_kernel[grid](
            gate_up, out, inner, gate_up.stride(0), out.stride(0), BLOCK=block, **pdl_args()
        )
    return out
