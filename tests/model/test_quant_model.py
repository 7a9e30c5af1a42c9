"""Models served with quantized weights against their float32 originals, through the offline
engine (the server's engine): greedy text and the perplexity of a fixed text.

- The embedded SmolLM2 GGUF (Q4_1 projections, Q8_0 embedding and tied head) kept quantized
  (`--quantization gguf`, bf16 activations) against the same file dequantized to float32.
- A random-weight Llama checkpoint in float32 with `--quantization int8` against itself.

Both: greedy output agrees on at least 90 % of the first 32 tokens over 10 prompts, and the
perplexity of ~2,000 tokens of English (the docstrings of standard-library modules: the same
text for both models of a run) is within 2 %.
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
    assert same >= 0.9 * total, f"greedy agreement {same}/{total}"
    assert abs(ppl / ref_ppl - 1) <= 0.02, f"perplexity {ppl:.3f} against {ref_ppl:.3f}"


def test_embedded_gguf_served_quantized() -> None:
    quantized = run(None)  # the default for a GGUF on the CPU: its blocks as stored
    reference = run(None, quantization="none", dtype="float32")
    assert_agree(quantized, reference)


@pytest.fixture(scope="module")
def random_llama(tmp_path_factory) -> Path:
    """A float32 Llama with random weights (SmolLM2's tokenizer and vocabulary)."""
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
        initializer_range=0.1,  # logits far enough apart for greedy choices to mean something
        dtype="float32",
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(out)
    source = resolve_model(None)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(source / name, out / name)
    return out


def test_int8_checkpoint(random_llama: Path) -> None:
    quantized = run(str(random_llama), quantization="int8", dtype="bfloat16")
    reference = run(str(random_llama), quantization="none", dtype="float32")
    assert_agree(quantized, reference)
