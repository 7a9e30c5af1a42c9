"""Maps requests to KV blocks: prefix-cache lookup, slot allocation and freeing."""

from __future__ import annotations

from kvflow.core.block_pool import BlockPool, KVCacheBlock
from kvflow.core.hashing import BlockHash, hash_full_blocks
from kvflow.core.kv_events import BlockStored
from kvflow.core.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, enable_caching)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self._req_to_hashes: dict[str, list[BlockHash]] = {}
        self._num_cached_blocks: dict[str, int] = {}  # leading blocks already registered
        self.prefix_cache_queries = 0  # tokens looked up
        self.prefix_cache_hits = 0  # tokens found

    @property
    def usage(self) -> float:
        return self.pool.usage

    def get_block_ids(self, request_id: str, start: int = 0) -> list[int]:
        """The request's block ids from its `start`-th block on."""
        blocks = self.req_to_blocks.get(request_id, ())
        return [b.block_id for b in blocks[start:]] if start < len(blocks) else []

    def _hashes(self, request: Request) -> list[BlockHash]:
        known = self._req_to_hashes.get(request.request_id, [])
        if len(known) < request.num_tokens // self.block_size:
            known = hash_full_blocks(request.all_token_ids, self.block_size, known)
            self._req_to_hashes[request.request_id] = known
        return known

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """Longest run of cached full blocks that prefixes `request`'s tokens.

        Never covers the last token: it is recomputed so the step produces logits. Returns the
        blocks (not yet referenced: pass them to `allocate_slots`) and the tokens they cover.
        """
        if not self.enable_caching or request.skip_reading_prefix_cache:
            return [], 0
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVCacheBlock] = []
        for block_hash in self._hashes(request)[:max_blocks]:
            block = self.pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def record_prefix_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        """Count one admitted lookup (failed admissions are retried and not counted)."""
        self.prefix_cache_queries += num_tokens
        self.prefix_cache_hits += num_hit_tokens

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: list[KVCacheBlock] | None = None,
    ) -> list[KVCacheBlock] | None:
        """Make room for `num_new_tokens` more tokens of `request`, or return None if they don't fit.

            | computed (held) | new computed (prefix hits) | new tokens | <- after this call
            |<------------ blocks needed = cdiv(total, block_size) -------->|

        On success the request holds every block it needs and the newly allocated ones are
        returned; full blocks are registered in the prefix cache. On None nothing changed.
        """
        held = self.req_to_blocks.get(request.request_id, [])
        total = request.num_computed_tokens + num_new_tokens
        if not new_computed_blocks and total <= len(held) * self.block_size:  # most decodes
            if self.enable_caching:
                self._cache_full_blocks(request, held, min(total, request.num_tokens))
            return []
        new_computed_blocks = new_computed_blocks or []
        total += len(new_computed_blocks) * self.block_size
        num_new_blocks = cdiv(total, self.block_size) - len(held) - len(new_computed_blocks)
        evictable_hits = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        if num_new_blocks > self.pool.num_free_blocks - evictable_hits:
            return None
        self.pool.touch(new_computed_blocks)
        new_blocks = self.pool.get_new_blocks(max(num_new_blocks, 0))
        blocks = self.req_to_blocks.setdefault(request.request_id, [])
        blocks.extend(new_computed_blocks)
        blocks.extend(new_blocks)
        if self.enable_caching:
            self._cache_full_blocks(request, blocks, min(total, request.num_tokens))
        return new_blocks

    def _cache_full_blocks(
        self, request: Request, blocks: list[KVCacheBlock], num_tokens: int
    ) -> None:
        start = self._num_cached_blocks.get(request.request_id, 0)
        end = num_tokens // self.block_size
        if end <= start:
            return
        hashes = self._hashes(request)
        stored: list[int] = []  # block indices that entered the cache now
        for i in range(start, end):
            if self.pool.cache_block(blocks[i], hashes[i]):
                stored.append(i)
        self._num_cached_blocks[request.request_id] = end
        if stored and self.pool.events is not None:
            self._record_stored(request, hashes, stored)

    def _record_stored(self, request: Request, hashes: list[BlockHash], stored: list[int]) -> None:
        """One BlockStored per run of consecutive block indices (vLLM groups them so too)."""
        runs: list[list[int]] = []
        for i in stored:
            if runs and runs[-1][-1] == i - 1:
                runs[-1].append(i)
            else:
                runs.append([i])
        tokens, size = request.all_token_ids, self.block_size
        for run in runs:
            first, last = run[0], run[-1]
            self.pool.events.append(
                BlockStored(
                    [hashes[i] for i in run],
                    hashes[first - 1] if first else None,
                    list(tokens[first * size : (last + 1) * size]),
                )
            )

    def uncache(self, request: Request) -> None:
        """Withdraw the request's blocks from the prefix cache: a request that failed in the
        model may have left non-finite K/V in them, which a prefix hit would read as context."""
        for block in self.req_to_blocks.get(request.request_id, []):
            self.pool.uncache(block)

    def free(self, request: Request) -> None:
        """Release the request's blocks, tail first, so its shared prefix is evicted last."""
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self.pool.free_blocks(list(reversed(blocks)))
        self._req_to_hashes.pop(request.request_id, None)
        self._num_cached_blocks.pop(request.request_id, None)
