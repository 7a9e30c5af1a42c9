"""Continuous batching under one token budget: chunked prefill, prefix caching, preemption.

Each step closes the gap between `num_computed_tokens` and `num_tokens` for as many requests as
the budget allows: running requests first (oldest first), then waiting ones in FCFS order.
Prefill chunks and decodes share the step. When blocks run out, the newest running request is
preempted (its blocks freed, recomputed later). The oldest request is never preempted while a
younger one holds blocks, and admission guarantees it fits alone, so every request finishes.

Async scheduling: `schedule()` may run while the previous step is still on the device. It
counts that step as computed and its sampled tokens as pending (`Request.num_pending_tokens`),
so a request's next decode is scheduled before its previous token is known (the runner feeds
it from the device). A request whose pending tokens already reach `max_tokens` is not
scheduled again; one that stops on a token only seen later has one extra token computed,
which `update_from_output` drops with the finished request.
"""

from __future__ import annotations

import bisect
import time
from collections import deque

from kvflow.config import CacheConfig, SchedulerConfig
from kvflow.core.kv_cache_manager import KVCacheManager
from kvflow.core.messages import (
    CachedRequestData,
    EngineCoreOutput,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)
from kvflow.core.request import Request, RequestStatus
from kvflow.core.snapshot import (
    WAIT_BUDGET,
    WAIT_CAPACITY,
    WAIT_GRAMMAR,
    WAIT_MAX_NUM_SEQS,
    WAIT_NEW,
    EngineSnapshot,
    EventLog,
    request_view,
)


def _arrival(req: Request) -> int:
    return req.arrival_seq


class Scheduler:
    def __init__(self, config: SchedulerConfig, cache: CacheConfig) -> None:
        self.config = config
        self.max_model_len = config.max_model_len
        self.kv = KVCacheManager(cache.num_blocks, cache.block_size, cache.enable_prefix_caching)
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # sorted by arrival: running[-1] is the preemption victim
        self._runner_blocks: dict[str, int] = {}  # requests the runner has -> blocks it was sent
        self._forget: set[str] = set()  # ended since the last step: the runner drops them
        self._preempted: set[str] = set()  # preempted since the last step: the runner parks them
        self.head_blocked_on_kv = False
        self.num_preemptions_total = 0
        # Why the queue did not move in the latest schedule (core/snapshot.py's WAIT_*), and
        # the newest arrival it judged: later arrivals have not been tried yet.
        self.waiting_reason: str | None = None
        self.waiting_seen = -1
        self.events = EventLog()

    # ---- admission -------------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Admit a request, or raise ValueError if it could never be served (liveness point 2).

        `max_tokens` is clamped to the rest of the context, so the request fits alone.
        """
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        if not 0 < request.num_prompt_tokens < self.max_model_len:
            raise ValueError(
                f"prompt of {request.num_prompt_tokens} tokens does not fit: it must be between "
                f"1 and max_model_len - 1 = {self.max_model_len - 1} tokens"
            )
        request.max_tokens = min(request.max_tokens, self.max_model_len - request.num_prompt_tokens)
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # ---- scheduling ------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Choose this step's tokens. Returns what the runner computes. The scheduled requests
        hold their blocks and count the tokens as computed (and a token they sample as
        pending); sampled tokens arrive through `update_from_output`."""
        budget = self.config.max_num_batched_tokens
        num_tokens: dict[str, int] = {}
        preempted: list[Request] = []
        budget = self._schedule_running(budget, num_tokens, preempted)
        if self.waiting:
            self.waiting_seen = self.waiting[-1].arrival_seq
        if not preempted:
            self._schedule_waiting(budget, num_tokens)
        else:
            self.waiting_reason = WAIT_CAPACITY
        self.num_preemptions_total += len(preempted)
        if not num_tokens:  # nothing to launch: the runner hears of ended requests later
            return SchedulerOutput([], CachedRequestData(), {}, 0, num_preemptions=len(preempted))
        return self._make_output(num_tokens, len(preempted))

    def _schedule_running(
        self, budget: int, num_tokens: dict[str, int], preempted: list[Request]
    ) -> int:
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            if req.num_output_tokens + req.num_pending_tokens >= req.max_tokens:
                i += 1  # its last token is pending: it finishes when that step's output arrives
                continue
            n = min(req.num_tokens_with_pending - req.num_computed_tokens, budget)
            while self.kv.allocate_slots(req, n) is None:
                victim = self.running[-1]  # the newest; never older than `req`
                self._preempt(victim)
                preempted.append(victim)
                if victim is req:
                    return budget
            num_tokens[req.request_id] = n
            budget -= n
            i += 1
        return budget

    def _schedule_waiting(self, budget: int, num_tokens: dict[str, int]) -> None:
        self.head_blocked_on_kv = False
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.first_ready_waiting()
            if req is None:  # every waiting request is still compiling its grammar
                self.waiting_reason = WAIT_GRAMMAR
                return
            hits, num_hit = self.kv.get_computed_blocks(req)
            n = min(req.num_tokens - num_hit, budget)
            if self.kv.allocate_slots(req, n, hits) is None:
                self.head_blocked_on_kv = True
                self.waiting_reason = WAIT_CAPACITY
                return
            if req is self.waiting[0]:
                self.waiting.popleft()
            else:
                self.waiting.remove(req)
            self.kv.record_prefix_lookup(req.num_tokens, num_hit)
            req.num_computed_tokens = num_hit
            req.status = RequestStatus.RUNNING
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = num_hit
                req.first_scheduled_time = time.monotonic()
            bisect.insort(self.running, req, key=_arrival)
            num_tokens[req.request_id] = n
            budget -= n
        self.waiting_reason = (
            None if not self.waiting else WAIT_BUDGET if budget <= 0 else WAIT_MAX_NUM_SEQS
        )

    def first_ready_waiting(self) -> Request | None:
        """The oldest waiting request whose grammar (if any) has compiled: the queue head as
        far as scheduling goes."""
        head = self.waiting[0] if self.waiting else None
        if head is None or not head.grammar_pending:
            return head
        return next((r for r in self.waiting if not r.grammar_pending), None)

    def has_structured_running(self) -> bool:
        """Whether a running request has an output constraint (its next mask needs its
        previous token on the host)."""
        return any(r.grammar is not None for r in self.running)

    def _preempt(self, req: Request) -> None:
        """Recompute-mode preemption: free every block, reset the counter, back to the queue
        head. A token still pending (async scheduling) arrives before it can resume, and is
        kept."""
        self.running.remove(req)
        self.kv.free(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.waiting.appendleft(req)
        del self._runner_blocks[req.request_id]
        self.events.record(
            "preempted",
            req.request_id,
            f"out of KV blocks: freed its blocks; {req.num_tokens} tokens to recompute",
        )
        self._preempted.add(req.request_id)

    def _make_output(self, num_tokens: dict[str, int], num_preemptions: int) -> SchedulerOutput:
        new_reqs, cached_reqs = [], CachedRequestData()
        for req_id, n in num_tokens.items():
            req = self.requests[req_id]
            known = self._runner_blocks.get(req_id)
            if known is not None:  # the runner has `known` blocks: send the rest only
                new_ids = self.kv.get_block_ids(req_id, known)
                cached_reqs.append(req_id, new_ids, req.num_computed_tokens)
                if new_ids:
                    self._runner_blocks[req_id] = known + len(new_ids)
            else:
                block_ids = self.kv.get_block_ids(req_id)
                new_reqs.append(
                    NewRequestData(
                        req_id,
                        req.prompt_token_ids,
                        list(req.output_token_ids),
                        req.sampling_params,
                        block_ids,
                        req.num_computed_tokens,
                        req.grammar,
                    )
                )
                self._runner_blocks[req_id] = len(block_ids)
            req.num_computed_tokens += n
            if req.num_computed_tokens == req.num_tokens_with_pending:
                req.num_pending_tokens += 1  # this step samples its next token
        forget, self._forget = self._forget, set()
        preempted, self._preempted = self._preempted, set()
        return SchedulerOutput(
            new_reqs,
            cached_reqs,
            num_tokens,
            sum(num_tokens.values()),
            forget,
            preempted,
            num_preemptions,
        )

    # ---- results ---------------------------------------------------------------------------

    def update_from_output(
        self, sched: SchedulerOutput, result: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        """Append sampled tokens, apply stop conditions, free finished requests.

        With async scheduling the next step is scheduled first: a request it preempted gets
        its token (it waits with it), one that ended since is skipped."""
        outputs = []
        sampled, failed, stopped = result.sampled_token_ids, result.failed, result.stopped
        for req_id in sched.num_scheduled_tokens:
            req = self.requests.get(req_id)
            if req is None:
                continue
            if req_id in failed:  # its K/V may be non-finite: no prefix hit may read them
                self.kv.uncache(req)
                outputs.extend(
                    self.finish_requests([req_id], RequestStatus.FINISHED_ERROR, failed[req_id])
                )
                continue
            new_ids = []
            for token in sampled.get(req_id, ()):
                req.num_pending_tokens -= 1
                req.output_token_ids.append(token)
                new_ids.append(token)
                if self._check_stop(req, token):
                    break
                if req_id in stopped:  # its output constraint ended with this token
                    req.status = RequestStatus.FINISHED_STOPPED
                    break
            prompt_logprobs = result.prompt_logprobs.get(req_id)
            if not new_ids and not prompt_logprobs:
                continue
            out = EngineCoreOutput(
                req_id,
                new_ids,
                result.logprobs.get(req_id),
                prompt_logprobs,
                num_cached_tokens=req.num_cached_tokens,
            )
            if new_ids and req.num_output_tokens == len(new_ids):
                out.first_scheduled_time = req.first_scheduled_time
            if req.is_finished:
                self._free(req)
                out.finish_reason, out.stop_reason = req.finish_reason, req.stop_reason
                out.num_preemptions = req.num_preemptions
            outputs.append(out)
        return outputs

    def _check_stop(self, req: Request, token: int) -> bool:
        """Sets the status of a request that `token` (just appended) finishes; returns whether
        it did."""
        num_output_tokens = len(req.output_token_ids)
        if num_output_tokens >= req.min_tokens:
            if token == req.eos_token_id and not req.ignore_eos:
                req.status = RequestStatus.FINISHED_STOPPED
                return True
            if token in req.stop_token_ids:
                req.status = RequestStatus.FINISHED_STOPPED
                req.stop_reason = token
                return True
        if num_output_tokens >= req.max_tokens or req.num_tokens >= self.max_model_len:
            req.status = RequestStatus.FINISHED_LENGTH_CAPPED
            return True
        return False

    def finish_requests(
        self, req_ids, status: RequestStatus, error: str | None = None
    ) -> list[EngineCoreOutput]:
        """End requests from outside the step (abort, stop string, error). Unknown ids are
        ignored. Returns one terminal output per request that was still live."""
        outputs = []
        for req_id in req_ids:
            req = self.requests.get(req_id)
            if req is None:
                continue
            req.status, req.error = status, error
            self._free(req)
            outputs.append(
                EngineCoreOutput(
                    req_id,
                    [],
                    finish_reason=req.finish_reason,
                    error=error,
                    num_cached_tokens=max(req.num_cached_tokens, 0),
                    num_preemptions=req.num_preemptions,
                )
            )
        return outputs

    def _free(self, req: Request) -> None:
        (self.running if req in self.running else self.waiting).remove(req)
        self.kv.free(req)
        del self.requests[req.request_id]
        self._runner_blocks.pop(req.request_id, None)
        self._forget.add(req.request_id)  # the runner may hold it, running or preempted

    # ---- the live view ---------------------------------------------------------------------

    def snapshot(
        self, num_steps: int, num_stuck_failures: int, max_requests: int = 256
    ) -> EngineSnapshot:
        """The state now, as plain data (core/snapshot.py); changes nothing. At most
        `max_requests` rows per list (the oldest first); the counts cover every request."""
        now = time.monotonic()
        running = [
            request_view(r, "running", now, self.kv.get_block_ids(r.request_id), None)
            for r in self.running[:max_requests]
        ]
        by_reason: dict[str, int] = {}
        waiting = []
        for i, req in enumerate(self.waiting):
            judged = req.arrival_seq <= self.waiting_seen
            reason = (self.waiting_reason if judged else None) or WAIT_NEW
            if req.grammar_pending:
                reason = WAIT_GRAMMAR
            by_reason[reason] = by_reason.get(reason, 0) + 1
            if i < max_requests:
                status = "preempted" if req.num_preemptions else "waiting"
                waiting.append(request_view(req, status, now, [], reason))
        return EngineSnapshot(
            time=time.time(),
            num_blocks=self.kv.pool.num_blocks,
            block_size=self.kv.block_size,
            blocks=self.kv.pool.block_states(),
            running=running,
            waiting=waiting,
            waiting_by_reason=by_reason,
            max_num_seqs=self.config.max_num_seqs,
            max_num_batched_tokens=self.config.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            num_steps=num_steps,
            num_preemptions_total=self.num_preemptions_total,
            num_stuck_failures=num_stuck_failures,
            events=self.events.latest(),
        )
