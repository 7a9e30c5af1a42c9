"""The Triton kernel behind `fp8_linear.fp8_weight_linear`: y = x @ (codes * scales).T + bias.

The weight's float8_e4m3fn bytes are decoded with integer operations (sign, 4-bit exponent,
3-bit mantissa -> float32 bits), which every card and Triton's interpreter run alike; the
per-channel scale multiplies the float32 sums once, in the epilogue.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _decode_e4m3(b):
    """float32 values of float8_e4m3fn bit patterns b (int32 in 0..255; no NaN codes)."""
    sign = (b >> 7) & 1
    exp = (b >> 3) & 15
    man = b & 7
    normal = (((exp + 120) << 23) | (man << 20)).to(tl.float32, bitcast=True)
    magnitude = tl.where(exp == 0, man.to(tl.float32) * 0.001953125, normal)  # 2^-9 subnormals
    return tl.where(sign == 1, -magnitude, magnitude)


@triton.jit
def _fp8_linear_kernel(
    x_ptr, w_ptr, s_ptr, b_ptr, y_ptr, M, N, K,
    HAS_BIAS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
):  # fmt: skip
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        rk = k0 + tl.arange(0, BK)
        xm = (rm[:, None] < M) & (rk[None, :] < K)
        x = tl.load(x_ptr + rm[:, None] * K + rk[None, :], mask=xm, other=0.0)
        wm = (rn[:, None] < N) & (rk[None, :] < K)
        bits = tl.load(w_ptr + rn[:, None] * K + rk[None, :], mask=wm, other=0).to(tl.int32)
        w = _decode_e4m3(bits).to(x.dtype)  # exact: e4m3 values fit bf16 and float16
        acc += tl.dot(x, tl.trans(w))
    acc *= tl.load(s_ptr + rn, mask=rn < N, other=0.0)[None, :]
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    ym = (rm[:, None] < M) & (rn[None, :] < N)
    tl.store(y_ptr + rm[:, None] * N + rn[None, :], acc.to(y_ptr.dtype.element_ty), mask=ym)


def fp8_weight_linear(
    x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """x [M, K] @ (codes [N, K] float8_e4m3fn * scales [N]).T (+ bias [N]) -> [M, N], x's dtype."""
    x = x.contiguous()
    rows, inner = x.shape
    out_features = codes.shape[0]
    out = torch.empty(rows, out_features, dtype=x.dtype, device=x.device)
    bm = 16 if rows <= 16 else 64
    grid = (triton.cdiv(rows, bm), triton.cdiv(out_features, 64))
    _fp8_linear_kernel[grid](
        x, codes.view(torch.uint8), scales, x if bias is None else bias, out,
        rows, out_features, inner,
        HAS_BIAS=bias is not None, BM=bm, BN=64, BK=64,
    )  # fmt: skip
    return out
