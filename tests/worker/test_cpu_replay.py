"""CPU decode steps replayed as recorded kernel calls (worker/cpu_replay.py).

Engines over tiny random bf16 checkpoints, one replaying its decode steps (the default on the
CPU) and one with --enforce-eager, see the same schedule (chunked prefill, batches shrinking as
requests finish, preemption in a small KV pool, prefix-cache hits): greedy and seeded outputs
must be identical, token for token, and the replay must really have run at several batch sizes
from one shared arena. A Qwen3 checkpoint (its q/k norms run torch ops in the layers) must be
refused a recording and still decode as the eager engine does; a torch op that runs once
(a value computed on first use) refuses only its step. Below the engine: the guard
refuses a computing torch op, and a relocated recording computes new inputs as eager calls do.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode
from transformers import LlamaConfig, Qwen3Config

from kvflow import LLM, SamplingParams
from kvflow.kernels.cpu import build, ops
from kvflow.worker.cpu_replay import (
    RECORD_TRIES,
    ComputeOpError,
    CpuDecodeReplay,
    Recording,
    record,
)
from support.decode_steps import LLAMA_LIKE
from support.engine_schedule import SMALL_POOL, VOCAB, params, prompts, save_checkpoint

pytestmark = pytest.mark.skipif(not build.native_available(), reason="no native CPU kernels")

SHAPE = dict(LLAMA_LIKE, vocab_size=VOCAB, max_position_embeddings=256)
ENGINE = dict(dtype="bfloat16", **SMALL_POOL)


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> str:
    return save_checkpoint(tmp_path_factory, LlamaConfig(**SHAPE, attention_bias=True), "llama")


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory) -> str:
    return save_checkpoint(tmp_path_factory, Qwen3Config(**SHAPE, head_dim=16), "qwen3")


def run(llm: LLM) -> list[tuple]:
    outs = llm.generate(prompts(), params(logprobs=2))
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]


def replay_of(llm: LLM) -> CpuDecodeReplay:
    graphs = llm.engine.core.runner.decode_graphs
    assert isinstance(graphs, CpuDecodeReplay)
    return graphs


def test_replayed_engine_equals_eager_engine(llama) -> None:
    eager = LLM(llama, enforce_eager=True, **ENGINE)
    assert eager.engine.core.runner.decode_graphs is None
    expected = run(eager)
    stats = eager.engine.stats()
    assert stats.num_preemptions_total > 0 and stats.prefix_cache_hits > 0

    llm = LLM(llama, **ENGINE)
    graphs = replay_of(llm)
    assert run(llm) == expected
    recorded = {b for b, r in graphs._recordings.items() if r is not None}
    assert len(recorded) >= 3 and recorded == set(graphs._recordings), graphs._recordings
    assert graphs.arena_bytes > 0
    assert sum(graphs.steps[b] > 1 for b in recorded) >= 2, graphs.steps  # replays, not records
    before = dict(graphs._recordings)
    assert run(llm) == expected  # the same schedule again: only replays
    assert graphs._recordings == before


def test_layers_with_torch_ops_stay_eager(qwen3) -> None:
    expected = run(LLM(qwen3, enforce_eager=True, **ENGINE))
    llm = LLM(qwen3, **ENGINE)
    assert run(llm) == expected
    graphs = replay_of(llm)
    assert all(r is None for r in graphs._recordings.values())
    assert max(graphs.refusals.values()) == RECORD_TRIES  # sizes seen that often gave up


def test_a_one_time_torch_op_refuses_only_its_step(llama) -> None:
    """A value the layers compute on first use (as QuantizedWeight.has_mins) runs a torch op
    in the first decode step: that step stays eager, the next one at its size records."""
    expected = run(LLM(llama, enforce_eager=True, **ENGINE))
    llm = LLM(llama, **ENGINE)
    layers = llm.engine.core.runner.model.model
    eager_run_layers, calls = layers.run_layers, []

    def first_use(*args):
        if not calls and _get_current_dispatch_mode() is not None:  # the first recording
            calls.append(1)
            torch.ones(2).sum()  # a torch op that computes, once
        return eager_run_layers(*args)

    layers.run_layers = first_use
    assert run(llm) == expected
    graphs = replay_of(llm)
    assert sum(graphs.refusals.values()) == 1
    assert all(r is not None for r in graphs._recordings.values())


def test_record_refuses_an_op_that_computes() -> None:
    x = torch.randn(2, 64).bfloat16()
    with pytest.raises(ComputeOpError), record(Recording(())):
        _ = x.view(2, 8, 8)[:, :4]  # views pass
        _ = torch.empty(3)  # allocations pass
        _ = x + 1


def test_relocated_recording_computes_new_inputs() -> None:
    """rms_norm -> silu_mul through an intermediate the recorded forward allocated: after
    `relocate` and `bind` into a fresh arena, a replay of new inputs gives what eager calls
    give on them, in the arena."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 64, generator=gen).bfloat16()
    weight = torch.randn(64, generator=gen).bfloat16()

    def forward(inp: torch.Tensor) -> torch.Tensor:
        return ops.silu_mul(ops.rms_norm(inp, weight, 1e-6))

    recording = Recording((x,))
    with record(recording):
        out = forward(x)
    assert [k.__name__ for k, _ in recording.calls] == ["kvflow_rms_norm", "kvflow_silu_mul"]
    assert torch.equal(out, forward(x))
    arena = torch.empty(recording.relocate(out), dtype=torch.uint8)
    recording.bind(arena)
    for seed in (1, 2):
        new = torch.randn(3, 64, generator=torch.Generator().manual_seed(seed)).bfloat16()
        replayed = recording.replay((new,))
        assert replayed.data_ptr() >= arena.data_ptr()  # the output lies in the arena
        assert torch.equal(replayed, forward(new))


def test_embedded_gguf_replay_equals_eager() -> None:
    """The embedded model's GGUF blocks as stored: the quantized kernels (VNNI at a few rows,
    AMX beyond, where the CPU has them) recorded and replayed, token for token."""
    texts = ["The capital of France is", "def add(a, b):", "Once upon a time", "Water is"]
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    outs = {}
    for eager in (True, False):
        llm = LLM(quantization="gguf", max_model_len=512, num_blocks=64, enforce_eager=eager)
        outs[eager] = [o.outputs[0].token_ids for o in llm.generate(texts, greedy)]
        if not eager:
            assert replay_of(llm).steps[len(texts)] > 1
        del llm
    assert outs[False] == outs[True]
