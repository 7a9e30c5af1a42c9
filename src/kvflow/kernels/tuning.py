"""Start-up tuning: the choices between kernels that are measured on the machine, once per
process (CPU: the native linear kernel against oneDNN by rows; CUDA: the one-row projections
against cuBLAS by weight shape)."""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from kvflow.kernels.cpu.build import native_available
from kvflow.kernels.cpu.linear import bf16_linear, pack_linear_weight
from kvflow.kernels.cpu.onednn import onednn_linear, pack_weight

logger = logging.getLogger("kvflow.engine")

EVERY_ROW = 1 << 30  # native_linear_max_rows where oneDNN has no packing to hand over to


def _best_of_3(fn: Callable[..., torch.Tensor], *args) -> float:
    """The shortest of 3 timed calls of fn(*args), in seconds."""
    times = []
    for _ in range(3):
        start = time.perf_counter()
        fn(*args)
        times.append(time.perf_counter() - start)
    return min(times)


@functools.cache
def native_linear_max_rows() -> int:
    """Up to how many rows the native kernel beats oneDNN's packed matmul on this CPU, measured
    once per process on a [1536, 576] weight (a small model's MLP): rows double from 16 while the
    native kernel stays ahead (best of 3 runs each). Always at least 8, where reading the weight
    once is what counts; the crossover differs by CPU (benchmarks/RESULTS.md)."""
    if not native_available():
        return 0
    weight = torch.randn(1536, 576, dtype=torch.bfloat16)
    native, packed = pack_linear_weight(weight), pack_weight(weight)
    if native is None or packed is None:
        return 0 if native is None else EVERY_ROW

    rows = 8
    while rows < 4096:
        x = torch.randn(2 * rows, weight.shape[1], dtype=weight.dtype)
        ours = _best_of_3(bf16_linear, x, native, None, weight.shape[0])
        theirs = _best_of_3(onednn_linear, x, packed, None)
        if ours > theirs:
            break
        rows *= 2
    return rows


@functools.cache
def bf16_matmul_pays() -> bool:
    """Whether torch's bf16 matmul beats widening to float32 and multiplying there, for a batch
    of 256 rows on a [1536, 576] weight (best of 3 each, measured once per process). Without
    AVX512-BF16 or AMX it does not: on 2 Zen cores with AVX2 alone the bf16 matmul took 6x the
    float32 one (benchmarks/RESULTS.md), so a long prompt's dequantized weight is made in
    float32 there."""
    weight = torch.randn(1536, 576, dtype=torch.bfloat16)
    x = torch.randn(256, 576, dtype=torch.bfloat16)
    bf16 = _best_of_3(F.linear, x, weight)
    wide = _best_of_3(lambda: F.linear(x.float(), weight.float()).to(torch.bfloat16))
    logger.info("bf16 matmul %.2f ms, through float32 %.2f ms (256 rows)", 1e3 * bf16, 1e3 * wide)
    return bf16 <= wide


def norm_fusion_pays() -> bool:
    """Whether `rms_norm_gemv` (the norm made inside the projection) is worth timing against
    the norm's own kernel then the projection: not with PDL. There the norm's kernel starts
    while the kernel before it ends, and the projection after it loads its weights meanwhile,
    which the one-launch timing `gemv_wins` uses cannot see (benchmarks/RESULTS.md, "One-row
    projections")."""
    from kvflow.kernels.triton.pdl import pdl_args  # triton: CUDA installs only

    return not pdl_args()["PDL"]


# (what, N, K, dtype, bias?) -> (ms of the one-row kernel, ms of what it replaces), as timed
_GEMV_TIMES: dict[tuple, tuple[float, float]] = {}


def gemv_wins(
    what: str,
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    ours: Callable[[], object],
    theirs: Callable[[], object],
) -> bool:
    """Whether the one-row kernel `ours` (a `gemv` of x by weight, maybe with the norm before
    it made inside) beats `theirs` (what runs without it: cuBLAS, after the norm's own kernel)
    for this `what` and weight shape on this card; False where `gemv` does not apply. Timed
    on the first call per shape as a decode graph runs them (`graph_us`); inside a CUDA graph
    capture an untimed shape answers False (the decode graphs warm every bucket up before
    capturing), and so does a shape whose timing failed (cuBLAS is always correct)."""
    if not gemv_applies(x, weight):
        return False
    key = (what, *weight.shape, x.dtype, bias is not None)
    times = _GEMV_TIMES.get(key)
    if times is None:
        if torch.cuda.is_current_stream_capturing():
            return False
        try:
            times = (graph_us(ours), graph_us(theirs))
        except Exception as exc:  # any failure here must cost speed only
            logger.warning("one-row %s %s: timing failed (%r); cuBLAS it is", what, key[1:3], exc)
            times = (float("inf"), 0.0)
        _GEMV_TIMES[key] = times
        winner = "Triton's one-row kernel" if times[0] < times[1] else "cuBLAS"
        logger.info("one-row %s %s: %s (%.1f us against %.1f us)", what, key[1:3], winner, *times)
    return times[0] < times[1]


def graph_us(fn: Callable[[], object], reps: int = 20) -> float:
    """Device microseconds per call of `fn` as a decode graph sees them: `reps` calls captured
    in a CUDA graph, each after a write over 96 MB (the weights come from HBM, as in a step,
    not from the 60 MB L2), less the same graph without `fn`. `fn` runs once first, outside
    the capture (Triton tunes its tile, nested choices are made)."""
    fn()
    flush = torch.empty(96 << 20, dtype=torch.uint8, device="cuda")

    def replay_ms(with_fn: bool) -> float:
        graph = torch.cuda.CUDAGraph()
        # thread_local: the engine's other threads may use CUDA meanwhile (at serve time)
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            for _ in range(reps):
                flush.zero_()
                if with_fn:
                    fn()
        graph.replay()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        return start.elapsed_time(end)

    with_fn = min(replay_ms(True) for _ in range(2))
    return 1e3 * max(with_fn - min(replay_ms(False) for _ in range(2)), 0.0) / reps


def gemv_applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """One half-precision row against a row-major weight: what `gemv` takes."""
    return (
        x.dim() == 2
        and x.shape[0] == 1
        and x.dtype in (torch.bfloat16, torch.float16)
        and weight.dtype == x.dtype
        and weight.stride(1) == 1
        and x.stride(1) == 1
    )
