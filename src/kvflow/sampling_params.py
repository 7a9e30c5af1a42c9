"""SamplingParams with vLLM's field names. Standard library only."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

_GREEDY_EPS = 1e-5
MAX_N_SEQUENCES = 16384  # vLLM's VLLM_MAX_N_SEQUENCES default: choices a request may ask for


@dataclass
class StructuredOutputsParams:
    """One output constraint, as vLLM's `StructuredOutputsParams`: exactly one field is set.

    json: a JSON schema (dict or its text); regex: a regular expression; choice: the output is one
    of these strings; grammar: an EBNF grammar (GBNF/xgrammar dialect); json_object: any JSON
    object; structural_tag: vLLM's structural-tag JSON text. Compiled by the engine's grammar
    backend; a constraint that does not compile is a ValueError at admission.
    """

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | None = None
    # vLLM's options: JSON without free whitespace; the others are accepted as vLLM's xgrammar
    # backend takes them (fallback and additionalProperties concern other backends)
    disable_any_whitespace: bool = False
    disable_fallback: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None

    def __post_init__(self) -> None:
        if self.whitespace_pattern is not None:
            raise ValueError("structured_outputs.whitespace_pattern is not supported by xgrammar.")
        kinds = self.kinds()
        if len(kinds) != 1:
            raise ValueError(
                "You can only use one kind of structured outputs constraint but multiple are "
                f"specified: {kinds}"
                if kinds
                else "structured_outputs needs one of json, regex, choice, grammar, json_object, "
                "structural_tag."
            )
        if self.choice is not None and not self.choice:
            raise ValueError("structured_outputs.choice must list at least one string.")

    def kinds(self) -> list[str]:
        """The names of the constraint fields that are set."""
        return [
            name
            for name in ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
            if getattr(self, name) not in (None, False)
        ]


@dataclass
class SamplingParams:
    """What to sample and when to stop; field names and defaults follow vLLM.

    `max_tokens=None` means "the rest of the context" (clamped at admission).
    """

    n: int = 1
    best_of: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    # token id -> added to its logit before penalties; clamped to [-100, 100] as vLLM does
    logit_bias: dict[int, float] | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    detokenize: bool = True
    # an output constraint (JSON schema, regex, choice, grammar); None: free generation
    structured_outputs: StructuredOutputsParams | None = None
    # With structured_outputs: the constraint applies from the token after the output's first
    # occurrence of these token ids (a reasoning section's end, e.g. `</think>`: vLLM's
    # reasoning-parser rule); None: from the first token. The server sets it.
    reasoning_end_ids: list[int] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        elif self.stop is None:
            self.stop = []
        else:
            self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.seed == -1:  # as vLLM: -1 is no seed (random)
            self.seed = None
        if self.top_k is None or self.top_k < 0:
            self.top_k = 0 if self.top_k is None or self.top_k == -1 else self.top_k
        if self.logit_bias:
            self.logit_bias = _logit_bias(self.logit_bias)
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    def validate(self) -> None:
        """Raise ValueError with a message a user can act on."""
        if self.n < 1:
            raise ValueError(f"n must be at least 1, got {self.n}.")
        if self.n > MAX_N_SEQUENCES:
            raise ValueError(f"n must be at most {MAX_N_SEQUENCES}, got {self.n}.")
        if self.n > 1 and self.greedy:  # vLLM's rule: n identical choices are a mistake
            raise ValueError(f"n must be 1 when using greedy sampling, got {self.n}.")
        if self.best_of is not None and self.best_of != self.n and self.best_of != 1:
            raise ValueError(f"best_of must be 1 or equal to n, got best_of={self.best_of}.")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise ValueError(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}.")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise ValueError(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}.")
        if not math.isfinite(self.repetition_penalty):
            raise ValueError(
                f"repetition_penalty must be a finite number, got {self.repetition_penalty}."
            )
        if self.repetition_penalty <= 0.0:
            raise ValueError(
                f"repetition_penalty must be greater than zero, got {self.repetition_penalty}."
            )
        if not math.isfinite(self.temperature):
            raise ValueError(f"temperature must be a finite number, got {self.temperature}.")
        if self.temperature < 0.0:
            raise ValueError(f"temperature must be non-negative, got {self.temperature}.")
        if self.temperature > 2.0:
            raise ValueError(f"temperature must be in [0, 2], got {self.temperature}.")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}.")
        if self.top_k < 0:
            raise ValueError(f"top_k must be 0 or -1 (disable), or at least 1, got {self.top_k}.")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}.")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}.")
        if self.min_tokens < 0:
            raise ValueError(
                f"min_tokens must be greater than or equal to 0, got {self.min_tokens}."
            )
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be less than or equal to max_tokens={self.max_tokens}, "
                f"got {self.min_tokens}."
            )
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise ValueError(f"logprobs must be in [0, 20], got {self.logprobs}.")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= 20:
            raise ValueError(f"prompt_logprobs must be in [0, 20], got {self.prompt_logprobs}.")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty.")
        if any(t < 0 for t in self.stop_token_ids):
            raise ValueError("stop_token_ids must be non-negative.")

    def clone(self, **changes) -> SamplingParams:
        values = {f: getattr(self, f) for f in self.__dataclass_fields__}
        values.update(changes)
        return SamplingParams(**values)


def _logit_bias(bias: dict) -> dict[int, float]:
    """Keys as token ids (JSON gives strings), values clamped to [-100, 100]."""
    bad = []
    out: dict[int, float] = {}
    for token, value in bias.items():
        try:
            out[int(token)] = min(100.0, max(-100.0, float(value)))
        except (TypeError, ValueError):
            bad.append(token)
    if bad:
        raise ValueError(
            f"logit_bias contains key(s) that cannot be converted to integer token IDs: {bad!r}"
        )
    return out
