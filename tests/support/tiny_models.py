"""Tiny model configs and checkpoint helpers shared by the model tests."""

from __future__ import annotations

from transformers import (
    LlamaConfig,
    MistralConfig,
    OPTConfig,
    PretrainedConfig,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen3Config,
)

VOCAB = 256
COMMON = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4)
LLAMA_LIKE = dict(COMMON, intermediate_size=96, num_key_value_heads=2, max_position_embeddings=128)


def tiny_configs() -> dict[str, PretrainedConfig]:
    llama3_rope = dict(
        rope_type="llama3",
        rope_theta=10000.0,
        factor=8.0,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position_embeddings=16,
    )
    return {
        "llama3": LlamaConfig(
            **LLAMA_LIKE, rope_parameters=llama3_rope, attention_bias=True, mlp_bias=True
        ),
        "llama-tied": LlamaConfig(
            **{**LLAMA_LIKE, "num_key_value_heads": 1}, tie_word_embeddings=True
        ),
        "mistral-window": MistralConfig(**LLAMA_LIKE, sliding_window=6),
        "qwen2-tied": Qwen2Config(**LLAMA_LIKE, tie_word_embeddings=True),
        # explicit head_dim (32 != 64 / 4) and a sliding-window second layer
        "qwen3": Qwen3Config(
            **LLAMA_LIKE,
            head_dim=32,
            use_sliding_window=True,
            sliding_window=5,
            max_window_layers=1,
        ),
        "opt": OPTConfig(**COMMON, ffn_dim=96, max_position_embeddings=64),
        # opt-350m shape: post-norm, embeddings projected in and out
        "opt-postnorm-proj": OPTConfig(
            **COMMON,
            ffn_dim=96,
            max_position_embeddings=64,
            do_layer_norm_before=False,
            word_embed_proj_dim=32,
        ),
    }


def word_tokenizer(vocab_size: int) -> PreTrainedTokenizerFast:
    """A tokenizer whose token i is the word `t{i}`: enough for token-id prompts and output."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"t{i}": i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", eos_token="t1")
