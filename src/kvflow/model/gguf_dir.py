"""A `.gguf` model's directory in the kvflow cache: its config, tokenizer and generation config,
written once from the GGUF's metadata (a few MB: no weight is written); the weights stay in the
GGUF and are read in place (`gguf_file`; `loader.load_weights`, `quantize`).

The directory is keyed by the file's name, size and mtime (an edited file gets a new one) and by
`FORMAT`; one that no lookup can reach again (its GGUF gone or changed, or an older format: the
float32 conversions earlier versions wrote) is pruned. Safe under concurrent writers.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

from kvflow.paths import cache_root, locked, scratch

logger = logging.getLogger(__name__)

# 4: Phi-3's LongRoPE from the file; 3: head_dim from the file's key length; 2: metadata only,
# the weights read in place; 1: a float32 conversion
FORMAT = 4
_SOURCE = "kvflow-source.json"  # which GGUF (path, size and mtime) a directory is made from
# GGUF general.file_type -> dtype of the original weights (quantized files: assume bfloat16).
_GGUF_FILE_TYPES = {0: "float32", 1: "float16", 32: "bfloat16"}


def gguf_cache_dir(gguf_path: Path, cache_dir: str | None = None) -> Path:
    """Where `gguf_path`'s directory goes: keyed by its name, size, mtime and FORMAT."""
    key = hashlib.sha256(f"{gguf_path.name}:{_stamp(gguf_path)}:{FORMAT}".encode())
    return cache_root(cache_dir) / f"{gguf_path.stem}-{key.hexdigest()[:12]}"


def _stamp(path: Path) -> str:
    stat = path.stat()
    return f"{stat.st_size}:{stat.st_mtime_ns}"


def gguf_model_dir(gguf_path: Path, cache_dir: str | None = None) -> Path:
    """The model directory for `gguf_path`, written first on a cache miss.

    Writers serialize on a lock file, and each writes into a temp dir next to the target that
    is renamed into place only when complete, so a reader never sees a half-written directory.
    """
    target = gguf_cache_dir(gguf_path, cache_dir)
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with locked(target.with_name(target.name + ".lock")):
        if (target / "config.json").is_file():
            return target
        for stale in target.parent.glob(f".{target.name}.tmp-*"):  # a killed writer's
            shutil.rmtree(stale, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
        logger.info("writing %s's config and tokenizer into %s (once)", gguf_path.name, target)
        with scratch(tmp):
            tmp.chmod(0o755)
            _write_metadata(gguf_path, tmp)
            source = {"gguf": str(gguf_path.resolve()), "stamp": _stamp(gguf_path)}
            (tmp / _SOURCE).write_text(json.dumps({**source, "format": FORMAT}))
            os.rename(tmp, target)
    _prune_unreachable(target.parent)
    return target


def source_gguf(model_dir: Path) -> Path | None:
    """The GGUF a model directory is made from (None: not a GGUF's directory)."""
    try:
        gguf = Path(json.loads((model_dir / _SOURCE).read_text())["gguf"])
    except (OSError, ValueError, KeyError):
        return None
    return gguf if gguf.is_file() else None


def _prune_unreachable(root: Path) -> None:
    """Remove the directories no lookup can reach again: their GGUF is gone (its virtualenv
    deleted) or changed (a reinstall gives it a new mtime, hence a new key), or they are of an
    older FORMAT. Directories without a source record and those being written are left alone."""
    for entry in root.iterdir():
        record = entry / _SOURCE
        if entry.name.startswith(".") or not record.is_file():
            continue
        try:
            source = json.loads(record.read_text())
            gguf = Path(source["gguf"])
            current = source.get("format") == FORMAT
            if current and gguf.is_file() and _stamp(gguf) == source["stamp"]:
                continue  # reachable
        except (OSError, ValueError, KeyError):
            pass  # unreadable: nothing can reach it either
        lock = entry.with_name(entry.name + ".lock")
        with open(lock, "a") as handle:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                continue  # a writer holds it
            shutil.rmtree(entry, ignore_errors=True)
        lock.unlink(missing_ok=True)


def _write_metadata(gguf_path: Path, out: Path) -> None:
    """The config, tokenizer (with its chat template) and generation config from the GGUF's
    metadata, through transformers' GGUF readers: the same config and the same token ids
    transformers gives for the file, plus what transformers' reader leaves out: the heads'
    size (the key length) and the rope factors of a `rope_freqs` tensor. No other tensor is
    read."""
    import torch
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from kvflow.model.gguf_file import GgufFile

    source = dict(gguf_file=gguf_path.name, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, **source)
    tokenizer.save_pretrained(out)
    config = AutoConfig.from_pretrained(gguf_path.parent, **source)
    if hasattr(config, "quantization_config"):  # the blocks are the loader's to read
        del config.quantization_config
    name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(config.model_type)
    if name is None:
        raise ValueError(f"GGUF model type {config.model_type!r} has no causal LM class")
    config.architectures = [name]
    gguf = GgufFile(gguf_path)
    config.dtype = _GGUF_FILE_TYPES.get(gguf.metadata.get("general.file_type"), "bfloat16")
    arch = gguf.metadata.get("general.architecture")
    key_length = gguf.metadata.get(f"{arch}.attention.key_length")
    if key_length is not None:  # transformers leaves it out (Qwen3's config then says 128)
        config.head_dim = int(key_length)
    if "rope_freqs.weight" in gguf.tensors:  # Llama 3's rope scaling: transformers drops it
        config.rope_freq_factors = gguf.dequantize("rope_freqs.weight", torch.float32).tolist()
    if "rope_factors_long.weight" in gguf.tensors:  # Phi-3's LongRoPE: transformers drops it
        _longrope(config, gguf, arch)
    config.save_pretrained(out)
    GenerationConfig.from_model_config(config).save_pretrained(out)


def _longrope(config, gguf, arch: str) -> None:
    """Phi-3's LongRoPE from llama.cpp's form of it (the `rope_factors_long` and
    `rope_factors_short` tensors, the original context length and attention factor keys) into
    the config's rope parameters, as the safetensors checkpoint's config.json holds them."""
    import torch

    original = gguf.metadata.get(f"{arch}.rope.scaling.original_context_length")
    if original is None:
        raise ValueError("GGUF LongRoPE factors without rope.scaling.original_context_length")
    factors = {
        f"{which}_factor": gguf.dequantize(f"rope_factors_{which}.weight", torch.float32).tolist()
        for which in ("long", "short")
    }
    params = {**config.rope_parameters, "rope_type": "longrope", **factors}
    params["original_max_position_embeddings"] = int(original)
    attention = gguf.metadata.get(f"{arch}.rope.scaling.attn_factor")
    if attention is not None:
        params["attention_factor"] = float(attention)
    config.rope_parameters = params
    config.original_max_position_embeddings = int(original)
