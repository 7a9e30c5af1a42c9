"""OPT: learned absolute positions (offset 2), LayerNorm, ReLU MLP, multi-head attention.

`do_layer_norm_before` chooses pre-norm (most sizes) or post-norm (opt-350m); when
`word_embed_proj_dim != hidden_size` the embeddings are projected in and the final hidden states
projected out (`project_in` / `project_out`), and the tied LM head works in the smaller width.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from kvflow.attention import AttentionBackend, AttentionMetadata
from kvflow.model.layers import (
    Embedding,
    LayerNorm,
    Linear,
    MergedLinear,
    PagedAttention,
    activation,
    logits_linear,
)

# OPT's position table has two extra leading rows: position p reads row p + 2.
POSITION_OFFSET = 2


class OPTAttention(nn.Module):
    def __init__(self, cfg: Any, backend: AttentionBackend | None) -> None:
        super().__init__()
        hidden, heads = cfg.hidden_size, cfg.num_attention_heads
        self.head_dim = hidden // heads
        bias = bool(getattr(cfg, "enable_bias", True))
        self.qkv_proj = MergedLinear(hidden, [hidden] * 3, bias=bias)
        self.out_proj = Linear(hidden, hidden, bias=bias)
        # transformers scales q after its projection and attends with scale 1; do the same.
        self.scaling = self.head_dim**-0.5
        self.attn = PagedAttention(heads, heads, self.head_dim, scale=1.0, backend=backend)

    def forward(
        self, hidden: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        q, k, v = self.qkv_proj.split(self.qkv_proj(hidden))
        return self.out_proj(self.attn(q * self.scaling, k, v, kv_cache, meta))


class OPTDecoderLayer(nn.Module):
    def __init__(self, cfg: Any, backend: AttentionBackend | None) -> None:
        super().__init__()
        hidden, bias = cfg.hidden_size, bool(getattr(cfg, "enable_bias", True))
        affine = bool(getattr(cfg, "layer_norm_elementwise_affine", True))
        self.pre_norm = bool(cfg.do_layer_norm_before)
        self.self_attn = OPTAttention(cfg, backend)
        self.self_attn_layer_norm = LayerNorm(hidden, elementwise_affine=affine)
        self.fc1 = Linear(hidden, cfg.ffn_dim, bias=bias)
        self.fc2 = Linear(cfg.ffn_dim, hidden, bias=bias)
        self.final_layer_norm = LayerNorm(hidden, elementwise_affine=affine)
        self.act = activation(cfg.activation_function)

    def forward(
        self, hidden: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        x = self.self_attn_layer_norm(hidden) if self.pre_norm else hidden
        hidden = hidden + self.self_attn(x, kv_cache, meta)
        if not self.pre_norm:
            hidden = self.self_attn_layer_norm(hidden)
        x = self.final_layer_norm(hidden) if self.pre_norm else hidden
        hidden = hidden + self.fc2(self.act(self.fc1(x)))
        if not self.pre_norm:
            hidden = self.final_layer_norm(hidden)
        return hidden


class OPTDecoder(nn.Module):
    def __init__(self, cfg: Any, backend: AttentionBackend | None) -> None:
        super().__init__()
        hidden, embed_dim = cfg.hidden_size, cfg.word_embed_proj_dim
        self.embed_tokens = Embedding(cfg.vocab_size, embed_dim)
        self.embed_positions = Embedding(cfg.max_position_embeddings + POSITION_OFFSET, hidden)
        projected = embed_dim != hidden
        self.project_in = Linear(embed_dim, hidden) if projected else None
        self.project_out = Linear(hidden, embed_dim) if projected else None
        keep_final_norm = cfg.do_layer_norm_before and not getattr(
            cfg, "_remove_final_layer_norm", False
        )
        affine = bool(getattr(cfg, "layer_norm_elementwise_affine", True))
        self.final_layer_norm = LayerNorm(hidden, affine) if keep_final_norm else None
        self.layers = nn.ModuleList(
            OPTDecoderLayer(cfg, backend) for _ in range(cfg.num_hidden_layers)
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        if self.project_in is not None:
            hidden = self.project_in(hidden)
        hidden = hidden + self.embed_positions(positions + POSITION_OFFSET)
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            hidden = layer(hidden, kv_cache, meta)
        if self.final_layer_norm is not None:
            hidden = self.final_layer_norm(hidden)
        if self.project_out is not None:
            hidden = self.project_out(hidden)
        return hidden


class OPTModel(nn.Module):
    def __init__(self, cfg: Any, backend: AttentionBackend | None) -> None:
        super().__init__()
        self.decoder = OPTDecoder(cfg, backend)


class OPTForCausalLM(nn.Module):
    """Causal LM over the packed tokens of one step; same interface as LlamaForCausalLM."""

    packed_modules: dict[str, list[str]] = {"qkv_proj": ["q_proj", "k_proj", "v_proj"]}

    def __init__(self, config: Any, attn_backend: AttentionBackend | None = None) -> None:
        super().__init__()
        self.config = config
        self.model = OPTModel(config, attn_backend)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", True))
        self.lm_head = (
            None
            if self.tie_word_embeddings
            else Linear(config.word_embed_proj_dim, config.vocab_size)
        )
        self.head_packed: torch.Tensor | None = None  # set by prepack_for_cpu
        self.head_native: torch.Tensor | None = None  # set by prepack_for_cpu
        self.head_quant = None  # set by model.quantize

    def checkpoint_name(self, name: str) -> str | None:
        """Old OPT checkpoints omit the leading "model."; the tied head is not loaded."""
        if name == "lm_head.weight":
            return None if self.tie_word_embeddings else name
        return name if name.startswith("model.") else f"model.{name}"

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """input_ids/positions int64 [T] -> hidden states [T, word_embed_proj_dim]."""
        return self.model.decoder(input_ids, positions, kv_caches, attn_metadata)

    def logits_weight(self) -> torch.Tensor:
        """The [vocab, hidden] matrix that turns hidden states into logits (tied or not)."""
        return (self.model.decoder.embed_tokens if self.lm_head is None else self.lm_head).weight

    def compute_logits(self, hidden: torch.Tensor, float32: bool = True) -> torch.Tensor:
        """hidden [N, word_embed_proj_dim] -> float32 logits [N, vocab] (`logits_linear`'s
        `float32`)."""
        weight = self.logits_weight()
        head = (self.head_packed, self.head_native, self.head_quant)
        return logits_linear(hidden, weight, *head, float32=float32)
