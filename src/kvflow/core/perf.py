"""Estimated FLOPs and memory traffic per step, counted from the model's shape as vLLM counts
them (`vllm/v1/metrics/perf.py`: dense attention and SwiGLU FFN, the LM head on the rows that
need logits), for `vllm:estimated_{flops,read_bytes,write_bytes}_per_gpu_total`.

Split over `num_gpus` devices (tensor parallelism), each device's share is the whole step's over
their number, as vLLM counts it per GPU. Plain ints only.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvflow.core.messages import SchedulerOutput


@dataclass(frozen=True)
class ModelShape:
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    weight_bytes: int  # per element, also activations and the KV cache (one dtype)
    num_gpus: int = 1  # devices the model is split over

    @classmethod
    def from_hf_config(cls, hf_config, dtype_bytes: int) -> ModelShape:
        heads = hf_config.num_attention_heads
        hidden = hf_config.hidden_size
        return cls(
            num_layers=hf_config.num_hidden_layers,
            hidden_size=hidden,
            num_heads=heads,
            num_kv_heads=getattr(hf_config, "num_key_value_heads", None) or heads,
            head_dim=getattr(hf_config, "head_dim", None) or hidden // heads,
            intermediate_size=getattr(hf_config, "intermediate_size", None)
            or getattr(hf_config, "ffn_dim", None)
            or 4 * hidden,
            vocab_size=hf_config.vocab_size,
            weight_bytes=dtype_bytes,
        )


@dataclass
class _Batch:
    """vLLM's ExecutionContext: tokens and context lengths of prefill and decode rows."""

    prefill_tokens: int = 0
    prefill_context: int = 0
    prefill_requests: int = 0
    decode_tokens: int = 0
    decode_context: int = 0
    token_context: int = 0  # sum of tokens x context length

    def add(self, num_tokens: int, context_len: int, is_prefill: bool) -> None:
        if is_prefill:
            self.prefill_tokens += num_tokens
            self.prefill_context += context_len
            self.prefill_requests += 1
        else:
            self.decode_tokens += num_tokens
            self.decode_context += context_len
        self.token_context += num_tokens * context_len


def _batch(sched: SchedulerOutput) -> _Batch:
    batch = _Batch()
    for new in sched.new_reqs:
        n = sched.num_scheduled_tokens.get(new.req_id, 0)
        if n:
            batch.add(n, new.num_computed_tokens + n, True)
    cached = sched.cached_reqs
    for req_id, computed in zip(cached.req_ids, cached.num_computed_tokens, strict=True):
        n = sched.num_scheduled_tokens.get(req_id, 0)
        if n:
            batch.add(n, computed + n, n > 1)
    return batch


def step_perf(shape: ModelShape, sched: SchedulerOutput) -> tuple[int, int, int]:
    """(flops, read bytes, write bytes) of one scheduled step, per device."""
    b = _batch(sched)
    s = shape
    L, D, q, kv, d, DI, V, w = (
        s.num_layers, s.hidden_size, s.num_heads, s.num_kv_heads, s.head_dim,
        s.intermediate_size, s.vocab_size, s.weight_bytes,
    )  # fmt: skip
    T = b.prefill_tokens + b.decode_tokens
    logits_rows = b.prefill_requests + b.decode_tokens
    flops = (
        2 * T * D * (q + 2 * kv) * d * L  # qkv projection
        + 2 * T * D * q * d * L  # output projection
        + 4 * q * b.token_context * d * L  # q.k and attention x v
        + 2 * D * 3 * DI * T * L  # gate, up, down
        + 2 * logits_rows * D * V  # LM head
    )
    attn_in = 0
    if b.prefill_tokens:
        attn_in += (b.prefill_tokens * q + 2 * b.prefill_context * kv) * d * w * L
    if b.decode_tokens:
        attn_in += (b.decode_tokens * q * d + 2 * b.decode_context * kv * d) * w * L
    read = (
        T * D * w * L + D * (q + 2 * kv) * d * w * L + attn_in
        + T * q * d * w * L + q * d * D * w * L  # attention
        + T * D * w * L + 2 * D * DI * w * L + 2 * T * DI * w * L
        + T * DI * w * L + D * DI * w * L  # FFN
        + logits_rows * D * w + D * V * w  # LM head
    )  # fmt: skip
    write = (
        T * (q + 2 * kv) * d * w * L + 2 * T * kv * d * w * L + T * D * w * L  # attention
        + 2 * T * DI * w * L + T * DI * w * L + T * D * w * L  # FFN
        + logits_rows * V * w  # LM head
    )  # fmt: skip
    n = shape.num_gpus
    return flops // n, read // n, write // n
