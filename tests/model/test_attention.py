"""The reference paged attention and the CPU backend against a naive per-request, per-query loop."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvflow.attention import AttentionMetadata, paged_attention, token_positions
from kvflow.attention.cpu import cpu_paged_attention
from kvflow.kernels.cpu import build


def _layout(rng: np.random.Generator, seq_lens: list[int], block_size: int) -> list[list[int]]:
    """Shuffled, non-contiguous block ids (never block 0) covering each context."""
    need = [-(-n // block_size) + int(rng.integers(0, 2)) for n in seq_lens]
    pool = rng.permutation(np.arange(1, sum(need) * 2 + 1)).tolist()
    out = []
    for n in need:
        out.append(pool[:n])
        pool = pool[n:]
    return out


def _naive(q, k_ctx, v_ctx, computed, scale, window):
    """q [q_len, Hq, D] at positions computed.., context [seq_len, Hkv, D], float64 math."""
    group = q.shape[1] // k_ctx.shape[1]
    out = torch.empty_like(q, dtype=torch.float64)
    for i in range(q.shape[0]):
        pos = computed + i
        lo = 0 if window is None else max(0, pos - window + 1)
        for h in range(q.shape[1]):
            keys = k_ctx[lo : pos + 1, h // group].double()
            vals = v_ctx[lo : pos + 1, h // group].double()
            weights = torch.softmax(keys @ q[i, h].double() * scale, dim=0)
            out[i, h] = weights @ vals
    return out


CASES = [
    # (num_computed_tokens, query_lens, Hq, Hkv, head_dim, block_size, window)
    ([0, 5, 9], [7, 3, 1], 8, 2, 64, 4, None),  # mixed prefill / chunk / decode, GQA
    ([3, 12, 0, 6], [1, 1, 1, 1], 4, 1, 128, 4, None),  # decode fast path, MQA
    ([0, 2], [13, 6], 4, 4, 128, 8, None),  # MHA, crossing 8-token blocks
    ([4, 0, 17], [5, 9, 1], 6, 3, 64, 4, 5),  # sliding window
    ([10, 1], [1, 1], 8, 2, 64, 4, 3),  # sliding window, decode path
    ([0, 0, 0], [7, 3, 12], 8, 2, 64, 4, None),  # new prompts only
    ([0, 0], [9, 4], 6, 3, 64, 4, 3),  # new prompts only, sliding window
    ([0, 0, 0], [6, 6, 6], 8, 2, 64, 4, None),  # new prompts of one length: causal SDPA, no mask
    ([0], [9], 4, 1, 32, 4, 9),  # one new prompt, MQA, a window as long as the prompt
    ([0, 0], [7, 7], 6, 3, 64, 4, 3),  # one length, a shorter window: the masked path
]


NATIVE_CASES = [  # shapes for the native kernel (every bf16 step with a head dim it takes)
    ([0, 20, 3], [40, 17, 1], 9, 3, 64, 16, None),  # prompt, chunk and decode; tiles of 16 tokens
    ([50, 0], [33, 70], 8, 2, 128, 16, 24),  # a window shorter than a tile's span of keys
    ([0], [35], 8, 1, 256, 5, None),  # the largest head dim, MQA: 8 query rows per token
    ([10, 0], [18, 21], 6, 2, 80, 4, 1),  # a window of one: chunks with no visible key for a row
    ([0, 16, 31, 2], [1, 1, 1, 1], 9, 3, 64, 16, None),  # SmolLM2's heads, block boundaries
    ([5, 0, 40], [1, 1, 1], 4, 4, 128, 3, None),  # block size not a power of two
    ([7, 20], [1, 1], 8, 2, 32, 1, None),  # one-token blocks
    ([30, 3, 11], [1, 1, 1], 8, 2, 64, 16, 6),  # sliding window
    ([5 * i for i in range(9)], [1] * 9, 9, 3, 64, 16, None),  # batch >= 4 x threads: per request
    ([33, 70, 0], [1, 1, 1], 6, 2, 80, 16, None),  # head dim a multiple of 16, not of 64
    ([33, 70], [1, 1], 8, 1, 256, 16, 50),  # the largest head dim, MQA, window over blocks
    ([9, 4], [1, 1], 4, 2, 40, 4, None),  # head dim not a multiple of 16: the reference runs
    ([700, 300], [1, 1], 7, 1, 64, 16, None),  # 7 query rows a KV head: 4, then 3
    ([2100], [1], 9, 3, 64, 16, None),  # a lone long context: heads split in parts of keys
    ([2100], [1], 9, 3, 64, 16, 1000),  # the same through a window: parts of the window's keys
    ([1300, 40], [1, 25], 8, 2, 128, 16, None),  # a split decode head beside a prompt chunk
    ([600], [1], 4, 4, 64, 5, None),  # MHA, blocks of 5: at most two parts of 300 keys
    ([0], [300], 4, 2, 64, 16, None),  # a long prompt: 38 blocks of 16 query rows, 10 key chunks
    ([100, 0], [50, 37], 9, 3, 32, 16, 40),  # a chunk windowed from key 61; 16 rows: 5.3 tokens
    ([10, 0], [18, 21], 6, 2, 64, 4, 1),  # a window of one on tiles: most chunks hidden from a row
    ([45, 3], [20, 2], 2, 2, 128, 7, None),  # one query row a token (MHA), blocks of 7
]


def _check_backend(case, backend, dtype, tol: float) -> None:
    """Run `backend` on random inputs for `case` and compare with the naive float64 loop."""
    computed, q_lens, hq, hkv, dim, block_size, window = case
    rng = np.random.default_rng(len(q_lens) * 31 + dim + block_size)
    torch.manual_seed(int(rng.integers(0, 1 << 30)))
    seq_lens = [c + q for c, q in zip(computed, q_lens, strict=True)]
    blocks = _layout(rng, seq_lens, block_size)
    num_blocks = max(max(b) for b in blocks) + 1
    # garbage outside the contexts: NaN must not leak from slots no request owns
    cache = torch.full((2, num_blocks, block_size, hkv, dim), float("nan"), dtype=dtype)
    k_ctx = [torch.randn(n, hkv, dim).to(dtype) for n in seq_lens]
    v_ctx = [torch.randn(n, hkv, dim).to(dtype) for n in seq_lens]
    for b, c in enumerate(computed):  # the cached prefix, written slot by slot
        for p in range(c):
            block, off = blocks[b][p // block_size], p % block_size
            cache[0, block, off], cache[1, block, off] = k_ctx[b][p], v_ctx[b][p]
    q = torch.randn(sum(q_lens), hq, dim).to(dtype)
    k = torch.cat([k_ctx[b][c:] for b, c in enumerate(computed)])
    v = torch.cat([v_ctx[b][c:] for b, c in enumerate(computed)])
    meta = AttentionMetadata.build(q_lens, computed, blocks, block_size, "cpu")
    scale = dim**-0.5
    out = backend(q, k, v, cache, meta, scale, sliding_window=window)
    assert out.shape == q.shape and out.dtype == q.dtype
    start = 0
    for b, (c, n) in enumerate(zip(computed, q_lens, strict=True)):
        ref = _naive(q[start : start + n], k_ctx[b], v_ctx[b], c, scale, window)
        torch.testing.assert_close(out[start : start + n].double(), ref, atol=tol, rtol=tol)
        start += n
    for b, c in enumerate(computed):  # the new tokens landed in their slots
        for p in range(c, seq_lens[b]):
            block, off = blocks[b][p // block_size], p % block_size
            assert torch.equal(cache[0, block, off], k_ctx[b][p])
            assert torch.equal(cache[1, block, off], v_ctx[b][p])


@pytest.mark.parametrize("case", CASES)
def test_paged_attention_matches_naive(case) -> None:
    _check_backend(case, paged_attention, torch.float32, 1e-5)


@pytest.mark.parametrize("case", CASES + NATIVE_CASES)
@pytest.mark.parametrize("dtype, tol", [(torch.bfloat16, 2e-2), (torch.float32, 1e-5)])
def test_cpu_backend_matches_naive(case, dtype, tol) -> None:
    """bf16 cases run the native kernel (but a head dim it does not take), float32 ones the
    new-prompt path or the reference; all within rounding of the float64 answer (bf16 inputs
    are bf16 already, so only the output rounds)."""
    assert build.native_available(), "the native kernels should build on this machine"
    _check_backend(case, cpu_paged_attention, dtype, tol)


@pytest.fixture
def vector_prompts():
    """Prompts on the AVX-512 kernel, where the AMX tiles would take them."""
    lib = build.library()
    assert lib is not None
    lib.kvflow_attention_tiles(0)
    yield
    lib.kvflow_attention_tiles(1)


@pytest.mark.parametrize("case", [c for c in CASES + NATIVE_CASES if max(c[1]) > 1])
def test_native_vector_prompts_match_naive(case, vector_prompts) -> None:
    """The prompt kernel AMX replaces, still taken where tiles are missing or D is not a
    multiple of 32, kept checked on every CPU."""
    _check_backend(case, cpu_paged_attention, torch.bfloat16, 2e-2)


def test_prompts_take_amx_tiles_where_the_cpu_has_them() -> None:
    flags = set()
    for line in open("/proc/cpuinfo"):
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
            break
    lib = build.library()
    assert lib is not None
    assert bool(lib.kvflow_attention_tiles(-1)) == ({"amx_tile", "amx_bf16"} <= flags)


def test_metadata_build() -> None:
    meta = AttentionMetadata.build([3, 1, 2], [0, 5, 4], [[7, 2], [3, 9], [5, 1]], 4, "cpu")
    assert meta.query_start_loc.tolist() == [0, 3, 4, 6]
    assert meta.seq_lens.tolist() == [3, 6, 6]
    assert meta.block_tables.tolist() == [[7, 2], [3, 9], [5, 1]]
    # request 0: positions 0-2 in block 7; request 1: position 5 -> block 9 offset 1;
    # request 2: positions 4, 5 -> block 1 offsets 0, 1
    assert meta.slot_mapping.tolist() == [28, 29, 30, 37, 4, 5]
    assert meta.slot_mapping.dtype == torch.int64
    assert meta.query_start_loc.dtype == meta.seq_lens.dtype == meta.block_tables.dtype
    assert meta.block_tables.dtype == torch.int32
    assert (meta.max_query_len, meta.max_seq_len, meta.block_size) == (3, 6, 4)
    assert token_positions([3, 1, 2], [0, 5, 4]).tolist() == [0, 1, 2, 5, 4, 5]


def test_metadata_pads_block_tables_with_null_block() -> None:
    meta = AttentionMetadata.build([1, 6], [2, 0], [[4], [8, 3]], 4, "cpu")
    assert meta.block_tables.tolist() == [[4, 0], [8, 3]]


def test_metadata_rejects_too_few_blocks() -> None:
    with pytest.raises(ValueError, match="blocks"):
        AttentionMetadata.build([5], [0], [[1]], 4, "cpu")
