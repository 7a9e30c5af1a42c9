"""Compiled grammars across a process boundary: a step's new requests go to the tensor-parallel
ranks pickled (a pipe, a gloo broadcast, Ray), and xgrammar's CompiledGrammar does not pickle.
The executor's GrammarSender puts a WireGrammar in its place; each rank's GrammarReceiver puts
the compiled grammar back, rebuilt from xgrammar's JSON over the tokenizer info, so every rank
masks with the grammar the EngineCore compiled.

A compiled grammar's JSON (megabytes: it holds the token mask cache) crosses once: the sender
numbers the grammars it has sent and later refers to them by number. Both sides keep the last
CACHE_SIZE numbers in least-recently-used order, updated by the same sequence of WireGrammars
(every rank receives every step, in order), so a number the sender refers to is one the
receiver holds. The tokenizer info crosses once, with the first grammar.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

CACHE_SIZE = 32  # compiled grammars each side keeps (a few MB each on a rank)


@dataclass(frozen=True)
class WireGrammar:
    """A compiled grammar as plain data: its number, with its JSON the first time it crosses
    (and the tokenizer info's JSON the first time any does)."""

    number: int
    grammar_json: str | None = None
    tokenizer_json: str | None = None


class GrammarSender:
    """The executor's side: `encode` a step for the ranks."""

    def __init__(self, cache_size: int = CACHE_SIZE) -> None:
        self._numbers: OrderedDict[int, tuple[Any, int]] = OrderedDict()  # id -> (grammar, no.)
        self._next = 0
        self._tokenizer_sent = False
        self._cache_size = cache_size

    def encode(self, sched: Any) -> Any:
        """`sched` (a SchedulerOutput) with each new request's compiled grammar as a
        WireGrammar; `sched` itself when no new request has one."""
        if all(new.grammar is None for new in sched.new_reqs):
            return sched
        new_reqs = [
            new
            if new.grammar is None
            else dataclasses.replace(new, grammar=self._wire(new.grammar))
            for new in sched.new_reqs
        ]
        return dataclasses.replace(sched, new_reqs=new_reqs)

    def _wire(self, compiled: Any) -> WireGrammar:
        known = self._numbers.get(id(compiled))  # (held while numbered: its id is its own)
        if known is not None:
            self._numbers.move_to_end(id(compiled))
            return WireGrammar(known[1])
        number, self._next = self._next, self._next + 1
        self._numbers[id(compiled)] = (compiled, number)
        if len(self._numbers) > self._cache_size:
            self._numbers.popitem(last=False)
        tokenizer = None if self._tokenizer_sent else compiled.tokenizer_info.serialize_json()
        self._tokenizer_sent = True
        return WireGrammar(number, compiled.serialize_json(), tokenizer)


class GrammarReceiver:
    """A rank's side: `decode` a step from the executor (or from rank 0's broadcast)."""

    def __init__(self, cache_size: int = CACHE_SIZE) -> None:
        self._grammars: OrderedDict[int, Any] = OrderedDict()  # number -> CompiledGrammar
        self._tokenizer_info: Any = None
        self._cache_size = cache_size

    def decode(self, sched: Any) -> Any:
        """`sched` with each WireGrammar replaced by its compiled grammar."""
        if all(not isinstance(new.grammar, WireGrammar) for new in sched.new_reqs):
            return sched
        new_reqs = [
            dataclasses.replace(new, grammar=self._compiled(new.grammar))
            if isinstance(new.grammar, WireGrammar)
            else new
            for new in sched.new_reqs
        ]
        return dataclasses.replace(sched, new_reqs=new_reqs)

    def _compiled(self, wire: WireGrammar) -> Any:
        import xgrammar as xgr

        if wire.grammar_json is None:
            self._grammars.move_to_end(wire.number)
            return self._grammars[wire.number]
        if wire.tokenizer_json is not None:
            self._tokenizer_info = xgr.TokenizerInfo.deserialize_json(wire.tokenizer_json)
        compiled = xgr.CompiledGrammar.deserialize_json(wire.grammar_json, self._tokenizer_info)
        self._grammars[wire.number] = compiled
        if len(self._grammars) > self._cache_size:
            self._grammars.popitem(last=False)
        return compiled
