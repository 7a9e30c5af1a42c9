"""POST /v1/completions: prompts (text, token ids, or lists of either), echo, logprobs (of the
prompt too, with echo: what log-likelihood evaluations read), n, SSE."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from dataclasses import replace

from kvflow.outputs import CompletionOutput, Logprob, RequestOutput
from kvflow.sampling_params import MAX_N_SEQUENCES, SamplingParams
from kvflow.server.protocol import (
    MAX_PROMPTS,
    CompletionLogProbs,
    CompletionRequest,
    CompletionResponse,
    CompletionResponseChoice,
    CompletionResponseStreamChoice,
    CompletionStreamResponse,
    UsageInfo,
    now,
    random_id,
)
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

logger = logging.getLogger("kvflow.server")

DEFAULT_MAX_TOKENS = 16


class CompletionLogprobsBuilder:
    """Completions-format logprobs (tokens, token_logprobs, top_logprobs, text_offset)."""

    def __init__(self, serving: BaseServing, initial_offset: int) -> None:
        self.serving = serving
        self.offset = initial_offset

    def build(self, pairs: list[tuple[int, dict[int, Logprob] | None]]) -> CompletionLogProbs:
        """Entries may be None (the prompt's first token has no logprob). The fields are set
        explicitly: streamed chunks are dumped with exclude_unset, which drops defaults."""
        out = CompletionLogProbs(text_offset=[], token_logprobs=[], tokens=[], top_logprobs=[])
        for token_id, entry in pairs:
            sampled = entry.get(token_id) if entry is not None else None
            text = self.serving.token_text(token_id, sampled)
            out.tokens.append(text)
            out.token_logprobs.append(clamp_logprob(sampled.logprob) if sampled else None)
            out.top_logprobs.append(
                None
                if entry is None
                else {
                    self.serving.token_text(tid, lp): clamp_logprob(lp.logprob)
                    for tid, lp in entry.items()
                }
            )
            out.text_offset.append(self.offset)
            self.offset += len(text)
        return out


class CompletionServing(BaseServing):
    async def create_completion(self, req: CompletionRequest) -> CompletionResponse | EventStream:
        """Validates and queues everything before returning: a refused request raises
        ServingError here, never after a stream began."""
        self.check_request(req)
        if req.suffix is not None:
            raise ServingError("suffix is not currently supported", param="suffix")
        prompts = self._prompts(req)
        params = [self._params(req, p) for p in prompts]
        so = params[0].structured_outputs  # the request's, for every prompt
        await check_constraint(self.engine, so, self._constraint(req)[1])
        request_id = random_id("cmpl")
        streams = self.submit(request_id, prompts, params)
        run = _Run(self, req, request_id, prompts)
        if req.stream:
            results = self.results(streams, req.request_timeout)
            return EventStream(sse_events(run, results, req.stream_options), streams)
        return await run.collect(self.results(streams, req.request_timeout))

    def _prompts(self, req: CompletionRequest) -> list[Prompt]:
        raw = req.prompt
        if isinstance(raw, str):
            raw = [raw]
        elif raw and isinstance(raw[0], int):
            raw = [raw]
        if not raw:
            raise ServingError("The prompt cannot be empty.", param="prompt")
        if len(raw) > MAX_PROMPTS:  # vLLM's bound and wording
            raise ServingError(
                f"prompt list length {len(raw)} exceeds the maximum allowed count of "
                f"{MAX_PROMPTS}.",
                param="prompt",
            )
        if len(raw) > 1 and len(raw) * req.n > MAX_N_SEQUENCES:  # each choice is a request
            raise ServingError(
                f"{len(raw)} prompts x n={req.n} = {len(raw) * req.n} choices; at most "
                f"{MAX_N_SEQUENCES} per request.",
                param="n",
            )
        prompts = []
        for item in raw:
            if isinstance(item, str):
                prompt = Prompt(item, self.encode(item, req.add_special_tokens))
            else:
                prompt = self.token_prompt(list(item))
            prompts.append(self.truncate(prompt, req))
        return prompts

    def _params(self, req: CompletionRequest, prompt: Prompt) -> SamplingParams:
        max_tokens = req.max_tokens
        if req.echo and max_tokens == 0:
            max_tokens = 1  # the prompt alone goes back (vLLM: the one token is dropped)
        elif "max_tokens" not in req.model_fields_set:
            # The default never makes a request fail: clamp it to the rest of the context.
            room = self.max_model_len - len(prompt.token_ids)
            max_tokens = max(1, min(DEFAULT_MAX_TOKENS, room))
        prompt_logprobs = req.prompt_logprobs
        if prompt_logprobs is None and req.echo:
            prompt_logprobs = req.logprobs  # echoed prompt tokens come with their logprobs
        return self.sampling_params(
            req, max_tokens, req.logprobs, len(prompt.token_ids), prompt_logprobs
        )

    def prompt_text(self, prompt: Prompt) -> str:
        if prompt.text is None:
            prompt.text = self.tokenizer.decode(prompt.token_ids)
        return prompt.text


class _Run:
    """One completion request in flight: its choices, usage and response shape."""

    def __init__(
        self, serving: CompletionServing, req: CompletionRequest, rid: str, prompts: list[Prompt]
    ) -> None:
        self.serving = serving
        self.req = req
        self.id = rid
        self.created = now()
        self.prompts = prompts
        self.choices: dict[int, ChoiceState] = {}
        self.builders: dict[int, CompletionLogprobsBuilder] = {}
        self.prompt_logprobs: dict[int, list] = {}  # prompt i -> its prompt logprobs, once known
        self.prompt_only = bool(req.echo) and req.max_tokens == 0  # scoring the prompt

    def _outputs(self, i: int, output: RequestOutput) -> list[CompletionOutput]:
        if output.prompt_logprobs is not None:
            self.prompt_logprobs[i] = output.prompt_logprobs
        return output.outputs

    def _fold(self, i: int, delta: CompletionOutput) -> tuple[int, str, CompletionLogProbs | None]:
        """Fold a delta into its choice; returns (choice index, new text, new logprobs). With
        echo the choice's first delta starts with the prompt (and its tokens' logprobs)."""
        key = i * self.req.n + delta.index
        if self.prompt_only:  # the engine's one token is not part of the answer
            delta = replace(delta, text="", token_ids=[], logprobs=None)
        state = self.choices.get(key)
        prefix, echoed = "", []
        if state is None:
            state = self.choices[key] = ChoiceState()
            offset = 0
            if self.req.echo:
                prefix = self.serving.prompt_text(self.prompts[i])
                entries = self.prompt_logprobs.get(i)
                if entries is None:  # ended before its prompt was computed
                    offset = len(prefix)
                else:
                    echoed = list(zip(self.prompts[i].token_ids, entries, strict=True))
            self.builders[key] = CompletionLogprobsBuilder(self.serving, offset)
        pairs = state.add(delta)
        if prefix:
            state.text.insert(0, prefix)
        logprobs = None
        if self.req.logprobs is not None:
            logprobs = self.builders[key].build(echoed + pairs)
        return key, prefix + delta.text, logprobs

    async def collect(self, results: AsyncIterator) -> CompletionResponse:
        logprobs: dict[int, CompletionLogProbs] = {}
        async for i, output in results:
            for delta in self._outputs(i, output):
                key, _, lp = self._fold(i, delta)
                if lp is not None:
                    acc = logprobs.setdefault(key, CompletionLogProbs())
                    for name in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
                        getattr(acc, name).extend(getattr(lp, name))
        choices = [
            CompletionResponseChoice(
                index=key,
                text="".join(state.text),
                logprobs=logprobs.get(key) if self.req.logprobs is not None else None,
                finish_reason=state.finish_reason,
                stop_reason=state.stop_reason,
                prompt_logprobs=clamp_prompt_logprobs(self.prompt_logprobs.get(key // self.req.n)),
            )
            for key, state in sorted(self.choices.items())
        ]
        return CompletionResponse(
            id=self.id,
            created=self.created,
            model=self.serving.model_name,
            choices=choices,
            usage=usage(self.prompts, self.choices),
        )

    def opening(self) -> list[CompletionStreamResponse]:
        return []

    async def chunks(self, results: AsyncIterator):
        async for i, output in results:
            for delta in self._outputs(i, output):
                chunk = self._chunk(i, delta)
                if chunk is not None:
                    key = chunk.choices[0].index
                    own = [self.prompts[key // self.req.n]]
                    yield chunk, usage(own, {key: self.choices[key]})

    def usage_chunk(self) -> CompletionStreamResponse:
        return self._chunk_base([], usage(self.prompts, self.choices))

    def _chunk(self, i: int, delta: CompletionOutput) -> CompletionStreamResponse | None:
        key, text, logprobs = self._fold(i, delta)
        if not text and delta.finish_reason is None and not logprobs:
            return None
        choice = CompletionResponseStreamChoice(
            index=key,
            text=text,
            logprobs=logprobs,
            finish_reason=None if delta.finish_reason is None else str(delta.finish_reason),
            stop_reason=delta.stop_reason,
        )
        return self._chunk_base([choice], None)

    def _chunk_base(self, choices: list, usage_info: UsageInfo | None) -> CompletionStreamResponse:
        chunk = CompletionStreamResponse(
            id=self.id,
            object="text_completion",
            created=self.created,
            model=self.serving.model_name,
            choices=choices,
        )
        if usage_info is not None:
            chunk.usage = usage_info
        return chunk
