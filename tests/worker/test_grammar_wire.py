"""Compiled grammars to the tensor-parallel ranks (`structured.wire`): steps pickle with their
grammars as WireGrammars, a rank gets back grammars that serialize as the EngineCore's did, and
each grammar's JSON crosses once while both sides still hold it (the same LRU updates on each
side), again after both evicted it; the tokenizer info crosses with the first grammar only."""

from __future__ import annotations

import pickle

import pytest

from kvflow.core.messages import CachedRequestData, NewRequestData, SchedulerOutput
from kvflow.model.loader import load_tokenizer, resolve_model
from kvflow.sampling_params import SamplingParams, StructuredOutputsParams
from kvflow.structured.backend import GrammarBackend
from kvflow.structured.wire import GrammarReceiver, GrammarSender


@pytest.fixture(scope="module")
def grammars() -> dict:
    backend = GrammarBackend(load_tokenizer(resolve_model(None)), 49152, [2])
    regexes = {"a": r"[0-9]{3}", "b": r"(yes|no)", "c": r"[a-z]+-[0-9]"}
    out = {
        name: backend.compile(StructuredOutputsParams(regex=r)).result(timeout=60)[0]
        for name, r in regexes.items()
    }
    backend.close()
    return out


def _step(*grammars) -> SchedulerOutput:
    new = [
        NewRequestData(f"r{i}", [1, 2], [], SamplingParams(), [1], 0, grammar)
        for i, grammar in enumerate(grammars)
    ]
    return SchedulerOutput(new, CachedRequestData(), {}, len(new))


def test_steps_cross_with_each_grammar_json_once_per_stay(grammars) -> None:
    sender, receiver = GrammarSender(cache_size=2), GrammarReceiver(cache_size=2)
    plain = _step(None)
    assert sender.encode(plain) is plain and receiver.decode(plain) is plain
    a, b, c = grammars["a"], grammars["b"], grammars["c"]
    # (a step's grammars, which of them carry their JSON), two kept: c evicts a; b, used
    # again, is kept when a crosses again and evicts c, and when c does and evicts a
    script = [
        ([a, None, a], [True, False]),
        ([b], [True]),
        ([c], [True]),
        ([b, a], [False, True]),
        ([b, c], [False, True]),
        ([a], [True]),
    ]
    for number, (step_grammars, carried) in enumerate(script):
        wire = pickle.loads(pickle.dumps(sender.encode(_step(*step_grammars))))
        sent = [new.grammar for new in wire.new_reqs if new.grammar is not None]
        assert [w.grammar_json is not None for w in sent] == carried, number
        assert [w.tokenizer_json is not None for w in sent][:1] == [number == 0]
        decoded = receiver.decode(wire)
        for new, original in zip(decoded.new_reqs, step_grammars, strict=True):
            if original is None:
                assert new.grammar is None
            else:
                assert new.grammar.serialize_json() == original.serialize_json(), number
