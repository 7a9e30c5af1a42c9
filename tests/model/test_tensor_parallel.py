"""Tensor parallelism against one rank: every architecture's shards on two real ranks (gloo,
separate processes) give the logits of the unsharded model, through packed prompts, prefill
chunks and decodes in the paged cache, in float32 (1e-4) and bfloat16 (bf16 rounding).

The checkpoints cover the head splits: even, KV heads replicated (1 KV head, 2 ranks), uneven
(3 KV groups on 2 ranks: 4 + 2 query heads, as the embedded SmolLM2's 9 heads), an MLP width
and a vocabulary that do not divide by two (padded vocabulary shards); one is quantized
(`--quantization int8`: every rank holds the values one device holds; the embedded GGUF's cuts
are tests/engine/test_tp_parity.py's).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    MistralConfig,
    OPTConfig,
    Phi3Config,
    Qwen2Config,
    Qwen3Config,
)

from kvflow.attention.cpu import cpu_paged_attention
from kvflow.distributed.group import TPGroup
from kvflow.model import load_model
from kvflow.model.linear import Linear
from kvflow.model.parallel_layers import RowParallelLinear, head_partition, split_evenly
from kvflow.model.quant_format import QuantizedWeight
from kvflow.model.quantize import quantize_model
from kvflow.model.registry import get_model_class
from kvflow.worker.executor import free_port
from kvflow.worker.kv_cache import allocate_kv_caches
from support.tp_ranks import BLOCK_SIZE, NUM_BLOCKS, rank_main, run_steps

COMMON = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4)
LLAMA = dict(COMMON, vocab_size=256, intermediate_size=96, num_key_value_heads=2)
LLAMA.update(max_position_embeddings=128)


def _configs() -> dict:
    rope = dict(rope_type="llama3", rope_theta=10000.0, factor=8.0, low_freq_factor=1.0)
    rope.update(high_freq_factor=4.0, original_max_position_embeddings=16)
    return {
        "llama3-bias": LlamaConfig(
            **LLAMA, rope_parameters=rope, attention_bias=True, mlp_bias=True
        ),
        "llama-tied-1kv": LlamaConfig(
            **{**LLAMA, "num_key_value_heads": 1}, tie_word_embeddings=True
        ),
        # 6 heads in 3 KV groups, MLP 97 wide, 257 tokens: nothing divides evenly by 2
        "llama-uneven": LlamaConfig(
            **{
                **LLAMA,
                "num_attention_heads": 6,
                "num_key_value_heads": 3,
                "hidden_size": 48,
                "vocab_size": 257,
                "intermediate_size": 97,
            }
        ),
        "mistral-window": MistralConfig(**LLAMA, sliding_window=6),
        "qwen2-tied": Qwen2Config(**LLAMA, tie_word_embeddings=True),
        "qwen3": Qwen3Config(**LLAMA, head_dim=32, use_sliding_window=True, sliding_window=5),
        # q | k | v and gate | up stored fused: each rank's shards cut from the fused tensors
        "phi3-fused": Phi3Config(**LLAMA, bos_token_id=1, eos_token_id=2, pad_token_id=None),
        # --quantization int8: the tied head's vocabulary shard padded, row-parallel scales
        # from whole rows (every input split a multiple of 32 columns, as int8 needs)
        "llama-int8": LlamaConfig(
            **{**LLAMA, "intermediate_size": 128, "vocab_size": 257}, tie_word_embeddings=True
        ),
        "opt": OPTConfig(**COMMON, vocab_size=256, ffn_dim=96, max_position_embeddings=64),
        "opt-postnorm-proj": OPTConfig(
            **COMMON,
            vocab_size=256,
            ffn_dim=96,
            max_position_embeddings=64,
            do_layer_norm_before=False,
            word_embed_proj_dim=32,
        ),
    }


def _randomize(model: torch.nn.Module, seed: int) -> None:
    """Order-one activations, so that a wrong shard cannot hide under tiny logits."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=gen)
            if param.ndim == 1:
                param.copy_(1.0 + 0.2 * noise if "norm" in name else 0.2 * noise)
            elif "embed" in name:
                param.copy_(noise)
            else:
                param.copy_(noise / param.shape[1] ** 0.5)


def _tokens(seed: int, n: int, vocab: int = 256) -> list[int]:
    return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


# (request, tokens, num_computed) per step: packed prompts, chunks, a mixed step, decodes
A, B = _tokens(1, 12), _tokens(2, 8)
STEPS = [
    [(0, A[:6], 0), (1, B[:5], 0)],
    [(1, B[5:8], 5), (0, A[6:9], 6)],
    [(0, A[9:10], 9), (1, [7], 8)],
    [(1, [11], 9), (0, A[10:12], 10)],
    [(0, [5], 12)],
]
BLOCK_IDS = [[9, 3, 14, 7], [5, 11, 2]]


def test_head_partition_covers_every_head_once() -> None:
    for heads, kv_heads, world in [(9, 3, 2), (8, 2, 4), (4, 1, 2), (8, 8, 3), (32, 8, 8)]:
        shards = [head_partition(heads, kv_heads, world, r) for r in range(world)]
        q = [h for s in shards for h in range(s.q_start, s.q_start + s.q_count)]
        assert q == list(range(heads))
        group = heads // kv_heads
        for s in shards:  # each query head's KV head is on its rank
            assert s.kv_start <= s.q_start // group
            assert (s.q_start + s.q_count - 1) // group < s.kv_start + s.kv_count
    assert head_partition(9, 3, 2, 0).q_count == 6 and head_partition(9, 3, 2, 1).q_count == 3
    assert [split_evenly(97, 2, r) for r in range(2)] == [(0, 49), (49, 48)]


def test_two_ranks_give_one_ranks_logits(tmp_path) -> None:
    jobs, refs, one_rank_bytes = [], {}, {}
    for i, (name, config) in enumerate(_configs().items()):
        hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        _randomize(hf, seed=i)
        path = tmp_path / name
        hf.save_pretrained(path)
        dtypes = ["float32", "bfloat16"] if name in ("llama-uneven", "opt") else ["float32"]
        method = "int8" if name.endswith("int8") else "none"
        for dtype_name in dtypes:
            dtype = getattr(torch, dtype_name)
            model, cfg = load_model(path, dtype, attn_backend=cpu_paged_attention)
            one_rank_bytes[name] = quantize_model(model, method, path)[0]
            caches = allocate_kv_caches(cfg, NUM_BLOCKS, BLOCK_SIZE, dtype, "cpu")
            refs[f"{name}/{dtype_name}"] = run_steps(model, caches, STEPS, BLOCK_IDS)
            jobs.append((f"{name}/{dtype_name}", str(path), dtype_name, method))
    out = str(tmp_path / "tp2.pt")
    mp.spawn(rank_main, args=(2, free_port(), jobs, STEPS, BLOCK_IDS, out), nprocs=2)
    got = torch.load(out)
    assert set(got) == set(refs)
    rank0_bytes, one_bytes = got["llama-int8/float32"][1][0], one_rank_bytes["llama-int8"]
    assert 0.3 * one_bytes < rank0_bytes < 0.7 * one_bytes  # its part of the int8 weights
    for key, ref_steps in refs.items():
        for step, (ours, ref) in enumerate(zip(got[key][0], ref_steps, strict=True)):
            assert ours.dtype == torch.float32 and ours.shape == ref.shape, key
            if key.endswith("float32"):
                torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4, msg=f"{key} {step}")
                continue
            # bf16: the ranks round their partial sums to bf16 before the all-reduce adds them,
            # one rounding more than one rank makes. Measured against float32, two ranks' error
            # stays of the size of one rank's.
            exact = refs[key.replace("bfloat16", "float32")][step]
            ours_err, one_rank_err = (ours - exact).abs().max(), (ref - exact).abs().max()
            assert ours_err <= 2 * one_rank_err + 1e-3, (key, step, ours_err, one_rank_err)


def test_quantized_splits_a_layer_cannot_take_are_refused_by_name() -> None:
    """A GGUF input split inside a 32-column block (96 columns at TP=2: 48 + 48) names the type,
    the columns and the TP size; `quantize_model` names the layer (int8 of 48 columns)."""
    down = RowParallelLinear.cut(Linear(96, 8), TPGroup(rank=0, world_size=2))
    half = dict(dtype=torch.float16)
    weight = QuantizedWeight(
        torch.zeros(8, 48, dtype=torch.uint8), torch.ones(8, 3, **half),
        torch.zeros(8, 3, **half), 4, 32, 96, "Q4_0",
    )  # fmt: skip
    with pytest.raises(ValueError, match=r"Q4_0 weight: columns 0\.\.48 of 96 .*_size 2 splits"):
        down.quant_part(weight, 0)
    config = LlamaConfig(**{**LLAMA, "hidden_size": 48, "num_attention_heads": 6})
    model = get_model_class("LlamaForCausalLM")(config)
    with pytest.raises(ValueError, match=r"^model\.layers\.0\.self_attn\.qkv_proj: int8 .* 48$"):
        quantize_model(model, "int8", Path("unused"))
