"""Native CPU kernels (csrc/cpu_kernels.c), compiled on first use with the machine's C compiler
and loaded with ctypes.

A decode step of a small model on a CPU is bound by reading memory once: the weights, then each
request's K/V. torch's paths read more than that: oneDNN's bf16 matmul reaches a fraction of the
memory bandwidth at 1-8 rows, and the reference attention gathers every request's blocks into a
padded copy before attending (see benchmarks/RESULTS.md). Two kernels read each byte once:
`bf16_linear` (linear layers up to the rows where oneDNN catches up) and `paged_attention`
(every step: prompts, chunks and decode tokens, K/V read where they lie in the paged cache).

The library is built with `-march=native` for the CPU it runs on, so the cache key holds the
source, the compiler command and the CPU's identity; builds are atomic (compile to a temporary
name, rename), so concurrent processes never load a half-written file. Without a compiler, or
with KVFLOW_NATIVE=0, `native_available()` is False and callers keep torch's paths.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from kvflow.attention.metadata import AttentionMetadata

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).resolve().parent.parent / "csrc" / "cpu_kernels.c"
FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC"]
if platform.machine().lower() in ("x86_64", "amd64"):
    # GCC otherwise splits 512-bit vector code in 256-bit halves: decode steps ran 1.8x slower
    FLAGS.append("-mprefer-vector-width=512")


def _cpu_identity() -> str:
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor()
    lines = [ln for ln in info.splitlines() if ln.startswith(("model name", "flags"))]
    return "\n".join(sorted(set(lines)))


def _build(compiler: str, path: Path = SOURCE) -> Path:
    """The shared library of the C file `path` (built now unless cached) -> its path."""
    from kvflow.model.loader import cache_root, scratch  # the model package imports this module

    source = path.read_bytes()
    key = hashlib.sha256(
        b"\0".join([source, " ".join([compiler, *FLAGS]).encode(), _cpu_identity().encode()])
    ).hexdigest()[:16]
    target = cache_root() / "kernels" / f"{path.stem}-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, suffix=".so.tmp")
    os.close(fd)
    with scratch(Path(tmp)):
        subprocess.run(
            [compiler, *FLAGS, "-o", tmp, str(path)], check=True, capture_output=True, text=True
        )
        os.replace(tmp, target)
    return target


@functools.cache
def _library() -> ctypes.CDLL | None:
    if os.environ.get("KVFLOW_NATIVE", "1") == "0":
        return None
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        logger.info("no C compiler found: CPU linear layers use torch's matmul")
        return None
    try:
        # torch's OpenMP runtime is loaded already, so the library shares its thread pool.
        lib = ctypes.CDLL(str(_build(compiler)))
    except (OSError, subprocess.CalledProcessError) as e:
        detail = getattr(e, "stderr", "") or str(e)
        logger.warning("native CPU kernel unavailable (%s): using torch's matmul", detail.strip())
        return None
    lib.kvflow_bf16_linear.restype = None
    lib.kvflow_bf16_linear.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int] * 3
    lib.kvflow_paged_attention.restype = None
    ptr, num = ctypes.c_void_p, ctypes.c_int
    lib.kvflow_paged_attention.argtypes = [ptr, num, ptr, ptr, num, ptr, ptr, ptr, ptr, num]
    lib.kvflow_paged_attention.argtypes += [ptr, ptr] + [num] * 6 + [ctypes.c_float, num, ptr]
    for name, args in {
        "kvflow_rms_norm": [ptr, ptr, ptr, ctypes.c_float, ptr, num, num],
        "kvflow_rotary": [ptr, num, num, num, num, ptr, num, ptr, num],
        "kvflow_silu_mul": [ptr, ptr, num, num],
    }.items():
        getattr(lib, name).restype = None
        getattr(lib, name).argtypes = args
    lib.kvflow_amx_init.restype = ctypes.c_int
    lib.kvflow_amx_init()  # tile instructions for the linear kernel, where the CPU has them
    return lib


def native_available() -> bool:
    """Whether the native kernels built and loaded (built now on first call)."""
    return _library() is not None


COLUMN_TILE = 32  # NB in csrc/cpu_kernels.c


def pack_linear_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """The native kernel's layout of a bf16 CPU weight [N, K] (see csrc/cpu_kernels.c):
    [ceil(N / 32), K / 2, 32, 2], output columns zero-padded to a multiple of 32. None where the
    kernel does not apply (another dtype or device, odd K, or no native library)."""
    out_features, in_features = weight.shape
    if weight.dtype != torch.bfloat16 or weight.device.type != "cpu" or in_features % 2:
        return None
    if not native_available():
        return None
    tiles = -(-out_features // COLUMN_TILE)
    padded = weight.new_zeros(tiles * COLUMN_TILE, in_features)
    padded[:out_features] = weight
    packed = padded.view(tiles, COLUMN_TILE, in_features // 2, 2).transpose(1, 2)
    return packed.contiguous()


def bf16_linear(
    x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int
) -> torch.Tensor:
    """x [M, K] @ weight.T (+ bias) -> [M, out_features], all bf16 on the CPU, through the weight
    packed by `pack_linear_weight`."""
    lib = _library()
    assert lib is not None, "pack_linear_weight returns None without the library"
    x = x.contiguous()
    rows, inner = x.shape
    out = torch.empty(rows, out_features, dtype=torch.bfloat16)
    lib.kvflow_bf16_linear(
        x.data_ptr(),
        packed.data_ptr(),
        None if bias is None else bias.data_ptr(),
        out.data_ptr(),
        rows,
        out_features,
        inner,
    )
    return out


def _rows(t: torch.Tensor) -> torch.Tensor:
    """t [rows, heads, D] with heads and D packed (any row stride), else a packed copy."""
    return t if t.stride(2) == 1 and t.stride(1) == t.shape[2] else t.contiguous()


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None,
) -> torch.Tensor:
    """One step's attention, any mix of new prompts, later chunks and decode tokens: writes k/v
    [T, Hkv, D] at `meta.slot_mapping` into the paged bf16 `kv_cache` [2, num_blocks,
    block_size, Hkv, D], then each token of q [T, Hq, D] attends over its request's context up
    to its own position (the last `sliding_window` positions with a window) -> [T, Hq, D].
    All bf16, head dim a multiple of 16 up to 256; needs `native_available()`."""
    lib = _library()
    assert lib is not None, "call native_available() first"
    q, k, v = _rows(q), _rows(k), _rows(v)
    if k.stride(0) != v.stride(0):
        k, v = k.contiguous(), v.contiguous()
    tokens, num_heads, head_dim = q.shape
    _, _, block_size, num_kv_heads, _ = kv_cache.shape
    out = torch.empty(tokens, num_heads, head_dim, dtype=q.dtype)
    lib.kvflow_paged_attention(
        q.data_ptr(),
        q.stride(0),
        k.data_ptr(),
        v.data_ptr(),
        k.stride(0),
        meta.slot_mapping.data_ptr(),
        kv_cache[0].data_ptr(),
        kv_cache[1].data_ptr(),
        meta.block_tables.data_ptr(),
        meta.block_tables.shape[1],
        meta.query_start_loc.data_ptr(),
        meta.seq_lens.data_ptr(),
        meta.num_reqs,
        num_heads,
        num_kv_heads,
        head_dim,
        block_size,
        sliding_window or 0,
        scale,
        meta.max_seq_len,
        out.data_ptr(),
    )
    return out


def applies(*tensors: torch.Tensor) -> bool:
    """Whether the native small ops apply: every tensor bf16 on the CPU and the library loaded."""
    ok = all(t.dtype == torch.bfloat16 and t.device.type == "cpu" for t in tensors)
    return ok and native_available()


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor:
    """RMSNorm over the last dim of x [..., D] as transformers rounds it; with `residual`
    (contiguous, x's shape), normalises x + residual and stores that sum into `residual`."""
    lib = _library()
    assert lib is not None, "check applies() first"
    x = x.contiguous()
    out = torch.empty_like(x)
    res = None if residual is None else residual.data_ptr()
    dim = x.shape[-1]
    lib.kvflow_rms_norm(
        x.data_ptr(), res, weight.data_ptr(), eps, out.data_ptr(), x.numel() // dim, dim
    )
    return out


def rotary_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [T, H, D] in place (rows may be strided, heads packed); cos/sin [T, 1, D] bf16,
    rows may be strided too (`RotaryEmbedding` gives views of one [T, 2, D] block: no copy)."""
    lib = _library()
    assert lib is not None, "check applies() first"
    assert x.stride(2) == 1 and x.stride(1) == x.shape[2], "heads must be packed"
    tokens, heads, dim = x.shape
    cos, sin = (t.reshape(tokens, dim) for t in (cos, sin))
    cos, sin = (t if t.stride(1) == 1 else t.contiguous() for t in (cos, sin))
    lib.kvflow_rotary(
        x.data_ptr(), x.stride(0), tokens, heads, dim,
        cos.data_ptr(), cos.stride(0), sin.data_ptr(), sin.stride(0),
    )  # fmt: skip
    return x


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up [T, 2I] (gate | up) -> [T, I], rounded as torch does."""
    lib = _library()
    assert lib is not None, "check applies() first"
    gate_up = gate_up.contiguous()
    tokens, width = gate_up.shape
    out = gate_up.new_empty(tokens, width // 2)
    lib.kvflow_silu_mul(gate_up.data_ptr(), out.data_ptr(), tokens, width // 2)
    return out
