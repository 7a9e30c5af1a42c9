"""Resolved engine configuration: frozen dataclasses of plain values, and the liveness checks.

Nothing here reads a model from disk; the loader does that and passes plain numbers in.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CacheConfig:
    block_size: int
    num_blocks: int  # includes the reserved null block 0
    enable_prefix_caching: bool = True

    @property
    def servable_tokens(self) -> int:
        """C = (num_blocks - 1) * block_size: block 0 is never handed out."""
        return (self.num_blocks - 1) * self.block_size


@dataclass(frozen=True)
class SchedulerConfig:
    max_model_len: int
    max_num_batched_tokens: int
    max_num_seqs: int
    max_num_queued_reqs: int | None = None  # None: unbounded waiting queue


@dataclass(frozen=True)
class EngineConfig:
    cache: CacheConfig
    scheduler: SchedulerConfig

    @property
    def max_model_len(self) -> int:
        return self.scheduler.max_model_len


def resolve_max_model_len(cache: CacheConfig, model_context: int, requested: int | None) -> int:
    """Liveness point 1: the advertised context is exactly servable.

    `requested` None or -1 auto-fits to min(model context, servable tokens). Raises ValueError
    naming the numbers and the flag that fixes it when no request could ever be served.
    """
    servable = cache.servable_tokens
    geometry = (
        f"--num-blocks {cache.num_blocks} x --block-size {cache.block_size} "
        f"(block 0 is reserved) = {servable} servable tokens"
    )
    if cache.block_size < 1:
        raise ValueError(f"--block-size must be at least 1, got {cache.block_size}.")
    if servable < 2:
        raise ValueError(
            f"The KV cache cannot serve a single request: {geometry}. "
            f"Raise --num-blocks to at least 2 (or --kv-cache-memory)."
        )
    if requested is None or requested == -1:
        return min(model_context, servable)
    if requested < 2:
        raise ValueError(f"--max-model-len must be at least 2 (or -1 for auto), got {requested}.")
    if requested > servable:
        need = -(-requested // cache.block_size) + 1
        raise ValueError(
            f"--max-model-len {requested} exceeds what the KV cache can serve: {geometry}. "
            f"Lower --max-model-len to at most {servable}, or raise --num-blocks to at least {need}."
        )
    if requested > model_context:
        raise ValueError(
            f"--max-model-len {requested} exceeds the model's context length {model_context}."
        )
    return requested
