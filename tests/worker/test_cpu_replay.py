"""CPU decode steps replayed as recorded kernel calls (worker/cpu_replay.py).

Engines over tiny random bf16 checkpoints, one replaying its decode steps (the default on the
CPU) and one with --enforce-eager, see the same schedule (chunked prefill, batches shrinking as
requests finish, preemption in a small KV pool, prefix-cache hits): greedy and seeded outputs
must be identical, token for token, and the replay must really have run at several batch sizes
from one shared arena. A Qwen3 checkpoint (its q/k norms run torch ops in the layers) must be
refused a recording and still decode as the eager engine does. Below the engine: the guard
refuses a computing torch op, and a relocated recording computes new inputs as eager calls do.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config

from kvflow import LLM, SamplingParams
from kvflow.kernels.cpu import build, ops
from kvflow.worker.cpu_replay import ComputeOpError, CpuDecodeReplay, Recording, record
from support.decode_steps import randomize
from support.tiny_models import word_tokenizer

pytestmark = pytest.mark.skipif(not build.native_available(), reason="no native CPU kernels")

VOCAB = 256
SHAPE = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=96,
    max_position_embeddings=256,
)
ENGINE = dict(
    dtype="bfloat16",
    num_blocks=28,  # 27 x 4 = 108 servable tokens: the batch below must preempt
    block_size=4,
    max_num_seqs=8,
    max_num_batched_tokens=16,
    max_model_len=64,
)


def _checkpoint(tmp_path_factory, config, name: str) -> str:
    hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    randomize(hf, seed=5, embed_std=0.1)
    path = tmp_path_factory.mktemp(name)
    hf.save_pretrained(path)
    word_tokenizer(VOCAB).save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> str:
    return _checkpoint(tmp_path_factory, LlamaConfig(**SHAPE, attention_bias=True), "llama")


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory) -> str:
    return _checkpoint(tmp_path_factory, Qwen3Config(**SHAPE, head_dim=16), "qwen3")


def prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(3)
    lengths = [3, 9, 17, 5, 12, 1, 22]
    out = [torch.randint(2, VOCAB, (n,), generator=gen).tolist() for n in lengths]
    out.append(out[2][:10] + [7, 8])  # shares a prefix block run with prompt 2
    return out


def params() -> list[SamplingParams]:
    greedy = [
        SamplingParams(temperature=0, max_tokens=6 + 2 * i, ignore_eos=True, logprobs=2)
        for i in range(6)
    ]
    seeded = [
        SamplingParams(temperature=0.8, top_p=0.9, seed=7 + i, max_tokens=9, ignore_eos=True)
        for i in range(2)
    ]
    return greedy + seeded


def run(llm: LLM) -> list[tuple]:
    outs = llm.generate(prompts(), params())
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
    recorded = {b for b, entry in graphs._recordings.items() if entry is not None}
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
    assert graphs._recordings and all(e is None for e in graphs._recordings.values())


def test_record_refuses_an_op_that_computes() -> None:
    x = torch.randn(2, 64).bfloat16()
    with pytest.raises(ComputeOpError), record(Recording()):
        _ = x.view(2, 8, 8)[:, :4]  # views pass
        _ = torch.empty(3)  # allocations pass
        _ = x + 1


def test_relocated_recording_computes_new_inputs() -> None:
    """rms_norm -> silu_mul through an intermediate the recorded forward allocated: after
    `relocate` and `bind` into a fresh arena, new values in the static input give what eager
    calls give on them, in the arena's output view."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 64, generator=gen).bfloat16()
    weight = torch.randn(64, generator=gen).bfloat16()

    def forward(inp: torch.Tensor) -> torch.Tensor:
        return ops.silu_mul(ops.rms_norm(inp, weight, 1e-6))

    recording = Recording()
    with record(recording):
        out = forward(x)
    assert [k.__name__ for k, _ in recording.calls] == ["kvflow_rms_norm", "kvflow_silu_mul"]
    assert torch.equal(out, forward(x))
    size, view = recording.relocate(out)
    arena = torch.empty(size, dtype=torch.uint8)
    recording.bind(arena)
    for seed in (1, 2):
        x.copy_(torch.randn(3, 64, generator=torch.Generator().manual_seed(seed)).bfloat16())
        recording.replay()
        assert torch.equal(view(arena), forward(x))


def test_embedded_gguf_replay_equals_eager() -> None:
    """The embedded model's GGUF blocks as stored: the quantized kernels (VNNI at a few rows,
    AMX beyond, where the CPU has them) recorded and replayed, token for token."""
    prompts = ["The capital of France is", "def add(a, b):", "Once upon a time", "Water is"]
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    outs = {}
    for eager in (True, False):
        llm = LLM(quantization="gguf", max_model_len=512, enforce_eager=eager)
        outs[eager] = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)]
        if not eager:
            assert replay_of(llm).steps[len(prompts)] > 1
        del llm
    assert outs[False] == outs[True]
