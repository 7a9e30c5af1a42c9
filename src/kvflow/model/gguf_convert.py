"""GGUF -> safetensors: a `.gguf` file converted once into the kvflow cache (dequantized float32
safetensors, config, tokenizer), safe under concurrent converters."""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import struct
import tempfile
from pathlib import Path
from typing import Any

import torch

from kvflow.memory_fit import CONVERSION_BYTES_PER_WEIGHT, check_fits
from kvflow.paths import cache_root, locked, scratch

# GGUF general.file_type -> dtype of the original weights (quantized files: assume bfloat16).
_GGUF_FILE_TYPES = {0: "float32", 1: "float16", 32: "bfloat16"}


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
    with locked(target.with_name(target.name + ".lock")):
        if (target / "config.json").is_file():
            return target
        for stale in target.parent.glob(f".{target.name}.tmp-*"):  # a killed converter's
            shutil.rmtree(stale, ignore_errors=True)
        try:
            weights = gguf_elements(gguf_path) * CONVERSION_BYTES_PER_WEIGHT
        except (OSError, ValueError, struct.error):  # transformers' reader names what is wrong
            weights = 0
        check_fits(
            f"Converting {gguf_path.name} to float32 safetensors (once; kvflow does not yet "
            "read a GGUF in place)",
            {"the float32 model and its dequantized source": weights},
            "Serve a smaller GGUF, or give the process more memory.",
        )
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
    deleted) or changed (a reinstall gives it a new mtime, hence a new key), so reinstalls do not
    pile up 0.5 GB conversions of the default model. Directories without a source record and
    those being converted are left alone."""
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


def gguf_elements(gguf_path: Path) -> int:
    """The number of weight elements in a GGUF file, from its tensor infos alone (after the
    key/value header, per tensor: u64-length name, u32 dims, u64 per dim, u32 type, u64
    offset): no tensor data is read."""
    with open(gguf_path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise ValueError(f"{gguf_path} is not a GGUF file")
        _version, tensor_count, kv_count = struct.unpack("<IQQ", f.read(20))
        for _ in range(kv_count):
            f.seek(struct.unpack("<Q", f.read(8))[0], os.SEEK_CUR)
            _skip_gguf_value(f, struct.unpack("<I", f.read(4))[0])
        total = 0
        for _ in range(tensor_count):
            f.seek(struct.unpack("<Q", f.read(8))[0], os.SEEK_CUR)
            (n_dims,) = struct.unpack("<I", f.read(4))
            count = 1
            for dim in struct.unpack(f"<{n_dims}Q", f.read(8 * n_dims)):
                count *= dim
            total += count
            f.seek(12, os.SEEK_CUR)  # type, offset
    return total


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
