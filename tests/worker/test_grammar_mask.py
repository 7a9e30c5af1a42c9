"""The token bitmask on real xgrammar matchers with the embedded model's tokenizer: the padded
logits tail, mixed constrained and free rows, min_tokens' blocked ids, empty masks, matcher
sync after preemption, and compile errors."""

from __future__ import annotations

import re

import pytest
import torch

from kvflow.model.loader import load_tokenizer, resolve_model
from kvflow.sampling_params import SamplingParams, StructuredOutputsParams
from kvflow.structured.backend import GrammarBackend
from kvflow.structured.bitmask import (
    EMPTY_MASK_ERROR,
    GrammarMasker,
    GrammarState,
    StepMask,
    blocked_ids,
)

EOS = 2
PAD = 100  # logits past the tokenizer's vocabulary, as a padded LM head has


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(resolve_model(None))


@pytest.fixture(scope="module")
def backend(tokenizer) -> GrammarBackend:
    backend = GrammarBackend(tokenizer, len(tokenizer) + PAD, [EOS])
    yield backend
    backend.close()


def _state(backend: GrammarBackend, **constraint) -> GrammarState:
    compiled, _, _ = backend.compile(StructuredOutputsParams(**constraint)).result(timeout=60)
    return GrammarState(compiled)


def _allowed(logits_row: torch.Tensor) -> list[int]:
    return torch.isfinite(logits_row).nonzero().flatten().tolist()


def test_mixed_rows_and_the_padded_tail(backend, tokenizer) -> None:
    """Rows 0 and 2 are constrained (digits; a choice), row 1 is free and left untouched; no
    constrained row allows an id past the tokenizer's vocabulary."""
    vocab = backend.vocab_size
    masker = GrammarMasker(vocab, torch.device("cpu"))
    digits, choice = _state(backend, regex=r"[0-9]+"), _state(backend, choice=["yes", "no"])
    mask = StepMask(masker, [0, 2], [digits, choice], 3, {})
    logits = torch.zeros(3, vocab)
    mask.apply(logits)
    assert torch.isfinite(logits[1]).all()
    for row in (0, 2):
        assert not torch.isfinite(logits[row, len(tokenizer) :]).any()
    digit_ids = _allowed(logits[0])
    assert digit_ids and all(re.fullmatch(r"[0-9]+", tokenizer.decode([t])) for t in digit_ids)
    starts = {tokenizer.decode([t]) for t in _allowed(logits[2])}
    assert starts and all("yes".startswith(s) or "no".startswith(s) for s in starts)
    assert mask.empty == set()


def test_a_finished_choice_allows_only_eos_and_min_tokens_empties_it(backend, tokenizer) -> None:
    state = _state(backend, choice=["yes"])
    for t in tokenizer.encode("yes", add_special_tokens=False):
        assert state.accept(t)
    masker = GrammarMasker(backend.vocab_size, torch.device("cpu"))
    logits = torch.zeros(1, backend.vocab_size)
    StepMask(masker, [0], [state], 1, {}).apply(logits)
    assert _allowed(logits[0]) == [EOS]
    params = SamplingParams(min_tokens=5, max_tokens=8)
    blocked = {0: blocked_ids(params, state.num_accepted, EOS)}
    mask = StepMask(masker, [0], [state], 1, blocked)
    assert mask.empty == {0}
    ended, failed = mask.advance([EOS], [True])
    assert failed == {0: EMPTY_MASK_ERROR} and not ended
    # without min_tokens the sampled EOS ends the grammar: the request stops
    ended, failed = StepMask(masker, [0], [state], 1, {}).advance([EOS], [True])
    assert ended == {0} and not failed and state.terminated


def test_advance_skips_rows_ended_since_the_launch_and_rejects_off_grammar(backend) -> None:
    masker = GrammarMasker(backend.vocab_size, torch.device("cpu"))
    a, b = _state(backend, regex=r"[0-9]+"), _state(backend, regex=r"[0-9]+")
    mask = StepMask(masker, [0, 1], [a, b], 2, {})
    letter = backend.tokenizer_info.decoded_vocab.index(b"x")
    ended, failed = mask.advance([letter, letter], [True, False])
    assert failed == {0: "the sampled token does not match the output constraint"}
    assert a.num_accepted == 0 and b.num_accepted == 0 and not ended


def test_sync_rebuilds_the_matcher_to_the_kept_tokens(backend, tokenizer) -> None:
    """A resumed request's kept tokens differ from what the matcher took: it is rebuilt."""
    state = _state(backend, regex=r"[a-z]+-[0-9]+")
    ids = tokenizer.encode("abc-12", add_special_tokens=False)
    for t in ids:
        assert state.accept(t)
    kept = tokenizer.encode("abc", add_special_tokens=False)
    assert state.sync(kept) and state.num_accepted == len(kept)
    assert not state.sync(kept + tokenizer.encode("X", add_special_tokens=False))


@pytest.mark.parametrize(
    ("constraint", "needle"),
    [
        ({"json": {"type": "object", "properties": {"a": {"type": "bogus"}}}}, "bogus"),
        ({"regex": "(unclosed"}, "regex"),
        ({"grammar": 'root ::= "a" missing'}, "missing"),
        ({"structural_tag": "{not json"}, "structural_tag"),
    ],
)
def test_a_constraint_that_does_not_compile_is_a_value_error(backend, constraint, needle) -> None:
    so = StructuredOutputsParams(**constraint)
    with pytest.raises(ValueError, match=needle):
        backend.validate(so)
    with pytest.raises(ValueError):
        backend.compile(so).result(timeout=60)


def test_compiles_are_cached_by_constraint(backend) -> None:
    a = backend.compile(StructuredOutputsParams(json={"type": "integer"}))
    b = backend.compile(StructuredOutputsParams(json='{"type": "integer"}'))
    c = backend.compile(
        StructuredOutputsParams(json={"type": "integer"}, disable_any_whitespace=True)
    )
    assert a is backend.compile(StructuredOutputsParams(json={"type": "integer"}))
    assert a is not c and b is not c
