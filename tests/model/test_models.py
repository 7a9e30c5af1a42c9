"""kvflow's architectures against transformers' float32 forward on tiny random checkpoints.

Each checkpoint is written with `save_pretrained` and loaded through kvflow's loader, then run
(a) on one whole prompt, (b) on three prompts packed into one forward, and (c) in pieces through
the paged cache: prefill chunks, chunks of 3 and single-token decodes of two interleaved requests
with block_size 4 and shuffled, non-contiguous block ids. Logits must match at every position.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from kvflow.attention import AttentionMetadata, token_positions
from kvflow.attention.cpu import cpu_paged_attention
from kvflow.kernels.cpu.build import native_available
from kvflow.model import linear, load_model
from kvflow.model.layers import Embedding
from kvflow.worker.kv_cache import allocate_kv_caches
from support.tiny_models import VOCAB, tiny_configs

ATOL = RTOL = 1e-4
BLOCK_SIZE = 4
ARCHS = [
    "llama3",
    "llama-tied",
    "mistral-window",
    "qwen2-tied",
    "qwen3",
    "phi3-window",
    "phi3-longrope",
    "opt",
    "opt-postnorm-proj",
]


def _randomize(model: torch.nn.Module, seed: int) -> None:
    """Weights of order-one activations, so a real mismatch cannot hide under tiny logits."""
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


@pytest.fixture(scope="module", params=ARCHS)
def checkpoint(request, tmp_path_factory) -> tuple[str, Path, torch.nn.Module]:
    arch = request.param
    config = tiny_configs()[arch]
    hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _randomize(hf, seed=ARCHS.index(arch))
    hf.eval()
    path = tmp_path_factory.mktemp(arch)
    hf.save_pretrained(path)
    return arch, path, hf


@pytest.fixture(scope="module")
def loaded(checkpoint) -> tuple[torch.nn.Module, object, torch.nn.Module]:
    _, path, hf = checkpoint
    model, hf_config = load_model(path, torch.float32)
    return model, hf_config, hf


def _hf_logits(hf: torch.nn.Module, tokens: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return hf(torch.tensor([tokens])).logits[0].float()


def _prompt(seed: int, length: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (length,), generator=gen).tolist()


def _step(
    model: torch.nn.Module,
    caches: list[torch.Tensor],
    chunks: list[tuple[list[int], int, list[int]]],
) -> list[torch.Tensor]:
    """One kvflow forward of packed chunks (tokens, num_computed_tokens, block ids) -> logits."""
    query_lens = [len(tokens) for tokens, _, _ in chunks]
    computed = [c for _, c, _ in chunks]
    meta = AttentionMetadata.build(query_lens, computed, [b for *_, b in chunks], BLOCK_SIZE, "cpu")
    input_ids = torch.tensor([t for tokens, _, _ in chunks for t in tokens])
    positions = torch.from_numpy(token_positions(query_lens, computed))
    with torch.inference_mode():
        logits = model.compute_logits(model(input_ids, positions, caches, meta))
    assert logits.dtype == torch.float32
    return list(logits.split(query_lens))


def _caches(hf_config: object, num_blocks: int = 16) -> list[torch.Tensor]:
    return allocate_kv_caches(hf_config, num_blocks, BLOCK_SIZE, torch.float32, "cpu")


def test_whole_prompt(loaded) -> None:
    model, hf_config, hf = loaded
    tokens = _prompt(1, 13)
    (logits,) = _step(model, _caches(hf_config), [(tokens, 0, [6, 2, 9, 4])])
    torch.testing.assert_close(logits, _hf_logits(hf, tokens), atol=ATOL, rtol=RTOL)


def test_packed_prompts(loaded) -> None:
    model, hf_config, hf = loaded
    prompts = [_prompt(2, 9), _prompt(3, 14), _prompt(4, 1)]
    blocks = [[5, 1, 13], [7, 3, 12, 10], [8]]
    outs = _step(
        model, _caches(hf_config), [(p, 0, b) for p, b in zip(prompts, blocks, strict=True)]
    )
    for prompt, logits in zip(prompts, outs, strict=True):
        torch.testing.assert_close(logits, _hf_logits(hf, prompt), atol=ATOL, rtol=RTOL)


# Two requests computed in pieces; each step lists (request, number of tokens) scheduled.
SCHEDULE = [
    [(0, 6), (1, 4)],  # prefill chunks
    [(0, 3), (1, 3)],  # chunks of 3
    [(1, 1), (0, 3)],  # a decode-sized chunk packed with a chunk, order swapped
    [(0, 1), (1, 1)],  # decodes (fast path)
    [(1, 1), (0, 1)],
    [(0, 1)],
]
BLOCKS = [[9, 3, 14, 7], [5, 11, 2]]  # shuffled, interleaved, never block 0


def test_chunked_through_paged_cache(loaded) -> None:
    model, hf_config, hf = loaded
    lengths = [sum(n for step in SCHEDULE for r, n in step if r == req) for req in (0, 1)]
    seqs = [_prompt(5, lengths[0]), _prompt(6, lengths[1])]
    refs = [_hf_logits(hf, seq) for seq in seqs]
    caches = _caches(hf_config)
    done = [0, 0]
    for step in SCHEDULE:
        chunks = [(seqs[r][done[r] : done[r] + n], done[r], BLOCKS[r]) for r, n in step]
        for (req, n), logits in zip(step, _step(model, caches, chunks), strict=True):
            expected = refs[req][done[req] : done[req] + n]
            torch.testing.assert_close(logits, expected, atol=ATOL, rtol=RTOL)
            done[req] += n
    assert done == lengths


def test_bf16_prepack_releases_linear_weights_and_changes_no_logit(checkpoint, monkeypatch) -> None:
    """On the CPU in bf16, a Linear holding both packings, or the native one where oneDNN has no
    bf16 packing (the native kernel then takes every row count: CPUs without AVX512-BF16),
    lets its weight go: the model answers bit for bit as one that keeps every weight, through
    prefill chunks, mixed steps and decodes (an untied head's logits included)."""
    if not native_available():
        pytest.skip("no native kernels: nothing is packed twice")
    _, path, _ = checkpoint
    kept, hf_config = load_model(path, torch.bfloat16, attn_backend=cpu_paged_attention)
    with monkeypatch.context() as patch:
        patch.setattr(linear, "_release_weight", lambda module: None)
        linear.prepack_for_cpu(kept)
    model, _ = load_model(path, torch.bfloat16, attn_backend=cpu_paged_attention)
    linear.prepack_for_cpu(model)
    linears = [m for m in model.modules() if isinstance(m, linear.Linear)]
    assert linears and all(m.weight.untyped_storage().nbytes() <= 2 for m in linears)
    assert sum(p.numel() for p in model.parameters()) < sum(p.numel() for p in kept.parameters())
    head = getattr(model, "lm_head", None)
    if head is not None:  # untied: the logits reuse the head's packing, no oneDNN one beside
        assert model.head_native is head.native and model.head_packed is None
    else:  # tied: the table's lookups read the head's packing, the table itself let go
        table, whole = (
            next(m for m in net.modules() if isinstance(m, Embedding)) for net in (model, kept)
        )
        assert table.native is model.head_native and table.weight.untyped_storage().nbytes() <= 2
        ids = torch.tensor([[0, 5], [VOCAB - 1, 33]])
        assert torch.equal(table(ids), torch.nn.functional.embedding(ids, whole.weight))
    lengths = [sum(n for step in SCHEDULE for r, n in step if r == req) for req in (0, 1)]
    seqs = [_prompt(7, lengths[0]), _prompt(8, lengths[1])]
    caches = [
        allocate_kv_caches(hf_config, 16, BLOCK_SIZE, torch.bfloat16, "cpu") for _ in range(2)
    ]
    done = [0, 0]
    for step in SCHEDULE:
        chunks = [(seqs[r][done[r] : done[r] + n], done[r], BLOCKS[r]) for r, n in step]
        ours, theirs = _step(model, caches[0], chunks), _step(kept, caches[1], chunks)
        for a, b in zip(ours, theirs, strict=True):
            assert torch.equal(a, b)
        for r, n in step:
            done[r] += n


def test_loader_rejects_incomplete_checkpoint(checkpoint, tmp_path) -> None:
    from safetensors.torch import load_file, save_file

    _, path, _ = checkpoint
    tensors = load_file(str(path / "model.safetensors"))
    dropped = next(name for name in tensors if name.endswith(("k_proj.weight", "qkv_proj.weight")))
    del tensors[dropped]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    with pytest.raises(ValueError, match="qkv_proj"):
        load_model(tmp_path, torch.float32)
