"""A request's output constraint, as vLLM reads it: `response_format` (OpenAI's json_object /
json_schema, vLLM's structural_tag) or vLLM's `structured_outputs` field; and whether the
grammar backend can compile it (`check_constraint`)."""

from __future__ import annotations

import json
from dataclasses import fields
from typing import Any

from kvflow.engine.async_llm import AsyncEngine, EngineDeadError
from kvflow.sampling_params import StructuredOutputsParams
from kvflow.server.errors import ServingError, engine_error

_FIELDS = {f.name for f in fields(StructuredOutputsParams)}


def constraint(
    response_format: Any, structured_outputs: Any
) -> tuple[StructuredOutputsParams | None, str]:
    """(the constraint or None, the request field it came from). Raises ValueError naming what
    is wrong."""
    from_format = _from_response_format(response_format)
    from_field = _from_field(structured_outputs)
    if from_format is not None and from_field is not None:
        raise ValueError(
            "Set either `response_format` or `structured_outputs`, not both: a request has "
            "one output constraint."
        )
    if from_field is not None:
        return from_field, "structured_outputs"
    return from_format, "response_format"


async def check_constraint(
    engine: AsyncEngine, so: StructuredOutputsParams | None, param: str, prefix: str = ""
) -> None:
    """A constraint the grammar backend cannot compile is the request's fault: a ServingError
    (400) naming `param`, before anything is queued. Awaited: over the engine process, the
    engine parses a constraint this process has not met (`AsyncEngine.check_constraint`)."""
    if so is None:
        return
    try:
        await engine.check_constraint(so)
    except ValueError as exc:
        raise ServingError(prefix + str(exc), param=param) from exc
    except EngineDeadError as exc:
        raise engine_error(exc) from exc


def _from_response_format(rf: Any) -> StructuredOutputsParams | None:
    if rf is None:
        return None
    if not isinstance(rf, dict):
        raise ValueError("`response_format` must be an object with a `type`.")
    kind = rf.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind == "json_schema":
        spec = rf.get("json_schema")
        if not isinstance(spec, dict):
            raise ValueError("`response_format.json_schema` must be an object with a `schema`.")
        schema = spec.get("schema")
        if schema is None:  # as OpenAI: no schema is any JSON object
            return StructuredOutputsParams(json_object=True)
        if not isinstance(schema, dict | bool):
            raise ValueError("`response_format.json_schema.schema` must be a JSON schema object.")
        return StructuredOutputsParams(json=schema if isinstance(schema, dict) else {})
    if kind == "structural_tag":
        return StructuredOutputsParams(structural_tag=json.dumps(rf))
    raise ValueError(
        f"`response_format.type` {kind!r} is not one of 'text', 'json_object', 'json_schema', "
        "'structural_tag'."
    )


def _from_field(so: Any) -> StructuredOutputsParams | None:
    if so is None:
        return None
    if not isinstance(so, dict):
        raise ValueError("`structured_outputs` must be an object.")
    if unknown := sorted(set(so) - _FIELDS - {"backend"}):
        raise ValueError(f"`structured_outputs` has unknown field(s): {unknown}")
    values = {k: v for k, v in so.items() if k in _FIELDS}
    if isinstance(values.get("json"), str):
        try:
            json.loads(values["json"])
        except json.JSONDecodeError as exc:
            raise ValueError(f"`structured_outputs.json` is not valid JSON: {exc}") from exc
    tag = values.get("structural_tag")
    if tag is not None and not isinstance(tag, str):
        values["structural_tag"] = json.dumps(tag)
    choice = values.get("choice")
    if choice is not None and not (
        isinstance(choice, list) and all(isinstance(c, str) for c in choice)
    ):
        raise ValueError("`structured_outputs.choice` must be a list of strings.")
    for name in ("regex", "grammar"):
        if values.get(name) is not None and not isinstance(values[name], str):
            raise ValueError(f"`structured_outputs.{name}` must be a string.")
    return StructuredOutputsParams(**values)
