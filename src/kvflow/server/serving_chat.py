"""POST /v1/chat/completions: the chat template, n, logprobs/top_logprobs, SSE with roles."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

from kvflow.outputs import CompletionOutput, Logprob
from kvflow.server.protocol import (
    ChatCompletionLogProb,
    ChatCompletionLogProbs,
    ChatCompletionLogProbsContent,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatCompletionResponseStreamChoice,
    ChatCompletionStreamResponse,
    ChatResponseMessage,
    DeltaMessage,
    now,
    random_id,
)
from kvflow.server.serving import (
    SSE_DONE,
    BaseServing,
    ChoiceState,
    EventStream,
    Prompt,
    ServingError,
    clamp_logprob,
    clamp_prompt_logprobs,
    sse,
    usage,
)

logger = logging.getLogger("kvflow.server")


class ChatServing(BaseServing):
    async def create_chat_completion(
        self, req: ChatCompletionRequest
    ) -> ChatCompletionResponse | EventStream:
        """Validates and queues before returning: a refused request raises ServingError here."""
        self.check_model(req.model)
        self._check_unsupported(req)
        prompt = self.truncate(self.render_chat(req), req)
        max_tokens = req.max_completion_tokens
        if max_tokens is None:
            max_tokens = req.max_tokens  # None: the rest of the context
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        params = self.sampling_params(req, max_tokens, logprobs)
        request_id = random_id("chatcmpl")
        streams = self.submit(request_id, [prompt], [params])
        run = _ChatRun(self, req, request_id, prompt)
        results = self.results(streams, req.request_timeout)
        if req.stream:
            return EventStream(run.stream(results), streams)
        return await run.collect(results)

    @staticmethod
    def _check_unsupported(req: ChatCompletionRequest) -> None:
        if req.top_logprobs and not req.logprobs:
            raise ServingError(
                "when using `top_logprobs`, `logprobs` must be set to true.", param="top_logprobs"
            )
        if req.top_logprobs is not None and not 0 <= req.top_logprobs <= 20:
            raise ServingError(
                f"`top_logprobs` must be in [0, 20], got {req.top_logprobs}.", param="top_logprobs"
            )
        # vLLM's rules for tools (its server without a tool-call parser): tools alone mean
        # tool_choice "auto", which needs one; "none" renders the tools into the prompt only
        if req.tools == []:
            raise ServingError(
                "`tools` must not be an empty array. Either provide at least one tool or omit "
                "the field entirely.",
                param="tools",
            )
        for tool in req.tools or []:
            function = tool.get("function")
            named = isinstance(function, dict) and isinstance(function.get("name"), str)
            if tool.get("type") != "function" or not named:
                raise ServingError(
                    'Each tool must be {"type": "function", "function": {"name": ...}}.',
                    param="tools",
                )
        choice = req.tool_choice
        if "tool_choice" not in req.model_fields_set and req.tools:
            choice = "auto"
        if choice not in (None, "none"):
            if req.tools is None:
                raise ServingError(
                    "When using `tool_choice`, `tools` must be set.", param="tool_choice"
                )
            raise ServingError(
                f"Tool calling is not supported: tool_choice {choice!r} needs a tool-call "
                'parser, which kvflow does not have. With tool_choice "none" the tools are '
                "rendered into the prompt only.",
                param="tool_choice",
            )

    def chat_logprobs(
        self, pairs: list[tuple[int, dict[int, Logprob]]], top_n: int
    ) -> ChatCompletionLogProbs:
        content = []
        for token_id, entry in pairs:
            sampled = entry.get(token_id)
            ranked = sorted(entry.items(), key=lambda kv: kv[1].rank or 1 << 30)[:top_n]
            content.append(
                ChatCompletionLogProbsContent(
                    **self._logprob(token_id, sampled).model_dump(),
                    top_logprobs=[self._logprob(tid, lp) for tid, lp in ranked],
                )
            )
        return ChatCompletionLogProbs(content=content)

    def _logprob(self, token_id: int, lp: Logprob | None) -> ChatCompletionLogProb:
        text = self.token_text(token_id, lp)
        value = clamp_logprob(lp.logprob) if lp is not None else -9999.0
        return ChatCompletionLogProb(token=text, logprob=value, bytes=list(text.encode()))


class _ChatRun:
    """One chat request in flight."""

    def __init__(
        self, serving: ChatServing, req: ChatCompletionRequest, rid: str, prompt: Prompt
    ) -> None:
        self.serving = serving
        self.req = req
        self.id = rid
        self.created = now()
        self.prompt = prompt
        self.choices = {i: ChoiceState() for i in range(req.n)}
        self.prompt_logprobs: list | None = None
        self.echo = self._echo(req)

    @staticmethod
    def _echo(req: ChatCompletionRequest) -> str:
        """vLLM's `echo`: the last message's text, when its role is the reply's (the assistant
        with a generation prompt, else the last message's own role: a continued message)."""
        if not req.echo or not req.messages:
            return ""
        last = req.messages[-1]
        if last.role != ("assistant" if req.add_generation_prompt else last.role):
            return ""
        content = last.content or ""
        return content if isinstance(content, str) else "\n".join(p["text"] for p in content)

    def _logprobs(self, pairs: list) -> ChatCompletionLogProbs | None:
        if not self.req.logprobs:
            return None
        return self.serving.chat_logprobs(pairs, self.req.top_logprobs or 0)

    async def collect(self, results: AsyncIterator) -> ChatCompletionResponse:
        async for _, output in results:
            if output.prompt_logprobs is not None:
                self.prompt_logprobs = output.prompt_logprobs
            for delta in output.outputs:
                self.choices[delta.index].add(delta)
        choices = [
            ChatCompletionResponseChoice(
                index=i,
                message=ChatResponseMessage(
                    role="assistant", content=self.echo + "".join(state.text)
                ),
                logprobs=self._logprobs(state.logprobs),
                finish_reason=state.finish_reason,
                stop_reason=state.stop_reason,
            )
            for i, state in sorted(self.choices.items())
        ]
        return ChatCompletionResponse(
            id=self.id,
            created=self.created,
            model=self.serving.model_name,
            choices=choices,
            usage=usage([self.prompt], self.choices),
            prompt_logprobs=clamp_prompt_logprobs(self.prompt_logprobs),
        )

    async def stream(self, results: AsyncIterator) -> AsyncIterator[str]:
        options = self.req.stream_options
        include_usage = bool(options and options.include_usage)
        continuous = include_usage and bool(options and options.continuous_usage_stats)
        try:
            for i in range(self.req.n):
                role = DeltaMessage(role="assistant", content="")
                yield sse(self._chunk(i, role, None, None))
            for i in range(self.req.n if self.echo else 0):
                yield sse(self._chunk(i, DeltaMessage(content=self.echo), None, None))
            async for _, output in results:
                for delta in output.outputs:
                    chunk = self._delta_chunk(delta)
                    if chunk is None:
                        continue
                    if continuous:  # as vLLM: this choice's tokens
                        own = {delta.index: self.choices[delta.index]}
                        chunk.usage = usage([self.prompt], own)
                    yield sse(chunk)
            if include_usage:
                final = self._base([])
                final.usage = usage([self.prompt], self.choices)
                yield sse(final)
        except ServingError as err:
            yield sse(err.body())
        except Exception as exc:
            logger.exception("chat stream %s failed", self.id)
            yield sse(ServingError(f"Internal error: {exc}", 500).body())
        yield SSE_DONE

    def _delta_chunk(self, delta: CompletionOutput) -> ChatCompletionStreamResponse | None:
        pairs = self.choices[delta.index].add(delta)
        logprobs = self._logprobs(pairs)
        if not delta.text and delta.finish_reason is None and not pairs:
            return None
        message = DeltaMessage(content=delta.text) if delta.text else DeltaMessage()
        choice = self._chunk(delta.index, message, logprobs, delta)
        return choice

    def _chunk(
        self,
        index: int,
        message: DeltaMessage,
        logprobs: ChatCompletionLogProbs | None,
        delta: CompletionOutput | None,
    ) -> ChatCompletionStreamResponse:
        finish = None if delta is None or delta.finish_reason is None else str(delta.finish_reason)
        choice = ChatCompletionResponseStreamChoice(
            index=index,
            delta=message,
            logprobs=logprobs,
            finish_reason=finish,
            stop_reason=None if delta is None else delta.stop_reason,
        )
        return self._base([choice])

    def _base(self, choices: list) -> ChatCompletionStreamResponse:
        return ChatCompletionStreamResponse(
            id=self.id,
            object="chat.completion.chunk",
            created=self.created,
            model=self.serving.model_name,
            choices=choices,
        )
