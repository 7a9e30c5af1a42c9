"""The liveness contract holds in both placements of the engine loop: every test here runs
against servers whose loop is on a thread of the API server, and again with it in the engine
core process (`placement`, tests/conftest.py)."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _in_both_placements(placement: str) -> str:
    return placement
