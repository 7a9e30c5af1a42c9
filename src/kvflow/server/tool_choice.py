"""What a chat request's `tools` and `tool_choice` ask for, checked as vLLM checks them: the
mode, the parser that reads the output, and for "required" and named the JSON schema that the
grammar enforces (vLLM's shapes: required is a list of `{"name", "parameters"}` objects, at
least one; named is the function's parameters object)."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

from kvflow.server.serving import ServingError
from kvflow.server.tool_parsers import ToolParser, get_tool_parser
from kvflow.server.tool_parsers.forced import NamedToolParser, RequiredToolParser
from kvflow.templates import template_text

_EMPTY_PARAMETERS = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class ToolConfig:
    """The server's flags for tools and reasoning."""

    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None
    chat_template_given: bool = False  # --chat-template: it wins over the packaged tool template


@dataclass
class ToolPlan:
    mode: str  # "none" | "auto" | "required" | "named"
    parser: ToolParser | None = None
    schema: dict[str, Any] | None = None  # the grammar of "required" and named
    limit: int | None = None  # parallel_tool_calls false: the first call only


def plan_tools(req: Any, config: ToolConfig) -> ToolPlan:
    """The request's tool mode; ServingError (400) for what vLLM refuses."""
    check_tools(req.tools)
    choice = req.tool_choice
    if "tool_choice" not in req.model_fields_set and req.tools:
        choice = "auto"  # as vLLM and OpenAI: tools alone mean "auto"
    limit = 1 if req.parallel_tool_calls is False else None
    if choice is None or choice == "none":
        return ToolPlan("none")
    if req.tools is None:
        raise ServingError("When using `tool_choice`, `tools` must be set.", param="tool_choice")
    if choice == "auto":
        if not (config.enable_auto_tool_choice and config.tool_call_parser):
            raise ServingError(
                '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser '
                "to be set",
                param="tool_choice",
            )
        return ToolPlan("auto", get_tool_parser(config.tool_call_parser), None, limit)
    if choice == "required":
        return ToolPlan("required", RequiredToolParser(), required_schema(req.tools, limit), limit)
    name = _named(choice)
    for tool in req.tools:
        if tool["function"]["name"] == name:
            schema = copy.deepcopy(tool["function"].get("parameters") or _EMPTY_PARAMETERS)
            return ToolPlan("named", NamedToolParser(name), schema, None)
    raise ServingError(f"Tool '{name}' has not been passed in `tools`.", param="tool_choice")


def _named(choice: Any) -> str:
    name = None
    if isinstance(choice, dict) and choice.get("type", "function") == "function":
        function = choice.get("function")
        name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str):
        raise ServingError(
            '`tool_choice` must be "none", "auto", "required" or {"type": "function", '
            f'"function": {{"name": ...}}}}, got {choice!r}.',
            param="tool_choice",
        )
    return name


def check_tools(tools: list[dict[str, Any]] | None) -> None:
    """Each tool is `{"type": "function", "function": {"name": ..., "parameters": <a JSON
    schema>}}`: a malformed one is a 400 that names it."""
    if tools is None:
        return
    if not tools:
        raise ServingError(
            "`tools` must not be an empty array. Either provide at least one tool or omit "
            "the field entirely.",
            param="tools",
        )
    for i, tool in enumerate(tools):
        function = tool.get("function")
        named = isinstance(function, dict) and isinstance(function.get("name"), str)
        if tool.get("type", "function") != "function" or not named or not function["name"]:
            raise ServingError(
                'Each tool must be {"type": "function", "function": {"name": ...}}; '
                f"tools[{i}] is not.",
                param="tools",
            )
        _check_schema(function["name"], function.get("parameters"))


def _check_schema(name: str, parameters: Any) -> None:
    from jsonschema import SchemaError
    from jsonschema.validators import validator_for

    if parameters is None:
        return
    if not isinstance(parameters, dict):
        raise ServingError(
            f"Tool '{name}': `parameters` must be a JSON schema object, got "
            f"{type(parameters).__name__}.",
            param="tools",
        )
    try:
        validator_for(parameters).check_schema(parameters)
    except SchemaError as exc:
        where = "/".join(str(p) for p in exc.path) or "(root)"
        raise ServingError(
            f"Tool '{name}' has an invalid parameters schema at {where}: {exc.message}",
            param="tools",
        ) from None


def required_schema(tools: list[dict[str, Any]], limit: int | None = None) -> dict[str, Any]:
    """vLLM's schema for tool_choice "required": a non-empty list of calls, each the name of
    one tool with its parameters (their `$defs` merged at the top)."""
    defs: dict[str, Any] = {}
    options = []
    for tool in tools:
        function = tool["function"]
        params = copy.deepcopy(function.get("parameters") or _EMPTY_PARAMETERS)
        for key, value in params.pop("$defs", {}).items():
            if defs.get(key, value) != value:
                raise ServingError(
                    f"Tool definition '{key}' has multiple schemas, which is not supported.",
                    param="tools",
                )
            defs[key] = value
        options.append(
            {
                "properties": {
                    "name": {"type": "string", "enum": [function["name"]]},
                    "parameters": params,
                },
                "required": ["name", "parameters"],
            }
        )
    schema: dict[str, Any] = {
        "type": "array",
        "minItems": 1,
        "items": {"type": "object", "anyOf": options},
    }
    if limit is not None:
        schema["maxItems"] = limit
    if defs:
        schema["$defs"] = defs
    return schema


def tool_template(tokenizer: Any, config: ToolConfig) -> str | None:
    """The packaged tool-aware ChatML template for a request with tools, when the model's own
    template is ChatML and ignores tools (SmolLM2's) and no --chat-template was given."""
    own = getattr(tokenizer, "chat_template", None)
    if config.chat_template_given or not isinstance(own, str):
        return None
    if "tools" in own or "<|im_start|>" not in own:
        return None
    return template_text("chatml_tools.jinja")
