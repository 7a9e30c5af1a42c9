"""FP8 weights (`--quantization fp8`): per-channel e4m3 codes, the Triton weight-decoding kernel
under Triton's interpreter without a GPU, and the matrix-unit path (torch._scaled_mm, which
torch also runs on the CPU) against float64 matmuls of the values they hold."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported

pytest.importorskip("triton")

from kvflow.model.fp8_linear import FP8_MAX, quantize_fp8, scaled_mm  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

if os.environ.get("TRITON_INTERPRET") == "1":
    from support.triton_interpreter import patch_interpreter  # float32 -> bf16 rounds as on a GPU

    patch_interpreter()


def test_per_channel_codes() -> None:
    """Each row's largest |w| is the largest code; e4m3's 3 mantissa bits: every value within
    2^-4 of itself (relative), or within half the smallest subnormal step of the row's scale."""
    torch.manual_seed(0)
    w = torch.randn(33, 64) * torch.linspace(0.01, 4.0, 33)[:, None]
    q = quantize_fp8(w)
    assert torch.equal(q.codes.float().abs().amax(dim=1), torch.full((33,), FP8_MAX))
    err = (q.dequantize(torch.float64) - w.double()).abs()
    assert (err <= 2.0**-4 * w.double().abs() + 2.0**-10 * q.scales.double()[:, None]).all()


@pytest.mark.parametrize("rows, cols, batch", [(64, 64, 1), (70, 96, 3), (130, 64, 17)])
def test_triton_kernel_decodes_every_code(rows: int, cols: int, batch: int) -> None:
    """The kernel's bit decoding against torch's float8 conversion, over weights that hold every
    finite e4m3 code; bf16 products are exact, sums in float32, one bf16 rounding of the output:
    within 2^-8 relative plus the float32 summation bound."""
    from kvflow.model.fp8_linear import fp8_weight_linear

    torch.manual_seed(rows)
    codes = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn)
    finite = codes[codes.float().isfinite()]
    pick = torch.randint(0, finite.numel(), (rows, cols))
    q = quantize_fp8(torch.ones(rows, cols))
    q.codes = finite[pick].contiguous()
    q.scales = torch.rand(rows) + 0.5
    x = torch.randn(batch, cols).bfloat16()
    bias = torch.randn(rows).bfloat16()
    w64 = q.dequantize(torch.float64)
    y64 = x.double() @ w64.T + bias.double()
    q.codes, q.scales = q.codes.to(DEVICE), q.scales.to(DEVICE)
    y = fp8_weight_linear(x.to(DEVICE), q, bias.to(DEVICE)).cpu().double()
    bound = 2.0**-8 * y64.abs() + (cols + 2) * 2.0**-24 * (x.double().abs() @ w64.abs().T)
    assert ((y - y64).abs() <= bound + 1e-3).all()  # 1e-3: the bias' addition in float32


def test_scaled_mm_rounds_activations_per_row() -> None:
    """The matrix-unit path quantizes each activation row to e4m3 (2^-4 relative per value):
    within that of the float64 product."""
    torch.manual_seed(2)
    w = torch.randn(48, 64)
    q = quantize_fp8(w)
    x = torch.randn(4, 64).bfloat16()
    y = scaled_mm(x, q, None).double()
    w64 = q.dequantize(torch.float64)
    y64 = x.double() @ w64.T
    bound = 2.0**-4 * (x.double().abs() @ w64.abs().T) + 2.0**-8 * y64.abs()
    assert ((y - y64).abs() <= bound).all()
