"""Structured outputs against a real server with a tiny KV pool, through the official client.

One module-scoped server (`--num-blocks 32`: 496 tokens of KV for about 100 concurrent
requests, so constrained requests are preempted and recomputed). Every output is checked
against its constraint: JSON with jsonschema, regexes with `re.fullmatch`, choices exactly.
"""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pytest

from support.serverproc import ServerProcess, scrape, start_server
from support.structured_schemas import MAX_TOKENS, MODELS

MODEL = "SmolLM2-135M-Instruct"
SEEDS = range(2)
TINY_POOL = ["--num-blocks", "32", "--block-size", "16"]


@pytest.fixture(scope="module")
def tiny(placement: str) -> ServerProcess:
    srv = start_server("--log-engine-steps", geometry=TINY_POOL)
    yield srv
    srv.stop()


def _parse(client: openai.OpenAI, model, seed: int):
    return client.chat.completions.parse(
        model=MODEL,
        messages=[{"role": "user", "content": f"Reply with a {model.__name__} as JSON."}],
        response_format=model,
        seed=seed,
        max_completion_tokens=MAX_TOKENS,
    )


def _checked(client: openai.OpenAI, model, seed: int) -> str | None:
    """None when the answer parses into `model` and validates against its schema, else why."""
    try:
        choice = _parse(client, model, seed).choices[0]
        assert choice.finish_reason == "stop", choice.finish_reason
        assert isinstance(choice.message.parsed, model)
        jsonschema.validate(json.loads(choice.message.content), model.model_json_schema())
    except Exception as exc:
        return f"{model.__name__} seed {seed}: {type(exc).__name__}: {str(exc)[:300]}"
    return None


# What it counts is the model's output under the constrained penalty, which the placement does
# not touch; the other tests here run in both.
@pytest.mark.placement("process")
def test_parse_returns_a_valid_object_for_every_schema_and_seed(tiny: ServerProcess) -> None:
    """21 pydantic models x 2 seeds, 42 requests in flight in a 496-token KV pool: each
    answer parses into its model and validates against the model's JSON schema, though
    requests were preempted on the way."""
    before = scrape(tiny).value("vllm:num_preemptions_total")
    client = tiny.client(timeout=900.0)
    jobs = [(m, s) for m in MODELS for s in SEEDS]
    with ThreadPoolExecutor(max_workers=len(jobs)) as pool:
        results = list(pool.map(lambda job: _checked(client, *job), jobs))
    failures = [r for r in results if r is not None]
    assert not failures, f"{len(failures)} of {len(jobs)} failed:\n" + "\n".join(failures)
    metrics = scrape(tiny)
    assert metrics.value("vllm:num_preemptions_total") > before, "the pool never preempted"
    assert metrics.value("kvflow:structured_output_compile_seconds_count") >= len(jobs)
    assert re.search(r"core-step .*masked=([1-9]\d*)", tiny.log()), "no step masked a row"


@pytest.mark.parametrize("stream", [False, True])
def test_structured_outputs_json_regex_choice_on_both_endpoints(
    tiny: ServerProcess, stream: bool
) -> None:
    client = tiny.client(timeout=120.0)
    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 50}},
        "required": ["n"],
        "additionalProperties": False,
    }
    constraints = [
        ({"json": schema}, lambda t: jsonschema.validate(json.loads(t), schema) or True),
        ({"regex": r"[a-z]{2,6}-[0-9]{3}"}, lambda t: re.fullmatch(r"[a-z]{2,6}-[0-9]{3}", t)),
        ({"choice": ["alpha", "beta", "gamma delta"]}, lambda t: t in ("alpha", "beta", "gamma delta")),
    ]  # fmt: skip

    def chat(so: dict, seed: int) -> str:
        kw = dict(model=MODEL, seed=seed, max_tokens=100, extra_body={"structured_outputs": so})
        messages = [{"role": "user", "content": "Answer."}]
        if not stream:
            out = client.chat.completions.create(messages=messages, **kw)
            return out.choices[0].message.content
        chunks = client.chat.completions.create(messages=messages, stream=True, **kw)
        return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)

    def complete(so: dict, seed: int) -> str:
        kw = dict(model=MODEL, seed=seed, max_tokens=100, extra_body={"structured_outputs": so})
        if not stream:
            return client.completions.create(prompt="Answer:", **kw).choices[0].text
        chunks = client.completions.create(prompt="Answer:", stream=True, **kw)
        return "".join(c.choices[0].text for c in chunks if c.choices)

    jobs = [
        (fn, so, check, s) for fn in (chat, complete) for so, check in constraints for s in (0, 1)
    ]
    with ThreadPoolExecutor(max_workers=len(jobs)) as pool:
        texts = list(pool.map(lambda j: j[0](j[1], j[3]), jobs))
    for (fn, so, check, seed), text in zip(jobs, texts, strict=True):
        assert check(text), (fn.__name__, so, seed, text)


def test_response_format_json_object_and_n_choices(tiny: ServerProcess) -> None:
    """json_object on completions, three choices each with its own matcher."""
    out = tiny.client().completions.create(
        model=MODEL,
        prompt="A JSON object describing a cat:",
        n=3,
        seed=3,
        max_tokens=MAX_TOKENS,
        extra_body={"response_format": {"type": "json_object"}},
    )
    assert len(out.choices) == 3
    for choice in out.choices:
        if choice.finish_reason == "stop":
            assert isinstance(json.loads(choice.text), dict), choice.text


def test_logprobs_come_from_the_masked_logits(tiny: ServerProcess) -> None:
    """The sampled token of a choice is one of the choice's words, its logprob is finite, and
    masked alternatives are clamped (JSON has no -inf), never NaN."""
    out = tiny.client().chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Pick one."}],
        max_tokens=8,
        logprobs=True,
        top_logprobs=5,
        extra_body={"structured_outputs": {"choice": ["north", "south"]}},
    )
    choice = out.choices[0]
    assert choice.message.content in ("north", "south")
    first = choice.logprobs.content[0]
    assert -9999.0 < first.logprob <= 0.0
    assert all(-9999.0 <= alt.logprob <= 0.0 for alt in first.top_logprobs)
    assert first.top_logprobs[0].logprob >= first.top_logprobs[-1].logprob


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}}, "nope"),
        ({"structured_outputs": {"regex": "([a-"}}, "regex"),
        ({"structured_outputs": {"grammar": "root ::= undefined_rule"}}, "undefined_rule"),
        ({"structured_outputs": {"json": "{not json"}}, "not valid JSON"),
        ({"structured_outputs": {"choice": []}}, "at least one"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "one kind"),
        ({"structured_outputs": {"regexp": "a"}}, "unknown field"),
        ({"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}}, "not both"),
        ({"response_format": {"type": "xml"}}, "xml"),
        ({"guided_json": {"type": "object"}}, "structured_outputs"),
    ],
)  # fmt: skip
def test_a_bad_constraint_is_a_400_naming_it(
    server: ServerProcess, body: dict, needle: str
) -> None:
    """On the session's shared server; it stays up and serves the next request."""
    for path, base in (
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
        ("/v1/completions", {"prompt": "hi"}),
    ):
        response = server.post(path, {"model": MODEL, "max_tokens": 4, **base, **body})
        assert response.status_code == 400, response.text
        assert needle in response.json()["error"]["message"], response.text
    assert server.post("/v1/completions", {"prompt": "hi", "max_tokens": 2}).status_code == 200


def test_a_mask_that_allows_no_token_fails_that_request_alone(tiny: ServerProcess) -> None:
    """A choice ends after one word, but min_tokens forbids the end: no token is allowed.
    That request fails with a clear error; one beside it completes."""
    client = tiny.client(timeout=120.0)

    def doomed():
        return client.completions.create(
            model=MODEL, prompt="Yes or no?", max_tokens=30, extra_body={
                "min_tokens": 20, "structured_outputs": {"choice": ["yes", "no"]}},
        )  # fmt: skip

    def fine():
        return client.completions.create(model=MODEL, prompt="Count:", max_tokens=20, seed=1)

    before = scrape(tiny).value("kvflow:structured_output_requests_failed_total")
    with ThreadPoolExecutor(2) as pool:
        bad, good = pool.submit(doomed), pool.submit(fine)
        with pytest.raises(openai.InternalServerError, match="allows no next token"):
            bad.result()
        assert good.result().choices[0].finish_reason == "length"
    after = scrape(tiny).value("kvflow:structured_output_requests_failed_total")
    assert after == before + 1
