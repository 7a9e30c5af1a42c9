"""Models served with quantized weights against their float32 originals, through the offline
engine (the server's engine): greedy text and the perplexity of a fixed text.

- The embedded SmolLM2 GGUF (Q4_1 projections, Q8_0 embedding and tied head) kept quantized
  (`--quantization gguf`) against the same file dequantized to float32.
- A random-weight Llama checkpoint in float32 with `--quantization int8` against itself.

Both: greedy output agrees on at least 90 % of the first 32 tokens over 10 prompts (each token
given the reference's prefix: `assert_agree`), and the perplexity of 2,000 tokens of English
(the docstrings of standard-library modules: the same text for both models of a run) is within
2 %. The embedded model runs with `--quantization gguf` (bf16 activations); the int8 checkpoint with
float32 activations. (The embedded model quantized with float32 activations matches its
float32 dequantized model at 320 of 320 tokens, same perplexity: benchmarks/RESULTS.md.)
"""

from __future__ import annotations

import gc
import importlib
import math
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch

from kvflow import LLM, SamplingParams
from kvflow.model import quant_kernels, resolve_model
from kvflow.model.quant_format import from_gguf_blocks

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
TEXT_MODULES += ["re", "csv", "turtle"]
# 4,096 tokens scored in windows of 512, as llama.cpp's perplexity tool scores: with int8
# activations a rounding-level change upstream (attention scores scaled by 1 + 2^-20) moved one
# unbroken 2,000-token text's perplexity ratio between +1.04 and +2.19 % (its first tokens' K/V
# weigh on every later token), eight windows between +1.25 and +1.80 % (benchmarks/RESULTS.md).
TEXT_TOKENS = 4096
WINDOW = 512


def fixed_text() -> str:
    return "\n\n".join(importlib.import_module(m).__doc__ or "" for m in TEXT_MODULES)


@dataclass
class Run:
    prompts: list[list[int]]  # the prompts' token ids
    greedy: list[list[int]]  # the first 32 greedy tokens of each
    forced: list[list[int]] | None  # greedy choices along another run's tokens (teacher-forced)
    perplexity: float


def run(model: str | None, reference: Run | None = None, **kwargs) -> Run:
    """Greedy text of PROMPTS, the greedy choice at each of `reference`'s tokens given its
    prefix, and the perplexity of the fixed text."""
    llm = LLM(model, max_model_len=4096, num_blocks=4096 // 16 + 8, **kwargs)
    greedy = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    outs = llm.generate(PROMPTS, greedy)
    forced = None
    if reference is not None:
        seqs = [p + g for p, g in zip(reference.prompts, reference.greedy, strict=True)]
        top1 = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1)
        scored = llm.generate([{"prompt_token_ids": seq} for seq in seqs], top1)
        forced = [
            [
                next(t for t, lp in o.prompt_logprobs[i].items() if lp.rank == 1)
                for i in range(n, n + 32)
            ]
            for o, n in zip(scored, (len(p) for p in reference.prompts), strict=True)
        ]
    tokens = llm.engine.tokenizer(fixed_text())["input_ids"][:TEXT_TOKENS]
    assert len(tokens) == TEXT_TOKENS
    windows = [tokens[i : i + WINDOW] for i in range(0, TEXT_TOKENS, WINDOW)]
    scoring = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    scored = llm.generate([{"prompt_token_ids": w} for w in windows], scoring)
    logprobs = [
        o.prompt_logprobs[i][t].logprob
        for o, w in zip(scored, windows, strict=True)
        for i, t in enumerate(w)
        if i > 0
    ]
    del llm
    gc.collect()
    prompts = [list(o.prompt_token_ids) for o in outs]
    ids = [list(o.outputs[0].token_ids) for o in outs]
    return Run(prompts, ids, forced, math.exp(-sum(logprobs) / len(logprobs)))


def matches(a: list[list[int]], b: list[list[int]]) -> int:
    return sum(x == y for p, q in zip(a, b, strict=True) for x, y in zip(p, q, strict=True))


def assert_agree(ours: Run, reference: Run) -> None:
    """Teacher-forced: at >= 90 % of the reference's 320 greedy tokens, given the reference's
    prefix, the quantized model's greedy choice is the same token (a free-running comparison
    counts every token after a first difference, where the two texts are no longer about the
    same prefix; it is printed too)."""
    total = 32 * len(PROMPTS)
    assert ours.forced is not None and sum(map(len, reference.greedy)) == total
    forced, free = matches(ours.forced, reference.greedy), matches(ours.greedy, reference.greedy)
    ppl, ref_ppl = ours.perplexity, reference.perplexity
    print(f"greedy: {forced}/{total} teacher-forced, {free}/{total} free-running; "
          f"perplexity {ppl:.4f} against {ref_ppl:.4f}")  # fmt: skip
    assert forced >= 0.9 * total, f"greedy agreement {forced}/{total}"
    assert abs(ppl / ref_ppl - 1) <= 0.02, f"perplexity {ppl:.3f} against {ref_ppl:.3f}"


@pytest.fixture(scope="module")
def embedded_f32() -> Run:
    return run(None, quantization="none", dtype="float32")


@pytest.mark.parametrize("route", ["amx", "gemm", "vnni"])
def test_embedded_gguf_served_quantized(embedded_f32: Run, route: str) -> None:
    """`--quantization gguf`: the GGUF's blocks as stored, bf16 activations, steps of at most
    AMX_ROWS[4] tokens (AMX-INT8's rows where it runs), 4 x AMX_ROWS[4] (AMX-BF16's, for the
    prompts) or VNNI_ROWS[4] (the VNNI kernel's, as a lone request's decode steps take): every
    prompt row through that kernel, not the dequantized layers a long prompt takes."""
    chunk = {"amx": quant_kernels.AMX_ROWS[4], "gemm": 4 * quant_kernels.AMX_ROWS[4]}.get(
        route, quant_kernels.VNNI_ROWS[4]
    )
    weight = from_gguf_blocks(np.zeros((1, 20 * 2), np.uint8), "Q4_1", 64)
    if quant_kernels.route(chunk, weight, torch.bfloat16) != route:
        pytest.skip(f"{chunk} rows of 4-bit codes do not take {route} on this CPU")
    ours = run(None, embedded_f32, quantization="gguf", max_num_batched_tokens=chunk)
    assert_agree(ours, embedded_f32)


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
    reference = run(str(random_llama), quantization="none", dtype="float32")
    assert_agree(run(str(random_llama), reference, quantization="int8", dtype="float32"), reference)
