"""Properties 1 and 3 against real servers at tiny KV geometries: the wedge report's six rows
never hang, the advertised context is exactly (num_blocks - 1) * block_size, a prompt of
max_model_len - 1 tokens completes alone, and a concurrent mix of max-length requests all
complete through preemption. One server per geometry, shared by its tests."""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple

import openai
import pytest

from support.live import (
    LONG_WAIT,
    MODEL,
    PROMPT,
    ServerProcess,
    geometry,
    serving,
    spawn,
    token_prompt,
)

# (block_size, num_blocks): the report's two (16 x 2, 16 x 4) and other block sizes.
GEOMETRIES = [(16, 2), (16, 4), (1, 33), (8, 5), (32, 2)]
# Where the concurrent mix runs: the pool holds several requests' first blocks but not their
# growth, so the mix must preempt (a 1-block pool would just serialize them).
MIX_GEOMETRIES = [(16, 4), (1, 33)]
# The report's rows: --num-blocks -> max_tokens tried with "The capital of France is".
REPORT_ROWS = {2: [8, 11, 12, 24], 4: [56]}


class Served(NamedTuple):
    server: ServerProcess
    block_size: int
    num_blocks: int

    @property
    def servable(self) -> int:
        return (self.num_blocks - 1) * self.block_size

    def __str__(self) -> str:
        return f"bs {self.block_size} x nb {self.num_blocks}"


@pytest.fixture(scope="module", params=GEOMETRIES, ids=lambda g: f"bs{g[0]}-nb{g[1]}")
def live(request: pytest.FixtureRequest, placement: str) -> Iterator[Served]:
    block_size, num_blocks = request.param
    with serving(geometry(block_size, num_blocks)) as server:
        yield Served(server, block_size, num_blocks)


def complete(server: ServerProcess, **body: object) -> tuple[int, dict, float]:
    """(status, body or error, seconds) of one completion through the official client."""
    t0 = time.monotonic()
    try:
        out = server.client().completions.create(model=MODEL, temperature=0, **body)
        return 200, out.model_dump(), time.monotonic() - t0
    except openai.APIStatusError as err:
        return err.status_code, err.body or {}, time.monotonic() - t0


def test_models_advertise_exactly_the_servable_context(live: Served) -> None:
    cards = live.server.client().models.list().data
    assert [c.id for c in cards] == [MODEL]
    advertised = (cards[0].model_extra or {})["max_model_len"]
    print(f"{live}: advertised max_model_len {advertised}")
    assert advertised == live.servable


def test_report_rows_answer_200_or_400_never_hang(live: Served) -> None:
    """The report's rows for this geometry, plus the boundary (prompt + max_tokens = context
    and one more), each greedy with and without ignore_eos."""
    mml, server = live.servable, live.server
    prompt_len = len(server.post("/tokenize", {"prompt": PROMPT}).json()["tokens"])
    room = mml - prompt_len
    report = REPORT_ROWS.get(live.num_blocks, []) if live.block_size == 16 else []
    for max_tokens in sorted({*report, room, room + 1}):
        # The report's rows as sent, and with ignore_eos so the model cannot stop early;
        # at the other geometries only the harder ignore_eos form.
        for ignore_eos in (False, True) if report else (True,):
            status, body, took = complete(
                server, prompt=PROMPT, max_tokens=max_tokens, extra_body={"ignore_eos": ignore_eos}
            )
            print(
                f"  {live} max_tokens {max_tokens} ignore_eos {ignore_eos}: {status} {took:.2f} s"
            )
            if prompt_len + max_tokens <= mml:
                assert status == 200, body
                choice, used = body["choices"][0], body["usage"]["completion_tokens"]
                assert choice["finish_reason"] in ("stop", "length") and 0 < used <= max_tokens
                if ignore_eos:
                    assert choice["finish_reason"] == "length" and used == max_tokens
            else:
                assert status == 400, body
                for number in (max_tokens, mml, prompt_len):
                    assert str(number) in body["message"], body["message"]


def test_prompt_of_max_model_len_minus_one_completes(live: Served) -> None:
    mml, server = live.servable, live.server
    for extra in ({"max_tokens": 1}, {}):  # explicit, and the default clamped to the room
        status, body, took = complete(server, prompt=token_prompt(mml - 1), **extra)
        assert status == 200, body
        usage = body["usage"]
        assert (usage["prompt_tokens"], usage["completion_tokens"]) == (mml - 1, 1)
        assert body["choices"][0]["finish_reason"] == "length"
        print(f"  {live}: {mml - 1}-token prompt done in {took:.2f} s")
    status, body, _ = complete(server, prompt=token_prompt(mml), max_tokens=1)
    assert status == 400 and str(mml) in body["message"]
    assert server.idle()


@pytest.mark.parametrize("live", MIX_GEOMETRIES, indirect=True, ids=lambda g: f"bs{g[0]}-nb{g[1]}")
def test_concurrent_max_length_requests_all_complete(live: Served) -> None:
    """Four requests each of exactly max_model_len tokens (prompt + max_tokens), started
    together: the pool cannot hold them all, so they pass through preemption, and all end."""
    mml, server = live.servable, live.server
    before = server.metrics().value("vllm:num_preemptions_total")
    prompts = [token_prompt(max(1, mml // d), offset=i) for i, d in enumerate((8, 6, 4, 3))]

    def run(ids: list[int]) -> tuple[int, dict, float]:
        room = mml - len(ids)
        return complete(server, prompt=ids, max_tokens=room, extra_body={"ignore_eos": True})

    with ThreadPoolExecutor(len(prompts)) as pool:
        results = list(pool.map(run, prompts))
    preemptions = server.metrics().value("vllm:num_preemptions_total") - before
    took = max(r[2] for r in results)
    print(f"  {live}: 4 x {mml} tokens in {took:.1f} s, {preemptions:.0f} preemptions")
    assert preemptions > 0, "the mix was meant to go through preemption"
    for ids, (status, body, _) in zip(prompts, results, strict=True):
        assert status == 200, body
        assert body["usage"]["completion_tokens"] == mml - len(ids)
        assert body["choices"][0]["finish_reason"] == "length"
    assert server.idle()


def test_one_block_refuses_to_start_naming_the_geometry_and_the_fix() -> None:
    server = spawn(geometry(16, 1))
    try:
        code = server.wait_exit(LONG_WAIT)
    finally:
        server.kill()
    log = server.log()
    print(f"  --num-blocks 1: exit {code}; {log.strip().splitlines()[-1]}")
    assert code != 0
    for needle in ("--num-blocks 1", "--block-size 16", "0 servable tokens", "--num-blocks to"):
        assert needle in log, log[-2000:]
    assert "Traceback" not in log
