"""Which kernel runs a layer's quantized weight (`QuantizedWeight`, `Fp8Weight`), and the
quantized embedding lookup. The CPU kernels themselves are kvflow.kernels.cpu.quant.

For bf16 activations (`route`): a few rows (decode) take the int8 dot-product kernel ("vnni":
AVX512-VNNI's, or AVX2's on a CPU without AVX-512), up to `VNNI_ROWS[bits]` where AMX is beside
it and up to `VNNI_ALONE_ROWS` (short prompts too) where it is not; more rows, up to
`AMX_ROWS[bits]`, take the AMX-INT8 kernel (both quantize the activations to int8 per 32
columns); more, up to `MAX_GEMM_ROWS`, AMX's bf16 tiles on the weight dequantized inside the
kernel ("gemm", which also makes an MLP's silu(gate) * up in its epilogue: `gated_linear`).
Without AMX or int8 dot products, the float32 kernel (codes widened in registers) takes up to
`MAX_KERNEL_ROWS` rows, as it does for float32 activations. Larger batches (long prompts) dequantize the weight to bf16
and run oneDNN's matmul, which is faster there; to float32 where torch's bf16 matmul is the
slower (`tuning.bf16_matmul_pays`: CPUs without AVX512-BF16 or AMX). The limits are measured
(benchmarks/quant_matmul.py; RESULTS.md).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from kvflow.kernels import tuning
from kvflow.kernels.cpu import quant
from kvflow.model.fp8_linear import Fp8Weight, fp8_linear
from kvflow.model.quant_format import QuantizedWeight

MAX_KERNEL_ROWS = 16  # rows the float32 kernel takes
# rows the VNNI kernel takes without AMX: it beats the dequantized weight's float32 matmul up to
# 256 rows of every block type, 1.4-10x, and loses from 512 (AVX2, benchmarks/RESULTS.md)
VNNI_ALONE_ROWS = 256
AMX_ROWS = {4: 16, 8: 64}  # rows the AMX-INT8 kernel takes, by code bits; more: "gemm"
MAX_GEMM_ROWS = 1024  # rows the AMX-BF16 kernel takes; more: dequantize, then oneDNN's matmul
VNNI_ROWS = {4: 4, 8: 1}  # rows the VNNI kernel takes beside AMX, by code bits


def native_available() -> bool:
    """Whether the quantized kernels built and loaded (built now on first call)."""
    return quant.native_available()


def route(rows: int, weight: QuantizedWeight, dtype: torch.dtype) -> str:
    """The kernel `rows` activation rows of `dtype` take against `weight`: "vnni", "amx",
    "gemm", "float" or "dequant" (see the module's doc)."""
    beyond = max(VNNI_ALONE_ROWS, MAX_GEMM_ROWS) + 1  # every count above the limits routes alike
    return _route(min(rows, beyond), weight.bits, weight.group, dtype)


@functools.cache  # every projection of a step asks; rows clamped, so a few hundred keys at most
def _route(rows: int, bits: int, group: int, dtype: torch.dtype) -> str:
    if not native_available() or dtype not in (torch.bfloat16, torch.float32):
        return "dequant"
    amx = dtype == torch.bfloat16 and quant.amx_available() and quant.amx_takes(group)
    if dtype == torch.bfloat16 and quant.vnni_available() and quant.vnni_takes(bits, group):
        if rows <= (VNNI_ROWS[bits] if amx else VNNI_ALONE_ROWS):
            return "vnni"
    if amx and rows <= AMX_ROWS[bits]:
        return "amx"
    if amx and rows <= MAX_GEMM_ROWS:
        return "gemm"
    return "float" if rows <= MAX_KERNEL_ROWS else "dequant"


def kernel_linear(
    x: torch.Tensor,
    weight: QuantizedWeight,
    bias: torch.Tensor | None,
    kernel: str = "float",
    silu: bool = False,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """x [M, K] @ weight.T (+ bias) -> [M, N] by a native kernel reading the codes in place:
    "float" (x, bias and the result all bf16 or all float32), "amx", "gemm" or "vnni" (bf16;
    check `route` first). `silu` ("gemm" only): weight is gate | up, the result silu(gate) * up.
    `out_dtype` float32 ("vnni" only): the sums unrounded, bias float32."""
    parts = (weight.codes, weight.scales)
    if kernel == "float":
        return quant.linear(x, *parts, weight.mins, weight.bits, weight.group, bias)
    if kernel == "gemm":
        return quant.gemm_bf16(x, *parts, weight.mins, weight.bits, weight.group, bias, silu)
    mins = weight.mins if weight.has_mins else None
    out_dtype = out_dtype or x.dtype
    offset = weight.offset if kernel == "vnni" else 0
    return quant.linear_int8(
        kernel, x, *parts, mins, weight.bits, weight.group, bias, out_dtype, offset
    )


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
    bias = None if bias is None else bias.to(x.dtype)
    kernel = route(x.shape[0], weight, x.dtype)
    if kernel == "dequant":
        if x.dtype == torch.bfloat16 and not tuning.bf16_matmul_pays():
            wide = None if bias is None else bias.float()
            return F.linear(x.float(), dequantize(weight, torch.float32), wide).to(x.dtype)
        return F.linear(x, dequantize(weight, x.dtype), bias)
    return kernel_linear(x, weight, bias, kernel)


Quantized = QuantizedWeight | Fp8Weight  # what a layer's `quant` holds


def apply(x: torch.Tensor, weight: Quantized, bias: torch.Tensor | None) -> torch.Tensor:
    """x [M, K] @ weight.T (+ bias) for either kind of quantized weight."""
    if isinstance(weight, Fp8Weight):
        return fp8_linear(x, weight, bias)
    return quant_linear(x, weight, bias)


def logits(x: torch.Tensor, weight: Quantized) -> torch.Tensor:
    """Logits of hidden rows x [N, hidden] by a quantized head: float32 on the CPU. bf16 rows
    that take the int8 kernel ("vnni") keep it, its float32 sums stored unrounded: the head is
    the largest weight a decode step reads (a 1B model's 128k x 2048 table in Q8_0: 279 MB of
    830), and the float32 kernel reads it at under half that kernel's bandwidth on AVX2. Other
    rows take the float32 activations' kernel (codes widened in registers, or the weight
    dequantized to float32 for many rows); fp8 (CUDA) its own, in x's dtype."""
    if not isinstance(weight, QuantizedWeight):
        return fp8_linear(x, weight, None)
    if route(x.shape[0], weight, x.dtype) == "vnni":
        return kernel_linear(x, weight, None, "vnni", out_dtype=torch.float32)
    return quant_linear(x.float(), weight, None)


def gated_linear(
    x: torch.Tensor, weight: Quantized, bias: torch.Tensor | None
) -> torch.Tensor | None:
    """silu(gate) * up of x @ weight.T (+ bias), weight = gate | up, made in the "gemm" kernel's
    epilogue where x's rows take that kernel (rounded as `silu_mul` rounds); None elsewhere."""
    if not isinstance(weight, QuantizedWeight) or route(x.shape[0], weight, x.dtype) != "gemm":
        return None
    bias = None if bias is None else bias.to(x.dtype)
    return kernel_linear(x, weight, bias, "gemm", silu=True)


def embedding(ids: torch.Tensor, weight: Quantized, dtype: torch.dtype) -> torch.Tensor:
    """Rows `ids` of a quantized embedding table, dequantized to `dtype` (by the native
    kernel where it runs, as the prompt steps' weights are: `dequantize`)."""
    if isinstance(weight, Fp8Weight):
        rows = Fp8Weight(weight.codes[ids], weight.scales[ids]).dequantize(dtype)
    else:
        rows = dequantize(weight.rows(ids.reshape(-1)), dtype)
    return rows.reshape(*ids.shape, -1)
