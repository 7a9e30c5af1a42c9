"""Which kernel runs a layer's quantized weight (`QuantizedWeight`, `Fp8Weight`), and the
quantized embedding lookup. The CPU kernels themselves are kvflow.kernels.cpu.quant.

For bf16 activations on a CPU with AMX: 8-bit codes at any batch up to `MAX_AMX_ROWS`, 4-bit
codes from two rows, take the AMX-INT8 kernel (activations quantized to int8 per 32 columns);
one row of 4-bit codes takes the float32 kernel (codes widened in registers, faster there);
without AMX, the float32 kernel takes up to `MAX_KERNEL_ROWS` rows (its cost grows with each
row). Larger batches (prompts) dequantize the weight to bf16 and run the bf16 matmul, which is
faster there (benchmarks/quant_matmul.py; RESULTS.md).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvflow.kernels.cpu import quant
from kvflow.model.fp8_linear import Fp8Weight, fp8_linear
from kvflow.model.quant_format import QuantizedWeight

MAX_KERNEL_ROWS = 16  # rows the float32 kernel takes without AMX
MAX_AMX_ROWS = 64  # rows the AMX kernel takes; more: dequantize, then bf16 matmul


def native_available() -> bool:
    """Whether the quantized kernels built and loaded (built now on first call)."""
    return quant.native_available()


def uses_amx(rows: int, weight: QuantizedWeight, dtype: torch.dtype) -> bool:
    """Whether `rows` activation rows of `dtype` take the AMX kernel for `weight`."""
    if dtype != torch.bfloat16 or rows > MAX_AMX_ROWS or (weight.bits == 4 and rows == 1):
        return False
    return quant.amx_available() and quant.amx_takes(weight.group)


def kernel_linear(
    x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None, amx: bool = False
) -> torch.Tensor:
    """x [M, K] @ weight.T (+ bias) -> [M, N] by a native kernel reading the codes in place: the
    float32 one (x, bias and the result all bf16 or all float32) or, `amx`, the AMX-INT8 one
    (bf16; check `uses_amx` first)."""
    parts = (weight.codes, weight.scales)
    if amx:
        mins = weight.mins if weight.has_mins else None
        return quant.linear_amx(x, *parts, mins, weight.bits, weight.group, bias)
    return quant.linear(x, *parts, weight.mins, weight.bits, weight.group, bias)


def dequantize(weight: QuantizedWeight, dtype: torch.dtype) -> torch.Tensor:
    """The weight [N, K] in `dtype` (the native kernel for bf16 and float32 where loaded)."""
    if not quant.native_available() or dtype not in (torch.bfloat16, torch.float32):
        return weight.dequantize(dtype)
    parts = (weight.codes, weight.scales, weight.mins, weight.bits, weight.group)
    return quant.dequantize(*parts, weight.in_features, dtype)


def quant_linear(
    x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None
) -> torch.Tensor:
    """x [M, K] @ weight.T (+ bias) -> [M, N] in x's dtype (see the module's routing)."""
    rows = x.shape[0]
    bias = None if bias is None else bias.to(x.dtype)
    if uses_amx(rows, weight, x.dtype):
        return kernel_linear(x, weight, bias, amx=True)
    small = rows <= MAX_KERNEL_ROWS
    if small and x.dtype in (torch.bfloat16, torch.float32) and native_available():
        return kernel_linear(x, weight, bias)
    return F.linear(x, dequantize(weight, x.dtype), bias)


Quantized = QuantizedWeight | Fp8Weight  # what a layer's `quant` holds


def apply(x: torch.Tensor, weight: Quantized, bias: torch.Tensor | None) -> torch.Tensor:
    """x [M, K] @ weight.T (+ bias) for either kind of quantized weight."""
    if isinstance(weight, Fp8Weight):
        return fp8_linear(x, weight, bias)
    return quant_linear(x, weight, bias)


def embedding(ids: torch.Tensor, weight: Quantized, dtype: torch.dtype) -> torch.Tensor:
    """Rows `ids` of a quantized embedding table, dequantized to `dtype`."""
    if isinstance(weight, Fp8Weight):
        rows = Fp8Weight(weight.codes[ids], weight.scales[ids])
    else:
        rows = weight.rows(ids.reshape(-1))
    return rows.dequantize(dtype).reshape(*ids.shape, -1)
