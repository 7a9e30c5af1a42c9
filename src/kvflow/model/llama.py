"""The Llama family: Llama 2/3 (and SmolLM2), Mistral, Qwen2, Qwen3, Phi-3 / Phi-4.

They share one decoder (pre-norm RMSNorm, rotary attention with GQA, gated MLP) and differ in
a few switches, collected per architecture in `Flavor`:

    Llama    attention_bias / mlp_bias flags, rope scaling (llama3, linear, yarn, ...)
    Mistral  sliding window on every layer when `sliding_window` is set
    Qwen2    bias on q/k/v (not o); sliding window on layers marked "sliding_attention"
    Qwen3    per-head RMSNorm of q and k before rope; explicit head_dim
    Phi-3    q | k | v and gate | up stored fused; sliding window on every layer when
             `sliding_window` is set; LongRoPE (`RotaryEmbedding`)

Parameter names follow the transformers checkpoints, except the fused `qkv_proj` and
`gate_up_proj`, which `packed_modules` maps back to their checkpoint tensors (a checkpoint that
stores them fused, Phi-3's, is cut into those tensors as it loads: `fused_in_checkpoint`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kvflow.attention import AttentionBackend, AttentionMetadata
from kvflow.model.layers import (
    Embedding,
    Linear,
    MergedLinear,
    PagedAttention,
    RMSNorm,
    RotaryEmbedding,
    activation,
    apply_rotary,
    logits_linear,
    norm_linear,
)


@dataclass(frozen=True)
class Flavor:
    """What distinguishes one architecture of the family; see the module docstring."""

    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False


def head_dim_of(cfg: Any) -> int:
    return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


def layer_sliding_window(cfg: Any, layer_idx: int) -> int | None:
    """The attention window of layer `layer_idx` (None: full causal attention)."""
    window = getattr(cfg, "sliding_window", None)
    layer_types = getattr(cfg, "layer_types", None)
    if window is None or layer_types is None:
        return window
    return window if layer_types[layer_idx] == "sliding_attention" else None


class LlamaAttention(nn.Module):
    def __init__(
        self, cfg: Any, layer_idx: int, flavor: Flavor, backend: AttentionBackend | None
    ) -> None:
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = getattr(cfg, "num_key_value_heads", None) or self.num_heads
        self.head_dim = head_dim_of(cfg)
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.qkv_proj = MergedLinear(cfg.hidden_size, [q_size, kv_size, kv_size], flavor.qkv_bias)
        self.o_proj = Linear(q_size, cfg.hidden_size, bias=flavor.o_bias)
        if flavor.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.qk_norm = flavor.qk_norm
        self.attn = PagedAttention(
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            scale=self.head_dim**-0.5,
            sliding_window=layer_sliding_window(cfg, layer_idx),
            backend=backend,
        )

    def forward(
        self,
        qkv: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Attention of the step's tokens from their fused q | k | v projection (the decoder
        layer computes it, with the norm before it: `norm_linear`)."""
        tokens = qkv.shape[0]
        heads = self.num_heads + self.num_kv_heads
        if self.qk_norm:
            q, k, v = self.qkv_proj.split(qkv)
            q = self.q_norm(q.reshape(tokens, self.num_heads, self.head_dim))
            k = self.k_norm(k.reshape(tokens, self.num_kv_heads, self.head_dim))
            qk = torch.cat((q, k), dim=1)
        else:  # q and k are adjacent in the fused output: rotate both in one pass
            qk = qkv[:, : heads * self.head_dim].view(tokens, heads, self.head_dim)
        v = qkv[:, heads * self.head_dim :].reshape(tokens, self.num_kv_heads, self.head_dim)
        rotary = None
        if self.attn.fuses_rotary:  # the backend rotates q and k (a decode: in its kernel)
            rotary = (cos, sin)
        else:
            qk = apply_rotary(qk, cos, sin)
        q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        return self.o_proj(self.attn(q, k, v, kv_cache, meta, rotary))


class LlamaMLP(nn.Module):
    def __init__(self, cfg: Any, flavor: Flavor) -> None:
        super().__init__()
        hidden, inner = cfg.hidden_size, cfg.intermediate_size
        self.gate_up_proj = MergedLinear(hidden, [inner, inner], bias=flavor.mlp_bias)
        self.down_proj = Linear(inner, hidden, bias=flavor.mlp_bias)
        self.act = activation(cfg.hidden_act)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor, norm: RMSNorm
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(down(act(gate) * up) of norm(x + residual), the residual stream): the norm before
        the MLP is taken here, so that a decode row can make it, gate | up and silu in one
        kernel (`norm_linear`)."""
        if self.act is F.silu:
            act, residual = norm_linear(norm, self.gate_up_proj, x, residual, silu=True)
        else:
            gate_up, residual = norm_linear(norm, self.gate_up_proj, x, residual)
            gate, up = self.gate_up_proj.split(gate_up)
            act = self.act(gate) * up
        return self.down_proj(act), residual


class LlamaDecoderLayer(nn.Module):
    def __init__(
        self, cfg: Any, layer_idx: int, flavor: Flavor, backend: AttentionBackend | None
    ) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(cfg, layer_idx, flavor, backend)
        self.mlp = LlamaMLP(cfg, flavor)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(this layer's MLP output, the residual stream before it); the next layer (or the
        final norm) adds the two. The first layer gets residual None and hidden = embeddings."""
        attn = self.self_attn
        qkv, residual = norm_linear(self.input_layernorm, attn.qkv_proj, hidden, residual)
        out = attn(qkv, cos, sin, kv_cache, meta)
        return self.mlp(out, residual, self.post_attention_layernorm)


class LlamaModel(nn.Module):
    def __init__(self, cfg: Any, flavor: Flavor, backend: AttentionBackend | None) -> None:
        super().__init__()
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(cfg, i, flavor, backend) for i in range(cfg.num_hidden_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(cfg, head_dim_of(cfg))

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        return self.run_layers(self.embed(input_ids, positions), kv_caches, meta)

    def embed(
        self, input_ids: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The layers' inputs for the tokens: (embeddings, cos, sin)."""
        hidden = self.embed_tokens(input_ids)
        return (hidden, *self.rotary_emb(positions, hidden.dtype))

    def run_layers(
        self,
        inputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """The final hidden states from `embed`'s inputs. On the CPU with native kernels a
        decode step here is only kernel calls and views (what `worker.cpu_replay` records)."""
        hidden, cos, sin = inputs
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            hidden, residual = layer(hidden, residual, cos, sin, kv_cache, meta)
        return self.norm(hidden, residual)[0]


class LlamaForCausalLM(nn.Module):
    """Causal LM over the packed tokens of one step; see `forward` and `compute_logits`."""

    packed_modules: dict[str, list[str]] = {
        "qkv_proj": ["q_proj", "k_proj", "v_proj"],
        "gate_up_proj": ["gate_proj", "up_proj"],
    }

    def __init__(self, config: Any, attn_backend: AttentionBackend | None = None) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config, self.flavor(config), attn_backend)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.lm_head = (
            None if self.tie_word_embeddings else Linear(config.hidden_size, config.vocab_size)
        )
        self.head_packed: torch.Tensor | None = None  # set by prepack_for_cpu
        self.head_native: torch.Tensor | None = None  # set by prepack_for_cpu
        self.head_quant = None  # set by model.quantize

    @classmethod
    def flavor(cls, cfg: Any) -> Flavor:
        bias = bool(getattr(cfg, "attention_bias", False))
        return Flavor(qkv_bias=bias, o_bias=bias, mlp_bias=bool(getattr(cfg, "mlp_bias", False)))

    def checkpoint_name(self, name: str) -> str | None:
        """The parameter a checkpoint tensor loads into (before unpacking), or None to skip."""
        if name.endswith("rotary_emb.inv_freq"):
            return None
        if self.tie_word_embeddings and name == "lm_head.weight":
            return None
        return name

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """input_ids/positions int64 [T], one cache per layer -> final hidden states [T, hidden]."""
        return self.model(input_ids, positions, kv_caches, attn_metadata)

    def logits_weight(self) -> torch.Tensor:
        """The [vocab, hidden] matrix that turns hidden states into logits (tied or not)."""
        return (self.model.embed_tokens if self.lm_head is None else self.lm_head).weight

    def compute_logits(self, hidden: torch.Tensor, float32: bool = True) -> torch.Tensor:
        """hidden [N, hidden] -> float32 logits [N, vocab] (`logits_linear`'s `float32`)."""
        weight = self.logits_weight()
        head = (self.head_packed, self.head_native, self.head_quant)
        return logits_linear(hidden, weight, *head, float32=float32)


class MistralForCausalLM(LlamaForCausalLM):
    @classmethod
    def flavor(cls, cfg: Any) -> Flavor:
        return Flavor()


class Qwen2ForCausalLM(LlamaForCausalLM):
    @classmethod
    def flavor(cls, cfg: Any) -> Flavor:
        return Flavor(qkv_bias=True)


class Phi3ForCausalLM(LlamaForCausalLM):
    """Phi-3 and Phi-4 (Phi3ForCausalLM): Llama's decoder; the checkpoint's fused `qkv_proj`
    and `gate_up_proj` are cut into their shards as they load, so each loads as a Llama's
    q/k/v and gate/up do (tensor-parallel sharding included)."""

    def __init__(self, config: Any, attn_backend: AttentionBackend | None = None) -> None:
        super().__init__(config, attn_backend)
        head_dim = head_dim_of(config)  # the whole model's rows (a rank cuts its own after)
        kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        q, kv = config.num_attention_heads * head_dim, kv_heads * head_dim
        inner = config.intermediate_size
        self.fused_in_checkpoint = {  # stored name -> (its shards' names, their rows)
            "qkv_proj": (self.packed_modules["qkv_proj"], [q, kv, kv]),
            "gate_up_proj": (self.packed_modules["gate_up_proj"], [inner, inner]),
        }

    @classmethod
    def flavor(cls, cfg: Any) -> Flavor:
        return Flavor()


class Qwen3ForCausalLM(LlamaForCausalLM):
    @classmethod
    def flavor(cls, cfg: Any) -> Flavor:
        return Flavor(
            qkv_bias=bool(cfg.attention_bias), o_bias=bool(cfg.attention_bias), qk_norm=True
        )
