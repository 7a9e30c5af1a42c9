"""Incremental detokenization and stop-string matching for one request.

Each new token is decoded inside a small sliding window of token ids, never the whole output:

    ids:   ... | context ............ | pending ....... |
                ^ window start         ^ read            ^ end
    text new this step = decode(window) - decode(context)

`context` (a few tokens already turned into text) gives the tokenizer's decoder the
neighbourhood it needs (leading spaces, byte merges); `pending` is what has not produced text
yet. While decode(window) ends in U+FFFD, a multi-byte character is still split across tokens
and the window waits for its next byte. Once text comes out, `pending` becomes the context.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvflow.sampling_params import SamplingParams

_REPLACEMENT = "\ufffd"
# Prompt tokens kept as decoding context for the first output token.
_CONTEXT_TOKENS = 5
# A UTF-8 character needs at most 4 byte tokens; past this many tokens without text the
# bytes are invalid, not split, and are emitted as the tokenizer decodes them (U+FFFD).
_MAX_PENDING = 8


def fast_decode(tokenizer: Any) -> Callable[[list[int], bool], str]:
    """`decode(ids, skip_special_tokens)`, exactly as `tokenizer.decode` returns it.

    A transformers fast tokenizer's `decode` is the Rust decoder plus a Python wrapper that
    costs 3x the decoding of a few ids (2.0 against 0.6 us measured), once or twice per
    generated token here. When the wrapper adds nothing (no space clean-up, `decode` and `_decode` not
    overridden) the Rust decoder is called directly; any other tokenizer keeps its own decode.
    """
    from transformers import PreTrainedTokenizerFast

    cls = type(tokenizer)
    if (
        isinstance(tokenizer, PreTrainedTokenizerFast)
        and cls.decode is PreTrainedTokenizerFast.decode
        and cls._decode is PreTrainedTokenizerFast._decode
        and not tokenizer.clean_up_tokenization_spaces
    ):
        backend = tokenizer.backend_tokenizer
        return lambda ids, skip: backend.decode(ids, skip_special_tokens=skip)
    return lambda ids, skip: tokenizer.decode(ids, skip_special_tokens=skip)


class Decoder:
    """`fast_decode(tokenizer)`, plus the text of single tokens memoised for every request of
    an engine: after each token a detokenizer decodes its new context, most often that one
    token alone (and logprobs decode their tokens one by one). At most two entries (with and
    without special tokens) per vocabulary id."""

    def __init__(self, tokenizer: Any) -> None:
        self.decode = fast_decode(tokenizer)
        self._texts: tuple[dict[int, str], dict[int, str]] = ({}, {})  # by skip_special

    def token_text(self, token_id: int, skip_special: bool) -> str:
        texts = self._texts[skip_special]
        text = texts.get(token_id)
        if text is None:
            text = texts[token_id] = self.decode([token_id], skip_special)
        return text


class IncrementalDetokenizer:
    """Turns one request's sampled tokens into text and finds its stop strings.

    Owns the request's output text. `update()` may be called with several tokens at once; it
    stops consuming at the first token that completes a stop string.
    """

    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: list[int],
        params: SamplingParams,
        decoder: Decoder | None = None,
    ):
        """`decoder`: `Decoder(tokenizer)`, made here unless the caller shares one."""
        self._decoder = decoder or Decoder(tokenizer)
        self._decode_ids = self._decoder.decode
        self._skip_special = params.skip_special_tokens
        self._stops = list(params.stop)
        self._max_stop_len = max((len(s) for s in self._stops), default=0)
        self._include_stop = params.include_stop_str_in_output
        # Without spaces between special tokens, a kept added token is appended verbatim and
        # the window restarts after it, so the decoder cannot put a separator next to it.
        added = getattr(tokenizer, "added_tokens_decoder", None) or {}
        self._verbatim: dict[int, str] = {}
        if not params.spaces_between_special_tokens and not self._skip_special:
            self._verbatim = {i: str(getattr(t, "content", t)) for i, t in added.items()}
        self._window: list[int] = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self._read = len(self._window)
        self._context_text = self._decode(self._window)
        self._text = ""  # full text so far, cut at the stop string once one matched
        self._sent = 0  # chars of _text already handed out by get_delta()
        self._stop_matched: str | None = None

    @property
    def output_text(self) -> str:
        """All text so far (cut before the stop string unless include_stop_str_in_output)."""
        return self._text

    @property
    def stop_matched(self) -> str | None:
        return self._stop_matched

    def update(self, new_token_ids: list[int], stop_terminated: bool = False) -> str | None:
        """Append tokens; return the stop string matched (first time only), else None.

        `stop_terminated`: the last token ended the request by id (EOS or stop_token_ids); as in
        vLLM its text is left out unless include_stop_str_in_output. Tokens after a match (and
        any call after it) are ignored.
        """
        if self._stop_matched is not None:
            return None
        if stop_terminated and not self._include_stop:
            new_token_ids = new_token_ids[:-1]
        for token_id in new_token_ids:
            before = len(self._text)
            self._append(token_id)
            if self._stops and len(self._text) > before and self._check_stop(before):
                return self._stop_matched
        return None

    def get_delta(self, finished: bool = False) -> str:
        """Text not handed out yet. Unless `finished` (or a stop string matched), a tail that
        could still grow into a stop string is withheld."""
        end = len(self._text)
        if self._stops and not finished and self._stop_matched is None:
            end -= self._held_back()
        if end <= self._sent:
            return ""
        delta = self._text[self._sent : end]
        self._sent = end
        return delta

    def decode_token(self, token_id: int) -> str:
        """One token alone as text (logprobs' decoded_token); special tokens are kept."""
        return self._decoder.token_text(token_id, False)

    def _decode(self, ids: list[int]) -> str:
        if not ids:
            return ""
        return self._decode_ids(ids, self._skip_special)

    def _append(self, token_id: int) -> None:
        verbatim = self._verbatim.get(token_id)
        if verbatim is not None:
            if self._read < len(self._window):
                self._advance(self._decode(self._window))
            self._text += verbatim
            self._window, self._read, self._context_text = [], 0, ""
            return
        self._window.append(token_id)
        text = self._decode_ids(self._window, self._skip_special)  # never empty here
        pending = len(self._window) - self._read
        if text.endswith(_REPLACEMENT) and pending < _MAX_PENDING:
            return
        if len(text) <= len(self._context_text) and pending < _MAX_PENDING:
            return
        self._advance(text)

    def _advance(self, window_text: str) -> None:
        """Emit what the pending tokens added; they become the next step's context."""
        if window_text.startswith(self._context_text):
            self._text += window_text[len(self._context_text) :]
        else:  # the decoder rewrote the context (rare clean-up rules): decode pending alone
            self._text += self._decode(self._window[self._read :])
        self._window = self._window[self._read :]
        self._read = len(self._window)
        if self._read == 1:  # the common case: the newest token alone
            self._context_text = self._decoder.token_text(self._window[0], self._skip_special)
        else:
            self._context_text = self._decode(self._window)

    def _check_stop(self, new_from: int) -> bool:
        """Search the new text (plus the longest stop - 1 chars before it) for a stop string."""
        start = max(0, new_from - self._max_stop_len + 1)
        best: tuple[int, str] | None = None
        for stop in self._stops:
            at = self._text.find(stop, start)
            if at != -1 and (best is None or at < best[0]):
                best = (at, stop)
        if best is None:
            return False
        at, stop = best
        self._text = self._text[: at + len(stop) if self._include_stop else at]
        self._sent = min(self._sent, len(self._text))
        self._stop_matched = stop
        return True

    def _held_back(self) -> int:
        """Length of the longest tail of the text that is a proper prefix of a stop string."""
        held = 0
        tail = self._text[-(self._max_stop_len - 1) :] if self._max_stop_len > 1 else ""
        for stop in self._stops:
            for k in range(min(len(stop) - 1, len(tail)), held, -1):
                if tail.endswith(stop[:k]):
                    held = k
                    break
        return held
