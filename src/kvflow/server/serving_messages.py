"""Anthropic's Messages API (`/v1/messages`, `/v1/messages/count_tokens`) over the chat
endpoint: a request becomes the chat request it means (system prompt, text, tool_use and
tool_result blocks, tools and tool_choice, stop_sequences), runs as one, and its answer or its
stream is put in Anthropic's shapes: content blocks, stop reasons, and the stream's events
(message_start, content_block_start / _delta / _stop, message_delta, message_stop). Errors take
Anthropic's shape (`anthropic_error`); the routes choose it by path.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any, Literal

from pydantic import BaseModel, Field

from kvflow.server.protocol import (
    MAX_STOP_STRINGS,
    ChatCompletionRequest,
    ChatCompletionResponse,
    RequestModel,
    StreamOptions,
    random_id,
)
from kvflow.server.serving import EventStream, ServingError
from kvflow.server.serving_chat import ChatServing

# what a chat's finish reason is as a message's stop reason
STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}


class AnthropicMessage(RequestModel):
    role: Literal["user", "assistant"]
    content: str | list[dict[str, Any]]


class MessagesRequest(RequestModel):
    model: str
    max_tokens: int = Field(ge=1)
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    stop_sequences: list[str] | None = Field(default=None, max_length=MAX_STOP_STRINGS)
    stream: bool = False
    temperature: float | None = Field(default=None, ge=0.0, le=1.0)
    top_p: float | None = None
    top_k: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None


class CountTokensRequest(RequestModel):
    model: str
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None


class CountTokensResponse(BaseModel):
    input_tokens: int


class MessageUsage(BaseModel):
    input_tokens: int
    output_tokens: int


class MessageResponse(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[dict[str, Any]]
    stop_reason: str | None
    stop_sequence: str | None = None
    usage: MessageUsage


def _text(content: Any, where: str) -> str:
    """The text of a system prompt or a tool result: a string, or its text blocks joined."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ServingError(f"{where}: expected a string or a list of text blocks.", param=where)
    parts = []
    for block in content:
        if not isinstance(block, dict) or block.get("type") != "text":
            raise ServingError(
                f"{where}: only text blocks are supported here, got {block!r:.80}.",
                param=where,
            )
        parts.append(str(block.get("text", "")))
    return "".join(parts)


def _chat_messages(req: MessagesRequest | CountTokensRequest) -> list[dict[str, Any]]:
    """The request's turns as chat messages: a user turn's tool_result blocks become tool
    messages (before its text, which answers after them), an assistant turn's tool_use blocks
    its tool calls."""
    out: list[dict[str, Any]] = []
    if req.system is not None:
        out.append({"role": "system", "content": _text(req.system, "system")})
    for i, message in enumerate(req.messages):
        where = f"messages.{i}.content"
        if isinstance(message.content, str):
            out.append({"role": message.role, "content": message.content})
            continue
        texts, calls, results = [], [], []
        for block in message.content:
            kind = block.get("type")
            if kind == "text":
                texts.append(str(block.get("text", "")))
            elif kind == "tool_use" and message.role == "assistant":
                arguments = json.dumps(block.get("input") or {})
                function = {"name": block.get("name"), "arguments": arguments}
                calls.append({"id": block.get("id"), "type": "function", "function": function})
            elif kind == "tool_result" and message.role == "user":
                content = block.get("content") or ""
                results.append(
                    {
                        "role": "tool",
                        "tool_call_id": block.get("tool_use_id"),
                        "content": _text(content, where),
                    }
                )
            elif kind == "thinking" and message.role == "assistant":
                continue  # earlier reasoning: the chat template drops it
            else:
                raise ServingError(
                    f"{where}: a {message.role} turn's block of type {kind!r} is not supported.",
                    param=where,
                )
        out += results
        if texts or calls or not results:
            turn: dict[str, Any] = {"role": message.role, "content": "".join(texts)}
            if calls:
                turn["tool_calls"] = calls
            out.append(turn)
    return out


def _tools(req: MessagesRequest | CountTokensRequest) -> tuple[list | None, Any]:
    """(the chat request's tools, its tool_choice) for Anthropic's tools and tool_choice."""
    if not req.tools:
        if req.tool_choice and req.tool_choice.get("type") not in (None, "auto", "none"):
            raise ServingError("tool_choice needs tools.", param="tool_choice")
        return None, "none"
    tools = []
    for i, tool in enumerate(req.tools):
        if "input_schema" not in tool or "name" not in tool:
            raise ServingError(
                f"tools.{i}: a tool needs a name and an input_schema (server tools such as "
                f"{tool.get('type')!r} are not supported).",
                param=f"tools.{i}",
            )
        function = {"name": tool["name"], "parameters": tool["input_schema"]}
        if tool.get("description"):
            function["description"] = tool["description"]
        tools.append({"type": "function", "function": function})
    choice = req.tool_choice or {"type": "auto"}
    kind = choice.get("type")
    if kind == "tool":
        return tools, {"type": "function", "function": {"name": choice.get("name")}}
    if kind not in ("auto", "any", "none"):
        raise ServingError(f"Unknown tool_choice type {kind!r}.", param="tool_choice")
    return tools, {"auto": "auto", "any": "required", "none": "none"}[kind]


def chat_request(req: MessagesRequest | CountTokensRequest, **fields: Any) -> ChatCompletionRequest:
    tools, tool_choice = _tools(req)
    return ChatCompletionRequest(
        model=req.model,
        messages=_chat_messages(req),
        tools=tools,
        tool_choice=tool_choice,
        **fields,
    )


def _stop_reason(finish: str | None, matched: Any, called: bool) -> tuple[str | None, str | None]:
    """(stop_reason, stop_sequence) of a chat finish reason, the stop string it matched and
    whether the reply called a tool (a named tool_choice's chat finishes "stop", as vLLM's)."""
    if finish == "stop" and isinstance(matched, str):
        return "stop_sequence", matched
    if finish == "stop" and called:
        return "tool_use", None
    return STOP_REASONS.get(finish or "", None if finish is None else "end_turn"), None


class MessagesServing:
    """`/v1/messages` and its token count, run by the chat endpoint's serving."""

    def __init__(self, chat: ChatServing) -> None:
        self.chat = chat

    def count_tokens(self, req: CountTokensRequest) -> CountTokensResponse:
        self.chat.check_request(req)
        chat = chat_request(req)
        return CountTokensResponse(input_tokens=len(self.chat.render_chat(chat).token_ids))

    async def create_message(self, req: MessagesRequest) -> MessageResponse | EventStream:
        self.chat.check_request(req)
        fields: dict[str, Any] = dict(max_tokens=req.max_tokens, stream=req.stream)
        for name in ("temperature", "top_p", "top_k"):
            if getattr(req, name) is not None:
                fields[name] = getattr(req, name)
        if req.stop_sequences:
            fields["stop"] = req.stop_sequences
        if req.stream:  # every chunk with its usage: message_start carries the prompt's
            fields["stream_options"] = StreamOptions(
                include_usage=True, continuous_usage_stats=True
            )
        result = await self.chat.create_chat_completion(chat_request(req, **fields))
        if isinstance(result, EventStream):
            events = _stream_events(result.body, random_id("msg"), self.chat.model_name)
            return EventStream(events, result.streams)
        return _message(result)


def _message(chat: ChatCompletionResponse) -> MessageResponse:
    choice = chat.choices[0]
    content: list[dict[str, Any]] = []
    if choice.message.reasoning:
        content.append({"type": "thinking", "thinking": choice.message.reasoning, "signature": ""})
    if choice.message.content:
        content.append({"type": "text", "text": choice.message.content})
    for call in choice.message.tool_calls:
        content.append(
            {
                "type": "tool_use",
                "id": call.id,
                "name": call.function.name,
                "input": _arguments(call.function.arguments),
            }
        )
    called = bool(choice.message.tool_calls)
    stop_reason, stop_sequence = _stop_reason(choice.finish_reason, choice.stop_reason, called)
    usage = MessageUsage(
        input_tokens=chat.usage.prompt_tokens, output_tokens=chat.usage.completion_tokens or 0
    )
    return MessageResponse(
        id=random_id("msg"),
        model=chat.model,
        content=content,
        stop_reason=stop_reason,
        stop_sequence=stop_sequence,
        usage=usage,
    )


def _arguments(text: str) -> Any:
    """A tool call's arguments as the JSON value they are (an object; {} when the model's text
    does not parse, as the call is still reported)."""
    try:
        return json.loads(text) if text else {}
    except json.JSONDecodeError:
        return {}


def _event(kind: str, **data: Any) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data})}\n\n"


class _MessageEvents:
    """A streamed message's state as its chat chunks arrive: whether message_start went out,
    the open content block (its kind and index), the usage so far, and how the chat ended."""

    def __init__(self, message_id: str, model: str) -> None:
        self.id, self.model = message_id, model
        self.started = False
        self.block: str | None = None  # the open block's kind: "text", "thinking" or "tool_use"
        self.index = -1
        self.usage = {"input_tokens": 0, "output_tokens": 0}
        self.finish: str | None = None
        self.matched: Any = None  # the stop string the chat matched
        self.called = False

    def start(self) -> str:
        self.started = True
        message = {"id": self.id, "type": "message", "role": "assistant", "model": self.model}
        message.update(content=[], stop_reason=None, stop_sequence=None, usage=dict(self.usage))
        return _event("message_start", message=message)

    def _open(self, kind: str, body: dict[str, Any]) -> list[str]:
        out = [_event("content_block_stop", index=self.index)] if self.block is not None else []
        self.block, self.index = kind, self.index + 1
        return [*out, _event("content_block_start", index=self.index, content_block=body)]

    def _delta(self, kind: str, body: dict[str, Any], delta: dict[str, Any]) -> list[str]:
        """A delta of a `kind` block, opening one (`body`) unless that kind is open."""
        out = self._open(kind, body) if self.block != kind else []
        return [*out, _event("content_block_delta", index=self.index, delta=delta)]

    def chunk(self, chunk: dict[str, Any]) -> list[str]:
        """The events of one chat chunk (message_start before the first that has any)."""
        if chunk.get("usage"):
            self.usage["input_tokens"] = chunk["usage"].get("prompt_tokens", 0)
            self.usage["output_tokens"] = chunk["usage"].get("completion_tokens") or 0
        if not chunk.get("choices"):
            return []
        choice = chunk["choices"][0]
        delta = choice.get("delta") or {}
        out: list[str] = []
        if delta.get("reasoning"):
            part = {"type": "thinking_delta", "thinking": delta["reasoning"]}
            out += self._delta("thinking", {"type": "thinking", "thinking": ""}, part)
        if delta.get("content"):
            part = {"type": "text_delta", "text": delta["content"]}
            out += self._delta("text", {"type": "text", "text": ""}, part)
        for call in delta.get("tool_calls") or []:
            function = call.get("function") or {}
            if call.get("id"):  # a call's first delta: a block of its own
                self.called = True
                body = {"type": "tool_use", "id": call["id"], "name": function.get("name")}
                out += self._open("tool_use", {**body, "input": {}})
            if function.get("arguments"):
                part = {"type": "input_json_delta", "partial_json": function["arguments"]}
                out.append(_event("content_block_delta", index=self.index, delta=part))
        if choice.get("finish_reason") is not None:
            self.finish, self.matched = choice["finish_reason"], choice.get("stop_reason")
        if out and not self.started:  # the prompt's usage came with this chunk
            out.insert(0, self.start())
        return out

    def error(self, error: dict[str, Any]) -> list[str]:
        body, _ = ServingError(error["message"], error.get("code", 500)).anthropic()
        opening = [] if self.started else [self.start()]
        return [*opening, _event("error", error=body.error.model_dump())]

    def end(self) -> list[str]:
        out = [] if self.started else [self.start()]
        if self.block is not None:
            out.append(_event("content_block_stop", index=self.index))
        stop_reason, stop_sequence = _stop_reason(self.finish, self.matched, self.called)
        delta = {"stop_reason": stop_reason, "stop_sequence": stop_sequence}
        usage = {"output_tokens": self.usage["output_tokens"]}
        return [*out, _event("message_delta", delta=delta, usage=usage), _event("message_stop")]


async def _stream_events(chunks: AsyncIterator[str], message_id: str, model: str):
    """Anthropic's events for a chat stream's SSE chunks (their usage on every chunk): text,
    reasoning ("thinking") and each tool call open a content block of their own; an error
    mid-stream is an `error` event, and the stream ends there."""
    message = _MessageEvents(message_id, model)
    try:
        async for raw in chunks:
            data = raw.removeprefix("data: ").strip()
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            if "error" in chunk:
                for event in message.error(chunk["error"]):
                    yield event
                return
            for event in message.chunk(chunk):
                yield event
    finally:
        await chunks.aclose()  # type: ignore[attr-defined]
    for event in message.end():
        yield event
