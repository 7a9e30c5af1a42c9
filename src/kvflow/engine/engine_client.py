"""EngineClient: what the server's routes call on an engine, whichever way it runs.

AsyncEngine (the engine stepped on a thread of the server's process) and ProcessEngine (the
engine core in its own process) both derive from it. It holds what does not depend on where
the engine runs: the checks before a request is admitted, validation, one RequestStream per
live request, and `generate` over `add_request`.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from kvflow.engine.llm_engine import LLMEngine
from kvflow.engine.request_stream import RequestStream
from kvflow.outputs import RequestOutput
from kvflow.sampling_params import SamplingParams, StructuredOutputsParams


class EngineUnavailableError(RuntimeError):
    """The engine admits no new request now (shutting down, or the queue is full)."""

    def __init__(self, message: str, retry_after: int | None = None) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class EngineDeadError(RuntimeError):
    """The engine loop failed; nothing more can run."""


class EngineClient:
    """A subclass sets `engine` (the LLMEngine whose tokenizer and validation it uses) and
    `max_num_queued_reqs`, and implements `add_request(request_id, prompt_token_ids, params,
    prompt) -> RequestStream` (with `_admit`, `_check_queue`, `_open_stream`),
    `_accepting_now`, `_num_queued` and `_release`."""

    engine: LLMEngine
    max_num_queued_reqs: int | None

    def __init__(self) -> None:
        self.dead_error: str | None = None
        self.num_admission_rejections = 0  # --max-num-queued-reqs refusals
        self._streams: dict[str, RequestStream] = {}  # event loop only
        self._released = asyncio.Event()  # no live request
        self._dead = asyncio.Event()  # set when the engine dies (dead_error says why)
        self._accepting = True  # False once shutdown begins

    async def wait_dead(self) -> str:
        """Returns (with the reason) once the engine has died."""
        await self._dead.wait()
        return self.dead_error or "engine failed"

    @property
    def accepting(self) -> bool:
        return self._accepting and self.dead_error is None

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> SamplingParams:
        """Raises ValueError (vLLM's wording) for a request that could never be served."""
        return self.engine.validate(prompt_token_ids, params)

    def validate_structured_outputs(self, so: StructuredOutputsParams) -> None:
        """Raises ValueError naming what is wrong with an output constraint."""
        self.engine.validate_structured_outputs(so)

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

    @property
    def num_live_requests(self) -> int:
        return len(self._streams)

    def request_ids(self) -> list[str]:
        """Requests whose consumer has not yet read their terminal output."""
        return list(self._streams)

    # ---- for the subclasses' add_request -------------------------------------------------------

    def _admit(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> SamplingParams:
        """The checks before anything is queued; the params to run with. Raises
        EngineDeadError, EngineUnavailableError or ValueError."""
        if self.dead_error is not None:
            raise EngineDeadError(self.dead_error)
        if not self._accepting_now():
            raise EngineUnavailableError("The server is shutting down.")
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        return self.engine.validate(prompt_token_ids, params)

    def _check_queue(self) -> None:
        """--max-num-queued-reqs: raises EngineUnavailableError (a 503 with Retry-After) when
        one more request would wait beyond the limit, and counts the refusal."""
        limit = self.max_num_queued_reqs
        if limit is not None and self._num_queued(adding=1) > limit:
            self.num_admission_rejections += 1
            raise EngineUnavailableError(
                f"The request queue is full ({limit} requests waiting, "
                "--max-num-queued-reqs). Retry later.",
                retry_after=1,
            )

    def _open_stream(self, request_id: str, n: int) -> RequestStream:
        stream = RequestStream(request_id, n, self._release)
        self._streams[request_id] = stream
        self._released.clear()
        return stream

    def _accepting_now(self) -> bool:
        raise NotImplementedError

    def _num_queued(self, adding: int) -> int:
        raise NotImplementedError

    def _release(self, request_id: str, abort: bool) -> None:
        raise NotImplementedError
