"""A newcomer's first requests, as the README writes them, against the embedded model served
with its defaults (bf16, `--generation-config auto`): each ends within a bound, the headline
question is answered right, `parse()` gets its lists, and the log says what a request that
sets nothing gets. (That such a request ends at the cap: test_engine_view.)

The headline question's first token is a near-tie ("The" ahead of "L" by 0.08 in
transformers' float32 logprobs): rounded to bf16, logits of about 16 move in steps of 0.125,
so a head whose logits went through bf16 could make the two level, and the argmax took "L"
(the lower id), which answered "L'Étoile, ...". The head's logits are float32 sums
(`model.linear.logits_linear`); the served answer is the offline LLM's, token for token."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import openai
import pytest
from pydantic import BaseModel

from kvflow import LLM, SamplingParams
from support.serverproc import MODEL, ServerProcess, start_server

README = Path(__file__).resolve().parents[2] / "README.md"
CAP = 512  # generation_defaults.EMBEDDED_MODEL_DEFAULTS["max_new_tokens"]
# Generous: 512 tokens of a 135M model on 2 busy cores; a request that loops to the end of the
# context (the defect) takes minutes.
REQUEST_BOUND_S = 300.0
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
TOKENS = 32


def readme_requests() -> list[tuple[str, dict]]:
    """Every `curl ... -d '{json}'` in the README, as (path, body)."""
    text = README.read_text()
    commands = re.findall(r"^ *curl .*?(?<!\\)$", text.replace("\\\n", " "), flags=re.M)
    requests = []
    for command in commands:
        words = shlex.split(command)
        if "-d" not in words:
            continue
        url = next(w for w in words if w.startswith("http"))
        requests.append(("/" + url.split("/", 3)[3], json.loads(words[words.index("-d") + 1])))
    return requests


@pytest.fixture(scope="module")
def readme_server():
    """The embedded model as `make serve` serves it (its dtype and sampling defaults), with a
    small KV pool."""
    srv = start_server(geometry=["--num-blocks", "256", "--max-model-len", "2048"])
    yield srv
    srv.stop()


def test_the_readme_has_example_requests():
    paths = [path for path, _ in readme_requests()]
    assert "/v1/chat/completions" in paths


@pytest.mark.parametrize("path, body", readme_requests())
def test_readme_requests_end_and_answer(readme_server: ServerProcess, path: str, body: dict):
    response = readme_server.post(path, {**body, "temperature": 0}, timeout=REQUEST_BOUND_S)
    assert response.status_code == 200, response.text
    data = response.json()
    assert data["usage"]["completion_tokens"] <= CAP
    choice = data["choices"][0]
    text = choice["message"]["content"] if "message" in choice else choice["text"]
    if "capital of France" in json.dumps(body):
        assert "Paris" in text


def test_server_and_offline_llm_give_the_same_tokens(readme_server: ServerProcess):
    """The same rendered prompt (the server's /tokenize of the messages is the offline chat
    template's ids), greedy with EOS ignored: the same tokens, texts and logprobs."""
    offline = LLM(None, num_blocks=128, max_model_len=1024)
    rendered = offline.get_tokenizer().apply_chat_template(
        QUESTION, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert readme_server.post("/tokenize", {"messages": QUESTION}).json()["tokens"] == rendered
    served = readme_server.client().chat.completions.create(
        model=MODEL,
        messages=QUESTION,
        temperature=0,
        max_tokens=TOKENS,
        logprobs=True,
        extra_body={"ignore_eos": True},
    )
    params = SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True, logprobs=0)
    ours = offline.generate({"prompt_token_ids": rendered}, params)[0].outputs[0]
    assert len(ours.token_ids) == served.usage.completion_tokens == TOKENS
    content = served.choices[0].logprobs.content
    tokens = [
        entry[t].decoded_token for t, entry in zip(ours.token_ids, ours.logprobs, strict=True)
    ]
    assert [c.token for c in content] == tokens
    assert [c.logprob for c in content] == pytest.approx(
        [entry[t].logprob for t, entry in zip(ours.token_ids, ours.logprobs, strict=True)], abs=1e-5
    )
    assert served.choices[0].message.content == ours.text
    assert "Paris" in ours.text


def test_the_start_up_log_states_the_defaults(readme_server: ServerProcess):
    log = readme_server.log()
    assert f"request defaults: max_tokens at most {CAP}" in log
    assert "temperature=0.2" in log and "top_p=0.9" in log
    sizes = re.search(
        r"memory at start-up: weights ([\d.]+) GiB, KV cache ([\d.]+) GiB, "
        r"peak resident ([\d.]+) GiB \(VmHWM; bound .* = ([\d.]+) GiB\)",
        log,
    )
    assert sizes, log[-3000:]
    weights, kv, peak, bound = map(float, sizes.groups())
    # the embedded model's 135M parameters in bf16, the tied head's packing beside them at most
    assert 0.2 < weights < 0.6 and kv > 0
    assert peak <= bound


def test_the_log_states_vllms_defaults_without_a_generation_config():
    from kvflow.server.generation_defaults import describe

    line = describe({}, 4096)
    assert "the rest of the 4096-token context for chat, 16 for completions" in line
    assert "temperature=1.0" in line and "repetition_penalty=1.0" in line


class Primes(BaseModel):
    primes: list[int]


class Shopping(BaseModel):
    store: str
    items: list[str]


class Trip(BaseModel):
    city: str
    days: int
    activities: list[str]


@pytest.mark.parametrize(
    "schema, question",
    [
        (Primes, "List three prime numbers."),
        (Shopping, "Make a short shopping list for a pancake breakfast."),
        (Trip, "Plan a two-day trip to Rome with a few activities."),
    ],
)
def test_parse_with_list_fields_at_the_defaults(readme_server: ServerProcess, schema, question):
    """`client.chat.completions.parse()` as a newcomer calls it (no max_tokens, the default
    sampling): a list that repeats an item until the cap is a LengthFinishReasonError."""
    client = readme_server.client(timeout=REQUEST_BOUND_S)
    parsed = 0
    for seed in range(6):
        messages = [{"role": "user", "content": question}]
        try:
            client.chat.completions.parse(
                model=MODEL, messages=messages, response_format=schema, seed=seed
            )
            parsed += 1
        except openai.LengthFinishReasonError:
            pass
    assert parsed >= 5
