"""One-row projections for a batch-1 decode step on CUDA, in Triton: `gemv`, and `rms_norm_gemv`
with the norm made inside; `kernels.tuning.gemv_wins` decides per shape where they run."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from kvflow.kernels.triton.device import INTERPRETED, sm_count
from kvflow.kernels.triton.ops import rms_norm, silu_mul  # noqa: F401 (OneRowOps)
from kvflow.kernels.triton.pdl import pdl_args
from kvflow.kernels.tuning import graph_us

# ---- one-row linear ----------------------------------------------------------------------------
# A decode step at batch 1 multiplies one activation row by every weight matrix: pure weight
# reads, which cuBLAS spreads over too few CTAs to reach the card's bandwidth. Here each program
# owns BLOCK_N output features (N / BLOCK_N programs) and loads their rows whole (BLOCK_K = K
# rounded up to a power of two, up to 8192 columns a pass), so all of a program's loads are in
# flight at once; BLOCK_N and the warps are tuned per shape among the tiles of at most 64
# elements per thread. Loading whole rows, not K tiles waited on one by one, is what makes it
# beat cuBLAS (figures: benchmarks/RESULTS.md, "One-row projections").
#
# With NORM the input row is made on the fly: rms_norm(x + residual) * norm weight, rounded as
# `rms_norm` rounds. Every program first sums the squares over the whole row, and program 0
# stores x + residual (to a new buffer: the others are still reading the old one). That saves
# the norm's own kernel but each program redoes the norm, so whether it pays is timed per shape
# like the rest (`gemv_wins`), and only without PDL (`norm_fusion_pays`). silu(gate) * up is not
# made this way for down: redone per program in float64 it costs more than its kernel.
#
# With GATED the weight is gate | up [2I, K] and the output silu(gate) * up [1, I], in the
# epilogue: a program takes gate rows n and up rows I + n, rounds both as the projection's
# output is rounded, then applies `silu_mul`'s rounding. Nothing is redone per program; it
# saves the silu kernel and the write and read of gate | up.
#
# PER_SM (tuned like the tile): 0 gives each program one tile of BLOCK_N rows, N / BLOCK_N
# programs. PER_SM > 0 launches that many programs per SM, each walking the row tiles pid,
# pid + programs, ... and loading its next tile's rows before it reduces the current one (two
# tiles in registers), so its loads never stop, and a NORM program makes its input row once, not
# once per tile. Only where K fits one pass (K <= 8192); beyond, one tile per program. One-tile
# programs take their own path: through the walking loop, the masked next-tile load would cost
# them registers.

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


# Tiles compared by device time as a decode graph sees it (`graph_us`): timed one launch at a
# time (Triton's default), the Python launch hides the kernel. (The tuner takes the minimum of
# what this returns, so three equal values.) The timings are kept in Triton's cache on disk (per
# Triton version, GPU architecture, kernel source, shape and config list): tuning every tile of
# a model's shapes is most of a CUDA engine's first start, and a restart reads them back.
_gemv_tuned = triton.autotune(
    _GEMV_CONFIGS,
    key=["N", "K", "NORM", "GATED"],
    prune_configs_by={"early_config_prune": _fitting_configs},
    do_bench=lambda kernel_call, quantiles: [graph_us(kernel_call)] * 3,
    cache_results=True,
)(_gemv_kernel)


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
    if config is None and INTERPRETED:  # no timing under Triton's interpreter (tests)
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
