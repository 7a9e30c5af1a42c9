"""The greedy sampler's reduction on CUDA: argmax and bad-row flags of float32 logits."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvflow.kernels.triton.pdl import pdl_args, pdl_start

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
