"""Shared test set-up: the embedded model converted once, a 1 GiB CPU KV cache unless a test
sizes its own, and tests marked `gpu` skipped where CUDA is not available. Helpers live in the
`support` package (tests/ is on pytest's `pythonpath`)."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from support.serverproc import PLACEMENTS, placement_env

# Engines and servers the tests start take this instead of the 4 GiB default: zeroing 4 GiB for
# every engine cost the suite seconds each, and no test needs more (tests of the default unset it).
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
# The engine loop on a thread gets its messages through the engine process's encoding
# (`ThreadCore`): a field that cannot cross the wire fails in both placements.
os.environ.setdefault("KVFLOW_WIRE_CHECK", "1")


@pytest.fixture(scope="session", autouse=True)
def _embedded_model_converted() -> None:
    """Convert the embedded GGUF once, before any test starts a server: on a cold machine the
    conversion must not eat into a server's start-up timeout."""
    from kvflow.model.loader import resolve_model

    resolve_model(None)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    gpu_items = [item for item in items if item.get_closest_marker("gpu") is not None]
    if not gpu_items:
        return
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in gpu_items:
        item.add_marker(skip)


@pytest.fixture(scope="module", params=PLACEMENTS)
def placement(request: pytest.FixtureRequest) -> Iterator[str]:
    """Where the engine loop of every real server a test starts runs: a thread of the API
    server, or the engine core process. A module's tests run once in each (its module-scoped
    server fixtures, which take this fixture, too); a test marked `placement("process")` runs
    in that placement only."""
    with pytest.MonkeyPatch.context() as patch:
        for name, value in placement_env(request.param).items():
            patch.setenv(name, value)
        yield request.param


@pytest.fixture(autouse=True)
def _only_in_its_placement(request: pytest.FixtureRequest) -> None:
    only = request.node.get_closest_marker("placement")
    if only is not None and "placement" in request.fixturenames:
        if request.getfixturevalue("placement") not in only.args:
            pytest.skip(f"a {only.args[0]} placement test")
