"""Native CPU kernels (kernels/cpu/csrc/cpu_kernels.c), compiled on first use with the machine's C compiler
and loaded with ctypes.

A decode step of a small model on a CPU is bound by reading memory once: the weights, then each
request's K/V. torch's paths read more than that: oneDNN's bf16 matmul reaches a fraction of the
memory bandwidth at 1-8 rows, and the reference attention gathers every request's blocks into a
padded copy before attending (see benchmarks/RESULTS.md). Two kernels read each byte once:
`bf16_linear` (linear layers up to the rows where oneDNN catches up) and `paged_attention`
(every step: prompts, chunks and decode tokens, K/V read where they lie in the paged cache).

The library is built with `-march=native` for the CPU it runs on (or `$KVFLOW_NATIVE_MARCH`), so
the cache key holds the source, the compiler command and the CPU's identity; builds are atomic (compile to a temporary
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

from kvflow.paths import cache_root, scratch

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).resolve().parent / "csrc" / "cpu_kernels.c"
# The CPU it runs on, or the one $KVFLOW_NATIVE_MARCH names (x86-64-v3: AVX2 + FMA, what most
# CPUs without AVX-512 have; tests/model/test_native_march.py builds it so on any host). Every
# wider path is compiled in only where the target has it (#ifdef), so any target builds.
MARCH = os.environ.get("KVFLOW_NATIVE_MARCH", "native")
FLAGS = ["-O3", f"-march={MARCH}", "-fopenmp", "-shared", "-fPIC"]
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
    """The shared library of the C file `path` (built now unless cached) -> its path. The key
    holds the headers beside it (csrc/*.h), which the C files include."""
    headers = [h.read_bytes() for h in sorted(path.parent.glob("*.h"))]
    source = b"\0".join([path.read_bytes(), *headers])
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
def library() -> ctypes.CDLL | None:
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
    for name in ("kvflow_bf16_linear", "kvflow_bf16_linear_f32"):
        getattr(lib, name).restype = None
        getattr(lib, name).argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int] * 3
    lib.kvflow_paged_attention.restype = None
    ptr, num = ctypes.c_void_p, ctypes.c_int
    lib.kvflow_paged_attention.argtypes = [ptr, num, ptr, ptr, num, ptr, ptr, ptr, ptr, num]
    lib.kvflow_paged_attention.argtypes += [ptr, ptr] + [num] * 6 + [ctypes.c_float, ptr]
    for name, args in {
        "kvflow_rms_norm": [ptr, ptr, ptr, ctypes.c_float, ptr, num, num],
        "kvflow_rotary": [ptr, num, num, num, num, ptr, num, ptr, num],
        "kvflow_silu_mul": [ptr, ptr, num, num],
        "kvflow_row_argmax": [ptr, num, ctypes.c_long, num, ptr, ptr],
    }.items():
        getattr(lib, name).restype = None
        getattr(lib, name).argtypes = args
    lib.kvflow_amx_init.restype = ctypes.c_int
    lib.kvflow_amx_init()  # tile instructions for linear layers and prompts, where the CPU has them
    lib.kvflow_attention_tiles.restype = ctypes.c_int
    lib.kvflow_attention_tiles.argtypes = [num]
    return lib


def native_available() -> bool:
    """Whether the native kernels built and loaded (built now on first call)."""
    return library() is not None
