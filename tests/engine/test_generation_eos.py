"""EOS ids from generation_config.json beyond the tokenizer's (Llama 3 lists three) stop a
request as vLLM does: finish_reason "stop", stop_reason the id, its text left out; ignore_eos
and min_tokens hold them back like the tokenizer's EOS."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvflow import LLM, SamplingParams
from kvflow.model.loader import resolve_model

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[list[int], LLM]:
    """Greedy ids of the embedded model with EOS ignored, then an LLM over a copy of it whose
    generation config also lists the first of those ids that repeats none before it (at k >= 2)."""
    source = resolve_model(None)
    plain = LLM(model=str(source), dtype="float32", num_blocks=64)
    ids = plain.generate(PROMPT, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    ids = ids[0].outputs[0].token_ids
    del plain
    k = next(i for i in range(2, len(ids)) if ids[i] not in ids[:i])
    copy = tmp_path_factory.mktemp("model")
    for item in Path(source).iterdir():
        if item.name != "generation_config.json":
            (copy / item.name).symlink_to(item)
    config = json.loads((Path(source) / "generation_config.json").read_text())
    config["eos_token_id"] = [config["eos_token_id"], ids[k]]
    (copy / "generation_config.json").write_text(json.dumps(config))
    return ids[: k + 1], LLM(model=str(copy), dtype="float32", num_blocks=64)


def test_generation_config_eos_stops(runs) -> None:
    ids, llm = runs
    out = llm.generate(PROMPT, SamplingParams(max_tokens=8, temperature=0))[0].outputs[0]
    assert out.token_ids == ids
    assert out.finish_reason == "stop" and out.stop_reason == ids[-1]
    assert out.text == llm.get_tokenizer().decode(ids[:-1], skip_special_tokens=True)


def test_ignore_eos_and_min_tokens_hold_it_back(runs) -> None:
    ids, llm = runs
    free = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    assert len(llm.generate(PROMPT, free)[0].outputs[0].token_ids) == 8
    held = SamplingParams(max_tokens=8, temperature=0, min_tokens=len(ids))
    out = llm.generate(PROMPT, held)[0].outputs[0]
    assert out.token_ids[: len(ids) - 1] == ids[:-1] and out.token_ids[len(ids) - 1] != ids[-1]
