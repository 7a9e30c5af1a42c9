"""The builder's GPU decisions, checked on the CPU: the attention backend per device, and KV
sizing from a profiled step (torch.cuda's memory counters replaced by fixed numbers)."""

from __future__ import annotations

import types

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from kvflow.attention.cpu import cpu_paged_attention
from kvflow.engine.llm_engine import EngineArgs
from kvflow.model import load_model
from kvflow.worker import builder

GIB = 1 << 30


def test_backend_per_device() -> None:
    assert builder.attention_backend("cpu") is cpu_paged_attention
    pytest.importorskip("triton")
    from kvflow.attention.triton_attn import triton_paged_attention

    assert builder.attention_backend("cuda") is triton_paged_attention
    assert builder.attention_backend("cuda:0") is triton_paged_attention


def test_only_utilization_sizing_profiles() -> None:
    assert builder.needs_profile(EngineArgs(), "cuda")
    assert not builder.needs_profile(EngineArgs(num_blocks=8), "cuda")
    assert not builder.needs_profile(EngineArgs(kv_cache_memory=GIB), "cuda")
    assert not builder.needs_profile(EngineArgs(), "cpu")


@pytest.fixture()
def fake_cuda_memory(monkeypatch):
    """torch.cuda's counters as a device with 80 GiB, 60 GiB free, 15 GiB reserved by torch,
    a 10 GiB peak: 5 GiB are outside torch's allocator."""
    fake = types.SimpleNamespace(
        synchronize=lambda *a: None,
        empty_cache=lambda: None,
        reset_peak_memory_stats=lambda *a: None,
        max_memory_allocated=lambda *a: 10 * GIB,
        memory_reserved=lambda *a: 15 * GIB,
        mem_get_info=lambda *a: (60 * GIB, 80 * GIB),
    )
    for name, value in vars(fake).items():
        monkeypatch.setattr(torch.cuda, name, value)


def test_profile_step_and_kv_budget(tmp_path, fake_cuda_memory) -> None:
    config = LlamaConfig(
        vocab_size=128,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=48,
        max_position_embeddings=256,
    )
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    model, hf_config = load_model(tmp_path, torch.float32)
    # 40 tokens over at most 16 requests (2 or 3 tokens each), block size 4: 16 blocks + null
    step = builder.profile_step(model, hf_config, 40, 16, 4, torch.float32)
    cache_bytes = 2 * 2 * (16 * 1 + 1) * 4 * 2 * 8 * 4  # layers, K/V, blocks, size, heads, dim
    assert step == 10 * GIB - cache_bytes + 5 * GIB
    args = EngineArgs(gpu_memory_utilization=0.5, block_size=4)
    per_block = builder.kv_bytes_per_block(hf_config, 4, torch.float32)
    blocks = builder.resolve_num_blocks(args, hf_config, torch.float32, "cuda", step)
    assert blocks == (40 * GIB - step) // per_block


def test_default_token_budget_per_device_and_card() -> None:
    """--max-num-batched-tokens unset: 2048 on the CPU (served and offline); on CUDA vLLM's
    defaults by card memory and usage (offline `LLM` or a server), an A100 held back."""
    assert builder.default_max_num_batched_tokens("cpu", offline=True) == 2048
    assert builder.default_max_num_batched_tokens("cpu", offline=False) == 2048
    card = builder.batched_tokens_for_card
    assert (card(139 * GIB, "NVIDIA H200", True), card(139 * GIB, "NVIDIA H200", False)) == (
        16384,
        8192,
    )
    assert card(80 * GIB, "NVIDIA H100 80GB HBM3", False) == 8192
    assert (card(80 * GIB, "NVIDIA A100-SXM4-80GB", True), card(80 * GIB, "A100", False)) == (
        8192,
        2048,
    )
    assert card(24 * GIB, "NVIDIA L4", False) == 2048
    assert card(180 * GIB, "NVIDIA B200", False) == 16384


def test_llm_is_offline_and_a_server_is_not(monkeypatch) -> None:
    """The usage context that picks the default: `LLM` marks its engine args offline; the
    server's flags leave them served (the engine itself is not built here)."""
    import argparse

    from kvflow import LLM
    from kvflow.engine.llm_engine import LLMEngine
    from kvflow.server.args import add_serve_arguments, engine_args_from

    seen: list[EngineArgs] = []
    monkeypatch.setattr(LLMEngine, "from_args", classmethod(lambda cls, args: seen.append(args)))
    LLM(None, max_num_seqs=4)
    assert seen[0].offline and seen[0].max_num_seqs == 4
    parser = add_serve_arguments(argparse.ArgumentParser())
    assert not engine_args_from(parser.parse_args([])).offline
