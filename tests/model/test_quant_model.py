"""Models served with quantized weights against their float32 originals, through the offline
engine (the server's engine): greedy text and the perplexity of a fixed text.

- The embedded SmolLM2 GGUF (Q4_1 projections, Q8_0 embedding and tied head) kept quantized
  (`--quantization gguf`) against the same file dequantized to float32.
- A random-weight Llama checkpoint in float32 with `--quantization int8` against itself.

Both: greedy output agrees on at least 90 % of the first 32 tokens over 10 prompts (position by
position), and the perplexity of 2,000 tokens of English (the docstrings of standard-library
modules: the same text for both models of a run) is within 2 %. The quantized models run with
float32 activations, so that what is compared is the weights: bf16 activations alone move
greedy text of this model off its float32 text within a few tokens (README, "Quantized
weights"), quantized or not; the bf16 default is checked for perplexity.
"""

from __future__ import annotations

import importlib
import math
import shutil
from pathlib import Path

import pytest
import torch

from kvflow import LLM, SamplingParams
from kvflow.model import resolve_model

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three primary colors are",
    "To make a cup of tea, first",
    "Water boils at a temperature of",
    "The largest planet in the solar system is",
    "import numpy as np\n",
    "My favourite book is",
    "Photosynthesis is the process by which",
]
TEXT_MODULES = ["argparse", "logging", "json", "functools", "subprocess", "collections", "pickle"]
TEXT_TOKENS = 2000


def fixed_text() -> str:
    return "\n\n".join(importlib.import_module(m).__doc__ or "" for m in TEXT_MODULES)


def run(model: str | None, **kwargs) -> tuple[list[list[int]], float]:
    """(greedy ids of the first 32 tokens per prompt, perplexity of the fixed text)."""
    llm = LLM(model, max_model_len=4096, **kwargs)
    greedy = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    ids = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy)]
    tokens = llm.engine.tokenizer(fixed_text())["input_ids"][:TEXT_TOKENS]
    assert len(tokens) == TEXT_TOKENS
    scoring = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    out = llm.generate([{"prompt_token_ids": tokens}], scoring)[0]
    logprobs = [out.prompt_logprobs[i][t].logprob for i, t in enumerate(tokens) if i > 0]
    del llm
    return ids, math.exp(-sum(logprobs) / len(logprobs))


def assert_agree(ours: tuple, reference: tuple) -> None:
    (ids, ppl), (ref_ids, ref_ppl) = ours, reference
    same = sum(
        a == b
        for mine, theirs in zip(ids, ref_ids, strict=True)
        for a, b in zip(mine, theirs, strict=True)
    )
    total = sum(len(r) for r in ref_ids)
    assert total == 32 * len(PROMPTS)
    print(f"greedy agreement {same}/{total}; perplexity {ppl:.4f} against {ref_ppl:.4f}")
    assert same >= 0.9 * total, f"greedy agreement {same}/{total}"
    assert abs(ppl / ref_ppl - 1) <= 0.02, f"perplexity {ppl:.3f} against {ref_ppl:.3f}"


@pytest.fixture(scope="module")
def embedded_f32() -> tuple[list[list[int]], float]:
    return run(None, quantization="none", dtype="float32")


def test_embedded_gguf_served_quantized(embedded_f32) -> None:
    assert_agree(run(None, quantization="gguf", dtype="float32"), embedded_f32)


def test_embedded_gguf_default_bf16_perplexity(embedded_f32) -> None:
    """The default (the GGUF's blocks, bf16 activations): perplexity within 2 % too."""
    _, ppl = run(None)
    print(f"bf16 default: perplexity {ppl:.4f} against {embedded_f32[1]:.4f}")
    assert abs(ppl / embedded_f32[1] - 1) <= 0.02, f"{ppl:.3f} against {embedded_f32[1]:.3f}"


@pytest.fixture(scope="module")
def random_llama(tmp_path_factory) -> Path:
    """A float32 Llama with random weights (SmolLM2's tokenizer and vocabulary): order-one
    activations, small embeddings (as benchmarks/gpu_check.py makes them: tied embeddings of
    order one make greedy text repeat its input)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    out = tmp_path_factory.mktemp("random-llama")
    config = LlamaConfig(
        vocab_size=49152,
        hidden_size=256,
        intermediate_size=640,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        dtype="float32",
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape)
            if param.ndim == 1:
                param.copy_(1.0 + 0.2 * noise)
            else:
                param.copy_(0.1 * noise if "embed" in name else noise / param.shape[1] ** 0.5)
    model.save_pretrained(out)
    source = resolve_model(None)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(source / name, out / name)
    return out


def test_int8_checkpoint(random_llama: Path) -> None:
    quantized = run(str(random_llama), quantization="int8", dtype="float32")
    reference = run(str(random_llama), quantization="none", dtype="float32")
    assert_agree(quantized, reference)
