"""Shared test set-up: make tests/ importable for small helper modules (fakes.py)."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))


@pytest.fixture(scope="session", autouse=True)
def _embedded_model_converted() -> None:
    """Convert the embedded GGUF once, before any test starts a server: on a cold machine the
    conversion must not eat into a server's start-up timeout."""
    from kvflow.model.loader import resolve_model

    resolve_model(None)
