"""Phi-3's LongRoPE past the original context: kvflow rotates positions below
`original_max_position_embeddings` by the short factors and later ones by the long factors,
whatever the chunks a step takes; transformers' cached generation does the same for a sequence
whose prompt fits the original context (each forward's frequencies follow its longest position).
The tiny Phi-3 of tests/support (original context 32) against transformers, prompt 20 tokens,
then steps crossing position 32.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from kvflow.attention import AttentionMetadata, token_positions
from kvflow.model import load_model
from kvflow.model.layers import RotaryEmbedding
from kvflow.worker.kv_cache import allocate_kv_caches
from support.tiny_models import VOCAB, tiny_configs

ORIGINAL = 32
PROMPT = 20
CHUNKS = [PROMPT, 10, 5, 1, 1, 3]  # kvflow's steps: 20 | 20-29 | 30-34 (crossing) | ... 40
BLOCK_SIZE = 4


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    config = tiny_configs()["phi3-longrope"]
    assert config.original_max_position_embeddings == ORIGINAL
    hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    gen = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for name, param in hf.named_parameters():
            noise = torch.randn(param.shape, generator=gen)
            scale = 1.0 if param.ndim == 1 or "embed" in name else param.shape[1] ** -0.5
            param.copy_(1.0 + 0.2 * noise if "norm" in name else noise * scale)
    hf.eval()
    path = tmp_path_factory.mktemp("phi3-longrope")
    hf.save_pretrained(path)
    model, hf_config = load_model(path, torch.float32)
    return hf, model, hf_config


def _cached_generation_logits(hf, tokens: list[int]) -> torch.Tensor:
    """transformers' logits for `tokens` as its cached generation makes them: the prompt in one
    forward, then one token a forward."""
    with torch.inference_mode():
        out = hf(torch.tensor([tokens[:PROMPT]]), use_cache=True)
        logits, past = [out.logits[0]], out.past_key_values
        for token in tokens[PROMPT:]:
            out = hf(torch.tensor([[token]]), past_key_values=past, use_cache=True)
            logits.append(out.logits[0])
            past = out.past_key_values
    return torch.cat(logits).float()


def test_long_factors_from_the_original_context_as_transformers_generates(models) -> None:
    hf, model, hf_config = models
    tokens = torch.randint(3, VOCAB, (sum(CHUNKS),), generator=torch.Generator().manual_seed(3))
    tokens = tokens.tolist()
    expected = _cached_generation_logits(hf, tokens)
    caches = allocate_kv_caches(hf_config, 16, BLOCK_SIZE, torch.float32, "cpu")
    blocks = [7, 2, 12, 0, 9, 4, 14, 1, 11, 5]
    done, got = 0, []
    for n in CHUNKS:
        meta = AttentionMetadata.build([n], [done], [blocks], BLOCK_SIZE, "cpu")
        positions = torch.from_numpy(token_positions([n], [done]))
        with torch.inference_mode():
            hidden = model(torch.tensor(tokens[done : done + n]), positions, caches, meta)
            got.append(model.compute_logits(hidden))
        done += n
    torch.testing.assert_close(torch.cat(got), expected, atol=1e-4, rtol=1e-4)


def test_the_long_factors_change_the_rotation(models) -> None:
    """The two sets of factors differ from position ORIGINAL on (so the test above tells them
    apart), and every position below it has the short factors' rotation."""
    _, model, _ = models
    rotary = next(m for m in model.modules() if isinstance(m, RotaryEmbedding))
    assert rotary.long is not None and rotary.long[0] == ORIGINAL
    positions = torch.arange(ORIGINAL + 8)
    cos, _ = rotary.rotary(positions, torch.float32)
    short_freq = rotary.inv_freq
    short_cos = (positions[:, None].float() * short_freq).cos().repeat(1, 2)
    short_cos = short_cos * rotary.attention_scaling
    torch.testing.assert_close(cos[:ORIGINAL], short_cos[:ORIGINAL], atol=1e-6, rtol=0)
    assert (cos[ORIGINAL:] - short_cos[ORIGINAL:]).abs().max() > 0.1


def test_partial_rotary_embeddings_are_refused(tmp_path) -> None:
    """Phi-4-mini's partial_rotary_factor (0.75) rotates part of each head: refused at load,
    by name, never served with a whole head rotated."""
    config = tiny_configs()["phi3-window"]
    config.rope_parameters = {**config.rope_parameters, "partial_rotary_factor": 0.75}
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="partial rotary"):
        load_model(tmp_path, torch.float32)
