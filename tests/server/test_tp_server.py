"""The server at --tensor-parallel-size 2 (two ranks over gloo, as processes and as Ray actors):
the official openai client, streaming, /metrics and the error answers, structured outputs and
tool_choice required / named, KV-cache events on a ZeroMQ subscriber and the estimated per-GPU
counters, on a module-scoped server per backend whose greedy answers and FLOPs are checked
against the offline engine at one rank; and quantized (int8, gguf) at two ranks through
`kvflow serve`, against the offline engine at one rank with the same quantization."""

from __future__ import annotations

import json
import time

import httpx
import jsonschema
import msgspec
import openai
import pytest
import zmq

from support.serverproc import (
    GEOMETRY,
    MAX_MODEL_LEN,
    ServerProcess,
    free_port,
    scrape,
    start_server,
    wait_for,
)

pytestmark = pytest.mark.tp
MODEL = "SmolLM2-135M-Instruct"
PROMPT = "The capital of France is"
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 20},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]


@pytest.fixture(scope="module", params=["mp", "ray"])
def tp_server(request):
    """The server, its ranks as processes (mp) or as actors of a private local Ray cluster,
    publishing KV-cache events on `srv.kv_events_port` (topic "kv"): every test runs on both."""
    port = free_port()
    events = {"enable_kv_cache_events": True, "publisher": "zmq", "topic": "kv"}
    events["endpoint"] = f"tcp://*:{port}"
    flags = ["--tensor-parallel-size", "2", "--kv-events-config", json.dumps(events)]
    flags += ["--distributed-executor-backend", request.param]
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("OMP_NUM_THREADS", "1")  # per rank (the server itself only schedules)
        srv = start_server(*flags)
    srv.kv_events_port = port
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def one_rank():
    """The offline engine at one rank in the server's geometry."""
    from kvflow import LLM

    geometry = dict(zip(GEOMETRY[::2], GEOMETRY[1::2], strict=True))
    return LLM(
        dtype=geometry["--dtype"],
        num_blocks=int(geometry["--num-blocks"]),
        block_size=int(geometry["--block-size"]),
        max_model_len=MAX_MODEL_LEN,
    )


@pytest.fixture(scope="module")
def one_rank_text(one_rank) -> str:
    """The greedy completion of PROMPT at one rank."""
    from kvflow import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    return one_rank.generate([PROMPT], params)[0].outputs[0].text


def test_completion_matches_one_rank(tp_server: ServerProcess, one_rank_text: str) -> None:
    client = tp_server.client()
    out = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0, extra_body={"ignore_eos": True}
    )
    assert out.choices[0].text == one_rank_text
    assert out.usage.completion_tokens == 16 and out.choices[0].finish_reason == "length"
    models = tp_server.get("/v1/models").json()["data"]
    assert models[0]["max_model_len"] == MAX_MODEL_LEN


def test_streaming_chat_and_batched_requests(tp_server: ServerProcess) -> None:
    client = tp_server.client()
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Name a colour."}],
        max_tokens=12,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text and chunks[-1].usage.completion_tokens <= 12
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("stop", "length")
    # n > 1 and several prompts: several requests in each step of the ranks
    out = client.completions.create(
        model=MODEL, prompt=[PROMPT, "1, 2, 3,"], n=2, max_tokens=8, temperature=0.7, seed=3
    )
    assert len(out.choices) == 4 and all(c.text for c in out.choices)


def test_metrics_count_the_ranks_work(tp_server: ServerProcess) -> None:
    labels = {"model_name": MODEL}
    before = scrape(tp_server).value("vllm:generation_tokens_total", **labels)
    tp_server.client().completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0)
    after = scrape(tp_server)
    assert after.value("vllm:generation_tokens_total", **labels) >= before + 5
    assert after.value("vllm:num_requests_running", **labels) == 0
    assert after.value("vllm:kv_cache_usage_perc", **labels) == 0


def test_errors_are_400_and_the_server_stays_up(tp_server: ServerProcess) -> None:
    client = tp_server.client()
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        client.completions.create(model=MODEL, prompt="hi " * (MAX_MODEL_LEN + 10), max_tokens=4)
    response = tp_server.post("/v1/completions", {"model": MODEL, "prompt": "x", "top_p": 7})
    assert response.status_code == 400 and response.json()["error"]["type"]
    assert httpx.get(f"{tp_server.url}/health", timeout=10).status_code == 200
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0)
    assert out.usage.completion_tokens == 3


def test_structured_outputs_and_tool_choice(tp_server: ServerProcess) -> None:
    """The grammar backend serves the ranks: a json_schema response_format, and tool_choice
    named and required, each valid against its schema."""
    client = tp_server.client()
    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 50}},
        "required": ["n"],
        "additionalProperties": False,
    }
    out = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Pick a number as JSON."}],
        response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": schema}},
        max_tokens=40,
        temperature=0,
    )
    assert out.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(out.choices[0].message.content), schema)
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    named = {"type": "function", "function": {"name": "get_weather"}}
    for choice in (named, "required"):
        out = client.chat.completions.create(
            model=MODEL,
            messages=ask,
            tools=TOOLS,
            tool_choice=choice,
            parallel_tool_calls=False,
            max_tokens=80,
            temperature=0,
        )
        calls = out.choices[0].message.tool_calls
        assert [c.function.name for c in calls] == ["get_weather"], choice
        jsonschema.validate(json.loads(calls[0].function.arguments), WEATHER)


def test_kv_events_reach_a_subscriber(tp_server: ServerProcess) -> None:
    """A prompt's full blocks arrive as BlockStored events carrying its tokens."""
    prompt = "A subscriber hears about every block of this prompt. " * 4
    ids = tp_server.post("/tokenize", {"model": MODEL, "prompt": prompt}).json()["tokens"]
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    sub.connect(f"tcp://127.0.0.1:{tp_server.kv_events_port}")
    full = len(ids) // 16 * 16  # the prompt's tokens in full blocks
    try:
        time.sleep(0.5)  # the subscription reaches the publisher
        tp_server.client().completions.create(model=MODEL, prompt=prompt, max_tokens=2)
        stored: list[int] = []
        while sub.poll(5000):
            topic, _, payload = sub.recv_multipart()
            assert topic == b"kv"
            for event in msgspec.msgpack.decode(payload)[1]:
                if event["type"] == "BlockStored":
                    stored += event["token_ids"]
            if any(stored[i : i + full] == ids[:full] for i in range(len(stored))):
                break
        else:
            raise AssertionError(f"no BlockStored events with the prompt's {full} tokens")
    finally:
        sub.close()
        ctx.term()


def test_estimated_flops_are_the_per_gpu_share(tp_server: ServerProcess, one_rank) -> None:
    """vllm:estimated_flops_per_gpu_total grows by half what one rank counts for the same
    request (the same steps: one prompt step, then one token a step)."""
    from kvflow import SamplingParams

    prompt = "Counting floating point operations per device:"
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    start = one_rank.engine.stats().estimated_flops
    one_rank.generate([prompt], params)
    one_rank_flops = one_rank.engine.stats().estimated_flops - start
    labels = {"model_name": MODEL}

    def flops() -> float:
        return scrape(tp_server).value("vllm:estimated_flops_per_gpu_total", **labels)

    before = flops()
    tp_server.client().completions.create(
        model=MODEL, prompt=prompt, max_tokens=6, temperature=0, extra_body={"ignore_eos": True}
    )
    wait_for(lambda: flops() - before >= one_rank_flops / 2, 5.0)
    assert one_rank_flops > 0 and flops() - before == one_rank_flops / 2


@pytest.mark.parametrize("method", ["int8", "gguf"])
def test_quantized_ranks_serve_one_ranks_tokens(method: str) -> None:
    """`kvflow serve -tp 2 --quantization METHOD` answers with the greedy tokens the offline
    engine gives at one rank with the same quantization (each rank holds its part of the same
    values)."""
    from kvflow import LLM, SamplingParams

    geometry = dict(zip(GEOMETRY[::2], GEOMETRY[1::2], strict=True))
    one = LLM(
        dtype=geometry["--dtype"],
        num_blocks=int(geometry["--num-blocks"]),
        block_size=int(geometry["--block-size"]),
        max_model_len=MAX_MODEL_LEN,
        quantization=method,
    )
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    expected = one.generate([PROMPT], params)[0].outputs[0].text
    del one
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("OMP_NUM_THREADS", "1")
        srv = start_server("--tensor-parallel-size", "2", "--quantization", method)
    try:
        out = srv.client().completions.create(
            model=MODEL,
            prompt=PROMPT,
            max_tokens=16,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        assert out.choices[0].text == expected
        assert f"quantization: {method}" in srv.log()
    finally:
        srv.stop()
