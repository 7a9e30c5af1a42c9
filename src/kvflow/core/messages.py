"""Plain data that crosses the scheduler -> runner -> scheduler boundary: ints and lists, and a
request's sampling params and compiled grammar, opaque here (the runner reads them). To the
tensor-parallel ranks these messages are pickled, the compiled grammar as `structured.wire`
sends it.

New requests are sent whole once; afterwards only diffs (new blocks, the computed counter).
A preempted request is sent whole again when it resumes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True, slots=True)
class NewRequestData:
    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # non-empty when resuming after preemption
    sampling_params: Any
    block_ids: list[int]
    num_computed_tokens: int
    grammar: Any = None  # the compiled output constraint (opaque here), or None


@dataclass(frozen=True, slots=True)
class CachedRequestData:
    """The scheduled requests the runner already has, as columns (entry i: request
    `req_ids[i]`), as vLLM lays them out: no object per request per step."""

    req_ids: list[str] = field(default_factory=list)
    new_block_ids: list[list[int]] = field(default_factory=list)  # empty: no new blocks
    num_computed_tokens: list[int] = field(default_factory=list)

    def append(self, req_id: str, new_block_ids: list[int], num_computed_tokens: int) -> None:
        self.req_ids.append(req_id)
        self.new_block_ids.append(new_block_ids)
        self.num_computed_tokens.append(num_computed_tokens)


@dataclass(frozen=True)
class SchedulerOutput:
    new_reqs: list[NewRequestData]
    cached_reqs: CachedRequestData
    num_scheduled_tokens: dict[str, int]  # req_id -> tokens computed this step
    total_num_scheduled_tokens: int
    # Requests the runner must forget (ended since the last step; unknown ids are ignored).
    finished_req_ids: set[str] = field(default_factory=set)
    # Requests preempted since the last step: the runner drops their rows and keeps their
    # sampling state (seeded generator) for the resume, which sends them whole again. Applied
    # after finished_req_ids, before new_reqs; ids it no longer has are ignored.
    preempted_req_ids: set[str] = field(default_factory=set)
    num_preemptions: int = 0  # preemptions made by this step's scheduling

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0


@dataclass(slots=True)
class TokenLogprobs:
    """Logprobs of one sampled token: its own (with rank) and the top-n alternatives."""

    token_id: int
    logprob: float
    rank: int
    top_ids: list[int]
    top_logprobs: list[float]


@dataclass
class ModelRunnerOutput:
    # req_id -> sampled token ids this step (empty list while a prompt is still being chunked).
    sampled_token_ids: dict[str, list[int]]
    logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
    # req_id -> logprobs of the prompt tokens this step's positions predict (next in order)
    prompt_logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
    # req_id -> message, for requests whose step failed alone (e.g. non-finite logits).
    failed: dict[str, str] = field(default_factory=dict)
    # Requests whose output constraint ended with this step's token: they stop ("stop").
    stopped: set[str] = field(default_factory=set)
    num_masked_rows: int = 0  # rows whose logits an output constraint masked (the step log)


@dataclass(slots=True)
class EngineCoreOutput:
    req_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprobs] | None = None
    new_prompt_logprobs: list[TokenLogprobs] | None = None  # the next prompt tokens' logprobs
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    error: str | None = None
    num_cached_tokens: int = 0
    first_scheduled_time: float | None = None  # set on a request's first output token
    num_preemptions: int = 0  # set on a request's terminal output

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
