"""A freed block keeps whatever K/V its last request wrote, NaN included when that request failed
in the model. A later request handed the block (and the null block padding every table) must
not read those slots: each backend's output with NaN there equals its output with zeros there.

The CPU backend runs every path it has (the native bf16 kernel, the float32 new-prompt path and
the reference); the Triton backend runs under Triton's interpreter without a GPU (prefill and
decode kernels, and the decode split among programs).
"""

from __future__ import annotations

import os

import pytest
import torch

from kvflow.attention import AttentionMetadata, paged_attention
from kvflow.attention.cpu import cpu_paged_attention

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported

BLOCK_SIZE = 4
HEADS, KV_HEADS, DIM = 4, 2, 64
# Request 0 holds block 3 (left full of NaN by a failed request) and writes 3 of its 4 slots;
# request 1 holds blocks 5, 2 (2 also stale: its tail slots past the context).
BLOCKS = [[3], [5, 2]]
STALE = [3, 2, 0]  # blocks whose slots past the contexts hold the failed request's K/V


def _step(computed: list[int], q_lens: list[int], dtype: torch.dtype, device: str, fill: float):
    """(q, k, v, cache, meta): the contexts' earlier K/V written, every other slot of the stale
    blocks `fill` (NaN: a failed request's leftovers; 0: a clean pool)."""
    gen = torch.Generator().manual_seed(7)
    cache = torch.zeros(2, 8, BLOCK_SIZE, KV_HEADS, DIM)
    cache[:, STALE] = fill
    for blocks, c in zip(BLOCKS, computed, strict=True):
        for p in range(c):  # the request's own earlier positions: finite
            cache[:, blocks[p // BLOCK_SIZE], p % BLOCK_SIZE] = torch.randn(
                2, KV_HEADS, DIM, generator=gen
            )
    tokens = sum(q_lens)
    q = torch.randn(tokens, HEADS, DIM, generator=gen)
    k, v = (torch.randn(tokens, KV_HEADS, DIM, generator=gen) for _ in range(2))
    meta = AttentionMetadata.build(q_lens, computed, BLOCKS, BLOCK_SIZE, device)
    on = {"dtype": dtype, "device": device}
    return q.to(**on), k.to(**on), v.to(**on), cache.to(**on), meta


STEPS = {  # (num_computed_tokens, query_lens)
    "prompts": ([0, 0], [3, 6]),
    "chunks": ([1, 2], [2, 3]),
    "decodes": ([2, 5], [1, 1]),
}


def _same_with_nan_or_zeros(backend, dtype: torch.dtype, device: str, **kwargs) -> None:
    for computed, q_lens in STEPS.values():
        runs = []
        for fill in (float("nan"), 0.0):
            q, k, v, cache, meta = _step(computed, q_lens, dtype, device, fill)
            runs.append(backend(q, k, v, cache, meta, DIM**-0.5, **kwargs))
        poisoned, clean = runs
        assert torch.isfinite(poisoned).all(), (computed, q_lens)
        assert torch.equal(poisoned, clean), (computed, q_lens)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["native", "float32"])
@pytest.mark.parametrize("window", [None, 2])
def test_cpu_backend_never_reads_stale_slots(dtype, window) -> None:
    extra = {} if window is None else {"sliding_window": window}
    _same_with_nan_or_zeros(cpu_paged_attention, dtype, "cpu", **extra)


def test_reference_never_reads_stale_slots() -> None:
    _same_with_nan_or_zeros(paged_attention, torch.float32, "cpu")


@pytest.mark.parametrize("splits", [1, 2])
def test_triton_backend_never_reads_stale_slots(splits) -> None:
    pytest.importorskip("triton")
    from kvflow.attention.triton_attn import triton_paged_attention

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        from support.triton_interpreter import patch_interpreter

        patch_interpreter()
    _same_with_nan_or_zeros(triton_paged_attention, torch.float32, device, splits=splits)
