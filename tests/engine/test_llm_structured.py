"""Offline `LLM.generate` with `SamplingParams(structured_outputs=...)` on the embedded model:
n > 1, stop strings, max_tokens, prefix caching and preemption in a tiny pool, and mixed
batches of constrained and free requests."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from kvflow import LLM, SamplingParams
from kvflow.sampling_params import StructuredOutputsParams as Constraint

WORD_PAIR = r"[a-z]{2,8} [a-z]{2,8}"
SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "rank": {"type": "integer", "minimum": 1, "maximum": 9},
    },
    "required": ["city", "rank"],
}


@pytest.fixture(scope="module")
def tiny() -> LLM:
    """88 tokens of KV for 8 sequences: requests of about 30 tokens preempt one another."""
    return LLM(None, dtype="float32", num_blocks=12, block_size=8, max_num_seqs=8)


def test_mixed_batch_with_n_stop_strings_and_lengths_under_preemption(tiny: LLM) -> None:
    prompt = "Name a city and its rank:"
    params = [
        SamplingParams(n=3, seed=1, max_tokens=40, structured_outputs=Constraint(json=SCHEMA)),
        SamplingParams(seed=2, max_tokens=20, structured_outputs=Constraint(regex=WORD_PAIR)),
        SamplingParams(seed=3, max_tokens=20, stop=[" "], structured_outputs=Constraint(regex=WORD_PAIR)),
        SamplingParams(seed=4, max_tokens=3, structured_outputs=Constraint(regex=r"[0-9]{10}")),
        SamplingParams(temperature=0, max_tokens=24),
        SamplingParams(temperature=0, max_tokens=10, structured_outputs=Constraint(choice=["up", "down"])),
    ]  # fmt: skip
    before = tiny.engine.stats().num_preemptions_total
    outs = tiny.generate([prompt] * len(params), params)
    assert tiny.engine.stats().num_preemptions_total > before, "the tiny pool never preempted"
    as_json, pair, stopped, short, free, choice = outs
    assert len(as_json.outputs) == 3
    for c in as_json.outputs:
        assert c.finish_reason == "stop", c.text
        jsonschema.validate(json.loads(c.text), SCHEMA)
    assert re.fullmatch(WORD_PAIR, pair.outputs[0].text)
    # the stop string ends the constrained request after its first word
    assert stopped.outputs[0].finish_reason == "stop"
    assert re.fullmatch(r"[a-z]{2,8}", stopped.outputs[0].text)
    # max_tokens first: "length", a prefix of the language
    assert short.outputs[0].finish_reason == "length"
    assert re.fullmatch(r"[0-9]{1,10}", short.outputs[0].text)
    assert choice.outputs[0].text in ("up", "down")
    # the free request is what it is alone: the masks of its neighbours do not touch it
    (alone,) = tiny.generate([prompt], [SamplingParams(temperature=0, max_tokens=24)])
    assert free.outputs[0].token_ids == alone.outputs[0].token_ids


def test_seeded_constrained_output_repeats_with_prefix_cache_hits(tiny: LLM) -> None:
    """Same seed, same constraint: the same tokens, though the second run reads the prompt
    from the prefix cache and its neighbours differ."""
    p = SamplingParams(seed=7, max_tokens=40, structured_outputs=Constraint(json=SCHEMA))
    prompt = "Describe a city as JSON with a rank from 1 to 9, please:"
    (first,) = tiny.generate([prompt], [p])
    second, _ = tiny.generate([prompt, "Other text"], [p, SamplingParams(max_tokens=8, seed=1)])
    assert second.outputs[0].token_ids == first.outputs[0].token_ids
    assert second.num_cached_tokens > 0
