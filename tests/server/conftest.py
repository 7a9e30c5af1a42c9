"""The session's shared server (see serverproc.py)."""

from __future__ import annotations

import openai
import pytest

from support.serverproc import ServerProcess, start_server


@pytest.fixture(scope="session")
def server():
    srv = start_server()
    yield srv
    srv.stop()


@pytest.fixture
def client(server: ServerProcess) -> openai.OpenAI:
    return server.client()
