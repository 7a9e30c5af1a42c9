"""The tokenizer of a random-weight checkpoint: the embedded model's (SmolLM2's byte-level BPE,
merges, special ids, chat template) padded with reserved tokens to the shape's vocabulary, so the
embedding and the head hold their real bytes and text still tokenizes as the embedded model's."""

from __future__ import annotations

import functools
import tempfile
from pathlib import Path

import gguf

# Reserved tokens are NORMAL entries of the vocabulary that no merge reaches: they decode to their
# visible text, so a random model's token always streams as a non-empty delta, and they cost a
# tokenizer load nothing. (As CONTROL or USER_DEFINED, transformers adds each as an added token:
# about 45 s per load for Llama's 79k reserved rows, and a matcher over all of them in every encode.)
RESERVED_TYPE = int(gguf.TokenType.NORMAL)


def embedded_gguf() -> Path:
    from kvflow.embedded_model import default_gguf_path

    return Path(default_gguf_path())


def tokenizer_fields(vocab_size: int) -> list[tuple[str, object, list[gguf.GGUFValueType]]]:
    """Every `tokenizer.*` key of the embedded GGUF as (key, value, GGUF types), the token list
    and the token types padded with `<|reserved_N|>` to `vocab_size` entries."""
    fields = list(_embedded_fields())
    tokens = {key: value for key, value, _ in fields}["tokenizer.ggml.tokens"]
    extra = reserved_tokens(set(tokens), vocab_size - len(tokens))
    for i, (key, value, types) in enumerate(fields):
        if key == "tokenizer.ggml.tokens":
            fields[i] = (key, value + extra, types)
        elif key == "tokenizer.ggml.token_type":
            fields[i] = (key, value + [RESERVED_TYPE] * len(extra), types)
    return fields


@functools.cache
def _embedded_fields() -> tuple[tuple[str, object, list[gguf.GGUFValueType]], ...]:
    """The embedded GGUF's `tokenizer.*` keys, read once (GGUFReader parses every string)."""
    reader = gguf.GGUFReader(embedded_gguf())
    return tuple(
        (key, field.contents(), list(field.types))
        for key, field in reader.fields.items()
        if key.startswith("tokenizer.")
    )


def reserved_tokens(taken: set[str], count: int) -> list[str]:
    if count < 0:
        raise ValueError(f"the embedded vocabulary is larger than the shape's by {-count}")
    names, n = [], 0
    while len(names) < count:
        name = f"<|reserved_{n}|>"
        n += 1
        if name not in taken:
            names.append(name)
    return names


def add_tokenizer(writer: gguf.GGUFWriter, vocab_size: int) -> None:
    """Write the padded tokenizer's keys into a GGUF's metadata."""
    for key, value, types in tokenizer_fields(vocab_size):
        if types[0] == gguf.GGUFValueType.ARRAY:
            writer.add_key_value(key, value, types[0], sub_type=types[1])
        else:
            writer.add_key_value(key, value, types[0])


def save_hf_tokenizer(out: Path, vocab_size: int) -> None:
    """Save the padded tokenizer (`vocab_size` entries) as HF tokenizer files into `out`. It is
    built by transformers' GGUF tokenizer loader from a tensorless GGUF of the same keys, so a
    safetensors checkpoint tokenizes exactly as its GGUF siblings do."""
    from transformers import AutoTokenizer

    with tempfile.TemporaryDirectory(prefix="kvflow-vocab-") as tmp:
        path = Path(tmp) / "vocab.gguf"
        writer = gguf.GGUFWriter(path, "llama")
        add_tokenizer(writer, vocab_size)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        writer.close()
        tokenizer = AutoTokenizer.from_pretrained(tmp, gguf_file=path.name)
    if len(tokenizer) != vocab_size:  # a token transformers merged or added would shift the head
        raise RuntimeError(f"the padded tokenizer has {len(tokenizer)} tokens, not {vocab_size}")
    tokenizer.save_pretrained(out)


def special_ids() -> dict[str, int]:
    """The embedded tokenizer's bos / eos ids, for config.json and generation_config.json."""
    fields = {key: value for key, value, _ in _embedded_fields()}
    return {
        name: int(fields[f"tokenizer.ggml.{name}"]) for name in ("bos_token_id", "eos_token_id")
    }
