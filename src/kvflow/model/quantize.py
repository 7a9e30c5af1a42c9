"""`--quantization`: which quantized weights a loaded model computes with, and putting them in.

- `gguf` (a .gguf model on the CPU): the file's own blocks, repacked (`gguf_weights`), for every
  projection and the logits head / embedding, as stored: no value is rounded again. They go in
  before the float weights load (`loader.load_weights`), so the float weights they replace are
  never read or written: never resident.
- `int8` (any model on the CPU): int8 codes with a float32 scale per output channel, made now.
- `fp8` (CUDA): float8_e4m3fn codes with a float32 scale per output channel, made now.
- `none`: the model's dtype throughout (a GGUF dequantized to it).

The default (None) is `gguf` for a `.gguf` on the CPU and `none` for the embedded model and
every other: see README, "Quantized weights", for why.
Each quantized layer lets its float weight go (a placeholder keeps the shape), so the
resident weights are the quantized bytes plus the norms. A tensor-parallel rank's layers hold
their parts of the values one device holds (`parallel_layers`).
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from torch import nn

from kvflow.embedded_model import DEFAULT_GGUF
from kvflow.model.fp8_linear import quantize_fp8
from kvflow.model.gguf_dir import source_gguf
from kvflow.model.gguf_weights import GgufWeights
from kvflow.model.layers import Embedding
from kvflow.model.linear import Linear, _release_weight
from kvflow.model.quant_format import QuantizedWeight, quantize_int8
from kvflow.model.quant_kernels import Quantized

logger = logging.getLogger(__name__)

METHODS = ("gguf", "int8", "fp8", "none")


def resolve_quantization(
    requested: str | None, path: Path, device: str, dtype: torch.dtype = torch.bfloat16
) -> str:
    """The method to load `path` with on `device` in `dtype`: `requested`, checked, or the
    default: a `.gguf` on the CPU is served as stored (`gguf`: its dequantized copy is 3-8x the
    file, the size a user picked the file to avoid), except the embedded model, whose measured
    default is `none` (README, "Quantized weights"); every other model `none`. ValueError
    naming the flag when the combination cannot run."""
    on_cuda = str(device).startswith("cuda")
    source = source_gguf(path)
    is_gguf = source is not None
    if requested is None:
        embedded = is_gguf and source.name == Path(DEFAULT_GGUF).name
        return "gguf" if is_gguf and not embedded and not on_cuda else "none"
    if requested not in METHODS:
        raise ValueError(f"Unknown quantization {requested!r}; choose one of {', '.join(METHODS)}.")
    if requested == "gguf" and not is_gguf:
        raise ValueError("--quantization gguf needs a .gguf model (or the embedded default).")
    if requested in ("gguf", "int8") and on_cuda:
        raise ValueError(f"--quantization {requested} runs on the CPU; on CUDA use fp8 or none.")
    if requested == "fp8" and not on_cuda:
        raise ValueError("--quantization fp8 runs on CUDA; on the CPU use int8 or gguf.")
    return requested


def quantize_model(model: nn.Module, method: str, path: Path) -> tuple[int, int]:
    """Put `method`'s weights into `model` (loaded from `path`; a tensor-parallel shard takes
    its layers' parts: `quant_part`, `row_absmax`); returns (quantized weights' bytes, the
    bytes the weights they replace held). ValueError naming the layer when one cannot be."""
    if method == "none":
        return 0, 0
    stored = GgufWeights(path) if method == "gguf" else None
    packed: dict[str, list[str]] = getattr(model, "packed_modules", {})
    fused = getattr(model, "fused_in_checkpoint", {})
    head = model.logits_weight() if hasattr(model, "logits_weight") else None
    new = old = 0
    for name, module in model.named_modules():
        if not isinstance(module, Linear | Embedding):
            continue
        try:
            if stored is not None:
                weight = _stored_weight(name, module, stored, packed, fused)
            elif isinstance(module, Linear) or module.weight is head:  # lookups: nothing to gain
                weight = _made_now(module, method)
            else:
                weight = None
        except ValueError as e:
            raise ValueError(f"{name}: {e}") from None
        if weight is None:
            continue
        new += weight.nbytes
        old += module.weight.numel() * module.weight.element_size()
        module.quant = weight
        if module.weight is head:
            model.head_quant = weight
    for module in model.modules():
        if isinstance(module, Linear | Embedding) and module.quant is not None:
            _release_weight(module)
    return new, old


def _made_now(module: Linear | Embedding, method: str) -> Quantized:
    """int8 or fp8 codes of the layer's weight, each row scaled by the max of the whole row
    (a row-parallel shard's `row_absmax`: every rank's values are the unsplit weight's)."""
    row_max = module.row_absmax() if isinstance(module, Linear) else None  # rows whole
    return (quantize_int8 if method == "int8" else quantize_fp8)(module.weight, row_max)


def _stored_weight(
    name: str,
    module: Linear | Embedding,
    stored: GgufWeights,
    packed: dict[str, list[str]],
    fused: dict[str, tuple[list[str], list[int]]],
) -> QuantizedWeight | None:
    """A layer's part of its weight from the file, its shards stacked (None: a float tensor in
    the file, which the layer keeps in the model's dtype). A file that stores the shards fused
    (Phi-3's attn_qkv: the model's `fused_in_checkpoint`) gives them as row ranges of it."""
    leaf = name.rsplit(".", 1)[-1]
    prefix = name[: len(name) - len(leaf)]
    if isinstance(module, Linear) and leaf in fused:
        whole = stored.quantized(f"{prefix}{leaf}.weight")
        if whole is None:
            return None
        starts = [sum(fused[leaf][1][:i]) for i in range(len(fused[leaf][1]))]
        parts = [whole.row_range(s, n) for s, n in zip(starts, fused[leaf][1], strict=True)]
    else:
        shards = packed.get(leaf, [leaf]) if isinstance(module, Linear) else [leaf]
        parts = [stored.quantized(f"{prefix}{shard}.weight") for shard in shards]
        if any(p is None for p in parts):
            return None
    parts = [module.quant_part(part, shard_id) for shard_id, part in enumerate(parts)]
    return parts[0] if len(parts) == 1 else QuantizedWeight.cat(parts)


def describe(method: str, new: int, old: int, dtype: torch.dtype) -> str:
    """The start-up line: method and the weights' bytes."""
    if method == "none":
        return f"quantization: none (weights in {str(dtype).removeprefix('torch.')})"
    return (
        f"quantization: {method}; quantized weights {new / 2**20:.1f} MiB in place of "
        f"{old / 2**20:.1f} MiB in {str(dtype).removeprefix('torch.')}"
    )
