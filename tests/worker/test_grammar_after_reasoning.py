"""A constraint that starts after a reasoning section (`SamplingParams.reasoning_end_ids`, set
by the server's --reasoning-parser): its tokens are free, the grammar shapes what follows."""

from __future__ import annotations

import pytest
import torch

from kvflow.sampling_params import StructuredOutputsParams
from kvflow.structured.backend import GrammarBackend
from kvflow.structured.bitmask import GrammarMasker, GrammarState


@pytest.fixture(scope="module")
def tokenizer():
    from kvflow.model.loader import load_tokenizer, resolve_model

    return load_tokenizer(resolve_model(None))


def allowed(masker: GrammarMasker, state: GrammarState, token_id: int) -> bool:
    bitmask, empty = masker.fill(1, [0], [state])
    assert not empty
    word = int(bitmask[0, token_id >> 5]) & 0xFFFFFFFF
    return bool(word >> (token_id & 31) & 1)


def test_reasoning_tokens_are_free_then_the_grammar_applies(tokenizer):
    vocab = len(tokenizer)
    backend = GrammarBackend(tokenizer, vocab, [tokenizer.eos_token_id])
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    so = StructuredOutputsParams(json=schema, disable_any_whitespace=True)
    compiled = backend.compile(so).result()[0]
    backend.close()
    end = tuple(tokenizer.encode("</think>", add_special_tokens=False))
    thinking = tokenizer.encode("Let me think: Hello world.", add_special_tokens=False)
    answer = tokenizer.encode('{"a": 7}', add_special_tokens=False)
    hello = tokenizer.encode("Hello", add_special_tokens=False)[0]
    brace = tokenizer.encode("{", add_special_tokens=False)[0]
    masker = GrammarMasker(vocab, torch.device("cpu"))

    state = GrammarState(compiled, end)
    for token in [*thinking, *end]:
        assert state.waiting and allowed(masker, state, hello)  # all ones while reasoning
        assert state.accept(token)
    assert not state.waiting
    assert allowed(masker, state, brace) and not allowed(masker, state, hello)
    assert not state.accept(hello)  # the grammar now refuses free text
    for token in answer:
        assert state.accept(token)
    assert state.accept(tokenizer.eos_token_id) and state.terminated

    outputs = [*thinking, *end, *answer]
    resumed = GrammarState(compiled, end)  # preempted and resumed: the kept tokens replayed
    assert resumed.sync(outputs) and not resumed.waiting
    assert resumed.num_accepted == len(outputs)
    plain = GrammarState(compiled)  # no reasoning: the grammar applies from the first token
    assert not plain.waiting and not allowed(masker, plain, hello)
