"""Fused small ops for CUDA, in Triton: what `cpu_kernels` does natively on the CPU.

A decode step of a small model on a GPU is a few hundred kernels, most of them tiny: at batch 1
each costs its launch latency (2-3 us inside a CUDA graph) more than its bytes. Per Llama layer
torch's ops take 2 kernels for add + RMSNorm (twice), 5 for the rotary embedding and 2 for
silu(gate) * up; these take 1 each, which removes 7 of about 18 kernels per layer.

Each rounds where transformers' eager code rounds (to the activations' dtype after each op),
so a bfloat16 model gives the tokens it gave through torch's ops:

    rms_norm   s = x + residual (rounded); s * rsqrt(mean(s^2) + eps) in float32, rounded, times
               the weight, rounded; s is stored back into `residual`
    rotary_    x * cos and rotate_half(x) * sin each rounded, their sum rounded, in place
    silu_mul   silu(gate) rounded, times up, rounded

It also holds the one-row projections of a batch-1 decode step (`gemv`, `rms_norm_gemv`,
chosen per shape by `gemv_wins`) and the greedy sampler's reduction (`argmax_rows`). Every
kernel here (and in `triton_attn`) takes part in programmatic dependent launch on sm_90 and
newer: see the comment above `pdl_args`.

Imported only for CUDA tensors (triton is absent from CPU installs); tests run them under
Triton's interpreter on the CPU.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

# ---- programmatic dependent launch (PDL) -------------------------------------------------------
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
# save their launch latency only. On an H200 (benchmarks/RESULTS.md
# 2026-12-01) the batch-1 decode graph of the Llama-3.2-1B shape went 0.789 -> 0.758 ms with
# it, SmolLM2's (30 thin layers) 0.629 -> 0.483 ms.
#
# `gdc_*` are no-ops when a kernel is launched without PDL; the PDL flag (a constexpr) leaves
# them out of the kernel altogether where PDL is off (before sm_90, under the interpreter, or
# with KVFLOW_PDL=0, which is how benchmarks/gpu_check.py measures what it saves).

logger = logging.getLogger("kvflow.engine")
PDL_ENABLED = os.environ.get("KVFLOW_PDL", "1") != "0"
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
_pdl_works: bool | None = None  # the probe's answer (`_has_pdl`), once it ran


def pdl_args() -> dict:
    """The launch arguments of a kernel with a `PDL` flag: PDL on where the card has it."""
    on = PDL_ENABLED and not _INTERPRETED and _has_pdl()
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


@triton.jit
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, eps, dim, stride_x, stride_res, stride_out,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False,
):  # fmt: skip
    pdl_start(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < dim
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0)
    if HAS_RESIDUAL:
        x = x.to(tl.float32) + tl.load(res_ptr + row * stride_res + cols, mask=ok, other=0.0)
        x = x.to(out_ptr.dtype.element_ty)
        tl.store(res_ptr + row * stride_res + cols, x, mask=ok)
    s = x.to(tl.float32)
    inv = tl.math.rsqrt(tl.sum(s * s, axis=0) / dim + eps)
    normed = (s * inv).to(out_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, (normed * w).to(out_ptr.dtype.element_ty), mask=ok)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor:
    """RMSNorm over the last dim of x [..., D]; with `residual` (x's shape, rows contiguous),
    normalises x + residual and stores that sum into `residual`."""
    dim = x.shape[-1]
    x2 = x.reshape(-1, dim)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    res = x2 if residual is None else residual.view(-1, dim)
    if x2.shape[0]:
        _rms_norm_kernel[(x2.shape[0],)](
            x2, res, weight, out, eps, dim, x2.stride(0), res.stride(0), out.stride(0),
            HAS_RESIDUAL=residual is not None, BLOCK=triton.next_power_of_2(dim), **pdl_args(),
        )  # fmt: skip
    return out.view(x.shape)


@triton.jit
def swapped_halves(dims, HEAD_DIM: tl.constexpr):
    """The dim each dim's rotate_half partner sits at: d + D/2 below D/2, d - D/2 above."""
    return tl.where(dims < HEAD_DIM // 2, dims + HEAD_DIM // 2, dims - HEAD_DIM // 2)


@triton.jit
def rotate(x, x_swapped, cos, sin, dims, HEAD_DIM: tl.constexpr):
    """x * cos + rotate_half(x) * sin, each product and the sum rounded to x's dtype, as
    transformers' eager ops round (x_swapped: x at `swapped_halves`; cos, sin float32). The
    kernel must be compiled without fused multiply-adds (`enable_fp_fusion=False`)."""
    dtype = x.dtype
    partner = x_swapped.to(tl.float32)
    partner = tl.where(dims < HEAD_DIM // 2, -partner, partner)
    a = (x.to(tl.float32) * cos).to(dtype).to(tl.float32)
    return (a + (partner * sin).to(dtype).to(tl.float32)).to(dtype)


@triton.jit
def _rotary_kernel(
    x_ptr, cos_ptr, sin_ptr, heads, stride_xt, stride_xh, stride_ct, stride_st,
    HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr, BLOCK_H: tl.constexpr,
    PDL: tl.constexpr = False,
):  # fmt: skip
    pdl_start(PDL)
    token = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    d = tl.arange(0, HEAD_PAD)
    d_ok = d < HEAD_DIM
    ok = (h < heads)[:, None] & d_ok[None, :]
    rows = x_ptr + token * stride_xt + h[:, None] * stride_xh
    x = tl.load(rows + d[None, :], mask=ok, other=0.0)
    x_swapped = tl.load(rows + swapped_halves(d, HEAD_DIM)[None, :], mask=ok, other=0.0)
    cos = tl.load(cos_ptr + token * stride_ct + d, mask=d_ok, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + token * stride_st + d, mask=d_ok, other=0.0).to(tl.float32)
    out = rotate(x, x_swapped, cos[None, :], sin[None, :], d[None, :], HEAD_DIM)
    tl.store(rows + d[None, :], out, mask=ok)


def rotary_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [T, H, D] in place (rows may be strided, heads packed); cos/sin [T, 1, D], rows
    may be strided too (`RotaryEmbedding` gives views of one [T, 2, D] block: no copy)."""
    assert x.stride(2) == 1 and x.stride(1) == x.shape[2], "heads must be packed"
    tokens, heads, dim = x.shape
    cos, sin = contiguous_rows(cos, tokens, dim), contiguous_rows(sin, tokens, dim)
    if tokens:
        block_h = min(triton.next_power_of_2(heads), 16)
        # No fused multiply-add: it would skip the rounding of each product (sm_90 turns
        # them into bf16 FMAs), and 23 % of outputs would differ from torch's.
        _rotary_kernel[(tokens, triton.cdiv(heads, block_h))](
            x, cos, sin, heads, x.stride(0), x.stride(1), cos.stride(0), sin.stride(0),
            HEAD_DIM=dim, HEAD_PAD=triton.next_power_of_2(dim), BLOCK_H=block_h,
            enable_fp_fusion=False, **pdl_args(),
        )  # fmt: skip
    return x


def contiguous_rows(t: torch.Tensor, tokens: int, dim: int) -> torch.Tensor:
    """t as [tokens, dim] with contiguous rows (a view where it can be)."""
    t = t.reshape(tokens, dim)
    return t if t.stride(1) == 1 else t.contiguous()


@triton.jit
def _silu_mul_kernel(
    gate_up_ptr, out_ptr, inner, stride_in, stride_out, BLOCK: tl.constexpr,
    PDL: tl.constexpr = False,
):  # fmt: skip
    pdl_start(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < inner
    gate = tl.load(gate_up_ptr + row * stride_in + cols, mask=ok, other=0.0)
    up = tl.load(gate_up_ptr + row * stride_in + inner + cols, mask=ok, other=0.0)
    dtype = gate.dtype
    # torch's float32 steps, each rounded as IEEE float32 rounds: exp, 1 + e, the division.
    # On NVIDIA a float32 tl.exp is ex2.approx of a rounded argument and `/` is div.full (up
    # to ~14 ulps off), so exp and the division go through float64 and are rounded back; exp
    # still overflows to inf where float32's does (silu(-100) = -0, as torch gives).
    g = gate.to(tl.float32)
    e = tl.exp(-g.to(tl.float64)).to(tl.float32)
    act = (g.to(tl.float64) / (1.0 + e).to(tl.float64)).to(tl.float32)
    act = act.to(dtype).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, (act * up.to(tl.float32)).to(dtype), mask=ok)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up [T, 2I] (gate | up) -> [T, I]."""
    if gate_up.stride(-1) != 1:
        gate_up = gate_up.contiguous()
    tokens, width = gate_up.shape
    inner = width // 2
    out = torch.empty(tokens, inner, dtype=gate_up.dtype, device=gate_up.device)
    if tokens:
        block = min(triton.next_power_of_2(inner), 1024)
        grid = (tokens, triton.cdiv(inner, block))
        _silu_mul_kernel[grid](
            gate_up, out, inner, gate_up.stride(0), out.stride(0), BLOCK=block, **pdl_args()
        )
    return out


# ---- one-row linear ----------------------------------------------------------------------------
# A decode step at batch 1 multiplies one activation row by every weight matrix: pure weight
# reads. cuBLAS launches 32-128 CTAs for such a row on a 132-SM H200 and reads qkv at 2.1 TB/s,
# o_proj at 1.5 TB/s, down at 2.6 (measured, benchmarks/RESULTS.md 2026-11-30 21:35); the copy
# bandwidth is 4.2. Here each program owns BLOCK_N output features (N / BLOCK_N programs) and
# loads their rows whole (BLOCK_K = K rounded up to a power of two, up to 8192 columns a pass),
# so all of a program's loads are in flight at once; BLOCK_N and the warps are tuned per shape
# among the tiles of at most 64 elements per thread. On the card (RESULTS.md 2026-11-30 22:45)
# it beat cuBLAS on every projection of the 1B shape, at 1.6 (o_proj) to 4.3 TB/s (logits);
# the small ones are bound by a kernel's fixed latency. (A first version walked K in 512-column
# tiles, waiting on each: 1.7 TB/s on o_proj, and slower than cuBLAS on the other three.)
#
# With NORM the input row is made on the fly: rms_norm(x + residual) * norm weight, rounded as
# `rms_norm` rounds. Every program first sums the squares over the whole row, and program 0
# stores x + residual (to a new buffer: the others are still reading the old one). That saves
# the norm's own kernel (2.4 us with its gap in a graph) but each program redoes the norm, so
# whether it pays is timed per shape like the rest (`gemv_wins`), and only without PDL
# (`norm_fusion_pays`). (silu(gate) * up made the same way before down was tried and dropped:
# redone per program in float64, down took 45 us, not 13.)
#
# With GATED the weight is gate | up [2I, K] and the output silu(gate) * up [1, I], in the
# epilogue: a program takes gate rows n and up rows I + n, rounds both as the projection's
# output is rounded, then applies `silu_mul`'s rounding. Nothing is redone per program; it
# saves the silu kernel (3.0 us a layer in the 1B's graph) and the write and read of gate | up.
#
# PER_SM (tuned like the tile): 0 gives each program one tile of BLOCK_N rows, N / BLOCK_N
# programs. PER_SM > 0 launches that many programs per SM, each walking the row tiles pid,
# pid + programs, ... and loading its next tile's rows before it reduces the current one (two
# tiles in registers), so its loads never stop, and a NORM program makes its input row once, not
# once per tile. Only where K fits one pass (K <= 8192); beyond, one tile per program. On the
# H200 (benchmarks/RESULTS.md 2026-12-01 00:50) the tuner took walking programs for the small
# projections and the norm-fused ones, one-tile programs for gate_up, down and the logits; a
# first version also ran one-tile programs through the walking loop, whose masked next-tile
# load cost them registers (down 9.3 -> 10.0 us in the graph), hence the two paths.

_MAX_BLOCK_K = 8192
_GEMV_CONFIGS = [
    triton.Config({"BLOCK_N": n, "PER_SM": p}, num_warps=w, num_stages=1)
    for p in (0, 4)
    for n in (1, 2, 4, 8, 16, 32)
    for w in (4, 8)
]


def _fitting_configs(configs: list, named_args: dict, **kwargs) -> list:
    """The configs whose weight tiles ([BLOCK_N, BLOCK_K], two with GATED, twice that for a
    program that walks tiles) are at most 64 elements per thread; walking only in one pass."""
    per_row = kwargs["BLOCK_K"] * (2 if kwargs["GATED"] else 1)
    fits = [
        c
        for c in configs
        if c.kwargs["BLOCK_N"] * per_row * (2 if c.kwargs["PER_SM"] else 1) <= 64 * 32 * c.num_warps
        and (kwargs["ONE_PASS"] or not c.kwargs["PER_SM"])
    ]
    return fits or configs[:1]


@triton.jit
def _gemv_input(
    x_ptr, res_ptr, norm_w_ptr, k, k_ok, inv, NORM: tl.constexpr, HAS_RESIDUAL: tl.constexpr
):  # fmt: skip
    """Columns k of the row the weight multiplies, in float32 (see the comment above)."""
    x = tl.load(x_ptr + k, mask=k_ok, other=0.0)
    if NORM:
        dtype = x.dtype
        if HAS_RESIDUAL:
            x = (x.to(tl.float32) + tl.load(res_ptr + k, mask=k_ok, other=0.0)).to(dtype)
        normed = (x.to(tl.float32) * inv).to(dtype).to(tl.float32)
        w = tl.load(norm_w_ptr + k, mask=k_ok, other=0.0).to(tl.float32)
        return (normed * w).to(dtype).to(tl.float32)
    return x.to(tl.float32)


@triton.jit
def _gemv_rows(w_ptr, n, k, N, K, stride_w, GATED: tl.constexpr):
    """Weight rows n (and with GATED the up rows N + n) at columns k; rows >= N masked."""
    rows = w_ptr + n.to(tl.int64)[:, None] * stride_w + k[None, :]
    mask = (n < N)[:, None] & (k < K)[None, :]
    w = tl.load(rows, mask=mask, other=0.0)
    w_up = w
    if GATED:
        w_up = tl.load(rows + N * stride_w, mask=mask, other=0.0)
    return w, w_up


@triton.jit
def _gemv_sums(w, w_up, x, GATED: tl.constexpr):
    """float32 sums of the rows w (and w_up) times x; without GATED the second is the first."""
    acc = tl.sum(w.to(tl.float32) * x[None, :], axis=1)
    acc_up = acc
    if GATED:
        acc_up = tl.sum(w_up.to(tl.float32) * x[None, :], axis=1)
    return acc, acc_up


@triton.jit
def _gemv_store(
    acc, acc_up, n, N, bias_ptr, out_ptr, dtype, HAS_BIAS: tl.constexpr, GATED: tl.constexpr
):  # fmt: skip
    """Outputs n of the float32 sums: bias added, silu(gate) * up with GATED, rounded to
    `dtype` (the weight's), stored in out's dtype (float32 logits: exactly that value)."""
    n_ok = n < N
    if HAS_BIAS:
        acc += tl.load(bias_ptr + n, mask=n_ok, other=0.0).to(tl.float32)
        if GATED:
            acc_up += tl.load(bias_ptr + N + n, mask=n_ok, other=0.0).to(tl.float32)
    if GATED:  # as `silu_mul` computes it from the rounded projection (see _silu_mul_kernel)
        g = acc.to(dtype).to(tl.float32)
        e = tl.exp(-g.to(tl.float64)).to(tl.float32)
        act = (g.to(tl.float64) / (1.0 + e).to(tl.float64)).to(tl.float32)
        acc = act.to(dtype).to(tl.float32) * acc_up.to(dtype).to(tl.float32)
    tl.store(out_ptr + n, acc.to(dtype).to(out_ptr.dtype.element_ty), mask=n_ok)


@triton.jit
def _gemv_kernel(
    x_ptr, w_ptr, bias_ptr, out_ptr, res_ptr, res_out_ptr, norm_w_ptr, eps, N, K, stride_w,
    HAS_BIAS: tl.constexpr, NORM: tl.constexpr, HAS_RESIDUAL: tl.constexpr, GATED: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ONE_PASS: tl.constexpr,
    PER_SM: tl.constexpr = 0, PDL: tl.constexpr = False,
):  # fmt: skip
    """PER_SM: 0, one tile per program; else programs walk tiles (the launch sizes the grid);
    see the comment above."""
    pid = tl.program_id(0)
    dtype = w_ptr.dtype.element_ty
    if PDL:
        gdc_launch_dependents()
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    if ONE_PASS:  # K <= BLOCK_K: the first tile's rows before anything else (see PDL)
        k = tl.arange(0, BLOCK_K)
        w, w_up = _gemv_rows(w_ptr, rows, k, N, K, stride_w, GATED)
    if PDL:
        gdc_wait()
    inv = 1.0
    if NORM:  # the row's mean square first (program 0 also stores the residual stream)
        squares = tl.zeros([BLOCK_K], tl.float32)
        for k_start in range(0, K, BLOCK_K):
            k = k_start + tl.arange(0, BLOCK_K)
            k_ok = k < K
            x = tl.load(x_ptr + k, mask=k_ok, other=0.0)
            if HAS_RESIDUAL:
                x = (x.to(tl.float32) + tl.load(res_ptr + k, mask=k_ok, other=0.0)).to(x.dtype)
                tl.store(res_out_ptr + k, x, mask=k_ok & (pid == 0))
            squares += x.to(tl.float32) * x.to(tl.float32)
        inv = tl.math.rsqrt(tl.sum(squares, axis=0) / K + eps)
    if ONE_PASS:
        k = tl.arange(0, BLOCK_K)
        x = _gemv_input(x_ptr, res_ptr, norm_w_ptr, k, k < K, inv, NORM, HAS_RESIDUAL)
        if PER_SM == 0:  # one tile, loaded above
            acc, acc_up = _gemv_sums(w, w_up, x, GATED)
            _gemv_store(acc, acc_up, rows, N, bias_ptr, out_ptr, dtype, HAS_BIAS, GATED)
        else:  # tiles pid, pid + programs, ..., each loaded while the one before is reduced
            stride = tl.num_programs(0) * BLOCK_N
            for start in range(pid * BLOCK_N, N, stride):
                n = start + tl.arange(0, BLOCK_N)
                w_next, w_up_next = _gemv_rows(w_ptr, n + stride, k, N, K, stride_w, GATED)
                acc, acc_up = _gemv_sums(w, w_up, x, GATED)
                _gemv_store(acc, acc_up, n, N, bias_ptr, out_ptr, dtype, HAS_BIAS, GATED)
                w, w_up = w_next, w_up_next
    else:  # one tile per program, K in passes of BLOCK_K columns
        acc = tl.zeros([BLOCK_N], tl.float32)
        acc_up = tl.zeros([BLOCK_N], tl.float32)
        for k_start in range(0, K, BLOCK_K):
            k = k_start + tl.arange(0, BLOCK_K)
            w, w_up = _gemv_rows(w_ptr, rows, k, N, K, stride_w, GATED)
            x = _gemv_input(x_ptr, res_ptr, norm_w_ptr, k, k < K, inv, NORM, HAS_RESIDUAL)
            part, part_up = _gemv_sums(w, w_up, x, GATED)
            acc += part
            acc_up += part_up
        _gemv_store(acc, acc_up, rows, N, bias_ptr, out_ptr, dtype, HAS_BIAS, GATED)


# Tiles compared by device time as a decode graph sees it (`_graph_us`): timed one launch at a
# time (Triton's default), the ~40 us Python launch hid the kernel and the card's first tuning
# picked at random. (The tuner takes the minimum of what this returns, so three equal values.)
# The timings are kept in Triton's cache on disk (per Triton version, GPU architecture, kernel
# source, shape and config list): tuning every tile of a 1B model's shapes took most of a
# CUDA engine's start (15 s on the H200, 2026-12-01), and a restart reads them back.
_gemv_tuned = triton.autotune(
    _GEMV_CONFIGS,
    key=["N", "K", "NORM", "GATED"],
    prune_configs_by={"early_config_prune": _fitting_configs},
    do_bench=lambda kernel_call, quantiles: [_graph_us(kernel_call)] * 3,
    cache_results=True,
)(_gemv_kernel)


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


def _launch_gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    config: dict | None,
    *,
    residual: torch.Tensor | None = None,
    norm: tuple[torch.Tensor, float] | None = None,
    gated: bool = False,
    out_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    n, k = weight.shape
    n //= 2 if gated else 1  # outputs: silu(gate) * up of the two halves
    out = torch.empty(1, n, dtype=out_dtype or x.dtype, device=x.device)
    res_out = None if residual is None else torch.empty_like(residual)
    norm_weight, eps = norm if norm is not None else (weight, 0.0)
    args = (
        x, weight, weight if bias is None else bias, out,
        x if residual is None else residual, x if res_out is None else res_out,
        norm_weight, eps, n, k, weight.stride(0),
    )  # fmt: skip
    block_k = min(triton.next_power_of_2(k), _MAX_BLOCK_K)
    flags = dict(
        HAS_BIAS=bias is not None,
        NORM=norm is not None,
        HAS_RESIDUAL=residual is not None,
        GATED=gated,
        BLOCK_K=block_k,
        ONE_PASS=k <= block_k,
        **pdl_args(),
    )
    if config is None and _INTERPRETED:  # no timing under Triton's interpreter (tests)
        config = dict(BLOCK_N=4, PER_SM=0, num_warps=4, num_stages=1)

    def grid(meta: dict) -> tuple[int]:  # programs walk tiles only in one pass over K
        tiles = triton.cdiv(n, meta["BLOCK_N"])
        walk = meta["PER_SM"] and flags["ONE_PASS"]
        return (min(tiles, meta["PER_SM"] * sm_count(x.device)) if walk else tiles,)

    if config is not None:
        config = {"PER_SM": 0} | config
        _gemv_kernel[grid(config)](*args, **flags, **config)
    else:
        _gemv_tuned[grid](*args, **flags)
    return out, res_out


@functools.cache
def sm_count(device: torch.device) -> int:
    """The card's SMs; 4 under the interpreter (so that tests walk several tiles a program)."""
    return (
        4
        if device.type != "cuda"
        else torch.cuda.get_device_properties(device).multi_processor_count
    )


def gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    config: dict | None = None,
    out_dtype: torch.dtype | None = None,
    gated: bool = False,
) -> torch.Tensor:
    """x [1, K] @ weight.T (+ bias) for weight [N, K] -> [1, N] (see `gemv_applies`), rounded
    to x's dtype and stored as `out_dtype` (default x's: float32 for logits saves a
    conversion). `gated`: weight is gate | up and the result [1, N / 2] silu(gate) * up, as
    `silu_mul` of the projection gives it. The tile is tuned per shape on the first call
    (which must not be inside a CUDA graph capture: the decode graphs warm each bucket up
    before capturing it); `config` (BLOCK_N, PER_SM, num_warps, num_stages) skips the tuning."""
    return _launch_gemv(x, weight, bias, config, out_dtype=out_dtype, gated=gated)[0]


def norm_fusion_pays() -> bool:
    """Whether `rms_norm_gemv` (the norm made inside the projection) is worth timing against
    the norm's own kernel then the projection: not with PDL. There the norm's kernel starts
    while the kernel before it ends, and the projection after it loads its weights meanwhile;
    in the H200's decode graph (benchmarks/RESULTS.md 2026-12-01 00:50) the separate norm and
    qkv took 4.9 us against 5.9 for the fused kernel, and gate_up with the norm inside 21.3
    against 16.5 without it, which the one-launch timing `gemv_wins` uses could not see."""
    return not pdl_args()["PDL"]


def rms_norm_gemv(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    config: dict | None = None,
    gated: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(`gemv` of rms_norm(x [+ residual]), the residual stream): what `rms_norm` then `gemv`
    give, in one kernel. The stream x + residual goes to a new tensor (x itself without
    `residual`). `gated`: weight is gate | up and the result silu(gate) * up, as `silu_mul`
    of the projection gives it."""
    out, res_out = _launch_gemv(
        x, weight, bias, config, residual=residual, norm=(norm_weight, eps), gated=gated
    )
    return out, x if res_out is None else res_out


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
    on the first call per shape as a decode graph runs them (`_graph_us`); inside a CUDA graph
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
            times = (_graph_us(ours), _graph_us(theirs))
        except Exception as exc:  # any failure here must cost speed only
            logger.warning("one-row %s %s: timing failed (%r); cuBLAS it is", what, key[1:3], exc)
            times = (float("inf"), 0.0)
        _GEMV_TIMES[key] = times
    return times[0] < times[1]


def _graph_us(fn: Callable[[], object], reps: int = 20) -> float:
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


# ---- greedy tokens ---------------------------------------------------------------------------
# A decode step's sampler reduces each row of float32 logits to its argmax, and flags rows whose
# maximum is not finite (NaN or +inf anywhere, or all -inf: `sampler.SamplerOutput.bad_mask`).
# torch does that in about ten small kernels at batch 1 (chunked max, chunk max, gather, the
# index arithmetic, the flag, its conversion, the stack the host copies): ~30 us on an H200 for
# ~5 us of reading. Here it is two: each program reduces a chunk of CHUNK logits of one row to
# (max, first index of it), then one program per row reduces its chunks and writes the
# [2, B] int64 block the host copies: argmax | bad flag. The argmax is torch.argmax's: the first
# index of the maximum, and a NaN counts as the maximum (the first NaN).

_ARGMAX_CHUNK = 2048


@triton.jit
def _chunk_argmax_kernel(
    logits_ptr, max_ptr, idx_ptr, V, stride_row, chunks, CHUNK: tl.constexpr,
    PDL: tl.constexpr = False,
):  # fmt: skip
    pdl_start(PDL)
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    cols = chunk * CHUNK + tl.arange(0, CHUNK)
    x = tl.load(logits_ptr + row * stride_row + cols, mask=cols < V, other=float("-inf"))
    nan = x != x
    clean = tl.where(nan, float("-inf"), x)
    top = tl.max(clean, axis=0)
    first_nan = tl.min(tl.where(nan, cols, V), axis=0)
    first_top = tl.min(tl.where(clean == top, cols, V), axis=0)  # a column < V: chunk < V
    has_nan = first_nan < V
    out = row * chunks + chunk
    tl.store(max_ptr + out, tl.where(has_nan, float("nan"), top))
    tl.store(idx_ptr + out, tl.where(has_nan, first_nan, first_top))


@triton.jit
def _rows_argmax_kernel(
    max_ptr, idx_ptr, out_ptr, chunks, batch, BLOCK_C: tl.constexpr, PDL: tl.constexpr = False
):  # fmt: skip
    pdl_start(PDL)
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK_C)
    ok = c < chunks
    m = tl.load(max_ptr + row * chunks + c, mask=ok, other=float("-inf"))
    nan = (m != m) & ok
    first_nan = tl.min(tl.where(nan, c, BLOCK_C), axis=0)
    clean = tl.where(nan | ~ok, float("-inf"), m)
    top = tl.max(clean, axis=0)
    first_top = tl.min(tl.where((clean == top) & ok, c, BLOCK_C), axis=0)
    has_nan = first_nan < BLOCK_C
    best = tl.where(has_nan, first_nan, first_top)
    tl.store(out_ptr + row, tl.load(idx_ptr + row * chunks + best).to(tl.int64))
    bad = has_nan | (top == float("inf")) | (top == float("-inf"))
    tl.store(out_ptr + batch + row, bad.to(tl.int64))


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """int64 [2, B] for float32 logits [B, V] (rows contiguous): row 0 the argmax of each row
    (torch.argmax's), row 1 its bad flag (1: NaN or +inf in the row, or all of it -inf)."""
    batch, vocab = logits.shape
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    chunks = triton.cdiv(vocab, _ARGMAX_CHUNK)
    on = {"device": logits.device}
    top = torch.empty(batch, chunks, dtype=torch.float32, **on)
    idx = torch.empty(batch, chunks, dtype=torch.int32, **on)
    out = torch.empty(2, batch, dtype=torch.int64, **on)
    if batch:
        _chunk_argmax_kernel[(batch, chunks)](
            logits, top, idx, vocab, logits.stride(0), chunks, CHUNK=_ARGMAX_CHUNK, **pdl_args()
        )
        _rows_argmax_kernel[(batch,)](
            top, idx, out, chunks, batch, BLOCK_C=triton.next_power_of_2(chunks), **pdl_args()
        )
    return out
