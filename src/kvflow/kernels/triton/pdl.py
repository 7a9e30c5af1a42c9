"""Programmatic dependent launch (PDL) for the Triton kernels: `pdl_args` for a launch, `pdl_start`
inside a kernel, and the start-up probe that decides whether the card runs it correctly."""

from __future__ import annotations

import logging
import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from kvflow.kernels.triton.device import INTERPRETED

# In a decode graph each kernel normally starts only once the one before it has ended and its
# writes are flushed: at batch 1, where a step is ~110 kernels of 1-20 us, that launch and the
# ramp of each kernel's first loads cost a large share of the step. Launched with PDL
# (`launch_pdl`), a kernel may start as soon as every program of the kernel before it has
# called `gdc_launch_dependents` (ours do so first thing), and runs up to its `gdc_wait`, which
# returns once the kernel before it has ended and its writes are visible (that kernel itself
# waited for its own predecessor, so everything earlier is done too). The rule every kernel here
# keeps: before `gdc_wait` it reads only what no kernel writes during a forward, and it stores
# nothing. The one-row projections load their weight rows there, so a projection's weight stream
# starts while the kernel before it is still running; a decode's attention reads its metadata
# and the keys of earlier steps there (see triton_attn); the other kernels wait first thing and
# save their launch latency only (what it saves: benchmarks/RESULTS.md, "PDL").
#
# `gdc_*` are no-ops when a kernel is launched without PDL; the PDL flag (a constexpr) leaves
# them out of the kernel altogether where PDL is off (before sm_90, under the interpreter, or
# with KVFLOW_PDL=0, which is how benchmarks/gpu_check.py measures what it saves).

logger = logging.getLogger("kvflow.engine")
PDL_ENABLED = os.environ.get("KVFLOW_PDL", "1") != "0"
_pdl_works: bool | None = None  # the probe's answer (`_has_pdl`), once it ran


def pdl_args() -> dict:
    """The launch arguments of a kernel with a `PDL` flag: PDL on where the card has it."""
    on = PDL_ENABLED and not INTERPRETED and _has_pdl()
    return dict(PDL=on, launch_pdl=on)


@triton.jit
def pdl_start(PDL: tl.constexpr):
    """Let the next kernel launch, then wait for the previous one (see `pdl_args`)."""
    if PDL:
        gdc_launch_dependents()
        gdc_wait()


@triton.jit
def _pdl_probe_kernel(x_ptr, PDL: tl.constexpr):
    pdl_start(PDL)
    i = tl.arange(0, 64)
    tl.store(x_ptr + i, tl.load(x_ptr + i) + 1)


def _has_pdl() -> bool:
    """sm_90 or newer, and a chain of PDL launches gives the right result eagerly and replayed
    in a CUDA graph; anything else (an old driver, a failed capture) keeps PDL off, with a
    warning. Inside a capture the probe cannot run: off for that launch, asked again later."""
    global _pdl_works
    if _pdl_works is None:
        if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0):
            _pdl_works = False
        elif torch.cuda.is_current_stream_capturing():
            return False
        else:
            _pdl_works = _probe_pdl()
    return _pdl_works


def _probe_pdl() -> bool:
    try:
        x = torch.zeros(64, dtype=torch.int32, device="cuda")
        for _ in range(3):
            _pdl_probe_kernel[(1,)](x, PDL=True, launch_pdl=True)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            for _ in range(3):
                _pdl_probe_kernel[(1,)](x, PDL=True, launch_pdl=True)
        graph.replay()
        graph.replay()
        if bool((x == 9).all()):
            return True
        logger.warning("programmatic dependent launch gave wrong results: off")
    except Exception as exc:  # PDL only saves time: never fail a forward for it
        logger.warning("programmatic dependent launch failed (%r): off", exc)
    return False
