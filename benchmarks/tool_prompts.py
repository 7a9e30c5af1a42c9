"""The prompts of `tool_calls.py`: 20 that clearly ask for an action one of their 1-3 function
tools performs (the expected tool named), and 5 that no tool fits (a call there is a false
call). Each tool is OpenAI's `{"type": "function", "function": {...}}`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


def tool(name: str, description: str, **params: tuple[str, str]) -> dict[str, Any]:
    """A function tool whose parameters are all required strings/numbers: `param=(type,
    description)`."""
    properties = {k: {"type": t, "description": d} for k, (t, d) in params.items()}
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {"type": "object", "properties": properties, "required": list(params)},
        },
    }


WEATHER = tool("get_weather", "Get the current weather in a city", city=("string", "The city"))
CALC = tool(
    "calculate",
    "Evaluate an arithmetic expression",
    expression=("string", "The expression, e.g. 2 * (3 + 4)"),
)
SEARCH = tool("web_search", "Search the web", query=("string", "What to search for"))
EMAIL = tool(
    "send_email",
    "Send an email",
    to=("string", "The recipient's address"),
    subject=("string", "The subject"),
    body=("string", "The message"),
)
CONVERT = tool(
    "convert_units",
    "Convert a value from one unit to another",
    value=("number", "The value"),
    from_unit=("string", "The unit it is in"),
    to_unit=("string", "The unit to convert to"),
)
TRANSLATE = tool(
    "translate",
    "Translate text into another language",
    text=("string", "The text"),
    target_language=("string", "The language to translate into"),
)
TIMER = tool("set_timer", "Set a timer", minutes=("integer", "How many minutes"))
STOCK = tool("get_stock_price", "Get a stock's latest price", symbol=("string", "Ticker symbol"))
REMINDER = tool(
    "create_reminder",
    "Create a reminder",
    text=("string", "What to be reminded of"),
    time=("string", "When, e.g. 5pm tomorrow"),
)
TIME = tool("get_time", "Get the current local time in a city", city=("string", "The city"))
CURRENCY = tool(
    "convert_currency",
    "Convert an amount of money between currencies",
    amount=("number", "The amount"),
    from_currency=("string", "ISO code, e.g. USD"),
    to_currency=("string", "ISO code, e.g. EUR"),
)
DEFINE = tool("define_word", "Look up a word's definition", word=("string", "The word"))


@dataclass(frozen=True)
class ToolPrompt:
    """A user message with its tools; `expected`: the tool that should be called (None: none)."""

    text: str
    tools: tuple[dict[str, Any], ...]
    expected: str | None


CALL_PROMPTS = (
    ToolPrompt("What's the weather like in Paris right now?", (WEATHER,), "get_weather"),
    ToolPrompt("Calculate 234 * 17 for me.", (CALC,), "calculate"),
    ToolPrompt("Search the web for the latest news about the Mars rover.", (SEARCH,), "web_search"),
    ToolPrompt(
        "Send an email to alice@example.com with the subject 'Lunch' saying I'll be late.",
        (EMAIL,),
        "send_email",
    ),
    ToolPrompt("Convert 5 miles to kilometers.", (CONVERT,), "convert_units"),
    ToolPrompt("Translate 'good morning' into Spanish.", (TRANSLATE, SEARCH), "translate"),
    ToolPrompt("Set a timer for 10 minutes.", (TIMER, REMINDER), "set_timer"),
    ToolPrompt(
        "What is Apple's stock price? The ticker is AAPL.", (STOCK, SEARCH), "get_stock_price"
    ),
    ToolPrompt(
        "Remind me to call my mother at 6pm tomorrow.", (REMINDER, TIMER, EMAIL), "create_reminder"
    ),
    ToolPrompt("What time is it in Tokyo?", (TIME, WEATHER), "get_time"),
    ToolPrompt("Convert 100 US dollars to euros.", (CURRENCY, CONVERT), "convert_currency"),
    ToolPrompt(
        "Look up the definition of the word 'serendipity'.", (DEFINE, SEARCH), "define_word"
    ),
    ToolPrompt("Is it raining in London? Check the weather.", (WEATHER, TIME), "get_weather"),
    ToolPrompt("Use the calculator: what is 1250 divided by 5?", (CALC, CONVERT), "calculate"),
    ToolPrompt(
        "Find information online about the history of the Eiffel Tower.",
        (SEARCH, WEATHER, DEFINE),
        "web_search",
    ),
    ToolPrompt(
        "Email bob@example.com, subject 'Report', body 'The report is attached.'",
        (EMAIL, REMINDER),
        "send_email",
    ),
    ToolPrompt("How many pounds is 70 kilograms? Convert it.", (CONVERT, CALC), "convert_units"),
    ToolPrompt("Translate 'thank you very much' into French.", (TRANSLATE, DEFINE), "translate"),
    ToolPrompt("Get the current price of Tesla stock, ticker TSLA.", (STOCK,), "get_stock_price"),
    ToolPrompt(
        "Check the weather in New York and tell me if I need an umbrella.",
        (WEATHER, SEARCH, TIME),
        "get_weather",
    ),
)

NO_CALL_PROMPTS = (
    ToolPrompt("Hi! How are you today?", (WEATHER,), None),
    ToolPrompt("Write a short poem about the sea.", (CALC, SEARCH), None),
    ToolPrompt("What is the capital of France?", (STOCK,), None),
    ToolPrompt("Thanks, that's all I needed.", (EMAIL, REMINDER), None),
    ToolPrompt("Tell me a fun fact about cats.", (TIMER, CONVERT), None),
)

PROMPTS = CALL_PROMPTS + NO_CALL_PROMPTS
