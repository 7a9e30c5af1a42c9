"""The KV block pool: reference counts, the prefix cache and LRU eviction.

Block 0 is the null block: it pads block tables and is never handed out. Every other block is
in exactly one of three places:

    referenced (ref_cnt > 0)  |  free, uncached (reused first)  |  free, cached (evicted LRU)

Free + cached-free = allocatable. Cached free blocks keep their KV so a later prefix hit can
take them back without recomputation.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from kvflow.core.hashing import BlockHash
from kvflow.core.kv_events import AllBlocksCleared, BlockRemoved, KVEvent

NULL_BLOCK_ID = 0
_NULL, _FREE, _CACHED, _HELD, _SHARED = b"n.chs"  # block_states()' characters


@dataclass(slots=True, eq=False)
class KVCacheBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 2:
            raise ValueError(
                f"num_blocks must be at least 2 (block 0 is reserved), got {num_blocks}"
            )
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.null_block = self.blocks[NULL_BLOCK_ID]
        self.null_block.ref_cnt = 1  # held forever
        self._free_uncached: OrderedDict[int, KVCacheBlock] = OrderedDict(
            (b.block_id, b) for b in self.blocks[1:]
        )
        self._free_cached: OrderedDict[int, KVCacheBlock] = OrderedDict()  # oldest first
        self._cached: dict[BlockHash, KVCacheBlock] = {}
        self.events: list[KVEvent] | None = None  # None: not recording (`record_events`)
        # one state character per block, kept as blocks move (see `block_states`)
        self._states = bytearray(b".") * num_blocks
        self._states[NULL_BLOCK_ID] = _NULL

    def record_events(self) -> None:
        """From now on, append a KV event for every change to the prefix cache."""
        if self.events is None:
            self.events = []

    def take_events(self) -> list[KVEvent]:
        """The events recorded since the last call, oldest first (the caller owns them)."""
        events, self.events = self.events, ([] if self.events is not None else None)
        return events or []

    @property
    def cached_hashes(self) -> set[BlockHash]:
        """Every hash in the prefix cache now (what a KV-event subscriber should hold)."""
        return set(self._cached)

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now (uncached free + evictable cached)."""
        return len(self._free_uncached) + len(self._free_cached)

    @property
    def usage(self) -> float:
        """Fraction of allocatable blocks held by requests (cached free blocks count as free)."""
        return 1.0 - self.num_free_blocks / (self.num_blocks - 1)

    def get_new_blocks(self, n: int) -> list[KVCacheBlock]:
        """Take `n` blocks (ref_cnt 1 each): uncached ones first, then evict the LRU cached ones.

        The caller checks `num_free_blocks` first; asking for more is a bug and raises.
        """
        if n > self.num_free_blocks:
            raise RuntimeError(f"asked for {n} blocks with {self.num_free_blocks} free")
        out = []
        for _ in range(n):
            if self._free_uncached:
                _, block = self._free_uncached.popitem(last=False)
            else:
                _, block = self._free_cached.popitem(last=False)
                self._evict(block)
            block.ref_cnt = 1
            self._states[block.block_id] = _HELD
            out.append(block)
        return out

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        return self._cached.get(block_hash)

    def touch(self, blocks: list[KVCacheBlock]) -> None:
        """Take a reference on prefix-cache hits; a free cached block leaves the eviction queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free_cached[block.block_id]
            block.ref_cnt += 1
            self._states[block.block_id] = _HELD if block.ref_cnt == 1 else _SHARED

    def cache_block(self, block: KVCacheBlock, block_hash: BlockHash) -> bool:
        """Register a full block under its hash. A hash that is already cached keeps its block.
        Returns whether the hash entered the cache now (the caller records BlockStored)."""
        if not self.enable_caching or block.block_hash is not None:
            return False
        if block_hash in self._cached:
            return False  # an identical block exists; this one stays uncached
        block.block_hash = block_hash
        self._cached[block_hash] = block
        return True

    def free_blocks(self, blocks: list[KVCacheBlock]) -> None:
        """Drop one reference each, in the order given (callers pass a request's blocks in
        reverse so its tail is evicted before its shared prefix)."""
        for block in blocks:
            if block.ref_cnt <= 0 or block is self.null_block:
                raise RuntimeError(f"double free of block {block.block_id}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.block_hash is None:
                    self._free_uncached[block.block_id] = block
                    self._states[block.block_id] = _FREE
                else:
                    self._free_cached[block.block_id] = block
                    self._states[block.block_id] = _CACHED
            elif block.ref_cnt == 1:
                self._states[block.block_id] = _HELD

    def uncache(self, block: KVCacheBlock) -> None:
        """Withdraw `block` from the prefix cache (no later request gets it as a hit); a free
        cached block becomes a plain free block. Its KV stays until the block is written again."""
        if block.block_hash is None:
            return
        self._evict(block)
        if block.ref_cnt == 0:
            del self._free_cached[block.block_id]
            self._free_uncached[block.block_id] = block
            self._states[block.block_id] = _FREE

    def reset_prefix_cache(self) -> None:
        """Forget every cached hash; free cached blocks become plain free blocks."""
        for block in self._cached.values():
            block.block_hash = None
        self._cached.clear()
        if self.events is not None:
            self.events.append(AllBlocksCleared())
        while self._free_cached:
            bid, block = self._free_cached.popitem(last=False)
            self._free_uncached[bid] = block
            self._states[bid] = _FREE

    def block_states(self) -> str:
        """One character per block, block 0 first: `n` the null block, `.` free, `c` free
        with a prefix-cache entry, `h` held by one request, `s` by more (a shared prefix).
        Kept up to date as blocks move, so this is a copy (a few microseconds per thousand
        blocks), never a pass over the blocks."""
        return self._states.decode("ascii")

    def _expected_state(self, block: KVCacheBlock) -> int:
        if block is self.null_block:
            return _NULL
        if block.ref_cnt == 0:
            return _FREE if block.block_hash is None else _CACHED
        return _HELD if block.ref_cnt == 1 else _SHARED

    def _evict(self, block: KVCacheBlock) -> None:
        del self._cached[block.block_hash]
        if self.events is not None:
            self.events.append(BlockRemoved([block.block_hash]))
        block.block_hash = None

    def check_invariants(self) -> None:
        """free + cached-free + referenced + null = total; the hash map and queues agree."""
        referenced = [b for b in self.blocks[1:] if b.ref_cnt > 0]
        assert self.null_block.ref_cnt == 1, "null block must stay held"
        assert len(referenced) + self.num_free_blocks + 1 == self.num_blocks, "block leak"
        assert all(b.ref_cnt == 0 and b.block_hash is None for b in self._free_uncached.values())
        assert all(b.ref_cnt == 0 and b.block_hash is not None for b in self._free_cached.values())
        assert not set(self._free_uncached) & set(self._free_cached)
        for h, b in self._cached.items():
            assert b.block_hash == h, "hash map out of sync"
        cached_ids = {b.block_id for b in self._cached.values()}
        assert set(self._free_cached) <= cached_ids
        expected = bytes(self._expected_state(b) for b in self.blocks)
        assert expected == bytes(self._states), "block states out of sync"
