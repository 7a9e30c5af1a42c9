"""The Triton paged-attention backend against the torch reference (`torch_ref.paged_attention`).

Without a GPU the kernel runs under Triton's interpreter (TRITON_INTERPRET=1, numpy on the CPU),
so shapes are small. Every case poisons the cache slots outside the requests' contexts (the
null block, spare blocks, slots past seq_len) with NaN for the Triton call: masking by seq_len
must keep them out. The reference reads the same cache with finite garbage in those slots
instead, so the comparison does not hang on how the reference treats NaN in masked slots.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported

triton = pytest.importorskip("triton")

from kvflow.attention import AttentionMetadata, paged_attention  # noqa: E402
from kvflow.attention.triton_attn import triton_paged_attention  # noqa: E402
from support.attention_cases import (  # noqa: E402
    CASES,
    DEVICE,
    TOLERANCE,
    check_case,
    setup_case,
)

if os.environ.get("TRITON_INTERPRET") == "1":  # its bugs, patched outside the kernel
    from support.triton_interpreter import patch_interpreter

    patch_interpreter()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_matches_reference(case, dtype) -> None:
    computed, q_lens, hq, hkv, dim, block_size, window = case
    inputs = setup_case(computed, q_lens, hq, hkv, dim, block_size, dtype, seed=sum(q_lens) + dim)
    check_case(*inputs, window=window)


@pytest.mark.parametrize("dim", [64, 128])
@pytest.mark.parametrize("group", [1, 3, 4])
@pytest.mark.parametrize("block_size", [1, 3, 16, 32])
def test_block_size_group_head_dim_grid(block_size, group, dim) -> None:
    """A cached-prefix chunk, a fresh prefill and a decode, crossing block boundaries."""
    seed = block_size * 100 + group * 10 + dim
    check_case(
        *setup_case([20, 0, 33], [6, 9, 1], 2 * group, 2, dim, block_size, torch.float32, seed)
    )


@pytest.mark.parametrize("dim", [32, 80, 256])
def test_other_head_dims(dim) -> None:
    """Any power of two 32..256 (256 takes the narrower key tile), and a padded one (80)."""
    check_case(*setup_case([5, 0], [1, 3], 4, 2, dim, 16, torch.float32, seed=dim))


@pytest.mark.parametrize("tile", [(128, 4), (256, 8)])
@pytest.mark.parametrize("window", [None, 40])
def test_decode_key_tiles(tile, window) -> None:
    """The longer key tiles a small decode batch takes on a card (`_key_tile`), over contexts
    shorter than, equal to and longer than one tile, with and without a window."""
    computed = [3, tile[0] - 1, tile[0] + 37]
    check_case(
        *setup_case(computed, [1, 1, 1], 8, 2, 64, 16, torch.bfloat16, seed=tile[0]), window, tile
    )


def test_layers_share_the_step_memo() -> None:
    """Two layers of one step: the query-tile map is built once and reused, both layers exact."""
    q, k, v, meta, garbage, poisoned, unused = setup_case(
        [0, 6, 2], [5, 1, 4], 4, 2, 64, 4, torch.float32, seed=7
    )
    check_case(q, k, v, meta, garbage, poisoned, unused)
    memo = dict(meta.memo)
    assert any(key[0] == "triton_query_tiles" for key in memo if isinstance(key, tuple))
    torch.manual_seed(8)  # the next layer: same step (block layout), other values
    garbage2 = torch.randn_like(garbage)
    poisoned2 = garbage2.masked_fill(unused.to(DEVICE), float("nan"))
    q2, k2, v2 = torch.randn_like(q), torch.randn_like(k), torch.randn_like(v)
    check_case(q2, k2, v2, meta, garbage2, poisoned2, unused)
    for key, value in memo.items():
        assert meta.memo[key] is value


def test_strided_query_view_and_bf16_cache() -> None:
    """q as a column slice of a fused projection (as llama.py passes it), cache in another
    dtype than q (the reference casts K/V to q's dtype)."""
    q, k, v, meta, garbage, poisoned, unused = setup_case(
        [3, 0], [2, 5], 4, 2, 64, 16, torch.float32, seed=3, cache_dtype=torch.bfloat16
    )
    fused = torch.cat([q, k], dim=1)  # [T, Hq + Hkv, D]
    q_view = fused[:, : q.shape[1]]
    assert not q_view.is_contiguous()
    out = check_case(q_view, k, v, meta, garbage, poisoned, unused)
    assert out.is_contiguous()


def test_empty_batch() -> None:
    meta = AttentionMetadata.build([], [], [], 16, DEVICE)
    q = torch.randn(0, 4, 64, device=DEVICE)
    kv = torch.randn(0, 2, 64, device=DEVICE)
    cache = torch.zeros(2, 3, 16, 2, 64, device=DEVICE)
    out = triton_paged_attention(q, kv, kv, cache, meta, 0.125)
    assert out.shape == q.shape


@pytest.mark.parametrize("heads, head_dim", [(2, 64), (3, 48)])
def test_write_kv_from_a_fused_projection_matches_index_copy(heads, head_dim) -> None:
    """`write_kv` (one kernel for k and v) stores what `write_kv_cache` stores, reading k and v
    where the fused qkv projection leaves them, and touches no other slot."""
    from kvflow.attention import write_kv_cache
    from kvflow.attention.triton_attn import write_kv

    gen = torch.Generator().manual_seed(heads)
    tokens, q_heads = 5, 4
    qkv = torch.randn(tokens, (q_heads + 2 * heads) * head_dim, generator=gen).to(DEVICE)
    k = qkv[:, q_heads * head_dim : (q_heads + heads) * head_dim].view(tokens, heads, head_dim)
    v = qkv[:, (q_heads + heads) * head_dim :].view(tokens, heads, head_dim)
    cache = torch.randn(2, 4, 4, heads, head_dim, generator=gen).to(DEVICE, torch.bfloat16)
    expected = cache.clone()
    slots = torch.tensor([5, 0, 15, 8, 9], device=DEVICE)
    write_kv_cache(k, v, expected, slots)
    write_kv(k, v, cache, slots)
    assert torch.equal(cache, expected)


DECODE_CASES = {
    # name: (num_computed_tokens, Hq, Hkv, head_dim, block_size, window)
    "one-request-first-token": ([0], 8, 2, 64, 16, None),
    "block-edges-bs16": ([15, 16, 31, 32, 47], 8, 2, 64, 16, None),
    "many-blocks-bs3-mqa": ([2, 3, 29, 40], 6, 1, 64, 3, None),
    "bs1-mha-d128": ([0, 7, 12], 2, 2, 128, 1, None),
    "window-bs4": ([3, 9, 21], 8, 2, 64, 4, 5),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", DECODE_CASES.values(), ids=DECODE_CASES.keys())
def test_decode_path_matches_reference_and_the_varlen_path(case, dtype) -> None:
    """Decode-only steps (max_query_len 1) take the DECODE path: no tile map is built, the output matches the reference and is bitwise the varlen path's (the same
    step with max_query_len 2, which keeps the tile sizes for groups up to 8)."""
    import dataclasses

    computed, hq, hkv, dim, block_size, window = case
    q_lens = [1] * len(computed)
    inputs = setup_case(computed, q_lens, hq, hkv, dim, block_size, dtype, seed=sum(computed) + dim)
    q, k, v, meta, garbage, poisoned, unused = inputs
    varlen_cache = poisoned.clone()
    out = check_case(*inputs, window=window)
    assert not _has_tile_map(meta)
    varlen_meta = dataclasses.replace(meta, max_query_len=2, memo={})
    varlen = triton_paged_attention(
        q, k, v, varlen_cache, varlen_meta, dim**-0.5, sliding_window=window
    )
    assert _has_tile_map(varlen_meta)
    assert torch.equal(out, varlen)


def _has_tile_map(meta: AttentionMetadata) -> bool:
    return any(isinstance(key, tuple) and key[0] == "triton_query_tiles" for key in meta.memo)


def _rope(positions: torch.Tensor, dim: int, dtype: torch.dtype) -> tuple:
    """cos, sin [T, 1, D] as `RotaryEmbedding` gives them: views of one [T, 2, D] block."""
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, dim, 2).float() / dim))
    freqs = positions[:, None].float() * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    block = torch.stack((emb.cos(), emb.sin()), dim=1).to(dtype).to(DEVICE)
    return block[:, :1], block[:, 1:]


def _rotated(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """transformers' rotate-half, each op rounded to x's dtype (torch's eager ops)."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    "computed, q_lens, dim",
    [([3, 17, 0, 40], [1, 1, 1, 1], 64), ([5, 0, 20], [1, 4, 2], 64), ([9, 2], [1, 1], 80)],
    ids=["decode", "mixed", "decode-d80"],
)
def test_rotary_in_the_backend_is_rotation_then_attention(computed, q_lens, dim, dtype) -> None:
    """`rotary=(cos, sin)` with q and k unrotated, as views of one fused projection: what the
    reference gives for the rotated q and k, and the cache holds the rotated k (a decode
    rotates and stores inside the attention kernel; other steps rotate q in place and k as
    `write_kv` stores it)."""
    hq, hkv = 4, 2
    q, k, v, meta, garbage, poisoned, unused = setup_case(
        computed, q_lens, hq, hkv, dim, 16, dtype, seed=sum(computed) + dim
    )
    positions = torch.tensor(
        [c + i for c, n in zip(computed, q_lens, strict=True) for i in range(n)]
    )
    cos, sin = _rope(positions, dim, dtype)
    fused = torch.cat([q, k, v], dim=1)  # [T, Hq + 2 Hkv, D]: strided views, as llama.py
    q_view, k_view, v_view = fused[:, :hq], fused[:, hq : hq + hkv], fused[:, hq + hkv :]
    scale = dim**-0.5
    ref_cache = garbage.clone()
    ref = paged_attention(_rotated(q, cos, sin), _rotated(k, cos, sin), v, ref_cache, meta, scale)
    k_before = k_view.clone()
    out = triton_paged_attention(q_view, k_view, v_view, poisoned, meta, scale, rotary=(cos, sin))
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out, ref, atol=tol, rtol=tol)
    expected = ref_cache.masked_fill(unused.to(ref_cache.device), float("nan"))
    torch.testing.assert_close(poisoned, expected, atol=0, rtol=0, equal_nan=True)
    assert torch.equal(k_view, k_before)  # k is stored rotated, not rotated in place


@pytest.mark.parametrize("rotary", [False, True])
@pytest.mark.parametrize("window", [None, 90])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_split_decode_matches_reference(dtype, window, rotary) -> None:
    """A decode step whose keys are cut among programs (`splits`, as a card does at small
    batch): contexts of one key tile or less (one program), a few tiles and many (up to all
    4 chunks), block edges, a window, rotary in the kernel (the program with the last keys
    stores the token's k/v); the merged result is the reference's, the cache holds what the
    reference wrote, and every split counter is back at 0."""
    from kvflow.attention.triton_attn import _COUNTERS

    computed = [3, 63, 64, 300, 700, 1000]
    q, k, v, meta, garbage, poisoned, unused = setup_case(
        computed, [1] * len(computed), 8, 2, 64, 16, dtype, seed=11 + (window or 0) + rotary
    )
    scale = 64**-0.5
    extra = {} if window is None else {"sliding_window": window}
    ref_cache = garbage.clone()
    if rotary:
        cos, sin = _rope(torch.tensor(computed), 64, dtype)
        ref_q, ref_k = _rotated(q, cos, sin), _rotated(k, cos, sin)
        extra["rotary"] = (cos, sin)
    else:
        ref_q, ref_k = q, k
    ref = paged_attention(ref_q, ref_k, v, ref_cache, meta, scale, **_without_rotary(extra))
    out = triton_paged_attention(q, k, v, poisoned, meta, scale, splits=4, **extra)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out, ref, atol=tol, rtol=tol)
    expected = ref_cache.masked_fill(unused.to(ref_cache.device), float("nan"))
    torch.testing.assert_close(poisoned, expected, atol=0, rtol=0, equal_nan=True)
    assert all(int(c.count_nonzero()) == 0 for held in _COUNTERS.values() for c in held)
    assert _COUNTERS  # the split path ran


def _without_rotary(extra: dict) -> dict:
    return {key: value for key, value in extra.items() if key != "rotary"}
