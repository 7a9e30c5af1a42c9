"""`--quantization`: the method chosen per model and device, the flag, the repacked GGUF file
(cached once, named as the checkpoint, the values of the float conversion), and what a
quantized model holds."""

from __future__ import annotations

import argparse

import pytest
import torch

from kvflow.model import resolve_model
from kvflow.model.gguf_quant import QUANT_FILE, GgufWeights, quant_file
from kvflow.model.quantize import resolve_quantization
from kvflow.server.args import add_serve_arguments, engine_args_from


@pytest.fixture(scope="module")
def smollm2():
    return resolve_model(None)


def test_default_is_gguf_for_a_gguf_on_the_cpu_in_bf16(smollm2, tmp_path) -> None:
    assert resolve_quantization(None, smollm2, "cpu") == "none"  # opt-in: --quantization gguf
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


def test_repacked_file_is_written_once(smollm2) -> None:
    path = quant_file(smollm2)
    assert path == smollm2 / QUANT_FILE
    stamp = path.stat().st_mtime_ns
    assert quant_file(smollm2).stat().st_mtime_ns == stamp


def test_repacked_weights_are_the_conversions_values(smollm2) -> None:
    """Every repacked tensor dequantizes to the float conversion's tensor (transformers'
    dequantization of the same blocks), q/k rows included (un-interleaved)."""
    from safetensors import safe_open

    weights = GgufWeights(smollm2)
    assert set(weights.kinds.values()) == {"Q4_1", "Q8_0"}
    names = ["model.embed_tokens.weight", "model.layers.3.self_attn.q_proj.weight"]
    names += ["model.layers.3.self_attn.k_proj.weight", "model.layers.29.mlp.down_proj.weight"]
    with safe_open(str(smollm2 / "model.safetensors"), framework="pt") as floats:
        for name in names:
            expected = floats.get_tensor(name)
            got = weights.get(name).dequantize(torch.float32)
            torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-7)
