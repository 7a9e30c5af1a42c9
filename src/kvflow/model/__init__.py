"""Model architectures, weight loading and model resolution (a GGUF read in place, dtype choice)."""

from __future__ import annotations

from kvflow.model.loader import (
    load_config,
    load_model,
    load_tokenizer,
    model_context_len,
    resolve_dtype,
    resolve_model,
)
from kvflow.model.registry import get_model_class, resolve_model_class, supported_architectures

__all__ = [
    "get_model_class",
    "load_config",
    "load_model",
    "load_tokenizer",
    "model_context_len",
    "resolve_dtype",
    "resolve_model",
    "resolve_model_class",
    "supported_architectures",
]
