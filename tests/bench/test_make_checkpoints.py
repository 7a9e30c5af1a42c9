"""`benchmarks/make_checkpoints.py` at its tiny shape: the GGUFs read back with llama.cpp's
names, types, shapes and keys; the bytes per token it prints are the file's; the values do not
depend on the format; the GGUF and the bf16 safetensors both serve through the offline engine,
and the padded tokenizer encodes text as the embedded one does."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest

from kvflow import LLM, SamplingParams
from kvflow.model import load_tokenizer, resolve_model

ROOT = Path(__file__).resolve().parents[2]
VOCAB = 49152 + 128  # the tiny shape: the embedded vocabulary plus 128 reserved tokens
GGUF_FORMATS = ("gguf-q4_0", "gguf-q8_0")
TEXTS = ["The capital of France is", "def f(x):\n    return x * 2", "héllo wörld 123 !!"]


def _make(fmt: str, out: Path) -> str:
    cmd = [sys.executable, str(ROOT / "benchmarks" / "make_checkpoints.py"), "--shape", "tiny"]
    cmd += ["--format", fmt, "--out", str(out), "--seed", "7"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


@pytest.fixture(scope="module")
def made(tmp_path_factory) -> dict[str, tuple[Path, str]]:
    """Each format's output path and the script's report."""
    root = tmp_path_factory.mktemp("shapes")
    outs = {fmt: root / f"tiny-{fmt}.gguf" for fmt in GGUF_FORMATS}
    outs["safetensors-bf16"] = root / "tiny-bf16"
    return {fmt: (out, _make(fmt, out)) for fmt, out in outs.items()}


def _reported_bytes_per_token(report: str) -> int:
    return int(re.search(r"bytes per token\s+([\d,]+)", report).group(1).replace(",", ""))


@pytest.mark.parametrize("fmt", GGUF_FORMATS)
def test_gguf_tensors_and_metadata(made, fmt) -> None:
    path, report = made[fmt]
    reader = gguf.GGUFReader(path)
    tensors = {t.name: t for t in reader.tensors}
    weights = (
        gguf.GGMLQuantizationType.Q4_0 if fmt == "gguf-q4_0" else gguf.GGMLQuantizationType.Q8_0
    )
    # ggml order: columns first
    assert [int(d) for d in tensors["token_embd.weight"].shape] == [64, VOCAB]
    assert [int(d) for d in tensors["blk.1.ffn_down.weight"].shape] == [128, 64]
    assert [int(d) for d in tensors["blk.0.attn_k.weight"].shape] == [64, 32]
    assert tensors["blk.1.ffn_down.weight"].tensor_type == weights
    assert tensors["token_embd.weight"].tensor_type == weights
    assert tensors["output.weight"].tensor_type == gguf.GGMLQuantizationType.Q8_0
    assert tensors["output_norm.weight"].tensor_type == gguf.GGMLQuantizationType.F32
    assert len(tensors) == 2 + 2 * 9 + 2  # embedding, rope factors, 2 blocks, norm, head

    fields = reader.fields
    assert fields["general.architecture"].contents() == "llama"
    assert fields["llama.block_count"].contents() == 2
    assert fields["llama.attention.head_count_kv"].contents() == 2
    assert fields["llama.vocab_size"].contents() == VOCAB
    tokens = fields["tokenizer.ggml.tokens"].contents()
    assert len(tokens) == VOCAB and tokens[-1] == "<|reserved_127|>"
    assert len(fields["tokenizer.ggml.token_type"].contents()) == VOCAB
    assert fields["tokenizer.ggml.eos_token_id"].contents() == 2
    assert "<|im_start|>" in fields["tokenizer.chat_template"].contents()

    # every weight once, the untied embedding as one row, no rope factors
    total = sum(int(t.n_bytes) for t in reader.tensors if t.name != "rope_freqs.weight")
    embedding = int(tensors["token_embd.weight"].n_bytes)
    assert _reported_bytes_per_token(report) == total - embedding + embedding // VOCAB


def test_values_are_the_same_in_every_format(made) -> None:
    """A tensor's values come from the seed and its index, not from the format."""
    from safetensors.torch import load_file

    def gguf_values(fmt: str, name: str) -> np.ndarray:
        tensor = next(t for t in gguf.GGUFReader(made[fmt][0]).tensors if t.name == name)
        return gguf.quants.dequantize(tensor.data, tensor.tensor_type)

    q8 = gguf_values("gguf-q8_0", "blk.0.attn_q.weight")
    q4 = gguf_values("gguf-q4_0", "blk.0.attn_q.weight")
    shard = made["safetensors-bf16"][0] / "model-00001-of-00001.safetensors"
    bf16 = load_file(shard)["model.layers.0.self_attn.q_proj.weight"].float().numpy()
    assert 0.018 < q8.std() < 0.022
    assert np.abs(q8 - bf16).max() < 2e-3
    assert np.abs(q4 - bf16).max() < 0.02  # 4-bit steps of (max |w| / 8) per 32 values
    assert (gguf_values("gguf-q8_0", "blk.0.ffn_norm.weight") == 1).all()


def _four_tokens(model: Path) -> list[int]:
    llm = LLM(str(model), num_blocks=16, max_model_len=64)
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    return list(llm.generate([TEXTS[0]], params)[0].outputs[0].token_ids)


def test_gguf_serves_in_place(made, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("KVFLOW_CACHE", str(tmp_path / "cache"))  # not the user's cache
    ids = _four_tokens(made["gguf-q4_0"][0])
    assert len(ids) == 4 and all(0 <= i < VOCAB for i in ids)


def test_safetensors_serve_and_tokenize_as_the_embedded_model(made) -> None:
    path = made["safetensors-bf16"][0]
    config = json.loads((path / "config.json").read_text())
    assert config["vocab_size"] == VOCAB and config["rope_scaling"]["rope_type"] == "llama3"
    index = json.loads((path / "model.safetensors.index.json").read_text())
    assert "lm_head.weight" in index["weight_map"] and len(index["weight_map"]) == 2 + 2 * 9 + 1

    ids = _four_tokens(path)
    assert len(ids) == 4 and all(0 <= i < VOCAB for i in ids)

    padded, embedded = load_tokenizer(path), load_tokenizer(resolve_model(None))
    assert len(padded) == VOCAB
    for text in TEXTS:
        assert padded.encode(text) == embedded.encode(text)
    assert padded.decode([VOCAB - 1]) == "<|reserved_127|>"
