"""KV-cache events as plain records: what the block pool did to its prefix cache.

The pool appends them, in order, while recording is on; the engine drains them after each
step and hands them to a publisher outside `core/` (`kvflow.kv_events`), which encodes them
as vLLM's `KVEventBatch`. A subscriber that applies them in order knows exactly which block
hashes the pool holds in its prefix cache.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvflow.core.hashing import BlockHash


@dataclass(frozen=True, slots=True)
class BlockStored:
    """A run of consecutive full blocks entered the prefix cache. `parent_hash` is the hash of
    the block before the first (None for a prompt's first block); `token_ids` are the run's
    tokens, `block_size` per block."""

    block_hashes: list[BlockHash]
    parent_hash: BlockHash | None
    token_ids: list[int]


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """Cached blocks left the prefix cache (evicted for reuse)."""

    block_hashes: list[BlockHash]


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """The whole prefix cache was dropped."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared
