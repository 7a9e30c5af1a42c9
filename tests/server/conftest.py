"""The session's shared servers (see serverproc.py): one per placement of the engine loop, so
every test of the served API runs against both."""

from __future__ import annotations

import openai
import pytest

from support.serverproc import PLACEMENTS, ServerProcess, start_server


@pytest.fixture(scope="session", params=PLACEMENTS)
def server(request: pytest.FixtureRequest):
    srv = start_server(placement=request.param)
    yield srv
    srv.stop()


@pytest.fixture
def client(server: ServerProcess) -> openai.OpenAI:
    return server.client()
