"""The grammar backend: one xgrammar tokenizer info per model, constraints compiled off the
engine thread with a cache keyed by the constraint.

`validate` parses a constraint on the caller's thread (milliseconds) so that a bad one is the
request's fault (ValueError, a 400) before anything is queued; `compile` returns a Future of the
compiled grammar, made by a worker thread, shared by every request with the same constraint.
`ConstraintValidator` is the validating half alone, for the front end in the engine's process
(an API server over the engine process has the engine's verdicts instead: `verdicts`).
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import xgrammar as xgr

from kvflow.sampling_params import StructuredOutputsParams
from kvflow.structured.config import StructuredOutputsConfig
from kvflow.structured.verdicts import CACHE_SIZE, constraint_key

# Whitespace between JSON elements is capped at this many characters (enough for indented
# JSON): small models otherwise fill max_tokens with whitespace inside an object.
MAX_JSON_WHITESPACE = 20
_XGR_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:\d+: (Check failed: .*? is false: )?")


def choice_grammar(choices: list[str]) -> str:
    """EBNF whose language is exactly the given strings."""
    return "root ::= " + " | ".join(_ebnf_string(c) for c in choices)


def _ebnf_string(text: str) -> str:
    out = []
    for ch in text:
        if ch in '"\\':
            out.append("\\" + ch)
        elif ch.isprintable() and ord(ch) < 0x10000:
            out.append(ch)
        else:
            out.append(f"\\U{ord(ch):08x}" if ord(ch) > 0xFFFF else f"\\u{ord(ch):04x}")
    return '"' + "".join(out) + '"'


def _message(exc: Exception) -> str:
    """xgrammar's error text without its source-location prefix."""
    text = str(exc).strip()
    return _XGR_PREFIX.sub("", text).strip() or type(exc).__name__


class ConstraintValidator:
    """Parses output constraints to refuse bad ones before anything is queued; needs no
    tokenizer."""

    def __init__(self, config: StructuredOutputsConfig | None = None) -> None:
        self.config = config or StructuredOutputsConfig()
        self._lock = threading.Lock()
        self._valid: OrderedDict[tuple, None] = OrderedDict()

    @property
    def any_whitespace(self) -> bool:
        return not self.config.disable_any_whitespace

    def key(self, so: StructuredOutputsParams) -> tuple:
        return constraint_key(so, self.any_whitespace)

    def unjudged(self, so: StructuredOutputsParams) -> bool:
        """False: `validate` parses any constraint here (`verdicts.EngineVerdicts` waits for
        the engine's)."""
        return False

    def validate(self, so: StructuredOutputsParams) -> None:
        """Parse the constraint; raises ValueError naming what is wrong with it."""
        key = self.key(so)
        with self._lock:
            if key in self._valid:
                self._valid.move_to_end(key)
                return
        self.grammar(so)
        with self._lock:
            self._valid[key] = None
            if len(self._valid) > CACHE_SIZE:
                self._valid.popitem(last=False)

    def grammar(self, so: StructuredOutputsParams) -> xgr.Grammar:
        """The constraint as an xgrammar Grammar. Raises ValueError."""
        kind, value, any_ws = self.key(so)
        try:
            if kind in ("json", "json_object"):
                schema = value if kind == "json" else '{"type": "object"}'
                return xgr.Grammar.from_json_schema(
                    schema,
                    any_whitespace=any_ws,
                    max_whitespace_cnt=MAX_JSON_WHITESPACE if any_ws else None,
                )
            if kind == "regex":
                return xgr.Grammar.from_regex(value)
            if kind == "choice":
                return xgr.Grammar.from_ebnf(choice_grammar(list(value)))
            if kind == "grammar":
                return xgr.Grammar.from_ebnf(value)
            return _structural_tag(value)
        except Exception as exc:  # xgrammar raises RuntimeError / its own errors
            label = {"json": "JSON schema", "json_object": "JSON object"}.get(kind, kind)
            raise ValueError(
                f"The output constraint ({label}) cannot be compiled: {_message(exc)}"
            ) from exc


class GrammarBackend(ConstraintValidator):
    """Validates, and owns the tokenizer info, the xgrammar compiler, the compile threads and
    the cache of compiled grammars."""

    def __init__(
        self,
        tokenizer: Any,
        logits_vocab_size: int,
        stop_token_ids: list[int],
        config: StructuredOutputsConfig | None = None,
        max_workers: int = 2,
    ) -> None:
        super().__init__(config)
        # The logits' size, not the tokenizer's: ids past the tokenizer's vocabulary (padding)
        # are never allowed by a mask.
        self.tokenizer_info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=logits_vocab_size, stop_token_ids=stop_token_ids
        )
        self.vocab_size = logits_vocab_size
        self.compiler = xgr.GrammarCompiler(self.tokenizer_info, max_threads=max_workers)
        self._pool = ThreadPoolExecutor(max_workers, thread_name_prefix="kvflow-grammar")
        self._cache: OrderedDict[tuple, Future] = OrderedDict()

    def compile(self, so: StructuredOutputsParams) -> Future:
        """A Future of `_compile`'s result for this constraint; a cached one when the same
        constraint was compiled before. Its exception is a ValueError."""
        key = self.key(so)
        with self._lock:
            future = self._cache.get(key)
            if future is not None:
                self._cache.move_to_end(key)
                return future
            future = self._pool.submit(self._compile, so)
            self._cache[key] = future
            if len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return future

    def _compile(self, so: StructuredOutputsParams) -> tuple[xgr.CompiledGrammar, float, float]:
        """(the compiled grammar, seconds it took, time.monotonic() when it was done)."""
        t0 = time.perf_counter()
        grammar = self.grammar(so)
        try:
            compiled = self.compiler.compile_grammar(grammar)
        except Exception as exc:
            raise ValueError(f"structured_outputs cannot be compiled: {_message(exc)}") from exc
        return compiled, time.perf_counter() - t0, time.monotonic()

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _structural_tag(text: str) -> xgr.Grammar:
    """vLLM's two spellings: the legacy {"structures": [{begin, schema, end}], "triggers": [...]}
    or xgrammar's {"type": "structural_tag", "format": {...}}."""
    spec = json.loads(text)
    if isinstance(spec, dict) and "structures" in spec:
        tags = [
            xgr.StructuralTagItem(begin=s["begin"], schema=json.dumps(s["schema"]), end=s["end"])
            for s in spec["structures"]
        ]
        return xgr.Grammar.from_structural_tag(tags, list(spec.get("triggers", [])))
    return xgr.Grammar.from_structural_tag(text)
