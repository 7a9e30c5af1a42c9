"""Building blocks shared by the architectures; each matches its transformers counterpart exactly.

Weights know how to load themselves: every parameter carries `weight_loader(param, tensor,
shard_id=None)`. Plain layers copy the checkpoint tensor; fused layers (`MergedLinear`) copy
checkpoint tensor number `shard_id` into their slice of the fused output dimension. Layers skip
random initialisation: the loader overwrites every parameter and checks that none was missed.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable, Iterator
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

from kvflow.attention import AttentionBackend, AttentionMetadata, paged_attention
from kvflow.model import cpu_kernels, quant_kernels

WeightLoader = Callable[..., None]


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


def default_weight_loader(
    param: nn.Parameter, loaded: torch.Tensor, shard_id: int | None = None
) -> None:
    """Copy a whole checkpoint tensor into `param` (shapes must match exactly)."""
    if shard_id is not None:
        raise ValueError(f"parameter of shape {tuple(param.shape)} is not fused (shard {shard_id})")
    if param.shape != loaded.shape:
        raise ValueError(
            f"shape mismatch: parameter {tuple(param.shape)}, checkpoint {tuple(loaded.shape)}"
        )
    param.data.copy_(loaded)


def _attach_loaders(module: nn.Module, loader: WeightLoader) -> None:
    for param in module.parameters(recurse=False):
        param.weight_loader = loader  # type: ignore[attr-defined]


def pack_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """oneDNN's blocked layout of a bf16 CPU weight [out, in], or None where it does not apply.

    torch's plain bf16 matmul on CPU re-lays the weight out on every call; a pre-packed weight
    skips that (measured 1.5-2.5x faster per projection, bit-identical results). The packing is
    checked against F.linear once, so a CPU or build without it silently keeps the plain path.
    """
    if weight.device.type != "cpu" or weight.dtype != torch.bfloat16:
        return None
    if not torch.backends.mkldnn.is_available():
        return None
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, 1)
        probe = torch.randn(3, weight.shape[1], dtype=weight.dtype)
        same = torch.equal(linear(probe, weight, None, packed), F.linear(probe, weight))
    except (RuntimeError, AttributeError, NotImplementedError):
        return None
    return packed if same else None


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    packed: torch.Tensor | None,
    native: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [T, in] @ weight.T (+ bias): small batches through the native kernel's packed weight
    when there is one (bound by reading the weight once), larger ones through oneDNN's
    pre-packed weight (faster once the matmul is compute-bound), one row on CUDA through
    Triton's `gemv` where it beats cuBLAS, else F.linear."""
    if native is not None and x.shape[0] <= native_linear_max_rows():
        return cpu_kernels.bf16_linear(x, native, bias, weight.shape[0])
    if packed is not None:
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    ops = _one_row_ops(x)
    if ops is not None:

        def gemv() -> torch.Tensor:
            return ops.gemv(x, weight, bias)

        if ops.gemv_wins("linear", x, weight, bias, gemv, lambda: F.linear(x, weight, bias)):
            return gemv()
    return F.linear(x, weight, bias)


def logits_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    packed: torch.Tensor | None,
    native: torch.Tensor | None,
    quant: quant_kernels.Quantized | None = None,
) -> torch.Tensor:
    """float32 logits of hidden rows x [N, hidden] by the head's weight [vocab, hidden]:
    `linear` in the model's dtype, then float32. A decode row on CUDA stores its logits in
    float32 straight from the one-row kernel where that wins, saving the conversion's kernel.
    `quant`: the head's quantized weight (`model.quantize`), which `weight` then only shapes."""
    if quant is not None:
        return quant_kernels.apply(x, quant, None).float()
    ops = _one_row_ops(x)
    if ops is not None:

        def gemv() -> torch.Tensor:
            return ops.gemv(x, weight, None, out_dtype=torch.float32)

        if ops.gemv_wins("logits", x, weight, None, gemv, lambda: F.linear(x, weight).float()):
            return gemv()
    return linear(x, weight, None, packed, native).float()


def _one_row_ops(x: torch.Tensor) -> ModuleType | None:
    """The Triton kernels for one row on CUDA (a decode step at batch 1), whose one-row
    projections (`gemv`, and `rms_norm_gemv` with the norm inside) may beat cuBLAS; else None."""
    return fused_ops(x) if x.is_cuda and x.shape[0] == 1 else None


@functools.cache
def native_linear_max_rows() -> int:
    """Up to how many rows the native kernel beats oneDNN's packed matmul on this CPU, measured
    once per process on a [1536, 576] weight (a small model's MLP): rows double from 16 while the
    native kernel stays ahead (best of 3 runs each). Always at least 8, where reading the weight
    once is what counts. Crossovers seen: 8 rows on an AVX-512 EPYC, 128 with AMX tiles, 512 on
    a Zen 5 EPYC, whose oneDNN matmul is no faster even at 2,048 (benchmarks/RESULTS.md)."""
    if not cpu_kernels.native_available():
        return 0
    weight = torch.randn(1536, 576, dtype=torch.bfloat16)
    native, packed = cpu_kernels.pack_linear_weight(weight), pack_weight(weight)
    if native is None or packed is None:
        return 0 if native is None else 1 << 30

    def best_of_3(fn: Callable[..., torch.Tensor], *args) -> float:
        times = []
        for _ in range(3):
            start = time.perf_counter()
            fn(*args)
            times.append(time.perf_counter() - start)
        return min(times)

    rows = 8
    while rows < 4096:
        x = torch.randn(2 * rows, weight.shape[1], dtype=weight.dtype)
        ours = best_of_3(cpu_kernels.bf16_linear, x, native, None, weight.shape[0])
        theirs = best_of_3(torch.ops.mkldnn._linear_pointwise, x, packed, None, "none", [], "")
        if ours > theirs:
            break
        rows *= 2
    return rows


def prepack_for_cpu(model: nn.Module) -> int:
    """Pack every Linear's weight (and the logits head's) for oneDNN and for the native kernel
    (each where it applies); returns how many weights got a oneDNN packing.

    A Linear whose weight got both packings never reads the weight again (`linear` takes one or
    the other), so it lets the weight go (`_release_weight`): three copies of every weight came
    to 0.8 GB for a 135M-parameter model. An untied logits head is such a Linear and its packings
    serve `compute_logits`; a head tied to the embedding keeps its weight for the lookups."""
    head = model.logits_weight() if hasattr(model, "logits_weight") else None
    count = 0
    if getattr(model, "head_quant", None) is not None:
        head = None  # the quantized head needs no packing
    for module in model.modules():
        if not isinstance(module, Linear) or module.quant is not None:
            continue
        module.packed = pack_weight(module.weight)
        module.native = cpu_kernels.pack_linear_weight(module.weight)
        count += module.packed is not None
        if module.weight is head:  # untied: the head's packings are this module's
            model.head_packed, model.head_native, head = module.packed, module.native, None
        if module.packed is not None and module.native is not None:
            _release_weight(module)
    if head is not None:
        model.head_packed = pack_weight(head)
        model.head_native = cpu_kernels.pack_linear_weight(head)
        count += model.head_packed is not None
    return count


def _release_weight(module: Linear) -> None:
    """Swap `module.weight` for a placeholder of the same shape and dtype that holds one element
    (a zero expanded, never read): `linear` still takes the output size from its shape."""
    weight = module.weight
    del module.weight  # the Parameter goes; a plain tensor attribute takes its name
    module.weight = weight.new_zeros(()).expand(weight.shape)


class Linear(nn.Linear):
    """nn.Linear without random init; its parameters load whole checkpoint tensors."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__(in_features, out_features, bias=bias)
        _attach_loaders(self, default_weight_loader)
        self.packed: torch.Tensor | None = None  # set by prepack_for_cpu
        self.native: torch.Tensor | None = None  # set by prepack_for_cpu
        self.quant: quant_kernels.Quantized | None = None  # set by model.quantize

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.quant is not None:
            return quant_kernels.apply(x, self.quant, self.bias)
        return linear(x, self.weight, self.bias, self.packed, self.native)

    def reset_parameters(self) -> None:
        """Left uninitialised on purpose: the loader overwrites every parameter."""


class MergedLinear(Linear):
    """Several projections of the same input fused along the output dim (q|k|v, gate|up).

    Shard i of the checkpoint fills output rows sum(output_sizes[:i]) .. + output_sizes[i].
    """

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool = False) -> None:
        super().__init__(in_features, sum(output_sizes), bias=bias)
        self.output_sizes = list(output_sizes)
        _attach_loaders(self, self._load_shard)

    def _load_shard(
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int | None = None
    ) -> None:
        if shard_id is None or not 0 <= shard_id < len(self.output_sizes):
            raise ValueError(f"fused parameter needs a shard id in 0..{len(self.output_sizes) - 1}")
        offset = sum(self.output_sizes[:shard_id])
        size = self.output_sizes[shard_id]
        default_weight_loader(param.data[offset : offset + size], loaded)  # type: ignore[arg-type]

    def split(self, out: torch.Tensor) -> list[torch.Tensor]:
        """The fused output cut back into its shards, in checkpoint order."""
        return list(out.split(self.output_sizes, dim=-1))


class Embedding(nn.Embedding):
    """nn.Embedding without random init."""

    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__(num_embeddings, embedding_dim)
        _attach_loaders(self, default_weight_loader)
        self.quant: quant_kernels.Quantized | None = None  # set by model.quantize

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.quant is not None:
            return quant_kernels.embedding(ids, self.quant, self.weight.dtype)
        return super().forward(ids)

    def reset_parameters(self) -> None:
        """Left uninitialised on purpose: the loader overwrites every parameter."""


class LayerNorm(nn.LayerNorm):
    """nn.LayerNorm whose parameters carry the default loader."""

    def __init__(self, hidden_size: int, elementwise_affine: bool = True) -> None:
        super().__init__(hidden_size, elementwise_affine=elementwise_affine)
        _attach_loaders(self, default_weight_loader)


class RMSNorm(nn.Module):
    """Root-mean-square norm computed in float32, scaled in the input dtype (as transformers)."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        _attach_loaders(self, default_weight_loader)

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


def norm_linear(
    norm: RMSNorm,
    proj: Linear,
    x: torch.Tensor,
    residual: torch.Tensor | None,
    silu: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(proj(norm(x + residual)), the residual stream x + residual); `residual` None: the first
    layer, whose stream is x. `silu`: proj is gate | up and the result silu(gate) * up. A
    decode row on CUDA makes the norm inside the projection's kernel where that beats the
    separate kernels (timed once per shape; only without PDL, see `norm_fusion_pays`)."""
    ops = _one_row_ops(x)
    contiguous = residual is None or residual.is_contiguous()
    if ops is not None and contiguous and proj.quant is None and ops.norm_fusion_pays():
        weight, bias = proj.weight, proj.bias

        def fused() -> tuple[torch.Tensor, torch.Tensor]:
            return ops.rms_norm_gemv(x, residual, norm.weight, norm.eps, weight, bias, gated=silu)

        def separate() -> torch.Tensor:  # timed without the residual (not to change it)
            return _projection(ops.rms_norm(x, norm.weight, norm.eps), proj, silu)

        if ops.gemv_wins("norm+silu" if silu else "norm", x, weight, bias, fused, separate):
            return fused()
    if residual is None:
        normed, residual = norm(x), x
    else:
        normed, residual = norm(x, residual)
    return _projection(normed, proj, silu), residual


def _projection(x: torch.Tensor, proj: Linear, silu: bool) -> torch.Tensor:
    """proj(x); `silu`: silu(gate) * up of it, for a decode row on CUDA in the projection's
    kernel (its epilogue) where that beats the projection then `silu_mul`."""
    if not silu:
        return proj(x)
    ops = _one_row_ops(x)
    if ops is not None and proj.quant is None:
        weight, bias = proj.weight, proj.bias

        def gated() -> torch.Tensor:
            return ops.gemv(x, weight, bias, gated=True)

        def separate() -> torch.Tensor:
            return ops.silu_mul(linear(x, weight, bias, None))

        if ops.gemv_wins("silu", x, weight, bias, gated, separate):
            return gated()
    return _silu_mul(proj(x))


def _silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    ops = fused_ops(gate_up)
    if ops is not None:
        return ops.silu_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


class RotaryEmbedding(nn.Module):
    """Rotary position embedding with transformers' frequencies for every rope type.

    Reads `hf_config.rope_parameters` (transformers 5) and uses
    `transformers.modeling_rope_utils.ROPE_INIT_FUNCTIONS` for scaled types (llama3, linear, yarn,
    ...). Frequencies are fixed at load time: "dynamic" and "longrope" use the frequencies
    transformers uses for sequences within the original context length.

    cos/sin come from a table of every position below max_position_embeddings (the engine's
    max_model_len never exceeds it), built once per dtype on first use, so a step gathers its
    rows in one op instead of computing them (nine small kernels, ~15 us of a CUDA decode step).
    The table holds 2 x positions x head_dim values: 32 MB in bf16 for Llama-3.2-1B (131072 x
    64), 2 MB for the embedded SmolLM2 (8192 x 64). Positions past it raise (an index error).
    """

    ROWS_PER_SLICE = 256  # positions per slice of the table build (see `table`)

    def __init__(self, hf_config: object, head_dim: int) -> None:
        super().__init__()
        with default_dtype(torch.float32):
            inv_freq, attention_scaling = _rope_frequencies(hf_config, head_dim)
        if inv_freq.numel() * 2 != head_dim:
            raise ValueError(f"partial rotary embeddings are not supported (head_dim {head_dim})")
        inv_freq = inv_freq.float().to(torch.get_default_device())
        self.register_buffer("inv_freq", inv_freq, persistent=False)
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
        freqs = positions[:, None].float() * self.inv_freq.float()[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = (emb.cos() * self.attention_scaling).to(dtype)
        sin = (emb.sin() * self.attention_scaling).to(dtype)
        return cos, sin


def _rope_frequencies(hf_config: object, head_dim: int) -> tuple[torch.Tensor, float]:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = getattr(hf_config, "rope_parameters", None) or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        base = params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
        exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
        return 1.0 / (base**exponents), 1.0
    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise ValueError(
            f"unsupported rope_type {rope_type!r}; known: {sorted(ROPE_INIT_FUNCTIONS)}"
        )
    return ROPE_INIT_FUNCTIONS[rope_type](hf_config, "cpu")


def fused_ops(*tensors: torch.Tensor) -> ModuleType | None:
    """The fused small ops (`rms_norm`, `rotary_`, `silu_mul`) for these tensors: the Triton
    kernels on CUDA, the native kernels for bf16 on the CPU; None: torch's ops."""
    if tensors[0].is_cuda:
        from kvflow.model import triton_kernels  # triton is only installed with CUDA

        return triton_kernels
    return cpu_kernels if cpu_kernels.applies(*tensors) else None


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
