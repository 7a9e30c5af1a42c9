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

Imported only for CUDA tensors (triton is absent from CPU installs); tests run them under
Triton's interpreter on the CPU.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, eps, dim, stride_x, stride_res, stride_out,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
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
            HAS_RESIDUAL=residual is not None, BLOCK=triton.next_power_of_2(dim),
        )  # fmt: skip
    return out.view(x.shape)


@triton.jit
def _rotary_kernel(
    x_ptr, cos_ptr, sin_ptr, heads, stride_xt, stride_xh, stride_ct, stride_st,
    HALF: tl.constexpr, BLOCK_H: tl.constexpr,
):  # fmt: skip
    token = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    d = tl.arange(0, HALF)
    ok = (h < heads)[:, None]
    base = x_ptr + token * stride_xt + h[:, None] * stride_xh + d[None, :]
    x1 = tl.load(base, mask=ok, other=0.0)
    x2 = tl.load(base + HALF, mask=ok, other=0.0)
    dtype = x1.dtype
    cos1 = tl.load(cos_ptr + token * stride_ct + d).to(tl.float32)[None, :]
    cos2 = tl.load(cos_ptr + token * stride_ct + HALF + d).to(tl.float32)[None, :]
    sin1 = tl.load(sin_ptr + token * stride_st + d).to(tl.float32)[None, :]
    sin2 = tl.load(sin_ptr + token * stride_st + HALF + d).to(tl.float32)[None, :]
    a1, a2 = x1.to(tl.float32), x2.to(tl.float32)
    # out = x * cos + cat(-x2, x1) * sin, each product and the sum rounded to x's dtype
    out1 = (a1 * cos1).to(dtype).to(tl.float32) + (-a2 * sin1).to(dtype).to(tl.float32)
    out2 = (a2 * cos2).to(dtype).to(tl.float32) + (a1 * sin2).to(dtype).to(tl.float32)
    tl.store(base, out1.to(dtype), mask=ok)
    tl.store(base + HALF, out2.to(dtype), mask=ok)


def rotary_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [T, H, D] in place (rows may be strided, heads packed); cos/sin [T, 1, D], rows
    may be strided too (`RotaryEmbedding` gives views of one [T, 2, D] block: no copy)."""
    assert x.stride(2) == 1 and x.stride(1) == x.shape[2], "heads must be packed"
    tokens, heads, dim = x.shape
    cos, sin = _rows(cos, tokens, dim), _rows(sin, tokens, dim)
    if tokens:
        block_h = min(triton.next_power_of_2(heads), 16)
        # No fused multiply-add: it would skip the rounding of each product (sm_90 turns
        # them into bf16 FMAs), and 23 % of outputs would differ from torch's.
        _rotary_kernel[(tokens, triton.cdiv(heads, block_h))](
            x, cos, sin, heads, x.stride(0), x.stride(1), cos.stride(0), sin.stride(0),
            HALF=dim // 2, BLOCK_H=block_h, enable_fp_fusion=False,
        )  # fmt: skip
    return x


def _rows(t: torch.Tensor, tokens: int, dim: int) -> torch.Tensor:
    """t as [tokens, dim] with contiguous rows (a view where it can be)."""
    t = t.reshape(tokens, dim)
    return t if t.stride(1) == 1 else t.contiguous()


@triton.jit
def _silu_mul_kernel(gate_up_ptr, out_ptr, inner, stride_in, stride_out, BLOCK: tl.constexpr):
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
        _silu_mul_kernel[grid](gate_up, out, inner, gate_up.stride(0), out.stride(0), BLOCK=block)
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
# whether it pays is timed per shape like the rest (`gemv_wins`). (silu(gate) * up made the
# same way was tried and dropped: redone per program in float64, down took 45 us, not 13.)
#
# With GATED the weight is gate | up [2I, K] and the output silu(gate) * up [1, I], in the
# epilogue: a program takes gate rows n and up rows I + n, rounds both as the projection's
# output is rounded, then applies `silu_mul`'s rounding. Nothing is redone per program; it
# saves the silu kernel and the write and read of gate | up.

logger = logging.getLogger("kvflow.engine")
_MAX_BLOCK_K = 8192
_GEMV_CONFIGS = [
    triton.Config({"BLOCK_N": n}, num_warps=w, num_stages=1)
    for n in (1, 2, 4, 8, 16, 32)
    for w in (4, 8)
]


def _fitting_configs(configs: list, named_args: dict, **kwargs) -> list:
    """The configs whose weight tiles ([BLOCK_N, BLOCK_K], two with GATED) are at most 64
    elements per thread."""
    per_row = kwargs["BLOCK_K"] * (2 if kwargs["GATED"] else 1)
    fits = [c for c in configs if c.kwargs["BLOCK_N"] * per_row <= 64 * 32 * c.num_warps]
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
def _gemv_kernel(
    x_ptr, w_ptr, bias_ptr, out_ptr, res_ptr, res_out_ptr, norm_w_ptr, eps, N, K, stride_w,
    HAS_BIAS: tl.constexpr, NORM: tl.constexpr, HAS_RESIDUAL: tl.constexpr, GATED: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
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
    n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    rows = w_ptr + n.to(tl.int64)[:, None] * stride_w
    up_rows = rows + N * stride_w  # GATED: the up half of the weight
    acc = tl.zeros([BLOCK_N], tl.float32)
    acc_up = tl.zeros([BLOCK_N], tl.float32)
    for k_start in range(0, K, BLOCK_K):
        k = k_start + tl.arange(0, BLOCK_K)
        k_ok = k < K
        w_mask = n_ok[:, None] & k_ok[None, :]
        w = tl.load(rows + k[None, :], mask=w_mask, other=0.0)
        if GATED:
            w_up = tl.load(up_rows + k[None, :], mask=w_mask, other=0.0)
        x = _gemv_input(x_ptr, res_ptr, norm_w_ptr, k, k_ok, inv, NORM, HAS_RESIDUAL)
        acc += tl.sum(w.to(tl.float32) * x[None, :], axis=1)
        if GATED:
            acc_up += tl.sum(w_up.to(tl.float32) * x[None, :], axis=1)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + n, mask=n_ok, other=0.0).to(tl.float32)
        if GATED:
            acc_up += tl.load(bias_ptr + N + n, mask=n_ok, other=0.0).to(tl.float32)
    dtype = out_ptr.dtype.element_ty
    if GATED:  # as `silu_mul` computes it from the rounded projection (see _silu_mul_kernel)
        g = acc.to(dtype).to(tl.float32)
        e = tl.exp(-g.to(tl.float64)).to(tl.float32)
        act = (g.to(tl.float64) / (1.0 + e).to(tl.float64)).to(tl.float32)
        acc = act.to(dtype).to(tl.float32) * acc_up.to(dtype).to(tl.float32)
    tl.store(out_ptr + n, acc.to(dtype), mask=n_ok)


_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
# Tiles compared by device time as a decode graph sees it (`_graph_us`): timed one launch at a
# time (Triton's default), the ~40 us Python launch hid the kernel and the card's first tuning
# picked at random. (The tuner takes the minimum of what this returns, so three equal values.)
_gemv_tuned = triton.autotune(
    _GEMV_CONFIGS,
    key=["N", "K", "NORM", "GATED"],
    prune_configs_by={"early_config_prune": _fitting_configs},
    do_bench=lambda kernel_call, quantiles: [_graph_us(kernel_call)] * 3,
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
) -> tuple[torch.Tensor, torch.Tensor | None]:
    n, k = weight.shape
    n //= 2 if gated else 1  # outputs: silu(gate) * up of the two halves
    out = torch.empty(1, n, dtype=x.dtype, device=x.device)
    res_out = None if residual is None else torch.empty_like(residual)
    norm_weight, eps = norm if norm is not None else (weight, 0.0)
    args = (
        x, weight, weight if bias is None else bias, out,
        x if residual is None else residual, x if res_out is None else res_out,
        norm_weight, eps, n, k, weight.stride(0),
    )  # fmt: skip
    flags = dict(
        HAS_BIAS=bias is not None,
        NORM=norm is not None,
        HAS_RESIDUAL=residual is not None,
        GATED=gated,
        BLOCK_K=min(triton.next_power_of_2(k), _MAX_BLOCK_K),
    )
    if config is None and _INTERPRETED:  # no timing under Triton's interpreter (tests)
        config = dict(BLOCK_N=4, num_warps=4, num_stages=1)
    if config is not None:
        _gemv_kernel[(triton.cdiv(n, config["BLOCK_N"]),)](*args, **flags, **config)
    else:
        grid = lambda meta: (triton.cdiv(n, meta["BLOCK_N"]),)  # noqa: E731
        _gemv_tuned[grid](*args, **flags)
    return out, res_out


def gemv(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, config: dict | None = None
) -> torch.Tensor:
    """x [1, K] @ weight.T (+ bias) for weight [N, K] -> [1, N] (see `gemv_applies`).
    The tile is tuned per shape on the first call (which must not be inside a CUDA graph
    capture: the decode graphs warm each bucket up before capturing it); `config` (BLOCK_N,
    num_warps, num_stages) skips the tuning."""
    return _launch_gemv(x, weight, bias, config)[0]


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
