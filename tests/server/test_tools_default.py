"""The README's first agent example against the embedded model as `kvflow serve` starts it (no
tool flags), through the official openai client: tool_choice "required" with the one tool the
step needs gives that call, its arguments taken from the question. ("auto" is not on by
default: benchmarks/tool_calls.py measures how rarely the 135M model calls the right tool under
it; tools alone are then a 400 naming the flags, test_errors. Offered several tools under
"required", the model often picks the wrong one: the same benchmark's "required" row.)"""

from __future__ import annotations

import json

import openai

MODEL = "SmolLM2-135M-Instruct"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 40}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
ASK = [{"role": "user", "content": "What's the weather like in Paris right now?"}]


def test_required_calls_the_tool_with_the_questions_argument(client: openai.OpenAI):
    out = client.chat.completions.create(
        model=MODEL,
        messages=ASK,
        tools=[WEATHER],
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=0,
        max_tokens=60,
    )
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
