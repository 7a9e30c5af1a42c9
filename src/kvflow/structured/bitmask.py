"""Runner side of constrained decoding: a matcher per request, and per step one token bitmask
for the constrained rows, filled in one batched call and applied to the logits in one call.

A request's matcher has accepted exactly its output tokens (`GrammarState.num_accepted`); the
runner advances it with each sampled token and, when a preempted request resumes, `sync`
rebuilds it if the tokens kept differ from those it accepted.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import xgrammar as xgr

from kvflow.transfer import to_device


class GrammarState:
    """One request's grammar matcher and how many of its output tokens it accepted. With
    `start_after` (a reasoning section's closing token ids) it is `waiting` until the output
    holds them: those tokens are free, and the grammar applies from the next one."""

    __slots__ = ("compiled", "matcher", "num_accepted", "start_after", "waiting", "_tail")

    def __init__(self, compiled: xgr.CompiledGrammar, start_after: tuple[int, ...] = ()) -> None:
        self.compiled = compiled
        self.matcher = xgr.GrammarMatcher(compiled)
        self.num_accepted = 0
        self.start_after = start_after
        self.waiting = bool(start_after)
        self._tail: list[int] = []

    def accept(self, token_id: int) -> bool:
        """Advance with a sampled token; False when the grammar does not allow it."""
        if self.waiting:
            self._tail = [*self._tail, token_id][-len(self.start_after) :]
            self.waiting = tuple(self._tail) != self.start_after
            self.num_accepted += 1
            return True
        if not self.matcher.accept_token(token_id):
            return False
        self.num_accepted += 1
        return True

    @property
    def terminated(self) -> bool:
        """The grammar has ended (it accepted a stop token): the request stops."""
        return self.matcher.is_terminated()

    def sync(self, output_token_ids: list[int]) -> bool:
        """Make the matcher match these output tokens (a resumed request's); False when the
        grammar rejects them."""
        if self.num_accepted == len(output_token_ids):
            return True
        self.matcher = xgr.GrammarMatcher(self.compiled)
        self.num_accepted = 0
        self.waiting = bool(self.start_after)
        self._tail = []
        return all(self.accept(t) for t in output_token_ids)


class GrammarMasker:
    """Fills and applies the step's token bitmask. Bits past the logits' vocabulary are never
    set; ids past the tokenizer's vocabulary (a padded logits tail) are never allowed."""

    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self.words = math.ceil(vocab_size / 32)
        self._batch = xgr.BatchGrammarMatcher()
        self._host = torch.empty((0, self.words), dtype=torch.int32)

    def fill(
        self,
        num_rows: int,
        rows: list[int],
        states: list[GrammarState],
        blocked: dict[int, list[int]] | None = None,
    ) -> tuple[torch.Tensor, list[int]]:
        """The int32 [num_rows, words] host bitmask: row rows[i] from states[i]'s matcher,
        other rows all ones; `blocked` (row -> token ids, e.g. EOS under min_tokens) clears
        those bits too. Also returns the constrained rows that allow no token at all."""
        if self._host.shape[0] < num_rows:
            size = max(num_rows, 2 * self._host.shape[0])
            self._host = torch.empty((size, self.words), dtype=torch.int32)
        bitmask = self._host[:num_rows]
        bitmask.fill_(-1)
        active = [(r, s.matcher) for r, s in zip(rows, states, strict=True) if not s.waiting]
        if active:  # a waiting row (still reasoning) keeps all ones
            matchers = [m for _, m in active]
            self._batch.batch_fill_next_token_bitmask(matchers, bitmask, [r for r, _ in active])
        view = bitmask.numpy().view(np.uint32)
        for row, ids in (blocked or {}).items():
            for t in ids:
                if 0 <= t < self.vocab_size:
                    view[row, t >> 5] &= np.uint32(~(1 << (t & 31)) & 0xFFFFFFFF)
        empty = [r for r in rows if not view[r].any()]
        return bitmask, empty

    def apply(self, logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
        """Set to -inf, in place, the logits of `rows` whose bit is 0 (float32 [B, V] logits)."""
        mask = (
            bitmask if self.device.type == "cpu" else to_device(bitmask, torch.int32, self.device)
        )
        xgr.apply_token_bitmask_inplace(logits, mask, vocab_size=self.vocab_size, indices=rows)


EMPTY_MASK_ERROR = (
    "the output constraint allows no next token here (e.g. it can only end, but min_tokens "
    "forbids the end-of-sequence token)"
)
REJECTED_ERROR = "the sampled token does not match the output constraint"


class StepMask:
    """One step's constrained rows: `rows[i]` (a position among the sampled rows) is masked by
    `states[i]`'s matcher; `empty` holds the positions whose mask allows no token."""

    def __init__(
        self,
        masker: GrammarMasker,
        rows: list[int],
        states: list[GrammarState],
        num_rows: int,
        blocked: dict[int, list[int]],
    ) -> None:
        self.masker = masker
        self.rows = rows
        self.states = states
        self.bitmask, empty = masker.fill(num_rows, rows, states, blocked)
        self.empty = set(empty)

    def apply(self, logits: torch.Tensor) -> None:
        self.masker.apply(logits, self.bitmask, self.rows)

    def advance(self, token_ids: list[int], live: list[bool]) -> tuple[set[int], dict[int, str]]:
        """Feed each live constrained row its sampled token. Returns the positions whose
        grammar ended (they stop) and those that failed, with the error."""
        ended: set[int] = set()
        failed: dict[int, str] = {}
        for row, state in zip(self.rows, self.states, strict=True):
            if not live[row]:
                continue
            if row in self.empty:
                failed[row] = EMPTY_MASK_ERROR
            elif not state.accept(token_ids[row]):
                failed[row] = REJECTED_ERROR
            elif state.terminated:
                ended.add(row)
        return ended, failed


def blocked_ids(params, num_outputs: int, eos_token_id: int | None) -> list[int]:
    """The ids min_tokens still forbids for a request with `num_outputs` tokens."""
    if num_outputs >= params.min_tokens:
        return []
    ids = list(params.stop_token_ids)
    return ids if eos_token_id is None else [*ids, eos_token_id]
