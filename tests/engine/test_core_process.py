"""The engine core in its own process, driven through ProcessEngine without HTTP: outputs
match the in-process engine's, a stop string found on the API side ends the request in the
core, aborts free blocks, a utility call returns typed plain data, an unknown method is a clear
error, output constraints compile and apply in the engine process, and Shutdown ends the
process with status 0. One engine process for the module (the
real embedded model; greedy)."""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Iterator

import pytest

from kvflow.engine.core_client import ProcessEngine, RemoteCore
from kvflow.engine.core_launch import frontend, launch_engine, load_frontend_tokenizer
from kvflow.engine.engine_core import EngineStats
from kvflow.engine.llm_engine import EngineArgs
from kvflow.model.loader import resolve_model
from kvflow.sampling_params import SamplingParams, StructuredOutputsParams

ARGS = dict(dtype="float32", num_blocks=64, block_size=16, max_num_seqs=8)
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def process() -> Iterator:
    proc, _ = launch_engine(EngineArgs(**ARGS))
    try:
        yield proc
    finally:
        if proc.proc is not None and proc.proc.poll() is None:
            proc.proc.kill()
            proc.proc.wait()


def run(process, scenario, **kwargs):
    """Run `scenario(engine)` on a fresh event loop with a client that does not stop the
    process (the module shares it)."""
    engine = frontend(
        process.ready, RemoteCore(), load_frontend_tokenizer(process.ready.model_path, None)
    )

    async def main():
        client = ProcessEngine(engine, process, owns_process=False, **kwargs)
        client.start()
        try:
            return await scenario(client)
        finally:
            await client.shutdown(0)
            client.close()

    return asyncio.run(main())


async def collect(client: ProcessEngine, rid: str, prompt: str, params: SamplingParams):
    ids = client.engine.tokenize_prompt(prompt)
    text, finish = "", None
    async for out in client.generate(rid, ids, params):
        text += out.outputs[0].text
        finish = out.outputs[0].finish_reason
    return text, finish


def test_outputs_match_the_in_process_engine(process) -> None:
    from kvflow.engine.llm import LLM

    params = SamplingParams(temperature=0, max_tokens=12)

    async def scenario(client):
        return await asyncio.gather(*(collect(client, f"r{i}", PROMPT, params) for i in range(3)))

    remote = run(process, scenario)
    local = LLM(**ARGS).generate([PROMPT], params)[0].outputs[0]
    assert [r[0] for r in remote] == [local.text] * 3
    assert {r[1] for r in remote} == {"length"}


def test_stop_string_abort_and_utility(process) -> None:
    async def scenario(client):
        stopped = await collect(
            client, "s", PROMPT, SamplingParams(temperature=0, max_tokens=40, stop=["Paris"])
        )
        long = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
        stream = client.add_request("a", client.engine.tokenize_prompt(PROMPT), long)
        first = await stream.__anext__()
        client.abort("a")
        rest = [out async for out in stream]
        await asyncio.sleep(0.2)
        stats = await client.call_utility("stats", type=EngineStats)
        with pytest.raises(RuntimeError, match="no engine method"):
            await client.call_utility("no_such_method")
        loop_stats = await client.call_utility("loop_stats")
        return stopped, first, rest, stats, loop_stats

    stopped, first, rest, stats, loop_stats = run(process, scenario)
    assert stopped == (" ", "stop")
    assert not first.finished and rest[-1].finished
    assert rest[-1].outputs[0].finish_reason == "abort"
    assert isinstance(stats, EngineStats)
    assert stats.num_running == stats.num_waiting == 0 and stats.kv_cache_usage == 0.0
    assert loop_stats["steps"] > 0 and loop_stats["step_s"] > 0 and loop_stats["idle_s"] > 0


class Recorder:
    """A stat logger that keeps every pass's IterationStats."""

    def __init__(self) -> None:
        self.passes: list = []

    def record(self, stats) -> None:
        self.passes.append(stats)


def test_output_constraints_compile_in_the_engine_process(process) -> None:
    """The API side parses a constraint (a bad one is a ValueError before anything is sent);
    the engine process compiles it and masks the logits: outputs follow the constraint, n > 1
    included, as the in-process engine's do, and each compile time comes back for the metrics."""
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 12}},
        "required": ["city"],
        "additionalProperties": False,
    }
    json_so = StructuredOutputsParams(json=schema, disable_any_whitespace=True)
    choice_so = StructuredOutputsParams(choice=["Paris", "Lyon", "Nice"])
    recorder = Recorder()

    async def scenario(client):
        with pytest.raises(ValueError, match="cannot be compiled"):
            client.validate_structured_outputs(StructuredOutputsParams(regex="(unclosed"))
        json_params = SamplingParams(temperature=0, max_tokens=40, structured_outputs=json_so)
        choice_params = SamplingParams(
            temperature=0.8, seed=3, n=3, max_tokens=8, structured_outputs=choice_so
        )
        ids = client.engine.tokenize_prompt(PROMPT)
        text = await collect(client, "j", PROMPT, json_params)
        outs = [o async for o in client.generate("c", ids, choice_params)]
        return text, outs

    (text, finish), outs = run(process, scenario, stat_logger=recorder)
    assert finish == "stop" and list(json.loads(text)) == ["city"], text
    choices: dict[int, str] = {}
    for out in outs:
        for c in out.outputs:
            choices[c.index] = choices.get(c.index, "") + c.text
    assert len(choices) == 3 and set(choices.values()) <= {"Paris", "Lyon", "Nice"}, choices
    compiles = [t for stats in recorder.passes for t in stats.grammar_compile_times]
    assert len(compiles) == 4 and all(t >= 0 for t in compiles)  # one per core request
    assert sum(stats.num_grammar_failures for stats in recorder.passes) == 0


def test_queue_limit_counts_adds_the_engine_has_not_taken(process) -> None:
    async def scenario(client):
        params = SamplingParams(temperature=0, max_tokens=2)
        ids = client.engine.tokenize_prompt(PROMPT)
        streams = [client.add_request(f"q{i}", ids, params) for i in range(8)]
        streams.append(client.add_request("q8", ids, params))  # waits: one over
        from kvflow.engine.engine_client import EngineUnavailableError

        with pytest.raises(EngineUnavailableError, match="queue is full"):
            client.add_request("q9", ids, params)
        return [[o async for o in s][-1].outputs[0].finish_reason for s in streams]

    assert run(process, scenario, max_num_queued_reqs=1) == ["length"] * 9


def test_shutdown_stops_the_process_with_status_0() -> None:
    proc, tokenizer = launch_engine(
        EngineArgs(**ARGS), meanwhile=lambda: load_frontend_tokenizer(resolve_model(None), None)
    )
    engine = frontend(proc.ready, RemoteCore(), tokenizer)

    async def main():
        client = ProcessEngine(engine, proc)
        client.start()
        ids = engine.tokenize_prompt(PROMPT)
        stream = client.add_request("x", ids, SamplingParams(max_tokens=500, ignore_eos=True))
        await stream.__anext__()
        await client.shutdown(0)
        outs = [o async for o in stream]
        client.close()
        return outs

    outs = asyncio.run(main())
    assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "abort"
    assert proc.proc.wait(10) == 0
    assert not os.path.exists(f"/proc/{proc.pid}")
