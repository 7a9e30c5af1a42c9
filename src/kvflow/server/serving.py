"""Request logic shared by the endpoints; knows nothing of FastAPI.

Every failure a client can cause or meet is a `ServingError` (status, vLLM's error type, a
message that names the numbers); the routes turn it into `{"error": {...}}` with that status,
or into an SSE error event once a stream has begun.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from pydantic import BaseModel

from kvflow.engine.async_llm import AsyncEngine, EngineDeadError, EngineUnavailableError
from kvflow.engine.request_stream import RequestStream
from kvflow.outputs import CompletionOutput, Logprob, RequestOutput
from kvflow.sampling_params import SamplingParams, StructuredOutputsParams
from kvflow.server.chat_messages import template_message
from kvflow.server.errors import ServingError, engine_error
from kvflow.server.generation_defaults import request_defaults
from kvflow.server.protocol import (
    UNSUPPORTED_FIELDS,
    ChatTemplateFields,
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    RequestModel,
    SamplingFields,
    TokenizeChatRequest,
    TokenizeRequest,
    TokenizeResponse,
    UsageInfo,
)
from kvflow.server.request_fields import UnknownFields
from kvflow.server.structured import constraint

logger = logging.getLogger("kvflow.server")

MIN_LOGPROB = -9999.0  # JSON has no -inf


def sse(model: BaseModel) -> str:
    return f"data: {model.model_dump_json(exclude_unset=True)}\n\n"


SSE_DONE = "data: [DONE]\n\n"


class StreamedResponse(Protocol):
    """What the SSE driver (`sse_events`) asks of a streamed completion or chat completion."""

    id: str

    def opening(self) -> list[BaseModel]:
        """Chunks sent before any output (a chat's role, an echo)."""
        ...

    def chunks(self, results: AsyncIterator) -> AsyncIterator[tuple[BaseModel, UsageInfo]]:
        """One chunk per delta worth sending, each with its own choice's usage."""
        ...

    def usage_chunk(self) -> BaseModel:
        """The chunk with no choices and the whole request's usage."""
        ...


async def sse_events(
    response: StreamedResponse, results: AsyncIterator, options: Any
) -> AsyncIterator[str]:
    """The SSE body of a streamed response, for both endpoints: its chunks (each with its own
    usage under `continuous_usage_stats`), the usage chunk under `include_usage`, an error event
    if it fails mid-stream, then `data: [DONE]` whatever happened."""
    include_usage = bool(options and options.include_usage)
    continuous = include_usage and bool(options and options.continuous_usage_stats)
    try:
        for chunk in response.opening():
            yield sse(chunk)
        async for chunk, own_usage in response.chunks(results):
            if continuous:  # as vLLM: this choice's prompt and tokens
                chunk.usage = own_usage
            yield sse(chunk)
        if include_usage:
            yield sse(response.usage_chunk())
    except ServingError as err:
        yield sse(err.body())
    except Exception as exc:
        logger.exception("stream %s failed", response.id)
        yield sse(ServingError(f"Internal error: {exc}", 500).body())
    yield SSE_DONE


@dataclass
class EventStream:
    """An SSE body and how to abort its requests, even if the body is never iterated."""

    body: AsyncIterator[str]
    streams: list[RequestStream]

    def close(self) -> None:
        for stream in self.streams:
            stream.abort()


@dataclass
class Prompt:
    text: str | None
    token_ids: list[int]


@dataclass
class ChoiceState:
    """One choice accumulated over the deltas of a request."""

    text: list[str] = field(default_factory=list)
    num_tokens: int = 0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[tuple[int, dict[int, Logprob]]] = field(default_factory=list)

    def add(self, delta: CompletionOutput) -> list[tuple[int, dict[int, Logprob]]]:
        """Fold one delta in; returns its (token id, logprob entry) pairs."""
        self.text.append(delta.text)
        self.num_tokens += len(delta.token_ids)
        if delta.finish_reason is not None:
            self.finish_reason = str(delta.finish_reason)
            self.stop_reason = delta.stop_reason
        pairs = list(zip(delta.token_ids, delta.logprobs or [], strict=False))
        self.logprobs += pairs
        return pairs


def usage(prompts: Sequence[Prompt], choices: dict[int, ChoiceState]) -> UsageInfo:
    prompt_tokens = sum(len(p.token_ids) for p in prompts)
    completion_tokens = sum(c.num_tokens for c in choices.values())
    return UsageInfo(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
    )


def _given(value: Any, defaults: dict[str, Any], name: str, fallback: Any) -> Any:
    """The request's value, else the model's default, else vLLM's."""
    return value if value is not None else defaults.get(name, fallback)


class BaseServing:
    def __init__(
        self,
        engine: AsyncEngine,
        served_names: list[str],
        model_root: str,
        request_timeout: float | None = None,
        log_requests: bool = False,
        trust_request_chat_template: bool = False,
        max_log_len: int | None = None,
        sampling_defaults: dict[str, Any] | None = None,
        unknown_fields: UnknownFields | None = None,
    ) -> None:
        self.engine = engine
        # shared by the endpoints of one server: a field name is logged once
        self.unknown_fields = unknown_fields or UnknownFields()
        self.tokenizer = engine.tokenizer
        self.max_model_len = engine.max_model_len
        self.max_log_len = max_log_len
        # the model's recommended sampling values (generation_defaults.py): fields a request
        # leaves out take them; `max_tokens` caps the request's
        self.sampling_defaults = dict(sampling_defaults or {})
        self.served_names = served_names
        self.model_name = served_names[0]
        self.model_root = model_root
        self.request_timeout = request_timeout
        self.log_requests = log_requests
        self.trust_request_chat_template = trust_request_chat_template
        # The longest token's text: no prompt of more than max_model_len times this many
        # characters can fit (vLLM's bound, checked before the tokenizer runs). Walking the
        # vocabulary takes ~0.2 s: here at start-up, not on the first request.
        self.max_chars_per_token = max(len(token) for token in self.tokenizer.get_vocab())

    def check_request(self, req: RequestModel) -> None:
        """A request's first checks: its unknown fields (logged, or a 400 in strict mode),
        then its model (404 if not served)."""
        self.unknown_fields.check(req)
        model = getattr(req, "model", None)
        if model and model not in self.served_names:
            raise ServingError(f"The model `{model}` does not exist.", 404, param="model")

    # ---- building requests -------------------------------------------------------------------

    def _capped(self, max_tokens: int | None, prompt_len: int) -> int | None:
        """`max_tokens` under the generation config's cap (vLLM's `max_new_tokens` rule); left
        out (None), the cap within the context's room: the default never makes a 400."""
        cap, room = self.sampling_defaults.get("max_tokens"), self.max_model_len - prompt_len
        if cap is None or (max_tokens is not None and max_tokens > room):
            return max_tokens  # beyond the room: refused with the numbers (LLMEngine.validate)
        return max(1, min(cap, room)) if max_tokens is None else min(max_tokens, cap)

    def sampling_params(
        self,
        req: SamplingFields,
        max_tokens: int | None,
        logprobs: int | None,
        prompt_len: int,
        prompt_logprobs: int | None = None,
    ) -> SamplingParams:
        if req.use_beam_search:
            raise ServingError("Beam search is not supported.", param="use_beam_search")
        for name in UNSUPPORTED_FIELDS:
            if (req.model_extra or {}).get(name):
                hint = " Use `structured_outputs` (vLLM's)." if name.startswith("guided_") else ""
                raise ServingError(f"`{name}` is not supported by kvflow.{hint}", param=name)
        structured = self._constraint(req)[0]
        if req.prompt_logprobs and req.stream:  # vLLM's rule and wording (0 is allowed)
            raise ServingError(
                "`prompt_logprobs` are not available when `stream=True`.", param="prompt_logprobs"
            )
        options = req.stream_options  # as vLLM: an empty object is no options
        if options is not None and options.model_fields_set and not req.stream:
            raise ServingError(
                "Stream options can only be defined when `stream=True`.", param="stream_options"
            )
        d = request_defaults(self.sampling_defaults, structured is not None)
        max_tokens = self._capped(max_tokens, prompt_len)
        try:
            params = SamplingParams(
                n=req.n,
                best_of=req.best_of,
                presence_penalty=req.presence_penalty or 0.0,
                frequency_penalty=req.frequency_penalty or 0.0,
                repetition_penalty=_given(req.repetition_penalty, d, "repetition_penalty", 1.0),
                temperature=_given(req.temperature, d, "temperature", 1.0),
                top_p=_given(req.top_p, d, "top_p", 1.0),
                top_k=_given(req.top_k, d, "top_k", 0),
                min_p=_given(req.min_p, d, "min_p", 0.0),
                seed=req.seed,
                stop=[req.stop] if isinstance(req.stop, str) else list(req.stop or []),
                stop_token_ids=list(req.stop_token_ids or []),
                ignore_eos=req.ignore_eos,
                max_tokens=max_tokens,
                min_tokens=req.min_tokens,
                logprobs=logprobs,
                prompt_logprobs=req.prompt_logprobs if prompt_logprobs is None else prompt_logprobs,
                logit_bias=req.logit_bias,
                skip_special_tokens=req.skip_special_tokens,
                spaces_between_special_tokens=req.spaces_between_special_tokens,
                include_stop_str_in_output=req.include_stop_str_in_output,
                structured_outputs=structured,
            )
        except (ValueError, TypeError) as exc:
            raise ServingError(str(exc)) from exc
        return params

    @staticmethod
    def _constraint(req: SamplingFields) -> tuple[StructuredOutputsParams | None, str]:
        """The request's output constraint and the field it came from (400 if malformed)."""
        try:
            return constraint(getattr(req, "response_format", None), req.structured_outputs)
        except ValueError as exc:
            raise ServingError(str(exc), param="structured_outputs") from exc

    def encode(self, text: str, add_special_tokens: bool, param: str = "prompt") -> list[int]:
        """Token ids of request text. Text longer than any prompt that fits, or not Unicode the
        tokenizer can take (a lone surrogate, which JSON's \\ud800 escapes can carry), is the
        request's fault: 400, before the tokenizer runs."""
        bound = self.max_model_len * self.max_chars_per_token
        if len(text) > bound:  # tokenizing megabytes would stall the event loop for seconds
            raise ServingError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, "
                f"your prompt contains {len(text)} characters (more than {bound} characters, "
                f"which is the upper bound for {self.max_model_len} input tokens). Please reduce "
                "the length of the input prompt.",
                param=param,
            )
        try:
            text.encode()
        except UnicodeEncodeError as exc:
            raise ServingError(
                f"The text in `{param}` is not valid Unicode ({exc.reason}).",
                param=param,
            ) from exc
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def token_prompt(self, token_ids: list[int]) -> Prompt:
        try:
            ids = self.engine.tokenize_prompt(token_ids)
        except ValueError as exc:
            raise ServingError(str(exc), param="prompt") from exc
        return Prompt(None, ids)

    def render_chat(self, req: ChatTemplateFields, default_template: str | None = None) -> Prompt:
        """The prompt of a chat: the request's template, else `default_template`, else the
        model's."""
        if req.continue_final_message and req.add_generation_prompt:
            raise ServingError(
                "Cannot set both `continue_final_message` and `add_generation_prompt` to True."
            )
        kwargs = dict(req.chat_template_kwargs or {})
        template = req.chat_template or kwargs.pop("chat_template", None)
        if template is not None and not self.trust_request_chat_template:
            raise ServingError(
                "Chat template is passed with request, but --trust-request-chat-template is not "
                "set. Refused request with untrusted chat template.",
                param="chat_template",
            )
        if unexpected := {"tokenize", "conversation"} & kwargs.keys():
            raise ServingError(
                f"Found unexpected chat template kwargs from request: {sorted(unexpected)}",
                param="chat_template_kwargs",
            )
        # as vLLM: the request's own fields win over the same keys in chat_template_kwargs
        kwargs.update(
            add_generation_prompt=req.add_generation_prompt,
            continue_final_message=req.continue_final_message,
        )
        if req.tools is not None:
            kwargs["tools"] = req.tools
        try:
            messages = [template_message(m) for m in req.messages]
        except ValueError as exc:
            raise ServingError(str(exc), param="messages") from exc
        try:
            text = self.tokenizer.apply_chat_template(
                messages, tokenize=False, chat_template=template or default_template, **kwargs
            )
        except Exception as exc:  # a template error is the request's fault
            raise ServingError(f"Could not apply the chat template: {exc}") from exc
        return Prompt(text, self.encode(text, req.add_special_tokens, "messages"))

    # ---- running requests --------------------------------------------------------------------

    def truncate(self, prompt: Prompt, req: SamplingFields) -> Prompt:
        """vLLM's `truncate_prompt_tokens` (-1: the context less one token of room): keep the
        last k tokens, or the first k with `truncation_side` "right"."""
        k = req.truncate_prompt_tokens
        if k is None:
            return prompt
        if k == -1:
            k = self.max_model_len - 1
        if k > self.max_model_len:
            raise ServingError(
                f"truncate_prompt_tokens={k} cannot be greater than max_model_len="
                f"{self.max_model_len}. Please request a smaller truncation size.",
                param="truncate_prompt_tokens",
            )
        ids = prompt.token_ids
        if len(ids) <= k:
            return prompt
        return Prompt(None, ids[:k] if req.truncation_side == "right" else ids[len(ids) - k :])

    def submit(
        self, request_id: str, prompts: list[Prompt], params: list[SamplingParams]
    ) -> list[RequestStream]:
        """Validate every prompt first, then queue them all: nothing is queued for a request
        that is refused (`AsyncEngine.add_requests`)."""
        ids = (
            [request_id]
            if len(prompts) == 1
            else [f"{request_id}-{i}" for i in range(len(prompts))]
        )
        try:
            streams = self.engine.add_requests(
                ids, [p.token_ids for p in prompts], params, [p.text for p in prompts]
            )
        except (ValueError, EngineUnavailableError, EngineDeadError) as exc:
            raise engine_error(exc) from exc
        if self.log_requests:
            cut = self.max_log_len
            logger.info(
                "request %s: %d prompt(s) of %s tokens, params %s, prompt %r, ids %s",
                request_id,
                len(prompts),
                [len(p.token_ids) for p in prompts],
                params[0],
                (prompts[0].text or "")[:cut],
                prompts[0].token_ids[:cut],
            )
        return streams

    async def results(
        self, streams: list[RequestStream], timeout: float | None
    ) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(prompt index, delta output) until every stream ends. Raises ServingError for a
        request that failed (500), was aborted (503) or ran past its deadline (408); leaving
        the iteration early aborts whatever still runs."""
        timeout = timeout or self.request_timeout
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        merged = _merge(streams)
        try:
            while True:
                try:
                    async with asyncio.timeout_at(deadline):
                        i, output = await anext(merged)
                except StopAsyncIteration:
                    return
                except TimeoutError:
                    raise ServingError(
                        f"The request exceeded its timeout of {timeout:g} s and was aborted.", 408
                    ) from None
                self._raise_for_failure(output)
                yield i, output
        finally:
            await merged.aclose()
            for stream in streams:
                stream.abort()

    def _raise_for_failure(self, output: RequestOutput) -> None:
        reasons = {str(c.finish_reason) for c in output.outputs if c.finish_reason}
        if "error" in reasons:
            raise ServingError(output.metrics.get("error") or "The request failed.", 500)
        if "abort" in reasons:
            why = "the server is shutting down" if not self.engine.accepting else "it was aborted"
            raise ServingError(f"The request was not completed: {why}.", 503)

    # ---- models, tokenizer ---------------------------------------------------------------------

    def models(self) -> ModelList:
        return ModelList(
            data=[
                ModelCard(id=name, root=self.model_root, max_model_len=self.max_model_len)
                for name in self.served_names
            ]
        )

    def tokenize(self, req: TokenizeRequest) -> TokenizeResponse:
        self.check_request(req)
        if isinstance(req, TokenizeChatRequest):
            ids = self.render_chat(req).token_ids
        else:
            ids = self.encode(req.prompt, req.add_special_tokens)
        strs = self.tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None
        return TokenizeResponse(
            count=len(ids), max_model_len=self.max_model_len, tokens=ids, token_strs=strs
        )

    def detokenize(self, req: DetokenizeRequest) -> DetokenizeResponse:
        self.check_request(req)
        ids = self.token_prompt(req.tokens).token_ids if req.tokens else []
        return DetokenizeResponse(prompt=self.tokenizer.decode(ids))

    def token_text(self, token_id: int, entry: Logprob | None) -> str:
        if entry is not None and entry.decoded_token is not None:
            return entry.decoded_token
        return self.tokenizer.decode([token_id])


async def _merge(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleave several request streams as their outputs arrive."""
    if len(streams) == 1:
        async for output in streams[0]:
            yield 0, output
        return
    queue: asyncio.Queue[tuple[int, RequestOutput]] = asyncio.Queue()

    async def pump(i: int, stream: RequestStream) -> None:
        async for output in stream:
            queue.put_nowait((i, output))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            i, output = await queue.get()
            remaining -= output.finished
            yield i, output
    finally:
        for task in tasks:
            task.cancel()


def clamp_logprob(value: float) -> float:
    return max(value, MIN_LOGPROB)


def clamp_prompt_logprobs(
    entries: list[dict[int, Logprob] | None] | None,
) -> list[dict[int, Logprob] | None] | None:
    """A response's `prompt_logprobs` (JSON has no -inf): vLLM's shape, values clamped."""
    if entries is None:
        return None
    return [
        None
        if entry is None
        else {
            t: Logprob(clamp_logprob(lp.logprob), lp.rank, lp.decoded_token)
            for t, lp in entry.items()
        }
        for entry in entries
    ]
