"""Building blocks shared by the architectures; each matches its transformers counterpart exactly.

Weights know how to load themselves: every parameter carries `weight_loader(param, tensor,
shard_id=None)`. Plain layers copy the checkpoint tensor; fused layers (`MergedLinear`) copy
checkpoint tensor number `shard_id` into their slice of the fused output dimension. Layers skip
random initialisation: the loader overwrites every parameter and checks that none was missed.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from kvflow.attention import AttentionBackend, AttentionMetadata, paged_attention
from kvflow.kernels.cpu.linear import packed_rows
from kvflow.kernels.select import fused_ops
from kvflow.model import quant_kernels
from kvflow.model.linear import (  # noqa: F401 (re-exported for the architectures)
    Linear,
    MergedLinear,
    attach_loaders,
    default_weight_loader,
    linear,
    logits_linear,
    norm_linear,
    prepack_for_cpu,
)
from kvflow.model.quant_format import QuantizedWeight


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """Create floating-point tensors in `dtype` inside the block (restored afterwards).

    torch's default dtype is process-global: build models from one thread at a time.
    """
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


class Embedding(nn.Embedding):
    """nn.Embedding without random init."""

    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__(num_embeddings, embedding_dim)
        attach_loaders(self, default_weight_loader)
        self.quant: quant_kernels.Quantized | None = None  # set by model.quantize
        # a tied logits head's native packing, read in place of the released weight (set by
        # prepack_for_cpu)
        self.native: torch.Tensor | None = None

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.quant is not None:
            return quant_kernels.embedding(ids, self.quant, self.weight.dtype)
        if self.native is not None:
            return packed_rows(self.native, ids)
        return super().forward(ids)

    def quant_part(self, weight: QuantizedWeight, shard_id: int) -> QuantizedWeight:
        """What this table holds of a checkpoint's quantized table: all of it (a vocab-parallel
        shard's rows: `parallel_layers`)."""
        return weight

    def reset_parameters(self) -> None:
        """Left uninitialised on purpose: the loader overwrites every parameter."""


class LayerNorm(nn.LayerNorm):
    """nn.LayerNorm whose parameters carry the default loader."""

    def __init__(self, hidden_size: int, elementwise_affine: bool = True) -> None:
        super().__init__(hidden_size, elementwise_affine=elementwise_affine)
        attach_loaders(self, default_weight_loader)


class RMSNorm(nn.Module):
    """Root-mean-square norm computed in float32, scaled in the input dtype (as transformers)."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        attach_loaders(self, default_weight_loader)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """norm(x); with `residual`, (norm(x + residual), x + residual): the pre-norm residual
        stream, added and normalised in one pass (in place into `residual` on the native path).
        Normalised in float32 as transformers does, then scaled."""
        ops = fused_ops(x, self.weight)
        if ops is not None and (residual is None or residual.is_contiguous()):
            out = ops.rms_norm(x, self.weight, self.eps, residual)
            return out if residual is None else (out, residual)
        if residual is None:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        residual = x + residual
        return F.rms_norm(residual, self.weight.shape, self.weight, self.eps), residual


class RotaryEmbedding(nn.Module):
    """Rotary position embedding with transformers' frequencies for every rope type.

    Reads `hf_config.rope_parameters` (transformers 5) and uses
    `transformers.modeling_rope_utils.ROPE_INIT_FUNCTIONS` for scaled types (llama3, linear, yarn,
    ...). "dynamic" uses the frequencies transformers uses for sequences within the original
    context length. "longrope" (Phi-3) rotates positions below the original context length
    (`original_max_position_embeddings`) by the short factors and later ones by the long
    factors: what transformers' cached generation gives a sequence whose prompt fits the
    original context (its frequencies follow the longest position of each forward), and what
    vLLM gives a prompt prefilled in chunks. A prompt longer than the original context differs
    from transformers' single forward over it, which rotates all of it by the long factors.

    cos/sin come from a table of every position below max_position_embeddings (the engine's
    max_model_len never exceeds it), built once per dtype on first use, so a step gathers its
    rows in one op instead of computing them (nine small kernels, ~15 us of a CUDA decode step).
    The table holds 2 x positions x head_dim values: 32 MB in bf16 for Llama-3.2-1B (131072 x
    64), 2 MB for the embedded SmolLM2 (8192 x 64). Positions past it raise (an index error).
    """

    ROWS_PER_SLICE = 256  # positions per slice of the table build (see `table`)

    def __init__(self, hf_config: object, head_dim: int) -> None:
        super().__init__()
        with default_dtype(torch.float32), torch.device("cpu"):  # also when built on "meta"
            inv_freq, attention_scaling, long = _rope_frequencies(hf_config, head_dim)
        if inv_freq.numel() * 2 != head_dim:
            raise ValueError(f"partial rotary embeddings are not supported (head_dim {head_dim})")
        device = torch.get_default_device()
        self.register_buffer("inv_freq", inv_freq.float().to(device), persistent=False)
        # longrope: (the position the long factors start at, their frequencies)
        self.long = None if long is None else (long[0], long[1].float().to(device))
        self.attention_scaling = float(attention_scaling)
        self.max_positions = getattr(hf_config, "max_position_embeddings", None)
        if not isinstance(self.max_positions, int) or self.max_positions < 1:
            raise ValueError("rotary embeddings need the config's max_position_embeddings")
        self._tables: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}

    def forward(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin), each [T, 1, head_dim] in `dtype`, for int64 positions [T]: views of one
        gathered [T, 2, head_dim] block (rows strided; the last dim is contiguous)."""
        rows = self.table(dtype)[positions]
        return rows[:, :1], rows[:, 1:]

    def table(self, dtype: torch.dtype) -> torch.Tensor:
        """[max_positions, 2, head_dim]: cos | sin of every position in `dtype`, on inv_freq's
        device, built on first use (the eager warm-up runs before any CUDA graph capture).

        Bitwise what `rotary(positions, dtype)` gives for a step's positions. It is built in
        slices of ROWS_PER_SLICE positions, the size of a step's tensors: on the CPU torch splits
        a larger op among threads at arbitrary elements, where its scalar tail loop can round
        cos/sin differently from the vectorized body."""
        device = self.inv_freq.device
        table = self._tables.get((dtype, device))
        if table is None:
            shape = (self.max_positions, 2, self.inv_freq.numel() * 2)
            table = torch.empty(shape, dtype=dtype, device=device)
            positions = torch.arange(self.max_positions, device=device)
            for start in range(0, self.max_positions, self.ROWS_PER_SLICE):
                end = start + self.ROWS_PER_SLICE
                cos, sin = self.rotary(positions[start:end], dtype)
                table[start:end, 0], table[start:end, 1] = cos, sin
            self._tables[(dtype, device)] = table
        return table

    def rotary(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin), each [T, head_dim] in `dtype`, computed for int64 positions [T] (as
        transformers computes them): what the table holds."""
        inv_freq = self.inv_freq.float()[None, :]
        if self.long is not None:
            start, long_freq = self.long
            inv_freq = torch.where(positions[:, None] >= start, long_freq[None, :], inv_freq)
        freqs = positions[:, None].float() * inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = (emb.cos() * self.attention_scaling).to(dtype)
        sin = (emb.sin() * self.attention_scaling).to(dtype)
        return cos, sin


def _rope_frequencies(
    hf_config: object, head_dim: int
) -> tuple[torch.Tensor, float, tuple[int, torch.Tensor] | None]:
    """(inverse frequencies, cos/sin scaling, for "longrope" (the original context length, the
    long factors' frequencies) else None), as transformers computes them."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = getattr(hf_config, "rope_parameters", None) or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    partial = params.get("partial_rotary_factor", getattr(hf_config, "partial_rotary_factor", 1.0))
    if partial not in (None, 1.0):
        raise ValueError(f"partial rotary embeddings are not supported (factor {partial})")
    if rope_type == "default":
        base = params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
        exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
        inv_freq = 1.0 / (base**exponents)
        # a GGUF's `rope_freqs` tensor (llama.cpp's form of Llama 3's rope scaling: each
        # frequency divided by its factor), copied into config.json by `gguf_dir`
        factors = getattr(hf_config, "rope_freq_factors", None)
        if factors is not None:
            inv_freq = inv_freq / torch.tensor(factors, dtype=torch.float32)
        return inv_freq, 1.0, None
    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise ValueError(
            f"unsupported rope_type {rope_type!r}; known: {sorted(ROPE_INIT_FUNCTIONS)}"
        )
    init = ROPE_INIT_FUNCTIONS[rope_type]
    inv_freq, scaling = init(hf_config, "cpu")
    if rope_type != "longrope":
        return inv_freq, scaling, None
    # where transformers switches to the long factors (its `longrope_frequency_update`)
    start = getattr(hf_config, "original_max_position_embeddings", None)
    start = start or hf_config.max_position_embeddings
    long_freq, long_scaling = init(hf_config, "cpu", seq_len=start + 1)
    assert long_scaling == scaling, "transformers scales cos/sin alike for both factors"
    return inv_freq, scaling, (start, long_freq)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] rotated by position: x * cos + rotate_half(x) * sin (halves, not pairs).
    With fused ops (`fused_ops`) x is rotated in place, in one kernel instead of six ops."""
    ops = fused_ops(x, cos, sin)
    if ops is not None and x.stride(2) == 1 and x.stride(1) == x.shape[2]:
        return ops.rotary_(x, cos, sin)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class PagedAttention(nn.Module):
    """Hands q/k/v of the scheduled tokens to an attention backend with this layer's cache."""

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float,
        sliding_window: int | None = None,
        backend: AttentionBackend | None = None,
    ) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = scale
        self.sliding_window = sliding_window
        self.backend: AttentionBackend = backend or paged_attention
        # the backend rotates q and k itself (see kvflow.attention): `rotary` is passed on
        self.fuses_rotary = bool(getattr(self.backend, "fuses_rotary", False))

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        rotary: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """q [T, Hq*D] or [T, Hq, D], k/v likewise with Hkv -> [T, Hq*D]. `rotary` (cos, sin):
        q and k are not rotated yet; only for a backend that `fuses_rotary`."""
        tokens = q.shape[0]
        q = q.view(tokens, self.num_heads, self.head_dim)
        k = k.view(tokens, self.num_kv_heads, self.head_dim)
        v = v.view(tokens, self.num_kv_heads, self.head_dim)
        extra: dict = {} if self.sliding_window is None else {"sliding_window": self.sliding_window}
        if rotary is not None:
            extra["rotary"] = rotary
        out = self.backend(q, k, v, kv_cache, meta, self.scale, **extra)
        return out.reshape(tokens, self.num_heads * self.head_dim)


def activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """The transformers activation called `name` (silu, gelu, relu, ...)."""
    if name == "silu":
        return F.silu
    if name == "relu":
        return F.relu
    from transformers.activations import ACT2FN

    return ACT2FN[name]
