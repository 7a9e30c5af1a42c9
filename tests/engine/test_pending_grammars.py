"""Requests whose constraint is compiling, in a real LLMEngine over the scripted runner: they
wait aside (counted as waiting) while others run, start once compiled, fail alone when the
compile fails, and an engine with nothing else to do waits on the compile instead of spinning."""

from __future__ import annotations

import time
from concurrent.futures import Future

from kvflow.sampling_params import SamplingParams, StructuredOutputsParams
from support.fake_engine import make_llm_engine
from support.fakes import FakeGrammar

GRAMMAR = FakeGrammar(length=3, allowed=(7, 8))


class ControlledBackend:
    """A grammar backend whose compiles end when the test says."""

    def __init__(self) -> None:
        self.futures: dict[str, Future] = {}

    def validate(self, so: StructuredOutputsParams) -> None:
        if so.regex == "bad":
            raise ValueError("The output constraint (regex) cannot be compiled: bad")

    def compile(self, so: StructuredOutputsParams) -> Future:
        return self.futures.setdefault(so.regex, Future())

    def finish(self, regex: str, error: str | None = None) -> None:
        future = self.futures[regex]
        if error:
            future.set_exception(ValueError(error))
        else:
            future.set_result((GRAMMAR, 0.01, time.monotonic()))


def _engine():
    engine, runner = make_llm_engine()
    runner.delay = 0.0
    engine.validator = engine.core.grammar = ControlledBackend()
    return engine, engine.validator


def _params(regex: str | None = None, max_tokens: int = 5) -> SamplingParams:
    so = None if regex is None else StructuredOutputsParams(regex=regex)
    return SamplingParams(
        max_tokens=max_tokens, ignore_eos=True, detokenize=False, structured_outputs=so
    )


def _run(engine, steps: int) -> dict[str, tuple[str, list[int]]]:
    """request id -> (finish reason, every token) for requests that ended in these steps."""
    tokens: dict[str, list[int]] = {}
    finished: dict[str, tuple[str, list[int]]] = {}
    for _ in range(steps):
        for out in engine.step():
            (choice,) = out.outputs
            tokens.setdefault(out.request_id, []).extend(choice.token_ids)
            if out.finished:
                finished[out.request_id] = (str(choice.finish_reason), tokens[out.request_id])
    return finished


def test_a_compiling_request_waits_aside_then_runs_to_its_grammar_end() -> None:
    engine, backend = _engine()
    engine.add_request("constrained", [5, 6, 7], _params("a", max_tokens=10))
    engine.add_request("free", [5, 6, 7], _params())
    finished = _run(engine, 8)
    assert "free" in finished and "constrained" not in finished
    assert engine.core.stats().num_waiting == 1
    backend.finish("a")
    finished = _run(engine, 8)
    reason, tokens = finished["constrained"]
    assert reason == "stop"  # the grammar ended after 3 tokens
    assert len(tokens) == 3 and set(tokens) <= set(GRAMMAR.allowed)
    assert engine.core.pending_grammars.take_compile_times()  # one per request
    assert not engine.has_unfinished_requests()


def test_a_failed_compile_fails_that_request_alone() -> None:
    engine, backend = _engine()
    engine.add_request("doomed", [5, 6], _params("b"))
    engine.add_request("free", [5, 6], _params())
    backend.finish("b", "structured_outputs cannot be compiled: nope")
    finished = _run(engine, 8)
    assert finished["doomed"][0] == "error"
    assert finished["free"][0] == "length"
    assert engine.core.num_grammar_failures() == 1


def test_a_constraint_that_does_not_parse_is_refused_before_queueing() -> None:
    engine, _ = _engine()
    try:
        engine.add_request("bad", [5, 6], _params("bad"))
    except ValueError as exc:
        assert "cannot be compiled" in str(exc)
    else:
        raise AssertionError("accepted a constraint that does not parse")
    assert not engine.has_unfinished_requests()


def test_an_engine_with_only_compiling_requests_waits_instead_of_spinning() -> None:
    engine, _ = _engine()
    engine.add_request("slow", [5, 6], _params("c"))
    start = time.monotonic()
    steps = 0
    while time.monotonic() - start < 0.3:
        engine.step()
        steps += 1
    assert steps <= 10, f"{steps} steps in 0.3 s with nothing to run"
    assert engine.core.stats().num_stuck_failures == 0 and engine.has_unfinished_requests()
    engine.abort_request(["slow"])
    assert not engine.has_unfinished_requests()
