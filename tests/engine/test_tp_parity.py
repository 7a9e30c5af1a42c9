"""`LLM(tensor_parallel_size=2)` against one rank on the embedded model in float32: the same
greedy tokens for 5 prompts x 32 tokens batched with other requests, prefill chunked at 16
tokens, through preemption (a pool of 8 usable blocks for 7 requests of 3 blocks each); then
`shutdown` leaves no rank process, zombie or not (read from /proc). With `--quantization
int8` and `gguf` the ranks hold their parts of the quantized weights and give one rank's
tokens and log-probabilities."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvflow import LLM, SamplingParams
from kvflow.model import resolve_model
from kvflow.model.gguf_weights import GgufWeights

PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a land far away,",
    "def fibonacci(n):",
    "1, 2, 3, 4, 5,",
    "The best way to learn a language is",
]
OTHERS = ["Tell me a story about a dragon", "List three colours:"]
ENGINE = dict(dtype="float32", num_blocks=9, block_size=16, max_num_batched_tokens=16)


def _generate(llm: LLM) -> list[list[int]]:
    greedy = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    seeded = SamplingParams(temperature=0.8, seed=7, max_tokens=32, ignore_eos=True)
    outs = llm.generate(PROMPTS + OTHERS, [greedy] * len(PROMPTS) + [seeded, greedy])
    assert all(len(o.outputs[0].token_ids) == 32 for o in outs)
    assert llm.engine.stats().num_preemptions_total > 0
    return [o.outputs[0].token_ids for o in outs]


def _gone(pid: int) -> bool:
    status = Path(f"/proc/{pid}/status")
    try:
        return "State:\tZ" not in status.read_text()
    except FileNotFoundError:
        return True


def test_two_ranks_generate_one_ranks_greedy_tokens(monkeypatch) -> None:
    one = _generate(LLM(**ENGINE))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # each rank's (read when it starts)
    llm = LLM(**ENGINE, tensor_parallel_size=2)
    runner = llm.engine.core.runner
    pids = runner.pids
    assert len(pids) == 2 and all(Path(f"/proc/{pid}").exists() for pid in pids)
    try:
        two = _generate(llm)
    finally:
        runner.shutdown()
    assert two[: len(PROMPTS)] == one[: len(PROMPTS)]
    assert two[-1] == one[-1]
    assert all(not Path(f"/proc/{pid}").exists() or _gone(pid) for pid in pids)
    assert all(not Path(f"/proc/{pid}").exists() for pid in pids)  # reaped, not zombies


def _greedy(llm: LLM) -> tuple[list[list[int]], list[float]]:
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0)
    outs = llm.generate(PROMPTS[:3], params)
    logprobs = [next(iter(p.values())).logprob for o in outs for p in o.outputs[0].logprobs]
    return [o.outputs[0].token_ids for o in outs], logprobs


@pytest.mark.parametrize("method", ["int8", "gguf"])
def test_two_ranks_serve_one_ranks_quantized_tokens(method: str, monkeypatch) -> None:
    """The same tokens and log-probabilities (1e-4: the row-parallel sums' order) as one rank
    with the same quantized values: int8 scales from whole rows on each rank, the GGUF's own
    blocks cut per rank, whose bytes add up to the file's."""
    engine = dict(dtype="float32", num_blocks=32, quantization=method)
    one_tokens, one_logprobs = _greedy(LLM(**engine))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    llm = LLM(**engine, tensor_parallel_size=2)
    runner = llm.engine.core.runner
    try:
        tokens, logprobs = _greedy(llm)
    finally:
        runner.shutdown()
    assert tokens == one_tokens
    assert max(abs(a - b) for a, b in zip(logprobs, one_logprobs, strict=True)) < 1e-4
    held = sum(r.quantized_bytes for r in runner.loaded)
    replaced = sum(r.replaced_bytes for r in runner.loaded)
    if method == "gguf":
        stored = GgufWeights(resolve_model(None))
        quantized = [stored.quantized(n) for _, n in stored.checkpoint_names(lambda n: True)]
        assert held == sum(q.nbytes for q in quantized if q is not None)
    else:  # int8 codes for float32 weights, and a scale per row
        assert 0 < held < replaced / 3
