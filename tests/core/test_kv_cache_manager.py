from __future__ import annotations

from kvflow.core.kv_cache_manager import KVCacheManager
from kvflow.core.request import Request


def req(rid, tokens, max_tokens=8):
    return Request(rid, list(tokens), max_tokens)


def test_allocate_exact_blocks_and_none_without_side_effects():
    kv = KVCacheManager(num_blocks=5, block_size=4)
    a = req("a", range(9))
    assert [b.block_id for b in kv.allocate_slots(a, 9)] == [1, 2, 3]
    b = req("b", range(100, 108))
    assert kv.allocate_slots(b, 8) is None  # needs 2, only 1 free
    assert kv.get_block_ids("b") == [] and kv.pool.num_free_blocks == 1
    a.num_computed_tokens = 9
    a.output_token_ids.append(5)
    assert kv.allocate_slots(a, 1) == []  # token 10 still fits in block 3
    kv.free(a)
    kv.pool.check_invariants()
    assert kv.pool.num_free_blocks == 4


def test_prefix_hit_never_covers_last_token_and_is_shared():
    kv = KVCacheManager(num_blocks=10, block_size=4)
    a = req("a", range(12))
    kv.allocate_slots(a, 12)
    a.num_computed_tokens = 12
    same = req("same", range(12))
    hits, n = kv.get_computed_blocks(same)
    assert n == 8 and [b.block_id for b in hits] == [1, 2]  # the 3rd block holds the last token
    longer = req("longer", list(range(12)) + [50])
    hits, n = kv.get_computed_blocks(longer)
    assert n == 12 and [b.block_id for b in hits] == [1, 2, 3]
    new = kv.allocate_slots(longer, 1, hits)
    assert [b.block_id for b in new] == [4]
    assert [b.block_id for b in hits] == kv.get_block_ids("longer")[:3]
    assert all(b.ref_cnt == 2 for b in hits)
    kv.free(a)
    kv.free(longer)
    kv.pool.check_invariants()
    assert kv.usage == 0.0


def test_free_in_reverse_keeps_prefix_cached_longest():
    kv = KVCacheManager(num_blocks=5, block_size=2)
    a = req("a", range(8))
    kv.allocate_slots(a, 8)  # blocks 1..4, all full and cached
    a.num_computed_tokens = 8
    kv.free(a)
    b = req("b", range(100, 102))
    assert [x.block_id for x in kv.allocate_slots(b, 2)] == [4]  # a's tail evicted first
    hits, n = kv.get_computed_blocks(req("c", range(8)))
    assert [x.block_id for x in hits] == [1, 2, 3] and n == 6


def test_evictable_hits_count_against_free_blocks():
    kv = KVCacheManager(num_blocks=4, block_size=2)
    a = req("a", range(6))
    kv.allocate_slots(a, 6)
    a.num_computed_tokens = 6
    kv.free(a)  # 3 cached free blocks
    b = req("b", list(range(4)) + [9, 9, 9])  # hits 2 blocks, needs 2 more: 1 left -> None
    hits, n = kv.get_computed_blocks(b)
    assert n == 4
    assert kv.allocate_slots(b, 3, hits) is None
    assert all(x.ref_cnt == 0 for x in hits)
    kv.pool.check_invariants()
