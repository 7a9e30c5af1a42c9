"""The whole HTTP stack in process (the app and uvicorn) over a real LLMEngine with the scripted
runner of `fake_engine`: `serve` runs a scenario against it and shuts it down."""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Awaitable, Callable

import httpx
import uvicorn

from kvflow.engine.async_llm import AsyncEngine
from kvflow.server.api_server import _Server, build_app
from kvflow.server.args import add_serve_arguments
from support.fake_engine import SlowRunner, make_front_end
from support.serverproc import free_port

LONG = {"prompt": [504, 3575, 282], "max_tokens": 200, "ignore_eos": True}

Scenario = Callable[[httpx.AsyncClient, AsyncEngine, SlowRunner], Awaitable[dict]]


async def wait(predicate, timeout: float = 10.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not predicate():
        assert loop.time() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)


def serve(
    tokenizer, argv: list[str], scenario: Scenario, max_num_seqs: int = 8, max_model_len: int = 256
):
    """Run `scenario` against a live server; returns (its result, the controller)."""
    engine, runner = make_front_end(
        tokenizer, max_num_seqs=max_num_seqs, max_model_len=max_model_len
    )
    runner.delay = 0.02
    args = add_serve_arguments(argparse.ArgumentParser()).parse_args(argv)
    app, controller = build_app(engine, args)
    config = uvicorn.Config(app, host="127.0.0.1", port=free_port(), log_level="warning")
    server = _Server(config, controller)
    controller.server = server

    async def main() -> dict:
        serving = asyncio.create_task(server.serve())
        await wait(lambda: server.started)
        async_engine = app.state.ctx.engine
        url = f"http://127.0.0.1:{config.port}"
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            result = await scenario(client, async_engine, runner)
            if not serving.done():
                controller.begin(0)
        await asyncio.wait_for(serving, 10)
        result["threads_alive"] = async_engine.threads_alive()
        return result

    return asyncio.run(main()), controller
