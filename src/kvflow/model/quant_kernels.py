"""Linear layers on quantized weights (`QuantizedWeight`): csrc/quant_kernels.c through ctypes,
built and cached like cpu_kernels.c; torch's paths where the library is not there.

`quant_linear` reads the codes in place for up to `MAX_KERNEL_ROWS` activation rows (a decode
step: bound by reading the weight once, a quarter to a half of the bf16 bytes); a larger batch
(a prompt) dequantizes the weight to bf16 and runs the bf16 matmul, which is compute-bound there
and faster on bf16 matrix units than widening codes row by row.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import shutil
import subprocess
from pathlib import Path

import torch
import torch.nn.functional as F

from kvflow.kernels.cpu import build
from kvflow.model.fp8_linear import Fp8Weight, fp8_linear
from kvflow.model.quant_format import QuantizedWeight

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).resolve().parent.parent / "kernels" / "cpu" / "csrc" / "quant_kernels.c"
MAX_KERNEL_ROWS = 16  # activation rows read by the kernel; more: dequantize, then bf16 matmul


@functools.cache
def _library() -> ctypes.CDLL | None:
    if os.environ.get("KVFLOW_NATIVE", "1") == "0":
        return None
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        return None
    try:
        lib = ctypes.CDLL(str(build._build(compiler, SOURCE)))
    except (OSError, subprocess.CalledProcessError) as e:
        detail = getattr(e, "stderr", "") or str(e)
        logger.warning("quantized CPU kernel unavailable (%s): dequantizing per call", detail)
        return None
    ptr, num = ctypes.c_void_p, ctypes.c_int
    for name in ("kvflow_q_linear", "kvflow_q_linear_f32"):
        getattr(lib, name).restype = None
        getattr(lib, name).argtypes = [ptr] * 4 + [num] * 2 + [ptr] * 2 + [num] * 3
    lib.kvflow_q_linear_amx.restype = num
    lib.kvflow_q_linear_amx_values.restype = num
    lib.kvflow_q_linear_amx_values.argtypes = [ptr] * 4 + [num] * 2 + [ptr] * 2 + [num] * 3
    lib.kvflow_q_linear_amx.argtypes = [ptr] * 4 + [num] * 2 + [ptr] * 2 + [num] * 3
    lib.kvflow_q_dequant.restype = None
    lib.kvflow_q_dequant.argtypes = [ptr] * 3 + [num] * 2 + [ptr] + [num] * 3
    lib.kvflow_q_amx_init.restype = num
    lib.amx = bool(lib.kvflow_q_amx_init())  # tile state granted: the AMX path may run
    return lib


def native_available() -> bool:
    """Whether the quantized kernels built and loaded (built now on first call)."""
    return _library() is not None


def amx_available() -> bool:
    """Whether the AMX small-batch kernel may run (built, the CPU has AMX, the OS granted it)."""
    lib = _library()
    return lib is not None and lib.amx


def amx_applies(weight: QuantizedWeight) -> bool:
    """Whether the AMX kernel takes this weight's layout (groups of 16 or of 32 columns' multiples)."""
    return weight.group == 16 or weight.group % 32 == 0


def kernel_linear(
    x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None, amx: bool = False
) -> torch.Tensor:
    """x [M, K] @ weight.T (+ bias) -> [M, N] by the native kernel, reading the codes in place;
    x, bias and the result all bf16 (float32 sums rounded once) or all float32. `amx`: the AMX
    kernel (bf16 only; check `amx_available()` and `amx_applies` first)."""
    lib = _library()
    assert lib is not None, "check native_available() first"
    x = x.contiguous()
    rows = x.shape[0]
    out = torch.empty(rows, weight.out_features, dtype=x.dtype)
    kernel = lib.kvflow_q_linear_f32 if x.dtype == torch.float32 else lib.kvflow_q_linear
    if amx:
        assert x.dtype == torch.bfloat16 and lib.amx and amx_applies(weight)
        kernel = lib.kvflow_q_linear_amx
        if amx == "values":
            kernel = lib.kvflow_q_linear_amx_values
    done = kernel(
        x.data_ptr(),
        weight.codes.data_ptr(),
        weight.scales.data_ptr(),
        weight.mins.data_ptr(),
        weight.bits,
        weight.group,
        None if bias is None else bias.data_ptr(),
        out.data_ptr(),
        rows,
        weight.out_features,
        weight.in_features,
    )
    if amx and not done:
        raise RuntimeError("the AMX quantized kernel refused its arguments")
    return out


def dequantize(weight: QuantizedWeight, dtype: torch.dtype) -> torch.Tensor:
    """The weight [N, K] in `dtype` (the native kernel for bf16 and float32 where loaded)."""
    lib = _library()
    if lib is None or dtype not in (torch.bfloat16, torch.float32):
        return weight.dequantize(dtype)
    out = torch.empty(weight.out_features, weight.in_features, dtype=dtype)
    lib.kvflow_q_dequant(
        weight.codes.data_ptr(),
        weight.scales.data_ptr(),
        weight.mins.data_ptr(),
        weight.bits,
        weight.group,
        out.data_ptr(),
        int(dtype == torch.float32),
        weight.out_features,
        weight.in_features,
    )
    return out


def quant_linear(
    x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None
) -> torch.Tensor:
    """x [M, K] @ weight.T (+ bias) -> [M, N] in x's dtype (the kernel's for bf16 and float32)."""
    small = x.shape[0] <= MAX_KERNEL_ROWS
    if small and x.dtype in (torch.bfloat16, torch.float32) and native_available():
        return kernel_linear(x, weight, None if bias is None else bias.to(x.dtype))
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
