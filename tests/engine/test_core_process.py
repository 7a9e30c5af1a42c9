"""The server's front end (AsyncEngine) without HTTP, in both placements of its engine loop (a
thread of this process, the engine core process): outputs match the offline engine's, a stop
string found on the API side ends the request in the core, aborts free blocks, a utility call
returns typed plain data, an unknown method is a clear error, output constraints compile and
apply where the loop runs, and Shutdown ends the loop (the engine process with status 0). The
real embedded model, greedy; one engine process for the module's process placement."""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Iterator

import pytest

from kvflow.engine.async_llm import AsyncEngine, EngineUnavailableError
from kvflow.engine.engine_core import EngineStats
from kvflow.engine.llm_engine import EngineArgs
from kvflow.sampling_params import SamplingParams, StructuredOutputsParams
from support.placements import PLACEMENTS, engine_loops, front_end

ARGS = dict(dtype="float32", num_blocks=64, block_size=16, max_num_seqs=8)
PROMPT = "The capital of France is"


@pytest.fixture(scope="module", params=PLACEMENTS)
def placement(request) -> Iterator[tuple[str, object]]:
    with engine_loops(request.param, EngineArgs(**ARGS)) as shared:
        yield request.param, shared


def run(placement, scenario, **kwargs):
    """Run `scenario(engine)` on a fresh event loop with a front end that does not stop a
    shared engine process."""

    async def main():
        engine = front_end(*placement, **kwargs)
        engine.start()
        try:
            return await scenario(engine)
        finally:
            await engine.shutdown(0)
            engine.close()

    return asyncio.run(main())


async def collect(client: AsyncEngine, rid: str, prompt: str, params: SamplingParams):
    ids = client.tokenize_prompt(prompt)
    text, finish = "", None
    async for out in client.generate(rid, ids, params):
        text += out.outputs[0].text
        finish = out.outputs[0].finish_reason
    return text, finish


def test_outputs_match_the_offline_engine(placement) -> None:
    from kvflow.engine.llm import LLM

    params = SamplingParams(temperature=0, max_tokens=12)

    async def scenario(client):
        return await asyncio.gather(*(collect(client, f"r{i}", PROMPT, params) for i in range(3)))

    remote = run(placement, scenario)
    local = LLM(**ARGS).generate([PROMPT], params)[0].outputs[0]
    assert [r[0] for r in remote] == [local.text] * 3
    assert {r[1] for r in remote} == {"length"}


def test_stop_string_abort_and_utility(placement) -> None:
    async def scenario(client):
        stopped = await collect(
            client, "s", PROMPT, SamplingParams(temperature=0, max_tokens=40, stop=["Paris"])
        )
        long = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
        stream = client.add_request("a", client.tokenize_prompt(PROMPT), long)
        first = await stream.__anext__()
        client.abort("a")
        rest = [out async for out in stream]
        stats = await client.call_utility("stats", type=EngineStats)  # after the Abort, in order
        with pytest.raises(RuntimeError, match="no engine method"):
            await client.call_utility("no_such_method")
        loop_stats = await client.call_utility("loop_stats")
        return stopped, first, rest, stats, loop_stats

    stopped, first, rest, stats, loop_stats = run(placement, scenario)
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


def test_output_constraints_compile_in_the_engine_process(placement) -> None:
    """A bad constraint is a ValueError before anything is sent (over the engine process, the
    engine's parse, asked once: `validate` then refuses it without asking); the engine process
    compiles it and masks the logits: outputs follow the constraint, n > 1 included, as the
    in-process engine's do, and each compile time comes back for the metrics."""
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
        bad = StructuredOutputsParams(regex="(unclosed")
        with pytest.raises(ValueError, match=r"\(regex\) cannot be compiled") as asked:
            await client.check_constraint(bad)
        with pytest.raises(ValueError) as known:
            client.add_request(
                "bad", client.tokenize_prompt(PROMPT), SamplingParams(structured_outputs=bad)
            )
        assert str(known.value) == str(asked.value)
        json_params = SamplingParams(temperature=0, max_tokens=40, structured_outputs=json_so)
        choice_params = SamplingParams(
            temperature=0.8, seed=3, n=3, max_tokens=8, structured_outputs=choice_so
        )
        ids = client.tokenize_prompt(PROMPT)
        text = await collect(client, "j", PROMPT, json_params)
        outs = [o async for o in client.generate("c", ids, choice_params)]
        return text, outs

    (text, finish), outs = run(placement, scenario, stat_logger=recorder)
    assert finish == "stop" and list(json.loads(text)) == ["city"], text
    choices: dict[int, str] = {}
    for out in outs:
        for c in out.outputs:
            choices[c.index] = choices.get(c.index, "") + c.text
    assert len(choices) == 3 and set(choices.values()) <= {"Paris", "Lyon", "Nice"}, choices
    compiles = [t for stats in recorder.passes for t in stats.grammar_compile_times]
    assert len(compiles) == 4 and all(t >= 0 for t in compiles)  # one per core request
    assert sum(stats.num_grammar_failures for stats in recorder.passes) == 0


def test_queue_limit_counts_adds_the_engine_has_not_taken(placement) -> None:
    async def scenario(client):
        params = SamplingParams(temperature=0, max_tokens=2)
        ids = client.tokenize_prompt(PROMPT)
        streams = [client.add_request(f"q{i}", ids, params) for i in range(8)]
        streams.append(client.add_request("q8", ids, params))  # waits: one over
        with pytest.raises(EngineUnavailableError, match="queue is full"):
            client.add_request("q9", ids, params)
        return [[o async for o in s][-1].outputs[0].finish_reason for s in streams]

    assert run(placement, scenario, max_num_queued_reqs=1) == ["length"] * 9


@pytest.mark.parametrize("where", PLACEMENTS)
def test_shutdown_ends_the_loop_and_the_engine_process_with_status_0(where) -> None:
    with engine_loops(where, EngineArgs(**ARGS)) as shared:

        async def main():
            engine = front_end(where, shared, owner=True)
            engine.start()
            ids = engine.tokenize_prompt(PROMPT)
            stream = engine.add_request("x", ids, SamplingParams(max_tokens=500, ignore_eos=True))
            await stream.__anext__()
            await engine.shutdown(0)
            outs = [o async for o in stream]
            engine.close()
            return outs, engine.threads_alive()

        outs, alive = asyncio.run(main())
        assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "abort"
        assert not alive
        if where == "process":
            assert shared.proc.wait(10) == 0
            assert not os.path.exists(f"/proc/{shared.pid}")
