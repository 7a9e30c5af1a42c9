"""One schedule that exercises the engine around a decode path: tiny random checkpoints, a
small KV pool, prompts and sampling params that bring chunked prefill (a 16-token budget),
batches shrinking as requests finish, preemption and prefix-cache hits (tests/gpu's padded
decode engine, tests/worker's CPU replay)."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, PretrainedConfig

from kvflow import SamplingParams
from support.decode_steps import randomize
from support.tiny_models import word_tokenizer

VOCAB = 256
SMALL_POOL = dict(
    num_blocks=28,  # 27 x 4 = 108 servable tokens: the batch below must preempt
    block_size=4,
    max_num_seqs=8,
    max_num_batched_tokens=16,
    max_model_len=64,
)


def save_checkpoint(tmp_path_factory, config: PretrainedConfig, name: str) -> str:
    """A random checkpoint of `config` (vocab VOCAB) with a word tokenizer, in a fresh dir."""
    hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    randomize(hf, seed=5, embed_std=0.1)
    path = tmp_path_factory.mktemp(name)
    hf.save_pretrained(path)
    word_tokenizer(VOCAB).save_pretrained(path)
    return str(path)


def prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(3)
    lengths = [3, 9, 17, 5, 12, 1, 22]
    out = [torch.randint(2, VOCAB, (n,), generator=gen).tolist() for n in lengths]
    out.append(out[2][:10] + [7, 8])  # shares a prefix block run with prompt 2
    return out


def params(logprobs: int | None = None) -> list[SamplingParams]:
    """Six greedy requests of 6..16 tokens (with `logprobs`), then two seeded random ones."""
    greedy = [
        SamplingParams(temperature=0, max_tokens=6 + 2 * i, ignore_eos=True, logprobs=logprobs)
        for i in range(6)
    ]
    seeded = [
        SamplingParams(temperature=0.8, top_p=0.9, seed=7 + i, max_tokens=9, ignore_eos=True)
        for i in range(2)
    ]
    return greedy + seeded
