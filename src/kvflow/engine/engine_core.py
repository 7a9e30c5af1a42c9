"""EngineCore: one step = schedule, run the model, update. The runner is injected.

A step is split in two: `launch` schedules and queues the model work, the call it returns
waits for that work and applies it. With `async_scheduling` (the default on CUDA) `step()`
launches step N+1 before it applies step N, so that the host schedules, builds inputs and
detokenizes while the device computes:

    host    | launch N+1 | wait N, apply N | (LLMEngine: detokenize N) | launch N+2 | wait N+1 ..
    device  | ..... step N ......| ......... step N+1 ...............| ...... step N+2 ....

Outputs then come one step after the work that produced them; without it a step is
`launch()()`, as on the CPU, where the model runs on the host anyway."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Protocol

from kvflow.config import EngineConfig
from kvflow.core.messages import EngineCoreOutput, ModelRunnerOutput, SchedulerOutput
from kvflow.core.perf import ModelShape, step_perf
from kvflow.core.request import Request, RequestStatus
from kvflow.core.scheduler import Scheduler
from kvflow.core.snapshot import EngineSnapshot
from kvflow.engine.pending_grammars import PendingGrammars
from kvflow.sampling_params import SamplingParams, StructuredOutputsParams

logger = logging.getLogger("kvflow.engine")


class KVEventSink(Protocol):
    num_dropped: int

    def publish(self, records: list) -> None:
        """Take one step's KV events (core/kv_events records); must not block."""
        ...


class Runner(Protocol):
    def launch(self, scheduler_output: SchedulerOutput) -> Callable[[], ModelRunnerOutput]:
        """Start the step's model work; the returned call waits for it and gives the output."""
        ...


class GrammarCompiler(Protocol):
    def compile(self, so) -> Future:
        """A Future of the compiled constraint (its exception a ValueError)."""
        ...

    def validate(self, so) -> None:
        """Parse the constraint; raises ValueError naming what is wrong with it."""
        ...


@dataclass(frozen=True, slots=True)
class EngineCoreRequest:
    """One choice of an API request as every core takes it: plain data, built once by the
    front end (`LLMEngine.add_request`) and handed as it is to a core in this process or
    encoded (msgspec) for the engine process."""

    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    sampling_params: SamplingParams
    eos_token_id: int | None
    stop_token_ids: list[int]
    min_tokens: int
    ignore_eos: bool
    skip_reading_prefix_cache: bool  # prompt logprobs: every prompt token's logits
    arrival_time: float  # time.monotonic(): one clock for every process on the host


@dataclass(frozen=True)
class EngineStats:
    num_running: int
    num_waiting: int
    num_waiting_for_capacity: int
    kv_cache_usage: float
    num_preemptions_total: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_stuck_failures: int
    num_steps: int
    # Cumulative estimates from the model's shape (vLLM's perf counters); 0 without a shape.
    estimated_flops: int = 0
    estimated_read_bytes: int = 0
    estimated_write_bytes: int = 0
    kv_events_dropped: int = 0  # KV-event batches the publisher's full queue dropped
    num_grammar_failures: int = 0  # requests failed by their output constraint


class EngineCore:
    def __init__(
        self,
        config: EngineConfig,
        runner: Runner,
        log_steps: bool = False,
        async_scheduling: bool = False,
        model_shape: ModelShape | None = None,
        kv_events: KVEventSink | None = None,
        grammar: GrammarCompiler | None = None,
    ) -> None:
        """`grammar` compiles output constraints (None: a request with one is refused)."""
        self.config = config
        self.runner = runner
        self.scheduler = Scheduler(config.scheduler, config.cache)
        self.log_steps = log_steps
        self.async_scheduling = async_scheduling
        self._in_flight: Callable[[], list[EngineCoreOutput]] | None = None  # launched, unapplied
        self.num_stuck_failures = 0
        self.num_steps = 0
        self.last_step_tokens = 0  # tokens scheduled by the latest step (iteration_tokens)
        self.model_shape = model_shape
        self.perf_totals = [0, 0, 0]  # flops, read bytes, write bytes
        self.kv_events = kv_events
        if kv_events is not None:
            self.scheduler.kv.pool.record_events()
        self.grammar = grammar
        self.pending_grammars = PendingGrammars()

    def close(self) -> None:
        """Release what outlives steps: the KV-event publisher, the grammar compile threads,
        the ranks of an executor. Idempotent."""
        sink, self.kv_events = self.kv_events, None
        for owner, method in ((sink, "close"), (self.grammar, "close"), (self.runner, "shutdown")):
            release = getattr(owner, method, None)
            if release is not None:
                release()

    def add_request(self, new: EngineCoreRequest) -> None:
        """Queue a request; one with an output constraint waits (not schedulable) until its
        grammar compiles (`PendingGrammars`). Raises ValueError when it could never be served."""
        so = new.sampling_params.structured_outputs
        if so is not None and self.grammar is None:
            raise ValueError("Structured outputs are not available: no grammar backend.")
        request = Request(
            new.request_id,
            list(new.prompt_token_ids),
            new.max_tokens,
            sampling_params=new.sampling_params,
            eos_token_id=new.eos_token_id,
            stop_token_ids=frozenset(new.stop_token_ids),
            min_tokens=new.min_tokens,
            ignore_eos=new.ignore_eos,
            skip_reading_prefix_cache=new.skip_reading_prefix_cache,
            arrival_time=new.arrival_time,
        )
        compiled = None if so is None else self.grammar.compile(so)
        self.scheduler.add_request(request)
        if compiled is not None:
            self.pending_grammars.add(request, compiled)

    def constraint_error(self, fields: dict) -> str | None:
        """Why the output constraint with these StructuredOutputsParams fields cannot be
        compiled, in the words a 400 gives; None when it can. A utility call: an API server
        over the engine process has no grammar backend and asks this before admitting."""
        if self.grammar is None:
            return "Structured outputs are not available: no grammar backend."
        try:
            self.grammar.validate(StructuredOutputsParams(**fields))
        except ValueError as exc:
            return str(exc)
        return None

    def abort_requests(
        self,
        req_ids,
        status: RequestStatus = RequestStatus.FINISHED_ABORTED,
        error: str | None = None,
    ) -> list[EngineCoreOutput]:
        return self.scheduler.finish_requests(req_ids, status, error)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or self._in_flight is not None

    def has_schedulable_work(self) -> bool:
        """A step could do something now: a step is in flight, a request runs, or one waits
        that is not compiling its grammar."""
        sch = self.scheduler
        return (
            self._in_flight is not None
            or bool(sch.running)
            or sch.first_ready_waiting() is not None
        )

    def step(self) -> list[EngineCoreOutput]:
        """Run one step. Returns outputs for requests that produced tokens or finished: this
        step's, or with async scheduling the previous step's (this one stays in flight).

        First, constrained requests whose grammar compiled become schedulable and those whose
        compile failed end; with nothing else to run it waits briefly on the compiles
        (`PendingGrammars.poll`) rather than stepping an idle engine in a loop."""
        block = not self.has_schedulable_work()
        return self.pending_grammars.poll(self, block) + self._step()

    def _step(self) -> list[EngineCoreOutput]:
        if not self.async_scheduling:  # (a step still in flight: it was just switched off)
            previous, self._in_flight = self._in_flight, None
            return (previous() if previous is not None else []) + self.launch()()
        applied: list[EngineCoreOutput] = []
        if self._in_flight is not None and self.scheduler.has_structured_running():
            # A constrained row's mask depends on the token in flight: apply it first (no
            # overlap for this step).
            previous, self._in_flight = self._in_flight, None
            applied = previous()
        finish = self.launch()
        launched = self.last_step_tokens > 0
        previous, self._in_flight = self._in_flight, finish if launched else None
        outputs = applied + (previous() if previous is not None else [])
        return outputs if launched else outputs + finish()

    def launch(self) -> Callable[[], list[EngineCoreOutput]]:
        """Schedule one step and start its model work. The returned call waits for that work,
        applies it (tokens, stops, freed blocks) and returns its outputs. Adds and aborts may
        come in between; the next `launch` may too, before the call (async scheduling), but
        not a third."""
        t0 = time.monotonic()
        sched = self.scheduler.schedule()
        self.num_steps += 1
        self.last_step_tokens = sched.total_num_scheduled_tokens
        self._account(sched)
        wait = None if sched.is_empty else self.runner.launch(sched)
        # Nothing scheduled: with a step in flight its output will change that; with none the
        # queue head can never run (checked now, while the state is the one that failed).
        stuck = [] if wait is not None or self._in_flight is not None else self._fail_stuck_head()

        def finish() -> list[EngineCoreOutput]:
            masked = 0
            if wait is None:
                outputs = stuck
            else:
                result = wait()
                masked = result.num_masked_rows
                outputs = self.scheduler.update_from_output(sched, result)
            if self.log_steps:
                logger.info(
                    "core-step unfinished=%d scheduled=%d model_executed=%d n_out=%d "
                    "masked=%d elapsed_s=%.4f",
                    len(self.scheduler.requests),
                    len(sched.num_scheduled_tokens),
                    int(wait is not None),
                    sum(len(o.new_token_ids) for o in outputs),
                    masked,
                    time.monotonic() - t0,
                )
            return outputs

        return finish

    def _account(self, sched: SchedulerOutput) -> None:
        """The step's perf estimates, and the KV events its scheduling recorded (published
        now: the publisher only enqueues)."""
        if self.model_shape is not None and not sched.is_empty:
            for i, value in enumerate(step_perf(self.model_shape, sched)):
                self.perf_totals[i] += value
        if self.kv_events is not None:
            self.kv_events.publish(self.scheduler.kv.pool.take_events())

    def _fail_stuck_head(self) -> list[EngineCoreOutput]:
        """Liveness point 4: nothing scheduled, nothing running, yet requests wait. The head can
        never run (a broken invariant); fail it now rather than spin on it forever."""
        sch = self.scheduler
        head = None if sch.running else sch.first_ready_waiting()
        if head is None:  # running, or idle, or every waiting request is compiling its grammar
            return []
        msg = (
            f"request {head.request_id} cannot be scheduled: it needs "
            f"{head.num_tokens} tokens of KV with {sch.kv.pool.num_free_blocks} free blocks of "
            f"{sch.kv.block_size} tokens (max_model_len {sch.max_model_len}, "
            f"{self.config.cache.num_blocks} blocks); failing it instead of waiting forever"
        )
        logger.error(msg)
        self.num_stuck_failures += 1
        sch.events.record("stuck", head.request_id, msg)
        return sch.finish_requests([head.request_id], RequestStatus.FINISHED_ERROR, msg)

    def snapshot(self) -> EngineSnapshot:
        """The scheduler and KV pool now, as plain data (core/snapshot.py); call it between
        steps on the thread that steps."""
        return self.scheduler.snapshot(self.num_steps, self.num_stuck_failures)

    def stats(self) -> EngineStats:
        sch = self.scheduler
        return EngineStats(
            num_running=len(sch.running),
            num_waiting=len(sch.waiting),
            num_waiting_for_capacity=len(sch.waiting) if sch.head_blocked_on_kv else 0,
            kv_cache_usage=sch.kv.usage,
            num_preemptions_total=sch.num_preemptions_total,
            prefix_cache_queries=sch.kv.prefix_cache_queries,
            prefix_cache_hits=sch.kv.prefix_cache_hits,
            num_stuck_failures=self.num_stuck_failures,
            num_steps=self.num_steps,
            estimated_flops=self.perf_totals[0],
            estimated_read_bytes=self.perf_totals[1],
            estimated_write_bytes=self.perf_totals[2],
            kv_events_dropped=self.kv_events.num_dropped if self.kv_events is not None else 0,
            num_grammar_failures=self.num_grammar_failures(),
        )

    def num_grammar_failures(self) -> int:
        """Requests failed by their output constraint so far: it did not compile, or it
        allowed no token (counted by the runner)."""
        runner_failures = getattr(self.runner, "num_grammar_failures", 0)
        return self.pending_grammars.num_failures + runner_failures
