"""Deltas a slow reader has not taken are merged into one, losing nothing (output_merge), and
RequestStream hands a reader that fell behind one merged delta."""

from __future__ import annotations

import asyncio

from kvflow.engine.output_merge import merge_delta
from kvflow.engine.request_stream import RequestStream
from kvflow.outputs import CompletionOutput, RequestOutput


def delta(outputs, finished=False, **kw) -> RequestOutput:
    return RequestOutput("r", "p", [1, 2], outputs, finished, **kw)


def test_merge_concatenates_each_choice_and_keeps_the_newest_ending() -> None:
    a = delta(
        [CompletionOutput(0, "Hel", [5], -0.5, [{5: 1}]), CompletionOutput(1, "x", [7])],
        prompt_logprobs=[None, {2: 0}],
        num_cached_tokens=16,
        metrics={"first_scheduled_time": 1.0},
    )
    b = delta(
        [CompletionOutput(0, "lo", [6], -0.75, [{6: 2}], "stop", "!")],
        finished=True,
        metrics={"error": "boom"},
    )
    m = merge_delta(a, b)
    assert [(c.index, c.text, c.token_ids) for c in m.outputs] == [
        (0, "Hello", [5, 6]),
        (1, "x", [7]),
    ]
    first = m.outputs[0]
    assert first.logprobs == [{5: 1}, {6: 2}] and first.cumulative_logprob == -0.75
    assert (first.finish_reason, first.stop_reason) == ("stop", "!")
    assert m.finished and m.prompt_logprobs == [None, {2: 0}] and m.num_cached_tokens == 16
    assert m.metrics == {"first_scheduled_time": 1.0, "error": "boom"}
    assert a.outputs[0].text == "Hel" and a.outputs[0].token_ids == [5]  # inputs untouched


def test_stream_gives_a_reader_that_fell_behind_one_merged_delta() -> None:
    released = []

    async def main():
        stream = RequestStream("r", 1, lambda rid, abort: released.append((rid, abort)))
        stream.put(delta([CompletionOutput(0, "a", [1])]))
        first = await stream.__anext__()
        for i, t in enumerate("bcd"):
            stream.put(
                delta(
                    [CompletionOutput(0, t, [2 + i], finish_reason="length" if t == "d" else None)],
                    finished=t == "d",
                )
            )
        stream.put(delta([CompletionOutput(0, "late", [9])]))  # after the terminal: dropped
        return first, [o async for o in stream]

    first, rest = asyncio.run(main())
    assert first.outputs[0].text == "a"
    assert len(rest) == 1 and rest[0].outputs[0].text == "bcd" and rest[0].finished
    assert rest[0].outputs[0].token_ids == [2, 3, 4] and released == [("r", False)]
