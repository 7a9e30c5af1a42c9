"""AsyncEngine: the server's one engine front end, over a core client in either placement (the
engine loop on a thread of this process, or in the engine core process: `core_client`).

    event loop (server)                                              engine loop
    add_request ─ LLMEngine: validate, EngineCoreRequests ─ Add ──►  CoreLoop: EngineCore.step()
    RequestStream ◄─ LLMEngine: detokenize, stop strings ◄── Step ◄── outputs + EngineStats

Tokenizing, detokenizing, stop strings (an Abort, status stopped, ends the core request), n > 1
fan-in and the per-request timings happen here, on the event loop, in both placements.
Liveness: every admitted request gets exactly one terminal output, whatever happens (finish,
abort, shutdown, engine death: Dead fails every request, `/health` turns 503, the server exits 1).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from kvflow.core.snapshot import EngineSnapshot
from kvflow.engine import core_wire as wire
from kvflow.engine.async_stats import StatLogger, StatsTracker
from kvflow.engine.engine_core import EngineStats
from kvflow.engine.llm_engine import LLMEngine
from kvflow.engine.request_stream import RequestStream, terminal_output
from kvflow.engine.stats_history import LiveSnapshot, StatsHistory
from kvflow.outputs import RequestOutput
from kvflow.sampling_params import SamplingParams, StructuredOutputsParams

logger = logging.getLogger("kvflow.engine")

_BYE_TIMEOUT_S = 10.0  # how long a Shutdown's aborts may take before the loop is stopped
_SNAPSHOT_WAIT_S = 5.0  # a step longer than this (a stall) makes a snapshot answer 503


class EngineUnavailableError(RuntimeError):
    """The engine admits no new request now (shutting down, or the queue is full)."""

    def __init__(self, message: str, retry_after: int | None = None) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class EngineDeadError(RuntimeError):
    """The engine loop failed; nothing more can run."""


class AsyncEngine:
    def __init__(
        self,
        engine: LLMEngine,
        stat_logger: StatLogger | None = None,
        max_num_queued_reqs: int | None = None,
        watchdog_timeout: float = 0.0,
    ) -> None:
        """`engine`'s core is a core client (a ThreadCore or a ProcessCore)."""
        self.engine = engine
        self.client = engine.core
        self.stat_logger = stat_logger
        self.max_num_queued_reqs = max_num_queued_reqs
        self.watchdog_timeout = watchdog_timeout
        self.history = StatsHistory()  # per-second stats for the live view
        self.dead_error: str | None = None
        self.num_admission_rejections = 0  # --max-num-queued-reqs refusals
        self._latest = EngineStats(0, 0, 0, 0.0, 0, 0, 0, 0, 0)
        self._tracker = StatsTracker(self._latest)
        self._streams: dict[str, RequestStream] = {}
        self._calls: dict[int, asyncio.Future] = {}
        self._call_ids = itertools.count()
        self._released = asyncio.Event()  # no live request
        self._dead = asyncio.Event()  # set when the engine dies (dead_error says why)
        self._bye = asyncio.Event()
        self._accepting = True  # False once shutdown begins
        self._started = False
        self._busy = False
        self._heard = time.monotonic()
        self._adds_applied = 0
        self._receiver: asyncio.Task | None = None

    # ---- lifecycle ---------------------------------------------------------------------------

    def start(self) -> None:
        """Start the client and take its messages; call from the event loop of the outputs."""
        loop = asyncio.get_running_loop()
        self._released.set()
        self.client.start(loop)
        self._receiver = loop.create_task(self._receive())
        self._started = True

    async def shutdown(self, timeout: float) -> None:
        """Stop admitting; drain up to `timeout` s (0: none); abort the rest. When this returns
        every consumer has its terminal output queued (it does not wait for them to read it);
        `close()` then stops the loop and reaps what it ran on."""
        self._accepting = False
        if timeout > 0:
            await self._wait(self._released, timeout)
        live, owner = self._live(), self.client.owns_engine
        if live and owner:
            self.client.shutdown()  # the loop aborts everything, then says Bye
        elif live:  # another API server's requests run on: end only this one's
            self.engine.abort_request(self.request_ids())
        for stream in list(self._streams.values()):  # answered now, not behind queued Steps
            if not stream.terminal_queued:
                stream.put(terminal_output(stream.request_id, stream.n, "abort"))
        if live:  # the aborts' outputs still come up, for the metrics
            await self._wait(self._bye if owner else self._released, _BYE_TIMEOUT_S)

    def close(self, timeout: float = 30.0) -> None:
        """Stop the loop (its thread joined, or the engine process reaped) and the taking of
        its messages. Idempotent; needs no event loop."""
        self._accepting = False
        self.client.close(timeout)
        if self._receiver is not None:
            loop = self._receiver.get_loop()
            if not loop.is_closed():
                loop.call_soon_threadsafe(self._receiver.cancel)

    def threads_alive(self) -> bool:
        """Whether the loop, or the engine process this server owns, still runs."""
        return self.client.owns_engine and self.client.alive()

    # ---- state -------------------------------------------------------------------------------

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def accepting(self) -> bool:
        return self._accepting and self.dead_error is None

    @property
    def stalled(self) -> bool:
        """Busy, and the loop's latest Step came longer than --watchdog-timeout ago (it starts
        its next step right after sending one): a step that runs too long, or a stopped
        process. The loop logs the WARNING (its StepWatchdog)."""
        return (
            self.watchdog_timeout > 0
            and self._busy
            and time.monotonic() - self._heard > self.watchdog_timeout
        )

    @property
    def is_healthy(self) -> bool:
        return self.accepting and self._started and self.client.alive() and not self.stalled

    def request_ids(self) -> list[str]:
        """Requests whose consumer has not yet read their terminal output."""
        return list(self._streams)

    def stats(self) -> EngineStats:
        return self._latest

    async def wait_dead(self) -> str:
        """Returns (with the reason) once the engine has died."""
        await self._dead.wait()
        return self.dead_error or "engine failed"

    async def snapshot(self, history_s: int = 120) -> LiveSnapshot:
        """The scheduler and KV pool between two steps, with the last `history_s` seconds of
        per-second stats. Raises EngineUnavailableError when a step outlasts the wait."""
        try:
            call = self.call_utility("snapshot", type=EngineSnapshot)
            engine = await asyncio.wait_for(call, _SNAPSHOT_WAIT_S)
        except TimeoutError as exc:
            raise EngineUnavailableError("The engine is busy in a step.") from exc
        return LiveSnapshot(engine, self.history.series(history_s), self.is_healthy)

    async def call_utility(self, method: str, *args: Any, type: Any = Any) -> Any:
        """`method(*args)` of the engine loop, else of its EngineCore, run between two steps:
        its plain-data result, decoded as `type`. Raises RuntimeError with the loop's error."""
        if not self._live():
            raise EngineDeadError(self.dead_error or "the engine is not running")
        call_id = next(self._call_ids)
        future = asyncio.get_running_loop().create_future()
        self._calls[call_id] = future
        self.client.utility(call_id, method, list(args))
        try:
            data = await future
        finally:
            self._calls.pop(call_id, None)
        return wire.decode_result(data, type)

    # ---- requests ----------------------------------------------------------------------------

    async def check_constraint(self, so: StructuredOutputsParams) -> None:
        """Raises ValueError naming what is wrong with an output constraint: parsed here, or,
        over the engine process, by the engine (between two steps) the first time this process
        meets it; `validate` then gives the same verdict without asking."""
        validator = self.engine.validator
        if validator is not None and validator.unjudged(so):
            fields = dataclasses.asdict(so)
            error = await self.call_utility("constraint_error", fields, type=str | None)
            validator.record(so, error)
        self.engine.validate_structured_outputs(so)

    def tokenize_prompt(self, prompt: str | list[int]) -> list[int]:
        return self.engine.tokenize_prompt(prompt)

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        prompt: str | None = None,
    ) -> RequestStream:
        """Validate and send one request (`add_requests`)."""
        return self.add_requests([request_id], [prompt_token_ids], [params], [prompt])[0]

    def add_requests(
        self,
        request_ids: list[str],
        prompt_token_ids: list[list[int]],
        params: list[SamplingParams],
        prompts: list[str | None],
    ) -> list[RequestStream]:
        """Validate every request (once: `LLMEngine.validate`), then send them all; a request
        that is refused queues nothing for the others (those sent before a late refusal, a full
        queue, are aborted). Raises ValueError, EngineUnavailableError or EngineDeadError."""
        if self.dead_error is not None:
            raise EngineDeadError(self.dead_error)
        if not (self._accepting and self._started):
            raise EngineUnavailableError("The server is shutting down.")
        if clash := [r for r in request_ids if r in self._streams]:
            raise ValueError(f"request id {clash[0]!r} is already in use")
        checked = [
            self.engine.validate(ids, p) for ids, p in zip(prompt_token_ids, params, strict=True)
        ]
        streams: list[RequestStream] = []
        try:
            for rid, ids, p, text in zip(
                request_ids, prompt_token_ids, checked, prompts, strict=True
            ):
                streams.append(self._send(rid, ids, p, text))
        except (ValueError, EngineUnavailableError):
            for stream in streams:
                stream.abort()
            raise
        return streams

    def _send(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        prompt: str | None,
    ) -> RequestStream:
        self._check_queue()
        if not self._busy:
            self._busy, self._heard = True, time.monotonic()
        arrival = time.monotonic()
        params = self.engine.send_request(request_id, prompt_token_ids, params, prompt, arrival)
        self._tracker.arrive(
            request_id, params.n, len(prompt_token_ids), arrival, params.max_tokens
        )
        stream = RequestStream(request_id, params.n, self._release)
        self._streams[request_id] = stream
        self._released.clear()
        return stream

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        prompt: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Delta outputs of one request; closing or cancelling the iteration aborts it."""
        stream = self.add_request(request_id, prompt_token_ids, params, prompt)
        try:
            async for output in stream:
                yield output
        finally:
            stream.abort()

    def abort(self, request_id: str) -> None:
        """Abort a request from outside its consumer, which then reads a terminal output
        (finish_reason "abort"). A consumer leaving uses `RequestStream.abort()` instead."""
        stream = self._streams.get(request_id)
        if stream is None:
            return
        if self._live():
            self.engine.abort_request([request_id])
        else:
            stream.put(terminal_output(request_id, stream.n, "abort"))

    def _check_queue(self) -> None:
        """--max-num-queued-reqs: raises EngineUnavailableError (a 503 with Retry-After) when
        one more request would wait beyond the limit (requests the loop has not taken yet wait
        too, beyond its free running slots: a burst into an idle engine does not queue)."""
        limit = self.max_num_queued_reqs
        if limit is None:
            return
        stats, seqs = self._latest, self.engine.config.scheduler.max_num_seqs
        free = 0 if stats.num_waiting else max(seqs - stats.num_running, 0)
        pending = self.client.adds_sent - self._adds_applied
        if stats.num_waiting + max(pending + 1 - free, 0) > limit:
            self.num_admission_rejections += 1
            raise EngineUnavailableError(
                f"The request queue is full ({limit} requests waiting, "
                "--max-num-queued-reqs). Retry later.",
                retry_after=1,
            )

    def _release(self, request_id: str, abort: bool) -> None:
        self._streams.pop(request_id, None)
        if abort and self._live():
            self.engine.abort_request([request_id])
        if not self._streams:
            self._released.set()

    def _live(self) -> bool:
        return self._started and self.dead_error is None and not self._bye.is_set()

    @staticmethod
    async def _wait(event: asyncio.Event, timeout: float) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(event.wait(), timeout)

    # ---- what comes up -----------------------------------------------------------------------

    async def _receive(self) -> None:
        while True:
            msg = await self.client.recv()
            try:
                self._on_message(msg)
            except Exception as exc:  # a bug here must not leave requests hanging
                logger.exception("handling an engine message failed")
                self._die(f"The engine front end failed: {type(exc).__name__}: {exc}")
                return

    def _on_message(self, msg: wire.Up) -> None:
        if isinstance(msg, wire.Step):
            self._on_step(msg)
        elif isinstance(msg, wire.UtilityResult):
            future = self._calls.pop(msg.call_id, None)
            if future is not None and not future.done():
                if msg.error is None:
                    future.set_result(msg.result)
                else:
                    future.set_exception(RuntimeError(msg.error))
        elif isinstance(msg, wire.Dead):
            self._die(msg.error)
        elif isinstance(msg, wire.Bye):
            self._bye.set()

    def _on_step(self, msg: wire.Step) -> None:
        self._heard = max(msg.sent_at, self._heard)
        self._latest = msg.stats
        self._busy = msg.busy or self.client.adds_sent > msg.adds_applied
        self._adds_applied = msg.adds_applied
        outputs = self.engine.process_outputs(msg.outputs) if msg.outputs else []
        stats = self._tracker.iteration(msg.stats, outputs, msg.step_start, msg.step_tokens)
        stats.grammar_compile_times = msg.grammar_compile_times
        self.history.record(stats)
        if self.stat_logger is not None:
            try:
                self.stat_logger.record(stats)
            except Exception:
                logger.exception("recording engine stats failed")
        streams = self._streams
        for output in outputs:
            stream = streams.get(output.request_id)
            if stream is not None:
                stream.put(output)

    def _die(self, error: str) -> None:
        """Engine death: every request a terminal error, /health 503, the server exits 1."""
        if self.dead_error is not None:
            return
        logger.error("%s; failing %d request(s)", error, len(self._streams))
        self.dead_error = error
        self._accepting = False
        for stream in list(self._streams.values()):
            stream.put(terminal_output(stream.request_id, stream.n, "error", error))
        for future in self._calls.values():
            if not future.done():
                future.set_exception(EngineDeadError(error))
        self._calls.clear()
        self._dead.set()
