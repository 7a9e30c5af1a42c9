"""Request state owned by the scheduler: token ids and the computed-token counter."""

from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field
from typing import Any

_arrival_counter = itertools.count()


class RequestStatus(enum.IntEnum):
    """Order matters: every status after PREEMPTED is a finished one."""

    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH_CAPPED = 4
    FINISHED_ABORTED = 5
    FINISHED_ERROR = 6

    @property
    def finished(self) -> bool:
        return self > RequestStatus.PREEMPTED


class FinishReason(enum.StrEnum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"


FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH_CAPPED: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
    RequestStatus.FINISHED_ERROR: FinishReason.ERROR,
}


@dataclass(eq=False, slots=True)
class Request:
    """One sequence to generate.

    The scheduler closes the gap between `num_computed_tokens` and `num_tokens` step by step:

        |<------------- prompt -------------->|<---- output ---->|<- pending ->|
        |<--- num_computed_tokens --->|<------ gap scheduled next ------------>|

    `num_computed_tokens` counts the tokens of every step scheduled so far, launched or done.
    Pending tokens are being sampled by launched steps whose outputs are not applied yet (with
    async scheduling, up to two: the step in flight and the one just scheduled); the next
    step can already compute the newest one, whose id the runner keeps on the device.
    """

    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    sampling_params: Any = None  # opaque to the core; the runner reads it
    eos_token_id: int | None = None
    stop_token_ids: frozenset[int] = frozenset()
    min_tokens: int = 0
    ignore_eos: bool = False
    # prompt logprobs need the logits of every prompt token: no prefix-cache hits (vLLM's name)
    skip_reading_prefix_cache: bool = False
    # An output constraint: its compiled grammar, opaque to the core (the runner reads it).
    # While `grammar_pending` it is still compiling: the request waits without holding the
    # queue (the scheduler passes over it) and counts as waiting.
    grammar: Any = None
    grammar_pending: bool = False
    arrival_time: float = field(default_factory=time.monotonic)

    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_pending_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    stop_reason: int | str | None = None
    error: str | None = None
    num_preemptions: int = 0
    num_cached_tokens: int = -1  # prefix-cache hit on first scheduling; -1 until scheduled
    first_scheduled_time: float | None = None
    arrival_seq: int = field(default_factory=lambda: next(_arrival_counter))

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_tokens_with_pending(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids) + self.num_pending_tokens

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    @property
    def finish_reason(self) -> FinishReason | None:
        return FINISH_REASONS.get(self.status)
