"""POST /v1/completions end to end: the official client and raw HTTP against the real server."""

from __future__ import annotations

import json

import httpx

CAPITAL = "The capital of France is"
CAPITAL_IDS = [504, 3575, 282, 4649, 314]  # the embedded tokenizer, no BOS


def greedy(client, prompt=CAPITAL, **kwargs):
    return client.completions.create(
        model="SmolLM2-135M-Instruct", prompt=prompt, temperature=0, **kwargs
    )


def test_greedy_capital_and_usage(client):
    out = greedy(client, max_tokens=2)
    choice = out.choices[0]
    assert choice.text == " Paris."
    assert choice.finish_reason == "length"
    assert out.object == "text_completion" and out.id.startswith("cmpl-")
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (5, 2)
    assert out.usage.total_tokens == 7


def test_model_may_be_omitted_and_max_tokens_defaults_to_16(server):
    body = {"prompt": CAPITAL, "temperature": 0, "ignore_eos": True}
    data = server.post("/v1/completions", body).json()
    assert data["model"] == "SmolLM2-135M-Instruct"
    assert data["usage"]["completion_tokens"] == 16


def test_token_id_prompts_match_text_prompts(client):
    by_text = greedy(client, max_tokens=3).choices[0].text
    assert greedy(client, prompt=CAPITAL_IDS, max_tokens=3).choices[0].text == by_text
    both = greedy(client, prompt=[CAPITAL_IDS, CAPITAL_IDS], max_tokens=3)
    assert [c.index for c in both.choices] == [0, 1]
    assert [c.text for c in both.choices] == [by_text, by_text]
    assert both.usage.prompt_tokens == 10


def test_list_of_prompts_with_n_counts_usage_exactly(server, client):
    prompts = [CAPITAL, "Hello, my name is"]
    counts = [server.post("/tokenize", {"prompt": p}).json()["count"] for p in prompts]
    out = client.completions.create(
        model="SmolLM2-135M-Instruct",
        prompt=prompts,
        n=2,
        max_tokens=3,
        temperature=0.8,
        seed=7,
        extra_body={"ignore_eos": True},
    )
    assert sorted(c.index for c in out.choices) == [0, 1, 2, 3]
    assert all(c.finish_reason == "length" for c in out.choices)
    assert out.usage.prompt_tokens == sum(counts)
    assert out.usage.completion_tokens == 4 * 3
    assert out.usage.total_tokens == sum(counts) + 12


def test_echo_prepends_the_prompt(client):
    out = greedy(client, max_tokens=2, echo=True)
    assert out.choices[0].text == CAPITAL + " Paris."
    ids = greedy(client, prompt=CAPITAL_IDS, max_tokens=2, echo=True)
    assert ids.choices[0].text == CAPITAL + " Paris."


def test_echo_with_logprobs_scores_the_prompt_as_transformers_does(server, client):
    """What log-likelihood evaluations (lm-eval's completions API) send: echo + logprobs. The
    prompt's tokens come first, the first without a logprob; the rest are the model's log-
    softmax at the previous position (transformers, float32, within bfloat16 rounding)."""
    import torch

    from kvflow.model.loader import load_transformers_model, resolve_model

    prompt = CAPITAL + " Paris, and the capital of Italy is Rome"
    ids = server.post("/tokenize", {"prompt": prompt, "add_special_tokens": True}).json()["tokens"]
    out = greedy(client, prompt=prompt, max_tokens=1, echo=True, logprobs=1)
    choice = out.choices[0]
    lp = choice.logprobs
    n = len(ids)
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == n + 1
    assert "".join(lp.tokens) == choice.text and choice.text.startswith(prompt)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(n + 1)]
    model = load_transformers_model(resolve_model(None), torch.float32)
    with torch.inference_mode():
        logprobs = model(torch.tensor([ids])).logits[0].log_softmax(-1)
    want = [logprobs[i - 1, ids[i]].item() for i in range(1, n)]
    assert max(abs(a - b) for a, b in zip(lp.token_logprobs[1:n], want, strict=True)) < 0.15
    for token, value, top in zip(
        lp.tokens[1:], lp.token_logprobs[1:], lp.top_logprobs[1:], strict=True
    ):
        assert token in top and top[token] == value and len(top) <= 2
    # vLLM's prompt_logprobs field: one entry per prompt token, keyed by token id
    entries = choice.model_extra["prompt_logprobs"]
    assert len(entries) == n and entries[0] is None
    for i, entry in enumerate(entries[1:], 1):
        own = entry[str(ids[i])]
        assert own["logprob"] == lp.token_logprobs[i] and own["rank"] >= 1
        assert own["decoded_token"] == lp.tokens[i]
    stream = greedy(client, prompt=prompt, max_tokens=1, echo=True, logprobs=1, stream=True)
    streamed = [
        t
        for c in stream
        if c.choices and c.choices[0].logprobs
        for t in c.choices[0].logprobs.tokens
    ]
    assert streamed == lp.tokens


def test_max_tokens_0_with_echo_returns_the_prompt_scored(server, client):
    """The classic scoring request: echo, logprobs, max_tokens 0 (refused without echo)."""
    out = greedy(client, max_tokens=0, echo=True, logprobs=1)
    choice = out.choices[0]
    assert choice.text == CAPITAL and out.usage.completion_tokens == 0
    assert len(choice.logprobs.tokens) == len(CAPITAL_IDS)
    assert choice.logprobs.token_logprobs[0] is None
    assert all(v < 0 for v in choice.logprobs.token_logprobs[1:])
    body = {"prompt": CAPITAL, "max_tokens": 0}
    refused = server.post("/v1/completions", body)
    assert refused.status_code == 400 and "max_tokens" in refused.json()["error"]["message"]


def test_prompt_logprobs_on_both_endpoints_and_refused_when_streaming(server, client):
    body = {"prompt": CAPITAL, "max_tokens": 1, "temperature": 0, "prompt_logprobs": 3}
    entries = server.post("/v1/completions", body).json()["choices"][0]["prompt_logprobs"]
    assert len(entries) == len(CAPITAL_IDS) and entries[0] is None
    assert all(
        1 <= len(e) <= 4 and str(t) in e for e, t in zip(entries[1:], CAPITAL_IDS[1:], strict=True)
    )
    chat = server.post(
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1, "prompt_logprobs": 0},
    ).json()
    prompt_tokens = chat["usage"]["prompt_tokens"]
    assert len(chat["prompt_logprobs"]) == prompt_tokens and chat["prompt_logprobs"][0] is None
    assert all(len(e) == 1 for e in chat["prompt_logprobs"][1:])  # 0: the token's own only
    refused = server.post("/v1/completions", {**body, "stream": True})
    assert refused.status_code == 400
    assert "not available when `stream=True`" in refused.json()["error"]["message"]


def test_logit_bias_steers_sampling_and_bad_keys_are_refused(server, client):
    def token(text: str) -> int:
        body = {"prompt": text, "add_special_tokens": False}
        (token_id,) = server.post("/tokenize", body).json()["tokens"]
        return token_id

    assert greedy(client, max_tokens=1).choices[0].text == " Paris"
    forced = greedy(client, max_tokens=1, logit_bias={str(token(" Rome")): 100})
    assert forced.choices[0].text == " Rome"
    banned = greedy(client, max_tokens=1, logit_bias={str(token(" Paris")): -100})
    assert banned.choices[0].text != " Paris"
    for bias, message in (({"49152": 1}, "out-of-vocab"), ({"x": 1}, "cannot be converted")):
        body = {"prompt": CAPITAL, "max_tokens": 1, "logit_bias": bias}
        refused = server.post("/v1/completions", body)
        assert refused.status_code == 400 and message in refused.json()["error"]["message"]


def test_logprobs_in_the_completions_format(client):
    out = greedy(client, max_tokens=4, logprobs=2)
    choice = out.choices[0]
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert "".join(lp.tokens) == choice.text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(4)]
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert value <= 0.0
        assert 1 <= len(top) <= 3 and token in top
        assert max(top.values()) == value  # greedy: the sampled token is the most likely


def test_stop_string_ends_the_text_before_it(client):
    full = greedy(client, max_tokens=4).choices[0].text
    assert full.startswith(" Paris.")
    out = greedy(client, max_tokens=4, stop=["."])
    choice = out.choices[0]
    assert choice.text == " Paris"
    assert choice.finish_reason == "stop"
    assert choice.model_extra.get("stop_reason") == "."
    kept = greedy(client, max_tokens=4, stop=["."], extra_body={"include_stop_str_in_output": True})
    assert kept.choices[0].text == " Paris."


def test_seeded_sampling_is_reproducible(client):
    def sample(seed):
        out = client.completions.create(
            model="SmolLM2-135M-Instruct",
            prompt="Once upon a time",
            max_tokens=8,
            temperature=1.0,
            seed=seed,
            extra_body={"ignore_eos": True},
        )
        return out.choices[0].text

    first = sample(1234)
    assert sample(1234) == first
    assert len({sample(s) for s in (1, 2, 3)} | {first}) > 1


def test_streaming_matches_non_streaming_and_reports_usage(client):
    expected = greedy(client, max_tokens=6, extra_body={"ignore_eos": True})
    stream = greedy(
        client,
        max_tokens=6,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == expected.choices[0].text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "length" and all(f is None for f in finishes[:-1])
    assert chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens == 6 and chunks[-1].usage.prompt_tokens == 5


def test_raw_sse_framing_ends_with_done(server):
    body = {"prompt": CAPITAL, "max_tokens": 3, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as resp:
        assert resp.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in resp.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines)
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line[6:]) for line in lines[:-1]]
    assert all(c["object"] == "text_completion" and "usage" not in c for c in chunks)
    server.received.extend(("stream", "/v1/completions", 200, c) for c in chunks)


def test_stream_options_as_vllm_reads_them(server):
    """include_usage defaults to false (an empty object, or continuous_usage_stats alone, adds
    no usage), an empty object without stream is no options, and continuous usage is each
    choice's own count (n=2: the chunks of choice 1 count choice 1's tokens)."""

    def usages(extra: dict) -> list:
        body = {"prompt": CAPITAL, "max_tokens": 3, "stream": True, "ignore_eos": True, **extra}
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as resp:
            lines = [line for line in resp.iter_lines() if line.startswith("data: {")]
        return [
            (c["choices"], c.get("usage")) for c in map(lambda line: json.loads(line[6:]), lines)
        ]

    null = {"prompt": CAPITAL, "max_tokens": None, "ignore_eos": True}  # vLLM: the default 16
    assert server.post("/v1/completions", null).json()["usage"]["completion_tokens"] == 16
    for options in ({}, {"continuous_usage_stats": True}):
        assert all(u is None for _, u in usages({"stream_options": options}))
    plain = server.post(
        "/v1/completions", {"prompt": CAPITAL, "max_tokens": 2, "stream_options": {}}
    )
    assert plain.status_code == 200, plain.text
    chunks = usages(
        {"n": 2, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    )
    last = {0: 0, 1: 0}
    for choices, u in chunks[:-1]:
        index = choices[0]["index"]
        assert u["prompt_tokens"] == 5 and last[index] <= u["completion_tokens"] <= 3
        last[index] = u["completion_tokens"]
    assert last == {0: 3, 1: 3}  # each choice's own 3, never the sum
    assert chunks[-1][0] == [] and chunks[-1][1]["completion_tokens"] == 6
