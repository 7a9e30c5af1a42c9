"""The CPU KV cache's size without --num-blocks or --kv-cache-memory: 4 GiB, or
VLLM_CPU_KVCACHE_SPACE GiB as vLLM's CPU backend reads it; the flags win over it."""

from __future__ import annotations

import pytest

from kvflow import LLM, SamplingParams
from kvflow.worker.builder import DEFAULT_CPU_KV_CACHE_MEMORY, cpu_kv_cache_memory

# one block of the embedded model's bf16 cache: K and V, 30 layers, 16 tokens, 3 KV heads of 64
PER_BLOCK = 2 * 30 * 16 * 3 * 64 * 2


def num_blocks(llm: LLM) -> int:
    return llm.engine.config.cache.num_blocks


def test_the_env_sizes_the_pool_and_the_flags_win(monkeypatch):
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    llm = LLM(None, dtype="bfloat16")
    assert num_blocks(llm) == (1 << 30) // PER_BLOCK
    assert llm.generate("Hi", SamplingParams(max_tokens=2))[0].outputs[0].token_ids
    del llm
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "2")
    assert num_blocks(LLM(None, dtype="bfloat16", num_blocks=40)) == 40
    given = LLM(None, dtype="bfloat16", kv_cache_memory=256 << 20)
    assert num_blocks(given) == (256 << 20) // PER_BLOCK


@pytest.mark.parametrize(("value", "gib"), [("", 0), ("0", 0), ("3", 3), (" 2 ", 2)])
def test_values_as_vllm_reads_them(monkeypatch, value, gib):
    """Empty or 0: the default (vLLM's 0 is "auto")."""
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", value)
    assert cpu_kv_cache_memory() == (gib << 30 if gib else DEFAULT_CPU_KV_CACHE_MEMORY)


def test_unset_is_the_4_gib_default(monkeypatch):
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    assert cpu_kv_cache_memory() == 4 << 30


@pytest.mark.parametrize("value", ["1.5", "2G", "-1"])
def test_bad_values_are_refused_by_name(monkeypatch, value):
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", value)
    with pytest.raises(ValueError, match="VLLM_CPU_KVCACHE_SPACE"):
        LLM(None, dtype="bfloat16")
