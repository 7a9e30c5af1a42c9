"""vLLM's `--structured-outputs-config`: which grammar backend, and its options. Stdlib only."""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

BACKENDS = ("auto", "xgrammar")  # vLLM's names that kvflow serves (auto is xgrammar)
REFUSED_BACKENDS = ("guidance", "outlines", "lm-format-enforcer")


@dataclass(frozen=True)
class StructuredOutputsConfig:
    """backend: "auto" or "xgrammar"; disable_any_whitespace: JSON without whitespace between
    tokens (vLLM's meaning). vLLM's reasoning fields belong to `--reasoning-parser`."""

    backend: str = "auto"
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        if self.backend in REFUSED_BACKENDS:
            raise ValueError(
                f"structured outputs backend {self.backend!r} is not available in kvflow; "
                f"use one of {list(BACKENDS)}."
            )
        if self.backend not in BACKENDS:
            raise ValueError(
                f"unknown structured outputs backend {self.backend!r}; use one of {list(BACKENDS)}."
            )

    @classmethod
    def parse(cls, value: str | dict[str, Any] | None) -> StructuredOutputsConfig:
        """From the flag's JSON text (or a dict). Raises ValueError naming unknown keys."""
        if value is None:
            return cls()
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"--structured-outputs-config is not JSON: {exc}") from exc
        if not isinstance(value, dict):
            raise ValueError("--structured-outputs-config must be a JSON object.")
        known = {f.name for f in fields(cls)}
        ignored = {"disable_fallback", "disable_additional_properties", "reasoning_parser"}
        if unknown := set(value) - known - ignored:
            raise ValueError(f"unknown --structured-outputs-config keys: {sorted(unknown)}")
        return cls(**{k: v for k, v in value.items() if k in known})
