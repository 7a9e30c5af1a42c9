"""The server at --tensor-parallel-size 2 (two rank processes over gloo): the official openai
client, streaming, /metrics and the error answers, on one module-scoped server whose greedy
answers are checked against the offline engine at one rank."""

from __future__ import annotations

import httpx
import openai
import pytest

from support.serverproc import GEOMETRY, MAX_MODEL_LEN, ServerProcess, scrape, start_server

pytestmark = pytest.mark.tp
MODEL = "SmolLM2-135M-Instruct"
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def tp_server():
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("OMP_NUM_THREADS", "1")  # per rank (the server itself only schedules)
        srv = start_server("--tensor-parallel-size", "2")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def one_rank_text() -> str:
    """The greedy completion of PROMPT at one rank, offline, in the server's geometry."""
    from kvflow import LLM, SamplingParams

    geometry = dict(zip(GEOMETRY[::2], GEOMETRY[1::2], strict=True))
    llm = LLM(
        dtype=geometry["--dtype"],
        num_blocks=int(geometry["--num-blocks"]),
        block_size=int(geometry["--block-size"]),
        max_model_len=MAX_MODEL_LEN,
    )
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    return llm.generate([PROMPT], params)[0].outputs[0].text


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
