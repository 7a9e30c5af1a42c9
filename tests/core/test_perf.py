"""The perf estimates (vllm:estimated_*_per_gpu_total) follow vLLM's counting: 2 FLOPs per
weight per token for the projections, the attention terms over the context, the LM head on the
rows that need logits only; weights read once per step."""

from __future__ import annotations

from kvflow.core.messages import CachedRequestData, NewRequestData, SchedulerOutput
from kvflow.core.perf import ModelShape, step_perf

# SmolLM2-135M's shape, bf16
SHAPE = ModelShape(30, 576, 9, 3, 64, 1536, 49152, 2)
LAYER_WEIGHTS = 576 * (9 + 2 * 3) * 64 + 9 * 64 * 576 + 3 * 576 * 1536
HEAD = 576 * 49152


def decode_step(context: int) -> SchedulerOutput:
    cached = CachedRequestData()
    cached.append("a", [], context - 1)
    return SchedulerOutput([], cached, {"a": 1}, 1)


def prefill_step(tokens: int) -> SchedulerOutput:
    new = NewRequestData("p", list(range(tokens)), [], None, [1], 0)
    return SchedulerOutput([new], CachedRequestData(), {"p": tokens}, tokens)


def test_one_decode_token():
    flops, read, write = step_perf(SHAPE, decode_step(100))
    attention = 4 * 9 * 100 * 64 * 30  # q.k and p.v over 100 positions, 30 layers
    assert flops == 2 * (30 * LAYER_WEIGHTS + HEAD) + attention
    kv_read = 2 * 100 * 3 * 64 * 2 * 30
    assert (30 * LAYER_WEIGHTS + HEAD) * 2 + kv_read < read < (30 * LAYER_WEIGHTS + HEAD) * 2.1
    assert write > 2 * 1 * 3 * 64 * 2 * 30  # at least the token's K and V


def test_a_prefill_computes_logits_for_its_last_token_only():
    flops, _, _ = step_perf(SHAPE, prefill_step(64))
    attention = 4 * 9 * (64 * 64) * 64 * 30
    assert flops == 2 * 64 * 30 * LAYER_WEIGHTS + 2 * HEAD + attention
