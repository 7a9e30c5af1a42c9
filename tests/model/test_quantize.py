"""`--quantization`: the method chosen per model and device, the flag, a GGUF's weights read in
place (named as the checkpoint, transformers' values, nothing written to the cache), and what a
quantized model holds."""

from __future__ import annotations

import argparse

import pytest
import torch

from kvflow.model import resolve_model
from kvflow.model.gguf_weights import GgufWeights
from kvflow.model.quantize import resolve_quantization
from kvflow.server.args import add_serve_arguments, engine_args_from


@pytest.fixture(scope="module")
def smollm2():
    return resolve_model(None)


def test_default_is_gguf_for_a_gguf_on_the_cpu_but_the_embedded_one(smollm2, tmp_path) -> None:
    import json

    from kvflow.model.gguf_dir import _SOURCE

    other = tmp_path / "other"  # another GGUF's directory: served as stored on the CPU
    other.mkdir()
    gguf = tmp_path / "llama-3.2-1b-q4_0.gguf"
    gguf.write_bytes(b"GGUF")
    (other / _SOURCE).write_text(json.dumps({"gguf": str(gguf), "stamp": "", "format": 2}))
    assert resolve_quantization(None, other, "cpu") == "gguf"
    assert resolve_quantization(None, other, "cpu", torch.float32) == "gguf"
    assert resolve_quantization(None, other, "cuda") == "none"
    assert resolve_quantization("none", other, "cpu") == "none"  # dequantized when asked
    assert resolve_quantization(None, smollm2, "cpu") == "none"  # the embedded: measured
    assert resolve_quantization(None, smollm2, "cpu", torch.float32) == "none"  # the reference
    assert resolve_quantization("gguf", smollm2, "cpu", torch.float32) == "gguf"
    assert resolve_quantization(None, smollm2, "cuda") == "none"
    (tmp_path / "config.json").write_text("{}")
    assert resolve_quantization(None, tmp_path, "cpu") == "none"  # a checkpoint directory
    assert resolve_quantization("int8", tmp_path, "cpu") == "int8"


@pytest.mark.parametrize(
    "method, device, message",
    [
        ("gguf", "cuda", "runs on the CPU"),
        ("int8", "cuda", "runs on the CPU"),
        ("fp8", "cpu", "runs on CUDA"),
        ("awq", "cpu", "Unknown quantization 'awq'"),
    ],
)
def test_impossible_combinations_are_refused(smollm2, method, device, message) -> None:
    with pytest.raises(ValueError, match=message):
        resolve_quantization(method, smollm2, device)


def test_gguf_needs_a_gguf(tmp_path) -> None:
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="needs a .gguf model"):
        resolve_quantization("gguf", tmp_path, "cpu")


def test_flag() -> None:
    parser = add_serve_arguments(argparse.ArgumentParser())
    assert engine_args_from(parser.parse_args([])).quantization is None
    assert engine_args_from(parser.parse_args(["-q", "int8"])).quantization == "int8"
    with pytest.raises(SystemExit):
        parser.parse_args(["--quantization", "q4"])


@pytest.fixture(scope="module")
def transformers_floats():
    """transformers' float32 dequantization of the embedded GGUF, the reference."""
    from transformers import AutoModelForCausalLM

    from kvflow.embedded_model import default_gguf_path

    gguf = default_gguf_path()
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    )
    return model.state_dict()


def test_a_gguf_writes_no_weights_to_the_cache(smollm2) -> None:
    """The model directory holds the config and tokenizer: a small fraction of the GGUF."""
    from kvflow.model.gguf_dir import source_gguf

    files = list(smollm2.iterdir())
    assert not [f for f in files if f.suffix in (".safetensors", ".sft", ".bin")]
    assert sum(f.stat().st_size for f in files) < source_gguf(smollm2).stat().st_size / 10


def test_repacked_weights_are_transformers_values(smollm2, transformers_floats) -> None:
    """Every repacked tensor dequantizes to transformers' dequantization of the same blocks,
    q/k rows included (un-interleaved); so does the float path of --quantization none."""
    weights = GgufWeights(smollm2)
    names = ["model.embed_tokens.weight", "model.layers.3.self_attn.q_proj.weight"]
    names += ["model.layers.3.self_attn.k_proj.weight", "model.layers.29.mlp.down_proj.weight"]
    kinds = set()
    for name in names:
        expected = transformers_floats[name]
        repacked = weights.quantized(name)
        kinds.add(repacked.kind)
        torch.testing.assert_close(
            repacked.dequantize(torch.float32), expected, rtol=1e-6, atol=1e-7
        )
        floats = weights.dequantized(weights.gguf_name(name), torch.float32)
        torch.testing.assert_close(floats, expected, rtol=0, atol=0)
    assert kinds == {"Q4_1", "Q8_0"}
    assert weights.quantized("model.layers.3.input_layernorm.weight") is None  # F32 in the file
