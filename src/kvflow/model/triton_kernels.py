"""Fused small ops for CUDA, in Triton: what `cpu_kernels` does natively on the CPU.

A decode step of a small model on a GPU is a few hundred kernels, most of them tiny: at batch 1
each costs its launch latency (2-3 us inside a CUDA graph) more than its bytes. Per Llama layer
torch's ops take 2 kernels for add + RMSNorm (twice), 5 for the rotary embedding and 2 for
silu(gate) * up; these take 1 each, which removes 7 of about 18 kernels per layer.

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


@triton.jit
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, eps, dim, stride_x, stride_res, stride_out,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
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
            HAS_RESIDUAL=residual is not None, BLOCK=triton.next_power_of_2(dim),
        )  # fmt: skip
    return out.view(x.shape)


@triton.jit
def _rotary_kernel(
    x_ptr, cos_ptr, sin_ptr, heads, stride_xt, stride_xh, stride_ct, stride_st,
    HALF: tl.constexpr, BLOCK_H: tl.constexpr,
):  # fmt: skip
    token = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    d = tl.arange(0, HALF)
    ok = (h < heads)[:, None]
    base = x_ptr + token * stride_xt + h[:, None] * stride_xh + d[None, :]
    x1 = tl.load(base, mask=ok, other=0.0)
    x2 = tl.load(base + HALF, mask=ok, other=0.0)
    dtype = x1.dtype
    cos1 = tl.load(cos_ptr + token * stride_ct + d).to(tl.float32)[None, :]
    cos2 = tl.load(cos_ptr + token * stride_ct + HALF + d).to(tl.float32)[None, :]
    sin1 = tl.load(sin_ptr + token * stride_st + d).to(tl.float32)[None, :]
    sin2 = tl.load(sin_ptr + token * stride_st + HALF + d).to(tl.float32)[None, :]
    a1, a2 = x1.to(tl.float32), x2.to(tl.float32)
    # out = x * cos + cat(-x2, x1) * sin, each product and the sum rounded to x's dtype
    out1 = (a1 * cos1).to(dtype).to(tl.float32) + (-a2 * sin1).to(dtype).to(tl.float32)
    out2 = (a2 * cos2).to(dtype).to(tl.float32) + (a1 * sin2).to(dtype).to(tl.float32)
    tl.store(base, out1.to(dtype), mask=ok)
    tl.store(base + HALF, out2.to(dtype), mask=ok)


def rotary_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [T, H, D] in place (rows may be strided, heads packed); cos/sin [T, 1, D], rows
    may be strided too (`RotaryEmbedding` gives views of one [T, 2, D] block: no copy)."""
    assert x.stride(2) == 1 and x.stride(1) == x.shape[2], "heads must be packed"
    tokens, heads, dim = x.shape
    cos, sin = _rows(cos, tokens, dim), _rows(sin, tokens, dim)
    if tokens:
        block_h = min(triton.next_power_of_2(heads), 16)
        # No fused multiply-add: it would skip the rounding of each product (sm_90 turns
        # them into bf16 FMAs), and 23 % of outputs would differ from torch's.
        _rotary_kernel[(tokens, triton.cdiv(heads, block_h))](
            x, cos, sin, heads, x.stride(0), x.stride(1), cos.stride(0), sin.stride(0),
            HALF=dim // 2, BLOCK_H=block_h, enable_fp_fusion=False,
        )  # fmt: skip
    return x


def _rows(t: torch.Tensor, tokens: int, dim: int) -> torch.Tensor:
    """t as [tokens, dim] with contiguous rows (a view where it can be)."""
    t = t.reshape(tokens, dim)
    return t if t.stride(1) == 1 else t.contiguous()


@triton.jit
def _silu_mul_kernel(gate_up_ptr, out_ptr, inner, stride_in, stride_out, BLOCK: tl.constexpr):
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
        _silu_mul_kernel[grid](gate_up, out, inner, gate_up.stride(0), out.stride(0), BLOCK=block)
    return out
