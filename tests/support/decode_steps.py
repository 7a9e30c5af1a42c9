"""Decode steps of tiny random models through DecodeGraphs' padded path and through the plain
forward, compared (tests/gpu): the models, the requests' blocks, one checked step."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, MistralConfig, Qwen3Config

from kvflow.attention import AttentionMetadata
from kvflow.worker.cuda_graphs import DecodeGraphs, pack_inputs
from kvflow.worker.kv_cache import allocate_kv_caches

VOCAB = 256
BLOCK_SIZE = 4
NUM_BLOCKS = 96
MAX_MODEL_LEN = 64
LLAMA_LIKE = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=96,
    num_key_value_heads=2,
    max_position_embeddings=128,
)


def graph_config(arch: str):
    if arch == "llama3":
        rope = dict(
            rope_type="llama3",
            rope_theta=10000.0,
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=16,
        )
        return LlamaConfig(**LLAMA_LIKE, rope_parameters=rope, tie_word_embeddings=True)
    if arch == "llama-mqa":
        return LlamaConfig(**{**LLAMA_LIKE, "num_key_value_heads": 1}, attention_bias=True)
    if arch == "mistral-window":
        return MistralConfig(**LLAMA_LIKE, sliding_window=6)
    # explicit head_dim and a sliding-window second layer
    return Qwen3Config(
        **LLAMA_LIKE, head_dim=32, use_sliding_window=True, sliding_window=5, max_window_layers=1
    )


def randomize(model: torch.nn.Module, seed: int, embed_std: float = 1.0) -> None:
    """Order-one activations (as tests/model/test_models.py), so differences cannot hide.
    A small `embed_std` keeps tied embeddings from making greedy output repeat its input."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=gen)
            if param.ndim == 1:
                param.copy_(1.0 + 0.2 * noise if "norm" in name else 0.2 * noise)
            elif "embed" in name:
                param.copy_(embed_std * noise)
            else:
                param.copy_(noise / param.shape[1] ** 0.5)


class Batch:
    """Requests with shuffled blocks (never block 0), prefilled through the plain forward."""

    def __init__(
        self, model, hf_config, prompt_lens: list[int], seed: int, device: str = "cpu"
    ) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.model, self.device = model, device
        dtype = next(model.parameters()).dtype
        self.caches = allocate_kv_caches(hf_config, NUM_BLOCKS, BLOCK_SIZE, dtype, device)
        for cache in self.caches:  # stale garbage everywhere a request has not written
            cache.copy_(torch.randn(cache.shape, generator=gen))
        pool = (torch.randperm(NUM_BLOCKS - 1, generator=gen) + 1).tolist()
        self.blocks, self.tokens = [], []
        for n in prompt_lens:
            count = -(-(n + 4) // BLOCK_SIZE)  # room for 4 decode steps
            self.blocks.append(pool[:count])
            pool = pool[count:]
            self.tokens.append(torch.randint(0, VOCAB, (n,), generator=gen).tolist())
        self.gen = gen
        chunks = [(t, 0, b) for t, b in zip(self.tokens, self.blocks, strict=True)]
        plain_forward(model, self.caches, chunks)

    def decode_inputs(self, rows: list[int]) -> tuple[list[int], list[int], list[list[int]]]:
        """A new random token for each of `rows`; (ids, positions, block ids)."""
        ids = torch.randint(0, VOCAB, (len(rows),), generator=self.gen).tolist()
        positions = [len(self.tokens[r]) for r in rows]
        for r, t in zip(rows, ids, strict=True):
            self.tokens[r].append(t)
        return ids, positions, [self.blocks[r] for r in rows]


def plain_forward(model, caches, chunks) -> torch.Tensor:
    """The runner's eager path: one forward of (tokens, num_computed, block ids) chunks."""
    device = caches[0].device
    query_lens = [len(tokens) for tokens, _, _ in chunks]
    computed = [c for _, c, _ in chunks]
    meta = AttentionMetadata.build(
        query_lens, computed, [b for *_, b in chunks], BLOCK_SIZE, device
    )
    ids = torch.tensor([t for tokens, _, _ in chunks for t in tokens], device=device)
    positions = [c + i for tokens, c, _ in chunks for i in range(len(tokens))]
    positions = torch.tensor(positions, device=device)
    with torch.inference_mode():
        return model(ids, positions, caches, meta)


def written_slots(positions: list[int], blocks: list[list[int]]) -> torch.Tensor:
    """Bool [NUM_BLOCKS, BLOCK_SIZE]: the slots a decode of these rows writes."""
    mask = torch.zeros(NUM_BLOCKS, BLOCK_SIZE, dtype=torch.bool)
    for p, b in zip(positions, blocks, strict=True):
        mask[b[p // BLOCK_SIZE], p % BLOCK_SIZE] = True
    return mask


def check_step(
    model, graphs: DecodeGraphs, caches: list[torch.Tensor], inputs: tuple, tol: float = 1e-5
) -> torch.Tensor:
    """One decode step (`Batch.decode_inputs`) through `graphs` (bound to `caches`) and through
    the plain forward on a copy of `caches`, compared (hidden states, logits, and the greedy
    tokens the graph picks); returns the padded path's hidden states."""
    ids, positions, blocks = inputs
    before = [c.clone() for c in caches]
    plain_caches = [c.clone() for c in caches]
    chunks = [([t], p, b) for t, p, b in zip(ids, positions, blocks, strict=True)]
    expected = plain_forward(model, plain_caches, chunks)
    with torch.inference_mode():
        out = graphs.run(*pack_inputs(ids, positions, blocks))
        hidden, logits = out.hidden.clone(), out.logits.clone()
        argmax, bad = (t.clone() for t in out.raw[:2])
        expected_logits = model.compute_logits(expected)
    assert hidden.shape == expected.shape
    torch.testing.assert_close(hidden, expected, atol=tol, rtol=tol)
    torch.testing.assert_close(logits, expected_logits, atol=10 * tol, rtol=10 * tol)
    assert argmax.tolist() == logits.argmax(-1).tolist() and not bad.any()
    written = written_slots(positions, blocks).to(hidden.device)
    for after, old, plain in zip(caches, before, plain_caches, strict=True):
        # real blocks: untouched except this step's slots, which hold the plain path's k/v
        untouched = ~written[1:]
        assert torch.equal(after[:, 1:][:, untouched], old[:, 1:][:, untouched])
        torch.testing.assert_close(after[:, written], plain[:, written], atol=tol, rtol=tol)
    bucket = graphs.bucket_for(len(ids))
    width = max(len(b) for b in blocks)
    table = graphs._block_tables
    assert not table[len(ids) : bucket].any(), "padded rows must be all null block"
    assert not table[:, width:].any(), "columns past the widest row must be zero"
    return hidden
