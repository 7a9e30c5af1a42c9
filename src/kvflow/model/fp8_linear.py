"""FP8 weights on CUDA (`--quantization fp8`): float8_e4m3fn codes with one float32 scale per
output channel, made at load time from the bf16/float32 checkpoint (max |w| of a row -> 448).

Two ways to multiply, both reading one byte per weight:
- `scaled_mm` (the card's FP8 matrix units, sm_89+): each activation row is quantized to FP8 with
  its own scale, then torch._scaled_mm with row-wise scales gives bf16.
- `fp8_weight_linear`, a Triton kernel that decodes the weight's FP8 bits in registers (exact
  in bf16) and multiplies bf16 activations on the bf16 matrix units (no activation rounding;
  any card, and Triton's interpreter on the CPU, where the tests run it).
`fp8_linear` takes the matrix units where the card has them, else the Triton kernel.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

FP8_MAX = 448.0  # largest finite float8_e4m3fn


@dataclass
class Fp8Weight:
    codes: torch.Tensor  # float8_e4m3fn [N, K]
    scales: torch.Tensor  # float32 [N]
    kind: str = "fp8"

    @property
    def out_features(self) -> int:
        return self.codes.shape[0]

    @property
    def in_features(self) -> int:
        return self.codes.shape[1]

    @property
    def nbytes(self) -> int:
        return self.codes.numel() + self.scales.numel() * 4

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return (self.codes.double() * self.scales.double()[:, None]).to(dtype)


def quantize_fp8(weight: torch.Tensor, row_max: torch.Tensor | None = None) -> Fp8Weight:
    """Per-output-channel FP8 (e4m3fn, round to nearest) of a weight [N, K]. `row_max` [N]:
    each row's max |w| when `weight` holds only some of the row's columns (a row-parallel
    shard), so that the codes and scales are those of the whole weight."""
    w = weight.detach().float()
    scale = (w.abs().amax(dim=1) if row_max is None else row_max.float()) / FP8_MAX
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = (w / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return Fp8Weight(codes.contiguous(), scale.contiguous())


def scaled_mm(x: torch.Tensor, weight: Fp8Weight, bias: torch.Tensor | None) -> torch.Tensor:
    """x [M, K] @ w.T through torch._scaled_mm, activations quantized per row -> [M, N] in x's
    dtype (bf16 or float16)."""
    xf = x.float()
    x_scale = (xf.abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp_min(1e-12)
    x8 = (xf / x_scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    out = torch._scaled_mm(
        x8,
        weight.codes.t(),
        scale_a=x_scale,
        scale_b=weight.scales[None, :],
        out_dtype=x.dtype,
    )
    return out if bias is None else out + bias


@functools.cache
def _has_fp8_units(device: torch.device) -> bool:
    return torch.cuda.get_device_capability(device) >= (8, 9)


def fp8_linear(x: torch.Tensor, weight: Fp8Weight, bias: torch.Tensor | None) -> torch.Tensor:
    """x [M, K] @ weight.T (+ bias) -> [M, N] in x's dtype, on x's device."""
    x = x.contiguous()
    if x.is_cuda and _has_fp8_units(x.device) and x.shape[1] % 16 == 0:
        return scaled_mm(x, weight, bias)
    if x.is_cuda:
        return fp8_weight_linear(x, weight, bias)
    return torch.nn.functional.linear(x, weight.dequantize(x.dtype), bias)


def fp8_weight_linear(
    x: torch.Tensor, weight: Fp8Weight, bias: torch.Tensor | None
) -> torch.Tensor:
    """x [M, K] (bf16) @ weight.T (+ bias) -> [M, N] bf16 by the Triton kernel, float32 sums."""
    from kvflow.model import fp8_triton  # triton is only installed with CUDA

    return fp8_triton.fp8_weight_linear(x, weight.codes, weight.scales, bias)
