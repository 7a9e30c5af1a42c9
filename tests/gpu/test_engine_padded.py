"""The whole engine with decode steps forced through DecodeGraphs' padded path, on the CPU.

Two engines over one tiny random Llama checkpoint: the plain one, and one whose runner is
built with `decode_graphs=DecodeGraphs(..., capture=False)` (what CUDA graphs replay, run
eagerly). Both see the same schedule (chunked prefill at a 16-token budget, batches shrinking
as requests finish, preemption in a small KV pool, prefix-cache hits), so greedy and seeded
random outputs must be identical, and the padded path must really have run at several buckets.
The padded engine also runs with async scheduling, as a CUDA engine does (the ids fed into
the graphs' static inputs on the device). Also: `--enforce-eager` and
`--[no-]async-scheduling` reach EngineArgs, and float32 CPU engines get neither graphs nor async
scheduling by default.
"""

from __future__ import annotations

import argparse

import pytest
from transformers import LlamaConfig

from kvflow import LLM, SamplingParams
from kvflow.server.args import add_serve_arguments, engine_args_from
from kvflow.worker.cuda_graphs import DecodeGraphs
from kvflow.worker.model_runner import ModelRunner
from support.engine_schedule import SMALL_POOL, VOCAB, params, prompts, save_checkpoint


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=96,
        max_position_embeddings=256,
        tie_word_embeddings=True,
    )
    return save_checkpoint(tmp_path_factory, config, "tiny-llama")


ENGINE = dict(dtype="float32", **SMALL_POOL)


def run(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts(), params())]


def padded(llm: LLM) -> DecodeGraphs:
    """Rebuild the engine's runner (before its first step) with an eager DecodeGraphs."""
    old = llm.engine.core.runner
    graphs = DecodeGraphs(
        old.model,
        old.kv_caches,
        old.block_size,
        llm.engine.max_model_len,
        ENGINE["max_num_seqs"],
        old.device,
        capture=False,
    )
    llm.engine.core.runner = ModelRunner(
        old.model,
        old.kv_caches,
        old.block_size,
        old.vocab_size,
        old.eos_token_id,
        str(old.device),
        decode_graphs=graphs,
    )
    return graphs


def test_padded_decode_engine_equals_plain_engine(checkpoint) -> None:
    plain = LLM(checkpoint, **ENGINE)
    assert plain.engine.core.runner.decode_graphs is None  # float32 CPU engines get no graphs
    assert not plain.engine.core.async_scheduling  # nor async scheduling
    expected = run(plain)
    stats = plain.engine.stats()
    assert stats.num_preemptions_total > 0 and stats.prefix_cache_hits > 0

    llm = LLM(checkpoint, **ENGINE)
    graphs = padded(llm)
    llm.engine.core.async_scheduling = True  # as a CUDA engine runs
    assert run(llm) == expected
    assert len(graphs.steps) >= 3, graphs.steps  # batches shrank through several buckets
    assert any(b > 1 for b in graphs.steps)


def test_nan_logits_in_a_padded_decode_fail_that_request_alone(checkpoint) -> None:
    """A decode graph hands the sampler its greedy tokens, made from the clean logits; the NaN
    fault (KVFLOW_FAULT nan:T) poisons the logits after the graph, so it must drop them: the
    marked request fails with the sampler's error, the others decode as the plain engine does."""
    from kvflow.worker.faults import FaultPlan

    mark = 9
    clean = [p for p in prompts() if mark not in p][:4]
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in LLM(checkpoint, **ENGINE).generate(clean, greedy)]
    llm = LLM(checkpoint, **ENGINE)
    graphs = padded(llm)
    llm.engine.core.runner = FaultPlan(nan_token=mark).wrap(llm.engine.core.runner)
    outs = llm.generate(clean, greedy)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert all("error" not in o.metrics for o in outs)
    steps = sum(graphs.steps.values())
    (alone,) = llm.generate([[mark]], greedy)  # one token: its first step is a decode graph's
    assert sum(graphs.steps.values()) == steps + 1
    assert "non-finite logits" in alone.metrics["error"] and not alone.outputs[0].token_ids


def test_enforce_eager_and_async_scheduling_flags() -> None:
    parser = add_serve_arguments(argparse.ArgumentParser())

    def engine_args(*argv: str):
        return engine_args_from(parser.parse_args(list(argv)))

    assert engine_args("--enforce-eager").enforce_eager
    assert not engine_args().enforce_eager
    assert engine_args("--async-scheduling").async_scheduling is True
    assert engine_args("--no-async-scheduling").async_scheduling is False
    assert engine_args().async_scheduling is None  # the device decides
