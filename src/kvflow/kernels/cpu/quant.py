"""Linear layers on quantized weights (csrc/quant_kernels.c) through ctypes, built and cached like
cpu_kernels.c.

A weight is passed as its parts, in the layout csrc/quant_kernels.c describes: `codes` uint8
[N, K / 2] (4 bits) or [N, K] (8 bits, int8 bit patterns), `scales` and `mins` [N, K / group],
both float32 or both float16; w[n, k] = scales[n, k / group] * code[n, k] + mins[n, k / group].

- `linear`: codes widened to float32 in registers (bf16 or float32 activations, exact weights).
- `linear_int8`: the activations quantized to int8 per 32 columns (bf16), the products on
  AMX-INT8 tiles (only where `amx_available()` and `amx_takes(group)`) or int8 dot products,
  "vnni" (a few rows; AVX512-VNNI's, or AVX2's where the CPU has no AVX-512; only where
  `vnni_available()` and `vnni_takes(bits, group)`).
- `gemm_bf16`: AMX-BF16 tiles on the weight dequantized to bf16 inside the kernel, 32 rows at a
  time (batches; only where `amx_available()`), optionally with silu(gate) * up in its epilogue.
- `dequantize`: the weight as bf16 or float32, for a large batch's matmul.
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

from kvflow.kernels.cpu import build

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).resolve().parent / "csrc" / "quant_kernels.c"


@functools.cache
def library() -> ctypes.CDLL | None:
    """The built library (None without a compiler or with KVFLOW_NATIVE=0); `.amx` says whether
    the AMX kernel may run (the CPU has AMX-INT8 and the OS granted the tile state)."""
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
    # 0: refused, nothing written
    refusing = ("kvflow_q_linear_amx", "kvflow_q_linear_vnni", "kvflow_q_linear_vnni_f32")
    for name in ("kvflow_q_linear", "kvflow_q_linear_f32", *refusing):
        getattr(lib, name).restype = num if name in refusing else None
        getattr(lib, name).argtypes = [ptr] * 4 + [num] * 3 + [ptr] * 2 + [num] * 3
    for name in ("kvflow_q_linear_vnni", "kvflow_q_linear_vnni_f32"):
        getattr(lib, name).argtypes += [num]  # offset
    lib.kvflow_q_gemm_amx.restype = num  # 0: refused, nothing written
    lib.kvflow_q_gemm_amx.argtypes = [ptr] * 4 + [num] * 3 + [ptr] * 2 + [num] * 4
    lib.kvflow_q_dequant.restype = None
    lib.kvflow_q_dequant.argtypes = [ptr] * 3 + [num] * 3 + [ptr] + [num] * 3
    lib.kvflow_q_amx_init.restype = num
    lib.amx = bool(lib.kvflow_q_amx_init())
    lib.kvflow_q_vnni_built.restype = num
    lib.vnni = bool(lib.kvflow_q_vnni_built())
    return lib


def native_available() -> bool:
    """Whether the quantized kernels built and loaded (built now on first call)."""
    return library() is not None


def amx_available() -> bool:
    """Whether `linear_int8` may run on "amx" here."""
    lib = library()
    return lib is not None and lib.amx


def amx_takes(group: int) -> bool:
    """Whether `linear_int8` on "amx" takes weights with groups of `group` columns."""
    return group == 16 or group % 32 == 0


def vnni_available() -> bool:
    """Whether `linear_int8` may run on "vnni" here (the library was built with AVX512-VNNI, or
    with AVX2 and no AVX-512)."""
    lib = library()
    return lib is not None and lib.vnni


def vnni_takes(bits: int, group: int) -> bool:
    """Whether `linear_int8` on "vnni" takes `bits`-bit codes with groups of `group` columns."""
    return group == 32 if bits == 4 else group in (16, 32) or group % 64 == 0


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _half(scales: torch.Tensor) -> int:
    """The kernels' `half` flag: 1 for float16 scales (and mins: `QuantizedWeight` keeps both
    in one dtype), 0 for float32."""
    return int(scales.dtype == torch.float16)


def _run(kernel, x, codes, scales, mins, bits, group, bias, out, *more) -> int:
    """One of the linear kernels on x [M, K] and a weight's parts into out [M, ...]: the argument
    list they share (`more` after it)."""
    shape = (x.shape[0], codes.shape[0], x.shape[1])
    parts = (codes.data_ptr(), scales.data_ptr(), _ptr(mins), _half(scales), bits, group)
    return kernel(x.data_ptr(), *parts, _ptr(bias), out.data_ptr(), *shape, *more)


def linear(
    x: torch.Tensor,
    codes: torch.Tensor,
    scales: torch.Tensor,
    mins: torch.Tensor,
    bits: int,
    group: int,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    """x [M, K] @ w.T (+ bias) -> [M, N], codes widened in registers; x, bias and the result all
    bf16 (float32 sums rounded once) or all float32."""
    lib = library()
    assert lib is not None, "check native_available() first"
    x = x.contiguous()
    out = torch.empty(x.shape[0], codes.shape[0], dtype=x.dtype)
    kernel = lib.kvflow_q_linear_f32 if x.dtype == torch.float32 else lib.kvflow_q_linear
    _run(kernel, x, codes, scales, mins, bits, group, bias, out)
    return out


def linear_int8(
    kernel: str,
    x: torch.Tensor,
    codes: torch.Tensor,
    scales: torch.Tensor,
    mins: torch.Tensor | None,
    bits: int,
    group: int,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype = torch.bfloat16,
    offset: int = 0,
) -> torch.Tensor:
    """x [M, K] @ w.T (+ bias) -> [M, N], bf16 x, x quantized to int8 with a scale per row and
    32 columns, the products on `kernel`: "amx" (AMX-INT8 tiles) or "vnni" (int8 dot products,
    AVX512-VNNI's or AVX2's, for a few rows); the same quantization, so the same error bound.
    The result and bias bf16, or float32 for "vnni" (the sums unrounded: the logits head's).
    `mins` None when every min is zero (it skips their pass). `offset` ("vnni" only): nonzero
    when every min is -offset x its scale (`QuantizedWeight.offset`): the kernel then makes the
    mins' term from the scales, the same sums, and never reads the mins."""
    lib = library()
    assert lib is not None and x.dtype == torch.bfloat16
    if kernel == "amx":
        assert lib.amx and amx_takes(group), "check amx_available() first"
        assert out_dtype == torch.bfloat16, "the AMX-INT8 kernel stores bf16"
        assert offset == 0, "the AMX-INT8 kernel reads the mins"
        run, more = lib.kvflow_q_linear_amx, ()
    else:
        assert lib.vnni and vnni_takes(bits, group), "check vnni_available() first"
        assert bias is None or bias.dtype == out_dtype, "the bias is read in the result's dtype"
        f32 = out_dtype == torch.float32
        run = lib.kvflow_q_linear_vnni_f32 if f32 else lib.kvflow_q_linear_vnni
        more = (offset,)
    x = x.contiguous()
    out = torch.empty(x.shape[0], codes.shape[0], dtype=out_dtype)
    done = _run(run, x, codes, scales, mins, bits, group, bias, out, *more)
    if not done:
        raise RuntimeError(f"{kernel} quantized kernel refused K={x.shape[1]}, group={group}")
    return out


def gemm_bf16(
    x: torch.Tensor,
    codes: torch.Tensor,
    scales: torch.Tensor,
    mins: torch.Tensor,
    bits: int,
    group: int,
    bias: torch.Tensor | None,
    silu: bool = False,
) -> torch.Tensor:
    """x [M, K] @ w.T (+ bias) -> [M, N], all bf16, on AMX-BF16 tiles with the weight dequantized
    (as `dequantize` makes it) 32 rows at a time inside the kernel: for batches. `silu`: w is
    gate | up and the result silu(gate) * up [M, N / 2], rounded as `silu_mul` rounds. Check
    `amx_available()` first."""
    lib = library()
    assert lib is not None and lib.amx and x.dtype == torch.bfloat16
    x = x.contiguous()
    out = torch.empty(x.shape[0], codes.shape[0] // (2 if silu else 1), dtype=x.dtype)
    done = _run(lib.kvflow_q_gemm_amx, x, codes, scales, mins, bits, group, bias, out, int(silu))
    if not done:
        raise RuntimeError(f"bf16 AMX kernel refused K={x.shape[1]}, group={group}")
    return out


def dequantize(
    codes: torch.Tensor,
    scales: torch.Tensor,
    mins: torch.Tensor,
    bits: int,
    group: int,
    in_features: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    """The weight [N, K] as bf16 (rounded to nearest even) or float32 (exact)."""
    lib = library()
    assert lib is not None and dtype in (torch.bfloat16, torch.float32)
    out = torch.empty(codes.shape[0], in_features, dtype=dtype)
    lib.kvflow_q_dequant(
        codes.data_ptr(),
        scales.data_ptr(),
        mins.data_ptr(),
        _half(scales),
        bits,
        group,
        out.data_ptr(),
        int(dtype == torch.float32),
        codes.shape[0],
        in_features,
    )
    return out
