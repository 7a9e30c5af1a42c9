"""Pydantic schemas of the OpenAI-compatible API, with vLLM's field names and defaults.

Requests accept unknown fields (like vLLM, which ignores them with a warning); responses are
exactly what the routes send, so `/openapi.json` describes the bodies truthfully.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from kvflow.outputs import Logprob


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


class RequestModel(BaseModel):
    model_config = ConfigDict(extra="allow")


MAX_STOP_STRINGS = 4  # vLLM's defaults (VLLM_MAX_STOP_STRINGS, VLLM_MAX_COMPLETION_PROMPTS)
MAX_PROMPTS = 1024
# vLLM request fields kvflow does not implement: refused when set, never silently ignored
UNSUPPORTED_FIELDS = (
    "allowed_token_ids",
    "bad_words",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "prompt_embeds",
)


# ---- errors ------------------------------------------------------------------------------------


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(BaseModel):
    error: ErrorInfo


class AnthropicErrorInfo(BaseModel):
    type: str
    message: str


class AnthropicErrorResponse(BaseModel):
    """Anthropic's error shape, which /v1/messages answers in."""

    type: Literal["error"] = "error"
    error: AnthropicErrorInfo


# ---- shared ------------------------------------------------------------------------------------


class StreamOptions(RequestModel):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class PromptTokenUsageInfo(BaseModel):
    cached_tokens: int | None = None


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    total_tokens: int = 0
    completion_tokens: int | None = 0
    prompt_tokens_details: PromptTokenUsageInfo | None = None


class SamplingFields(RequestModel):
    """Sampling fields shared by both endpoints: OpenAI's, then vLLM's extras."""

    n: int | None = 1
    best_of: int | None = None
    presence_penalty: float | None = 0.0
    frequency_penalty: float | None = 0.0
    logit_bias: dict[str, float] | None = None
    seed: int | None = Field(default=None, ge=-(2**63), le=2**63 - 1)
    stop: str | Annotated[list[str], Field(max_length=MAX_STOP_STRINGS)] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    user: str | None = None
    use_beam_search: bool = False
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    prompt_logprobs: int | None = None
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1)
    truncation_side: Literal["left", "right"] | None = None
    # vLLM's output constraint: json, regex, choice, grammar, json_object or structural_tag
    structured_outputs: dict[str, Any] | None = None
    request_timeout: float | None = Field(
        default=None, gt=0, description="kvflow: abort the request after this many seconds"
    )

    @field_validator("n")
    @classmethod
    def _n_null_is_one(cls, n: int | None) -> int:
        return 1 if n is None else n


# ---- /v1/completions ---------------------------------------------------------------------------


class CompletionRequest(SamplingFields):
    model: str | None = None
    prompt: list[int] | list[list[int]] | str | list[str]
    echo: bool | None = False
    logprobs: int | None = None
    max_tokens: int | None = 16
    suffix: str | None = None
    add_special_tokens: bool = True
    response_format: dict[str, Any] | None = None

    @model_validator(mode="before")
    @classmethod
    def _max_tokens_null_is_default(cls, data: Any) -> Any:
        """As vLLM: an explicit null max_tokens is the default (16, within the context's room),
        not the rest of the context."""
        if isinstance(data, dict) and "max_tokens" in data and data["max_tokens"] is None:
            data = {k: v for k, v in data.items() if k != "max_tokens"}
        return data


class CompletionLogProbs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionResponseChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None  # vLLM's extension


class CompletionResponse(BaseModel):
    id: str = Field(default_factory=lambda: random_id("cmpl"))
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[CompletionResponseChoice]
    usage: UsageInfo


class CompletionResponseStreamChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionStreamResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionResponseStreamChoice]
    usage: UsageInfo | None = None


# ---- /v1/chat/completions ----------------------------------------------------------------------


class ChatMessage(RequestModel):
    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant turn's calls
    tool_call_id: str | None = None  # a tool turn: the call it answers


class ChatTemplateFields(RequestModel):
    messages: list[ChatMessage]
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None


class ChatCompletionRequest(ChatTemplateFields, SamplingFields):
    model: str | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = 0
    max_tokens: int | None = Field(default=None, description="deprecated: max_completion_tokens")
    max_completion_tokens: int | None = None
    response_format: dict[str, Any] | None = None
    tool_choice: str | dict[str, Any] | None = "none"
    parallel_tool_calls: bool | None = True
    include_reasoning: bool = True  # vLLM's: false drops the reasoning from the response
    echo: bool = False  # vLLM's: the reply starts with the last message if its role is the reply's


class ChatCompletionLogProb(BaseModel):
    token: str
    logprob: float = -9999.0
    bytes: list[int] | None = None


class ChatCompletionLogProbsContent(ChatCompletionLogProb):
    top_logprobs: list[ChatCompletionLogProb] = Field(default_factory=list)


class ChatCompletionLogProbs(BaseModel):
    content: list[ChatCompletionLogProbsContent] | None = None


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatResponseMessage(BaseModel):
    role: str
    content: str | None = None
    reasoning: str | None = None  # vLLM's field (0.3x) for a --reasoning-parser's split
    tool_calls: list[ToolCall] = Field(default_factory=list)


class ChatCompletionResponseChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = "stop"
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str = Field(default_factory=lambda: random_id("chatcmpl"))
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[ChatCompletionResponseChoice]
    usage: UsageInfo
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None  # vLLM's extension


class DeltaFunctionCall(BaseModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(BaseModel):
    """A call's first delta has its index, id, type and name; later ones the index and more
    argument text."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall | None = None


class DeltaMessage(BaseModel):
    role: str | None = None
    content: str | None = None
    reasoning: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatCompletionResponseStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionStreamResponse(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatCompletionResponseStreamChoice]
    usage: UsageInfo | None = None


# ---- models, tokenizer, version ----------------------------------------------------------------


class ModelPermission(BaseModel):
    id: str = Field(default_factory=lambda: random_id("modelperm"))
    object: Literal["model_permission"] = "model_permission"
    created: int = Field(default_factory=now)
    allow_create_engine: bool = False
    allow_sampling: bool = True
    allow_logprobs: bool = True
    allow_search_indices: bool = False
    allow_view: bool = True
    allow_fine_tuning: bool = False
    organization: str = "*"
    group: str | None = None
    is_blocking: bool = False


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=now)
    owned_by: str = "kvflow"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None
    permission: list[ModelPermission] = Field(default_factory=lambda: [ModelPermission()])


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeCompletionRequest(RequestModel):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool | None = False


class TokenizeChatRequest(ChatTemplateFields):
    model: str | None = None
    return_token_strs: bool | None = False


TokenizeRequest = TokenizeCompletionRequest | TokenizeChatRequest


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(RequestModel):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


class VersionResponse(BaseModel):
    version: str


STREAM_CHUNK_MODELS: tuple[type[BaseModel], ...] = (
    CompletionStreamResponse,
    ChatCompletionStreamResponse,
)
