"""RotaryEmbedding's table against the formula it replaced (transformers' cos/sin per step).

The table is built once per dtype and gathered per step; its rows must be bitwise what the
formula computes for a step's positions, for every rope type (scaled ones included) and dtype,
on the CPU and, where there is one, on the GPU.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers import LlamaConfig

from kvflow.model.layers import RotaryEmbedding

LLAMA3_1B = dict(  # Llama-3.2-1B's rope: 131072 positions, head_dim 64
    rope_type="llama3",
    rope_theta=500000.0,
    factor=32.0,
    low_freq_factor=1.0,
    high_freq_factor=4.0,
    original_max_position_embeddings=8192,
)
YARN = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=512)
CONFIGS = {
    # name: (max_position_embeddings, head_dim, rope_parameters or None)
    "default-smollm2": (8192, 64, None),
    "llama3-1b": (131072, 64, LLAMA3_1B),
    "yarn-scaled-d128": (2048, 128, YARN),  # attention_scaling != 1
}
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _rotary(config: tuple) -> RotaryEmbedding:
    positions, head_dim, rope = config
    cfg = LlamaConfig(
        hidden_size=head_dim * 4,
        num_attention_heads=4,
        max_position_embeddings=positions,
        rope_parameters=rope,
    )
    with torch.device(DEVICE):
        return RotaryEmbedding(cfg, head_dim)


def _formula(emb: RotaryEmbedding, positions: torch.Tensor, dtype: torch.dtype) -> tuple:
    """What RotaryEmbedding.forward computed per step before the table: [T, 1, D] each."""
    freqs = positions[:, None].float() * emb.inv_freq.float()[None, :]
    full = torch.cat((freqs, freqs), dim=-1)
    cos = (full.cos() * emb.attention_scaling).to(dtype)
    sin = (full.sin() * emb.attention_scaling).to(dtype)
    return cos[:, None, :], sin[:, None, :]


@pytest.fixture(scope="module", params=CONFIGS.values(), ids=CONFIGS.keys())
def rotary(request) -> RotaryEmbedding:
    return _rotary(request.param)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_table_rows_are_bitwise_the_formula(rotary, dtype) -> None:
    last = rotary.max_positions - 1
    gen = torch.Generator().manual_seed(last)
    # a decode batch, slice edges of the table build, a prefill chunk; then single tokens
    steps = [
        torch.randint(0, last + 1, (37,), generator=gen),
        torch.tensor([0, 1, 255, 256, 257, 511, 512, last - 1, last]),
        torch.arange(1000, 1000 + 300),
    ]
    steps += [torch.tensor([p]) for p in (0, 7, 256, last)]
    for positions in steps:
        positions = positions.to(DEVICE)
        cos, sin = rotary(positions, dtype)
        want_cos, want_sin = _formula(rotary, positions, dtype)
        assert cos.shape == sin.shape == want_cos.shape and cos.dtype == dtype
        assert torch.equal(cos, want_cos) and torch.equal(sin, want_sin)
    table = rotary.table(dtype)
    for start in range(0, rotary.max_positions, 512):  # every row, by prefill-sized steps
        positions = torch.arange(start, min(start + 512, rotary.max_positions), device=DEVICE)
        want = torch.cat(_formula(rotary, positions, dtype), dim=1)
        assert torch.equal(table[start : start + 512], want)


def test_one_table_per_dtype_gathered_into_views() -> None:
    """Built once per dtype (forward only gathers), cos and sin are views of one gathered
    block (one op per step), and positions past the table raise instead of reading garbage."""
    rotary = _rotary((64, 32, None))
    table = rotary.table(torch.bfloat16)
    assert table.shape == (64, 2, 32)
    cos, sin = rotary(torch.tensor([3, 0, 63], device=DEVICE), torch.bfloat16)
    assert rotary.table(torch.bfloat16) is table
    assert rotary.table(torch.float32) is not table
    assert cos.stride() == sin.stride() == (64, 32, 1)
    assert sin.data_ptr() == cos.data_ptr() + 32 * cos.element_size()
    assert torch.equal(cos[:, 0], table[[3, 0, 63], 0])
    if DEVICE == "cpu":  # on CUDA a device-side assert, which would end the test process
        with pytest.raises(IndexError):
            rotary(torch.tensor([64]), torch.bfloat16)


def test_needs_max_position_embeddings() -> None:
    with pytest.raises(ValueError, match="max_position_embeddings"):
        RotaryEmbedding(SimpleNamespace(rope_theta=10000.0), 32)
