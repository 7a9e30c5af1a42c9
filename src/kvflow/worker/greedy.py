"""Greedy tokens and bad rows of raw logits in one reduction: the Triton kernels on CUDA,
the native kernel on the CPU (`kernels.cpu.ops.row_argmax`), a chunked torch reduction
elsewhere."""

from __future__ import annotations

from functools import cache

import torch
from torch import Tensor

from kvflow.kernels.cpu import build, ops

# (argmax [B], bad flags [B], both as one int64 [2, B] block or None)
RawArgmax = tuple[Tensor, Tensor, Tensor | None]


def raw_argmax(logits: Tensor) -> RawArgmax:
    """The greedy tokens and bad rows (see `SamplerOutput.bad_mask`) of raw logits (float32;
    on the CPU also bf16): on CUDA from two Triton kernels (`kernels.triton.argmax.argmax_rows`,
    which also lay out the block the host copies), elsewhere from `row_argmax`."""
    if logits.is_cuda:
        from kvflow.kernels.triton.argmax import argmax_rows  # triton: CUDA installs only

        ids_and_bad = argmax_rows(logits)
        return ids_and_bad[0], ids_and_bad[1], ids_and_bad
    argmax, row_max = row_argmax(logits)
    # not finite: x - x is NaN for NaN and +-inf
    return argmax, (row_max - row_max).ne(0), None


def row_argmax(logits: Tensor) -> tuple[Tensor, Tensor]:
    """(argmax int64 [B], max [B]) of each row of `logits` [B, V]: the first index holding the
    row's maximum, as `torch.argmax` gives it (a NaN counts as the maximum and is the maximum).
    float32 or bf16 on the CPU: the native kernel (one pass per row, rows split among the
    threads, a few times the torch reduction's speed: benchmarks/RESULTS.md); otherwise
    `chunked_argmax`."""
    on_cpu = logits.device.type == "cpu" and logits.dtype in (torch.float32, torch.bfloat16)
    if on_cpu and build.native_available():
        return ops.row_argmax(logits)
    return chunked_argmax(logits)


def chunked_argmax(logits: Tensor) -> tuple[Tensor, Tensor]:
    """`row_argmax` by torch: one reduction over the [B, C, V / C] view (C: `_num_chunks`),
    then one over the C chunk maxima, whose first maximum is the first chunk holding the row
    maximum; its offset in the chunk is that of the row maximum. torch reduces a whole row with
    one thread block, which at batch 1 cost 28 us for the argmax of 128256 logits on an H200,
    and 14 us more for the sum that flagged bad rows; here a small batch is cut into about 256
    rows, reduced at once."""
    batch, vocab = logits.shape
    chunks = _num_chunks(vocab, batch)
    width = vocab // chunks
    chunk_max, offsets = logits.reshape(batch, chunks, width).max(dim=-1)
    row_max, chunk = chunk_max.max(dim=-1)
    argmax = chunk * width + offsets.gather(1, chunk.unsqueeze(1)).squeeze(1)
    return argmax, row_max


@cache
def _num_chunks(vocab: int, batch: int) -> int:
    """`chunked_argmax`'s chunks per row: the largest divisor of `vocab` up to 256 / batch (1 for a
    prime vocab or from batch 129 on: enough rows already; narrower chunks only cost more)."""
    most = max(1, min(vocab, 256 // max(batch, 1)))
    return next(c for c in range(most, 0, -1) if vocab % c == 0)
