"""Property 14 (P21): schemathesis generates requests from the server's own /openapi.json, valid
ones and invalid ones, for every operation: none gets a 5xx, and /health answers 200 after.

The server has a short context (--max-model-len 32) and a 1 s request timeout so that the
generated completions stay cheap: a 408 is a terminal answer, not a server error. The number
of examples per operation and mode is KVFLOW_SCHEMA_EXAMPLES (default 50: 100 requests for
each operation that takes input)."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import Unsatisfiable

from support.live import MODEL, ServerProcess, geometry, serving

EXAMPLES = int(os.environ.get("KVFLOW_SCHEMA_EXAMPLES", "50"))
MODES = [schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE]


@pytest.fixture(scope="module")
def live(placement: str) -> Iterator[ServerProcess]:
    flags = [*geometry(16, 64), "--max-model-len", "32", "--request-timeout", "1"]
    with serving(flags) as server:
        yield server


def served_model(case: schemathesis.Case) -> schemathesis.Case:
    """A valid body names the served model, so that it gets past the 404 into the engine."""
    body = case.body
    if isinstance(body, dict) and isinstance(body.get("model"), str) and case.meta is not None:
        if case.meta.generation.mode == schemathesis.GenerationMode.POSITIVE:
            body["model"] = MODEL
    return case


def fuzz(operation: schemathesis.APIOperation, mode: schemathesis.GenerationMode) -> dict:
    """Run EXAMPLES generated cases; returns status counts. Fails on the first 5xx."""
    counts: dict[int, int] = {}

    @given(case=operation.as_strategy(generation_mode=mode).map(served_model))
    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        database=None,
        derandomize=True,
        phases=[Phase.explicit, Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    def run(case: schemathesis.Case) -> None:
        response = case.call(timeout=30)
        counts[response.status_code] = counts.get(response.status_code, 0) + 1
        assert response.status_code < 500, (case.as_curl_command(), response.text[:500])

    try:
        run()
    except Unsatisfiable:  # nothing to make invalid (an operation without inputs)
        pass
    return counts


def test_generated_requests_never_get_a_5xx(live: ServerProcess) -> None:
    schema = schemathesis.openapi.from_url(f"{live.url}/openapi.json")
    schema.config.update(base_url=live.url)
    total = 0
    for result in schema.get_all_operations():
        operation = result.ok()
        for mode in MODES:
            counts = fuzz(operation, mode)
            total += sum(counts.values())
            print(f"  {operation.label} {mode.value}: {dict(sorted(counts.items()))}")
    print(f"  {total} generated requests, no 5xx")
    assert live.health() == 200
