"""POST /v1/chat/completions: the chat template, n, logprobs/top_logprobs, SSE with roles."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

from kvflow.outputs import CompletionOutput, Logprob
from kvflow.sampling_params import SamplingParams, StructuredOutputsParams
from kvflow.server.chat_output import ChoiceParser
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
from kvflow.server.reasoning import get_reasoning_parser
from kvflow.server.reasoning.think import DeepSeekR1ReasoningParser
from kvflow.server.serving import (
    BaseServing,
    ChoiceState,
    EventStream,
    Prompt,
    ServingError,
    clamp_logprob,
    clamp_prompt_logprobs,
    sse_events,
    usage,
)
from kvflow.server.structured import check_constraint
from kvflow.server.tool_choice import ToolConfig, ToolPlan, plan_tools, tool_template

logger = logging.getLogger("kvflow.server")


class ChatServing(BaseServing):
    def __init__(self, *args, tool_config: ToolConfig | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.tool_config = tool_config or ToolConfig()

    async def create_chat_completion(
        self, req: ChatCompletionRequest
    ) -> ChatCompletionResponse | EventStream:
        """Validates and queues before returning: a refused request raises ServingError here."""
        self.check_request(req)
        self._check_unsupported(req)
        plan = plan_tools(req, self.tool_config)
        prompt = self.truncate(self.render_chat(req), req)
        max_tokens = req.max_completion_tokens
        if max_tokens is None:
            max_tokens = req.max_tokens  # None: the rest of the context
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        params = self._with_plan(
            self.sampling_params(req, max_tokens, logprobs, len(prompt.token_ids)), plan, req
        )
        so = params.structured_outputs
        if plan.schema is None:
            await check_constraint(self.engine, so, self._constraint(req)[1])
        else:  # a tool schema the grammar backend cannot compile: 400 naming it
            await check_constraint(self.engine, so, "tools", "The tools' schema: ")
        request_id = random_id("chatcmpl")
        streams = self.submit(request_id, [prompt], [params])
        run = _ChatRun(self, req, request_id, prompt, plan)
        results = self.results(streams, req.request_timeout)
        if req.stream:
            return EventStream(sse_events(run, results, req.stream_options), streams)
        return await run.collect(results)

    def render_chat(self, req, default_template: str | None = None) -> Prompt:
        """With tools, the packaged tool-aware template where the model's ignores them."""
        if default_template is None and req.tools:
            default_template = tool_template(self.tokenizer, self.tool_config)
        return super().render_chat(req, default_template)

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

    def _with_plan(
        self, params: SamplingParams, plan: ToolPlan, req: ChatCompletionRequest
    ) -> SamplingParams:
        """ "required" and named tool choices constrain the output to their JSON schema; a
        parser whose markers are special tokens keeps special tokens in the text."""
        reasoning = self._reasoning_parser(req)
        if plan.schema is not None:
            if params.structured_outputs is not None:
                raise ServingError(
                    f'tool_choice "{plan.mode}" constrains the output to tool calls; it cannot '
                    "be combined with response_format or structured_outputs.",
                    param="tool_choice",
                )
            # compact JSON: a small model let free whitespace between tokens can run on
            # emitting whitespace until max_tokens instead of finishing its call
            params.structured_outputs = StructuredOutputsParams(
                json=plan.schema, disable_any_whitespace=True
            )
        if plan.parser is not None and plan.parser.keeps_special_tokens:
            params.skip_special_tokens = False
        if params.structured_outputs is not None and reasoning is not None and reasoning.thinking:
            # as vLLM: a constraint shapes the answer, from the end of the reasoning
            end = self.tokenizer.encode(reasoning.end_text, add_special_tokens=False)
            params.reasoning_end_ids = list(end)
        return params

    def _reasoning_parser(self, req: ChatCompletionRequest) -> DeepSeekR1ReasoningParser | None:
        name = self.tool_config.reasoning_parser
        return None if name is None else get_reasoning_parser(name, req.chat_template_kwargs)

    def choice_parser(self, req: ChatCompletionRequest, plan: ToolPlan) -> ChoiceParser:
        reasoning = self._reasoning_parser(req)
        return ChoiceParser(reasoning, plan.parser, plan.limit, req.include_reasoning)

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
        self,
        serving: ChatServing,
        req: ChatCompletionRequest,
        rid: str,
        prompt: Prompt,
        plan: ToolPlan,
    ) -> None:
        self.serving = serving
        self.req = req
        self.id = rid
        self.created = now()
        self.prompt = prompt
        self.plan = plan
        self.choices = {i: ChoiceState() for i in range(req.n)}
        self.parsers = {i: serving.choice_parser(req, plan) for i in range(req.n)}
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

    def _finish_reason(self, index: int, reason: str | None) -> str | None:
        """As vLLM: "tool_calls" when an auto or required choice called a tool and stopped
        (a named choice keeps "stop", as OpenAI's; a cut-off call keeps "length")."""
        called = self.parsers[index].called and self.plan.mode in ("auto", "required")
        return "tool_calls" if called and reason == "stop" else reason

    async def collect(self, results: AsyncIterator) -> ChatCompletionResponse:
        async for _, output in results:
            if output.prompt_logprobs is not None:
                self.prompt_logprobs = output.prompt_logprobs
            for delta in output.outputs:
                self.choices[delta.index].add(delta)
                self.parsers[delta.index].step(delta.text, delta.finish_reason is not None)
        choices = []
        for i, state in sorted(self.choices.items()):
            parsed = self.parsers[i].message()
            content = parsed.content
            if self.echo:
                content = self.echo + (content or "")
            message = ChatResponseMessage(
                role="assistant",
                content=content,
                reasoning=parsed.reasoning,
                tool_calls=parsed.tool_calls,
            )
            choices.append(
                ChatCompletionResponseChoice(
                    index=i,
                    message=message,
                    logprobs=self._logprobs(state.logprobs),
                    finish_reason=self._finish_reason(i, state.finish_reason),
                    stop_reason=state.stop_reason,
                )
            )
        return ChatCompletionResponse(
            id=self.id,
            created=self.created,
            model=self.serving.model_name,
            choices=choices,
            usage=usage([self.prompt], self.choices),
            prompt_logprobs=clamp_prompt_logprobs(self.prompt_logprobs),
        )

    def opening(self) -> list[ChatCompletionStreamResponse]:
        # as OpenAI's: a reply that may be tool calls starts with content null, not ""
        parsed = self.plan.parser is not None or self.serving.tool_config.reasoning_parser
        role = DeltaMessage(role="assistant", content=None if parsed else "")
        opening = [self._chunk(i, role, None, None) for i in range(self.req.n)]
        if self.echo:
            echo = DeltaMessage(content=self.echo)
            opening += [self._chunk(i, echo, None, None) for i in range(self.req.n)]
        return opening

    async def chunks(self, results: AsyncIterator):
        async for _, output in results:
            for delta in output.outputs:
                chunk = self._delta_chunk(delta)
                if chunk is not None:
                    yield chunk, usage([self.prompt], {delta.index: self.choices[delta.index]})

    def usage_chunk(self) -> ChatCompletionStreamResponse:
        final = self._base([])
        final.usage = usage([self.prompt], self.choices)
        return final

    def _delta_chunk(self, delta: CompletionOutput) -> ChatCompletionStreamResponse | None:
        pairs = self.choices[delta.index].add(delta)
        logprobs = self._logprobs(pairs)
        new = self.parsers[delta.index].step(delta.text, delta.finish_reason is not None)
        if not new and delta.finish_reason is None and not pairs:
            return None
        fields: dict = {}
        if new.reasoning:
            fields["reasoning"] = new.reasoning
        if new.content:
            fields["content"] = new.content
        if new.tool_calls:
            fields["tool_calls"] = new.tool_calls
        return self._chunk(delta.index, DeltaMessage(**fields), logprobs, delta)

    def _chunk(
        self,
        index: int,
        message: DeltaMessage,
        logprobs: ChatCompletionLogProbs | None,
        delta: CompletionOutput | None,
    ) -> ChatCompletionStreamResponse:
        finish = None
        if delta is not None and delta.finish_reason is not None:
            finish = self._finish_reason(index, str(delta.finish_reason))
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
