"""GET /v1/engine/snapshot, the page's routes and --generation-config, through the whole HTTP
stack in process over a real LLMEngine with the scripted runner (steps of a known length, no
model): what a request's blocks and the queue look like, the rate bound, the API key.

Placement: the thread alone, because the scripted runner lives in this process; under tests the
thread's messages pass through the engine process's encoding (`ThreadCore`), and the engine
process itself is tested in tests/engine/test_core_process.py and the liveness suite."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

import kvflow.server.engine_view as engine_view
from kvflow.server.generation_defaults import EMBEDDED_MODEL_DEFAULTS, default_sampling_params
from support.inprocess import LONG, serve, wait


class SteppedClock:
    """engine_view's clock, moved on by the test: a cached snapshot expires when the test
    says, not after a sleep."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now

    def time(self) -> float:
        return time.time()

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def clock(monkeypatch) -> SteppedClock:
    stepped = SteppedClock()
    monkeypatch.setattr(engine_view, "time", stepped)
    return stepped


@pytest.fixture(scope="module")
def tokenizer():
    from kvflow.model.loader import load_tokenizer, resolve_model

    return load_tokenizer(resolve_model(None))


def test_snapshot_shows_the_running_request_its_blocks_and_why_the_next_waits(tokenizer, clock):
    async def scenario(client, engine, runner) -> dict:
        first = asyncio.create_task(client.post("/v1/completions", json=LONG))
        await wait(lambda: engine.stats().num_running == 1)
        second = asyncio.create_task(client.post("/v1/completions", json=LONG))
        await wait(lambda: engine.stats().num_waiting == 1)
        during = (await client.get("/v1/engine/snapshot")).json()
        for request_id in engine.request_ids():
            engine.abort(request_id)
        await first, await second
        clock.advance(1.0)  # past the snapshot cache's interval
        after = (await client.get("/v1/engine/snapshot")).json()
        return {"during": during, "after": after}

    result, _ = serve(tokenizer, [], scenario, max_num_seqs=1)
    during = result["during"]["engine"]
    (running,) = during["running"]
    assert running["request_id"].startswith("cmpl-") and running["num_prompt_tokens"] == 3
    assert running["max_tokens"] == 200 and 0 < running["num_output_tokens"] < 200
    assert running["block_ids"] and all(during["blocks"][b] == "h" for b in running["block_ids"])
    assert during["blocks"].count("h") == len(running["block_ids"])
    assert during["waiting_by_reason"] == {"max_num_seqs": 1}
    assert during["waiting"][0]["wait_reason"] == "max_num_seqs"
    assert during["num_blocks"] == 64 and during["blocks"][0] == "n"
    after = result["after"]["engine"]
    assert not after["running"] and not after["waiting"]
    assert set(after["blocks"][1:]) <= {".", "c"}
    fields = result["after"]["history_fields"]
    rows = result["after"]["history"]
    assert sum(row[fields.index("gen_tokens")] for row in rows) > 0
    assert sum(row[fields.index("steps")] for row in rows) > 0


def test_snapshots_are_bounded_in_rate_and_shared(tokenizer, clock):
    async def scenario(client, engine, runner) -> dict:
        burst = await asyncio.gather(*(client.get("/v1/engine/snapshot") for _ in range(40)))
        clock.advance(1.0)
        later = await client.get("/v1/engine/snapshot")
        bad = await client.get("/v1/engine/snapshot", params={"history_s": -1})
        return {"burst": burst, "later": later, "bad": bad}

    result, _ = serve(tokenizer, [], scenario)
    assert all(r.status_code == 200 for r in result["burst"])
    seqs = {r.json()["snapshot_seq"] for r in result["burst"]}
    assert len(seqs) <= 2  # 40 callers at once: one or two engine snapshots, not 40
    assert result["later"].json()["snapshot_seq"] > max(seqs)
    assert result["bad"].status_code == 400


def test_api_key_guards_the_snapshot_not_the_page(tokenizer):
    async def scenario(client, engine, runner) -> dict:
        key = {"Authorization": "Bearer sesame"}
        return {
            "bare": await client.get("/v1/engine/snapshot"),
            "wrong": await client.get("/v1/engine/snapshot", headers={"Authorization": "x"}),
            "keyed": await client.get("/v1/engine/snapshot", headers=key),
            "page": await client.get("/"),
            "script": await client.get("/ui/app.js"),
        }

    result, _ = serve(tokenizer, ["--api-key", "sesame"], scenario)
    assert result["bare"].status_code == 401 and result["wrong"].status_code == 401
    assert result["bare"].json()["error"]["message"] == "Unauthorized"
    assert result["keyed"].status_code == 200
    assert result["page"].status_code == 200 and "<title>kvflow</title>" in result["page"].text
    assert result["script"].status_code == 200 and "engine/snapshot" in result["script"].text


def test_disable_web_ui_removes_the_page_only(tokenizer):
    async def scenario(client, engine, runner) -> dict:
        return {
            "page": await client.get("/"),
            "script": await client.get("/ui/app.js"),
            "snapshot": await client.get("/v1/engine/snapshot"),
        }

    result, _ = serve(tokenizer, ["--disable-web-ui"], scenario)
    assert result["page"].status_code == 404 and result["script"].status_code == 404
    assert result["snapshot"].status_code == 200


def _sampling_seen(tokenizer, argv: list[str], bodies: list[dict]) -> list:
    """The SamplingParams the runner received for each body, and the responses."""

    async def scenario(client, engine, runner) -> dict:
        responses = [await client.post("/v1/completions", json=body) for body in bodies]
        params = [new.sampling_params for step in runner.steps for new in step.new_reqs]
        return {"params": params, "responses": responses}

    result, _ = serve(tokenizer, argv, scenario)
    return [*zip(result["params"], result["responses"], strict=True)]


def test_generation_config_auto_gives_the_embedded_model_its_card_values(tokenizer):
    bodies = [
        {"prompt": "Hi", "max_tokens": 2},
        {"prompt": "Hi", "max_tokens": 2, "temperature": 0.7, "top_p": 0.5},
    ]
    (default, _), (own, _) = _sampling_seen(tokenizer, [], bodies)
    assert (default.temperature, default.top_p) == (0.2, 0.9)
    assert (own.temperature, own.top_p) == (0.7, 0.5)  # a request's own values win
    ((plain, _),) = _sampling_seen(tokenizer, ["--generation-config", "vllm"], bodies[:1])
    assert (plain.temperature, plain.top_p) == (1.0, 1.0)


def test_the_embedded_model_penalizes_repeats_in_constrained_requests_alone():
    """(The served path: test_first_requests' parse() against the embedded model.)"""
    from kvflow.server.generation_defaults import request_defaults

    embedded = default_sampling_params("auto", None)
    assert request_defaults(embedded, constrained=True)["repetition_penalty"] == 1.2
    assert "repetition_penalty" not in request_defaults(embedded, constrained=False)
    assert request_defaults(default_sampling_params("vllm", None), constrained=True) == {}
    off = default_sampling_params("auto", None, {"constrained_repetition_penalty": None})
    assert "repetition_penalty" not in request_defaults(off, constrained=True)


def test_generation_config_folder_and_override(tokenizer, tmp_path):
    config = {"temperature": 0.6, "top_k": 20, "max_new_tokens": 5, "do_sample": True}
    (tmp_path / "generation_config.json").write_text(json.dumps(config))
    argv = [
        "--generation-config",
        str(tmp_path),
        "--override-generation-config",
        '{"repetition_penalty": 1.1}',
    ]
    bodies = [{"prompt": "Hi", "max_tokens": 50, "ignore_eos": True}, {"prompt": "Hi"}]
    (capped, response), (_, _) = _sampling_seen(tokenizer, argv, bodies)
    assert (capped.temperature, capped.top_k, capped.repetition_penalty) == (0.6, 20, 1.1)
    assert capped.top_p == 1.0 and capped.max_tokens == 5  # max_new_tokens caps max_tokens
    assert response.json()["usage"]["completion_tokens"] == 5


def test_no_request_left_at_its_defaults_runs_past_the_embedded_cap(tokenizer):
    """The scripted runner never stops a request: only max_tokens does. A chat request that
    sets nothing ends at the embedded model's cap; one whose prompt leaves less room than the
    cap gets the room (not a 400); a request's own max_tokens above the cap is capped."""
    chat = {"messages": [{"role": "user", "content": "List three prime numbers."}]}
    long = {"messages": [{"role": "user", "content": "go " * 800}]}

    async def scenario(client, engine, runner) -> dict:
        runner.delay = 0.0
        bodies = [chat, long, {**chat, "max_tokens": 900}, {"prompt": "Hi"}]
        paths = ["/v1/chat/completions"] * 3 + ["/v1/completions"]
        return {
            "answers": [await client.post(p, json=b) for p, b in zip(paths, bodies, strict=True)]
        }

    result, _ = serve(tokenizer, [], scenario, max_model_len=1008)  # 63 usable blocks of 16
    default, room, asked, completion = [r.json() for r in result["answers"]]
    assert default["usage"]["completion_tokens"] == 512
    assert default["choices"][0]["finish_reason"] == "length"
    assert 0 < room["usage"]["completion_tokens"] < 512
    assert room["usage"]["prompt_tokens"] + room["usage"]["completion_tokens"] == 1008
    assert asked["usage"]["completion_tokens"] == 512
    assert completion["usage"]["completion_tokens"] == 16  # vLLM's completions default


def test_default_sampling_params_reads_only_vllms_fields(tmp_path):
    embedded = {
        "temperature": 0.2,
        "top_p": 0.9,
        "max_tokens": 512,
        "constrained_repetition_penalty": 1.2,
    }
    assert default_sampling_params("auto", None) == embedded  # max_new_tokens as the cap
    assert EMBEDDED_MODEL_DEFAULTS["max_new_tokens"] == 512
    no_cap = default_sampling_params("auto", None, {"max_new_tokens": None})
    assert "max_tokens" not in no_cap  # the override's null removes the cap
    assert default_sampling_params("vllm", None) == {}
    assert default_sampling_params("vllm", None, {"temperature": 0.3}) == {"temperature": 0.3}
    (tmp_path / "config.json").write_text("{}")
    assert default_sampling_params("auto", str(tmp_path)) == {}  # no generation_config.json
    # the sampling fields vLLM takes, nothing else (token ids, do_sample)
    body = {"temperature": 1.0, "min_p": 0.05, "bos_token_id": 1, "do_sample": True}
    (tmp_path / "generation_config.json").write_text(json.dumps(body))
    assert default_sampling_params("auto", str(tmp_path)) == {"temperature": 1.0, "min_p": 0.05}
    with pytest.raises(ValueError, match="not a folder"):
        default_sampling_params(str(tmp_path / "missing"), None)
    with pytest.raises(ValueError, match="JSON object"):
        from kvflow.server.generation_defaults import parse_override

        parse_override("[1]")


def test_a_snapshot_that_outwaits_a_step_leaves_the_engine_alive(tokenizer, monkeypatch):
    """A snapshot is taken between two steps; a caller whose wait a step outlasts gets a 503
    at once (not a hang), and the loop answers the call it stopped waiting for harmlessly:
    the request completes, the engine stays healthy, and once idle a snapshot answers 200."""
    import kvflow.engine.async_llm as async_llm

    monkeypatch.setattr(async_llm, "_SNAPSHOT_WAIT_S", 0.01)

    async def scenario(client, engine, runner) -> dict:
        runner.delay = 0.2
        done = asyncio.create_task(client.post("/v1/completions", json={**LONG, "max_tokens": 8}))
        await wait(lambda: engine.stats().num_running == 1)
        during = []
        for _ in range(3):
            steps = engine.stats().num_steps
            during.append(await client.get("/v1/engine/snapshot"))
            await wait(lambda s=steps: engine.stats().num_steps > s + 1)
        finished = await done
        await wait(lambda: engine.stats().num_running == 0)
        after = await client.get("/v1/engine/snapshot")
        return {"during": during, "after": after, "done": finished, "healthy": engine.is_healthy}

    result, controller = serve(tokenizer, [], scenario)
    assert all(r.status_code in (200, 503) for r in result["during"])
    assert any(r.status_code == 503 for r in result["during"])
    assert "busy in a step" in next(r for r in result["during"] if r.status_code == 503).text
    assert result["after"].status_code == 200
    assert result["done"].status_code == 200 and result["healthy"]
    assert controller.exit_code == 0
