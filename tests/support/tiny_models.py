"""Tiny model configs and checkpoint helpers shared by the model tests."""

from __future__ import annotations

from transformers import (
    LlamaConfig,
    MistralConfig,
    OPTConfig,
    Phi3Config,
    PretrainedConfig,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen3Config,
)

VOCAB = 256
COMMON = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4)
LLAMA_LIKE = dict(COMMON, intermediate_size=96, num_key_value_heads=2, max_position_embeddings=128)
PHI3_IDS = dict(bos_token_id=1, eos_token_id=2, pad_token_id=None)  # its defaults: 32000 and up


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
        # q | k | v and gate | up stored fused; a window on every layer
        "phi3-window": Phi3Config(**LLAMA_LIKE, **PHI3_IDS, sliding_window=6),
        # LongRoPE: the short factors below position 32 (every prompt the shared tests run),
        # the long ones from it (tests/model/test_longrope.py)
        "phi3-longrope": Phi3Config(
            **LLAMA_LIKE,
            **PHI3_IDS,
            original_max_position_embeddings=32,
            rope_parameters=longrope(32),
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


def longrope(original: int) -> dict:
    """Phi-3's LongRoPE parameters for LLAMA_LIKE's head_dim (16): distinct short and long
    factors per frequency, the long ones from position `original`."""
    half = LLAMA_LIKE["hidden_size"] // LLAMA_LIKE["num_attention_heads"] // 2
    return dict(
        rope_type="longrope",
        rope_theta=10000.0,
        short_factor=[1.0 + 0.1 * i for i in range(half)],
        long_factor=[1.0 + 1.5 * i for i in range(half)],
        original_max_position_embeddings=original,
    )


def word_tokenizer(vocab_size: int) -> PreTrainedTokenizerFast:
    """A tokenizer whose token i is the word `t{i}`: enough for token-id prompts and output."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"t{i}": i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", eos_token="t1")
