"""The attention cases the Triton backend is checked on (tests/attention, tests/gpu): random
q/k/v, metadata with shuffled blocks, and the cache with NaN outside every context."""

from __future__ import annotations

import torch

from kvflow.attention import AttentionMetadata, paged_attention

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2}


def setup_case(computed, q_lens, hq, hkv, dim, block_size, dtype, seed, cache_dtype=None):
    """Random q/k/v, metadata with shuffled block ids (never block 0, some spare blocks), and
    the cache twice: with finite garbage outside the contexts, and with NaN there instead."""
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [c + q for c, q in zip(computed, q_lens, strict=True)]
    need = [-(-n // block_size) + (b % 2) for b, n in enumerate(seq_lens)]  # odd b: a spare
    pool = (torch.randperm(sum(need) + 3, generator=gen) + 1).tolist()
    blocks = []
    for n in need:
        blocks.append(pool[:n])
        pool = pool[n:]
    num_blocks = sum(need) + 4
    cache_dtype = cache_dtype or dtype
    shape = (2, num_blocks, block_size, hkv, dim)
    garbage = torch.randn(shape, generator=gen).to(cache_dtype)
    unused = torch.ones(shape, dtype=torch.bool)
    for ids, n in zip(blocks, seq_lens, strict=True):
        for p in range(n):
            unused[:, ids[p // block_size], p % block_size] = False
    num_tokens = sum(q_lens)
    q = torch.randn(num_tokens, hq, dim, generator=gen).to(dtype)
    k = torch.randn(num_tokens, hkv, dim, generator=gen).to(dtype)
    v = torch.randn(num_tokens, hkv, dim, generator=gen).to(dtype)
    meta = AttentionMetadata.build(q_lens, computed, blocks, block_size, DEVICE)
    poisoned = garbage.masked_fill(unused, float("nan"))
    to = {"device": DEVICE}
    return q.to(**to), k.to(**to), v.to(**to), meta, garbage.to(**to), poisoned.to(**to), unused


def check_case(q, k, v, meta, garbage, poisoned, unused, window=None, tile=None):
    scale = q.shape[-1] ** -0.5
    ref_cache = garbage.clone()
    ref = paged_attention(q, k, v, ref_cache, meta, scale, sliding_window=window)
    from kvflow.attention.triton_attn import triton_paged_attention

    out = triton_paged_attention(q, k, v, poisoned, meta, scale, sliding_window=window, tile=tile)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert torch.isfinite(out).all()
    tol = TOLERANCE[q.dtype]
    torch.testing.assert_close(out, ref, atol=tol, rtol=tol)
    # the step's k/v landed where the reference put them; the rest of the cache is untouched
    expected = ref_cache.masked_fill(unused.to(ref_cache.device), float("nan"))
    torch.testing.assert_close(poisoned, expected, atol=0, rtol=0, equal_nan=True)
    return out


CASES = {
    # name: (num_computed_tokens, query_lens, Hq, Hkv, head_dim, block_size, window)
    "mixed-gqa4-bs16": ([0, 5, 20], [7, 3, 1], 8, 2, 64, 16, None),
    "decode-mqa-bs16-d128": ([3, 17, 0, 40], [1, 1, 1, 1], 4, 1, 128, 16, None),
    "prefill-mha-bs32-two-tiles": ([0, 0], [70, 9], 2, 2, 128, 32, None),
    "prefix-chunks-gqa3-bs3": ([10, 4], [6, 5], 6, 2, 64, 3, None),
    "mixed-gqa3-bs1": ([2, 0, 5], [3, 4, 1], 3, 1, 64, 1, None),
    "window-mixed-bs3": ([4, 0, 17], [5, 9, 1], 6, 3, 64, 3, 5),
    "window-decode-bs16": ([10, 1, 30], [1, 1, 1], 8, 2, 128, 16, 3),
    "window-1-prefix-bs32": ([33, 0], [4, 3], 4, 1, 64, 32, 1),
    # 64-query tile over 32-key tiles: late rows see nothing in the first key tile
    "window-long-chunk-d256": ([3], [60], 2, 2, 256, 16, 4),
}
