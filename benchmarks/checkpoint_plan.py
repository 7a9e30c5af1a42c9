"""What a random-weight checkpoint of a real model's shape holds: its dimensions, its tensors
(HF and llama.cpp names, shapes, what fills them) and their values, made a few rows at a time."""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, replace

import numpy as np

# Values made at a time: 16 Mi float32 (64 MiB), whatever the tensor's size.
CHUNK_ELEMENTS = 1 << 24
WEIGHT_STD = 0.02  # the initializer range of Llama's config: activations stay finite


@dataclass(frozen=True)
class Shape:
    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied: bool
    context: int
    rope_theta: float = 500000.0
    rope_factor: float = 32.0  # llama3 scaling; its other fields are Llama 3.1's
    rms_eps: float = 1e-5
    # llama.cpp's architecture: "llama", "qwen2" (q/k/v biases), "qwen3" (q/k norms), "phi3"
    # (q | k | v and gate | up stored fused)
    arch: str = "llama"


# A few MB for tests: the embedded vocabulary plus 128 reserved tokens (the padding's path,
# without parsing Llama's 128k token strings); untied, so a test runs the `output` path.
TINY = Shape("tiny", 64, 2, 4, 2, 16, 128, 49152 + 128, False, 131072)
SHAPES = {
    "llama-3.2-1b": Shape("llama-3.2-1b", 2048, 16, 32, 8, 64, 8192, 128256, True, 131072),
    "llama-3.1-8b": Shape(
        "llama-3.1-8b", 4096, 32, 32, 8, 128, 14336, 128256, False, 131072, rope_factor=8.0
    ),
    "tiny": TINY,
    # the same, as Qwen2 (q/k/v biases), Qwen3 (q/k norms; its heads of 128, wider than
    # hidden / heads, as Qwen3-0.6B's) and Phi-3 (fused projections) store it: GGUF only
    **{
        f"tiny-{arch}": replace(
            TINY,
            name=f"tiny-{arch}",
            context=32768,
            rope_theta=1e6,
            rms_eps=1e-6,
            arch=arch,
            head_dim=128 if arch == "qwen3" else TINY.head_dim,
        )
        for arch in ("qwen2", "qwen3")
    },
    # Phi-3-mini-128k's form (fused projections): LongRoPE over an original context of PHI3_ORIGINAL, its factors
    # as llama.cpp stores them (two tensors); the short ones 1 and no attention scaling, so that
    # transformers' GGUF reader, which drops both, gives the same logits below that context
    "tiny-phi3": replace(TINY, name="tiny-phi3", rope_theta=1e4, rms_eps=1e-5, arch="phi3"),
}
PHI3_ORIGINAL = 4096


def phi3_rope_factors(shape: Shape, which: str) -> np.ndarray:
    """The tiny Phi-3's LongRoPE factors: "short" all 1, "long" 1, 1.5, 2, ... per frequency."""
    half = np.arange(shape.head_dim // 2, dtype=np.float32)
    return np.ones_like(half) if which == "short" else 1.0 + 0.5 * half


@dataclass(frozen=True)
class TensorSpec:
    hf: str  # the safetensors name
    gguf: str  # llama.cpp's name
    shape: tuple[int, ...]  # numpy order: (rows, columns)
    # "normal" (weights and biases), "ones" (norms), "rope" (llama3 frequencies), "rope-long" and
    # "rope-short" (Phi-3's LongRoPE factors)
    fill: str
    role: str = "layer"  # "embed", "head" or "layer": what a decode step reads of it


def plan(shape: Shape) -> list[TensorSpec]:
    """The checkpoint's tensors in file order (llama.cpp's: embedding, blocks, norm, head).
    A tied model has no head tensor: the embedding is also the head. `rope_freqs` is a GGUF
    extra (llama.cpp's llama3 scaling); the safetensors carry the scaling in config.json."""
    h, kv = shape.hidden, shape.kv_heads * shape.head_dim
    q = shape.heads * shape.head_dim
    qkv = (("q", q), ("k", kv), ("v", kv))
    specs = [
        TensorSpec(
            "model.embed_tokens.weight", "token_embd.weight", (shape.vocab, h), "normal", "embed"
        )
    ]
    if shape.arch == "llama":
        specs.append(TensorSpec("", "rope_freqs.weight", (shape.head_dim // 2,), "rope"))
    if shape.arch == "phi3":
        specs += [
            TensorSpec("", f"rope_factors_{w}.weight", (shape.head_dim // 2,), f"rope-{w}")
            for w in ("long", "short")
        ]
    for i in range(shape.layers):
        hf, gg = f"model.layers.{i}.", f"blk.{i}."

        def weight(name: str, gguf_name: str, rows_cols: tuple, hf=hf, gg=gg) -> TensorSpec:
            return TensorSpec(f"{hf}{name}.weight", f"{gg}{gguf_name}.weight", rows_cols, "normal")

        specs.append(
            TensorSpec(hf + "input_layernorm.weight", gg + "attn_norm.weight", (h,), "ones")
        )
        if shape.arch == "phi3":
            specs.append(weight("self_attn.qkv_proj", "attn_qkv", (q + 2 * kv, h)))
        else:
            specs += [weight(f"self_attn.{p}_proj", f"attn_{p}", (n, h)) for p, n in qkv]
        if shape.arch == "qwen2":
            specs += [
                TensorSpec(hf + f"self_attn.{p}_proj.bias", gg + f"attn_{p}.bias", (n,), "normal")
                for p, n in qkv
            ]
        if shape.arch == "qwen3":
            specs += [
                TensorSpec(
                    hf + f"self_attn.{p}_norm.weight",
                    gg + f"attn_{p}_norm.weight",
                    (shape.head_dim,),
                    "ones",
                )  # fmt: skip
                for p in ("q", "k")
            ]
        specs += [
            TensorSpec(hf + "self_attn.o_proj.weight", gg + "attn_output.weight", (h, q), "normal"),
            TensorSpec(
                hf + "post_attention_layernorm.weight", gg + "ffn_norm.weight", (h,), "ones"
            ),
        ]
        inner = shape.intermediate
        if shape.arch == "phi3":  # llama.cpp's ffn_up holds gate | up
            specs.append(weight("mlp.gate_up_proj", "ffn_up", (2 * inner, h)))
        else:
            specs += [weight("mlp.gate_proj", "ffn_gate", (inner, h))]
            specs += [weight("mlp.up_proj", "ffn_up", (inner, h))]
        specs += [
            TensorSpec(
                hf + "mlp.down_proj.weight",
                gg + "ffn_down.weight",
                (h, shape.intermediate),
                "normal",
            ),
        ]
    specs.append(TensorSpec("model.norm.weight", "output_norm.weight", (h,), "ones"))
    if not shape.tied:
        specs.append(
            TensorSpec("lm_head.weight", "output.weight", (shape.vocab, h), "normal", "head")
        )
    return specs


def row_chunks(spec: TensorSpec, shape: Shape, seed: int, index: int) -> Iterator[np.ndarray]:
    """The tensor's float32 values, a block of whole rows at a time. Each tensor has its own
    generator (seeded by `seed` and its index), so its values do not depend on the format."""
    if spec.fill == "ones":
        yield np.ones(spec.shape, dtype=np.float32)
        return
    if spec.fill == "rope":
        yield llama3_rope_factors(shape)
        return
    if spec.fill.startswith("rope-"):
        yield phi3_rope_factors(shape, spec.fill.removeprefix("rope-"))
        return
    rng = np.random.default_rng([seed, index])
    if len(spec.shape) == 1:  # a bias
        yield rng.standard_normal(spec.shape, dtype=np.float32) * WEIGHT_STD
        return
    rows, cols = spec.shape
    step = max(1, CHUNK_ELEMENTS // cols)
    for start in range(0, rows, step):
        block = rng.standard_normal((min(step, rows - start), cols), dtype=np.float32)
        block *= WEIGHT_STD
        yield block


def llama3_rope_factors(shape: Shape) -> np.ndarray:
    """llama.cpp's `rope_freqs` for llama3 scaling, as its convert_hf_to_gguf.py computes them
    (low / high frequency factors 1 and 4 over an original context of 8192)."""
    low, high, original = 1.0, 4.0, 8192
    dims = np.arange(0, shape.head_dim, 2, dtype=np.float32) / shape.head_dim
    factors = []
    for freq in 1.0 / (shape.rope_theta**dims):
        wavelen = 2 * math.pi / freq
        if wavelen < original / high:
            factors.append(1.0)
        elif wavelen > original / low:
            factors.append(shape.rope_factor)
        else:
            smooth = (original / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / shape.rope_factor + smooth))
    return np.asarray(factors, dtype=np.float32)


def rope_scaling(shape: Shape) -> dict[str, object]:
    """config.json's `rope_scaling`, as Llama 3.1 / 3.2 ship it."""
    return {
        "rope_type": "llama3",
        "factor": shape.rope_factor,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }


def parameter_count(specs: list[TensorSpec]) -> int:
    """Model parameters: every weight once (a tied head is the embedding), no rope factors."""
    return sum(math.prod(s.shape) for s in specs if not s.fill.startswith("rope"))
