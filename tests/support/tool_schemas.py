"""The weather tool's parameters, as the tool-calling tests of both APIs declare it (OpenAI's
`function.parameters`, Anthropic's `input_schema`): short, bounded strings, so that the embedded
model ends a call within the tests' token limits."""

from __future__ import annotations

WEATHER_PARAMETERS = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 40},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
