"""Output constraints as an API server over the engine process checks them: by the engine's
verdict. No xgrammar here (its import loads torch): the engine process parses a constraint the
first time this process meets it (`EngineCore.constraint_error`, asked by
`AsyncEngine.check_constraint`), and the verdict is kept by the constraint's key.

`constraint_key` is what a compiled grammar, and so a verdict, depends on (`backend` caches by
it too).
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict

from kvflow.sampling_params import StructuredOutputsParams
from kvflow.structured.config import StructuredOutputsConfig

CACHE_SIZE = 256  # constraints whose verdict (or compiled grammar, in `backend`) is kept


def constraint_key(so: StructuredOutputsParams, any_whitespace: bool) -> tuple:
    """What a compiled grammar depends on: the kind, its canonical text, the whitespace rule."""
    kind = so.kinds()[0]
    value = getattr(so, kind)
    if kind == "json" and not isinstance(value, str):
        value = json.dumps(value)  # property order matters: the output follows it
    elif kind == "choice":
        value = tuple(value)
    return (kind, value, any_whitespace and not so.disable_any_whitespace)


class EngineVerdicts:
    """The engine's verdicts on the constraints this process has met: None (it compiles) or
    the message of the ValueError the engine's parse raised. The newest CACHE_SIZE are kept."""

    def __init__(self, config: StructuredOutputsConfig) -> None:
        self.config = config
        self._lock = threading.Lock()
        self._verdicts: OrderedDict[tuple, str | None] = OrderedDict()

    def key(self, so: StructuredOutputsParams) -> tuple:
        return constraint_key(so, not self.config.disable_any_whitespace)

    def unjudged(self, so: StructuredOutputsParams) -> bool:
        """Whether the engine has yet to give its verdict on `so`."""
        with self._lock:
            return self.key(so) not in self._verdicts

    def record(self, so: StructuredOutputsParams, error: str | None) -> None:
        key = self.key(so)
        with self._lock:
            self._verdicts[key] = error
            self._verdicts.move_to_end(key)
            if len(self._verdicts) > CACHE_SIZE:
                self._verdicts.popitem(last=False)

    def validate(self, so: StructuredOutputsParams) -> None:
        """Raises ValueError with the engine's message for a constraint it refused. One it has
        not judged passes: the engine parses it again when it compiles it, and a refusal then
        fails that request (the server's requests are judged first: `check_constraint`)."""
        key = self.key(so)
        with self._lock:
            error = self._verdicts.get(key)
            if key in self._verdicts:
                self._verdicts.move_to_end(key)
        if error is not None:
            raise ValueError(error)
