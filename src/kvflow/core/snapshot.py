"""A read-only picture of the scheduler and the KV pool, in plain data, and the event log the
live page reads (preemptions, stuck-request failures).

`Scheduler.snapshot` runs on the thread that owns the scheduler, between steps. It copies what is
there and changes nothing: the pool's state string (kept up to date by the pool, so a copy)
and one row per request, at most `max_requests` per list.

Block states, one character each, block 0 first:

    n  the null block (reserved)        .  free, holds nothing
    c  free, holds a prefix-cache entry (evicted LRU when blocks run out)
    h  held by one request              s  held by more than one (a shared prefix)
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

# Why the waiting queue did not move in the latest schedule (the queue is FCFS: the head's
# reason holds for every request behind it).
WAIT_BUDGET = "budget"  # the step's token budget (--max-num-batched-tokens) was spent
WAIT_CAPACITY = "capacity"  # the head's blocks do not fit in the free KV blocks
WAIT_MAX_NUM_SEQS = "max_num_seqs"  # --max-num-seqs requests already run
WAIT_NEW = "new"  # arrived since the latest schedule
WAIT_GRAMMAR = "grammar"  # every waiting request's output constraint is still compiling


@dataclass(frozen=True, slots=True)
class EngineEvent:
    seq: int
    time: float  # wall clock (time.time())
    kind: str  # "preempted" | "stuck"
    request_id: str
    message: str


class EventLog:
    """The latest `maxlen` events, numbered from 1 so a reader can ask for what is new."""

    def __init__(self, maxlen: int = 200) -> None:
        self._events: deque[EngineEvent] = deque(maxlen=maxlen)
        self._seq = 0

    def record(self, kind: str, request_id: str, message: str) -> None:
        self._seq += 1
        self._events.append(EngineEvent(self._seq, time.time(), kind, request_id, message))

    def latest(self, limit: int = 50) -> list[EngineEvent]:
        return list(self._events)[-limit:]


@dataclass(frozen=True, slots=True)
class RequestView:
    request_id: str
    status: str  # "running" | "waiting" | "preempted"
    num_prompt_tokens: int
    num_output_tokens: int
    max_tokens: int
    num_computed_tokens: int
    num_cached_tokens: int  # prefix-cache hit at first scheduling (-1: not scheduled yet)
    num_preemptions: int
    age_s: float
    block_ids: list[int]
    wait_reason: str | None = None  # waiting requests only


@dataclass(frozen=True)
class EngineSnapshot:
    """What the engine holds now. Plain data: it crosses threads (and processes) as is."""

    time: float  # wall clock
    num_blocks: int
    block_size: int
    blocks: str  # one state character per block (see the module docstring)
    running: list[RequestView]
    waiting: list[RequestView]
    waiting_by_reason: dict[str, int]
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    num_steps: int
    num_preemptions_total: int
    num_stuck_failures: int
    events: list[EngineEvent] = field(default_factory=list)


def request_view(
    req, status: str, now: float, blocks: list[int], reason: str | None
) -> RequestView:
    """One row of the snapshot for `req` (a core Request)."""
    return RequestView(
        request_id=req.request_id,
        status=status,
        num_prompt_tokens=req.num_prompt_tokens,
        num_output_tokens=req.num_output_tokens,
        max_tokens=req.max_tokens,
        num_computed_tokens=req.num_computed_tokens,
        num_cached_tokens=req.num_cached_tokens,
        num_preemptions=req.num_preemptions,
        age_s=round(now - req.arrival_time, 3),
        block_ids=blocks,
        wait_reason=reason,
    )
