from __future__ import annotations

import pytest

from kvflow.core.block_pool import BlockPool
from kvflow.core.hashing import hash_block, hash_full_blocks


def ids(blocks):
    return [b.block_id for b in blocks]


def test_null_block_never_handed_out_and_uncached_fifo_order():
    pool = BlockPool(10)
    assert pool.num_free_blocks == 9
    first = pool.get_new_blocks(3)
    assert ids(first) == [1, 2, 3]
    pool.free_blocks(list(reversed(first)))  # freed tail first: 3, 2, 1 go to the back
    assert ids(pool.get_new_blocks(9)) == [4, 5, 6, 7, 8, 9, 3, 2, 1]
    assert pool.num_free_blocks == 0
    with pytest.raises(RuntimeError):
        pool.get_new_blocks(1)
    pool.check_invariants()


def test_uncached_blocks_reused_before_cached_ones_then_lru_eviction():
    pool = BlockPool(6)
    a = pool.get_new_blocks(3)  # 1, 2, 3
    h1 = hash_block(b"", [1, 2])
    h2 = hash_block(h1, [3, 4])
    pool.cache_block(a[0], h1)
    pool.cache_block(a[1], h2)
    pool.free_blocks(list(reversed(a)))  # 3 uncached; then 2, 1 cached in that LRU order
    pool.check_invariants()
    assert pool.usage == 0.0
    assert ids(pool.get_new_blocks(3)) == [4, 5, 3]  # every uncached block first
    assert pool.get_cached_block(h1) is a[0] and pool.get_cached_block(h2) is a[1]
    assert ids(pool.get_new_blocks(1)) == [2]  # least recently freed cached block evicted first
    assert pool.get_cached_block(h2) is None
    assert pool.get_cached_block(h1) is a[0]
    pool.check_invariants()


def test_touch_takes_cached_free_block_out_of_eviction_and_refcounts():
    pool = BlockPool(4)
    a = pool.get_new_blocks(1)
    h = hash_block(b"", [7])
    pool.cache_block(a[0], h)
    pool.free_blocks(a)
    assert pool.num_free_blocks == 3
    pool.touch([a[0]])
    pool.touch([a[0]])  # a second request shares it
    assert a[0].ref_cnt == 2 and pool.num_free_blocks == 2
    pool.free_blocks([a[0]])
    assert pool.num_free_blocks == 2  # still held once
    pool.free_blocks([a[0]])
    assert pool.num_free_blocks == 3 and pool.get_cached_block(h) is a[0]
    with pytest.raises(RuntimeError):
        pool.free_blocks([a[0]])
    pool.check_invariants()


def test_duplicate_hash_keeps_first_block_and_reset_clears_cache():
    pool = BlockPool(4)
    a, b = pool.get_new_blocks(2)
    h = hash_block(b"", [1])
    pool.cache_block(a, h)
    pool.cache_block(b, h)
    assert pool.get_cached_block(h) is a and b.block_hash is None
    pool.free_blocks([b, a])
    pool.reset_prefix_cache()
    assert pool.get_cached_block(h) is None
    assert ids(pool.get_new_blocks(3)) == [3, 2, 1]
    pool.check_invariants()


def test_uncache_withdraws_held_and_free_cached_blocks():
    pool = BlockPool(4)
    a, b = pool.get_new_blocks(2)
    ha, hb = hash_block(b"", [1]), hash_block(b"", [2])
    pool.cache_block(a, ha)
    pool.cache_block(b, hb)
    pool.free_blocks([b])  # b: free and cached; a: still held
    pool.uncache(a)
    pool.uncache(b)
    assert pool.get_cached_block(ha) is None and pool.get_cached_block(hb) is None
    pool.check_invariants()
    pool.free_blocks([a])  # a goes back as a plain free block, after b
    assert ids(pool.get_new_blocks(3)) == [3, 2, 1]
    pool.check_invariants()


def test_chained_hashes_depend_on_prefix_and_extend_incrementally():
    toks = list(range(10))
    full = hash_full_blocks(toks, 4, [])
    assert len(full) == 2
    assert hash_full_blocks(toks, 4, full[:1]) == full
    other = hash_full_blocks([99] + toks[1:], 4, [])
    assert other[1] != full[1]  # same second block, different parent
    assert hash_block(b"", [1, 2], b"lora") != hash_block(b"", [1, 2])


def test_pool_needs_an_allocatable_block():
    with pytest.raises(ValueError):
        BlockPool(1)
