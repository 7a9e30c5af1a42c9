"""The whole HTTP stack in process (the app and uvicorn) over a real LLMEngine whose scripted
runner can be told to raise: engine death and the queue limit, which a real model cannot be
made to show on demand.

Placement: the thread alone, because the scripted runner lives in this process; under tests the
thread's messages pass through the engine process's encoding (`ThreadCore`), and the engine
process itself is tested in tests/engine/test_core_process.py and the liveness suite."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from support.inprocess import LONG, serve, wait


@pytest.fixture(scope="module")
def tokenizer():
    from kvflow.model.loader import load_tokenizer, resolve_model

    return load_tokenizer(resolve_model(None))


async def stream(client: httpx.AsyncClient, body: dict) -> list[str]:
    async with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as resp:
        return [line async for line in resp.aiter_lines() if line]


def last_event(lines: list[str]) -> dict:
    assert lines[-1] == "data: [DONE]"
    return json.loads(lines[-2][len("data: ") :])


def test_engine_death_answers_every_client_and_exits_1(tokenizer):
    async def scenario(client, engine, runner) -> dict:
        ok = await client.post("/v1/completions", json={**LONG, "max_tokens": 3})
        plain = asyncio.create_task(client.post("/v1/completions", json=LONG))
        streamed = asyncio.create_task(stream(client, LONG))
        await wait(lambda: engine.stats().num_running == 2)
        runner.boom = True
        result = {"ok": ok, "plain": await plain, "stream": await streamed}
        result["healthy"] = engine.is_healthy
        return result

    result, controller = serve(tokenizer, ["--served-model-name", "fake"], scenario)
    assert result["ok"].status_code == 200
    plain = result["plain"]
    assert plain.status_code == 500
    assert plain.json()["error"]["type"] == "InternalServerError"
    assert "injected step failure" in plain.json()["error"]["message"]
    event = last_event(result["stream"])
    assert event["error"]["code"] == 500 and "injected step failure" in event["error"]["message"]
    assert not result["healthy"]
    assert controller.exit_code == 1 and not result["threads_alive"]


def test_queue_limit_is_503_with_retry_after_and_none_is_lost(tokenizer):
    async def scenario(client, engine, runner) -> dict:
        first = asyncio.create_task(client.post("/v1/completions", json=LONG))
        await wait(lambda: engine.stats().num_running == 1)
        second = asyncio.create_task(stream(client, {**LONG, "max_tokens": 2}))
        await wait(lambda: engine.stats().num_waiting == 1)
        refused = await client.post("/v1/completions", json=LONG)
        engine.abort(engine.request_ids()[0])  # let the queue move: end the first request
        return {"first": await first, "second": await second, "refused": refused}

    argv = ["--max-num-queued-reqs", "1"]
    result, controller = serve(tokenizer, argv, scenario, max_num_seqs=1)
    refused = result["refused"]
    assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
    assert "--max-num-queued-reqs" in refused.json()["error"]["message"]
    assert result["first"].status_code == 503  # aborted: a terminal answer, not silence
    chunks = [json.loads(line[6:]) for line in result["second"][:-1]]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert controller.exit_code == 0 and not result["threads_alive"]
