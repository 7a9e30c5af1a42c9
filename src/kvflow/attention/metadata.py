"""Per-step attention metadata: where each scheduled token's K/V goes and what each request sees.

Requests are packed in order into one flat batch of T tokens. For request b with
`c = num_computed_tokens[b]` tokens already in the cache and `q = query_lens[b]` new tokens:

    context positions   0 ........... c-1 | c ........ c+q-1
                        cached (in blocks) | scheduled now (tokens query_start_loc[b] ..)
    seq_lens[b] = c + q

The token at position p lives in slot `block_ids[b][p // block_size] * block_size + p % block_size`.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import numpy as np
import torch

from kvflow.transfer import to_device


@dataclass(frozen=True)
class AttentionMetadata:
    """Everything an attention backend needs for one forward pass; built once per step.

    slot_mapping: int64 [T], the KV-cache slot of every scheduled token.
    query_start_loc: int32 [B+1], cumulative query lengths; request b owns tokens
        query_start_loc[b] .. query_start_loc[b+1]-1.
    seq_lens: int32 [B], context length of each request after this step's tokens.
    block_tables: int32 [B, max_blocks], padded with 0 (the null block, never read unmasked).
    """

    slot_mapping: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    max_query_len: int
    max_seq_len: int
    block_size: int
    # Per-step values every layer would otherwise rebuild (masks, gather indices): filled by the
    # backend on first use, shared by all layers of the step.
    memo: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def num_reqs(self) -> int:
        return int(self.seq_lens.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.slot_mapping.shape[0])

    @classmethod
    def build(
        cls,
        query_lens: list[int],
        num_computed_tokens: list[int],
        block_ids: list[list[int]],
        block_size: int,
        device: torch.device | str,
    ) -> AttentionMetadata:
        """`from_table` over `block_ids` packed into a table (callers without persistent rows)."""
        if not (len(num_computed_tokens) == len(block_ids) == len(query_lens)):
            raise ValueError("query_lens, num_computed_tokens and block_ids differ in length")
        table, num_blocks = pack_block_ids(block_ids)
        return cls.from_table(
            np.asarray(query_lens, dtype=np.int64),
            np.asarray(num_computed_tokens, dtype=np.int64),
            table,
            num_blocks,
            block_size,
            device,
        )

    @classmethod
    def from_table(
        cls,
        q_lens: np.ndarray,
        computed: np.ndarray,
        table: np.ndarray,
        num_blocks: np.ndarray,
        block_size: int,
        device: torch.device | str,
    ) -> AttentionMetadata:
        """Vectorized numpy, no per-token Python work. Row b of `table` [B, W] holds request b's
        `num_blocks[b]` blocks, then zeros; `q_lens` and `computed` are int64 [B].

        Raises ValueError if a request's blocks cannot hold its context or a query length is < 1
        (both are caller bugs: the scheduler allocates slots before scheduling tokens).
        """
        num_reqs = len(q_lens)
        seq_lens = computed + q_lens
        if num_reqs and q_lens.min() < 1:
            raise ValueError(f"every scheduled request needs >= 1 token, got {q_lens.tolist()}")
        if np.any(num_blocks * block_size < seq_lens):
            bad = int(np.argmax(num_blocks * block_size < seq_lens))
            raise ValueError(
                f"request {bad} has {num_blocks[bad]} blocks of {block_size} tokens "
                f"for a context of {seq_lens[bad]} tokens"
            )
        query_start_loc = np.zeros(num_reqs + 1, dtype=np.int64)
        np.cumsum(q_lens, out=query_start_loc[1:])
        slot_mapping = _slot_mapping(table, q_lens, computed, query_start_loc, block_size)
        return cls(
            slot_mapping=to_device(slot_mapping, torch.int64, device),
            query_start_loc=to_device(query_start_loc, torch.int32, device),
            seq_lens=to_device(seq_lens, torch.int32, device),
            block_tables=to_device(table, torch.int32, device),
            max_query_len=int(q_lens.max()) if num_reqs else 0,
            max_seq_len=int(seq_lens.max()) if num_reqs else 0,
            block_size=block_size,
        )


def token_positions(query_lens: list[int], num_computed_tokens: list[int]) -> np.ndarray:
    """int64 [T]: the position of every scheduled token (c_b .. c_b + q_b - 1 per request)."""
    q_lens = np.asarray(query_lens, dtype=np.int64)
    computed = np.asarray(num_computed_tokens, dtype=np.int64)
    starts = np.cumsum(q_lens) - q_lens
    total = int(q_lens.sum())
    return np.arange(total, dtype=np.int64) - np.repeat(starts - computed, q_lens)


def pack_block_ids(block_ids: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    """(table int32 [B, max(1, widest row)], block counts int64 [B]): row b is block_ids[b]
    then zeros (the null block)."""
    num_blocks = np.fromiter(map(len, block_ids), dtype=np.int64, count=len(block_ids))
    width = max(int(num_blocks.max()) if num_blocks.size else 0, 1)
    table = np.zeros((len(block_ids), width), dtype=np.int32)
    flat = np.fromiter(
        itertools.chain.from_iterable(block_ids), dtype=np.int32, count=int(num_blocks.sum())
    )
    table[np.arange(width)[None, :] < num_blocks[:, None]] = flat
    return table, num_blocks


def _slot_mapping(
    table: np.ndarray,
    q_lens: np.ndarray,
    computed: np.ndarray,
    query_start_loc: np.ndarray,
    block_size: int,
) -> np.ndarray:
    req = np.repeat(np.arange(len(q_lens)), q_lens)
    positions = np.arange(int(query_start_loc[-1])) - query_start_loc[req] + computed[req]
    blocks = table[req, positions // block_size].astype(np.int64)
    return blocks * block_size + positions % block_size
