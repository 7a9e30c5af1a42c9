"""`tool_choice: "auto"` with the embedded model, per chat template and tool-call parser: over
the 20 tool prompts and 5 no-tool prompts of `tool_prompts.py`, the rate at which the expected
tool is called with arguments that parse as a JSON object (and, stricter, that its parameters'
JSON schema accepts), the rate at which any tool is called, and the rate of calls on the
no-tool prompts.

Under "auto" the model's output depends on the template alone (no grammar; greedy at
temperature 0) and a parser only reads it. So each template's prompts are sent once, with
tool_choice "none" (the same prompt, the same tokens, the text unparsed), and every shipped
parser reads that text as the server's "auto" does (`tool_parsers.base.extract`). `--auto`
then runs the prompts end to end with tool_choice "auto" through a server started with
`--enable-auto-tool-choice --tool-call-parser PARSER` and the packaged template, as an agent
framework sends them (the official openai client): its row should equal that pairing's.
`--required` adds tool_choice "required" (the grammar forces a call; which tool is the model's
pick).

Templates: `packaged` (kvflow's chatml_tools.jinja, what a request with tools gets), `smollm2`
(the GGUF's own, which ignores tools), and the variants in `tool_templates/`. All prompts go at
once (the engine batches them).

    python benchmarks/tool_calls.py --auto xlam --out tool_calls.json
    python benchmarks/tool_calls.py --url http://127.0.0.1:8000 --templates packaged
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))

from tool_prompts import PROMPTS, ToolPrompt  # noqa: E402

from kvflow.server.tool_parsers import get_tool_parser  # noqa: E402
from kvflow.server.tool_parsers.base import extract  # noqa: E402
from support.serverproc import start_server  # noqa: E402

MODEL = "SmolLM2-135M-Instruct"
PARSERS = ("hermes", "llama3_json", "mistral", "pythonic", "xlam")
TEMPLATES = ("packaged", "smollm2", "card", "fewshot", "compact", "compact2")
# float32 as the test servers run; a pool that holds every prompt at once without preemption
GEOMETRY = ["--dtype", "float32", "--num-blocks", "1024", "--block-size", "16"]


def template_text(name: str) -> str | None:
    """The request's chat_template for `name` (None: the server's choice, the packaged one)."""
    if name == "packaged":
        return None
    if name == "smollm2":
        from gguf import GGUFReader

        from kvflow.model.loader import default_gguf_path

        field = GGUFReader(default_gguf_path()).fields["tokenizer.chat_template"]
        return bytes(field.parts[field.data[0]]).decode()
    return (HERE / "tool_templates" / f"{name}.jinja").read_text()


def ask(
    client: openai.OpenAI,
    prompt: ToolPrompt,
    choice: str,
    args: argparse.Namespace,
    template: str | None,
    seed: int | None,
) -> openai.types.chat.ChatCompletionMessage:
    extra = {} if template is None else {"chat_template": template}
    sampling = {"temperature": 0.0} if seed is None else {"seed": seed}  # else the defaults
    if choice == "required":  # one call: the schema then ends the output
        sampling["parallel_tool_calls"] = False
    out = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": prompt.text}],
        tools=list(prompt.tools),
        tool_choice=choice,
        max_tokens=args.max_tokens,
        extra_body=extra,
        **sampling,
    )
    return out.choices[0].message


def run_all(client, choice, args, template, seed) -> list:
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        return list(pool.map(lambda p: ask(client, p, choice, args, template, seed), PROMPTS))


def calls_of(parser: str, text: str) -> list[tuple[str, str]]:
    _, calls = extract(get_tool_parser(parser), text or "")
    return [(c["function"]["name"], c["function"]["arguments"]) for c in calls]


def is_object(arguments: str) -> bool:
    try:
        return isinstance(json.loads(arguments), dict)
    except ValueError:
        return False


def is_valid(prompt: ToolPrompt, name: str, arguments: str) -> bool:
    """The arguments are an object the expected tool's parameters schema accepts."""
    import jsonschema

    schema = next(
        t["function"]["parameters"] for t in prompt.tools if t["function"]["name"] == name
    )
    return is_object(arguments) and jsonschema.Draft202012Validator(schema).is_valid(
        json.loads(arguments)
    )


def score(calls_per_prompt: list[list[tuple[str, str]]]) -> dict:
    """Rates over the tool prompts (correct, any) and the no-tool prompts (false)."""
    correct = valid = called = false = 0
    for prompt, calls in zip(PROMPTS, calls_per_prompt, strict=True):
        if prompt.expected is None:
            false += bool(calls)
            continue
        called += bool(calls)
        right = [a for name, a in calls if name == prompt.expected]
        correct += any(is_object(a) for a in right)
        valid += any(is_valid(prompt, prompt.expected, a) for a in right)
    asked = sum(p.expected is not None for p in PROMPTS)
    return {
        "correct": correct / asked,
        "valid": valid / asked,
        "any_call": called / asked,
        "false_call": false / (len(PROMPTS) - asked),
        "n": len(PROMPTS),
    }


def measure_templates(client, args, outputs: dict[str, list[str]]) -> list[dict]:
    """A row per template, sampling and parser; each template's texts go into `outputs`."""
    rows = []
    for name in args.templates:
        for seed in [None, *args.seeds]:
            start = time.monotonic()
            texts = [m.content for m in run_all(client, "none", args, template_text(name), seed)]
            took = time.monotonic() - start
            outputs[f"{name}/{'t0' if seed is None else seed}"] = texts
            for parser in args.parsers:
                row = {"template": name, "parser": parser, "seed": seed, "choice": "none+parse"}
                rows.append(row | score([calls_of(parser, t) for t in texts]) | {"s": took})
                print(json.dumps(rows[-1]), flush=True)
            if args.show:
                for prompt, text in zip(PROMPTS, texts, strict=True):
                    print(f"  {prompt.expected}: {text[:100]!r}")
    return rows


def measure_required(client, args) -> dict:
    """tool_choice "required" (the grammar forces a call of one of the tools) with the packaged
    template: which tool the model picks. The no-tool prompts' false-call rate is 1 by
    construction."""
    messages = run_all(client, "required", args, None, None)
    calls = [
        [(c.function.name, c.function.arguments) for c in m.tool_calls or []] for m in messages
    ]
    row = {"template": "packaged", "parser": "(grammar)", "seed": None, "choice": "required"}
    return row | score(calls)


def measure_auto(url: str | None, args) -> dict:
    """The packaged template with `args.auto` as the parser, end to end with "auto"."""
    server = None
    if url is None:
        server = start_server(
            "--enable-auto-tool-choice", "--tool-call-parser", args.auto, geometry=GEOMETRY
        )
        url = server.url
    try:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="EMPTY", max_retries=0, timeout=1800)
        messages = run_all(client, "auto", args, None, None)
    finally:
        if server is not None:
            server.stop()
    calls = [
        [(c.function.name, c.function.arguments) for c in m.tool_calls or []] for m in messages
    ]
    row = {"template": "packaged", "parser": args.auto, "seed": None, "choice": "auto"}
    return row | score(calls)


def table(rows: list[dict]) -> str:
    lines = [
        "| template | parser | sampling | choice | correct call | schema-valid | any call "
        "| false call |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        sampling = "temperature 0" if r["seed"] is None else f"defaults, seed {r['seed']}"
        lines.append(
            f"| {r['template']} | {r['parser']} | {sampling} | {r['choice']} | "
            f"{r['correct']:.0%} | {_rate(r.get('valid'))} | {r['any_call']:.0%} | "
            f"{r['false_call']:.0%} |"
        )
    return "\n".join(lines)


def _rate(value: float | None) -> str:
    return "-" if value is None else f"{value:.0%}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--url",
        default=None,
        help="a running kvflow server (with --trust-request-chat-template); default: start one",
    )
    p.add_argument("--templates", nargs="+", default=list(TEMPLATES), choices=TEMPLATES)
    p.add_argument("--parsers", nargs="+", default=list(PARSERS), choices=PARSERS)
    p.add_argument(
        "--seeds",
        nargs="*",
        type=int,
        default=[],
        help="also sample with the server's default sampling at these seeds",
    )
    p.add_argument(
        "--auto",
        default=None,
        choices=PARSERS,
        help="also run tool_choice auto end to end with this parser",
    )
    p.add_argument(
        "--required", action="store_true", help="also run tool_choice required (no parser)"
    )
    p.add_argument("--max-tokens", type=int, default=60)
    p.add_argument("--show", action="store_true", help="print each output's start")
    p.add_argument("--out", default=None, help="write the rows as JSON here")
    args = p.parse_args()

    server = None
    url = args.url
    outputs: dict[str, list[str]] = {}
    if url is None:
        server = start_server("--trust-request-chat-template", geometry=GEOMETRY)
        url = server.url
    try:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="EMPTY", max_retries=0, timeout=1800)
        rows = measure_templates(client, args, outputs)
        if args.required:
            rows.append(measure_required(client, args))
    finally:
        if server is not None:
            server.stop()
    if args.auto:
        rows.append(measure_auto(args.url, args))
    print(table(rows))
    if args.out:
        Path(args.out).write_text(json.dumps({"rows": rows, "outputs": outputs}, indent=1))


if __name__ == "__main__":
    main()
